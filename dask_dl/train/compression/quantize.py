"""The pieces of 1-bit SGD: sign packing, the column layout of a gradient bucket and the two-mean quantizer.

1-bit SGD (Seide et al., Interspeech 2014, as in CNTK) quantizes each *column* of a weight gradient on its own:
entries above zero become 1, the others 0, and a column is rebuilt from two values, the mean of its positive
entries and the mean of its other entries. The rebuilt column therefore has the same sum as the original one.

Columns: a parameter of shape ``(out, *rest)`` is viewed as the matrix ``(out, prod(rest))`` (a ``Linear``
weight as it is, a conv weight ``(out, in, kh, kw)`` as ``(out, in*kh*kw)``) and a column is ``matrix[:, j]``:
one value per output unit, for one input position, as CNTK's column-major weight matrices have it. A vector
(bias, norm weight) or scalar parameter is a single column. :class:`ColumnLayout` reorders a flat bucket so that
every column is contiguous ("column order"); the quantizer then works on runs of equally long columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)  # bit k of a byte holds element 8*i + k: MSB first


def pack_signs(bits: torch.Tensor) -> torch.Tensor:
    """Pack a 1-D bool tensor 8 entries per byte, as ``numpy.packbits`` (``bitorder='big'``) does.

    Parameters
    ----------
    bits : torch.Tensor
        1-D bool (or 0/1) tensor of length ``n``.

    Returns
    -------
    torch.Tensor
        uint8 tensor of length ``ceil(n / 8)``; the last byte is padded with zero bits.

    Examples
    --------
    >>> pack_signs(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)).tolist()
    [129, 128]
    """
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
    """Inverse of :func:`pack_signs`: the first ``n`` bits of ``packed`` as a bool tensor."""
    shifts = _SHIFTS.to(packed.device)
    return ((packed.reshape(-1, 1) >> shifts) & 1).view(-1)[:n].bool()


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D ``(rows, columns)`` view of a parameter of ``shape``: ``(shape[0], prod(shape[1:]))``.

    Vectors are one column ``(n, 1)``; scalars ``(1, 1)``.
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        return (1, 1)
    return (shape[0], math.prod(shape[1:]))


@dataclass(frozen=True)
class ColumnLayout:
    """Where each parameter's columns lie in a flat bucket.

    ``shapes`` are the parameters' shapes in bucket order. In column order a parameter keeps its offset in the
    bucket, and inside its block the columns follow each other, each ``rows`` long (the transpose of the
    parameter's row-major ``(rows, cols)`` matrix).
    """

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
    def column_lengths(self) -> np.ndarray:
        """Length of every column (quantization group), in column order."""
        return np.concatenate([np.full(c, r, dtype=np.int64) for r, c in self.matrices] or [np.zeros(0, np.int64)])

    @cached_property
    def column_starts(self) -> np.ndarray:
        """Offset of every column in column order, plus the total as the last entry."""
        return np.concatenate([[0], np.cumsum(self.column_lengths)]).astype(np.int64)

    @property
    def n_columns(self) -> int:
        return len(self.column_lengths)

    def to_columns(self, flat: torch.Tensor) -> torch.Tensor:
        """Return a new flat tensor in column order (float32) from ``flat`` in bucket order."""
        blocks = zip(self.offsets, self.matrices, strict=True)
        parts = [flat[o : o + r * c].view(r, c).t().reshape(-1) for o, (r, c) in blocks]
        return torch.cat(parts).float() if parts else flat.new_zeros(0, dtype=torch.float32)

    def from_columns(self, columns: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``columns`` (column order) back in bucket order, into ``out`` when given."""
        out = torch.empty_like(columns) if out is None else out
        for o, (r, c) in zip(self.offsets, self.matrices, strict=True):
            out[o : o + r * c].view(r, c).copy_(columns[o : o + r * c].view(c, r).t())
        return out

    def runs(self, first: int = 0, last: int | None = None) -> list[tuple[int, int, int]]:
        """Columns ``first:last`` as runs ``(start, n_columns, column_length)``; ``start`` is relative to the
        start of column ``first`` in column order."""
        last = self.n_columns if last is None else last
        runs, column = [], 0
        base = int(self.column_starts[first])
        for rows, cols in self.matrices:
            lo, hi = max(first, column), min(last, column + cols)
            if lo < hi:
                runs.append((int(self.column_starts[lo]) - base, hi - lo, rows))
            column += cols
        return runs

    def stripes(self, n: int) -> list[tuple[int, int]]:
        """Cut the columns into ``n`` contiguous ranges ``(first, last)`` of about ``numel / n`` entries each.

        Cuts fall on column boundaries (a column is never split), so a stripe's quantization groups are
        the same as the whole bucket's; a stripe may be empty when there are fewer columns than stripes.
        """
        starts = self.column_starts
        cuts = [0]
        for k in range(1, n):
            target = self.numel * k / n
            i = int(np.searchsorted(starts, target))  # first boundary at or above the target
            if i > 0 and target - starts[i - 1] < starts[min(i, len(starts) - 1)] - target:
                i -= 1
            cuts.append(min(max(i, cuts[-1]), self.n_columns))
        cuts.append(self.n_columns)
        return list(zip(cuts[:-1], cuts[1:], strict=True))


def quantize(values: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``values`` (column order) to one bit per entry and two float32 scales per column.

    Parameters
    ----------
    values : torch.Tensor
        Flat float tensor in column order covering exactly the columns in ``runs``.
    runs : sequence of (start, n_columns, column_length)
        From :meth:`ColumnLayout.runs`.

    Returns
    -------
    bits : torch.Tensor
        bool, ``values > 0``.
    scales : torch.Tensor
        float32 ``(n_columns, 2)``: the mean of the positive entries and the mean of the others (0 where a
        column has none), so that every rebuilt column keeps the column's sum.
    """
    bits = values > 0
    scales = []
    for start, n_columns, length in runs:
        block = values[start : start + n_columns * length].view(n_columns, length)
        positive = bits[start : start + n_columns * length].view(n_columns, length)
        count = positive.sum(dim=1)
        zero = block.new_zeros(())
        sum_pos = torch.where(positive, block, zero).sum(dim=1)
        sum_neg = torch.where(positive, zero, block).sum(dim=1)
        scales.append(
            torch.stack([sum_pos / count.clamp(min=1), sum_neg / (length - count).clamp(min=1)], dim=1).float()
        )
    return bits, (torch.cat(scales) if scales else values.new_zeros((0, 2), dtype=torch.float32))


def dequantize(
    bits: torch.Tensor, scales: torch.Tensor, runs: Sequence[tuple[int, int, int]], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rebuild the column-order values from :func:`quantize`'s ``bits`` and ``scales`` (into ``out``)."""
    n = sum(n_columns * length for _, n_columns, length in runs)
    out = scales.new_empty(n) if out is None else out
    column = 0
    for start, n_columns, length in runs:
        positive = bits[start : start + n_columns * length].view(n_columns, length)
        s = scales[column : column + n_columns]
        torch.where(positive, s[:, :1], s[:, 1:], out=out[start : start + n_columns * length].view(n_columns, length))
        column += n_columns
    return out


def encode(bits: torch.Tensor, scales: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """Serialize to one uint8 message: the scales' float32 bytes, then the packed bits, zero-padded to ``size``."""
    message = torch.cat([scales.reshape(-1).contiguous().view(torch.uint8), pack_signs(bits)])
    if size is not None and size > message.numel():
        message = torch.cat([message, message.new_zeros(size - message.numel())])
    return message


def message_size(n_values: int, n_columns: int) -> int:
    """Bytes of :func:`encode`'s message for ``n_values`` entries in ``n_columns`` columns (no padding)."""
    return 8 * n_columns + (n_values + 7) // 8


def decode(
    message: torch.Tensor, runs: Sequence[tuple[int, int, int]], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rebuild values from an :func:`encode` message (padding ignored)."""
    n_columns = sum(n for _, n, _ in runs)
    n_values = sum(n * length for _, n, length in runs)
    scales = message[: 8 * n_columns].clone().view(torch.float32).view(n_columns, 2)
    bits = unpack_signs(message[8 * n_columns : message_size(n_values, n_columns)], n_values)
    return dequantize(bits, scales, runs, out=out)
