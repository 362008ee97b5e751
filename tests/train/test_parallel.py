"""parallel="fsdp" and parallel="pipeline" on real gloo ranks in a real LocalCluster (2 worker processes).

Exactness: a few steps of FSDP (2 trainers x batch b) and of a 2-stage pipeline (micro-batched) end with the
weights and losses of one process training the same model on the same batches, to float tolerance. Then the
sharded checkpoints resume and export, the memory budget picks FSDP over DDP, and compressors that do not apply
fail before any actor is placed.
"""

from __future__ import annotations

import time

import dask
import numpy as np
import onnxruntime
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import dask_dl
from dask_dl import ConfigurationError, TrainingError
from dask_dl.data.loader import ChunkLoader
from dask_dl.errors import CheckpointError
from dask_dl.models import MODELS, build_model
from dask_dl.normalize import normalize
from dask_dl.testing.servers import free_port
from dask_dl.testing.train import fit_squares, squares_collection
from dask_dl.train.checkpoint import save_checkpoint
from dask_dl.train.options import check_run
from dask_dl.train.parallel import check_parallel, data_shard
from dask_dl.train.parallel.memory import estimate_memory, parse_budget
from dask_dl.train.parallel.split import assign_stages, blocks, check_split, stage_names

N_TRAIN, SIZE, LR = 64, 32, 0.05
MODEL = dict(model="small_cnn", model_kwargs={"width": 8})


def fit(store, client, **kwargs):
    return fit_squares(store, client, **{**MODEL, "lr": LR, "seed": 3, **kwargs})


def train_samples(store) -> np.ndarray:
    ds = dask_dl.open_dataset(store)
    return ds.sample.values[ds.split.values == "train"]


def new_model() -> nn.Module:
    torch.manual_seed(3)  # the trainers' seed: every rank builds these initial weights
    return build_model("small_cnn", num_outputs=2, width=8)


# ---- one process, the same batches -------------------------------------------------------------------------


def data_parallel_reference(store, *, b: int, trainers: int, epochs: int) -> tuple[dict, list[float]]:
    """Weights and per-epoch mean losses of ``trainers`` ranks of batch ``b`` with averaged gradients, in one process.

    BatchNorm sees each rank's batch on its own and rank 0's running statistics are kept (FSDP does not shard
    buffers and each rank updates its own; DDP broadcasts rank 0's), so the reference normalizes each rank's part
    alone and keeps rank 0's buffers.
    """
    loaders = [
        ChunkLoader(store, train_samples(store), batch_size=b, rank=r, world_size=trainers, seed=3, prefetch=0)
        for r in range(trainers)
    ]
    model = new_model().train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for epoch in range(epochs):
        step_losses = []
        for batches in zip(*(loader.epoch(epoch) for loader in loaders), strict=True):
            opt.zero_grad()
            rank_losses, rank0_buffers = [], None
            for r, (x, y) in enumerate(batches):
                rank_losses.append(F.binary_cross_entropy_with_logits(model(x), y))
                if r == 0:
                    rank0_buffers = {k: v.clone() for k, v in model.named_buffers()}
            loss = torch.stack(rank_losses).mean()  # each rank's mean loss, gradients averaged over ranks
            loss.backward()
            with torch.no_grad():
                for k, v in model.named_buffers():
                    v.copy_(rank0_buffers[k])
            opt.step()
            step_losses.append(float(loss.detach()))
        losses.append(float(np.mean(step_losses)))
    return model.state_dict(), losses


def pipeline_reference(store, *, b: int, microbatches: int, epochs: int = 1) -> tuple[dict, list[float]]:
    """One process accumulating the gradients of ``microbatches`` equal parts of each batch; per-epoch losses."""
    loader = ChunkLoader(store, train_samples(store), batch_size=b, rank=0, world_size=1, seed=3, prefetch=0)
    model = new_model().train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for epoch in range(epochs):
        step_losses = []
        for x, y in loader.epoch(epoch):
            opt.zero_grad()
            parts = [
                F.binary_cross_entropy_with_logits(model(xs), ys)
                for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)
            ]
            loss = torch.stack(parts).mean()
            loss.backward()
            opt.step()
            step_losses.append(float(loss.detach()))
        losses.append(float(np.mean(step_losses)))
    return model.state_dict(), losses


def validation_loss(store, model: nn.Module) -> float:
    """The mean loss of ``model`` (in eval mode) over every image of the validation split, in one process."""
    ds = dask_dl.open_dataset(store)
    val = ChunkLoader(
        store, ds.sample.values[ds.split.values == "val"], batch_size=16, shuffle=False, drop_last=False, prefetch=0
    )
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in val.epoch(0):
            total += float(F.binary_cross_entropy_with_logits(model.eval()(x), y, reduction="none").mean(1).sum())
            count += len(x)
    assert count == 32
    return total / count


def assert_weights(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)
    initial = new_model().state_dict()  # and training moved the weights well beyond that tolerance
    assert max(float((got[k] - initial[k]).abs().max()) for k in got if got[k].is_floating_point()) > 1e-2


# ---- 1. FSDP ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fsdp_matches_one_process_and_resumes_from_its_shards(store, cluster_client, tmp_path):
    directory = tmp_path / "ck"
    # a budget between FSDP's and DDP's need: DDP refuses it before any actor (below), FSDP trains under it
    model = build_model("small_cnn", num_outputs=2, width=8)
    ddp = estimate_memory(model, parallel="ddp", trainers=2).total
    fsdp = estimate_memory(model, parallel="fsdp", trainers=2).total
    assert fsdp < ddp
    budget = (fsdp + ddp) // 2
    run = fit(store, cluster_client, parallel="fsdp", checkpoint_dir=str(directory), memory_budget=budget)
    assert run.status == "finished"
    # the epoch's shards, one file per rank, and the consolidated checkpoint written after them
    assert sorted(p.name for p in (directory / "epoch-0000.dcp").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    ck = run.checkpoint()
    assert ck["parallel"] == {"kind": "fsdp", "trainers": 2, "sharded": "epoch-0000.dcp"}
    assert ck["optimizer"] == {}  # the optimizer state lives in the shards only
    expected, losses = data_parallel_reference(store, b=8, trainers=2, epochs=2)
    first, _ = data_parallel_reference(store, b=8, trainers=2, epochs=1)
    assert_weights(ck["model"], first)
    assert run.history["train_loss"].iloc[0] == pytest.approx(losses[0], rel=1e-5)
    assert run.history["steps"].iloc[0] == N_TRAIN // 16

    # resume: epoch 1 from the shards (parameters and momentum) equals an uninterrupted two-epoch run
    resumed = fit(store, cluster_client, parallel="fsdp", checkpoint_dir=str(directory), resume=True, epochs=2)
    assert list(resumed.history["event"]) == ["", "resumed"]
    assert_weights(resumed.checkpoint()["model"], expected)
    assert resumed.history["train_loss"].iloc[1] == pytest.approx(losses[1], rel=1e-5)

    # the consolidated model exports (export_onnx checks onnxruntime against torch); scores are the reference's
    onnx_path = dask_dl.export_onnx(resumed, tmp_path / "fsdp.onnx")
    images = np.random.default_rng(1).integers(0, 256, (3, SIZE, SIZE), dtype=np.uint8)
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: images[:, None].astype(np.float32)})[0]
    reference = new_model()
    reference.load_state_dict(expected)
    with torch.no_grad():
        want = torch.sigmoid(reference.eval()(normalize(images))).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    # a DDP run cannot resume an FSDP checkpoint: the message says how
    with pytest.raises(TrainingError, match=r"parallel='fsdp'.*resume with parallel='fsdp'"):
        fit(store, cluster_client, checkpoint_dir=str(directory), resume=True, epochs=3)


def wait_until(condition, *, within: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("parallel", ["fsdp", "pipeline"])
@pytest.mark.slow
def test_step_checkpoints_resume_inside_an_epoch_bit_for_bit(store, cluster_client, tmp_path, parallel):
    """32 steps per epoch (batch 1 per FSDP trainer; batch 2 per pipeline of 2 stages), a step checkpoint every 5
    steps, stopped at a step the test does not choose; resumed from it, the run ends with the weights of an
    uninterrupted one, bit for bit."""
    options = dict(parallel=parallel, batch_size=1 if parallel == "fsdp" else 2, epochs=3)
    uninterrupted = fit(store, cluster_client, **options)
    straight = uninterrupted.checkpoint()["model"]
    ck = tmp_path / "ck"
    run = fit(store, cluster_client, **options, checkpoint_dir=str(ck), checkpoint_every_steps=5, wait=False)
    wait_until(lambda: list(ck.glob("step-0001-*.pt")) or run.done, what="a step checkpoint of epoch 1")
    run.stop().wait(timeout=120)
    assert run.status == "stopped" and run.history["event"].iloc[-1] == "stopped"
    (saved,) = ck.glob("step-*.pt")  # the newest only
    step = torch.load(saved, weights_only=True)
    assert step["global_step"] % 5 == 0 and step["position"]["epoch"] >= 1
    if parallel == "fsdp":  # with its shards, and no others
        assert sorted(p.name for p in ck.glob("step-*.dcp")) == [f"{saved.stem}.dcp"]
        assert sorted(p.name for p in (ck / f"{saved.stem}.dcp").iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]
        assert step["parallel"] == {"kind": "fsdp", "trainers": 2, "sharded": f"{saved.stem}.dcp"}
        assert step["optimizer"] == {}
    else:  # consolidated; both stages read the same batches: one position in the data
        assert step["parallel"] == {"kind": "pipeline", "trainers": 2, "stages": 2}
        assert len(step["optimizer"]["stages"]) == 2
        assert [s["world_size"] for s in step["position"]["segments"]] == [1]
    assert len(step["partial"]) == 2  # every trainer's loss sums

    resumed = fit(store, cluster_client, **options, checkpoint_dir=str(ck), resume=True)
    assert resumed.history["event"].iloc[step["position"]["epoch"]] == "resumed"
    # the interrupted epoch's loss too: every trainer's loss sum went on from its step checkpoint's
    assert list(resumed.history["train_loss"]) == list(uninterrupted.history["train_loss"])
    if parallel == "fsdp":  # pipelines do not count samples (their stages serve the same rows)
        assert list(resumed.history["samples"]) == [N_TRAIN] * 3 and not resumed.history["samples_repeated"].any()
    got = resumed.checkpoint()["model"]
    assert set(got) == set(straight)
    for name, value in straight.items():
        assert torch.equal(got[name], value), name
    assert not list(ck.glob("step-*"))  # the epochs' checkpoints removed the step files (and shards)


@pytest.mark.slow
def test_a_damaged_shard_file_fails_the_resume_with_its_cause(store, cluster_client, tmp_path):
    """torch.distributed.checkpoint's errors are BaseExceptions, which Dask's actor calls do not pass on: the
    driver must report what went wrong, not "Unable to contact Actor's worker"."""
    directory = tmp_path / "ck"
    fit(store, cluster_client, parallel="fsdp", checkpoint_dir=str(directory))
    shard = directory / "epoch-0000.dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:64])
    with pytest.raises(CheckpointError) as failed:
        fit(store, cluster_client, parallel="fsdp", checkpoint_dir=str(directory), resume=True, epochs=2)
    message = str(failed.value)
    assert message.startswith(f"the sharded checkpoint '{directory}/epoch-0000.dcp' cannot be read (rank 0: ")
    assert "rank 1: EOFError" in message and "Unable to contact" not in message and "Traceback" not in message
    assert message.endswith(
        f"resume from an earlier checkpoint by removing '{directory}/epoch-0000.pt', or train "
        "afresh with another checkpoint_dir"
    )
    assert fit(store, cluster_client, parallel="fsdp").status == "finished"  # the workers are as good as new


def _load_shards_on_one_trainer(rank: int, path: str, port: int, out: str) -> None:
    """A world of one: build the sharded model as a trainer does, load ``path``'s shards, save the full state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from dask_dl.checkpoint import load_checkpoint
    from dask_dl.train.parallel.fsdp import ShardedModel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    try:
        sharded = ShardedModel(new_model(), device=torch.device("cpu"), world_size=1, input_shape=(1, SIZE, SIZE))
        optimizer = torch.optim.SGD(sharded.module.parameters(), lr=LR, momentum=0.9)
        sharded.load(load_checkpoint(path), optimizer, source=path)
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(sharded.module, options=full)
        state = get_optimizer_state_dict(sharded.module, optimizer, options=full)
        torch.save({"model": model, "optimizer": state}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_shards_of_two_trainers_load_on_one(store, cluster_client, tmp_path):
    """What a restart on fewer trainers does with a sharded checkpoint: the shards written by 2 ranks, loaded by a
    world of 1, give back the whole model and the optimizer state that the 2 ranks consolidate, exactly."""
    sharded = fit(store, cluster_client, parallel="fsdp", checkpoint_dir=str(tmp_path / "ck"))
    consolidated = fit(store, cluster_client, parallel="fsdp").checkpoint()  # no directory: the whole optimizer
    path = str(tmp_path / "ck" / "epoch-0000.pt")
    args = (path, free_port(), str(tmp_path / "one.pt"))  # forked from the warm server, as in test_hooks.py
    mp.start_processes(_load_shards_on_one_trainer, args=args, nprocs=1, join=True, start_method="forkserver")
    loaded = torch.load(tmp_path / "one.pt", weights_only=True)
    assert set(loaded["model"]) == set(consolidated["model"])
    for name, value in consolidated["model"].items():
        assert torch.equal(loaded["model"][name], value), name
        assert torch.equal(sharded.checkpoint()["model"][name], value), name  # the two runs are the same run
    momentum = {name: state["momentum_buffer"] for name, state in consolidated["optimizer"]["state"].items()}
    assert set(momentum) == set(dict(new_model().named_parameters()))  # every parameter's
    for name, value in momentum.items():
        assert torch.equal(loaded["optimizer"]["state"][name]["momentum_buffer"], value), name
        assert float(value.abs().max()) > 0


@pytest.mark.slow
def test_fsdp_validation_with_more_batches_on_one_rank(tmp_path_factory, cluster_client):
    """33 validation images: rank 0 scores 17 (3 batches), rank 1 16 (2 batches, then one empty forward)."""
    root = tmp_path_factory.mktemp("odd")
    store = str(root / "odd.zarr")
    dask_dl.ingest(
        squares_collection(root, n_val=33), store, size=SIZE, chunk=8, shard=2, client=cluster_client, progress=False
    )
    run = fit(store, cluster_client, parallel="fsdp")
    ds = dask_dl.open_dataset(store)
    val = ChunkLoader(
        store, ds.sample.values[ds.split.values == "val"], batch_size=8, shuffle=False, drop_last=False, prefetch=0
    )
    model, total, count = run.model(), 0.0, 0
    with torch.no_grad():  # every image scored once, with rank 0's BatchNorm statistics (the checkpoint's)
        for x, y in val.epoch(0):
            total += float(F.binary_cross_entropy_with_logits(model(x), y, reduction="none").mean(1).sum())
            count += len(x)
    assert count == 33
    assert run.history["val_loss"].iloc[0] == pytest.approx(total / count, rel=1e-5)

    # without checkpoint_dir the checkpoint holds the consolidated optimizer state: written out, it resumes too
    ck = run.checkpoint()
    assert ck["parallel"] == {"kind": "fsdp", "trainers": 2} and ck["optimizer"]["state"]
    directory = str(tmp_path_factory.mktemp("odd-ck"))
    save_checkpoint(ck, directory)
    resumed = fit(store, cluster_client, parallel="fsdp", checkpoint_dir=directory, resume=True, epochs=2)
    assert list(resumed.history["event"]) == ["", "resumed"]
    expected, losses = data_parallel_reference(store, b=8, trainers=2, epochs=2)
    assert_weights(resumed.checkpoint()["model"], expected)
    assert resumed.history["train_loss"].iloc[1] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.parametrize("parallel", ["fsdp", "pipeline"])
@pytest.mark.slow
def test_colour_collections_train_sharded_and_in_stages(tmp_path_factory, cluster_client, parallel):
    """channels=3: the first stage, FSDP's empty validation batches and the checks take three channels."""
    from dask_dl.data.synthetic import make_collection

    root = tmp_path_factory.mktemp(f"colour-{parallel}")
    catalog = dask_dl.read_folders(make_collection(root / "discs", per_class=8, val_per_class=5, size=SIZE))
    store = str(root / "colour.zarr")
    dask_dl.ingest(catalog, store, size=SIZE, chunk=8, shard=2, channels=3, client=cluster_client, progress=False)
    options = {"stages": 2, "microbatches": 2} if parallel == "pipeline" else {}
    run = fit(store, cluster_client, parallel=parallel, batch_size=4, **options)
    ck = run.checkpoint()
    assert ck["in_channels"] == 3 and ck["model"]["features.0.weight"].shape[1] == 3
    assert np.isfinite(run.history["val_loss"].iloc[0])


def test_ddp_over_the_memory_budget_fails_before_any_actor(store, cluster_client):
    model = build_model("small_cnn", num_outputs=2, width=8)
    fsdp = estimate_memory(model, parallel="fsdp", trainers=2).total
    ddp = estimate_memory(model, parallel="ddp", trainers=2).total
    budget = (fsdp + ddp) // 2
    with pytest.raises(
        ConfigurationError, match=r"needs about .* per trainer with parallel='ddp'.*use parallel='fsdp'"
    ):
        fit(store, cluster_client, memory_budget=budget)
    with pytest.raises(ConfigurationError, match=r"over the memory budget of .*; use more trainers"):
        fit(store, cluster_client, parallel="fsdp", memory_budget=fsdp // 4)
    assert not cluster_client.run_on_scheduler(
        lambda dask_scheduler: [k for k in dask_scheduler.tasks if "dask-dl-trainer" in str(k)]
    )


def test_memory_estimates():
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 6))  # 110 + 66 parameters
    ddp = estimate_memory(model, parallel="ddp", trainers=2, optimizer="adamw")
    assert (ddp.parameters, ddp.gradients, ddp.optimizer, ddp.total) == (4 * 176, 4 * 176, 8 * 176, 16 * 176)
    sgd = estimate_memory(model, parallel="ddp", trainers=2, optimizer="sgd", momentum=0.0)
    assert sgd.total == 8 * 176  # no momentum buffer
    fsdp = estimate_memory(model, parallel="fsdp", trainers=2)
    assert (fsdp.parameters, fsdp.optimizer, fsdp.gathered) == (4 * 88, 4 * 88, 2 * 4 * 110)
    pipe = estimate_memory(model, parallel="pipeline", trainers=2, stages=2)
    assert pipe.parameters == 4 * 110  # the larger stage
    assert parse_budget("2 GiB") == 2**31 and parse_budget(1000) == 1000 and parse_budget(None) is None
    for bad in ("lots", 0, -5, True):
        with pytest.raises(ConfigurationError, match="memory_budget must be a positive number of bytes"):
            parse_budget(bad)


# ---- 2. pipeline --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.slow
def test_pipeline_matches_one_process_accumulating_microbatches(store, cluster_client, tmp_path, schedule):
    import dask

    with dask.config.set({"dask-dl.train.pipeline-schedule": schedule}):
        run = fit(
            store,
            cluster_client,
            parallel="pipeline",
            stages=2,
            microbatches=4,
            batch_size=16,
            checkpoint_dir=str(tmp_path / "ck"),
        )
    expected, losses = pipeline_reference(store, b=16, microbatches=4)
    ck = run.checkpoint()
    assert ck["parallel"] == {"kind": "pipeline", "trainers": 2, "stages": 2}
    assert len(ck["optimizer"]["stages"]) == 2
    assert_weights(ck["model"], expected)  # the stages' parameters, under the model's own names
    row = run.history.iloc[0]
    assert row["train_loss"] == pytest.approx(losses[0], rel=1e-5)
    assert row["steps"] == N_TRAIN // 16 and row["global_batch"] == 16
    # validation went through the stages: every validation image scored once, as the whole model scores it
    assert row["val_loss"] == pytest.approx(validation_loss(store, run.model()), rel=1e-5)
    if schedule == "gpipe":  # resume: each stage takes its parameters and optimizer state back
        with dask.config.set({"dask-dl.train.pipeline-schedule": schedule}):
            resumed = fit(
                store,
                cluster_client,
                parallel="pipeline",
                stages=2,
                microbatches=4,
                batch_size=16,
                checkpoint_dir=str(tmp_path / "ck"),
                resume=True,
                epochs=2,
            )
        expected, losses = pipeline_reference(store, b=16, microbatches=4, epochs=2)
        assert list(resumed.history["event"]) == ["", "resumed"]
        assert_weights(resumed.checkpoint()["model"], expected)
        assert resumed.history["train_loss"].iloc[1] == pytest.approx(losses[1], rel=1e-5)


def test_pipeline_layout_and_checks():
    assert [data_shard("pipeline", 2, r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert check_parallel("ddp", trainers=2, batch_size=8, compression="onebit")["stages"] == 1
    cases = [
        (dict(parallel="pipeline", trainers=3, stages=2), "trainers=3 is not a multiple of stages=2"),
        (dict(parallel="pipeline", stages=2, microbatches=3), "microbatches=3 does not divide batch_size=8"),
        (dict(parallel="pipeline", stages=2, microbatches=1), "1f1b schedule needs at least as many micro-batches"),
        (dict(parallel="ddp", stages=2), "stages=2 applies to parallel='pipeline' only"),
        (dict(parallel="tensor"), "unknown parallel 'tensor': use one of ddp, fsdp, pipeline"),
    ]
    for kwargs, message in cases:
        kwargs = {"trainers": 2, "batch_size": 8, "compression": "none", **kwargs}
        with pytest.raises(ConfigurationError, match=message):
            check_parallel(kwargs.pop("parallel"), **kwargs)


@pytest.mark.parametrize("name", ["small_cnn", "resnet18"])
def test_registry_models_split_into_blocks_that_compose_to_the_model(name):
    torch.manual_seed(0)
    model = build_model(name, num_outputs=3).eval()
    x = torch.randn(2, 1, 32, 32)
    parts = blocks(model)
    stages = [nn.Sequential(*group) for group in assign_stages(parts, 3)]
    assert all(len(s) for s in stages) and sum(len(s) for s in stages) == len(parts)
    with torch.no_grad():
        torch.testing.assert_close(nn.Sequential(*stages)(x), model(x), rtol=0, atol=0)
    names = [n for s in stages for n in stage_names(model, s).values()]
    assert sorted(names) == sorted(model.state_dict())  # every tensor in exactly one stage, by its own name


def test_a_model_that_cannot_be_split_fails_before_any_actor(store, cluster_client):
    @dask_dl.register_model("two_linear_unsplit")
    def two_linear(num_outputs, in_channels=1):
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Flatten(), nn.Linear(in_channels * SIZE * SIZE, num_outputs)

            def forward(self, x):
                return self.b(self.a(x))

        return Net()

    try:
        with pytest.raises(ConfigurationError, match=r"'two_linear_unsplit' \(Net\) cannot be split into pipeline"):
            fit(store, cluster_client, model="two_linear_unsplit", model_kwargs={}, parallel="pipeline")
    finally:
        MODELS._entries.pop("two_linear_unsplit")  # the registry is process-wide: leave it as the other tests see it
    with pytest.raises(ConfigurationError, match="'small_cnn' has 16 blocks, fewer than stages=17"):
        fit(store, cluster_client, parallel="pipeline", stages=17, trainers=17, batch_size=17)
    assert not cluster_client.run_on_scheduler(
        lambda dask_scheduler: [k for k in dask_scheduler.tasks if "dask-dl-trainer" in str(k)]
    )


def test_a_builder_that_needs_real_tensors_is_checked_on_the_cpu():
    def reads_values(num_outputs, in_channels=1):  # .tolist() has no meaning on torch's meta device
        scale = torch.ones(1).tolist()[0]
        return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 4, int(scale) * num_outputs))

    MODELS.register("reads_values_in_test", reads_values)
    try:
        check_split("reads_values_in_test", {}, num_outputs=2, in_channels=1, stages=2)
        with pytest.raises(ConfigurationError, match="has 2 blocks, fewer than stages=3"):
            check_split("reads_values_in_test", {}, num_outputs=2, in_channels=1, stages=3)
    finally:
        MODELS._entries.pop("reads_values_in_test")


def test_a_model_that_cannot_be_split_says_how():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(ConfigurationError, match=r"make it an nn.Sequential, or give it a method pipeline_blocks"):
        blocks(Net(), name="mine")
    net = Net()
    net.pipeline_blocks = lambda: [net.a, net.b]
    assert blocks(net) == [net.a, net.b]
    with pytest.raises(ConfigurationError, match="has 2 blocks, fewer than stages=3"):
        assign_stages(blocks(net), 3)


# ---- 3. compressors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parallel", "compression", "applies"),
    [
        ("fsdp", "onebit", "'none' or 'fp16' or 'bf16'"),
        ("fsdp", "powersgd", "'none' or 'fp16' or 'bf16'"),
        ("pipeline", "bf16", "'none'"),
    ],
)
def test_compressors_that_do_not_apply_fail_before_any_actor(store, cluster_client, parallel, compression, applies):
    message = rf"compression='{compression}' does not apply to parallel='{parallel}'"
    message += rf".*only compression={applies} applies"
    with pytest.raises(ConfigurationError, match=message):
        fit(store, cluster_client, parallel=parallel, compression=compression)
    assert not cluster_client.run_on_scheduler(
        lambda dask_scheduler: [k for k in dask_scheduler.tasks if "dask-dl-trainer" in str(k)]
    )


def test_pipelines_restart_on_whole_pipelines(store, cluster_client):
    ds = dask_dl.open_dataset(store)
    with pytest.raises(
        ConfigurationError,
        match=r"min_trainers=1 with parallel='pipeline' and stages=2: a pipeline "
        r"restarts on whole pipelines of 2 trainers \(one per stage\); pass "
        r"min_trainers=2",
    ):
        fit(store, cluster_client, parallel="pipeline", min_trainers=1)
    with pytest.raises(ConfigurationError, match=r"min_trainers=3 .* pass min_trainers=2"):
        check_run(ds, parallel="pipeline", stages=2, trainers=4, batch_size=4, min_trainers=3, **MODEL)
    options = check_run(ds, parallel="pipeline", stages=2, trainers=4, batch_size=4, min_trainers=2, **MODEL)
    assert (options.trainers, options.min_trainers) == (4, 2)
    # step checkpoints apply to every mode, the configured defaults too
    with dask.config.set({"dask-dl.train.checkpoint-every-steps": 5}):
        for parallel in ("ddp", "fsdp", "pipeline"):
            options = check_run(ds, parallel=parallel, trainers=2, batch_size=4, **MODEL)
            assert (options.checkpoint_every_steps, options.checkpoint_every_seconds) == (5, 300)
            assert options.min_trainers == 2


def test_fsdp_reduces_gradients_in_bf16(store, cluster_client):
    """compression="bf16" with FSDP: gradients reduce-scattered in bfloat16, close to float32 but not equal."""
    run = fit(store, cluster_client, parallel="fsdp", compression="bf16")
    expected, _ = data_parallel_reference(store, b=8, trainers=2, epochs=1)
    got = run.checkpoint()["model"]
    differences = [float((got[k] - v).abs().max()) for k, v in expected.items() if v.is_floating_point()]
    assert max(differences) > 1e-5  # the float32 run matches to 1e-5: bf16 rounding shows
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0.05, atol=0.01, msg=name)


def test_train_command_takes_the_parallel_options(store, cluster_client):
    from click.testing import CliRunner

    from dask_dl.cli import cli

    args = ["train", store, "--parallel", "pipeline", "--stages", "2", "--microbatches", "3", "-b", "8", "-t", "2"]
    result = CliRunner().invoke(cli, [*args, "--quiet", "--scheduler", cluster_client.scheduler.address])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [
        "error: microbatches=3 does not divide batch_size=8 (every micro-batch has the same size); pass e.g. "
        "batch_size=6"
    ]


# ---- 4. pipeline replicas (last: the module's cluster grows to 4 workers and back) ---------------------------


def replicated_pipeline_reference(store, *, b: int, microbatches: int, replicas: int) -> dict:
    """Replicas of a micro-batched pipeline averaging their gradients; replica 0's BatchNorm statistics kept."""
    loaders = [
        ChunkLoader(store, train_samples(store), batch_size=b, rank=r, world_size=replicas, seed=3, prefetch=0)
        for r in range(replicas)
    ]
    model = new_model().train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for batches in zip(*(loader.epoch(0) for loader in loaders), strict=True):
        opt.zero_grad()
        losses, replica0_buffers = [], None
        for r, (x, y) in enumerate(batches):
            chunks = zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)
            losses.append(torch.stack([F.binary_cross_entropy_with_logits(model(xs), ys) for xs, ys in chunks]).mean())
            if r == 0:
                replica0_buffers = {k: v.clone() for k, v in model.named_buffers()}
        torch.stack(losses).mean().backward()
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(replica0_buffers[k])
        opt.step()
    return model.state_dict()


@pytest.mark.slow
def test_two_replicas_of_a_two_stage_pipeline(store, own_cluster_client):
    cluster = own_cluster_client.cluster
    cluster.scale(4)
    try:
        own_cluster_client.wait_for_workers(4, timeout=120)
        run = fit(store, own_cluster_client, parallel="pipeline", stages=2, microbatches=2, batch_size=8, trainers=4)
        assert run.history["global_batch"].iloc[0] == 16 and run.history["steps"].iloc[0] == N_TRAIN // 16
        assert_weights(run.checkpoint()["model"], replicated_pipeline_reference(store, b=8, microbatches=2, replicas=2))
        # both replicas score their half of the validation split with the checkpointed (first replica's) statistics
        assert run.history["val_loss"].iloc[-1] == pytest.approx(validation_loss(store, run.model()), rel=1e-6)
    finally:
        cluster.scale(2)
