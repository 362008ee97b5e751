"""Augmentation as batched tensor ops, with each image's own parameters, on whatever device the pixels are.

The work is split in two so that a GPU trainer's CPU cores only decode:

- :func:`draw_parameters` draws one row of parameters per image (rotation, zoom, shift, contrast, brightness, flip)
  from the loader's ``(seed, epoch, rank)`` stream. It is the same stream, drawn in the same order, as the CPU
  path's, so a resumed epoch skips exactly the draws of the batches already served, and a GPU run and a CPU run with
  the same seed augment each image alike;
- :func:`augment_batch` applies a batch of parameters to a batch of pixels in one affine grid and one
  ``grid_sample`` call plus a few elementwise ops, on the pixels' device. The CPU path
  (:meth:`~dask_dl.data.loader.Augmentation.apply`) runs these same ops on the CPU and rounds to uint8; the device
  path (:func:`finish_batch`) runs them on the trainer's device and normalizes without rounding.

Why not the libraries' random modules: torchvision's v2 transforms draw one set of parameters per batch
(pytorch/vision#8484), so every image of a batch would move alike; kornia's ``RandomAffine(same_on_batch=False)``
draws per image, but from torch's global generator (``torch.distributions`` sampling, no generator argument),
which dropout draws from as well, so a step checkpoint could not say where the augmentation's stream stood. The
transform itself is the one kornia applies (an affine grid sampled bilinearly with zero padding), written here for
the CPU path's conventions: contrast around each image's mean, shift as a fraction of the side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from dask_dl.data.loader import Augmentation

__all__ = ["COLUMNS", "augment_batch", "draw_parameters", "finish_batch"]

#: the columns of a parameter row: rotation (radians), zoom (>1 enlarges), shift along x and y (fractions of the
#: side), contrast factor (around the image mean), brightness offset (fraction of full scale), flip (-1 or 1)
COLUMNS: tuple[str, ...] = ("angle", "zoom", "shift_x", "shift_y", "contrast", "brightness", "flip")


def draw_parameters(augmentation: Augmentation, n: int, rng: np.random.Generator) -> np.ndarray:
    """One float64 row of :data:`COLUMNS` per image for ``n`` images, drawn uniformly from ``augmentation``'s ranges.

    Draws from ``rng`` exactly what :meth:`~dask_dl.data.loader.Augmentation.skip` skips.

    Examples
    --------
    >>> from dask_dl.data.loader import Augmentation
    >>> p = draw_parameters(Augmentation(rotation=10), 4, np.random.default_rng(0))
    >>> p.shape, bool((abs(np.rad2deg(p[:, 0])) <= 10).all()), p[:, 6].tolist()
    ((4, 7), True, [1.0, 1.0, 1.0, 1.0])
    """
    a = augmentation
    u = rng.uniform(-1.0, 1.0, size=(6, n))
    flip = np.where(rng.random(n) < 0.5, -1.0, 1.0) if a.hflip else np.ones(n)
    return np.stack(
        [
            np.deg2rad(a.rotation * u[0]),
            1.0 + a.scale * u[1],
            a.shift * u[2],
            a.shift * u[3],
            1.0 + a.contrast * u[4],
            a.brightness * u[5],
            flip,
        ],
        axis=1,
    )


def augment_batch(x: torch.Tensor, parameters: Any) -> torch.Tensor:
    """Augment the float pixels ``x`` ``(B, C, S, S)`` in 0..1, image ``i`` with row ``i`` of ``parameters``.

    Every channel of an image moves with the same transform and jitter. Runs on ``x``'s device; ``parameters``
    (a ``(B, 7)`` array or tensor, :data:`COLUMNS`) is moved there. Pixels moved in from outside are black; the
    result is clamped to 0..1.

    Examples
    --------
    >>> import torch
    >>> identity = np.array([[0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0]])
    >>> x = torch.rand(1, 1, 8, 8)
    >>> torch.allclose(augment_batch(x, identity), x, atol=1e-6)
    True
    """
    import torch
    import torch.nn.functional as F

    b = x.shape[0]
    # float64 for the transform's few numbers (B x 7): the CPU path's theta is computed in float64 too
    p = torch.as_tensor(parameters).to(device=x.device, dtype=torch.float64)
    angle, zoom, flip = p[:, 0], p[:, 1], p[:, 6]
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    # theta maps output to input coordinates (-1..1), so dividing by zoom enlarges the picture; a shift of a
    # fraction f of the side is 2f in those coordinates
    theta = torch.stack(
        [torch.stack([flip * cos, -sin, 2.0 * p[:, 2]], dim=1), torch.stack([flip * sin, cos, 2.0 * p[:, 3]], dim=1)],
        dim=1,
    ).to(torch.float32)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    x = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    contrast = p[:, 4].to(torch.float32).view(b, 1, 1, 1)
    brightness = p[:, 5].to(torch.float32).view(b, 1, 1, 1)
    return ((x - mean) * contrast + mean + brightness).clamp_(0.0, 1.0)


def finish_batch(pixels: torch.Tensor, parameters: Any, *, normalization: dict[str, Any]) -> torch.Tensor:
    """The model's input from a loader's deferred batch: uint8 ``pixels`` ``(B, C, S, S)`` augmented with
    ``parameters`` (None: not augmented) and normalized, float32 on ``pixels``' device.

    Unlike the CPU path, the augmented pixels are not rounded to uint8 before normalizing: they differ from the
    CPU path's by less than half a grey level.
    """
    import torch

    from dask_dl.normalize import scale

    x = pixels.to(torch.float32)
    if parameters is not None:
        x = augment_batch(x.div_(255.0), parameters).mul_(255.0)
    return scale(x, normalization["mean"], normalization["std"])
