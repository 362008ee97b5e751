"""Mixed precision, memory layout, gradient accumulation and activation checkpointing for one trainer.

``precision``
    ``"fp32"`` (default); ``"bf16"``: the forward pass under ``torch.autocast`` with bfloat16, on CPU and GPU
    (weights, gradients and the optimizer stay float32, so compressors see float32 gradients); ``"fp16"``:
    float16 autocast with a ``torch.amp.GradScaler``, on GPU trainers only (float16 autocast on a CPU is slow
    and has no scaler there: a ConfigurationError says to use bf16).
``channels_last``
    On a GPU trainer the model and every batch use ``torch.channels_last`` (faster convolutions on tensor cores).
    On a CPU trainer it is a no-op, said once in the log: the CPU kernels gain nothing from it here.
``accumulate``
    K micro-batches per optimizer step; the first K-1 backward passes run under DDP's ``no_sync`` (no
    communication), the K-th all-reduces the summed gradients through the compressor. Each micro-batch's loss is
    divided by K, so the step is that of one batch K times larger (global batch = batch x trainers x K).
``activation_checkpointing``
    Recompute each block's activations in backward instead of keeping them (``torch.utils.checkpoint``,
    non-reentrant). The blocks are the model's ``checkpoint_blocks()`` (the registry's models have one), or
    timm's ``set_grad_checkpointing``. BatchNorm running statistics are updated once per step, as without
    checkpointing (the recomputation runs with momentum 0).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch
from torch import nn

from dask_dl.errors import ConfigurationError
from dask_dl.train.options import PRECISIONS

__all__ = ["PRECISIONS", "Precision", "enable_activation_checkpointing"]

logger = logging.getLogger("dask_dl.train")


class Precision:
    """Autocast and gradient scaling of one trainer, for ``precision`` on ``device``.

    Raises
    ------
    ConfigurationError
        ``precision="fp16"`` on a CPU trainer.
    """

    def __init__(self, precision: str, device: torch.device, *, channels_last: bool = False) -> None:
        if precision == "fp16" and device.type != "cuda":
            raise ConfigurationError(
                f"precision='fp16' needs GPU trainers (float16 with a gradient scaler); this trainer runs on "
                f"{device.type}: use precision='bf16' on CPUs"
            )
        self.precision, self.device = precision, device
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        self.channels_last = bool(channels_last) and device.type == "cuda"
        if channels_last and not self.channels_last:
            logger.info("channels_last=True is a no-op on %s trainers (it speeds up GPU convolutions)", device.type)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context of a forward pass (a no-op in fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The model in the trainer's memory format (before DDP wraps it)."""
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """A batch in the trainer's memory format."""
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled under fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; under fp16 unscaled, skipped on non-finite gradients, and the scale updated."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (empty without one), for the checkpoint."""
        return dict(self.scaler.state_dict()) if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scaler's state of a checkpoint."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def enable_activation_checkpointing(model: nn.Module, *, name: str = "model") -> int:
    """Make ``model``'s blocks recompute their activations in backward; return how many blocks.

    Raises
    ------
    ConfigurationError
        The model has neither ``checkpoint_blocks()`` nor timm's ``set_grad_checkpointing``.
    """
    blocks = getattr(model, "checkpoint_blocks", None)
    if callable(blocks):
        found = list(blocks())
        for block in found:
            block.forward = functools.partial(_checkpointed, block, block.forward)
        return len(found)
    timm_switch = getattr(model, "set_grad_checkpointing", None)
    if callable(timm_switch):
        timm_switch(True)
        return -1
    raise ConfigurationError(
        f"activation_checkpointing=True needs to know the blocks of model {name!r}: give its class a method "
        "checkpoint_blocks() returning the modules to recompute (e.g. its residual blocks), or train without it"
    )


def _checkpointed(block: nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled():  # validation, export: nothing to save memory for
        return forward(*args, **kwargs)
    context = functools.partial(_contexts, block)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


def _contexts(block: nn.Module) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), _frozen_statistics(block)


@contextlib.contextmanager
def _frozen_statistics(block: nn.Module):
    """The recomputation in backward must not update BatchNorm running statistics a second time."""
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    saved = [(m.momentum, m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved, strict=True):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)
