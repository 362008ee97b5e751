"""What the compression hooks keep between steps, and the helpers every hook path shares.

A hook's state is an explicit object (as torch's ``PowerSGDState``): process group, warm-up, step and byte
counters, parameter names and, for the 1-bit hooks, the error-feedback residuals.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' real annotation objects (``dist.GradBucket``).
import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dask_dl import config
from dask_dl.errors import ConfigurationError

Future = torch.futures.Future[torch.Tensor]


class _Described(NamedTuple):
    """A bucket's parameters and the ``param_names`` mapping as :meth:`HookState.describe` found them, and what it
    made of them."""

    params: list
    param_names: dict
    names: list[str]
    shapes: list[tuple[int, ...]]


class HookState:
    """What every hook keeps: process group, warm-up, step counter, byte counters, parameter names.

    Parameters
    ----------
    process_group : ProcessGroup, optional
        Group to communicate in; when None, the group of the DDP model the compressor is registered on
        (:meth:`Compressor.register <dask_dl.train.compression.Compressor.register>`), else the default group (or
        no communication when torch.distributed is not initialized: one rank).
    warmup_steps : int
        Steps of plain allreduce before compression starts.
    """

    def __init__(self, *, process_group: Any = None, warmup_steps: int = 0) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigurationError(
                f"warmup_steps must be an integer >= 0, got {warmup_steps!r}; pass e.g. warmup_steps=10"
            )
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.step = 0
        self.bytes_sent = 0
        self.wire_bytes = 0
        #: id(parameter) -> name, filled by ``Compressor.register``; residuals are kept by parameter name.
        self.param_names: dict[int, str] = {}
        self._buckets: dict[int, _Described] = {}  # bucket index -> what ``describe`` found

    @property
    def world_size(self) -> int:
        if self.process_group is not None:
            return self.process_group.size()
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        if self.process_group is not None:
            return self.process_group.rank()
        if self.world_size == 1:
            return 0
        return dist.get_rank()

    @property
    def compressing(self) -> bool:
        return self.step >= self.warmup_steps

    def end_bucket(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.step += 1

    def names(self, bucket: dist.GradBucket) -> list[str]:
        """Names of the bucket's parameters; ``"<bucket index>.<position>"`` for unregistered ones."""
        return self.describe(bucket)[0]

    def describe(self, bucket: dist.GradBucket) -> tuple[list[str], list[tuple[int, ...]]]:
        """Names (see :meth:`names`) and shapes of the bucket's parameters.

        Kept per bucket index while DDP hands over the same parameter objects (its buckets change only when it
        rebuilds them) and ``param_names`` is the same mapping: a hook runs just after a kernel swept megabytes
        through the caches, where asking DDP for the gradients' views and their shapes at every call cost about
        50 us a bucket (1 ms a ResNet-50 step).
        """
        params, index = bucket.parameters(), bucket.index()
        kept = self._buckets.get(index)
        if (
            kept is not None
            and kept.param_names is self.param_names
            and len(kept.params) == len(params)
            and all(map(operator.is_, kept.params, params))
        ):
            return kept.names, kept.shapes
        names = [self.param_names.get(id(p), f"{index}.{i}") for i, p in enumerate(params)]
        shapes = [tuple(p.shape) for p in params]
        self._buckets[index] = _Described(list(params), self.param_names, names, shapes)
        return names, shapes

    def count(self, tensor: torch.Tensor, wire_factor: float) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_sent += nbytes
        self.wire_bytes += round(nbytes * wire_factor)


def done(tensor: torch.Tensor) -> Future:
    future: Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def allreduce_mean(state: HookState, tensor: torch.Tensor) -> Future:
    n = state.world_size
    if n == 1:
        return done(tensor)
    state.count(tensor, 2 * (n - 1) / n)
    tensor.div_(n)  # before the sum, as torch's default hook does: no overflow in half precision
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class _Settled:
    """A residual dict of :class:`OneBitState` (``state.stores[name]``), got and set after ``state.settle()``:
    whoever reads it through the state sees errors, never what the kernels still owe."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, state: Any, owner: type | None = None) -> Any:
        if state is None:
            return self
        state.settle()
        return state.stores[self.name]

    def __set__(self, state: Any, value: dict[str, torch.Tensor]) -> None:
        state.settle()
        state.stores[self.name] = value


class OneBitState(HookState):
    """State of the 1-bit hooks: error-feedback residuals, kept per parameter name.

    ``residuals[name]``: this rank's quantization error of the parameter (its shape), added to the next step's
    gradient. ``server_residuals[name]`` (two-stage only): the error of re-quantizing the averaged stripe this
    rank owns, in the parameter's shape, zero outside its stripe. Keeping them by name (not by bucket) keeps
    them valid when DDP rebuilds its buckets and across checkpoints.

    The fused kernels leave part of that error owed between steps (``kernels.quantize``'s ``owed``): the next
    step takes it in the sweep that adds the gradient. Reading ``residuals`` or ``server_residuals`` (a
    checkpoint, a test) first writes what is owed (:meth:`settle`), so they always hold the errors.
    """

    def __init__(self, *, error_feedback: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(error_feedback, bool):
            raise ConfigurationError(f"error_feedback must be True or False, got {error_feedback!r}")
        self.error_feedback = error_feedback
        #: the residual dicts as the hooks keep them (read as ``residuals``/``server_residuals``, they are settled
        #: first): attribute -> name -> tensor
        self.stores: dict[str, dict[str, torch.Tensor]] = {"residuals": {}, "server_residuals": {}}
        #: what the fused kernels owe to the residuals: key -> a function that writes it (see ``settle``)
        self.owed: dict[tuple, Callable[[], None]] = {}
        self.flats: dict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # see ``residuals``
        self.workspace: dict = {}  # temporaries and plans kept between steps
        #: CPU buckets go through the fused kernels (``dask-dl.train.fused-kernels``, read in the trainer's
        #: process); False runs the eager torch reference, as GPU buckets do
        self.fused = bool(config.get("train.fused-kernels"))

    residuals = _Settled()
    server_residuals = _Settled()

    def settle(self) -> None:
        """Write every error the fused kernels left owed into the residuals (cheap when none is)."""
        while self.owed:
            self.owed.popitem()[1]()


def residuals(state: OneBitState, attribute: str, names: list[str], shapes: list, like: torch.Tensor) -> torch.Tensor:
    """One flat float32 tensor of the residuals ``state.stores[attribute][name]`` of a bucket's parameters.

    The residuals stay keyed by name (they outlive DDP's bucket layouts and travel in checkpoints) but are views
    of one tensor per bucket layout, so that a kernel reads and writes them in one sweep. Missing residuals start
    at zero; when the layout changes (a rebuild, a load) the values are copied into a new flat tensor once, so
    what the kernels owe must be settled before (the fused path does when a bucket's plan changes, the eager
    path at each call, a load when it replaces the residuals).
    """
    store = state.stores[attribute]  # as it is: the callers settle what is owed before a layout changes
    key = (attribute, tuple(names))
    kept = state.flats.get(key)
    if kept is not None and all(store.get(n) is v for n, v in zip(names, kept[1], strict=True)):
        return kept[0]
    numels = [math.prod(s) for s in shapes]
    flat = torch.zeros(sum(numels), dtype=torch.float32, device=like.device)
    views, offset = [], 0
    for name, shape, k in zip(names, shapes, numels, strict=True):
        view = flat[offset : offset + k].view(tuple(shape))
        old = store.get(name)
        if old is not None and tuple(old.shape) == tuple(shape):
            view.copy_(old)
        store[name] = view
        views.append(view)
        offset += k
    for other in [k for k in state.flats if k[0] == attribute and set(k[1]) & set(names)]:
        del state.flats[other]  # its views were replaced: drop the stale copy
    state.flats[key] = (flat, views)
    return flat


def gather_then(state, message: torch.Tensor, gathered: torch.Tensor, then, n: int) -> Future:
    """All-gather every rank's ``message`` into ``gathered`` (``n`` ranks), then return ``then()``'s result as a
    future.

    With one rank there is nothing to exchange: the message is its own gather and nothing is counted as sent.
    """
    if n == 1:
        if gathered.data_ptr() != message.data_ptr():  # the fused path passes the message itself
            gathered.copy_(message)
        return done(then())
    state.count(message, n - 1)
    work = dist.all_gather_single(gathered, message, group=state.process_group, async_op=True)
    return work.get_future().then(then)
