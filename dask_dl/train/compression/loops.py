"""The numba bodies of the 1-bit kernels (:mod:`dask_dl.train.compression.kernels` calls them): loops over a
task table, each compiled twice.

Work is described by a *task table* (:mod:`dask_dl.train.compression.plan` builds it): each row is a run of
quantization groups of one parameter and where their signs and scales go in a message. Rows run in parallel
(``prange``); a sign byte shared by two rows (when a row's signs do not end on a byte boundary) is stored by the
row that completes it, the other's bits collected apart and OR-ed in afterwards, so no two threads write one byte.

The inner loops over values are vector loops (:mod:`dask_dl.train.compression.simd`, 16 values and two sign
bytes per step, shifted into place wherever the signs start in a byte). The decode does the ragged ends of runs
that do not start or end on a sign byte value by value.

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

STREAM_MIN = 256  # values in a decoded run from which its stores bypass the caches (see _decode_run)


# Loops index slices from 0 (``for j in range(n): a[j]``): numba then knows no index is negative and skips
# its wrap-around check, which otherwise stops LLVM from vectorizing (2-3x slower).


@njit(cache=True, inline="always")
def _unpack(row, bit0, length, bits):
    """``bits[e]`` = sign bit ``bit0 + e`` of the message ``row`` (uint8), for ``e < length``."""
    e = 0
    while e < length and ((bit0 + e) & 7) != 0:
        b = bit0 + e
        bits[e] = (row[b >> 3] >> (b & 7)) & 1
        e += 1
    full = (length - e) >> 3
    src = row[(bit0 + e) >> 3 : ((bit0 + e) >> 3) + full]
    dst = bits[e : e + 8 * full]
    for i in range(full):
        v = src[i]
        for lane in range(8):
            dst[8 * i + lane] = (v >> lane) & 1
    e += 8 * full
    while e < length:
        b = bit0 + e
        bits[e] = (row[b >> 3] >> (b & 7)) & 1
        e += 1


@njit(cache=True, inline="always")
def _mean_run(msgs, mp, mn, r0, r1, inv_n, col, per_column, bit0, out, bits, acc):
    """``out[e]`` = the mean over messages ``r0:r1`` of their entry at sign bit ``bit0 + e`` (summed in float64
    in message order, times ``inv_n``), of column ``col`` (``col + e`` when ``per_column``). ``bits`` and ``acc``
    are scratch at least as long as ``out``."""
    length = out.shape[0]
    for r in range(r0, r1):
        _unpack(msgs[r], bit0, length, bits)
        if per_column:
            pos, neg = mp[r, col : col + length], mn[r, col : col + length]
            if r == r0:
                for j in range(length):
                    acc[j] = pos[j] if bits[j] else neg[j]
            else:
                for j in range(length):
                    acc[j] += pos[j] if bits[j] else neg[j]
        else:
            p, q = np.float64(mp[r, col]), np.float64(mn[r, col])
            if r == r0:
                for j in range(length):
                    acc[j] = p if bits[j] else q
            else:
                for j in range(length):
                    acc[j] += p if bits[j] else q
    for j in range(length):
        out[j] = np.float32(acc[j] * inv_n)


@njit(cache=True, inline="always")
def _means(sp, sn, cp, length):
    mp = np.float32(sp / cp) if cp > 0 else np.float32(0.0)
    mn = np.float32(sn / (length - cp)) if length - cp > 0 else np.float32(0.0)
    return mp, mn


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


@njit(cache=True, inline="always")
def _decode_run(msgs, mp, mn, r0, r1, inv_n, col, per_column, bit0, out, bits, acc, streamable):
    """:func:`_mean_run` with whole sign bytes decoded 16 values at a time (same sums, same order).

    A long ``streamable`` run (one not read again soon: a decoded bucket larger than the cache) starts its vector
    part on a 64-byte boundary where that is also a sign byte's (always, for ``onebit``'s message of a 64-byte
    aligned bucket), and is stored past the caches; the caller then runs ``simd.fence``.
    """
    length = out.shape[0]
    e = min((8 - (bit0 & 7)) & 7, length)
    stream = False
    if streamable and length >= STREAM_MIN:
        address = simd.address(out, 0)
        if address & 3 == 0:
            skip = ((64 - (address & 63)) & 63) >> 2
            if (bit0 + skip) & 7 == 0:
                e, stream = skip, True
    if e > 0:
        _mean_run(msgs, mp, mn, r0, r1, inv_n, col, per_column, bit0, out[:e], bits, acc)
    k = (length - e) // W
    if k > 0:
        byte = (bit0 + e) >> 3
        if per_column and stream:
            simd.column_decode_stream(msgs, r0, r1, byte, k, mp, mn, col + e, inv_n, out, e)
        elif per_column:
            simd.column_decode(msgs, r0, r1, byte, k, mp, mn, col + e, inv_n, out, e)
        elif stream:
            simd.decode_stream(msgs, r0, r1, byte, k, mp, mn, col, inv_n, out, e)
        else:
            simd.decode(msgs, r0, r1, byte, k, mp, mn, col, inv_n, out, e)
    done = e + W * k
    if done < length:
        c = col + done if per_column else col
        _mean_run(msgs, mp, mn, r0, r1, inv_n, c, per_column, bit0 + done, out[done:], bits, acc)


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

    Summing a group and then signing it and writing its errors, in two sweeps, took 1.4x the time of adding a
    4096x6400 layer's gradient to its residual; one sweep takes 1.15x (the server side's, which reads no
    gradient, 1.0x against 1.55x in three).
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
        mps, mns = np.empty(width, dtype=np.float32), np.empty(width, dtype=np.float32)
        for j in range(width):
            mps[j], mns[j] = scales[m, 2 * (dcol + j)], scales[m, 2 * (dcol + j) + 1]
        psp[p : p + width] = 0.0
        psn[p : p + width] = 0.0
        pcp[p : p + width] = 0.0
        carry = 0  # the signs of a byte begun and not yet completed (units follow each other in the message)
        for q in range(t0, t1):
            if tr:  # group ``q``
                base, length, bit0, col = s + q * rest, rest, dbit + (q - lo) * rest, dcol + q - lo
                mp0, mn0 = scales[m, 2 * col], scales[m, 2 * col + 1]  # what the group owes (with ``ef``)
                # arguments written out: no helper taking arrays is called on this path, nor a tuple of arrays
                # made (numba increfs and decrefs each array an inlined helper takes or a tuple holds: 20 atomic
                # calls a group, 10% of the time; a tuple of the call's arguments cost 10% more)
                sp, sn, cp, carry = simd.sweep(
                    mode == 1, ef, vals, grad, base, length, received, 0, n_in, bit0, mp_in, mn_in, col, inv_n,
                    mp0, mn0, msgs, m, carry,
                )  # fmt: skip
                scales[m, 2 * col], scales[m, 2 * col + 1] = _means(sp, sn, cp, rest)
            else:  # row ``q`` of the band, its columns' means owed (no sums: the band sums its columns below)
                base, bit0 = s + q * rest + lo, dbit + q * pitch
                _, _, _, carry = simd.sweep(
                    mode == 1, ef, vals, grad, base, pitch, received, 0, n_in, bit0, mp_in, mn_in, dcol, inv_n,
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
        pitch, m, dcol = tasks[t, PITCH], tasks[t, M], tasks[t, DCOL]
        if tr:
            for g in range(t0, t1):
                col = dcol + g - lo
                mp, mn = scales[m, 2 * col], scales[m, 2 * col + 1]
                v = vals[s + g * rest : s + (g + 1) * rest]
                for j in range(rest):
                    x = v[j]
                    v[j] = x - (mp if x >= 0 else mn)
        else:
            mps, mns = np.empty(pitch, dtype=np.float32), np.empty(pitch, dtype=np.float32)
            for j in range(pitch):
                mps[j], mns[j] = scales[m, 2 * (dcol + j)], scales[m, 2 * (dcol + j) + 1]
            for i in range(t0, t1):
                v = vals[s + i * rest + lo : s + i * rest + lo + pitch]
                for j in range(pitch):
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
    With ``stream``, long runs are stored past the caches (see ``kernels.decode``)."""
    n = msgs.shape[0]
    for t in prange(tasks.shape[0]):
        s, rest, tr = tasks[t, S], tasks[t, REST], tasks[t, TR]
        t0, t1, lo, pitch, m = tasks[t, T0], tasks[t, T1], tasks[t, LO], tasks[t, PITCH], tasks[t, M]
        dbit, dcol = tasks[t, DBIT], tasks[t, DCOL]
        r0, r1, inv_n = (0, n, 1.0 / n) if average else (m, m + 1, 1.0)
        bits = np.empty(W, dtype=np.uint8)
        acc = np.empty(W)
        if tr:
            for g in range(t0, t1):
                base, bit0 = s + g * rest, dbit + (g - lo) * rest
                o = out[base : base + rest]
                _decode_run(msgs, mp, mn, r0, r1, inv_n, dcol + g - lo, False, bit0, o, bits, acc, stream)
        else:
            for i in range(t0, t1):
                base, bit0 = s + i * rest + lo, dbit + i * pitch
                o = out[base : base + pitch]
                _decode_run(msgs, mp, mn, r0, r1, inv_n, dcol, True, bit0, o, bits, acc, stream)
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
