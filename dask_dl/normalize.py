"""Pixel normalization: the one definition of how uint8 images become model input.

Training (the loader), export (inside the ONNX graph) and inference (for models that do not normalize in their
graph) all use :func:`scale`, so a model always sees at inference the numbers it was trained on::

    x = (pixels / 255 - mean) / std

This module imports neither torch nor numpy at import time; :func:`normalize` imports torch when called.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, TypeVar

from dask_dl.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["DEFAULT_NORMALIZATION", "check_normalization", "normalize", "scale"]

#: mean and std applied after scaling uint8 pixels to [0, 1]: ``(x / 255 - mean) / std``.
DEFAULT_NORMALIZATION: dict[str, float] = {"mean": 0.5, "std": 0.25}

T = TypeVar("T")


def check_normalization(normalization: Any) -> dict[str, float]:
    """Return ``normalization`` as ``{"mean": float, "std": float}``, or raise when it is not one.

    Parameters
    ----------
    normalization
        A mapping with exactly the keys ``mean`` and ``std`` (real numbers, ``std > 0``), or None for
        :data:`DEFAULT_NORMALIZATION`.

    Raises
    ------
    ConfigurationError
        Other keys, non-numbers or ``std <= 0``.

    Examples
    --------
    >>> check_normalization({"mean": 0.5, "std": 0.25})
    {'mean': 0.5, 'std': 0.25}
    """
    if normalization is None:
        return dict(DEFAULT_NORMALIZATION)
    ok = (
        hasattr(normalization, "keys")
        and set(normalization.keys()) == {"mean", "std"}
        and all(isinstance(normalization[k], numbers.Real) for k in ("mean", "std"))
        and normalization["std"] > 0
    )
    if not ok:
        raise ConfigurationError(
            f"normalization must be {{'mean': m, 'std': s}} with s > 0; got {normalization!r}; pass e.g. "
            f"normalization={DEFAULT_NORMALIZATION!r}"
        )
    return {"mean": float(normalization["mean"]), "std": float(normalization["std"])}


def scale(pixels: T, mean: float, std: float) -> T:
    """Return ``(pixels / 255 - mean) / std`` for a float torch tensor or numpy array (any shape).

    The arithmetic is written once here; it traces into ONNX graphs and runs on numpy alike.

    Examples
    --------
    >>> import numpy as np
    >>> scale(np.array([0.0, 255.0]), 0.5, 0.25).tolist()
    [-2.0, 2.0]
    """
    return (pixels / 255.0 - mean) / std


def normalize(batch: torch.Tensor | np.ndarray, *, mean: float | None = None, std: float | None = None) -> torch.Tensor:
    """Map a uint8 image batch to the normalized float32 tensor the models take.

    Parameters
    ----------
    batch : torch.Tensor or numpy.ndarray
        Pixels 0-255 (uint8, or any real dtype holding that range), shape ``(B, S, S)`` or ``(B, 1, S, S)``.
    mean, std : float, optional
        Default :data:`DEFAULT_NORMALIZATION`.

    Returns
    -------
    torch.Tensor
        float32, shape ``(B, 1, S, S)``, equal to ``(batch / 255 - mean) / std``.

    Raises
    ------
    DatasetError
        A batch of another shape.

    Examples
    --------
    >>> import numpy as np
    >>> normalize(np.full((2, 4, 4), 255, np.uint8)).shape
    torch.Size([2, 1, 4, 4])
    >>> float(normalize(np.zeros((1, 4, 4), np.uint8))[0, 0, 0, 0])
    -2.0
    """
    import torch

    from dask_dl.errors import DatasetError

    mean = DEFAULT_NORMALIZATION["mean"] if mean is None else float(mean)
    std = DEFAULT_NORMALIZATION["std"] if std is None else float(std)
    x = torch.as_tensor(batch)
    if x.ndim == 3:
        x = x.unsqueeze(1)
    if x.ndim != 4 or x.shape[1] != 1:
        raise DatasetError(
            f"normalize takes a batch of shape (B, S, S) or (B, 1, S, S); got {tuple(x.shape)}. "
            "Stack single images first, e.g. batch[None]"
        )
    return scale(x.to(torch.float32), mean, std)
