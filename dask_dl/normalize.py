"""Pixel normalization: the one definition of how uint8 images become model input.

Training (the loader), export (inside the ONNX graph) and inference (for models that do not normalize in their
graph) all use :func:`scale`, so a model always sees at inference the numbers it was trained on::

    x = (pixels / 255 - mean) / std

``mean`` and ``std`` are numbers (the same for every channel) or, for colour images, one number per channel
(``{"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}``, ImageNet's), applied along the channel axis of
``(B, C, S, S)`` batches. :func:`channel_stats` measures them on a dataset.

This module imports neither torch nor numpy at import time; :func:`normalize` imports torch when called.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from dask_dl.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch
    import xarray as xr

__all__ = [
    "DEFAULT_NORMALIZATION",
    "IMAGENET_NORMALIZATION",
    "channel_stats",
    "check_normalization",
    "normalize",
    "parse_normalization",
    "scale",
]

#: mean and std applied after scaling uint8 pixels to [0, 1]: ``(x / 255 - mean) / std``, for every channel.
DEFAULT_NORMALIZATION: dict[str, float] = {"mean": 0.5, "std": 0.25}

#: ImageNet's mean and std of R, G and B: the normalization of weights pretrained on ImageNet.
IMAGENET_NORMALIZATION: dict[str, list[float]] = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}

T = TypeVar("T")


def _values(value: Any) -> list[float] | None:
    """``value`` as a list of finite floats (one number: a list of one), or None when it is not that."""
    items = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    ok = items and all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in items)
    return [float(v) for v in items] if ok else None


def check_normalization(normalization: Any, *, channels: int | None = None) -> dict[str, Any]:
    """Return ``normalization`` as ``{"mean": m, "std": s}``, or raise when it is not one.

    Parameters
    ----------
    normalization
        A mapping with exactly the keys ``mean`` and ``std``, each a real number or a sequence of one number per
        channel (``std > 0``), or None for :data:`DEFAULT_NORMALIZATION`.
    channels
        The images' channels: per-channel sequences must have this length. None accepts any length.

    Returns
    -------
    dict
        Numbers stay floats; sequences become lists of floats (a sequence of one number too).

    Raises
    ------
    ConfigurationError
        Other keys, non-numbers, ``std <= 0``, or sequences whose length is not ``channels`` (or differ).

    Examples
    --------
    >>> check_normalization({"mean": 0.5, "std": 0.25})
    {'mean': 0.5, 'std': 0.25}
    >>> check_normalization({"mean": (0.485, 0.456, 0.406), "std": 0.25}, channels=3)
    {'mean': [0.485, 0.456, 0.406], 'std': 0.25}
    """
    if normalization is None:
        return dict(DEFAULT_NORMALIZATION)
    parts = (
        {k: _values(normalization[k]) for k in ("mean", "std")}
        if hasattr(normalization, "keys") and set(normalization.keys()) == {"mean", "std"}
        else None
    )
    if parts is None or None in parts.values() or min(parts["std"]) <= 0:
        raise ConfigurationError(
            f"normalization must be {{'mean': m, 'std': s}} with numbers (or one number per channel) and s > 0; "
            f"got {normalization!r}; pass e.g. normalization={DEFAULT_NORMALIZATION!r}"
        )
    lengths = {len(v) for k, v in parts.items() if not isinstance(normalization[k], numbers.Real)}
    if len(lengths) > 1 or (channels is not None and lengths and lengths != {int(channels)}):
        raise ConfigurationError(
            f"normalization {normalization!r} has per-channel values of length(s) {sorted(lengths)}, but the images "
            f"have {channels if channels is not None else 'one length of'} channel(s); give one mean and one std per "
            "channel, or single numbers for all channels"
        )
    return {k: float(normalization[k]) if isinstance(normalization[k], numbers.Real) else parts[k] for k in parts}


def parse_normalization(text: str | None, *, channels: int) -> dict[str, Any] | str | None:
    """A normalization written as text (``dask-dl train --normalization``), checked against the images' channels.

    Parameters
    ----------
    text
        ``MEAN:STD`` with numbers, or one number per channel separated by commas; ``imagenet`` for
        :data:`IMAGENET_NORMALIZATION` (3 channels only); ``stats`` or None, returned as they are (``stats`` is
        measured on the cluster by :func:`channel_stats`, None means the default).
    channels
        The images' channels.

    Returns
    -------
    dict, "stats" or None
        ``{"mean": m, "std": s}`` with a float for one number, a list of floats for one per channel.

    Raises
    ------
    ConfigurationError
        Text of another form, a ``STD <= 0``, or a count of numbers that is neither 1 nor ``channels``.

    Examples
    --------
    >>> parse_normalization("0.5:0.25", channels=1)
    {'mean': 0.5, 'std': 0.25}
    >>> parse_normalization("0.485,0.456,0.406:0.2", channels=3)
    {'mean': [0.485, 0.456, 0.406], 'std': 0.2}
    >>> parse_normalization("imagenet", channels=1)
    Traceback (most recent call last):
    ...
    dask_dl.errors.ConfigurationError: imagenet is ImageNet's mean and std of R, G and B, and this store has 1 channel(s); give MEAN:STD or stats
    """  # noqa: E501
    if text in (None, "stats"):
        return text
    if text == "imagenet":
        if channels != 3:
            raise ConfigurationError(
                f"imagenet is ImageNet's mean and std of R, G and B, and this store has {channels} channel(s); "
                "give MEAN:STD or stats"
            )
        return {k: list(v) for k, v in IMAGENET_NORMALIZATION.items()}
    mean, sep, std = text.partition(":")
    try:
        parts = [[float(v) for v in part.split(",")] for part in (mean, std)] if sep else None
    except ValueError:
        parts = None
    if parts is None:
        raise ConfigurationError(
            f"{text!r} is no normalization: give MEAN:STD (e.g. 0.5:0.25, or per channel "
            "0.485,0.456,0.406:0.229,0.224,0.225), imagenet or stats"
        )
    if min(parts[1]) <= 0 or any(len(p) not in (1, channels) for p in parts):
        raise ConfigurationError(
            f"{text!r}: every STD must be above 0, and the store has {channels} channel(s): give one MEAN and one "
            f"STD{'' if channels == 1 else f', or {channels} of each'}"
        )
    return {k: v[0] if len(v) == 1 else v for k, v in zip(("mean", "std"), parts, strict=True)}


def channel_stats(dataset: xr.Dataset | xr.DataArray, *, split: str | None = "train") -> dict[str, Any]:
    """Measure the mean and standard deviation of each channel of a dataset's images, on the ``[0, 1]`` scale.

    The result is a ``normalization`` for :func:`dask_dl.fit` that centres and scales every channel of this
    collection (what ImageNet's ``mean=[0.485, 0.456, 0.406]`` is for ImageNet). It reads every image once,
    as one Dask computation.

    Parameters
    ----------
    dataset
        A dataset of :func:`dask_dl.open_dataset` (or its ``image`` DataArray): ``image(sample, y, x)`` grey or
        ``image(sample, y, x, channel)`` colour.
    split
        Measure only this split (default ``"train"``: statistics of the validation images must not leak into
        training); None measures every sample. Ignored for a DataArray or a dataset without ``split``.

    Returns
    -------
    dict
        ``{"mean": [m_0, ...], "std": [s_0, ...]}``, one float per channel (one for grey).

    Raises
    ------
    DatasetError
        No image to measure (an empty selection), or a channel without any contrast (std 0).

    Examples
    --------
    On a store of yours (not run as a doctest: it needs the store and a cluster):

    >>> stats = channel_stats(dask_dl.open_dataset("derm.zarr"))  # doctest: +SKIP
    >>> run = dask_dl.fit(ds, normalization=stats)  # doctest: +SKIP
    """
    import dask
    import numpy as np

    from dask_dl.errors import DatasetError

    data = dataset
    if hasattr(data, "data_vars"):
        if split is not None and "split" in data.coords:
            data = data.isel(sample=np.flatnonzero(np.asarray(data["split"].values).astype(str) == split))
        data = data["image"]
    pixels = data.data
    if pixels.shape[0] == 0:
        raise DatasetError(f"there is no image to measure (split={split!r} selects none); pass split=None")
    axes = tuple(i for i in range(pixels.ndim) if data.dims[i] != "channel")
    x = pixels.astype(np.float64) / 255.0
    mean, square = dask.compute(x.mean(axis=axes), (x * x).mean(axis=axes))
    mean, square = np.atleast_1d(mean), np.atleast_1d(square)
    std = np.sqrt(np.maximum(square - mean * mean, 0.0))
    if not (std > 0).all():
        raise DatasetError(
            f"channel(s) {np.flatnonzero(std <= 0).tolist()} have the same value in every pixel (std 0): "
            "normalizing by them would divide by zero; check the collection"
        )
    return {"mean": [float(v) for v in mean], "std": [float(v) for v in std]}


def _per_channel(value: Any, like: Any) -> Any:
    """A number stays; a sequence becomes a ``(C, 1, 1)`` array/tensor of ``like``'s kind (broadcasts over NCHW)."""
    if isinstance(value, numbers.Real) or not isinstance(value, Sequence):
        return value
    if type(like).__module__.startswith("torch"):
        import torch

        return torch.tensor(list(value), dtype=like.dtype, device=like.device).view(-1, 1, 1)
    import numpy as np

    return np.asarray(value, dtype=getattr(like, "dtype", np.float64)).reshape(-1, 1, 1)


def scale(pixels: T, mean: Any, std: Any) -> T:
    """Return ``(pixels / 255 - mean) / std`` for a float torch tensor or numpy array.

    ``mean`` and ``std`` are numbers, or sequences of one number per channel applied along axis ``-3`` of
    ``pixels`` (``(B, C, S, S)`` or ``(C, S, S)``), or arrays/tensors that broadcast against ``pixels``. The
    arithmetic is written once here; it traces into ONNX graphs and runs on numpy alike.

    Examples
    --------
    >>> import numpy as np
    >>> scale(np.array([0.0, 255.0]), 0.5, 0.25).tolist()
    [-2.0, 2.0]
    >>> scale(np.full((1, 2, 1, 1), 255.0), [0.5, 0.0], [0.25, 1.0]).ravel().tolist()
    [2.0, 1.0]
    """
    return (pixels / 255.0 - _per_channel(mean, pixels)) / _per_channel(std, pixels)


def normalize(batch: torch.Tensor | np.ndarray, *, mean: Any = None, std: Any = None) -> torch.Tensor:
    """Map a uint8 image batch to the normalized float32 tensor the models take.

    Parameters
    ----------
    batch : torch.Tensor or numpy.ndarray
        Pixels 0-255 (uint8, or any real dtype holding that range), shape ``(B, S, S)`` (grey) or
        ``(B, C, S, S)`` (channels first, as the models take them).
    mean, std : float or sequence of float, optional
        Default :data:`DEFAULT_NORMALIZATION` (the same for every channel); a sequence gives one value per channel.

    Returns
    -------
    torch.Tensor
        float32, shape ``(B, C, S, S)`` (``C = 1`` for a ``(B, S, S)`` batch), equal to ``(batch / 255 - mean) /
        std`` channel by channel.

    Raises
    ------
    DatasetError
        A batch of another rank, or per-channel values whose length is not the batch's channels.

    Examples
    --------
    >>> import numpy as np
    >>> normalize(np.full((2, 4, 4), 255, np.uint8)).shape
    torch.Size([2, 1, 4, 4])
    >>> float(normalize(np.zeros((1, 4, 4), np.uint8))[0, 0, 0, 0])
    -2.0
    >>> normalize(np.zeros((1, 3, 4, 4), np.uint8), mean=[0.0, 0.5, 1.0], std=1.0)[0, :, 0, 0].tolist()
    [0.0, -0.5, -1.0]
    """
    import torch

    from dask_dl.errors import DatasetError

    mean = DEFAULT_NORMALIZATION["mean"] if mean is None else mean
    std = DEFAULT_NORMALIZATION["std"] if std is None else std
    x = torch.as_tensor(batch)
    if x.ndim == 3:
        x = x.unsqueeze(1)
    if x.ndim != 4:
        raise DatasetError(
            f"normalize takes a batch of shape (B, S, S) or (B, C, S, S); got {tuple(x.shape)}. "
            "Stack single images first, e.g. batch[None]"
        )
    for name, value in (("mean", mean), ("std", std)):
        if not isinstance(value, numbers.Real) and len(value) not in (1, x.shape[1]):
            raise DatasetError(
                f"normalize got {len(value)} {name} values for a batch of {x.shape[1]} channel(s) "
                f"(shape {tuple(x.shape)}); give one value per channel or a single number"
            )
    return scale(x.to(torch.float32), mean, std)
