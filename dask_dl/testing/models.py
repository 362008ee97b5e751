"""Small user models for tests and examples: a module and a factory importable as ``dask_dl.testing.models:...``.

:class:`TinyNet` has no BatchNorm, so that data-parallel training equals one process training on the same images
exactly (to float tolerance), whatever the per-trainer batch (accumulation tests compare batch sizes).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BrokenNet", "TinyNet", "broken_net", "tiny_net"]


class TinyNet(nn.Module):
    """Two stride-2 convolutions, global average pooling and a linear head (``fc``)."""

    def __init__(self, num_outputs: int = 2, in_channels: int = 1, *, width: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.fc = nn.Linear(2 * width, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(x.mean(dim=(2, 3)))

    def checkpoint_blocks(self) -> list[nn.Module]:
        """The modules activation checkpointing recomputes."""
        return [self.conv1, self.conv2]


def tiny_net(num_outputs: int, in_channels: int = 1, width: int = 4) -> TinyNet:
    """A factory for ``fit(model=tiny_net)``: called on every trainer with the data's labels and channels."""
    return TinyNet(num_outputs, in_channels, width=width)


class BrokenNet(TinyNet):
    """A :class:`TinyNet` whose training forward on a trainer (in a process group) raises torch's
    ``CheckpointException``, a ``BaseException`` as torch.distributed.checkpoint raises it: rank 1's disk is full.
    Tests that trainers hand such errors to the driver with their cause."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.training and dist.is_initialized():
            import traceback

            from torch.distributed.checkpoint.api import CheckpointException

            full = OSError(28, "No space left on device")
            raise CheckpointException("write", {1: (full, traceback.StackSummary())})
        return super().forward(x)


def broken_net(num_outputs: int, in_channels: int = 1) -> BrokenNet:
    """A factory for ``fit(model=broken_net)``."""
    return BrokenNet(num_outputs, in_channels)
