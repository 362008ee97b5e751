"""Gradient compressors by name: one :class:`~dask_dl.registry.Registry` of DDP comm hooks.

The hooks live in :mod:`dask_dl.train.compression` (which imports torch); they are registered here by
``"module:attribute"`` path so that the names and their help lines (the CLI's ``--compression`` choices,
``fit``'s checks) are known without importing torch. :func:`dask_dl.train.compression.make_compressor` builds the
state that goes with each hook.
"""

from __future__ import annotations

from dask_dl.registry import Registry

__all__ = ["AUTO", "COMPRESSORS", "choices"]

#: compressor name -> DDP comm hook ``(state, bucket) -> Future``
COMPRESSORS = Registry("compressor", argument="compression")

_HOOKS = "dask_dl.train.compression.hooks"
COMPRESSORS.register("none", f"{_HOOKS}:allreduce_hook", help="float32 all-reduce: 4 bytes per value")
COMPRESSORS.register("fp16", f"{_HOOKS}:cast_hook", help="float16 all-reduce: 2 bytes per value")
COMPRESSORS.register("bf16", f"{_HOOKS}:cast_hook", help="bfloat16 all-reduce: 2 bytes per value")
COMPRESSORS.register(
    "powersgd", "dask_dl.train.compression.powersgd:powersgd_hook", help="low-rank PowerSGD (Vogels et al. 2019)"
)
COMPRESSORS.register("onebit", f"{_HOOKS}:onebit_hook", help="1-bit SGD with error feedback, all-gather")
COMPRESSORS.register(
    "onebit2", f"{_HOOKS}:onebit2_hook", help="two-stage 1-bit SGD: bytes per rank independent of the rank count"
)

#: ``compression="auto"``: not a hook, but the choice of one at run start (dask_dl.train.compression.auto)
AUTO = "auto"
AUTO_HELP = "the compressor the scale-out model predicts fastest, from the link and compute time measured at start"


def choices() -> list[str]:
    """What ``compression=`` takes: every compressor's name, and ``auto``."""
    return [*COMPRESSORS.names(), AUTO]
