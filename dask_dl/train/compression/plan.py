"""Where each quantization group of a bucket goes: the stripes' messages, and the task tables of the kernels.

A 1-bit message (see :mod:`dask_dl.train.compression.quantize`) is the float32 scales of its groups, then their
packed signs, piece after piece. ``onebit`` sends the whole bucket as one message; ``onebit2`` cuts it in ``N``
stripes (:meth:`ColumnLayout.stripe_pieces <dask_dl.train.compression.quantize.ColumnLayout.stripe_pieces>`),
one message per stripe, all padded to the longest. A :class:`StripePlan` holds the task table that
:mod:`dask_dl.train.compression.kernels` runs for a bucket layout: one row per run of groups of one parameter,
with the bit and scale offsets of those groups in their message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dask_dl.train.compression.quantize import ColumnLayout, message_size

# The task table's columns: a run of groups of parameter S (its view OUT x REST, transposed TR) from T0 to T1, its
# first column LO and width PITCH, going to message M at sign bit DBIT and scale column DCOL; TAIL, its last sign
# byte when the next run completes it (-1: none); P, its first partial sum (untransposed pieces).
S, OUT, REST, TR, T0, T1, LO, PITCH, M, DBIT, DCOL, TAIL, P = range(13)
N_FIELDS = 13
# The reduction table's columns (untransposed pieces: their bands' partial sums, added up in band order).
R_P, R_BANDS, R_PITCH, R_M, R_DCOL, R_OUT = range(6)
N_REDUCE = 6

GRAIN = 1 << 16  # entries per task: big enough to amortize a task, small enough that a task's groups stay in cache
# A band of an untransposed piece holds BAND * GRAIN entries: its rows are summed in blocks of 16 that stay in
# cache, and each band keeps float64 partial sums of its columns (few bands: little memory to clear and add up).
BAND = 16

Pieces = list[tuple[int, int, int]]  # (parameter index, first group, last group) in bucket order


@dataclass(frozen=True)
class TaskTable:
    """The kernels' work for one set of messages: ``rows`` (one per task, columns ``S``...``P``),
    ``reductions`` (one per untransposed piece, columns ``R_P``...) and the number of partial sums."""

    rows: np.ndarray
    reductions: np.ndarray
    n_partials: int
    values: int  # entries the tasks cover
    #: the kernels' small arrays (scales, side slots, partial sums, header means), made at the first call and
    #: kept: a step then allocates nothing (see ``kernels._Scratch``)
    scratch: dict = field(default_factory=dict, compare=False, repr=False)


def task_table(layout: ColumnLayout, messages: Sequence[Pieces], *, grain: int | None = None) -> TaskTable:
    """The task table for ``messages[m]``'s pieces going to message ``m``.

    A transposed parameter's groups (rows of its ``(out, rest)`` view, contiguous) are cut into runs of about
    ``grain`` entries, each quantized whole while in cache. An untransposed piece (columns ``lo:hi`` of the
    view) is cut into bands of about ``BAND * grain`` entries (whole rows), walked in memory order: each band
    sweeps its rows (signs written) and sums its columns in blocks of 16 rows (phase one), then the bands' sums
    are added in band order (phase two). Cuts depend on the piece and ``grain`` only, so sums are the same
    whatever the bucket and the number of threads.
    """
    grain = GRAIN if grain is None else grain
    rows, reductions, partials = [], [], 0
    for m, pieces in enumerate(messages):
        bit, col = 64 * sum(hi - lo for _, lo, hi in pieces), 0
        for i, lo, hi in pieces:
            shape, s = layout.matrices[i], layout.offsets[i]
            # A vector (one column) is one contiguous group: run as a transposed parameter's row, whose signs
            # and scales go to the same places (walked as a column of one-entry rows it costs ~200 ns a value).
            runs = shape.transposed or shape.cols == 1
            out, rest = (shape.cols, shape.rows) if runs else (shape.rows, shape.cols)
            pitch = hi - lo
            fixed, where = (s, out, rest, int(runs)), (lo, pitch, m, bit, col)
            if runs:
                per = max(1, grain // rest)
                for t0 in range(lo, hi, per):
                    t1 = min(hi, t0 + per)
                    rows.append([*fixed, t0, t1, *where, _tail(bit + (t1 - lo) * rest), 0])
            else:
                per = max(1, BAND * grain // pitch)
                bands = range(0, out, per)
                for b, i0 in enumerate(bands):
                    i1 = min(out, i0 + per)
                    rows.append([*fixed, i0, i1, *where, _tail(bit + i1 * pitch), partials + b * pitch])
                reductions.append([partials, len(bands), pitch, m, col, out])
                partials += len(bands) * pitch
            bit += pitch * shape.rows
            col += pitch
    table = np.array(rows, dtype=np.int64).reshape(-1, N_FIELDS)
    values = sum((hi - lo) * layout.matrices[i].rows for pieces in messages for i, lo, hi in pieces)
    return TaskTable(table, np.array(reductions, dtype=np.int64).reshape(-1, N_REDUCE), partials, values)


def _tail(end_bit: int) -> int:
    """The last sign byte of a run of bits ending at ``end_bit`` when the next run completes it (else -1)."""
    return (end_bit - 1) >> 3 if end_bit % 8 else -1


@dataclass
class StripePlan:
    """The stripes of one bucket layout for ``n`` messages: pieces, sizes and task tables.

    ``tasks`` sends stripe ``k``'s groups to message ``k``; :meth:`own_tasks` sends one stripe's groups to
    message 0 (the two-stage server side, which quantizes only the stripe it owns).
    """

    layout: ColumnLayout
    pieces: list[Pieces]
    tasks: TaskTable
    columns: np.ndarray  # groups per message
    size: int  # bytes of every message (the longest one; the others are zero-padded)
    _own: dict[int, TaskTable] = field(default_factory=dict, repr=False)

    def own_tasks(self, k: int) -> TaskTable:
        if k not in self._own:
            self._own[k] = task_table(self.layout, [self.pieces[k]])
        return self._own[k]


def plan_stripes(shapes: Sequence[tuple[int, ...]], names: Sequence[str], n: int) -> StripePlan:
    """Plan a bucket of parameters ``shapes`` named ``names`` cut in ``n`` stripes (1: the whole bucket)."""
    layout = ColumnLayout(tuple(tuple(int(d) for d in s) for s in shapes))
    pieces = layout.stripe_pieces(names, n)
    columns = np.array([sum(hi - lo for _, lo, hi in p) for p in pieces], dtype=np.int64)
    values = [sum((hi - lo) * layout.matrices[i].rows for i, lo, hi in p) for p in pieces]
    size = max(message_size(v, int(c)) for v, c in zip(values, columns, strict=True))
    return StripePlan(layout, pieces, task_table(layout, pieces), columns, size)
