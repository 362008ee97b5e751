"""Data where the workers are: every file on a real S3-compatible server (moto, on 127.0.0.1).

The raw images, the Zarr store, the checkpoints and the ONNX model all live in one bucket; the storage options
(endpoint, credentials) are given once with ``set_storage_options`` and every worker uses them. A worker without
them cannot see the bucket, and ``check_visible`` says which worker, before any work starts.
"""

from __future__ import annotations

import fsspec
import numpy as np
import pytest

import dask_dl
from dask_dl import StoreNotFoundError
from dask_dl.cluster import check_visible, connect, set_storage_options
from dask_dl.data.store import StoreFiles
from dask_dl.testing.cluster import small_story

# An S3 server (moto) and the stores written to it: for the full run only.
pytestmark = pytest.mark.slow


@pytest.fixture
def bucket(s3_server):
    set_storage_options(None, {"s3": s3_server})  # this process: to make the bucket and to look at it
    fs = fsspec.filesystem("s3")
    fs.mkdir("dask-dl")
    yield "s3://dask-dl"
    fs.rm("dask-dl", recursive=True)


def test_ingest_train_export_score_with_every_file_on_s3(s3_server, bucket, tmp_path):
    with connect(kind="local", n_workers=2) as client:
        store = f"{bucket}/cxr.zarr"
        # workers given another endpoint (one they cannot reach) do not see the bucket, and the check names them
        dead = {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"retries": {"max_attempts": 1}}}
        client.run(lambda: __import__("fsspec").config.conf.update(s3=dead))
        with pytest.raises(StoreNotFoundError, match=r"worker tcp://127\.0\.0\.1:\d+ cannot see 's3://dask-dl'"):
            check_visible(client, bucket)

        set_storage_options(client, {"s3": s3_server})  # once, for every worker
        check_visible(client, bucket)
        story = small_story(
            client,
            tmp_path,
            upload_raw=f"{bucket}/raw",
            store=store,
            checkpoint_dir=f"{bucket}/checkpoints",
            model_path=f"{bucket}/cxr.onnx",
        )

        # fit and predict check what their workers will open before any work, and name who cannot see it
        client.run(lambda: __import__("fsspec").config.conf.update(s3=dead))
        worker = r"worker tcp://127\.0\.0\.1:\d+ cannot see "
        with pytest.raises(StoreNotFoundError, match=worker + "'s3://dask-dl/cxr.zarr'"):
            dask_dl.fit(dask_dl.open_dataset(store), model="small_cnn", trainers=2, batch_size=8, client=client)
        with pytest.raises(StoreNotFoundError, match=worker + "'s3://dask-dl/cxr.onnx'"):
            dask_dl.predict(dask_dl.open_dataset(store, split="test"), story.model, client=client)

    fs = fsspec.filesystem("s3")
    assert story.images == 48
    assert fs.exists("dask-dl/cxr.zarr/zarr.json")
    assert fs.exists("dask-dl/checkpoints/epoch-0000.pt")
    assert fs.exists("dask-dl/cxr.onnx")
    assert dask_dl.read_catalog(f"{bucket}/raw")["path"].str.startswith("s3://dask-dl/raw/images/").all()
    test = dask_dl.open_dataset(store, split="test")
    assert story.scores.shape == (test.sizes["sample"], 14)
    # the scores from the model on S3 equal the exported model's own scores on the same images
    expected = dask_dl.predict(test.image.values, story.model).compute()
    np.testing.assert_allclose(story.scores, expected, rtol=1e-5, atol=1e-6)
    assert not (tmp_path / "s3:").exists()  # nothing was written to a local folder named after the URL


def test_clearing_a_store_on_s3_keeps_only_its_lease(bucket):
    # what ingest(overwrite=True) does under its lease; on S3 folders are only prefixes of keys
    fs = fsspec.filesystem("s3")
    for key in [
        "zarr.json",
        "image/c/0/0/0",
        "_dask_dl/zarr.json",
        "_dask_dl/status/shard-0.json",
        "_dask_dl/lease.json",
    ]:
        fs.pipe_file(f"dask-dl/s.zarr/{key}", key.encode())
    StoreFiles(f"{bucket}/s.zarr").clear(keep="_dask_dl/lease.json")
    fs.invalidate_cache()
    assert fs.find("dask-dl/s.zarr") == ["dask-dl/s.zarr/_dask_dl/lease.json"]
    assert fs.cat_file("dask-dl/s.zarr/_dask_dl/lease.json") == b"_dask_dl/lease.json"


def test_the_command_line_gives_its_storage_settings_to_workers_that_lack_them(s3_server, bucket, tmp_path):
    """A shell user names the object store once, in fsspec's FSSPEC_S3_* variables; the workers of a cluster that
    does not share that shell (a gateway's, SLURM jobs, a scheduler elsewhere) get them from the command."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pandas as pd
    import torch
    from distributed import Client, LocalCluster

    from dask_dl.data.synthetic import synthesize
    from dask_dl.testing.models import TinyNet

    store = f"{bucket}/cli.zarr"
    synthesize(tmp_path / "raw", n_images=24, size=64, seed=3)
    catalog = dask_dl.read_catalog(tmp_path / "raw")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSSPEC_")}
    env |= {
        "FSSPEC_S3_ENDPOINT_URL": s3_server["endpoint_url"],
        "FSSPEC_S3_KEY": s3_server["key"],
        "FSSPEC_S3_SECRET": s3_server["secret"],
    }
    command = Path(sys.executable).with_name("dask-dl")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(command), *args], env=env, capture_output=True, text=True, timeout=180)

    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        # the workers have no settings for s3: ingest names the worker before any shard is written
        with pytest.raises(
            StoreNotFoundError, match=r"worker tcp://127\.0\.0\.1:\d+ cannot see 's3://dask-dl/cli\.zarr'"
        ):
            dask_dl.ingest(catalog, store, size=32, chunk=8, client=client)
        assert not fsspec.filesystem("s3").exists("dask-dl/cli.zarr/_dask_dl/status")

        ingested = run(
            "ingest",
            str(tmp_path / "raw"),
            store,
            "-s",
            "32",
            "--chunk",
            "8",
            "--scheduler",
            cluster.scheduler_address,
            "--overwrite",
        )
        assert ingested.returncode == 0, ingested.stderr
        assert ingested.stdout.startswith(f"ingested 24 images into {store}: 24 valid, 0 rejected"), ingested.stdout

        model = f"{bucket}/tiny.onnx"
        torch.manual_seed(0)
        dask_dl.export_onnx(
            TinyNet(14, width=3), model, labels=list(dask_dl.open_dataset(store).finding.values), input_size=32
        )
        scored = run(
            "predict",
            store,
            model,
            "--split",
            "test",
            "--out",
            f"{bucket}/scores.parquet",
            "--scheduler",
            cluster.scheduler_address,
        )
        assert scored.returncode == 0, scored.stderr
        assert "Unclosed" not in scored.stderr, scored.stderr  # aiohttp's reports of sessions left for exit
    with fsspec.open(f"{bucket}/scores.parquet", "rb") as f:  # written through fsspec, not pyarrow's own S3 client
        table = pd.read_parquet(f)
    test = dask_dl.open_dataset(store, split="test")
    assert list(table["sample"]) == list(test.sample.values)
    expected = dask_dl.predict(test.image.values, model).compute()
    np.testing.assert_allclose(
        table[[c for c in table.columns if c.startswith("p_")]].to_numpy(), expected, rtol=1e-5, atol=1e-6
    )

    # explain reads the model on S3 as predict does (occlusion runs the ONNX model): the same maps as a local copy
    local = tmp_path / "tiny.onnx"
    fsspec.filesystem("s3").get_file("dask-dl/tiny.onnx", str(local))
    few = test.isel(sample=slice(0, 2))
    maps = dask_dl.explain(few, model, labels=["Effusion"], method="occlusion").values
    np.testing.assert_array_equal(maps, dask_dl.explain(few, local, labels=["Effusion"], method="occlusion").values)

    missing = run("predict", store, f"{bucket}/nothing.onnx", "--out", str(tmp_path / "s.parquet"))
    assert missing.returncode == 2
    assert "Invalid value for 'MODEL': 's3://dask-dl/nothing.onnx' does not exist." in missing.stderr
