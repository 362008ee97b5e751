"""Gradient compressors as DDP communication hooks: pure functions ``(state, bucket) -> Future[Tensor]``.

Every hook returns the *mean* of the ranks' bucket gradients (what DDP expects), runs plain allreduce for the
first ``state.warmup_steps`` steps, counts a step when DDP hands it the last bucket of an iteration, and adds
to ``state.bytes_sent`` the bytes of every tensor it hands to a torch.distributed collective: for
``all_reduce`` the tensor, for ``all_gather`` this rank's input, for ``all_to_all`` this rank's whole input
(its own chunk included). ``state.wire_bytes`` estimates what leaves this rank on the network under the usual
algorithms: ring allreduce ``2 (N-1)/N`` of the tensor, all-gather ``N-1`` inputs, all-to-all ``(N-1)/N`` of the
input. With one rank there are no collectives: the hooks return what the algorithm defines for ``N = 1``.

Hooks accept any bucket with DDP's ``GradBucket`` interface (``buffer()``, ``gradients()``, ``parameters()``,
``index()``, ``is_last()``), so they can be driven directly in tests and benchmarks.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook checks the real annotation objects
# (``bucket: dist.GradBucket``, ``-> torch.futures.Future[torch.Tensor]``), not strings.
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dask_dl.errors import ConfigurationError
from dask_dl.train.compression.quantize import (
    ColumnLayout,
    decode,
    dequantize,
    encode,
    message_size,
    quantize,
    scratch,
    scratch_like,
)

Future = torch.futures.Future[torch.Tensor]


class HookState:
    """What every hook keeps: process group, warm-up, step counter, byte counters, parameter names.

    Parameters
    ----------
    process_group : ProcessGroup, optional
        Group to communicate in; the default group when None (or no communication when torch.distributed is
        not initialized: one rank).
    warmup_steps : int
        Steps of plain allreduce before compression starts.
    """

    def __init__(self, *, process_group: Any = None, warmup_steps: int = 0) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigurationError(
                f"warmup_steps must be an integer >= 0, got {warmup_steps!r}; pass e.g. warmup_steps=10"
            )
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.step = 0
        self.bytes_sent = 0
        self.wire_bytes = 0
        #: id(parameter) -> name, filled by ``Compressor.register``; residuals are kept by parameter name.
        self.param_names: dict[int, str] = {}

    @property
    def world_size(self) -> int:
        if self.process_group is not None:
            return self.process_group.size()
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        if self.world_size == 1:
            return 0
        return dist.get_rank(self.process_group)

    @property
    def compressing(self) -> bool:
        return self.step >= self.warmup_steps

    def end_bucket(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.step += 1

    def names(self, bucket: dist.GradBucket) -> list[str]:
        """Names of the bucket's parameters; ``"<bucket index>.<position>"`` for unregistered ones."""
        return [self.param_names.get(id(p), f"{bucket.index()}.{i}") for i, p in enumerate(bucket.parameters())]

    def count(self, tensor: torch.Tensor, wire_factor: float) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_sent += nbytes
        self.wire_bytes += round(nbytes * wire_factor)


def _done(tensor: torch.Tensor) -> Future:
    future: Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def _allreduce_mean(state: HookState, tensor: torch.Tensor) -> Future:
    n = state.world_size
    if n == 1:
        return _done(tensor)
    state.count(tensor, 2 * (n - 1) / n)
    tensor.div_(n)  # before the sum, as torch's default hook does: no overflow in half precision
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> Future:
    """Plain allreduce of the bucket, averaged: the ``none`` compressor (same result as DDP without a hook)."""
    future = _allreduce_mean(state, bucket.buffer())
    state.end_bucket(bucket)
    return future


class CastState(HookState):
    """State of :func:`cast_hook`: allreduce in ``dtype`` (``torch.float16`` or ``torch.bfloat16``)."""

    def __init__(self, dtype: torch.dtype, **kwargs: Any) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ConfigurationError(f"cast compression needs torch.float16 or torch.bfloat16, got {dtype!r}")
        super().__init__(**kwargs)
        self.dtype = dtype


def cast_hook(state: CastState, bucket: dist.GradBucket) -> Future:
    """``fp16``/``bf16``: torch's own ``fp16_compress_hook``/``bf16_compress_hook`` after the warm-up."""
    if not state.compressing:
        return allreduce_hook(state, bucket)
    buffer = bucket.buffer()
    n = state.world_size
    if n == 1:
        future = _done(buffer.copy_(buffer.to(state.dtype)))  # the rounding is all the algorithm does alone
    else:
        state.count(torch.empty(buffer.numel(), dtype=state.dtype, device="meta"), 2 * (n - 1) / n)
        fp16 = state.dtype == torch.float16
        torch_hook = default_hooks.fp16_compress_hook if fp16 else default_hooks.bf16_compress_hook
        future = torch_hook(state.process_group, bucket)
    state.end_bucket(bucket)
    return future


class OneBitState(HookState):
    """State of the 1-bit hooks: error-feedback residuals, kept per parameter name.

    ``residuals[name]``: this rank's quantization error of the parameter (its shape), added to the next step's
    gradient. ``server_residuals[name]`` (two-stage only): the error of re-quantizing the averaged stripe this
    rank owns, in the parameter's shape, zero outside its stripe. Keeping them by name (not by bucket) keeps
    them valid when DDP rebuilds its buckets and across checkpoints.
    """

    def __init__(self, *, error_feedback: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(error_feedback, bool):
            raise ConfigurationError(f"error_feedback must be True or False, got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.residuals: dict[str, torch.Tensor] = {}
        self.server_residuals: dict[str, torch.Tensor] = {}
        self.stripe_keys: dict[str, tuple] = {}  # first parameter of a bucket -> the layout its stripe is for
        self.workspace: dict = {}  # temporaries kept between steps (about two copies of the gradients)


def _residual(store: dict[str, torch.Tensor], name: str, shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
    residual = store.get(name)
    if residual is None or tuple(residual.shape) != tuple(shape):
        residual = store[name] = torch.zeros(shape, dtype=torch.float32, device=like.device)
    return residual


def onebit_hook(state: OneBitState, bucket: dist.GradBucket) -> Future:
    """``onebit``: 1-bit SGD with error feedback; packed signs and scales are all-gathered, each rank decodes
    every rank's message and averages (summing in rank order, so that every rank gets the same bits)."""
    return _onebit(state, bucket, two_stage=False)


def onebit2_hook(state: OneBitState, bucket: dist.GradBucket) -> Future:
    """``onebit2``: two-stage 1-bit SGD (CNTK stripe aggregation, DeepSpeed compressed allreduce).

    The bucket's columns are cut in N stripes; all-to-all sends each rank the messages for its stripe; it
    decodes them, averages, adds its server residual, re-quantizes (keeping the new server residual) and all
    ranks all-gather the re-quantized stripes. Per step a rank hands ``N`` stripe messages (``~n/8`` bytes) to
    all-to-all and one (``~n/8N``) to all-gather; on the wire that is ``~2 (N-1)/N * n/8`` whatever N.
    gloo has ``all_to_all_single`` for uint8 on CPU in this torch, so it is used as is.
    """
    return _onebit(state, bucket, two_stage=True)


def _onebit(state: OneBitState, bucket: dist.GradBucket, *, two_stage: bool) -> Future:
    if not state.compressing:
        return allreduce_hook(state, bucket)
    buffer = bucket.buffer()
    gradients = bucket.gradients()
    layout = ColumnLayout(tuple(tuple(g.shape) for g in gradients))
    if layout.numel != buffer.numel() or buffer.dtype != torch.float32:
        raise ConfigurationError(
            f"1-bit compression needs dense float32 gradients; bucket {bucket.index()} holds {buffer.numel()} "
            f"{buffer.dtype} values for parameters of {layout.numel}; use fp16/bf16/none for this model"
        )
    names = state.names(bucket)
    blocks = layout.blocks(buffer)  # 2-D views of the bucket, one per parameter
    if state.error_feedback:  # the bucket is ours to change: add last step's error in place
        for i, (name, grad, block) in enumerate(zip(names, gradients, blocks, strict=True)):
            block.add_(layout.matrix(_residual(state.residuals, name, grad.shape, buffer), i))
    key = (bucket.index(),)
    ws = state.workspace
    bits, scales = quantize(blocks, workspace=ws, key=key)
    if state.error_feedback:
        rebuilt = [scratch_like(ws, ("approx", *key, i), b, torch.float32) for i, b in enumerate(blocks)]
        dequantize(bits, scales, out=rebuilt, workspace=ws, key=key)
        for i, (name, block, approx) in enumerate(zip(names, blocks, rebuilt, strict=True)):
            torch.sub(block, approx, out=layout.matrix(state.residuals[name], i))
    if two_stage:
        future = _two_stage(state, layout, names, bits, scales, buffer, key)
    else:
        future = _all_gather(state, layout, bits, scales, buffer, key)
    state.end_bucket(bucket)
    return future


def _average(messages: torch.Tensor, shapes: list[tuple[int, int]], out: list[torch.Tensor], ws, key) -> None:
    """Decode each row of ``messages`` and write their mean (summed in row order) into the ``out`` blocks."""
    n = messages.shape[0]
    temporaries = [scratch_like(ws, ("avg", *key, i), t, torch.float32) for i, t in enumerate(out)]
    for r in range(n):
        bits, scales = decode(messages[r], shapes)
        if r == 0:
            dequantize(bits, scales, out=out, workspace=ws, key=key)
            continue
        dequantize(bits, scales, out=temporaries, workspace=ws, key=key)
        for target, values in zip(out, temporaries, strict=True):
            target.add_(values)
    for target in out:
        target.div_(n)


def _all_gather(state, layout, bits, scales, buffer, key) -> Future:
    n = state.world_size
    message = encode(bits, scales, transposed=[m.transposed for m in layout.matrices])
    gathered = message.new_empty(n * message.numel())

    def average(_: Any = None) -> torch.Tensor:
        _average(gathered.view(n, -1), layout.block_shapes(), layout.blocks(buffer), state.workspace, key)
        return buffer

    return _gather_then(state, message, gathered, average)


def _gather_then(state, message: torch.Tensor, gathered: torch.Tensor, then) -> Future:
    """All-gather every rank's ``message`` into ``gathered``, then return ``then()``'s result as a future.

    With one rank there is nothing to exchange: the message is its own gather and nothing is counted as sent.
    """
    n = state.world_size
    if n == 1:
        gathered.copy_(message)
        return _done(then())
    state.count(message, n - 1)
    work = dist.all_gather_single(gathered, message, group=state.process_group, async_op=True)
    return work.get_future().then(then)


def _two_stage(state, layout, names, bits, scales, buffer, key) -> Future:
    n, rank = state.world_size, state.rank
    stripes = layout.stripes(n)
    starts = layout.column_starts
    size = max(message_size(int(starts[b] - starts[a]), b - a) for a, b in stripes)

    def stripe_bits(a: int, b: int) -> list[torch.Tensor]:
        return [bits[i][:, lo:hi] for i, lo, hi in layout.pieces(a, b)]

    def flags(a: int, b: int) -> list[bool]:
        return [s.transposed for s in layout.block_shapes(a, b)]

    # Stage 1: every rank sends stripe j's signs and scales to rank j.
    send = torch.cat([encode(stripe_bits(a, b), scales[a:b], size, transposed=flags(a, b)) for a, b in stripes])
    received = torch.empty_like(send)
    if n > 1:
        state.count(send, (n - 1) / n)
        dist.all_to_all_single(received, send, group=state.process_group)
    else:
        received.copy_(send)
    first, last = stripes[rank]
    shapes = layout.block_shapes(first, last)
    ws = state.workspace
    mean = [
        scratch(ws, ("mean", *key, i), buffer, shape[:2], torch.float32, transposed=shape.transposed)
        for i, shape in enumerate(shapes)
    ]
    _average(received.view(n, size), shapes, mean, ws, key)
    # Stage 2: re-quantize the averaged stripe with the server residual, then all-gather the stripes.
    pieces = layout.pieces(first, last)
    if state.error_feedback:
        _own_stripe(state, layout, names, first, last, buffer)
        for block, (i, lo, hi) in zip(mean, pieces, strict=True):
            block.add_(layout.matrix(state.server_residuals[names[i]], i)[:, lo:hi])
    bits2, scales2 = quantize(mean, column_major=True, workspace=ws, key=("server", *key))
    if state.error_feedback:
        rebuilt = [scratch_like(ws, ("approx2", *key, i), b, torch.float32) for i, b in enumerate(mean)]
        dequantize(bits2, scales2, out=rebuilt, workspace=ws, key=key)
        for block, approx, (i, lo, hi) in zip(mean, rebuilt, pieces, strict=True):
            residual = layout.matrix(state.server_residuals[names[i]], i)[:, lo:hi]
            torch.sub(block, approx, out=residual)
    message = encode(bits2, scales2, size, transposed=flags(first, last))
    gathered = message.new_empty(n * size)

    def assemble(_: Any = None) -> torch.Tensor:
        for j, (a, b) in enumerate(stripes):
            stripe_bits2, stripe_scales = decode(gathered.view(n, size)[j], layout.block_shapes(a, b))
            dequantize(stripe_bits2, stripe_scales, out=layout.blocks(buffer, a, b), workspace=ws, key=key)
        return buffer

    return _gather_then(state, message, gathered, assemble)


def _own_stripe(state: OneBitState, layout: ColumnLayout, names: list[str], first: int, last: int, like) -> None:
    """Make this rank hold the server residuals of its stripe (columns ``first:last``) and zeros elsewhere.

    Stripes follow the bucket's layout, which changes when DDP rebuilds its buckets (after its first step,
    also in a resumed run): then the residuals are summed over ranks (they are zero outside each owner's
    stripe, so the sum is exact) and each rank keeps its new stripe.
    """
    key = (tuple(names), state.world_size, first, last)
    if state.stripe_keys.get(names[0]) == key:
        return
    state.stripe_keys[names[0]] = key
    fresh = not any(name in state.server_residuals for name in names)  # the same on every rank
    residuals = [
        _residual(state.server_residuals, name, shape, like) for name, shape in zip(names, layout.shapes, strict=True)
    ]
    if fresh:
        return
    flat = torch.cat([r.reshape(-1) for r in residuals])
    if state.world_size > 1:
        state.count(flat, 2 * (state.world_size - 1) / state.world_size)
        dist.all_reduce(flat, group=state.process_group)
    kept = torch.zeros_like(flat)
    for source, target in zip(layout.blocks(flat, first, last), layout.blocks(kept, first, last), strict=True):
        target.copy_(source)
    for name, shape, offset in zip(names, layout.shapes, layout.offsets, strict=True):
        state.server_residuals[name] = kept[offset : offset + math.prod(shape)].view(shape).clone()
