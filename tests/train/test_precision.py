"""Mixed precision, channels-last, activation checkpointing: in process, and in fits with compression hooks.

The GPU-only parts (fp16 with a gradient scaler, channels-last) are marked ``gpu`` and skipped without CUDA.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from dask_dl import ConfigurationError
from dask_dl.models import build_model
from dask_dl.testing.models import TinyNet, tiny_net
from dask_dl.testing.train import fit_squares
from dask_dl.train.precision import Precision, enable_activation_checkpointing

SIZE = 32


# ---- in process --------------------------------------------------------------------------------------------


def test_precision_on_cpu(caplog):
    with pytest.raises(ConfigurationError, match="precision='fp16' needs GPU trainers.*use precision='bf16'"):
        Precision("fp16", torch.device("cpu"))
    bf16 = Precision("bf16", torch.device("cpu"))
    with bf16.autocast():
        assert torch.nn.Linear(4, 2)(torch.ones(3, 4)).dtype == torch.bfloat16
    with Precision("fp32", torch.device("cpu")).autocast():
        assert torch.nn.Linear(4, 2)(torch.ones(3, 4)).dtype == torch.float32
    with caplog.at_level(logging.INFO, logger="dask_dl.train"):
        plain = Precision("fp32", torch.device("cpu"), channels_last=True)
    assert "channels_last=True is a no-op on cpu" in caplog.text
    x = torch.zeros(2, 1, 8, 8)
    assert plain.prepare_input(x) is x and plain.state_dict() == {}


@pytest.mark.parametrize("name, blocks", [("resnet18", 8), ("small_cnn", 1), ("densenet121", 7)])
def test_activation_checkpointing_gives_the_same_step(name, blocks):
    kwargs = {"block_config": (2, 2, 2, 2)} if name == "densenet121" else {}
    torch.manual_seed(0)
    plain = build_model(name, num_outputs=3, **kwargs)
    checked = build_model(name, num_outputs=3, **kwargs)
    checked.load_state_dict(plain.state_dict())
    assert enable_activation_checkpointing(checked, name=name) == blocks
    x = torch.randn(2, 1, 32, 32)
    for net in (plain, checked):
        net.train()
        net(x).square().mean().backward()
    grads = dict(checked.named_parameters())
    for key, p in plain.named_parameters():
        torch.testing.assert_close(grads[key].grad, p.grad, rtol=1e-5, atol=1e-6)
    state = checked.state_dict()
    for key, value in plain.state_dict().items():  # running statistics updated once, not twice
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(checked.eval()(x), plain.eval()(x))


def test_activation_checkpointing_needs_blocks():
    with pytest.raises(ConfigurationError, match="give its class a method checkpoint_blocks"):
        enable_activation_checkpointing(torch.nn.Sequential(torch.nn.Flatten()), name="seq")
    assert enable_activation_checkpointing(TinyNet()) == 2


@pytest.mark.gpu
def test_fp16_scaler_and_channels_last_on_gpu():
    device = torch.device("cuda", 0)
    precision = Precision("fp16", device, channels_last=True)
    net = precision.prepare_model(TinyNet().to(device))
    assert net.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = precision.prepare_input(torch.randn(4, 1, 32, 32, device=device))
    with precision.autocast():
        out = net(x)
    assert out.dtype == torch.float16
    before = net.fc.weight.detach().clone()
    precision.backward(out.float().square().mean())
    precision.step(opt)
    assert not torch.equal(before, net.fc.weight) and precision.state_dict()["scale"] > 0


# ---- in fits, with compression -----------------------------------------------------------------------------


@pytest.mark.slow
def test_bf16_with_onebit(store, cluster_client):
    common = dict(model=tiny_net, compression="onebit", warmup_steps=0, seed=1)  # bf16 convolutions are slow on CPUs
    full = fit_squares(store, cluster_client, **common)
    half = fit_squares(store, cluster_client, precision="bf16", **common)
    assert half.options.precision == "bf16" and np.isfinite(half.history["train_loss"]).all()
    assert half.history["bytes_sent"].iloc[0] == full.history["bytes_sent"].iloc[0] > 0  # float32 gradients
    np.testing.assert_allclose(half.history["train_loss"], full.history["train_loss"], rtol=0.05)


def test_fp16_on_cpu_trainers_fails_before_training(store, cluster_client):
    with pytest.raises(ConfigurationError, match="precision='fp16' needs GPU trainers"):
        fit_squares(store, cluster_client, precision="fp16")


def test_activation_checkpointing_with_accumulate_and_powersgd(store, cluster_client):
    common = dict(accumulate=2, batch_size=4, compression="powersgd", warmup_steps=2, seed=2)
    plain = fit_squares(store, cluster_client, **common)
    checked = fit_squares(store, cluster_client, activation_checkpointing=True, **common)
    want, got = plain.checkpoint()["model"], checked.checkpoint()["model"]
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
