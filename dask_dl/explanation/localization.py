"""Localization accuracy of explanation maps against true boxes, as the ChestX-ray14 paper measures it.

Wang et al. (CVPR 2017, section 5.3) turn each heatmap into boxes: the map is scaled to [0, 255], thresholded,
and a box drawn around each isolated region of the binary map. A true box counts as localized at threshold T when
a generated box overlaps it with IoBB >= T (intersection over the *generated* box's area) or IoU >= T. Here the
regions are taken largest heat first (``regions=1``, the default, keeps the region of most heat: one box per map,
so that a map cannot score by scattering many small boxes; ``regions=None`` keeps them all, as the paper does). The
per-box scores are computed on the cluster, one task per chunk of maps that holds a boxed image; only the small
table of scores comes back. The "pointing" rate (the map's peak inside the true box) is reported beside them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import dask
import numpy as np
import pandas as pd

from dask_dl.checks import positive_int
from dask_dl.data.boxes import boxes_of, read_boxes, text
from dask_dl.errors import ConfigurationError, DatasetError

if TYPE_CHECKING:  # pragma: no cover
    import xarray as xr
    from distributed import Client

__all__ = ["THRESHOLDS", "localization"]

#: T(IoBB) and T(IoU) of the paper's localization table.
THRESHOLDS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
#: The paper's higher heatmap threshold, 180 of 255.
HEAT = 180 / 255
_PER_BOX = ["image_id", "finding", "iobb", "iou", "pointing", "regions"]


def localization(
    maps: xr.DataArray,
    boxes: Any,
    *,
    thresholds: Sequence[float] = THRESHOLDS,
    heat: float = HEAT,
    regions: int | None = 1,
    image_size: int | tuple[int, int] | None = None,
    per_box: bool = False,
    client: Client | None = None,
) -> pd.DataFrame:
    """Per-label localization hit rates of explanation maps at IoBB and IoU thresholds.

    Parameters
    ----------
    maps
        From :func:`~dask_dl.explain`: ``(sample, finding, y, x)`` with an ``image_id`` coordinate, lazy or not.
    boxes
        NIH's ``BBox_List_2017.csv`` or a generic box CSV (read with :func:`~dask_dl.read_boxes` and scaled to the
        maps' size), a box table already in the maps' pixels, or a dataset with boxes attached.
    thresholds
        The T(IoBB) and T(IoU) values to report.
    heat
        Share of a map's maximum that a pixel needs to be inside a region; default the paper's 180/255.
    regions
        How many regions of each map become boxes, most heat first; None for all of them.
    image_size
        Side (or width, height) of the images a box CSV's coordinates are in (see :func:`~dask_dl.read_boxes`).
    per_box
        Return one row per true box (``image_id, finding, iobb, iou, pointing, regions``: best IoBB and IoU of a
        generated box, whether the map's peak is inside, how many boxes the map gave) instead of the summary.

    Returns
    -------
    pandas.DataFrame
        One row per finding with boxes (and ``all``): ``boxes`` (true boxes scored), ``maps`` (images with such
        boxes), ``pointing`` (share of those maps whose peak is inside one of the image's boxes of the finding),
        ``IoBB 0.1``, ..., ``IoU 0.1``, ... (share of true boxes localized at that threshold).

    Raises
    ------
    DatasetError
        No box matches an image and finding of the maps; maps without ``image_id``.
    ConfigurationError
        Thresholds or ``heat`` outside (0, 1]; ``regions`` not a positive integer.

    Examples
    --------
    With maps and NIH's box table (not run as a doctest: it needs both):

    >>> dask_dl.localization(maps, "BBox_List_2017.csv").round(2)  # doctest: +SKIP
    """
    import xarray as xr

    thresholds = [float(t) for t in thresholds]
    if not thresholds or not all(0 < t <= 1 for t in thresholds) or not 0 < heat <= 1:
        raise ConfigurationError(f"thresholds {thresholds} and heat={heat} must lie in (0, 1], e.g. heat=0.7")
    if regions is not None:
        regions = positive_int("regions", regions)
    if not isinstance(maps, xr.DataArray) or maps.dims != ("sample", "finding", "y", "x"):
        raise DatasetError("maps must be the (sample, finding, y, x) DataArray dask_dl.explain returns")
    if "image_id" not in maps.coords:
        raise DatasetError("the maps have no image_id coordinate to match boxes with; explain an open_dataset dataset")
    table = _boxes(maps, boxes, image_size)
    scores = _score(maps, table, heat=heat, regions=regions, client=client)
    if per_box:
        return scores
    return _summary(scores, thresholds)


def _boxes(maps: xr.DataArray, boxes: Any, image_size: Any) -> pd.DataFrame:
    import xarray as xr

    side = int(maps.sizes["x"])
    if isinstance(boxes, xr.Dataset):
        table = boxes_of(boxes)
    elif isinstance(boxes, str | os.PathLike):
        table = read_boxes(boxes, size=side, image_size=image_size)
    elif isinstance(boxes, pd.DataFrame):
        table = boxes
    else:
        raise ConfigurationError(
            f"boxes must be a box CSV path, a table from read_boxes or a dataset with boxes; got {type(boxes).__name__}"
        )
    got = table.attrs.get("size")
    if got is not None and int(got) != side:
        raise DatasetError(
            f"the boxes are in pixels of {got} px images, the maps are {side} px; read them with "
            f"read_boxes(..., size={side})"
        )
    findings = text(maps["finding"].values).tolist()
    ids = text(maps["image_id"].values)
    table = table[table["finding"].isin(findings) & table["image_id"].astype(str).isin(ids)]
    if table.empty:
        raise DatasetError(
            f"no box is of an image in the maps and one of their findings {findings}; check that the boxes belong to "
            "this collection (image ids) and that the findings are spelled alike"
        )
    return table.reset_index(drop=True)


def _score(maps: xr.DataArray, table: pd.DataFrame, *, heat: float, regions: int | None, client) -> pd.DataFrame:
    array = maps.data
    if not hasattr(array, "to_delayed"):  # computed maps: one in-memory block
        import dask.array as da

        array = da.from_array(np.asarray(array), chunks=(max(1, len(array)), -1, -1, -1))
    array = array.rechunk({1: -1, 2: -1, 3: -1})
    ids = text(maps["image_id"].values)
    findings = text(maps["finding"].values).tolist()
    row = pd.Series(np.arange(len(ids)), index=ids)
    table = table.assign(row=row[table["image_id"].astype(str)].to_numpy(), j=table["finding"].map(findings.index))
    starts = np.cumsum((0, *array.chunks[0]))
    tasks = []
    for b, block in enumerate(array.to_delayed().ravel()):
        part = table[(table["row"] >= starts[b]) & (table["row"] < starts[b + 1])]
        if len(part):
            part = part.assign(row=part["row"] - starts[b])
            tasks.append(dask.delayed(_score_block)(block, part, heat=heat, regions=regions))
    results = client.gather(client.compute(tasks)) if client is not None else dask.compute(*tasks)
    return pd.concat(results, ignore_index=True)


def _score_block(block: np.ndarray, boxes: pd.DataFrame, *, heat: float, regions: int | None) -> pd.DataFrame:
    """Best IoBB and IoU of the generated boxes for each true box of the maps of this block."""
    generated: dict[tuple[int, int], tuple[np.ndarray, tuple[float, float]]] = {}
    rows = []
    for box in boxes.itertuples(index=False):
        key = (int(box.row), int(box.j))
        if key not in generated:
            generated[key] = _generated_boxes(np.asarray(block[key], np.float32), heat, regions)
        found, (py, px) = generated[key]
        x0, y0, x1, y1 = box.x, box.y, box.x + box.w, box.y + box.h
        iobb = iou = 0.0
        if len(found):
            w = np.clip(np.minimum(found[:, 2], x1) - np.maximum(found[:, 0], x0), 0, None)
            h = np.clip(np.minimum(found[:, 3], y1) - np.maximum(found[:, 1], y0), 0, None)
            inter = w * h
            area = (found[:, 2] - found[:, 0]) * (found[:, 3] - found[:, 1])
            iobb = float((inter / area).max())
            iou = float((inter / (area + box.w * box.h - inter)).max())
        pointing = bool(len(found)) and x0 <= px < x1 and y0 <= py < y1
        rows.append((box.image_id, box.finding, iobb, iou, pointing, len(found)))
    return pd.DataFrame(rows, columns=_PER_BOX)


def _generated_boxes(heatmap: np.ndarray, heat: float, regions: int | None):
    """Boxes ``(k, 4)`` as x0, y0, x1, y1 pixel edges around the map's regions, and its peak's pixel centre."""
    from scipy import ndimage

    peak = float(heatmap.max())
    if not peak > 0:
        return np.empty((0, 4)), (-1.0, -1.0)
    py, px = np.unravel_index(int(np.argmax(heatmap)), heatmap.shape)
    labels, n = ndimage.label(heatmap >= heat * peak, structure=np.ones((3, 3)))
    order = np.arange(1, n + 1)
    if regions is not None and n > regions:
        mass = ndimage.sum_labels(heatmap, labels, order)
        order = order[np.argsort(-mass, kind="stable")[:regions]]
    slices = ndimage.find_objects(labels)
    found = np.array(
        [(s[1].start, s[0].start, s[1].stop, s[0].stop) for s in (slices[i - 1] for i in order)], np.float64
    )
    return found.reshape(-1, 4), (py + 0.5, px + 0.5)


def _summary(scores: pd.DataFrame, thresholds: list[float]) -> pd.DataFrame:
    def rates(frame: pd.DataFrame) -> dict[str, float]:
        # pointing is per map: its peak inside any true box of that image and finding
        pointing = frame.groupby(["image_id", "finding"], sort=False)["pointing"].any()
        out = {"boxes": len(frame), "maps": len(pointing), "pointing": float(pointing.mean())}
        out |= {f"IoBB {t:g}": float((frame["iobb"] >= t).mean()) for t in thresholds}
        out |= {f"IoU {t:g}": float((frame["iou"] >= t).mean()) for t in thresholds}
        return out

    table = pd.DataFrame({finding: rates(frame) for finding, frame in scores.groupby("finding", sort=False)}).T
    table.loc["all"] = rates(scores)
    table.index.name = "finding"
    table[["boxes", "maps"]] = table[["boxes", "maps"]].astype(np.int64)
    return table
