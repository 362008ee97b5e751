"""MLflow runs written from the client on a background thread: :func:`open_tracker` and :class:`Tracker`.

A :class:`Tracker` is one MLflow run. What it is asked to log is queued and written by one thread per run tree
(a run and the runs nested in it share it) through an ``mlflow.MlflowClient`` with explicit run ids: no global
active run, so a process may track several runs at once (a sweep's trials running side by side). Nothing of it
ever waits for the tracking server except :meth:`Tracker.finish` (at most ``dask-dl.tracking.timeout`` seconds)
and a registration the user asked for. A server that is down or fails turns the tree's tracking off with one
warning on the ``dask_dl.tracking`` logger; training goes on and its history keeps every number.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import math
import os
import re
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from dask_dl import config
from dask_dl.errors import ClusterError, ConfigurationError, missing_dependency

__all__ = ["STATUSES", "Tracker", "TrackingError", "open_tracker", "tracking_uri"]

logger = logging.getLogger("dask_dl.tracking")

#: a dask_dl run's status -> the MLflow run status it ends with (``stopped-...``: KILLED too)
STATUSES = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}

_MAX_PARAM = 6000  # MLflow's longest param value
_BATCH = 100  # MLflow's most params per log_batch call
_IDLE_S = 5.0  # an idle writer thread ends after this; the next record starts another
_METRIC_NAME = re.compile(r"[^\w\-./ ]")


class TrackingError(ClusterError):
    """A tracking request that needs an answer (a model registration) did not get one."""


def tracking_uri(tracking: str | os.PathLike | None) -> str | None:
    """Resolve ``fit(tracking=...)``: the URI itself, else ``dask-dl.tracking.uri``, else ``MLFLOW_TRACKING_URI``.

    A folder (a path or ``file://`` URI) becomes an SQLite database ``mlflow.db`` in it: MLflow 3 no longer writes
    its file store. Returns None when tracking is off.

    Raises
    ------
    ConfigurationError
        ``tracking`` is not a string or path.
    MissingDependencyError
        mlflow is not installed.
    """
    if tracking is False:
        return None
    if tracking is None:
        tracking = config.get("tracking.uri") or os.environ.get("MLFLOW_TRACKING_URI") or None
    if tracking is None or tracking == "":
        return None
    if not isinstance(tracking, str | os.PathLike):
        raise ConfigurationError(
            f"tracking must be an MLflow tracking URI, a folder or a Tracker, got {type(tracking).__name__} "
            f"{tracking!r}; pass e.g. tracking='http://127.0.0.1:5000' or tracking='sqlite:///runs.db'"
        )
    uri = os.fspath(tracking)
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme in ("", "file") or len(scheme) == 1:  # a folder (a one-letter scheme: a Windows drive)
        folder = urllib.parse.urlparse(uri).path if scheme == "file" else uri
        folder = os.path.abspath(os.path.expanduser(folder))
        os.makedirs(folder, exist_ok=True)
        uri = "sqlite:///" + os.path.join(folder, "mlflow.db")
    if importlib.util.find_spec("mlflow") is None:
        raise missing_dependency("mlflow", "tracking", f"tracking={uri!r}")
    return uri


def open_tracker(
    tracking: str | os.PathLike | Tracker | None,
    *,
    run_name: str,
    experiment: str | None = None,
    tags: Mapping[str, Any] | None = None,
) -> Tracker | None:
    """Start an MLflow run named ``run_name``, or hand back a :class:`Tracker` given as ``tracking``.

    Returns at once: the run is created on the tracker's thread. None when tracking is off (no URI given, none in
    ``dask-dl.tracking.uri`` or ``MLFLOW_TRACKING_URI``).

    Parameters
    ----------
    tracking : str, path, Tracker or None
        ``http://host:port`` (a tracking server), ``sqlite:///path.db``, another MLflow store URI, or a folder.
    run_name : str
    experiment : str, optional
        MLflow experiment, made when missing. Default ``dask-dl.tracking.experiment``.
    tags : mapping, optional
        Tags of the new run.

    Examples
    --------
    >>> parent = open_tracker("sqlite:///runs.db", run_name="lr sweep")  # doctest: +SKIP
    >>> run = fit(ds, lr=0.01, tracking=parent.nested("lr 0.01"))  # doctest: +SKIP
    >>> parent.finish("finished")  # doctest: +SKIP
    """
    if isinstance(tracking, Tracker):
        if tags:
            tracking.set_tags(tags)
        return tracking
    uri = tracking_uri(tracking)
    if uri is None:
        return None
    writer = _Writer(uri, timeout=float(config.get("tracking.timeout")))
    return Tracker(writer, run_name=run_name, experiment=config.get("tracking.experiment", experiment), tags=tags)


class _Writer:
    """One MlflowClient and the thread that writes to it, shared by a run and the runs nested in it.

    Records are written in the order they were queued. The first failure turns the writer off: one warning, and
    what is queued then or later is dropped.
    """

    def __init__(self, uri: str, *, timeout: float) -> None:
        self.uri, self.timeout = uri, timeout
        self.error: BaseException | None = None
        self._pending: collections.deque[tuple[Callable[[Any], Any], Future, str]] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._experiments: dict[str, str] = {}

    def submit(self, op: Callable[[Any], Any], what: str) -> Future:
        """Queue ``op(client)``; its future holds what it returned (None when the writer is off)."""
        future: Future = Future()
        with self._cond:
            if self.error is not None:
                future.set_result(None)
                return future
            self._pending.append((op, future, what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="dask-dl-tracking", daemon=True)
                self._thread.start()
            self._cond.notify()
        return future

    def wait(self, future: Future, timeout: float | None = None) -> bool:
        """Wait for ``future`` up to ``timeout`` (default the writer's); True when it is done."""
        try:
            future.exception(timeout=self.timeout if timeout is None else timeout)
        except FutureTimeout:
            return False
        return True

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._cond.wait(_IDLE_S)
                if not self._pending:
                    self._thread = None
                    return
                op, future, what = self._pending.popleft()
            if self.error is not None:
                future.set_result(None)
                continue
            try:
                if self._client is None:
                    self._client = self._connect()
                future.set_result(op(self._client))
            except Exception as exc:  # the server is down, slow or refuses: training goes on untracked
                self._fail(exc, what)
                future.set_exception(exc)

    def _connect(self) -> Any:
        if self.uri.startswith(("http://", "https://")):
            # MLflow's own requests retry with back-off for minutes; one short probe tells a server that is not there
            url = self.uri.rstrip("/") + "/health"
            with urllib.request.urlopen(url, timeout=self.timeout) as answer:
                answer.read()
        from mlflow import MlflowClient

        quiet = logging.getLogger("mlflow.store.db.utils")
        if quiet.level == logging.NOTSET:  # unless set by the user: MLflow says at INFO that a new store gets tables
            quiet.setLevel(logging.WARNING)
        return MlflowClient(tracking_uri=self.uri)

    def _fail(self, exc: BaseException, what: str) -> None:
        with self._cond:
            first = self.error is None
            self.error = exc
            dropped = list(self._pending)
            self._pending.clear()
        for _, future, _ in dropped:
            future.set_result(None)
        if first:
            logger.warning(
                "MLflow tracking at %s failed while %s (%s: %s); nothing more of this run is sent there. Training "
                "goes on and run.history keeps every metric",
                self.uri,
                what,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )

    def experiment_id(self, client: Any, name: str | None) -> str:
        """The id of experiment ``name``, made when missing (artifacts beside an SQLite database); writer thread."""
        if name is None:
            return "0"
        if name not in self._experiments:
            found = client.get_experiment_by_name(name)
            if found is not None:
                self._experiments[name] = found.experiment_id
            else:
                location = None
                if self.uri.startswith("sqlite:///"):  # MLflow's default is ./mlruns, wherever the user stands
                    database = os.path.abspath(self.uri[len("sqlite:///") :].split("?")[0])
                    location = "file://" + os.path.join(os.path.dirname(database), "mlartifacts")
                self._experiments[name] = client.create_experiment(name, artifact_location=location)
        return self._experiments[name]


class Tracker:
    """One MLflow run; made by :func:`open_tracker` or :meth:`nested`.

    Every method returns at once: records are written in order on the tracker's thread. Attributes: ``run_name``,
    ``uri`` (the tracking URI) and :attr:`run_id`.
    """

    def __init__(
        self,
        writer: _Writer,
        *,
        run_name: str,
        experiment: str | None,
        tags: Mapping[str, Any] | None = None,
        parent: Tracker | None = None,
    ) -> None:
        self._writer, self.run_name, self.experiment, self.parent = writer, run_name, experiment, parent
        self.uri = writer.uri
        self._id: str | None = None
        self._finished = False
        self._children: list[Tracker] = []
        tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self._created = writer.submit(lambda client: self._create(client, tags), f"creating run {run_name!r}")

    def _create(self, client: Any, tags: dict[str, str]) -> str:
        if self.parent is not None:
            if self.parent._id is None:  # the parent's run was never made: the writer is off
                raise RuntimeError(f"the parent run {self.parent.run_name!r} does not exist")
            tags["mlflow.parentRunId"] = self.parent._id
        experiment_id = self._writer.experiment_id(client, self.experiment)
        self._id = client.create_run(experiment_id, run_name=self.run_name, tags=tags).info.run_id
        return self._id

    @property
    def run_id(self) -> str | None:
        """The MLflow run id; waits until the run is made (at most ``dask-dl.tracking.timeout`` s); None if not."""
        self._writer.wait(self._created)
        return self._id

    @property
    def active(self) -> bool:
        """False once the tracking of this run tree has failed (one warning said why)."""
        return self._writer.error is None

    def nested(self, run_name: str, *, tags: Mapping[str, Any] | None = None) -> Tracker:
        """A run nested in this one (MLflow's ``mlflow.parentRunId`` tag), in the same experiment and thread.

        Pass it to ``fit(tracking=...)``, which ends it; one still open when this run finishes ends as failed (a
        fit that raised before it trained).
        """
        child = Tracker(self._writer, run_name=run_name, experiment=self.experiment, tags=tags, parent=self)
        self._children.append(child)
        return child

    def log_params(self, params: Mapping[str, Any]) -> Future:
        """Log ``params`` (values as strings, cut to MLflow's 6000 characters)."""
        from_items = [(str(k), _param_value(v)) for k, v in params.items()]

        def op(client: Any) -> None:
            from mlflow.entities import Param

            for i in range(0, len(from_items), _BATCH):
                client.log_batch(self._id, params=[Param(k, v) for k, v in from_items[i : i + _BATCH]])

        return self._writer.submit(op, f"logging the params of {self.run_name!r}")

    def set_tags(self, tags: Mapping[str, Any]) -> Future:
        """Set tags of the run."""
        items = [(str(k), str(v)) for k, v in tags.items()]

        def op(client: Any) -> None:
            from mlflow.entities import RunTag

            client.log_batch(self._id, tags=[RunTag(k, v) for k, v in items])

        return self._writer.submit(op, f"tagging {self.run_name!r}")

    def log_epoch(self, row: Mapping[str, Any], step: int) -> Future:
        """Log the finite numbers of a history ``row`` as metrics at ``step`` (names MLflow refuses are cleaned)."""
        stamp = int(time.time() * 1000)
        values = {_metric_name(k): float(v) for k, v in row.items() if _is_number(v)}

        def op(client: Any) -> None:
            from mlflow.entities import Metric

            client.log_batch(self._id, metrics=[Metric(k, v, stamp, int(step)) for k, v in values.items()])

        return self._writer.submit(op, f"logging step {step} of {self.run_name!r}")

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> Future:
        """Upload the file or folder ``path`` (read on the tracker's thread: keep it until the future is done)."""
        path = os.fspath(path)
        return self._writer.submit(
            lambda client: client.log_artifact(self._id, path, artifact_path), f"uploading {path!r}"
        )

    def log_text(self, text: str, name: str) -> Future:
        """Write ``text`` as the artifact file ``name`` (e.g. ``model/source.py``)."""
        return self._writer.submit(lambda client: client.log_text(self._id, text, name), f"writing {name!r}")

    def log_table(self, table: Any, name: str) -> Future:
        """Write a pandas DataFrame as the CSV artifact ``name`` (e.g. ``history.csv``)."""
        text = table.to_csv(index=False)
        return self.log_text(text, name)

    def register_onnx(
        self,
        path: str | os.PathLike,
        name: str,
        *,
        labels: list[str] | tuple[str, ...],
        normalization: Mapping[str, Any],
        extra: Mapping[str, Any] | None = None,
    ) -> Any:
        """Upload the ONNX file ``path`` under ``onnx/`` and register it as a new version of model ``name``.

        The version's tags hold ``labels`` and ``normalization`` (JSON) and ``extra``; its description says them in
        words. Waits for the answer (registration is asked for, not a side effect of training).

        Returns
        -------
        mlflow.entities.model_registry.ModelVersion

        Raises
        ------
        TrackingError
            The tracking server did not answer, or refused.
        """
        path = os.fspath(path)
        tags = {"labels": json.dumps(list(labels)), "normalization": json.dumps(dict(normalization))}
        tags |= {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (extra or {}).items()}
        description = (
            f"dask_dl ONNX model {os.path.basename(path)}: labels {', '.join(labels)}; inputs are pixels 0-255 "
            f"normalized in the graph as (x / 255 - mean) / std with {dict(normalization)}"
        )

        def op(client: Any) -> Any:
            from mlflow.exceptions import MlflowException

            client.log_artifact(self._id, path, "onnx")
            try:
                client.create_registered_model(name)
            except MlflowException as exc:  # it exists: this is one more version of it
                if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
                    raise
            source = client.get_run(self._id).info.artifact_uri.rstrip("/") + "/onnx"
            return client.create_model_version(name, source=source, run_id=self._id, tags=tags, description=description)

        future = self._writer.submit(op, f"registering model {name!r}")
        if not self._writer.wait(future, max(self._writer.timeout, 60.0)):
            raise TrackingError(f"the MLflow server at {self.uri} did not register {name!r} within 60 s; try again")
        if future.exception() is not None or future.result() is None:
            raise TrackingError(
                f"model {name!r} was not registered: MLflow tracking at {self.uri} failed "
                f"({type(self._writer.error).__name__}: {self._writer.error}); export again once it answers"
            )
        return future.result()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what was queued so far is written (at most ``timeout``, default ``dask-dl.tracking.timeout``)."""
        return self._writer.wait(self._writer.submit(lambda client: None, "flushing"), timeout)

    def finish(self, status: str = "finished") -> None:
        """End the run with a dask_dl ``status`` (``finished``, ``stopped``, ``failed``) and wait for its records.

        Waits at most ``dask-dl.tracking.timeout`` seconds: a server that does not take them in time is left
        behind (with one warning) and the records go on in the background.
        """
        if self._finished:
            return
        self._finished = True
        for child in self._children:
            child.finish("failed")
        state = STATUSES.get(status, "KILLED" if status.startswith("stopped") else "FINISHED")
        future = self._writer.submit(
            lambda client: client.set_terminated(self._id, state), f"ending run {self.run_name!r}"
        )
        if not self._writer.wait(future) and self.active:
            logger.warning(
                "MLflow tracking at %s has not taken the last records of %r within %g s "
                "(dask-dl.tracking.timeout); they are sent in the background while this process lives",
                self.uri,
                self.run_name,
                self._writer.timeout,
            )

    def __repr__(self) -> str:
        state = "active" if self.active else f"off: {self._writer.error}"
        return f"Tracker({self.run_name!r}, {self.uri}, run_id={self._id}, {state})"


def _is_number(value: Any) -> bool:
    import numbers

    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _metric_name(name: Any) -> str:
    return _METRIC_NAME.sub("_", str(name))


def _param_value(value: Any) -> str:
    plain = value is None or isinstance(value, str | bool | int | float)
    text = str(value) if plain else json.dumps(value, default=str)
    return text if len(text) <= _MAX_PARAM else text[: _MAX_PARAM - 3] + "..."
