"""check_store and `dask-dl check` on real stores: a sound one, and one damage of each kind."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from click.testing import CliRunner

import dask_dl
from dask_dl.cli import cli
from dask_dl.data.check import check_store
from dask_dl.errors import StoreNotFoundError
from dask_dl.testing.data import corrupt_shard, write_store

N, CHUNK, SHARD = 40, 4, 2  # 10 chunks, 5 shards of 8 samples


def split_of(i: int) -> str:
    return ("train", "val", "test")[i % 3]


@pytest.fixture
def store(tmp_path):
    return write_store(tmp_path / "s.zarr", n=N, chunk=CHUNK, shard=SHARD, rejected=(5, 30), split_of=split_of)


def problems(store) -> list[tuple[str, str, str]]:
    report = check_store(store)
    return [tuple(row) for row in report.problems.itertuples(index=False)]


def test_a_sound_store_is_ok(store):
    report = check_store(store)
    assert report.ok and report.chunks_read == 10 and report.layout.n == N
    assert report.summary() == f"{store}: ok ({N} samples, 10 chunks decoded, every shard present)"
    assert dask_dl.check_store is check_store


def test_a_corrupt_chunk_is_named_with_its_samples(store):
    corrupt_shard(store, 2)  # chunks 4 and 5
    found = problems(store)
    assert [(c, s) for c, s, _ in found] == [("chunks", "16..19"), ("chunks", "20..23")]
    assert found[0][2].startswith("chunk 4 cannot be decoded")


@pytest.mark.slow
def test_missing_shard_and_status_files(store):
    (store / "image" / "c" / "3" / "0" / "0").unlink()  # reads as zeros: the check must not trust that
    (store / "_dask_dl" / "status" / "shard-000001.json").unlink()
    assert problems(store) == [
        ("shards", "8..15", "shard 1 has no status file: its ingest did not finish"),
        ("shards", "24..31", "shard 3's file image/c/3/0/0 is missing"),
    ]


def test_table_damage_is_reported_by_sample(store):
    group = zarr.open_group(store, mode="r+")
    label = group["label"][:]
    label[7, 1] = 2
    group["label"][:] = label
    ids = np.asarray(group["image_id"][:].tolist(), dtype=str)
    ids[9] = ids[8]
    group["image_id"][:] = ids
    split = np.asarray(group["split"][:].tolist(), dtype=str)
    split[11] = "valid"
    group["split"][:] = split
    image = group["image"]
    image[30] = np.full(image.shape[1:], 3, np.uint8)  # a rejected sample with pixels
    assert problems(store) == [
        ("labels", "7", "label values other than 0 and 1"),
        ("coordinates", "11", "split not one of ['train', 'val', 'test']"),
        ("coordinates", "8..9", "image_id appears more than once"),
        ("chunks", "30", "rejected samples hold pixels (they must be all zero)"),
    ]


def test_metadata_problems(tmp_path, store):
    incomplete = write_store(tmp_path / "partial.zarr", n=8, chunk=CHUNK, shard=SHARD, complete=False)
    assert problems(incomplete) == [
        ("metadata", "", "the store is incomplete: an ingest into it did not finish; run it again")
    ]
    zarr.open_group(tmp_path / "other.zarr", mode="w")
    [(check, samples, problem)] = problems(tmp_path / "other.zarr")
    assert check == "metadata" and "not a dask_dl store" in problem
    with pytest.raises(StoreNotFoundError):
        check_store(tmp_path / "absent.zarr")
    (store / "_dask_dl" / "rejects.parquet").write_bytes(b"not parquet")
    [(check, samples, problem)] = problems(store)
    assert check == "rejects" and problem.startswith("the rejects table cannot be read")


def test_cli_check(store):
    runner = CliRunner()
    result = runner.invoke(cli, ["check", str(store)])
    assert result.exit_code == 0 and result.output.strip().endswith("every shard present)")
    corrupt_shard(store, 0)
    result = runner.invoke(cli, ["check", str(store)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{store}: 2 problem(s)" in result.output
    assert "[chunks] samples 0..3: chunk 0 cannot be decoded" in result.output
    assert "repair: delete the damaged shard files" in result.output
