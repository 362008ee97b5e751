"""One cluster per site: a coordinator holds a client per site's LocalCluster and only weights and metrics cross.

Each site's store is ingested by that site's own cluster; the coordinator never opens it. What the coordinator
received is counted per site and kind (``run.transfers``). A site whose cluster is closed mid-run is reported in
the history, and the protocol goes on without it (cyclic skips it; fedavg averages the sites that answered) or
stops, as configured.
"""

from __future__ import annotations

import threading
import time

import pytest
from distributed import Client, LocalCluster

import dask_dl
from dask_dl import TrainingError
from dask_dl.sites.weights import state_nbytes
from dask_dl.testing.train import squares_collection

# A cluster per site, started and stopped per test: for the full run only.
pytestmark = pytest.mark.slow

OPTIONS = dict(model="small_cnn", model_kwargs={"width": 8}, batch_size=8, lr=0.05, optimizer="sgd", seed=0)


def _site_cluster() -> LocalCluster:
    return LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0")


def _site_store(tmp_path, name: str, cluster: LocalCluster, seed: int) -> str:
    root = tmp_path / name
    store = str(root / "site.zarr")
    with Client(cluster) as client:  # the site ingests its own images
        dask_dl.ingest(
            squares_collection(root, n_train=48, n_val=24, seed=seed),
            store,
            size=32,
            chunk=8,
            shard=2,
            client=client,
            progress=False,
        )
    return store


@pytest.fixture(scope="module")
def two_sites(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sites")
    with _site_cluster() as a, _site_cluster() as b:
        yield {"A": (a, _site_store(tmp, "A", a, 1)), "B": (b, _site_store(tmp, "B", b, 2))}


def _sites(two_sites):
    return {name: {"cluster": cluster, "store": store} for name, (cluster, store) in two_sites.items()}


def test_only_weights_and_metrics_cross(two_sites):
    run = dask_dl.fit_sites(_sites(two_sites), protocol="cyclic", rounds=2, **OPTIONS)
    assert run.status == "finished"
    received = run.transfers
    # per site: its manifest once, one state dict per visit, metrics of every visit and every evaluation
    assert set(received["kind"]) == {"manifest", "weights", "metrics"}, received
    weights = received[received["kind"] == "weights"].set_index("site")
    assert list(weights["objects"]) == [2, 2]  # two rounds, one visit per site each
    state_bytes = state_nbytes(run.state())
    assert list(weights["bytes"]) == [2 * state_bytes, 2 * state_bytes]
    manifests = received[received["kind"] == "manifest"]
    assert list(manifests["objects"]) == [1, 1]
    # a manifest is sample numbers and splits: far smaller than the 72 images of 32 x 32 px a site holds
    assert manifests["bytes"].max() < 72 * 32 * 32 / 4
    h = run.history
    assert list(h["round"]) == [0, 0, 1, 1] and list(h["site"]) == ["A", "B", "A", "B"]
    assert (h["event"] == "").all() and h["auroc_mean"].notna().all() and (h["n"] == 24).all()


def test_a_site_that_goes_away_is_reported_and_skipped(tmp_path, two_sites):
    with _site_cluster() as c:
        sites = {**_sites(two_sites), "C": {"cluster": c, "store": _site_store(tmp_path, "C", c, 3)}}
        run = dask_dl.fit_sites(sites, protocol="fedavg", rounds=2, min_sites=2, wait=False, **OPTIONS)
        _close_after_round(run, c, 0)
        run.wait(timeout=300)
    h = run.history
    assert run.status == "finished"
    lost = h[h["event"] == "lost"]
    assert set(lost["site"]) == {"C"} and set(lost["round"]) == {1}, h[["round", "site", "event", "error"]]
    assert (h[(h["site"] != "C")]["auroc_mean"].notna()).all()


def test_a_lost_site_can_stop_the_run(tmp_path, two_sites):
    with _site_cluster() as c:
        sites = {**_sites(two_sites), "C": {"cluster": c, "store": _site_store(tmp_path, "C", c, 3)}}
        run = dask_dl.fit_sites(sites, protocol="cyclic", rounds=3, on_lost="stop", wait=False, **OPTIONS)
        _close_after_round(run, c, 0)
        run.wait(timeout=300)
    assert run.status == "stopped-sites-lost"
    h = run.history
    assert h["round"].max() == 1 and set(h[h["event"] == "lost"]["site"]) == {"C"}


def test_too_few_sites_fail_a_fedavg_round(tmp_path, two_sites):
    with _site_cluster() as c:
        sites = {"A": _sites(two_sites)["A"], "C": {"cluster": c, "store": _site_store(tmp_path, "C", c, 3)}}
        run = dask_dl.fit_sites(sites, protocol="fedavg", rounds=2, min_sites=2, wait=False, **OPTIONS)
        _close_after_round(run, c, 0)
        with pytest.raises(TrainingError, match=r"only 1 of 2 sites answered, fewer than min_sites=2"):
            run.wait(timeout=300)
    assert run.state() is not None  # the last averaged weights stay


def _close_after_round(run, cluster: LocalCluster, round_: int) -> None:
    """Close ``cluster`` (a site going away) once ``round_`` is in the run's history."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not run.done:
        h = run.history
        if len(h) and h["round"].max() >= round_:
            break
        time.sleep(0.1)
    threading.Thread(target=cluster.close, daemon=True).start()


def test_a_site_scheduler_that_cannot_be_reached_is_named(two_sites):
    import socket

    import dask.config

    from dask_dl import ClusterError

    (a, store_a), (_, store_b) = two_sites["A"], two_sites["B"]
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        nothing = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    sites = {"A": {"scheduler": a.scheduler_address, "store": store_a}, "B": {"scheduler": nothing, "store": store_b}}
    said = rf"^site 'B': cannot connect to the scheduler at {nothing} \(OSError: .*\): check that the scheduler runs"
    with dask.config.set({"distributed.comm.timeouts.connect": "2s"}), pytest.raises(ClusterError, match=said):
        dask_dl.fit_sites(sites, protocol="fedavg", rounds=1, **OPTIONS)
