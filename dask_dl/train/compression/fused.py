"""The fused CPU path of the 1-bit hooks: the kernels of :mod:`dask_dl.train.compression.kernels` on a bucket.

Per step and bucket, ``onebit`` makes one compress sweep (gradient and residual read, residual and message
written) and one decode sweep (all ``N`` messages read, the bucket written once); ``onebit2`` makes a compress
sweep, a server sweep over its own stripe (decode the ``N`` stripe messages, add the server residual,
re-quantize) and an assembling sweep. Results equal the eager path's (:mod:`dask_dl.train.compression.eager`)
sign for sign; scales agree to float32 rounding (both sum in float64, in different orders), and decoded means
exactly for two ranks (for more, the fused path sums in float64, the eager one in float32).
"""

# No ``from __future__ import annotations``: kept like the hooks'.
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dask_dl.train.compression import kernels
from dask_dl.train.compression.plan import StripePlan, plan_stripes
from dask_dl.train.compression.state import Future, OneBitState, gather_then, residuals


def _plan(state: OneBitState, names: list[str], shapes: list[tuple[int, ...]], n: int) -> StripePlan:
    key = ("plan", tuple(names), tuple(shapes), n)
    plan = state.workspace.get(key)
    if plan is None:
        plan = state.workspace[key] = plan_stripes(shapes, names, n)
    return plan


def _kept(state: OneBitState, key: tuple, shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 tensor kept between steps (a fresh one costs page faults on first touch). Safe to reuse: DDP
    waits for every bucket's future before the next step starts."""
    kept = state.workspace.get(key)
    if kept is None or tuple(kept.shape) != shape:
        kept = state.workspace[key] = torch.empty(shape, dtype=torch.uint8)
    return kept


def onebit_fused(state: OneBitState, names: list[str], shapes: list, buffer: torch.Tensor, key, *, two_stage) -> Future:
    """Quantize the CPU bucket ``buffer`` with the kernels, exchange, and return the future of the mean."""
    n = state.world_size
    plan = _plan(state, names, shapes, n if two_stage else 1)
    grad = buffer.numpy()
    ef = state.error_feedback
    worker = residuals(state, "residuals", names, shapes, buffer).numpy() if ef else None
    size = plan.size
    if not two_stage:
        message = _kept(state, ("message", *key), (1, size))
        kernels.quantize(plan.tasks, message.numpy(), plan.columns, grad=grad, vals=worker, ef=ef)
        gathered = message.view(-1) if n == 1 else _kept(state, ("gathered", *key), (n * size,))

        def average(_: Any = None) -> torch.Tensor:
            kernels.decode(plan.tasks, gathered.view(n, size).numpy(), plan.columns.repeat(n), grad, average=True)
            return buffer

        return gather_then(state, message.view(-1), gathered, average, n)
    # Stage 1: every rank sends stripe k's signs and scales to rank k.
    send = _kept(state, ("send", *key), (n, size))
    kernels.quantize(plan.tasks, send.numpy(), plan.columns, grad=grad, vals=worker, ef=ef)
    received = send  # one rank: its stripe message is what it receives
    if n > 1:
        received = _kept(state, ("received", *key), (n, size))
        state.count(send, (n - 1) / n)
        dist.all_to_all_single(received.view(-1), send.view(-1), group=state.process_group)
    # Stage 2: average the stripe this rank owns, add the server residual, re-quantize, all-gather the stripes.
    rank = state.rank
    server = residuals(state, "server_residuals", names, shapes, buffer).numpy() if ef else grad
    message = _kept(state, ("stripe", *key), (1, size))
    columns = plan.columns[rank : rank + 1]
    kernels.quantize(plan.own_tasks(rank), message.numpy(), columns, received=received.numpy(), vals=server, ef=ef)
    gathered = message.view(-1) if n == 1 else _kept(state, ("gathered", *key), (n * size,))

    def assemble(_: Any = None) -> torch.Tensor:
        kernels.decode(plan.tasks, gathered.view(n, size).numpy(), plan.columns, grad, average=False)
        return buffer

    return gather_then(state, message.view(-1), gathered, assemble, n)


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel on a tiny bucket, so that no training step pays it.

    Both twins of each kernel where the parallel one can run (torch on more than one thread), the serial one only
    otherwise.
    """
    try:
        for kernels._FORCE in (0, 1) if torch.get_num_threads() > 1 else (1,):
            for transposed_shape in ((2, 9), (9, 2)):
                plan = plan_stripes([transposed_shape], ["w"], 1)
                values = np.arange(18, dtype=np.float32) - 9
                residual = np.zeros(18, dtype=np.float32)
                msgs = np.zeros((1, plan.size), dtype=np.uint8)
                kernels.quantize(plan.tasks, msgs, plan.columns, grad=values, vals=residual)
                kernels.quantize(plan.own_tasks(0), msgs.copy(), plan.columns, received=msgs, vals=residual)
                kernels.decode(plan.tasks, msgs, plan.columns, values, average=True)
                kernels.decode(plan.tasks, msgs, plan.columns, values, average=False)
    finally:
        kernels._FORCE = None
