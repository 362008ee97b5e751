"""Class folders, torchvision's ImageFolder convention: ``root/<class>/<image>`` or ``root/<split>/<class>/<image>``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from dask_dl.data.layouts import LAYOUTS
from dask_dl.data.schema import SPLITS, validate_catalog
from dask_dl.data.splits import split_by_patient
from dask_dl.errors import CatalogError, StoreNotFoundError

__all__ = ["IMAGE_EXTENSIONS", "read_folders", "visible_dirs"]

#: File extensions :func:`read_folders` takes as images (compared case-insensitively).
IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".dcm", ".tif", ".tiff", ".bmp")


def visible_dirs(folder: Path) -> list[Path]:
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
    On a folder of class folders (not run as a doctest: it needs the images):

    >>> catalog = read_folders("/data/xray-classes")  # doctest: +SKIP
    """
    root = Path(root).expanduser().absolute()
    if not root.is_dir():
        raise StoreNotFoundError(f"the folder collection {str(root)!r} is not a directory")
    extensions = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in extensions)
    top = visible_dirs(root)
    by_split = bool(top) and {p.name for p in top} <= set(SPLITS)
    rows = []
    for split_dir in top if by_split else [root]:
        for class_dir in visible_dirs(split_dir):
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


LAYOUTS.register("folders", read_folders, help="class folders: root/<class>/<image> or root/<split>/<class>/<image>")
