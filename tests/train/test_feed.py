"""Where a trainer augments its batches (``augment_on``) and how they reach its device (dask_dl/train/feed.py).

Without a GPU the device path runs on CPU tensors: a fit with ``augment_on="device"`` forced on CPU trainers is
compared with the same training written out here. The CUDA-only part (pinned batches copied ahead and finished on
a stream of their own) is marked ``gpu``: skipped on machines without CUDA, run by bench/gpu_check.sh.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dask_dl
from dask_dl import ConfigurationError
from dask_dl.data.device_augment import finish_batch
from dask_dl.data.loader import Augmentation, ChunkLoader
from dask_dl.models import build_model
from dask_dl.normalize import DEFAULT_NORMALIZATION
from dask_dl.testing.train import SQUARES_RUN, fit_squares
from dask_dl.train.feed import DeviceFeed, where_to_augment
from dask_dl.train.options import check_run

HALF_GREY = 0.5 / 255 / DEFAULT_NORMALIZATION["std"]  # the CPU path's rounding to uint8, normalized


def train_samples(store) -> np.ndarray:
    ds = dask_dl.open_dataset(store)
    return ds.sample.values[ds.split.values == "train"]


def loader(store, **options) -> ChunkLoader:
    options = {"augment": True, "prefetch": 0, **options}
    return ChunkLoader(store, train_samples(store), batch_size=16, seed=3, **options)


def test_auto_augments_on_the_device_of_a_gpu_trainer_and_on_the_cpu_elsewhere():
    assert where_to_augment("auto", cuda=True) == "device"
    assert where_to_augment("auto", cuda=False) == "cpu"
    assert [where_to_augment(v, cuda=c) for v in ("cpu", "device") for c in (True, False)] == [
        "cpu",
        "cpu",
        "device",
        "device",
    ]


def test_a_cpu_feed_hands_cpu_batches_through_and_finishes_deferred_ones(store):
    plain = list(loader(store).epoch(0, with_samples=True))
    fed = list(DeviceFeed(torch.device("cpu"), normalization=DEFAULT_NORMALIZATION, deferred=False)(iter(plain)))
    assert all(a[0] is b[0] and a[1] is b[1] and a[2] is b[2] for a, b in zip(plain, fed, strict=True))
    feed = DeviceFeed(torch.device("cpu"), normalization=DEFAULT_NORMALIZATION, deferred=True)
    finished = list(feed(loader(store, augment_on="device").epoch(0, with_samples=True)))
    assert len(finished) == len(plain) == 4
    for (x, y, rows), (x0, y0, rows0) in zip(finished, plain, strict=True):
        assert x.dtype == torch.float32 and x.shape == x0.shape and np.array_equal(rows, rows0)
        torch.testing.assert_close(x, x0, rtol=0, atol=HALF_GREY + 1e-5)  # the same augmentation, unrounded
        assert torch.equal(y, y0)


def reference_weights(store, *, augment_on: str | None) -> dict[str, torch.Tensor]:
    """One trainer's run of SQUARES_RUN (batch 16, seed 3) written out with plain torch in this process, on the
    batches of a loader that augments (on the CPU, or deferred and finished here) or not (None)."""
    torch.manual_seed(3)
    model = build_model("small_cnn", num_outputs=2, width=8)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=SQUARES_RUN["lr"], momentum=0.9)
    if augment_on is None:
        batches = loader(store, augment=False).epoch(0)
    elif augment_on == "cpu":
        batches = loader(store).epoch(0)
    else:
        batches = (
            (finish_batch(p, d, normalization=DEFAULT_NORMALIZATION), y)
            for p, y, d in loader(store, augment_on="device").epoch(0)
        )
    for x, y in batches:
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(x), y).backward()
        opt.step()
    return model.state_dict()


def test_a_fit_with_device_augmentation_forced_on_cpu_trainers_trains_on_the_finished_batches(store, cluster_client):
    run = fit_squares(store, cluster_client, trainers=1, batch_size=16, seed=3, augment=True, augment_on="device")
    assert run.info["augment_on"] == "device"
    got = run.checkpoint()["model"]
    expected = reference_weights(store, augment_on="device")
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)
    # augmented: far from the weights of the same run on plain batches (0.08 apart), near the CPU path's (0.003:
    # the same augmentation, not rounded to uint8)
    plain, cpu = reference_weights(store, augment_on=None), reference_weights(store, augment_on="cpu")
    floating = [k for k in got if got[k].is_floating_point()]
    to_plain = max(float((got[k] - plain[k]).abs().max()) for k in floating)
    to_cpu = max(float((got[k] - cpu[k]).abs().max()) for k in floating)
    assert to_plain > 0.02 and to_cpu < to_plain / 5, (to_plain, to_cpu)
    assert np.isfinite(run.history["train_loss"]).all() and run.history["steps"].iloc[0] == 4


@pytest.mark.parametrize(
    "value, match",
    [
        ("gpu", r"unknown augment_on 'gpu': use one of auto, cpu, device"),
        (True, r"unknown augment_on True: use one of auto, cpu, device"),
    ],
)
def test_a_bad_augment_on_is_refused_before_any_trainer_starts(store, cluster_client, value, match):
    ds = dask_dl.open_dataset(store)
    with pytest.raises(ConfigurationError, match=match):
        check_run(ds, augment_on=value)
    with pytest.raises(ConfigurationError, match=match):
        fit_squares(store, cluster_client, augment=True, augment_on=value)


def test_the_train_command_takes_augment_on_and_names_its_values(tmp_path):
    from click.testing import CliRunner

    from dask_dl.cli import cli

    result = CliRunner().invoke(cli, ["train", str(tmp_path), "--augment-on", "gpu"])
    assert result.exit_code == 2
    assert "'gpu' is not one of 'auto', 'cpu', 'device'" in result.output


# ---- CUDA: skipped without a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_cuda_feed_copies_pinned_batches_ahead_and_finishes_them_on_the_gpu(store):
    """The loader pins on its thread; the feed's batches are on the GPU, equal to the CPU tensors' finish."""
    device = torch.device("cuda", torch.cuda.current_device())
    pinned = list(loader(store, augment_on="device", pin_memory=True, prefetch=2).epoch(0, with_samples=True))
    assert all(p.is_pinned() and y.is_pinned() and d.is_pinned() for p, y, _, d in pinned)
    feed = DeviceFeed(device, normalization=DEFAULT_NORMALIZATION, deferred=True, depth=2)
    got = [(x, y, rows) for x, y, rows in feed(iter(pinned))]
    assert len(got) == len(pinned)
    for (x, y, rows), (p, y0, rows0, d) in zip(got, pinned, strict=True):
        assert x.device == device and y.device == device and np.array_equal(rows, rows0)
        expected = finish_batch(p, d, normalization=DEFAULT_NORMALIZATION)
        torch.testing.assert_close(x.cpu(), expected, rtol=0, atol=1e-4)
        assert torch.equal(y.cpu(), y0)
    # the CPU path pinned too (a GPU trainer told augment_on="cpu"): normalized floats, copied ahead alike
    cpu_path = loader(store, pin_memory=True, augment=Augmentation()).epoch(0, with_samples=True)
    expected = [x0 for x0, _ in loader(store, augment=Augmentation()).epoch(0)]
    feed = DeviceFeed(device, normalization=DEFAULT_NORMALIZATION, deferred=False)
    for (x, _, _), x0 in zip(feed(cpu_path), expected, strict=True):
        assert x.device == device and torch.equal(x.cpu(), x0)


@pytest.mark.gpu
def test_leaving_a_cuda_feed_early_stops_the_loaders_thread(store):
    device = torch.device("cuda", torch.cuda.current_device())
    batches = DeviceFeed(device, normalization=DEFAULT_NORMALIZATION, deferred=True)(
        loader(store, augment_on="device", pin_memory=True, prefetch=2).epoch(0, with_samples=True)
    )
    next(batches)
    batches.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("dask-dl-loader")]
