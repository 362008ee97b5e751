"""find_lr: the learning-rate range test on one trainer of a real LocalCluster, its suggestion, curve and CLI."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

import dask_dl
from dask_dl.cli import cli
from dask_dl.errors import ConfigurationError, DatasetError
from dask_dl.testing.train import squares_collection
from dask_dl.train.lr_find import LRFinder, suggest

OPTIONS = {"model": "small_cnn", "model_kwargs": {"width": 8}, "batch_size": 16, "optimizer": "sgd"}


@pytest.fixture(scope="module")
def store(tmp_path_factory, cluster_client) -> str:
    root = tmp_path_factory.mktemp("squares")
    path = str(root / "squares.zarr")
    catalog = squares_collection(root, n_train=128, n_val=32)
    dask_dl.ingest(catalog, path, size=32, chunk=8, shard=2, client=cluster_client, progress=False)
    return path


@pytest.fixture(scope="module")
def finder(store, cluster_client) -> LRFinder:
    ds = dask_dl.open_dataset(store)
    return dask_dl.find_lr(ds, start_lr=1e-4, end_lr=100.0, steps=60, client=cluster_client, **OPTIONS)


@pytest.mark.slow
def test_the_suggestion_lies_where_the_loss_falls(finder):
    results = finder.results
    assert list(results.columns) == ["lr", "loss", "smoothed_loss"]
    lrs = results["lr"].to_numpy()
    # the exponential ramp: the same factor every step, from start_lr on
    assert lrs[0] == pytest.approx(1e-4) and np.allclose(lrs[1:] / lrs[:-1], (100.0 / 1e-4) ** (1 / 59))
    # SGD at lr 100 diverges: the test stops once the smoothed loss passes 4 times its lowest, before the ramp ends
    smoothed = results["smoothed_loss"].to_numpy()
    assert finder.stopped == "diverged" and len(results) < 60 and smoothed[-1] > 4 * smoothed.min()
    lowest = int(smoothed.argmin())
    assert smoothed[lowest] < 0.9 * smoothed[10], smoothed  # the loss fell on the way
    at = int(np.flatnonzero(lrs == finder.suggestion)[0])
    # the steepest descent: after the skipped start, before the lowest loss, where the smoothed loss falls
    assert 10 <= at < lowest and np.gradient(smoothed[10:-1])[at - 10] < 0
    assert finder.suggestion == suggest(smoothed, lrs)
    assert repr(finder).startswith(f"LRFinder(suggestion={finder.suggestion:.3g}, steps={len(results)}")


def test_suggest_takes_the_steepest_descent_after_the_start():
    lrs = np.geomspace(1e-5, 1.0, 40)
    # flat, a steep fall at step 20, a gentle one, then up; a steeper drop inside the skipped start is ignored
    smoothed = np.r_[[1.0, 0.2], np.ones(18), [0.5], np.linspace(0.45, 0.3, 10), np.linspace(0.4, 3.0, 9)]
    assert suggest(smoothed, lrs) == lrs[20]
    assert suggest(smoothed, lrs, skip_start=0) == lrs[0]
    assert suggest(smoothed[:13], lrs) is None  # too few points after the skipped start


def test_plot_marks_the_suggestion(finder):
    fig = finder.plot()
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "learning rate"
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["batch loss", "smoothed", f"suggestion {finder.suggestion:.2g}"]
    assert ax.get_lines()[2].get_xdata()[0] == finder.suggestion


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start_lr": 1.0, "end_lr": 0.1}, r"start_lr=1.0 must be below end_lr=0.1: the ramp rises"),
        ({"start_lr": 0}, r"start_lr must be a positive number, got 0"),
        ({"steps": 12}, r"steps=12 leaves fewer than 3 steps after skip_start=10 .* pass steps >= 13"),
        ({"smoothing": 1.0}, r"smoothing must be in \[0, 1\), got 1.0"),
        ({"skip_start": "10"}, r"skip_start must be an integer >= 0, got '10'"),
        ({"stop_factor": 1}, r"stop_factor must be a number above 1 or None, got 1"),
        ({"lr": 0.1}, r"find_lr takes no lr: the ramp sets it; pass start_lr= and end_lr="),
        ({"epochs": 3}, r"find_lr does not take epochs=: the range test trains one trainer"),
        ({"batchsize": 8}, r"unknown option batchsize=8; did you mean batch_size=\?"),
        ({"optimizer": "adam"}, r"unknown optimizer 'adam': use one of sgd, adamw"),
    ],
)
def test_bad_input_is_named_before_any_work(store, kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        dask_dl.find_lr(dask_dl.open_dataset(store), client="never used", **kwargs)


def test_a_batch_larger_than_the_data_is_a_dataset_error(store):
    with pytest.raises(DatasetError, match="batch"):
        dask_dl.find_lr(dask_dl.open_dataset(store), batch_size=1000, client="never used")


@pytest.mark.slow
def test_cli_lr_find_trains_with_the_suggestion(store, cluster_client):
    args = [
        "train",
        store,
        "--lr",
        "find",
        "-m",
        "small_cnn",
        "-e",
        "1",
        "-b",
        "16",
        "-t",
        "1",
        "-q",
        "--scheduler",
        cluster_client.scheduler.address,
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("learning-rate range test:"))
    suggested = float(line.split("suggested lr ")[1].split()[0])
    assert 1e-7 < suggested < 10
    assert ": finished" in result.output
    bad = CliRunner().invoke(cli, ["train", store, "--lr", "fast"])
    assert bad.exit_code == 2 and "'fast' is neither a number nor 'find'; e.g. --lr 0.001 or --lr find" in bad.output
