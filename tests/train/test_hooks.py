"""The compression hooks (``compression/hooks.py``, ``fused.py``, ``eager.py``) on real gloo process groups.

The distributed checks run in three worlds of real ranks (2, 2 and 3) that each do many checks and save what
they saw; the assertions are made here, against a NumPy simulation of the algorithms written independently of
the hooks (``dask_dl.testing.compression``). onebit and onebit2 run their fused CPU kernels, and the eager path too
where the check says so.
"""

from __future__ import annotations

import gc
import io
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dask_dl.testing.compression import FakeBucket, numel, sim_grouping, sim_onebit
from dask_dl.testing.servers import free_port
from dask_dl.train.compression import COMPRESSORS, make_compressor
from dask_dl.train.compression.hooks import onebit2_hook, onebit_hook
from dask_dl.train.compression.plan import plan_stripes
from dask_dl.train.compression.quantize import ColumnLayout

# wide linear and conv (grouped by rows), bias, scalar, wide matrix, then tall linear and conv and a square
# matrix (grouped by columns)
SHAPES = [(6, 20), (5, 3, 3, 3), (7,), (), (4, 9), (12, 5), (8, 1, 2, 2), (3, 3)]
NAMES = COMPRESSORS.names()


def test_a_bucket_is_described_again_when_its_parameters_change():
    """Names and shapes are kept per bucket index while the bucket holds the same parameter objects, and made
    again when DDP hands over others under that index (a rebuild), even of the same count, or when the names are
    registered again."""
    state = make_compressor("onebit").state
    w, b = (torch.nn.Parameter(torch.empty(s, device="meta")) for s in [(4, 9), (7,)])
    state.param_names = {id(w): "w", id(b): "b"}
    first = state.describe(FakeBucket([(4, 9), (7,)], torch.zeros(43), 3, params=[w, b]))
    assert first == (["w", "b"], [(4, 9), (7,)])
    assert state.describe(FakeBucket([(4, 9), (7,)], torch.zeros(43), 3, params=[w, b]))[0] is first[0]  # kept
    assert state.describe(FakeBucket([(7,), (4, 9)], torch.zeros(43), 3, params=[b, w])) == (["b", "w"], [(7,), (4, 9)])
    others = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in [(43,), (0,)]]
    assert state.describe(FakeBucket([(43,), (0,)], torch.zeros(43), 3, params=others)) == (
        ["3.0", "3.1"],
        [(43,), (0,)],
    )
    assert state.names(FakeBucket([(4, 9), (7,)], torch.zeros(43), 0, params=[w, b])) == ["w", "b"]
    state.param_names = {id(w): "fc.weight", id(b): "fc.bias"}  # registered again (on another DDP wrapper)
    assert state.names(FakeBucket([(4, 9), (7,)], torch.zeros(43), 0, params=[w, b])) == ["fc.weight", "fc.bias"]


def _run(compressor, shapes, values):
    return compressor.hook(compressor.state, FakeBucket(shapes, values.clone())).wait().clone()


def _gradients(seed, steps, n_ranks, shapes):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(numel(shapes)).astype(np.float32) for _ in range(n_ranks)] for _ in range(steps)]


def _entry(rank, world, port, outdir, checks):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {name: globals()[name](rank, world) for name in checks}
        # every rank done with its collectives before any tears the group down, and the checks' DDP reducers
        # freed while the group exists: either left to teardown can abort the process in C++ ("terminate called
        # without an active exception")
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(outdir) / f"rank{rank}.pt")


def _run_ranks(world, tmp_path, checks):
    # the ranks fork from the test process's warm server (tests/conftest.py), as the run's workers do: a spawned
    # rank imports torch and dask_dl again, about 4 s of CPU each
    args = (world, free_port(), str(tmp_path), checks)
    mp.start_processes(_entry, args=args, nprocs=world, join=True, start_method="forkserver")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


def check_simulation(rank, world):
    """Drive onebit and onebit2 with known per-rank gradients; record outputs, residuals and bytes."""
    grads = _gradients(7, 5, world, SHAPES)
    results = {}
    for name in ("onebit", "onebit2"):
        for fused in (True, False):
            compressor = make_compressor(name, warmup_steps=1)
            compressor.state.fused = fused
            outputs, sent = [], []
            for step in grads:
                before = compressor.bytes_sent
                outputs.append(_run(compressor, SHAPES, torch.from_numpy(step[rank])))
                sent.append(compressor.bytes_sent - before)
            fresh = make_compressor(name)
            fresh.state.fused = fused
            zero = _run(fresh, SHAPES, torch.zeros(numel(SHAPES)))
            key = name if fused else f"{name}-eager"
            results[key] = {"outputs": outputs, "sent": sent, "state": compressor.state_dict(), "zero": zero}
    return results


LARGE = [(512, 1024), (512,)]  # a layer big enough that 1-bit's scales are small beside its signs


def check_bytes(rank, world):
    g = torch.randn(numel(LARGE), generator=torch.Generator().manual_seed(rank))
    sent = {}
    for name in NAMES:
        options = {"rank": 2} if name == "powersgd" else {}
        compressor = make_compressor(name, warmup_steps=2, **options)
        per_step = []
        for _ in range(4):
            before = compressor.bytes_sent
            _run(compressor, LARGE, g)
            per_step.append(compressor.bytes_sent - before)
        sent[name] = per_step
    return sent


def check_convergence(rank, world):
    """SGD on sum_r ||X_r W^T - Y_r||^2 / 2k with the compressed mean gradient; ranks hold different data."""
    k, d, m, delta = 64, 32, 16, 0.35
    gen = torch.Generator().manual_seed(3)
    xs = [torch.linalg.qr(torch.randn(k, d, generator=gen, dtype=torch.float64)).Q * k**0.5 for _ in range(world)]
    w0 = torch.randn(m, d, generator=gen, dtype=torch.float64)
    ys = [x @ (w0 + delta * torch.randn(m, d, generator=gen, dtype=torch.float64)).T for x in xs]
    optimum = torch.linalg.lstsq(torch.cat(xs), torch.cat(ys)).solution.T
    x, y = xs[rank], ys[rank]
    distance = {}
    for name in ("onebit", "onebit2"):
        for error_feedback in (True, False):
            compressor = make_compressor(name, error_feedback=error_feedback)
            w = torch.zeros(m, d, dtype=torch.float64)
            for t in range(1200 if error_feedback else 300):  # without, it has stalled long before 300
                grad = ((x @ w.T - y).T @ x / k).float().reshape(-1)
                mean = _run(compressor, [(m, d)], grad)
                w -= 0.5 / (1 + t / 10) * mean.double().view(m, d)  # a decaying rate, as error feedback needs
            distance[f"{name}-{error_feedback}"] = float((w - optimum).norm() / optimum.norm())
    return distance


def _ddp_model(bias: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32, bias=bias), torch.nn.Tanh(), torch.nn.Linear(32, 4, bias=bias))
    return torch.nn.parallel.DistributedDataParallel(model)


def _train(ddp, optimizer, compressor, batches):
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def check_ddp_training(rank, world):
    """A real DDP model trained with each compressor; then a resume from a state_dict checkpoint."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(32, 20, generator=gen)
    y = torch.tanh(x[:, :4] * 2)
    batches = [(x, y)] * 12
    results = {}
    for name in NAMES:
        for bias in (True, False) if name == "powersgd" else (True,):
            # without biases every matrix is compressed: torch's hook allreduces an empty tensor (issue 58467)
            options = {"rank": 2, "min_compression_rate": 1.0 if not bias else 2.0} if name == "powersgd" else {}

            def fresh(name=name, bias=bias, options=options):
                ddp = _ddp_model(bias)
                compressor = make_compressor(name, warmup_steps=2, **options)
                compressor.register(ddp)
                return ddp, torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.5), compressor

            ddp, optimizer, compressor = fresh()
            losses = _train(ddp, optimizer, compressor, batches[:8])
            saved = io.BytesIO()
            torch.save(
                {
                    "model": ddp.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "compressor": compressor.state_dict(),
                },
                saved,
            )
            _train(ddp, optimizer, compressor, batches[8:])
            straight = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
            saved.seek(0)
            checkpoint = torch.load(saved, weights_only=True)
            ddp, optimizer, compressor = fresh()
            ddp.module.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            compressor.load_state_dict(checkpoint["compressor"])
            _train(ddp, optimizer, compressor, batches[8:])
            resumed = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
            results[f"{name}-bias{bias}"] = {
                "losses": losses,
                "weights": straight,
                "resumed": resumed,
                "bytes": compressor.bytes_sent,
            }
    return results


def _small_cnn_shapes():
    from dask_dl.models import build_model

    return [tuple(p.shape) for p in build_model("small_cnn", num_outputs=14).parameters()]


def check_small_cnn_bytes(rank, world):
    """onebit on a real DDP small_cnn: bytes counted per step, and the parameter shapes of every bucket."""
    from dask_dl.models import build_model

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(build_model("small_cnn", num_outputs=14))
    compressor = make_compressor("onebit")
    buckets = []

    def recording(state, bucket):  # DDP checks the hook's parameter name: ``bucket``
        buckets.append([tuple(g.shape) for g in bucket.gradients()])
        return onebit_hook(state, bucket)

    compressor.hook = recording
    compressor.register(ddp)
    gen = torch.Generator().manual_seed(rank)
    sent = []
    for _ in range(2):  # DDP rebuilds its buckets after the first step
        before, buckets[:] = compressor.bytes_sent, []
        x = torch.randn(4, 1, 32, 32, generator=gen)
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        sent.append({"bytes": compressor.bytes_sent - before, "buckets": list(buckets)})
    return sent


class Shuffled(torch.nn.Module):
    """Parameters registered in another order than backward produces their gradients: DDP's buckets differ
    before and after it rebuilds them (after the first step, and again in a resumed run)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(48, 4)
        self.inner = torch.nn.Linear(48, 48)
        self.stem = torch.nn.Linear(20, 48)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(torch.tanh(self.stem(x)))))


def check_onebit2_ddp_bytes(rank, world):
    """onebit2 from step 0 (no warm-up) on a DDP model whose buckets change at the rebuild and on resume: the
    bytes of every step, the buckets each step saw, and the weights of a straight and a resumed run."""
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [(torch.randn(16, 20, generator=gen), torch.randn(16, 4, generator=gen)) for _ in range(6)]

    def fresh():
        ddp = torch.nn.parallel.DistributedDataParallel(Shuffled(), bucket_cap_mb=0.005)
        compressor = make_compressor("onebit2")
        buckets = []

        def recording(state, bucket):  # DDP checks the hook's parameter name: ``bucket``
            buckets.append((state.names(bucket), [tuple(g.shape) for g in bucket.gradients()]))
            return onebit2_hook(state, bucket)

        compressor.hook = recording
        compressor.register(ddp)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), compressor, buckets

    def steps(ddp, optimizer, compressor, buckets, batches):
        out = []
        for x, y in batches:
            before, buckets[:] = compressor.bytes_sent, []
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            out.append({"bytes": compressor.bytes_sent - before, "buckets": list(buckets)})
        return out

    ddp, optimizer, compressor, buckets = fresh()
    straight = steps(ddp, optimizer, compressor, buckets, batches[:3])
    saved = io.BytesIO()
    torch.save(
        {"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(), "compressor": compressor.state_dict()},
        saved,
    )
    straight += steps(ddp, optimizer, compressor, buckets, batches[3:])
    weights = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    ddp, optimizer, compressor, buckets = fresh()
    ddp.module.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    compressor.load_state_dict(checkpoint["compressor"])
    resumed = steps(ddp, optimizer, compressor, buckets, batches[3:])
    resumed_weights = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    return {"straight": straight, "resumed": resumed, "weights": weights, "resumed_weights": resumed_weights}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    checks = ["check_simulation", "check_bytes", "check_small_cnn_bytes", "check_onebit2_ddp_bytes"]
    return _run_ranks(2, tmp_path_factory.mktemp("gloo2"), checks)


@pytest.fixture(scope="module")
def two_ranks_training(tmp_path_factory):
    """A world of its own: its setup lands in another test than ``two_ranks``' (each under the test timeout)."""
    return _run_ranks(2, tmp_path_factory.mktemp("gloo2t"), ["check_convergence", "check_ddp_training"])


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return _run_ranks(3, tmp_path_factory.mktemp("gloo3"), ["check_simulation"])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["onebit", "onebit2"])
@pytest.mark.slow
def test_distributed_equals_simulation(world, name, request):
    results = request.getfixturevalue("two_ranks" if world == 2 else "three_ranks")
    results = [r["check_simulation"] for r in results]
    grads = _gradients(7, 5, world, SHAPES)
    stages = 1 if name == "onebit" else 2
    expected, worker, server = sim_onebit(SHAPES, grads[1:], stages=stages)
    warm = np.mean(grads[0], axis=0)
    for r in range(world):
        eager = results[r][f"{name}-eager"]
        for t in range(len(grads)):  # the fused kernels and the eager reference agree to float32 rounding
            np.testing.assert_allclose(results[r][name]["outputs"][t], eager["outputs"][t], rtol=2e-7, atol=1e-7)
        assert eager["sent"] == results[r][name]["sent"]
        assert torch.equal(results[r][name]["zero"], torch.zeros(numel(SHAPES)))  # an all-zero bucket stays zero
        got = results[r][name]["outputs"]
        np.testing.assert_allclose(got[0].numpy(), warm, rtol=1e-6, atol=1e-6)  # warm-up: the exact mean
        reference = results[0][name]["outputs"]
        for t in range(1, len(got)):
            assert torch.equal(got[t], reference[t])  # every rank holds the same bits
            np.testing.assert_allclose(got[t].numpy(), expected[t - 1], rtol=1e-5, atol=1e-5)
        state = results[r][name]["state"]
        residual = torch.cat([state["residuals"][f"0.{i}"].reshape(-1) for i in range(len(SHAPES))])
        np.testing.assert_allclose(residual.numpy(), worker[r], atol=1e-5)
    if name == "onebit2":
        total = sum(
            torch.cat([res[name]["state"]["server_residuals"][f"0.{i}"].reshape(-1) for i in range(len(SHAPES))])
            for res in results
        )
        np.testing.assert_allclose(total.numpy(), server, atol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_onebit2_telescoping_identity(world, request):
    """sum_t out_t + (sum_r worker residual_r) / N + server residual == sum_t mean_r g_r,t (after warm-up)."""
    ranks = request.getfixturevalue("two_ranks" if world == 2 else "three_ranks")
    results = [r["check_simulation"]["onebit2"] for r in ranks]
    grads = _gradients(7, 5, world, SHAPES)
    n = len(SHAPES)
    target = sum(np.mean(step, axis=0) for step in grads[1:])  # the steps after the warm-up one
    outputs = sum(o.numpy() for o in results[0]["outputs"][1:])
    worker = sum(torch.cat([r["state"]["residuals"][f"0.{i}"].reshape(-1) for i in range(n)]) for r in results)
    server = sum(torch.cat([r["state"]["server_residuals"][f"0.{i}"].reshape(-1) for i in range(n)]) for r in results)
    np.testing.assert_allclose(outputs + worker.numpy() / world + server.numpy(), target, rtol=1e-5, atol=2e-6)
    assert np.abs(server.numpy()).max() > 1e-3  # the server residual is really in play


def test_bytes_per_step_match_the_formulas(two_ranks):
    world, n = 2, numel(LARGE)
    layout = ColumnLayout(tuple(LARGE))
    columns = layout.n_columns
    # each parameter's columns are halved; the bias (one column of 512) goes to one stripe
    stripe_message = 8 * (256 + 1) + (256 * 1024 + 512 + 7) // 8
    assert plan_stripes(LARGE, ["0.0", "0.1"], world).size == stripe_message
    compressed = {
        "none": 4 * n,
        "fp16": 2 * n,
        "bf16": 2 * n,
        "powersgd": 4 * ((512 + 1024) * 2 + 512),  # rank-2 P and Q of the matrix; the bias uncompressed
        "onebit": 8 * columns + (n + 7) // 8,
        "onebit2": world * stripe_message + stripe_message,  # all-to-all input, then all-gather input
    }
    for rank in range(world):
        sent = two_ranks[rank]["check_bytes"]
        for name, per_step in sent.items():
            assert per_step == [4 * n, 4 * n, compressed[name], compressed[name]], name
    assert compressed["onebit"] < 4 * n / 25 and compressed["onebit2"] < 2 * 4 * n / 25


def _onebit_message_bytes(shapes):
    """onebit's message for one bucket, from the grouping rule alone: 8 bytes per group, one bit per value."""
    groups = sum(out if by_rows else rest for out, rest, by_rows in map(sim_grouping, shapes))
    return 8 * groups + (numel(shapes) + 7) // 8


def test_onebit_sends_under_a_25th_of_fp32_for_small_cnn(two_ranks):
    shapes = _small_cnn_shapes()
    fp32 = 4 * numel(shapes)
    # 16 + 32 + 64 + 128 conv filters (of 9 to 576 weights), 14 head rows of 128, 8 norm vectors, 1 bias
    assert sum(out if by_rows else rest for out, rest, by_rows in map(sim_grouping, shapes)) == 256
    assert _onebit_message_bytes(shapes) < fp32 / 25
    for rank in range(2):
        for step in two_ranks[rank]["check_small_cnn_bytes"]:
            assert sorted(s for b in step["buckets"] for s in b) == sorted(shapes)  # every parameter, once
            assert step["bytes"] == sum(_onebit_message_bytes(b) for b in step["buckets"])
            assert step["bytes"] < fp32 / 25, step["bytes"] / fp32


@pytest.mark.slow
def test_error_feedback_converges_and_without_it_stalls(two_ranks_training):
    for rank in range(2):
        distance = two_ranks_training[rank]["check_convergence"]
        for name in ("onebit", "onebit2"):
            assert distance[f"{name}-True"] < 1e-3, distance
            assert distance[f"{name}-False"] > 0.1, distance


def test_ddp_ranks_stay_identical_loss_falls_and_resume_is_exact(two_ranks_training):
    results = [r["check_ddp_training"] for r in two_ranks_training]
    assert set(results[0]) == {f"{c}-biasTrue" for c in NAMES} | {"powersgd-biasFalse"}
    for key, first in results[0].items():
        second = results[1][key]
        assert torch.equal(first["weights"], second["weights"]), key  # bitwise the same model on both ranks
        assert torch.equal(first["resumed"], first["weights"]), key  # resuming from the state_dict is exact
        assert torch.equal(second["resumed"], second["weights"]), key
        assert first["losses"][-1] < 0.8 * first["losses"][0], (key, first["losses"])
        assert first["bytes"] > 0


def test_onebit2_never_sends_a_gradient_sized_message_through_rebuild_and_resume(two_ranks):
    """Every step, also the one after DDP rebuilds its buckets and the first after a resume (where sending the
    whole fp32 server residual would cost 1.05x an fp32 all-reduce), sends exactly its stripes' messages."""
    results = [r["check_onebit2_ddp_bytes"] for r in two_ranks]
    model = Shuffled()
    fp32 = 4 * sum(p.numel() for p in model.parameters())
    for result in results:
        runs = result["straight"] + result["resumed"]
        layouts = [tuple(tuple(names) for names, _ in step["buckets"]) for step in runs]
        assert layouts[0] != layouts[1] and layouts[3] == layouts[1]  # rebuilt after step 0; the same later
        assert result["resumed"] and layouts[6] == layouts[0] and layouts[7] == layouts[1]  # resumed: again
        for step in runs:
            expected = sum((2 + 1) * plan_stripes(shapes, names, 2).size for names, shapes in step["buckets"])
            assert step["bytes"] == expected
            assert step["bytes"] < fp32 / 8, step["bytes"] / fp32
        # stripes follow parameters, not buckets: the resumed run is the straight one, bit for bit
        assert torch.equal(result["resumed_weights"], result["weights"])
    assert torch.equal(results[0]["weights"], results[1]["weights"])
