"""ingest on a real LocalCluster into real Zarr stores: layout, round trip, rejects, refusals, resume after a kill."""

from __future__ import annotations

import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import dask.config
import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
from click.testing import CliRunner
from PIL import Image

import dask_dl
from dask_dl.cli import cli
from dask_dl.data.images import load_image
from dask_dl.data.ingest import IngestResult, read_rejects
from dask_dl.data.lease import StoreLease
from dask_dl.data.schema import make_catalog, write_catalog
from dask_dl.data.store import StoreFiles
from dask_dl.errors import CatalogError, DatasetError, IngestError, StoreError
from dask_dl.testing.data import class_folders, png_bomb, png_collection, write_dicom

LABELS = ["Effusion", "Mass", "Nodule"]


SIZE, CHUNK, SHARD = 32, 4, 2  # 8 images per shard


@pytest.fixture(scope="module", autouse=True)
def catalog_order():
    """These tests name samples by their catalog row: store them in catalog order, here and in the subprocesses
    some tests start (the shuffled default order is tested in test_order.py)."""
    with pytest.MonkeyPatch.context() as patch, dask.config.set({"dask-dl.ingest.order": "catalog"}):
        patch.setenv("DASK_DASK_DL__INGEST__ORDER", "catalog")
        yield


def make_collection(root: Path, n: int = 36, bad: dict[int, str] | None = None) -> pd.DataFrame:
    """``n`` PNGs (80-112 px, some not square) and their catalog; rows in ``bad`` get a broken file."""
    return png_collection(root, n, labels=LABELS, bad=bad)


BAD = {3: "missing", 9: "truncated", 10: "garbage", 30: "too_small"}


def run_ingest(catalog, store, cluster_client, **kwargs) -> IngestResult:
    options = {"size": SIZE, "chunk": CHUNK, "shard": SHARD, "client": cluster_client, "progress": False}
    return dask_dl.ingest(catalog, store, **{**options, **kwargs})


@pytest.mark.slow
def test_round_trip(cluster_client, tmp_path):
    catalog = make_collection(tmp_path / "images", bad=BAD)
    store = tmp_path / "cxr.zarr"
    result = run_ingest(catalog, store, cluster_client, progress=True)
    n = len(catalog)
    assert (result.n, result.n_rejected, result.n_written) == (n, 4, n - 4)
    assert (result.shards_written, result.shards_skipped) == (5, 0)  # ceil(36 / 8)
    assert result.rejects.set_index("row")["reason"].to_dict() == {
        3: "missing",
        9: "truncated",
        10: "undecodable",
        30: "too_small",
    }
    assert "4 rejected" in result.summary() and "shards_written=5" in repr(result)
    assert f"read_rejects({str(store)!r})" in result.summary()  # says where the details are

    # the layout of the contract, read with zarr directly
    group = zarr.open_group(store, mode="r")
    assert group.attrs["dask_dl"] == {
        "format": 1,
        "size": SIZE,
        "chunk": CHUNK,
        "shard": SHARD,
        "labels": LABELS,
        "task": "multilabel",
        "n": n,
        "channels": 1,
        "order": "catalog",
        "order_seed": 0,
        "complete": True,
    }
    image = group["image"]
    assert (image.shape, image.dtype, image.chunks, image.shards) == (
        (n, SIZE, SIZE),
        np.uint8,
        (4, 32, 32),
        (8, 32, 32),
    )
    assert image.metadata.dimension_names == ("sample", "y", "x")
    assert [type(c).__name__ for c in image.compressors] == ["ZstdCodec"]
    assert group["label"].metadata.dimension_names == ("sample", "finding")
    assert group["valid"].dtype == np.bool_
    np.testing.assert_array_equal(group["sample"][:], np.arange(n))
    valid = np.ones(n, bool)
    valid[list(BAD)] = False
    np.testing.assert_array_equal(group["valid"][:], valid)

    # every image equals load_image of its file; rejected rows stay all zero
    pixels = image[:]
    for i, path in enumerate(catalog["path"]):
        if valid[i]:
            np.testing.assert_array_equal(pixels[i], load_image(path, size=SIZE), err_msg=f"row {i}")
        else:
            assert not pixels[i].any()

    # xarray reads it too, and open_dataset drops the rejects from image, label and coordinates alike
    raw = xr.open_zarr(store, consolidated=False)
    assert set(raw.coords) >= {"image_id", "patient_id", "split", "site", "finding", "sample"}
    ds = dask_dl.open_dataset(store)
    kept = catalog[valid]
    np.testing.assert_array_equal(ds.sample.values, np.flatnonzero(valid))
    np.testing.assert_array_equal(ds.label.values, kept[LABELS].to_numpy(np.uint8))
    np.testing.assert_array_equal(ds.image.values, pixels[valid])
    for name in ("image_id", "patient_id", "split", "site"):
        np.testing.assert_array_equal(ds[name].values, kept[name].to_numpy(str))
    assert list(ds.finding.values) == LABELS
    # the official split is kept: each split is exactly the catalog's rows of that split, minus the rejects
    for split in ("train", "val", "test"):
        subset = dask_dl.open_dataset(store, split=split)
        assert list(subset.image_id.values) == list(kept.loc[kept["split"] == split, "image_id"])

    # the rejects table, in the store and returned
    stored = read_rejects(store)
    pd.testing.assert_frame_equal(stored, result.rejects)
    assert list(stored.columns) == ["row", "image_id", "path", "patient_id", "split", "site", "reason", "message"]
    assert list(stored["image_id"]) == [f"img{i:05d}" for i in sorted(BAD)]


def test_rejects_also_written_where_asked(cluster_client, tmp_path):
    catalog = make_collection(tmp_path / "images", n=10, bad={2: "garbage"})
    result = run_ingest(catalog, tmp_path / "s.zarr", cluster_client, rejects=tmp_path / "rejects.parquet")
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "rejects.parquet"), result.rejects)
    assert result.rejects["reason"].tolist() == ["undecodable"]


def test_quiet_progress_logs_lines(cluster_client, tmp_path, caplog):
    catalog = make_collection(tmp_path / "images", n=20)
    with caplog.at_level(logging.INFO, logger="dask_dl.data.ingest"):
        run_ingest(catalog, tmp_path / "s.zarr", cluster_client, progress=False)
    assert any("3/3 shards written" in r.getMessage() for r in caplog.records)


def test_malformed_catalog_fails_before_any_work(tmp_path):
    catalog = make_collection(tmp_path / "images", n=6)
    duplicated = pd.concat([catalog, catalog.iloc[:1]], ignore_index=True)
    duplicated.attrs = catalog.attrs
    with pytest.raises(CatalogError, match="img00000.*more than once"):
        dask_dl.ingest(duplicated, tmp_path / "dup.zarr", size=SIZE)
    leaking = catalog.copy()
    leaking.loc[0, "split"] = "test"  # p000 now in train and test
    with pytest.raises(CatalogError, match="p000"):
        dask_dl.ingest(leaking, tmp_path / "leak.zarr", size=SIZE)
    with pytest.raises(CatalogError, match="no rows"):
        dask_dl.ingest(catalog.iloc[:0], tmp_path / "empty.zarr", size=SIZE)
    assert not any((tmp_path / name).exists() for name in ("dup.zarr", "leak.zarr", "empty.zarr"))


def test_bad_options_fail_before_any_work(tmp_path):
    catalog = make_collection(tmp_path / "images", n=4)
    with pytest.raises(dask_dl.ConfigurationError, match="chunk must be a positive integer, got 0"):
        dask_dl.ingest(catalog, tmp_path / "s.zarr", size=SIZE, chunk=0)
    assert not (tmp_path / "s.zarr").exists()


def test_other_store_refused_unless_overwrite(cluster_client, tmp_path):
    catalog = make_collection(tmp_path / "images", n=12)
    store = tmp_path / "s.zarr"
    run_ingest(catalog, store, cluster_client)
    with pytest.raises(StoreError, match="size: store has 32, asked for 48.*overwrite=True"):
        run_ingest(catalog, store, cluster_client, size=48)
    with pytest.raises(StoreError, match="n: store has 12, asked for 11"):
        run_ingest(catalog.iloc[:11], store, cluster_client)
    renamed = catalog.copy()
    renamed.loc[5, "image_id"] = "another"
    with pytest.raises(StoreError, match="catalog \\(hash of the image ids\\)"):
        run_ingest(renamed, store, cluster_client)
    relabelled = catalog.copy()
    relabelled.attrs = {"labels": LABELS[:2], "task": "multilabel"}
    with pytest.raises(StoreError, match="labels: store has"):
        run_ingest(relabelled, store, cluster_client)
    assert dask_dl.open_dataset(store).image.shape == (12, 32, 32)  # untouched by the refused runs

    result = run_ingest(catalog.iloc[:11], store, cluster_client, size=48, overwrite=True)
    assert (result.shards_written, result.shards_skipped) == (2, 0)
    ds = dask_dl.open_dataset(store)
    assert ds.image.shape == (11, 48, 48) and ds.attrs["dask_dl"]["n"] == 11
    np.testing.assert_array_equal(ds.image.values[10], load_image(catalog["path"][10], size=48))

    folder = tmp_path / "not-a-store"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a dask_dl store"):
        run_ingest(catalog, folder, cluster_client)
    assert (folder / "notes.txt").exists()


def test_store_left_empty_by_a_killed_run_is_used(cluster_client, tmp_path):
    catalog = make_collection(tmp_path / "images", n=8)
    zarr.open_group(tmp_path / "s.zarr", mode="w")  # killed before anything but the group was written
    result = run_ingest(catalog, tmp_path / "s.zarr", cluster_client)
    assert (result.shards_written, result.n_written) == (1, 8)


def test_second_run_on_finished_store_writes_nothing(cluster_client, tmp_path):
    catalog = make_collection(tmp_path / "images", n=20)
    store = tmp_path / "s.zarr"
    run_ingest(catalog, store, cluster_client)
    before = store_files(store)
    relabelled = catalog.copy()
    relabelled["Mass"] = 1 - relabelled["Mass"]
    result = run_ingest(relabelled, store, cluster_client)
    assert (result.shards_written, result.shards_skipped, result.n_written) == (0, 3, 0)
    after = store_files(store)
    assert {k: v for k, v in after.items() if k.startswith("image/")} == {
        k: v for k, v in before.items() if k.startswith("image/")
    }
    # labels come from the catalog on every run
    np.testing.assert_array_equal(dask_dl.open_dataset(store).label.values[:, 1], relabelled["Mass"].to_numpy())


def test_real_nih_pngs_and_dicoms(cluster_client, shared_data, tmp_path):
    table = pd.read_csv(shared_data / "nih" / "Data_Entry_2017_v2020.csv.gz")
    rows = table[table["Image Index"].isin(["00000001_000.png", "00027426_000.png"])]
    frame = pd.DataFrame(
        {
            "image_id": rows["Image Index"],
            "path": [str(shared_data / "nih" / name) for name in rows["Image Index"]],
            "patient_id": rows["Patient ID"].astype(str),
            "site": "nih",
            "split": ["train", "test"],
        }
    )
    labels = sorted({f for value in table["Finding Labels"] for f in value.split("|")} - {"No Finding"})
    for label in labels:
        frame[label] = [int(label in value.split("|")) for value in rows["Finding Labels"]]
    dicoms = sorted((shared_data / "dicom").glob("*.dcm"))
    extra = pd.DataFrame(
        {"image_id": [p.name for p in dicoms], "path": [str(p) for p in dicoms], "patient_id": ["d1", "d2"]}
    ).assign(site="dicom", split="val", **{label: 0 for label in labels})
    catalog = make_catalog(pd.concat([frame, extra], ignore_index=True), labels)
    with dask.config.set({"dask-dl.ingest.min-size": 16}):
        result = run_ingest(catalog, tmp_path / "nih.zarr", cluster_client, size=64, chunk=1, shard=2)
    assert result.n_rejected == 0 and result.shards_written == 2
    ds = dask_dl.open_dataset(tmp_path / "nih.zarr")
    for i, path in enumerate(catalog["path"]):
        np.testing.assert_array_equal(ds.image.values[i], load_image(path, size=64, min_size=16))
    for i, findings in enumerate(rows["Finding Labels"]):  # e.g. "Cardiomegaly" for 00000001_000.png
        assert {str(f) for f in ds.finding.values[ds.label.values[i] == 1]} == set(findings.split("|")) - {"No Finding"}
    assert ds.label.values[0].sum() >= 1 and not ds.label.values[2:].any()


@pytest.mark.slow
def test_nih_at_full_resolution(cluster_client, shared_data, tmp_path):
    """1024x1024 PNGs in the NIH layout, as published (the shared copies are 512 px: upscaled 2x), read by read_nih
    and ingested at 256 px: each stored image is Pillow's reducing Lanczos of the file, exactly, and within 1.5 grey
    levels on average of a plain 4x4 block mean (0.45 measured; flipped, transposed or shifted by 8 px: 19 or more)."""
    names = ["00000001_000.png", "00027426_000.png"]
    table = pd.read_csv(shared_data / "nih" / "Data_Entry_2017_v2020.csv.gz", dtype=str, keep_default_na=False)
    rows = table[table["Image Index"].isin(names)]
    root = tmp_path / "nih"
    (root / "images").mkdir(parents=True)
    rows.to_csv(root / "Data_Entry_2017_v2020.csv", index=False)
    for name in names:
        small = Image.open(shared_data / "nih" / name).convert("L")
        small.resize((1024, 1024), Image.Resampling.BICUBIC).save(root / "images" / name)
    catalog = dask_dl.read_nih(root)
    result = run_ingest(catalog, tmp_path / "nih.zarr", cluster_client, size=256, chunk=1, shard=2)
    assert (result.n, result.n_rejected) == (2, 0)
    ds = dask_dl.open_dataset(tmp_path / "nih.zarr")
    assert ds.image.shape == (2, 256, 256)
    findings = dict(zip(rows["Image Index"], rows["Finding Labels"], strict=True))
    for i, name in enumerate(ds.image_id.values):
        original = Image.open(root / "images" / str(name))
        assert original.size == (1024, 1024) and original.mode == "L"
        stored = ds.image.values[i]
        reference = original.resize((256, 256), Image.Resampling.LANCZOS, reducing_gap=2.0)
        np.testing.assert_array_equal(stored, np.asarray(reference))
        block_mean = np.asarray(original, np.float64).reshape(256, 4, 256, 4).mean(axis=(1, 3))
        assert np.abs(stored - block_mean).mean() < 1.5
        assert {str(f) for f in ds.finding.values[ds.label.values[i] == 1]} == set(findings[name].split("|")) - {
            "No Finding"
        }


# ---- small images and too many rejects (issue 8) -----------------------------------------------------------


def test_small_class_folder_collection_ingests_at_its_size(cluster_client, tmp_path):
    """A 32x32 collection in class folders ingests at size=32 with no setting changed."""
    root = class_folders(tmp_path / "digits", classes=("0", "1", "2"), per_class=6, size=32)
    catalog = dask_dl.read_folders(root, val_fraction=0.2, test_fraction=0.2)
    store = tmp_path / "digits.zarr"
    result = dask_dl.ingest(catalog, store, size=32, chunk=4, shard=2, client=cluster_client, progress=False)
    assert (result.n, result.n_rejected, result.n_written) == (18, 0, 18)
    ds = dask_dl.open_dataset(store)
    assert ds.image.shape == (18, 32, 32) and list(ds.finding.values) == ["0", "1", "2"]
    for i, path in enumerate(catalog["path"]):  # 32 px at size 32: stored as they are
        np.testing.assert_array_equal(ds.image.values[i], np.asarray(Image.open(path)))
    np.testing.assert_array_equal(ds.label.values, catalog[["0", "1", "2"]].to_numpy(np.uint8))


def test_ingest_that_keeps_no_image_fails_with_the_fix(cluster_client, tmp_path):
    root = class_folders(tmp_path / "digits", classes=("a", "b"), per_class=5, size=32)
    catalog = dask_dl.read_folders(root)
    store = tmp_path / "s.zarr"
    options = {"size": 32, "chunk": 2, "shard": 2, "client": cluster_client, "progress": False}
    with pytest.raises(IngestError) as info:
        dask_dl.ingest(catalog, store, min_size=64, **options)
    message = str(info.value)
    assert "rejected 10 of 10 images (too_small 10): no image was kept" in message
    assert message.count("\n  row ") == 3 and "\n  row 0 'a/0000.png' (" in message  # the first rejected rows
    assert "32x32 pixels has a side under min-size 64" in message
    assert "pass a smaller min_size= (or --min-size), e.g. min_size=32" in message  # the fix, with a value that works
    assert info.value.counts == {"too_small": 10}
    assert isinstance(info.value, dask_dl.DatasetError)
    # the rejects table is written all the same
    pd.testing.assert_frame_equal(read_rejects(store), info.value.rejects)
    assert len(info.value.rejects) == 10
    # and open_dataset says in one line that nothing is there
    with pytest.raises(DatasetError) as opened:
        dask_dl.open_dataset(store)
    assert "\n" not in str(opened.value)
    assert f"the store {str(store)!r} has no valid image: all 10 rows were rejected at ingest" in str(opened.value)
    # the fix works
    result = dask_dl.ingest(catalog, store, min_size=32, overwrite=True, **options)
    assert (result.n_rejected, result.n_written) == (0, 10)


def test_too_many_rejects_fail_above_the_share(cluster_client, tmp_path):
    catalog = make_collection(tmp_path / "images", n=10, bad={i: "garbage" for i in (1, 2, 4, 5, 7, 8)})
    store = tmp_path / "s.zarr"
    with pytest.raises(
        IngestError,
        match=r"rejected 6 of 10 images \(undecodable 6\): 60% were rejected, more "
        r"than max_reject_share=0\.5",
    ) as info:
        run_ingest(catalog, store, cluster_client)
    assert "pass max_reject_share=1.0" in str(info.value)
    assert read_rejects(store)["row"].tolist() == [1, 2, 4, 5, 7, 8]
    # the store is finished; accepting the share needs no new work
    result = run_ingest(catalog, store, cluster_client, max_reject_share=0.6)
    assert (result.n_rejected, result.shards_written, result.shards_skipped) == (6, 0, 2)
    with dask.config.set({"dask-dl.ingest.max-reject-share": 0.7}):
        assert run_ingest(catalog, store, cluster_client).n_rejected == 6
    assert len(dask_dl.open_dataset(store).sample) == 4
    # exactly half is not more than half
    half = make_collection(tmp_path / "half", n=8, bad={i: "missing" for i in range(4)})
    assert run_ingest(half, tmp_path / "half.zarr", cluster_client).n_rejected == 4


@pytest.mark.parametrize("value", [-0.1, 1.5, "most", True])
def test_bad_reject_share_is_a_configuration_error(tmp_path, value):
    catalog = make_collection(tmp_path / "images", n=2)
    with pytest.raises(dask_dl.ConfigurationError, match="max_reject_share must be a fraction in \\[0, 1\\]"):
        dask_dl.ingest(catalog, tmp_path / "s.zarr", size=SIZE, max_reject_share=value)
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.slow
def test_cli_ingest_small_images_and_the_reject_error(cluster_client, tmp_path):
    root = class_folders(tmp_path / "digits", classes=("x", "y"), per_class=4, size=32)
    address = ["--scheduler", cluster_client.scheduler.address, "--quiet"]
    args = ["ingest", str(root), str(tmp_path / "s.zarr"), "--size", "32", "--chunk", "2", "--shard", "2"]
    result = CliRunner().invoke(cli, [*args, *address])
    assert result.exit_code == 0, result.output
    assert f"ingested 8 images into {tmp_path / 's.zarr'}: 8 valid, 0 rejected" in result.output
    result = CliRunner().invoke(cli, [*args, "--min-size", "40", "--overwrite", *address])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "error: ingest into" in result.output and "no image was kept" in result.output


# ---- hostile input (issue 11): one bad item is one reject, never a failed or hung job --------------------------


@pytest.mark.timeout(120)
def test_hostile_rows_are_rejects_and_the_rest_is_ingested(cluster_client, tmp_path):
    catalog = make_collection(tmp_path / "images", n=16)
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    os.mkfifo(hostile / "fifo.png")  # hung ingest forever
    (hostile / "zero.png").symlink_to("/dev/zero")  # was read without bound: workers killed
    png_bomb(hostile / "bomb.png")  # 0.6 MB, 648 MB decoded: workers killed
    ramp = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) % 4096
    write_dicom(hostile / "flat.dcm", ramp, RescaleSlope=0, RescaleIntercept=7)  # constant: accepted before
    server = socket.create_server(("127.0.0.1", 0))
    paths = {
        1: hostile / "fifo.png",
        4: hostile / "zero.png",
        6: f"{tmp_path}/a\x00b.png",  # failed the whole ingest with ValueError: embedded null byte
        9: f"http://127.0.0.1:{server.getsockname()[1]}/x.png",  # was fetched from anywhere
        11: hostile / "bomb.png",
        14: hostile / "flat.dcm",
    }
    for row, path in paths.items():
        catalog.loc[row, "path"] = str(path)
    try:
        result = run_ingest(catalog, tmp_path / "s.zarr", cluster_client, max_reject_share=0.5)
    finally:
        server.close()
    assert result.rejects.set_index("row")["reason"].to_dict() == {
        1: "unreadable",
        4: "unreadable",
        6: "refused",
        9: "refused",
        11: "too_large",
        14: "degenerate",
    }
    messages = result.rejects.set_index("row")["message"]
    assert "a FIFO (named pipe)" in messages[1] and "a character device" in messages[4]
    assert "NUL byte" in messages[6] and "scheme 'http' is not allowed" in messages[9]
    assert "648000000 bytes decoded" in messages[11] and "constant after scaling" in messages[14]
    ds = dask_dl.open_dataset(tmp_path / "s.zarr")
    keep = [i for i in range(16) if i not in paths]
    np.testing.assert_array_equal(ds.sample.values, keep)
    for i in keep:
        np.testing.assert_array_equal(ds.image.sel(sample=i).values, load_image(catalog["path"][i], size=SIZE))


# ---- resume after a real kill ---------------------------------------------------------------------------------


def store_files(store: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(store)): p.read_bytes()
        for p in sorted(store.rglob("*"))
        if p.is_file() and p.name != "rejects.parquet"
    }


KILLED_RUN = textwrap.dedent(
    """
    import sys
    import dask
    import dask_dl
    from dask_dl.data.schema import read_parquet_catalog

    if __name__ == "__main__":  # the worker processes are spawned and import this module
        catalog = read_parquet_catalog(sys.argv[1])
        with dask.config.set({"dask-dl.ingest.allowed-schemes": ["file", "http"]}):
            dask_dl.ingest(catalog, sys.argv[2], size=32, chunk=2, shard=2, progress=False)
    """
)


def wait_until_stuck(process: subprocess.Popen, status: Path) -> None:
    """Wait until an ingest whose two hung images keep both workers busy has written every shard it can."""
    count, stable_since, deadline = -1, time.monotonic(), time.monotonic() + 120
    while time.monotonic() < deadline:
        now = len(list(status.glob("*.json"))) if status.exists() else 0
        if now != count:
            count, stable_since = now, time.monotonic()
        elif count > 0 and time.monotonic() - stable_since > 3:
            return
        assert process.poll() is None, "the run finished although two of its images hang"
        time.sleep(0.2)
    pytest.fail(f"the run never settled ({count} status files)")


def shards_done(status: Path) -> set[int]:
    return {int(p.stem.split("-")[1]) for p in status.glob("*.json")}


@pytest.mark.slow
def test_resume_after_kill_writes_only_missing_shards(cluster_client, tmp_path, request):
    catalog = make_collection(tmp_path / "images", n=48, bad={13: "garbage"})  # 12 shards of 4 images
    # Rows 9 and 21 (shards 2 and 5) are URLs of a server that accepts connections and never answers, like a hung
    # network mount, so the killed run is stuck with both workers busy and some shards done, whatever order the
    # scheduler picked.
    hung = [9, 21]
    server = socket.create_server(("127.0.0.1", 0), backlog=16)
    request.addfinalizer(server.close)
    hanging = catalog.copy()
    for row in hung:
        hanging.loc[row, "path"] = f"http://127.0.0.1:{server.getsockname()[1]}/{row}.png"
    catalog, recovered = hanging, catalog
    write_catalog(catalog, tmp_path / "catalog.parquet")
    (tmp_path / "run.py").write_text(KILLED_RUN)
    store = tmp_path / "resumed.zarr"
    status = store / "_dask_dl" / "status"
    process = subprocess.Popen(
        [sys.executable, str(tmp_path / "run.py"), str(tmp_path / "catalog.parquet"), str(store)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_stuck(process, status)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the driver and its LocalCluster's worker processes
        process.wait()
    done = shards_done(status)
    assert 0 < len(done) < 12 and not done & {2, 5}
    assert zarr.open_group(store, mode="r").attrs["dask_dl"]["complete"] is False
    with pytest.raises(StoreError, match="(?i)run ingest again to resume"):
        dask_dl.open_dataset(store)

    # a half-written shard file of an unfinished shard (the status file is what counts, not the shard file)
    missing = sorted(set(range(12)) - done)
    half = store / "image" / "c" / str(missing[-1]) / "0" / "0"
    half.parent.mkdir(parents=True, exist_ok=True)
    half.write_bytes(b"\x00half a shard")
    # the storage recovers: the catalog points at the images themselves (same image ids: the same dataset)
    catalog = recovered
    finished = {s: os.stat(store / "image" / "c" / str(s) / "0" / "0") for s in done}

    result = dask_dl.ingest(catalog, store, size=32, chunk=2, shard=2, client=cluster_client, progress=False)
    assert (result.shards_written, result.shards_skipped) == (len(missing), len(done))
    assert result.n_written == 4 * len(missing) - (13 // 4 in missing)  # row 13 is garbage
    for s, before in finished.items():  # finished shards were not rewritten (an atomic rewrite changes the inode)
        after = os.stat(store / "image" / "c" / str(s) / "0" / "0")
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    clean = tmp_path / "clean.zarr"
    reference = dask_dl.ingest(catalog, clean, size=32, chunk=2, shard=2, client=cluster_client, progress=False)
    assert store_files(store) == store_files(clean)  # same files, same bytes: shards, arrays, status, metadata
    pd.testing.assert_frame_equal(result.rejects, reference.rejects)
    assert result.rejects["row"].tolist() == [13]
    np.testing.assert_array_equal(dask_dl.open_dataset(store).image.values, dask_dl.open_dataset(clean).image.values)
    assert json.loads((store / "zarr.json").read_text())["attributes"]["dask_dl"]["complete"] is True


KILLED_AT_CLOSE = "distributed.nanny - WARNING - Worker process still alive after 4.0 seconds, killing"


class GatedImages(http.server.ThreadingHTTPServer):
    """Serves ``/<row>.png`` with the bytes of ``files[row]`` once ``gates[row]`` is set: a slow network mount."""

    daemon_threads = True

    def __init__(self, files: dict[int, Path]) -> None:
        self.files = files
        self.gates = {row: threading.Event() for row in files}
        super().__init__(("127.0.0.1", 0), _GatedHandler)

    def url(self, row: int) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{row}.png"


class _GatedHandler(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        row = int(self.path.strip("/").split(".")[0])
        while not self.server.gates[row].wait(0.2):
            if getattr(self.server, "_BaseServer__shutdown_request", False):
                return
        data = self.server.files[row].read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.slow
def test_ctrl_c_in_the_terminal_stops_ingest_after_the_shards_being_written(cluster_client, tmp_path, request):
    """Ctrl-C as a terminal sends it (to the command and its local cluster's workers): the shards not started are
    cancelled, the ones being written finish (a second Ctrl-C leaves them), the command says what it kept and exits
    with 130, and the next ingest writes the rest."""
    catalog = make_collection(tmp_path / "images", n=48)  # 12 shards of 4 images
    served = GatedImages({9: Path(catalog.loc[9, "path"]), 21: Path(catalog.loc[21, "path"])})  # shards 2 and 5
    threading.Thread(target=served.serve_forever, daemon=True).start()
    request.addfinalizer(served.server_close)
    request.addfinalizer(served.shutdown)
    remote = catalog.copy()
    for row in served.files:
        remote.loc[row, "path"] = served.url(row)
    write_catalog(remote, tmp_path / "catalog.parquet")
    store = tmp_path / "stopped.zarr"
    status, output = store / "_dask_dl" / "status", tmp_path / "output.txt"
    env = {**os.environ, "DASK_DASK_DL__INGEST__ALLOWED_SCHEMES": '["file", "http"]'}
    command = [
        sys.executable,
        "-m",
        "dask_dl.cli",
        "ingest",
        str(tmp_path / "catalog.parquet"),
        str(store),
        "--size",
        "32",
        "--chunk",
        "2",
        "--shard",
        "2",
        "--workers",
        "2",
    ]
    with output.open("w") as out:
        process = subprocess.Popen(command, start_new_session=True, stdout=out, stderr=subprocess.STDOUT, env=env)
    request.addfinalizer(lambda: process.poll() is None and os.killpg(process.pid, signal.SIGKILL))
    wait_until_stuck(process, status)
    before = shards_done(status)
    assert before and not before & {2, 5}

    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the whole job, as a terminal sends it
    waiting = "ingest stopping: waiting for the 2 shard(s) being written to finish (Ctrl-C again to leave them; the next ingest rewrites them)"  # noqa: E501
    deadline = time.monotonic() + 60
    while waiting not in output.read_text():
        assert process.poll() is None and time.monotonic() < deadline, output.read_text()
        time.sleep(0.1)
    served.gates[9].set()  # shard 2's image arrives: its task writes the shard although the ingest was stopped
    while 2 not in shards_done(status):
        assert process.poll() is None and time.monotonic() < deadline, output.read_text()
        time.sleep(0.1)
    time.sleep(0.5)
    assert process.poll() is None  # still waiting for shard 5
    os.killpg(process.pid, signal.SIGINT)  # the second Ctrl-C leaves shard 5 hanging
    assert process.wait(timeout=60) == 130
    done = shards_done(status)
    assert done == before | {2}
    # the worker still reading shard 5's image cannot close, and the cluster's nanny ends its process: it says so
    lines = [line for line in output.read_text().splitlines() if not line.endswith(KILLED_AT_CLOSE)]
    assert lines == [
        waiting,
        f"ingest into '{store}' stopped by Ctrl-C with {len(done)} of 12 shards written; run the same ingest again "
        f"to write the other {12 - len(done)} (it keeps the written shards)",
    ]  # and nothing else: no worker's traceback, no cancelled task's warning, no "Aborted!"
    assert not (store / "_dask_dl" / "lease.json").exists()

    served.gates[21].set()
    with dask.config.set({"dask-dl.ingest.allowed-schemes": ["file", "http"]}):
        result = dask_dl.ingest(remote, store, size=32, chunk=2, shard=2, client=cluster_client, progress=False)
    assert (result.shards_written, result.shards_skipped, result.n_rejected) == (12 - len(done), len(done), 0)
    assert shards_done(status) == set(range(12))


# ---- one writer per store (issue 11) ----------------------------------------------------------------------------

RACING_RUN = textwrap.dedent(
    """
    import sys, time
    from distributed import Client
    import dask_dl
    from dask_dl.data.schema import read_parquet_catalog

    catalog = read_parquet_catalog(sys.argv[1])
    time.sleep(float(sys.argv[4]))
    with Client(sys.argv[3]) as client:
        try:
            result = dask_dl.ingest(catalog, sys.argv[2], size=32, chunk=2, shard=2, client=client, progress=False)
        except dask_dl.StoreError as exc:
            print("REFUSED", exc)
            sys.exit(3)
    print("DONE", result.shards_written, result.shards_skipped)
    """
)


@pytest.mark.slow
def test_two_ingests_into_one_store_never_both_write(cluster_client, tmp_path):
    catalog = make_collection(tmp_path / "images", n=40)
    write_catalog(catalog, tmp_path / "catalog.parquet")
    (tmp_path / "race.py").write_text(RACING_RUN)
    store = tmp_path / "raced.zarr"
    address = cluster_client.scheduler.address
    runs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "race.py"), str(tmp_path / "catalog.parquet"), str(store), address, delay],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for delay in ("0", "0.15")
    ]
    outputs = [run.communicate(timeout=240)[0] for run in runs]
    codes = sorted(run.returncode for run in runs)
    assert codes in ([0, 0], [0, 3]), outputs
    refused = [out for out in outputs if "REFUSED" in out]
    for out in refused:  # refused clearly, naming the holder, while the first one writes
        assert "another ingest is writing" in out and "pid" in out and "wait for it to finish" in out
    if codes == [0, 0]:  # the second started after the first had finished: it found every shard done
        assert any("DONE 0 10" in out for out in outputs), outputs
    assert dask_dl.check_store(store).ok
    assert not (store / "_dask_dl" / "lease.json").exists()
    clean = tmp_path / "clean.zarr"
    dask_dl.ingest(catalog, clean, size=32, chunk=2, shard=2, client=cluster_client, progress=False)
    assert store_files(store) == store_files(clean)


def test_two_leases_asked_for_at_the_same_instant_have_one_holder(tmp_path):
    # issue 28: the lease file is created empty (O_EXCL) and its record written an instant later; a second ingest
    # that read it in that instant took it for damaged, deleted it and took the lease too: both wrote the store,
    # and the loser failed with zarr's ContainsArrayError. Two threads ask at the same instant, 300 times; without
    # the fix 1 round in 25 to 1 in 5 had two holders (67 of 300 once).
    outcomes = []
    for round_ in range(300):
        url = str(tmp_path / f"s{round_}.zarr")
        start, results = threading.Barrier(2), []

        def ask(url=url, start=start, results=results):
            lease = StoreLease(url)
            start.wait()
            try:
                results.append(lease.acquire())
            except StoreError as exc:
                results.append(str(exc))

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        holders = [r for r in results if isinstance(r, StoreLease)]
        refusals = [r for r in results if isinstance(r, str)]
        outcomes.append((len(holders), len(refusals)))
        assert all("another ingest is writing" in r for r in refusals), refusals
        for holder in holders:
            holder.release()
    assert outcomes == [(1, 1)] * 300, f"{sum(o != (1, 1) for o in outcomes)} of 300 rounds had {set(outcomes)}"


def test_an_ingest_meeting_a_lease_being_written_is_refused(cluster_client, tmp_path, caplog):
    # the instant the race above turns on, made to last: a lease file just created, its record not yet written
    catalog = make_collection(tmp_path / "images", n=8)
    store = tmp_path / "s.zarr"
    (store / "_dask_dl").mkdir(parents=True)
    lease = store / "_dask_dl" / "lease.json"
    lease.write_bytes(b"")
    with pytest.raises(StoreError, match="another ingest is writing .*taking the lease at this moment.*run this one"):
        run_ingest(catalog, store, cluster_client)
    assert sorted(str(p.relative_to(store)) for p in store.rglob("*")) == ["_dask_dl", "_dask_dl/lease.json"]
    old = time.time() - 1000  # its writer died in that instant, 1000 s > dask-dl.ingest.lease-stale ago
    os.utime(lease, (old, old))
    with caplog.at_level(logging.WARNING, logger="dask_dl.data.lease"):
        assert run_ingest(catalog, store, cluster_client).n_written == 8
    assert "it cannot be read and is 1000 s old" in caplog.text
    run_ingest(catalog, tmp_path / "clean.zarr", cluster_client)
    assert store_files(store) == store_files(tmp_path / "clean.zarr")


def test_two_ingests_started_at_the_same_instant_one_writes_one_is_refused(cluster_client, tmp_path):
    catalog = make_collection(tmp_path / "images", n=16)
    run_ingest(catalog, tmp_path / "clean.zarr", cluster_client)
    for round_ in range(3):
        store = tmp_path / f"raced-{round_}.zarr"
        start, results = threading.Barrier(2), []

        def run(store=store, start=start, results=results):
            start.wait()
            try:
                results.append(run_ingest(catalog, store, cluster_client).n_written)
            except Exception as exc:  # noqa: BLE001 - the kind of error is what is tested
                results.append(exc)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [r for r in results if not isinstance(r, Exception)] == [16], results
        (refused,) = [r for r in results if isinstance(r, Exception)]
        assert isinstance(refused, StoreError) and "another ingest is writing" in str(refused), repr(refused)
        assert store_files(store) == store_files(tmp_path / "clean.zarr")


def test_clearing_a_store_keeps_its_lease_and_the_lease_being_rewritten(tmp_path):
    store = tmp_path / "s.zarr"
    for name in [
        "zarr.json",
        "image/c/0/0/0",
        "_dask_dl/zarr.json",
        "_dask_dl/status/shard-0.json",
        "_dask_dl/lease.json",
        "_dask_dl/lease.json.0a1b.partial",
        "_dask_dl/lease.jsonx",
    ]:
        (store / name).parent.mkdir(parents=True, exist_ok=True)
        (store / name).write_text(name)
    StoreFiles(str(store)).clear(keep="_dask_dl/lease.json")
    left = sorted(str(p.relative_to(store)) for p in store.rglob("*"))
    assert left == ["_dask_dl", "_dask_dl/lease.json", "_dask_dl/lease.json.0a1b.partial"]
    assert (store / "_dask_dl" / "lease.json").read_text() == "_dask_dl/lease.json"
    StoreFiles(str(tmp_path / "nothing.zarr")).clear(keep="_dask_dl/lease.json")  # nothing there: nothing to do
    assert not (tmp_path / "nothing.zarr").exists()


def test_an_overwrite_keeps_the_lease_while_it_clears_the_store(cluster_client, tmp_path, monkeypatch):
    # the moment CI once caught by chance in the race above: an overwrite cleared the store (Zarr's mode "w"), its
    # lease with it, and a second ingest took the lease before the first wrote it again; the first one was then
    # refused as if it were the second. Here the second ingest asks for the lease right at that moment every time:
    # the real zarr.open_group and StoreLease, only the timing is arranged.
    catalog = make_collection(tmp_path / "images", n=8)
    store = tmp_path / "s.zarr"
    run_ingest(catalog, store, cluster_client, size=16)
    (store / "stray.txt").write_text("what overwrite=True deletes")
    refusals = []
    real_open_group = zarr.open_group

    def open_group(*args, mode=None, **kwargs):
        group = real_open_group(*args, mode=mode, **kwargs)
        if mode != "r":
            try:
                StoreLease(str(store)).acquire().release()
            except StoreError as exc:
                refusals.append(str(exc))
            else:
                refusals.append("the second ingest got the lease")
        return group

    monkeypatch.setattr(zarr, "open_group", open_group)
    result = run_ingest(catalog, store, cluster_client, overwrite=True)
    monkeypatch.undo()
    assert result.shards_written == 1 and refusals and all("another ingest is writing" in r for r in refusals)
    run_ingest(catalog, tmp_path / "clean.zarr", cluster_client)
    assert store_files(store) == store_files(tmp_path / "clean.zarr")  # no stray file, no old array, no lease


def _lease(store: Path, **record) -> None:
    (store / "_dask_dl").mkdir(parents=True, exist_ok=True)
    (store / "_dask_dl" / "lease.json").write_text(json.dumps({"token": "theirs", **record}))


def test_a_live_lease_refuses_and_a_stale_one_is_taken_over(cluster_client, tmp_path, caplog):
    catalog = make_collection(tmp_path / "images", n=8)
    store = tmp_path / "s.zarr"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lease(store, host=socket.gethostname(), pid=sleeper.pid, heartbeat=time.time())
        with pytest.raises(StoreError, match=f"another ingest is writing .* pid {sleeper.pid}"):
            run_ingest(catalog, store, cluster_client)
    finally:
        sleeper.kill()
        sleeper.wait()
    with caplog.at_level(logging.WARNING, logger="dask_dl.data.lease"):
        result = run_ingest(catalog, store, cluster_client)  # its process is gone: stale
    assert result.n_written == 8 and f"its process {sleeper.pid} on this host is gone" in caplog.text
    assert not (store / "_dask_dl" / "lease.json").exists()

    other = tmp_path / "other.zarr"
    _lease(other, host="elsewhere", pid=1, heartbeat=time.time())
    with pytest.raises(StoreError, match="another ingest is writing .*host elsewhere"):
        run_ingest(catalog, other, cluster_client)
    _lease(other, host="elsewhere", pid=1, heartbeat=time.time() - 1000)  # no heartbeat for 1000 s > 300 s
    assert run_ingest(catalog, other, cluster_client).n_written == 8


# ---- disk full (issue 11) -----------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 160 KiB tmpfs: a store on it runs out of space part-way. Needs the right to mount (root)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip() or 'not root'})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_disk_full_is_a_clear_error_and_resume_is_identical(cluster_client, tmp_path, tiny_disk):
    catalog = make_collection(tmp_path / "images", n=64)  # noise images: shards hardly compress
    store = tiny_disk / "s.zarr"
    with pytest.raises(StoreError, match=r"no space left on the device of the store .*s\.zarr.* run ingest again"):
        run_ingest(catalog, store, cluster_client, size=48, chunk=2, shard=2)
    assert not (store / "_dask_dl" / "lease.json").exists()
    write_catalog(catalog, tmp_path / "catalog.parquet")
    args = ["ingest", str(tmp_path / "catalog.parquet"), str(store), "--size", "48", "--chunk", "2", "--shard", "2"]
    result = CliRunner().invoke(cli, [*args, "--scheduler", cluster_client.scheduler.address, "--quiet"])
    assert result.exit_code == 1 and "Traceback" not in result.output and "no space left" in result.output
    subprocess.run(["mount", "-o", "remount,size=8m", str(tiny_disk)], check=True)
    resumed = run_ingest(catalog, store, cluster_client, size=48, chunk=2, shard=2)
    assert resumed.shards_skipped > 0
    clean = run_ingest(catalog, tmp_path / "clean.zarr", cluster_client, size=48, chunk=2, shard=2)
    assert store_files(store) == store_files(tmp_path / "clean.zarr")
    pd.testing.assert_frame_equal(resumed.rejects, clean.rejects)


def _page_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator settings are Linux-only")
@pytest.mark.slow
def test_ingest_tasks_reuse_freed_memory_under_the_nannys_trim_threshold(cluster_client, tmp_path):
    # the nanny starts workers with MALLOC_TRIM_THRESHOLD_, under which every allocation over 128 KiB is a fresh
    # mapping: each 1 MB file's bytes alone would fault in its 257 pages again for every image
    # read in the workers (a lambda travels by value; os.environ.get would take this process's environ with it)
    assert set(cluster_client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values()) == {"65536"}
    rng = np.random.default_rng(0)
    paths = []
    for i in range(16):  # noise: the PNG files hardly compress
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(rng.integers(0, 256, (1024, 1024), dtype=np.uint8)).save(paths[-1], compress_level=1)
    rows = {
        "image_id": [p.name for p in paths],
        "path": list(map(str, paths)),
        "site": "a",
        "split": "train",
        "patient_id": [f"p{i}" for i in range(16)],
        "Finding": [i % 2 for i in range(16)],
    }
    catalog = make_catalog(pd.DataFrame(rows), ["Finding"])
    file_pages = min(p.stat().st_size for p in paths) // 4096
    per_image = []
    for run in range(3):  # the first task on a worker also faults in its first imports: one of 3 runs is warm
        before = cluster_client.run(_page_faults)
        run_ingest(catalog, tmp_path / f"{run}.zarr", cluster_client, size=64, chunk=4, shard=4)  # one task
        after = cluster_client.run(_page_faults)
        per_image.append(sum(after[w] - before[w] for w in after) / len(paths))
    assert min(per_image) < file_pages / 4, (per_image, file_pages)  # about 280 without the allocator settings


@pytest.mark.slow
def test_relative_image_paths_are_read_from_the_clients_folder(cluster_client, tmp_path, monkeypatch):
    """A catalog of one's own may name images relative to where one works; the workers may run elsewhere."""
    here, elsewhere = tmp_path / "client", tmp_path / "workers"
    catalog = make_collection(here / "images", n=8)
    elsewhere.mkdir()
    monkeypatch.chdir(here)
    relative = catalog.assign(path=[os.path.relpath(p, here) for p in catalog["path"]])
    assert relative["path"].iloc[0] == os.path.join("images", os.path.basename(catalog["path"].iloc[0]))
    before = cluster_client.run(os.getcwd)
    cluster_client.run(os.chdir, str(elsewhere))
    try:
        result = run_ingest(relative, "cxr.zarr", cluster_client)
    finally:
        for worker, cwd in before.items():
            cluster_client.run(os.chdir, cwd, workers=[worker])
    assert (result.n, result.n_rejected) == (8, 0), result.rejects
    assert result.store == str(here / "cxr.zarr")
    expected = run_ingest(catalog, tmp_path / "absolute.zarr", cluster_client)
    np.testing.assert_array_equal(
        dask_dl.open_dataset(result.store).image.values, dask_dl.open_dataset(expected.store).image.values
    )
