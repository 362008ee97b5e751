"""Recovery after a lost trainer, step checkpoints and the loader's position, on a real LocalCluster.

Four worker processes with nannies (one thread each), real gloo groups, real SIGKILLs by pid. The collection is
``test_fit``'s tiny learnable squares (32 px, 64 training images); every run here is the same 4-epoch onebit run
(batch 1 per trainer: 32 steps per epoch on 2 trainers), so one uninterrupted run is the reference of them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from pathlib import Path

import click
import dask
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from distributed import Client, LocalCluster
from distributed.core import Status

import dask_dl
from dask_dl import ConfigurationError, TrainingError
from dask_dl.cli.train import _echo_training
from dask_dl.cluster.workers import scheduler_workers
from dask_dl.data.loader import ChunkLoader
from dask_dl.data.position import EpochPosition
from dask_dl.errors import CheckpointError
from dask_dl.testing import data as kit
from dask_dl.testing.train import RECOVERY_RUN

OPTIONS = RECOVERY_RUN
STEPS = 32  # per epoch: 64 images / (2 trainers x 1)


# ---- the loader's position: pure, no cluster -----------------------------------------------------------------


@pytest.fixture(scope="module")
def small_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("position") / "rows.zarr"
    return kit.write_store(path, n=96, size=8, chunk=4, shard=2, labels=["a", "b"])


def loaders(store, world_size: int, **kwargs) -> list[ChunkLoader]:
    options = dict(batch_size=3, seed=7, window=2, augment=True, prefetch=2, **kwargs)
    return [ChunkLoader(store, np.arange(96), rank=r, world_size=world_size, **options) for r in range(world_size)]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_resumed_epoch_serves_exactly_the_batches_left(small_store, prefetch):
    ranks = loaders(small_store, 2)
    for loader in ranks:
        loader.prefetch = prefetch
    full = [list(loader.epoch(3, with_samples=True)) for loader in ranks]
    steps = len(full[0])
    assert steps == 96 // 6
    for r, loader in enumerate(ranks):  # order() is what the epoch serves, computed without reading an image
        assert np.array_equal(loader.order(3), np.concatenate([s for _, _, s in full[r]]))
    for step in range(steps):  # resumed at any step: the same images, augmentation, labels and rows
        position = EpochPosition.start(3, seed=7, world_size=2, batch_size=3).advanced(step)
        for r, loader in enumerate(ranks):
            assert loader.steps_from(position) == steps - step
            got = list(loader.epoch(3, with_samples=True, position=position))
            assert len(got) == steps - step
            for (x, y, s), (x0, y0, s0) in zip(got, full[r][step:], strict=True):
                assert torch.equal(x, x0) and torch.equal(y, y0) and np.array_equal(s, s0)


@pytest.mark.parametrize("old, new", [(2, 1), (3, 2), (2, 3)])
def test_a_changed_world_size_serves_every_remaining_sample_once(small_store, old, new):
    before = loaders(small_store, old)
    planned = np.concatenate([loader.order(1) for loader in before])
    orders = lambda r, w, b: before[0].order(1, rank=r, world_size=w, batch_size=b)  # noqa: E731
    for step in range(1, len(planned) // (3 * old)):  # at step 0 nothing was served: a fresh epoch of `new` ranks
        saved = EpochPosition.start(1, seed=7, world_size=old, batch_size=3).advanced(step)
        position = EpochPosition.from_dict(saved.to_dict()).resumed(world_size=new, batch_size=3)
        after = loaders(small_store, new)
        steps = {loader.steps_from(position) for loader in after}
        assert len(steps) == 1  # every rank takes the same number of steps (DDP needs it)
        served = [s for loader in after for _, _, s in loader.epoch(1, with_samples=True, position=position)]
        rows = np.concatenate([saved.served(orders), *served])
        assert sorted(rows.tolist()) == sorted(planned.tolist())  # none repeated, none skipped
        assert all(2 <= len(s) <= 4 for s in served)  # batches of 3, or one more or fewer


def test_a_malformed_position_is_refused():
    with pytest.raises(CheckpointError, match="loader position .* malformed"):
        EpochPosition.from_dict({"epoch": 1, "segments": []})
    with pytest.raises(CheckpointError, match="no or impossible segments"):
        EpochPosition.from_dict({"epoch": 1, "seed": 0, "segments": [{"world_size": 0, "batch_size": 1, "steps": 0}]})


def test_recovery_options_are_checked_before_anything_runs(tmp_path):
    from dask_dl.train.options import check_run

    path = kit.write_store(
        tmp_path / "s.zarr", n=32, size=8, chunk=4, labels=["a"], split_of=lambda i: "train" if i < 24 else "val"
    )
    ds = dask_dl.open_dataset(path)
    options = check_run(ds, trainers=2, batch_size=2)
    assert (options.max_restarts, options.min_trainers, options.restart_wait_s) == (3, 2, 60.0)
    assert options.hang_grace_s == 30.0
    refused = pytest.raises(ConfigurationError, match=r"dask-dl.train.hang-grace must be a positive number, got 0")
    with dask.config.set({"dask-dl.train.hang-grace": 0}), refused:
        check_run(ds, trainers=2, batch_size=2)
    assert (options.checkpoint_every_steps, options.checkpoint_every_seconds) == (None, 300.0)
    options = check_run(
        ds, trainers=2, batch_size=2, min_trainers=1, checkpoint_every_steps=10, checkpoint_every_seconds=0
    )
    assert (options.min_trainers, options.checkpoint_every_steps, options.checkpoint_every_seconds) == (1, 10, None)
    with pytest.raises(ConfigurationError, match=r"min_trainers=3 is more than trainers=2.*min_trainers <= 2"):
        check_run(ds, trainers=2, batch_size=2, min_trainers=3)
    with pytest.raises(ConfigurationError, match=r"max_restarts must be an integer >= 0, got -1"):
        check_run(ds, trainers=2, batch_size=2, max_restarts=-1)
    with pytest.raises(ConfigurationError, match=r"checkpoint_every_steps must be a positive integer"):
        check_run(ds, trainers=2, batch_size=2, checkpoint_every_steps=2.5)


# ---- recovery on a real cluster ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster) as client:
        client.run(lambda: __import__("torch"))  # every worker imports torch once, side by side
        yield client


@pytest.fixture(scope="module")
def straight(store, client) -> dict[str, torch.Tensor]:
    """The weights of the uninterrupted run."""
    run = dask_dl.fit(dask_dl.open_dataset(store), client=client, **OPTIONS)
    assert list(run.history["samples"]) == [STEPS * 2] * 4 and not run.history["samples_repeated"].any()
    return run.checkpoint()["model"]


def fit(store, client, **kwargs):
    """``dask_dl.fit`` of the tests' options; ``workers=`` pins the trainers (fit_sites' private path takes it)."""
    from dask_dl.train.run import fit_visit

    start = fit_visit if "workers" in kwargs else dask_dl.fit
    return start(dask_dl.open_dataset(store), client=client, **{**OPTIONS, **kwargs})


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def pid_of(client: Client, worker: str) -> int:
    return client.run(os.getpid, workers=[worker])[worker]


def wait_until(condition, *, within: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def live_workers(client: Client, n: int) -> None:
    """Wait until exactly ``n`` workers answer. A killed worker stays on the scheduler's list until the scheduler
    notices (``client.wait_for_workers`` counts it), and its nanny's new one may not be there yet.

    A nanny whose new worker has not answered in 30 s gets a spare worker beside it, with a warning that says
    what the nanny and its process are doing: on a loaded machine a nanny's restart can stay silent for good (its
    worker never registers, nothing is logged), and every test after it would fail waiting for a worker that
    distributed's nanny, not dask_dl, owes them.
    """

    def answered(exactly: bool = False) -> bool:
        pids = client.run(os.getpid, on_error="return")
        count = sum(isinstance(pid, int) for pid in pids.values())
        if count == n or (count > n and not exactly):
            return True
        time.sleep(0.2)
        return False

    cluster = client.cluster
    try:
        wait_until(answered, within=30, what=f"{n} workers that answer")
    except AssertionError:
        states = nanny_states(cluster)
        warnings.warn(f"a spare worker replaces a nanny's restart that did not come: {states}", stacklevel=2)
        cluster.scale(len(cluster.worker_spec) + 1)
        wait_until(answered, within=120, what=f"{n} workers that answer ({nanny_states(cluster)})")
    if len(cluster.worker_spec) > n:
        # the late restart a spare stood in for came after all: a test that counts trainers needs exactly n workers
        cluster.scale(n)  # SpecCluster drops workers that never registered first, then the newest
        wait_until(lambda: answered(exactly=True), within=60, what=f"exactly {n} workers ({nanny_states(cluster)})")


def nanny_states(cluster: LocalCluster) -> str:
    """What each of ``cluster``'s nannies and its worker process are doing: status, pid and the kernel's state."""
    states = []
    for name, nanny in cluster.workers.items():
        process = getattr(getattr(nanny, "process", None), "process", None)  # WorkerProcess -> AsyncProcess
        pid = getattr(process, "pid", None)
        kernel = ""
        with contextlib.suppress(OSError, TypeError):
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            kernel = " ".join(line for line in status if line.startswith("State:"))
        worker_status = getattr(getattr(nanny, "process", None), "status", None)
        states.append(f"{name}: nanny {nanny.status}, worker process {worker_status} pid {pid} {kernel}".strip())
    return "; ".join(states)


def validation_loss(store, model: torch.nn.Module) -> float:
    """The mean loss of ``model`` over the validation split, in this process."""
    ds = dask_dl.open_dataset(store)
    val = ChunkLoader(
        store, ds.sample.values[ds.split.values == "val"], batch_size=16, shuffle=False, drop_last=False, prefetch=0
    )
    with torch.no_grad():
        losses = [
            F.binary_cross_entropy_with_logits(model.eval()(x), y, reduction="none").mean(1) for x, y in val.epoch(0)
        ]
    return float(torch.cat(losses).mean())


def kill_after_a_step_checkpoint(run, client: Client, ck: Path, *, epoch: int) -> str:
    """SIGKILL trainer 1's worker as soon as epoch ``epoch`` has a step checkpoint (in the middle of the epoch, at a
    step the test does not choose), wait for the run to end; the killed worker's address."""
    wait_until(lambda: list(ck.glob(f"step-{epoch:04d}-*.pt")) or run.done, what=f"a step checkpoint of epoch {epoch}")
    victim = run.workers[1]
    os.kill(pid_of(client, victim), signal.SIGKILL)
    run.wait(timeout=300)
    return victim


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_a_lost_worker_is_noticed_in_seconds_with_many_trainers(store, client, cluster, tmp_path):
    """With four trainers, survivors blocked on each other (not on the lost rank) would notice the loss only at
    the collective's timeout (124-126 s); the driver makes their collectives fail at once. First on this cluster:
    on workers that had trained no group before, that wait showed every time."""
    cluster.scale(5)  # a spare worker: the restart need not wait for the nanny's new one
    try:
        client.wait_for_workers(5, timeout=120)
        options = dict(trainers=4, epochs=3)
        with dask.config.set({"dask-dl.train.timeout": 120}):
            run = fit(store, client, **options, wait=False)  # in-memory checkpoints
        wait_until(lambda: len(run.history) or run.done, what="the first epoch")
        victim = run.workers[3]
        os.kill(pid_of(client, victim), signal.SIGKILL)
        killed = time.time()
        run.wait(timeout=280)
        assert run.status == "finished"
        restarts = run.restarts
        assert len(restarts) == 1 and restarts.loc[0, "lost_workers"] == victim
        assert restarts.loc[0, "world_size"] == 4 and victim not in run.workers
        assert restarts.loc[0, "at"] - killed < 40  # far below the 120 s timeout
        # the uninterrupted run after it: the run above is the first these workers train
        assert_same_weights(run.checkpoint()["model"], fit(store, client, **options).checkpoint()["model"])
    finally:
        cluster.scale(4)
        live_workers(client, 4)


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_a_hung_trainer_is_left_out_and_the_run_goes_on(store, client, straight, tmp_path):
    """A stopped worker (SIGSTOP) neither hangs the run nor joins the next group: found hung at the collective's
    timeout plus dask-dl.train.hang-grace, left out, restarted by its nanny; one restart, the straight weights."""
    live_workers(client, 4)
    ck = tmp_path / "ck"
    with dask.config.set({"dask-dl.train.timeout": 5, "dask-dl.train.hang-grace": 2}):
        run = fit(store, client, checkpoint_dir=str(ck), checkpoint_every_steps=3, max_restarts=1, wait=False)
    wait_until(lambda: list(ck.glob("step-0002-*.pt")) or run.done, what="a step checkpoint of epoch 2")
    victim = run.workers[1]
    pid = pid_of(client, victim)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    try:
        run.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):  # its nanny killed it: nothing left to wake
            os.kill(pid, signal.SIGCONT)
    assert run.status == "finished"
    restarts = run.restarts
    assert len(restarts) == 1 and restarts.loc[0, "lost_workers"] == victim  # max_restarts=1: not hung again
    assert restarts.loc[0, "error"].startswith(f"TrainingError: {run.run_id}: trainer 1 on {victim} did not answer")
    assert victim not in run.workers and restarts.loc[0, "world_size"] == 2
    # timeout 5 s + grace 2 s, then the restart itself; on main the run waited for the scheduler's worker TTL
    assert restarts.loc[0, "at"] - stopped < 5 + 2 + 40
    assert list(run.history["event"]) == ["", "", "restarted", ""]
    assert_same_weights(run.checkpoint()["model"], straight)
    wait_until(lambda: victim not in scheduler_workers(client), what="the nanny's restart of the hung worker")
    live_workers(client, 4)


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_two_runs_on_one_cluster_do_not_interfere(store, client, straight, tmp_path):
    # the second starts as soon as fit returns the first: the first's actors are placed by then, so the second
    # sees those workers busy and trains on the other two
    first = fit(store, client, checkpoint_dir=str(tmp_path / "a"), wait=False)
    second = fit(store, client, checkpoint_dir=str(tmp_path / "b"), wait=False)
    first.wait(timeout=300), second.wait(timeout=300)
    assert not set(first.workers) & set(second.workers)  # separate workers, groups and rendezvous ports
    assert first.status == second.status == "finished"
    assert_same_weights(first.checkpoint()["model"], straight)
    assert_same_weights(second.checkpoint()["model"], straight)


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_a_killed_trainer_recovers_with_identical_weights(store, client, straight, tmp_path):
    ck = tmp_path / "ck"
    run = fit(store, client, checkpoint_dir=str(ck), checkpoint_every_steps=3, wait=False)
    victim = kill_after_a_step_checkpoint(run, client, ck, epoch=2)
    assert run.status == "finished"
    restarts = run.restarts
    assert len(restarts) == 1 and restarts.loc[0, "lost_workers"] == victim
    assert restarts.loc[0, "failed_epoch"] == 2 and restarts.loc[0, "resumed_epoch"] == 2
    assert restarts.loc[0, "resumed_step"] > 0 and restarts.loc[0, "world_size"] == 2
    assert 0 <= restarts.loc[0, "steps_lost"] <= 3 + 8  # the checkpoint interval, and the steps of one live poll
    assert list(run.history["epoch"]) == [0, 1, 2, 3]
    assert list(run.history["event"]) == ["", "", "restarted", ""]
    assert list(run.history["samples"]) == [STEPS * 2] * 4 and not run.history["samples_repeated"].any()
    assert_same_weights(run.checkpoint()["model"], straight)
    assert not list(ck.glob("step-*.pt"))  # the epochs' checkpoints replaced the step checkpoints
    live_workers(client, 4)  # the nanny restarts the killed worker

    # `dask-dl train` prints a restart as it sees it, before the epochs it has not shown yet (here: all four)
    printed = CliRunner().invoke(click.command()(lambda: _echo_training(run, (0, 0), False))).output.splitlines()
    row = restarts.loc[0]
    assert printed[0] == (
        f"{run.run_id}: lost {victim} in epoch 2 step {row.failed_step} ({row.error}); went on {row.seconds:.1f} s "
        f"later with 2 trainer(s) from epoch 2 step {row.resumed_step}, {row.steps_lost} step(s) lost"
    )
    assert [line.split()[1] for line in printed[1:]] == ["epoch=0", "epoch=1", "epoch=2", "epoch=3"]
    assert printed[3].endswith(" (restarted)") and "(restarted)" not in printed[4]


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_a_worker_lost_before_its_trainer_started_is_a_restart(store, client, straight):
    """A trainer's actor may only start on its worker: when the worker died first (here while a task held its one
    thread; in the wild while it imported torch), the run waited for it for good."""
    from dask_dl.train.placement import place_trainers

    live_workers(client, 4)
    victim = place_trainers(client, 2)[1]  # the worker rank 1 will be placed on
    busy = client.submit(time.sleep, 600, workers=[victim], allow_other_workers=False, pure=False)
    wait_until(lambda: client.processing([victim])[victim], what="the task that holds the worker's thread")
    run = fit(store, client, wait=False)
    assert run.workers[1] == victim
    wait_until(
        lambda: client.run_on_scheduler(_actor_waits, prefix=f"dask-dl-trainer-{run.run_id}-1"),
        what="rank 1's actor waiting for the worker's thread",
    )
    os.kill(pid_of(client, victim), signal.SIGKILL)
    run.wait(timeout=300)
    busy.cancel()
    assert run.status == "finished"
    restarts = run.restarts
    assert len(restarts) == 1 and restarts.loc[0, "lost_workers"] == victim
    assert restarts.loc[0, "error"].startswith(f"TrainingError: {run.run_id}: the worker(s) {victim} left before")
    assert (restarts.loc[0, "failed_epoch"], restarts.loc[0, "resumed_epoch"], restarts.loc[0, "steps_lost"]) == (
        -1,
        0,
        0,
    )
    assert victim not in run.workers and list(run.history["event"]) == ["restarted", "", "", ""]
    printed = CliRunner().invoke(click.command()(lambda: _echo_training(run, (0, 4), False))).output
    assert printed.startswith(f"{run.run_id}: lost {victim} before training started (TrainingError: ")
    assert_same_weights(run.checkpoint()["model"], straight)  # it started over, as if nothing had happened
    live_workers(client, 4)


def _actor_waits(dask_scheduler, prefix: str) -> bool:
    return any(str(k).startswith(prefix) and ts.state == "processing" for k, ts in dask_scheduler.tasks.items())


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_resume_from_a_step_checkpoint_is_identical(store, client, straight, tmp_path):
    ck = tmp_path / "ck"
    run = fit(store, client, checkpoint_dir=str(ck), checkpoint_every_steps=5, wait=False)
    wait_until(lambda: list(ck.glob("step-0001-*.pt")) or run.done, what="a step checkpoint of epoch 1")
    run.stop().wait(timeout=120)
    assert run.status == "stopped" and list(run.history["event"]) == ["", "stopped"]
    (saved,) = ck.glob("step-0001-*.pt")
    resumed = fit(store, client, checkpoint_dir=str(ck), resume=True)
    assert list(resumed.history["event"]) == ["", "resumed", "", ""]
    assert list(resumed.history["samples"]) == [STEPS * 2] * 4 and not resumed.history["samples_repeated"].any()
    assert int(saved.name.split("-")[2].split(".")[0]) % 5 == 0
    assert_same_weights(resumed.checkpoint()["model"], straight)


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_a_killed_fsdp_trainer_recovers_from_sharded_step_checkpoints(store, client, tmp_path):
    """The same kill in an FSDP run: the restart loads the step checkpoint's shards and the loader's position, and
    the run ends with the weights of an uninterrupted FSDP run, bit for bit."""
    live_workers(client, 4)
    options = dict(parallel="fsdp", compression="none", epochs=3)
    straight = fit(store, client, **options).checkpoint()["model"]
    ck = tmp_path / "ck"
    run = fit(store, client, **options, checkpoint_dir=str(ck), checkpoint_every_steps=3, wait=False)
    victim = kill_after_a_step_checkpoint(run, client, ck, epoch=1)
    assert run.status == "finished"
    restarts = run.restarts
    assert len(restarts) == 1 and restarts.loc[0, "lost_workers"] == victim and restarts.loc[0, "world_size"] == 2
    assert restarts.loc[0, "resumed_epoch"] >= 1 and restarts.loc[0, "resumed_step"] > 0
    assert list(run.history["samples"]) == [STEPS * 2] * 3 and not run.history["samples_repeated"].any()
    assert_same_weights(run.checkpoint()["model"], straight)
    assert not list(ck.glob("step-*"))  # the epochs' checkpoints removed the step files and their shards
    live_workers(client, 4)


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_fsdp_workers_that_change_rank_between_runs_save_and_load_their_own_shards(store, client, tmp_path):
    """A worker that was rank 1 of one FSDP run and is rank 0 of the next (and back): DTensor's caches once handed
    the new run tensors on the old run's mesh, so the worker saved (and loaded) its old rank's shard."""
    live_workers(client, 4)
    a, b, c = sorted(scheduler_workers(client))[:3]  # trainers take their ranks in this order
    options = dict(parallel="fsdp", compression="none", batch_size=8)
    whole = fit(store, client, **options, epochs=2, workers=[a, b]).checkpoint()["model"]
    first = fit(store, client, **options, epochs=1, workers=[b, c], checkpoint_dir=str(tmp_path / "ck"))
    assert first.workers == [b, c] and first.status == "finished"  # b: rank 1, then rank 0
    resumed = fit(store, client, **options, epochs=2, workers=[a, b], checkpoint_dir=str(tmp_path / "ck"), resume=True)
    assert resumed.workers == [a, b] and list(resumed.history["event"]) == ["", "resumed"]  # b: rank 1 again
    assert_same_weights(resumed.checkpoint()["model"], whole)


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_an_fsdp_run_on_two_trainers_goes_on_with_one(store, client, tmp_path):
    """FSDP at another world size: the killed rank's worker comes back at a new address, outside the run's
    workers, so the restart goes on with the one trainer left, its shards re-sharded from the step checkpoint."""
    live_workers(client, 4)
    pair = sorted(scheduler_workers(client))[:2]
    ck = tmp_path / "ck"
    with dask.config.set({"dask-dl.train.restart-wait": 2}):
        run = fit(
            store,
            client,
            parallel="fsdp",
            compression="none",
            epochs=3,
            workers=pair,
            min_trainers=1,
            checkpoint_dir=str(ck),
            checkpoint_every_steps=3,
            wait=False,
        )
    victim = kill_after_a_step_checkpoint(run, client, ck, epoch=1)
    assert run.status == "finished" and run.workers == [w for w in pair if w != victim]
    restarts = run.restarts
    assert len(restarts) == 1 and restarts.loc[0, "lost_workers"] == victim and restarts.loc[0, "world_size"] == 1
    assert restarts.loc[0, "resumed_epoch"] == 1 and restarts.loc[0, "resumed_step"] > 0
    history = run.history.set_index("epoch")
    assert list(history["event"]) == ["", "restarted", ""]
    # every row of the interrupted epoch once: 2 trainers before the step checkpoint, the rest on one
    assert history.loc[1, "samples"] == STEPS * 2 and history.loc[1, "samples_repeated"] == 0
    assert history.loc[2, "samples"] == STEPS * 2 and history.loc[2, "global_batch"] == 1
    assert np.isfinite(history["train_loss"]).all() and np.isfinite(history["val_loss"]).all()
    live_workers(client, 4)


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_a_pipeline_that_lost_a_replica_goes_on_with_one(store, client, tmp_path):
    """2 replicas of a 2-stage pipeline lose replica 1's last stage: the restart goes on with replica 0's stages
    alone, from the step checkpoint, the epoch's remaining rows re-sharded for one replica."""
    live_workers(client, 4)
    four = sorted(scheduler_workers(client))[:4]
    ck = tmp_path / "ck"
    with dask.config.set({"dask-dl.train.restart-wait": 2}):
        run = fit(
            store,
            client,
            parallel="pipeline",
            stages=2,
            microbatches=2,
            batch_size=2,
            trainers=4,
            compression="none",
            epochs=3,
            workers=four,
            min_trainers=2,
            checkpoint_dir=str(ck),
            checkpoint_every_steps=3,
            wait=False,
        )
    wait_until(lambda: list(ck.glob("step-0001-*.pt")) or run.done, what="a step checkpoint of epoch 1")
    victim = run.workers[3]
    os.kill(pid_of(client, victim), signal.SIGKILL)
    run.wait(timeout=300)
    assert run.status == "finished" and len(run.workers) == 2 and victim not in run.workers
    restarts = run.restarts
    assert len(restarts) == 1 and restarts.loc[0, "lost_workers"] == victim and restarts.loc[0, "world_size"] == 2
    assert restarts.loc[0, "resumed_epoch"] == 1 and restarts.loc[0, "resumed_step"] > 0
    history = run.history.set_index("epoch")
    assert list(history["event"]) == ["", "restarted", ""]
    assert list(history["global_batch"]) == [4, 2, 2]  # batch_size x replicas
    assert history.loc[0, "steps"] == 64 // 4 and history.loc[2, "steps"] == 64 // 2
    assert np.isfinite(history["train_loss"]).all()
    # the consolidated checkpoint of the replica left scores the validation split as its stages did
    assert validation_loss(store, run.model()) == pytest.approx(history.loc[2, "val_loss"], rel=1e-5)
    live_workers(client, 4)


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_more_failures_than_max_restarts_is_a_clear_error(store, client):
    live_workers(client, 4)
    run = fit(store, client, epochs=500, max_restarts=1, wait=False)  # no checkpoint_dir: in-memory checkpoints
    wait_until(lambda: len(run.history) >= 1 or run.done, what="the first epoch")
    first = run.workers[0]  # rank 0: the driver takes the checkpoint from rank 1, which every rank keeps
    os.kill(pid_of(client, first), signal.SIGKILL)
    wait_until(lambda: len(run.restarts) == 1 and run.status == "running" or run.done, what="the restart")
    assert run.restarts.loc[0, "lost_workers"] == first and first not in run.workers
    second = run.workers[1]
    os.kill(pid_of(client, second), signal.SIGKILL)
    with pytest.raises(TrainingError, match=r"gave up after 1 restart\(s\) \(max_restarts=1\).*trainer 1 on .* lost"):
        run.wait(timeout=120)
    assert run.error.lost_workers == [second]
    live_workers(client, 4)


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_a_worker_lost_for_good_finishes_on_fewer_trainers(store, client, cluster, tmp_path):
    """Last in this module: the cluster keeps one worker fewer."""
    live_workers(client, 4)
    ck = tmp_path / "ck"
    # with 4 ranks, a survivor that waits on another survivor (not on the lost rank) sees the failure only at the
    # collective's timeout: a short one keeps this test short
    with dask.config.set({"dask-dl.train.restart-wait": 2, "dask-dl.train.timeout": 10}):
        run = fit(
            store, client, trainers=4, checkpoint_dir=str(ck), checkpoint_every_steps=2, min_trainers=1, wait=False
        )
    wait_until(lambda: list(ck.glob("step-0001-*.pt")) or run.done, what="a step checkpoint of epoch 1")
    victim = run.workers[2]
    (nanny,) = [n for n in cluster.workers.values() if n.worker_address == victim]
    nanny.status = Status.closing_gracefully  # its worker's exit then closes the nanny: no worker comes back
    os.kill(pid_of(client, victim), signal.SIGKILL)
    run.wait(timeout=300)
    assert run.status == "finished" and len(run.workers) == 3 and victim not in run.workers
    restarts = run.restarts
    assert restarts.loc[0, "lost_workers"] == victim and restarts.loc[0, "world_size"] == 3
    assert restarts.loc[0, "resumed_epoch"] == 1 and restarts.loc[0, "resumed_step"] >= 2
    history = run.history.set_index("epoch")
    assert history.loc[1, "event"] == "restarted"
    # the interrupted epoch: every sample its 4 trainers had planned (16 steps x 4) trained on exactly once,
    # those before the step checkpoint by 4 trainers, the rest re-sharded over 3
    assert history.loc[1, "samples"] == 64 and history.loc[1, "samples_repeated"] == 0
    for later in (2, 3):  # then whole epochs on 3 trainers: 21 steps x 3
        assert history.loc[later, "samples"] == 63 and history.loc[later, "samples_repeated"] == 0


@pytest.mark.slow  # a 4-worker cluster whose workers are killed
def test_an_fsdp_run_that_lost_a_worker_for_good_goes_on_with_its_shards_resharded(store, client, cluster, tmp_path):
    """After the test above (last in this module with it): FSDP on every worker left, one of them lost for good;
    the restart on one trainer fewer loads the step checkpoint's shards re-sharded and the epoch's remaining rows."""
    workers = len(scheduler_workers(client))
    assert workers >= 2
    ck = tmp_path / "ck"
    with dask.config.set({"dask-dl.train.restart-wait": 2, "dask-dl.train.timeout": 10}):
        run = fit(
            store,
            client,
            parallel="fsdp",
            compression="none",
            epochs=3,
            trainers=workers,
            checkpoint_dir=str(ck),
            checkpoint_every_steps=2,
            min_trainers=1,
            wait=False,
        )
    wait_until(lambda: list(ck.glob("step-0001-*.pt")) or run.done, what="a step checkpoint of epoch 1")
    victim = run.workers[-1]
    (nanny,) = [n for n in cluster.workers.values() if n.worker_address == victim]
    nanny.status = Status.closing_gracefully
    os.kill(pid_of(client, victim), signal.SIGKILL)
    run.wait(timeout=300)
    assert run.status == "finished" and len(run.workers) == workers - 1 and victim not in run.workers
    restarts = run.restarts
    assert restarts.loc[0, "world_size"] == workers - 1 and restarts.loc[0, "resumed_epoch"] == 1
    assert restarts.loc[0, "resumed_step"] > 0  # from the step checkpoint's shards, not from epoch 0's
    history = run.history.set_index("epoch")
    planned = 64 // workers * workers  # what the epoch's trainers had planned, each row once
    assert history.loc[1, "event"] == "restarted"
    assert history.loc[1, "samples"] == planned and history.loc[1, "samples_repeated"] == 0
    assert history.loc[2, "samples"] == 64 // (workers - 1) * (workers - 1)
    assert np.isfinite(history["train_loss"]).all()  # the loaded shards' exactness: test_parallel's one-trainer load
