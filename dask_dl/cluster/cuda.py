"""``make("cuda")``: one GPU box: dask-cuda trainer workers (one per GPU) plus CPU workers, one scheduler.

dask-cuda's ``LocalCUDACluster`` starts one worker per GPU with ``CUDA_VISIBLE_DEVICES`` rotated so that each
worker's own GPU is its device 0; dask_dl tags them with a ``GPU`` resource (trainers go there) and adds CPU
workers, with no GPU visible, for ingest, synthesis and scoring. On a machine without GPUs this fails with an
error that says so and what to use instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from typing import TYPE_CHECKING, Any

from dask_dl import config
from dask_dl.checks import positive_int
from dask_dl.cluster.sigint import with_preload
from dask_dl.cluster.tls import security_from
from dask_dl.cluster.workers import GPU_RESOURCE, add_cpu_workers
from dask_dl.errors import ClusterError, missing_dependency

if TYPE_CHECKING:  # pragma: no cover
    from distributed.security import Security

__all__ = ["gpu_count", "make_cuda"]

logger = logging.getLogger(__name__)


def gpu_count() -> int:
    """Number of NVIDIA GPUs this process may use (``CUDA_VISIBLE_DEVICES`` respected); 0 without a driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return 0
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("nvidia-smi -L failed (%s): taking this machine as one without GPUs", exc)
        return 0
    n = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    if visible is not None:
        n = min(n, len([d for d in visible.split(",") if d.strip()]))
    return n


def make_cuda(
    *,
    n_workers: int | None = None,
    cpu_workers: int | None = None,
    threads_per_worker: int | None = None,
    memory_limit: str | float | None = None,
    security: Security | bool | None = None,
    **kwargs: Any,
) -> Any:
    """A dask-cuda ``LocalCUDACluster`` (one trainer worker per GPU) with CPU workers under the same scheduler.

    Parameters
    ----------
    n_workers
        GPU workers; default every visible GPU.
    cpu_workers
        CPU workers beside them for data work; default ``dask-dl.cluster.cuda.cpu-workers``.
    threads_per_worker, memory_limit
        Of the CPU workers; default ``dask-dl.cluster.threads-per-worker`` / ``memory-limit``.
    security
        True for TLS with throw-away certificates, or a ``distributed.security.Security``.
    **kwargs
        Go to ``dask_cuda.LocalCUDACluster`` (``rmm_pool_size``, ``protocol="ucx"``, ``CUDA_VISIBLE_DEVICES``, ...).

    Returns
    -------
    dask_cuda.LocalCUDACluster

    Raises
    ------
    ClusterError
        No GPU on this machine, or fewer than ``n_workers``.
    MissingDependencyError
        dask-cuda is not installed.
    """
    gpus = gpu_count()
    if gpus == 0:
        raise ClusterError(
            "make('cuda') needs NVIDIA GPUs, and this machine has none (nvidia-smi found no GPU"
            f"{'' if shutil.which('nvidia-smi') else ', or is not installed'}); use make('local') for CPU "
            "workers, or make('local', tagged_workers=2) to try GPU-style placement on CPU workers"
        )
    n_gpu = gpus if n_workers is None else positive_int("n_workers", n_workers, example=gpus)
    if n_gpu > gpus:
        raise ClusterError(
            f"make('cuda', n_workers={n_gpu}) asks for more GPU workers than the {gpus} GPUs here; "
            f"pass n_workers={gpus}"
        )
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        raise missing_dependency("dask-cuda", "gpu", "make('cuda')") from None
    n_cpu = int(config.get("cluster.cuda.cpu-workers", cpu_workers))
    security = security_from(security)
    options: dict[str, Any] = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}
    if security is not None:
        options |= {"security": security, "protocol": "tls://"}
    options = with_preload(options | kwargs)  # the worker processes leave Ctrl-C to the driver
    resources = dict(options.pop("resources", {}) or {}) | {GPU_RESOURCE: 1}
    cluster = LocalCUDACluster(n_workers=n_gpu, threads_per_worker=1, resources=resources, **options)
    try:
        add_cpu_workers(
            cluster,
            n_cpu,
            options={
                "nthreads": config.get("cluster.threads-per-worker", threads_per_worker),
                "memory_limit": config.get("cluster.memory-limit", memory_limit),
            },
        )
    except BaseException:
        cluster.close()
        raise
    cluster._dask_dl_workers = n_gpu + n_cpu
    return cluster
