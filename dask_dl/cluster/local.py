"""``make("local")``: a LocalCluster of worker processes on 127.0.0.1, the default everywhere.

With ``tagged_workers=N`` it is also the stand-in for a GPU box on a machine without GPUs: N CPU workers
advertise a ``GPU`` resource and take the trainers, the other ``n_workers`` are plain CPU workers and take the
data work, under one scheduler, exactly as :func:`dask_dl.cluster.cuda.make_cuda` lays out a real GPU box.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_dl import config
from dask_dl.checks import positive_int
from dask_dl.cluster.sigint import with_preload
from dask_dl.cluster.tls import security_from
from dask_dl.cluster.workers import GPU_RESOURCE, add_cpu_workers
from dask_dl.reproducible import cpu_pinning_environment

if TYPE_CHECKING:  # pragma: no cover
    from distributed import LocalCluster
    from distributed.security import Security

__all__ = ["make_local"]


def make_local(
    *,
    n_workers: int | None = None,
    threads_per_worker: int | None = None,
    memory_limit: str | float | None = None,
    tagged_workers: int | None = None,
    security: Security | bool | None = None,
    **kwargs: Any,
) -> LocalCluster:
    """A ``LocalCluster`` with worker processes, listening on 127.0.0.1 only, dashboard on a free port.

    Parameters
    ----------
    n_workers, threads_per_worker, memory_limit
        Default ``dask-dl.cluster.n-workers``, ``threads-per-worker``, ``memory-limit``.
    tagged_workers
        Extra worker processes that advertise a ``GPU`` resource without having a GPU: a stand-in for GPU workers
        that lets trainer placement and CPU-only data work be tried on any machine (default
        ``dask-dl.cluster.local.tagged-workers``, 0).
    security
        True for TLS with throw-away certificates, or a ``distributed.security.Security``.
    **kwargs
        Go to :class:`distributed.LocalCluster` (``host="0.0.0.0"`` to listen on all interfaces, on purpose).
        With ``dask-dl.train.deterministic`` set, the workers' environment pins their CPU kernels
        (:func:`dask_dl.reproducible.cpu_pinning_environment`), beside ``env=`` if given.

    Returns
    -------
    distributed.LocalCluster
    """
    from distributed import LocalCluster

    n_workers = positive_int("n_workers", config.get("cluster.n-workers", n_workers))
    tagged = int(config.get("cluster.local.tagged-workers", tagged_workers))
    if tagged:
        tagged = positive_int("tagged_workers", tagged)
    security = security_from(security)
    options: dict[str, Any] = {
        "threads_per_worker": config.get("cluster.threads-per-worker", threads_per_worker),
        "memory_limit": config.get("cluster.memory-limit", memory_limit),
        "processes": True,
        "host": "127.0.0.1",  # nothing listens on all interfaces unless asked
        "dashboard_address": "127.0.0.1:0",
    }
    if security is not None:
        options |= {"security": security, "protocol": "tls://"}
    if config.get("train.deterministic"):  # the workers compute as on any other machine: dask_dl.reproducible
        options["env"] = cpu_pinning_environment() | dict(kwargs.pop("env", None) or {})
    options = with_preload(options | kwargs)  # the worker processes leave Ctrl-C to the driver
    if "host" in kwargs and "dashboard_address" not in kwargs:
        options["dashboard_address"] = f"{kwargs['host']}:0"
    if not tagged:
        cluster = LocalCluster(n_workers=n_workers, **options)
        cluster._dask_dl_workers = n_workers
        return cluster
    cluster = LocalCluster(n_workers=tagged, resources={GPU_RESOURCE: 1}, **options)
    try:
        add_cpu_workers(cluster, n_workers)
    except BaseException:
        cluster.close()
        raise
    cluster._dask_dl_workers = tagged + n_workers
    return cluster
