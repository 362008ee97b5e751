"""Fully sharded data parallel on the trainers: torch's ``fully_shard`` (FSDP2), sharded checkpoints.

Each trainer keeps ``1 / trainers`` of every parameter, its gradient and its optimizer state. Before a block
computes, its parameters are all-gathered; after its backward, its gradients are reduce-scattered (averaged over
the trainers, as DDP's all-reduce does), so the optimizer steps on shards and the run trains exactly as DDP
would. The blocks sharded one by one are the model's blocks (:func:`dask_dl.train.parallel.memory.fsdp_units`),
so no more than one block is whole on a trainer at a time. BatchNorm statistics stay per trainer, as in DDP, and
rank 0's are the ones checkpointed.

Checkpoints: every rank writes its shards of the model and the optimizer with ``torch.distributed.checkpoint``
to ``<checkpoint_dir>/epoch-NNNN.dcp/``, then rank 0 writes ``epoch-NNNN.pt`` with the consolidated model (the
full state dict, for ``run.model()`` and ``export_onnx``) and ``parallel={"kind": "fsdp", "sharded":
"epoch-NNNN.dcp", ...}``: the ``.pt`` comes last, so an epoch whose shards are incomplete has no ``.pt`` and
is never resumed from. Step checkpoints do the same under their own name (``step-EEEE-GGGGGGGGG.dcp/`` beside
``step-EEEE-GGGGGGGGG.pt``), and go with their ``.pt`` when a newer checkpoint replaces it. Without
``checkpoint_dir`` the in-memory checkpoint holds the consolidated optimizer state instead.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

from dask_dl.errors import CheckpointError
from dask_dl.train.buffers import broadcast_buffers

__all__ = ["ShardedModel"]


class ShardedModel:
    """A model sharded over all ranks of the default process group with ``fully_shard``."""

    kind = "fsdp"
    counts_examples = True  # every trainer trains on its own images

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        world_size: int,
        input_shape: tuple[int, ...],
        compression: str = "none",
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from dask_dl.train.parallel.memory import fsdp_units

        self.world_size, self.data_world, self.input_shape = world_size, world_size, tuple(input_shape)
        # A name of its own for every mesh. DTensor caches sharding decisions by mesh *equality* (its ranks and
        # dimension names, not its process group), and a cached result keeps the mesh it was made with: a worker
        # that was rank 0 of an earlier run and is rank 1 now got tensors on the old mesh, with the old rank's
        # offsets, and torch.distributed.checkpoint then saved (or loaded) rank 0's shard twice.
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=(f"fsdp-{uuid.uuid4().hex[:12]}",))
        # fp16 / bf16 "compression": gradients are reduce-scattered in that dtype (parameters stay float32)
        reduce_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(compression)
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        for unit in fsdp_units(model):
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.module = model
        self.device = device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def train(self, mode: bool = True) -> ShardedModel:
        self.module.train(mode)
        return self

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """One step's forward and backward (gradients are reduce-scattered as blocks finish); the loss."""
        loss = loss_fn(self.module(x), y)
        loss.backward()
        return loss.detach()

    def evaluate(self, batches: Iterable[Any]) -> Iterator[tuple[torch.Tensor, Any, Any]]:
        """Yield ``(logits, y, samples)`` for this rank's validation batches.

        Every forward all-gathers parameters on all ranks, so all ranks run the same number of forwards: a rank
        whose share has run out runs empty batches until every rank is done (one tiny all-reduce per batch).
        Rank 0's BatchNorm statistics, the checkpointed ones, are sent to every rank first, so every image is
        scored by the model the checkpoint holds.
        """
        broadcast_buffers(self.module)
        items = iter(batches)
        while True:
            item = next(items, None)
            more = torch.tensor([0.0 if item is None else 1.0], device=self.device)
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if more.item() == 0:
                return
            if item is None:
                self.module(torch.zeros((0, *self.input_shape), device=self.device))
                continue
            x, y, s = item
            yield self.module(x.to(self.device)), y.to(self.device), s

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def checkpoint_parts(self, optimizer: Optimizer, *, name: str, directory: str | None) -> dict[str, Any]:
        """Collective: write the shards of checkpoint file ``name`` (with a directory); return the consolidated
        parts on rank 0, {} elsewhere."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            get_state_dict,
        )

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0 only
        model = get_model_state_dict(self.module, options=full)
        parallel: dict[str, Any] = {"kind": self.kind, "trainers": self.world_size}
        if directory is not None:
            import torch.distributed.checkpoint as dcp

            from dask_dl.train.checkpoint import failure_causes, shards_name

            shards = shards_name(name)
            model_shards, optimizer_shards = get_state_dict(self.module, optimizer)
            try:
                dcp.save(
                    {"model": model_shards, "optimizer": optimizer_shards}, storage_writer=_writer(directory, shards)
                )
            except (Exception, CheckpointException) as exc:  # torch's is a BaseException
                # a RuntimeError, as torch's own errors: a restart may cure it (a peer lost while writing)
                raise RuntimeError(
                    f"writing the sharded checkpoint {_where(directory, shards)!r} failed ({failure_causes(exc)}); the "
                    "checkpoints written before it are kept"
                ) from exc
            parallel["sharded"] = shards
            optimizer_state: dict[str, Any] = {}
        else:
            optimizer_state = get_optimizer_state_dict(self.module, optimizer, options=full)
        if dist.get_rank() != 0:
            return {}
        return {"model": model, "optimizer": optimizer_state, "parallel": parallel}

    def load(self, checkpoint: dict[str, Any], optimizer: Optimizer, *, source: str | None) -> None:
        """Load a checkpoint of an FSDP run: its shards when it has them, else its consolidated state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        parallel = checkpoint.get("parallel") or {}
        sharded = parallel.get("sharded")
        if sharded is not None:
            import torch.distributed.checkpoint as dcp

            if source is None:
                raise CheckpointError("a sharded FSDP checkpoint is read from its directory; pass its file path")
            model_shards, optimizer_shards = get_state_dict(self.module, optimizer)
            state = {"model": model_shards, "optimizer": optimizer_shards}
            from dask_dl.train.checkpoint import failure_causes

            directory = source.rsplit("/", 1)[0] if "/" in source else "."
            reader = _reader(directory, sharded)
            try:
                dcp.load(state, storage_reader=reader)
            except (Exception, CheckpointException) as exc:  # torch's is a BaseException
                raise CheckpointError(
                    f"the sharded checkpoint {_where(directory, sharded)!r} cannot be read ({failure_causes(exc)}): "
                    f"it is damaged or incomplete; resume from an earlier checkpoint by removing {source!r}, or "
                    "train afresh with another checkpoint_dir"
                ) from exc
            set_state_dict(self.module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            # buffers are not sharded, and the shards keep one rank's copy: take rank 0's, which the .pt holds
            with torch.no_grad():
                for name, buffer in self.module.named_buffers():
                    if name in checkpoint["model"]:
                        buffer.copy_(checkpoint["model"][name])
            return
        full = StateDictOptions(full_state_dict=True)
        set_state_dict(
            self.module,
            optimizer,
            model_state_dict=checkpoint["model"],
            optim_state_dict=checkpoint["optimizer"],
            options=full,
        )


def _where(directory: str, name: str) -> str:
    return f"{str(directory).rstrip('/')}/{name}"


def _writer(directory: str, name: str) -> Any:
    from dask_dl.checkpoint import fs_of, is_local

    fs, root = fs_of(directory)
    if is_local(fs):
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(f"{root}/{name}")
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(f"{str(directory).rstrip('/')}/{name}")


def _reader(directory: str, name: str) -> Any:
    from dask_dl.checkpoint import fs_of, is_local

    fs, root = fs_of(directory)
    path = f"{root}/{name}" if is_local(fs) else f"{str(directory).rstrip('/')}/{name}"
    if not fs.exists(f"{root}/{name}/.metadata"):
        raise CheckpointError(
            f"the sharded checkpoint {path!r} is missing or incomplete (no .metadata); resume from an earlier "
            f"checkpoint by removing the newer {name[: -len('.dcp')]}.pt, or train afresh with another checkpoint_dir"
        )
    if is_local(fs):
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(path)
