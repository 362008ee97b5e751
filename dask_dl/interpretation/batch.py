"""A grid of a store's images with their labels, patient and split, read through Dask chunk by chunk."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from dask_dl.checks import positive_int
from dask_dl.errors import ConfigurationError, DatasetError
from dask_dl.interpretation.figures import image_grid, label_names

if TYPE_CHECKING:  # pragma: no cover
    import xarray as xr
    from matplotlib.figure import Figure

__all__ = ["catalog_of", "show_batch"]


def show_batch(
    ds: xr.Dataset | str | os.PathLike,
    n: int = 16,
    *,
    split: str | None = None,
    where: Any = None,
    labels: Sequence[str] | None = None,
    catalog: pd.DataFrame | str | os.PathLike | None = None,
    seed: int = 0,
    columns: int = 4,
) -> Figure:
    """Draw ``n`` images picked at random from a store, titled with their labels, patient and split.

    Only the chunks holding the drawn images are read, on the cluster when a client is current.

    Parameters
    ----------
    ds
        A dataset from :func:`~dask_dl.open_dataset`, or the store's path.
    n
        How many images (fewer when fewer match).
    split
        Draw only from this split.
    where
        Which images may be drawn: a boolean DataArray along ``sample`` (``ds.label.sel(finding="Mass") == 1``),
        or a :meth:`pandas.DataFrame.query` string over the catalog: the columns ``image_id``, ``patient_id``,
        ``split``, ``site``, one 0/1 column per label, and the columns of ``catalog`` (``"Effusion == 1 and
        age > 60"``).
    labels
        The labels named in the titles; default all of the store's.
    catalog
        A catalog (DataFrame or Parquet file, e.g. from :func:`~dask_dl.read_catalog`) whose other columns
        (age, sex, view, ...) ``where`` may use; joined on ``image_id``.
    seed
        Seed of the random pick: the same seed draws the same images.
    columns
        Images per row.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    DatasetError
        No image matches, or ``where`` has another length than the dataset.
    ConfigurationError
        ``where`` is a query that pandas cannot evaluate on the catalog (the message lists its columns).
    MissingDependencyError
        matplotlib is not installed (``pip install 'dask-dl[notebook]'``).

    Examples
    --------
    >>> fig = dask_dl.show_batch(ds, 16, split="test", where="Effusion == 1")  # doctest: +SKIP
    >>> fig.savefig("effusion.png")  # doctest: +SKIP
    """
    from dask_dl.data.dataset import open_dataset

    n, columns = positive_int("n", n), positive_int("columns", columns)
    ds = ds if hasattr(ds, "data_vars") else open_dataset(ds)
    table = catalog_of(ds, catalog)
    keep = _matching(table, where)
    if split is not None:
        if not (table["split"] == split).any():
            raise DatasetError(f"the dataset has no image in split {split!r}; it has {sorted(set(table['split']))}")
        keep = keep & (table["split"] == split).to_numpy()
    if not keep.any():
        raise DatasetError(f"no image matches where={where!r} (of {len(table)} images{_in_split(split)})")
    names = label_names(ds["finding"].values)
    shown = list(labels) if labels is not None else names
    unknown = sorted(set(shown) - set(names))
    if unknown:
        raise ConfigurationError(f"labels {unknown} are not in the store; its labels are {names}")
    positions = np.flatnonzero(keep)
    chosen = np.sort(np.random.default_rng(seed).choice(positions, size=min(n, len(positions)), replace=False))
    images = ds["image"].isel(sample=chosen).values  # sorted positions: Dask reads only their chunks
    titles = [_title(table.iloc[i], shown) for i in chosen]
    return image_grid(images, titles, columns=columns, purpose="dask_dl.show_batch")


def catalog_of(ds: xr.Dataset, catalog: pd.DataFrame | str | os.PathLike | None = None) -> pd.DataFrame:
    """The dataset's catalog as a table, one row per sample in its order: ids, split, site, one column per label,
    and the other columns of ``catalog`` joined on ``image_id``."""
    table = pd.DataFrame({name: ds[name].values.astype(str) for name in ("image_id", "patient_id", "split", "site")})
    names = label_names(ds["finding"].values)
    truth = np.asarray(ds["label"].values)
    for j, name in enumerate(names):
        table[name] = truth[:, j]
    if catalog is not None:
        catalog = catalog if isinstance(catalog, pd.DataFrame) else pd.read_parquet(catalog)
        extra = [c for c in catalog.columns if c not in table.columns or c == "image_id"]
        table = table.merge(catalog[extra].astype({"image_id": str}), on="image_id", how="left", validate="1:1")
    return table


def _matching(table: pd.DataFrame, where: Any) -> np.ndarray:
    if where is None:
        return np.ones(len(table), bool)
    if isinstance(where, str):
        try:
            kept = table.query(where)
        except Exception as exc:  # pandas raises many kinds: say which columns there are
            raise ConfigurationError(
                f"where={where!r} cannot be evaluated ({type(exc).__name__}: {exc}); the catalog's columns are "
                f"{list(table.columns)} (pass catalog=... for others, such as age)"
            ) from None
        return table.index.isin(kept.index)
    keep = np.asarray(getattr(where, "values", where))
    if keep.dtype != bool or keep.shape != (len(table),):
        raise DatasetError(
            f"where must be a query string or one boolean per image ({len(table)}); got dtype {keep.dtype}, "
            f"shape {keep.shape}"
        )
    return keep


def _title(row: pd.Series, labels: list[str]) -> str:
    present = [name for name in labels if row[name]]
    return f"{row['image_id']}\n{', '.join(present) or 'No Finding'}\npatient {row['patient_id']} · {row['split']}"


def _in_split(split: str | None) -> str:
    return f" in split {split!r}" if split else ""
