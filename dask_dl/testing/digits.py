"""scikit-learn's bundled handwritten digits as a collection of class folders, and a plain PyTorch loop over a store.

What the data-order test and ``bench/order.py`` compare ``fit`` with: the same images, net, batch, learning rate
and steps, trained by a loop of a dozen lines in the order it is given (a full shuffle, or the loader's order).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["plain_accuracy", "write_digits"]


def write_digits(root: Path, *, size: int = 32) -> Path:
    """scikit-learn's digits as ``root/<digit>/<n>.png``, grey, upsampled from 8 px to ``size``."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for n, (image, target) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = root / str(target)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image * (255.0 / 16.0)).round().astype(np.uint8)
        Image.fromarray(pixels).resize((size, size), Image.Resampling.BILINEAR).save(folder / f"{n:04d}.png")
    return root


def plain_accuracy(
    store: str,
    order_of_epoch: Callable[[int], np.ndarray],
    *,
    epochs: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    model: str = "small_cnn",
) -> float:
    """Validation accuracy of a plain torch loop (SGD with momentum 0.9, as ``fit``'s) over the train split of
    ``store``: each epoch takes ``steps`` batches from the sample rows ``order_of_epoch(epoch)`` in that order."""
    import torch

    import dask_dl
    from dask_dl.models import build_model
    from dask_dl.normalize import normalize

    ds = dask_dl.open_dataset(store)
    images, labels = ds.image.values, ds.label.values.argmax(axis=1)
    row = {int(s): i for i, s in enumerate(ds.sample.values)}
    val = np.flatnonzero(ds.split.values == "val")
    torch.manual_seed(seed)
    net = build_model(model, num_outputs=ds.sizes["finding"])
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    for epoch in range(epochs):
        net.train()
        order = np.array([row[int(s)] for s in order_of_epoch(epoch)])
        for step in range(steps):
            batch = order[step * batch_size : (step + 1) * batch_size]
            x = normalize(torch.from_numpy(images[batch]).unsqueeze(1))
            loss = torch.nn.functional.cross_entropy(net(x), torch.from_numpy(labels[batch]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    net.eval()
    with torch.no_grad():
        predicted = net(normalize(torch.from_numpy(images[val]).unsqueeze(1))).argmax(dim=1).numpy()
    return float((predicted == labels[val]).mean())
