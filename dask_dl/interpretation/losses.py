"""Per-image losses over Dask chunks and the k largest of them, found without gathering every loss.

Each chunk's losses come from its scores and labels where they live; :func:`dask.array.argtopk` keeps the k
largest of each chunk and merges them in a tree, so the client receives k positions whatever the collection's size.
"""

from __future__ import annotations

import dask.array as da
import numpy as np

__all__ = ["per_label_losses", "sample_losses", "top_positions"]

#: probabilities are clipped to [EPS, 1 - EPS]: a confident mistake costs -log(EPS), not infinity
EPS = 1e-7


def sample_losses(probs: da.Array, truth: da.Array, *, task: str = "multilabel") -> da.Array:
    """The loss of each image, chunked like ``probs``.

    ``"multilabel"``: binary cross-entropy averaged over the labels, as training minimizes it;
    ``"multiclass"``: the cross-entropy of the true class (``truth`` one-hot).
    """
    truth = truth.rechunk((probs.chunks[0], -1))
    return da.map_blocks(_block_losses, probs, truth, task=task, drop_axis=1, dtype=np.float64)


def per_label_losses(probs: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Binary cross-entropy of each label of each image (NumPy): which label an image is most wrong about."""
    p = np.clip(np.asarray(probs, np.float64), EPS, 1 - EPS)
    y = np.asarray(truth, np.float64)
    return -(y * np.log(p) + (1 - y) * np.log1p(-p))


def _block_losses(probs: np.ndarray, truth: np.ndarray, *, task: str) -> np.ndarray:
    if task == "multiclass":
        p = np.clip(np.asarray(probs, np.float64), EPS, 1 - EPS)
        return -np.log((p * truth).sum(axis=1))
    return per_label_losses(probs, truth).mean(axis=1)


def top_positions(losses: da.Array, k: int) -> np.ndarray:
    """Positions of the ``k`` largest losses, largest first (ties in no particular order)."""
    if k >= losses.shape[0]:
        # every image asked for: the table holds them all anyway (and dask's argtopk fails for k >= n)
        return np.argsort(-np.asarray(losses.compute()), kind="stable")
    return np.asarray(da.argtopk(losses, int(k)).compute())  # sorted by dask: largest first
