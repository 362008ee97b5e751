"""The pieces of 1-bit SGD: sign packing, the columns of a gradient bucket and the two-mean quantizer.

1-bit SGD (Seide et al., Interspeech 2014, as in CNTK) quantizes each *column* of a weight gradient on its own:
entries ``>= 0`` become 1 (zeros, common after ReLU, go to the positive side as in CNTK), the others 0, and a
column is rebuilt from two values, the mean of its entries ``>= 0`` and the mean of its other entries, each
summed in float64 (the negative sum is summed itself, not taken as ``sum - positive sum``, which cancels). The
rebuilt column therefore has the same sum as the original one.

This module is the eager torch implementation: the reference the fused CPU kernels
(:mod:`dask_dl.train.compression.kernels`) are tested against, and the path for tensors on a GPU.

Columns (the quantization groups): a parameter of shape ``(out, *rest)`` is viewed as the matrix
``(out, r)`` with ``r = prod(rest)`` (a ``Linear`` weight as it is, a conv weight ``(out, in, kh, kw)`` as
``(out, in*kh*kw)``). Groups run along its longer axis: when ``r > out`` a column is a *row* of that view
(the ``r`` weights of one output unit or conv filter, contiguous in memory), otherwise a column ``[:, j]``
(the ``out`` weights of one input position). A vector (bias, norm weight) or a scalar is a single column.
Why: every column costs 8 bytes of scales beside its ``length / 8`` bytes of signs, so short columns waste
the compression. CNTK's speech DNNs had columns thousands long; a ``(32, 16, 3, 3)`` conv cut along
``out`` would have 144 columns of 32 (scales 2/3 of its message), its 32 rows of 144 have under 1/3.

In code, each parameter is a logical matrix whose columns are its groups (:func:`matrix_shape`): ``(out, r)``
or, *transposed*, ``(r, out)``, the transpose of the contiguous ``(out, r)`` view. Columns are numbered
parameter by parameter in bucket order; a range of columns is a list of 2-D views ("blocks") of the bucket,
so nothing is copied to quantize. Signs are packed block after block, each in its parameter's memory order
(row after row of a block, or column after column of a transposed one), so the signs of whole parameters
are those of the bucket in order.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

_SHIFTS = torch.arange(8, dtype=torch.uint8)  # bit k of byte i holds entry 8*i + k: least significant first


def pack_signs(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (flattened) 8 entries per byte, as ``numpy.packbits(bits, bitorder="little")`` does.

    Least significant bit first: entry ``k`` of a run of 16 is bit ``k`` of the two bytes read as a
    little-endian ``uint16``, the order of a CPU's comparison mask, so the kernels pack and unpack with one move.

    Parameters
    ----------
    bits : torch.Tensor
        bool tensor of ``n`` entries.

    Returns
    -------
    torch.Tensor
        uint8 tensor of length ``ceil(n / 8)``; the last byte is padded with zero bits.

    Examples
    --------
    >>> pack_signs(torch.tensor([1, 1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool)).tolist()
    [3, 1]
    """
    bits = bits.reshape(-1)
    if bits.device.type == "cpu":
        return torch.from_numpy(np.packbits(bits.to(torch.bool).numpy(), bitorder="little"))
    return _pack_signs_torch(bits)


def _pack_signs_torch(bits: torch.Tensor) -> torch.Tensor:
    """The same packing with torch operations, for tensors on an accelerator."""
    bits = bits.reshape(-1).to(torch.uint8)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    bits = bits.view(-1, 8)
    packed = bits[:, 0].clone()
    for k in range(1, 8):
        packed |= bits[:, k] << k
    return packed


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: the first ``n`` bits of ``packed`` as a 1-D bool tensor."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little").view(np.bool_))
    return _unpack_signs_torch(packed, n)


def _unpack_signs_torch(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The same unpacking with torch operations, for tensors on an accelerator."""
    shifts = _SHIFTS.to(packed.device)
    return ((packed.reshape(-1, 1) >> shifts) & 1).view(-1)[:n].bool()


class BlockShape(NamedTuple):
    """A block of columns: ``rows`` entries per column, ``cols`` columns; ``transposed`` when the block is the
    transpose of a contiguous run of its parameter (its columns are the parameter's rows)."""

    rows: int
    cols: int
    transposed: bool = False


def matrix_shape(shape: Sequence[int]) -> BlockShape:
    """The matrix whose columns are the quantization groups of a parameter of ``shape``.

    With ``out, rest = shape[0], prod(shape[1:])``: ``(rest, out, transposed=True)`` when ``rest >= out`` (a
    group per row of the ``(out, rest)`` view), else ``(out, rest, transposed=False)``: groups are the longer
    side, so there are fewer scales to send. A square parameter (fc7's 4096x4096, attention projections) is
    grouped by rows, which are contiguous in memory: the columns of a square matrix are as many and as long,
    but strided, and cost the fused kernels a second sweep. Vectors are one column ``(n, 1)``; scalars
    ``(1, 1)``.

    Examples
    --------
    >>> matrix_shape((16, 16, 3, 3))  # a conv filter per group: 16 groups of 144
    BlockShape(rows=144, cols=16, transposed=True)
    >>> matrix_shape((128, 14))  # 14 groups of 128
    BlockShape(rows=128, cols=14, transposed=False)
    >>> matrix_shape((64, 64))  # 64 groups of 64, each a row
    BlockShape(rows=64, cols=64, transposed=True)
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        return BlockShape(1, 1)
    out, rest = shape[0], math.prod(shape[1:])
    return BlockShape(rest, out, True) if rest >= out else BlockShape(out, rest)


def empty_block(shape: BlockShape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized ``(rows, cols)`` tensor laid out as a block of ``shape`` is (column-major if transposed)."""
    if shape.transposed:
        return torch.empty((shape.cols, shape.rows), dtype=dtype, device=device).t()
    return torch.empty((shape.rows, shape.cols), dtype=dtype, device=device)


@dataclass(frozen=True)
class ColumnLayout:
    """The columns of a bucket whose parameters have ``shapes`` (in bucket order)."""

    shapes: tuple[tuple[int, ...], ...]

    @cached_property
    def matrices(self) -> tuple[BlockShape, ...]:
        return tuple(matrix_shape(s) for s in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(o) for o in np.cumsum([0] + [m.rows * m.cols for m in self.matrices])[:-1])

    @property
    def numel(self) -> int:
        return sum(m.rows * m.cols for m in self.matrices)

    @cached_property
    def column_starts(self) -> np.ndarray:
        """Entries before each column (columns numbered across parameters), plus the total at the end."""
        lengths = [np.full(m.cols, m.rows, dtype=np.int64) for m in self.matrices]
        return np.concatenate([[0], np.cumsum(np.concatenate(lengths))]) if lengths else np.zeros(1, np.int64)

    @property
    def n_columns(self) -> int:
        return len(self.column_starts) - 1

    def matrix(self, tensor: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s values ``tensor`` (its shape, or flat) as the matrix whose columns are its groups.

        A view, never a copy: ``tensor.view(out, rest)``, or its transpose ``.t()`` for a transposed parameter.
        """
        m = self.matrices[i]
        if m.transposed:
            return tensor.view(m.cols, m.rows).t()
        return tensor.view(m.rows, m.cols)

    def pieces(self, first: int = 0, last: int | None = None) -> list[tuple[int, int, int]]:
        """Columns ``first:last`` as ``(parameter index, first column, last column)`` inside each parameter."""
        last = self.n_columns if last is None else last
        out, column = [], 0
        for i, m in enumerate(self.matrices):
            lo, hi = max(first, column), min(last, column + m.cols)
            if lo < hi:
                out.append((i, lo - column, hi - column))
            column += m.cols
        return out

    def blocks(self, flat: torch.Tensor, first: int = 0, last: int | None = None) -> list[torch.Tensor]:
        """2-D views of ``flat`` (bucket order) holding columns ``first:last``, one per parameter touched.

        The columns of a transposed parameter are contiguous runs of ``flat``: its block is the transpose of a
        contiguous tensor.
        """
        views = []
        for i, a, b in self.pieces(first, last):
            m, offset = self.matrices[i], self.offsets[i]
            views.append(self.matrix(flat[offset : offset + m.rows * m.cols], i)[:, a:b])
        return views

    def block_shapes(self, first: int = 0, last: int | None = None) -> list[BlockShape]:
        return [
            BlockShape(self.matrices[i].rows, b - a, self.matrices[i].transposed)
            for i, a, b in self.pieces(first, last)
        ]

    @cached_property
    def column_offsets(self) -> tuple[int, ...]:
        """The number of the first column of each parameter (columns numbered across parameters)."""
        return tuple(int(o) for o in np.cumsum([0] + [m.cols for m in self.matrices])[:-1])

    def stripe_pieces(self, names: Sequence[str], n: int) -> list[list[tuple[int, int, int]]]:
        """Cut the columns into ``n`` stripes: ``(parameter index, first column, last column)`` pieces each.

        Every parameter's columns are cut in ``n`` contiguous runs of ``cols // n`` or one more, and run ``j``
        goes to stripe ``(j + crc32(name)) % n``: which stripe holds a column depends on its parameter's name
        and shape only, never on the bucket (DDP rebuilds its buckets after the first step, and a resumed run
        starts with other buckets), so the two-stage server residuals never change hands. The name rotates the
        runs, so parameters with fewer columns than stripes spread over the stripes. Pieces are in bucket order.
        """
        out: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        for i, (name, m) in enumerate(zip(names, self.matrices, strict=True)):
            turn = zlib.crc32(name.encode()) % n
            for j in range(n):
                lo, hi = j * m.cols // n, (j + 1) * m.cols // n
                if hi > lo:
                    out[(j + turn) % n].append((i, lo, hi))
        return out

    def piece_blocks(self, flat: torch.Tensor, pieces: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
        """2-D views of ``flat`` (bucket order), one per piece."""
        return [
            self.matrix(flat[self.offsets[i] : self.offsets[i] + self.matrices[i].rows * self.matrices[i].cols], i)[
                :, lo:hi
            ]
            for i, lo, hi in pieces
        ]

    def piece_shapes(self, pieces: Sequence[tuple[int, int, int]]) -> list[BlockShape]:
        return [BlockShape(self.matrices[i].rows, hi - lo, self.matrices[i].transposed) for i, lo, hi in pieces]

    def piece_columns(self, pieces: Sequence[tuple[int, int, int]]) -> list[int]:
        """The column numbers (across parameters) of the pieces, in order."""
        return [c for i, lo, hi in pieces for c in range(self.column_offsets[i] + lo, self.column_offsets[i] + hi)]


Workspace = dict  # (role, key...) -> a tensor reused from step to step


def scratch(
    workspace: Workspace | None, key: tuple, like: torch.Tensor, shape, dtype, *, transposed: bool = False
) -> torch.Tensor:
    """A tensor for ``key`` kept in ``workspace`` (fresh each call without one).

    Writing into kept tensors instead of new ones matters on CPU: a fresh 100 MB tensor costs its page faults
    on first touch, several times the cost of the arithmetic done in it. With ``transposed`` the 2-D tensor is
    column-major (the transpose of a contiguous one), as the blocks of transposed parameters are.
    """
    shape = tuple(shape)
    physical = shape[::-1] if transposed else shape
    if workspace is None:
        kept = torch.empty(physical, dtype=dtype, device=like.device)
    else:
        kept = workspace.get(key)
        if kept is None or tuple(kept.shape) != physical or kept.dtype != dtype or kept.device != like.device:
            kept = workspace[key] = torch.empty(physical, dtype=dtype, device=like.device)
    return kept.t() if transposed else kept


def _at_least(workspace: Workspace | None, key: tuple, like: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` float32 values from a flat tensor kept for ``key``, grown to the largest ever asked for."""
    kept = None if workspace is None else workspace.get(key)
    if kept is None or kept.numel() < numel or kept.device != like.device:
        kept = torch.empty(numel, dtype=torch.float32, device=like.device)
        if workspace is not None:
            workspace[key] = kept
    return kept[:numel]


def is_column_major(block: torch.Tensor) -> bool:
    """Whether the 2-D ``block`` is the transpose of a contiguous tensor (and not contiguous itself)."""
    return block.dim() == 2 and not block.is_contiguous() and block.t().is_contiguous()


def scratch_like(workspace: Workspace | None, key: tuple, block: torch.Tensor, dtype) -> torch.Tensor:
    """:func:`scratch` of ``block``'s shape and layout (row- or column-major), so that element-wise work
    between the two runs over memory in order."""
    return scratch(workspace, key, block, block.shape, dtype, transposed=is_column_major(block))


def quantize(
    blocks: Sequence[torch.Tensor], *, column_major: bool = False, workspace: Workspace | None = None, key=()
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Quantize 2-D blocks column by column to one bit per entry and two float32 scales per column.

    With ``column_major=True`` each column is summed as a contiguous row of a transposed copy (no copy for a
    block that is already column-major), so its scales do not depend on which other columns share the block
    (float sums over a strided axis may be grouped differently for blocks of other widths); the two-stage
    server side uses it, because its stripes change with DDP's bucket layout and a resumed run must give the
    same bits. ``workspace`` and ``key`` keep the temporary tensors (and the returned bits) from call to call.

    Returns
    -------
    bits : list of torch.Tensor
        bool, ``block >= 0`` (zeros on the positive side, as CNTK does), one per block, laid out as the block is.
    scales : torch.Tensor
        float32 ``(n_columns, 2)``: the mean of the entries ``>= 0`` and the mean of the others (0 where a
        column has none), each summed in float64, so that every rebuilt column keeps the column's sum.
    """
    bits, scales = [], []
    for i, block in enumerate(blocks):
        rows = block.shape[0]
        positive = torch.ge(block, 0, out=scratch_like(workspace, ("bits", *key, i), block, torch.bool))
        columns = block.t().contiguous() if column_major else block
        side = positive.t() if column_major else positive
        axis = 1 if column_major else 0
        wide = columns.double()  # float64 sums; the negatives summed themselves, never as sum_all - sum_pos
        sum_pos = torch.where(side, wide, 0.0).sum(dim=axis)
        sum_neg = torch.where(side, 0.0, wide).sum(dim=axis)
        count = side.sum(dim=axis)
        means = [sum_pos / count.clamp(min=1), sum_neg / (rows - count).clamp(min=1)]
        scales.append(torch.stack(means, dim=1).float())
        bits.append(positive)
    out = torch.cat(scales).float() if scales else torch.zeros((0, 2))
    return bits, out


def dequantize(
    bits: Sequence[torch.Tensor],
    scales: torch.Tensor,
    out: Sequence[torch.Tensor] | None = None,
    *,
    workspace: Workspace | None = None,
    key=(),
) -> list[torch.Tensor]:
    """Rebuild the blocks from :func:`quantize`'s ``bits`` and ``scales`` (into the ``out`` blocks if given).

    Every entry is exactly its column's positive or negative mean (``lerp`` with a 0/1 weight). ``workspace``
    and ``key`` keep the weights of column-major blocks from call to call.
    """
    result, column = [], 0
    for i, positive in enumerate(bits):
        k = positive.shape[1]
        s = scales[column : column + k]
        column += k
        target = out[i] if out is not None else scratch_like(None, (), positive, torch.float32)
        negative, positive_mean = s[:, 1].contiguous(), s[:, 0].contiguous()  # unit stride: vectorized lerp
        if is_column_major(target):
            # Here a column is a contiguous row of ``target.t()``: its two means are constant along the memory,
            # and lerp between two such broadcasts is not vectorized (8x slower). Materialize the negative
            # mean as the start, keep the 0/1 weight apart: one broadcast operand, a vectorized lerp.
            rows = target.t()
            weight = _at_least(workspace, ("dequantize", *key), target, rows.numel()).view(rows.shape)
            weight.copy_(positive.t())
            rows.copy_(negative[:, None].expand_as(rows))
            torch.lerp(rows, positive_mean[:, None].expand_as(rows), weight, out=rows)
        else:
            target.copy_(positive)  # 0/1, then lerp picks the negative (0) or positive (1) mean exactly
            torch.lerp(negative.expand_as(target), positive_mean.expand_as(target), target, out=target)
        result.append(target)
    return result


def _in_memory_order(bits: torch.Tensor, transposed: bool) -> torch.Tensor:
    return (bits.t() if transposed else bits).reshape(-1)


def encode(
    bits: Sequence[torch.Tensor],
    scales: torch.Tensor,
    size: int | None = None,
    *,
    transposed: Sequence[bool] | None = None,
) -> torch.Tensor:
    """One uint8 message: the scales' float32 bytes, then the packed signs, zero-padded to ``size``.

    ``transposed[i]`` (default all False) says block ``i`` is a transposed parameter's: its signs are packed
    column after column (the parameter's memory order), those of other blocks row after row.
    """
    transposed = [False] * len(bits) if transposed is None else transposed
    if bits:
        signs = torch.cat([_in_memory_order(b, t) for b, t in zip(bits, transposed, strict=True)])
    else:
        signs = torch.zeros(0, dtype=torch.bool)
    message = torch.cat([scales.reshape(-1).contiguous().view(torch.uint8), pack_signs(signs)])
    if size is not None and size > message.numel():
        message = torch.cat([message, message.new_zeros(size - message.numel())])
    return message


def message_size(n_values: int, n_columns: int) -> int:
    """Bytes of :func:`encode`'s message for ``n_values`` entries in ``n_columns`` columns (no padding)."""
    return 8 * n_columns + (n_values + 7) // 8


def decode(message: torch.Tensor, shapes: Sequence[tuple]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Bits (one bool block per shape) and scales from an :func:`encode` message (padding ignored).

    ``shapes``: :class:`BlockShape` (or ``(rows, cols)``) per block; a transposed block's bits are a
    column-major view.
    """
    shapes = [BlockShape(*s) for s in shapes]
    n_columns = sum(s.cols for s in shapes)
    n_values = sum(s.rows * s.cols for s in shapes)
    scales = message[: 8 * n_columns].clone().view(torch.float32).view(n_columns, 2)
    signs = unpack_signs(message[8 * n_columns : message_size(n_values, n_columns)], n_values)
    bits, offset = [], 0
    for r, k, transposed in shapes:
        run = signs[offset : offset + r * k]
        bits.append(run.view(k, r).t() if transposed else run.view(r, k))
        offset += r * k
    return bits, scales
