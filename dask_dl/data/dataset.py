"""Open a store written by :func:`dask_dl.ingest` as a lazy :class:`xarray.Dataset`, and summarise it.

The dataset has ``image(sample, y, x)`` uint8 (``image(sample, y, x, channel)`` for a colour store, with the
coordinate ``channel = ["R", "G", "B"]``) and ``label(sample, finding)`` uint8 as dask arrays chunked like the
Zarr chunks along ``sample``, ``valid(sample)``, and the coordinates ``image_id``, ``patient_id``, ``split``,
``site`` (in memory: they are small and selections need them), ``finding`` and ``sample``. ``sample`` keeps the
physical row numbers of the store after rows are dropped, so a loader can go straight to the Zarr chunks.
Splits come from the catalog, which never puts one patient in two splits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import dask.array as da
import numpy as np
import pandas as pd
import xarray as xr

from dask_dl.data import store as contract
from dask_dl.data.store import open_store
from dask_dl.errors import DatasetError

__all__ = ["open_dataset", "summary"]


def _plain_str(values: np.ndarray) -> np.ndarray:
    return np.asarray(values.tolist(), dtype=str)


def _select(ds: xr.Dataset, name: str, wanted: str | Sequence[str] | None) -> np.ndarray:
    values = ds[name].values
    if wanted is None:
        return np.ones(len(values), bool)
    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
    present = sorted(set(values.tolist()))
    unknown = [w for w in wanted if w not in present]
    if unknown:
        raise DatasetError(f"{name} {unknown[0]!r} is not in this dataset; the {name}s present are {present}")
    return np.isin(values, wanted)


def open_dataset(
    store: str | os.PathLike,
    *,
    split: str | Sequence[str] | None = None,
    site: str | Sequence[str] | None = None,
    include_rejected: bool = False,
) -> xr.Dataset:
    """Open a dask_dl Zarr store lazily.

    Parameters
    ----------
    store
        Path or fsspec URL of a store written by :func:`dask_dl.ingest`.
    split
        Keep only this split (``"train"``, ``"val"``, ``"test"``) or these splits.
    site
        Keep only this site or these sites.
    include_rejected
        Keep the rows whose image was rejected at ingest (all-zero image, ``valid`` False).

    Returns
    -------
    xarray.Dataset
        ``ds.attrs["dask_dl"]`` holds the store's layout (size, chunk, shard, labels, task, n, channels, complete)
        and ``ds.encoding["source"]`` the store path or URL. ``ds.image`` is ``(sample, y, x)`` for a grey store
        and ``(sample, y, x, channel)`` for a colour one (``ds.sizes.get("channel", 1)`` is the channel count).

    Raises
    ------
    StoreNotFoundError
        Nothing at ``store``.
    StoreError
        Not a dask_dl store, or an ingest into it did not finish.
    DatasetError
        ``split`` or ``site`` names one that is not in the store; the message lists those present.

    Examples
    --------
    On a store of yours (not run as a doctest: it needs the store):

    >>> ds = dask_dl.open_dataset("cxr.zarr", split="train")  # doctest: +SKIP
    >>> ds.image  # doctest: +SKIP
    <xarray.DataArray 'image' (sample: 78468, y: 224, x: 224)> dask.array<...>
    """
    url, _, layout = open_store(os.fspath(store))
    ds = xr.open_zarr(url, consolidated=False, chunks={})
    ds = ds.set_coords([c for c in contract.COORDS if c in ds.data_vars])
    # zarr 3 strings arrive as numpy's StringDType, which many numpy/pandas calls cannot cast: use plain str
    ds = ds.assign_coords(
        {name: (contract.SAMPLE, _plain_str(ds[name].values)) for name in contract.COORDS}
        | {contract.FINDING: (contract.FINDING, _plain_str(ds[contract.FINDING].values))}
    )
    keep = _select(ds, "split", split) & _select(ds, "site", site)
    if not include_rejected:
        valid = ds[contract.VALID].values.astype(bool)
        if not valid.any():
            raise DatasetError(
                f"the store {url!r} has no valid image: all {layout.n} rows were rejected at ingest; see why with "
                f"dask_dl.data.ingest.read_rejects({url!r}) and ingest again"
            )
        keep &= valid
    if not keep.any():
        asked = ", ".join(f"{name}={value!r}" for name, value in (("split", split), ("site", site)) if value)
        raise DatasetError(
            f"the store {url!r} has no valid image with {asked}: all of them were rejected at ingest; "
            f"see dask_dl.data.ingest.read_rejects({url!r})"
        )
    image = ds[contract.IMAGE].data if keep.all() else _keep_rows(ds[contract.IMAGE].data, keep)
    # label/valid are small (n x labels bytes) and stored in few large chunks: read them once and hand them out as
    # dask arrays chunked like the images, so that all variables share one chunking and reading every label does
    # not decode a large chunk once per image chunk
    small = {name: (ds[name].dims, ds[name].values[keep], ds[name].attrs) for name in ("label", "valid")}
    ds = ds.drop_vars(["image", "label", "valid"]).isel(sample=np.flatnonzero(keep))
    ds["image"] = (layout.image_dims, image, {})
    if layout.channels == 3:
        ds = ds.assign_coords({contract.CHANNEL: (contract.CHANNEL, np.array(list("RGB")))})
    for name, (dims, values, var_attrs) in small.items():
        ds[name] = (dims, da.from_array(values, chunks=(image.chunks[0], *values.shape[1:])), var_attrs)
    ds.attrs = {contract.ATTRIBUTE: layout.to_dict()}
    ds.encoding["source"] = url
    return ds


def _keep_rows(array: da.Array, keep: np.ndarray) -> da.Array:
    """``array[keep]`` along axis 0, with one output chunk per input chunk that keeps a row.

    Dask's own fancy indexing regroups rows into new chunks that straddle the Zarr chunks, so that reading one
    would decode two; selecting inside each chunk keeps every dask chunk within one Zarr chunk.
    """
    mask = da.from_array(keep, chunks=(array.chunks[0],))
    sizes = np.array([int(block.sum()) for block in np.split(keep, np.cumsum(array.chunks[0])[:-1])])
    blocks = np.flatnonzero(sizes)
    array = array.blocks[blocks]
    mask = mask.blocks[blocks][(slice(None),) + (None,) * (array.ndim - 1)]  # (n, 1, 1): broadcasts like array
    return da.map_blocks(
        _pick, array, mask, chunks=(tuple(sizes[blocks].tolist()), *array.chunks[1:]), dtype=array.dtype
    )


def _pick(block: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return block[mask.reshape(-1)]


def summary(store_or_dataset: str | os.PathLike | xr.Dataset) -> pd.DataFrame:
    """Count images per split and label, and rejected rows.

    Parameters
    ----------
    store_or_dataset
        A store path/URL (all rows counted, rejected ones in ``rejected``) or a dataset from
        :func:`open_dataset`.

    Returns
    -------
    pandas.DataFrame
        One row per split plus ``total``; columns ``images`` (valid images), one count per label (valid images
        with that finding), ``rejected``.
    """
    if isinstance(store_or_dataset, xr.Dataset):
        ds = store_or_dataset
    else:
        ds = open_dataset(store_or_dataset, include_rejected=True)
    valid = ds["valid"].values.astype(bool)
    labels = [str(f) for f in ds["finding"].values]
    frame = pd.DataFrame(ds["label"].values[valid], columns=labels)
    frame.insert(0, "split", ds["split"].values[valid].astype(str))
    counts = frame.groupby("split").sum()
    counts.insert(0, "images", frame.groupby("split").size())
    rejected = pd.Series(ds["split"].values[~valid].astype(str)).value_counts()
    order = [s for s in ("train", "val", "test") if s in set(counts.index) | set(rejected.index)]
    order += sorted((set(counts.index) | set(rejected.index)) - set(order))
    table = counts.reindex(order, fill_value=0)
    table["rejected"] = rejected.reindex(order, fill_value=0).to_numpy()
    table.loc["total"] = table.sum()
    table.index.name = "split"
    return table.astype(np.int64)
