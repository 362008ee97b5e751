"""The pieces of 1-bit SGD: sign packing, the columns of a gradient bucket and the two-mean quantizer.

1-bit SGD (Seide et al., Interspeech 2014, as in CNTK) quantizes each *column* of a weight gradient on its own:
entries above zero become 1, the others 0, and a column is rebuilt from two values, the mean of its positive
entries and the mean of its other entries. The rebuilt column therefore has the same sum as the original one.

Columns: a parameter of shape ``(out, *rest)`` is viewed as the matrix ``(out, prod(rest))`` (a ``Linear``
weight as it is, a conv weight ``(out, in, kh, kw)`` as ``(out, in*kh*kw)``) and a column is ``matrix[:, j]``:
one value per output unit, for one input position, as in CNTK's column-major weight matrices. A vector (bias,
norm weight) or a scalar is a single column. Columns are numbered parameter by parameter in bucket order; a
range of columns is a list of 2-D views ("blocks") of the bucket, so nothing is transposed or copied to
quantize. Signs are packed in the row-major order of those blocks, one block after the other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)  # bit k of byte i holds entry 8*i + k: MSB first


def pack_signs(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (flattened) 8 entries per byte, as ``numpy.packbits`` (``bitorder='big'``) does.

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
    >>> pack_signs(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)).tolist()
    [129, 128]
    """
    bits = bits.reshape(-1)
    if bits.device.type == "cpu":
        return torch.from_numpy(np.packbits(bits.to(torch.bool).numpy()))
    return _pack_signs_torch(bits)


def _pack_signs_torch(bits: torch.Tensor) -> torch.Tensor:
    """The same packing with torch operations, for tensors on an accelerator."""
    bits = bits.reshape(-1).to(torch.uint8)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    bits = bits.view(-1, 8)
    packed = bits[:, 0] << 7
    for k in range(1, 8):
        packed |= bits[:, k] << (7 - k)
    return packed


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: the first ``n`` bits of ``packed`` as a 1-D bool tensor."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n).view(np.bool_))
    shifts = _SHIFTS.to(packed.device)
    return ((packed.reshape(-1, 1) >> shifts) & 1).view(-1)[:n].bool()


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D ``(rows, columns)`` view of a parameter of ``shape``: ``(shape[0], prod(shape[1:]))``.

    Vectors are one column ``(n, 1)``; scalars ``(1, 1)``.
    """
    shape = tuple(int(s) for s in shape)
    return (shape[0], math.prod(shape[1:])) if shape else (1, 1)


@dataclass(frozen=True)
class ColumnLayout:
    """The columns of a bucket whose parameters have ``shapes`` (in bucket order)."""

    shapes: tuple[tuple[int, ...], ...]

    @cached_property
    def matrices(self) -> tuple[tuple[int, int], ...]:
        return tuple(matrix_shape(s) for s in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(o) for o in np.cumsum([0] + [r * c for r, c in self.matrices])[:-1])

    @property
    def numel(self) -> int:
        return sum(r * c for r, c in self.matrices)

    @cached_property
    def column_starts(self) -> np.ndarray:
        """Entries before each column (columns numbered across parameters), plus the total at the end."""
        lengths = [np.full(c, r, dtype=np.int64) for r, c in self.matrices]
        return np.concatenate([[0], np.cumsum(np.concatenate(lengths))]) if lengths else np.zeros(1, np.int64)

    @property
    def n_columns(self) -> int:
        return len(self.column_starts) - 1

    def pieces(self, first: int = 0, last: int | None = None) -> list[tuple[int, int, int]]:
        """Columns ``first:last`` as ``(parameter index, first column, last column)`` inside each parameter."""
        last = self.n_columns if last is None else last
        out, column = [], 0
        for i, (_, cols) in enumerate(self.matrices):
            lo, hi = max(first, column), min(last, column + cols)
            if lo < hi:
                out.append((i, lo - column, hi - column))
            column += cols
        return out

    def blocks(self, flat: torch.Tensor, first: int = 0, last: int | None = None) -> list[torch.Tensor]:
        """2-D views of ``flat`` (bucket order) holding columns ``first:last``, one per parameter touched."""
        views = []
        for i, a, b in self.pieces(first, last):
            (rows, cols), offset = self.matrices[i], self.offsets[i]
            views.append(flat[offset : offset + rows * cols].view(rows, cols)[:, a:b])
        return views

    def block_shapes(self, first: int = 0, last: int | None = None) -> list[tuple[int, int]]:
        return [(self.matrices[i][0], b - a) for i, a, b in self.pieces(first, last)]

    def stripes(self, n: int) -> list[tuple[int, int]]:
        """Cut the columns into ``n`` contiguous ranges ``(first, last)`` of about ``numel / n`` entries each.

        Cuts fall between columns (a column is never split), so a stripe's quantization groups are the
        whole bucket's; a stripe may be empty when there are fewer columns than stripes.
        """
        starts = self.column_starts
        cuts = [0]
        for k in range(1, n):
            target = self.numel * k / n
            i = int(np.searchsorted(starts, target))  # first boundary at or above the target
            if 0 < i < len(starts) and target - starts[i - 1] < starts[i] - target:
                i -= 1
            cuts.append(min(max(i, cuts[-1]), self.n_columns))
        cuts.append(self.n_columns)
        return list(zip(cuts[:-1], cuts[1:], strict=True))


Workspace = dict  # (role, key...) -> a tensor reused from step to step


def scratch(workspace: Workspace | None, key: tuple, like: torch.Tensor, shape, dtype) -> torch.Tensor:
    """A tensor for ``key`` kept in ``workspace`` (fresh each call without one).

    Writing into kept tensors instead of new ones matters on CPU: a fresh 100 MB tensor costs its page faults
    on first touch, several times the cost of the arithmetic done in it.
    """
    shape = tuple(shape)
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    kept = workspace.get(key)
    if kept is None or tuple(kept.shape) != shape or kept.dtype != dtype or kept.device != like.device:
        kept = workspace[key] = torch.empty(shape, dtype=dtype, device=like.device)
    return kept


def quantize(
    blocks: Sequence[torch.Tensor], *, column_major: bool = False, workspace: Workspace | None = None, key=()
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Quantize 2-D blocks column by column to one bit per entry and two float32 scales per column.

    With ``column_major=True`` each column is summed as a contiguous row of a transposed copy, so its scales do
    not depend on which other columns share the block (float sums over a strided axis may be grouped
    differently for blocks of other widths); the two-stage server side uses it, because its stripes change
    with DDP's bucket layout and a resumed run must give the same bits. ``workspace`` and ``key`` keep the
    temporary tensors (and the returned bits) from call to call.

    Returns
    -------
    bits : list of torch.Tensor
        bool, ``block > 0``, one per block.
    scales : torch.Tensor
        float32 ``(n_columns, 2)``: the mean of the positive entries and the mean of the others (0 where a
        column has none), so that every rebuilt column keeps the column's sum.
    """
    bits, scales = [], []
    for i, block in enumerate(blocks):
        rows = block.shape[0]
        positive = torch.gt(block, 0, out=scratch(workspace, ("bits", *key, i), block, block.shape, torch.bool))
        columns = block.t().contiguous() if column_major else block
        axis = 1 if column_major else 0
        tmp = scratch(workspace, ("tmp", *key, i), block, columns.shape, torch.float32)
        sum_all = columns.sum(dim=axis)
        sum_pos = torch.clamp_min(columns, 0, out=tmp).sum(dim=axis)
        count = (tmp.copy_(positive.t() if column_major else positive)).sum(dim=axis)  # exact below 2**24 rows
        sum_neg = sum_all - sum_pos
        scales.append(torch.stack([sum_pos / count.clamp(min=1), sum_neg / (rows - count).clamp(min=1)], dim=1))
        bits.append(positive)
    out = torch.cat(scales).float() if scales else torch.zeros((0, 2))
    return bits, out


def dequantize(
    bits: Sequence[torch.Tensor], scales: torch.Tensor, out: Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Rebuild the blocks from :func:`quantize`'s ``bits`` and ``scales`` (into the ``out`` blocks if given)."""
    result, column = [], 0
    for i, positive in enumerate(bits):
        k = positive.shape[1]
        s = scales[column : column + k]
        column += k
        target = out[i] if out is not None else torch.empty(positive.shape, device=positive.device)
        target.copy_(positive)  # 0/1, then lerp picks the negative (0) or positive (1) mean exactly
        negative, positive_mean = s[:, 1].contiguous(), s[:, 0].contiguous()  # unit stride: vectorized lerp
        torch.lerp(negative.expand_as(target), positive_mean.expand_as(target), target, out=target)
        result.append(target)
    return result


def encode(bits: Sequence[torch.Tensor], scales: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """One uint8 message: the scales' float32 bytes, then the packed signs, zero-padded to ``size``."""
    signs = torch.cat([b.reshape(-1) for b in bits]) if bits else torch.zeros(0, dtype=torch.bool)
    message = torch.cat([scales.reshape(-1).contiguous().view(torch.uint8), pack_signs(signs)])
    if size is not None and size > message.numel():
        message = torch.cat([message, message.new_zeros(size - message.numel())])
    return message


def message_size(n_values: int, n_columns: int) -> int:
    """Bytes of :func:`encode`'s message for ``n_values`` entries in ``n_columns`` columns (no padding)."""
    return 8 * n_columns + (n_values + 7) // 8


def decode(message: torch.Tensor, shapes: Sequence[tuple[int, int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Bits (one bool block per shape) and scales from an :func:`encode` message (padding ignored)."""
    n_columns = sum(k for _, k in shapes)
    n_values = sum(r * k for r, k in shapes)
    scales = message[: 8 * n_columns].clone().view(torch.float32).view(n_columns, 2)
    signs = unpack_signs(message[8 * n_columns : message_size(n_values, n_columns)], n_values)
    bits, offset = [], 0
    for r, k in shapes:
        bits.append(signs[offset : offset + r * k].view(r, k))
        offset += r * k
    return bits, scales
