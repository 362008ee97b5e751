"""``make_compressor``, the compressor registry, warm-up steps, state dicts and the hooks on one rank."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch

from dask_dl.errors import ConfigurationError
from dask_dl.testing.compression import FakeBucket, numel, sim_onebit
from dask_dl.testing.train import one_rank_group
from dask_dl.train.compression import COMPRESSORS, make_compressor

SHAPES = [(6, 20), (5, 3, 3, 3), (7,), (), (4, 9), (12, 5), (8, 1, 2, 2), (3, 3)]


def _run(compressor, shapes, values):
    return compressor.hook(compressor.state, FakeBucket(shapes, values.clone())).wait().clone()


def _gradients(seed, steps, n_ranks, shapes):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(numel(shapes)).astype(np.float32) for _ in range(n_ranks)] for _ in range(steps)]


def test_the_registry_lists_every_compressor_with_help_and_no_torch():
    assert COMPRESSORS.names() == ["none", "fp16", "bf16", "powersgd", "onebit", "onebit2"]
    assert all(COMPRESSORS.help().values())
    code = "import sys; from dask_dl.train.compression import COMPRESSORS as C; C.help(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # the CLI can list the names and their help without importing torch


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", ["onebit", "onebit2"])
def test_one_rank_degrades_to_the_algorithm(name, fused):
    """Without a process group (N=1) no communication happens and the result is the algorithm's for N=1."""
    compressor = make_compressor(name)
    compressor.state.fused = fused
    grads = _gradients(1, 3, 1, SHAPES)
    expected, worker, server = sim_onebit(SHAPES, grads, stages=1 if name == "onebit" else 2)
    for t, step in enumerate(grads):
        out = _run(compressor, SHAPES, torch.from_numpy(step[0]))
        np.testing.assert_allclose(out.numpy(), expected[t], rtol=1e-5, atol=1e-5)
    assert compressor.bytes_sent == 0 and compressor.step == 3
    residual = torch.cat([compressor.state.residuals[f"0.{i}"].reshape(-1) for i in range(len(SHAPES))])
    np.testing.assert_allclose(residual.numpy(), worker[0], atol=1e-5)
    if name == "onebit2":
        srv = torch.cat([compressor.state.server_residuals[f"0.{i}"].reshape(-1) for i in range(len(SHAPES))])
        np.testing.assert_allclose(srv.numpy(), server, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", ["onebit", "onebit2"])
def test_all_zero_bucket_stays_zero(name, fused):
    compressor = make_compressor(name)
    compressor.state.fused = fused
    out = _run(compressor, SHAPES, torch.zeros(numel(SHAPES)))
    assert torch.equal(out, torch.zeros(numel(SHAPES)))
    assert all(torch.count_nonzero(r) == 0 for r in compressor.state.residuals.values())


def test_residuals_stay_by_name_across_bucket_layouts():
    """Residuals are views of one tensor per bucket layout; a new layout copies them over, values kept."""
    compressor = make_compressor("onebit")
    g = torch.randn(numel(SHAPES))
    _run(compressor, SHAPES, g)
    before = {k: v.clone() for k, v in compressor.state.residuals.items()}
    params = FakeBucket(SHAPES, g).params
    # the same parameters in the reverse order, in another bucket (as after DDP rebuilds its buckets)
    bucket = FakeBucket(SHAPES[::-1], torch.zeros(numel(SHAPES)), 1, params=params[::-1])
    compressor.state.param_names = {id(p): f"0.{i}" for i, p in enumerate(params)}
    compressor.hook(compressor.state, bucket).wait()
    assert set(compressor.state.residuals) == set(before)
    assert len(compressor.state.flats) == 1  # the old layout's tensor is dropped
    flat = next(iter(compressor.state.flats.values()))[0]
    assert all(
        v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in compressor.state.residuals.values()
    )


@pytest.fixture
def one_rank():
    """A real one-rank gloo group (torch's PowerSGD hook needs a group even alone)."""
    with one_rank_group():
        yield


@pytest.mark.parametrize("name", COMPRESSORS.names())
def test_warmup_steps_are_plain_and_state_dict_loads_weights_only(name, request):
    if name == "powersgd":
        request.getfixturevalue("one_rank")
    warmup = 2
    compressor = make_compressor(name, warmup_steps=warmup)
    shapes = SHAPES[:3]  # torch's PowerSGD hook cannot take 0-d parameters
    g = torch.randn(numel(shapes))
    for _ in range(warmup):
        assert torch.equal(_run(compressor, shapes, g), g)  # one rank: the mean is the gradient itself
    assert compressor.step == warmup
    buffer = io.BytesIO()
    torch.save(compressor.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    again = make_compressor(name, warmup_steps=warmup)
    again.load_state_dict(state)
    assert again.step == warmup and again.state_dict()["name"] == name


def test_bad_names_and_options_raise_clear_errors():
    with pytest.raises(ConfigurationError, match="unknown compressor 'onebit3'.*none, fp16, bf16.*compression="):
        make_compressor("onebit3")
    with pytest.raises(ConfigurationError, match="unknown option.*rank.*'onebit'.*error_feedback"):
        make_compressor("onebit", rank=2)
    with pytest.raises(ConfigurationError, match="warmup_steps must be an integer >= 0, got -1"):
        make_compressor("none", warmup_steps=-1)
    with pytest.raises(ConfigurationError, match="error_feedback must be True or False, got 1"):
        make_compressor("onebit2", error_feedback=1)
    with pytest.raises(ConfigurationError, match="saved by 'onebit', not 'onebit2'"):
        make_compressor("onebit2").load_state_dict(make_compressor("onebit").state_dict())
    with pytest.raises(ConfigurationError, match="1-bit compression needs dense float32 gradients"):
        _run(make_compressor("onebit"), [(4,)], torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("name", ["onebit", "onebit2"])
def test_a_state_loaded_into_a_running_compressor_is_the_one_it_goes_on_with(name):
    """``load_state_dict`` replaces the residuals of a compressor whose hook kept its bucket's buffers between
    calls (the same parameter objects each step, as DDP hands them over): the next step must start from the loaded
    residuals, as a new compressor loaded with the same state does."""
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in SHAPES]
    grads = [torch.from_numpy(g[0]) for g in _gradients(5, 4, 1, SHAPES)]
    running, fresh = make_compressor(name), make_compressor(name)

    def step(compressor, g):
        return compressor.hook(compressor.state, FakeBucket(SHAPES, g.clone(), params=params)).wait().clone()

    for g in grads[:2]:
        step(running, g)
    saved = running.state_dict()
    step(running, grads[2])  # its residuals move on from the saved ones
    running.load_state_dict(saved)
    fresh.load_state_dict(saved)
    assert torch.equal(step(running, grads[3]), step(fresh, grads[3]))
    for key in ("residuals", "server_residuals"):
        ours, theirs = running.state_dict()[key], fresh.state_dict()[key]
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), key
