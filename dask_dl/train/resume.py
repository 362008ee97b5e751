"""What a trainer takes from a checkpoint to go on: its compressor state, its generator state, and where the epoch
stands (a step checkpoint's loader position and loss accumulators).

At the world size the checkpoint was written with, rank ``r`` takes back exactly rank ``r``'s state: error-feedback
residuals, random generators, loss sum and example count, and the loader goes on at the same step with the same
batches, so the run goes on bit for bit as if it had not stopped. At another world size (a restart on fewer
trainers) the residuals are reset (each belonged to one old rank's share of the data: there is no right way to
hand them to new ranks), the generators are reseeded from ``(seed, epoch, rank, segment)``, the optimizer and the
model are kept, the remaining rows of the epoch are re-sharded (:mod:`dask_dl.data.position`), and the old ranks'
loss sums and step counts are folded into the new ranks' (old ranks beyond the new world size into rank 0's), so
the epoch's ``train_loss`` still averages every step taken. Nothing here touches the process group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from dask_dl.data.position import EpochPosition

__all__ = ["EpochResume", "compressor_state", "epoch_resume", "partial_state"]

logger = logging.getLogger("dask_dl.train")


@dataclass
class EpochResume:
    """Where rank ``rank`` goes on in a partly trained epoch."""

    position: EpochPosition  # made ``resumed`` for this world size and batch size
    rng: dict[str, Any] | None  # the rank's generator states at the checkpoint (same world size), else None
    loss_acc: torch.Tensor  # the sum of this rank's step losses so far in the epoch
    examples: int
    steps: int  # the steps whose losses loss_acc sums


def partial_state(loss_acc: torch.Tensor, *, examples: int, steps: int) -> dict[str, Any]:
    """One rank's loss accumulators for a step checkpoint (plain tensors and ints)."""
    return {"loss_acc": loss_acc.detach().cpu().clone(), "examples": int(examples), "steps": int(steps)}


def compressor_state(
    checkpoint: dict[str, Any], fresh: dict[str, Any], *, rank: int, world_size: int
) -> dict[str, Any]:
    """The compressor state rank ``rank`` of ``world_size`` loads from ``checkpoint``.

    ``fresh`` is the state of a newly built compressor; at another world size than the checkpoint's it is kept
    (no residuals), with the step and byte counters of the old rank, so warm-up and accounting go on.
    """
    states = checkpoint["compressor"]
    if len(states) == world_size:
        return states[rank]
    old = states[min(rank, len(states) - 1)]
    logger.info(
        "rank %d: the checkpoint is of %d trainers, this run has %d: error-feedback residuals start from zero "
        "(optimizer and weights kept)",
        rank,
        len(states),
        world_size,
    )
    return {**fresh, **{k: old[k] for k in ("step", "bytes_sent", "wire_bytes") if k in old}}


def epoch_resume(
    checkpoint: dict[str, Any], *, rank: int, world_size: int, batch_size: int, data_world: int | None = None
) -> EpochResume | None:
    """Where rank ``rank`` goes on in the checkpoint's epoch; None for an epoch checkpoint (the next epoch starts).

    ``data_world`` is how many trainers read distinct data (a pipeline's stages share one position in the data:
    ``world_size // stages``); default ``world_size``. Loss sums and generators are per trainer.
    """
    if checkpoint.get("position") is None:
        return None
    saved = EpochPosition.from_dict(checkpoint["position"])
    position = saved.resumed(world_size=data_world or world_size, batch_size=batch_size)
    partial = list(checkpoint["partial"])
    same = len(partial) == world_size and position.segments == saved.segments
    mine = [partial[rank]] if rank < len(partial) else []
    if not same and rank == 0:
        mine += partial[world_size:]  # the old ranks that have no new rank of their number
    if not mine:
        zero = torch.zeros((), dtype=partial[0]["loss_acc"].dtype)
        mine = [{"loss_acc": zero, "examples": 0, "steps": 0}]
    loss_acc = mine[0]["loss_acc"].clone()
    for extra in mine[1:]:
        loss_acc = loss_acc + extra["loss_acc"]
    return EpochResume(
        position=position,
        rng=checkpoint["rng"][rank] if same else None,
        loss_acc=loss_acc,
        examples=sum(int(p["examples"]) for p in mine),
        steps=sum(int(p["steps"]) for p in mine),
    )
