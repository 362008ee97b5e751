"""Building a trainer's model and optimizer from its :class:`~dask_dl.train.spec.TrainerSpec`.

In this order, on every rank, before DDP wraps the model: build it (:class:`dask_dl.models.source.ModelSource`),
check that it fits the data with one dummy batch (so a wrong head or first layer fails before any epoch), load
``weights=`` (:func:`dask_dl.models.weights.load_weights`), switch on activation checkpointing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from dask_dl.models.source import ModelSource, check_fits
from dask_dl.train.precision import enable_activation_checkpointing

__all__ = ["build_trainer_model", "make_optimizer", "source_of_spec"]

logger = logging.getLogger("dask_dl.train")


def source_of_spec(spec: Any) -> ModelSource:
    """The spec's model source (specs made without one train the registry model ``spec.model_name``)."""
    if spec.model_source is not None:
        return spec.model_source
    return ModelSource("registry", spec.model_name, dict(spec.model_kwargs), target=spec.model_target)


def build_trainer_model(spec: Any, *, in_channels: int) -> tuple[nn.Module, dict[str, Any] | None]:
    """Return the trainer's model (on the CPU) and the report of its start weights (None without ``weights``).

    Raises
    ------
    ConfigurationError
        The model does not take the data's images or does not return one logit per label; the weights differ
        in shape beyond the first layer and the head; activation checkpointing on a model without known blocks.
    CheckpointError
        The weights file cannot be read safely.
    """
    from dask_dl.models.weights import describe, load_weights

    source = source_of_spec(spec)
    model = source.build(num_outputs=len(spec.labels), in_channels=in_channels)
    check_fits(model, name=source.name, in_channels=in_channels, input_size=int(spec.input_size), labels=spec.labels)
    report = None
    if spec.weights is not None:
        report = load_weights(model, spec.weights, name=source.name)
        logger.info("%s", describe(report, spec.weights))
    if spec.activation_checkpointing:
        enable_activation_checkpointing(model, name=source.name)
    return model, report


def make_optimizer(spec: Any, params: Any) -> torch.optim.Optimizer:
    """The run's optimizer over ``params`` (parameters or parameter groups)."""
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
