"""TrainingActor: one data-parallel trainer, living on one Dask worker as a Dask actor.

The driver (:mod:`dask_dl.train.driver`) makes one actor per trainer and calls, on all of them at once:
``free_address`` (rank 0 only), ``setup``, then ``run_epochs`` (which runs ``train_epoch``, ``validate`` and
``checkpoint`` epoch after epoch on its own), and finally ``teardown``. A worker runs an actor's synchronous
methods one at a time on a single thread, so the collective ones (``setup``, ``run_epochs``, ``train_epoch``,
``checkpoint``) must be started on every actor before any result is awaited. ``request_stop``, ``progress``,
``latest_checkpoint`` and ``abort_group`` are ``async`` methods: they run on the worker's event loop and answer
while epochs run (a trainer that does not answer them hangs: the driver leaves its worker out).

The pieces live beside it: the process group this worker is in (:mod:`dask_dl.train.process_group`), what a step
is made of besides the model (its clock, the ranks' agreement, DDP: :mod:`dask_dl.train.step`) and the
checkpoint dict (:mod:`dask_dl.train.checkpoint_state`).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import multiprocessing
import socket
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, NoReturn
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist

from dask_dl import allocator
from dask_dl.checkpoint import load_checkpoint
from dask_dl.errors import TrainingError
from dask_dl.train import profiler
from dask_dl.train.abort import before_group, group_sockets, shut_group_sockets
from dask_dl.train.buffers import broadcast_buffers
from dask_dl.train.checkpoint import set_rng_state, to_cpu
from dask_dl.train.checkpoint_state import checkpoint_state, kept, plain
from dask_dl.train.parallel import data_shard
from dask_dl.train.process_group import (
    CLAIM_WAIT_S,
    claim_process_group,
    exit_without_finalization,
    own_group,
    owns_group,
    registered,
    rendezvous,
    reset_process_group,
)
from dask_dl.train.spec import TrainerSpec, unpickle_spec
from dask_dl.train.step import Agreement, Alone, CommTimer, StepClock, agree, epoch_seed, make_ddp

__all__ = ["TrainerSpec", "TrainingActor"]


class TrainingActor:
    """One rank of a data-parallel training run (used through ``client.submit(TrainingActor, actor=True)``)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._progress: dict[str, Any] = {}
        self._ready = False
        self._orphaned = False  # released by the scheduler while running (its client is gone)
        self._release_lock = threading.Lock()  # who frees an orphaned trainer: its epochs' end or its watcher
        self._watch_end = threading.Event()  # set by teardown: the release watcher of the last run_epochs ends
        self._latest: dict[str, Any] | None = None  # the newest epoch checkpoint when there is no directory
        self._latest_step: dict[str, Any] | None = None  # the newest step checkpoint (newer than _latest) likewise
        self._resume: Any = None  # an EpochResume for the first epoch of run_epochs (a step checkpoint's)
        self._context: dict[str, Any] | None = None  # run_epochs' directory and history, for step checkpoints
        self.global_step = 0  # optimizer steps of the run so far (also those of the runs it resumed)
        self.auto: dict[str, Any] | None = None  # compression="auto": the choice, its reason and figures

    # ---- answered on the event loop, also while an epoch runs ----------------------------------------------

    async def request_stop(self) -> bool:
        """Ask the trainer to stop at the next agreement of the ranks (within ``check_every`` steps, same step)."""
        self._stop.set()
        return True

    async def progress(self) -> dict[str, Any]:
        """Return where the current epoch is: ``epoch, step, steps, loss, images_per_s``."""
        return dict(self._progress)

    async def latest_checkpoint(self, step: bool = False) -> dict[str, Any] | None:
        """The checkpoint of the last completed epoch of :meth:`run_epochs` without a directory (every rank keeps
        it); ``step=True``: the newest step checkpoint instead when there is a newer one."""
        if step and self._latest_step is not None:
            return self._latest_step
        if step or self._latest is None:
            return self._latest
        return kept(self._latest, self.spec)  # what the driver may take away for run.checkpoint()

    async def abort_group(self, peers: list[int]) -> int:
        """Make this trainer's pending collectives fail now (a peer is lost or hung); return the sockets shut.

        gloo cannot abort a collective: the group's connections are shut instead (:mod:`dask_dl.train.abort`), and
        the epoch fails as after a peer's crash, so the driver need not wait for ``dask-dl.train.timeout``. An NCCL
        group is left to its timeout.
        ``peers`` are the group listener ports of every rank (from their ``setup``). A trainer that has left its
        group (or never joined one) has nothing to shut.
        """
        sockets = self.__dict__.get("_group_sockets")
        if sockets is None or not owns_group(self):
            return 0
        try:
            backend = dist.get_backend()
        except (ValueError, RuntimeError):  # the trainer has just left its group (the group is gone)
            return 0
        if backend != "gloo":  # NCCL's collectives end at its own timeout (or by its watchdog)
            return 0
        return shut_group_sockets(sockets, peers)

    # ---- process group and model ----------------------------------------------------------------------

    def free_address(self) -> str:
        """Return ``tcp://host:port`` with a port free now on this worker's host (rank 0's rendezvous)."""
        from distributed import get_worker

        host = urlparse(get_worker().address).hostname or "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def setup(
        self, spec: TrainerSpec | bytes, *, init_method: str, rank: int, world_size: int, checkpoint: Any = None
    ) -> dict[str, Any]:
        """Join the process group, build model, DDP, compressor, optimizer and loaders; load a checkpoint.

        ``spec`` comes pickled (distributed's pickle) from the driver, so that failing to unpickle it is this call's
        error. ``checkpoint`` (a path or a checkpoint dict; a restart's) replaces ``spec.resume_from``; it may be of
        another world size (:mod:`dask_dl.train.resume`).
        """
        from distributed import get_worker

        worker = get_worker()
        spec = unpickle_spec(spec, worker.address)
        claim_process_group(worker, wait_s=min(float(spec.timeout_s), CLAIM_WAIT_S))
        try:
            return self._setup(
                worker, spec, init_method=init_method, rank=rank, world_size=world_size, checkpoint=checkpoint
            )
        except BaseException as exc:
            # a failed rendezvous must not leave this worker unusable: no half-made group, no advanced counter
            self.teardown()
            _raise_for_the_driver(exc)

    def _setup(
        self, worker: Any, spec: TrainerSpec, *, init_method: str, rank: int, world_size: int, checkpoint: Any = None
    ) -> dict[str, Any]:
        from dask_dl.data.loader import ChunkLoader
        from dask_dl.models import MODELS
        from dask_dl.models.source import head_name
        from dask_dl.train.building import build_trainer_model, make_optimizer
        from dask_dl.train.compression import make_compressor
        from dask_dl.train.feed import DeviceFeed, where_to_augment
        from dask_dl.train.losses import loss_function
        from dask_dl.train.precision import Precision
        from dask_dl.train.tuning import Tuner

        if worker.nanny is not None and multiprocessing.parent_process() is not None:
            exit_without_finalization()  # only in a worker process of a nanny: never in the user's own process
        if spec.model_name not in MODELS and spec.model_target is not None:  # registered in the user's process
            MODELS.register(spec.model_name, spec.model_target)
        torch.set_num_threads(max(1, worker.state.nthreads))  # a fixed count: the sums of a kernel split by thread
        torch.use_deterministic_algorithms(spec.deterministic)
        if not self.__dict__.get("_holds_allocator"):  # held once per trainer: see let_go_of_allocator
            allocator.keep_freed_memory()  # the nanny's MALLOC_TRIM_THRESHOLD_ made every step 1.65x slower
            self._holds_allocator = True
        self._worker = worker
        profiler.pause(worker)  # its samples of this thread are racy on CPython 3.11 and say nothing of use
        self.spec, self.rank, self.world_size, self.auto = spec, rank, world_size, None
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        own_group(self)
        sockets_before = before_group()  # what the group opens is what abort_group shuts
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=rendezvous(init_method, rank=rank, world_size=world_size, timeout_s=spec.timeout_s),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=spec.timeout_s),
        )
        self.precision = Precision(spec.precision, self.device, channels_last=spec.channels_last)
        torch.manual_seed(spec.seed)  # every rank builds the same initial weights (DDP broadcasts rank 0's anyway)
        model, self.weights_report = build_trainer_model(spec, in_channels=spec.channels)
        _load_start_state(model, spec)
        model = self.precision.prepare_model(model.to(self.device))
        self.loss_fn = loss_function(spec.loss)
        self.parallel = None  # fsdp or pipeline (dask_dl.train.parallel): no DDP, no comm hook
        if spec.parallel != "ddp":
            from dask_dl.train.parallel.wrap import wrap_model

            self.ddp = self.parallel = wrap_model(spec, model, device=self.device, rank=rank, world_size=world_size)
            model = self.parallel.module  # what this rank trains: the sharded model or its pipeline stage
            self.timer, self.compressor = CommTimer(), make_compressor("none")
        elif world_size == 1 and spec.compression in ("none", "auto"):
            self.ddp, self.timer, self.compressor = Alone(model), CommTimer(), make_compressor("none")
            if spec.compression == "auto":
                self.auto = {"name": "none", "reason": "one trainer: nothing to exchange", "figures": {}}
        else:
            self.ddp = make_ddp(model, device_ids=[self.device.index] if cuda else None)
            self.timer = CommTimer()
            self.timer.attach(self.ddp)
            name = spec.compression
            if name == "auto":
                self.auto = self._choose_compression(model, checkpoint)
                name = self.auto["name"]
            self.compressor = make_compressor(name, warmup_steps=spec.warmup_steps, **dict(spec.compression_options))
            self.compressor.register(self.ddp)
            del self.ddp.register_comm_hook  # drop the timing shim: it would keep ddp in a reference cycle
        self._anchor = _proximal_anchor(model, spec)  # the parameters this rank trains, as they start
        self.tuner = Tuner(
            model,
            head=head_name(model) if spec.head_lr is not None or spec.freeze_epochs else None,
            lr=spec.lr,
            head_lr=spec.head_lr,
            freeze_epochs=spec.freeze_epochs,
            schedule=spec.schedule,
            total_steps=0,
        )
        grouped = spec.head_lr is not None or spec.freeze_epochs > 0  # else one group, as checkpoints before
        self.optimizer = make_optimizer(spec, self.tuner.param_groups() if grouped else model.parameters())
        self.start_epoch, self.global_step, self._resume = 0, 0, None
        if isinstance(checkpoint, dict):
            self._load(checkpoint, elastic=True)
        elif checkpoint is not None or spec.resume_from is not None:
            source = checkpoint or spec.resume_from
            self._load(load_checkpoint(source, map_location=self.device), elastic=checkpoint is not None, source=source)
        data_rank, data_world = data_shard(spec.parallel, spec.stages, rank, world_size)  # a pipeline's stages share
        common = dict(
            rank=data_rank,
            world_size=data_world,
            seed=spec.seed,
            window=spec.window,
            prefetch=spec.prefetch,
            cache=spec.cache,
            normalization=spec.normalization,
        )
        augment_on = where_to_augment(spec.augment_on, cuda=cuda)
        self.train_loader = ChunkLoader(
            spec.store,
            spec.train_samples,
            batch_size=spec.batch_size,
            shuffle=True,
            augment=spec.augment,
            augment_on=augment_on,
            pin_memory=cuda,
            **common,
        )
        self.feed = DeviceFeed(
            self.device, normalization=self.train_loader.normalization, deferred=augment_on == "device"
        )
        self.val_loader = ChunkLoader(
            spec.store, spec.val_samples, batch_size=spec.batch_size, shuffle=False, drop_last=False, **common
        )
        if self._resume is None and self.start_epoch and not self.global_step:  # a checkpoint from before step counts
            self.global_step = self.start_epoch * int(self.train_loader.steps_per_epoch)
        self._group_sockets = group_sockets(sockets_before)  # after DDP's and a pipeline's groups connected
        self._ready = True
        return {
            "rank": rank,
            "address": worker.address,
            "device": str(self.device),
            "gpu": cuda,
            "augment_on": augment_on,
            "threads": torch.get_num_threads(),
            "steps_per_epoch": int(self.train_loader.steps_per_epoch),
            "start_epoch": self.start_epoch,
            "start_step": self._resume.position.step if self._resume is not None else 0,
            "global_step": self.global_step,
            "weights": self.weights_report,
            "group_ports": sorted(self._group_sockets.listeners),
            "compression": self.auto,
        }

    def _choose_compression(self, model: torch.nn.Module, checkpoint: Any) -> dict[str, Any]:
        """``compression="auto"``: the checkpoint's compressor when resuming (its residuals are that compressor's),
        else the scale-out model's choice from figures measured now (:mod:`dask_dl.train.compression.auto`)."""
        from dask_dl.train.compression.auto import decide

        source = checkpoint if checkpoint is not None else self.spec.resume_from
        if source is not None:
            saved = source if isinstance(source, dict) else load_checkpoint(source, map_location="cpu")
            name = saved["compressor"][0]["name"]
            return {"name": name, "reason": f"resumed: the checkpoint's compressor is {name}", "figures": {}}
        spec = self.spec
        gen = torch.Generator().manual_seed(spec.seed)
        x = torch.randn(spec.batch_size, spec.channels, spec.input_size, spec.input_size, generator=gen)
        y = torch.zeros(spec.batch_size, len(spec.labels))
        y[:, 0] = 1.0  # a one-hot target serves every loss (ce takes its argmax)
        x = self.precision.prepare_input(x.to(self.device))
        choice, figures = decide(model, x, y.to(self.device), self._loss)
        return {"name": choice.name, "reason": choice.reason, "figures": figures, "predicted_s": choice.predicted_s}

    def _load(self, checkpoint: dict[str, Any], *, elastic: bool = False, source: str | None = None) -> None:
        from dask_dl.train.resume import compressor_state, epoch_resume

        if self.parallel is not None:  # sharded (fsdp) or per stage (pipeline)
            self.parallel.load(checkpoint, self.optimizer, source=source or self.spec.resume_from)
        else:
            self.ddp.module.load_state_dict(checkpoint["model"])
            groups = len(checkpoint["optimizer"].get("param_groups", []))
            if groups != len(self.optimizer.param_groups):  # head_lr / freeze_epochs make a second group
                raise TrainingError(
                    f"the checkpoint's optimizer has {groups} parameter group(s) and this run's has "
                    f"{len(self.optimizer.param_groups)}: resume with head_lr= and freeze_epochs= as the run that "
                    "wrote it had them (both set or both unset)"
                )
            self.optimizer.load_state_dict(checkpoint["optimizer"])
        # the learning rates passed to this fit win over the checkpoint's; the schedule continues where it was
        self.tuner.load_state_dict(checkpoint.get("tuning") or {})
        self.precision.load_state_dict(checkpoint.get("scaler") or {})
        states = checkpoint["compressor"]
        if len(states) != self.world_size and not elastic:
            raise TrainingError(
                f"the checkpoint was written by {len(states)} trainers and this run has {self.world_size}; "
                f"resume with trainers={len(states)} (error-feedback residuals are per rank)"
            )
        fresh = to_cpu(self.compressor.state_dict())
        self.compressor.load_state_dict(compressor_state(checkpoint, fresh, rank=self.rank, world_size=self.world_size))
        if len(states) == self.world_size:
            set_rng_state(checkpoint["rng"][self.rank])
        self.global_step = int(checkpoint.get("global_step", 0))
        data_world = data_shard(self.spec.parallel, self.spec.stages, self.rank, self.world_size)[1]
        self._resume = epoch_resume(
            checkpoint,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.spec.batch_size,
            data_world=data_world,
        )
        self.start_epoch = self._resume.position.epoch if self._resume else int(checkpoint["epoch"]) + 1

    # ---- one epoch ------------------------------------------------------------------------------------

    def _loss(self, logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return self.loss_fn(logits, y, reduction=reduction)

    def train_epoch(self, epoch: int, *, resume: Any = None) -> dict[str, Any]:
        """Train one epoch; every rank stops at the same step when a stop was requested on any rank.

        The ranks agree on stopping (and on a non-finite loss) every ``spec.check_every`` steps and at the last
        step, so a stop takes effect within that many steps. ``resume`` (an
        :class:`~dask_dl.train.resume.EpochResume` of a step checkpoint) goes on where that checkpoint left the
        epoch. Step checkpoints are taken every ``spec.checkpoint_every_steps`` steps of the run, or at the first
        check after ``spec.checkpoint_every_seconds``, when :meth:`run_epochs` drives the epoch.

        Raises
        ------
        TrainingError
            On every rank, when the loss of any rank is not finite (no optimizer step is taken with it).
        """
        spec, loader, accumulate = self.spec, self.train_loader, int(self.spec.accumulate)
        position, before_steps, before_examples, loss_acc = self._begin_epoch(epoch, resume)
        # micro-batches that fill whole optimizer steps (the rest of the epoch's batches is not read)
        steps = loader.steps_from(position) if not position.fresh else loader.steps_per_epoch
        steps = steps // accumulate * accumulate
        offset = position.step  # in-epoch steps before this call, in the current segment
        self._progress = {"epoch": epoch, "step": offset, "steps": offset + steps, "loss": None, "images_per_s": None}
        lrs, bytes_before = self.tuner.lrs(self.optimizer), int(self.compressor.bytes_sent)
        loss_sum, step, examples, stopped, served = float(loss_acc), 0, 0, False, []
        counts_examples = getattr(self.parallel, "counts_examples", True)  # pipelines: the reading stage
        data_world = getattr(self.parallel, "data_world", self.world_size)
        last_checkpoint = time.monotonic()
        clock = StepClock(self.timer)
        batches = self.feed(loader.epoch(epoch, with_samples=True, position=position))
        for step, (x, y, rows) in enumerate(itertools.islice(batches, steps)):
            served.append(rows)
            clock.begin()
            x = self.precision.prepare_input(x.to(self.device, non_blocking=True))
            y = y.to(self.device, non_blocking=True)
            last_micro = (step + 1) % accumulate == 0  # this micro-batch's backward all-reduces and steps
            if step % accumulate == 0:
                self.optimizer.zero_grad(set_to_none=True)
            loss = self._forward_backward(x, y, sync=last_micro)
            clock.backward_done()
            loss_acc += loss.detach()  # stays on the device: no host sync per step
            examples += x.shape[0] if counts_examples else 0
            agreed = Agreement()
            if (step + 1) % spec.check_every == 0 or step + 1 == steps:
                late = spec.checkpoint_every_seconds is not None and (
                    time.monotonic() - last_checkpoint >= spec.checkpoint_every_seconds
                )
                agreed = self._agree(epoch, step, loss_acc, late=late)
                loss_sum = float(loss_acc)
                self._progress.update(loss=loss_sum / (before_steps + step + 1))
            clock.agreed()
            if last_micro:
                lrs = self._optimizer_step()
            clock.end()
            self.global_step += 1
            self._progress.update(
                step=offset + step + 1,
                images_per_s=examples * data_world / clock.elapsed(),
                global_step=self.global_step,
            )
            # step checkpoints at optimizer steps only: an accumulation's partial gradients are not saved
            if self._step_checkpoint_due(agreed) and last_micro and step + 1 < steps and not agreed.stop:
                partial = dict(loss_acc=loss_acc, examples=before_examples + examples, steps=before_steps + step + 1)
                self._step_checkpoint(position.advanced(step + 1), partial)
                last_checkpoint = time.monotonic()
            if agreed.stop:
                stopped = True
                break
        else:
            step = steps - 1 if steps else -1
        done = step + 1 if steps else 0
        return {
            "rank": self.rank,
            "epoch": epoch,
            "steps": before_steps + done,
            "loss_sum": loss_sum,
            "examples": examples,
            "seconds": clock.elapsed(),
            "compute_s": clock.busy_s - clock.comm_s,
            "comm_s": clock.comm_s,
            "data_wait_s": float(self.train_loader.wait_s),
            "bytes_sent": int(self.compressor.bytes_sent) - bytes_before,
            "stopped": stopped,
            "served": np.concatenate(served) if served else np.zeros(0, np.int64),
            "position": position.advanced(done).to_dict(),
            "lrs": lrs,
            "auto": self.auto,
        }

    def _begin_epoch(self, epoch: int, resume: Any) -> tuple[Any, int, int, torch.Tensor]:
        """Seed (or restore) the generators and put the model in training mode for epoch ``epoch``.

        Returns where the epoch starts (an :class:`~dask_dl.data.position.EpochPosition`), the steps and examples
        a step checkpoint's earlier part of it took, and its running loss sum.
        """
        from dask_dl.data.position import EpochPosition

        seed, loader = self.spec.seed, self.train_loader
        position = EpochPosition.start(epoch, seed=seed, world_size=loader.world_size, batch_size=loader.batch_size)
        before_steps, before_examples, loss_acc = 0, 0, torch.zeros((), device=self.device)
        if resume is None:
            torch.manual_seed(epoch_seed(seed, epoch, self.rank))
        else:
            position, before_steps, before_examples = resume.position, resume.steps, resume.examples
            loss_acc = resume.loss_acc.to(self.device).clone()
            if resume.rng is not None:
                set_rng_state(resume.rng)  # the generators exactly where the uninterrupted epoch had them
            else:
                torch.manual_seed(epoch_seed(seed, epoch, self.rank) + 7919 * len(position.segments))
        self.ddp.train()
        self.tuner.start_epoch(epoch, self.optimizer)
        self.tuner.train_mode()
        return position, before_steps, before_examples, loss_acc

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        """The loss of one micro-batch, its gradients added up; ``sync``: DDP all-reduces them in backward."""
        if self.parallel is not None:
            return self.parallel.forward_backward(x, y, self._loss)
        accumulate = int(self.spec.accumulate)
        # the first accumulate-1 micro-batches only add up gradients locally: no communication
        with contextlib.nullcontext() if sync else self.ddp.no_sync():
            with self.precision.autocast():
                loss = self._loss(self.ddp(x), y)
            self.precision.backward(loss / accumulate if accumulate > 1 else loss)
        return loss

    def _agree(self, epoch: int, step: int, loss_acc: torch.Tensor, *, late: bool) -> Agreement:
        """The ranks' agreement (:func:`~dask_dl.train.step.agree`); a non-finite loss on any rank fails them all."""
        agreed = agree(stop=self._stop.is_set(), loss_sum=loss_acc, late=late, device=self.device)
        if agreed.bad:
            raise TrainingError(
                f"non-finite training loss at epoch {epoch} step {step} (checked every {self.spec.check_every} "
                f"steps; rank {self.rank} loss sum {float(loss_acc):.4g}); the weights of the last completed epoch "
                "are kept in its checkpoint; lower the learning rate (lr=...) or check the data"
            )
        return agreed

    def _optimizer_step(self) -> dict[str, float]:
        """Step the optimizer (FedProx's term added, the gradient scaler applied) and the schedule; return the
        learning rates the step took."""
        lrs = self.tuner.lrs(self.optimizer)
        self._add_proximal_gradient(self.precision)
        self.precision.step(self.optimizer)
        self.tuner.stepped(self.optimizer)
        return lrs

    def _step_checkpoint_due(self, agreed: Agreement) -> bool:
        """A step checkpoint is due: the ranks agreed ``checkpoint_every_seconds`` passed, or the run's step count
        is a multiple of ``checkpoint_every_steps``; only when :meth:`run_epochs` drives the epoch."""
        every = self.spec.checkpoint_every_steps
        due = agreed.due or (every is not None and self.global_step % every == 0)
        return due and self._context is not None

    @torch.no_grad()
    def _add_proximal_gradient(self, precision: Any) -> None:
        """FedProx: add ``mu (w - w_start)``, the gradient of ``mu/2 ||w - w_start||^2``, to every gradient.

        Added after the gradients are averaged: the term is the same on every rank (or, sharded, is each rank's
        own shard of it), so adding it before or after averaging is the same, and it costs no communication.
        Under fp16 the gradients are still scaled by the gradient scaler here: the term is scaled alike.
        """
        if self._anchor is None:
            return
        scaler = getattr(precision, "scaler", None)
        mu = float(self.spec.proximal_mu) * (float(scaler.get_scale()) if scaler is not None else 1.0)
        for p, start in self._anchor:
            if p.grad is not None:
                p.grad.add_(p.detach() - start, alpha=mu)

    @torch.no_grad()
    def validate(self, epoch: int) -> dict[str, Any]:
        """Score this rank's share of the validation split (no DDP sync: ``ddp.module`` under no_grad).

        Returns the sample numbers, scores (sigmoid, or softmax for multiclass), 0/1 labels and the loss sum, so
        that the driver computes metrics over all predictions of all ranks.
        """
        model = self.ddp.module
        model.eval()
        if self.parallel is None and self.world_size > 1:  # score with rank 0's BatchNorm statistics, as checkpointed
            broadcast_buffers(model)
        samples, scores, labels, loss_sum = [], [], [], 0.0
        batches = self.val_loader.epoch(epoch, with_samples=True)
        if self.parallel is not None:  # fsdp: all ranks gather each block; pipeline: through the stages
            scored = self.parallel.evaluate(batches)
        else:
            scored = _evaluate(model, batches, self.device, self.precision)
        for logits, y, s in scored:
            loss_sum += float(self._loss(logits, y, reduction="sum"))
            prob = logits.softmax(dim=1) if self.spec.task == "multiclass" else logits.sigmoid()
            samples.append(np.asarray(s, dtype=np.int64))
            scores.append(prob.float().cpu().numpy())
            labels.append(y.cpu().numpy().astype(np.uint8))
        k = len(self.spec.labels)
        return {
            "rank": self.rank,
            "samples": np.concatenate(samples) if samples else np.zeros(0, np.int64),
            "scores": np.concatenate(scores) if scores else np.zeros((0, k), np.float32),
            "labels": np.concatenate(labels) if labels else np.zeros((0, k), np.uint8),
            "loss_sum": loss_sum,
        }

    # ---- epoch after epoch, on their own ----------------------------------------------------------------

    def run_epochs(
        self,
        *,
        first_epoch: int,
        epochs: int,
        history: list[dict[str, Any]],
        directory: str | None,
        topic: str,
        global_batch: int,
        price: float,
        resumed: bool = False,
        restarted: bool = False,
    ) -> dict[str, Any]:
        """Train, validate and checkpoint epochs ``first_epoch .. epochs - 1`` without waiting for the driver.

        All ranks call it at once. After each epoch rank 0 gathers every rank's training report and
        predictions, makes the epoch's history row (:func:`dask_dl.train.aggregate.epoch_row`) and publishes it
        as a Dask event on ``topic`` (``log_event``), which the driver subscribes to; the checkpoint is written by
        rank 0 to ``directory``, or, without one, kept by every rank (:meth:`latest_checkpoint`) rather than sent
        anywhere. A stop request ends the loop at the same step on every rank, with a ``stopped`` row. Step
        checkpoints (``spec.checkpoint_every_*``) go to ``directory`` too, or are kept likewise; a first epoch that
        a step checkpoint left part way goes on from its position. ``restarted`` marks the first row ``restarted``
        (the driver re-formed the group after losing a trainer).

        Returns
        -------
        dict
            ``status`` (``finished`` or ``stopped``) and, on rank 0, the ``rows`` published by this call.
        """
        from distributed import get_worker

        done = threading.Event()
        self._orphaned = False
        self._watch_end.set()  # a watcher still waiting from an earlier call ends: this call starts its own
        self._watch_end = threading.Event()
        args = (get_worker(), done, self._watch_end)
        watcher = threading.Thread(target=self._watch_release, args=args, name="dask-dl-trainer-watch", daemon=True)
        watcher.start()
        try:
            result = self._epochs(
                first_epoch=first_epoch,
                epochs=epochs,
                history=history,
                directory=directory,
                topic=topic,
                global_batch=global_batch,
                price=price,
                event="restarted" if restarted else "resumed" if resumed else "",
            )
        except BaseException as exc:
            # leave the group now: the driver's teardown may never come (a client gone, a peer hung), and the
            # worker must be as good as new for the next fit; every rank keeps its last checkpoint for the driver
            self.teardown(keep_latest=True)
            _raise_for_the_driver(exc)
        finally:
            with self._release_lock:
                done.set()
                orphaned = self._orphaned
        if orphaned:  # no driver is left to tear this trainer down: free the worker now
            self.teardown()
        return result

    def _watch_release(self, worker: Any, done: threading.Event, end: threading.Event) -> None:
        """Stop the epochs when this actor is released without a stop (its client disconnected or was killed).

        The scheduler forgets an actor whose client is gone, and the worker drops it from its actors; the
        epochs, running in the actor's thread, would otherwise go on for ever. The watch goes on after the epochs,
        until a teardown: the ranks of a killed client are released one by one, and the first one seen stops all
        of them at their next agreement, before the others have seen their own release; a rank whose release
        comes after its epochs ended frees its worker here, since no driver will.
        """
        while not end.wait(_WATCH_S):
            if not registered(worker, self):
                logger.warning(
                    "worker %s: trainer %d was released by its client (disconnected?); stopping",
                    worker.address,
                    self.rank,
                )
                with self._release_lock:
                    self._orphaned = True
                    self._stop.set()  # every rank sees its own release; they agree on the step at the next check
                    ended = done.is_set()
                if ended:
                    self.teardown()
                return

    def _epochs(
        self,
        *,
        first_epoch: int,
        epochs: int,
        history: list[dict[str, Any]],
        directory: str | None,
        topic: str,
        global_batch: int,
        price: float,
        event: str,
    ) -> dict[str, Any]:
        from distributed import get_worker

        from dask_dl.train.aggregate import epoch_row

        worker = get_worker() if self.rank == 0 else None
        history, published = [plain(r) for r in history], []
        self.tuner.total_steps = epochs * (self.train_loader.steps_per_epoch // int(self.spec.accumulate))
        common = dict(labels=self.spec.labels, task=self.spec.task, global_batch=global_batch, price=price)

        def publish(row: dict[str, Any]) -> None:
            row = plain(row)
            published.append(row)
            worker.log_event(topic, row)

        self._context = {"directory": directory, "history": history}
        for epoch in range(first_epoch, epochs):
            started = time.perf_counter()
            resume, self._resume = (self._resume, None) if epoch == first_epoch else (None, None)
            report = self.train_epoch(epoch, resume=resume)
            trained = self._gather_to_root(report)
            if self.rank == 0 and self.spec.parallel != "pipeline":  # a pipeline's stages share their rows
                _count_samples(trained, resume, self.train_loader)
            if report["stopped"]:  # every rank stopped at the same step (train_epoch's flags)
                if self.rank == 0:
                    seconds = time.perf_counter() - started
                    row = epoch_row(epoch, trained, None, seconds=seconds, event="stopped", **common)
                    publish({**row, **report["lrs"]})  # the learning rate it stopped at, not NaN
                return {"status": "stopped", "rows": published}
            scored = self._gather_to_root(self.validate(epoch))
            row = None
            if self.rank == 0:
                row = epoch_row(
                    epoch,
                    trained,
                    scored,
                    seconds=time.perf_counter() - started,
                    event=event if epoch == first_epoch else "",
                    **common,
                )
                row.update({k: trained[0][k] for k in ("samples", "samples_repeated") if k in trained[0]})
                row.update(report["lrs"])
                history.append(plain(row))
            if self.tuner.schedule["name"] == "plateau":  # every rank needs rank 0's validation loss
                box = [row["val_loss"] if row is not None else None]
                dist.broadcast_object_list(box, src=0)
                self.tuner.end_epoch(float(box[0]), self.optimizer)
            checkpoint = self.checkpoint(epoch, history=history, directory=directory)
            self._latest, self._latest_step = (checkpoint if directory is None else None), None
            if self.rank == 0:
                publish(row)
        return {"status": "finished", "rows": published}

    def _gather_to_root(self, report: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every rank's ``report`` on rank 0 (in rank order), None elsewhere."""
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(report, gathered, dst=0)
        return gathered

    # ---- checkpoint and teardown ----------------------------------------------------------------------

    def checkpoint(
        self,
        epoch: int,
        *,
        history: list[dict[str, Any]],
        directory: str | None,
        position: Any = None,
        partial: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Gather every rank's compressor and RNG state and build the checkpoint dict of completed epoch ``epoch``.

        With ``directory``, rank 0 gathers, writes it there (atomically) and returns it; other ranks return None.
        Without one, every rank gets every rank's state (and rank 0's model buffers, the checkpointed ones) and
        returns the same checkpoint, so the driver can fetch it from any trainer that survives a failure.
        ``position`` (an :class:`~dask_dl.data.position.EpochPosition`) and ``partial`` (this rank's loss
        accumulators) make it a step checkpoint inside epoch ``position.epoch``.
        """
        return checkpoint_state(self, epoch, history=history, directory=directory, position=position, partial=partial)

    def _step_checkpoint(self, position: Any, partial: dict[str, Any]) -> None:
        """A checkpoint inside epoch ``position.epoch``, taken by every rank at the same step (collective)."""
        context = self._context or {}
        directory = context.get("directory")
        checkpoint = self.checkpoint(
            position.epoch - 1,
            history=context.get("history", []),
            directory=directory,
            position=position,
            partial=partial,
        )
        if directory is None:
            self._latest_step = checkpoint

    def let_go_of_allocator(self) -> None:
        """Let go of this trainer's hold on the allocator settings, once: at teardown, or when the worker drops
        the stale group of a trainer whose teardown never came. Other holders in the worker keep theirs."""
        if self.__dict__.pop("_holds_allocator", False):
            allocator.restore()

    def teardown(self, *, keep_latest: bool = False) -> bool:
        """Leave the process group and drop model, loaders and optimizer, so the worker is free again.

        ``keep_latest`` keeps rank 0's in-memory checkpoint for the driver to fetch (after a failed epoch).
        """
        self._watch_end.set()
        for name in ("train_loader", "val_loader"):
            close = getattr(getattr(self, name, None), "close", None)
            if close is not None:
                close()
        # DDP's reducer, a pipeline's or FSDP's wrapper and a compressor's state hold the process group: they must
        # be gone before the group goes, not at interpreter exit. Dropping them usually frees them; a collection
        # (0.15-0.2 s in a worker that imported torch) runs only when a reference cycle keeps one alive.
        holders = [
            weakref.ref(self.__dict__[name])
            for name in ("ddp", "parallel", "compressor")
            if self.__dict__.get(name) is not None
        ]
        for name in (
            "ddp",
            "parallel",
            "optimizer",
            "compressor",
            "train_loader",
            "val_loader",
            "feed",
            "timer",
            "tuner",
            "precision",
            "loss_fn",
            "_anchor",
            "_group_sockets",
        ):
            self.__dict__.pop(name, None)
        if not keep_latest:
            self._latest = self._latest_step = None
        if any(ref() is not None for ref in holders):
            gc.collect()
        if owns_group(self):
            reset_process_group()
        self._ready = False
        self.let_go_of_allocator()
        worker = self.__dict__.pop("_worker", None)  # the worker whose profiler setup paused
        if worker is not None:
            profiler.resume(worker)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True


logger = logging.getLogger("dask_dl.train")

_WATCH_S = 1.0  # how often a running trainer checks that its actor is still wanted (its client still there)


def _raise_for_the_driver(exc: BaseException) -> NoReturn:
    """Raise ``exc`` (being handled) in a form that Dask's actor call hands to the driver.

    Dask passes on what an actor method raises only when it is an ``Exception``: anything else ends the call's
    connection, and the driver saw "OSError: Unable to contact Actor's worker" instead of the cause. torch's
    ``CheckpointException`` (a failed sharded checkpoint read or write) is such a ``BaseException``; it is raised as
    a ``RuntimeError`` with its message, which the driver judges as it judges torch's own errors (a restart may
    cure it).
    """
    from dask_dl.train.checkpoint import failure_causes

    if isinstance(exc, Exception | KeyboardInterrupt | SystemExit):
        raise exc
    raise RuntimeError(f"{type(exc).__name__}: {failure_causes(exc)}") from exc


def _evaluate(model: Any, batches: Any, device: torch.device, precision: Any = None) -> Any:
    """``(logits, y, samples)`` of each validation batch, by the whole (unwrapped) model on this rank."""
    for x, y, s in batches:
        x = x.to(device)
        if precision is None:
            yield model(x), y.to(device), s
            continue
        with precision.autocast():
            logits = model(precision.prepare_input(x))
        yield logits, y.to(device), s


def _load_start_state(model: torch.nn.Module, spec: TrainerSpec) -> None:
    """Load ``spec.start_state`` into the freshly built ``model`` (the weights a site's visit starts from)."""
    if spec.start_state is None:
        return
    try:
        model.load_state_dict(spec.start_state)
    except RuntimeError as exc:
        raise TrainingError(
            f"start_state does not fit model {spec.model_name!r} ({len(spec.labels)} outputs, {spec.model_kwargs}): "
            f"{exc}"
        ) from exc


def _proximal_anchor(model: torch.nn.Module, spec: TrainerSpec) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each parameter this rank trains with a copy of its starting value, for FedProx; None without the term."""
    if spec.proximal_mu <= 0:
        return None
    return [(p, p.detach().clone()) for p in model.parameters()]


def _count_samples(trained: list[dict[str, Any]], resume: Any, loader: Any) -> None:
    """Rank 0: count the distinct rows the epoch trained on, and those served twice, into ``trained[0]``.

    The rows served before a step checkpoint this epoch resumed from are recomputed from its position; each
    rank's report then drops its row list (it is not a history column).
    """
    parts = [t.pop("served") for t in trained]
    if resume is not None and not resume.position.fresh:
        orders = lambda r, w, b: loader.order(resume.position.epoch, rank=r, world_size=w, batch_size=b)  # noqa: E731
        parts.append(resume.position.served(orders))
    rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    distinct = len(np.unique(rows))
    trained[0]["samples"], trained[0]["samples_repeated"] = distinct, len(rows) - distinct
