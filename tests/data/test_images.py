"""load_image: decoding, grayscale, padding, anti-aliased resizing and the reasons an image is rejected."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image
from scipy.ndimage import gaussian_filter

from dask_dl.data.dicom import read_pixels
from dask_dl.data.images import REJECT_REASONS, ImageRejected, load_image, resize_square, to_gray


def smooth_image(shape: tuple[int, int], seed: int = 0, sigma: float = 6) -> np.ndarray:
    noise = gaussian_filter(np.random.default_rng(seed).random(shape), sigma)
    return np.rint((noise - noise.min()) / (noise.max() - noise.min()) * 255).astype(np.uint8)


def save(array: np.ndarray, path, mode: str | None = None, **kwargs) -> str:
    image = Image.fromarray(array) if mode is None else Image.fromarray(array).convert(mode)
    image.save(path, **kwargs)
    return os.fspath(path)


def pillow_luma(rgb: np.ndarray) -> np.ndarray:
    """BT.601 luma in Pillow's integer arithmetic, written out independently of dask_dl."""
    r, g, b = (rgb[..., i].astype(np.int64) for i in range(3))
    return ((r * 19595 + g * 38470 + b * 7471 + 32768) >> 16).astype(np.uint8)


def test_resize_keeps_mean_and_matches_area_average(tmp_path):
    source = smooth_image((512, 512), sigma=12)
    out = load_image(save(source, tmp_path / "a.png"), size=64, min_size=64)
    assert out.shape == (64, 64) and out.dtype == np.uint8
    assert abs(out.mean() - source.mean()) < 0.25
    error = np.abs(out - source.reshape(64, 8, 64, 8).mean(axis=(1, 3)))  # exact area average over 8x8 blocks
    assert error.mean() < 1.0 and error.max() < 5
    # full-precision Lanczos over the whole image (no integer pre-reduction), in float
    lanczos = np.asarray(Image.fromarray(source.astype(np.float32)).resize((64, 64), Image.Resampling.LANCZOS))
    error = np.abs(out - lanczos)
    assert error.mean() < 0.5 and error.max() < 2


def test_nyquist_checkerboard_becomes_flat_gray(tmp_path):
    yy, xx = np.indices((256, 256))
    board = np.where((yy + xx) % 2 == 0, 255, 0).astype(np.uint8)
    out = load_image(save(board, tmp_path / "board.png"), size=64, min_size=64)
    assert abs(out.mean() - 127.5) < 1.0
    assert out.min() >= 125 and out.max() <= 130
    naive = board[::4, ::4]  # nearest-neighbour subsampling aliases the pattern to a constant black or white
    assert naive.std() == 0 and abs(naive.mean() - 127.5) > 100


def test_rgba_and_rgb_are_601_luma_alpha_ignored(tmp_path):
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)
    alpha = rng.integers(0, 256, (96, 96, 1), dtype=np.uint8)
    rgba = np.concatenate([rgb, alpha], axis=2)
    expected = pillow_luma(rgb)
    float_luma = rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114
    assert np.abs(expected - float_luma).max() <= 0.5 + 1e-9
    for name, array in [("rgb.png", rgb), ("rgba.png", rgba), ("rgba.tif", rgba), ("rgb.bmp", rgb)]:
        out = load_image(save(array, tmp_path / name), size=96, min_size=64)
        np.testing.assert_array_equal(out, expected, err_msg=name)
    gray = load_image(save(rgb, tmp_path / "l.png", mode="L"), size=96, min_size=64)
    np.testing.assert_array_equal(gray, np.asarray(Image.fromarray(rgb).convert("L")))
    np.testing.assert_array_equal(gray, expected)


def test_palette_and_gray_alpha(tmp_path):
    gray = smooth_image((80, 80), seed=3)
    palette = Image.fromarray(np.stack([gray] * 3, axis=2)).quantize(64)
    palette.save(tmp_path / "p.png")
    out = load_image(tmp_path / "p.png", size=80, min_size=64)
    np.testing.assert_array_equal(out, pillow_luma(np.asarray(palette.convert("RGB"))))
    la = np.stack([gray, np.full_like(gray, 9)], axis=2)
    Image.fromarray(la, mode="LA").save(tmp_path / "la.png")
    np.testing.assert_array_equal(load_image(tmp_path / "la.png", size=80, min_size=64), gray)


def test_16_bit_is_stretched_to_min_max(tmp_path):
    values = np.linspace(1000, 5000, 64 * 64).reshape(64, 64).astype(np.uint16)
    Image.fromarray(values).save(tmp_path / "16.png")
    out = load_image(tmp_path / "16.png", size=64, min_size=64)
    np.testing.assert_array_equal(out, np.rint((values - 1000.0) * 255 / 4000).astype(np.uint8))


def test_non_square_is_centre_padded_with_black(tmp_path):
    out = load_image(save(np.full((128, 64), 200, np.uint8), tmp_path / "tall.png"), size=64, min_size=64)
    # the 64 px wide image sits in columns 32..95 of a 128 px square, i.e. columns 16..47 after halving
    assert (out[:, :12] == 0).all() and (out[:, 52:] == 0).all()  # Lanczos rings 3 px
    assert (out[:, 20:44] == 200).all()
    np.testing.assert_array_equal(out, out[:, ::-1])  # centred: symmetric


def test_real_nih_pngs(shared_data):
    for name in ("00000001_000.png", "00027426_000.png"):
        path = shared_data / "nih" / name
        original = np.asarray(Image.open(path).convert("L"))
        assert original.shape[0] == original.shape[1]  # NIH images are square (these copies are 512 px)
        out = load_image(path, size=64)
        assert out.shape == (64, 64) and out.dtype == np.uint8
        assert abs(out.mean() - original.mean()) < 1.0
        np.testing.assert_array_equal(out, resize_square(original, size=64))
        np.testing.assert_array_equal(load_image(path, size=original.shape[0]), original)


def test_real_dicoms_go_through_read_pixels(shared_data):
    for path in sorted((shared_data / "dicom").glob("*.dcm")):
        out = load_image(path, size=64, min_size=8)
        np.testing.assert_array_equal(out, resize_square(read_pixels(str(path)), size=64))


def rejected(path, **kwargs) -> ImageRejected:
    with pytest.raises(ImageRejected) as info:
        load_image(path, **{"size": 32, "min_size": 64, **kwargs})
    assert info.value.reason in REJECT_REASONS
    assert str(path) in str(info.value)
    return info.value


def test_rejection_reasons(tmp_path):
    assert rejected(tmp_path / "absent.png").reason == "missing"
    os.mkdir(tmp_path / "folder.png")
    assert rejected(tmp_path / "folder.png").reason == "unreadable"
    (tmp_path / "garbage.png").write_bytes(b"this is not an image" * 10)
    assert rejected(tmp_path / "garbage.png").reason == "undecodable"
    (tmp_path / "empty.png").write_bytes(b"")
    assert rejected(tmp_path / "empty.png").reason == "undecodable"
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (128, 128), np.uint8)).save(buffer, format="PNG")
    (tmp_path / "cut.png").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    assert rejected(tmp_path / "cut.png").reason == "truncated"
    buffer = io.BytesIO()
    Image.fromarray(smooth_image((128, 128))).save(buffer, format="JPEG")
    (tmp_path / "cut.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    assert rejected(tmp_path / "cut.jpg").reason == "truncated"
    small = rejected(save(np.zeros((100, 40), np.uint8), tmp_path / "small.png"))
    assert small.reason == "too_small" and "40" in small.detail and "min-size 64" in small.detail
    # the same image passes when min_size allows it
    assert load_image(tmp_path / "small.png", size=32, min_size=40).shape == (32, 32)


def test_min_size_and_size_come_from_config(tmp_path):
    import dask.config

    path = save(smooth_image((96, 96)), tmp_path / "a.png")
    with dask.config.set({"dask-dl.ingest.size": 48, "dask-dl.ingest.min-size": 100}):
        assert rejected(path, size=None, min_size=None).reason == "too_small"
    with dask.config.set({"dask-dl.ingest.size": 48, "dask-dl.ingest.min-size": 96}):
        assert load_image(path).shape == (48, 48)


def test_to_gray_rejects_odd_shapes():
    with pytest.raises(ValueError, match="5 channels"):
        to_gray(np.zeros((4, 4, 5), np.uint8))
    np.testing.assert_array_equal(to_gray(np.full((2, 2), 7.0)), np.zeros((2, 2), np.uint8))  # constant float


def test_results_never_share_the_reused_decode_buffer(tmp_path):
    first = load_image(save(np.full((64, 64), 10, np.uint8), tmp_path / "a.png"), size=64, min_size=64)
    second = load_image(save(np.full((64, 64), 20, np.uint8), tmp_path / "b.png"), size=64, min_size=64)
    assert (first == 10).all() and (second == 20).all()
    rgba = np.concatenate([np.full((64, 64, 3), 30, np.uint8), np.zeros((64, 64, 1), np.uint8)], axis=2)
    third = load_image(save(rgba, tmp_path / "c.png"), size=64, min_size=64)  # another buffer shape
    assert (first == 10).all() and (second == 20).all() and (third == 30).all()
