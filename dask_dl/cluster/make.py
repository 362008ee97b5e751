"""``make(kind, **kwargs)``: one call for a laptop, a GPU box, a dask-gateway and a SLURM centre.

Each kind lives in its own module and registers its maker below. Settings come from the arguments, then from
``dask.config`` under ``dask-dl.cluster.<kind>.*`` (so a site sets its defaults once in a yaml), and keyword
arguments dask_dl does not use go through to the underlying class (``LocalCluster``, ``LocalCUDACluster``,
``GatewayCluster``, ``SLURMCluster``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dask_dl import config
from dask_dl.cluster.workers import scheduler_workers
from dask_dl.errors import ClusterError
from dask_dl.registry import Registry

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["KINDS", "make", "wait_for_workers"]

logger = logging.getLogger(__name__)

KINDS = Registry("cluster kind", argument="kind")
KINDS.register("local", "dask_dl.cluster.local:make_local", help="LocalCluster of processes on 127.0.0.1")
KINDS.register("cuda", "dask_dl.cluster.cuda:make_cuda", help="dask-cuda GPU trainers plus CPU workers")
KINDS.register("gateway", "dask_dl.cluster.gateway:make_gateway", help="a cluster of a dask-gateway server")
KINDS.register("slurm", "dask_dl.cluster.slurm:make_slurm", help="dask-jobqueue SLURM jobs (GPU and CPU jobs)")


def make(kind: str | None = None, **kwargs: Any) -> Any:
    """Make a Dask cluster of ``kind``; ``Client(cluster)`` connects to it, ``cluster.close()`` ends it.

    Parameters
    ----------
    kind
        ``local`` (default, ``dask-dl.cluster.kind``), ``cuda``, ``gateway`` or ``slurm``.
    **kwargs
        The kind's options (see :func:`~dask_dl.cluster.local.make_local`, :func:`~dask_dl.cluster.cuda.make_cuda`,
        :func:`~dask_dl.cluster.gateway.make_gateway`, :func:`~dask_dl.cluster.slurm.make_slurm`); every kind takes
        ``n_workers`` (workers, or jobs) and ``security`` (TLS); other keywords go to the underlying class.

    Returns
    -------
    distributed.deploy.Cluster
        The cluster; its workers may still be starting (a batch queue): :func:`wait_for_workers` waits for them.

    Raises
    ------
    ConfigurationError
        An unknown kind, or an option with a bad value.
    ClusterError
        The kind cannot run here (``cuda`` without a GPU).
    MissingDependencyError
        The kind's package is not installed; the message names the extra.

    Examples
    --------
    >>> cluster = make("local", n_workers=2)  # doctest: +SKIP
    >>> cluster = make("cuda", cpu_workers=8)  # doctest: +SKIP
    >>> cluster = make("gateway", address="https://gateway.example.org", workers=4, gpus=1)  # doctest: +SKIP
    >>> cluster = make("slurm", queue="gpu", jobs=4, gpus_per_job=1, cpu_jobs=2, cpu_queue="cpu")  # doctest: +SKIP
    """
    kind = config.get("cluster.kind", kind)
    maker = KINDS.get(kind)
    cluster = maker(**kwargs)
    logger.info("made a %s cluster: %s", kind, cluster)
    return cluster


def expected_workers(cluster: Any) -> int:
    """How many workers ``cluster`` was asked for (dask_dl's makers record it; else its worker spec's size)."""
    n = getattr(cluster, "_dask_dl_workers", None)
    if n is None:
        n = len(getattr(cluster, "worker_spec", {}) or {})
    return int(n)


def wait_for_workers(client: Client, cluster: Any, *, timeout: float | None = None) -> None:
    """Wait until the workers ``cluster`` was asked for have joined (batch jobs wait in a queue first).

    Raises
    ------
    ClusterError
        They did not all come within ``timeout`` seconds (default ``dask-dl.cluster.wait-timeout``); the message
        says how many did and what to check.
    """
    n = expected_workers(cluster)
    if n < 1:
        return
    timeout = config.get("cluster.wait-timeout", timeout)
    try:
        client.wait_for_workers(n, timeout=timeout)
    except TimeoutError:
        have = len(scheduler_workers(client))
        raise ClusterError(
            f"only {have} of the {n} workers of the {type(cluster).__name__} joined within {timeout:g} s; check "
            f"the queue (squeue, or the gateway's and the cluster's logs: cluster.get_logs()), or wait longer with "
            f"dask.config.set({{'dask-dl.cluster.wait-timeout': {int(timeout) * 4}}})"
        ) from None
