"""``dask-dl xsite PLAN``: a YAML plan of sites and protocol, run on a local cluster the command starts."""

from __future__ import annotations

import onnx
import pytest
from click.testing import CliRunner

import dask_dl
from dask_dl.cli import cli
from dask_dl.testing.interrupt import ctrl_c_in_a_finalizer
from dask_dl.testing.train import squares_collection


def _plan(tmp_path, body: str):
    path = tmp_path / "plan.yaml"
    path.write_text(body)
    return path


@pytest.fixture(scope="module")
def two_sites(tmp_path_factory):
    """A folder with two sites' stores, a.zarr and b.zarr, and plan.yaml naming them (cyclic, 1 round)."""
    from distributed import Client, LocalCluster

    folder = tmp_path_factory.mktemp("xsite")
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        for i, name in enumerate(("a", "b")):
            catalog = squares_collection(folder / name, n_train=32, n_val=16, seed=i)
            dask_dl.ingest(catalog, folder / f"{name}.zarr", size=32, chunk=8, shard=2, progress=False, client=client)
    _plan(
        folder,
        "protocol: cyclic\nrounds: 1\nmodel: small_cnn\noptions: {batch_size: 8, lr: 0.05, model_kwargs: {width: 8}}\n"
        "sites:\n  A: {store: a.zarr}\n  B: {store: b.zarr}\n",
    )
    return folder


@pytest.mark.slow
def test_xsite_runs_a_plan(two_sites, tmp_path):
    plan = two_sites / "plan.yaml"
    out = tmp_path / "model.onnx"
    result = CliRunner().invoke(
        cli,
        [
            "xsite",
            str(plan),
            "--protocol",
            "fedavg",
            "--rounds",
            "2",
            "--workers",
            "2",
            "--export",
            str(out),
            "--history",
            str(tmp_path / "h.csv"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "round 0: A=" in result.output and "round 1: A=" in result.output
    assert "fedavg: finished" in result.output and f"wrote {out} (the model of round 1)" in result.output
    assert "received by the coordinator:" in result.output and "weights" in result.output
    assert (tmp_path / "h.csv").read_text().count("\n") == 5  # header and 2 rounds x 2 sites


@pytest.mark.slow
def test_ctrl_c_stops_the_sites_prints_the_rounds_done_and_exits_130(two_sites, tmp_path):
    # pressed inside a finalizer of the follow loop, where Python's own handler would lose it (dask_dl.interrupt)
    out = tmp_path / "model.onnx"
    args = ["xsite", str(two_sites / "plan.yaml"), "--rounds", "500", "--workers", "2", "--export", str(out)]
    with ctrl_c_in_a_finalizer("_echo_rounds", when=lambda frame: frame.f_locals["shown"] > 0, within=120):
        result = CliRunner().invoke(cli, args)  # pressed once a round was printed
    assert result.exit_code == 130, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("round 0: A=")
    assert "stopping the sites' trainers within a few steps ..." in lines
    assert [line for line in lines if line.endswith(" cyclic: stopped")]
    assert "received by the coordinator:" in lines
    last = lines[lines.index("received by the coordinator:") - 1].split()[0]  # the curves' last round
    assert lines[-1] == f"wrote {out} (the model of round {last})"  # the model of the rounds that finished
    assert onnx.load(out).graph.input


@pytest.mark.slow
def test_ctrl_c_before_a_round_finished_exports_nothing_and_says_so(two_sites, tmp_path):
    plan = two_sites / "plan.yaml"
    slow = tmp_path / "slow.yaml"  # rounds of 200 epochs per visit: the first print comes long before one ends
    text = plan.read_text().replace("options: {", "options: {local_epochs: 200, ")
    slow.write_text(text.replace("store: ", f"store: {two_sites}/"))  # the stores stay where the plan is
    out = tmp_path / "model.onnx"
    with ctrl_c_in_a_finalizer("_echo_rounds", within=120):
        result = CliRunner().invoke(cli, ["xsite", str(slow), "--workers", "2", "--export", str(out)])
    assert result.exit_code == 130, result.output
    lines = result.output.splitlines()
    assert lines[0] == "stopping the sites' trainers within a few steps ..."
    assert [line for line in lines if line.endswith(" cyclic: stopped")]
    assert lines[-1].startswith(f"nothing exported to {out}: sites-")
    assert lines[-1].endswith("has no weights yet: no round has completed (stopped)")
    assert not out.exists()


def test_xsite_explains_a_bad_plan(tmp_path):
    result = CliRunner().invoke(cli, ["xsite", str(_plan(tmp_path, "protocol: cyclic\nrounds: 1\nsite: {}\n"))])
    assert result.exit_code == 1
    assert "unknown keys ['site']" in result.output
    result = CliRunner().invoke(cli, ["xsite", str(_plan(tmp_path, "rounds: 1\nsites: {A: {store: x.zarr}}\n"))])
    assert result.exit_code == 2 and "has no protocol" in result.output
