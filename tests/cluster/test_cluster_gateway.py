"""Training through a real dask-gateway server (the session fixture in conftest.py starts it on 127.0.0.1)."""

from __future__ import annotations

import gc

import dask.config
import numpy as np
import pytest

import dask_dl
from dask_dl.cluster import connect, gpu_workers
from dask_dl.testing.cluster import small_story

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
        workers = client.scheduler_info(n_workers=-1)["workers"]
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
def test_a_plain_gateway_cluster_works_through_the_default_client(gateway_server, tmp_path):
    """The path users take without dask_dl.cluster: their own GatewayCluster and ``cluster.get_client()``."""
    from dask_dl.data.synthetic import synthesize

    auth = dask_gateway.BasicAuth("bob", gateway_server["password"])
    with dask_gateway.GatewayCluster(gateway_server["address"], auth=auth) as cluster:
        cluster.scale(2)
        with cluster.get_client() as client:
            client.wait_for_workers(2, timeout=120)
            raw = tmp_path / "raw"
            synthesize(raw, n_images=32, size=64, seed=1)
            result = dask_dl.ingest(dask_dl.read_catalog(raw), tmp_path / "plain.zarr", size=32, chunk=8, shard=1)
            assert result.n == 32 and result.n_rejected == 0
            run = dask_dl.fit(
                dask_dl.open_dataset(tmp_path / "plain.zarr"), model="small_cnn", model_kwargs={"width": 8},
                epochs=1, batch_size=8, trainers=2,
            )  # fmt: skip
            assert sorted(run.workers) == sorted(client.scheduler_info(n_workers=-1)["workers"])
            assert len(run.history) == 1
    del cluster, client, run  # the run holds the client, which holds the cluster and its Gateway
    gc.collect()  # the Gateway's __del__ runs here, under this test's filter, not in whichever test comes next
