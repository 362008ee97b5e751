"""Trainer placement and the TrainingActor protocol, driven by hand through Dask actors."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster, Scheduler, SpecCluster, Worker

import dask_dl
from dask_dl import ClusterError, ConfigurationError
from dask_dl.cluster.workers import scheduler_workers
from dask_dl.testing.train import one_rank_group, squares_collection
from dask_dl.train.actor import TrainerSpec, TrainingActor
from dask_dl.train.placement import place_trainers

# ---- placement -----------------------------------------------------------------------------------------------


def _spec_cluster(resources: list[dict]) -> SpecCluster:
    workers = {f"w{i}": {"cls": Worker, "options": {"nthreads": 1, "resources": r}} for i, r in enumerate(resources)}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    return SpecCluster(workers=workers, scheduler=scheduler, asynchronous=False)


def test_placement_prefers_gpu_workers():
    with _spec_cluster([{}, {"GPU": 1}, {}, {"GPU": 1}]) as cluster, Client(cluster) as client:
        info = scheduler_workers(client)
        gpu = sorted(a for a, w in info.items() if w["resources"].get("GPU"))
        assert place_trainers(client, 2) == gpu
        assert place_trainers(client, 1) == gpu[:1]
        with pytest.raises(ClusterError, match=r"only 2 workers with a 'GPU' resource.*trainers=2"):
            place_trainers(client, 3)


def test_placement_on_cpu_workers():
    with _spec_cluster([{}, {}]) as cluster, Client(cluster) as client:
        chosen = place_trainers(client, 2)
        assert len(set(chosen)) == 2 and set(chosen) == set(scheduler_workers(client))
        with pytest.raises(ClusterError, match=r"only 2 workers .*pass trainers=2.*scale\(5\)"):
            place_trainers(client, 5)
        with pytest.raises(ConfigurationError, match="trainers must be a positive integer, got 0"):
            place_trainers(client, 0)


# ---- the actor protocol ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup_client(tmp_path_factory):
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        root = tmp_path_factory.mktemp("squares")
        store = str(root / "s.zarr")
        dask_dl.ingest(squares_collection(root), store, size=32, chunk=8, shard=2, client=client, progress=False)
        yield client, store


def _spec(store: str, **kwargs) -> TrainerSpec:
    """The spec fit would make for small_cnn on ``store`` (batch 1, 2 trainers), with ``kwargs`` replaced."""
    from dask_dl.train.options import check_run
    from dask_dl.train.run import _trainer_spec

    options = check_run(
        dask_dl.open_dataset(store), model="small_cnn", model_kwargs={"width": 4}, batch_size=1, lr=0.01, trainers=2
    )
    return replace(_trainer_spec(options, None), **kwargs)


def profiling(client, workers, expect: bool, *, wait_s: float = 5.0) -> dict[str, bool]:
    """Whether each worker's sampling profiler runs, given up to ``wait_s`` to become ``expect`` (the change is
    handed to the worker's event loop)."""

    def running(dask_worker) -> bool:
        return dask_worker.periodic_callbacks["profile"].is_running()

    deadline = time.monotonic() + wait_s
    state = client.run(running, workers=workers)
    while set(state.values()) != {expect} and time.monotonic() < deadline:
        time.sleep(0.05)
        state = client.run(running, workers=workers)
    return state


def allocator_holders() -> int:
    from dask_dl import allocator

    return allocator._holders


@pytest.mark.slow
def test_actor_protocol(setup_client):
    client, store = setup_client
    workers = place_trainers(client, 2)
    futures = [
        client.submit(TrainingActor, actor=True, workers=[w], allow_other_workers=False, pure=False) for w in workers
    ]
    actors = [f.result() for f in futures]
    try:
        init = actors[0].free_address().result()
        assert init.startswith("tcp://127.0.0.1:") and int(init.rsplit(":", 1)[1]) > 0
        spec = _spec(store)
        # the rendezvous: both setups in flight before either is awaited
        infos = [
            f.result() for f in [a.setup(spec, init_method=init, rank=r, world_size=2) for r, a in enumerate(actors)]
        ]
        assert [i["rank"] for i in infos] == [0, 1] and [i["address"] for i in infos] == workers
        assert infos[0]["steps_per_epoch"] == infos[1]["steps_per_epoch"] == 32  # 64 images, 1 per rank and step
        assert infos[0]["threads"] == 1 and infos[0]["device"] == "cpu"
        assert client.run(lambda: torch.distributed.get_world_size()) == {w: 2 for w in workers}
        # the workers' sampling profiler is paused while they hold a trainer (dask_dl/train/profiler.py)
        assert profiling(client, workers, False) == {w: False for w in workers}
        with pytest.raises(ClusterError, match="already in a torch.distributed process group"):
            actors[0].setup(spec, init_method=init, rank=0, world_size=2).result()
        # each trainer holds the allocator settings once (dask_dl/allocator.py), the refused setup included
        assert client.run(allocator_holders, workers=workers) == {w: 1 for w in workers}

        # stop asked of rank 1 alone, while the epoch runs: progress and request_stop are answered at once
        # (async methods), and both ranks stop after the same step
        epoch = [a.train_epoch(0) for a in actors]
        deadline = time.monotonic() + 30
        while actors[1].progress().result().get("step", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert actors[1].request_stop().result() is True
        results = [f.result() for f in epoch]
        assert all(r["stopped"] for r in results)
        assert results[0]["steps"] == results[1]["steps"] < 32
        assert results[0]["bytes_sent"] > 0 and results[0]["comm_s"] > 0

        # validation: the ranks together score every val sample exactly once
        scored = [f.result() for f in [a.validate(0) for a in actors]]
        samples = np.concatenate([s["samples"] for s in scored])
        assert sorted(samples.tolist()) == sorted(spec.val_samples.tolist())
        assert all(s["scores"].shape == (len(s["samples"]), 2) for s in scored)
        assert all(((s["scores"] > 0) & (s["scores"] < 1)).all() for s in scored)

        # checkpoint without a directory: every rank gets both ranks' compressor and RNG states and rank 0's model
        # buffers, so the same checkpoint survives the loss of any one trainer
        ck = [f.result() for f in [a.checkpoint(0, history=[], directory=None) for a in actors]]
        assert len(ck[0]["compressor"]) == 2 and len(ck[0]["rng"]) == 2
        assert ck[0]["epoch"] == 0 and not any(k.startswith("module.") for k in ck[0]["model"])
        assert all(torch.equal(ck[0]["model"][k], ck[1]["model"][k]) for k in ck[0]["model"])
        assert torch.equal(ck[0]["rng"][1]["torch"], ck[1]["rng"][1]["torch"])
    finally:
        for f in [a.teardown() for a in actors]:
            f.result()
    assert client.run(lambda: torch.distributed.is_initialized()) == {w: False for w in workers}
    assert profiling(client, workers, True) == {w: True for w in workers}
    assert client.run(allocator_holders, workers=workers) == {w: 0 for w in workers}  # and let go at teardown
    # a second teardown (the driver's, after a failed setup's own) lets go of nothing an ingest task holds meanwhile
    from dask_dl import allocator

    client.run(allocator.keep_freed_memory, workers=workers)
    for f in [a.teardown() for a in actors]:
        f.result()
    assert client.run(allocator_holders, workers=workers) == {w: 1 for w in workers}
    client.run(allocator.restore, workers=workers)


def _ddp_step() -> object:
    """A trainer's DDP model, made without warnings, and one training step; return its buffer switch."""
    import warnings

    from dask_dl.models import build_model
    from dask_dl.train.step import make_ddp

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddp = make_ddp(build_model("small_cnn", num_outputs=2, width=8), device_ids=None)
    ddp.train()
    ddp(torch.randn(4, 1, 32, 32)).sum().backward()  # a training step runs without the broadcast
    return getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None))


def test_the_ranks_agree_on_a_stop_a_non_finite_loss_and_a_due_checkpoint():
    """train_epoch's agreement: one all-reduce of (stop, loss sum, checkpoint clock), each flag raised on its own."""
    from dask_dl.train.step import Agreement, agree

    cpu = torch.device("cpu")
    with one_rank_group():
        assert agree(stop=False, loss_sum=torch.tensor(1.5), late=False, device=cpu) == Agreement(False, False, False)
        assert agree(stop=True, loss_sum=torch.tensor(1.5), late=False, device=cpu) == Agreement(True, False, False)
        assert agree(stop=False, loss_sum=torch.tensor(float("nan")), late=False, device=cpu) == Agreement(bad=True)
        assert agree(stop=False, loss_sum=torch.tensor(float("-inf")), late=True, device=cpu) == Agreement(
            bad=True, due=True
        )


def test_trainer_ddp_skips_the_per_step_buffer_broadcast_without_a_warning():
    """DDP's broadcast of rank 0's buffers at every forward is off (they are sent before validation instead), and
    turning it off warns nothing on any torch: 2.13 deprecates ``broadcast_buffers`` for ``forward_sync_buffers``,
    and a warning would reach the user's terminal from every trainer."""
    with one_rank_group():
        switch = _ddp_step()  # its DDP model is freed when it returns, while the group exists
    assert switch is False
