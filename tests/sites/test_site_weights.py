"""Weights averaging is exact: fedavg of identical models is the model, of two the weighted mean to float precision."""

from __future__ import annotations

import pytest
import torch

from dask_dl import ConfigurationError, TrainingError
from dask_dl.models import build_model
from dask_dl.sites.weights import average_weights, state_nbytes


def _model(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = build_model("small_cnn", num_outputs=3, width=8)
    net.train()
    net(torch.randn(4, 1, 32, 32) * (seed + 1))  # BatchNorm running statistics and num_batches_tracked move
    return net.state_dict()


def test_identical_models_average_to_the_model_bit_for_bit():
    state = _model(0)
    for weights in ([1, 1, 1], [117, 98, 136], [0.3, 0.3, 0.4]):
        mean = average_weights([state, state, state], weights)
        for key, value in state.items():
            assert mean[key].dtype == value.dtype
            assert torch.equal(mean[key], value), key


def test_two_models_average_to_the_weighted_mean():
    a, b = _model(1), _model(2)
    mean = average_weights([a, b], [3, 1])
    floats = [k for k in a if a[k].is_floating_point()]
    assert floats and any("running_mean" in k for k in floats)
    for key in floats:
        expected = (3 * a[key].double() + b[key].double()) / 4
        torch.testing.assert_close(mean[key], expected.float(), rtol=0, atol=1e-7)
        if not torch.equal(a[key], b[key]):  # BatchNorm's weights start at 1 in both
            assert not torch.equal(mean[key], a[key])


def test_integer_buffers_take_the_rounded_weighted_mean():
    a, b = _model(1), _model(2)
    a["features.1.num_batches_tracked"] = torch.tensor(10)
    b["features.1.num_batches_tracked"] = torch.tensor(15)
    mean = average_weights([a, b], [3, 1])  # (30 + 15) / 4 = 11.25
    assert mean["features.1.num_batches_tracked"].dtype == torch.int64
    assert int(mean["features.1.num_batches_tracked"]) == 11
    counts = [k for k in _model(0) if k.endswith("num_batches_tracked")]
    assert counts and all(average_weights([a, a])[k].dtype == torch.int64 for k in counts)


def test_a_zero_weight_leaves_a_model_out():
    a, b = _model(1), _model(2)
    mean = average_weights([a, b], [5, 0])
    assert all(torch.equal(mean[k], a[k]) for k in a)


def test_bad_input_is_refused():
    a, b = _model(1), _model(2)
    with pytest.raises(ConfigurationError, match="at least one state"):
        average_weights([])
    with pytest.raises(ConfigurationError, match="2 weights for 1 state"):
        average_weights([a], [1, 2])
    with pytest.raises(ConfigurationError, match="numbers >= 0"):
        average_weights([a, b], [1, -1])
    with pytest.raises(ConfigurationError, match="sum to zero"):
        average_weights([a, b], [0, 0])
    c = dict(b)
    c["extra"] = torch.zeros(1)
    with pytest.raises(TrainingError, match="other keys"):
        average_weights([a, c])
    d = dict(b)
    d[next(iter(d))] = torch.zeros(7)
    with pytest.raises(TrainingError, match="not the same model"):
        average_weights([a, d])


def test_state_nbytes_counts_data_not_memory_addresses():
    """torch pickles a storage under the address of its storage object: one made in the main thread (heap,
    0x55...) and one made in another thread (that thread's malloc arena, 0x7f...) pickle to different lengths.
    The ledger counts the same state the same whichever thread received it."""
    import pickle
    import threading

    made: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: made.append(torch.ones(16)))
    thread.start()
    thread.join()
    elsewhere, here = made[0], torch.ones(16)
    plain = {len(pickle.dumps({"w": t}, protocol=pickle.HIGHEST_PROTOCOL)) for t in (elsewhere, here)}
    assert len(plain) in (1, 2)  # 2 on Linux with glibc: that is what made the ledger drift
    assert state_nbytes({"w": elsewhere}) == state_nbytes({"w": here}) == state_nbytes({"w": here.clone()})
    # the data plus the structure: 4 bytes more per float32 value
    assert state_nbytes({"w": torch.ones(216)}) - state_nbytes({"w": here}) == 4 * 200
