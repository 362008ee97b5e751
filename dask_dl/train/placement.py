"""Where trainers run: one trainer per worker, GPU workers first.

A trainer is a :class:`~dask_dl.train.actor.TrainingActor` pinned to one Dask worker. Workers that advertise a
``GPU`` resource (``dask worker --resources GPU=1``, or dask-cuda's workers) take trainers when there are any, so
CPU workers stay free for ingest and loading; otherwise any distinct workers do. Two trainers never share a
worker: a worker process holds one torch.distributed default process group, and workers that hold another live
run's trainer are left alone (two runs on one cluster train side by side, never on the same worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dask_dl.checks import positive_int
from dask_dl.cluster.workers import scheduler_workers
from dask_dl.errors import ClusterError

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

GPU_RESOURCE = "GPU"
TRAINER_KEY = "dask-dl-trainer-"  # the prefix of every training actor's key (then the run id and the rank)


def busy_workers(client: Client, *, run_id: str | None = None) -> set[str]:
    """Addresses of the workers that hold a training actor of a run other than ``run_id``."""

    def held(dask_scheduler: Any, prefix: str = TRAINER_KEY, own: str | None = None) -> list[str]:
        out = []
        for key, ts in dask_scheduler.tasks.items():
            name = str(key)
            if not name.startswith(prefix) or (own is not None and name.startswith(f"{prefix}{own}-")):
                continue
            out += [ws.address for ws in ts.who_has or ()]
            if ts.processing_on is not None:
                out.append(ts.processing_on.address)
        return out

    return set(client.run_on_scheduler(held, own=run_id))


def place_trainers(
    client: Client, trainers: int, *, resource: str = GPU_RESOURCE, among: Sequence[str] | None = None
) -> list[str]:
    """Choose the worker addresses that ``trainers`` trainers run on, one trainer per worker.

    Parameters
    ----------
    client
        Client of the cluster to train on.
    trainers
        Number of trainers (data-parallel ranks).
    resource
        Worker resource that marks accelerator workers; workers advertising it are used when there are any.
    among
        Choose only among these worker addresses (a site's workers in :func:`dask_dl.fit_sites`).

    Returns
    -------
    list of str
        ``trainers`` distinct worker addresses, sorted so that rank order is stable.

    Raises
    ------
    ConfigurationError
        When ``trainers`` is not a positive integer.
    ClusterError
        When the cluster has fewer (accelerator) workers than ``trainers``, or ``among`` names workers the
        cluster does not have (any more: a site's workers that went away).

    Examples
    --------
    >>> from distributed import Client, LocalCluster
    >>> with LocalCluster(n_workers=2, threads_per_worker=1, processes=False) as cluster, Client(cluster) as c:
    ...     len(place_trainers(c, 2))
    2
    """
    trainers = positive_int("trainers", trainers, example=2)
    workers = scheduler_workers(client)
    if among is not None:
        missing = sorted(set(among) - set(workers))
        if missing:
            raise ClusterError(
                f"workers={missing} are not workers of the cluster (it has {', '.join(sorted(workers)) or 'none'}); "
                "pass addresses from client.scheduler_info()['workers']"
            )
        workers = {a: w for a, w in workers.items() if a in set(among)}
    busy = busy_workers(client)
    free = {a: w for a, w in workers.items() if a not in busy}
    workers = free if len(free) >= trainers else workers
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
