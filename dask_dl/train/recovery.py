"""Recovery after a lost trainer: which failures a run recovers from, where it finds workers again, and what the
history records of each restart.

The driver (:mod:`dask_dl.train.driver`) calls these between the failure of a group and the next one: after the
surviving trainers left their group and the actors were released, :func:`wait_for_trainers` waits (at most
``restart_wait`` seconds) for as many free workers as the run had trainers (a nanny's restarted worker, or others),
or goes on with at least ``min_trainers`` when that time is up. A worker is free when it holds no trainer of another
live run (two runs on one cluster never share a worker) and is not one the run found hung.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from dask_dl.errors import DaskDLError, TrainingError

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["RestartPolicy", "recoverable", "restart_row", "wait_for_trainers"]

logger = logging.getLogger("dask_dl.train")


@dataclass(frozen=True)
class RestartPolicy:
    """How a run recovers: at most ``max_restarts`` times, on at least ``min_trainers``, waiting ``wait_s``."""

    max_restarts: int = 0
    min_trainers: int = 1
    wait_s: float = 60.0
    #: the only workers a restart may use (a site's workers in :func:`dask_dl.fit_sites`); None: any
    among: tuple[str, ...] | None = None
    #: seconds past a failed collective a trainer may take to answer before its worker counts as hung
    hang_grace_s: float = 30.0


def recoverable(exc: BaseException) -> bool:
    """True for a failure a restart can cure: a lost trainer worker, a broken or timed-out collective, a lost comm.

    Not recoverable: what the trainers themselves judged (a non-finite loss, a bad store or sample, a busy worker):
    training again on the same data and workers would fail the same way.
    """
    if getattr(exc, "lost_workers", None):
        return True
    cause = exc.__cause__ if isinstance(exc, TrainingError) and exc.__cause__ is not None else exc
    if isinstance(exc, TrainingError) and exc.__cause__ is None:
        return False  # raised as such on a trainer (a non-finite loss): not a fault of the cluster
    return not isinstance(cause, DaskDLError)


def wait_for_trainers(
    client: Client,
    *,
    trainers: int,
    policy: RestartPolicy,
    run_id: str,
    lost: list[str] | None = None,
    multiple: int = 1,
) -> list[str]:
    """Wait for ``trainers`` free workers, or for ``policy.min_trainers`` once ``policy.wait_s`` passed.

    Workers in ``lost`` (the addresses that just failed, and those found hung) are not used again: a nanny
    restarts a killed worker at a new address. ``multiple``: the number of workers returned is a multiple of it
    (a pipeline's stages: whole pipelines only).

    Returns
    -------
    list of str
        The workers to re-form the group on, sorted (GPU workers first when there are any).

    Raises
    ------
    TrainingError
        When fewer than ``min_trainers`` workers are free after ``wait_s`` seconds.
    """
    from dask_dl.cluster.workers import scheduler_workers
    from dask_dl.train.placement import GPU_RESOURCE, busy_workers

    deadline = time.monotonic() + policy.wait_s
    gone = set(lost or ())
    while True:
        workers = scheduler_workers(client)
        busy = busy_workers(client, run_id=run_id)
        allowed = set(workers) if policy.among is None else set(policy.among)
        free = sorted(a for a in workers if a in allowed and a not in busy and a not in gone)
        accelerated = [a for a in free if workers[a].get("resources", {}).get(GPU_RESOURCE, 0) > 0]
        free = accelerated or free
        if len(free) >= trainers:
            return free[:trainers]
        if time.monotonic() >= deadline:
            usable = free[: len(free) // multiple * multiple]
            if usable and len(usable) >= policy.min_trainers:
                return usable
            left_out = sorted(gone & set(workers))
            raise TrainingError(
                f"{run_id}: after losing a trainer, waited {policy.wait_s:g} s (dask-dl.train.restart-wait) for "
                f"{policy.min_trainers} free worker(s) and found {len(free)} ({', '.join(free) or 'none'}; "
                f"{len(busy)} busy with other runs"
                + (f"; left out, lost or hung: {', '.join(left_out)}" if left_out else "")
                + "). Add workers (cluster.scale(...)), allow fewer trainers (fit(..., min_trainers=1)) or wait longer "
                "(dask-dl.train.restart-wait)"
            )
        time.sleep(0.25)


def restart_row(
    number: int,
    *,
    error: BaseException,
    lost: list[str],
    failed_at: dict[str, Any],
    resumed: dict[str, Any],
    workers: list[str],
    seconds: float,
) -> dict[str, Any]:
    """One row of ``run.restarts``: when training went on (``time``, and ``at`` in unix seconds), which worker was
    lost, where training went on, how much was lost.

    ``failed_at`` and ``resumed`` hold ``epoch``, ``step`` (in the epoch) and ``global_step`` (of the run): where
    the trainers were when the group failed, and the checkpoint the new group went on from.
    """
    first = str(error).split(". ")[0]
    return {
        "restart": int(number),
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "at": time.time(),  # when training went on (unix seconds)
        "lost_workers": ", ".join(lost),
        "error": f"{type(error).__name__}: {first}"[:300],
        "failed_epoch": int(failed_at.get("epoch", -1)),
        "failed_step": int(failed_at.get("step", -1)),
        "resumed_epoch": int(resumed["epoch"]),
        "resumed_step": int(resumed["step"]),
        "steps_lost": max(int(failed_at.get("global_step", resumed["global_step"])) - int(resumed["global_step"]), 0),
        "world_size": len(workers),
        "workers": ", ".join(workers),
        "seconds": float(seconds),
    }
