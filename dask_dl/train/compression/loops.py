"""The numba bodies of the 1-bit kernels (:mod:`dask_dl.train.compression.kernels` calls them): loops over a
task table, each compiled twice.

Work is described by a *task table* (:mod:`dask_dl.train.compression.plan` builds it): each row is a run of
quantization groups of one parameter and where their signs and scales go in a message. Rows run in parallel
(``prange``); a sign byte shared by two rows (when a row's signs do not end on a byte boundary) is stored by the
row that completes it, the other's bits collected apart and OR-ed in afterwards, so no two threads write one byte.

The inner loops over values are vector loops (:mod:`dask_dl.train.compression.simd`, 16 values and two sign
bytes per step, shifted into place wherever the signs start in a byte; a run's last 1-15 values are one partial
step).

The kernels release the GIL (``nogil``): DDP runs hooks and their callbacks on different threads, and a decode in
a collective's callback (on gloo's thread) would otherwise keep the trainer's thread from returning to Python,
out of a collective that has finished or into the next hook, until the decode ends. Each kernel is compiled as a
parallel twin (``prange`` on numba's threads, which :mod:`~dask_dl.train.compression.kernels` runs under a lock)
and a serial one.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import njit, prange

from dask_dl.train.compression import simd
from dask_dl.train.compression.plan import (  # the columns of the tables the kernels run (plan fills them)
    DBIT,
    DCOL,
    LO,
    PITCH,
    R_BANDS,
    R_DCOL,
    R_M,
    R_OUT,
    R_P,
    R_PITCH,
    REST,
    T0,
    T1,
    TAIL,
    TR,
    M,
    P,
    S,
)
from dask_dl.train.compression.simd import W

STREAM_MIN = 256  # values in a decoded run from which its stores bypass the caches (see decode_tasks)

# Loops index slices from 0 (``for j in range(n): a[j]``): numba then knows no index is negative and skips
# its wrap-around check, which otherwise stops LLVM from vectorizing (2-3x slower).


@njit(cache=True, inline="always")
def _means(sp, sn, cp, length):
    mp = np.float32(sp / cp) if cp > 0 else np.float32(0.0)
    mn = np.float32(sn / (length - cp)) if length - cp > 0 else np.float32(0.0)
    return mp, mn


@njit(cache=True, inline="always")
def _unit(tr, q, s, rest, lo, pitch, dbit, dcol):
    """Where unit ``q`` of a task is: a transposed task's group ``q`` (a contiguous row of ``rest`` entries, one
    column), or row ``q`` of a band (``pitch`` entries, one in each of its columns from ``dcol``). Returns its
    first entry, its length, its first sign bit and its (first) column. Scalars only: no array to incref."""
    if tr:
        return s + q * rest, rest, dbit + (q - lo) * rest, dcol + q - lo
    return s + q * rest + lo, pitch, dbit + q * pitch, dcol


@njit(cache=True, inline="always")
def _column_means(scales, m, dcol, width):
    """The two means of message ``m``'s columns ``dcol:dcol + width``, as two contiguous float32 arrays."""
    mps, mns = np.empty(width, dtype=np.float32), np.empty(width, dtype=np.float32)
    for j in range(width):
        mps[j], mns[j] = scales[m, 2 * (dcol + j)], scales[m, 2 * (dcol + j) + 1]
    return mps, mns


@njit(cache=True, inline="always")
def _add(target, source):
    for j in range(target.shape[0]):
        target[j] += source[j]


@njit(cache=True, inline="always")
def _band_sums(vals, base, stride, rows, pitch, psp, psn, pcp, p):
    """Add the columns of the block of ``rows`` rows of ``pitch`` values from ``vals[base]``, ``stride`` apart,
    to their float64 partial sums ``psp/psn/pcp[p:p + pitch]``: each column summed down the block in row order
    from 0.0, then added (a band's sums are those of its blocks of 16 rows, in order; ``simd.band_sums``)."""
    k = pitch // W
    simd.band_sums(vals, base, stride, rows, k, psp, psn, pcp, p)
    for j in range(W * k, pitch):
        sp, sn, cp = 0.0, 0.0, 0.0
        for i in range(rows):
            x = np.float64(vals[base + i * stride + j])
            if x >= 0:
                sp += x
                cp += 1.0
            else:
                sn += x
        psp[p + j] += sp
        psn[p + j] += sn
        pcp[p + j] += cp


@njit(cache=True, nogil=True)
def or_sides(tasks, msgs, tails):
    """OR the side slots into their messages' shared sign bytes, one task after another (a compiled loop:
    ``np.bitwise_or.at`` costs about 0.4 us a byte, 0.1 ms a call on a bucket of 260 tasks)."""
    for t in range(tasks.shape[0]):
        if tasks[t, TAIL] >= 0:
            msgs[tasks[t, M], tasks[t, TAIL]] |= tails[t]


@njit(cache=True, nogil=True)
def finish(tasks, msgs, tails, header, columns):
    """:func:`or_sides`, then each message's header: ``8 * columns[m]`` bytes of ``header[m]`` (its scales)."""
    or_sides(tasks, msgs, tails)
    for m in range(msgs.shape[0]):
        k = 8 * columns[m]
        msgs[m, :k] = header[m, :k]


@njit(cache=True, nogil=True)
def header_means(msgs, columns, pairs, mp, mn):
    """``mp[r, j]``, ``mn[r, j]``: the two means of column ``j`` in message ``r``'s header (float32 pairs; zero
    past ``columns[r]``). ``pairs``: float32 scratch of ``2 * mp.shape[1]``, through which the header's bytes are
    read (a message row need not start on a float's boundary)."""
    raw = pairs.view(np.uint8)
    for r in range(msgs.shape[0]):
        k = columns[r]
        raw[: 8 * k] = msgs[r, : 8 * k]
        for j in range(k):
            mp[r, j] = pairs[2 * j]
            mn[r, j] = pairs[2 * j + 1]
        mp[r, k:] = 0.0
        mn[r, k:] = 0.0


def quantize_tasks(mode, grad, received, mp_in, mn_in, vals, ef, tasks, msgs, scales, tails, psp, psn, pcp):
    """Phase one of quantizing: every value swept once, its sign written; each transposed group's scales, and
    the partial column sums ``psp``/``psn``/``pcp`` of the untransposed pieces' bands (phase two,
    :func:`reduce_columns`, adds those up into their columns' scales).

    Mode 0 quantizes ``grad`` plus the residual ``vals`` (when ``ef``); mode 1 the mean of the ``received``
    messages (same layout as the output; scales ``mp_in``/``mn_in``) plus the residual ``vals`` (when ``ef``;
    otherwise ``vals`` is scratch). ``scales``: the two means of each group, what ``vals`` owes against on the
    way in (with ``ef``; zeros owe nothing), the new ones on the way out.

    The unit of a sweep is a transposed group (a contiguous row of ``rest`` entries, one column) or a band's
    row (``pitch`` entries, one in each of its columns): its entries (the gradient's in mode 0, the received
    mean's in mode 1) plus, with ``ef``, the error ``x - (mp if x >= 0 else mn)`` that ``vals`` owes, are
    stored into ``vals``, signed and, for a group, summed (``simd.sweep``: 16 values at a time wherever the
    unit's signs start in a byte, its last 1-15 values as one partial step; a group's entry ``e`` is summed in
    lane ``e % 16``, a fixed order whoever runs it). A band sums its columns after each block of 16 rows, while
    they are in cache. With ``ef`` the entries are left as they were quantized, ``x``, owing their error
    against the means written into ``scales`` (by phase two for bands): the next call takes it in its sweep, or
    :func:`settle_tasks` writes it.

    A task's units follow each other in its message, so the sign bits a unit leaves in a byte it does not
    complete are carried to the next; each byte is stored by the task that completes it, and a task's last byte,
    when the next task completes it, goes to its side slot ``tails`` (OR-ed in by :func:`finish`).

    Why the error is owed: writing it needs the group's means, so a group summed in one sweep and signed in a
    second took 1.4x the time of adding a 4096x6400 layer's gradient to its residual; the one sweep takes 1.15x
    (the server side's, which reads no gradient, 1.0x).
    """
    n_in = received.shape[0]
    inv_n = 1.0 / max(n_in, 1)
    store = ef or mode == 1  # the values quantized are stored into ``vals`` (bands sum them from there)
    src = vals if store else grad
    for t in prange(tasks.shape[0]):
        s, rest, tr = tasks[t, S], tasks[t, REST], tasks[t, TR]
        t0, t1, lo, pitch, m = tasks[t, T0], tasks[t, T1], tasks[t, LO], tasks[t, PITCH], tasks[t, M]
        dbit, dcol, tail, p = tasks[t, DBIT], tasks[t, DCOL], tasks[t, TAIL], tasks[t, P]
        tails[t] = 0  # each task's own side slot (and partial sums): cleared here
        # a band's columns owe against their means, read before phase two replaces them (a group's: in its turn)
        width = 0 if tr else pitch
        mps, mns = _column_means(scales, m, dcol, width)
        psp[p : p + width] = 0.0
        psn[p : p + width] = 0.0
        pcp[p : p + width] = 0.0
        carry = 0  # the signs of a byte begun and not yet completed (units follow each other in the message)
        for q in range(t0, t1):
            base, length, bit0, col = _unit(tr, q, s, rest, lo, pitch, dbit, dcol)
            if tr:
                mp0, mn0 = scales[m, 2 * col], scales[m, 2 * col + 1]  # what the group owes (with ``ef``)
                # arguments written out: no helper taking arrays is called on this path, nor a tuple of arrays
                # made (numba increfs and decrefs each array an inlined helper takes or a tuple holds: 20 atomic
                # calls a group, 10% of the time; a tuple of the call's arguments cost 10% more)
                sp, sn, cp, carry = simd.sweep(
                    mode == 1, ef, vals, grad, base, length, received, 0, n_in, bit0, mp_in, mn_in, col, inv_n,
                    mp0, mn0, msgs, m, carry,
                )  # fmt: skip
                scales[m, 2 * col], scales[m, 2 * col + 1] = _means(sp, sn, cp, rest)
            else:  # a band's row, its columns' means owed (no sums: the band sums its columns below)
                _, _, _, carry = simd.sweep(
                    mode == 1, ef, vals, grad, base, length, received, 0, n_in, bit0, mp_in, mn_in, col, inv_n,
                    mps, mns, msgs, m, carry,
                )  # fmt: skip
                if (q - t0) % W == W - 1 or q == t1 - 1:  # a block of 16 rows swept: sum its columns while in cache
                    i0 = q - (q - t0) % W
                    _band_sums(src, s + i0 * rest + lo, rest, q + 1 - i0, pitch, psp, psn, pcp, p)
        if tail >= 0:  # the task's last byte, shared with the next task's first: OR-ed in by ``finish``
            tails[t] = carry


def settle_tasks(tasks, vals, scales):
    """Write the errors ``vals`` owes after :func:`quantize_tasks` with ``ef``: each entry ``x`` becomes ``x -
    (mp if x >= 0 else mn)``, the two means of its group (its column, in a band) read from ``scales``."""
    for t in prange(tasks.shape[0]):
        s, rest, tr, t0, t1, lo = tasks[t, S], tasks[t, REST], tasks[t, TR], tasks[t, T0], tasks[t, T1], tasks[t, LO]
        pitch, m, dbit, dcol = tasks[t, PITCH], tasks[t, M], tasks[t, DBIT], tasks[t, DCOL]
        mps, mns = _column_means(scales, m, dcol, 0 if tr else pitch)
        for q in range(t0, t1):
            base, length, _, col = _unit(tr, q, s, rest, lo, pitch, dbit, dcol)
            v = vals[base : base + length]
            if tr:
                mp, mn = scales[m, 2 * col], scales[m, 2 * col + 1]
                for j in range(length):
                    x = v[j]
                    v[j] = x - (mp if x >= 0 else mn)
            else:
                for j in range(length):
                    x = v[j]
                    v[j] = x - (mps[j] if x >= 0 else mns[j])


def reduce_columns(reductions, psp, psn, pcp, scales):
    """Phase two: add up each untransposed piece's band sums in band order; write its columns' scales."""
    for t in prange(reductions.shape[0]):
        p0, bands, pitch = reductions[t, R_P], reductions[t, R_BANDS], reductions[t, R_PITCH]
        m, dcol, length = reductions[t, R_M], reductions[t, R_DCOL], reductions[t, R_OUT]
        sp, sn, cp = np.zeros(pitch), np.zeros(pitch), np.zeros(pitch)
        for b in range(bands):
            start = p0 + b * pitch
            _add(sp, psp[start : start + pitch])
            _add(sn, psn[start : start + pitch])
            _add(cp, pcp[start : start + pitch])
        for j in range(pitch):
            scales[m, 2 * (dcol + j)], scales[m, 2 * (dcol + j) + 1] = _means(sp[j], sn[j], cp[j], length)


def decode_tasks(msgs, mp, mn, tasks, average, out, stream):
    """Write every task's entries into ``out``: the mean over all rows of ``msgs`` (``average``), or the
    entry of row ``M`` of the task (the owner of its stripe). ``mp``/``mn``: the two means per row and column.

    With ``stream``, long runs (``STREAM_MIN`` values or more: a decoded bucket larger than the cache, not read
    again soon) are stored past the caches from their first 64-byte boundary on (see ``kernels.decode``)."""
    n = msgs.shape[0]
    for t in prange(tasks.shape[0]):
        s, rest, tr = tasks[t, S], tasks[t, REST], tasks[t, TR]
        t0, t1, lo, pitch, m = tasks[t, T0], tasks[t, T1], tasks[t, LO], tasks[t, PITCH], tasks[t, M]
        dbit, dcol = tasks[t, DBIT], tasks[t, DCOL]
        r0, r1, inv_n = (0, n, 1.0 / n) if average else (m, m + 1, 1.0)
        for q in range(t0, t1):
            base, length, bit0, col = _unit(tr, q, s, rest, lo, pitch, dbit, dcol)
            skip = length  # entries before the first 64-byte boundary: stored normally (all of them unless streamed)
            if stream and length >= STREAM_MIN and simd.address(out, base) & 3 == 0:
                skip = min(((64 - (simd.address(out, base) & 63)) & 63) >> 2, length)
            # arguments written out, no slice of ``out`` made: numba increfs each array an inlined helper takes
            if not tr and skip > 0:
                simd.column_decode(msgs, r0, r1, bit0, skip, mp, mn, col, inv_n, out, base)
            elif skip > 0:
                simd.decode(msgs, r0, r1, bit0, skip, mp, mn, col, inv_n, out, base)
            c = col + skip if not tr else col
            if not tr and skip < length:
                simd.column_decode_stream(msgs, r0, r1, bit0 + skip, length - skip, mp, mn, c, inv_n, out, base + skip)
            elif skip < length:
                simd.decode_stream(msgs, r0, r1, bit0 + skip, length - skip, mp, mn, c, inv_n, out, base + skip)
        if stream:
            simd.fence()  # the runs stored past the caches reach memory before the bucket is handed back


def _outlined(namespace: dict[str, Any]) -> dict[str, Any]:
    """``namespace`` with each helper that numba inlines into its callers (``inline="always"``) replaced by a copy
    that it calls instead, under a name of its own in numba's cache. The parallel twins call these: inlining the
    helpers into ``prange`` loops nearly tripled their compile time (40 s of a cold 58 s) for no measured speed
    (``python bench/compile.py``)."""
    outlined = dict(namespace)
    for name, value in namespace.items():
        if isinstance(value, numba.core.registry.CPUDispatcher) and value.targetoptions.get("inline") == "always":
            copy = types.FunctionType(value.py_func.__code__, outlined, value.py_func.__name__ + "_outlined")
            copy.__qualname__ = value.py_func.__qualname__ + "_outlined"
            outlined[name] = njit(cache=True)(copy)
    return outlined


def _twins(function: Callable) -> tuple[Callable, Callable]:
    """A kernel compiled twice: with ``prange`` run by numba's threads (its helpers called, not inlined), and
    serially (no thread launch, which costs milliseconds on a busy machine: small buckets and one-thread workers
    run serially)."""
    parallel = types.FunctionType(function.__code__, _OUTLINED, function.__name__)
    parallel.__qualname__ = function.__qualname__
    serial = types.FunctionType(function.__code__, function.__globals__, function.__name__ + "_serial")
    serial.__qualname__ = function.__qualname__ + "_serial"  # its own entry in numba's cache
    return njit(cache=True, parallel=True, nogil=True)(parallel), njit(cache=True, nogil=True)(serial)


_OUTLINED = _outlined(globals())
QUANTIZE_TASKS = _twins(quantize_tasks)
SETTLE_TASKS = _twins(settle_tasks)
REDUCE_COLUMNS = _twins(reduce_columns)
DECODE_TASKS = _twins(decode_tasks)
