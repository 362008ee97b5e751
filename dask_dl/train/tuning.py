"""Fine-tuning controls: a frozen backbone, a separate head learning rate, learning-rate schedules.

:func:`check_schedule` checks ``fit(schedule=...)`` on the driver (no torch). On the trainer, :class:`Tuner`
owns the optimizer's learning rates: every optimizer step it sets each parameter group's ``lr`` to
``base * schedule factor``, with the backbone's at 0 while it is frozen.

Freezing keeps the backbone exactly as loaded while ``epoch < freeze_epochs``: its learning rate is 0 (so neither
the gradient, momentum nor weight decay moves it) and its BatchNorm layers stay in eval mode (their running
statistics are not updated). Its gradients are still computed and exchanged: DDP expects a gradient for every
parameter it was built with, and rebuilding DDP per phase would drop the compressor's error-feedback state. When
the backbone thaws, its optimizer state (momentum, Adam moments gathered at lr 0) is cleared.

Schedules (``schedule=`` a name, or a dict with ``name`` and options), over the run's optimizer steps ``T``:

``constant``
    the default;
``cosine``
    ``min_factor + (1 - min_factor) * (1 + cos(pi * t / T)) / 2``;
``warmup-cosine``
    linear warm-up over ``warmup_steps`` (default 5% of ``T``), then cosine to ``min_factor``;
``onecycle``
    torch's one-cycle shape: from ``1/div_factor`` up to 1 over ``pct_start * T`` steps, then down to
    ``1/(div_factor * final_div_factor)``, both with cosine annealing;
``plateau``
    multiply by ``factor`` after ``patience`` epochs without a lower validation loss (``min_factor`` at least).

The schedule's state (steps taken, the plateau's best loss and count) is in every checkpoint, so a resumed run
continues the curve where it stopped.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

from dask_dl.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

__all__ = ["SCHEDULES", "Tuner", "check_schedule", "schedule_factor"]

SCHEDULES: dict[str, dict[str, float]] = {
    "constant": {},
    "cosine": {"min_factor": 0.0},
    "warmup-cosine": {"warmup_steps": -1, "min_factor": 0.0},
    "onecycle": {"pct_start": 0.3, "div_factor": 25.0, "final_div_factor": 1e4},
    "plateau": {"factor": 0.1, "patience": 2, "min_factor": 0.0},
}


def check_schedule(schedule: Any) -> dict[str, Any]:
    """Return ``schedule`` as a dict ``{"name": ..., option: value}`` with every option filled in.

    Raises
    ------
    ConfigurationError
        An unknown name or option, or an option out of range.
    """
    if schedule is None:
        schedule = "constant"
    if isinstance(schedule, str):
        schedule = {"name": schedule}
    if not isinstance(schedule, dict) or not isinstance(schedule.get("name"), str):
        raise ConfigurationError(
            f"schedule must be a name ({', '.join(SCHEDULES)}) or a dict with 'name', got {schedule!r}; pass e.g. "
            "schedule='warmup-cosine' or schedule={'name': 'warmup-cosine', 'warmup_steps': 100}"
        )
    name = schedule["name"]
    if name not in SCHEDULES:
        raise ConfigurationError(f"unknown schedule {name!r}: the schedules are {', '.join(SCHEDULES)}")
    defaults = SCHEDULES[name]
    options = {k: v for k, v in schedule.items() if k != "name"}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ConfigurationError(
            f"schedule {name!r} has no option(s) {unknown}; its options are {list(defaults) or 'none'}"
        )
    out: dict[str, Any] = {"name": name}
    for key, default in defaults.items():
        value = options.get(key, default)
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            raise ConfigurationError(f"schedule option {key} must be a number, got {value!r}")
        bad = (
            (key in ("min_factor", "factor") and not 0 <= value <= 1)
            or (key == "pct_start" and not 0 < value < 1)
            or (key in ("div_factor", "final_div_factor") and value < 1)
            or (key == "patience" and (value < 0 or int(value) != value))
            or (key == "warmup_steps" and value != -1 and (value < 0 or int(value) != value))
        )
        if bad:
            raise ConfigurationError(f"schedule {name!r}: option {key}={value!r} is out of range")
        out[key] = int(value) if key in ("patience", "warmup_steps") else float(value)
    return out


def schedule_factor(schedule: dict[str, Any], step: int, total: int) -> float:
    """The factor of the base learning rate at optimizer step ``step`` of ``total`` (per-step schedules)."""
    name, t, total = schedule["name"], float(step), float(max(total, 1))
    if name in ("constant", "plateau"):
        return 1.0
    if name == "cosine":
        return _cosine(schedule["min_factor"], min(t / total, 1.0))
    if name == "warmup-cosine":
        warmup = schedule["warmup_steps"] if schedule["warmup_steps"] >= 0 else max(1, round(0.05 * total))
        if t < warmup:
            return (t + 1) / warmup
        return _cosine(schedule["min_factor"], min((t - warmup) / max(total - warmup, 1.0), 1.0))
    # onecycle, as torch.optim.lr_scheduler.OneCycleLR (anneal_strategy="cos", three_phase=False)
    start, low = 1.0 / schedule["div_factor"], 1.0 / (schedule["div_factor"] * schedule["final_div_factor"])
    peak = max(schedule["pct_start"] * total - 1, 1.0)
    if t <= peak:
        return start + (1.0 - start) * (1 - math.cos(math.pi * t / peak)) / 2
    return low + (1.0 - low) * (1 + math.cos(math.pi * min((t - peak) / max(total - 1 - peak, 1.0), 1.0))) / 2


def _cosine(min_factor: float, progress: float) -> float:
    return min_factor + (1.0 - min_factor) * (1 + math.cos(math.pi * progress)) / 2


class Tuner:
    """The learning rates of one trainer's optimizer: parameter groups, freezing and the schedule.

    Parameters
    ----------
    model
        The unwrapped model.
    head
        Name of its head module (:func:`dask_dl.models.source.head_name`), or None (one group).
    lr, head_lr
        Base learning rates of the backbone and the head (``head_lr`` None: ``lr``).
    freeze_epochs
        Epochs with the backbone frozen.
    schedule
        A :func:`check_schedule` dict.
    total_steps
        Optimizer steps of the whole run (epochs x optimizer steps per epoch).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        head: str | None,
        lr: float,
        head_lr: float | None,
        freeze_epochs: int,
        schedule: dict[str, Any],
        total_steps: int,
    ) -> None:
        self.model, self.schedule, self.total_steps = model, dict(schedule), int(total_steps)
        self.freeze_epochs = int(freeze_epochs)
        if (head_lr is not None or freeze_epochs) and head is None:
            raise ConfigurationError(
                "head_lr= and freeze_epochs= need a model with a head (a last torch.nn.Linear layer); this model has "
                "none: train it without them"
            )
        prefix = f"{head}." if head is not None else None
        named = list(model.named_parameters())
        self.head_params = [p for n, p in named if prefix is not None and n.startswith(prefix)]
        head_ids = {id(p) for p in self.head_params}
        self.backbone_params = [p for _, p in named if id(p) not in head_ids]
        norms = _norm_types()
        self.backbone_norms = [
            m for n, m in model.named_modules() if isinstance(m, norms) and not (prefix and n.startswith(prefix))
        ]
        self.base = {"backbone": float(lr), "head": float(lr if head_lr is None else head_lr)}
        self.step = 0
        self.plateau = {"best": math.inf, "bad_epochs": 0, "scale": 1.0}
        self.frozen = False

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: ``backbone`` then ``head`` (one group when there is no head)."""
        groups = [{"params": self.backbone_params, "lr": self.base["backbone"], "name": "backbone"}]
        if self.head_params:
            groups.append({"params": self.head_params, "lr": self.base["head"], "name": "head"})
        return groups

    def start_epoch(self, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        """Freeze or thaw the backbone for ``epoch`` and set the learning rates of the next step."""
        frozen = epoch < self.freeze_epochs
        if self.frozen and not frozen:  # thawing: forget what the optimizer gathered at lr 0
            for p in self.backbone_params:
                optimizer.state.pop(p, None)
        self.frozen = frozen
        self.set_lrs(optimizer)

    def train_mode(self) -> None:
        """After ``model.train()``: keep the frozen backbone's normalization statistics as they are."""
        if self.frozen:
            for m in self.backbone_norms:
                m.eval()

    def set_lrs(self, optimizer: torch.optim.Optimizer) -> None:
        """Set every group's ``lr`` for the optimizer step about to be taken."""
        factor = schedule_factor(self.schedule, self.step, self.total_steps) * self.plateau["scale"]
        for group in optimizer.param_groups:
            name = group.get("name", "backbone")
            group["lr"] = 0.0 if (self.frozen and name == "backbone") else self.base[name] * factor

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """After an optimizer step: advance the schedule."""
        self.step += 1
        self.set_lrs(optimizer)

    def end_epoch(self, val_loss: float, optimizer: torch.optim.Optimizer) -> None:
        """After validation: the plateau schedule's bookkeeping (every rank sees the same loss)."""
        if self.schedule["name"] != "plateau" or not math.isfinite(val_loss):
            return
        p = self.plateau
        if val_loss < p["best"]:
            p["best"], p["bad_epochs"] = float(val_loss), 0
        else:
            p["bad_epochs"] += 1
            if p["bad_epochs"] > self.schedule["patience"]:
                p["scale"] = max(p["scale"] * self.schedule["factor"], self.schedule["min_factor"])
                p["bad_epochs"] = 0
        self.set_lrs(optimizer)

    def lrs(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """The history row's learning rates: ``lr`` (backbone) and ``head_lr`` (when the head has its own group)."""
        out = {}
        for group in optimizer.param_groups:
            out["head_lr" if group.get("name") == "head" else "lr"] = float(group["lr"])
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint: steps taken and the plateau's state."""
        return {"step": int(self.step), "plateau": dict(self.plateau)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the schedule of a checkpoint."""
        self.step = int(state.get("step", 0))
        self.plateau.update(state.get("plateau") or {})


def _norm_types() -> tuple[type, ...]:
    from torch import nn

    return (nn.modules.batchnorm._BatchNorm,)
