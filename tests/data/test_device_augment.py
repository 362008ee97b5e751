"""Device augmentation (dask_dl/data/device_augment.py) and the loader's deferred batches (``augment_on="device"``).

The ops are plain torch and run on whatever device the pixels are on: here, CPU tensors. The CUDA-only parts
(pinned batches copied ahead on a stream of their own) are in tests/train/test_feed.py, marked ``gpu``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from dask_dl.data.device_augment import COLUMNS, augment_batch, draw_parameters, finish_batch
from dask_dl.data.loader import Augmentation, ChunkLoader
from dask_dl.data.position import EpochPosition
from dask_dl.errors import ConfigurationError
from dask_dl.normalize import DEFAULT_NORMALIZATION
from dask_dl.testing import data as kit

#: every range on, flips included
WIDE = Augmentation(rotation=10, scale=0.1, shift=0.08, brightness=0.2, contrast=0.3, hflip=True)
IDENTITY = [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
N, SIZE = 384, 16
#: half a grey level after normalization: what the CPU path's rounding to uint8 may move a pixel
HALF_GREY = 0.5 / 255 / DEFAULT_NORMALIZATION["std"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return kit.write_store(tmp_path_factory.mktemp("device-augment") / "s.zarr", n=N, size=SIZE, chunk=16, shard=2)


def parameters(**changes: float) -> torch.Tensor:
    row = dict(zip(COLUMNS, IDENTITY, strict=True)) | changes
    return torch.tensor([[row[c] for c in COLUMNS]], dtype=torch.float64)


def structured(size: int = 32, *, mark: bool = True) -> torch.Tensor:
    """One grey image ``(1, 1, S, S)`` in 0..1 with no symmetry: any move, turn or flip changes it (a smooth ramp,
    and a bright mark near the top left unless ``mark=False``)."""
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    image = (0.2 + 0.5 * xx / size + 0.2 * (yy / size) ** 2).float()
    if mark:
        image[4:10, 6:9] = 1.0
    return image[None, None]


# ---- per-image parameters --------------------------------------------------------------------------------


def test_each_image_of_a_batch_gets_its_own_parameters():
    x = structured().repeat(16, 1, 1, 1)  # sixteen equal images
    drawn = WIDE.draw(16, np.random.default_rng(0))
    out = augment_batch(x, drawn)
    closest = min(float((out[i] - out[j]).abs().max()) for i, j in itertools.combinations(range(16), 2))
    assert closest > 0.02, "two equal images came out (nearly) equal: one set of parameters for the batch?"
    # one row for all sixteen makes them equal again: the differences come from the rows alone
    same = augment_batch(x, np.repeat(drawn[:1], 16, axis=0))
    assert all(torch.equal(same[i], same[0]) for i in range(16))
    torch.testing.assert_close(same[0], out[0], rtol=0, atol=0)


def test_each_parameter_does_what_its_column_says():
    x = structured()
    torch.testing.assert_close(augment_batch(x, parameters()), x, rtol=0, atol=1e-6)
    # a flip mirrors left-right; a quarter turn turns the picture (counter-clockwise as displayed, row 0 on top)
    torch.testing.assert_close(augment_batch(x, parameters(flip=-1.0)), x.flip(3), rtol=0, atol=1e-6)
    turned = augment_batch(x, parameters(angle=math.pi / 2))
    torch.testing.assert_close(turned, torch.rot90(x, 1, dims=(2, 3)), rtol=0, atol=1e-5)
    # a shift of a quarter of the side moves the picture 8 of 32 pixels, black coming in
    shifted = augment_batch(x, parameters(shift_x=0.25))
    torch.testing.assert_close(shifted[..., :, :-8], x[..., :, 8:], rtol=0, atol=1e-6)
    assert float(shifted[..., :, -8:].abs().max()) == 0.0
    # a zoom of 2 shows the middle half of the picture, twice as large (every other pixel falls a quarter pixel
    # from one of the original's: a smooth picture, so that interpolating there changes little)
    ramp = structured(mark=False)
    zoomed = augment_batch(ramp, parameters(zoom=2.0))
    torch.testing.assert_close(zoomed[..., 1::2, 1::2], ramp[..., 8:24, 8:24], rtol=0, atol=0.01)
    # contrast scales the distance to the image's mean, brightness adds to every pixel
    halves = torch.full((1, 1, 8, 8), 0.25)
    halves[..., 4:] = 0.75
    expected = torch.where(halves > 0.5, 0.875, 0.125)
    torch.testing.assert_close(augment_batch(halves, parameters(contrast=1.5)), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(augment_batch(halves, parameters(brightness=0.1)), halves + 0.1, rtol=0, atol=1e-6)
    assert float(augment_batch(halves, parameters(brightness=0.5)).max()) == 1.0  # clamped to full scale


def test_the_parameters_fill_the_configured_ranges_uniformly():
    drawn = WIDE.draw(40_000, np.random.default_rng(0))
    ranges = {
        "angle": (-math.radians(10), math.radians(10)),
        "zoom": (0.9, 1.1),
        "shift_x": (-0.08, 0.08),
        "shift_y": (-0.08, 0.08),
        "contrast": (0.7, 1.3),
        "brightness": (-0.2, 0.2),
    }
    for name, (low, high) in ranges.items():
        column, width = drawn[:, COLUMNS.index(name)], high - low
        assert low <= column.min() < low + 0.01 * width and high - 0.01 * width < column.max() <= high, name
        assert column.mean() == pytest.approx((low + high) / 2, abs=0.01 * width), name
        assert column.std() == pytest.approx(width / math.sqrt(12), rel=0.02), name  # a uniform's spread
    flips = drawn[:, COLUMNS.index("flip")]
    assert set(np.unique(flips)) == {-1.0, 1.0} and 0.48 < (flips < 0).mean() < 0.52
    assert (Augmentation().draw(1000, np.random.default_rng(0))[:, COLUMNS.index("flip")] == 1.0).all()


def test_the_same_seed_draws_the_same_parameters_and_skip_draws_as_many():
    a, b = np.random.default_rng([3, 1]), np.random.default_rng([3, 1])
    np.testing.assert_array_equal(draw_parameters(WIDE, 8, a), WIDE.draw(8, b))
    c = np.random.default_rng([3, 1])
    WIDE.skip(8, c)  # what a resumed epoch does for the batches already served
    np.testing.assert_array_equal(WIDE.draw(4, a), WIDE.draw(4, c))
    assert not np.array_equal(WIDE.draw(4, np.random.default_rng([4, 1])), WIDE.draw(4, np.random.default_rng([3, 1])))


# ---- the loader's deferred batches ------------------------------------------------------------------------


def deferred(store, *, seed: int = 0, augment=WIDE, **options) -> ChunkLoader:
    return ChunkLoader(store, np.arange(N), batch_size=32, seed=seed, augment=augment, augment_on="device", **options)


def test_deferred_batches_are_uint8_pixels_with_their_parameters(store):
    plain = list(deferred(store, augment=False).epoch(0, with_samples=True))
    for x, y, rows, drawn in plain:
        assert x.dtype == torch.uint8 and x.shape == (32, 1, SIZE, SIZE) and drawn is None
        np.testing.assert_array_equal(x[:, 0].numpy(), np.stack([kit.row_pattern(int(i), SIZE) for i in rows]))
        assert y.shape == (32, 3)
    x, y, drawn = next(deferred(store).epoch(0))  # without samples: pixels, labels, parameters
    assert x.dtype == torch.uint8 and drawn.dtype == torch.float64 and drawn.shape == (32, len(COLUMNS))


def test_device_path_augments_each_image_as_the_cpu_path_does(store):
    """Same seed, same stream: the device path's images are the CPU path's, less its rounding to uint8."""
    cpu = ChunkLoader(store, np.arange(N), batch_size=32, seed=5, augment=WIDE)
    batches = zip(cpu.epoch(2, with_samples=True), deferred(store, seed=5).epoch(2, with_samples=True), strict=True)
    for (x_cpu, y_cpu, rows_cpu), (pixels, y, rows, drawn) in batches:
        np.testing.assert_array_equal(rows, rows_cpu)
        torch.testing.assert_close(y, y_cpu, rtol=0, atol=0)
        x = finish_batch(pixels, drawn, normalization=cpu.normalization)
        torch.testing.assert_close(x, x_cpu, rtol=0, atol=HALF_GREY + 1e-5)
        assert float((x - x_cpu).abs().mean()) < 0.6 * HALF_GREY  # rounding: a quarter grey level on average


def image_statistics(batches) -> tuple[np.ndarray, np.ndarray]:
    x = torch.cat(list(batches))
    return x.mean(dim=(1, 2, 3)).numpy(), x.std(dim=(1, 2, 3)).numpy()


@pytest.mark.parametrize("brighter", [False, True])
def test_device_and_cpu_paths_draw_from_the_same_ranges(store, brighter):
    """A distribution check, not equality: other seeds, the same law of each image's mean and spread. The same
    check tells apart a device path whose brightness range is twice as wide (``brighter``)."""
    cpu = ChunkLoader(store, np.arange(N), batch_size=32, seed=1, augment=WIDE)
    cpu_mean, cpu_std = image_statistics(x for x, _ in cpu.epoch(0))
    device_augment = Augmentation(**{**WIDE.to_dict(), "brightness": 0.4}) if brighter else WIDE
    loader = deferred(store, seed=2, augment=device_augment)
    finished = (finish_batch(p, d, normalization=loader.normalization) for p, _, d in loader.epoch(0))
    dev_mean, dev_std = image_statistics(finished)
    p_mean = stats.ks_2samp(cpu_mean, dev_mean).pvalue
    p_std = stats.ks_2samp(cpu_std, dev_std).pvalue
    if brighter:
        assert p_mean < 1e-4, p_mean
    else:
        assert p_mean > 1e-3 and p_std > 1e-3, (p_mean, p_std)


def test_a_resumed_epoch_hands_over_the_same_pixels_and_parameters(store):
    full = list(deferred(store, seed=7).epoch(1, with_samples=True))
    step = 5
    position = EpochPosition.start(1, seed=7, world_size=1, batch_size=32).advanced(step)
    resumed = list(deferred(store, seed=7).epoch(1, with_samples=True, position=position))
    assert len(resumed) == len(full) - step
    for (x, y, rows, drawn), (x0, y0, rows0, drawn0) in zip(resumed, full[step:], strict=True):
        assert torch.equal(x, x0) and torch.equal(y, y0) and np.array_equal(rows, rows0)
        assert torch.equal(drawn, drawn0)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"augment_on": "gpu"}, r"unknown augment_on 'gpu': use one of cpu, device"),
        ({"augment_on": True}, r"unknown augment_on True: use one of cpu, device"),
    ],
)
def test_bad_augment_on_is_explained(store, options, match):
    with pytest.raises(ConfigurationError, match=match):
        ChunkLoader(store, np.arange(N), batch_size=32, augment=True, **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_pinned_memory_without_cuda_is_explained(store):
    with pytest.raises(ConfigurationError, match=r"pin_memory=True needs CUDA .*pass pin_memory=False"):
        deferred(store, pin_memory=True)
