"""Pipeline parallel on the trainers: the model's blocks cut into stages, micro-batches flowing through them.

Trainer ``r`` is stage ``r % stages`` of replica ``r // stages`` (``trainers = stages * replicas``). Every trainer
builds the whole model from the run's seed (so the stages start from the weights one process would have), keeps
its stage's blocks (:func:`dask_dl.train.parallel.split.assign_stages`: consecutive blocks of about equal parameter
count) and drops the rest. Training steps run torch's ``torch.distributed.pipelining`` schedule (GPipe or 1F1B)
over ``microbatches`` micro-batches of each batch; gradients are those of the batch's mean loss. The replicas of a
stage then average its gradients with one all-reduce, and the last stage broadcasts the batch's loss to its
pipeline, so every trainer reports it.

All stages of a pipeline read the same batches (the first needs the images, the last the labels). Validation
sends each batch's activations from stage to stage under ``no_grad`` (the last stage scores them). BatchNorm
normalizes each micro-batch on its own, as gradient accumulation would.

Checkpoints are consolidated on rank 0: the first replica's stages send their parameters (under the model's own
names) and optimizer states, and rank 0 writes one ``epoch-NNNN.pt`` whose ``model`` is the whole model (for
``run.model()`` and ``export_onnx``) and whose ``optimizer`` is ``{"stages": [state of stage 0, ...]}``. A step
checkpoint (``step-EEEE-GGGGGGGGG.pt``) is the same with the loader's position, which the stages of a pipeline
share (one data rank per replica), and every trainer's loss sums and generators.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from dask_dl.errors import TrainingError
from dask_dl.train.buffers import broadcast_buffers
from dask_dl.train.checkpoint import to_cpu

__all__ = ["PipelineModel"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_HEADER = 8  # dtype, ndim and up to 6 sizes of an activation sent in validation


class PipelineModel:
    """This rank's stage of a pipeline over the default process group."""

    kind = "pipeline"

    def __init__(
        self,
        model: nn.Module,
        *,
        name: str,
        device: torch.device,
        rank: int,
        world_size: int,
        stages: int,
        microbatches: int,
        microbatch: int,
        input_shape: tuple[int, ...],
        schedule: str,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from dask_dl.train.parallel.split import assign_stages, blocks, stage_names

        self.device, self.stages, self.world_size = device, stages, world_size
        self.stage, self.replica = rank % stages, rank // stages
        self.replicas = self.data_world = world_size // stages
        self.first, self.last = self.stage == 0, self.stage == stages - 1
        self.counts_examples = self.first  # a batch's images count once, on the stage that reads them
        self.ranks = [self.replica * stages + s for s in range(stages)]  # this pipeline's trainers, by stage
        # every rank makes every group, in the same order (torch.distributed's rule for new_group)
        self.pipe_group = self.stage_group = None
        for replica in range(self.replicas):
            group = dist.new_group([replica * stages + s for s in range(stages)])
            if replica == self.replica:
                self.pipe_group = group
        if self.replicas > 1:
            for stage in range(stages):
                group = dist.new_group([replica * stages + stage for replica in range(self.replicas)])
                if stage == self.stage:
                    self.stage_group = group
        groups = assign_stages(blocks(model, name=name), stages, name=name)
        shapes = _stage_shapes(groups, (microbatch, *input_shape), device)
        self.module = nn.Sequential(*groups[self.stage]).to(device)
        self.names = stage_names(model, self.module)  # stage's state-dict names -> the model's own
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        # the stage's input and output shapes given: torch would otherwise find them by a training-mode forward
        # of the first micro-batch, which updates BatchNorm's running statistics one time too many
        example_in, example_out = (torch.empty(shape, device=device) for shape in shapes[self.stage])
        example_in.requires_grad_(not self.first)  # a later stage sends the gradient of its input back
        example_out.requires_grad_(True)
        self._pipeline_stage = PipelineStage(
            self.module,
            self.stage,
            stages,
            device,
            input_args=example_in,
            output_args=example_out,
            group=self.pipe_group,
        )
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.schedule = kind(self._pipeline_stage, n_microbatches=microbatches, loss_fn=self._loss)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(output, target)

    def train(self, mode: bool = True) -> PipelineModel:
        self.module.train(mode)
        return self

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """One step of the schedule over this pipeline, then the replicas' gradient average; the batch's loss."""
        self._loss_fn = loss_fn
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        self.schedule.step(
            *args, target=y if self.last else None, losses=losses if self.last else None, return_outputs=False
        )
        loss = torch.stack(losses).mean().detach() if self.last else torch.zeros((), device=self.device)
        if self.stages > 1:
            dist.broadcast(loss, src=self.ranks[-1], group=self.pipe_group)
        if self.stage_group is not None:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            if grads:
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=self.stage_group)
                flat /= self.replicas
                offset = 0
                for g in grads:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
        return loss

    def evaluate(self, batches: Iterable[Any]) -> Iterator[tuple[torch.Tensor, Any, Any]]:
        """Send each validation batch through the stages; the last stage yields ``(logits, y, samples)``.

        With several replicas, each stage first takes the first replica's BatchNorm statistics (the checkpointed
        ones: every replica trains its own), so every image is scored by the model the checkpoint holds.
        """
        if self.stage_group is not None:
            broadcast_buffers(self.module, src=self.stage, group=self.stage_group)  # the first replica's stage
        for x, y, s in batches:
            h = x.to(self.device) if self.first else self._receive(self.ranks[self.stage - 1])
            h = self.module(h)
            if self.last:
                yield h, y.to(self.device), s
            else:
                self._send(h, self.ranks[self.stage + 1])

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
            raise TrainingError(
                f"stage {self.stage} returned a {tensor.dtype} tensor of shape {tuple(tensor.shape)}; pipeline "
                f"stages pass floating-point tensors of at most {_HEADER - 2} dimensions between them"
            )
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        dist.send(header.to(self.device), dst=dst, group=self.pipe_group)
        dist.send(tensor.contiguous(), dst=dst, group=self.pipe_group)

    def _receive(self, src: int) -> torch.Tensor:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src=src, group=self.pipe_group)
        header = header.cpu()
        shape = tuple(int(v) for v in header[2 : 2 + int(header[1])])
        tensor = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=self.device)
        dist.recv(tensor, src=src, group=self.pipe_group)
        return tensor

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def checkpoint_parts(self, optimizer: Optimizer, *, name: str, directory: str | None) -> dict[str, Any]:
        """Collective: the first replica's stages send their state to rank 0; the consolidated parts there."""
        mine = None
        if self.replica == 0:
            state = self.module.state_dict()
            mine = {
                "model": {self.names[k]: v.detach().cpu().clone() for k, v in state.items()},
                "optimizer": to_cpu(optimizer.state_dict()),
            }
        gathered: list[Any] | None = [None] * self.world_size if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is None:
            return {}
        model: dict[str, torch.Tensor] = {}
        for part in gathered[: self.stages]:
            model.update(part["model"])
        parallel = {"kind": self.kind, "trainers": self.world_size, "stages": self.stages}
        return {
            "model": model,
            "optimizer": {"stages": [p["optimizer"] for p in gathered[: self.stages]]},
            "parallel": parallel,
        }

    def load(self, checkpoint: dict[str, Any], optimizer: Optimizer, *, source: str | None) -> None:
        """Load this stage's parameters and optimizer state from a consolidated pipeline checkpoint."""
        full = checkpoint["model"]
        self.module.load_state_dict({k: full[v] for k, v in self.names.items()})
        optimizer.load_state_dict(checkpoint["optimizer"]["stages"][self.stage])


def _stage_shapes(groups: list[list[nn.Module]], shape: tuple[int, ...], device: torch.device) -> list[tuple]:
    """``(input shape, output shape)`` of each stage for a micro-batch of ``shape`` (an eval-mode pass on zeros)."""
    modes = [m.training for group in groups for m in group]
    shapes = []
    with torch.no_grad():
        h = torch.zeros(shape, device=device)
        for group in groups:
            before = tuple(h.shape)
            for block in group:
                h = block.to(device).eval()(h)
            shapes.append((before, tuple(h.shape)))
    for block, mode in zip((m for group in groups for m in group), modes, strict=True):
        block.train(mode)
    return shapes
