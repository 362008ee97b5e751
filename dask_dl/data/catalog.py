"""Read any collection dask_dl understands into a catalog (see :mod:`dask_dl.data.schema`).

Layouts understood, each a reader registered in :data:`~dask_dl.data.layouts.LAYOUTS`:

- **Parquet catalogs** written by :func:`~dask_dl.data.schema.write_catalog` (``parquet``).
- **NIH ChestX-ray14** (:func:`~dask_dl.data.nih.read_nih`, ``nih``).
- **DICOM folders** (:func:`~dask_dl.data.dicom.read_dicom`, ``dicom``): every DICOM file under a root, labels
  from a CSV.
- **Class folders** (:func:`~dask_dl.data.folders.read_folders`, ``folders``).

:func:`read_catalog` picks the reader from what the source is. Labels are parsed by
:func:`~dask_dl.data.labels.parse_findings`; collections without an official split are split by patient with
:func:`~dask_dl.data.splits.split_by_patient`.

Metadata columns, where the source has them: ``follow_up`` (int), ``age`` (float years), ``sex`` and ``view``
(str), ``orig_width``/``orig_height`` (int pixels), ``spacing_x``/``spacing_y`` (float mm).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import pandas as pd

from dask_dl.data import schema  # noqa: F401  (registers the parquet layout)
from dask_dl.data.dicom import is_dicom_file, read_dicom
from dask_dl.data.folders import IMAGE_EXTENSIONS, read_folders, visible_dirs
from dask_dl.data.labels import NO_FINDING, parse_findings
from dask_dl.data.layouts import LAYOUTS
from dask_dl.data.nih import NIH_HEADER, NIH_TABLES, find_table, read_nih
from dask_dl.data.roots import CollectionRoot
from dask_dl.data.splits import split_by_patient
from dask_dl.errors import CatalogError, ConfigurationError, StoreNotFoundError

__all__ = [
    "IMAGE_EXTENSIONS",
    "LAYOUTS",
    "NIH_HEADER",
    "NIH_TABLES",
    "NO_FINDING",
    "parse_findings",
    "read_catalog",
    "read_dicom",
    "read_folders",
    "read_nih",
    "split_by_patient",
]


def _detect(source: Path) -> str:
    if source.is_file():
        if source.suffix == ".parquet":
            return "parquet"
        if source.name in NIH_TABLES:
            return "nih"
    if not source.is_dir():
        return ""
    if find_table(CollectionRoot(source)) is not None:
        return "nih"
    folders = visible_dirs(source)
    sites = [p.name for p in folders if find_table(CollectionRoot(p)) is not None]
    if sites:
        raise CatalogError(
            f"{str(source)!r} holds NIH collections in {sites[:10]}, one per site; read each on its own, e.g. "
            f"read_nih(root / {sites[0]!r}, site={sites[0]!r}), and combine them with pandas.concat"
        )
    files = [p for p in source.rglob("*") if p.is_file() and not p.name.startswith(".")]
    dicoms = [p for p in files if is_dicom_file(str(p))]
    others = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS and not is_dicom_file(str(p))]
    if dicoms and not others:
        return "dicom"
    if others and [p.name for p in folders] == ["images"]:  # NIH's layout without its table
        raise CatalogError(
            f"{str(source)!r} has an images/ folder and no Data_Entry_2017.csv (nor _v2020): an NIH root without its "
            "table, from a synthesis that did not finish (dask-dl synth and the demo write it last) or a copy that "
            "left it out. Run the synthesis again, or copy NIH's Data_Entry_2017.csv next to images/"
        )
    if others and any(p.parent != source for p in others):
        return "folders"
    return ""


def read_catalog(source: str | os.PathLike, *, layout: str | None = None, **kwargs: Any) -> pd.DataFrame:
    """Read any collection dask_dl understands into a catalog, choosing the reader from what ``source`` is.

    ======================================================  =====================================
    source                                                  reader
    ======================================================  =====================================
    a ``.parquet`` file                                     :func:`~dask_dl.data.schema.read_parquet_catalog`
    a folder with ``Data_Entry_2017*.csv[.gz]``, or it      :func:`~dask_dl.data.nih.read_nih`
    a folder whose images are all DICOM files               :func:`~dask_dl.data.dicom.read_dicom`
    a folder of class folders holding images                :func:`~dask_dl.data.folders.read_folders`
    ======================================================  =====================================

    Parameters
    ----------
    source : str or path
        File or folder. A URL (``s3://bucket/nih``, any fsspec protocol) is read as an NIH root, or as a
        Parquet catalog when it ends with ``.parquet``.
    layout : str, optional
        A name in :data:`~dask_dl.data.layouts.LAYOUTS`: ``"parquet"``, ``"nih"``, ``"dicom"``, ``"folders"``.
        Skip the detection, e.g. for class folders of DICOM files (``layout="folders"``).
    **kwargs
        Options of the chosen reader (``site=``, ``seed=``, ``labels_csv=`` ...).

    Returns
    -------
    pandas.DataFrame
        A validated catalog.

    Raises
    ------
    StoreNotFoundError
        If ``source`` does not exist.
    CatalogError
        If ``source`` has no layout dask_dl understands (the message says what was found).
    ConfigurationError
        For an unknown ``layout`` or an option the chosen reader does not take.

    Examples
    --------
    >>> catalog = read_catalog("/data/nih", site="NIH")  # doctest: +SKIP
    """
    if layout is not None:
        LAYOUTS.entry(layout)  # a ConfigurationError listing the layouts
    text = os.fspath(source)
    if "://" in text and not text.startswith("file://"):
        # Remote sources: only NIH roots (and Parquet files pyarrow opens itself) are read from URLs.
        layout = layout or ("parquet" if text.endswith(".parquet") else "nih")
        return _call(layout, text, kwargs)
    path = Path(text.removeprefix("file://")).expanduser().absolute()
    if not path.exists():
        raise StoreNotFoundError(f"{str(source)!r} does not exist; pass a catalog .parquet file or a collection folder")
    layout = layout or _detect(path)
    if not layout:
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir()) if path.is_dir() else []
        raise CatalogError(
            f"{str(source)!r} is not a collection dask_dl understands; it holds {entries[:12] or 'no entries'}. "
            "Understood: a catalog .parquet file; an NIH folder with Data_Entry_2017.csv (or _v2020) and images/; "
            "a folder of DICOM files; class folders root/<class>/<image>. Pass layout= to choose the reader"
        )
    if layout == "nih" and path.is_file():
        path = path.parent
    return _call(layout, str(path), kwargs)


def _call(layout: str, source: str, kwargs: dict[str, Any]) -> pd.DataFrame:
    reader = LAYOUTS.get(layout)
    accepted = set(list(inspect.signature(reader).parameters)[1:])
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ConfigurationError(
            f"option(s) {unknown} do not apply to a {layout} source {source!r}; "
            f"{reader.__name__} takes {sorted(accepted)}"
        )
    return reader(source, **kwargs)
