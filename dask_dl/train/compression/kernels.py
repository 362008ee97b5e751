"""Fused CPU kernels for 1-bit SGD, compiled with numba: about the passes over memory the algorithm needs.

Eager torch makes about 20 passes over a gradient to quantize it (bool-to-float copies, broadcasts, transposes,
sums, lerps). Here a quantization group is read once from memory and handled while it is in cache:

- :func:`quantize` adds the residual, sums the entries ``>= 0`` and the others (float64, 16 lanes in a fixed
  order, so sums do not depend on how the work is cut or on the CPU), writes the two scales, the packed signs
  and the new residual. Its source is either a gradient bucket or, on the two-stage server side, the mean of
  ``N`` received messages (decoded on the fly).
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
from contextlib import contextmanager
from typing import Any

import numba
import numpy as np

from dask_dl.train.compression.loops import DECODE_TASKS, QUANTIZE_TASKS, REDUCE_COLUMNS, SIGN_BANDS, or_sides

# Buckets from which the decode stores past the caches: a bucket larger than the last-level cache (32 MB here)
# leaves it anyway, and skipping the read of each line before it is written pays a little (AlexNet's 67 and 105 MB
# buckets). A smaller one stays in cache for the optimizer if stored normally: streamed, pieces of ResNet-50's
# shapes of 1 to 17 MB decoded 1.5-6x slower.
STREAM_BYTES = 32 << 20

_LOCK = threading.Lock()
PARALLEL_MIN = 1 << 18  # values in a bucket below which the kernels run serially


@contextmanager
def _kernels(values: int) -> Iterator[int]:
    """Say which twin to run (0: parallel, 1: serial) for a bucket of ``values`` entries, holding the lock for
    the parallel one.

    The parallel twin runs on as many numba threads as torch uses. Starting numba's threads can change
    torch's: with numba's OpenMP layer both share one OpenMP runtime, and its start sets the thread count of
    the calling thread. torch's count is put back afterwards, or every later torch op would run on another
    number of threads (and sum in another order: a run would not repeat itself bit for bit).
    """
    import torch

    threads = torch.get_num_threads()
    parallel = _FORCE == 0 or (_FORCE is None and threads > 1 and values >= PARALLEL_MIN)
    if not parallel:
        yield 1
        return
    with _LOCK:
        try:
            numba.set_num_threads(max(1, min(numba.config.NUMBA_NUM_THREADS, threads)))
            yield 0
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)


_FORCE: int | None = None  # 0 or 1: run that twin whatever the bucket (fused.warm_up compiles both)


def quantize(
    table: Any,
    msgs: np.ndarray,
    columns: np.ndarray,
    *,
    grad: np.ndarray | None = None,
    received: np.ndarray | None = None,
    vals: np.ndarray | None = None,
    ef: bool = True,
) -> None:
    """Fill ``msgs`` (uint8, one row per message, its scales first) from ``grad`` (or the ``received`` messages).

    ``table``: a :class:`~dask_dl.train.compression.plan.TaskTable`. ``columns[m]``: the number of groups in
    message ``m`` (its header holds ``8 * columns[m]`` bytes of float32 scales).
    """
    if (ef or received is not None) and (vals is None or (grad is not None and len(vals) != len(grad))):
        raise ValueError("error feedback and the server side need ``vals``, a float32 array as long as the bucket")
    tasks = table.rows
    width = 2 * max(int(columns.max(initial=0)), 1)
    scales = _scratch(table, "scales", (msgs.shape[0], width), np.float32)
    heads = _scratch(table, "heads", (len(tasks),), np.uint8)
    tails = _scratch(table, "tails", (len(tasks),), np.uint8)
    psp = _scratch(table, "psp", (table.n_partials,), np.float64)
    psn = _scratch(table, "psn", (table.n_partials,), np.float64)
    pcp = _scratch(table, "pcp", (table.n_partials,), np.float64)
    nothing = _scratch(table, "nothing", (1,), np.float32)
    grad = nothing if grad is None else grad
    vals = nothing if vals is None else vals
    if received is None:
        mode, received = 0, _scratch(table, "received", (0, 1), np.uint8)
        mp_in = mn_in = _scratch(table, "means", (0, 1), np.float32)
    else:
        mode = 1
        mp_in, mn_in = header_means(received, columns[:1].repeat(len(received)), table, "received")
    msgs.fill(0)  # signs are OR-ed in where two tasks share a byte
    with _kernels(table.values) as k:
        QUANTIZE_TASKS[k](
            mode, grad, received, mp_in, mn_in, vals, ef, tasks, msgs, scales, heads, tails, psp, psn, pcp
        )
        if len(table.reductions):
            REDUCE_COLUMNS[k](table.reductions, psp, psn, pcp, scales)
            SIGN_BANDS[k](mode, grad, vals, ef, tasks, msgs, scales, heads, tails)
    or_sides(tasks, msgs, heads, tails)
    for m in range(msgs.shape[0]):
        k = int(columns[m])
        msgs[m, : 8 * k] = scales[m, : 2 * k].view(np.uint8)


def _scratch(table: Any, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """The zeroed array ``name`` of ``shape`` kept in ``table.scratch`` (made at the first call, cleared after).

    Safe to share between calls: a table is run by one call at a time (each bucket has its own tables, and DDP
    waits for every bucket's future before the next step), and the arrays never leave the call.
    """
    kept = table.scratch.get(name)
    if kept is None or kept.shape != shape or kept.dtype != dtype:
        kept = table.scratch[name] = np.zeros(shape, dtype=dtype)
        return kept
    kept.fill(0)
    return kept


def header_means(msgs: np.ndarray, columns: np.ndarray, table: Any, use: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``(rows, max(columns))`` twice: the two means of each column, from each message's header (kept in
    ``table``'s scratch under ``use``)."""
    width = max(int(columns.max(initial=0)), 1)
    mp = _scratch(table, f"{use} mp", (msgs.shape[0], width), np.float32)
    mn = _scratch(table, f"{use} mn", (msgs.shape[0], width), np.float32)
    for r in range(msgs.shape[0]):
        k = int(columns[r])
        pairs = msgs[r, : 8 * k].view(np.float32).reshape(k, 2)
        mp[r, :k], mn[r, :k] = pairs[:, 0], pairs[:, 1]
    return mp, mn


def decode(table: Any, msgs: np.ndarray, columns: np.ndarray, out: np.ndarray, *, average: bool) -> None:
    """Write the bucket ``out`` from ``msgs``: their mean (``average``), or each task's entries from its row
    (stored past the caches when ``out`` holds at least ``STREAM_BYTES``)."""
    mp, mn = header_means(msgs, columns, table, "decode")
    with _kernels(table.values) as k:
        DECODE_TASKS[k](msgs, mp, mn, table.rows, average, out, out.nbytes >= STREAM_BYTES)
