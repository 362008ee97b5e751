"""What a trainer's step is made of besides the model: its clock, the ranks' agreement, DDP or a lone model.

Time accounting of an epoch (the ``*_s`` fields of :meth:`~dask_dl.train.actor.TrainingActor.train_epoch`), kept
by :class:`StepClock`:

``data_wait_s``
    time the trainer waited for its next batch (the loader's ``wait_s``);
``comm_s``
    communication the trainer was blocked on: the synchronous part of every DDP comm-hook call (compression,
    launching the collective), plus the wait from the return of the last bucket's hook to the end of
    ``backward()`` (all-reduces still in flight once gradients are computed), plus the all-reduce of the
    stop/finite flags (every ``check_every`` steps). All-reduce time hidden behind backward compute is not
    counted: it cost nothing;
``compute_s``
    the rest of the step: forward, backward compute, optimizer (step wall time minus ``comm_s``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of one rank's epoch.

    Reseeding at every epoch start makes an epoch's randomness (dropout, augmentation) a function of
    (seed, epoch, rank) alone, so a resumed run draws exactly what the uninterrupted one drew.
    """
    return (seed * 1_000_003 + epoch * 10_007 + rank) % (2**63)


class CommTimer:
    """Wraps DDP comm hooks to measure the communication a trainer is blocked on (see the module docstring)."""

    def __init__(self) -> None:
        self.hook_s = 0.0
        self.last_return: float | None = None
        self.calls = 0

    def wrap(self, hook):
        def timed_hook(state, bucket):
            start = time.perf_counter()
            future = hook(state, bucket)
            self.last_return = time.perf_counter()
            self.hook_s += self.last_return - start
            self.calls += 1
            return future

        return timed_hook

    def attach(self, ddp: DistributedDataParallel) -> None:
        """Make every later ``ddp.register_comm_hook`` register a timed version of its hook."""
        register = ddp.register_comm_hook

        def register_timed(state, hook):
            return register(state, self.wrap(hook))

        ddp.register_comm_hook = register_timed  # instance attribute shadows the method


class StepClock:
    """The time of an epoch's steps, split into communication and the rest (see the module docstring).

    Each step calls :meth:`begin`, :meth:`backward_done`, :meth:`agreed` (after the agreement, if any) and
    :meth:`end`, in this order.
    """

    def __init__(self, timer: CommTimer) -> None:
        self.timer = timer
        self.comm_s = 0.0
        self.busy_s = 0.0
        self.started = time.perf_counter()

    def begin(self) -> None:
        self._begin = time.perf_counter()
        self._hook_s, self.timer.last_return = self.timer.hook_s, None

    def backward_done(self) -> None:
        self._backward_end = time.perf_counter()

    def agreed(self) -> None:
        self._flags_end = time.perf_counter()

    def end(self) -> None:
        end = time.perf_counter()
        timer = self.timer
        tail = self._backward_end - timer.last_return if timer.last_return is not None else 0.0
        self.comm_s += (timer.hook_s - self._hook_s) + tail + (self._flags_end - self._backward_end)
        self.busy_s += end - self._begin

    def elapsed(self) -> float:
        """Seconds since the epoch's first step began (the clock was made)."""
        return time.perf_counter() - self.started


class Agreement(NamedTuple):
    """What the ranks agreed at a check: stop now, a non-finite loss somewhere, a step checkpoint is due."""

    stop: bool = False
    bad: bool = False
    due: bool = False


def agree(*, stop: bool, loss_sum: torch.Tensor, late: bool, device: torch.device) -> Agreement:
    """One small all-reduce (MAX) of every rank's stop request, loss health and checkpoint clock.

    Done at the same steps on every rank, it makes the ranks stop, or fail, at the same step: a rank that broke
    out alone would leave the others waiting in DDP's next all-reduce. A non-finite loss anywhere since the last
    check makes that rank's running ``loss_sum`` non-finite.
    """
    flags = torch.stack([torch.tensor(float(stop), device=device), loss_sum, torch.tensor(float(late), device=device)])
    flags[1] = (~torch.isfinite(flags[1])).float()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return Agreement(bool(flags[0] > 0), bool(flags[1] > 0), bool(flags[2] > 0))


class Alone:
    """What DDP is to a lone trainer with no compression: the model itself.

    An all-reduce over one rank is the identity and DDP's buffer broadcast a no-op, so training is bit for bit
    what it is inside DDP, without DDP's per-step bucket copies and hook calls (2-5 % of a small model's step on
    one core, measured with the process pinned). Offers the parts of DDP the trainer uses.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> Alone:
        self.module.train(mode)
        return self

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def make_ddp(model: torch.nn.Module, *, device_ids: list[int] | None, **options: Any) -> DistributedDataParallel:
    """DDP that does not broadcast buffers at every forward (one more collective a step, where ranks wait for
    each other): rank 0's are sent before validation (:mod:`dask_dl.train.buffers`), and are the checkpointed
    ones. torch 2.13 names the switch ``forward_sync_buffers`` and warns on the older ``broadcast_buffers``,
    which the torch versions before it take. (The new switch still sends rank 0's buffers once, when DDP starts;
    the ranks build the same model either way.) ``options`` go to DDP as they are (``bucket_cap_mb``)."""
    import inspect

    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    switch = "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"
    return DistributedDataParallel(model, device_ids=device_ids, **{switch: False}, **options)
