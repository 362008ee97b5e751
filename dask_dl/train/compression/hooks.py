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
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dask_dl.errors import ConfigurationError
from dask_dl.train.compression.quantize import ColumnLayout, decode, dequantize, encode, message_size, quantize

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
    gradient. ``server_residuals[name]`` (two-stage only): the error of re-quantizing the summed stripe this rank
    owns, in the parameter's shape, zero outside its stripe. Keeping them by name (not by bucket) keeps them
    valid when DDP rebuilds its buckets and across checkpoints.
    """

    def __init__(self, *, error_feedback: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(error_feedback, bool):
            raise ConfigurationError(f"error_feedback must be True or False, got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.residuals: dict[str, torch.Tensor] = {}
        self.server_residuals: dict[str, torch.Tensor] = {}
        self.stripe_keys: dict[str, tuple] = {}  # first parameter of a bucket -> the layout its stripe is for


def _param_blocks(layout: ColumnLayout, names: list[str]):
    return zip(names, layout.shapes, layout.offsets, layout.matrices, strict=True)


def _residual_in(store: dict[str, torch.Tensor], name: str, shape, like: torch.Tensor) -> torch.Tensor:
    residual = store.get(name)
    if residual is None or tuple(residual.shape) != tuple(shape):
        residual = store[name] = torch.zeros(shape, dtype=torch.float32, device=like.device)
    return residual


def _worker_quantize(state: OneBitState, bucket: dist.GradBucket, layout: ColumnLayout, names: list[str]):
    """Gradient + residual in column order, quantized per column; the new residual is kept."""
    buffer = bucket.buffer()
    values = layout.to_columns(buffer)
    if state.error_feedback:
        for name, shape, offset, (rows, cols) in _param_blocks(layout, names):
            residual = _residual_in(state.residuals, name, shape, buffer)
            values[offset : offset + rows * cols] += residual.reshape(rows, cols).t().reshape(-1)
    runs = layout.runs()
    bits, scales = quantize(values, runs)
    if state.error_feedback:
        error = layout.from_columns(values - dequantize(bits, scales, runs))
        for name, shape, offset, (rows, cols) in _param_blocks(layout, names):
            state.residuals[name] = error[offset : offset + rows * cols].view(shape)
    return bits, scales


def _finish(bucket: dist.GradBucket, layout: ColumnLayout, columns: torch.Tensor) -> torch.Tensor:
    buffer = bucket.buffer()
    return layout.from_columns(columns.to(buffer.dtype), out=buffer)


def onebit_hook(state: OneBitState, bucket: dist.GradBucket) -> Future:
    """``onebit``: 1-bit SGD with error feedback; packed signs and scales are all-gathered, each rank decodes
    every rank's message and averages (sums in rank order, so every rank gets the same bits)."""
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
    layout = ColumnLayout(tuple(tuple(g.shape) for g in bucket.gradients()))
    if layout.numel != bucket.buffer().numel():
        raise ConfigurationError(
            f"bucket {bucket.index()} holds {bucket.buffer().numel()} values but its parameters {layout.numel}; "
            "1-bit compression needs dense gradients (no sparse embeddings)"
        )
    names = state.names(bucket)
    bits, scales = _worker_quantize(state, bucket, layout, names)
    future = _two_stage(state, layout, names, bits, scales) if two_stage else _all_gather(state, layout, bits, scales)
    state.end_bucket(bucket)
    return future.then(lambda fut: _finish(bucket, layout, fut.value()))


def _all_gather(state: OneBitState, layout: ColumnLayout, bits: torch.Tensor, scales: torch.Tensor) -> Future:
    n, runs = state.world_size, layout.runs()
    message = encode(bits, scales)
    if n == 1:
        return _done(decode(message, runs))
    gathered = message.new_empty(n * message.numel())
    state.count(message, n - 1)
    work = dist.all_gather_single(gathered, message, group=state.process_group, async_op=True)

    def average(fut: Future) -> torch.Tensor:
        messages = gathered.view(n, -1)
        total = decode(messages[0], runs)
        for r in range(1, n):
            total += decode(messages[r], runs)
        return total.div_(n)

    return work.get_future().then(average)


def _two_stage(
    state: OneBitState, layout: ColumnLayout, names: list[str], bits: torch.Tensor, scales: torch.Tensor
) -> Future:
    n, rank = state.world_size, state.rank
    stripes = layout.stripes(n)
    starts = layout.column_starts
    sizes = [message_size(int(starts[b] - starts[a]), b - a) for a, b in stripes]
    size = max(sizes)
    # Stage 1: every rank sends stripe j's signs and scales to rank j.
    send = torch.cat([encode(bits[starts[a] : starts[b]], scales[a:b], size) for a, b in stripes])
    if n > 1:
        received = torch.empty_like(send)
        state.count(send, (n - 1) / n)
        dist.all_to_all_single(received, send, group=state.process_group)
    else:
        received = send
    first, last = stripes[rank]
    lo, hi = int(starts[first]), int(starts[last])
    if state.error_feedback:
        _own_stripe(state, layout, names, lo, hi, send)
    runs = layout.runs(first, last)
    messages = received.view(n, size)
    mean = decode(messages[0], runs)
    for r in range(1, n):
        mean += decode(messages[r], runs)
    mean.div_(n)
    # Stage 2: re-quantize the averaged stripe with the server residual, then all-gather the stripes.
    blocks = _stripe_blocks(layout, names, lo, hi)
    if state.error_feedback:
        for name, shape in zip(names, layout.shapes, strict=True):  # every parameter, so a checkpoint has all
            _residual_in(state.server_residuals, name, shape, mean)
        for name, shape, (rows, cols), a, b, at in blocks:
            residual = _residual_in(state.server_residuals, name, shape, mean)
            mean[at : at + b - a] += residual.reshape(rows, cols).t().reshape(-1)[a:b]
    bits2, scales2 = quantize(mean, runs)
    if state.error_feedback:
        error = mean - dequantize(bits2, scales2, runs)
        for name, shape, (rows, cols), a, b, at in blocks:
            residual = state.server_residuals[name]
            columns = residual.reshape(rows, cols).t().reshape(-1)  # a copy unless cols == 1
            columns[a:b] = error[at : at + b - a]
            state.server_residuals[name] = columns.view(cols, rows).t().reshape(shape).contiguous()
    message = encode(bits2, scales2, size)
    all_runs = [layout.runs(a, b) for a, b in stripes]

    def assemble(gathered: torch.Tensor) -> torch.Tensor:
        columns = torch.empty(layout.numel, dtype=torch.float32, device=gathered.device)
        for j, (a, b) in enumerate(stripes):
            decode(gathered.view(n, size)[j], all_runs[j], out=columns[starts[a] : starts[b]])
        return columns

    if n == 1:
        return _done(assemble(message))
    gathered = message.new_empty(n * size)
    state.count(message, n - 1)
    work = dist.all_gather_single(gathered, message, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: assemble(gathered))


def _own_stripe(
    state: OneBitState, layout: ColumnLayout, names: list[str], lo: int, hi: int, like: torch.Tensor
) -> None:
    """Make this rank hold the server residuals of its stripe ``lo:hi`` (column order) and zeros elsewhere.

    Stripes follow the bucket's layout, which changes when DDP rebuilds its buckets (after its first step,
    also in a resumed run): then the residuals are summed over ranks (they are zero outside each owner's
    stripe, so the sum is exact) and each rank keeps its new stripe.
    """
    key = (tuple(names), state.world_size, lo, hi)
    if state.stripe_keys.get(names[0] if names else "") == key:
        return
    state.stripe_keys[names[0] if names else ""] = key
    if not any(name in state.server_residuals for name in names):
        return  # nothing kept yet: a fresh start, the same on every rank
    flat = torch.cat(
        [
            _residual_in(state.server_residuals, name, shape, like).reshape(-1)
            for name, shape in zip(names, layout.shapes, strict=True)
        ]
    )
    if state.world_size > 1:
        state.count(flat, 2 * (state.world_size - 1) / state.world_size)
        dist.all_reduce(flat, group=state.process_group)
    columns = layout.to_columns(flat)
    columns[:lo] = 0
    columns[hi:] = 0
    flat = layout.from_columns(columns)
    for name, shape, offset, (rows, cols) in _param_blocks(layout, names):
        state.server_residuals[name] = flat[offset : offset + rows * cols].view(shape).clone()


def _stripe_blocks(layout: ColumnLayout, names: list[str], lo: int, hi: int):
    """For the column-order range ``lo:hi``: (name, shape, matrix, a, b, at) per parameter it touches, where
    ``a:b`` is the range inside the parameter's column-order block and ``at`` where it starts in the stripe."""
    blocks = []
    for name, shape, offset, (rows, cols) in _param_blocks(layout, names):
        a, b = max(lo, offset), min(hi, offset + rows * cols)
        if a < b:
            blocks.append((name, shape, (rows, cols), a - offset, b - offset, a - lo))
    return blocks
