"""What every figure of the package shares: matplotlib (named by its extra when missing) and a grid of images."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dask_dl.errors import import_optional

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure


def pyplot(purpose: str) -> Any:
    """``matplotlib.pyplot``, or the error naming the extras that bring it."""
    return import_optional("matplotlib.pyplot", extra="notebook", purpose=purpose)


def image_grid(images: np.ndarray, titles: list[str], *, columns: int, purpose: str) -> Figure:
    """One grey image per axis, ``columns`` per row, each with its title; spare axes hidden."""
    plt = pyplot(purpose)
    columns = max(1, min(columns, len(images)))
    rows = max(1, -(-len(images) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.9 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, title in zip(axes.flat, images, titles, strict=False):
        ax.imshow(image, cmap="gray", vmin=0, vmax=255)
        ax.set_title(title, fontsize=7)
    fig.tight_layout()
    return fig


def label_names(values: Any) -> list[str]:
    """Plain ``str`` names of a coordinate's values."""
    return [str(v) for v in np.asarray(values).tolist()]
