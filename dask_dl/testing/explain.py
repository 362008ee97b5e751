"""A boxed collection for explanation tests: synthetic radiographs whose findings are common and visible.

:func:`~dask_dl.synthesize` keeps NIH's label frequencies (Mass on 5% of images, findings from faint to obvious),
which a small model trained for seconds on a CPU learns only roughly. :func:`boxed_collection` draws with the same
:func:`~dask_dl.data.radiograph.draw_with_boxes`, but each chosen finding on ``prevalence`` of the images at a
strength from ``strength``, and writes what NIH publishes: the PNGs, a catalog (returned) and
``BBox_List_2017.csv`` in NIH's form. A model learns it in a few epochs, so tests can ask where it looks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import pandas as pd
from PIL import Image

from dask_dl.data.radiograph import draw_with_boxes
from dask_dl.data.schema import make_catalog

__all__ = ["boxed_collection", "train_small_cnn"]

NIH_BOX_HEADER = "Image Index,Finding Label,Bbox [x,y,w,h],,,"


def boxed_collection(
    root: str | os.PathLike,
    *,
    n_images: int = 1000,
    size: int = 128,
    findings: Sequence[str] = ("Effusion", "Mass"),
    prevalence: float = 0.4,
    strength: tuple[float, float] = (0.4, 1.0),
    test_fraction: float = 0.25,
    seed: int = 0,
) -> pd.DataFrame:
    """Write ``n_images`` PNGs and their ``BBox_List_2017.csv`` under ``root``; return the catalog.

    One patient per image; the last ``test_fraction`` of the images are the ``test`` split, the rest ``train``.
    Box coordinates are in pixels of the ``size`` x ``size`` PNGs.
    """
    root = os.fspath(root)
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    rng = np.random.default_rng(seed)
    labels = (rng.random((n_images, len(findings))) < prevalence).astype(np.uint8)
    strengths = rng.uniform(*strength, n_images)
    rows, lines = [], [NIH_BOX_HEADER]
    n_test = round(test_fraction * n_images)
    for i in range(n_images):
        present = [f for f, v in zip(findings, labels[i], strict=True) if v]
        pixels, boxes = draw_with_boxes(size, present, seed=seed, key=(i,), strength=float(strengths[i]))
        image_id = f"{i:08d}_000.png"
        path = os.path.join(root, "images", image_id)
        Image.fromarray(pixels).save(path)
        lines += [
            f"{image_id},{'Infiltrate' if f == 'Infiltration' else f},{x:g},{y:g},{w:g},{h:g}"
            for f, x, y, w, h in boxes
        ]
        split = "test" if i >= n_images - n_test else "train"
        rows.append({"image_id": image_id, "path": path, "patient_id": f"{i:08d}", "site": "synthetic", "split": split})
    with open(os.path.join(root, "BBox_List_2017.csv"), "w") as f:
        f.write("\n".join(lines) + "\n")
    frame = pd.DataFrame(rows)
    for j, name in enumerate(findings):
        frame[name] = labels[:, j]
    return make_catalog(frame, list(findings))


def train_small_cnn(
    dataset, *, epochs: int = 6, width: int = 8, lr: float = 3e-3, shift: int = 4, seed: int = 0
) -> dict:
    """Train ``small_cnn`` on a dataset's ``train`` split in this process; return a dask_dl checkpoint dict.

    A checkpoint like :func:`dask_dl.fit` writes (model, labels, input size, normalization, ...), so everything
    that takes a checkpoint takes it; quicker than a cluster run for tests that need any trained model.
    """
    import torch
    import torch.nn.functional as F

    from dask_dl.checkpoint import FORMAT
    from dask_dl.models import build_model
    from dask_dl.normalize import DEFAULT_NORMALIZATION, normalize

    labels = [str(f) for f in dataset["finding"].values]
    train = dataset.isel(sample=np.flatnonzero(dataset["split"].values == "train"))
    x = normalize(train["image"].values)
    y = torch.from_numpy(train["label"].values.astype(np.float32))
    torch.manual_seed(seed)
    net = build_model("small_cnn", num_outputs=len(labels), width=width)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
    for _ in range(epochs):
        net.train()
        for batch in torch.randperm(len(x)).split(32):
            # a random shift of a few pixels per batch: the model must find a finding where it is, not by position
            dy, dx = (int(v) for v in torch.randint(-shift, shift + 1, (2,)))
            images = F.pad(x[batch], (shift, shift, shift, shift), mode="replicate")
            images = images[..., shift + dy : shift + dy + x.shape[-2], shift + dx : shift + dx + x.shape[-1]]
            loss = F.binary_cross_entropy_with_logits(net(images), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    net.eval()
    return {
        "format": FORMAT,
        "model_name": "small_cnn",
        "model_kwargs": {"width": width},
        "model": net.state_dict(),
        "labels": labels,
        "task": "multilabel",
        "input_size": int(x.shape[-1]),
        "in_channels": 1,
        "normalization": dict(DEFAULT_NORMALIZATION),
        "epoch": epochs - 1,
        "optimizer": {},
        "compressor": [],
        "rng": [],
        "history": [],
    }
