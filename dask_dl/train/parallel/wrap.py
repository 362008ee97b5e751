"""The trainer's side of ``parallel=``: wrap a freshly built model for FSDP or a pipeline stage."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["wrap_model"]


def wrap_model(spec: Any, model: nn.Module, *, device: torch.device, rank: int, world_size: int) -> Any:
    """Return the :class:`~.fsdp.ShardedModel` or :class:`~.pipeline.PipelineModel` of ``spec.parallel``.

    The result has ``module`` (the parameters this rank trains: all of them sharded, or its stage's), ``train()``,
    ``forward_backward(x, y, loss_fn)``, ``evaluate(batches)``, ``counts_examples``, ``data_world`` (trainers
    reading distinct data), and the collective checkpoint methods ``checkpoint_parts`` and ``load``.
    """
    shape = (spec.channels, spec.input_size, spec.input_size)  # one image
    if spec.parallel == "fsdp":
        from dask_dl.train.parallel.fsdp import ShardedModel

        return ShardedModel(
            model, device=device, world_size=world_size, input_shape=shape, compression=spec.compression
        )
    from dask_dl.train.parallel.pipeline import PipelineModel

    return PipelineModel(
        model,
        name=spec.model_name,
        device=device,
        rank=rank,
        world_size=world_size,
        stages=spec.stages,
        microbatches=spec.microbatches,
        schedule=spec.pipeline_schedule,
        microbatch=spec.batch_size // spec.microbatches,
        input_shape=shape,
    )
