"""Scoring a model on a site, where the site's data is: a task that returns metrics only.

:func:`score` runs on one of a site's workers (or in the coordinator's process for a test split it can read). It
builds the model from weights sent to it, predicts the samples it is given with the training loader
(:class:`dask_dl.data.loader.ChunkLoader`, so preprocessing is the trainers'), and returns numbers: per-label
AUROC (:func:`dask_dl.metrics.auroc`), their mean, the loss and the sample count. Predictions never leave it.
Given several weights (the ``ensemble`` protocol) it scores the mean of their probabilities, as
:class:`Ensemble` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dask_dl.normalize import DEFAULT_NORMALIZATION

__all__ = ["Ensemble", "ModelSpec", "build", "score"]


@dataclass(frozen=True)
class ModelSpec:
    """How to build the run's model anywhere: its name (a registry name, and its target; ``torchvision:NAME``,
    ``timm:NAME``, or a factory's import path), options, labels, task, batch size."""

    name: str
    labels: tuple[str, ...]
    task: str
    input_size: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    target: Any = None
    batch_size: int = 32
    channels: int = 1
    normalization: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_NORMALIZATION))


def build(spec: ModelSpec, state: dict[str, Any] | None = None) -> Any:
    """The model of ``spec`` with ``state`` loaded (fresh seeded weights without it), in eval mode on the CPU."""
    from dask_dl.models import MODELS
    from dask_dl.models.source import model_source

    if spec.name not in MODELS and spec.target is not None:  # registered in the coordinator's process
        MODELS.register(spec.name, spec.target)
    net = model_source(spec.name, spec.kwargs).build(num_outputs=len(spec.labels), in_channels=spec.channels)
    if state is not None:
        net.load_state_dict(state)
    return net.eval()


class Ensemble(torch.nn.Module):
    """A module whose logits are those of the mean probability of ``members`` (sigmoid, or softmax for multiclass).

    Its sigmoid (softmax) is the mean of the members' probabilities, so it exports to ONNX like any model.
    """

    def __init__(self, members: list[torch.nn.Module], task: str) -> None:
        super().__init__()
        self.members = torch.nn.ModuleList(members)
        self.task = task

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.task == "multiclass":
            p = torch.stack([m(x).softmax(dim=1) for m in self.members]).mean(dim=0)
            return torch.log(p.clamp_min(1e-12))
        p = torch.stack([m(x).sigmoid() for m in self.members]).mean(dim=0).clamp(1e-7, 1 - 1e-7)
        return torch.log(p) - torch.log1p(-p)


def score(store: str, samples: np.ndarray, states: list[dict[str, Any]], spec: ModelSpec) -> dict[str, float]:
    """Score ``states`` (one model, or an ensemble of several) on ``samples`` of ``store``; return metrics only.

    Returns
    -------
    dict
        ``n``, ``loss`` (mean binary cross-entropy, or cross-entropy for multiclass, of the mean probabilities),
        ``auroc_mean`` and ``auroc_<label>`` per label (NaN where a label has one class only).
    """
    from dask_dl.data.loader import ChunkLoader
    from dask_dl.metrics import auroc

    net = build(spec, states[0]) if len(states) == 1 else Ensemble([build(spec, s) for s in states], spec.task)
    net.eval()
    loader = ChunkLoader(  # one pass: nothing to keep
        store,
        np.asarray(samples),
        batch_size=spec.batch_size,
        shuffle=False,
        drop_last=False,
        cache=0,
        normalization=spec.normalization,
    )
    probs, truth = [], []
    try:
        with torch.no_grad():
            for x, y in loader.epoch(0):
                logits = net(x)
                probs.append((logits.softmax(dim=1) if spec.task == "multiclass" else logits.sigmoid()).numpy())
                truth.append(y.numpy().astype(np.uint8))
    finally:
        loader.close()
    p = np.concatenate(probs).astype(np.float64)
    y = np.concatenate(truth)
    eps = 1e-7
    if spec.task == "multiclass":
        loss = float(-np.mean(np.log(np.clip(p[np.arange(len(y)), y.argmax(1)], eps, 1))))
    else:
        q = np.clip(p, eps, 1 - eps)
        loss = float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q)))
    per_label = np.atleast_1d(auroc(y, p))
    finite = per_label[np.isfinite(per_label)]
    out = {"n": int(len(y)), "loss": loss, "auroc_mean": float(finite.mean()) if len(finite) else math.nan}
    out.update({f"auroc_{label}": float(v) for label, v in zip(spec.labels, per_label, strict=True)})
    return out
