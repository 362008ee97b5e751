"""What runs publish to the dashboard, where the scheduler keeps it, and the checks that keep one bad run from
breaking the page.

A run reports with :func:`publish`: one event on the scheduler's event log (topic :data:`TOPIC`) per update, each
carrying the run's latest *snapshot* (the dict of :meth:`dask_dl.TrainingRun.snapshot`). On the scheduler, the
dashboard plugin folds every such event into a :class:`RunStore` as it arrives (the event log itself keeps only
the last ``distributed.admin.low-level-log-length`` events, about a quarter of an hour of training), which keeps
the latest state of the last ``dask-dl.dashboard.max-runs`` runs. The event log is open to every client, so the
page checks every run with :func:`check_run` before drawing it: a run that fails shows its problems, not a
traceback, and the other runs are drawn as usual.

Nothing here imports Bokeh: the checks also run in the client that publishes.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from dask_dl.errors import ConfigurationError

TOPIC = "dask-dl-runs"
SWEEP_TOPIC = "dask-dl-sweeps"
PLUGIN_NAME = "dask-dl-dashboard"

#: keys of a snapshot the page draws as numbers (every one optional)
RUN_NUMBERS = (
    "trainers",
    "epoch",
    "epochs",
    "step",
    "steps_per_epoch",
    "global_batch",
    "loss",
    "images_per_s",
    "data_wait_share",
    "bytes_sent",
    "bytes_uncompressed",
)
#: keys of a history row the page draws as numbers; ``val_auroc_<label>`` columns are numbers too
ROW_NUMBERS = (
    "epoch",
    "steps",
    "global_batch",
    "train_loss",
    "val_loss",
    "images_per_s",
    "data_wait_s",
    "seconds",
    "bytes_sent",
    "bytes_uncompressed",
    "cost",
)
#: what a run and each of its history rows must hold
RUN_REQUIRED = ("status",)
ROW_REQUIRED = ("epoch", "train_loss")
#: what a sweep and each of its trials must hold
SWEEP_REQUIRED = ("status", "metric", "trials")
TRIAL_REQUIRED = ("number", "state")
_MAX_PROBLEMS = 5  # a run with a thousand bad rows shows the first few and a count


def publish(client: Any, run_id: str, snapshot: dict[str, Any]) -> None:
    """Send the current state of a run to the scheduler's event log, where the dashboard page reads it.

    Parameters
    ----------
    client
        A :class:`distributed.Client` connected to the scheduler that serves the page.
    run_id
        The run's name; later snapshots of the same run replace the keys they carry.
    snapshot
        The run's state, shaped like :meth:`dask_dl.TrainingRun.snapshot`: ``status`` and optionally the keys of
        :data:`RUN_NUMBERS` and ``history``, a list of epoch rows (dicts with ``epoch``, ``train_loss`` and
        optionally :data:`ROW_NUMBERS` and ``val_auroc_<label>``). NaN and infinity travel as ``None``.

    Raises
    ------
    ConfigurationError
        When ``run_id`` is not a non-empty string or ``snapshot`` is malformed (not a dict, no ``status``, a
        number that is not a number, a history that is not a list of rows); nothing is published then.
    """
    example = "{'status': 'running', 'epoch': 0, 'loss': 0.4, 'history': [{'epoch': 0, 'train_loss': 0.5}, ...]}"
    _send(client, TOPIC, "run", run_id, snapshot, check_run, "TrainingRun.snapshot()", example)


def publish_sweep(client: Any, sweep_id: str, snapshot: dict[str, Any]) -> None:
    """Send the current state of a sweep to the scheduler's event log, where the sweeps page reads it.

    Parameters
    ----------
    client
        A :class:`distributed.Client` connected to the scheduler that serves the page.
    sweep_id
        The sweep's name; later snapshots of the same sweep replace the keys they carry.
    snapshot
        The sweep's state, shaped like :meth:`dask_dl.sweeps.Sweep.snapshot`: ``status``, ``metric``,
        ``direction`` and ``trials``, a list of trials (dicts with ``number``, ``state`` and optionally
        ``params``, ``curve``, the metric per epoch, ``best``, ``epochs``, ``seconds``, ``run_id`` and
        ``error``); optionally ``best_trial``, the number of the best trial.

    Raises
    ------
    ConfigurationError
        When ``sweep_id`` is not a non-empty string or ``snapshot`` is malformed; nothing is published then.
    """
    example = "{'status': 'running', 'metric': 'val_auroc_mean', 'trials': [{'number': 0, 'state': 'running'}]}"
    _send(client, SWEEP_TOPIC, "sweep", sweep_id, snapshot, check_sweep, "Sweep.snapshot()", example)


def _send(client: Any, topic: str, kind: str, name: str, snapshot: Any, check: Any, shape: str, example: str) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"{kind}_id must be a non-empty string, got {name!r}")
    if not isinstance(snapshot, dict):
        raise ConfigurationError(
            f"the snapshot of {kind} {name!r} must be a dict like {shape}, got {type(snapshot).__name__}"
        )
    message = jsonable(snapshot)
    problems = check(message)
    if problems:
        raise ConfigurationError(
            f"the snapshot of {kind} {name!r} cannot go to the dashboard: {'; '.join(problems)}. "
            f"Publish dicts shaped like {shape}: {example}"
        )
    client.log_event(topic, {**message, f"{kind}_id": name})


class RunStore:
    """The latest state of each run (or sweep), folded from its events as they arrive, in start order.

    Parameters
    ----------
    max_runs
        How many runs to keep; beyond it, the run started first goes. Default ``dask-dl.dashboard.max-runs``.
    key
        The message key that names the run: ``"run_id"``, or ``"sweep_id"`` for the sweeps' events.

    Raises
    ------
    ConfigurationError
        When ``max_runs`` is not a positive integer.
    """

    def __init__(self, max_runs: int | None = None, *, key: str = "run_id") -> None:
        from dask_dl import config
        from dask_dl.checks import positive_int

        self.key = key
        self.max_runs = positive_int("dask-dl.dashboard.max-runs", config.get("dashboard.max-runs", max_runs))
        self.runs: dict[str, dict[str, Any]] = {}
        self.version = 0  # counts the events folded: the page redraws when it changes

    def fold(self, msg: Any) -> None:
        """Merge one event's message into its run's state; messages that are not run updates are skipped.

        A message is an update when it is a dict with the store's ``key`` (``run_id``); an id that is not a
        string is used as its ``str``. Later keys replace earlier ones.
        """
        if not isinstance(msg, dict) or msg.get(self.key) is None:
            return
        run_id = msg[self.key] if isinstance(msg[self.key], str) else str(msg[self.key])
        self.runs.setdefault(run_id, {}).update({str(k): v for k, v in msg.items() if k != self.key})
        while len(self.runs) > self.max_runs:
            del self.runs[next(iter(self.runs))]
        self.version += 1


def runs_from_events(events: Any, *, max_runs: int | None = None, key: str = "run_id") -> dict[str, dict[str, Any]]:
    """Fold the scheduler's ``dask-dl-runs`` events into the latest state of each run, in start order.

    Parameters
    ----------
    events
        ``(timestamp, message)`` pairs as ``Scheduler.get_events(TOPIC)`` returns them; see :meth:`RunStore.fold`
        for which messages count.
    max_runs, key
        See :class:`RunStore` (``key="sweep_id"`` folds the ``dask-dl-sweeps`` events).

    Returns
    -------
    dict
        ``{run_id: state}``, each state the union of the run's messages, later keys winning.
    """
    store = RunStore(max_runs, key=key)
    for event in events:
        if isinstance(event, tuple | list) and len(event) == 2:
            store.fold(event[1])
    return store.runs


def scheduler_runs(scheduler: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    """A version and the runs on ``scheduler``: the dashboard plugin's store, else folded from the event log.

    The version changes whenever a run does, so a page redraws only then.
    """
    return _scheduler_store(scheduler, "store", TOPIC, "run_id")


def scheduler_sweeps(scheduler: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    """A version and the sweeps on ``scheduler``, as :func:`scheduler_runs` gives the runs."""
    return _scheduler_store(scheduler, "sweeps", SWEEP_TOPIC, "sweep_id")


def _scheduler_store(scheduler: Any, attribute: str, topic: str, key: str) -> tuple[Any, dict[str, dict[str, Any]]]:
    store = getattr(scheduler.plugins.get(PLUGIN_NAME), attribute, None)
    if store is not None:
        return ("store", id(store), store.version), store.runs
    events = scheduler.get_events(topic)  # no plugin (yet): what the event log still holds
    return ("events", len(events), events[-1][0] if events else None), runs_from_events(events, key=key)


def check_run(run: Any) -> list[str]:
    """Return what is wrong with a run's state for drawing it (an empty list when nothing is).

    Parameters
    ----------
    run
        A run's state as :func:`runs_from_events` folds it.

    Returns
    -------
    list of str
        One line per problem, naming the key and the offending value, e.g.
        ``"history[2]['train_loss'] is 'abc' (str), not a number"``; at most a few, then a count.
    """
    if not isinstance(run, dict):
        return [f"the run's state is a {type(run).__name__}, not a dict"]
    problems = [f"missing key {key!r}" for key in RUN_REQUIRED if key not in run]
    if "status" in run and not isinstance(run["status"], str):
        problems.append(f"status is {_show(run['status'])}, not a string")
    problems += [_not_a_number(key, run[key]) for key in RUN_NUMBERS if key in run and not _is_number(run[key])]
    history = run.get("history", [])
    if not isinstance(history, list | tuple):  # msgpack hands the scheduler tuples
        problems.append(f"history is {_show(history)}, not a list of epoch rows")
        history = []
    for i, row in enumerate(history):
        if not isinstance(row, dict):
            problems.append(f"history[{i}] is {_show(row)}, not a dict")
            continue
        problems += [f"history[{i}] misses key {key!r}" for key in ROW_REQUIRED if key not in row]
        if "epoch" in row and row["epoch"] is None:
            problems.append(f"history[{i}]['epoch'] is None: every row needs its epoch number")
        problems += [
            _not_a_number(f"history[{i}][{key!r}]", value)
            for key, value in row.items()
            if (key in ROW_NUMBERS or key.startswith("val_auroc_")) and not _is_number(value)
        ]
    if len(problems) > _MAX_PROBLEMS:
        problems = [*problems[:_MAX_PROBLEMS], f"and {len(problems) - _MAX_PROBLEMS} more"]
    return problems


def check_sweep(sweep: Any) -> list[str]:
    """Return what is wrong with a sweep's state for drawing it (an empty list when nothing is).

    Parameters
    ----------
    sweep
        A sweep's state as the dashboard plugin folds it (see :func:`publish_sweep`).

    Returns
    -------
    list of str
        One line per problem, naming the key and the offending value, e.g.
        ``"trials[1]['curve'][0] is 'x' (str), not a number"``; at most a few, then a count.
    """
    if not isinstance(sweep, dict):
        return [f"the sweep's state is a {type(sweep).__name__}, not a dict"]
    problems = [f"missing key {key!r}" for key in SWEEP_REQUIRED if key not in sweep]
    for key in ("status", "metric", "direction"):
        if key in sweep and not isinstance(sweep[key], str):
            problems.append(f"{key} is {_show(sweep[key])}, not a string")
    if "best_trial" in sweep and not _is_number(sweep["best_trial"]):
        problems.append(_not_a_number("best_trial", sweep["best_trial"]))
    trials = sweep.get("trials", [])
    if not isinstance(trials, list | tuple):
        problems.append(f"trials is {_show(trials)}, not a list of trials")
        trials = []
    for i, trial in enumerate(trials):
        if not isinstance(trial, dict):
            problems.append(f"trials[{i}] is {_show(trial)}, not a dict")
            continue
        problems += [f"trials[{i}] misses key {key!r}" for key in TRIAL_REQUIRED if key not in trial]
        if "number" in trial and (trial["number"] is None or not _is_number(trial["number"])):
            problems.append(_not_a_number(f"trials[{i}]['number']", trial["number"]))
        if "state" in trial and not isinstance(trial["state"], str):
            problems.append(f"trials[{i}]['state'] is {_show(trial['state'])}, not a string")
        problems += [
            _not_a_number(f"trials[{i}][{key!r}]", trial[key])
            for key in ("best", "epochs", "seconds")
            if key in trial and not _is_number(trial[key])
        ]
        curve = trial.get("curve", [])
        if not isinstance(curve, list | tuple):
            problems.append(f"trials[{i}]['curve'] is {_show(curve)}, not a list of numbers")
            continue
        problems += [
            _not_a_number(f"trials[{i}]['curve'][{j}]", value) for j, value in enumerate(curve) if not _is_number(value)
        ]
    if len(problems) > _MAX_PROBLEMS:
        problems = [*problems[:_MAX_PROBLEMS], f"and {len(problems) - _MAX_PROBLEMS} more"]
    return problems


def jsonable(value: Any) -> Any:
    """Return ``value`` with only JSON types: numpy scalars as Python numbers, NaN and infinity as ``None``,
    tuples as lists, dict keys as strings and anything else as its ``str``."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:  # numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _is_number(value: Any) -> bool:
    if value is None:
        return True  # not measured (yet), or NaN on the way
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _not_a_number(name: str, value: Any) -> str:
    return f"{name} is {_show(value)}, not a number"


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"
