"""Training through a real dask-gateway server (the session fixture in conftest.py starts it on 127.0.0.1)."""

from __future__ import annotations

import gc
import os
import socket

import dask.config
import numpy as np
import pytest

import dask_dl
from dask_dl.cluster import connect, gpu_workers, make
from dask_dl.cluster.workers import scheduler_workers
from dask_dl.errors import ClusterError, ConfigurationError
from dask_dl.testing.cluster import small_story

# A gateway server and its clusters start per test: for the full run only.
pytestmark = pytest.mark.slow

dask_gateway = pytest.importorskip("dask_gateway")


def test_make_gateway_trains_end_to_end_with_gpu_tagged_workers(gateway_server, tmp_path):
    auth = dask_gateway.BasicAuth("alice", gateway_server["password"])
    settings = {"dask-dl.cluster.gateway.address": gateway_server["address"]}  # a site's yaml, set once
    with (
        dask.config.set(settings),
        connect(kind="gateway", auth=auth, workers=2, gpus=1, environment={"DASK_DL_SITE": "gw"}) as client,
    ):
        cluster = client.cluster
        assert type(cluster).__name__ == "GatewayCluster"
        workers = scheduler_workers(client)
        assert len(workers) == 2 and all(a.startswith("tls://") for a in workers)  # gateway clusters are TLS
        assert gpu_workers(client) == sorted(workers)  # gpus=1 became the workers' GPU resource
        assert set(client.run(lambda: __import__("os").environ["DASK_DL_SITE"]).values()) == {"gw"}

        story = small_story(client, tmp_path, trainers=2)

        assert sorted(story.trainers) == sorted(workers)
        assert np.isfinite(story.history["train_loss"]).all()
        assert story.scores.shape == (len(dask_dl.open_dataset(story.store, split="test").sample), 14)
    assert cluster.status == "closed"
    # connect() shut the gateway cluster down. dask-gateway 2026.3's Gateway.__del__ closes it a second time, which
    # raises once close() stopped its loop: forget the loop runner after closing, as dask_dl.cluster.gateway does.
    gateway = dask_gateway.Gateway(gateway_server["address"], auth=auth)
    try:
        assert gateway.list_clusters() == []
    finally:
        gateway.close()
        gateway.__dict__.pop("_loop_runner", None)


# dask-gateway 2026.3's Gateway.__del__ closes an already closed gateway and prints a traceback at garbage
# collection; make("gateway") avoids it (gateway.py), a user's own GatewayCluster still shows it.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_plain_gateway_cluster_works_through_the_default_client(gateway_server, tmp_path, monkeypatch):
    """The path users take without dask_dl.cluster: their own GatewayCluster and ``cluster.get_client()``.

    With paths relative to the client's folder, as a user in a shell or notebook writes them: the gateway's workers
    run in folders of their own (under the server's clusters directory), where "plain.zarr" is somewhere else.
    """
    from dask_dl.data.synthetic import synthesize

    monkeypatch.chdir(tmp_path)
    auth = dask_gateway.BasicAuth("bob", gateway_server["password"])
    with dask_gateway.GatewayCluster(gateway_server["address"], auth=auth) as cluster:
        cluster.scale(2)
        with cluster.get_client() as client:
            client.wait_for_workers(2, timeout=120)
            assert all(cwd != str(tmp_path) for cwd in client.run(os.getcwd).values())
            synthesize("raw", n_images=32, size=64, seed=1)
            result = dask_dl.ingest(dask_dl.read_catalog("raw"), "plain.zarr", size=32, chunk=8, shard=1)
            assert result.n == 32 and result.n_rejected == 0
            assert result.store == str(tmp_path / "plain.zarr")
            run = dask_dl.fit(
                dask_dl.open_dataset("plain.zarr"),
                model="small_cnn",
                model_kwargs={"width": 8},
                epochs=1,
                batch_size=8,
                trainers=2,
                checkpoint_dir="ckpt",
            )
            assert sorted(run.workers) == sorted(scheduler_workers(client))
            assert len(run.history) == 1
            assert sorted(p.name for p in (tmp_path / "ckpt").glob("epoch-*.pt")) == ["epoch-0000.pt"]
    del cluster, client, run  # the run holds the client, which holds the cluster and its Gateway
    gc.collect()  # the Gateway's __del__ runs here, under this test's filter, not in whichever test comes next


def test_a_gateway_that_cannot_be_asked_is_an_error_that_says_what_to_fix(gateway_server, monkeypatch):
    """dask-gateway passes its HTTP client's errors through; each common mistake gets its own one-line cause."""
    address = gateway_server["address"]
    wrong = dask_gateway.BasicAuth("alice", "not-the-password")
    with pytest.raises(
        ClusterError,
        match=r"^the gateway at http://127\.0\.0\.1:\d+ refused this user \(401 "
        r"Unauthorized\): .*DASK_GATEWAY__AUTH__KWARGS__PASSWORD",
    ):
        make("gateway", address=address, auth=wrong)
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        nothing = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(
        ClusterError,
        match=rf"^cannot reach the gateway at {nothing} \(ClientConnectorError: .*\): "
        "check that the server runs",
    ):
        make("gateway", address=nothing, auth=wrong)
    bare = address.removeprefix("http://")
    with pytest.raises(
        ClusterError,
        match=rf"^the gateway address '{bare}' is not an http\(s\) URL .*; write it as "
        r"http://host:port$",
    ):
        make("gateway", address=bare, auth=wrong)
    right = dask_gateway.BasicAuth("alice", gateway_server["password"])
    with pytest.raises(
        ClusterError,
        match=rf"^the server at {address}/elsewhere did not answer as a dask-gateway "
        r"server \(ValueError: 404: Not Found\)",
    ):
        make("gateway", address=f"{address}/elsewhere", auth=right)
    monkeypatch.delenv("DASK_GATEWAY__ADDRESS", raising=False)
    with (
        dask.config.set({"gateway.address": None}),
        pytest.raises(
            ConfigurationError,
            match=(r"needs the gateway's address: .* or in the environment: DASK_GATEWAY__ADDRESS=http://gateway:8000"),
        ),
    ):
        make("gateway", auth=right)
