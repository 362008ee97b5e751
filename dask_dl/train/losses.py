"""Training losses: ``fit(loss=...)`` takes a name or a callable ``(logits, targets) -> loss``.

Targets are always the dataset's float 0/1 label matrix ``(batch, labels)``. The name decides the task unless the
dataset's does: ``bce`` is multi-label (a sigmoid per label, scored with per-label AUROC), ``ce`` single-label
(softmax over the labels, the target is the row's positive label); ``None`` keeps the dataset's task
(``multiclass`` datasets train with ``ce``, the others with ``bce``). A callable keeps the dataset's task, which
picks the validation activation, and must return the batch's mean loss (a scalar tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dask_dl.errors import ConfigurationError

__all__ = ["LOSSES", "check_loss", "loss_function"]

#: loss name -> the task it trains
LOSSES: dict[str, str] = {"bce": "multilabel", "ce": "multiclass"}


def check_loss(loss: Any, task: str) -> tuple[str | Callable, str]:
    """Return ``(loss, task)``: the loss name (or the callable) and the run's task.

    Raises
    ------
    ConfigurationError
        An unknown loss name, or something neither a name nor callable.
    """
    if loss is None:
        return ("ce" if task == "multiclass" else "bce"), task
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ConfigurationError(
                f"unknown loss {loss!r}: the losses are {', '.join(LOSSES)}, or pass a function "
                "(logits, targets) -> loss"
            )
        return loss, LOSSES[loss]
    if callable(loss):
        return loss, task
    raise ConfigurationError(
        f"loss must be a name ({', '.join(LOSSES)}) or a function (logits, targets) -> loss, got {type(loss).__name__}"
    )


def loss_function(loss: str | Callable) -> Callable[..., Any]:
    """Return ``f(logits, targets, reduction="mean"|"sum")`` for a checked loss (``sum``: over the batch)."""
    import torch.nn.functional as F

    if loss == "ce":

        def cross_entropy(logits, targets, reduction="mean"):
            return F.cross_entropy(logits.float(), targets.argmax(dim=1), reduction=reduction)

        return cross_entropy
    if loss == "bce":

        def binary_cross_entropy(logits, targets, reduction="mean"):
            per_image = F.binary_cross_entropy_with_logits(logits.float(), targets, reduction="none").mean(dim=1)
            return per_image.mean() if reduction == "mean" else per_image.sum()

        return binary_cross_entropy

    def user_loss(logits, targets, reduction="mean"):
        value = loss(logits, targets)
        if getattr(value, "ndim", None) != 0:
            raise ConfigurationError(
                f"the loss function {getattr(loss, '__name__', loss)!r} returned shape "
                f"{tuple(getattr(value, 'shape', ()))}; it must return the batch's mean loss, a scalar tensor"
            )
        return value if reduction == "mean" else value * logits.shape[0]

    return user_loss
