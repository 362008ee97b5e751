"""The :class:`Compressor` (a named DDP comm hook and its state) and :func:`make_compressor`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dask_dl.errors import ConfigurationError
from dask_dl.train.compression.hooks import (
    CastState,
    HookState,
    OneBitState,
    allreduce_hook,
    cast_hook,
    onebit2_hook,
    onebit_hook,
)
from dask_dl.train.compression.powersgd import PowerSGDHookState, powersgd_hook
from dask_dl.train.compressors import COMPRESSORS

__all__ = ["Compressor", "make_compressor"]


class Compressor:
    """A named gradient compressor: a DDP comm hook and its state.

    Build it with :func:`make_compressor`. ``hook(state, bucket)`` can also be called directly with any object
    that has DDP's ``GradBucket`` interface.
    """

    def __init__(self, name: str, state: HookState, hook: Callable[[Any, Any], torch.futures.Future]) -> None:
        self.name = name
        self.state = state
        self.hook = hook
        self._group = state.process_group  # the group asked for; None: each DDP model's own (see ``register``)

    def __repr__(self) -> str:
        return f"Compressor({self.name!r}, step={self.step}, bytes_sent={self.bytes_sent})"

    @property
    def bytes_sent(self) -> int:
        """Bytes of the tensors this rank's hook handed to torch.distributed collectives, since creation."""
        return int(self.state.bytes_sent)

    @property
    def wire_bytes(self) -> int:
        """Estimated bytes this rank put on the network (ring allreduce, all-gather, all-to-all), since creation."""
        return int(self.state.wire_bytes)

    @property
    def step(self) -> int:
        """Training steps (DDP iterations) seen so far, warm-up included."""
        return int(self.state.step)

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register the hook on ``ddp_model`` and learn its parameter names (residuals are kept by name) and, unless
        the compressor was made for a group of its own, the process group DDP reduces in.

        The 1-bit compressors compile (or load from numba's cache) their kernels here, not in a training step.
        """
        self.state.param_names = {id(p): name for name, p in ddp_model.module.named_parameters()}
        if self._group is None:  # the hook averages over the group DDP reduces in (a C++ call a bucket to ask)
            self.state.process_group = ddp_model.process_group
        on_cpu = all(p.device.type == "cpu" for p in ddp_model.module.parameters())
        if isinstance(self.state, OneBitState) and self.state.fused and on_cpu:  # GPU buckets: the torch path
            from dask_dl.train.compression.fused import warm_up  # numba: imported when first needed

            warm_up()
        ddp_model.register_comm_hook(self.state, self.hook)

    def state_dict(self) -> dict[str, Any]:
        """Residuals, step and byte counters as plain tensors, ints and dicts (``torch.load(weights_only=True)``)."""
        s = self.state
        out: dict[str, Any] = {
            "format": 1,
            "name": self.name,
            "step": int(s.step),
            "warmup_steps": int(s.warmup_steps),
            "bytes_sent": int(s.bytes_sent),
            "wire_bytes": int(s.wire_bytes),
        }
        if isinstance(s, OneBitState):
            out["residuals"] = {k: v.detach().clone() for k, v in s.residuals.items()}
            out["server_residuals"] = {k: v.detach().clone() for k, v in s.server_residuals.items()}
        if isinstance(s, PowerSGDHookState):
            out["powersgd"] = s.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (residuals go to the device they were saved on)."""
        if state_dict.get("name") != self.name:
            raise ConfigurationError(
                f"this compressor state was saved by {state_dict.get('name')!r}, not {self.name!r}; resume with "
                f"compression={state_dict.get('name')!r} or start without the compressor state"
            )
        s = self.state
        s.step = int(state_dict["step"])
        s.bytes_sent = int(state_dict["bytes_sent"])
        s.wire_bytes = int(state_dict.get("wire_bytes", 0))
        if isinstance(s, OneBitState):
            s.residuals = {k: v.clone() for k, v in state_dict["residuals"].items()}
            s.server_residuals = {k: v.clone() for k, v in state_dict["server_residuals"].items()}
        if isinstance(s, PowerSGDHookState):
            s.load_state_dict(state_dict["powersgd"])


def make_compressor(name: str, *, warmup_steps: int = 0, process_group: Any = None, **options: Any) -> Compressor:
    """Return the gradient compressor ``name`` for DDP.

    Parameters
    ----------
    name : str
        A name in :data:`COMPRESSORS`: ``none``, ``fp16``, ``bf16``, ``powersgd``, ``onebit``, ``onebit2``.
    warmup_steps : int
        Plain allreduce steps before compression starts (``powersgd`` needs 2 or more with error feedback).
    process_group : ProcessGroup, optional
        Group to communicate in; default: the default group.
    **options
        ``powersgd``: ``rank=1``, ``min_compression_rate=2.0``, ``error_feedback=True``, ``warm_start=True``,
        ``seed=0`` (torch's ``PowerSGDState`` arguments). ``onebit``/``onebit2``: ``error_feedback=True``
        (False only to show why it matters).

    Returns
    -------
    Compressor
        Call ``compressor.register(ddp_model)``.

    Raises
    ------
    ConfigurationError
        For an unknown name or option, or an option value out of range.

    Examples
    --------
    >>> compressor = make_compressor("onebit", warmup_steps=10)
    >>> compressor.name, compressor.bytes_sent
    ('onebit', 0)
    """
    COMPRESSORS.entry(name)  # the registry's error for unknown names lists them
    build = _BUILDERS[name]
    unknown = sorted(set(options) - set(build.options))
    if unknown:
        allowed = ", ".join(build.options) or "none"
        raise ConfigurationError(
            f"unknown option(s) {', '.join(unknown)} for compressor {name!r}; its options: {allowed}"
        )
    return build(name, warmup_steps=warmup_steps, process_group=process_group, **options)


def _builder(*options: str) -> Callable[[Callable[..., Compressor]], Callable[..., Compressor]]:
    def decorate(build: Callable[..., Compressor]) -> Callable[..., Compressor]:
        build.options = options  # type: ignore[attr-defined]
        return build

    return decorate


@_builder()
def build_none(name: str, **common: Any) -> Compressor:
    return Compressor(name, HookState(**common), allreduce_hook)


@_builder()
def build_cast(name: str, **common: Any) -> Compressor:
    dtype = torch.float16 if name == "fp16" else torch.bfloat16
    return Compressor(name, CastState(dtype, **common), cast_hook)


@_builder("rank", "min_compression_rate", "error_feedback", "warm_start", "seed")
def build_powersgd(name: str, **kwargs: Any) -> Compressor:
    return Compressor(name, PowerSGDHookState(**kwargs), powersgd_hook)


@_builder("error_feedback")
def build_onebit(name: str, **kwargs: Any) -> Compressor:
    return Compressor(name, OneBitState(**kwargs), onebit_hook if name == "onebit" else onebit2_hook)


_BUILDERS: dict[str, Callable[..., Compressor]] = {
    "none": build_none,
    "fp16": build_cast,
    "bf16": build_cast,
    "powersgd": build_powersgd,
    "onebit": build_onebit,
    "onebit2": build_onebit,
}
