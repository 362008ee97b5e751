"""Chaos: the whole path while workers are SIGKILLed, and what it leaves equals a calm run's.

Real LocalClusters with nannies (the killed workers come back), real SIGKILLs by pid from
:class:`dask_dl.testing.chaos.WorkerKiller`, real Zarr stores, onnxruntime and gloo. Each stage runs once calm and
once under chaos in the same cluster, and the test compares what they left: the ingested store bit for bit, the
scores exactly, the weights of a fit with ``torch.equal``. ``bench/chaos.py`` runs the same stages longer and
prints the time the kills cost.
"""

from __future__ import annotations

import os
import threading
import time

import dask
import numpy as np
import pandas as pd
import pytest
import torch
import zarr
from distributed import Client, LocalCluster

import dask_dl
from dask_dl.cluster.workers import scheduler_workers
from dask_dl.data.ingest import read_rejects
from dask_dl.data.store import StoreFiles, StoreLayout
from dask_dl.testing.chaos import (
    WorkerKiller,
    large_images,
    pause_workers_above,
    paused_workers,
    store_differences,
    worker_states,
)
from dask_dl.testing.train import RECOVERY_RUN, squares_collection

# Workers killed, paused and restarted under real work: minutes, for the full run only.
pytestmark = pytest.mark.slow

IMAGES = 3000  # 64 px: 94 ingest tasks of 32 images, a few seconds calm on 2 workers
# one worker down at a time, the next killed once its replacement is up (and 2 s old): a task the killed worker ran
# is re-run by the other, not again on a dying one (4 deaths while running one task make the scheduler give it up)
CHAOS = dict(every=0.3, max_seconds=60, keep=1)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster) as client:
        yield client


@pytest.fixture(scope="module")
def catalog(tmp_path_factory, client) -> pd.DataFrame:
    """A synthetic NIH collection with a few corrupt files (so the rejects table has rows)."""
    root = tmp_path_factory.mktemp("collection")
    dask_dl.synthesize(root, n_images=IMAGES, size=64, seed=2, corrupt_fraction=0.01, client=client)
    return dask_dl.read_catalog(root)


def ingest(catalog, store, client, **kwargs) -> dask_dl.IngestResult:
    options = {"size": 64, "chunk": 16, "shard": 2, "progress": False, **kwargs}
    return dask_dl.ingest(catalog, store, client=client, **options)


@pytest.fixture(scope="module")
def calm(catalog, client, tmp_path_factory) -> str:
    store = str(tmp_path_factory.mktemp("calm") / "calm.zarr")
    result = ingest(catalog, store, client)
    assert result.n_rejected > 0
    return store


def landed(kills, started: float, ended: float) -> int:
    return sum(started <= kill.at <= ended for kill in kills)


class ShardWatch:
    """Polls a store being ingested and notes each shard file as it is once its status file says it is written;
    :meth:`rewritten` names the shards whose file changed after that (written again, or deleted)."""

    def __init__(self, store: str, layout: StoreLayout) -> None:
        self.files, self.layout, self.seen = StoreFiles(store), layout, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _stamp(self, shard: int) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.files.path(self.layout.shard_key(shard)))
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_mtime_ns

    def _poll(self) -> None:
        while not self._stop.wait(0.01):
            for shard in range(self.layout.n_shards):
                if shard not in self.seen and self.files.get(self.layout.status_key(shard)) is not None:
                    self.seen[shard] = self._stamp(shard)

    def __enter__(self) -> ShardWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def rewritten(self) -> list[int]:
        return sorted(shard for shard, stamp in self.seen.items() if self._stamp(shard) != stamp)


# ---- ingest and predict while a random worker is SIGKILLed as soon as its replacement is up -------------------


def test_an_ingest_under_chaos_equals_a_calm_one(catalog, calm, client, tmp_path):
    store = str(tmp_path / "chaos.zarr")
    layout = StoreLayout.from_dict(zarr.open_group(calm, mode="r").attrs["dask_dl"])
    started = time.time()
    with (
        WorkerKiller(client, max_kills=5, seed=1, **CHAOS) as killer,
        ShardWatch(store, layout) as watch,
    ):
        result = ingest(catalog, store, client)
    ended = time.time()
    print(f"ingest: {landed(killer.kills, started, ended)} kills survived in {ended - started:.1f} s")
    assert landed(killer.kills, started, ended) >= 1
    assert result.n_rejected == len(read_rejects(calm)) > 0
    assert store_differences(calm, store) == []  # the image array, the valid mask, the rejects table
    # a shard whose task finished is never written again: the scheduler re-runs the finished tasks whose results a
    # killed worker held, and a re-run that deleted and rewrote its shard left a hole when it was killed in between
    assert len(watch.seen) == layout.n_shards and watch.rewritten() == []
    client.wait_for_workers(2, timeout=120)


@pytest.fixture(scope="module")
def model(calm, tmp_path_factory) -> str:
    """small_cnn with BatchNorm statistics from real images, exported to ONNX."""
    from dask_dl.models import build_model
    from dask_dl.normalize import normalize

    ds = dask_dl.open_dataset(calm)
    torch.manual_seed(0)
    net = build_model("small_cnn", num_outputs=ds.sizes["finding"], width=8)
    with torch.no_grad():
        net(normalize(ds.image[:16].values))  # train mode: updates the running statistics
    path = str(tmp_path_factory.mktemp("model") / "cxr.onnx")
    dask_dl.export_onnx(net.eval(), path, labels=list(ds.finding.values), input_size=64)
    return path


def test_predict_under_chaos_equals_a_calm_one(calm, model, client):
    client.wait_for_workers(2, timeout=120)
    dataset = dask_dl.open_dataset(calm)
    expected = dask_dl.predict(dataset, model, client=client).compute()
    started = time.time()
    with WorkerKiller(client, max_kills=2, seed=2, **CHAOS) as killer:
        scores = dask_dl.predict(dataset, model, client=client).compute()
    ended = time.time()
    print(f"predict: {landed(killer.kills, started, ended)} kills survived in {ended - started:.1f} s")
    assert landed(killer.kills, started, ended) >= 1
    assert scores.shape == (int(dataset.sizes["sample"]), int(dataset.sizes["finding"]))
    np.testing.assert_array_equal(scores, expected)
    client.wait_for_workers(2, timeout=120)


# ---- fit: a trainer's worker killed once per epoch ------------------------------------------------------------

#: the recovery tests' run, one epoch shorter: 32 steps per epoch
OPTIONS = {**RECOVERY_RUN, "epochs": 3}


#: the killed run: the same, with small_cnn sleeping 80 ms a step (same weights), about 3 s an epoch
PACED = {
    **OPTIONS,
    "model": "dask_dl.testing.train:paced_small_cnn",
    "model_kwargs": {**OPTIONS["model_kwargs"], "seconds": 0.08},
}


def wait_until(condition, *, within: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_fit_with_a_trainer_killed_every_epoch_ends_with_an_uninterrupted_runs_weights(tmp_path):
    """Three workers for two trainers: the spare, then each nanny's replacement, takes a killed trainer's place,
    so every restart goes on at world size 2 and the weights equal an uninterrupted run's bit for bit.

    The killed run (PACED) is small_cnn paced to 80 ms a step (same weights, no more computation): an epoch
    then lasts longer than a restart and the killer's wait for the replaced worker to settle, so that the next
    kill lands in the next epoch however fast the restarts are."""
    root = tmp_path / "squares"
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        store = str(tmp_path / "squares.zarr")
        dask_dl.ingest(squares_collection(root), store, size=32, chunk=8, shard=2, client=client, progress=False)
        dataset = dask_dl.open_dataset(store)
        straight = dask_dl.fit(dataset, client=client, **OPTIONS).checkpoint()["model"]

        ck = tmp_path / "ck"
        run = dask_dl.fit(dataset, client=client, **PACED, checkpoint_dir=str(ck), checkpoint_every_steps=3, wait=False)
        killer = WorkerKiller(client, among=lambda: run.workers, keep=0)
        for epoch in range(OPTIONS["epochs"]):
            # in the middle of the epoch, after a step checkpoint: the restart goes on from that step
            step = f"step-{epoch:04d}-*.pt"
            wait_until(lambda s=step: list(ck.glob(s)) or run.done, what=f"a step checkpoint of epoch {epoch}")
            assert not run.done
            wait_until(lambda: killer.kill() is not None or run.done, what="a worker to kill (no restart under way)")
            wait_until(lambda e=epoch: len(run.restarts) > e or run.done, what=f"the restart in epoch {epoch}")
        run.wait(timeout=300)

        assert run.status == "finished"
        restarts = run.restarts
        assert list(restarts["lost_workers"]) == [kill.address for kill in killer.kills]
        assert list(restarts["world_size"]) == [2, 2, 2]
        assert list(restarts["resumed_epoch"]) == [0, 1, 2] and (restarts["resumed_step"] > 0).all()
        assert list(run.history["event"]) == ["restarted"] * 3
        assert list(run.history["samples"]) == [64] * 3 and not run.history["samples_repeated"].any()
        weights = run.checkpoint()["model"]
        assert set(weights) == set(straight)
        for name in straight:
            assert torch.equal(weights[name], straight[name]), name
        client.wait_for_workers(3, timeout=120)  # the nannies brought every killed worker back


# ---- memory pressure: workers pause and resume ----------------------------------------------------------------

SIDE = 7000  # px: a 49 MB decode buffer per image, far above what one worker's memory wobbles by


def finishes(function, *, within: float, why):
    """``function()``'s result, or a failure saying ``why()`` when it has not returned after ``within`` seconds."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=function()), daemon=True)
    thread.start()
    thread.join(within)
    if thread.is_alive():
        pytest.fail(f"did not finish in {within:.0f} s: {why()}")
    return out["result"]


def test_an_ingest_that_pauses_its_workers_for_memory_slows_down_and_loses_nothing(client, tmp_path):
    catalog = large_images(tmp_path / "large", 8, side=SIDE)
    calm = str(tmp_path / "calm.zarr")
    ingest(catalog, calm, client, chunk=1)  # on the module's cluster: no memory limit
    # the nanny would restart a worker at 95 % of its limit: pausing is what is tested here, not that
    with dask.config.set({"distributed.worker.memory.terminate": False}):
        cluster = LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", memory_limit="2 GiB"
        )
    with cluster, Client(cluster) as tight:
        # every worker ingests a large image first: what a worker imports and keeps after one (codecs, glibc's
        # arenas) is its idle memory here
        ingest(catalog.iloc[:6], str(tmp_path / "warm.zarr"), tight, chunk=1, shard=1)
        pause_workers_above(tight, SIDE * SIDE // 2)  # halfway up one image's decode buffer
        store = str(tmp_path / "paused.zarr")
        started = time.time()
        run = lambda: ingest(catalog, store, tight, chunk=1)  # noqa: E731
        finishes(run, within=60, why=lambda: f"the workers' (status, memory): {worker_states(tight)}")
        seconds = time.time() - started
        paused = paused_workers(tight)
        print(f"ingest with paused workers: {sum(paused.values())} pauses in {seconds:.1f} s")
        assert set(paused) == set(scheduler_workers(tight))  # each worker paused, and resumed (at its
        # memory monitor's next look, every 100 ms)
        running = lambda: all(status == "running" for status, _ in worker_states(tight).values())  # noqa: E731
        wait_until(running, within=10, what=f"the workers to resume: {worker_states(tight)}")
    assert store_differences(calm, store) == []
    assert zarr.open_group(store, mode="r")["valid"][:].all()
