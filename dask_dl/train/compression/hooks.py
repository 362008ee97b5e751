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
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dask_dl.errors import ConfigurationError
from dask_dl.train.compression.eager import onebit_eager
from dask_dl.train.compression.quantize import ColumnLayout
from dask_dl.train.compression.state import Future, HookState, OneBitState, allreduce_mean, done

__all__ = ["CastState", "HookState", "OneBitState", "allreduce_hook", "cast_hook", "onebit2_hook", "onebit_hook"]


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> Future:
    """Plain allreduce of the bucket, averaged: the ``none`` compressor (same result as DDP without a hook)."""
    future = allreduce_mean(state, bucket.buffer())
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
        future = done(buffer.copy_(buffer.to(state.dtype)))  # the rounding is all the algorithm does alone
    else:
        state.count(torch.empty(buffer.numel(), dtype=state.dtype, device="meta"), 2 * (n - 1) / n)
        fp16 = state.dtype == torch.float16
        torch_hook = default_hooks.fp16_compress_hook if fp16 else default_hooks.bf16_compress_hook
        future = torch_hook(state.process_group, bucket)
    state.end_bucket(bucket)
    return future


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
    names, shapes = state.describe(bucket)
    layout = _layout(state, tuple(shapes))
    if layout.numel != buffer.numel() or buffer.dtype != torch.float32:
        raise ConfigurationError(
            f"1-bit compression needs dense float32 gradients; bucket {bucket.index()} holds {buffer.numel()} "
            f"{buffer.dtype} values for parameters of {layout.numel}; use fp16/bf16/none for this model"
        )
    key = (bucket.index(),)
    if state.fused and buffer.device.type == "cpu":
        future = _fused()(state, names, shapes, buffer, key, two_stage=two_stage)
    else:
        future = onebit_eager(state, layout, names, buffer, key, two_stage=two_stage)
    state.end_bucket(bucket)
    return future


@functools.cache
def _fused():
    """``fused.onebit_fused``: its module (numba) imported at the first call, not with the hooks."""
    from dask_dl.train.compression.fused import onebit_fused

    return onebit_fused


def _layout(state: OneBitState, shapes: tuple[tuple[int, ...], ...]) -> ColumnLayout:
    """The bucket's :class:`ColumnLayout`, made once per layout: its cached properties (matrices, offsets,
    column starts) are then computed once, not at every step of every bucket."""
    key = ("layout", shapes)
    layout = state.workspace.get(key)
    if layout is None:
        layout = state.workspace[key] = ColumnLayout(shapes)
    return layout
