"""The trials of a sweep on disjoint groups of workers, driven from one client thread.

The cluster's free workers are cut into groups of ``trainers_per_trial`` (accelerator workers first, as
:func:`dask_dl.train.placement.place_trainers` chooses). Each group runs one trial at a time: a normal
``fit(..., workers=group, wait=False)`` with its own checkpoint folder and its own recovery. The thread reads the
per-epoch history rows the trainers publish, reports the metric to the trial (step = epochs trained), and stops a
run its pruner prunes: ``run.stop()`` makes every rank stop at the same agreed step. A group is given the next
trial the moment its trial ends. Optuna is asked and told here only: nothing of it runs in the trainers.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask_dl.cluster.workers import scheduler_workers
from dask_dl.errors import ClusterError
from dask_dl.train.placement import GPU_RESOURCE, busy_workers

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["Scheduler", "TrialRecord", "worker_groups"]

logger = logging.getLogger("dask_dl.sweep")

POLL_S = 0.2
MOVE_WAIT_S = 120.0  # how long a trial that lost a worker waits for a group to go on with
MOVES = 3  # how often a trial that lost a worker goes on on other workers before it is recorded failed


def worker_groups(client: Client, size: int, *, most: int | None = None) -> list[tuple[str, ...]]:
    """Disjoint groups of ``size`` free workers (accelerator workers when there are any), at most ``most``.

    Raises
    ------
    ClusterError
        When the cluster has fewer free workers than ``size``.
    """
    workers = scheduler_workers(client)
    busy = busy_workers(client)
    free = {a: w for a, w in workers.items() if a not in busy}
    accelerated = sorted(a for a, w in free.items() if w.get("resources", {}).get(GPU_RESOURCE, 0) > 0)
    chosen = accelerated or sorted(free)
    groups = [tuple(chosen[i : i + size]) for i in range(0, len(chosen) - size + 1, size)]
    if not groups:
        raise ClusterError(
            f"a trial needs {size} free workers but the cluster has {len(chosen)} ({len(workers)} in all, "
            f"{len(busy)} training another run); pass trainers_per_trial={max(len(chosen), 1)} or add workers"
        )
    return groups[:most] if most else groups


@dataclass
class TrialRecord:
    """One trial this client runs: its Optuna trial, its training run and what it did so far."""

    number: int
    trial: Any
    params: dict[str, Any]
    checkpoint_dir: str
    group: tuple[str, ...]
    state: str = "running"
    run: Any = None
    curve: dict[int, float] = field(default_factory=dict)  # epochs trained -> metric
    seconds: float = 0.0
    error: str | None = None
    pruning: bool = False
    reported: set[int] = field(default_factory=set)
    moves: int = 0  # times the trial went on on other workers after it lost one


def _tell(study: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
    """``study.tell``, taking the grid sampler's end in stride.

    Optuna's GridSampler calls ``study.stop()`` after the last point of its grid, which only an ``optimize`` loop
    may call; the trial's state is stored before (``tell`` stores it in a ``finally``), and the sweep ends on its
    own once no trial is left, so that error means nothing here.
    """
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


class Scheduler(threading.Thread):
    """Run a sweep's trials on worker groups until ``trials`` are done or :meth:`halt` is called."""

    def __init__(
        self,
        *,
        client: Client,
        dataset: Any,
        study: Any,
        space: Mapping[str, Any] | Callable[[Any], dict[str, Any]],
        fixed: dict[str, Any],
        new_trials: int,
        continued: list[Any],
        metric: str,
        groups: list[tuple[str, ...]],
        root: str,
        tracking: Any = None,
    ) -> None:
        super().__init__(name="dask-dl-sweep", daemon=True)
        self.client, self.dataset, self.study = client, dataset, study
        self.space, self.fixed, self.metric = space, dict(fixed), metric
        self.new_trials, self.continued = new_trials, list(continued)
        self.free: list[tuple[str, ...]] = list(groups)
        self.root, self.tracking = root, tracking
        self.groups = len(groups)  # the most trials at a time, also after lost workers' groups are made anew
        self.spare: list[str] = []  # workers of broken groups, waiting for the rest of a group
        self.moves: dict[int, int] = {}  # trial number -> times it went on elsewhere after a lost worker
        self._moving_since = 0.0
        self.records: dict[int, TrialRecord] = {}
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._halt = threading.Event()
        self.on_change: Callable[[], None] | None = None

    # ---- control ---------------------------------------------------------------------------------------

    def halt(self) -> None:
        """Stop every running trial (left RUNNING in the study, for ``resume=True``) and start no other."""
        self._halt.set()

    @property
    def halted(self) -> bool:
        """Whether :meth:`halt` was called."""
        return self._halt.is_set()

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the sweep's own failure: its trials stop, the error is the sweep's
            logger.error("sweep failed: %s: %s", type(exc).__name__, exc)
            self.error = exc
            self._stop_all()
        finally:
            self._finish_tracking()
            self.finished.set()
            self._changed()

    def _finish_tracking(self) -> None:
        """End the sweep's parent run: its trials' table as an artifact, the best value as a metric."""
        if self.tracking is None:
            return
        try:
            rows = [
                {"number": t.number, "state": t.state.name.lower(), "value": t.value, **t.params}
                for t in self.study.get_trials(deepcopy=False)
            ]
            import pandas as pd

            self.tracking.log_table(pd.DataFrame(rows), "trials.csv")
            done = [r["value"] for r in rows if r["state"] == "complete" and r["value"] is not None]
            if done:
                self.tracking.log_epoch({f"best_{self.metric}": self.study.best_value}, step=0)
        except Exception as exc:  # tracking never fails a sweep
            logger.warning("sweep: could not log its trials to MLflow: %s: %s", type(exc).__name__, exc)
        self.tracking.finish("failed" if self.error is not None else "finished")

    def _loop(self) -> None:
        while True:
            if self._halt.is_set():
                self._stop_all()
                return
            if self.spare and not self.free and self.continued:
                self._regroup()
                self._give_up_moving()
            while self.free and (self.continued or self.new_trials > 0) and not self._halt.is_set():
                self._start(self.free.pop(0))
            active = [r for r in self._records() if r.state == "running"]
            if not active and not (self.continued or self.new_trials > 0):
                return
            for record in active:
                self._follow(record)
            time.sleep(POLL_S)

    def _records(self) -> list[TrialRecord]:
        with self.lock:
            return list(self.records.values())

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception as exc:  # a view; the sweep goes on without it
                logger.warning("sweep view not updated: %s: %s", type(exc).__name__, exc)

    # ---- one trial -------------------------------------------------------------------------------------

    def _start(self, group: tuple[str, ...]) -> None:
        import optuna

        frozen = self.continued.pop(0) if self.continued else None
        resumed = frozen is not None
        if resumed:
            trial = optuna.Trial(self.study, frozen._trial_id)
        else:
            self.new_trials -= 1
            trial = self.study.ask(dict(self.space) if isinstance(self.space, Mapping) else None)
        try:
            params = dict(trial.params) if isinstance(self.space, Mapping) else self._define_by_run(trial)
        except BaseException:
            _tell(self.study, trial, state=optuna.trial.TrialState.FAIL)
            raise
        folder = frozen.user_attrs.get("checkpoint_dir") if resumed else None
        folder = folder or os.path.join(self.root, f"trial-{trial.number:04d}")
        record = TrialRecord(trial.number, trial, params, folder, group, moves=self.moves.get(trial.number, 0))
        if resumed:
            record.reported = set(frozen.intermediate_values)
            record.curve = dict(frozen.intermediate_values)
        trial.set_user_attr("checkpoint_dir", folder)
        with self.lock:
            self.records[trial.number] = record
        kwargs = {**self.fixed, **params}
        kwargs.setdefault("view", "none")
        kwargs.update(workers=list(group), checkpoint_dir=folder, resume=resumed, client=self.client, wait=False)
        if self.tracking is not None:  # the sweep's parent run: each trial is a run nested in it
            kwargs["tracking"] = self.tracking.nested(f"trial {trial.number}", tags={"optuna.trial": trial.number})
        from dask_dl.train.run import fit

        try:
            record.run = fit(self.dataset, **kwargs)
        except Exception as exc:  # the trial's params do not fit (a batch larger than the data): a failed trial
            self._fail(record, exc)
            return
        logger.info("trial %d on %s: %s", trial.number, ", ".join(group), params)
        self._changed()

    def _define_by_run(self, trial: Any) -> dict[str, Any]:
        from dask_dl.sweeps.space import check_key, fit_options

        params = self.space(trial)
        if not isinstance(params, Mapping):
            raise TypeError(f"the space function returned {type(params).__name__}, not a dict of fit keywords")
        options = fit_options()
        for key in params:
            check_key(key, options, where="the space function's result")
        return dict(params)

    def _follow(self, record: TrialRecord) -> None:
        run = record.run
        # done is read before the history: a run is done only after its last epoch's row, so the history read next
        # holds every epoch that _end counts, and the trial's curve and its ``epochs`` agree
        done = run.done
        for row in run.history.to_dict("records"):
            if row.get("event") == "stopped":
                continue
            step = int(row["epoch"]) + 1
            value = float(row.get(self.metric, math.nan))
            record.curve[step] = value
            if step not in record.reported and math.isfinite(value):
                record.trial.report(value, step)
                record.reported.add(step)
                self._changed()
                if not record.pruning and record.trial.should_prune():
                    logger.info("trial %d pruned after %d epochs (%s=%.4g)", record.number, step, self.metric, value)
                    record.pruning = True
                    run.stop()
        if done:
            self._end(record)

    def _end(self, record: TrialRecord) -> None:
        import optuna

        run, trial = record.run, record.trial
        rows = [r for r in run.history.to_dict("records") if r.get("event") != "stopped"]
        record.seconds = float(sum(r.get("seconds", 0.0) for r in run.history.to_dict("records")))
        trial.set_user_attr("epochs", len(rows))
        trial.set_user_attr("seconds", record.seconds)
        if run.status == "stopped" and not record.pruning:  # the sweep was stopped: resume=True continues it
            record.state = "stopped"
        elif run.status == "failed":
            live = scheduler_workers(self.client)
            lost = [a for a in record.group if a not in live or a in (getattr(run.error, "lost_workers", None) or ())]
            if lost and record.moves < MOVES:
                self._move(record, lost)
            else:
                self._fail(record, run.error)
            return
        elif record.pruning and len(rows) < run.epochs:
            record.state = "pruned"
            _tell(self.study, trial, state=optuna.trial.TrialState.PRUNED)
        else:
            finite = {s: v for s, v in record.curve.items() if math.isfinite(v)}
            if not finite:
                self._fail(record, ValueError(f"{self.metric} is NaN in every epoch of the trial"))
                return
            best_step = (max if self.study.direction == optuna.study.StudyDirection.MAXIMIZE else min)(
                finite, key=finite.get
            )
            from dask_dl.checkpoint import checkpoint_name

            trial.set_user_attr("checkpoint", os.path.join(record.checkpoint_dir, checkpoint_name(best_step - 1)))
            record.state = "complete"
            _tell(self.study, trial, finite[best_step])
        self._free(record)

    def _fail(self, record: TrialRecord, exc: BaseException | None) -> None:
        import optuna

        record.error = f"{type(exc).__name__}: {exc}"
        record.state = "failed"
        logger.warning("trial %d failed: %s", record.number, record.error)
        record.trial.set_user_attr("error", record.error)
        _tell(self.study, record.trial, state=optuna.trial.TrialState.FAIL)
        self._free(record)

    def _move(self, record: TrialRecord, lost: list[str]) -> None:
        """Go on with a trial whose run lost a worker (beyond its own restarts) on another group, from its newest
        checkpoint: its run was pinned to its group, whose lost worker comes back (if at all) at a new address."""
        record.state = "moving"
        self.moves[record.number] = record.moves + 1
        self._moving_since = time.monotonic()
        self.spare += [a for a in record.group if a not in set(lost)]
        self.continued.insert(0, self.study._storage.get_trial(record.trial._trial_id))
        logger.warning(
            "trial %d lost %s (%s); it goes on from its newest checkpoint on other workers",
            record.number,
            ", ".join(lost),
            record.run.error,
        )
        self._regroup()
        self._changed()

    def _regroup(self) -> None:
        """Make groups of the spare workers and of workers new to the cluster (a nanny's restarted worker), up to
        the sweep's number of groups."""
        live = set(scheduler_workers(self.client))
        running = [r for r in self._records() if r.state == "running" and r.run is not None and not r.run.done]
        used = {a for r in running for a in r.group} | {a for g in self.free for a in g}
        self.spare = [a for a in self.spare if a in live and a not in used]
        new = sorted(live - used - set(self.spare) - busy_workers(self.client))
        pool, size = self.spare + new, int(self.fixed["trainers"])
        while len(pool) >= size and len(running) + len(self.free) < self.groups:
            self.free.append(tuple(pool[:size]))
            pool = pool[size:]
        self.spare = [a for a in pool if a in set(self.spare)]

    def _give_up_moving(self) -> None:
        """Fail the trials waiting to go on elsewhere when no group has formed for ``MOVE_WAIT_S`` and nothing runs
        (the lost workers did not come back and no others are free)."""
        running = [r for r in self._records() if r.state == "running"]
        if self.free or running or time.monotonic() < self._moving_since + MOVE_WAIT_S:
            return
        import optuna

        while self.continued:
            frozen = self.continued.pop(0)
            error = (
                f"ClusterError: trial {frozen.number} lost a worker and no {self.fixed['trainers']} free worker(s) "
                f"came for {MOVE_WAIT_S:g} s to go on with; add workers and resume the sweep"
            )
            logger.warning("trial %d failed: %s", frozen.number, error)
            with self.lock:
                if frozen.number in self.records:
                    self.records[frozen.number].state, self.records[frozen.number].error = "failed", error
            trial = optuna.Trial(self.study, frozen._trial_id)
            trial.set_user_attr("error", error)
            _tell(self.study, trial, state=optuna.trial.TrialState.FAIL)
        self._changed()

    def _free(self, record: TrialRecord) -> None:
        self.free.append(record.group)
        self._changed()

    def _stop_all(self) -> None:
        running = [r for r in self._records() if r.state == "running" and r.run is not None]
        for record in running:
            record.run.stop()
        for record in running:
            try:
                record.run.wait()
            except Exception as exc:  # a run that fails while stopping is still over
                logger.warning("trial %d ended with %s: %s", record.number, type(exc).__name__, exc)
            record.state = "stopped"
        self._changed()
