"""What one trainer holds for training: parameters, gradients and optimizer state, per ``parallel`` mode.

The estimate is made on the driver before anything is placed, from the model built on torch's ``meta`` device
(no memory, no initialization cost). It counts the model state only, not activations (they depend on the batch
and the input size), nor DDP's gradient buckets:

``ddp``       ``P + G + O``: every trainer holds all of it;
``fsdp``      ``(P + G + O) / trainers`` plus the largest block gathered whole (its parameters and gradients) while
              it computes;
``pipeline``  ``P + G + O`` of the largest stage.

``O`` is 1 x parameters for SGD with momentum (0 without), 2 x for AdamW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from dask_dl.errors import ConfigurationError

__all__ = ["MemoryEstimate", "check_memory_budget", "estimate_memory", "parse_budget"]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one trainer holds for the model's state (the largest of the trainers)."""

    parallel: str
    trainers: int
    parameters: int
    gradients: int
    optimizer: int
    gathered: int = 0  # fsdp: the largest block's parameters and gradients, unsharded while it computes

    @property
    def total(self) -> int:
        """All of it, in bytes."""
        return self.parameters + self.gradients + self.optimizer + self.gathered

    def describe(self) -> str:
        """``"652.84 MiB (parameters 217.61 MiB + gradients ... )"``: the total and its parts, for messages."""
        from dask.utils import format_bytes

        parts = [
            f"parameters {format_bytes(self.parameters)}",
            f"gradients {format_bytes(self.gradients)}",
            f"optimizer state {format_bytes(self.optimizer)}",
        ]
        if self.gathered:
            parts.append(f"largest block gathered {format_bytes(self.gathered)}")
        return f"{format_bytes(self.total)} ({' + '.join(parts)})"


def parse_budget(value: Any) -> int | None:
    """Return a memory budget in bytes from an int or a string such as ``"2 GiB"``; None stays None.

    Raises
    ------
    ConfigurationError
        Not a positive number of bytes.

    Examples
    --------
    >>> parse_budget("2 GiB")
    2147483648
    """
    from dask.utils import parse_bytes

    if value is None:
        return None
    try:
        parsed = parse_bytes(value) if isinstance(value, str) else value
    except ValueError:
        parsed = None
    if isinstance(parsed, int) and not isinstance(parsed, bool) and parsed > 0:
        return int(parsed)
    raise ConfigurationError(
        f"memory_budget must be a positive number of bytes or a size such as '2 GiB', got {value!r}; pass e.g. "
        "memory_budget='2 GiB' (or set dask-dl.train.memory-budget)"
    )


def estimate_memory(
    model: nn.Module, *, parallel: str, trainers: int, stages: int = 1, optimizer: str = "sgd", momentum: float = 0.9
) -> MemoryEstimate:
    """Estimate the bytes of model state the largest trainer holds (see the module's description).

    Parameters
    ----------
    model
        The model (any device, ``meta`` included).
    parallel, trainers, stages
        How the run shares the model.
    optimizer, momentum
        ``"sgd"`` (state only with ``momentum > 0``) or ``"adamw"``.
    """
    from dask_dl.train.parallel.split import assign_stages, blocks

    slots = 2 if optimizer == "adamw" else (1 if momentum > 0 else 0)

    def nbytes(modules: list[nn.Module]) -> int:
        seen = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}
        return sum(p.numel() * p.element_size() for p in seen.values())

    if parallel == "pipeline":
        groups = assign_stages(blocks(model), stages)
        biggest = max(nbytes(group) for group in groups)
        return MemoryEstimate(parallel, trainers, biggest, biggest, slots * biggest)
    whole = nbytes([model])
    if parallel == "fsdp":
        shard = math.ceil(whole / trainers)
        units = fsdp_units(model)
        largest = max((nbytes([u]) for u in units), default=whole) if units else whole
        return MemoryEstimate(parallel, trainers, shard, shard, slots * shard, gathered=2 * largest)
    return MemoryEstimate(parallel, trainers, whole, whole, slots * whole)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one by one: the model's pipeline blocks, else its children, that hold parameters."""
    from dask_dl.train.parallel.split import blocks

    try:
        parts = blocks(model)
    except ConfigurationError:
        parts = list(model.children())
    return [p for p in parts if any(True for _ in p.parameters())]


def check_memory_budget(
    model_name: str,
    model_kwargs: dict[str, Any],
    *,
    num_outputs: int,
    in_channels: int,
    budget: int,
    parallel: str,
    trainers: int,
    stages: int,
    optimizer: str,
    momentum: float,
) -> MemoryEstimate:
    """Estimate what a trainer of this run holds and raise when it is over ``budget`` bytes.

    Raises
    ------
    ConfigurationError
        Over the budget: the message gives both numbers and the modes that fit.
    """
    from dask.utils import format_bytes

    from dask_dl.train.parallel.split import build_bare

    model = build_bare(model_name, model_kwargs, num_outputs=num_outputs, in_channels=in_channels)
    common = dict(trainers=trainers, optimizer=optimizer, momentum=momentum)
    need = estimate_memory(model, parallel=parallel, stages=stages, **common)
    if need.total <= budget:
        return need
    fsdp = estimate_memory(model, parallel="fsdp", **common)
    hints = []
    if parallel != "fsdp" and fsdp.total <= budget:
        hints.append(f"use parallel='fsdp' (about {format_bytes(fsdp.total)} per trainer with {trainers} trainers)")
    if parallel != "pipeline" and trainers > 1:
        try:
            pipe = estimate_memory(model, parallel="pipeline", stages=trainers, **common)
        except ConfigurationError:  # a model that cannot be split: no pipeline hint
            pipe = None
        if pipe is not None and pipe.total <= budget:
            hints.append(f"parallel='pipeline', stages={trainers} (about {format_bytes(pipe.total)} per trainer)")
    hint = " or ".join(hints) if hints else "use more trainers with parallel='fsdp', or a smaller model"
    raise ConfigurationError(
        f"model {model_name!r} needs about {need.describe()} per trainer with parallel={parallel!r}, over the "
        f"memory budget of {format_bytes(budget)} per trainer (memory_budget / dask-dl.train.memory-budget); {hint}"
    )
