"""A synthetic colour collection in class folders, whose class only colour tells (for the demo and the tests).

:func:`make_collection` writes ``root/<split>/<class>/<split>-<class>-<k>.png``: each image is smooth grey noise
with a disc of its class's colour at a random place and size, and a random brightness. The class colours have the
same luma (BT.601, within two levels) and the brightness jitter is larger than that, so the classes differ in hue
only: a model trained on the RGB store (``ingest(..., channels=3)``) can learn them, one trained on the grey store of
the same files cannot, which is what makes the collection a test of the colour path rather than of shapes.

Everything is a function of ``seed``: image ``k`` of class ``c`` in split ``s`` draws from
``numpy.random.default_rng([seed, s, c, k])``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dask_dl.checks import one_of, positive_int
from dask_dl.errors import ConfigurationError

__all__ = ["COLOURS", "make_collection"]

#: Class name -> RGB of its disc; all three have a BT.601 luma of 128-130.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 90, 90),
    "green": (60, 170, 90),
    "blue": (110, 115, 255),
}
_SPLITS = ("train", "val", "test")


def make_collection(
    root: str | os.PathLike,
    *,
    per_class: int = 16,
    val_per_class: int | None = None,
    test_per_class: int = 0,
    size: int = 48,
    channels: int = 3,
    classes: Sequence[str] | None = None,
    seed: int = 0,
) -> Path:
    """Write a class-folder collection of coloured discs under ``root`` and return ``root``.

    Parameters
    ----------
    root
        Folder to write into (created); read it with :func:`dask_dl.read_folders`.
    per_class, val_per_class, test_per_class
        Images per class in ``train``, ``val`` (default ``max(2, per_class // 2)``) and ``test`` (default none).
    size
        Side of the square PNGs (at least 16).
    channels
        3 writes RGB PNGs; 1 writes the same pictures as grey PNGs (Pillow's ``convert("L")``), in which the
        classes cannot be told apart: a control.
    classes
        Names among :data:`COLOURS`; default all three.
    seed
        Seed of every image.

    Returns
    -------
    pathlib.Path
        ``root``, holding ``train/<class>/*.png``, ``val/<class>/*.png`` (and ``test/`` when asked); every file
        name is unique, so each image is its own patient.

    Raises
    ------
    ConfigurationError
        A count or size that is not a positive integer, ``size < 16``, ``channels`` not 1 or 3, an unknown class.

    Examples
    --------
    >>> import tempfile
    >>> root = make_collection(tempfile.mkdtemp(), per_class=2, size=32)
    >>> sorted(p.relative_to(root).as_posix() for p in root.glob("train/red/*"))
    ['train/red/train-red-0000.png', 'train/red/train-red-0001.png']
    """
    from PIL import Image

    per_class = positive_int("per_class", per_class)
    val_per_class = positive_int("val_per_class", max(2, per_class // 2) if val_per_class is None else val_per_class)
    if isinstance(test_per_class, bool) or not isinstance(test_per_class, int) or test_per_class < 0:
        raise ConfigurationError(f"test_per_class must be an integer >= 0, got {test_per_class!r}")
    size = positive_int("size", size)
    if size < 16:
        raise ConfigurationError(f"size must be at least 16 pixels, got {size}; pass e.g. size=48")
    one_of("channels", channels, (1, 3))
    names = list(COLOURS) if classes is None else [str(c) for c in classes]
    for name in names:
        one_of("class", name, COLOURS)
    root = Path(root)
    counts = dict(zip(_SPLITS, (per_class, val_per_class, test_per_class), strict=True))
    for s, split in enumerate(_SPLITS):
        for name in names:
            c = list(COLOURS).index(name)
            folder = root / split / name
            if counts[split]:
                folder.mkdir(parents=True, exist_ok=True)
            for k in range(counts[split]):
                rgb = _picture(np.random.default_rng([seed, s, c, k]), COLOURS[name], size)
                image = Image.fromarray(rgb)
                # the stem is the patient id read_folders gives an image: one per image, unique in the collection
                (image if channels == 3 else image.convert("L")).save(folder / f"{split}-{name}-{k:04d}.png")
    return root


def _picture(rng: np.random.Generator, colour: tuple[int, int, int], size: int) -> np.ndarray:
    """Smooth grey noise with a disc of ``colour``, both scaled by one random brightness; ``(size, size, 3)``."""
    coarse = rng.uniform(70, 150, (4, 4))
    grid = np.linspace(0, 3, size)
    # bilinear upsampling of a 4 x 4 grid: smooth background, no scipy needed
    rows = np.array([np.interp(grid, np.arange(4), coarse[i]) for i in range(4)])
    background = np.array([np.interp(grid, np.arange(4), rows[:, j]) for j in range(size)]).T
    picture = np.repeat(background[:, :, None], 3, axis=2)
    radius = rng.uniform(0.18, 0.32) * size
    cy, cx = rng.uniform(radius, size - radius, 2)
    y, x = np.mgrid[:size, :size]
    disc = (y - cy) ** 2 + (x - cx) ** 2 <= radius**2
    picture[disc] = colour
    brightness = rng.uniform(0.8, 1.2)
    noise = rng.normal(0, 4, picture.shape)
    return np.clip(np.rint(picture * brightness + noise), 0, 255).astype(np.uint8)
