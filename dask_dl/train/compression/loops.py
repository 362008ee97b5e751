"""The numba bodies of the 1-bit kernels (:mod:`dask_dl.train.compression.kernels` calls them): loops over a
task table, each compiled twice.

Work is described by a *task table* (:mod:`dask_dl.train.compression.plan` builds it): each row is a run of
quantization groups of one parameter and where their signs and scales go in a message. Rows run in parallel
(``prange``); sign bytes shared by two rows (when a row's signs do not start or end on a byte boundary) are
collected apart and OR-ed in afterwards, so no two threads write one byte.

The inner loops over values are vector loops (:mod:`dask_dl.train.compression.simd`, 16 values and two sign
bytes per step); the ragged ends of runs that do not start or end on a sign byte are done value by value.

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
    HEAD,
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


@njit(cache=True, inline="always")
def _put(msgs, m, byte, value, head, tail, heads, tails, t):
    """OR a sign byte into message ``m``; a byte shared with another task goes to that task's side slot."""
    if byte == head:
        heads[t] |= value
    elif byte == tail:
        tails[t] |= value
    else:
        msgs[m, byte] |= value


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
def _pack(bits, length, bit0, msgs, m, head, tail, heads, tails, t):
    """Pack ``bits[:length]`` into message ``m`` from sign bit ``bit0``: whole bytes written, partial ones OR-ed."""
    e = 0
    acc = 0
    while e < length and ((bit0 + e) & 7) != 0:
        acc |= bits[e] << ((bit0 + e) & 7)
        e += 1
    if e > 0:
        _put(msgs, m, bit0 >> 3, np.uint8(acc), head, tail, heads, tails, t)
    full = (length - e) >> 3
    dst = msgs[m, (bit0 + e) >> 3 : ((bit0 + e) >> 3) + full]
    src = bits[e : e + 8 * full]
    for i in range(full):
        dst[i] = (
            src[8 * i]
            | (src[8 * i + 1] << 1)
            | (src[8 * i + 2] << 2)
            | (src[8 * i + 3] << 3)
            | (src[8 * i + 4] << 4)
            | (src[8 * i + 5] << 5)
            | (src[8 * i + 6] << 6)
            | (src[8 * i + 7] << 7)
        )
    e += 8 * full
    if e < length:
        acc = 0
        while e < length:
            acc |= bits[e] << ((bit0 + e) & 7)
            e += 1
        _put(msgs, m, (bit0 + length - 1) >> 3, np.uint8(acc), head, tail, heads, tails, t)


@njit(cache=True, inline="always")
def _mean_run(msgs, mp, mn, r0, r1, inv_n, col, per_column, bit0, out, add, bits, acc):
    """``out[e]`` = the mean over messages ``r0:r1`` of their entry at sign bit ``bit0 + e`` (summed in float64
    in message order, times ``inv_n``), of column ``col`` (``col + e`` when ``per_column``); plus ``out[e]`` in
    float32 when ``add``. ``bits`` and ``acc`` are scratch at least as long as ``out``."""
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
    if add:
        for j in range(length):
            out[j] = np.float32(acc[j] * inv_n) + out[j]
    else:
        for j in range(length):
            out[j] = np.float32(acc[j] * inv_n)


@njit(cache=True, inline="always")
def _signs(src, mps, mns, ef, bits):
    """``bits[e]`` = ``src[e] >= 0``; with ``ef`` the entry becomes its error (minus its column's mean)."""
    if ef:
        for j in range(src.shape[0]):
            x = src[j]
            pos = x >= 0
            bits[j] = pos
            src[j] = x - (mps[j] if pos else mns[j])
    else:
        for j in range(src.shape[0]):
            bits[j] = src[j] >= 0


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
def _band_sums(vals, grad, base, stride, rows, pitch, add, psp, psn, pcp, p):
    """Add the columns of the block of ``rows`` rows of ``pitch`` values from ``vals[base]``, ``stride`` apart
    (plus ``grad``'s, stored, with ``add``), to their float64 partial sums ``psp/psn/pcp[p:p + pitch]``: each
    column summed down the block in row order from 0.0, then added (a band's sums are those of its blocks of 16
    rows, in order). With ``add`` the rows are added first, each in memory order (``simd.band_sums``)."""
    if add:
        for i in range(rows):
            row = base + i * stride
            _add(vals[row : row + pitch], grad[row : row + pitch])
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
def _column_sign_run(v, mps, mns, ef, bit0, msgs, m, head, tail, heads, tails, t, bits):
    """Signs (and with ``ef`` errors) of the row ``v`` of a band into message ``m`` from sign bit ``bit0``, entry
    ``j`` in a column of means ``mps[j]``, ``mns[j]``: whole bytes 16 values at a time, the ragged ends packed
    bit by bit."""
    length = v.shape[0]
    e = min((8 - (bit0 & 7)) & 7, length)
    if e > 0:
        _signs(v[:e], mps, mns, ef, bits)
        _pack(bits, e, bit0, msgs, m, head, tail, heads, tails, t)
    k = (length - e) // W
    if k > 0:
        row, byte = msgs[m], (bit0 + e) >> 3
        if ef:
            simd.column_signs_error(v, e, k, mps, mns, e, row, byte)
        else:
            simd.column_signs(v, e, k, mps, mns, e, row, byte)
    done = e + W * k
    if done < length:
        _signs(v[done:], mps[done:], mns[done:], ef, bits)
        _pack(bits, length - done, bit0 + done, msgs, m, head, tail, heads, tails, t)


@njit(cache=True, inline="always")
def _decode_run(msgs, mp, mn, r0, r1, inv_n, col, per_column, bit0, out, add, bits, acc, streamable):
    """:func:`_mean_run` with whole sign bytes decoded 16 values at a time (same sums, same order).

    A long ``streamable`` run (one written, not added to, and not read again soon: a decoded bucket larger than
    the cache) starts its vector part on a 64-byte boundary where that is also a sign byte's (always, for
    ``onebit``'s message of a 64-byte aligned bucket), and is stored past the caches; the caller then runs
    ``simd.fence``.

    ``add`` only ``per_column`` (the server side's bands; its row groups are decoded inside their sweep).
    """
    length = out.shape[0]
    e = min((8 - (bit0 & 7)) & 7, length)
    stream = False
    if streamable and not add and length >= STREAM_MIN:
        address = simd.address(out, 0)
        if address & 3 == 0:
            skip = ((64 - (address & 63)) & 63) >> 2
            if (bit0 + skip) & 7 == 0:
                e, stream = skip, True
    if e > 0:
        _mean_run(msgs, mp, mn, r0, r1, inv_n, col, per_column, bit0, out[:e], add, bits, acc)
    k = (length - e) // W
    if k > 0:
        byte = (bit0 + e) >> 3
        if per_column and add:
            simd.column_decode_add(msgs, r0, r1, byte, k, mp, mn, col + e, inv_n, out, e)
        elif per_column and stream:
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
        _mean_run(msgs, mp, mn, r0, r1, inv_n, c, per_column, bit0 + done, out[done:], add, bits, acc)


@njit(cache=True, nogil=True)
def or_sides(tasks, msgs, heads, tails):
    """OR the side slots into their messages' shared sign bytes, one task after another (a compiled loop:
    ``np.bitwise_or.at`` costs about 0.4 us a byte, 0.1 ms a call on a bucket of 260 tasks)."""
    for t in range(tasks.shape[0]):
        m = tasks[t, M]
        if tasks[t, HEAD] >= 0:
            msgs[m, tasks[t, HEAD]] |= heads[t]
        if tasks[t, TAIL] >= 0:
            msgs[m, tasks[t, TAIL]] |= tails[t]


@njit(cache=True, nogil=True)
def finish(tasks, msgs, heads, tails, header, columns):
    """:func:`or_sides`, then each message's header: ``8 * columns[m]`` bytes of ``header[m]`` (its scales)."""
    or_sides(tasks, msgs, heads, tails)
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


def quantize_tasks(mode, grad, received, mp_in, mn_in, vals, ef, tasks, msgs, scales, heads, tails, psp, psn, pcp):
    """Phase one of quantizing: transposed groups completely (sums, scales, signs, residual); untransposed
    pieces' bands up to their partial column sums ``psp``/``psn``/``pcp``.

    Mode 0 quantizes ``grad`` plus the residual ``vals`` (when ``ef``); mode 1 the mean of the ``received``
    messages (same layout as the output; scales ``mp_in``/``mn_in``) plus the residual ``vals`` (when ``ef``;
    otherwise ``vals`` is scratch). ``scales``: the two means of each group, written here.

    A transposed group is read and written once (``simd.sweep``, the ragged ends value by value): the
    gradient's entries (mode 0) or the received mean's, plus with ``ef`` the error ``vals`` owes, summed, signed
    and stored into ``vals``. Sums: the 16 lanes of the whole sign bytes, then the ragged head and tail in order
    (a fixed order for a group, whoever runs it). With ``ef`` its entries are left as they
    were quantized, ``x``, owing their error ``x - (mp if x >= 0 else mn)`` against the means this call writes
    into ``scales``; the next call reads those means back and takes the error in the same sweep (zeros owe
    nothing), or :func:`settle_tasks` writes it. Summing a group and then signing it and writing its errors,
    in two sweeps, took 1.4x the time of adding a 4096x6400 layer's gradient to its residual; one sweep takes
    1.15x (the server side's, which reads no gradient, 1.0x against 1.55x in three). Untransposed pieces'
    entries to quantize are left in ``vals`` (with ``ef`` or in mode 1) for phase two; with ``ef`` a finished
    one is replaced by its error.
    """
    n_in = received.shape[0]
    inv_n = 1.0 / max(n_in, 1)
    src = vals if ef or mode == 1 else grad  # the values quantized (and, with ``ef``, their errors)
    for t in prange(tasks.shape[0]):
        s, rest, tr = tasks[t, S], tasks[t, REST], tasks[t, TR]
        t0, t1, lo, pitch, m = tasks[t, T0], tasks[t, T1], tasks[t, LO], tasks[t, PITCH], tasks[t, M]
        dbit, dcol, head, tail = tasks[t, DBIT], tasks[t, DCOL], tasks[t, HEAD], tasks[t, TAIL]
        heads[t], tails[t] = 0, 0  # each task's own side slots (and partial sums, below): cleared here
        if tr:  # each group is a contiguous row of ``rest`` entries, quantized in one sweep
            for g in range(t0, t1):
                base, bit0, col = s + g * rest, dbit + (g - lo) * rest, dcol + g - lo
                mp0, mn0 = scales[m, 2 * col], scales[m, 2 * col + 1]  # what ``vals`` owes (with ``ef``)
                # the whole sign bytes 16 values at a time; no helper taking arrays is called on this path (an
                # inlined one increfs and decrefs each array it takes: 20 atomic calls a group, 10% of the time)
                e = min((8 - (bit0 & 7)) & 7, rest)
                k = (rest - e) // W
                v0, byte = base + e, (bit0 + e) >> 3
                args = (received, 0, n_in, byte, mp_in, mn_in, col, inv_n, mp0, mn0, msgs, m, byte)
                if mode == 1 and ef:
                    sp, sn, cp = simd.sweep_received_owed(vals, grad, v0, k, *args)
                elif mode == 1:
                    sp, sn, cp = simd.sweep_received(vals, grad, v0, k, *args)
                elif ef:
                    sp, sn, cp = simd.sweep_owed(vals, grad, v0, k, *args)
                else:
                    sp, sn, cp = simd.sweep(vals, grad, v0, k, *args)
                # the ragged head (before the first whole sign byte) and tail, value by value in the same float32
                # operations, written out here for the same reason: in bucket layouts where a small parameter
                # comes first (14 labels' biases) every group has both
                done = e + W * k
                for part in range(2):
                    j0, j1, b0 = (base, v0, bit0) if part == 0 else (base + done, base + rest, bit0 + done)
                    signs = 0
                    for j in range(j0, j1):
                        bit = b0 + j - j0
                        if mode == 1:  # the mean of the received entries, summed in float64 in message order
                            total = 0.0
                            for r in range(n_in):
                                on = (received[r, bit >> 3] >> (bit & 7)) & 1
                                mean = np.float64(mp_in[r, col] if on else mn_in[r, col])
                                total = mean if r == 0 else total + mean
                            z = np.float32(total * inv_n)
                        else:
                            z = grad[j]
                        y = z
                        if ef:
                            x = vals[j]
                            error = x - (mp0 if x >= 0 else mn0)
                            y = z + error if mode == 1 else error + z
                            vals[j] = y
                        if y >= 0:
                            sp += np.float64(y)
                            cp += 1.0
                            signs |= 1 << (bit & 7)
                        else:
                            sn += np.float64(y)
                        # a byte's last sign of this run: OR it in (``_put`` written out: calling it here made
                        # DDP's first AlexNet bucket, every group ragged, 4% slower)
                        if (bit & 7) == 7 or j == j1 - 1:
                            packed, at = np.uint8(signs), bit >> 3
                            if at == head:
                                heads[t] |= packed
                            elif at == tail:
                                tails[t] |= packed
                            else:
                                msgs[m, at] |= packed
                            signs = 0
                scales[m, 2 * col], scales[m, 2 * col + 1] = _means(sp, sn, cp, rest)
        else:  # a band of rows t0:t1 of columns lo:lo+pitch: partial sums per column
            bits = np.empty(W, dtype=np.uint8)
            acc = np.empty(W)
            p = tasks[t, P]
            psp[p : p + pitch] = 0.0
            psn[p : p + pitch] = 0.0
            pcp[p : p + pitch] = 0.0
            for i0 in range(t0, t1, W):  # blocks of 16 rows: summed in registers, then added to the band's sums
                i1 = min(t1, i0 + W)
                if mode == 1:  # decode the block's rows, then sum them while they are in cache
                    for i in range(i0, i1):
                        base, bit0 = s + i * rest + lo, dbit + i * pitch
                        v = src[base : base + pitch]
                        _decode_run(received, mp_in, mn_in, 0, n_in, inv_n, dcol, True, bit0, v, ef, bits, acc, False)
                _band_sums(src, grad, s + i0 * rest + lo, rest, i1 - i0, pitch, ef and mode == 0, psp, psn, pcp, p)


def settle_tasks(tasks, vals, scales):
    """Write the errors ``vals`` owes after :func:`quantize_tasks` with ``ef``: each transposed group's entries
    ``x`` become ``x - (mp if x >= 0 else mn)``, its two means read from ``scales``."""
    for t in prange(tasks.shape[0]):
        if not tasks[t, TR]:
            continue
        s, rest, t0, t1, lo = tasks[t, S], tasks[t, REST], tasks[t, T0], tasks[t, T1], tasks[t, LO]
        m, dcol = tasks[t, M], tasks[t, DCOL]
        for g in range(t0, t1):
            col = dcol + g - lo
            mp, mn = scales[m, 2 * col], scales[m, 2 * col + 1]
            v = vals[s + g * rest : s + (g + 1) * rest]
            for j in range(rest):
                x = v[j]
                v[j] = x - (mp if x >= 0 else mn)


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


def sign_bands(mode, grad, vals, ef, tasks, msgs, scales, heads, tails):
    """Phase three: the signs and errors of the untransposed pieces' bands."""
    store = ef or mode == 1
    for t in prange(tasks.shape[0]):
        if tasks[t, TR]:
            continue
        s, rest, t0, t1, lo = tasks[t, S], tasks[t, REST], tasks[t, T0], tasks[t, T1], tasks[t, LO]
        pitch, m, dbit, dcol = tasks[t, PITCH], tasks[t, M], tasks[t, DBIT], tasks[t, DCOL]
        head, tail = tasks[t, HEAD], tasks[t, TAIL]
        mps = scales[m, 2 * dcol : 2 * (dcol + pitch) : 2].copy()
        mns = scales[m, 2 * dcol + 1 : 2 * (dcol + pitch) : 2].copy()
        bits = np.empty(W, dtype=np.uint8)
        for i in range(t0, t1):
            base, bit0 = s + i * rest + lo, dbit + i * pitch
            v = vals[base : base + pitch] if store else grad[base : base + pitch]
            _column_sign_run(v, mps, mns, ef, bit0, msgs, m, head, tail, heads, tails, t, bits)


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
                _decode_run(msgs, mp, mn, r0, r1, inv_n, dcol + g - lo, False, bit0, o, False, bits, acc, stream)
        else:
            for i in range(t0, t1):
                base, bit0 = s + i * rest + lo, dbit + i * pitch
                o = out[base : base + pitch]
                _decode_run(msgs, mp, mn, r0, r1, inv_n, dcol, True, bit0, o, False, bits, acc, stream)
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
SIGN_BANDS = _twins(sign_bands)
DECODE_TASKS = _twins(decode_tasks)
