"""The NIH ChestX-ray14 layout: ``Data_Entry_2017[_v2020].csv[.gz]``, images, and the official split lists.

Images are under ``images/`` or ``images_001/images/`` ... ``images_012/images/``; the official
``train_val_list.txt`` / ``test_list.txt`` give the test split, and val comes out of train_val by patient hash.
The constants of the published format live here, and :mod:`dask_dl.data.synthetic` writes with them.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping

import numpy as np
import pandas as pd

from dask_dl import config
from dask_dl.data.labels import parse_findings
from dask_dl.data.layouts import LAYOUTS
from dask_dl.data.roots import CollectionRoot
from dask_dl.data.schema import NIH_LABELS, make_catalog
from dask_dl.data.splits import check_fraction, hashed_split, split_by_patient
from dask_dl.errors import CatalogError, StoreNotFoundError

__all__ = ["NIH_HEADER", "NIH_TABLES", "find_table", "read_nih"]

#: The header line of the published NIH table (the bracketed names cover two columns each).
NIH_HEADER = (
    "Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position,"
    "OriginalImage[Width,Height],OriginalImagePixelSpacing[x,y]"
)
#: NIH table names looked for in a root, in order of preference (the 2020 revision first).
NIH_TABLES: tuple[str, ...] = (
    "Data_Entry_2017_v2020.csv",
    "Data_Entry_2017_v2020.csv.gz",
    "Data_Entry_2017.csv",
    "Data_Entry_2017.csv.gz",
)
#: The official split lists of the published collection.
NIH_LISTS: tuple[str, str] = ("train_val_list.txt", "test_list.txt")
_NIH_COLUMNS = [
    "image_id",
    "findings",
    "follow_up",
    "patient_id",
    "age",
    "sex",
    "view",
    "orig_width",
    "orig_height",
    "spacing_x",
    "spacing_y",
    "_trailing",  # the 2017 original ends every data line with a comma
]


def find_table(root: CollectionRoot) -> str | None:
    for name in NIH_TABLES:
        if root.isfile(name):
            return name
    return None


def _read_nih_table(root: CollectionRoot, name: str) -> pd.DataFrame:
    where = root.url(root.join(name))
    compression = "gzip" if name.endswith(".gz") else None
    with root.fs.open(root.join(name), "rb", compression=compression) as raw:
        header = io.TextIOWrapper(raw, encoding="utf-8-sig").readline().strip()
    if header.rstrip(",") != NIH_HEADER:
        raise CatalogError(
            f"{where!r} does not start with the NIH header; found\n  {header}\nexpected\n  {NIH_HEADER}\n"
            "Use the table as published, or build a catalog yourself with dask_dl.make_catalog(frame, labels)"
        )
    try:
        with root.fs.open(root.join(name), "rb", compression=compression) as f:
            table = pd.read_csv(
                f,
                skiprows=1,
                header=None,
                names=_NIH_COLUMNS,
                index_col=False,
                dtype={c: str for c in ("image_id", "findings", "patient_id", "sex", "view", "_trailing")},
                keep_default_na=False,
                na_values={"age": [""], "follow_up": [""]},
                encoding="utf-8-sig",
            )
    except (ValueError, pd.errors.ParserError) as exc:
        raise CatalogError(f"{where!r} is not a readable NIH table: {exc}") from None
    extra = table["_trailing"].fillna("").str.strip() != ""
    if extra.any():
        pos = int(np.flatnonzero(extra.to_numpy())[0])
        raise CatalogError(
            f"row {pos} (image {table['image_id'].iloc[pos]!r}) of {where!r} has more than 11 fields; "
            "each line holds 11 values, optionally followed by one trailing comma"
        )
    return table.drop(columns="_trailing")


def _nih_image_paths(root: CollectionRoot, image_ids: pd.Series) -> pd.Series:
    """Where each image is: ``images/`` or ``images_NNN/images/``; missing ones keep ``root/images/<id>``."""
    found: dict[str, str] = {}
    folders = [root.join("images"), *sorted(root.fs.glob(root.join("images_*", "images")))]
    for folder in folders:
        if root.fs.isdir(folder):
            found.update(root.files_in(folder))
    fallback = root.url(root.join("images")) + (os.sep if root.local else "/") + image_ids
    # a plain lookup: Series.map(...).fillna(...) warns when no image is found (all-NaN float column)
    paths = [found.get(i, f) for i, f in zip(image_ids, fallback, strict=True)]
    return pd.Series(paths, index=image_ids.index, dtype=str)


def _read_list(root: CollectionRoot, name: str) -> pd.Index:
    names = pd.Series(root.fs.cat_file(root.join(name)).decode().split(), dtype=str)
    return pd.Index(names.unique())


def _official_split(root: CollectionRoot, table: pd.DataFrame, *, seed: int, val_fraction: float) -> np.ndarray | None:
    """Splits from ``train_val_list.txt`` / ``test_list.txt``, val taken from train_val by patient hash."""
    lists = NIH_LISTS
    present = [name for name in lists if root.isfile(name)]
    if not present:
        return None
    if len(present) == 1:
        absent = next(name for name in lists if name not in present)
        raise CatalogError(
            f"{str(root)!r} has {present[0]} but no {absent}; the official split needs both lists. "
            f"Add {absent}, or remove {present[0]} to split by patient hash"
        )
    train_val, test = _read_list(root, lists[0]), _read_list(root, lists[1])
    both = train_val.intersection(test)
    if len(both):
        raise CatalogError(
            f"{len(both)} image(s) are in both train_val_list.txt and test_list.txt, e.g. {list(both[:5])}; "
            "an image belongs to one list: remove it from the other"
        )
    ids = table["image_id"]
    in_test, in_train_val = ids.isin(test).to_numpy(), ids.isin(train_val).to_numpy()
    unlisted = ~(in_test | in_train_val)
    if unlisted.any():
        shown = list(ids[unlisted][:5])
        raise CatalogError(
            f"{int(unlisted.sum())} image(s) of the table are in neither train_val_list.txt nor test_list.txt, "
            f"e.g. {shown}; add them to one list, or remove both lists to split by patient hash"
        )
    patients = table["patient_id"]
    crossing = np.intersect1d(patients[in_test].unique(), patients[in_train_val].unique())
    if len(crossing):
        pid = crossing[0]
        images = list(ids[(patients == pid).to_numpy()][:6])
        raise CatalogError(
            f"patient {pid!r} has images in both train_val_list.txt and test_list.txt ({images}), and "
            f"{len(crossing) - 1} more patients too; a patient must stay in one split: move all of the patient's "
            "images into one list, or remove both lists to split by patient hash"
        )
    hashed = hashed_split(patients, seed=seed, val_fraction=val_fraction, test_fraction=0.0)
    return np.where(in_test, "test", hashed)


def _patient_ids(values: pd.Series) -> pd.Series:
    """NIH patient ids are integers; zero-pad them to 8 digits as in the file names (``00000001``)."""
    text = values.astype(str).str.strip()
    return text.where(~text.str.fullmatch(r"\d+"), text.str.zfill(8))


def read_nih(
    root: str | os.PathLike,
    *,
    site: str = "NIH",
    seed: int | None = None,
    val_fraction: float | None = None,
    test_fraction: float | None = None,
    label_map: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Read an NIH ChestX-ray14 collection as published into a catalog.

    Parameters
    ----------
    root : str or path
        Folder (or fsspec URL, e.g. ``s3://bucket/nih``) holding ``Data_Entry_2017_v2020.csv`` or
        ``Data_Entry_2017.csv`` (either may be gzipped; the 2020 revision is preferred when both are there)
        and the images under ``images/`` or ``images_001/images/`` ... ``images_012/images/``, and optionally
        ``train_val_list.txt`` and ``test_list.txt``. An image listed but not found keeps the path
        ``root/images/<id>``, so that ingest rejects it as missing. Paths are absolute OS paths for local
        roots and full URLs for remote ones.
    site : str
        Value of the ``site`` column.
    seed : int, optional
        Key of the patient hash. Default ``dask-dl.split.seed``.
    val_fraction : float, optional
        Share of patients for ``val``; with the official lists they come out of ``train_val_list.txt``.
        Default ``dask-dl.split.val-fraction``.
    test_fraction : float, optional
        Share of patients for ``test`` when there are no official lists. Default ``dask-dl.split.test-fraction``.
    label_map : mapping, optional
        Renames findings of the table onto :data:`~dask_dl.data.schema.NIH_LABELS`,
        e.g. ``{"Infiltrate": "Infiltration"}``.

    Returns
    -------
    pandas.DataFrame
        The catalog: canonical columns, the 14 labels of ``NIH_LABELS`` in order, and ``follow_up``, ``age``,
        ``sex``, ``view``, ``orig_width``, ``orig_height``, ``spacing_x``, ``spacing_y``. Patient ids are
        zero-padded to 8 digits (``"00000001"``). Splits come from ``train_val_list.txt`` / ``test_list.txt``
        when both are in ``root`` (val taken from train_val by patient hash), else from
        :func:`split_by_patient`.

    Raises
    ------
    StoreNotFoundError
        If ``root`` or its table does not exist.
    CatalogError
        For a header that is not NIH's, an unknown finding (the message shows the ``label_map=`` to pass),
        an image in both official lists or in neither, or a patient whose images are in both lists.

    Examples
    --------
    On the NIH collection (not run as a doctest: it needs the download):

    >>> catalog = read_nih("/data/nih")  # doctest: +SKIP
    >>> catalog["split"].value_counts()  # doctest: +SKIP
    """
    root = CollectionRoot(root)
    if not root.isdir():
        raise StoreNotFoundError(f"the NIH root {str(root)!r} is not a directory")
    name = find_table(root)
    if name is None:
        raise StoreNotFoundError(
            f"no NIH table in {str(root)!r}: expected one of {list(NIH_TABLES)}; it holds {root.names()[:10]}"
        )
    seed = int(config.get("split.seed", seed))
    table = _read_nih_table(root, name)
    table["patient_id"] = _patient_ids(table["patient_id"])
    labels = parse_findings(table["findings"], labels=NIH_LABELS, label_map=label_map, image_ids=table["image_id"])
    frame = pd.DataFrame(
        {
            "image_id": table["image_id"].str.strip(),
            "path": _nih_image_paths(root, table["image_id"].str.strip()),
            "patient_id": table["patient_id"],
            "site": str(site),
            "split": "train",
        }
    )
    frame = pd.concat([frame, labels], axis=1)
    frame["follow_up"] = pd.to_numeric(table["follow_up"], errors="coerce").astype("Int64")
    # Some copies of the 2017 table write ages as "058Y"; keep the number of years.
    frame["age"] = pd.to_numeric(table["age"].astype(str).str.extract(r"(\d+)", expand=False), errors="coerce")
    frame["age"] = frame["age"].astype(np.float64)
    frame["sex"] = table["sex"].astype(str)
    frame["view"] = table["view"].astype(str)
    for col in ("orig_width", "orig_height"):
        frame[col] = pd.to_numeric(table[col], errors="coerce").astype("Int64")
    for col in ("spacing_x", "spacing_y"):
        frame[col] = pd.to_numeric(table[col], errors="coerce").astype(np.float64)
    frame.attrs = {"labels": list(NIH_LABELS), "task": "multilabel"}
    val_fraction = check_fraction("val_fraction", config.get("split.val-fraction", val_fraction))
    official = _official_split(root, frame, seed=seed, val_fraction=val_fraction)
    if official is None:
        return split_by_patient(frame, seed=seed, val_fraction=val_fraction, test_fraction=test_fraction)
    frame["split"] = official
    return make_catalog(frame, NIH_LABELS)


LAYOUTS.register("nih", read_nih, help="an NIH ChestX-ray14 folder: Data_Entry_2017[_v2020].csv[.gz] and images/")
