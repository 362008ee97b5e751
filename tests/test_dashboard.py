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
