"""A grid of images with their explanation maps laid over them and the true boxes drawn on top."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from dask_dl.checks import positive_int
from dask_dl.data.boxes import boxes_of, text
from dask_dl.errors import DatasetError, missing_dependency

if TYPE_CHECKING:  # pragma: no cover
    import xarray as xr
    from matplotlib.figure import Figure

__all__ = ["show"]


def show(
    dataset: xr.Dataset,
    maps: xr.DataArray | None = None,
    *,
    n: int = 8,
    finding: str | None = None,
    boxes: pd.DataFrame | None = None,
    samples: Any = None,
    columns: int = 4,
    alpha: float = 0.45,
) -> Figure:
    """Draw ``n`` images with a finding's map over each (when ``maps`` is given) and its true boxes.

    Parameters
    ----------
    dataset
        From :func:`~dask_dl.open_dataset`, with boxes attached by :func:`~dask_dl.attach_boxes` or not.
    maps
        From :func:`~dask_dl.explain` for this dataset (same samples, same order), or None for the images alone.
    n
        How many images.
    finding
        The finding whose map and boxes to draw; default, per image, the first finding of ``maps`` that the image
        has a box of (else the first finding of ``maps``).
    boxes
        A box table in the dataset's pixels (default the dataset's attached boxes, if any).
    samples
        Positions of the images to draw; default the first ``n`` with a box of a drawn finding, or the first
        ``n`` when there are no boxes.
    columns
        Images per row.
    alpha
        Opacity of the heatmap.

    Returns
    -------
    matplotlib.figure.Figure
    """
    try:
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError as exc:  # pragma: no cover - matplotlib comes with the explain extra
        raise missing_dependency("matplotlib", "explain", "dask_dl.show") from exc
    n, columns = positive_int("n", n), positive_int("columns", columns)
    if boxes is None and "box_image_id" in dataset.coords:
        boxes = boxes_of(dataset)
    ids = text(dataset["image_id"].values)
    findings = text(maps["finding"].values).tolist() if maps is not None else ([finding] if finding else [])
    if maps is not None and maps.sizes["sample"] != len(ids):
        raise DatasetError(
            f"the maps have {maps.sizes['sample']} images, the dataset {len(ids)}: explain this very dataset"
        )
    boxed = boxes[boxes["finding"].isin(findings)] if boxes is not None and findings else boxes
    if samples is None:
        with_boxes = np.flatnonzero(np.isin(ids, boxed["image_id"].astype(str))) if boxed is not None else []
        samples = with_boxes[:n] if len(with_boxes) else np.arange(min(n, len(ids)))
    samples = np.asarray(samples, dtype=np.int64)[:n]
    images = dataset["image"].isel(sample=samples).values
    rows = -(-len(samples) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3 * columns, 3.2 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, position, image in zip(axes.flat, samples, images, strict=False):
        image_id = ids[position]
        own = boxed[boxed["image_id"].astype(str) == image_id] if boxed is not None else None
        shown = finding or (own["finding"].iloc[0] if own is not None and len(own) else (findings or [None])[0])
        ax.imshow(image, cmap="gray", vmin=0, vmax=255)
        if maps is not None and shown in findings:
            heat = np.asarray(maps.isel(sample=int(position)).sel(finding=shown).values, np.float32)
            heat = heat / 255.0 if maps.dtype == np.uint8 else heat
            ax.imshow(heat, cmap="jet", alpha=alpha, vmin=0, vmax=1)
        if own is not None:
            for box in own[own["finding"] == shown].itertuples(index=False):
                # pixel i covers [i - 0.5, i + 0.5) in imshow's coordinates
                ax.add_patch(Rectangle((box.x - 0.5, box.y - 0.5), box.w, box.h, fill=False, color="lime", lw=1.5))
        ax.set_title(f"{image_id}\n{shown or ''}", fontsize=8)
    fig.tight_layout()
    return fig
