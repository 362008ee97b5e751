"""Gradient buckets without DDP, and a NumPy model of 1-bit SGD: what the compression tests and bench share.

:class:`FakeBucket` has the interface of DDP's ``GradBucket`` (which Python cannot build), so a comm hook can be
driven directly; :func:`ddp_buckets` groups parameter shapes as DDP does by default. The ``sim_*`` functions
are an implementation of the 1-bit algorithms written independently of the hooks, for tests to compare with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "ALEXNET",
    "FakeBucket",
    "ddp_buckets",
    "model_shapes",
    "numel",
    "shaped_model",
    "sim_columns",
    "sim_grouping",
    "sim_onebit",
    "sim_q",
    "sim_uncolumns",
]

# dask_dl's alexnet (one input channel, 14 outputs) with fc6 on a 5x5x256 feature map: 45.5M values, 182 MB.
ALEXNET = [
    (64, 1, 11, 11),
    (64,),
    (192, 64, 5, 5),
    (192,),
    (384, 192, 3, 3),
    (384,),
    (256, 384, 3, 3),
    (256,),
    (256, 256, 3, 3),
    (256,),
    (4096, 6400),
    (4096,),
    (4096, 4096),
    (4096,),
    (14, 4096),
    (14,),
]


def numel(shapes: Sequence[Sequence[int]]) -> int:
    """Values in parameters of ``shapes``."""
    return sum(math.prod(s) for s in shapes)


class FakeBucket:
    """DDP's ``GradBucket`` interface over a flat float32 tensor ``values`` holding parameters of ``shapes``.

    Parameters
    ----------
    shapes
        Parameter shapes, in bucket order.
    values
        The flat bucket (``numel(shapes)`` values); the hook may change it in place.
    index
        The bucket's index (``bucket.index()``).
    last
        Whether it is the last bucket of its step (``bucket.is_last()``; the hooks count steps on it).
    params
        Parameter objects (``bucket.parameters()``); by default new ``torch.nn.Parameter`` of ``shapes`` on the
        ``meta`` device (no memory: a bucket is cheap to make inside a timed step).
    """

    def __init__(self, shapes, values, index: int = 0, *, last: bool = True, params=None) -> None:
        import torch

        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.values, self.idx, self.last = values, index, last
        if params is None:
            params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in self.shapes]
        self.params = params

    def buffer(self):
        return self.values

    def gradients(self):
        out, offset = [], 0
        for s in self.shapes:
            k = math.prod(s)
            out.append(self.values[offset : offset + k].view(s))
            offset += k
        return out

    def parameters(self):
        return self.params

    def index(self) -> int:
        return self.idx

    def is_last(self) -> bool:
        return self.last


def model_shapes(name: str) -> list[tuple[int, ...]]:
    """The trainable parameters' shapes of the registered model ``name`` (three input channels, 14 outputs)."""
    from dask_dl.models import build_model

    net = build_model(name, num_outputs=14, in_channels=3)
    return [tuple(p.shape) for p in net.parameters() if p.requires_grad]


def ddp_buckets(shapes: Sequence[tuple[int, ...]], cap_bytes: int = 25 * 2**20) -> list[list[tuple[int, ...]]]:
    """Group parameter shapes the way DDP does by default: reverse order, about ``cap_bytes`` per bucket (the
    scale-out model's :func:`~dask_dl.train.compression.model.buckets`)."""
    from dask_dl.train.compression.model import buckets

    return buckets(shapes, cap_bytes)


def shaped_model(shapes: Sequence[tuple[int, ...]]):
    """A ``torch.nn.Module`` with zero parameters of ``shapes`` whose ``forward(grads)`` is ``sum((p * g).sum())``:
    after ``backward`` each parameter's gradient is its ``g`` exactly, so DDP hands its hook known buckets."""
    import torch

    class Shaped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

        def forward(self, grads):
            return sum((p * g).sum() for p, g in zip(self.weights, grads, strict=True))

    return Shaped()


# ---- a NumPy model of 1-bit SGD --------------------------------------------------------------------------------


def sim_grouping(shape) -> tuple[int, int, bool]:
    """``(out, rest, by_rows)``: a parameter's ``(out, prod(rest))`` view; groups are its rows if rest >= out."""
    if not shape:
        return 1, 1, False
    out, rest = shape[0], math.prod(shape[1:])
    return out, rest, rest >= out


def sim_columns(shapes, flat) -> list[np.ndarray]:
    """Bucket order -> list of quantization groups ("columns", each a 1-D array), in column order."""
    columns, offset = [], 0
    for s in shapes:
        out, rest, by_rows = sim_grouping(s)
        matrix = flat[offset : offset + out * rest].reshape(out, rest)
        columns += [matrix[i] for i in range(out)] if by_rows else [matrix[:, j] for j in range(rest)]
        offset += out * rest
    return columns


def sim_uncolumns(shapes, columns) -> np.ndarray:
    """Inverse of :func:`sim_columns`."""
    out, i = [], 0
    for s in shapes:
        rows, rest, by_rows = sim_grouping(s)
        k = rows if by_rows else rest
        out.append(np.stack(columns[i : i + k], axis=0 if by_rows else 1).reshape(-1))
        i += k
    return np.concatenate(out)


def sim_q(column: np.ndarray) -> np.ndarray:
    """The two-mean 1-bit quantizer of one column: entries ``>= 0`` (CNTK's side for zeros) and the others."""
    pos = column >= 0
    mean_pos = column[pos].astype(np.float64).mean() if pos.any() else 0.0
    mean_neg = column[~pos].astype(np.float64).mean() if (~pos).any() else 0.0
    return np.where(pos, mean_pos, mean_neg).astype(column.dtype)


def sim_onebit(shapes, grads, *, stages: int, error_feedback: bool = True):
    """Run 1-bit SGD on ``grads[t][r]`` (flat gradient of rank ``r`` at step ``t``).

    Returns the outputs per step, each rank's worker residual and the server residual (``stages=2``; summed
    over ranks, as each rank holds its stripe's), all flat in bucket order. The server side re-quantizes each
    column of the mean with its residual: which rank does it does not change the result.
    """
    n_ranks = len(grads[0])
    worker = [np.zeros(numel(shapes)) for _ in range(n_ranks)]
    server = [np.zeros(len(c)) for c in sim_columns(shapes, np.zeros(numel(shapes)))]
    outputs = []
    for step in grads:
        quantized = []
        for r, g in enumerate(step):
            x = sim_columns(shapes, g + worker[r])
            q = [sim_q(c) for c in x]
            if error_feedback:
                worker[r] = sim_uncolumns(shapes, [a - b for a, b in zip(x, q, strict=True)])
            quantized.append(q)
        mean = [sum(qs[j] for qs in quantized) / n_ranks for j in range(len(quantized[0]))]
        if stages == 1:
            outputs.append(sim_uncolumns(shapes, mean))
            continue
        out = []
        for j, column in enumerate(mean):
            y = column + server[j]
            q2 = sim_q(y)
            if error_feedback:
                server[j] = y - q2
            out.append(q2)
        outputs.append(sim_uncolumns(shapes, out))
    return outputs, worker, sim_uncolumns(shapes, server)
