"""open_dataset, summary and the ingest/summary CLI on a real store written by ingest on a real LocalCluster."""

from __future__ import annotations

import json
from pathlib import Path

import dask.config
import numpy as np
import pandas as pd
import pytest
import zarr
from click.testing import CliRunner
from PIL import Image

import dask_dl
from dask_dl.cli import cli
from dask_dl.data.dataset import open_dataset, summary
from dask_dl.data.schema import make_catalog, write_catalog
from dask_dl.errors import DatasetError, StoreError, StoreNotFoundError

LABELS = ["Atelectasis", "Edema"]
N = 24


def make_catalog_on_disk(root: Path) -> pd.DataFrame:
    """N PNGs whose pixels all equal their row number, two sites, three splits; rows 5 and 17 are broken."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(N):
        path = root / f"{i:03d}.png"
        Image.fromarray(np.full((64, 64), i * 10, np.uint8)).save(path)
        patient = i // 2
        rows.append(
            {
                "image_id": f"id{i:03d}",
                "path": str(path),
                "patient_id": f"p{patient}",
                "site": ("east", "west")[patient % 2],
                "split": ("train", "val", "test", "train")[patient % 4],
                "Atelectasis": i % 2,
                "Edema": int(i % 3 == 0),
            }
        )
    (root / "005.png").write_bytes(b"garbage")
    (root / "017.png").unlink()
    return make_catalog(pd.DataFrame(rows), LABELS)


@pytest.fixture(scope="module", autouse=True)
def catalog_order():
    """These tests name samples by their catalog row: store them in catalog order, here and in the subprocesses
    some tests start (the shuffled default order is tested in test_order.py)."""
    with pytest.MonkeyPatch.context() as patch, dask.config.set({"dask-dl.ingest.order": "catalog"}):
        patch.setenv("DASK_DASK_DL__INGEST__ORDER", "catalog")
        yield


@pytest.fixture(scope="module")
def ingested(cluster_client, tmp_path_factory):
    root = tmp_path_factory.mktemp("dataset")
    catalog = make_catalog_on_disk(root / "images")
    store = root / "store.zarr"
    dask_dl.ingest(catalog, store, size=16, chunk=2, shard=3, client=cluster_client, progress=False)
    return catalog, store


@pytest.mark.slow
def test_open_dataset_contract(ingested):
    catalog, store = ingested
    ds = open_dataset(store)
    valid = np.ones(N, bool)
    valid[[5, 17]] = False
    assert ds.sizes == {"sample": N - 2, "y": 16, "x": 16, "finding": 2}
    assert ds.image.dtype == np.uint8 and ds.image.dims == ("sample", "y", "x")
    assert ds.label.dims == ("sample", "finding") and list(ds.finding.values) == LABELS
    np.testing.assert_array_equal(ds.sample.values, np.flatnonzero(valid))  # physical rows
    np.testing.assert_array_equal(ds.image.values[:, 8, 8], np.flatnonzero(valid) * 10)  # pixel value = 10 * row
    np.testing.assert_array_equal(ds.label.values, catalog[LABELS].to_numpy(np.uint8)[valid])
    assert ds.valid.values.all()
    assert ds.attrs["dask_dl"] == {
        "format": 1,
        "size": 16,
        "chunk": 2,
        "shard": 3,
        "labels": LABELS,
        "task": "multilabel",
        "n": N,
        "channels": 1,
        "order": "catalog",
        "order_seed": 0,
        "complete": True,
    }
    assert ds.encoding["source"] == str(store)
    # lazy, every variable chunked alike, and no dask chunk straddles two Zarr chunks (of 2 images)
    assert ds.image.chunks is not None and ds.label.chunks is not None
    assert ds.chunks["sample"] == ds.image.data.chunks[0] == (2, 2, 1, *[2] * 5, 1, 2, 2, 2)
    bounds = np.cumsum((0, *ds.image.data.chunks[0]))
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        assert len(set(ds.sample.values[start:stop] // 2)) == 1
    train = open_dataset(store, split="train")
    np.testing.assert_array_equal(train.image.values[:, 0, 0], train.sample.values * 10)
    np.testing.assert_array_equal(train.label.values, catalog[LABELS].to_numpy(np.uint8)[train.sample.values])
    full = open_dataset(store, include_rejected=True)
    assert full.image.data.chunks[0] == (2,) * (N // 2) and full.label.data.chunks[0] == (2,) * (N // 2)
    assert not full.valid.values[[5, 17]].any() and full.valid.values.sum() == N - 2
    assert not full.image.values[[5, 17]].any()
    np.testing.assert_array_equal(full.image_id.values, catalog["image_id"].to_numpy(str))


def test_select_split_and_site(ingested):
    catalog, store = ingested
    kept = catalog.drop(index=[5, 17])
    for split in ("train", "val", "test"):
        ds = open_dataset(store, split=split)
        assert list(ds.image_id.values) == list(kept.loc[kept["split"] == split, "image_id"])
        assert set(ds.split.values) == {split}
    ds = open_dataset(store, split=["val", "test"], site="west")
    expected = kept[kept["split"].isin(["val", "test"]) & (kept["site"] == "west")]
    assert list(ds.image_id.values) == list(expected["image_id"])
    np.testing.assert_array_equal(ds.image.values[:, 0, 0], expected.index.to_numpy() * 10)
    # no patient in two splits
    patients = {s: set(open_dataset(store, split=s).patient_id.values) for s in ("train", "val", "test")}
    assert not (patients["train"] & patients["val"] or patients["train"] & patients["test"])


def test_unknown_split_or_site_lists_those_present(ingested):
    _, store = ingested
    with pytest.raises(DatasetError, match=r"split 'valid' .*\['test', 'train', 'val'\]"):
        open_dataset(store, split="valid")
    with pytest.raises(DatasetError, match=r"site 'north' .*\['east', 'west'\]"):
        open_dataset(store, site=["east", "north"])


def test_not_a_store_errors(tmp_path):
    with pytest.raises(StoreNotFoundError, match="no Zarr store"):
        open_dataset(tmp_path / "absent.zarr")
    (tmp_path / "folder").mkdir()
    with pytest.raises(StoreError, match="not a Zarr store"):
        open_dataset(tmp_path / "folder")
    zarr.open_group(tmp_path / "other.zarr", mode="w").attrs["x"] = 1
    with pytest.raises(StoreError, match="not a dask_dl store"):
        open_dataset(tmp_path / "other.zarr")


def test_incomplete_store_says_resume(ingested, cluster_client, tmp_path):
    catalog, store = ingested
    copy_ = tmp_path / "copy.zarr"
    import shutil

    shutil.copytree(store, copy_)
    meta = json.loads((copy_ / "zarr.json").read_text())
    meta["attributes"]["dask_dl"]["complete"] = False
    (copy_ / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="incomplete.*Run ingest again to resume"):
        open_dataset(copy_)
    result = dask_dl.ingest(catalog, copy_, size=16, chunk=2, shard=3, client=cluster_client, progress=False)
    assert (result.shards_written, result.shards_skipped) == (0, 4)
    assert open_dataset(copy_).sizes["sample"] == N - 2


def expected_summary(catalog: pd.DataFrame) -> pd.DataFrame:
    kept = catalog.drop(index=[5, 17])
    rows = {}
    for split in ("train", "val", "test"):
        part = kept[kept["split"] == split]
        rows[split] = {
            "images": len(part),
            **{label: int(part[label].sum()) for label in LABELS},
            "rejected": int((catalog.loc[[5, 17], "split"] == split).sum()),
        }
    table = pd.DataFrame(rows).T
    table.loc["total"] = table.sum()
    return table


def test_summary_counts(ingested):
    catalog, store = ingested
    table = summary(store)
    expected = expected_summary(catalog)
    assert list(table.index) == ["train", "val", "test", "total"]
    assert table.to_dict() == expected.to_dict()
    assert table.loc["total", "images"] == N - 2 and table.loc["total", "rejected"] == 2
    only_val = summary(open_dataset(store, split="val"))
    assert list(only_val.index) == ["val", "total"] and only_val.loc["val", "images"] == expected.loc["val", "images"]


@pytest.mark.slow
def test_cli_ingest_and_summary(cluster_client, tmp_path):
    catalog = make_catalog_on_disk(tmp_path / "images")
    write_catalog(catalog, tmp_path / "catalog.parquet")
    store = tmp_path / "cli.zarr"
    runner = CliRunner()
    args = ["ingest", str(tmp_path / "catalog.parquet"), str(store), "--size", "16", "--chunk", "2", "--shard", "3"]
    address = ["--scheduler", cluster_client.scheduler.address, "--quiet"]
    result = runner.invoke(cli, [*args, *address])
    assert result.exit_code == 0, result.output
    assert f"ingested {N} images into {store}: {N - 2} valid, 2 rejected" in result.output
    assert "missing 1, undecodable 1" in result.output
    result = runner.invoke(cli, [*args[:3], "--size", "32", *address])
    assert result.exit_code == 1 and "size: store has 16, asked for 32" in result.output
    assert "Traceback" not in result.output
    result = runner.invoke(cli, ["summary", str(store)])
    assert result.exit_code == 0, result.output
    assert f"{N - 2} images, 2 rejected" in result.output
    lines = {line.split()[0]: line.split()[1:] for line in result.output.splitlines()[1:]}
    assert lines["split"] == ["train", "val", "test", "total"]
    assert lines["images"] == [str(v) for v in expected_summary(catalog)["images"]]
