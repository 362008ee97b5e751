"""Vector loops for the 1-bit kernels, written as LLVM IR (numba intrinsics): 16 values per step.

numba's loops leave two things to LLVM's auto-vectorizer that it does not do: a float64 sum is a chain it may
not reorder (fastmath would change results), and packing comparisons into sign bytes is not a pattern it knows.
Here each loop is spelled with LLVM vector types, which LLVM lowers to whatever the CPU has (AVX-512, AVX2,
SSE, NEON) without reordering anything:

- sums of the entries ``>= 0``, of the others (float64, the negative side summed itself) and their count, in 16
  lanes (entry ``e`` of a run goes to lane ``e % 16``), the lanes added in order at the end: a fixed order, so
  results do not depend on how work is cut or on the CPU;
- signs (``x >= 0``: NaN on the negative side, zeros on the positive) packed 16 to two bytes, least significant
  bit first (the order of a comparison mask: packing is one move), with the error ``x - mean`` written back
  while the values are in registers;
- the mean of ``N`` messages decoded into float32, summed in float64 in message order, one store per value; a
  single message (``onebit`` on one rank, the owner's stripe in ``onebit2``) in float32: a blend and a store;
  for the server side of ``onebit2``, with the sums above of what is stored, in the same sweep.

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
_ONE_D = ir.Constant(_VD, [1.0] * W)
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


def _mask_of(builder, pointer, index):
    """The 16 signs stored at two bytes from ``pointer[index]``, as a vector of i1 (element k: value k)."""
    bits = builder.load(builder.bitcast(builder.gep(pointer, [index]), _BYTES.as_pointer()), align=1)
    return builder.bitcast(bits, _MASK)


def _lanes_in_order(builder, vector):
    total = builder.extract_element(vector, ir.Constant(_I32, 0))
    for lane in range(1, W):
        total = builder.fadd(total, builder.extract_element(vector, ir.Constant(_I32, lane)))
    return total


def _accumulate(builder, x, accumulators, per_lane):
    """Add the float64 of ``x``'s entries ``>= 0`` to the first of three accumulators, of the others to the
    second (two float64 vectors), and the count of the first to the third: a float64 vector ``per_lane``,
    else an i64 (a popcount of the comparison mask).

    A lane not added to keeps its value: a masked add, the same sum as adding 0.0 (accumulators start at +0.0).
    """
    wide = builder.fpext(x, _VD)
    positive = builder.fcmp_ordered(">=", x, _ZERO_F)
    sp, sn, count = accumulators
    sp = builder.select(positive, builder.fadd(sp, wide), sp)
    sn = builder.select(positive, sn, builder.fadd(sn, wide))
    if per_lane:
        count = builder.select(positive, builder.fadd(count, _ONE_D), count)
    else:
        ones = builder.call(builder.module.declare_intrinsic("llvm.ctpop", [_BYTES]), [_sign_bytes(builder, positive)])
        count = builder.add(count, builder.zext(ones, _I64))
    return [sp, sn, count]


def _make_sums(add: bool):
    """``sums(src, s0, count)`` or, with ``add``, ``add_sums(vals, v0, grad, g0, count)`` (``vals += grad``
    first, stored): the float64 sums ``(positive, negative, count positive)`` of ``16 * count`` values."""

    def codegen(context, builder, sig, args):
        src = _base(context, builder, sig.args[0], args[0], _int(context, builder, args[1], sig.args[1]))
        if add:
            grad = _base(context, builder, sig.args[2], args[2], _int(context, builder, args[3], sig.args[3]))
        count = _int(context, builder, args[-1], sig.args[-1])
        zero = ir.Constant(_I64, 0)
        slots = [
            cgutils.alloca_once_value(builder, _ZERO_D),
            cgutils.alloca_once_value(builder, _ZERO_D),
            cgutils.alloca_once_value(builder, zero),
        ]
        with _steps(builder, count) as loop:
            at = builder.mul(loop.index, ir.Constant(_I64, W))
            x = _load(builder, src, at, _VF, 4)
            if add:
                x = builder.fadd(x, _load(builder, grad, at, _VF, 4))
                _store(builder, x, src, at, 4)
            totals = _accumulate(builder, x, [builder.load(s) for s in slots], per_lane=False)
            for slot, total in zip(slots, totals, strict=True):
                builder.store(total, slot)
        sums = [_lanes_in_order(builder, builder.load(s)) for s in slots[:2]]
        sums.append(builder.uitofp(builder.load(slots[2]), _F64))  # the count: exact in float64
        return context.make_tuple(builder, sig.return_type, sums)

    if add:

        @intrinsic
        def add_sums(typingctx, vals, v0, grad, g0, count):
            return types.UniTuple(types.float64, 3)(vals, v0, grad, g0, count), codegen

        return add_sums

    @intrinsic
    def sums(typingctx, src, s0, count):
        return types.UniTuple(types.float64, 3)(src, s0, count), codegen

    return sums


sums = _make_sums(False)
add_sums = _make_sums(True)


@intrinsic
def band_sums(typingctx, src, s0, stride, rows, count, psp, psn, pcp, p0):
    """``band_sums(src, s0, stride, rows, count, psp, psn, pcp, p0)``: the float64 sums of the columns of a band
    (``rows`` rows ``stride`` apart from ``src[s0]``, ``16 * count`` columns), each summed down its rows in order
    from 0.0 in registers, added to ``psp/psn/pcp[p0...]``.

    It only reads ``src``: a loop that also stored each value back (adding the gradient to the residual on the
    way) ran at a third of the speed of the two steps apart, the rows added in memory order first
    (``loops._band_sums``), then summed here while in cache.
    """

    def codegen(context, builder, sig, args):
        s0 = _int(context, builder, args[1], sig.args[1])
        src = _base(context, builder, sig.args[0], args[0], s0)
        stride, rows, count, p0 = (_int(context, builder, args[k], sig.args[k]) for k in (2, 3, 4, 8))
        partials = [_base(context, builder, sig.args[5 + k], args[5 + k], p0) for k in range(3)]
        slots = [cgutils.alloca_once(builder, _VD) for _ in range(3)]
        with _steps(builder, count) as columns:
            column = builder.mul(columns.index, ir.Constant(_I64, W))
            for slot in slots:
                builder.store(_ZERO_D, slot)
            with cgutils.for_range(builder, rows) as row:
                x = _load(builder, src, builder.add(builder.mul(row.index, stride), column), _VF, 4)
                totals = _accumulate(builder, x, [builder.load(slot) for slot in slots], per_lane=True)
                for slot, total in zip(slots, totals, strict=True):
                    builder.store(total, slot)
            for p, slot in zip(partials, slots, strict=True):
                _store(builder, builder.fadd(_load(builder, p, column, _VD, 8), builder.load(slot)), p, column, 8)
        return context.get_dummy_value()

    return types.none(src, s0, stride, rows, count, psp, psn, pcp, p0), codegen


def _make_signs(error: bool, per_column: bool):
    """``signs(src, s0, count, mp, mn, c0, msg, byte0)``: pack the signs of ``16 * count`` values into the
    uint8 array ``msg`` from byte ``byte0``; with ``error`` replace each value by ``value - its mean``. The means
    are the scalars ``mp``/``mn`` (``c0`` unused) or, ``per_column``, the arrays ``mp[c0...]``/``mn[c0...]``."""

    def codegen(context, builder, sig, args):
        src = _base(context, builder, sig.args[0], args[0], _int(context, builder, args[1], sig.args[1]))
        count = _int(context, builder, args[2], sig.args[2])
        msg = _base(context, builder, sig.args[6], args[6], _int(context, builder, args[7], sig.args[7]))
        if per_column:
            c0 = _int(context, builder, args[5], sig.args[5])
            mps, mns = (_base(context, builder, sig.args[k], args[k], c0) for k in (3, 4))
        else:
            mp, mn = (_splat(builder, context.cast(builder, args[k], sig.args[k], types.float32), _VF) for k in (3, 4))
        with _steps(builder, count) as loop:
            at = builder.mul(loop.index, ir.Constant(_I64, W))
            x = _load(builder, src, at, _VF, 4)
            positive = builder.fcmp_ordered(">=", x, _ZERO_F)
            if error:
                if per_column:
                    mp, mn = _load(builder, mps, at, _VF, 4), _load(builder, mns, at, _VF, 4)
                _store(builder, builder.fsub(x, builder.select(positive, mp, mn)), src, at, 4)
            _store(builder, _sign_bytes(builder, positive), msg, builder.mul(loop.index, ir.Constant(_I64, 2)), 1)
        return context.get_dummy_value()

    @intrinsic
    def signs(typingctx, src, s0, count, mp, mn, c0, msg, byte0):
        return types.none(src, s0, count, mp, mn, c0, msg, byte0), codegen

    return signs


signs = _make_signs(False, False)
signs_error = _make_signs(True, False)
column_signs = _make_signs(False, True)
column_signs_error = _make_signs(True, True)


def _make_decode(per_column: bool, add: bool, stream: bool = False, sums: bool = False):
    """``decode(msgs, r0, r1, byte0, count, mp, mn, col, inv_n, out, o0)``: ``out[o0 + e]`` (``e < 16 * count``)
    = float32(``inv_n`` * the float64 sum over rows ``r0:r1`` of ``msgs`` of the mean their sign bit ``8 * byte0
    + e`` picks), plus ``out[o0 + e]`` with ``add``. The means: ``mp[r, col]``/``mn[r, col]``, or ``[r, col +
    e]`` ``per_column`` (2-D float32 arrays, C order). With ``stream``, ``&out[o0]`` must be 64-byte aligned:
    the values are stored past the caches (non-temporal: a bucket is not read back soon, and the store does not
    read the line first); the caller then runs :func:`fence` before it hands the values on.

    One row with ``inv_n == 1`` is decoded in float32 (the float64 round trip of one float32 mean is exact):
    the picked mean is a blend of two vectors, stored (or added) as it is.

    With ``sums`` it also returns the float64 sums of the values it stores, as :func:`sums` takes them (entry
    ``e`` in lane ``e % 16``): the server side's sweep, where summing in a second pass over the group, from the
    first-level cache, cost as much again as the decode's own pass from memory.
    """

    def codegen(context, builder, sig, args):
        msgs_ty, mp_ty = sig.args[0], sig.args[5]
        r0, r1, byte0, count, col = (_int(context, builder, args[k], sig.args[k]) for k in (1, 2, 3, 4, 7))
        inv_n = context.cast(builder, args[8], sig.args[8], types.float64)
        out = _base(context, builder, sig.args[9], args[9], _int(context, builder, args[10], sig.args[10]))
        slot = cgutils.alloca_once_value(builder, _ZERO_D)
        one = ir.Constant(_I64, 1)
        totals = [cgutils.alloca_once_value(builder, v) for v in (_ZERO_D, _ZERO_D, ir.Constant(_I64, 0))]

        def means(r, at, vty):
            """The two means of row ``r`` for the 16 values from ``at``, as vectors of ``vty``."""
            pointers = [_row(context, builder, mp_ty, args[k], r, col) for k in (5, 6)]
            if per_column:
                loaded = [_load(builder, p, at, _VF, 4) for p in pointers]
                return loaded if vty is _VF else [builder.fpext(v, _VD) for v in loaded]
            scalars = [builder.load(p) for p in pointers]
            if vty is _VD:
                scalars = [builder.fpext(v, _F64) for v in scalars]
            return [_splat(builder, v, vty) for v in scalars]

        def picked(r, at, vty):
            signs = _row(context, builder, msgs_ty, args[0], r, byte0)
            mask = _mask_of(builder, signs, builder.udiv(at, ir.Constant(_I64, 8)))
            return builder.select(mask, *means(r, at, vty))

        def put(value, at):
            if add:
                value = builder.fadd(value, _load(builder, out, at, _VF, 4))
            if stream:
                target = builder.bitcast(builder.gep(out, [at]), _VF.as_pointer())
                store = builder.store(value, target, align=64)
                store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))
            else:
                _store(builder, value, out, at, 4)
            if sums:
                added = _accumulate(builder, value, [builder.load(t) for t in totals], per_lane=False)
                for total, new in zip(totals, added, strict=True):
                    builder.store(new, total)

        one_row = builder.icmp_signed("==", builder.sub(r1, r0), one)
        single = builder.and_(one_row, builder.fcmp_ordered("==", inv_n, ir.Constant(_F64, 1.0)))
        with builder.if_else(single) as (alone, several):
            with alone, _steps(builder, count) as loop:
                at = builder.mul(loop.index, ir.Constant(_I64, W))
                put(picked(r0, at, _VF), at)
            with several:
                scale = _splat(builder, inv_n, _VD)
                with _steps(builder, count) as loop:
                    at = builder.mul(loop.index, ir.Constant(_I64, W))
                    builder.store(picked(r0, at, _VD), slot)  # the first row as it is (0.0 + -0.0 would be +0.0)
                    with cgutils.for_range(builder, builder.sub(r1, builder.add(r0, one))) as rows:
                        r = builder.add(builder.add(r0, one), rows.index)
                        builder.store(builder.fadd(builder.load(slot), picked(r, at, _VD)), slot)
                    put(builder.fptrunc(builder.fmul(builder.load(slot), scale), _VF), at)
        if not sums:
            return context.get_dummy_value()
        found = [_lanes_in_order(builder, builder.load(t)) for t in totals[:2]]
        found.append(builder.uitofp(builder.load(totals[2]), _F64))  # the count: exact in float64
        return context.make_tuple(builder, sig.return_type, found)

    returns = types.UniTuple(types.float64, 3) if sums else types.none

    @intrinsic
    def decode(typingctx, msgs, r0, r1, byte0, count, mp, mn, col, inv_n, out, o0):
        return returns(msgs, r0, r1, byte0, count, mp, mn, col, inv_n, out, o0), codegen

    return decode


decode = _make_decode(False, False)
decode_sums = _make_decode(False, False, sums=True)
decode_add_sums = _make_decode(False, True, sums=True)
decode_stream = _make_decode(False, False, stream=True)
column_decode = _make_decode(True, False)
column_decode_add = _make_decode(True, True)
column_decode_stream = _make_decode(True, False, stream=True)


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
