"""Vector loops for the 1-bit kernels, written as LLVM IR (numba intrinsics): 16 values per step.

numba's loops leave two things to LLVM's auto-vectorizer that it does not do: a float64 sum is a chain it may
not reorder (fastmath would change results), and packing comparisons into sign bytes is not a pattern it knows.
Here each loop is spelled with LLVM vector types, which LLVM lowers to whatever the CPU has (AVX-512, AVX2,
SSE, NEON) without reordering anything:

- sums of the entries ``>= 0``, of the others (float64, the negative side summed itself) and their count, in 16
  lanes (entry ``e`` of a run goes to lane ``e % 16``), the lanes added in order at the end: a fixed order, so
  results do not depend on how work is cut or on the CPU;
- signs (``x >= 0``: NaN on the negative side, zeros on the positive) packed 16 to two bytes, least significant
  bit first (the order of a comparison mask: packing is one move);
- the mean of ``N`` messages decoded into float32, summed in float64 in message order, one store per value; a
  single message (``onebit`` on one rank, the owner's stripe in ``onebit2``) in float32: a blend and a store;
- a group's quantize in one sweep (:func:`sweep`): the error its residual still owes from the last step,
  plus the gradient (or the decoded mean of the received messages), stored, summed and signed while in
  registers. The error ``x - mean`` of this step is left owed: the means come from the sums at the end. A band's
  row (an entry in each of its columns) is swept the same way, its columns summed afterwards (:func:`band_sums`).

Every loop covers ``count`` blocks of 16 values; callers do the ragged ends with scalar code in the same order.
numba's cache does not follow imports: a change here needs a change to ``loops.py`` (or a cleared cache).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

W = 16  # values per vector step: two bytes of signs
_I32, _I64 = ir.IntType(32), ir.IntType(64)
_F32, _F64 = ir.FloatType(), ir.DoubleType()
_VF, _VD = ir.VectorType(_F32, W), ir.VectorType(_F64, W)
_ZERO_D = ir.Constant(_VD, [0.0] * W)
_VI = ir.VectorType(_I32, W)
_ZERO_I = ir.Constant(_VI, [0] * W)
_C16 = ir.Constant(_I32, 16)
_I64_0 = ir.Constant(_I64, 0)
_ZERO_F = ir.Constant(_VF, [0.0] * W)
_MASK = ir.VectorType(ir.IntType(1), W)
_BYTES = ir.IntType(W)  # two sign bytes; bit k of a byte holds value 8*i + k (LSB first), as a mask bitcast


def _int(context, builder, value, ty):
    return context.cast(builder, value, ty, types.int64)


def _base(context, builder, aryty, ary, offset):
    """Pointer to element ``offset`` of a 1-D array (or of row 0 of a 2-D one)."""
    return builder.gep(context.make_array(aryty)(context, builder, ary).data, [offset])


def _row(context, builder, aryty, ary, row, offset):
    """Pointer to element ``offset`` of row ``row`` of a C-contiguous 2-D array."""
    a = context.make_array(aryty)(context, builder, ary)
    width = cgutils.unpack_tuple(builder, a.shape, 2)[1]
    return builder.gep(a.data, [builder.add(builder.mul(row, width), offset)])


def _load(builder, pointer, index, vty, align):
    return builder.load(builder.bitcast(builder.gep(pointer, [index]), vty.as_pointer()), align=align)


def _store(builder, value, pointer, index, align):
    builder.store(value, builder.bitcast(builder.gep(pointer, [index]), value.type.as_pointer()), align=align)


def _splat(builder, scalar, vty):
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(_I32, W), [0] * W))


def _steps(builder, count):
    """``for k in range(count)`` with ``W * k`` as the element offset of step ``k``."""
    return cgutils.for_range(builder, count)


def _sign_bytes(builder, mask):
    """The two sign bytes (as an i16 to store little-endian) of a 16-lane comparison."""
    return builder.bitcast(mask, _BYTES)


def _lanes_in_order(builder, vector):
    total = builder.extract_element(vector, ir.Constant(_I32, 0))
    for lane in range(1, W):
        total = builder.fadd(total, builder.extract_element(vector, ir.Constant(_I32, lane)))
    return total


def _accumulate(builder, x, accumulators, per_lane, valid=None):
    """Add the float64 of ``x``'s entries ``>= 0`` to the first of three accumulators, of the others to the
    second (two float64 vectors), and the count of the first to the third: a vector of 16 i32 ``per_lane``,
    else an i64 (a popcount of the comparison mask). ``valid``: the lanes that hold entries (all if None).

    A lane not added to keeps its value: a masked add, the same sum as adding 0.0 (accumulators start at +0.0).
    The negative side has a comparison of its own (``x < 0`` or NaN), so that it too is one masked add: selecting
    the sum where ``x >= 0`` fails compiled to an add and a masked move.
    """
    wide = builder.fpext(x, _VD)
    positive = builder.fcmp_ordered(">=", x, _ZERO_F)
    negative = builder.fcmp_unordered("<", x, _ZERO_F)
    if valid is not None:
        positive, negative = builder.and_(positive, valid), builder.and_(negative, valid)
    sp, sn, count = accumulators
    sp = builder.select(positive, builder.fadd(sp, wide), sp)
    sn = builder.select(negative, builder.fadd(sn, wide), sn)
    if per_lane:
        count = builder.sub(count, builder.sext(positive, _VI))  # true is -1
    else:
        ones = builder.call(builder.module.declare_intrinsic("llvm.ctpop", [_BYTES]), [_sign_bytes(builder, positive)])
        count = builder.add(count, builder.zext(ones, _I64))
    return [sp, sn, count]


def _at_most(builder, i: int, last):
    """``min(i, last)``, i64."""
    return builder.select(builder.icmp_unsigned("<", ir.Constant(_I64, i), last), ir.Constant(_I64, i), last)


class _Lanes:
    """How a block's 16 lanes read and write memory: all of them (``count`` None), or the first ``count`` (a
    run's last, partial block), the others reading the last entry again and writing nothing, so that no access
    leaves the run (element by element: it happens once a run)."""

    def __init__(self, builder, count=None):
        self.builder, self.count, self.valid = builder, count, None
        if count is not None:
            lanes = ir.Constant(ir.VectorType(_I64, W), list(range(W)))
            self.valid = builder.icmp_unsigned("<", lanes, _splat(builder, count, ir.VectorType(_I64, W)))
            self.index = [_at_most(builder, lane, builder.sub(count, ir.Constant(_I64, 1))) for lane in range(W)]

    def load(self, pointer, at):
        """The 16 float32 from ``pointer[at]``."""
        b = self.builder
        if self.count is None:
            return _load(b, pointer, at, _VF, 4)
        vector = ir.Constant(_VF, ir.Undefined)
        for lane, index in enumerate(self.index):
            value = b.load(b.gep(pointer, [b.add(at, index)]))
            vector = b.insert_element(vector, value, ir.Constant(_I32, lane))
        return vector

    def store(self, vector, pointer, at):
        """Store the lanes of ``vector`` from ``pointer[at]`` (the last lanes first: those past ``count`` write
        the last entry, which its own lane then writes)."""
        b = self.builder
        if self.count is None:
            _store(b, vector, pointer, at, 4)
            return
        for lane in reversed(range(W)):
            b.store(b.extract_element(vector, ir.Constant(_I32, lane)), b.gep(pointer, [b.add(at, self.index[lane])]))

    def signs(self, row, byte, shift):
        """The 16 sign bits from bit ``shift`` (0-7) of ``row[byte]`` (uint8), as a vector of i1."""
        b, window = self.builder, ir.Constant(_I32, 0)
        if self.count is None:  # two bytes, and a third only if the bits reach it
            pair = b.load(b.bitcast(b.gep(row, [byte]), _BYTES.as_pointer()), align=1)
            third = b.select(b.icmp_unsigned("!=", shift, _I64_0), ir.Constant(_I64, 2), _I64_0)
            window = b.or_(b.zext(pair, _I32), b.shl(b.zext(b.load(b.gep(row, [b.add(byte, third)])), _I32), _C16))
        else:  # the bytes the bits reach, the others read again
            last = b.lshr(b.add(b.add(shift, self.count), ir.Constant(_I64, 7)), ir.Constant(_I64, 3))
            last = b.sub(last, ir.Constant(_I64, 1))
            for i in range(3):
                at = _at_most(b, i, last)
                byte_i = b.zext(b.load(b.gep(row, [b.add(byte, at)])), _I32)
                window = b.or_(window, b.shl(byte_i, ir.Constant(_I32, 8 * i)))
        return b.bitcast(b.trunc(b.lshr(window, b.trunc(shift, _I32)), _BYTES), _MASK)


def _whole_then_partial(builder, n, blocks) -> None:
    """Emit ``blocks(count, first, lanes)`` for the ``n // 16`` whole blocks of a run, then, if ``n % 16``, for
    its last, partial one (:class:`_Lanes` of that many)."""
    whole, rest = builder.udiv(n, ir.Constant(_I64, W)), builder.urem(n, ir.Constant(_I64, W))
    blocks(whole, _I64_0, _Lanes(builder))
    with builder.if_then(builder.icmp_unsigned("!=", rest, _I64_0)):
        blocks(ir.Constant(_I64, 1), whole, _Lanes(builder, rest))


@intrinsic
def band_sums(typingctx, src, s0, stride, rows, count, psp, psn, pcp, p0):
    """``band_sums(src, s0, stride, rows, count, psp, psn, pcp, p0)``: the float64 sums of the columns of a band
    (``rows`` rows ``stride`` apart from ``src[s0]``, ``16 * count`` columns), each summed down its rows in order
    from 0.0 in registers, added to ``psp/psn/pcp[p0...]``.

    It only reads ``src``: a loop that also stored each value back (adding the gradient to the residual on the
    way) ran at a third of the speed of the two steps apart, the rows swept in memory order first
    (:func:`sweep`), then summed here while in cache.
    """

    def codegen(context, builder, sig, args):
        s0 = _int(context, builder, args[1], sig.args[1])
        src = _base(context, builder, sig.args[0], args[0], s0)
        stride, rows, count, p0 = (_int(context, builder, args[k], sig.args[k]) for k in (2, 3, 4, 8))
        partials = [_base(context, builder, sig.args[5 + k], args[5 + k], p0) for k in range(3)]
        zeros = (_ZERO_D, _ZERO_D, _ZERO_I)  # the sums, and the count of entries >= 0 in i32 lanes
        slots = [cgutils.alloca_once(builder, zero.type) for zero in zeros]
        with _steps(builder, count) as columns:
            column = builder.mul(columns.index, ir.Constant(_I64, W))
            for slot, zero in zip(slots, zeros, strict=True):
                builder.store(zero, slot)
            with cgutils.for_range(builder, rows) as row:
                x = _load(builder, src, builder.add(builder.mul(row.index, stride), column), _VF, 4)
                totals = _accumulate(builder, x, [builder.load(slot) for slot in slots], per_lane=True)
                for slot, total in zip(slots, totals, strict=True):
                    builder.store(total, slot)
            found = [builder.load(slot) for slot in slots]
            found[2] = builder.sitofp(found[2], _VD)  # exact
            for p, total in zip(partials, found, strict=True):
                _store(builder, builder.fadd(_load(builder, p, column, _VD, 8), total), p, column, 8)
        return context.get_dummy_value()

    return types.none(src, s0, stride, rows, count, psp, psn, pcp, p0), codegen


def _decoded_blocks(
    context, builder, sig, args, at: tuple[int, ...], count, body, per_column, shift, lanes, first
) -> None:
    """Emit ``for k in range(first, first + count): body(16 * k, k, value)``, ``value`` the 16 float32 entries
    from block ``k`` of the mean of ``N`` messages: float32(``inv_n`` * the float64 sum over rows ``r0:r1`` of
    ``msgs`` of the mean their sign bit picks), sign bits from ``8 * byte0 + shift`` (``shift``: 0-7).

    ``at``: the positions in ``args`` of ``msgs, r0, r1, byte0, mp, mn, col, inv_n``. The means:
    ``mp[r, col]``/``mn[r, col]``, or ``[r, col + e]`` ``per_column`` (2-D float32 arrays, C order). One row with
    ``inv_n == 1`` is decoded in float32 (the float64 round trip of one float32 mean is exact): the picked mean
    is a blend of two vectors; the choice is made once, outside the loop. ``lanes``: a :class:`_Lanes` (a
    partial block reads no sign bit or mean past its entries).
    """
    i_msgs, i_r0, i_r1, i_byte0, i_mp, i_mn, i_col, i_inv = at
    msgs_ty, mp_ty = sig.args[i_msgs], sig.args[i_mp]
    r0, r1, byte0, col = (_int(context, builder, args[k], sig.args[k]) for k in (i_r0, i_r1, i_byte0, i_col))
    inv_n = context.cast(builder, args[i_inv], sig.args[i_inv], types.float64)
    slot = cgutils.alloca_once_value(builder, _ZERO_D)
    one = ir.Constant(_I64, 1)

    def means(r, at, vty):
        """The two means of row ``r`` for the 16 values from ``at``, as vectors of ``vty``."""
        pointers = [_row(context, builder, mp_ty, args[k], r, col) for k in (i_mp, i_mn)]
        if per_column:
            loaded = [lanes.load(p, at) for p in pointers]
            return loaded if vty is _VF else [builder.fpext(v, _VD) for v in loaded]
        scalars = [builder.load(p) for p in pointers]
        if vty is _VD:
            scalars = [builder.fpext(v, _F64) for v in scalars]
        return [_splat(builder, v, vty) for v in scalars]

    def picked(r, at, vty):
        signs = _row(context, builder, msgs_ty, args[i_msgs], r, byte0)
        byte = builder.udiv(at, ir.Constant(_I64, 8))
        mask = lanes.signs(signs, byte, shift)
        return builder.select(mask, *means(r, at, vty))

    def blocks():
        with _steps(builder, count) as loop:
            k = builder.add(first, loop.index)
            yield builder.mul(k, ir.Constant(_I64, W)), k

    one_row = builder.icmp_signed("==", builder.sub(r1, r0), one)
    single = builder.and_(one_row, builder.fcmp_ordered("==", inv_n, ir.Constant(_F64, 1.0)))
    with builder.if_else(single) as (alone, several):
        with alone:
            for at, k in blocks():
                body(at, k, picked(r0, at, _VF))
        with several:
            scale = _splat(builder, inv_n, _VD)
            for at, k in blocks():
                builder.store(picked(r0, at, _VD), slot)  # the first row as it is (0.0 + -0.0 would be +0.0)
                with cgutils.for_range(builder, builder.sub(r1, builder.add(r0, one))) as rows:
                    r = builder.add(builder.add(r0, one), rows.index)
                    builder.store(builder.fadd(builder.load(slot), picked(r, at, _VD)), slot)
                body(at, k, builder.fptrunc(builder.fmul(builder.load(slot), scale), _VF))


def _make_decode(per_column: bool, stream: bool = False):
    """``decode(msgs, r0, r1, bit0, n, mp, mn, col, inv_n, out, o0)``: ``out[o0 + e]`` (``e < n``) = the mean of
    the messages' entries at sign bit ``bit0 + e`` (:func:`_decoded_blocks`), 16 at a time wherever they start in
    a byte, the last 1-15 as one partial step. With ``stream``, ``&out[o0]`` must be 64-byte aligned: the whole
    blocks are stored past the caches (non-temporal: a bucket is not read back soon, and the store does not read
    the line first); the caller then runs :func:`fence` before it hands the values on.
    """

    def codegen(context, builder, sig, args):
        n, bit0 = (_int(context, builder, args[k], sig.args[k]) for k in (4, 3))
        shift = builder.and_(bit0, ir.Constant(_I64, 7))
        out = _base(context, builder, sig.args[9], args[9], _int(context, builder, args[10], sig.args[10]))
        at = (0, 1, 2, 3, 5, 6, 7, 8)
        byte_args = _bytes_of(builder, args, 3)

        def blocks(count, first, lanes):
            def put(at, k, value):
                if stream and lanes.count is None:
                    target = builder.bitcast(builder.gep(out, [at]), _VF.as_pointer())
                    store = builder.store(value, target, align=64)
                    store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))
                else:
                    lanes.store(value, out, at)

            _decoded_blocks(context, builder, sig, byte_args, at, count, put, per_column, shift, lanes, first)

        _whole_then_partial(builder, n, blocks)
        return context.get_dummy_value()

    @intrinsic
    def decode(typingctx, msgs, r0, r1, bit0, n, mp, mn, col, inv_n, out, o0):
        return types.none(msgs, r0, r1, bit0, n, mp, mn, col, inv_n, out, o0), codegen

    return decode


decode = _make_decode(False)
decode_stream = _make_decode(False, stream=True)
column_decode = _make_decode(True)
column_decode_stream = _make_decode(True, stream=True)


@intrinsic
def sweep(typingctx, received, owe, vals, grad, v0, n, msgs, r0, r1, bit0, mp, mn, col, inv_n, mp0, mn0, out, m, carry):
    """``sweep(received, owe, vals, grad, v0, n, msgs, r0, r1, bit0, mp, mn, col, inv_n, mp0, mn0, out, m,
    carry)``: a group's whole quantize in one pass over its ``n`` values from ``v0``, returning the float64 sums
    ``(positive, negative, count positive)`` of the values quantized (entry ``e`` in lane ``e % 16``, the lanes
    added in order) and the carry (below).

    Each value is ``y`` = the addend (``grad[v0 + e]``, or with ``received`` the mean of the messages ``msgs``
    as :func:`_decoded_blocks` decodes it, its arguments ``msgs`` to ``inv_n``), plus with ``owe`` the error that
    ``vals[v0 + e]`` still owes: ``x - (mp0 if x >= 0 else mn0)`` (the means of the group's last quantize; zeros
    owe nothing). With ``owe``, ``y`` is stored into ``vals``: it owes its own error to the next call, against
    the means the caller makes of these sums. ``received`` and ``owe`` are booleans, tested once, outside the
    loops.

    Sign bit ``e`` is bit ``bit0 + e`` of row ``m`` of ``out`` (and of ``msgs``): 16 values are signed at once
    whatever ``bit0`` is, shifted into place. Every byte the group completes is stored, not OR-ed: its bits
    before the group's are ``carry``'s (the bits the caller's previous, contiguous group left in that byte; 0
    if none: then they are someone else's, OR-ed in later), and the bits of the byte the group leaves
    incomplete are returned as the next carry. The last 1-15 values are one block of partial lanes.

    A band's row (an entry in each of its columns) when ``mp0`` and ``mn0`` are float32 arrays: the means owed
    are ``mp0[e]``, ``mn0[e]``, the received messages' ``mp[r, col + e]``; ``y`` is stored whenever it is not the
    gradient itself, and no sums are taken (zeros are returned): the band sums its columns afterwards
    (:func:`band_sums`), from ``vals``, while they are in cache.

    The error needs the group's means, and the means need the whole group summed: leaving it owed keeps the
    group to one pass over memory, which runs at about the speed of adding a gradient to its residual.
    """
    arguments = (received, owe, vals, grad, v0, n, msgs, r0, r1, bit0, mp, mn, col, inv_n, mp0, mn0, out, m, carry)
    per_column = isinstance(mp0, types.Array)

    def codegen(context, builder, sig, args):
        flags = [context.cast(builder, args[k], sig.args[k], types.boolean) for k in (0, 1)]
        totals = [cgutils.alloca_once_value(builder, v) for v in (_ZERO_D, _ZERO_D, ir.Constant(_I64, 0))]
        carry = builder.trunc(_int(context, builder, args[18], sig.args[18]), _I32)
        carried = cgutils.alloca_once_value(builder, carry)
        with builder.if_else(flags[0]) as (decoded, added):
            for received, branch in ((True, decoded), (False, added)):
                with branch, builder.if_else(flags[1]) as (owing, clear):
                    for owe, inner in ((True, owing), (False, clear)):
                        with inner:
                            _sweep_loop(context, builder, sig, args, received, owe, per_column, totals, carried)
        found = [_lanes_in_order(builder, builder.load(t)) for t in totals[:2]]
        found.append(builder.uitofp(builder.load(totals[2]), _F64))  # the count: exact in float64
        found.append(builder.zext(builder.load(carried), _I64))
        return context.make_tuple(builder, sig.return_type, found)

    return types.Tuple((types.float64, types.float64, types.float64, types.int64))(*arguments), codegen


def _sweep_loop(context, builder, sig, args, received: bool, owe: bool, per_column: bool, totals, carried) -> None:
    """Emit one of :func:`sweep`'s loops: its whole blocks, then its partial one; the sums are added to the
    three allocas ``totals``, the carry kept in ``carried`` (i32)."""
    store = owe or (received and per_column)
    v0 = _int(context, builder, args[4], sig.args[4])
    vals, grad = (_base(context, builder, sig.args[k], args[k], v0) for k in (2, 3))
    n, bit0 = (_int(context, builder, args[k], sig.args[k]) for k in (5, 9))
    byte0, shift = builder.lshr(bit0, ir.Constant(_I64, 3)), builder.and_(bit0, ir.Constant(_I64, 7))
    if per_column:
        owed = [_base(context, builder, sig.args[k], args[k], ir.Constant(_I64, 0)) for k in (14, 15)]
    else:
        owed = [_splat(builder, context.cast(builder, args[k], sig.args[k], types.float32), _VF) for k in (14, 15)]
    signs = _row(context, builder, sig.args[16], args[16], _int(context, builder, args[17], sig.args[17]), byte0)
    shift32 = builder.trunc(shift, _I32)

    def blocks(count, first, lanes):
        def body(at, k, addend):
            y = addend
            if owe:
                x = lanes.load(vals, at)
                mp0, mn0 = (lanes.load(p, at) for p in owed) if per_column else owed
                error = builder.fsub(x, builder.select(builder.fcmp_ordered(">=", x, _ZERO_F), mp0, mn0))
                y = builder.fadd(addend, error) if received else builder.fadd(error, addend)
            if store:
                lanes.store(y, vals, at)
            if not per_column:
                added = _accumulate(builder, y, [builder.load(t) for t in totals], False, lanes.valid)
                for total, new in zip(totals, added, strict=True):
                    builder.store(new, total)
            positive = builder.fcmp_ordered(">=", y, _ZERO_F)
            if lanes.valid is not None:
                positive = builder.and_(positive, lanes.valid)
            bits = builder.shl(builder.zext(_sign_bytes(builder, positive), _I32), shift32)
            bits = builder.or_(bits, builder.load(carried))
            byte = builder.mul(k, ir.Constant(_I64, 2))
            if lanes.count is None:
                pair = builder.bitcast(builder.gep(signs, [byte]), _BYTES.as_pointer())
                builder.store(builder.trunc(bits, _BYTES), pair, align=1)
                builder.store(builder.lshr(bits, _C16), carried)
            else:  # the bytes this block completes (0-2), then what is left over
                done = builder.lshr(builder.add(shift, lanes.count), ir.Constant(_I64, 3))
                for i in range(2):
                    with builder.if_then(builder.icmp_unsigned("<", ir.Constant(_I64, i), done)):
                        value = builder.trunc(builder.lshr(bits, ir.Constant(_I32, 8 * i)), ir.IntType(8))
                        builder.store(value, builder.gep(signs, [builder.add(byte, ir.Constant(_I64, i))]))
                builder.store(builder.lshr(bits, builder.trunc(builder.mul(done, ir.Constant(_I64, 8)), _I32)), carried)

        if received:
            at = (6, 7, 8, 9, 10, 11, 12, 13)
            byte_args = _bytes_of(builder, args, 9)
            _decoded_blocks(context, builder, sig, byte_args, at, count, body, per_column, shift, lanes, first)
        else:
            with _steps(builder, count) as loop:
                k = builder.add(first, loop.index)
                at = builder.mul(k, ir.Constant(_I64, W))
                body(at, k, lanes.load(grad, at))

    _whole_then_partial(builder, n, blocks)


def _bytes_of(builder, args, k):
    """``args`` with the bit position ``args[k]`` replaced by its byte (``_decoded_blocks`` takes a byte)."""
    replaced = list(args)
    replaced[k] = builder.lshr(args[k], ir.Constant(args[k].type, 3))
    return replaced


@intrinsic
def fence(typingctx):
    """A full memory fence: the stores past the caches before it are seen by every core before what follows.
    Once after a task's decoded runs, not after each run (a fence waits for the stores to reach memory: after
    each row of a 512-wide band it made the decode four times slower)."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def address(typingctx, array, index):
    """The address of ``array[index]`` (1-D), as an integer."""

    def codegen(context, builder, sig, args):
        pointer = _base(context, builder, sig.args[0], args[0], _int(context, builder, args[1], sig.args[1]))
        return builder.ptrtoint(pointer, _I64)

    return types.int64(array, index), codegen
