"""The canonical catalog table every reader produces and every consumer takes.

A catalog is a :class:`pandas.DataFrame` with one row per image:

=============  =========  ==========================================================================
column         dtype      meaning
=============  =========  ==========================================================================
image_id       str        unique id of the image (the NIH ``Image Index``, a file name, a SOP UID)
path           str        where the image file is (absolute path or fsspec URL)
patient_id     str        the patient; never split across ``train``/``val``/``test``
site           str        the hospital or source the image belongs to
split          str        ``train``, ``val`` or ``test``
<label>        uint8      one column per label, 0 or 1, in the order of ``catalog.attrs["labels"]``
=============  =========  ==========================================================================

plus whatever metadata the source has (``age``, ``sex``, ``view``, ``follow_up``, ``orig_width``,
``orig_height``, ``spacing_x``, ``spacing_y``). The label names and the task (``multilabel`` or
``multiclass``) ride in ``catalog.attrs`` and in the Parquet file's metadata. A catalog becomes a Dask
DataFrame, with pandas or (on a GPU box) cudf partitions, with :func:`dask_dl.data.frames.to_dask_dataframe`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pandas as pd

from dask_dl.data.layouts import LAYOUTS
from dask_dl.errors import CatalogError, StoreNotFoundError

#: The 14 NIH ChestX-ray14 findings, in the published order.
NIH_LABELS: tuple[str, ...] = (
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumonia",
    "Pneumothorax",
    "Consolidation",
    "Edema",
    "Emphysema",
    "Fibrosis",
    "Pleural_Thickening",
    "Hernia",
)

REQUIRED_COLUMNS: tuple[str, ...] = ("image_id", "path", "patient_id", "site", "split")
#: the metadata columns a reader writes where its source has them, in this order after the labels
METADATA_COLUMNS: tuple[str, ...] = (
    "follow_up",
    "age",
    "sex",
    "view",
    "orig_width",
    "orig_height",
    "spacing_x",
    "spacing_y",
)
SPLITS: tuple[str, ...] = ("train", "val", "test")
TASKS: tuple[str, ...] = ("multilabel", "multiclass")
_META_KEY = b"dask_dl"


def labels_of(catalog: pd.DataFrame) -> list[str]:
    """Return the label names of ``catalog`` (from ``catalog.attrs["labels"]``)."""
    try:
        return list(catalog.attrs["labels"])
    except KeyError:
        raise CatalogError(
            "the catalog has no label names in catalog.attrs['labels']; build it with a dask_dl reader "
            "or set them: catalog.attrs['labels'] = ['Atelectasis', ...]"
        ) from None


def task_of(catalog: pd.DataFrame) -> str:
    """Return ``"multilabel"`` or ``"multiclass"`` (one label per row), from ``catalog.attrs``."""
    return catalog.attrs.get("task", "multilabel")


def _rows(mask: pd.Series | np.ndarray, limit: int = 5) -> str:
    idx = np.flatnonzero(np.asarray(mask))
    shown = ", ".join(str(i) for i in idx[:limit])
    return shown + (f" and {len(idx) - limit} more" if len(idx) > limit else "")


def _show(value: object) -> str:
    """repr of a table value as the user wrote it: ``2``, not ``np.int64(2)``."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def validate_catalog(catalog: pd.DataFrame) -> pd.DataFrame:
    """Check ``catalog`` against the canonical schema and return it with canonical dtypes.

    Raises
    ------
    CatalogError
        With the offending rows and the fix, for missing columns, duplicated image ids, unknown splits,
        a patient in two splits, or label values other than 0 and 1.
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in catalog.columns]
    labels = labels_of(catalog)
    missing += [c for c in labels if c not in catalog.columns]
    if missing:
        raise CatalogError(
            f"the catalog lacks the column(s) {missing}; it has {list(catalog.columns)}. "
            "Read collections with dask_dl.read_catalog(...) or add the columns."
        )
    if len(set(labels)) != len(labels):
        twice = sorted({label for label in labels if labels.count(label) > 1})
        raise CatalogError(f"catalog.attrs['labels'] names {twice} more than once; each label names one column")
    for col in REQUIRED_COLUMNS:
        values = catalog[col]
        blank = values.isna() | (values.astype(str).str.strip() == "")
        if blank.any():
            raise CatalogError(
                f"column {col!r} is empty in rows {_rows(blank)}; every image needs a value there: "
                "fill it in or drop those rows"
            )
    task = task_of(catalog)
    if task not in TASKS:
        raise CatalogError(f"catalog.attrs['task'] is {task!r}; use one of {list(TASKS)}")
    dup = catalog["image_id"].duplicated(keep=False)
    if dup.any():
        first = catalog.loc[dup, "image_id"].iloc[0]
        raise CatalogError(
            f"image_id {_show(first)} appears more than once (rows {_rows(dup)}); image ids must be unique: "
            "drop the duplicates, e.g. catalog.drop_duplicates('image_id')"
        )
    bad_split = ~catalog["split"].isin(SPLITS)
    if bad_split.any():
        value = catalog.loc[bad_split, "split"].iloc[0]
        raise CatalogError(
            f"split {_show(value)} in rows {_rows(bad_split)} is not one of {list(SPLITS)}; "
            "map it, e.g. catalog['split'] = catalog['split'].replace({'valid': 'val'})"
        )
    # Compare patients as strings, the form they are stored in: 1 and "1" are one patient.
    n_splits = catalog["split"].groupby(catalog["patient_id"].astype(str), observed=True).nunique()
    leaking = n_splits[n_splits > 1]
    if len(leaking):
        pid = leaking.index[0]
        rows = catalog["patient_id"].astype(str) == pid
        raise CatalogError(
            f"patient {_show(pid)} is in more than one split ({sorted(catalog.loc[rows, 'split'].unique())}, "
            f"rows {_rows(rows)}) and {len(leaking) - 1} more patients too; a patient must stay in one split. "
            "Re-split by patient with dask_dl.data.catalog.split_by_patient(catalog)"
        )
    out = catalog.copy()
    for col in REQUIRED_COLUMNS:
        out[col] = out[col].astype(str)
    for label in labels:
        values = pd.to_numeric(out[label], errors="coerce")
        bad = ~values.isin([0, 1])
        if bad.any():
            raise CatalogError(
                f"label column {label!r} has values other than 0/1 in rows {_rows(bad)} "
                f"(e.g. {_show(out.loc[bad, label].iloc[0])}); labels are 0 or 1"
            )
        out[label] = values.astype(np.uint8)
    if task == "multiclass" and len(out):
        per_row = out[labels].sum(axis=1)
        bad = per_row != 1
        if bad.any():
            raise CatalogError(
                f"a multiclass catalog needs exactly one label per row; rows {_rows(bad)} have "
                f"{int(per_row[bad].iloc[0])}. Use task='multilabel' for several findings per image."
            )
    out.attrs = {
        "labels": labels,
        "task": task,
        **{k: v for k, v in catalog.attrs.items() if k not in ("labels", "task")},
    }
    return out


def write_catalog(catalog: pd.DataFrame, path: str) -> None:
    """Write ``catalog`` as Parquet, keeping its label names and task in the file's metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    catalog = validate_catalog(catalog)
    table = pa.Table.from_pandas(catalog, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta[_META_KEY] = json.dumps({k: v for k, v in catalog.attrs.items()}).encode()
    pq.write_table(table.replace_schema_metadata(meta), path)


def read_parquet_catalog(path: str, *, labels: Sequence[str] | None = None, task: str | None = None) -> pd.DataFrame:
    """Read a catalog written by :func:`write_catalog` (or any Parquet file with the canonical columns).

    ``labels`` and ``task`` are needed only for Parquet files that dask_dl did not write.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise StoreNotFoundError(f"no Parquet catalog at {str(path)!r}") from None
    except pa.ArrowInvalid as exc:
        raise CatalogError(
            f"{str(path)!r} is not a Parquet file ({exc}); write catalogs with dask_dl.write_catalog"
        ) from None
    catalog = table.to_pandas()
    meta = (table.schema.metadata or {}).get(_META_KEY)
    attrs = json.loads(meta) if meta else {}
    if labels is not None:
        attrs["labels"] = list(labels)
    if task is not None:
        attrs["task"] = task
    if "labels" not in attrs:
        raise CatalogError(
            f"the Parquet file {path!r} has no dask_dl metadata naming its label columns; "
            "pass labels=[...] or write it with dask_dl.write_catalog"
        )
    catalog.attrs = attrs
    return validate_catalog(catalog)


def make_catalog(frame: pd.DataFrame, labels: Sequence[str], *, task: str = "multilabel") -> pd.DataFrame:
    """Attach ``labels`` and ``task`` to ``frame`` and validate it as a catalog."""
    frame = frame.copy()
    frame.attrs = {"labels": list(labels), "task": task}
    return validate_catalog(frame)


LAYOUTS.register("parquet", read_parquet_catalog, help="a catalog .parquet file written by write_catalog")
