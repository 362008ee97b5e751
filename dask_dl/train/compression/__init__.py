"""Gradient compression for DistributedDataParallel, as DDP communication hooks with explicit state.

========== ==========================================================================================
name       what a rank sends per step (``n`` gradient values, ``N`` ranks; see ``hooks`` for the count)
========== ==========================================================================================
none       allreduce of the float32 bucket: ``4 n`` bytes
fp16       torch's ``fp16_compress_hook``: ``2 n``
bf16       torch's ``bf16_compress_hook``: ``2 n``
powersgd   torch's ``powerSGD_hook``: ``4 (sum of (rows + cols) * rank over compressed matrices + the rest)``
onebit     1-bit SGD, all-gather: ``n / 8 + 8 * columns``
onebit2    two-stage 1-bit SGD: all-to-all ``~ n / 8 + 8 * columns``, all-gather ``~ (n / 8 + 8 * columns) / N``
========== ==========================================================================================

Every compressor runs ``warmup_steps`` plain allreduce steps first. Use :func:`make_compressor`, then
``compressor.register(ddp_model)``; ``compressor.bytes_sent`` counts the bytes this rank handed to
torch.distributed, ``compressor.state_dict()`` holds what a checkpoint needs to resume identically.
"""

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
from dask_dl.train.compression.quantize import pack_signs, unpack_signs
from dask_dl.train.compressors import COMPRESSORS

__all__ = ["COMPRESSORS", "Compressor", "make_compressor", "pack_signs", "unpack_signs"]

_OPTIONS: dict[str, tuple[str, ...]] = {
    "none": (),
    "fp16": (),
    "bf16": (),
    "powersgd": ("rank", "min_compression_rate", "error_feedback", "warm_start", "seed"),
    "onebit": ("error_feedback",),
    "onebit2": ("error_feedback",),
}


class Compressor:
    """A named gradient compressor: a DDP comm hook and its state.

    Build it with :func:`make_compressor`. ``hook(state, bucket)`` can also be called directly with any object
    that has DDP's ``GradBucket`` interface.
    """

    def __init__(self, name: str, state: HookState, hook: Callable[[Any, Any], torch.futures.Future]) -> None:
        self.name = name
        self.state = state
        self.hook = hook

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
        """Register the hook on ``ddp_model`` and learn its parameter names (residuals are kept by name)."""
        self.state.param_names = {id(p): name for name, p in ddp_model.module.named_parameters()}
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
        One of :data:`COMPRESSORS`: ``none``, ``fp16``, ``bf16``, ``powersgd``, ``onebit``, ``onebit2``.
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
    unknown = sorted(set(options) - set(_OPTIONS[name]))
    if unknown:
        allowed = ", ".join(_OPTIONS[name]) or "none"
        raise ConfigurationError(
            f"unknown option(s) {', '.join(unknown)} for compressor {name!r}; its options: {allowed}"
        )
    common = {"warmup_steps": warmup_steps, "process_group": process_group}
    if name == "none":
        return Compressor(name, HookState(**common), allreduce_hook)
    if name in ("fp16", "bf16"):
        dtype = torch.float16 if name == "fp16" else torch.bfloat16
        return Compressor(name, CastState(dtype, **common), cast_hook)
    if name == "powersgd":
        return Compressor(name, PowerSGDHookState(**common, **options), powersgd_hook)
    hook = onebit_hook if name == "onebit" else onebit2_hook
    return Compressor(name, OneBitState(**common, **options), hook)
