"""Which workers do what in a cluster with GPU workers next to CPU workers.

Trainer workers advertise a ``GPU`` resource (dask-cuda's workers, ``dask worker --resources GPU=1``, a SLURM GPU
job); the others are CPU workers. When a cluster has both, data work (ingest, synthesis, scoring) goes to the CPU
workers so that the GPU workers' memory and cores stay with the trainers: :func:`cpu_workers` is the restriction
the data room passes to ``client.map``/``client.persist``. On a cluster of one kind it is None: anywhere.
:func:`workers_for` turns a user's choice (``on="cpu"``, ``"gpu"`` or ``"any"``) into that restriction, e.g. for
scoring on the GPU workers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_dl.checks import one_of
from dask_dl.errors import ClusterError

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = [
    "GPU_RESOURCE",
    "WORKER_KINDS",
    "add_cpu_workers",
    "ask_workers",
    "cpu_workers",
    "gpu_workers",
    "scheduler_workers",
    "workers_for",
]

#: the worker resource that marks trainer (accelerator) workers; ``dask_dl.train.placement`` uses the same name
GPU_RESOURCE = "GPU"
#: the choices of :func:`workers_for`'s ``on``
WORKER_KINDS = ("cpu", "gpu", "any")


def scheduler_workers(client: Client) -> dict[str, dict[str, Any]]:
    """The scheduler's workers now, ``{address: info}``, asked of the scheduler itself.

    Not ``client.scheduler_info()["workers"]``: that returns the client's cached copy after refreshing it, and the
    client's periodic refresh (which asks for no workers) can land in between, leaving an empty dict.
    """
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def ask_workers(
    client: Client, function: Callable[..., Any], *args: Any, workers: list[str] | None = None
) -> dict[str, Any]:
    """``function(*args)`` run on every worker (or ``workers``) that stays while asked: ``{address: answer}``.

    A worker lost while it is asked (killed, out of memory, its machine gone) is left out of the answers, as the
    scheduler leaves it out of the work that follows; the worker its nanny starts in its place starts as it did.
    Any other failure, such as ``function`` raising on a worker, is raised here. ``client.run`` with
    ``on_error="raise"`` would fail the caller for a worker that happened to die during the question. An
    ``OSError`` counts as a lost worker, so ``function`` should return its own I/O failures as answers, as the
    store and module checks' probes do.
    """
    answers = client.run(function, *args, workers=workers, on_error="return")
    kept = {}
    for address, answer in answers.items():
        if isinstance(answer, OSError):  # distributed's CommClosedError (its connection closed), or unreachable
            continue
        if isinstance(answer, BaseException):
            raise answer
        kept[address] = answer
    return kept


def gpu_workers(client: Client, *, resource: str = GPU_RESOURCE) -> list[str]:
    """Addresses of the workers that advertise ``resource``, sorted.

    Examples
    --------
    >>> gpu_workers(client)  # doctest: +SKIP
    ['tcp://127.0.0.1:40123']
    """
    workers = scheduler_workers(client)
    return sorted(a for a, w in workers.items() if w.get("resources", {}).get(resource, 0) > 0)


def cpu_workers(client: Client | None, *, resource: str = GPU_RESOURCE) -> list[str] | None:
    """The workers data work should run on: the CPU workers when the cluster also has GPU workers, else None.

    Parameters
    ----------
    client
        Client of the cluster; None (work in this process) gives None.
    resource
        Worker resource that marks GPU workers.

    Returns
    -------
    list of str or None
        Addresses for ``client.map(..., workers=...)`` / ``client.persist(..., workers=...)``; None means any
        worker (a cluster of one kind, or GPU workers only).

    Examples
    --------
    >>> futures = client.map(decode, paths, workers=cpu_workers(client))  # doctest: +SKIP
    """
    if client is None:
        return None
    workers = scheduler_workers(client)
    plain = sorted(a for a, w in workers.items() if not w.get("resources", {}).get(resource, 0) > 0)
    if not plain or len(plain) == len(workers):
        return None
    return plain


def workers_for(
    client: Client, on: str, *, resource: str = GPU_RESOURCE, purpose: str = "the work"
) -> list[str] | None:
    """The workers ``on`` names: the restriction to pass to ``client.persist``/``client.compute``.

    Parameters
    ----------
    client
        Client of the cluster.
    on : {"cpu", "gpu", "any"}
        ``"cpu"``: the CPU workers when the cluster also has GPU workers (:func:`cpu_workers`), else any worker;
        ``"gpu"``: the workers that advertise ``resource`` (:func:`gpu_workers`); ``"any"``: no restriction.
    resource
        Worker resource that marks GPU workers.
    purpose
        What the workers are for, in the error message (``"scoring"``).

    Returns
    -------
    list of str or None
        Worker addresses, or None for any worker.

    Raises
    ------
    ConfigurationError
        ``on`` is not one of ``"cpu"``, ``"gpu"``, ``"any"``.
    ClusterError
        ``on="gpu"`` and no worker advertises ``resource``.

    Examples
    --------
    >>> probs = client.persist(probs, workers=workers_for(client, "gpu"))  # doctest: +SKIP
    """
    on = one_of("on", on, WORKER_KINDS)
    if on == "any":
        return None
    if on == "cpu":
        return cpu_workers(client, resource=resource)
    tagged = gpu_workers(client, resource=resource)
    if not tagged:
        n = len(scheduler_workers(client))
        raise ClusterError(
            f"{purpose} was asked to run on the GPU workers (on='gpu'), and none of the cluster's {n} workers "
            f"advertises a {resource!r} resource; pass on='cpu', or start GPU workers: "
            "dask_dl.cluster.make('cuda'), or `dask cuda worker SCHEDULER` / `dask worker SCHEDULER --resources GPU=1`"
        )
    return tagged


def add_cpu_workers(cluster: Any, n: int, *, prefix: str = "cpu", options: dict[str, Any] | None = None) -> None:
    """Add ``n`` CPU workers to a ``SpecCluster`` whose workers are trainers, under the same scheduler.

    The new workers take the cluster's worker template (host, security, threads, memory) without its resources,
    plugins and environment, and with ``CUDA_VISIBLE_DEVICES`` empty, so they never touch a GPU.

    Parameters
    ----------
    cluster
        A started ``distributed.SpecCluster`` (``LocalCluster``, dask-cuda's ``LocalCUDACluster``).
    n
        Number of CPU workers; 0 adds none.
    prefix
        Their names are ``{prefix}-0``, ``{prefix}-1``, ...
    options
        Worker options that replace the template's (``nthreads``, ``memory_limit``, ...).
    """
    if n <= 0:
        return
    from distributed import Nanny

    template = copy.copy(cluster.new_spec.get("options", {}))
    for key in ("resources", "plugins", "env", "name", "data", "CUDA_VISIBLE_DEVICES"):
        template.pop(key, None)
    template["env"] = {"CUDA_VISIBLE_DEVICES": ""}
    template.update(options or {})
    for i in range(n):
        cluster.worker_spec[f"{prefix}-{i}"] = {"cls": Nanny, "options": dict(template)}
    cluster.sync(cluster._correct_state)  # starts the missing workers, as SpecCluster.scale does
