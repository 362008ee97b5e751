"""Model buffers (BatchNorm statistics) across the ranks of a process group.

A training forward normalizes with its batch's statistics, so buffers never touch the gradients: every rank
updates its own running statistics from its own batches, and only rank 0's are checkpointed. Before ranks
score a model, they take rank 0's (:func:`broadcast_buffers`), so every image is scored by the model the
checkpoint holds. DDP's own ``broadcast_buffers`` would send them at every forward instead: one more
collective a step, where the ranks wait for each other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def broadcast_buffers(module: nn.Module, *, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Give every rank of ``group`` (default: all) rank ``src``'s buffers of ``module`` (one broadcast, in float64;
    a collective of the group; ``src`` is a global rank)."""
    buffers = [b for b in module.buffers() if b.numel()]
    if not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in buffers])
    dist.broadcast(flat, src=src, group=group)
    offset = 0
    with torch.no_grad():
        for b in buffers:
            b.copy_(flat[offset : offset + b.numel()].view_as(b).to(b.dtype))
            offset += b.numel()
