"""The 1-bit hooks as DDP calls them: real ``DistributedDataParallel`` on a one-rank gloo group, its buckets handed
to the hook bucket by bucket during backward (``bench/hook.py`` times this path)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from dask_dl.testing.compression import FakeBucket, numel, shaped_model
from dask_dl.testing.train import one_rank_group
from dask_dl.train.compression import fused, hooks, make_compressor
from dask_dl.train.compression.plan import StripePlan
from dask_dl.train.step import make_ddp

# Row-grouped conv and linear weights, biases and a column-grouped (tall) matrix: 610k values, 2.4 MB.
SHAPES = [(128, 64, 3, 3), (128,), (512, 1024), (512,), (512, 16), (14, 256), (14,)]
CAP_MB = 0.03  # DDP then hands these over in 3 buckets: (14, 14x256, 512x16), (512, 512x1024), (128, 128x64x3x3)


def _steps(seed: int, steps: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]


def _ddp(name: str):
    ddp = make_ddp(shaped_model(SHAPES), device_ids=None, bucket_cap_mb=CAP_MB)  # as the trainer makes it
    compressor = make_compressor(name)
    seen: list = []  # (bucket index, shapes, parameters) of each call, in DDP's order
    register = ddp.register_comm_hook

    def recording(state, hook):
        def recorded(state, bucket):
            shapes = [tuple(g.shape) for g in bucket.gradients()]
            seen.append((bucket.index(), shapes, bucket.parameters(), bucket.is_last()))
            return hook(state, bucket)

        return register(state, recorded)

    ddp.register_comm_hook = recording
    compressor.register(ddp)  # as the trainer registers it
    del ddp.register_comm_hook
    return ddp, compressor, seen


def _ddp_equals_fakebucket(name: str) -> int:
    ddp, compressor, seen = _ddp(name)
    fake = make_compressor(name)
    fake.state.param_names = dict(compressor.state.param_names)  # residuals under the same names
    index = {id(p): i for i, p in enumerate(ddp.module.weights)}
    for step, grads in enumerate(_steps(3, 4)):
        seen.clear()
        ddp(grads).backward()
        for i, shapes, params, last in seen:  # the same buckets, handed over as bench/compression.py does
            values = torch.cat([grads[index[id(p)]].reshape(-1) for p in params])
            out = fake.hook(fake.state, FakeBucket(shapes, values, i, last=last, params=params)).wait()
            got = torch.cat([ddp.module.weights[index[id(p)]].grad.reshape(-1) for p in params])
            assert torch.equal(got, out), f"{name}: step {step}, bucket {i}: DDP's hook and FakeBucket differ"
        for p in ddp.module.weights:
            p.grad = None
    assert compressor.step == fake.step == 4
    for key, residual in compressor.state.residuals.items():
        assert torch.equal(residual, fake.state.residuals[key]), key
    return len(seen)


@pytest.mark.parametrize("name", ["onebit", "onebit2"])
def test_the_hook_as_ddp_calls_it_gives_the_fakebucket_result_bit_for_bit(name):
    with one_rank_group():
        buckets = _ddp_equals_fakebucket(name)
    assert buckets == 3  # several buckets a step, as in training, not one


def _kept(state) -> dict:
    """Address of every buffer the state keeps between steps: messages, residuals' flat tensors and the kernels'
    scratch arrays of every plan."""
    out = {k: v.flat.data_ptr() for k, v in state.workspace.items() if isinstance(v, fused._Message)}
    out.update({k: v[0].data_ptr() for k, v in state.flats.items()})
    plans = [v for v in state.workspace.values() if isinstance(v, StripePlan)]
    for i, table in enumerate(t for plan in plans for t in [plan.tasks, *plan._own.values()]):
        for use, scratch in table.scratch.items():
            arrays = {name: a for name, a in vars(scratch).items() if isinstance(a, np.ndarray)}
            out.update({(i, use, name): array.ctypes.data for name, array in arrays.items()})
    return out


def _steady_steps(name: str, monkeypatch) -> tuple[dict, dict, int, int, int]:
    ddp, compressor, _ = _ddp(name)
    steps = _steps(4, 5)
    for grads in steps[:2]:  # DDP rebuilds its buckets after its first step; the hook's buffers are made
        ddp(grads).backward()
    before = _kept(compressor.state)
    made, layout = [], hooks.ColumnLayout
    monkeypatch.setattr(hooks, "ColumnLayout", lambda shapes: made.append(shapes) or layout(shapes))
    peak = 0
    for grads in steps[2:]:
        loss = ddp(grads)
        tracemalloc.start()
        loss.backward()
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return before, _kept(compressor.state), len(made), peak, 4 * numel(SHAPES)


@pytest.mark.parametrize("name", ["onebit", "onebit2"])
def test_after_warm_up_a_step_through_ddp_allocates_no_buffer_and_no_layout(name, monkeypatch):
    with one_rank_group():
        before, after, layouts, peak, gradient_bytes = _steady_steps(name, monkeypatch)
    # every message, gather buffer, residual and scratch array kept, at the same address
    assert any(isinstance(k[0], int) for k in before) and after == before
    assert {k[0] for k in before} >= ({"message"} if name == "onebit" else {"send", "stripe"})  # messages counted
    assert layouts == 0  # the bucket's layout (and its cached properties) is made once, not at every call
    # what tracemalloc sees (NumPy and Python objects, not torch's allocator) stays far below one message
    # (gradient_bytes / 32): views, lists, the futures
    assert peak < gradient_bytes / 64, f"a step allocated up to {peak} bytes at once through NumPy or Python"


def _groups() -> None:
    import torch.distributed as dist

    ddp = make_ddp(shaped_model(SHAPES), device_ids=None, bucket_cap_mb=CAP_MB)
    learned = make_compressor("onebit2")
    assert learned.state.process_group is None
    learned.register(ddp)
    assert learned.state.process_group is ddp.process_group
    assert (learned.state.world_size, learned.state.rank) == (1, 0)
    group = dist.new_group([0])
    given = make_compressor("onebit2", process_group=group)
    given.register(make_ddp(shaped_model(SHAPES), device_ids=None, bucket_cap_mb=CAP_MB))
    assert given.state.process_group is group and group is not ddp.process_group


def test_register_takes_the_ddp_models_group_unless_the_compressor_has_one():
    """The hooks average over the group DDP reduces in, and ask it for its size and rank at each bucket (a C++
    call, where the default group's Python lookups cost tens of microseconds on the caches a kernel left)."""
    with one_rank_group():
        _groups()
