"""The fused CPU path of the 1-bit hooks: the kernels of :mod:`dask_dl.train.compression.kernels` on a bucket.

Per step and bucket, ``onebit`` makes one compress sweep (gradient and residual read, residual and message
written) and one decode sweep (all ``N`` messages read, the bucket written once); ``onebit2`` makes a compress
sweep, a server sweep over its own stripe (decode the ``N`` stripe messages, add the server residual,
re-quantize) and an assembling sweep. Results equal the eager path's (:mod:`dask_dl.train.compression.eager`)
sign for sign; scales agree to float32 rounding (both sum in float64, in different orders), and decoded means
exactly for two ranks (for more, the fused path sums in float64, the eager one in float32).
"""

# No ``from __future__ import annotations``: kept like the hooks'.
from functools import partial
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


class _Message:
    """A uint8 message buffer: ``flat``, the tensor the collectives take, and ``rows``, the ``(messages, size)``
    array the kernels take."""

    def __init__(self, rows: int, size: int) -> None:
        self.flat = torch.empty(rows * size, dtype=torch.uint8)
        self.rows = self.flat.numpy().reshape(rows, size)


def _message(state: OneBitState, name: str, key: tuple, rows: int, size: int) -> _Message:
    """The message buffer ``name`` of bucket ``key``, kept between steps while its shape holds (a fresh one
    costs page faults on first touch), also when the bucket's parameters change."""
    kept = state.workspace.get((name, *key))
    if kept is None or kept.rows.shape != (rows, size):
        kept = state.workspace[(name, *key)] = _Message(rows, size)
    return kept


class _Bucket:
    """What the fused path keeps for a bucket between steps, made again when its parameters (the ``names`` list
    :meth:`~dask_dl.train.compression.state.HookState.describe` keeps), the world size or the rank change.

    A hook runs just after a kernel swept megabytes through the caches, where every tensor view, NumPy view and
    dictionary lookup made again at each call cost tens of microseconds; these are made once. Safe to reuse:
    DDP waits for every bucket's future before the next step starts.

    It also keeps the means the residuals owe their errors against (``kernels.quantize``'s ``owed``): a new
    record for the same plan takes them over; one for another plan (other parameters, world size or rank) comes
    after :meth:`~dask_dl.train.compression.state.OneBitState.settle`.
    """

    def __init__(
        self, state: OneBitState, key: tuple, names: list[str], plan: StripePlan, n: int, rank: int, two_stage: bool
    ) -> None:
        self.names, self.plan, self.n, self.rank = names, plan, n, rank
        size = plan.size
        self.arrays: dict[str, tuple[torch.Tensor, np.ndarray]] = {}  # tensor.numpy(), while the same tensor
        self.server_owed: np.ndarray | None = None  # onebit2: the means the server residual owes errors against
        if not two_stage:  # onebit: one message of the whole bucket
            self.message = _message(state, "message", key, 1, size)
            self.gathered = self.message if n == 1 else _message(state, "gathered", key, n, size)
            self.decode_columns = plan.columns.repeat(n)
            self.owed = kernels.owed_means(1, plan.columns)  # the means the worker residual owes errors against
            return
        self.send = _message(state, "send", key, n, size)  # stripe k's signs and scales go to rank k
        # one rank receives what it sends
        self.received = self.send if n == 1 else _message(state, "received", key, n, size)
        self.message = _message(state, "stripe", key, 1, size)  # the stripe this rank owns, re-quantized
        self.gathered = self.message if n == 1 else _message(state, "gathered", key, n, size)
        self.own_tasks, self.own_columns = plan.own_tasks(rank), plan.columns[rank : rank + 1]
        self.owed = kernels.owed_means(n, plan.columns)
        self.server_owed = kernels.owed_means(1, self.own_columns)

    def array(self, name: str, tensor: torch.Tensor) -> np.ndarray:
        """``tensor.numpy()`` of a tensor the state owns (the residuals: one flat tensor per bucket layout), kept
        while the same tensor object comes back."""
        kept = self.arrays.get(name)
        if kept is None or kept[0] is not tensor:
            kept = self.arrays[name] = (tensor, tensor.numpy())
        return kept[1]


def _bucket(state: OneBitState, names: list[str], shapes: list, key, two_stage: bool) -> _Bucket:
    n = state.world_size
    rank = state.rank if two_stage else 0
    kept = state.workspace.get(("bucket", *key))
    if kept is None or kept.names is not names or kept.n != n or kept.rank != rank:
        plan = _plan(state, names, shapes, n if two_stage else 1)
        new = _Bucket(state, key, names, plan, n, rank, two_stage)
        if kept is not None and kept.plan is plan and kept.rank == rank:  # the same groups: what is owed stays
            new.owed, new.server_owed = kept.owed, kept.server_owed
        else:
            state.settle()  # what a residual owes is against the old record's plan
        kept = state.workspace[("bucket", *key)] = new
    return kept


def onebit_fused(state: OneBitState, names: list[str], shapes: list, buffer: torch.Tensor, key, *, two_stage) -> Future:
    """Quantize the CPU bucket ``buffer`` with the kernels, exchange, and return the future of the mean."""
    b = _bucket(state, names, shapes, key, two_stage)
    plan, n = b.plan, b.n
    grad = buffer.numpy()  # not kept: a reference would keep the caller's tensor alive past the call
    ef = state.error_feedback
    worker = b.array("residuals", residuals(state, "residuals", names, shapes, buffer)) if ef else None
    if ef:  # the worker residual owes its errors against b.owed until this bucket's next call, or a settle
        state.owed["residuals", key] = partial(kernels.settle, plan.tasks, worker, b.owed)
    if not two_stage:
        kernels.quantize(plan.tasks, b.message.rows, plan.columns, grad=grad, vals=worker, ef=ef, owed=b.owed)

        def average(_: Any = None) -> torch.Tensor:
            kernels.decode(plan.tasks, b.gathered.rows, b.decode_columns, grad, average=True)
            return buffer

        return gather_then(state, b.message.flat, b.gathered.flat, average, n)
    # Stage 1: every rank sends stripe k's signs and scales to rank k.
    kernels.quantize(plan.tasks, b.send.rows, plan.columns, grad=grad, vals=worker, ef=ef, owed=b.owed)
    if n > 1:
        state.count(b.send.flat, (n - 1) / n)
        dist.all_to_all_single(b.received.flat, b.send.flat, group=state.process_group)
    # Stage 2: average the stripe this rank owns, add the server residual, re-quantize, all-gather the stripes.
    server = b.array("server", residuals(state, "server_residuals", names, shapes, buffer)) if ef else grad
    if ef:
        state.owed["server_residuals", key] = partial(kernels.settle, b.own_tasks, server, b.server_owed)
    kernels.quantize(
        b.own_tasks, b.message.rows, b.own_columns, received=b.received.rows, vals=server, ef=ef, owed=b.server_owed
    )

    def assemble(_: Any = None) -> torch.Tensor:
        kernels.decode(plan.tasks, b.gathered.rows, plan.columns, grad, average=False)
        return buffer

    return gather_then(state, b.message.flat, b.gathered.flat, assemble, n)


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
