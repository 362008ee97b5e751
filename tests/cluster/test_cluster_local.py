"""A heterogeneous local cluster over TLS: trainers on the GPU-tagged workers, data work on the CPU worker.

There is no GPU here: the two "trainer" workers are CPU worker processes that advertise a ``GPU`` resource, a
stand-in for dask-cuda's workers (``make("local", tagged_workers=2)``); placement and restrictions only look at
the resource, so they are tested for real. The cluster runs with throw-away TLS certificates, so the same story
also proves that training, ingest and scoring work over ``tls://``, and a client without the certificates is
refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from distributed import Client
from distributed.security import Security

from dask_dl.cluster import connect, cpu_workers, gpu_workers
from dask_dl.testing.cluster import small_story


@pytest.fixture(scope="module")
def tls_client():
    with connect(kind="local", n_workers=1, tagged_workers=2, security=True) as client:
        yield client


def test_story_over_tls_puts_trainers_on_tagged_workers_and_data_work_on_the_cpu_worker(tls_client, tmp_path):
    client = tls_client
    assert client.scheduler.address.startswith("tls://127.0.0.1:")
    assert all(a.startswith("tls://") for a in client.scheduler_info(n_workers=-1)["workers"])
    tagged, plain = gpu_workers(client), cpu_workers(client)
    assert len(tagged) == 2 and len(plain) == 1

    story = small_story(client, tmp_path, trainers=2)

    assert sorted(story.trainers) == tagged
    assert story.ran_on == {"synthesize": set(plain), "ingest": set(plain), "predict": set(plain)}
    assert story.images == 48 and len(story.history) == 1
    assert np.isfinite(story.history["train_loss"]).all()
    assert story.scores.shape[1] == 14 and ((story.scores >= 0) & (story.scores <= 1)).all()


def test_a_client_without_the_certificates_is_refused(tls_client):
    address = tls_client.scheduler.address
    with pytest.raises(TypeError, match="TLS expects a `ssl_context`"):  # no certificates at all
        Client(address, timeout="5s")
    # certificates of another authority: the handshake fails
    with pytest.raises(OSError, match="TLS certificate does not match"):
        Client(address, security=Security.temporary(), timeout="3s")
    assert tls_client.submit(lambda: 1).result() == 1  # the cluster itself is unharmed
