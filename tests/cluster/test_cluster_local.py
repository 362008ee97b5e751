"""A heterogeneous local cluster over TLS: trainers on the GPU-tagged workers, data work on the CPU worker.

There is no GPU here: the two "trainer" workers are CPU worker processes that advertise a ``GPU`` resource, a
stand-in for dask-cuda's workers (``make("local", tagged_workers=2)``); placement and restrictions only look at
the resource, so they are tested for real. The cluster runs with throw-away TLS certificates, so the same story
also proves that training, ingest and scoring work over ``tls://``, and a client without the certificates is
refused. Scoring can be sent to the tagged workers instead (``predict(..., on="gpu")``, ``dask-dl predict --on
gpu``); with the CPU build of onnxruntime there, the sessions use the CPU provider (the CUDA provider itself is
tested in test_cluster_gpu.py, where a GPU exists).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import dask.config
import numpy as np
import pandas as pd
import pytest
from distributed import Client, get_task_stream
from distributed.security import Security

import dask_dl
from dask_dl.cluster import connect, cpu_workers, get_client, gpu_workers, workers_for
from dask_dl.cluster.workers import scheduler_workers
from dask_dl.errors import ClusterError
from dask_dl.testing.cluster import small_story, worker_of_tasks, write_tls_files

# A TLS cluster, the small story on it and dask-dl runs in processes of their own: for the full run only.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tls_client():
    with connect(kind="local", n_workers=1, tagged_workers=2, security=True) as client:
        yield client


@pytest.fixture(scope="module")
def story(tls_client, tmp_path_factory):
    return small_story(tls_client, tmp_path_factory.mktemp("tls-story"), trainers=2)


def test_story_over_tls_puts_trainers_on_tagged_workers_and_data_work_on_the_cpu_worker(tls_client, story):
    client = tls_client
    assert client.scheduler.address.startswith("tls://127.0.0.1:")
    assert all(a.startswith("tls://") for a in scheduler_workers(client))
    tagged, plain = gpu_workers(client), cpu_workers(client)
    assert len(tagged) == 2 and len(plain) == 1

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
    # the same through dask_dl (dask-dl --scheduler): one line that says which mistake it is, not a traceback
    cannot = r"^cannot connect to the scheduler at {} \({}\): {}"
    with pytest.raises(
        ClusterError, match=cannot.format(address, ".*TLS certificate does not match.*", "the TLS handshake failed")
    ):
        get_client(scheduler=address, security=Security.temporary())
    plain = address.replace("tls://", "tcp://")
    closed = "the scheduler closed the connection: if it uses TLS, its address starts with tls://$"
    with pytest.raises(ClusterError, match=cannot.format(plain, "CommClosedError: .*", closed)):
        get_client(scheduler=plain)
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        nothing = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with (
        dask.config.set({"distributed.comm.timeouts.connect": "2s"}),
        pytest.raises(
            ClusterError,
            match=(cannot.format(nothing, "OSError: .*", "check that the scheduler runs, that this is its address")),
        ),
    ):
        get_client(scheduler=nothing)
    assert tls_client.submit(lambda: 1).result() == 1  # the cluster itself is unharmed


def test_cli_over_tls_with_certificate_files_and_without(tls_client, story, tmp_path):
    files = write_tls_files(tls_client.security, tmp_path)
    address = tls_client.scheduler.address
    raw = os.path.join(os.path.dirname(story.store), "raw")
    command = [sys.executable, "-m", "dask_dl.cli", "ingest", raw, str(tmp_path / "cli.zarr"), "--size", "32", "-q"]
    tls = ["--scheduler", address, "--tls-ca", files["ca"], "--tls-cert", files["cert"], "--tls-key", files["key"]]

    done = subprocess.run(command + tls, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ingested {story.images} images into {tmp_path / 'cli.zarr'}" in done.stdout

    refused = subprocess.run(command + ["--scheduler", address], capture_output=True, text=True, timeout=180)
    assert refused.returncode == 1
    assert f"the scheduler {address} uses TLS, and no certificates were given: pass --tls-ca" in refused.stderr
    assert "Traceback" not in refused.stderr


def _session_providers(model: str) -> list[list[str]]:
    """The providers of this worker's onnxruntime sessions of ``model`` (run on the workers)."""
    from dask_dl import inference

    return [session.get_providers() for key, session in inference._SESSIONS.items() if key[0] == model]


def test_predict_on_gpu_scores_on_the_tagged_workers_only(tls_client, story):
    client = tls_client
    tagged, plain = gpu_workers(client), cpu_workers(client)
    assert workers_for(client, "gpu") == tagged and workers_for(client, "cpu") == plain
    assert workers_for(client, "any") is None
    test = dask_dl.open_dataset(story.store, split="test")
    with get_task_stream(client) as stream:
        probs = dask_dl.predict(test, story.model, client=client, on="gpu")
        holders = client.who_has(probs)
        scores = probs.compute()
    assert worker_of_tasks(stream.data, "predict") == set(tagged)
    assert holders and {w for ws in holders.values() for w in ws} <= set(tagged)
    # on= without client=: the current client's cluster
    again = dask_dl.predict(test, story.model, on="gpu")
    assert {w for ws in client.who_has(again).values() for w in ws} <= set(tagged)
    # the same scores as the CPU workers' (the story scored there)
    np.testing.assert_allclose(scores, story.scores, rtol=0, atol=1e-6)
    # no CUDA provider in this onnxruntime: the tagged workers' sessions run on the CPU
    providers = client.run(_session_providers, story.model, workers=tagged)
    assert [p for ps in providers.values() for p in ps] and all(
        ps == [["CPUExecutionProvider"]] for ps in providers.values() if ps
    )


def test_cli_predict_on_gpu_scores_on_the_tagged_workers(tls_client, story, tmp_path):
    client = tls_client
    files = write_tls_files(client.security, tmp_path)
    out = tmp_path / "scores.parquet"
    command = [
        sys.executable,
        "-m",
        "dask_dl.cli",
        "predict",
        story.store,
        story.model,
        "--out",
        str(out),
        "--split",
        "test",
        "--on",
        "gpu",
        "--scheduler",
        client.scheduler.address,
        "--tls-ca",
        files["ca"],
        "--tls-cert",
        files["cert"],
        "--tls-key",
        files["key"],
    ]
    with get_task_stream(client) as stream:  # the scheduler records the CLI's tasks too
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    table = pd.read_parquet(out)
    assert f"wrote {len(table)} scores of 14 labels to {out}" in done.stdout
    assert worker_of_tasks(stream.data, "predict") == set(gpu_workers(client))
    np.testing.assert_allclose(table.filter(like="p_").to_numpy(), story.scores, rtol=0, atol=1e-6)


def test_cli_predict_on_gpu_without_gpu_workers_says_what_to_start(story, tmp_path):
    out = tmp_path / "scores.parquet"
    command = [
        sys.executable,
        "-m",
        "dask_dl.cli",
        "predict",
        story.store,
        story.model,
        "--out",
        str(out),
        "--on",
        "gpu",
        "--cluster",
        "local",
        "--workers",
        "1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1
    assert (
        "error: scoring was asked to run on the GPU workers (on='gpu'), and none of the cluster's 1 workers "
        "advertises a 'GPU' resource; pass on='cpu', or start GPU workers" in done.stderr
    )
    assert "Traceback" not in done.stderr and not out.exists()
