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
:data:`COMPRESSORS` lists the names with a help line each, without importing torch.

The modules: ``compressor`` (:class:`Compressor`, :func:`make_compressor`), ``state`` (what hooks keep),
``hooks`` (the hooks), ``quantize`` (groups, messages and the eager torch quantizer), ``eager`` (the 1-bit
hooks in torch operations: the reference, and the path for GPU tensors), ``plan`` and ``kernels`` (the fused
numba kernels the 1-bit hooks run on CPU buckets), ``simd`` (their vector loops, in LLVM IR), ``fused`` (the
hooks' use of them), ``powersgd``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_dl.train.compressors import COMPRESSORS  # the registry of names and help lines (no torch)

if TYPE_CHECKING:
    from dask_dl.train.compression.compressor import Compressor, make_compressor
    from dask_dl.train.compression.quantize import pack_signs, unpack_signs

__all__ = ["COMPRESSORS", "Compressor", "make_compressor", "pack_signs", "unpack_signs"]

_LAZY = {
    "Compressor": "dask_dl.train.compression.compressor",
    "make_compressor": "dask_dl.train.compression.compressor",
    "pack_signs": "dask_dl.train.compression.quantize",
    "unpack_signs": "dask_dl.train.compression.quantize",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
