"""Models larger than one trainer: fully sharded data parallel and pipeline stages, beside plain DDP.

``fit(..., parallel=...)`` picks how the trainers share the work:

============ ============================================================================================
``ddp``      every trainer holds the whole model, optimizer state and gradients; gradients are all-reduced
             by DistributedDataParallel, through the chosen compressor's comm hook (the default)
``fsdp``     torch's ``fully_shard`` (FSDP2): parameters, gradients and optimizer state are split across the
             trainers, each block's parameters are all-gathered for its forward and backward and its
             gradients reduce-scattered; checkpoints are sharded (``torch.distributed.checkpoint``) beside a
             consolidated ``epoch-NNNN.pt`` for export
``pipeline`` the model's blocks are split into ``stages`` consecutive stages on as many trainers; each batch is
             cut into ``microbatches`` that flow through the stages (``torch.distributed.pipelining``, GPipe
             or 1F1B schedule); ``trainers = stages * replicas``, the replicas of a stage all-reduce its
             gradients
============ ============================================================================================

Which gradient compressors apply where (checked by :func:`check_parallel` before anything is placed):
DDP's comm hooks (``fp16``, ``bf16``, ``powersgd``, ``onebit``, ``onebit2``) are a DDP mechanism and apply to
``parallel="ddp"``. FSDP reduce-scatters gradients itself: ``fp16`` and ``bf16`` apply to it as its
``MixedPrecisionPolicy(reduce_dtype=...)`` (gradients reduce-scattered in 16 bits from the first step: no
``warmup_steps``), the others do not. Pipeline stages send activations point to point, not gradient buckets: with
``pipeline`` only ``compression="none"`` applies (the gradient average of a stage's replicas is a plain
all-reduce).

This package's top level imports no torch: the driver checks options with it. The parts that run on the
trainers (:mod:`.fsdp`, :mod:`.pipeline`, :mod:`.split`, :mod:`.memory`) import torch.
"""

from __future__ import annotations

from typing import Any

from dask_dl.checks import one_of, positive_int
from dask_dl.errors import ConfigurationError, TrainingError

__all__ = ["FSDP_COMPRESSION", "PARALLEL", "SCHEDULES", "check_parallel", "check_resume", "data_shard"]

PARALLEL: tuple[str, ...] = ("ddp", "fsdp", "pipeline")
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
#: compressions that apply to FSDP: the dtype its reduce-scatter sends gradients in
FSDP_COMPRESSION: tuple[str, ...] = ("none", "fp16", "bf16")


def check_parallel(
    parallel: Any,
    *,
    trainers: int,
    batch_size: int,
    compression: str,
    stages: Any = None,
    microbatches: Any = None,
    schedule: Any = "1f1b",
) -> dict[str, Any]:
    """Check how the trainers share the model; return the plan (``stages`` 1 and ``microbatches`` 1 unless pipeline).

    Parameters
    ----------
    parallel
        ``"ddp"``, ``"fsdp"`` or ``"pipeline"``.
    trainers, batch_size, compression
        The run's (already checked) values.
    stages
        Pipeline stages (``parallel="pipeline"`` only); ``trainers`` must be a multiple of it.
    microbatches
        Micro-batches per batch (``parallel="pipeline"`` only; default ``stages``); must divide ``batch_size``.
    schedule
        ``"gpipe"`` or ``"1f1b"`` (1F1B needs ``microbatches >= stages``).

    Returns
    -------
    dict
        ``parallel``, ``stages``, ``microbatches`` and ``schedule``.

    Raises
    ------
    ConfigurationError
        An unknown mode or schedule, a compressor that does not apply to the mode, ``stages`` without pipeline,
        trainers that are not a multiple of ``stages``, or micro-batches that do not divide the batch.

    Examples
    --------
    >>> check_parallel("pipeline", trainers=4, batch_size=8, compression="none", stages=2)
    {'parallel': 'pipeline', 'stages': 2, 'microbatches': 2, 'schedule': '1f1b'}
    """
    parallel = one_of("parallel", parallel, PARALLEL)
    schedule = one_of("dask-dl.train.pipeline-schedule", schedule, SCHEDULES)
    applies = FSDP_COMPRESSION if parallel == "fsdp" else ("none",) if parallel == "pipeline" else None
    if applies is not None and compression not in applies:
        why = (
            "FSDP reduce-scatters gradients itself, in float32 or, with fp16/bf16, in that dtype"
            if parallel == "fsdp"
            else "pipeline stages send activations, not gradient buckets"
        )
        raise ConfigurationError(
            f"compression={compression!r} does not apply to parallel={parallel!r}: gradient compressors are DDP "
            f"comm hooks, and {why}; with parallel={parallel!r} only compression="
            f"{' or '.join(repr(c) for c in applies)} applies. Pass one of those, or parallel='ddp' to keep "
            f"compression={compression!r}"
        )
    if parallel != "pipeline":
        for name, value in (("stages", stages), ("microbatches", microbatches)):
            if value is not None and value != 1:
                raise ConfigurationError(
                    f"{name}={value!r} applies to parallel='pipeline' only (got parallel={parallel!r}); pass "
                    f"parallel='pipeline', {name}={value!r} or leave {name} out"
                )
        return dict(parallel=parallel, stages=1, microbatches=1, schedule=schedule)
    stages = positive_int("stages", 2 if stages is None else stages, example=2)
    if trainers % stages:
        raise ConfigurationError(
            f"trainers={trainers} is not a multiple of stages={stages}: a pipeline puts one stage on each of "
            f"stages trainers, and trainers = stages x replicas; pass trainers={stages * max(trainers // stages, 1)}"
        )
    microbatches = positive_int("microbatches", stages if microbatches is None else microbatches, example=stages)
    if batch_size % microbatches:
        raise ConfigurationError(
            f"microbatches={microbatches} does not divide batch_size={batch_size} (every micro-batch has the same "
            f"size); pass e.g. batch_size={microbatches * max(batch_size // microbatches, 1)}"
        )
    if schedule == "1f1b" and microbatches < stages:
        raise ConfigurationError(
            f"the 1f1b schedule needs at least as many micro-batches as stages (got microbatches={microbatches}, "
            f"stages={stages}); pass microbatches={stages} or set dask-dl.train.pipeline-schedule to 'gpipe'"
        )
    return dict(parallel=parallel, stages=stages, microbatches=microbatches, schedule=schedule)


def data_shard(parallel: str, stages: int, rank: int, world_size: int) -> tuple[int, int]:
    """Return ``(rank, world_size)`` of a trainer's share of the data.

    Every stage of one pipeline reads the same batches (the first stage needs the images, the last the labels),
    so a pipeline's trainers share one data rank: trainer ``r`` is stage ``r % stages`` of replica
    ``r // stages``. DDP and FSDP trainers each read their own share.

    Examples
    --------
    >>> data_shard("pipeline", 2, 3, 4)
    (1, 2)
    >>> data_shard("fsdp", 1, 3, 4)
    (3, 4)
    """
    if parallel != "pipeline":
        return rank, world_size
    return rank // stages, world_size // stages


def check_resume(checkpoint: dict[str, Any], path: str, *, parallel: str, stages: int) -> None:
    """Raise when the checkpoint at ``path`` was written with another ``parallel`` mode or number of stages.

    Raises
    ------
    TrainingError
        The message names the mode (and stages) to resume with.
    """
    written = checkpoint.get("parallel") or {"kind": "ddp"}
    kind, written_stages = written.get("kind", "ddp"), int(written.get("stages", 1))
    if kind != parallel or (kind == "pipeline" and written_stages != stages):
        with_stages = f", stages={written_stages}" if kind == "pipeline" else ""
        raise TrainingError(
            f"the checkpoint {path!r} was written with parallel={kind!r}{with_stages}, and this run has "
            f"parallel={parallel!r}{f', stages={stages}' if parallel == 'pipeline' else ''}: their model and optimizer "
            f"states are laid out differently; resume with parallel={kind!r}{with_stages}, or use a new checkpoint_dir"
        )
