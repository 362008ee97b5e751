"""The dask_dl page on a real scheduler's dashboard server."""

import json
import time
import urllib.request
from urllib.parse import urlparse

from distributed import Client, LocalCluster

from dask_dl import dashboard


def _local(url: str) -> str:
    # the dashboard link names the machine's address; ask over loopback instead
    return url.replace(urlparse(url).hostname, "127.0.0.1", 1)


def _wait_for(url, ready, timeout=10):
    deadline = time.monotonic() + timeout
    while True:
        runs = json.loads(urllib.request.urlopen(url, timeout=timeout).read())
        if ready(runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.05)


def test_routes_serve_published_runs():
    with (
        LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
    ):
        page = _local(dashboard.install(client))
        dashboard.install(client)  # idempotent: a second fit registers again
        history = [{"epoch": 0, "train_loss": 0.7, "val_auroc_mean": 0.61}]
        dashboard.publish(client, "run-a", {"status": "running", "model": "small_cnn", "history": history})
        history = history + [{"epoch": 1, "train_loss": 0.5, "val_auroc_mean": float("nan")}]
        dashboard.publish(client, "run-a", {"status": "finished", "history": history})
        dashboard.publish(client, "run-b", {"status": "running", "history": []})
        runs = _wait_for(page + "runs.json", lambda r: "run-b" in r)  # events travel on a batched stream
        assert list(runs) == ["run-a", "run-b"]
        assert runs["run-a"]["status"] == "finished"
        assert runs["run-a"]["model"] == "small_cnn"  # kept from the first message
        assert runs["run-a"]["history"] == [
            {"epoch": 0, "train_loss": 0.7, "val_auroc_mean": 0.61},
            {"epoch": 1, "train_loss": 0.5, "val_auroc_mean": None},  # NaN is not JSON
        ]
        body = urllib.request.urlopen(page, timeout=10).read().decode()
        assert "run-a" in body and "finished" in body and "<polyline" in body


def test_render_page_without_runs():
    assert "No runs yet" in dashboard.render_page({})


def test_route_shows_the_active_run(tmp_path):
    """While a real run trains, /dask-dl/runs.json answers with its current history; after stop, its status."""
    import dask_dl

    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
    ):
        dask_dl.synthesize(tmp_path / "raw", n_images=160, size=64, seed=0)
        dask_dl.ingest(
            dask_dl.read_catalog(tmp_path / "raw"),
            tmp_path / "s.zarr",
            size=32,
            chunk=8,
            shard=2,
            client=client,
            progress=False,
        )
        ds = dask_dl.open_dataset(tmp_path / "s.zarr")
        run = dask_dl.fit(ds, model="small_cnn", epochs=50, batch_size=8, trainers=2, client=client, wait=False)
        try:
            url = _local(client.dashboard_link.replace("/status", "/dask-dl/runs.json"))
            runs = _wait_for(url, lambda r: len((r.get(run.run_id) or {}).get("history") or []) >= 2, timeout=120)
            live = runs[run.run_id]
            assert live["status"] == "running"
            assert live["model"] == "small_cnn" and live["trainers"] == 2
            served = [(row["epoch"], row["train_loss"]) for row in live["history"]]
            ours = list(zip(run.history.epoch, run.history.train_loss, strict=False))[: len(served)]
            assert served == ours  # the page shows this run's own numbers
            assert run.run_id in urllib.request.urlopen(url.replace("runs.json", ""), timeout=10).read().decode()
        finally:
            run.stop().wait()
        runs = _wait_for(url, lambda r: r[run.run_id]["status"] != "running")
        assert runs[run.run_id]["status"] == "stopped"
