"""Hostile paths and files: each is one reject with a reason, never a hang, a crash or unbounded reading."""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path

import dask.config
import numpy as np
import pytest
from PIL import Image

from dask_dl.data.images import ImageRejected, load_image
from dask_dl.data.paths import PathPolicy
from dask_dl.errors import ConfigurationError
from dask_dl.testing.data import png_bomb, write_dicom, write_png


def rejected(path, **kwargs) -> ImageRejected:
    with pytest.raises(ImageRejected) as info:
        load_image(path, **{"size": 32, **kwargs})
    return info.value


@pytest.mark.timeout(30)
def test_fifo_is_a_reject_not_a_hang(tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    error = rejected(fifo)
    assert error.reason == "unreadable" and "a FIFO (named pipe), not a regular file" in error.detail


@pytest.mark.timeout(30)
def test_devices_and_folders_are_not_read(tmp_path):
    (tmp_path / "zero.png").symlink_to("/dev/zero")  # read without bound, it fills a worker's memory
    error = rejected(tmp_path / "zero.png")
    assert error.reason == "unreadable" and "a character device" in error.detail
    (tmp_path / "folder.png").mkdir()
    assert "a folder" in rejected(tmp_path / "folder.png").detail


def test_nul_byte_in_a_path_is_refused(tmp_path):
    error = rejected(str(tmp_path / "a\x00b.png"))
    assert error.reason == "refused" and error.detail == "the path holds a NUL byte"
    assert "\\x00" in error.path  # printable in the rejects table


def test_files_over_the_size_limit_are_not_read(tmp_path):
    path = write_png(tmp_path / "big.png", seed=0, shape=(64, 64))
    size = path.stat().st_size
    with dask.config.set({"dask-dl.ingest.max-file-bytes": size - 1}):
        error = rejected(path)
    assert error.reason == "too_large"
    assert f"the file has {size} bytes, over dask-dl.ingest.max-file-bytes = {size - 1}" in error.detail
    assert load_image(path, size=32).shape == (32, 32)  # the default limit lets it through


def test_a_file_that_grows_after_it_was_measured_is_read_whole_up_to_the_limit(tmp_path, monkeypatch):
    path = write_png(tmp_path / "grows.png", seed=2, shape=(64, 64))
    data = path.read_bytes()
    real_fstat = os.fstat

    def measured_short(fd):  # the file grew between fstat and read: a race no test can time, so fstat is told to lag
        info = real_fstat(fd)
        return os.stat_result((*info[:6], info.st_size // 2, *info[7:]))

    monkeypatch.setattr("dask_dl.data.paths.os.fstat", measured_short)
    assert PathPolicy.from_config().read(str(path)) == data  # every byte, not the size fstat gave
    np.testing.assert_array_equal(load_image(path, size=32), load_image(path, size=32, max_image_bytes=2**20))
    error = rejected(path, policy=PathPolicy.from_config(max_file_bytes=len(data) - 1))
    assert error.reason == "too_large"
    assert error.detail.startswith(f"the file has {len(data)} bytes, over dask-dl.ingest.max-file-bytes")


def test_png_decompression_bomb_is_rejected_from_its_header(tmp_path):
    bomb = png_bomb(tmp_path / "bomb.png")  # 9000 x 9000 16-bit RGBA, under Pillow's pixel limit
    assert bomb.stat().st_size < 1_000_000
    error = rejected(bomb)
    assert error.reason == "too_large"
    assert error.detail.startswith("9000x9000 pixels x 4 channel(s) x 2 byte(s) = 648000000 bytes decoded, over")
    # the budget is a setting: a small bomb under it decodes (to black)
    small = png_bomb(tmp_path / "small.png", side=64)
    np.testing.assert_array_equal(load_image(small, size=32), np.zeros((32, 32), np.uint8))
    with dask.config.set({"dask-dl.ingest.max-image-bytes": 64 * 64 * 8 - 1}):
        assert rejected(small).reason == "too_large"


def test_dicom_decompression_bomb_is_rejected_from_its_header(tmp_path):
    path = tmp_path / "bomb.dcm"
    write_dicom(path, np.zeros((4, 4), np.uint16), bits=16)
    import pydicom

    ds = pydicom.dcmread(path)
    ds.Rows = ds.Columns = 12000  # the header promises 288 MB of pixels; the budget refuses before decoding
    ds.save_as(path)
    error = rejected(path)
    assert error.reason == "too_large"
    assert error.detail.startswith("12000x12000 pixels x 1 channel(s) x 2 byte(s) = 288000000 bytes decoded")


def test_pillow_pixel_limit_is_too_large(tmp_path, monkeypatch):
    path = write_png(tmp_path / "a.tif", seed=1, shape=(64, 64))
    Image.open(path).save(tmp_path / "a.bmp")
    # Pillow's own bomb check (a process-wide setting Pillow documents for exactly this) also counts as too_large
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 64 // 4)
    assert rejected(tmp_path / "a.bmp").reason == "too_large"


@pytest.mark.timeout(30)
def test_url_schemes_must_be_allowed(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))  # never answers: a fetch would hang
    url = f"http://127.0.0.1:{server.getsockname()[1]}/x.png"
    try:
        error = rejected(url)
    finally:
        server.close()
    assert error.reason == "refused"
    schemes = ["file", "s3", "gs", "gcs", "az", "abfs", "abfss"]  # files and object stores, not http
    assert f"the scheme 'http' is not allowed (dask-dl.ingest.allowed-schemes is {schemes})" in error.detail
    assert f"dask.config.set({{'dask-dl.ingest.allowed-schemes': {[*schemes, 'http']}}})" in error.detail
    assert rejected("ftp://127.0.0.1/x.png").reason == "refused"
    with dask.config.set({"dask-dl.ingest.allowed-schemes": ["file", "memory"]}):
        import fsspec

        source = write_png(tmp_path / "m.png", seed=3, shape=(40, 40))
        with fsspec.open("memory://dask-dl-paths/m.png", "wb") as f:
            f.write(source.read_bytes())
        np.testing.assert_array_equal(load_image("memory://dask-dl-paths/m.png", size=32), load_image(source, size=32))
        assert rejected("memory://dask-dl-paths/absent.png").reason == "missing"


def test_paths_must_stay_under_the_allowed_roots(tmp_path):
    root = tmp_path / "collection"
    inside = write_png(root / "a.png", seed=0, shape=(40, 40))
    outside = write_png(tmp_path / "secret.png", seed=1, shape=(40, 40))
    (root / "escape.png").symlink_to(outside)
    with dask.config.set({"dask-dl.ingest.allowed-roots": [str(root)]}):
        assert load_image(inside, size=32).shape == (32, 32)
        for path in (outside, root / "escape.png", root / ".." / "secret.png"):
            error = rejected(path)
            assert error.reason == "refused" and f"{outside} is outside the allowed roots" in error.detail


def test_policy_settings_are_checked():
    with pytest.raises(ConfigurationError, match="lists"):
        PathPolicy.from_config(schemes="file")
    with pytest.raises(ConfigurationError, match="max_file_bytes must be a positive integer, got 0"):
        PathPolicy.from_config(max_file_bytes=0)
    policy = PathPolicy.from_config(schemes=["FILE", "s3"], roots=["~"])
    assert policy.schemes == ("file", "s3") and policy.roots == (os.path.realpath(Path.home()),)


# ---- DICOM files that decode to nothing useful --------------------------------------------------------------


def test_dicom_with_a_zero_rescale_slope_is_degenerate(tmp_path):
    ramp = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) % 4096
    write_dicom(tmp_path / "flat.dcm", ramp, RescaleSlope=0, RescaleIntercept=100)
    error = rejected(tmp_path / "flat.dcm")
    assert error.reason == "degenerate" and "constant after scaling" in error.detail
    write_dicom(tmp_path / "fine.dcm", ramp, RescaleSlope=1, RescaleIntercept=100)
    assert load_image(tmp_path / "fine.dcm", size=32).std() > 10


def test_dicom_with_a_nan_rescale_slope_is_degenerate(tmp_path):
    ramp = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) % 4096
    with warnings.catch_warnings():  # pydicom warns that 'NaN' is no valid DS: the file is broken on purpose
        warnings.simplefilter("ignore")
        write_dicom(tmp_path / "nan.dcm", ramp, RescaleSlope="NaN", RescaleIntercept=0)
    error = rejected(tmp_path / "nan.dcm")
    assert error.reason == "degenerate"
    # deterministic (no memory address of a file object), so that status files are identical from run to run
    assert error.detail.startswith("the modality LUT (RescaleSlope 'NaN'") and "0x" not in error.detail


def test_dicom_window_that_maps_everything_to_white_is_degenerate(tmp_path):
    ramp = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) % 4096
    write_dicom(tmp_path / "white.dcm", ramp, WindowCenter=-5000, WindowWidth=10)
    error = rejected(tmp_path / "white.dcm")
    assert error.reason == "degenerate" and "every pixel 255" in error.detail


def test_damaged_compressed_dicom_pixels_are_rejected(tmp_path):
    import pydicom
    from pydicom.uid import RLELossless

    ramp = (np.add.outer(np.arange(64), np.arange(64)) * 30).astype(np.uint16) % 4096
    write_dicom(tmp_path / "plain.dcm", ramp, WindowCenter=2048, WindowWidth=4096)
    ds = pydicom.dcmread(tmp_path / "plain.dcm")
    ds.compress(RLELossless)
    ds.save_as(tmp_path / "rle.dcm")
    expected = load_image(tmp_path / "plain.dcm", size=32)
    np.testing.assert_array_equal(load_image(tmp_path / "rle.dcm", size=32), expected)
    data = bytearray((tmp_path / "rle.dcm").read_bytes())
    for i in range(len(data) - 300, len(data) - 250):  # damage inside the RLE segments
        data[i] ^= 0x5A
    (tmp_path / "damaged.dcm").write_bytes(bytes(data))
    error = rejected(tmp_path / "damaged.dcm")  # decoded, it is far from the original: pydicom warns
    assert error.reason == "undecodable" and error.detail.startswith("the decoder warned: The decoded RLE segment")
    (tmp_path / "cut.dcm").write_bytes(bytes(data[:-40]))
    assert rejected(tmp_path / "cut.dcm").reason in ("undecodable", "truncated")
