"""MLflow tracking of fit, fit_sites and export_onnx, against a real ``mlflow server`` and a plain SQLite file.

The server (SQLite backend, served artifacts, on a free 127.0.0.1 port) is started once per session and stopped
by its pid. The collection is the 32 px "squares" of tests/train/test_fit.py (64 train, 32 val images); each fit is
1-2 epochs of one trainer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys

import dask.config
import numpy as np
import pandas as pd
import pytest

import dask_dl
from dask_dl import ConfigurationError, MissingDependencyError
from dask_dl.normalize import DEFAULT_NORMALIZATION
from dask_dl.testing.models import tiny_net
from dask_dl.testing.servers import unavailable
from dask_dl.testing.train import squares_collection
from dask_dl.tracking import open_tracker, tracking_uri
from dask_dl.tracking.runs import _params

mlflow = pytest.importorskip("mlflow")

OPTIONS = dict(model="small_cnn", model_kwargs={"width": 8}, batch_size=8, trainers=1, lr=0.05, seed=0)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` with an SQLite backend; yields its URI."""
    from dask_dl.testing.tracking import mlflow_server

    try:
        with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as uri:
            yield uri
    except RuntimeError as exc:
        unavailable(f"mlflow server did not start: {exc}")


@pytest.fixture(autouse=True)
def patient_tracking():
    """The end of a run waits for its last records long enough on a loaded CI machine."""
    with dask.config.set({"dask-dl.tracking.timeout": 120}):
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory, cluster_client) -> str:
    root = tmp_path_factory.mktemp("squares")
    path = str(root / "squares.zarr")
    dask_dl.ingest(squares_collection(root), path, size=32, chunk=8, shard=2, client=cluster_client, progress=False)
    return path


def client_for(uri: str):
    return mlflow.MlflowClient(tracking_uri=uri)


def artifacts(client, run_id: str, path: str | None = None) -> list[str]:
    return sorted(f.path for f in client.list_artifacts(run_id, path))


# ---- a fit on a tracking server, its export and its registration ---------------------------------------------


@pytest.mark.slow
def test_fit_on_server_logs_params_epochs_history_and_registers_onnx(mlflow_server, store, cluster_client, tmp_path):
    run = dask_dl.fit(dask_dl.open_dataset(store), epochs=2, client=cluster_client, tracking=mlflow_server, **OPTIONS)
    client = client_for(mlflow_server)
    logged = client.get_run(run.tracker.run_id)
    assert logged.info.status == "FINISHED"
    assert logged.info.run_name == run.run_id
    params = logged.data.params
    expected = {
        "model": "small_cnn",
        "model_kwargs.width": "8",
        "epochs": "2",
        "batch_size": "8",
        "trainers": "1",
        "lr": "0.05",
        "seed": "0",
        "compression": "none",
        "store": store,
        "train_samples": "64",
        "val_samples": "32",
        "labels": '["a", "b"]',
        "normalization.mean": str(DEFAULT_NORMALIZATION["mean"]),
        "store.images": "96",
        "store.size": "32",
        "store.labels": '["a", "b"]',
        "store.split.train": "64",
        "store.split.val": "32",
        "trainer_workers": json.dumps(run.workers),
    }
    assert {k: params.get(k) for k in expected} == expected
    assert set(_params(run.options)) <= set(params)  # every option, whatever its group
    assert logged.data.tags["dask_dl.run_id"] == run.run_id

    history = run.history
    for column in (
        "train_loss",
        "val_loss",
        "val_auroc_mean",
        "val_auroc_a",
        "val_auroc_b",
        "images_per_s",
        "data_wait_s",
        "bytes_sent",
    ):
        points = client.get_metric_history(logged.info.run_id, column)
        assert [p.step for p in points] == [0, 1], column
        np.testing.assert_allclose([p.value for p in points], history[column].to_numpy(float), rtol=1e-6)
    assert "epoch" not in logged.data.metrics  # it is the step
    assert artifacts(client, logged.info.run_id) == ["history.csv"]  # a registry model: its name says it all
    table = pd.read_csv(client.download_artifacts(logged.info.run_id, "history.csv", str(tmp_path)))
    pd.testing.assert_frame_equal(table[["epoch", "train_loss"]], history[["epoch", "train_loss"]], check_exact=False)

    onnx_path = dask_dl.export_onnx(run, tmp_path / "squares.onnx", register="squares-cnn")
    assert artifacts(client, logged.info.run_id, "onnx") == ["onnx/squares.onnx"]
    versions = client.search_model_versions("name = 'squares-cnn'")
    assert [v.version for v in versions] == ["1"]
    version = versions[0]
    assert version.run_id == logged.info.run_id
    assert json.loads(version.tags["labels"]) == ["a", "b"]
    assert json.loads(version.tags["normalization"]) == {"mean": 0.5, "std": 0.25}
    assert version.tags["input_size"] == "32" and version.tags["task"] == "multilabel"
    assert "labels a, b" in version.description
    assert onnx_path.exists()


# ---- nesting: two fits under one parent, at the same time, in a plain SQLite file ----------------------------


@pytest.mark.slow
def test_two_fits_nested_under_one_parent_in_sqlite(store, cluster_client, tmp_path):
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    parent = open_tracker(uri, run_name="lr trials", experiment="nesting")
    ds = dask_dl.open_dataset(store)
    runs = [
        dask_dl.fit(
            ds,
            epochs=e,
            client=cluster_client,
            wait=False,
            tracking=parent.nested(f"trial {n}"),
            **{**OPTIONS, "lr": lr, "model": "small_cnn" if n == 0 else tiny_net},
        )
        for n, (lr, e) in enumerate([(0.05, 1), (0.01, 2)])
    ]  # the second: a factory of the user's, whose source the run keeps
    for run in runs:
        run.wait()
    parent.finish("finished")

    client = client_for(uri)
    experiment = client.get_experiment_by_name("nesting")
    assert experiment.artifact_location == f"file://{tmp_path / 'mlartifacts'}"  # beside the database, not ./mlruns
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["trial 0", "trial 1"]
    by_name = {c.info.run_name: c for c in children}
    for n, (run, lr, epochs) in enumerate(zip(runs, (0.05, 0.01), (1, 2), strict=True)):
        child = by_name[f"trial {n}"]
        assert child.info.run_id == run.tracker.run_id
        assert child.info.status == "FINISHED"
        assert child.data.params["lr"] == str(lr)
        assert len(client.get_metric_history(child.info.run_id, "train_loss")) == epochs
    assert artifacts(client, runs[0].tracker.run_id) == ["history.csv"]
    dask_dl.export_onnx(runs[0], tmp_path / "trial-0.onnx")  # no register=: the file goes to the run
    assert artifacts(client, runs[0].tracker.run_id, "onnx") == ["onnx/trial-0.onnx"]
    assert client.search_registered_models() == []
    assert artifacts(client, runs[1].tracker.run_id) == ["history.csv", "model"]
    assert by_name["trial 1"].data.params["model"] == "dask_dl.testing.models:tiny_net"
    source = client.download_artifacts(runs[1].tracker.run_id, "model/source.py", str(tmp_path))
    with open(source) as f:
        assert f.read().startswith("def tiny_net(num_outputs: int, in_channels: int = 1, width: int = 4)")
    assert client.get_run(parent.run_id).info.status == "FINISHED"
    assert "mlflow.parentRunId" not in client.get_run(parent.run_id).data.tags


@pytest.mark.slow
def test_a_nested_run_whose_fit_failed_ends_failed(store, cluster_client, tmp_path):
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    parent = open_tracker(uri, run_name="sweep")
    trial = parent.nested("trial 0")
    with pytest.raises(dask_dl.DatasetError, match="batch"):
        dask_dl.fit(
            dask_dl.open_dataset(store),
            epochs=1,
            client=cluster_client,
            tracking=trial,
            **{**OPTIONS, "batch_size": 4096},
        )
    parent.finish("finished")
    assert client_for(uri).get_run(trial.run_id).info.status == "FAILED"


# ---- a tracking server that is not there ---------------------------------------------------------------------


def test_server_down_warns_once_and_training_goes_on(store, cluster_client, caplog):
    from dask_dl.testing.servers import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="dask_dl.tracking"):
        run = dask_dl.fit(dask_dl.open_dataset(store), epochs=2, client=cluster_client, tracking=closed, **OPTIONS)
    warnings = [r for r in caplog.records if r.name == "dask_dl.tracking"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert closed in message and "Connection refused" in message and "run.history keeps every metric" in message
    assert run.status == "finished"
    assert list(run.history["epoch"]) == [0, 1]
    assert run.history["val_auroc_mean"].notna().all()
    assert not run.tracker.active and run.tracker.run_id is None


# ---- fit_sites: a parent run, one nested run per site and round ----------------------------------------------


@pytest.mark.slow
def test_fit_sites_parent_run_with_a_run_per_site_and_round(store, cluster_client, tmp_path):
    root = tmp_path / "B"
    other = str(root / "b.zarr")
    dask_dl.ingest(
        squares_collection(root, n_train=32, n_val=16, seed=1),
        other,
        size=32,
        chunk=8,
        shard=2,
        client=cluster_client,
        progress=False,
    )
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    sites = {"A": dask_dl.open_dataset(store), "B": dask_dl.open_dataset(other)}
    options = {k: v for k, v in OPTIONS.items() if k != "trainers"}
    run = dask_dl.fit_sites(sites, protocol="fedavg", rounds=2, client=cluster_client, tracking=uri, **options)

    client = client_for(uri)
    parent = client.get_run(run.tracker.run_id)
    assert parent.info.status == "FINISHED" and parent.info.run_name == run.run_id
    assert parent.data.params["protocol"] == "fedavg" and parent.data.params["rounds"] == "2"
    assert parent.data.params["sites.A.train"] == "64" and parent.data.params["sites.B.train"] == "32"
    for site in ("A", "B"):
        points = client.get_metric_history(parent.info.run_id, f"{site}.auroc_mean")
        assert [p.step for p in points] == [0, 1]
        np.testing.assert_allclose([p.value for p in points], list(run.curves[site]), rtol=1e-6)
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["A round 0", "A round 1", "B round 0", "B round 1"]
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.tags["dask_dl.site"] == child.info.run_name[0]
        assert child.data.params["store"] == (store if child.info.run_name[0] == "A" else other)
        assert len(client.get_metric_history(child.info.run_id, "train_loss")) == 1
    assert artifacts(client, parent.info.run_id) == ["history.csv"]


# ---- where the URI comes from; what is refused ---------------------------------------------------------------


def test_uri_from_argument_config_then_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(None) is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking_uri(None) == "http://127.0.0.1:5999"
    with dask.config.set({"dask-dl.tracking.uri": "sqlite:///config.db"}):
        assert tracking_uri(None) == "sqlite:///config.db"
        assert tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
        assert tracking_uri(False) is None
    folder = tmp_path / "runs"
    assert tracking_uri(folder) == f"sqlite:///{folder}/mlflow.db"  # MLflow 3 writes no file store
    assert tracking_uri(f"file://{folder}") == f"sqlite:///{folder}/mlflow.db"
    assert folder.is_dir()


def test_bad_tracking_values_are_refused_before_training(store, tmp_path, monkeypatch):
    ds = dask_dl.open_dataset(store)
    with pytest.raises(ConfigurationError, match=r"tracking must be an MLflow tracking URI.*got int 5000"):
        dask_dl.fit(ds, tracking=5000, **OPTIONS)
    with pytest.raises(ConfigurationError, match=r"register='cxr'.*was not tracked.*fit\(\.\.\., tracking="):
        dask_dl.export_onnx({}, tmp_path / "m.onnx", register="cxr")
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if mlflow were not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'dask-dl\[tracking\]'"):
        dask_dl.fit(ds, tracking="sqlite:///runs.db", **OPTIONS)


def test_params_flatten_option_groups_generically():
    @dataclasses.dataclass(frozen=True)
    class Optimisation:
        lr: float = 0.1
        schedule: dict = dataclasses.field(default_factory=lambda: {"name": "cosine", "warmup": 5})

    @dataclasses.dataclass(frozen=True)
    class Options:
        optimisation: Optimisation = dataclasses.field(default_factory=Optimisation)
        train_samples: np.ndarray = dataclasses.field(default_factory=lambda: np.arange(7))
        loss: object = np.mean
        labels: tuple = ("a", "b")
        options: dict = dataclasses.field(default_factory=dict)

    assert _params(Options()) == {
        "optimisation.lr": 0.1,
        "optimisation.schedule.name": "cosine",
        "optimisation.schedule.warmup": 5,
        "train_samples": 7,
        "loss": "numpy:mean",
        "labels": ("a", "b"),
        "options": {},
    }


@pytest.mark.slow
def test_cli_train_tracking(store, cluster_client, tmp_path):
    from click.testing import CliRunner

    from dask_dl.cli import cli

    folder = tmp_path / "runs"
    args = ["train", store, "-m", "small_cnn", "-e", "1", "-b", "8", "-q", "--tracking", str(folder)]
    result = CliRunner().invoke(cli, [*args, "--scheduler", cluster_client.scheduler.address])
    assert result.exit_code == 0, result.output
    uri = f"sqlite:///{folder}/mlflow.db"
    client = client_for(uri)
    (logged,) = client.search_runs([client.get_experiment_by_name("dask-dl").experiment_id])
    assert f"MLflow run {logged.info.run_id} at {uri}" in result.output
    assert logged.info.status == "FINISHED" and logged.data.params["epochs"] == "1"
    assert len(client.get_metric_history(logged.info.run_id, "val_auroc_mean")) == 1


@pytest.mark.slow
def test_a_relative_sqlite_database_keeps_its_artifacts_beside_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tracker = open_tracker("sqlite:///runs.db", run_name="here")
    tracker.log_text("hello", "notes/hello.txt")
    tracker.finish("stopped")
    client = client_for(f"sqlite:///{tmp_path / 'runs.db'}")
    assert client.get_experiment_by_name("dask-dl").artifact_location == f"file://{tmp_path / 'mlartifacts'}"
    assert client.get_run(tracker.run_id).info.status == "KILLED"
    assert (tmp_path / "mlartifacts" / tracker.run_id / "artifacts" / "notes" / "hello.txt").read_text() == "hello"


def test_a_new_sqlite_store_gets_its_tables_without_mlflows_info_lines(tmp_path, request):
    """MLflow says at INFO that it creates a new store's tables ('Creating initial MLflow database tables...'):
    two log lines at the top of a first `dask-dl train --tracking FOLDER` that tell the user nothing."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("mlflow").addHandler(handler)
    request.addfinalizer(lambda: logging.getLogger("mlflow").removeHandler(handler))
    tracker = open_tracker(tmp_path / "runs", run_name="first")
    tracker.finish("finished")
    client = client_for(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    assert client.get_run(tracker.run_id).info.status == "FINISHED"  # the tables were made
    assert [r.getMessage() for r in records if r.name == "mlflow.store.db.utils" and r.levelno < logging.WARNING] == []
