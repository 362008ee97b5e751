"""Bounding boxes of findings: NIH's ``BBox_List_2017.csv``, a generic CSV, and boxes as part of a dataset.

A box table has one row per box: ``image_id``, ``finding``, ``x``, ``y``, ``w``, ``h`` (float pixels, x right and
y down from the image's top-left corner; one image and finding may have several boxes). :func:`read_boxes` reads

- NIH's form, exactly as published: header ``Image Index,Finding Label,Bbox [x,y,w,h],,,``, the label
  ``Infiltrate`` for what the image table calls ``Infiltration``, coordinates in pixels of NIH's 1024 x 1024
  PNGs (not of the ``OriginalImage[Width,Height]`` detector size in ``Data_Entry_2017.csv``: the PNGs were
  already resized from it);
- a generic CSV with the columns ``image_id,finding,x,y,w,h``,

and scales them to the store's image size the way :func:`dask_dl.ingest` resizes images: padded to a centred
square, then scaled. :func:`attach_boxes` adds a table to a dataset as a ragged ``box`` dimension keyed by image
id (variables ``box_x``, ``box_y``, ``box_w``, ``box_h``; coordinates ``box_image_id``, ``box_finding``), and
:func:`boxes_of` reads it back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from dask_dl.errors import ConfigurationError, DatasetError, StoreNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    import xarray as xr

__all__ = ["BOX_COLUMNS", "NIH_BOX_LABELS", "NIH_IMAGE_SIZE", "attach_boxes", "boxes_of", "read_boxes"]

BOX_COLUMNS: tuple[str, ...] = ("image_id", "finding", "x", "y", "w", "h")
#: Side of NIH's published PNGs, the frame of ``BBox_List_2017.csv``'s coordinates.
NIH_IMAGE_SIZE = 1024
#: Labels of ``BBox_List_2017.csv`` that the image table spells differently.
NIH_BOX_LABELS: dict[str, str] = {"Infiltrate": "Infiltration"}
_NIH_FIRST = "Image Index"
_XYWH = ("x", "y", "w", "h")


def text(values: Any) -> np.ndarray:
    """Plain ``str`` values of a coordinate (zarr 3 reads strings as numpy's StringDType, which many calls refuse)."""
    return np.asarray(np.asarray(values).tolist(), dtype=str)


def _read_table(source: str | os.PathLike | pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """The raw table as ``BOX_COLUMNS`` and whether it is in NIH's form."""
    if isinstance(source, pd.DataFrame):
        table = source
    else:
        path = os.fspath(source)
        if not os.path.exists(path):
            raise StoreNotFoundError(
                f"no box table at {path!r}; pass NIH's BBox_List_2017.csv or a CSV with columns {','.join(BOX_COLUMNS)}"
            )
        # index_col=False: NIH's header names nine columns, its data lines hold six
        table = pd.read_csv(path, index_col=False)
    if len(table.columns) and str(table.columns[0]) == _NIH_FIRST:
        if len(table.columns) < 6:
            raise DatasetError(
                f"the NIH box table has columns {list(table.columns)}; NIH's form is 'Image Index,Finding Label,"
                "Bbox [x,y,w,h],,,' with six values per line"
            )
        frame = table.iloc[:, :6].copy()
        frame.columns = list(BOX_COLUMNS)
        return frame, True
    missing = [c for c in BOX_COLUMNS if c not in table.columns]
    if missing:
        raise DatasetError(
            f"the box table lacks columns {missing} (it has {list(table.columns)[:8]}); pass NIH's "
            f"BBox_List_2017.csv or a CSV with the columns {','.join(BOX_COLUMNS)}"
        )
    return table[list(BOX_COLUMNS)].copy(), False


def _clean(frame: pd.DataFrame, label_map: Mapping[str, str]) -> pd.DataFrame:
    frame["image_id"] = frame["image_id"].astype(str).str.strip()
    frame["finding"] = frame["finding"].astype(str).str.strip().replace(dict(label_map))
    for name in _XYWH:
        frame[name] = pd.to_numeric(frame[name], errors="coerce").astype(np.float64)
    bad = ~np.isfinite(frame[list(_XYWH)].to_numpy()).all(axis=1) | (frame["w"] <= 0) | (frame["h"] <= 0)
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise DatasetError(
            f"box row {row} ({frame.iloc[row].to_dict()}) is not a box: x, y must be numbers and w, h positive "
            "numbers of pixels"
        )
    return frame.reset_index(drop=True)


def _frames(
    frame: pd.DataFrame, image_size: Any, catalog: pd.DataFrame | None, nih: bool
) -> tuple[pd.DataFrame, np.ndarray | None]:
    """The boxes kept, and ``(n, 2)`` width and height of each one's source image (None: not to be scaled)."""
    if image_size is not None and catalog is not None:
        raise ConfigurationError("pass image_size= or catalog=, not both: both say how large the source images are")
    if catalog is not None:
        return _catalog_frames(frame, catalog)
    return frame, _given_frames(frame, image_size, nih)


def _given_frames(frame: pd.DataFrame, image_size: Any, nih: bool) -> np.ndarray | None:
    if image_size is None:
        image_size = NIH_IMAGE_SIZE if nih else None
    if image_size is None:
        return None
    if isinstance(image_size, int | np.integer) and not isinstance(image_size, bool) and image_size > 0:
        return np.full((len(frame), 2), float(image_size))
    if isinstance(image_size, tuple | list) and len(image_size) == 2 and all(float(v) > 0 for v in image_size):
        return np.tile(np.asarray(image_size, np.float64), (len(frame), 1))
    raise ConfigurationError(
        f"image_size must be the source images' side in pixels or their (width, height); got {image_size!r}, "
        "e.g. image_size=1024"
    )


def _catalog_frames(frame: pd.DataFrame, catalog: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """Each boxed image's size, read from its file's header (PNG/JPEG/TIFF: PIL reads no pixels for it)."""
    from PIL import Image

    if not {"image_id", "path"} <= set(catalog.columns):
        raise ConfigurationError(
            f"catalog= must be a catalog with image_id and path columns; it has {list(catalog.columns)[:8]}"
        )
    paths = dict(zip(catalog["image_id"].astype(str), catalog["path"].astype(str), strict=True))
    sizes: dict[str, tuple[int, int]] = {}
    for image_id in frame["image_id"].unique():
        if image_id not in paths:
            continue  # a box of an image the catalog does not hold: it is dropped below
        try:
            with Image.open(paths[image_id]) as image:
                sizes[image_id] = image.size
        except (OSError, ValueError) as exc:
            raise DatasetError(
                f"cannot read the size of {paths[image_id]!r} (boxed image {image_id!r}): {exc}; pass "
                "image_size=(width, height) of the images the boxes were drawn on instead of catalog="
            ) from exc
    frame = frame[frame["image_id"].isin(sizes)].reset_index(drop=True)
    return frame, np.array([sizes[i] for i in frame["image_id"]], np.float64).reshape(-1, 2)


def _target_size(size: Any) -> int | None:
    if size is None:
        return None
    attrs = getattr(size, "attrs", None)
    if attrs is not None:  # a dataset or map from dask_dl
        meta = attrs.get("dask_dl") or {}
        if "size" in meta:
            return int(meta["size"])
        if "x" in getattr(size, "sizes", {}):
            return int(size.sizes["x"])
        raise ConfigurationError("size= got an xarray object without an x dimension; pass the image side as an int")
    if isinstance(size, int | np.integer) and not isinstance(size, bool) and size > 0:
        return int(size)
    raise ConfigurationError(f"size must be the store's image side in pixels (or its dataset); got {size!r}")


def read_boxes(
    source: str | os.PathLike | pd.DataFrame,
    *,
    size: int | xr.Dataset | None = None,
    image_size: int | tuple[int, int] | None = None,
    catalog: pd.DataFrame | None = None,
    label_map: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Read a box table and scale it to the store's image size.

    Parameters
    ----------
    source
        NIH's ``BBox_List_2017.csv`` (or ``.csv.gz``) as published, a CSV with columns ``image_id,finding,x,y,w,h``,
        or such a DataFrame.
    size
        The store's image side (an int, or a dataset/maps array whose side is used). Default: no scaling, the
        coordinates stay in pixels of the source images.
    image_size
        Side (or ``(width, height)``) of the images the boxes were drawn on. Default 1024 for NIH's form (its
        PNGs), none for the generic form (then ``size`` needs ``image_size`` or ``catalog``). A synthetic
        collection's boxes are in its ``size`` x ``size`` PNGs: ``image_size=<the size given to synthesize>``.
    catalog
        A catalog (``image_id``, ``path``): each boxed image's size is read from its file's header; boxes of
        images the catalog lacks are dropped.
    label_map
        Renames findings; default ``{"Infiltrate": "Infiltration"}`` for NIH's form.

    Returns
    -------
    pandas.DataFrame
        Columns ``image_id`` (str), ``finding`` (str), ``x``, ``y``, ``w``, ``h`` (float64 pixels, top-left
        corner and size); ``table.attrs["size"]`` is the image side they are in (None when unknown).

    Raises
    ------
    StoreNotFoundError
        No file at ``source``.
    DatasetError
        Not a box table, or a row whose coordinates are not a box.
    ConfigurationError
        A bad ``size``/``image_size``; ``size`` without a source frame for a generic table.

    Examples
    --------
    >>> boxes = read_boxes("BBox_List_2017.csv", size=224)  # doctest: +SKIP
    >>> boxes.finding.value_counts()["Infiltration"]  # doctest: +SKIP
    123
    """
    frame, nih = _read_table(source)
    frame = _clean(frame, NIH_BOX_LABELS if label_map is None and nih else (label_map or {}))
    target = _target_size(size)
    frame, frames = _frames(frame, image_size, catalog, nih)
    if target is not None and nih and image_size is None and catalog is None:  # the assumed frame would scale them
        _check_nih_frame(frame, source)
    if target is not None:
        if frames is None:
            raise ConfigurationError(
                "the generic box table's coordinates are in pixels of the source images, whose size is unknown: "
                "pass image_size=<their side> or catalog=<the catalog> with size=, or omit size= when the "
                "coordinates are already in the store's pixels"
            )
        frame = _scale(frame, frames, target)
    frame.attrs = {"size": target if target is not None else (None if frames is None else _common_side(frames))}
    return frame


#: Fewer boxes than this may all lie in one corner of NIH's frame by chance; more cannot (lungs fill the image).
_CORNER_BOXES = 20


def _check_nih_frame(frame: pd.DataFrame, source: Any) -> None:
    """Refuse an NIH-form table whose boxes all lie in the top-left quarter of the 1024-pixel frame assumed for it.

    That is the mark of boxes drawn on smaller images, such as a synthetic collection's (in the ``size`` given to
    :func:`~dask_dl.data.synthetic.synthesize`): scaled from 1024 pixels they would shrink into one corner, and
    every localization score would be 0 without any error. Passing ``image_size=`` skips this check.
    """
    if len(frame) < _CORNER_BOXES:
        return
    extent = float(max((frame["x"] + frame["w"]).max(), (frame["y"] + frame["h"]).max()))
    if extent <= NIH_IMAGE_SIZE / 2:
        name = "the box table" if isinstance(source, pd.DataFrame) else repr(os.fspath(source))
        raise DatasetError(
            f"all {len(frame)} boxes of {name} end within {extent:g} pixels of the top-left corner of the "
            f"{NIH_IMAGE_SIZE} x {NIH_IMAGE_SIZE} frame assumed for NIH's form: they were drawn on smaller images "
            "(a synthetic collection's boxes are in the size given to synthesize). Pass image_size=<the side of "
            "those images> (dask-dl explain --image-size), or image_size=1024 if they are NIH's"
        )


def _common_side(frames: np.ndarray) -> int | None:
    sides = np.unique(frames)
    return int(sides[0]) if len(sides) == 1 else None


def _scale(frame: pd.DataFrame, frames: np.ndarray, size: int) -> pd.DataFrame:
    """Pad to a centred square (integer offsets, as the image resizing does), then scale to ``size``."""
    width, height = frames[:, 0], frames[:, 1]
    side = np.maximum(width, height)
    scale = size / side
    out = frame.copy()
    out["x"] = (frame["x"].to_numpy() + (side - width) // 2) * scale
    out["y"] = (frame["y"].to_numpy() + (side - height) // 2) * scale
    out["w"] = frame["w"].to_numpy() * scale
    out["h"] = frame["h"].to_numpy() * scale
    return out


# ---- boxes in a dataset ------------------------------------------------------------------------------------


def attach_boxes(ds: xr.Dataset, boxes: str | os.PathLike | pd.DataFrame, **read_options: Any) -> xr.Dataset:
    """Return ``ds`` with the boxes of its images as a ragged ``box`` dimension.

    Parameters
    ----------
    ds
        A dataset from :func:`~dask_dl.open_dataset` (any selection of it).
    boxes
        A table from :func:`read_boxes` (in the store's pixels), or a path read with
        ``read_boxes(path, size=ds, **read_options)``.
    **read_options
        ``image_size``, ``catalog`` or ``label_map`` for :func:`read_boxes`.

    Returns
    -------
    xarray.Dataset
        ``ds`` plus ``box_x``, ``box_y``, ``box_w``, ``box_h`` (float32, dim ``box``) and the coordinates
        ``box_image_id``, ``box_finding``: one entry per box of an image in ``ds`` (others are left out), in the
        order of the images. Replaces boxes attached before.
    """
    table = boxes if isinstance(boxes, pd.DataFrame) else read_boxes(boxes, size=ds, **read_options)
    table, _ = _read_table(table)  # checks the columns of a DataFrame passed in
    size = int(ds.attrs.get("dask_dl", {}).get("size", ds.sizes.get("x", 0)))
    got = getattr(boxes, "attrs", {}).get("size") if isinstance(boxes, pd.DataFrame) else size
    if got is not None and size and int(got) != size:
        raise DatasetError(
            f"the boxes are in pixels of {got} px images, the dataset's images are {size} px; read them with "
            f"read_boxes(..., size={size})"
        )
    if "image_id" not in ds.coords:
        raise DatasetError("the dataset has no image_id coordinate; attach boxes to a dataset from open_dataset")
    position = pd.Series(np.arange(ds.sizes["sample"]), index=text(ds["image_id"].values))
    table = table[table["image_id"].astype(str).isin(position.index)]
    order = np.argsort(position[table["image_id"].astype(str)].to_numpy(), kind="stable")
    table = table.iloc[order]
    ds = ds.drop_vars([name for name in ds.variables if str(name).startswith("box_")])
    data = {f"box_{k}": ("box", table[k].to_numpy(np.float32)) for k in _XYWH}
    coords = {
        "box_image_id": ("box", table["image_id"].to_numpy(dtype=str)),
        "box_finding": ("box", table["finding"].to_numpy(dtype=str)),
    }
    return ds.assign(data).assign_coords(coords)


def boxes_of(data: Any) -> pd.DataFrame:
    """The box table attached to a dataset (or maps) by :func:`attach_boxes`: ``image_id, finding, x, y, w, h``.

    Raises
    ------
    DatasetError
        When no boxes are attached.
    """
    if "box_image_id" not in getattr(data, "coords", {}):
        raise DatasetError(
            "no boxes are attached; attach them with dask_dl.attach_boxes(ds, 'BBox_List_2017.csv') or pass boxes="
        )
    table = pd.DataFrame(
        {
            "image_id": text(data["box_image_id"].values),
            "finding": text(data["box_finding"].values),
            **{k: np.asarray(data[f"box_{k}"].values, np.float64) for k in _XYWH},
        }
    )
    table.attrs = {"size": int(data.sizes["x"]) if "x" in data.sizes else None}
    return table
