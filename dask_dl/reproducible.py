"""Runs that give the same numbers on every machine: what a seed cannot fix by itself.

A seed fixes the initial weights, the data order and the augmentation. The arithmetic is the other half. PyTorch's
own CPU kernels (ATen), oneDNN (convolutions) and MKL (matrix products) each choose a code path by the processor's
instruction set when they load, and an AVX-512 path adds the terms of a sum in another order than an AVX2 path.
Float addition is not associative, so the same seed on two machines that differ only in their processor gives
weights that drift apart by a rounding error per step, and after a few hundred steps by enough to move a
validation AUROC by 0.03.

Each library reads one environment variable that caps the instruction set it uses; set before torch loads, they
make a processor with AVX-512 compute exactly as one with AVX2 does:

``ATEN_CPU_CAPABILITY=avx2``
    PyTorch's vectorised CPU kernels;
``ONEDNN_MAX_CPU_ISA=AVX2``
    oneDNN's convolutions and matrix products;
``MKL_CBWR=AVX2``
    MKL's conditional numerical reproducibility branch.

:func:`cpu_pinning_environment` returns them (nothing on a processor without AVX2, whose kernels are then the
same everywhere anyway), and :func:`pin_cpu_kernels` sets them for this process and the processes it starts.
``dask-dl.train.deterministic: true`` turns on ``torch.use_deterministic_algorithms`` in the trainers, and
``make("local")`` gives its workers the pinned environment. Workers started elsewhere (a batch job, a gateway)
need these variables in their own environment.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import MutableMapping

__all__ = ["PINNED_CPU_KERNELS", "cpu_pinning_environment", "pin_cpu_kernels"]

PINNED_CPU_KERNELS: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:  # not Linux: no way to ask without torch; AVX2 is in every x86-64 processor since 2015
        return True


def cpu_pinning_environment() -> dict[str, str]:
    """The environment variables that pin PyTorch's CPU kernels to AVX2, or ``{}`` where there is nothing to pin.

    Returns
    -------
    dict
        :data:`PINNED_CPU_KERNELS` on an x86-64 processor with AVX2; ``{}`` on other processors (Arm has one set of
        kernels) and on x86-64 processors without AVX2.

    Examples
    --------
    >>> env = cpu_pinning_environment()
    >>> env in ({}, PINNED_CPU_KERNELS)
    True
    """
    if platform.machine().lower() not in ("x86_64", "amd64") or not _has_avx2():
        return {}
    return dict(PINNED_CPU_KERNELS)


def pin_cpu_kernels(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the variables of :func:`cpu_pinning_environment` in ``environ`` where they are not set already.

    Call it before anything imports torch: the libraries read the variables once, when they load.

    Parameters
    ----------
    environ
        Default ``os.environ``: this process and every process it starts (local workers, notebook kernels).

    Returns
    -------
    dict
        The variables it set (those already set are left as the user set them).

    Raises
    ------
    RuntimeError
        ``environ`` is ``os.environ`` and torch is imported already: its kernels are chosen, and setting the
        variables now would pin the processes it starts but not this one.
    """
    if environ is None:
        environ = os.environ
        if "torch" in sys.modules:
            raise RuntimeError(
                "pin_cpu_kernels() was called after torch was imported: its CPU kernels are chosen already; "
                "call it first thing (before importing torch or anything that imports it), or set "
                + ", ".join(f"{k}={v}" for k, v in PINNED_CPU_KERNELS.items())
                + " in the environment"
            )
    added = {k: v for k, v in cpu_pinning_environment().items() if k not in environ}
    environ.update(added)
    return added
