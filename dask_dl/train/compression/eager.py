"""The eager torch path of the 1-bit hooks: the reference the fused kernels are tested against, and the path for
tensors on a GPU (torch operations over whole blocks of a bucket, no Python loop over entries).

Its messages are byte for byte those of the fused path (same groups, stripes and layout), so the two paths can
be compared message by message and could even be mixed across ranks.
"""

# No ``from __future__ import annotations``: kept like the hooks'.
from typing import Any

import torch
import torch.distributed as dist

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
from dask_dl.train.compression.state import Future, OneBitState, gather_then, residuals


def onebit_eager(state: OneBitState, layout: ColumnLayout, names: list[str], buffer, key, *, two_stage) -> Future:
    """Quantize the bucket ``buffer`` (with error feedback), exchange, and return the future of the mean."""
    blocks = layout.blocks(buffer)  # 2-D views of the bucket, one per parameter
    state.settle()  # errors the fused kernels owe (a state they ran on: the eager path reads residuals whole)
    ws = state.workspace
    if state.error_feedback:  # the bucket is ours to change: add last step's error in place
        flat = residuals(state, "residuals", names, list(layout.shapes), buffer)
        for block, residual in zip(blocks, layout.blocks(flat), strict=True):
            block.add_(residual)
    bits, scales = quantize(blocks, workspace=ws, key=key)
    if state.error_feedback:
        rebuilt = [scratch_like(ws, ("approx", *key, i), b, torch.float32) for i, b in enumerate(blocks)]
        dequantize(bits, scales, out=rebuilt, workspace=ws, key=key)
        for block, approx, residual in zip(blocks, rebuilt, layout.blocks(flat), strict=True):
            torch.sub(block, approx, out=residual)
    if two_stage:
        return _two_stage(state, layout, names, bits, scales, buffer, key)
    return _all_gather(state, layout, bits, scales, buffer, key)


def _average(messages: torch.Tensor, shapes, out: list[torch.Tensor], ws, key) -> None:
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

    return gather_then(state, message, gathered, average, n)


def _stripe_message(layout: ColumnLayout, pieces, bits, scales, size: int) -> torch.Tensor:
    """The message of the pieces' columns: their scales, then their signs, zero-padded to ``size`` bytes."""
    columns = torch.tensor(layout.piece_columns(pieces), dtype=torch.long, device=scales.device)
    piece_bits = [bits[i][:, lo:hi] for i, lo, hi in pieces]
    return encode(piece_bits, scales[columns], size, transposed=[s.transposed for s in layout.piece_shapes(pieces)])


def _two_stage(state, layout: ColumnLayout, names, bits, scales, buffer, key) -> Future:
    n, rank = state.world_size, state.rank
    stripes = layout.stripe_pieces(names, n)
    shapes = [layout.piece_shapes(p) for p in stripes]
    size = max(message_size(sum(s.rows * s.cols for s in sh), sum(s.cols for s in sh)) for sh in shapes)
    # Stage 1: every rank sends stripe k's signs and scales to rank k.
    send = torch.cat([_stripe_message(layout, p, bits, scales, size) for p in stripes])
    received = torch.empty_like(send)
    if n > 1:
        state.count(send, (n - 1) / n)
        dist.all_to_all_single(received, send, group=state.process_group)
    else:
        received.copy_(send)
    own = stripes[rank]
    ws = state.workspace
    mean = [
        scratch(ws, ("mean", *key, j), buffer, shape[:2], torch.float32, transposed=shape.transposed)
        for j, shape in enumerate(shapes[rank])
    ]
    _average(received.view(n, size), shapes[rank], mean, ws, key)
    # Stage 2: re-quantize the averaged stripe with the server residual, then all-gather the stripes.
    if state.error_feedback:
        server = layout.piece_blocks(residuals(state, "server_residuals", names, list(layout.shapes), buffer), own)
        for block, residual in zip(mean, server, strict=True):
            block.add_(residual)
    # column_major: a column's sum does not depend on which other columns share its block
    bits2, scales2 = quantize(mean, column_major=True, workspace=ws, key=("server", *key))
    if state.error_feedback:
        rebuilt = [scratch_like(ws, ("approx2", *key, j), b, torch.float32) for j, b in enumerate(mean)]
        dequantize(bits2, scales2, out=rebuilt, workspace=ws, key=key)
        for block, approx, residual in zip(mean, rebuilt, server, strict=True):
            torch.sub(block, approx, out=residual)
    message = encode(bits2, scales2, size, transposed=[s.transposed for s in shapes[rank]])
    gathered = message.new_empty(n * size)

    def assemble(_: Any = None) -> torch.Tensor:
        for k, pieces in enumerate(stripes):
            stripe_bits, stripe_scales = decode(gathered.view(n, size)[k], shapes[k])
            dequantize(stripe_bits, stripe_scales, out=layout.piece_blocks(buffer, pieces), workspace=ws, key=key)
        return buffer

    return gather_then(state, message, gathered, assemble, n)
