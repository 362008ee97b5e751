"""``make("slurm")``: GPU jobs and CPU jobs of a SLURM centre under one scheduler, through dask-jobqueue.

Each job runs one worker. GPU jobs ask SLURM for ``--gres=gpu:N`` and advertise a ``GPU`` resource (trainers go
there); CPU jobs, on ``cpu_queue`` when given, take the data work. The scheduler runs in this process (the batch
script's or the notebook's); ``cluster.close()`` cancels every job (``scancel``), and :func:`dask_dl.cluster.connect`
closes it on exit, also on error and Ctrl-C. With no settings at all one CPU job goes to the default partition.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_dl import config
from dask_dl.checks import positive_int
from dask_dl.cluster.tls import security_from
from dask_dl.cluster.workers import GPU_RESOURCE
from dask_dl.errors import ClusterError, ConfigurationError, missing_dependency

if TYPE_CHECKING:  # pragma: no cover
    from distributed.security import Security

__all__ = ["make_slurm"]


def make_slurm(
    *,
    queue: str | None = None,
    jobs: int | None = None,
    n_workers: int | None = None,
    gpus_per_job: int | None = None,
    cpu_jobs: int | None = None,
    cpu_queue: str | None = None,
    cores: int | None = None,
    memory: str | None = None,
    walltime: str | None = None,
    security: Security | bool | None = None,
    **kwargs: Any,
) -> Any:
    """A ``dask_jobqueue.SLURMCluster`` with ``jobs`` (GPU) jobs plus ``cpu_jobs`` CPU jobs, one worker each.

    Parameters
    ----------
    queue
        Partition of the jobs (of the GPU jobs when ``gpus_per_job`` is set); default
        ``dask-dl.cluster.slurm.queue``, then SLURM's default partition.
    jobs, n_workers
        Number of jobs (``n_workers`` is the same for callers that pass every kind one count); default
        ``dask-dl.cluster.slurm.jobs``.
    gpus_per_job
        GPUs of each of those jobs (``--gres=gpu:N``, and a ``GPU`` worker resource); 0 makes them CPU jobs.
    cpu_jobs, cpu_queue
        CPU jobs beside the GPU jobs, for the data work, and their partition (default ``queue``).
    cores, memory, walltime
        Of each job; default ``dask-dl.cluster.slurm.*``.
    security
        True for TLS with throw-away certificates (the jobs read them from the job script), or a ``Security``.
    **kwargs
        Go to ``SLURMCluster`` (``account``, ``job_extra_directives``, ``job_script_prologue``, ``interface``, ...).

    Returns
    -------
    dask_jobqueue.SLURMCluster
        Its jobs are submitted; they start when the queue lets them (:func:`dask_dl.cluster.make.wait_for_workers`).

    Raises
    ------
    ConfigurationError
        A count is not a positive integer.
    MissingDependencyError
        dask-jobqueue is not installed.
    """
    SLURMCluster = _import_jobqueue().SLURMCluster

    n_jobs = positive_int("jobs", config.get("cluster.slurm.jobs", jobs if jobs is not None else n_workers))
    gpus = _count("gpus_per_job", config.get("cluster.slurm.gpus-per-job", gpus_per_job))
    n_cpu = _count("cpu_jobs", config.get("cluster.slurm.cpu-jobs", cpu_jobs))
    queue = config.get("cluster.slurm.queue", queue)
    extra_args = list(kwargs.pop("worker_extra_args", None) or [])
    directives = list(kwargs.pop("job_extra_directives", None) or config.get("cluster.slurm.job-extra-directives"))
    options: dict[str, Any] = {
        "queue": queue,
        "cores": config.get("cluster.slurm.cores", cores),
        "memory": config.get("cluster.slurm.memory", memory),
        "walltime": config.get("cluster.slurm.walltime", walltime),
        "processes": 1,  # one worker per job: a trainer holds its job's GPUs and one process group
        "worker_extra_args": extra_args + (["--resources", f"{GPU_RESOURCE}={gpus}"] if gpus else []),
        "job_extra_directives": directives + ([f"--gres=gpu:{gpus}"] if gpus else []),
        "scheduler_options": {"dashboard_address": "127.0.0.1:0"},
    }
    security = security_from(security)
    if security is not None:
        options |= {"security": security, "protocol": "tls://"}
    options |= kwargs
    cluster = SLURMCluster(**options)
    cpu = copy.deepcopy(cluster.new_spec)
    cpu["options"] |= {
        "queue": config.get("cluster.slurm.cpu-queue", cpu_queue) or queue,
        "worker_extra_args": extra_args,
        "job_extra_directives": directives,
    }
    try:
        _submit(cluster, n_jobs, lambda i: cluster.new_worker_spec(), "GPU" if gpus else "", queue)
        _submit(cluster, n_cpu, lambda i: {f"cpu-{i}": copy.deepcopy(cpu)}, "CPU", cpu["options"]["queue"])
    except BaseException:
        cluster.close()  # scancel what was submitted
        raise
    cluster._dask_dl_workers = n_jobs + n_cpu
    return cluster


def _submit(cluster: Any, n: int, spec: Callable[[int], dict[str, Any]], kind: str, queue: str | None) -> None:
    """Submit ``n`` jobs of ``spec(i)`` now; raise a ClusterError with sbatch's own words when SLURM refuses them.

    ``SLURMCluster.scale`` submits in a callback whose failure is only logged (a traceback), after which the
    caller would wait for workers that never come. One job goes first, alone: a refusal (a partition, account or
    GRES SLURM does not know) is then one error, and the others are not submitted at all.
    """
    from distributed.core import Status

    for batch in (range(min(n, 1)), range(1, n)):
        if not batch:
            continue
        for i in batch:
            cluster.worker_spec.update(spec(i))  # one at a time: new_worker_spec names a job after those there
        try:
            cluster.sync(cluster._correct_state)  # as SpecCluster.scale does, but waiting for the submission
        except RuntimeError as exc:
            for name in [name for name, job in cluster.workers.items() if job.status == Status.created]:
                cluster.workers.pop(name).status = Status.failed  # never submitted: nothing to cancel
                del cluster.worker_spec[name]
            said = str(exc).partition("stderr:")[2].strip() or str(exc)
            where = f"partition {queue!r}" if queue else "the default partition"
            raise ClusterError(
                f"SLURM refused the {kind + ' ' if kind else ''}job ({where}): {' '.join(said.split())}; check the "
                "jobs' settings: queue=, cpu_queue=, gpus_per_job=, cores=, memory=, walltime=, account= (or "
                "dask-dl.cluster.slurm.* and jobqueue.slurm.* in the dask config)"
            ) from None


def _count(name: str, value: Any) -> int:
    if value in (None, 0):
        return 0
    try:
        return positive_int(name, value)
    except ConfigurationError:
        raise ConfigurationError(f"{name} must be 0 or a positive integer, got {value!r}; pass e.g. {name}=1") from None


def _import_jobqueue() -> Any:
    """Import dask_jobqueue, keeping this process's Ctrl-C handler.

    ``dask_jobqueue.runner`` replaces the SIGINT handler with ``sys.exit`` when it is imported (meant for its own
    runner processes), which would turn a user's Ctrl-C into a SystemExit that skips ``TrainingRun.wait``'s clean
    stop. The handler that was there before is put back.
    """
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    try:
        import dask_jobqueue
    except ImportError:
        raise missing_dependency("dask-jobqueue", "hpc", "make('slurm')") from None
    finally:
        if main and previous is not None and signal.getsignal(signal.SIGINT) is not previous:
            signal.signal(signal.SIGINT, previous)
    return dask_jobqueue
