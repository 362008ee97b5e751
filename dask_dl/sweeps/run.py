"""``sweep()`` and :class:`Sweep`: search ``fit``'s options with Optuna, trials side by side on the cluster.

``sweep`` checks everything (the space against ``fit``'s options, the metric against the history's columns, the
storage against the sweep) before any trial starts, opens the study, and hands the trials to a
:class:`~dask_dl.sweeps.scheduler.Scheduler` thread. The user holds a :class:`Sweep`: its results table, its best
trial, stop, wait and views.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from dask_dl.checks import one_of, positive_int
from dask_dl.errors import ConfigurationError, DaskDLError, TrainingError, import_optional
from dask_dl.interrupt import wait_for

if TYPE_CHECKING:  # pragma: no cover
    import xarray as xr
    from distributed import Client
    from matplotlib.figure import Figure

__all__ = ["Best", "Sweep", "sweep"]

logger = logging.getLogger("dask_dl.sweep")

#: history columns a trial's metric can be, besides ``val_auroc_<label>`` (and ``val_accuracy`` for one label per
#: image)
METRICS: tuple[str, ...] = ("val_auroc_mean", "val_loss", "train_loss", "images_per_s")
STATES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running", "WAITING": "waiting"}


def sweep(
    dataset: xr.Dataset,
    space: Mapping[str, Any] | Callable[[Any], dict[str, Any]],
    *,
    trials: int,
    metric: str = "val_auroc_mean",
    direction: str = "maximize",
    pruner: Any = "asha",
    sampler: Any = "tpe",
    trainers_per_trial: int = 1,
    max_concurrent: int | None = None,
    storage: str | os.PathLike | None = None,
    resume: bool = False,
    tracking: Any = None,
    client: Client | None = None,
    wait: bool = True,
    **fit_kwargs: Any,
) -> Sweep:
    """Search ``fit``'s options on ``dataset``: trials side by side on disjoint groups of workers, losers pruned.

    Parameters
    ----------
    dataset : xarray.Dataset
        From :func:`dask_dl.open_dataset`, as for :func:`dask_dl.fit`.
    space : dict or callable
        ``fit`` keyword -> Optuna distribution (``FloatDistribution(1e-4, 0.3, log=True)``, ``IntDistribution``,
        ``CategoricalDistribution``), or a function of an ``optuna.Trial`` returning ``fit`` keywords
        (define-by-run, for conditional spaces).
    trials : int
        Trials in all (a resumed sweep runs only those its study does not hold yet).
    metric, direction : str
        The history column a trial is judged by (its best epoch's value) and ``"maximize"`` or ``"minimize"``.
    pruner : {"asha", "hyperband", "median", "none"} or optuna.pruners.BasePruner
        Stops losing trials early, from the metric after each epoch (:mod:`dask_dl.sweeps.choices`).
    sampler : {"tpe", "random", "grid"} or optuna.samplers.BaseSampler
        Chooses each trial's options; seeded with ``seed`` from ``fit_kwargs`` when given.
    trainers_per_trial : int
        Trainers (workers) of each trial; the cluster's free workers are cut into groups of this size.
    max_concurrent : int, optional
        At most this many trials at once (default: as many as there are groups).
    storage : str, optional
        An Optuna storage: a path is an SQLite file that only this client writes (``optuna.load_study(
        study_name="dask-dl-sweep", storage="sqlite:///PATH")`` reads it), a URL an Optuna RDB. Each trial
        checkpoints into ``<storage>-trials/trial-NNNN`` (or ``checkpoint_dir/trial-NNNN`` when given).
    resume : bool
        Continue the sweep of ``storage``: complete, pruned and failed trials are kept as they are, trials that
        were running continue from their newest checkpoint, sampler and pruner take their state from the study.
    tracking : optional
        Passed to each trial's ``fit(tracking=...)``.
    client : distributed.Client, optional
        Default: the current client.
    wait : bool
        Block until the sweep ends (True), or return the running :class:`Sweep` at once (False).
    **fit_kwargs
        ``fit`` keywords fixed for every trial (``epochs=4, batch_size=16, model="small_cnn"``).

    Returns
    -------
    Sweep

    Raises
    ------
    ConfigurationError
        Before any trial: an empty space, a key ``fit`` does not take (with the nearest option), a number range on
        an option that takes no number, ``trials`` < 1, a metric the history does not have, an unknown pruner or
        sampler, a storage that holds another study (or this sweep, without ``resume=True``).
    ClusterError
        Fewer free workers than ``trainers_per_trial``.

    Examples
    --------
    >>> from optuna.distributions import CategoricalDistribution, FloatDistribution
    >>> s = sweep(ds, {"lr": FloatDistribution(1e-3, 0.3, log=True),
    ...                "model": CategoricalDistribution(["small_cnn", "resnet18"])},
    ...           trials=16, epochs=4, storage="sweep.db", wait=False)  # doctest: +SKIP
    >>> s.results  # doctest: +SKIP
    >>> dask_dl.export_onnx(s.wait().best, "best.onnx")  # doctest: +SKIP
    """
    optuna = import_optional("optuna", extra="sweep", purpose="dask_dl.sweep")
    from dask_dl.cluster import get_client
    from dask_dl.sweeps.choices import grid_size, make_pruner, make_sampler
    from dask_dl.sweeps.scheduler import Scheduler, worker_groups
    from dask_dl.sweeps.space import check_fixed, check_key, check_space, fit_options
    from dask_dl.sweeps.study import describe, open_study, quiet_optuna
    from dask_dl.train.options import check_dataset

    root = fit_kwargs.pop("checkpoint_dir", None)
    space = check_space(space)
    fixed = check_fixed(fit_kwargs, space)
    trials = positive_int("trials", trials, example=20)
    trainers_per_trial = positive_int("trainers_per_trial", trainers_per_trial, example=1)
    if max_concurrent is not None:
        max_concurrent = positive_int("max_concurrent", max_concurrent, example=2)
    direction = one_of("direction", direction, ("maximize", "minimize"))
    data = check_dataset(dataset)
    metrics = [*METRICS, *(f"val_auroc_{label}" for label in data["labels"])]
    if data["task"] == "multiclass":
        metrics.append("val_accuracy")
    if metric not in metrics:
        import difflib

        close = difflib.get_close_matches(str(metric), metrics, n=1)
        raise ConfigurationError(
            f"metric={metric!r} is not a column of a trial's history; {f'did you mean {close[0]!r}? ' if close else ''}"
            f"pick one of {', '.join(metrics)}"
        )
    if not isinstance(space, Mapping):  # a define-by-run space: one dry call, on a throwaway trial, checks its keys
        with quiet_optuna():
            dry = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
        options = fit_options()
        for key in space(dry):
            check_key(key, options, where="the space function's result")
    seed = fixed.get("seed")
    sampler = make_sampler(sampler, space, seed=seed)
    pruner = make_pruner(pruner, epochs=fixed.get("epochs"))
    identity = describe(metric=metric, direction=direction, store=data["store"], space=space)
    study = open_study(storage, resume=resume, sampler=sampler, pruner=pruner, identity=identity)
    if root is None:
        root = (
            f"{os.path.abspath(os.fspath(storage))}-trials"
            if storage is not None and "://" not in os.fspath(storage)
            else tempfile.mkdtemp(prefix="dask-dl-sweep-")
        )
    held = study.get_trials(deepcopy=False)
    continued = [t for t in held if t.state == optuna.trial.TrialState.RUNNING]
    new_trials = max(trials - len(held), 0)
    grid = grid_size(sampler)
    if grid is not None and new_trials > grid:
        logger.info("sampler='grid' has %d points; the sweep runs %d trials, not %d", grid, grid, new_trials)
        new_trials = grid
    client = get_client(client)
    groups = worker_groups(client, trainers_per_trial, most=max_concurrent)
    tracker = _open_sweep_tracker(
        tracking, study=study, trials=trials, metric=metric, direction=direction, fixed=fixed, space=space
    )
    scheduler = Scheduler(
        client=client,
        dataset=dataset,
        study=study,
        space=space,
        fixed={**fixed, "trainers": trainers_per_trial},
        new_trials=new_trials,
        continued=continued,
        metric=metric,
        groups=groups,
        root=str(root),
        tracking=tracker,
    )
    result = Sweep(study, scheduler, metric=metric, storage=storage, root=str(root))
    result._publish()  # the sweeps page lists it before its first trial reports
    logger.info(
        "sweep of %d trials (%d to start, %d to continue) on %d groups of %d workers",
        trials,
        new_trials,
        len(continued),
        len(groups),
        trainers_per_trial,
    )
    scheduler.start()
    if wait:
        result.wait()
    return result


def _open_sweep_tracker(
    tracking: Any, *, study: Any, trials: int, metric: str, direction: str, fixed: dict[str, Any], space: Any
) -> Any:
    """The sweep's MLflow parent run (each trial's fit is a run nested in it), or None when tracking is off."""
    from dask_dl.tracking import open_tracker

    tracker = open_tracker(tracking, run_name=f"sweep {study.study_name}", tags={"dask_dl.kind": "sweep"})
    if tracker is not None:
        searched = {f"space.{k}": repr(v) for k, v in space.items()} if isinstance(space, Mapping) else {}
        tracker.log_params(
            {
                "study": study.study_name,
                "trials": trials,
                "metric": metric,
                "direction": direction,
                "pruner": type(study.pruner).__name__,
                "sampler": type(study.sampler).__name__,
                **searched,
                **{f"fixed.{k}": v for k, v in fixed.items()},
            }
        )
    return tracker


@dataclass(frozen=True)
class Best:
    """The best complete trial of a sweep: ``export_onnx(best, path)`` exports its checkpoint.

    Attributes
    ----------
    number : int
        The trial's number in the study.
    params : dict
        The options the sweep chose for it.
    metric : float
        Its best epoch's metric.
    checkpoint : str
        The checkpoint file of that epoch.
    """

    number: int
    params: dict[str, Any]
    metric: float
    checkpoint: str

    def __fspath__(self) -> str:
        return self.checkpoint


class Sweep:
    """A sweep in progress or finished; made by :func:`sweep`.

    Attributes
    ----------
    sweep_id : str
        Name of the sweep in logs and on the dashboard's sweeps page.
    dashboard_link : str or None
        The sweeps page on the Dask dashboard (``/dask-dl-sweeps``), live while the sweep runs; None when the
        scheduler serves no dashboard.
    study : optuna.Study
        Its study (read it as any Optuna study; only the sweep writes it).
    metric : str
        The history column trials are judged by.
    """

    def __init__(self, study: Any, scheduler: Any, *, metric: str, storage: Any, root: str) -> None:
        self.sweep_id = f"sweep-{uuid.uuid4().hex[:8]}"
        self.study, self.metric, self.storage, self.root = study, metric, storage, root
        self._scheduler = scheduler
        self._handle: Any = None
        self._drawn = 0.0
        self.dashboard_link = _install_dashboard(scheduler.client)
        scheduler.on_change = self._changed

    # ---- state ------------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once every trial has ended (or the sweep was stopped) and its workers are free."""
        return self._scheduler.finished.is_set()

    @property
    def error(self) -> BaseException | None:
        """Why the sweep itself failed (a trial's failure is in ``results``, not here)."""
        return self._scheduler.error

    @property
    def results(self) -> pd.DataFrame:
        """One row per trial: ``number``, ``state`` (complete, pruned, failed, running, stopped), ``params``
        (and a ``params_NAME`` column each), the metric per epoch (a list, in the column named by the metric),
        ``best`` (the best epoch's metric), ``epochs`` trained, ``seconds`` of training, ``checkpoint`` (of the
        best epoch) and ``error``."""
        with self._scheduler.lock:
            records = dict(self._scheduler.records)
        rows = []
        for trial in self.study.get_trials(deepcopy=False):
            record = records.get(trial.number)
            state = STATES.get(trial.state.name, trial.state.name.lower())
            curve_of = dict(trial.intermediate_values)
            if record is not None:
                state = record.state if state == "running" else state
                curve_of.update(record.curve)
            curve = [curve_of[s] for s in sorted(curve_of)]
            finite = [v for v in curve if math.isfinite(v)]
            best = trial.value if trial.value is not None else (self._pick(finite) if finite else math.nan)
            params = dict(record.params) if record is not None else dict(trial.params)
            seconds = trial.user_attrs.get("seconds")
            if seconds is None and record is not None and record.run is not None:
                seconds = float(sum(r.get("seconds", 0.0) for r in record.run.history.to_dict("records")))
            rows.append(
                {
                    "number": trial.number,
                    "state": state,
                    "params": params,
                    **{f"params_{k}": v for k, v in params.items()},
                    self.metric: curve,
                    "best": float(best),
                    "epochs": int(trial.user_attrs.get("epochs", len(curve))),
                    "seconds": float(seconds or 0.0),
                    "checkpoint": trial.user_attrs.get("checkpoint"),
                    "error": trial.user_attrs.get("error") or (record.error if record is not None else None),
                }
            )
        if not rows:  # the same columns before the first trial starts
            columns = ["number", "state", "params", self.metric, "best", "epochs", "seconds", "checkpoint", "error"]
            return pd.DataFrame(columns=columns)
        return pd.DataFrame(rows)

    def _pick(self, values: list[float]) -> float:
        import optuna

        return max(values) if self.study.direction == optuna.study.StudyDirection.MAXIMIZE else min(values)

    @property
    def best(self) -> Best:
        """The best complete trial: ``.params``, ``.metric``, ``.checkpoint``.

        Raises
        ------
        TrainingError
            When no trial has completed yet.
        """
        import optuna

        complete = [t for t in self.study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
        if not complete:
            states = self.results["state"].value_counts().to_dict() if len(self.study.trials) else {}
            raise TrainingError(
                f"{self.sweep_id} has no complete trial yet ({states or 'no trial'}); wait for one (sweep.wait()) "
                "or look at sweep.results"
            )
        trial = self.study.best_trial
        return Best(trial.number, dict(trial.params), float(trial.value), trial.user_attrs["checkpoint"])

    def history(self, number: int) -> pd.DataFrame:
        """The history table of trial ``number`` (its ``history.parquet``), e.g. for :func:`dask_dl.compare`."""
        from dask_dl.train.history import HISTORY_FILE

        trial = self.study.trials[number]
        folder = trial.user_attrs.get("checkpoint_dir")
        if folder is None or not os.path.exists(os.path.join(folder, HISTORY_FILE)):
            raise TrainingError(f"trial {number} has no history yet (it finished no epoch)")
        return pd.read_parquet(os.path.join(folder, HISTORY_FILE))

    # ---- control ----------------------------------------------------------------------------------------

    def stop(self) -> Sweep:
        """Stop every running trial and start no other; returns at once (``wait()`` to block).

        Running trials stay RUNNING in the study: ``sweep(..., storage=..., resume=True)`` continues them.
        """
        self._scheduler.halt()
        return self

    def wait(self, timeout: float | None = None) -> Sweep:
        """Block until the sweep ends; stop it on KeyboardInterrupt (then re-raise it).

        Raises
        ------
        TimeoutError
            When ``timeout`` seconds passed and the sweep still goes on.
        TrainingError
            When the sweep itself failed (failed trials are rows of ``results``, not errors).
        """
        try:
            finished = wait_for(self._scheduler.finished, timeout)
        except KeyboardInterrupt:
            self.stop()
            wait_for(self._scheduler.finished)
            raise
        if not finished:
            raise TimeoutError(f"{self.sweep_id} still runs after {timeout} s")
        error = self._scheduler.error
        if error is not None:
            if isinstance(error, DaskDLError):
                raise error
            raise TrainingError(f"{self.sweep_id} failed: {type(error).__name__}: {error}") from error
        return self

    # ---- views ------------------------------------------------------------------------------------------

    def plot(self) -> Figure:
        """The metric per epoch of every trial, pruned ones dashed and crossed, the best one thick."""
        from dask_dl.sweeps.view import plot_trials

        return plot_trials(self.results, metric=self.metric, best=self._best_number())

    def show(self) -> Sweep:
        """Show the sweep in the notebook and keep that view up to date as trials report."""
        from IPython.display import HTML, display

        self._handle = display(HTML(self._repr_html_()), display_id=True)
        return self

    @property
    def status(self) -> str:
        """``running``, ``done`` (every trial ended), ``stopped`` (by :meth:`stop`) or ``failed`` (see ``error``)."""
        if not self.done:
            return "running"
        if self.error is not None:
            return "failed"
        return "stopped" if self._scheduler.halted else "done"

    def snapshot(self) -> dict[str, Any]:
        """The sweep's state as the dashboard's sweeps page draws it (see :func:`dask_dl.dashboard.publish_sweep`):
        ``status``, ``metric``, ``direction``, ``best_trial`` and one dict per trial (``number``, ``state``,
        ``params``, ``curve``, ``best``, ``epochs``, ``seconds``, ``run_id``, ``error``)."""
        with self._scheduler.lock:
            runs = {n: r.run.run_id for n, r in self._scheduler.records.items() if r.run is not None}
        trials = [
            {
                "number": int(row["number"]),
                "state": row["state"],
                "params": dict(row["params"]),
                "curve": list(row[self.metric]),
                "best": row["best"],
                "epochs": int(row["epochs"]),
                "seconds": row["seconds"],
                "run_id": runs.get(int(row["number"])),
                "error": row["error"],
            }
            for row in self.results.to_dict("records")
        ]
        return {
            "status": self.status,
            "metric": self.metric,
            "direction": self.study.direction.name.lower(),
            "best_trial": self._best_number(),
            "trials": trials,
        }

    def _changed(self) -> None:
        self._publish()
        self._update_view()

    def _publish(self) -> None:
        from dask_dl.dashboard.events import publish_sweep

        try:
            publish_sweep(self._scheduler.client, self.sweep_id, self.snapshot())
        except Exception as exc:  # the dashboard page is a view; the sweep goes on without it
            logger.warning("%s: dashboard page not updated: %s: %s", self.sweep_id, type(exc).__name__, exc)

    def _update_view(self) -> None:
        if self._handle is None or (time.monotonic() - self._drawn < 2.0 and not self.done):
            return
        from IPython.display import HTML

        self._drawn = time.monotonic()
        self._handle.update(HTML(self._repr_html_()))

    def _best_number(self) -> int | None:
        try:
            return self.best.number
        except TrainingError:
            return None

    def _title(self) -> str:
        results = self.results
        counts = results["state"].value_counts().to_dict() if len(results) else {}
        status = "done" if self.done else "running"
        return f"{self.sweep_id} ({status}): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))

    def __repr__(self) -> str:
        return f"Sweep({self._title()})"

    def _repr_html_(self) -> str:
        from dask_dl.sweeps.view import results_html

        return results_html(self.results, metric=self.metric, title=self._title(), best=self._best_number())


def _install_dashboard(client: Any) -> str | None:
    """Serve the dask_dl pages on ``client``'s scheduler and return the sweeps page's address (None without one)."""
    from dask_dl.dashboard import install
    from dask_dl.dashboard.plugin import PAGE, SWEEPS_PAGE

    try:
        link = install(client)
    except Exception as exc:  # the page is a view; the sweep runs without it
        logger.warning("dask_dl dashboard page not installed on the scheduler: %s", exc)
        return None
    return None if link is None else link[: -len(PAGE)] + SWEEPS_PAGE
