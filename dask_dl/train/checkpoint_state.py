"""A trainer's checkpoint dict (the contract of :mod:`dask_dl.checkpoint`), gathered from every rank.

:func:`checkpoint_state` is collective: every rank of a run calls it at the same step. It gathers each rank's
compressor and generator states (and, inside an epoch, its loss accumulators), takes the model and optimizer from
the trainer (consolidated on rank 0 for ``fsdp`` and ``pipeline``) and builds the dict that is written or kept.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.distributed as dist

from dask_dl.train.checkpoint import rng_state, to_cpu


def checkpoint_state(
    trainer: Any,
    epoch: int,
    *,
    history: list[dict[str, Any]],
    directory: str | None,
    position: Any = None,
    partial: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Gather every rank's compressor and RNG state and build the checkpoint dict of completed epoch ``epoch``.

    ``trainer`` is a set-up :class:`~dask_dl.train.actor.TrainingActor`. With ``directory``, rank 0 gathers,
    writes it there (atomically) and returns it; other ranks return None. Without one, every rank gets every rank's
    state (and rank 0's model buffers, the checkpointed ones) and returns the same checkpoint, so the driver can
    fetch it from any trainer that survives a failure. ``position`` (an
    :class:`~dask_dl.data.position.EpochPosition`) and ``partial`` (this rank's loss accumulators) make it a step
    checkpoint inside epoch ``position.epoch``.
    """
    from dask_dl.checkpoint import FORMAT, checkpoint_name
    from dask_dl.normalize import DEFAULT_NORMALIZATION
    from dask_dl.train.building import source_of_spec
    from dask_dl.train.checkpoint import save_checkpoint, step_checkpoint_name
    from dask_dl.train.resume import partial_state

    mine: dict[str, Any] = {"compressor": to_cpu(trainer.compressor.state_dict()), "rng": rng_state()}
    if partial is not None:
        mine["partial"] = partial_state(**partial)
    name = checkpoint_name(epoch) if position is None else step_checkpoint_name(position.epoch, trainer.global_step)
    # fsdp / pipeline: collective (shards written, the model consolidated on rank 0)
    parts = (
        {}
        if trainer.parallel is None
        else trainer.parallel.checkpoint_parts(trainer.optimizer, name=name, directory=directory)
    )
    model = parts["model"] if parts else to_cpu(trainer.ddp.module.state_dict())
    if directory is None and trainer.parallel is None:
        if trainer.rank == 0:
            mine["buffers"] = {k: v for k, v in model.items() if k in dict(trainer.ddp.module.named_buffers())}
        gathered: list[Any] | None = [None] * trainer.world_size
        dist.all_gather_object(gathered, mine)
        model.update(gathered[0]["buffers"])  # every rank keeps rank 0's buffers: the ones training goes on with
    else:  # to a directory, or a sharded model (only rank 0 holds it whole)
        gathered = [None] * trainer.world_size if trainer.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if trainer.rank != 0:
            return None
    spec = trainer.spec
    checkpoint = {
        "format": FORMAT,
        "model_name": spec.model_name,
        "model_kwargs": dict(spec.model_kwargs),
        "model_source": source_of_spec(spec).to_dict(),
        "loss": spec.loss if isinstance(spec.loss, str) else None,
        "tuning": trainer.tuner.state_dict(),
        "scaler": to_cpu(trainer.precision.state_dict()),
        "model": model,
        "labels": list(spec.labels),
        "task": spec.task,
        "input_size": int(spec.input_size),
        "in_channels": int(spec.channels),
        "normalization": dict(spec.normalization or DEFAULT_NORMALIZATION),
        "epoch": int(epoch),
        "optimizer": parts["optimizer"] if parts else to_cpu(trainer.optimizer.state_dict()),
        "compressor": [g["compressor"] for g in gathered],
        "rng": [g["rng"] for g in gathered],
        "history": [plain(row) for row in history],
        "parallel": parts.get("parallel", {"kind": "ddp", "trainers": trainer.world_size}),
        "global_step": int(trainer.global_step),
    }
    if position is not None:
        checkpoint["position"] = position.to_dict()
        checkpoint["partial"] = [g["partial"] for g in gathered]
    if directory is not None and trainer.rank == 0:
        save_checkpoint(checkpoint, directory, name=name)
    return checkpoint


def kept(checkpoint: dict[str, Any], spec: Any) -> dict[str, Any]:
    """What rank 0 keeps for the driver: the whole checkpoint, or only the weights (``spec.weights_only``)."""
    if not spec.weights_only:
        return checkpoint
    return {"model": checkpoint["model"], "epoch": checkpoint["epoch"], "model_name": checkpoint["model_name"]}


def plain(row: dict[str, Any]) -> dict[str, Any]:
    """History rows as plain Python values (``weights_only`` loading takes no numpy scalars)."""
    out = {}
    for key, value in row.items():
        if isinstance(value, np.generic):
            value = value.item()
        out[str(key)] = value
    return out
