"""Readers that turn an image collection into a catalog (see :mod:`dask_dl.data.schema`).

Layouts understood:

- **NIH ChestX-ray14** (:func:`read_nih`): ``Data_Entry_2017.csv`` or ``Data_Entry_2017_v2020.csv`` (optionally
  gzipped) with images under ``images/`` or ``images_001/images/`` ... ``images_012/images/``, and optionally
  the official ``train_val_list.txt`` / ``test_list.txt``.
- **Class folders** (:func:`read_folders`): ``root/<class>/<image>`` (torchvision's ImageFolder convention) or
  ``root/<split>/<class>/<image>`` with ``<split>`` in train/val/test.
- **DICOM folders** (:func:`~dask_dl.data.dicom.read_dicom`): every DICOM file under a root, labels from a CSV.
- **Parquet catalogs** written by :func:`~dask_dl.data.schema.write_catalog`.

:func:`read_catalog` picks the reader from what the source is. Where a collection has no official split,
:func:`split_by_patient` assigns whole patients to train/val/test by a seeded, stable hash of the patient id, so
the same collection always splits the same way on every machine and Python version.

Metadata columns, where the source has them: ``follow_up`` (int), ``age`` (float years), ``sex`` and ``view``
(str), ``orig_width``/``orig_height`` (int pixels), ``spacing_x``/``spacing_y`` (float mm).
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import io
import os
import posixpath
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dask_dl import config
from dask_dl.data.dicom import is_dicom_file, read_dicom
from dask_dl.data.schema import NIH_LABELS, SPLITS, make_catalog, read_parquet_catalog, validate_catalog
from dask_dl.errors import CatalogError, ConfigurationError, StoreNotFoundError

__all__ = [
    "IMAGE_EXTENSIONS",
    "NIH_HEADER",
    "NIH_TABLES",
    "parse_findings",
    "read_catalog",
    "read_dicom",
    "read_folders",
    "read_nih",
    "split_by_patient",
]

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
NO_FINDING = "No Finding"
#: File extensions :func:`read_folders` takes as images (compared case-insensitively).
IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".dcm", ".tif", ".tiff", ".bmp")


# ---- splitting ---------------------------------------------------------------------------------------------


def _patient_hash(patient_ids: np.ndarray, seed: int) -> np.ndarray:
    """A uniform number in [0, 1) per patient id, from BLAKE2b: unlike ``hash()`` it is not salted per process."""
    key = str(seed).encode()
    out = np.empty(len(patient_ids), dtype=np.float64)
    for i, pid in enumerate(patient_ids):  # one hash per patient, not per image
        digest = hashlib.blake2b(str(pid).encode(), digest_size=8, key=key).digest()
        out[i] = int.from_bytes(digest, "little") / 2.0**64
    return out


def _check_fraction(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ConfigurationError(f"{name}={value!r} is not a fraction in [0, 1); pass e.g. {name}=0.1")
    return value


def _hashed_split(patient_ids: pd.Series, *, seed: int, val_fraction: float, test_fraction: float) -> np.ndarray:
    codes, uniques = pd.factorize(patient_ids, sort=False)
    u = _patient_hash(np.asarray(uniques), seed)
    per_patient = np.where(u < test_fraction, "test", np.where(u < test_fraction + val_fraction, "val", "train"))
    return per_patient[codes]


def split_by_patient(
    catalog: pd.DataFrame,
    *,
    seed: int | None = None,
    val_fraction: float | None = None,
    test_fraction: float | None = None,
) -> pd.DataFrame:
    """Assign every patient's images to one split by a seeded, stable hash of the patient id.

    Each patient gets a number in [0, 1) from BLAKE2b keyed by ``seed``; patients below ``test_fraction`` go to
    ``test``, the next ``val_fraction`` to ``val``, the rest to ``train``. The fractions are shares of patients
    (not images) and are met approximately; the split of a patient never depends on the other patients, so
    adding images to a collection does not move anyone.

    Parameters
    ----------
    catalog : pandas.DataFrame
        Any catalog; its ``split`` column is replaced (it need not have one).
    seed : int, optional
        Hash key. Default ``dask-dl.split.seed``.
    val_fraction, test_fraction : float, optional
        Shares of patients for ``val`` and ``test``. Defaults ``dask-dl.split.val-fraction`` and
        ``dask-dl.split.test-fraction``.

    Returns
    -------
    pandas.DataFrame
        A validated copy of ``catalog`` with the new ``split`` column.

    Raises
    ------
    ConfigurationError
        If a fraction is outside [0, 1) or both together reach 1.

    Examples
    --------
    >>> import pandas as pd
    >>> frame = pd.DataFrame({"image_id": ["a", "b", "c"], "path": ["a", "b", "c"],
    ...                       "patient_id": ["p1", "p1", "p2"], "site": "X", "split": "train"})
    >>> frame.attrs = {"labels": [], "task": "multilabel"}
    >>> out = split_by_patient(frame, seed=0, val_fraction=0.0, test_fraction=0.5)
    >>> out["split"].iloc[0] == out["split"].iloc[1]
    True
    """
    seed = int(config.get("split.seed", seed))
    val_fraction = _check_fraction("val_fraction", config.get("split.val-fraction", val_fraction))
    test_fraction = _check_fraction("test_fraction", config.get("split.test-fraction", test_fraction))
    if val_fraction + test_fraction >= 1.0:
        raise ConfigurationError(
            f"val_fraction={val_fraction} and test_fraction={test_fraction} leave no patients for training; "
            "make their sum less than 1, e.g. val_fraction=0.1, test_fraction=0.2"
        )
    out = catalog.copy()
    out["split"] = _hashed_split(
        catalog["patient_id"].astype(str), seed=seed, val_fraction=val_fraction, test_fraction=test_fraction
    )
    return validate_catalog(out)


# ---- labels ------------------------------------------------------------------------------------------------


def parse_findings(
    findings: pd.Series,
    *,
    labels: Sequence[str] = NIH_LABELS,
    label_map: Mapping[str, str] | None = None,
    image_ids: pd.Series | None = None,
) -> pd.DataFrame:
    """Turn pipe-separated finding strings (``"Cardiomegaly|Effusion"``, ``"No Finding"``) into 0/1 columns.

    Parameters
    ----------
    findings : pandas.Series
        One string per image.
    labels : sequence of str
        The label columns to produce, in order. ``"No Finding"`` means all of them are 0.
    label_map : mapping, optional
        Renames findings before they are matched, e.g. ``{"Infiltrate": "Infiltration"}``; map to
        ``"No Finding"`` to ignore a finding.
    image_ids : pandas.Series, optional
        Shown in error messages beside the row number.

    Returns
    -------
    pandas.DataFrame
        ``uint8`` columns ``labels``, same index as ``findings``.

    Raises
    ------
    CatalogError
        For an empty finding, a finding that is not in ``labels`` (naming the row and showing ``label_map=`` as
        the fix), or ``"No Finding"`` together with a finding.
    """
    labels = list(labels)
    ids = image_ids if image_ids is not None else pd.Series(np.arange(len(findings)), index=findings.index)

    def where(pos: int) -> str:
        return f"row {pos} (image {ids.iloc[pos]!r})"

    text = findings.astype("string").str.strip()
    empty = text.isna() | (text == "")
    if empty.any():
        pos = int(np.flatnonzero(empty.to_numpy())[0])
        raise CatalogError(f"{where(pos)} has no finding labels; write {NO_FINDING!r} for an image without findings")
    dummies = text.str.get_dummies(sep="|")
    dummies.columns = [c.strip() for c in dummies.columns]
    if label_map:
        dummies.columns = [label_map.get(c, c) for c in dummies.columns]
    # Duplicate columns appear when stripping or label_map merges names; an image has a finding if any has it.
    dummies = dummies.T.groupby(level=0, sort=False).max().T if dummies.columns.duplicated().any() else dummies
    unknown = [c for c in dummies.columns if c not in labels and c != NO_FINDING]
    if unknown:
        name = unknown[0]
        pos = int(np.flatnonzero(dummies[name].to_numpy())[0])
        guess = difflib.get_close_matches(name, labels, n=1)
        target = guess[0] if guess else labels[0] if labels else NO_FINDING
        raise CatalogError(
            f"unknown label {name!r} in {where(pos)}"
            + (f" (and {len(unknown) - 1} more: {unknown[1:6]})" if len(unknown) > 1 else "")
            + f": labels are {', '.join(labels)}; pass label_map={{{name!r}: {target!r}}}"
        )
    if NO_FINDING in dummies.columns:
        known = [c for c in dummies.columns if c != NO_FINDING]
        both = (dummies[NO_FINDING] > 0) & (dummies[known].sum(axis=1) > 0) if known else None
        if both is not None and both.any():
            pos = int(np.flatnonzero(both.to_numpy())[0])
            raise CatalogError(
                f"{where(pos)} says {findings.iloc[pos]!r}: {NO_FINDING!r} together with findings; "
                f"fix the table, or drop {NO_FINDING!r} from such rows"
            )
    return dummies.reindex(columns=labels, fill_value=0).astype(np.uint8).set_axis(findings.index, axis=0)


# ---- NIH ---------------------------------------------------------------------------------------------------


class _Root:
    """A collection folder, local or behind an fsspec URL (``s3://``, ``gs://``, ``memory://`` ...).

    Local paths stay plain absolute OS paths in the catalog; remote ones are full URLs, so that workers can
    open them with fsspec.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        text = os.fspath(root)
        if "://" not in text:
            text = str(Path(text).expanduser().absolute())
        self.fs, path = fsspec.core.url_to_fs(text)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.path = path.rstrip("/") or "/"

    def join(self, *parts: str) -> str:
        return (os.path.join if self.local else posixpath.join)(self.path, *parts)

    def url(self, path: str) -> str:
        return path if self.local else self.fs.unstrip_protocol(path)

    def __str__(self) -> str:
        return self.url(self.path)

    def isdir(self, *parts: str) -> bool:
        return self.fs.isdir(self.join(*parts))

    def isfile(self, *parts: str) -> bool:
        return self.fs.isfile(self.join(*parts))

    def names(self) -> list[str]:
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.path, detail=False))

    def files_in(self, folder: str) -> dict[str, str]:
        """File name -> path or URL for the files directly in ``folder``."""
        if self.local:  # os.scandir lists the 112,120 NIH images in a fraction of a second
            with os.scandir(folder) as entries:
                return {e.name: e.path for e in entries if e.is_file()}
        listing = self.fs.ls(folder, detail=True)
        return {posixpath.basename(e["name"]): self.url(e["name"]) for e in listing if e["type"] == "file"}


def _find_table(root: _Root) -> str | None:
    for name in NIH_TABLES:
        if root.isfile(name):
            return name
    return None


def _read_nih_table(root: _Root, name: str) -> pd.DataFrame:
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


def _nih_image_paths(root: _Root, image_ids: pd.Series) -> pd.Series:
    """Where each image is: ``images/`` or ``images_NNN/images/``; missing ones keep ``root/images/<id>``."""
    found: dict[str, str] = {}
    folders = [root.join("images"), *sorted(root.fs.glob(root.join("images_*", "images")))]
    for folder in folders:
        if root.fs.isdir(folder):
            found.update(root.files_in(folder))
    fallback = root.url(root.join("images")) + (os.sep if root.local else "/") + image_ids
    return image_ids.map(found).fillna(fallback).astype(str)


def _read_list(root: _Root, name: str) -> pd.Index:
    names = pd.Series(root.fs.cat_file(root.join(name)).decode().split(), dtype=str)
    return pd.Index(names.unique())


def _official_split(root: _Root, table: pd.DataFrame, *, seed: int, val_fraction: float) -> np.ndarray | None:
    """Splits from ``train_val_list.txt`` / ``test_list.txt``, val taken from train_val by patient hash."""
    lists = ("train_val_list.txt", "test_list.txt")
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
    hashed = _hashed_split(patients, seed=seed, val_fraction=val_fraction, test_fraction=0.0)
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
    >>> catalog = read_nih("/data/nih")  # doctest: +SKIP
    >>> catalog["split"].value_counts()  # doctest: +SKIP
    """
    root = _Root(root)
    if not root.isdir():
        raise StoreNotFoundError(f"the NIH root {str(root)!r} is not a directory")
    name = _find_table(root)
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
    val_fraction = _check_fraction("val_fraction", config.get("split.val-fraction", val_fraction))
    official = _official_split(root, frame, seed=seed, val_fraction=val_fraction)
    if official is None:
        return split_by_patient(frame, seed=seed, val_fraction=val_fraction, test_fraction=test_fraction)
    frame["split"] = official
    return make_catalog(frame, NIH_LABELS)


# ---- class folders -----------------------------------------------------------------------------------------


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images_under(folder: Path, extensions: tuple[str, ...]) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix.lower() in extensions and not any(s.startswith(".") for s in p.parts)
    )


def _read_patients(path: Path) -> dict[str, str]:
    table = pd.read_csv(path, dtype=str)
    missing = [c for c in ("image_id", "patient_id") if c not in table.columns]
    if missing:
        raise CatalogError(
            f"{str(path)!r} lacks the column(s) {missing}; it has {list(table.columns)}. A patients table has "
            "columns image_id (the path under the root, e.g. 'cat/img1.png') and patient_id"
        )
    return dict(zip(table["image_id"].str.strip(), table["patient_id"].str.strip(), strict=True))


def read_folders(
    root: str | os.PathLike,
    *,
    site: str | None = None,
    extensions: Sequence[str] = IMAGE_EXTENSIONS,
    patients: str | os.PathLike | None = None,
    seed: int | None = None,
    val_fraction: float | None = None,
    test_fraction: float | None = None,
) -> pd.DataFrame:
    """Read a collection of class folders, ``root/<class>/<image>``, into a single-label catalog.

    This is torchvision's ImageFolder convention: every folder under ``root`` is a class, every image file
    below it (at any depth) an example of that class. If the folders under ``root`` are all named ``train``,
    ``val`` or ``test``, they give the split and the classes are one level down:
    ``root/<split>/<class>/<image>``.

    Parameters
    ----------
    root : str or path
        The collection.
    site : str, optional
        Value of the ``site`` column. Default: the name of ``root``.
    extensions : sequence of str
        File name endings taken as images, compared case-insensitively; other files are ignored.
    patients : str or path, optional
        CSV with columns ``image_id`` (the path under ``root``, as in the catalog, e.g. ``cat/img1.png``) and
        ``patient_id``. Default: ``root/patients.csv`` if it exists. Images it does not list, and all images
        when there is no such table, count as their own patient (patient id = file stem) since folders carry
        no patient information; give the table whenever a patient has several images, or they may land in
        different splits.
    seed, val_fraction, test_fraction
        Passed to :func:`split_by_patient` when the folders do not give the split.

    Returns
    -------
    pandas.DataFrame
        A ``multiclass`` catalog: image_id = path under ``root`` with ``/`` separators, one label column per
        class in sorted order, exactly one 1 per row.

    Raises
    ------
    StoreNotFoundError
        If ``root`` is not a directory.
    CatalogError
        If there are no class folders with images, or a patients table lacks its columns.

    Examples
    --------
    >>> catalog = read_folders("/data/xray-classes")  # doctest: +SKIP
    """
    root = Path(root).expanduser().absolute()
    if not root.is_dir():
        raise StoreNotFoundError(f"the folder collection {str(root)!r} is not a directory")
    extensions = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in extensions)
    top = _visible_dirs(root)
    by_split = bool(top) and {p.name for p in top} <= set(SPLITS)
    rows = []
    for split_dir in top if by_split else [root]:
        for class_dir in _visible_dirs(split_dir):
            for image in _images_under(class_dir, extensions):
                rows.append((image.relative_to(root).as_posix(), str(image), class_dir.name, split_dir.name))
    if not rows:
        raise CatalogError(
            f"no images with extensions {list(extensions)} in class folders under {str(root)!r} "
            f"(folders found: {[p.name for p in top][:10]}); the layout is root/<class>/<image> or "
            "root/<split>/<class>/<image>"
        )
    frame = pd.DataFrame(rows, columns=["image_id", "path", "_class", "split"])
    classes = sorted(frame["_class"].unique())
    patients_path = Path(patients) if patients is not None else root / "patients.csv"
    if patients is not None and not patients_path.is_file():
        raise StoreNotFoundError(f"no patients table at {str(patients_path)!r}")
    stems = frame["image_id"].map(lambda p: Path(p).stem)
    if patients_path.is_file():
        frame["patient_id"] = frame["image_id"].map(_read_patients(patients_path)).fillna(stems)
    else:
        frame["patient_id"] = stems
    frame["site"] = str(site) if site is not None else root.name
    onehot = pd.get_dummies(frame["_class"]).reindex(columns=classes, fill_value=False).astype(np.uint8)
    frame = pd.concat([frame[["image_id", "path", "patient_id", "site", "split"]], onehot], axis=1)
    frame.attrs = {"labels": classes, "task": "multiclass"}
    if by_split:
        return validate_catalog(frame)
    return split_by_patient(frame, seed=seed, val_fraction=val_fraction, test_fraction=test_fraction)


# ---- dispatch ----------------------------------------------------------------------------------------------

LAYOUTS: tuple[str, ...] = ("parquet", "nih", "dicom", "folders")


def _detect(source: Path) -> str:
    if source.is_file():
        if source.suffix == ".parquet":
            return "parquet"
        if source.name in NIH_TABLES:
            return "nih"
    if not source.is_dir():
        return ""
    if _find_table(_Root(source)) is not None:
        return "nih"
    sites = [p.name for p in _visible_dirs(source) if _find_table(_Root(p)) is not None]
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
    if others and any(p.parent != source for p in others):
        return "folders"
    return ""


def read_catalog(source: str | os.PathLike, *, layout: str | None = None, **kwargs: Any) -> pd.DataFrame:
    """Read any collection dask_dl understands into a catalog, choosing the reader from what ``source`` is.

    ======================================================  =====================================
    source                                                  reader
    ======================================================  =====================================
    a ``.parquet`` file                                     :func:`~dask_dl.data.schema.read_parquet_catalog`
    a folder with ``Data_Entry_2017*.csv[.gz]``, or it      :func:`read_nih`
    a folder whose images are all DICOM files               :func:`~dask_dl.data.dicom.read_dicom`
    a folder of class folders holding images                :func:`read_folders`
    ======================================================  =====================================

    Parameters
    ----------
    source : str or path
        File or folder. A URL (``s3://bucket/nih``, any fsspec protocol) is read as an NIH root, or as a
        Parquet catalog when it ends with ``.parquet``.
    layout : {"parquet", "nih", "dicom", "folders"}, optional
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
    if layout is not None and layout not in LAYOUTS:
        raise ConfigurationError(f"layout={layout!r} is not one of {list(LAYOUTS)}")
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
    reader = {"parquet": read_parquet_catalog, "nih": read_nih, "dicom": read_dicom, "folders": read_folders}[layout]
    accepted = set(list(inspect.signature(reader).parameters)[1:])
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ConfigurationError(
            f"option(s) {unknown} do not apply to a {layout} source {source!r}; "
            f"{reader.__name__} takes {sorted(accepted)}"
        )
    return reader(source, **kwargs)
