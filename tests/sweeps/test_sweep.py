"""dask_dl.sweep end to end on a real LocalCluster (2 worker processes x 1 thread: 2 trials at a time).

The collection is the training tests' tiny learnable one (32 px, 96 images): a good learning rate reaches a
validation AUROC near 1 within an epoch, a tiny one stays where it started, so a pruner has losers to stop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import optuna
import pandas as pd
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

import dask_dl
from dask_dl import ConfigurationError
from dask_dl.testing.train import squares_collection

SIZE = 32
FIXED = dict(model="small_cnn", model_kwargs={"width": 8}, batch_size=8, optimizer="sgd", seed=0)
#: three learning rates that learn and three that barely move (in the 256 steps of an epoch of the ASHA test's
#: collection), in a grid (each tried once)
LRS = [1e-6, 3e-6, 1e-5, 0.05, 0.1, 0.2]


@pytest.fixture(scope="module")
def store(tmp_path_factory, cluster_client) -> str:
    root = tmp_path_factory.mktemp("squares")
    path = str(root / "squares.zarr")
    dask_dl.ingest(squares_collection(root), path, size=SIZE, chunk=8, shard=2, client=cluster_client, progress=False)
    return path


@pytest.fixture(scope="module")
def long_store(tmp_path_factory, cluster_client) -> str:
    """A store whose epochs outlast a message from the sweep to a running trial (batches of 2).

    A pruning verdict or a stop reaches a trial a poll of the driver, a poll of the sweep, an Optuna storage write
    and a stop request after the trial published its epoch: about half a second. The usual 64 training images in
    batches of 2 train an epoch in 0.1 s, and trials ended before the message arrived; 512 images make 256 steps,
    about 0.6 s an epoch here.
    """
    root = tmp_path_factory.mktemp("long")
    path = str(root / "squares.zarr")
    catalog = squares_collection(root, n_train=512, n_val=32)
    dask_dl.ingest(catalog, path, size=SIZE, chunk=32, shard=2, client=cluster_client, progress=False)
    return path


@pytest.mark.slow
def test_asha_prunes_losers_keeps_every_trial_and_the_best_exports(long_store, cluster_client, tmp_path):
    store = long_store
    epochs = 4  # ASHA's rungs are at epochs 1 and 3
    result = dask_dl.sweep(
        dask_dl.open_dataset(store),
        {"lr": CategoricalDistribution(LRS)},
        trials=len(LRS),
        sampler="grid",
        pruner="asha",
        epochs=epochs,
        client=cluster_client,
        storage=tmp_path / "sweep.db",
        **{**FIXED, "batch_size": 2},
    )
    results = result.results
    print(results[["number", "state", "params_lr", "best", "epochs", "seconds"]])
    assert sorted(results["number"]) == list(range(len(LRS)))
    assert sorted(results["params_lr"]) == LRS  # the grid: every learning rate once
    assert set(results["state"]) <= {"complete", "pruned"}
    assert (results["state"] == "pruned").any()
    assert results["epochs"].sum() < len(LRS) * epochs  # pruned trials stopped early
    pruned = results[results["state"] == "pruned"]
    assert (pruned["epochs"] < epochs).all()
    assert all(len(c) == e for c, e in zip(results["val_auroc_mean"], results["epochs"], strict=True))
    best = result.best
    assert best.metric > results["best"].median()
    assert best.params["lr"] >= 0.05
    assert best.metric == results.set_index("number").loc[best.number, "best"]
    assert Path(best.checkpoint).parent == tmp_path / "sweep.db-trials" / f"trial-{best.number:04d}"
    study = optuna.load_study(study_name="dask-dl-sweep", storage=f"sqlite:///{tmp_path / 'sweep.db'}")
    assert len(study.trials) == len(LRS)
    assert study.best_trial.number == best.number
    onnx_path = dask_dl.export_onnx(best, tmp_path / "best.onnx")
    assert dask_dl.read_model_info(onnx_path).labels == ("a", "b")
    assert "<img" in result._repr_html_() and "pruned" in result._repr_html_()
    assert len(result.plot().axes[0].lines) >= len(LRS)
    _check_sweeps_page(result, results)


def _check_sweeps_page(result, results) -> None:
    """The dashboard's sweeps page holds the sweep as ``results`` does, and a browser draws it."""
    from urllib.parse import urlparse

    from dask_dl.testing.browser import Browser, find_chromium

    page = result.dashboard_link.replace(urlparse(result.dashboard_link).hostname, "127.0.0.1", 1)
    assert page.endswith("/dask-dl-sweeps")
    deadline = time.monotonic() + 30
    while True:  # the last event travels on a batched stream
        with urllib.request.urlopen(page.replace("-sweeps", "/sweeps.json"), timeout=30) as response:
            shown = json.loads(response.read()).get(result.sweep_id)
        if (shown and shown["status"] == "done") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert shown["status"] == "done" and shown["best_trial"] == result.best.number
    assert shown["metric"] == "val_auroc_mean" and shown["direction"] == "maximize"
    trials = {t["number"]: t for t in shown["trials"]}
    for row in results.to_dict("records"):
        trial = trials[row["number"]]
        assert (trial["state"], trial["params"], trial["epochs"]) == (row["state"], row["params"], row["epochs"])
        assert trial["curve"] == row["val_auroc_mean"] and trial["run_id"].startswith("fit-")
    chromium = find_chromium()
    if chromium is not None:
        with Browser() as browser:
            text = browser.open(page).wait_for(f"text.includes('{result.sweep_id}\\ndone')")
        lines = set(text.splitlines())
        assert {"val_auroc_mean per trial", "epochs trained", *(f"#{n}" for n in trials)} <= lines


def test_a_trial_whose_fit_fails_is_recorded_failed_and_the_others_complete(store, cluster_client):
    result = dask_dl.sweep(
        dask_dl.open_dataset(store),
        {"batch_size": CategoricalDistribution([8, 500])},
        trials=2,
        sampler="grid",
        pruner="none",
        epochs=1,
        lr=0.1,
        model="small_cnn",
        model_kwargs={"width": 8},
        client=cluster_client,
    )
    results = result.results.set_index("params_batch_size")
    print(results[["state", "error"]])
    assert results.loc[500, "state"] == "failed"
    assert "DatasetError" in results.loc[500, "error"] and "500" in results.loc[500, "error"]
    assert results.loc[8, "state"] == "complete" and pd.isna(results.loc[8, "error"])
    assert result.best.params == {"batch_size": 8}


def test_define_by_run_space(store, cluster_client):
    def space(trial):
        optimizer = trial.suggest_categorical("optimizer", ["sgd", "adamw"])
        high = 0.3 if optimizer == "sgd" else 0.01
        return {"optimizer": optimizer, "lr": trial.suggest_float("lr", high / 10, high, log=True)}

    result = dask_dl.sweep(
        dask_dl.open_dataset(store),
        space,
        trials=2,
        sampler="random",
        pruner="none",
        epochs=1,
        client=cluster_client,
        **FIXED,
    )
    results = result.results
    assert list(results["state"]) == ["complete", "complete"]
    for params in results["params"]:
        assert params["lr"] <= (0.3 if params["optimizer"] == "sgd" else 0.01)


@pytest.mark.slow
def test_a_tracked_sweep_is_a_parent_run_with_a_nested_run_per_trial(store, cluster_client, tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    result = dask_dl.sweep(
        dask_dl.open_dataset(store),
        {"lr": CategoricalDistribution([0.05, 0.1])},
        trials=2,
        sampler="grid",
        pruner="none",
        epochs=2,
        tracking=uri,
        client=cluster_client,
        **FIXED,
    )
    mlflow = MlflowClient(uri)
    (experiment,) = [e for e in mlflow.search_experiments() if e.name == "dask-dl"]
    runs = mlflow.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("dask_dl.kind") == "sweep"]
    assert parent.info.status == "FINISHED" and parent.info.run_name == f"sweep {result.study.study_name}"
    assert parent.data.params["trials"] == "2" and parent.data.params["metric"] == "val_auroc_mean"
    assert parent.data.metrics["best_val_auroc_mean"] == pytest.approx(result.best.metric)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(c.info.run_name for c in children) == ["trial 0", "trial 1"]
    for child in children:
        number = int(child.data.tags["optuna.trial"])
        lr = result.results.set_index("number").loc[number, "params_lr"]
        assert child.info.status == "FINISHED" and child.data.params["lr"] == str(lr)
        assert len(mlflow.get_metric_history(child.info.run_id, "val_auroc_mean")) == 2
    table = mlflow.download_artifacts(parent.info.run_id, "trials.csv", str(tmp_path))
    assert sorted(pd.read_csv(table)["number"]) == [0, 1]


@pytest.mark.slow
def test_a_trial_whose_worker_is_killed_goes_on_from_its_checkpoint(store, tmp_path):
    """The trial's run is pinned to its worker, which its nanny restarts at a new address: the sweep moves the trial
    to a group with the new worker (or the other trial's, once free), from its newest epoch checkpoint."""
    import dask
    from distributed import Client, LocalCluster

    epochs = 3
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
        dask.config.set({"dask-dl.train.restart-wait": 2}),
    ):
        result = dask_dl.sweep(
            dask_dl.open_dataset(store),
            {"lr": CategoricalDistribution([0.05, 0.1])},
            trials=2,
            sampler="grid",
            pruner="none",
            epochs=epochs,
            batch_size=2,
            checkpoint_dir=str(tmp_path),
            client=client,
            wait=False,
            **{k: v for k, v in FIXED.items() if k != "batch_size"},
        )
        first = tmp_path / "trial-0000" / "epoch-0000.pt"
        deadline = time.monotonic() + 240
        while not first.exists():
            assert time.monotonic() < deadline and not result.done, "trial 0 wrote no epoch checkpoint"
            time.sleep(0.05)
        written = first.stat().st_mtime_ns
        victim = result._scheduler.records[0].group[0]
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        result.wait()
        results = result.results.set_index("number")
        print(results[["state", "epochs", "error"]])
        assert list(results["state"]) == ["complete", "complete"]
        assert len(result.study.trials) == 2  # the same trial went on, no new one
        assert sorted(result.study.trials[0].intermediate_values) == [1, 2, 3]
        assert first.stat().st_mtime_ns == written  # went on from its checkpoint, not from the start
        assert victim not in result._scheduler.records[0].group and result._scheduler.records[0].moves == 1


# ---- bad input: one error each, before any trial --------------------------------------------------------------


def trainer_keys(client) -> set[str]:
    keys = client.run_on_scheduler(lambda dask_scheduler: [str(k) for k in dask_scheduler.tasks])
    return {k for k in keys if "trainer" in k}


def _other_study(path: Path) -> None:
    study = optuna.create_study(study_name="someone-else", storage=f"sqlite:///{path}")
    study.enqueue_trial({"x": 1})


@pytest.mark.parametrize(
    ("space", "kwargs", "says"),
    [
        ({"lrr": FloatDistribution(1e-3, 0.1)}, {}, ["'lrr'", "did you mean 'lr'"]),
        ({}, {}, ["space is empty"]),
        ({"model": FloatDistribution(1, 3)}, {}, ["'model'", "takes no number", "CategoricalDistribution"]),
        ({"compression": IntDistribution(0, 3)}, {}, ["'compression'", "takes no number"]),
        ({"epochs": FloatDistribution(1, 3)}, {}, ["'epochs'", "takes no float", "IntDistribution"]),
        ({"workers": CategoricalDistribution([1])}, {}, ["'workers'", "trial its own group"]),
        ({"lr": FloatDistribution(1e-3, 0.1)}, {"trials": 0}, ["trials must be a positive integer, got 0"]),
        ({"lr": FloatDistribution(1e-3, 0.1)}, {"metric": "val_auroc_c"}, ["'val_auroc_c'", "val_auroc_a"]),
        ({"lr": FloatDistribution(1e-3, 0.1)}, {"metric": "val_aucroc_mean"}, ["did you mean 'val_auroc_mean'"]),
        ({"lr": FloatDistribution(1e-3, 0.1)}, {"pruner": "ashe"}, ["unknown pruner 'ashe'", "'asha'"]),
        ({"lr": FloatDistribution(1e-3, 0.1)}, {"sampler": "grid"}, ["sampler='grid'", "'lr'"]),
        ({"lr": FloatDistribution(1e-3, 0.1)}, {"storage": "other"}, ["holds another study", "someone-else"]),
    ],
)
def test_bad_input_is_one_error_before_any_trial(store, cluster_client, tmp_path, space, kwargs, says):
    storage = tmp_path / "sweep.db"
    if kwargs.pop("storage", None) == "other":
        _other_study(storage)
    kwargs = {"trials": 2, "storage": storage, **kwargs}
    before = trainer_keys(cluster_client)
    with pytest.raises(ConfigurationError) as info:
        dask_dl.sweep(dask_dl.open_dataset(store), space, epochs=1, client=cluster_client, **FIXED, **kwargs)
    message = str(info.value)
    print(message)
    for part in says:
        assert part in message
    names = [s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{storage}")] if storage.exists() else []
    assert "dask-dl-sweep" not in names  # no study was made, so no trial either
    assert trainer_keys(cluster_client) <= before  # and no trainer started


@pytest.mark.slow
def test_a_storage_that_holds_this_sweep_needs_resume(store, cluster_client, tmp_path):
    storage = tmp_path / "sweep.db"
    space = {"lr": CategoricalDistribution([0.1])}
    dask_dl.sweep(
        dask_dl.open_dataset(store),
        space,
        trials=1,
        epochs=1,
        storage=storage,
        client=cluster_client,
        pruner="none",
        **FIXED,
    )
    with pytest.raises(ConfigurationError, match="holds this sweep already .1 trials.; pass resume=True"):
        dask_dl.sweep(
            dask_dl.open_dataset(store), space, trials=2, epochs=1, storage=storage, client=cluster_client, **FIXED
        )
    with pytest.raises(ConfigurationError, match="holds another sweep .metric: stored 'val_auroc_mean', asked"):
        dask_dl.sweep(
            dask_dl.open_dataset(store),
            space,
            trials=2,
            epochs=1,
            storage=storage,
            client=cluster_client,
            metric="val_loss",
            direction="minimize",
            resume=True,
            **FIXED,
        )


# ---- resume after the client was killed ----------------------------------------------------------------------

SCRIPT = """
import dask_dl
from distributed import Client, LocalCluster
from optuna.distributions import CategoricalDistribution

if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \\
            Client(cluster) as client:
        dask_dl.sweep(dask_dl.open_dataset({store!r}), {{"lr": CategoricalDistribution([0.05, 0.1, 0.2, 0.15])}},
                      trials=4, sampler="grid", pruner="none", epochs={epochs}, storage={storage!r}, client=client,
                      model="small_cnn", model_kwargs={{"width": 8}}, batch_size=2, optimizer="sgd", seed=0)
"""  # batches of 2: epochs of 256 steps, so that the watcher below sees a trial between its epochs


def _states(storage: Path) -> dict[tuple[int, int], str]:
    """``{(trial number, values reported): state}`` read from the SQLite file, read-only.

    Not ``optuna.load_study``: on a file whose tables the sweep is still making, it makes them too, and one of the
    two processes fails.
    """
    import sqlite3

    if not storage.exists():
        return {}
    try:
        with contextlib.closing(sqlite3.connect(f"file:{storage}?mode=ro", uri=True)) as db:
            rows = db.execute(
                "SELECT number, state, (SELECT COUNT(*) FROM trial_intermediate_values v WHERE v.trial_id = "
                "t.trial_id) FROM trials t"
            ).fetchall()
    except sqlite3.OperationalError:  # no tables yet, or the file is being written
        return {}
    return {(number, reported): state for number, state, reported in rows}


def _epoch_files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob("epoch-*.pt"))}


@pytest.mark.slow
def test_resume_after_sigkill_trains_no_complete_trial_again(long_store, cluster_client, tmp_path):
    store = long_store  # epochs long enough for the watcher below to see a trial between two of them
    epochs, storage = 2, tmp_path / "sweep.db"
    script = tmp_path / "run_sweep.py"
    script.write_text(textwrap.dedent(SCRIPT.format(store=store, epochs=epochs, storage=str(storage))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True)
    url = f"sqlite:///{storage}"
    deadline = time.monotonic() + 240
    try:
        while True:  # until one trial is complete and another has a checkpoint
            assert proc.poll() is None, "the sweep ended before it could be killed"
            assert time.monotonic() < deadline, "the sweep made no progress"
            time.sleep(0.1)
            states = _states(storage)
            if "COMPLETE" in states.values() and any(s == "RUNNING" and n for (_, n), s in states.items()):
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed = {t.number: t for t in optuna.load_study(study_name="dask-dl-sweep", storage=url).trials}
    folders = {n: Path(t.user_attrs["checkpoint_dir"]) for n, t in killed.items()}
    files = {n: _epoch_files(f) for n, f in folders.items()}
    print({n: (t.state.name, sorted(t.intermediate_values)) for n, t in killed.items()}, files)

    result = dask_dl.sweep(
        dask_dl.open_dataset(store),
        {"lr": CategoricalDistribution([0.05, 0.1, 0.2, 0.15])},
        trials=4,
        sampler="grid",
        pruner="none",
        epochs=epochs,
        storage=storage,
        resume=True,
        client=cluster_client,
        **FIXED,
    )
    after = {t.number: t for t in result.study.trials}
    assert len(after) == 4  # exactly the trials asked for
    assert sorted(t.params["lr"] for t in after.values()) == [0.05, 0.1, 0.15, 0.2]
    assert all(t.state.name == "COMPLETE" for t in after.values())
    for n, t in killed.items():
        if t.state.name == "COMPLETE":  # never trained again: same value, same completion, same files
            assert after[n].value == t.value and after[n].datetime_complete == t.datetime_complete
            assert _epoch_files(folders[n]) == files[n]
        elif t.state.name == "RUNNING":  # went on from its newest checkpoint: the epochs before it kept their files
            now = _epoch_files(folders[n])
            assert {k: now[k] for k in files[n]} == files[n]
            assert len(now) == epochs
            assert sorted(after[n].intermediate_values) == list(range(1, epochs + 1))
    assert math.isfinite(result.best.metric)


# ---- the command -----------------------------------------------------------------------------------------------


def test_space_from_yaml_maps_onto_optuna_distributions():
    import yaml

    from dask_dl.sweeps.space import space_from_yaml

    text = "lr: {low: 1e-4, high: 0.3, log: true}\nepochs: {low: 1, high: 5, step: 2}\nmodel: [small_cnn, resnet18]\n"
    assert space_from_yaml({"lr": ["1e-5", 0.1]})[0] == {"lr": CategoricalDistribution([1e-5, 0.1])}
    space, fixed = space_from_yaml(yaml.safe_load(text + "batch_size: 16\nhead_lr: 1e-3\n"))
    assert space == {
        "lr": FloatDistribution(1e-4, 0.3, log=True),
        "epochs": IntDistribution(1, 5, step=2),
        "model": CategoricalDistribution(["small_cnn", "resnet18"]),
    }
    assert fixed == {"batch_size": 16, "head_lr": 1e-3}
    with pytest.raises(ConfigurationError, match="a range has low, high and optionally log and step, got"):
        space_from_yaml({"lr": {"low": 1e-4, "hi": 0.3}})
    assert space_from_yaml({"model_kwargs": {"width": 8}}) == ({}, {"model_kwargs": {"width": 8}})


def test_without_optuna_the_command_and_the_function_name_the_extra(tmp_path, monkeypatch):
    """The README's first install leaves the extras out: a sweep then says which extra to install, in one line,
    before it starts a cluster or opens the store (the command printed a ModuleNotFoundError traceback)."""
    from click.testing import CliRunner

    from dask_dl.cli import cli
    from dask_dl.errors import MissingDependencyError
    from dask_dl.sweeps.space import check_space

    space = tmp_path / "space.yaml"
    space.write_text("lr: {low: 0.001, high: 0.1, log: true}\nepochs: 2\n")
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna now raises ImportError
    result = CliRunner().invoke(cli, ["sweep", str(tmp_path / "absent.zarr"), "--space", str(space)])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (
        "error: dask-dl sweep --space needs the 'optuna' package, which is not installed; "
        "install it with: pip install 'dask-dl[sweep]'"
    )
    with pytest.raises(MissingDependencyError, match=r"^dask_dl.sweep needs the 'optuna' package.*\[sweep\]'$"):
        dask_dl.sweep(None, {"lr": [0.1]}, trials=1)
    with pytest.raises(MissingDependencyError, match=r"^a sweep's space needs the 'optuna' package.*\[sweep\]'$"):
        check_space({"lr": [0.1]})


@pytest.mark.slow
def test_sweep_command_end_to_end_and_resumed(store, cluster_client, tmp_path, request):
    from click.testing import CliRunner

    from dask_dl.cli import cli

    optuna_logger, optuna_records = logging.getLogger("optuna"), []
    handler = logging.Handler()
    handler.emit = optuna_records.append
    optuna_logger.addHandler(handler)
    request.addfinalizer(lambda: optuna_logger.removeHandler(handler))

    space = tmp_path / "space.yaml"
    space.write_text("lr: [0.1, 1e-5]\nepochs: 1\nbatch_size: 8\nmodel: small_cnn\nmodel_kwargs: {width: 8}\n")
    args = [
        "sweep",
        store,
        "--space",
        str(space),
        "--trials",
        "2",
        "--sampler",
        "grid",
        "--pruner",
        "none",
        "--storage",
        str(tmp_path / "sweep.db"),
        "--scheduler",
        cluster_client.scheduler.address,
    ]
    result = CliRunner().invoke(cli, args)
    print(result.output)
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert sorted(line.split(" after ")[0] for line in lines[:2]) == ["trial 0 complete", "trial 1 complete"]
    assert all(" after 1 epoch: " in line for line in lines[:2])
    # Optuna's own log lines ("A new study created ...") stay out of the command's output; its verbosity is back
    assert [r.getMessage() for r in optuna_records if r.levelno < logging.WARNING] == []
    assert optuna.logging.get_verbosity() == optuna.logging.INFO
    assert lines[-2].startswith("best: trial ") and "lr=0.1 " in lines[-2] + " "
    assert lines[-1] == f"checkpoint: {tmp_path}/sweep.db-trials/trial-{lines[-2].split()[2]}/epoch-0000.pt".replace(
        f"trial-{lines[-2].split()[2]}", f"trial-{int(lines[-2].split()[2]):04d}"
    )
    again = CliRunner().invoke(cli, [*args, "--resume"])  # nothing left to run: the same best, no trial trained
    assert again.exit_code == 0, again.output
    assert again.output.strip().splitlines()[-2:] == lines[-2:]
    refused = CliRunner().invoke(cli, args)
    assert refused.exit_code == 1 and "pass resume=True to continue it" in refused.output


@pytest.mark.slow
def test_stop_leaves_running_trials_for_resume(long_store, cluster_client, tmp_path):
    store = long_store
    storage = tmp_path / "sweep.db"
    space = {"lr": CategoricalDistribution([0.1, 0.2])}
    # the stop must reach the trials before their last epoch ends: small_cnn paced to 5 ms a step (the same
    # weights), 1.3 s more an epoch, so that it does on a machine busy with other tests too
    paced = {"model": "dask_dl.testing.train:paced_small_cnn", "model_kwargs": {"width": 8, "seconds": 0.005}}
    options = dict(
        trials=2,
        sampler="grid",
        pruner="none",
        epochs=3,
        storage=storage,
        client=cluster_client,
        **{**FIXED, "batch_size": 2, **paced},
    )
    running = dask_dl.sweep(dask_dl.open_dataset(store), space, wait=False, **options)
    deadline = time.monotonic() + 120
    while not any(len(c) for c in running.results["val_auroc_mean"]):  # an epoch is done and checkpointed
        assert time.monotonic() < deadline and not running.done
        time.sleep(0.2)
    running.stop().wait()
    stopped = running.results
    print(stopped[["number", "state", "epochs"]])
    assert set(stopped["state"]) <= {"stopped", "complete"} and "stopped" in set(stopped["state"])
    assert {
        t.state.name for t in running.study.trials if t.number in set(stopped.query("state == 'stopped'")["number"])
    } == {"RUNNING"}
    resumed = dask_dl.sweep(dask_dl.open_dataset(store), space, resume=True, **options)
    assert list(resumed.results["state"]) == ["complete", "complete"]
    assert list(resumed.results["epochs"]) == [3, 3]
