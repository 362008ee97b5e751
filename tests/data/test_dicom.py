"""DICOM pixels and headers (dask_dl.data.dicom) on the two real chest X-ray DICOMs and on files written here."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pydicom
import pytest
from pydicom.dataset import Dataset

from dask_dl.data import dicom_gdcm
from dask_dl.data.dicom import is_dicom_file, read_dicom, read_header, read_pixels
from dask_dl.data.schema import NIH_LABELS
from dask_dl.errors import CatalogError, ConfigurationError, MissingDependencyError, StoreNotFoundError
from dask_dl.testing.data import write_dicom

MONO2 = "1.2.276.0.7230010.3.1.4.8323329.6904.1517875201.850819.dcm"
MONO1 = "Fake_MONOHR1.dcm"


@pytest.fixture
def ramp12() -> np.ndarray:
    """A 12-bit image covering 0..4095 with a few repeats, 48 x 96."""
    return (np.arange(48 * 96).reshape(48, 96) % 4096).astype(np.uint16)


# ---- the real files ---------------------------------------------------------------------------------------


def test_real_monochrome2_is_min_max_scaled(shared_data):
    path = shared_data / "dicom" / MONO2
    raw = pydicom.dcmread(path).pixel_array  # 8-bit JPEG baseline, no VOI LUT or window
    image = read_pixels(str(path))
    assert image.dtype == np.uint8 and image.shape == (1024, 1024)
    assert (image.min(), image.max()) == (0, 255)
    # The dicom extra's 8-bit JPEG decoders, GDCM (pydicom's first choice: its IJG libjpeg) and Pillow
    # (libjpeg-turbo, a core dependency), decode this file to the same 0..254; the ISO libjpeg of the GPL
    # pylibjpeg-libjpeg, which the extra leaves out, decodes it to 0..255 (3 % of the pixels one grey level apart)
    decoded = {}
    for plugin in ("gdcm", "pillow"):
        ds = pydicom.dcmread(path)
        ds.pixel_array_options(decoding_plugin=plugin)
        decoded[plugin] = ds.pixel_array
    np.testing.assert_array_equal(decoded["gdcm"], decoded["pillow"])
    np.testing.assert_array_equal(raw, decoded["gdcm"])
    assert (raw.min(), raw.max()) == (0, 254)
    expected = np.rint(raw.astype(np.float64) * 255.0 / 254.0).astype(np.uint8)
    np.testing.assert_array_equal(image, expected)


def test_real_monochrome1_is_inverted(shared_data):
    mono1 = pydicom.dcmread(shared_data / "dicom" / MONO1)
    assert mono1.PhotometricInterpretation == "MONOCHROME1"
    raw = mono1.pixel_array.astype(np.float64)
    image = read_pixels(str(shared_data / "dicom" / MONO1))
    assert image.dtype == np.uint8 and image.shape == (1024, 1024)
    expected = 255 - np.rint((raw - raw.min()) * 255.0 / (raw.max() - raw.min())).astype(np.uint8)
    np.testing.assert_array_equal(image, expected)
    # The two files hold the same pixel data, so together they add up to white everywhere.
    other = read_pixels(str(shared_data / "dicom" / MONO2))
    np.testing.assert_array_equal(image.astype(int) + other.astype(int), np.full((1024, 1024), 255))
    assert image.mean() < 128 < other.mean()  # lungs dark in MONOCHROME2, bright when inverted
    # A file object (what ingest hands over for remote files) reads the same.
    from_bytes = read_pixels(io.BytesIO((shared_data / "dicom" / MONO1).read_bytes()))
    np.testing.assert_array_equal(from_bytes, image)


def test_real_headers(shared_data):
    header = read_header(str(shared_data / "dicom" / MONO2))
    assert header == {
        "sop_uid": "1.2.276.0.7230010.3.1.4.8323329.6904.1517875201.850819",
        "patient_id": "16d7f894-55d7-4d95-8957-d18987f0e981",
        "age": 62.0,
        "sex": "M",
        "view": "PA",
        "orig_width": 1024,
        "orig_height": 1024,
        "spacing_x": 0.168,
        "spacing_y": 0.168,
    }


def test_real_folder_shares_one_uid(shared_data, tmp_path):
    # Both real files carry the same SOP Instance UID: ids by UID would collide, and the error says what to do.
    with pytest.raises(CatalogError, match="share the SOP Instance UID.*id_from='path'") as info:
        read_dicom(shared_data / "dicom")
    assert MONO1 in str(info.value) and MONO2 in str(info.value)
    catalog = read_dicom(shared_data / "dicom", id_from="path", site="NIH-dicom")
    assert sorted(catalog["image_id"]) == sorted([MONO1, MONO2])
    assert catalog.attrs == {"labels": [], "task": "multilabel"}
    assert set(catalog["site"]) == {"NIH-dicom"}
    assert catalog["patient_id"].nunique() == 1 and catalog["split"].nunique() == 1
    assert list(catalog["age"]) == [62.0, 62.0] and list(catalog["orig_width"]) == [1024, 1024]
    # the fix the error gives a shell user works from the shell
    from click.testing import CliRunner

    from dask_dl.cli import cli

    refused = CliRunner().invoke(cli, ["catalog", str(shared_data / "dicom")])
    assert refused.exit_code == 1 and "dask-dl catalog --id-from path -o catalog.parquet" in refused.output
    out = tmp_path / "catalog.parquet"
    done = CliRunner().invoke(cli, ["catalog", str(shared_data / "dicom"), "--id-from", "path", "-o", str(out)])
    assert done.exit_code == 0, done.output
    assert sorted(pd.read_parquet(out)["image_id"]) == sorted([MONO1, MONO2])


# ---- pixel pipeline on files written here -----------------------------------------------------------------


def test_rescale_then_window(tmp_path, ramp12):
    slope, intercept, center, width = 2.0, -1024.0, 1500.0, 2001.0
    path = tmp_path / "w.dcm"
    write_dicom(path, ramp12, RescaleSlope=slope, RescaleIntercept=intercept, WindowCenter=center, WindowWidth=width)
    image = read_pixels(str(path))
    # DICOM PS3.3 C.11.2.1.2.1, LINEAR window straight onto 0..255.
    v = ramp12.astype(np.float64) * slope + intercept
    c, w = center - 0.5, width - 1
    expected = np.where(v <= c - w / 2, 0.0, np.where(v > c + w / 2, 255.0, ((v - c) / w + 0.5) * 255.0))
    np.testing.assert_array_equal(image, np.rint(expected).astype(np.uint8))
    assert image.max() > image.min()  # not blank both ways
    assert 0 < np.mean((image > 0) & (image < 255)) < 1  # the window clips at both ends


def test_wide_window_keeps_its_scale(tmp_path, ramp12):
    # The whole image lies inside the window: it must stay grey, not be stretched to 0..255.
    write_dicom(tmp_path / "wide.dcm", ramp12, WindowCenter=2048, WindowWidth=8193)
    image = read_pixels(str(tmp_path / "wide.dcm"))
    v, c, w = ramp12.astype(np.float64), 2047.5, 8192.0
    np.testing.assert_array_equal(image, np.rint(((v - c) / w + 0.5) * 255.0).astype(np.uint8))
    assert (image.min(), image.max()) == (64, 191)


def test_window_on_monochrome1_is_inverted(tmp_path, ramp12):
    write_dicom(tmp_path / "m2.dcm", ramp12, WindowCenter=2048, WindowWidth=1024)
    write_dicom(tmp_path / "m1.dcm", ramp12, WindowCenter=2048, WindowWidth=1024, photometric="MONOCHROME1")
    np.testing.assert_array_equal(read_pixels(str(tmp_path / "m1.dcm")), 255 - read_pixels(str(tmp_path / "m2.dcm")))


def test_voi_lut_sequence(tmp_path, ramp12):
    # A decreasing LUT into 100..611 of a 10-bit range: min-max scaling would stretch it, the LUT must not be.
    lut = (100 + np.arange(4096)[::-1] // 8).astype(np.uint16)
    item = Dataset()
    # Both tags are "US or SS"/"US or OW" in the dictionary: give the VR so that pydicom can write them.
    item.add_new(0x00283002, "US", [4096, 0, 10])  # LUTDescriptor: entries, first mapped value, bits
    item.add_new(0x00283006, "US", lut.tolist())  # LUTData
    path = tmp_path / "lut.dcm"
    write_dicom(path, ramp12, VOILUTSequence=[item])
    expected = np.rint(lut[ramp12] * 255.0 / 1023.0).astype(np.uint8)
    np.testing.assert_array_equal(read_pixels(str(path)), expected)


def test_16_bit_without_window_is_min_max(tmp_path):
    rng = np.random.default_rng(0)
    pixels = rng.integers(1000, 60000, size=(40, 30)).astype(np.uint16)
    write_dicom(tmp_path / "16.dcm", pixels, bits=16)
    lo, hi = float(pixels.min()), float(pixels.max())
    expected = np.rint((pixels - lo) * 255.0 / (hi - lo)).astype(np.uint8)
    image = read_pixels(str(tmp_path / "16.dcm"))
    assert image.shape == (40, 30)
    np.testing.assert_array_equal(image, expected)


def test_signed_with_rescale_min_max(tmp_path):
    pixels = np.array([[-1000, 0], [500, 3000]], dtype=np.int16).repeat(8, 0).repeat(8, 1)
    write_dicom(tmp_path / "s.dcm", pixels, bits=16, RescaleSlope=1.0, RescaleIntercept=-24.0)
    image = read_pixels(str(tmp_path / "s.dcm"))
    expected = np.rint((pixels + 1000.0) * 255.0 / 4000.0).astype(np.uint8)
    np.testing.assert_array_equal(image, expected)


def test_constant_image_is_black(tmp_path):
    write_dicom(tmp_path / "c.dcm", np.full((16, 16), 700, np.uint16))
    np.testing.assert_array_equal(read_pixels(str(tmp_path / "c.dcm")), np.zeros((16, 16), np.uint8))


def test_colour_is_refused(tmp_path, ramp12):
    path = tmp_path / "rgb.dcm"
    write_dicom(path, ramp12, photometric="PALETTE COLOR")
    with pytest.raises(CatalogError, match="not a single-frame grayscale DICOM.*PALETTE COLOR"):
        read_pixels(str(path))


def test_headers_units(tmp_path, ramp12):
    path = tmp_path / "h.dcm"
    uid = write_dicom(path, ramp12, PatientAge="006M", PatientSex="F", ViewPosition="AP", PixelSpacing=[0.2, 0.3])
    header = read_header(str(path))
    assert header["sop_uid"] == uid
    assert header["age"] == 0.5
    # PixelSpacing is (row, column) spacing: rows run along y.
    assert (header["spacing_y"], header["spacing_x"]) == (0.2, 0.3)
    assert (header["orig_height"], header["orig_width"]) == (48, 96)
    write_dicom(tmp_path / "y.dcm", ramp12, PatientAge="045Y", ImagerPixelSpacing=[0.15, 0.15])
    header = read_header(str(tmp_path / "y.dcm"))
    assert header["age"] == 45.0 and header["spacing_x"] == 0.15


def test_is_dicom_file(tmp_path, ramp12):
    write_dicom(tmp_path / "noext", ramp12)
    (tmp_path / "plain").write_bytes(b"\0" * 200)
    (tmp_path / "x.png").write_bytes(b"\0" * 200)
    assert is_dicom_file(str(tmp_path / "noext"))
    assert not is_dicom_file(str(tmp_path / "plain"))
    assert not is_dicom_file(str(tmp_path / "x.png"))
    assert is_dicom_file("whatever.DCM")


# ---- read_dicom -------------------------------------------------------------------------------------------


@pytest.fixture
def dicom_root(tmp_path, ramp12) -> tuple[Path, dict[str, str]]:
    """Five DICOMs of three patients, nested, one without extension, plus files that are not DICOM."""
    root = tmp_path / "hospital"
    uids = {
        "a.dcm": write_dicom(root / "p1" / "a.dcm", ramp12, patient="P1", PatientAge="050Y", PatientSex="M"),
        "b.dcm": write_dicom(root / "p1" / "s2" / "b.dcm", ramp12, patient="P1", ViewPosition="AP"),
        "c.dcm": write_dicom(root / "p2" / "c.dcm", ramp12, patient="P2", PixelSpacing=[0.1, 0.2]),
        "d": write_dicom(root / "p3" / "d", ramp12, patient="P3"),
        "e.dcm": write_dicom(root / "e.dcm", ramp12, patient=None),
    }
    (root / "notes.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    write_dicom(root / ".hidden" / "skip.dcm", ramp12)
    return root, uids


def test_read_dicom_headers_and_ids(dicom_root):
    root, uids = dicom_root
    catalog = read_dicom(root, seed=3)
    assert sorted(catalog["image_id"]) == sorted(uids.values())
    by_file = catalog.set_index(catalog["path"].map(lambda p: Path(p).name))
    assert by_file.loc["a.dcm", "patient_id"] == "P1" and by_file.loc["b.dcm", "patient_id"] == "P1"
    assert by_file.loc["a.dcm", "age"] == 50.0 and by_file.loc["a.dcm", "sex"] == "M"
    assert by_file.loc["b.dcm", "view"] == "AP"
    assert by_file.loc["c.dcm", ["spacing_y", "spacing_x"]].tolist() == [0.1, 0.2]
    # No PatientID: the image is its own patient.
    assert by_file.loc["e.dcm", "patient_id"] == uids["e.dcm"]
    assert by_file.loc["a.dcm", "split"] == by_file.loc["b.dcm", "split"]
    assert set(catalog["site"]) == {"hospital"}
    assert catalog.attrs["labels"] == []
    by_path = read_dicom(root, id_from="path")
    assert sorted(by_path["image_id"]) == ["e.dcm", "p1/a.dcm", "p1/s2/b.dcm", "p2/c.dcm", "p3/d"]


def test_read_dicom_finding_labels(dicom_root, tmp_path):
    root, uids = dicom_root
    csv = tmp_path / "labels.csv"
    # Keyed by SOP UID, file name or path under the root, mixed.
    pd.DataFrame(
        {
            "key": [uids["a.dcm"], "b.dcm", "p2/c.dcm", "d", "e.dcm"],
            "Finding Labels": ["Effusion|Mass", "No Finding", "Hernia", "Mass", "No Finding"],
        }
    ).to_csv(csv, index=False)
    catalog = read_dicom(root, labels_csv=csv).set_index("image_id")
    assert catalog.attrs["labels"] == list(NIH_LABELS)
    rows = {name: catalog.loc[uid, list(NIH_LABELS)] for name, uid in uids.items()}
    assert rows["a.dcm"].to_dict() == {k: int(k in ("Effusion", "Mass")) for k in NIH_LABELS}
    assert rows["b.dcm"].sum() == 0 and rows["e.dcm"].sum() == 0
    assert rows["c.dcm"]["Hernia"] == 1 and rows["c.dcm"].sum() == 1
    assert rows["d"]["Mass"] == 1 and catalog[list(NIH_LABELS)].dtypes.eq(np.uint8).all()


def test_read_dicom_own_labels_and_columns(dicom_root, tmp_path):
    root, uids = dicom_root
    findings = tmp_path / "own.csv"
    names = ["a.dcm", "b.dcm", "c.dcm", "d", "e.dcm"]
    pd.DataFrame({"file": names, "Finding Labels": ["covid", "normal|covid", "normal", "normal", "normal"]}).to_csv(
        findings, index=False
    )
    catalog = read_dicom(root, labels_csv=findings)
    assert catalog.attrs["labels"] == ["covid", "normal"]
    assert int(catalog["covid"].sum()) == 2 and int(catalog["normal"].sum()) == 4
    columns = tmp_path / "cols.csv"
    pd.DataFrame({"file": names, "nodule": [1, 0, 0, 1, 0], "mass": [0, 0, 1, 1, 0]}).to_csv(columns, index=False)
    catalog = read_dicom(root, labels_csv=columns).set_index("image_id")
    assert catalog.attrs["labels"] == ["nodule", "mass"]
    assert catalog.loc[uids["d"], ["nodule", "mass"]].tolist() == [1, 1]
    only = read_dicom(root, labels_csv=columns, labels=["mass"])
    assert only.attrs["labels"] == ["mass"] and "nodule" not in only.columns
    with pytest.raises(CatalogError, match=r"lacks label column\(s\) \['effusion'\]"):
        read_dicom(root, labels_csv=columns, labels=["effusion"])


def test_read_dicom_errors(dicom_root, tmp_path, monkeypatch):
    root, _ = dicom_root
    partial = tmp_path / "partial.csv"
    pd.DataFrame({"file": ["a.dcm"], "Finding Labels": ["Mass"]}).to_csv(partial, index=False)
    with pytest.raises(CatalogError, match="4 DICOM file.* have no row"):
        read_dicom(root, labels_csv=partial)
    with pytest.raises(ConfigurationError, match="pass labels_csv="):
        read_dicom(root, labels=["Mass"])
    with pytest.raises(ConfigurationError, match="unknown id_from 'sop': use one of uid, path"):
        read_dicom(root, id_from="sop")
    with pytest.raises(StoreNotFoundError):
        read_dicom(tmp_path / "absent")
    with pytest.raises(StoreNotFoundError, match="no labels table"):
        read_dicom(root, labels_csv=tmp_path / "absent.csv")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.png").write_bytes(b"png")
    with pytest.raises(CatalogError, match="no DICOM files"):
        read_dicom(empty)
    monkeypatch.setitem(sys.modules, "pydicom", None)  # import pydicom now raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'dask-dl\[dicom\]'"):
        read_dicom(root)
    with pytest.raises(MissingDependencyError, match="pydicom"):
        read_pixels(str(root / "p1" / "a.dcm"))


def test_one_bad_header_skips_one_file(tmp_path, ramp12, caplog):
    """An unknown VR in (0028,0030) does not make read_dicom refuse the folder: that file is skipped, by name."""
    root = tmp_path / "dicoms"
    write_dicom(root / "good.dcm", ramp12, uid="1.2.3.1", PixelSpacing=[0.1, 0.1])
    write_dicom(root / "bad.dcm", ramp12, uid="1.2.3.2", PixelSpacing=[0.1, 0.1])
    data = (root / "bad.dcm").read_bytes()
    tag = b"\x28\x00\x30\x00DS"  # (0028,0030) PixelSpacing, explicit VR
    assert data.count(tag) == 1
    (root / "bad.dcm").write_bytes(data.replace(tag, b"\x28\x00\x30\x00ZZ"))
    with caplog.at_level("WARNING", logger="dask_dl.data.dicom"):
        catalog = read_dicom(root)
    assert list(catalog["image_id"]) == ["1.2.3.1"]
    [skipped] = catalog.attrs["skipped"]
    assert skipped["path"] == str(root / "bad.dcm") and "Unknown Value Representation" in skipped["reason"]
    assert "skipped 1 file(s)" in caplog.text and "bad.dcm" in caplog.text
    (root / "good.dcm").unlink()
    with pytest.raises(CatalogError, match="none of the 1 DICOM files .* has a readable header, e.g. .*bad.dcm"):
        read_dicom(root)


# ---- a deflated file that inflates to 800 MB (issue 28) ---------------------------------------------------------


def write_deflated_bomb(path: Path, *, rows: int, columns: int) -> None:
    """A Deflated Explicit VR Little Endian file of ``rows x columns`` 16-bit zeros, written without holding them.

    The dataset (header elements, then Pixel Data) is deflated in pieces as PS3.5 A.5 lays it out; pydicom reads it
    as any deflated file, and it is a few hundred times smaller than its pixels.
    """
    import struct
    import zlib

    from pydicom.filebase import DicomBytesIO
    from pydicom.filewriter import write_dataset, write_file_meta_info
    from pydicom.uid import DeflatedExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    uid = generate_uid()
    meta = pydicom.dataset.FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = SecondaryCaptureImageStorage, uid
    meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
    ds = Dataset()
    ds.SOPClassUID, ds.SOPInstanceUID, ds.PatientID = SecondaryCaptureImageStorage, uid, "P1"
    ds.Rows, ds.Columns, ds.SamplesPerPixel, ds.PhotometricInterpretation = rows, columns, 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
    head, body = DicomBytesIO(), DicomBytesIO()
    head.is_little_endian, head.is_implicit_VR = True, False
    body.is_little_endian, body.is_implicit_VR = True, False
    write_file_meta_info(head, meta)
    write_dataset(body, ds)
    pixels = rows * columns * 2
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    zeros = bytes(1 << 22)
    with open(path, "wb") as f:
        f.write(bytes(128) + b"DICM" + head.getvalue())
        f.write(deflate.compress(body.getvalue() + struct.pack("<HH2sHI", 0x7FE0, 0x0010, b"OW", 0, pixels)))
        for start in range(0, pixels, len(zeros)):
            f.write(deflate.compress(zeros[: min(len(zeros), pixels - start)]))
        f.write(deflate.flush())


@pytest.mark.slow
def test_a_deflated_bomb_is_too_large_before_it_is_inflated(tmp_path, cluster_client):
    # issue 28: pydicom inflates a deflated dataset whole before reading its header, so the worker that rejected
    # this 0.8 MB file as too_large first held its 800 MB of pixels (1.66 GB at its peak)
    import tracemalloc

    import dask_dl
    from dask_dl.data.images import ImageRejected, load_image

    root = tmp_path / "archive"
    root.mkdir()
    write_deflated_bomb(root / "bomb.dcm", rows=20000, columns=20000)
    write_deflated_bomb(tmp_path / "small.dcm", rows=64, columns=64)  # the same writer, read back whole by pydicom
    assert pydicom.dcmread(tmp_path / "small.dcm").pixel_array.shape == (64, 64)
    write_dicom(root / "fine.dcm", np.arange(64 * 64, dtype=np.uint16).reshape(64, 64), uid="1.2.3.4")
    assert (root / "bomb.dcm").stat().st_size < 1_000_000  # and 800 000 000 bytes of pixels
    tracemalloc.start()
    try:
        with pytest.raises(ImageRejected) as caught:
            load_image(root / "bomb.dcm", size=32, min_size=1)
        _, peak_load = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        catalog = read_dicom(root)  # the header fields for the catalog: no inflating either
        _, peak_catalog = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.reason == "too_large"
    assert "20000x20000 pixels x 1 channel(s) x 2 byte(s) = 800000000 bytes decoded" in caught.value.detail
    assert peak_load < 8_000_000, f"peak {peak_load / 1e6:.0f} MB while reading the header of the deflated file"
    assert peak_catalog < 8_000_000, f"peak {peak_catalog / 1e6:.0f} MB while cataloguing the deflated file"
    assert sorted(catalog["orig_width"]) == [64, 20000]
    result = dask_dl.ingest(
        catalog,
        tmp_path / "s.zarr",
        size=32,
        chunk=2,
        shard=1,
        client=cluster_client,
        progress=False,
        max_reject_share=1.0,
    )
    assert result.rejects[["path", "reason"]].values.tolist() == [[str(root / "bomb.dcm"), "too_large"]]


# ---- transfer syntaxes, with the files that ship inside pydicom (issue 28) ------------------------------------------

# the MR_small files hold the same 64 x 64 pixels (window 600/1600), each in another transfer syntax, losslessly
LOSSLESS = {
    "1.2.840.10008.1.2.1": "MR_small.dcm",  # Explicit VR Little Endian
    "1.2.840.10008.1.2": "MR_small_implicit.dcm",  # Implicit VR Little Endian
    "1.2.840.10008.1.2.2": "MR_small_bigendian.dcm",  # Explicit VR Big Endian
    "1.2.840.10008.1.2.5": "MR_small_RLE.dcm",  # RLE Lossless
    "1.2.840.10008.1.2.4.80": "MR_small_jpeg_ls_lossless.dcm",  # JPEG-LS Lossless
    "1.2.840.10008.1.2.4.90": "MR_small_jp2klossless.dcm",  # JPEG 2000 Lossless
}
OTHER_GREY = {
    "1.2.840.10008.1.2.1.99": "image_dfl.dcm",  # Deflated Explicit VR Little Endian, 8 bit
    "1.2.840.10008.1.2.4.51": "JPGExtended.dcm",  # JPEG Extended, 12 bit
    "1.2.840.10008.1.2.4.81": "JPEGLSNearLossless_16.dcm",  # JPEG-LS Near-Lossless, 16 bit
    "1.2.840.10008.1.2.4.91": "JPEG2000.dcm",  # JPEG 2000, signed
}
COLOUR = {
    "1.2.840.10008.1.2.4.50": "SC_rgb_jpeg_dcmtk.dcm",  # JPEG Baseline 8 bit, YBR_FULL
    "1.2.840.10008.1.2.4.70": "SC_rgb_jpeg_gdcm.dcm",  # JPEG Lossless, Process 14 SV1, RGB
}
# 128 bytes after its pixel data, which pydicom removes with a warning; and a header written in implicit VR where
# its transfer syntax says explicit, which pydicom reads with a warning: both decode intact
WARNED = {"MR_small_padded.dcm": "excess padding to be removed", "SC_rgb_jpeg.dcm": "but found implicit VR"}


def bundled(name: str) -> Path:
    """A test file that ships inside the installed pydicom package (never downloaded)."""
    path = Path(pydicom.data.__file__).parent / "test_files" / name
    assert path.is_file(), f"{name} does not ship with pydicom {pydicom.__version__}"
    return path


def windowed(values: np.ndarray, centre: float, width: float) -> np.ndarray:
    """PS3.3 C.11.2.1.2.1, the linear window, onto 0..255."""
    low, high = centre - 0.5 - (width - 1) / 2, centre - 0.5 + (width - 1) / 2
    out = ((values - (centre - 0.5)) / (width - 1) + 0.5) * 255
    return np.rint(np.where(values <= low, 0, np.where(values > high, 255, out))).astype(np.uint8)


def gdcm_read(path: Path) -> np.ndarray:
    """The stored values of a 12-bit grey JPEG file as GDCM's own reader decodes the whole file.

    pydicom decodes 12-bit JPEG only with a plugin (dask_dl's GDCM one, or the GPL pylibjpeg-libjpeg): this is the
    reference apart from both. GDCM's reader prints "Unsupported JPEG data precision 12" on stderr as it decodes.
    """
    import gdcm

    ds = pydicom.dcmread(path, stop_before_pixels=True)
    assert (ds.BitsAllocated, ds.SamplesPerPixel) == (16, 1)
    reader = gdcm.ImageReader()
    reader.SetFileName(str(path))
    assert reader.Read(), path
    buffer = reader.GetImage().GetBuffer().encode("utf-8", "surrogateescape")
    return np.frombuffer(buffer, dtype="<u2").reshape(ds.Rows, ds.Columns)


def displayed(path: Path) -> np.ndarray:
    """pydicom's own decode through the mapping read_pixels documents: rescale, then the window or min-max."""
    with warnings.catch_warnings():  # the files of WARNED: what pydicom says about them is tested elsewhere
        warnings.simplefilter("ignore")
        ds = pydicom.dcmread(path)
        twelve_bit_jpeg = ds.file_meta.TransferSyntaxUID == "1.2.840.10008.1.2.4.51" and ds.BitsStored > 8
        stored = gdcm_read(path) if twelve_bit_jpeg else ds.pixel_array
        values = stored.astype(np.float64) * float(ds.get("RescaleSlope", 1)) + float(ds.get("RescaleIntercept", 0))
    if ds.get("WindowCenter") is not None:
        return windowed(values, float(ds.WindowCenter), float(ds.WindowWidth))
    return np.rint((values - values.min()) * 255 / (values.max() - values.min())).astype(np.uint8)


@pytest.mark.parametrize("syntax", [*LOSSLESS, *OTHER_GREY])
def test_each_transfer_syntax_reads_as_pydicom_decodes_it(syntax):
    path = bundled({**LOSSLESS, **OTHER_GREY}[syntax])
    assert pydicom.dcmread(path, stop_before_pixels=True).file_meta.TransferSyntaxUID == syntax
    image = read_pixels(path)
    np.testing.assert_array_equal(image, displayed(path))
    assert image.max() > image.min()  # not blank both ways
    if syntax in LOSSLESS:
        np.testing.assert_array_equal(image, read_pixels(bundled("MR_small.dcm")))


@pytest.mark.slow
def test_every_transfer_syntax_is_ingested_without_a_warning(tmp_path, cluster_client):
    import json
    import shutil

    import dask_dl
    from dask_dl.data.images import load_image, resize_square
    from dask_dl.data.store import StoreFiles

    grey, colour = tmp_path / "grey", tmp_path / "colour"
    for folder, names in (
        (grey, [*LOSSLESS.values(), *OTHER_GREY.values(), "MR_small_padded.dcm"]),
        (colour, [*COLOUR.values(), "SC_rgb_jpeg.dcm"]),
    ):
        folder.mkdir()
        for name in names:
            shutil.copy(bundled(name), folder / name)
    for name, warned in WARNED.items():  # the warning is noted, not shown, and the pixels are kept
        notes = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_image((grey if name.startswith("MR") else colour) / name, size=32, channels=3, notes=notes)
        assert len(notes) == 1 and notes[0].startswith("pydicom: ") and warned in notes[0], notes
    size = 48
    for folder, channels in ((grey, 1), (colour, 3)):
        with warnings.catch_warnings():  # pydicom's warnings about SC_rgb_jpeg.dcm's header stay inside
            warnings.simplefilter("error")
            catalog = read_dicom(folder, id_from="path")
        store = tmp_path / f"{folder.name}.zarr"
        result = dask_dl.ingest(
            catalog,
            store,
            size=size,
            chunk=2,
            shard=1,
            min_size=1,
            channels=channels,
            client=cluster_client,
            progress=False,
        )
        assert result.n_rejected == 0, result.rejects[["image_id", "reason", "message"]].to_string()
        ds = dask_dl.open_dataset(store)
        for row, image_id in enumerate(ds.image_id.values):
            path = folder / image_id
            if channels == 1:
                expected = resize_square(displayed(path), size=size)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    expected = resize_square(np.asarray(pydicom.dcmread(path).pixel_array), size=size)  # RGB, 8 bit
            np.testing.assert_array_equal(ds.image[row].values, expected, err_msg=image_id)
        files = StoreFiles(str(store))
        messages = {}
        for name in files.list("_dask_dl/status/"):
            status = json.loads(files.get(f"_dask_dl/status/{name}"))["status"]
            messages.update(zip(status["image_id"], status["message"], strict=True))
        noted = {k for k, v in messages.items() if v}
        assert noted == {n for n in WARNED if (folder / n).exists()}, messages


def test_the_broken_files_pydicom_ships_are_rejected_with_their_reason():
    from dask_dl.data.images import ImageRejected, load_image

    broken = {
        "MR_truncated.dcm": ("truncated", "less than expected (8130 vs 8192 bytes)"),
        "JPEG2000-embedded-sequence-delimiter.dcm": ("undecodable", "Error decoding the J2K data"),
    }
    for name, (reason, message) in broken.items():
        with pytest.raises(ImageRejected) as caught:
            load_image(bundled(name), size=32, min_size=1)
        assert (caught.value.reason, message in caught.value.detail) == (reason, True), caught.value.detail


def test_12_bit_jpeg_is_decoded_by_gdcm_without_noise(capfd, caplog):
    # pydicom's own GDCM plugin refuses 12-bit JPEG Extended, and pylibjpeg-libjpeg (GPL) is not in the dicom extra:
    # dask_dl's GDCM plugin decodes it, without pydicom logging the refusals of its own plugins (with tracebacks)
    # and without GDCM printing "Unsupported JPEG data precision 12" on the worker's stderr for every image
    from dask_dl.data.images import load_image

    path = bundled("JPGExtended.dcm")
    ds = pydicom.dcmread(path)
    dicom_gdcm.use_for(ds)
    assert (ds.BitsStored, ds.PhotometricInterpretation) == (12, "MONOCHROME2")
    assert (ds.pixel_array.dtype, ds.pixel_array.min(), ds.pixel_array.max()) == (np.uint16, 0, 264)
    with caplog.at_level("WARNING", logger="pydicom"):
        image = read_pixels(path)
        # JPEG-lossy.dcm is the same image with a scan header that breaks the JPEG standard (Ss/Se of a lossless
        # scan), which GDCM reads all the same ("Invalid SOS parameters for sequential JPEG" on stderr)
        lossy = load_image(bundled("JPEG-lossy.dcm"), size=64, min_size=1)
    assert caplog.records == [], [r.getMessage() for r in caplog.records]
    noise = capfd.readouterr().err
    assert "precision" not in noise, noise
    np.testing.assert_array_equal(ds.pixel_array, gdcm_read(path))  # GDCM's reader on the whole file
    np.testing.assert_array_equal(image, displayed(path))
    np.testing.assert_array_equal(lossy, load_image(path, size=64, min_size=1))


@pytest.mark.slow
def test_a_missing_decoder_is_named_with_the_extra_that_brings_it(tmp_path):
    # a worker without the dicom extra's decoders: they are hidden from a fresh process
    hidden = tmp_path / "hidden"
    for module in ("pylibjpeg", "libjpeg", "openjpeg", "rle", "jpeg_ls", "gdcm"):
        (hidden / module).mkdir(parents=True)
        (hidden / module / "__init__.py").write_text(f"raise ModuleNotFoundError('no {module} here')\n")
    script = (
        "import sys\n"
        "from dask_dl.data.images import ImageRejected, load_image\n"
        "try:\n"
        "    load_image(sys.argv[1], size=32, min_size=1)\n"
        "except ImageRejected as exc:\n"
        "    print(exc.reason, exc.detail)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden), str(Path(__file__).parents[2])])}
    said = {}
    for name in ("MR_small_jpeg_ls_lossless.dcm", "JPGExtended.dcm"):
        done = subprocess.run(
            [sys.executable, "-c", script, str(bundled(name))], capture_output=True, text=True, env=env, timeout=120
        )
        said[name] = done.stdout
        assert done.stdout, done.stderr
    assert said["MR_small_jpeg_ls_lossless.dcm"].startswith(
        "undecodable no decoder installed here handles its transfer syntax JPEG-LS Lossless Image Compression "
        "(1.2.840.10008.1.2.4.80); install dask-dl[dicom] on the workers (pip install 'dask-dl[dicom]'). pydicom: "
    ), said
    assert "gdcm - requires gdcm>=3.0.10" in said["MR_small_jpeg_ls_lossless.dcm"]  # what the extra brings
    assert said["JPGExtended.dcm"].startswith(
        "undecodable no decoder installed here handles its transfer syntax JPEG Extended (Process 2 and 4) "
        "(1.2.840.10008.1.2.4.51); install dask-dl[dicom] on the workers (pip install 'dask-dl[dicom]'). pydicom: "
    ), said
