"""Where trainers run: one trainer per worker, GPU workers first.

A trainer is a :class:`~dask_dl.train.actor.TrainingActor` pinned to one Dask worker. Workers that advertise a
``GPU`` resource (``dask worker --resources GPU=1``, or dask-cuda's workers) take trainers when there are any, so
CPU workers stay free for ingest and loading; otherwise any distinct workers do. Two trainers never share a
worker: a worker process holds one torch.distributed default process group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_dl.checks import positive_int
from dask_dl.errors import ClusterError

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

GPU_RESOURCE = "GPU"


def place_trainers(client: Client, trainers: int, *, resource: str = GPU_RESOURCE) -> list[str]:
    """Choose the worker addresses that ``trainers`` trainers run on, one trainer per worker.

    Parameters
    ----------
    client
        Client of the cluster to train on.
    trainers
        Number of trainers (data-parallel ranks).
    resource
        Worker resource that marks accelerator workers; workers advertising it are used when there are any.

    Returns
    -------
    list of str
        ``trainers`` distinct worker addresses, sorted so that rank order is stable.

    Raises
    ------
    ConfigurationError
        When ``trainers`` is not a positive integer.
    ClusterError
        When the cluster has fewer (accelerator) workers than ``trainers``.

    Examples
    --------
    >>> from distributed import Client, LocalCluster
    >>> with LocalCluster(n_workers=2, threads_per_worker=1, processes=False) as cluster, Client(cluster) as c:
    ...     len(place_trainers(c, 2))
    2
    """
    trainers = positive_int("trainers", trainers, example=2)
    workers = client.scheduler_info(n_workers=-1)["workers"]
    accelerated = sorted(a for a, w in workers.items() if w.get("resources", {}).get(resource, 0) > 0)
    if accelerated:
        if len(accelerated) < trainers:
            raise ClusterError(
                f"fit asked for {trainers} trainers but the cluster has only {len(accelerated)} workers with a "
                f"{resource!r} resource ({', '.join(accelerated)}); pass trainers={len(accelerated)} or start more "
                f"GPU workers (dask cuda worker SCHEDULER, or dask worker SCHEDULER --resources {resource}=1)"
            )
        return accelerated[:trainers]
    available = sorted(workers)
    if len(available) < trainers:
        raise ClusterError(
            f"fit asked for {trainers} trainers but the cluster has only {len(available)} workers "
            f"({', '.join(available) or 'none'}); each trainer needs a worker of its own: pass "
            f"trainers={max(len(available), 1)}, or add workers (cluster.scale({trainers}), "
            f"or dask-dl train --workers {trainers})"
        )
    return available[:trainers]
