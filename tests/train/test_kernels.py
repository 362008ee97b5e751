"""The fused CPU kernels (``compression/kernels.py``, ``plan.py``, ``fused.py``) against the eager torch reference.

Signs, messages layout and error-feedback residuals must equal the eager path's exactly; scales agree to float32
rounding (both sum in float64, in different orders), which for these inputs is bit-exact too, and the tests
say so where they rely on it. Means of N decoded messages: exact for N=2 (both paths round once), within one
float32 rounding for N=3 (the kernels sum in float64, the reference in float32).
"""

from __future__ import annotations

import threading
import time

import dask
import numpy as np
import pytest
import torch

from dask_dl.testing.compression import FakeBucket, numel
from dask_dl.testing.train import one_rank_group
from dask_dl.train.compression import fused as fused_path
from dask_dl.train.compression import kernels, make_compressor, plan
from dask_dl.train.compression.plan import plan_stripes
from dask_dl.train.compression.quantize import ColumnLayout, decode, dequantize, quantize

SHAPES = [(6, 20), (5, 3, 3, 3), (7,), (), (4, 9), (12, 5), (8, 1, 2, 2), (3, 3)]
# wide (transposed) and tall parameters whose groups are not multiples of 8, tall ones cut in bands
MIXED = [(64, 300), (300, 64), (33, 500), (20, 11), (1000, 13), (5,), (24, 24)]


def _pair(name: str):
    fused = make_compressor(name)
    with dask.config.set({"dask-dl.train.fused-kernels": False}):  # the eager torch path, as GPU buckets take
        eager = make_compressor(name)
    assert fused.state.fused and not eager.state.fused
    return fused, eager


def _step(compressor, shapes, values, index=0):
    return compressor.hook(compressor.state, FakeBucket(shapes, values.clone(), index)).wait().clone()


def _flat(store, n):
    return torch.cat([store[f"0.{i}"].reshape(-1) for i in range(n)])


@pytest.mark.parametrize("grain", [16, 100, None])
@pytest.mark.parametrize("name", ["onebit", "onebit2"])
@pytest.mark.parametrize("shapes", [SHAPES, MIXED], ids=["small", "mixed"])
def test_fused_equals_eager_step_after_step(name, shapes, grain, monkeypatch):
    """One rank, error feedback on: every output and residual equal the eager path's, bit for bit."""
    if grain is not None:
        monkeypatch.setattr(plan, "GRAIN", grain)  # small tasks: runs cut inside groups' bytes and bands
    fused, eager = _pair(name)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        g = torch.randn(numel(shapes), generator=gen)
        g[::5] = 0.0  # exact zeros: the positive side
        assert torch.equal(_step(fused, shapes, g), _step(eager, shapes, g))
    n = len(shapes)
    assert torch.equal(_flat(fused.state.residuals, n), _flat(eager.state.residuals, n))
    if name == "onebit2":
        assert torch.equal(_flat(fused.state.server_residuals, n), _flat(eager.state.server_residuals, n))
    assert _flat(fused.state.residuals, n).abs().max() > 0.1  # error feedback really in play


@pytest.mark.parametrize("name", ["onebit", "onebit2"])
def test_fused_equals_eager_without_error_feedback(name, monkeypatch):
    """Without error feedback (the server side then quantizes the decoded mean itself, in scratch): every output
    equals the eager path's, bit for bit, on runs that start on and off sign-byte boundaries; nothing is kept."""
    monkeypatch.setattr(plan, "GRAIN", 100)
    fused = make_compressor(name, error_feedback=False)
    with dask.config.set({"dask-dl.train.fused-kernels": False}):
        eager = make_compressor(name, error_feedback=False)
    shapes = MIXED + RAGGED
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        g = torch.randn(numel(shapes), generator=gen)
        g[::5] = 0.0
        got, want = _step(fused, shapes, g), _step(eager, shapes, g)
        assert torch.equal(got, want)
        assert len(torch.unique(got)) > 2 * len(shapes)  # two means a group, not a constant
    assert not fused.state.residuals and not fused.state.server_residuals


def _steps_of(compressor, layouts, grads, read_between: bool = False):
    """Each gradient through the hook in its step's bucket ``layouts`` (a list of shape lists, one bucket each,
    named by position in the whole parameter list so residuals follow the parameters across layouts)."""
    outputs = []
    for layout, g in zip(layouts, grads, strict=True):
        pieces, offset = [], 0
        names_at = 0
        for b, shapes in enumerate(layout):
            n = numel(shapes)
            params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
            compressor.state.param_names = {id(p): f"p{names_at + i}" for i, p in enumerate(params)}
            names_at += len(shapes)
            bucket = FakeBucket(shapes, g[offset : offset + n].clone(), b, last=b == len(layout) - 1, params=params)
            pieces.append(compressor.hook(compressor.state, bucket).wait().clone())
            offset += n
        outputs.append(torch.cat(pieces))
        if read_between:
            compressor.state.residuals  # noqa: B018 (reading settles what the kernels owe)
    return outputs


@pytest.mark.parametrize("name", ["onebit", "onebit2"])
def test_owed_errors_are_settled_once_whoever_reads_them(name):
    """The fused kernels leave a group's new error owed to the next step's sweep. Reading the residuals between
    steps (a checkpoint) writes it; the run then goes on exactly as one nobody read, and as the eager path,
    whose residuals are always written: every output and every residual equal."""
    # a 14-value bias first: every later group, and every row of the tall parameter's band, starts inside a byte
    shapes = [(14,), (14, 40), (40,), (40, 64), (100, 21)]
    grads = [torch.randn(numel(shapes), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    layouts = [[shapes]] * 4
    read, unread = make_compressor(name), make_compressor(name)
    with dask.config.set({"dask-dl.train.fused-kernels": False}):
        eager = make_compressor(name)
    runs = [_steps_of(c, layouts, grads, read_between=c is read) for c in (read, unread, eager)]
    for step in range(4):
        assert torch.equal(runs[0][step], runs[2][step]) and torch.equal(runs[1][step], runs[2][step]), step
    for key in ("residuals", "server_residuals") if name == "onebit2" else ("residuals",):
        theirs = getattr(eager.state, key)
        for c in (read, unread):
            ours = getattr(c.state, key)
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), key
    for key in ("p1", "p4"):  # errors, not the values quantized (and the band's too)
        assert unread.state.residuals[key].abs().max() > 0.1


@pytest.mark.parametrize("name", ["onebit", "onebit2"])
def test_owed_errors_follow_the_parameters_into_new_buckets_and_the_eager_path(name):
    """The buckets are cut differently from one step to the next (as DDP rebuilds them), then the same state
    goes on through the eager path: what the kernels owed is settled against the old buckets' groups before the
    residuals move, so every step equals an eager run's."""
    shapes = [(3,), (7, 300), (300,), (20, 33), (64, 64), (90, 7)]  # the last one grouped by column, in a band
    layouts = [[shapes], [shapes[:2], shapes[2:]], [shapes[:2], shapes[2:]], [shapes[:1], shapes[1:]], [shapes]]
    grads = [torch.randn(numel(shapes), generator=torch.Generator().manual_seed(10 + s)) for s in range(6)]
    fused = make_compressor(name)
    with dask.config.set({"dask-dl.train.fused-kernels": False}):
        eager = make_compressor(name)
    ours, theirs = _steps_of(fused, layouts, grads[:5]), _steps_of(eager, layouts, grads[:5])
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    fused.state.fused = False  # the eager path on a state the kernels left owing
    assert torch.equal(_steps_of(fused, [[shapes]], grads[5:])[0], _steps_of(eager, [[shapes]], grads[5:])[0])


def test_quantize_says_what_owed_must_look_like():
    p = plan_stripes([(4, 9)], ["w"], 1)
    msgs = np.zeros((1, p.size), dtype=np.uint8)
    grad, residual = np.ones(36, dtype=np.float32), np.zeros(36, dtype=np.float32)
    with pytest.raises(ValueError, match=r"owed has shape \(1, 2\), these messages need \(1, 8\): see owed_means"):
        kernels.quantize(p.tasks, msgs, p.columns, grad=grad, vals=residual, owed=np.zeros((1, 2), np.float32))
    owed = kernels.owed_means(1, p.columns)
    kernels.quantize(p.tasks, msgs, p.columns, grad=grad, vals=residual, owed=owed)
    assert np.array_equal(residual, grad) and owed[0, 0] == 1.0  # left as quantized, owing against mean 1
    kernels.settle(p.tasks, residual, owed)
    assert not residual.any() and not owed.any()


# runs of every length around the vector steps of 16 values, starting on and off sign-byte boundaries:
# transposed groups of 17, 33, 300 and 1000 (the last two long enough to be streamed when decoded, once the
# bucket is counted as large enough: ``STREAM_BYTES`` is set to 0), bands of 17
# and 70 columns (vector columns and a ragged rest), a 257-long vector (one column, no vector part)
RAGGED = [(3, 17), (40, 33), (2, 300), (300, 17), (70, 70), (1, 1000), (257,), (16, 16), (5, 7)]


@pytest.mark.parametrize("name", ["onebit", "onebit2"])
def test_fused_equals_eager_on_adversarial_values(name, monkeypatch):
    """Magnitudes from 1e-30 to 1e30, +0.0 and -0.0 (the positive side), and from the second step NaNs.

    Outputs and residuals equal the eager path's bit for bit wherever the eager path's are not NaN. A NaN goes to
    the negative side, so its group's negative mean is NaN: the kernels decode its negative entries to NaN and
    its positive ones to their mean, while the eager path's ``lerp`` (``neg + 0 * (pos - neg)``) makes the whole
    group NaN. So the kernels' NaNs are a subset of the eager path's, and there are some. (Infinities are left
    out: ``lerp`` turns an infinite mean into NaN too; either way the step is not finite and training stops.)
    """
    monkeypatch.setattr(kernels, "STREAM_BYTES", 0)  # decoded runs stored past the caches, as in a large bucket
    fused, eager = _pair(name)
    gen = torch.Generator().manual_seed(5)
    n = numel(RAGGED)
    scale = torch.logspace(-30, 30, n)[torch.randperm(n, generator=gen)]
    k = len(RAGGED)
    stores = ["residuals", "server_residuals"] if name == "onebit2" else ["residuals"]
    for step in range(3):
        g = torch.randn(n, generator=gen) * scale
        g[::7], g[3::11] = 0.0, -0.0
        if step:
            g[torch.randint(n, (3,), generator=gen)] = float("nan")
        outputs = [(_step(fused, RAGGED, g), _step(eager, RAGGED, g))]
        outputs += [(_flat(getattr(fused.state, a), k), _flat(getattr(eager.state, a), k)) for a in stores]
        for got, want in outputs:
            finite = ~torch.isnan(want)
            assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))
            assert bool(torch.isnan(got).any()) == (step > 0)


def test_messages_equal_the_eager_encoding_for_every_stripe():
    """The kernels write each stripe's message (scales, then signs in the parameters' memory order) exactly as
    the eager ``encode`` does, for N = 1..4 stripes."""
    shapes = MIXED
    names = [f"p{i}" for i in range(len(shapes))]
    layout = ColumnLayout(tuple(shapes))
    g = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1))
    bits, scales = quantize(layout.blocks(g.clone()))
    for n in (1, 2, 3, 4):
        p = plan_stripes(shapes, names, n)
        msgs = np.zeros((n, p.size), dtype=np.uint8)
        kernels.quantize(p.tasks, msgs, p.columns, grad=g.numpy().copy(), ef=False)
        for k, pieces in enumerate(p.pieces):
            got_bits, got_scales = decode(torch.from_numpy(msgs[k]), layout.piece_shapes(pieces))
            want = [bits[i][:, lo:hi] for i, lo, hi in pieces]
            assert all(torch.equal(a, b) for a, b in zip(got_bits, want, strict=True))
            assert torch.equal(got_scales, scales[torch.tensor(layout.piece_columns(pieces), dtype=torch.long)])


@pytest.mark.parametrize("streamed", [True, False])
@pytest.mark.parametrize("n", [2, 3])
def test_decoding_n_messages_gives_their_mean(n, streamed, monkeypatch):
    """Decoded means equal the exact ones, whether the decode stores past the caches (a bucket of at least
    ``STREAM_BYTES``) or not, and wherever the bucket starts."""
    monkeypatch.setattr(kernels, "STREAM_BYTES", 0 if streamed else 1 << 62)
    shapes = [*MIXED, (600, 270)]  # the last grouped by column, its rows long enough to be streamed
    p = plan_stripes(shapes, [f"p{i}" for i in range(len(shapes))], 1)
    layout = p.layout
    gen = torch.Generator().manual_seed(n)
    msgs = np.zeros((n, p.size), dtype=np.uint8)
    for r in range(n):
        values = torch.randn(layout.numel, generator=gen).numpy()
        kernels.quantize(p.tasks, msgs[r : r + 1], p.columns, grad=values, ef=False)
    out = torch.full((layout.numel,), np.nan).numpy()  # 64-byte aligned: long runs are streamed
    kernels.decode(p.tasks, msgs, p.columns.repeat(n), out, average=True)
    for shift in (1, 5):  # 4 and 20 bytes off: other runs streamed, or none
        shifted = torch.full((layout.numel + shift,), np.nan).numpy()[shift:]
        kernels.decode(p.tasks, msgs, p.columns.repeat(n), shifted, average=True)
        assert np.array_equal(shifted, out)
    decoded = [decode(torch.from_numpy(m), layout.block_shapes()) for m in msgs]
    rebuilt = [torch.cat([b.reshape(-1) for b in _memory_order(layout, dequantize(*d))]) for d in decoded]
    exact = torch.stack([r.double() for r in rebuilt]).mean(0)
    if n == 2:
        assert torch.equal(torch.from_numpy(out), exact.float())
    else:
        np.testing.assert_allclose(out, exact.numpy(), rtol=2**-23, atol=0)


def _memory_order(layout, blocks):
    return [b.t() if m.transposed else b for b, m in zip(blocks, layout.matrices, strict=True)]


def test_results_do_not_depend_on_the_number_of_threads():
    """Every rank must decode the same bits whatever its thread count: work is cut by the plan, not threads."""
    shapes = [(512, 300), (700, 64), (96,)]
    g = torch.randn(numel(shapes), generator=torch.Generator().manual_seed(0))
    outputs = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            compressor = make_compressor("onebit2")
            outputs.append((_step(compressor, shapes, g), _flat(compressor.state.residuals, 3)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


def test_the_kernels_release_the_gil():
    """DDP runs a collective's callback (a decode) on gloo's thread while the trainer's thread goes on: a kernel that
    held the GIL stopped that thread for its whole length (onebit2's all-to-alls returned only when the previous
    bucket's decode had ended). The main thread must keep running while another thread decodes."""
    shapes = [(4096, 8192)]
    p = plan_stripes(shapes, ["w"], 1)
    message = np.zeros((1, p.size), dtype=np.uint8)
    values = torch.randn(p.layout.numel, generator=torch.Generator().manual_seed(0)).numpy()
    kernels.quantize(p.tasks, message, p.columns, grad=values, ef=False)
    msgs, out, alone = np.repeat(message, 16, axis=0), np.empty_like(values), np.empty_like(values)
    spans: list[tuple[float, float]] = []

    def decode_thrice():
        for _ in range(3):
            start = time.perf_counter()
            kernels.decode(p.tasks, msgs, p.columns.repeat(16), out, average=True)
            spans.append((start, time.perf_counter()))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the serial twin, a one-thread trainer's
    try:
        kernels.decode(p.tasks, message, p.columns, alone, average=True)  # compiled (with the GIL) before the clock
        worker = threading.Thread(target=decode_thrice)
        ticks = [time.perf_counter()]
        worker.start()
        while worker.is_alive():
            ticks.append(time.perf_counter())
        worker.join()
    finally:
        torch.set_num_threads(threads)
    shortest = min(end - start for start, end in spans)
    longest_stop = float(np.diff(ticks).max())
    assert shortest > 0.01  # long enough for a kernel that held the GIL to stop the main thread that long
    assert longest_stop < shortest / 2, (longest_stop, spans)
    assert np.array_equal(out, alone)  # the mean of 16 equal messages, decoded while the main thread ran


@pytest.mark.slow
def test_the_kernels_leave_torch_threads_alone():
    """numba's OpenMP layer shares torch's OpenMP runtime: starting its threads must not change torch's thread
    count (it did: a trainer on 1 thread went on on 2, and runs stopped repeating themselves bit for bit)."""
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            fused_path.warm_up()  # both twins where torch has 2 threads: numba's threads start
            assert kernels._FORCE is None and torch.get_num_threads() == t
            _step(make_compressor("onebit"), [(512, 600)], torch.randn(512 * 600))  # parallel with 2 threads
            assert torch.get_num_threads() == t
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [(6400, 1), (1, 6400), (9, 1), (4096,)])
def test_kernel_fidelity_on_a_nearly_cancelling_group(shape):
    """The issue's cases through the kernels, as a column (bands) and as a row (one contiguous group): the
    negative mean is exact, the lone negative entry keeps no residual, the positive mean is the float32
    rounding of the exact one."""
    n = int(np.prod(shape))
    column = (np.random.default_rng(n).random(n) + 0.5).astype(np.float32)
    column[n // 3] = np.float32(-1e-3)
    p = plan_stripes([shape], ["w"], 1)
    msgs = np.zeros((1, p.size), dtype=np.uint8)
    residual = np.zeros(n, dtype=np.float32)
    kernels.quantize(p.tasks, msgs, p.columns, grad=column.copy(), vals=residual)
    mean_pos, mean_neg = msgs[0, :8].view(np.float32)
    assert mean_neg == np.float32(-1e-3)
    assert mean_pos == np.float32(np.delete(column, n // 3).astype(np.float64).mean())
    assert residual[n // 3] == 0.0
    assert np.unpackbits(msgs[0, 8:], count=n, bitorder="little").sum() == n - 1


def test_all_zero_bucket_stays_zero_and_zeros_are_positive():
    p = plan_stripes([(8, 3)], ["w"], 1)
    msgs = np.zeros((1, p.size), dtype=np.uint8)
    residual = np.zeros(24, dtype=np.float32)
    kernels.quantize(p.tasks, msgs, p.columns, grad=np.zeros(24, dtype=np.float32), vals=residual)
    signs = np.unpackbits(msgs[0, 24:], count=24, bitorder="little")
    assert signs.all() and not msgs[0, :24].any()  # scales all 0, signs all 1
    out = np.full(24, np.nan, dtype=np.float32)
    kernels.decode(p.tasks, msgs, p.columns, out, average=True)
    assert not out.any() and not residual.any()


def test_task_table_cuts_and_shared_bytes():
    """Runs of whole groups; a run's last sign byte is marked when the next run completes it."""
    layout = ColumnLayout(((4, 10), (400, 3)))  # 4 rows of 10 (transposed), then 3 columns of 400 (bands)
    table = plan.task_table(layout, [[(0, 0, 4), (1, 0, 3)]], grain=20)
    rows = table.rows
    header = 64 * 7
    assert rows[:, plan.TR].tolist() == [1, 1, 0, 0, 0, 0]
    assert rows[:2, plan.T0].tolist() == [0, 2] and rows[:2, plan.T1].tolist() == [2, 4]
    assert rows[2:, plan.T0].tolist() == [0, 106, 212, 318]  # bands of plan.BAND * 20 // 3 = 106 rows
    second = header + 20  # bit of row 2: not on a byte boundary
    assert rows[0, plan.TAIL] == (second - 1) >> 3 and rows[1, plan.TAIL] == -1  # row 4 starts on a byte
    assert table.reductions.tolist() == [[0, 4, 3, 0, 4, 400]]
    assert table.n_partials == 12


@pytest.fixture
def one_rank():
    """A real one-rank gloo group, for a real DDP model."""
    with one_rank_group():
        yield


def test_register_warms_the_kernels_up(one_rank, monkeypatch):
    """Hook construction compiles (or loads) the kernels: no training step pays numba's compile time."""
    calls = []
    warm_up = fused_path.warm_up
    monkeypatch.setattr(fused_path, "warm_up", lambda: calls.append(warm_up()))
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    make_compressor("onebit").register(ddp)
    assert len(calls) == 1
    with dask.config.set({"dask-dl.train.fused-kernels": False}):  # the eager path needs no kernels
        eager = make_compressor("onebit2")
    assert eager.state.fused is False
    eager.register(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2)))
    make_compressor("none").register(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2)))
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["onebit", "onebit2"])
def test_cuda_buckets_take_the_torch_path_and_agree_with_the_cpu_kernels(name):
    """A bucket on a GPU goes through the eager torch path (no numba); its results are the CPU kernels'."""
    shapes = MIXED
    cpu, gpu = make_compressor(name), make_compressor(name)
    gen = torch.Generator().manual_seed(11)
    for step in range(3):
        g = torch.randn(numel(shapes), generator=gen)
        on_cpu = _step(cpu, shapes, g)
        on_gpu = _step(gpu, shapes, g.cuda())
        assert on_gpu.is_cuda
        if step == 0:  # the same input: the same signs, and scales within float32 rounding
            assert torch.equal(on_gpu.cpu() >= 0, on_cpu >= 0)
        torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-5, atol=1e-6)
    residual = _flat(gpu.state.residuals, len(shapes))
    assert residual.is_cuda
    torch.testing.assert_close(residual.cpu(), _flat(cpu.state.residuals, len(shapes)), rtol=1e-5, atol=1e-5)
