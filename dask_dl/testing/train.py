"""Tiny learnable collections for training tests: a bright square per positive label."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from dask_dl.data.schema import make_catalog

__all__ = ["squares_collection"]


def squares_collection(root: Path, *, n_train: int = 64, n_val: int = 32, seed: int = 0) -> pd.DataFrame:
    """Write 64 px PNGs under ``root/images`` and return their catalog (one patient per image).

    Label ``a`` is a bright square top left, ``b`` one bottom right, each present in about half the images, on
    Gaussian noise: a small CNN learns both within a couple of epochs at 32 px.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n_train + n_val):
        a, b = rng.random() < 0.5, rng.random() < 0.5
        pixels = rng.normal(80, 20, (64, 64))
        pixels[8:24, 8:24] += 120 * a
        pixels[40:56, 40:56] += 120 * b
        path = root / "images" / f"{i:04d}.png"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path)
        split = "train" if i < n_train else "val"
        rows.append(dict(image_id=path.name, path=str(path), patient_id=f"p{i}", site="A", split=split, a=a, b=b))
    frame = pd.DataFrame(rows).astype({"a": "uint8", "b": "uint8"})
    return make_catalog(frame, ["a", "b"])
