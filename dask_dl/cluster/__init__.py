"""Making or connecting to the Dask cluster that dask_dl runs on: a laptop, a GPU box, a gateway, a SLURM centre.

The same script runs anywhere by changing one argument::

    cluster = dask_dl.cluster.make("local")                  # LocalCluster of processes on 127.0.0.1
    cluster = dask_dl.cluster.make("cuda", cpu_workers=8)    # dask-cuda GPU trainers + CPU workers
    cluster = dask_dl.cluster.make("gateway", address=..., workers=4, gpus=1)
    cluster = dask_dl.cluster.make("slurm", queue="gpu", jobs=4, gpus_per_job=1, cpu_jobs=2, cpu_queue="cpu")
    client = Client(cluster)

:func:`connect` opens one for a piece of work and closes on exit exactly what it opened; :func:`get_client`
turns ``client=None`` into a client. Trainers go to workers with a ``GPU`` resource, data work to the others
(:func:`cpu_workers`); :func:`workers_for` picks either on request (``predict(..., on="gpu")``). Any kind runs
with TLS (``security=True`` or :func:`tls_files`).
"""

from __future__ import annotations

from dask_dl.cluster.client import close_client, connect, get_client
from dask_dl.cluster.code import check_importable
from dask_dl.cluster.make import KINDS, make, wait_for_workers
from dask_dl.cluster.storage import check_visible, set_storage_options
from dask_dl.cluster.tls import security_from, tls_files
from dask_dl.cluster.workers import GPU_RESOURCE, WORKER_KINDS, add_cpu_workers, cpu_workers, gpu_workers, workers_for

__all__ = [
    "GPU_RESOURCE",
    "KINDS",
    "WORKER_KINDS",
    "add_cpu_workers",
    "check_importable",
    "check_visible",
    "close_client",
    "connect",
    "cpu_workers",
    "get_client",
    "gpu_workers",
    "make",
    "security_from",
    "set_storage_options",
    "tls_files",
    "wait_for_workers",
    "workers_for",
]
