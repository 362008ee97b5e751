"""Fused CPU kernels for 1-bit SGD, compiled with numba: about the passes over memory the algorithm needs.

Eager torch makes about 20 passes over a gradient to quantize it (bool-to-float copies, broadcasts, transposes,
sums, lerps). Here a quantization group is read once from memory and handled while it is in cache:

- :func:`quantize` adds the residual, sums the entries ``>= 0`` and the others (float64, 16 lanes in a fixed
  order, so sums do not depend on how the work is cut or on the CPU), writes the two scales, the packed signs
  and the new residual. Its source is either a gradient bucket or, on the two-stage server side, the mean of
  ``N`` received messages (decoded on the fly). A group is swept once: its new error, which needs the group's
  means, is left owed to the next call's sweep (``owed``) or written by :func:`settle`.
- :func:`decode` decodes all ``N`` messages of a bucket and writes their mean (summed in float64 in rank order,
  times ``1/N``) into the bucket once; or, for the two-stage all-gather, each entry from its owner's message.

This module holds what a call does around the compiled loops (:mod:`dask_dl.train.compression.loops`): which
twin runs (parallel for large buckets when torch uses several threads, under a lock, since numba's default
threading layer must not be entered from two threads at once; serial twins run at once on two threads, each call
on its own bucket's tables and buffers), the scratch arrays kept on the task table, and the scales in the
messages' headers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numba
import numpy as np
import torch

from dask_dl.train.compression.loops import (
    DECODE_TASKS,
    QUANTIZE_TASKS,
    REDUCE_COLUMNS,
    SETTLE_TASKS,
    finish,
    header_means,
)

# Buckets from which the decode stores past the caches: a bucket larger than the last-level cache (32 MB here)
# leaves it anyway, and skipping the read of each line before it is written pays a little (AlexNet's 67 and 105 MB
# buckets). A smaller one stays in cache for the optimizer if stored normally: streamed, pieces of ResNet-50's
# shapes of 1 to 17 MB decoded 1.5-6x slower.
STREAM_BYTES = 32 << 20

_LOCK = threading.Lock()
PARALLEL_MIN = 1 << 18  # values in a bucket below which the kernels run serially
_SERIAL = nullcontext()


def _twin(values: int) -> int:
    """Which twin runs a bucket of ``values`` entries: 0, the parallel one (large buckets, when torch uses several
    threads), or 1, the serial one."""
    if _FORCE is not None:
        return _FORCE
    return 0 if values >= PARALLEL_MIN and torch.get_num_threads() > 1 else 1


@contextmanager
def _parallel() -> Iterator[None]:
    """Hold the lock around a parallel twin, which runs on as many numba threads as torch uses.

    Starting numba's threads can change torch's: with numba's OpenMP layer both share one OpenMP runtime, and its
    start sets the thread count of the calling thread. torch's count is put back afterwards, or every later torch
    op would run on another number of threads (and sum in another order: a run would not repeat itself bit for
    bit).
    """
    with _LOCK:
        threads = torch.get_num_threads()
        try:
            numba.set_num_threads(max(1, min(numba.config.NUMBA_NUM_THREADS, threads)))
            yield
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)


_FORCE: int | None = None  # 0 or 1: run that twin whatever the bucket (fused.warm_up compiles both)


class _Scratch:
    """The small arrays a quantize call on one task table needs, made at its first call and kept on the table
    (``table.scratch``): a step then allocates nothing, and finds them in one lookup. Safe to share between
    calls: a table is run by one call at a time (each bucket has its own tables, and DDP waits for every bucket's
    future before the next step), and the arrays never leave the call. The kernels clear what they add to."""

    def __init__(self, table: Any, rows: int, width: int) -> None:
        self.shape = (rows, width)
        self.scales = np.zeros((rows, 2 * width), dtype=np.float32)  # two means a group, when none is owed
        self.tails = np.zeros(len(table.rows), dtype=np.uint8)  # each task's last sign byte, if shared
        self.psp, self.psn, self.pcp = (np.zeros(table.n_partials) for _ in range(3))  # bands' column sums
        self.nothing = np.zeros(1, dtype=np.float32)  # stands for an array a call does not take
        self.no_messages = np.zeros((0, 1), dtype=np.uint8)
        self.no_means = np.zeros((0, 1), dtype=np.float32)


class _Means:
    """The two means of each group of ``rows`` messages, read from their headers (``loops.header_means``), kept
    on the table as :class:`_Scratch` is."""

    def __init__(self, table: Any, rows: int, width: int) -> None:
        self.shape = (rows, width)
        self.pairs = np.zeros(2 * width, dtype=np.float32)  # one header, read through an aligned array
        self.mp = np.zeros((rows, width), dtype=np.float32)
        self.mn = np.zeros((rows, width), dtype=np.float32)


def _scratch(table: Any, kind: type, use: str, rows: int, columns: np.ndarray) -> Any:
    """The ``kind`` (:class:`_Scratch` or :class:`_Means`) of ``table`` for ``use`` and ``rows`` messages of at
    most ``max(columns)`` groups."""
    width = max(int(columns.max(initial=0)), 1)
    kept = table.scratch.get(use)
    if kept is None or kept.shape != (rows, width):
        kept = table.scratch[use] = kind(table, rows, width)
    return kept


def owed_means(rows: int, columns: np.ndarray) -> np.ndarray:
    """An array for :func:`quantize`'s ``owed``: the two means of each group of ``rows`` messages of at most
    ``max(columns)`` groups, zero (nothing owed)."""
    return np.zeros((rows, 2 * max(int(columns.max(initial=0)), 1)), dtype=np.float32)


def quantize(
    table: Any,
    msgs: np.ndarray,
    columns: np.ndarray,
    *,
    grad: np.ndarray | None = None,
    received: np.ndarray | None = None,
    vals: np.ndarray | None = None,
    ef: bool = True,
    owed: np.ndarray | None = None,
) -> None:
    """Fill ``msgs`` (uint8, one row per message, its scales first) from ``grad`` (or the ``received`` messages).

    ``table``: a :class:`~dask_dl.train.compression.plan.TaskTable`. ``columns[m]``: the number of groups in
    message ``m`` (its header holds ``8 * columns[m]`` bytes of float32 scales).

    With ``ef``, the residual ``vals`` ends as the quantization error, unless ``owed`` is given (an array from
    :func:`owed_means`, kept with ``vals`` between calls): then its entries are left as they were quantized,
    owing their error against their group's means that ``owed`` now holds, and the next call with the same
    ``vals`` and ``owed`` takes that error in its single sweep over them. Anything else that reads ``vals`` runs
    :func:`settle` first.
    """
    if (ef or received is not None) and (vals is None or (grad is not None and len(vals) != len(grad))):
        raise ValueError("error feedback and the server side need ``vals``, a float32 array as long as the bucket")
    sc = _scratch(table, _Scratch, "quantize", msgs.shape[0], columns)
    if owed is None:
        scales = sc.scales
        scales.fill(0.0)  # nothing owed
    elif owed.shape != sc.scales.shape:
        raise ValueError(f"owed has shape {owed.shape}, these messages need {sc.scales.shape}: see owed_means")
    else:
        scales = owed
    grad = sc.nothing if grad is None else grad
    vals = sc.nothing if vals is None else vals
    if received is None:
        mode, received, mp_in, mn_in = 0, sc.no_messages, sc.no_means, sc.no_means
    else:
        mode = 1
        means = _scratch(table, _Means, "received", len(received), columns[:1])
        header_means(received, columns[:1].repeat(len(received)), means.pairs, means.mp, means.mn)
        mp_in, mn_in = means.mp, means.mn
    msgs.fill(0)  # the padding, and a byte two tasks share: its first task's bits are OR-ed in afterwards
    k = _twin(table.values)
    with _parallel() if k == 0 else _SERIAL:
        QUANTIZE_TASKS[k](
            mode, grad, received, mp_in, mn_in, vals, ef, table.rows, msgs, scales, sc.tails, sc.psp,
            sc.psn, sc.pcp,
        )  # fmt: skip
        if len(table.reductions):
            REDUCE_COLUMNS[k](table.reductions, sc.psp, sc.psn, sc.pcp, scales)
        if ef and owed is None:
            SETTLE_TASKS[k](table.rows, vals, scales)
    finish(table.rows, msgs, sc.tails, scales.view(np.uint8), columns)


def settle(table: Any, vals: np.ndarray, owed: np.ndarray) -> None:
    """Write into ``vals`` the errors it owes after :func:`quantize` with ``owed``; then it owes nothing."""
    k = _twin(table.values)
    with _parallel() if k == 0 else _SERIAL:
        SETTLE_TASKS[k](table.rows, vals, owed)
    owed.fill(0.0)


def decode(table: Any, msgs: np.ndarray, columns: np.ndarray, out: np.ndarray, *, average: bool) -> None:
    """Write the bucket ``out`` from ``msgs``: their mean (``average``), or each task's entries from its row
    (stored past the caches when ``out`` holds at least ``STREAM_BYTES``)."""
    means = _scratch(table, _Means, "decode", len(msgs), columns)
    header_means(msgs, columns, means.pairs, means.mp, means.mn)
    k = _twin(table.values)
    with _parallel() if k == 0 else _SERIAL:
        DECODE_TASKS[k](msgs, means.mp, means.mn, table.rows, average, out, out.nbytes >= STREAM_BYTES)
