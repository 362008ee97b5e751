"""predict() over a real ingested store on a real LocalCluster, the session cache, scores tables, the CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.external_data_helper
import onnxruntime as ort
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from distributed import wait

import dask_dl
from dask_dl import ConfigurationError, DatasetError, ExportError, StoreNotFoundError
from dask_dl.cli import cli
from dask_dl.export import INPUT_NAME, OUTPUT_NAME, export_onnx
from dask_dl.inference import evaluate, predict, scores_table
from dask_dl.metrics import auroc
from dask_dl.models import build_model
from dask_dl.normalize import normalize

SIZE, CHUNK, BATCH = 64, 8, 4


@pytest.fixture(scope="module")
def store(tmp_path_factory, cluster_client):
    """A synthetic NIH-layout collection with a few corrupt files, ingested at 64 px in chunks of 8."""
    from dask_dl.data.catalog import read_nih
    from dask_dl.data.synthetic import synthesize

    root = tmp_path_factory.mktemp("collection")
    synthesize(root / "nih", n_images=60, size=SIZE, seed=3, corrupt_fraction=0.1)
    catalog = read_nih(root / "nih")
    result = dask_dl.ingest(
        catalog, root / "cxr.zarr", size=SIZE, chunk=CHUNK, shard=2, client=cluster_client, progress=False
    )
    assert result.n_rejected > 0  # rejected rows make gaps in the sample numbers the scores must follow
    return root / "cxr.zarr"


@pytest.fixture(scope="module")
def model(store, tmp_path_factory):
    """A small CNN with BatchNorm statistics from real images, exported; returns (torch model, onnx path)."""
    ds = dask_dl.open_dataset(store)
    torch.manual_seed(0)
    net = build_model("small_cnn", num_outputs=ds.sizes["finding"], width=8)
    with torch.no_grad():
        net(normalize(ds.image[:16].values))  # train mode: updates the running statistics
    net.eval()
    path = tmp_path_factory.mktemp("model") / "cxr.onnx"
    export_onnx(net, path, labels=list(ds.finding.values), input_size=SIZE)
    return net, path


def _reference(path, images: np.ndarray, chunks: tuple[int, ...], batch: int) -> np.ndarray:
    """One onnxruntime session in this process over the same chunk and batch boundaries as predict."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    out, start = [], 0
    for size in chunks:
        block = images[start : start + size]
        for b in range(0, size, batch):
            x = block[b : b + batch, None].astype(np.float32)
            out.append(session.run([OUTPUT_NAME], {INPUT_NAME: x})[0])
        start += size
    return np.concatenate(out)


def _sessions(cluster_client) -> dict[str, int]:
    def count():
        import dask_dl.inference

        return dask_dl.inference.SESSIONS_CREATED

    return cluster_client.run(count)


@pytest.mark.slow
def test_predict_on_cluster_equals_single_process_and_torch(cluster_client, store, model):
    net, path = model
    ds = dask_dl.open_dataset(store)
    assert ds.sizes["sample"] < 60 and ds.sample.values[-1] == 59  # rejected rows dropped, numbers kept
    before = _sessions(cluster_client)
    probs = predict(ds, path, batch_size=BATCH, client=cluster_client)  # persisted on the cluster
    assert probs.shape == (ds.sizes["sample"], ds.sizes["finding"]) and probs.dtype == np.float32
    assert probs.chunks[0] == ds.image.data.chunks[0] and len(probs.chunks[0]) >= 6
    wait(probs)
    # where each chunk was scored: read before compute(), which copies every chunk to one worker, after which the
    # scheduler may drop the copy on the worker that scored it (seen once in CI)
    placed = cluster_client.who_has(probs)
    assert all(len(workers) == 1 for workers in placed.values()), placed
    got = probs.compute()
    images = ds.image.values
    np.testing.assert_array_equal(got, _reference(path, images, probs.chunks[0], BATCH))
    with torch.no_grad():
        want = torch.sigmoid(net(normalize(images))).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)

    # exactly one new session in each worker process that scored chunks, however many chunks it scored
    blocks = dict.fromkeys(before, 0)
    for workers in placed.values():
        for worker in workers:
            blocks[worker] += 1
    assert max(blocks.values()) >= 2, blocks  # 7 chunks on 2 workers: one of them reused its session
    after = _sessions(cluster_client)
    assert {w: after[w] - before[w] for w in after} == {w: int(n > 0) for w, n in blocks.items()}
    # and none for a second computation with the same model
    again = predict(ds.isel(sample=slice(0, 20)), path, batch_size=BATCH).compute()
    np.testing.assert_array_equal(again, got[:20])
    assert _sessions(cluster_client) == after


def test_numpy_and_float_inputs(store, model):
    _, path = model
    ds = dask_dl.open_dataset(store)
    expected = predict(ds, path, batch_size=BATCH).compute(scheduler="threads")
    images = ds.image.values
    # NumPy uint8 (n, S, S) and float (n, 1, S, S): chunks of 256, batch boundaries at the same multiples of 4
    np.testing.assert_array_equal(predict(images, path, batch_size=BATCH).compute(), expected)
    as_float = images[:, None].astype(np.float64)
    np.testing.assert_array_equal(predict(as_float, path, batch_size=BATCH).compute(), expected)
    # a bare DataArray
    np.testing.assert_array_equal(predict(ds.image, path, batch_size=BATCH).compute(), expected)


def test_wrong_shapes_refused(store, model):
    _, path = model
    with pytest.raises(ExportError, match=r"takes images of shape \(1, 64, 64\).*data has images of shape \(32, 32\)"):
        predict(np.zeros((4, 32, 32), np.uint8), path)
    with pytest.raises(ExportError, match=r"\(1, 64, 64\).*\(3, 64, 64\)"):
        predict(np.zeros((4, 3, 64, 64), np.uint8), path)
    with pytest.raises(ExportError, match=r"\(1, 64, 64\).*\(64,\)"):
        predict(np.zeros((4, 64), np.uint8), path)
    with pytest.raises(DatasetError, match="uint8 or float.*bool"):
        predict(np.zeros((4, 64, 64), bool), path)
    with pytest.raises(ConfigurationError, match="batch_size must be a positive integer, got 0"):
        predict(np.zeros((4, 64, 64), np.uint8), path, batch_size=0)


def test_not_onnx_and_missing_metadata(tmp_path, store, model):
    net, path = model
    ds = dask_dl.open_dataset(store)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"PK\x03\x04 a zip file, not a model" * 10)
    with pytest.raises(ExportError, match="is not an ONNX model"):
        predict(ds, junk)
    with pytest.raises(StoreNotFoundError, match="no ONNX model file"):
        predict(ds, tmp_path / "absent.onnx")

    proto = onnx.load(str(path))
    del proto.metadata_props[:]
    bare = tmp_path / "bare.onnx"
    onnx.save(proto, str(bare))
    with pytest.raises(ExportError, match="no dask_dl metadata"):
        predict(ds, bare)
    labels = list(ds.finding.values)
    got = predict(ds, bare, input_size=SIZE, labels=labels, batch_size=BATCH).compute(scheduler="threads")
    np.testing.assert_array_equal(got, predict(ds, path, batch_size=BATCH).compute(scheduler="threads"))
    with pytest.raises(ExportError, match="predicts"):
        predict(ds, path, labels=labels[:3])


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch's exporter, called directly here
def test_metadata_less_model_with_outside_normalization(tmp_path, model):
    net, _ = model
    path = tmp_path / "plain.onnx"
    # a model exported by someone else: takes normalized float input, returns logits, no metadata
    torch.onnx.export(
        net,
        (torch.zeros(2, 1, SIZE, SIZE),),
        str(path),
        dynamo=True,
        input_names=["x"],
        dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1)}},
    )
    images = np.random.default_rng(0).integers(0, 256, (10, SIZE, SIZE), dtype=np.uint8)
    labels = [f"l{i}" for i in range(net.fc.out_features)]
    got = predict(images, path, input_size=SIZE, labels=labels, normalization={"mean": 0.5, "std": 0.25}).compute()
    with torch.no_grad():
        want = net(normalize(images)).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_scores_table_round_trips_through_parquet(tmp_path, store, model):
    _, path = model
    ds = dask_dl.open_dataset(store, split="train")
    probs = predict(ds, path, batch_size=BATCH)
    table = scores_table(ds, probs)
    labels = list(ds.finding.values)
    assert list(table.columns[:5]) == ["sample", "image_id", "patient_id", "split", "site"]
    assert list(table.columns[5 : 5 + len(labels)]) == [f"p_{label}" for label in labels]
    assert list(table.columns[5 + len(labels) :]) == labels
    np.testing.assert_array_equal(table["sample"], ds.sample.values)
    np.testing.assert_array_equal(table["image_id"], ds.image_id.values)
    assert (table["split"] == "train").all()
    values = probs.compute(scheduler="threads")
    np.testing.assert_array_equal(table[[f"p_{label}" for label in labels]].to_numpy(), values)
    np.testing.assert_array_equal(table[labels].to_numpy(), ds.label.values)

    table.to_parquet(tmp_path / "scores.parquet", index=False)
    back = pd.read_parquet(tmp_path / "scores.parquet")
    pd.testing.assert_frame_equal(back, table, check_dtype=False)
    assert [str(back[c].dtype) for c in ("sample", "p_Mass", "Mass")] == ["int64", "float32", "uint8"]
    result = evaluate(back)
    assert list(result.index) == labels
    np.testing.assert_array_equal(result.to_numpy(), auroc(ds.label.values, values))
    assert np.isfinite(result.to_numpy()).sum() >= 3

    with pytest.raises(DatasetError, match="pass labels="):
        scores_table(ds, values[:, :3])
    partial = scores_table(ds, values[:, :3], labels=labels[:3])
    assert list(evaluate(partial).index) == labels[:3]
    with pytest.raises(DatasetError, match="lacks score or truth columns"):
        evaluate(partial.drop(columns=labels[:3]))


@pytest.mark.slow
def test_cli_export_and_predict(tmp_path, cluster_client, store, model):
    net, _ = model
    ds = dask_dl.open_dataset(store)
    ckdir = tmp_path / "ck"
    ckdir.mkdir()
    checkpoint = {
        "format": 1,
        "model_name": "small_cnn",
        "model_kwargs": {"width": 8},
        "model": net.state_dict(),
        "labels": [str(v) for v in ds.finding.values],
        "task": "multilabel",
        "input_size": SIZE,
        "in_channels": 1,
        "normalization": {"mean": 0.5, "std": 0.25},
        "epoch": 2,
        "optimizer": {},
        "compressor": [],
        "rng": [],
        "history": [],
    }
    torch.save(checkpoint, ckdir / "epoch-0002.pt")
    runner = CliRunner()
    onnx_path = tmp_path / "m.onnx"
    result = runner.invoke(cli, ["export", str(ckdir), str(onnx_path)])
    assert result.exit_code == 0, result.output
    assert "parity with torch checked" in result.output
    result = runner.invoke(cli, ["export", str(ckdir), str(onnx_path)])
    assert result.exit_code == 1 and "exists already" in result.output

    out = tmp_path / "scores.parquet"
    args = ["predict", str(store), str(onnx_path), "--out", str(out), "--split", "test"]
    args += ["--scheduler", cluster_client.scheduler.address]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    test = dask_dl.open_dataset(store, split="test")
    table = pd.read_parquet(out)
    expected = scores_table(test, predict(test, onnx_path).compute(scheduler="threads"))
    np.testing.assert_allclose(table.filter(like="p_").to_numpy(), expected.filter(like="p_").to_numpy(), atol=0)
    lines = result.output.splitlines()
    assert lines[1] == f"  {'AUROC':24s}{'test':>8s}"  # one split: one column
    for label, value in evaluate(expected).items():
        assert f"  {label:24s}{value:8.4f}" in lines if np.isfinite(value) else f"  {label:24s}{'-':>8s}" in lines
    result = runner.invoke(cli, args)
    assert result.exit_code == 1 and "exists already; pass --overwrite" in result.output
    assert runner.invoke(cli, [*args, "--overwrite"]).exit_code == 0

    zarr_out = tmp_path / "scores.zarr"
    result = runner.invoke(cli, [*args[:4], str(zarr_out), *args[5:]])
    assert result.exit_code == 0, result.output
    import xarray as xr

    scores = xr.open_zarr(zarr_out, consolidated=False)
    np.testing.assert_array_equal(scores.sample.values, test.sample.values)
    np.testing.assert_array_equal(scores.probability.values, expected.filter(like="p_").to_numpy())
    assert list(scores.label.values) == list(test.finding.values)


def test_model_changed_after_predict_is_refused(tmp_path, model):
    import os
    import shutil

    _, path = model
    copy = tmp_path / "m.onnx"
    shutil.copy(path, copy)
    images = np.zeros((8, SIZE, SIZE), np.uint8)
    lazy = predict(images, copy, providers=["CPUExecutionProvider"])
    st = os.stat(copy)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a re-export would
    with pytest.raises(ExportError, match="changed after predict"):
        lazy.compute(scheduler="sync")
    fresh = predict(images, copy, providers=["CPUExecutionProvider"]).compute(scheduler="sync")
    np.testing.assert_array_equal(fresh, predict(images, path).compute(scheduler="sync"))


def _altered(path, tmp_path, name: str, *, meta=None, op_type=None):
    """A copy of the model at ``path`` with its dask_dl metadata replaced by ``meta`` or its first node renamed."""
    proto = onnx.load(str(path))
    if meta is not None:
        for prop in proto.metadata_props:
            if prop.key == "dask_dl":
                prop.value = meta
    if op_type is not None:
        proto.graph.node[0].op_type = op_type
    out = tmp_path / name
    onnx.save(proto, str(out))
    return out


def test_bad_onnx_metadata_is_refused_when_the_model_is_opened(tmp_path, store, model):
    import json

    from dask_dl.export import read_model_info

    _, path = model
    ds = dask_dl.open_dataset(store)
    meta = json.loads({p.key: p.value for p in onnx.load(str(path)).metadata_props}["dask_dl"])
    n = len(meta["labels"])
    cases = {
        "notjson.onnx": ('{"labels": [', r"'dask_dl' metadata entry that is not JSON"),
        "nolabels.onnx": (json.dumps({k: v for k, v in meta.items() if k != "labels"}), r"without \['labels'\]"),
        "list.onnx": (json.dumps([1, 2]), "is a list, not a JSON object"),
        "size.onnx": (json.dumps({**meta, "input_size": 128}), r"says images of 1 x 128 x 128, but the graph input"),
        "labels.onnx": (json.dumps({**meta, "labels": ["a", "b"]}), rf"2 labels, but the graph outputs {n}"),
    }
    for name, (value, message) in cases.items():
        bad = _altered(path, tmp_path, name, meta=value)
        with pytest.raises(ExportError, match=rf"{name}'.*{message}"):
            read_model_info(bad)
        with pytest.raises(ExportError, match=message):
            predict(ds, bad)  # when the graph is built, not when a worker computes
    unknown = _altered(path, tmp_path, "op.onnx", op_type="NoSuchOperator")
    with pytest.raises(ExportError, match=r"op\.onnx' uses operators no ONNX runtime here knows: \['ai.onnx::NoSuch"):
        predict(ds, unknown)
    assert read_model_info(path).labels == tuple(meta["labels"])  # the untouched model still opens


def _with_external_data(path, folder, location: str):
    """A copy of the model at ``path`` in ``folder`` whose weights are in external data files at ``location``."""
    folder.mkdir(parents=True, exist_ok=True)
    proto = onnx.load(str(path))
    out = folder / "m.onnx"
    onnx.save_model(proto, str(out), save_as_external_data=True, location="m.onnx.data")  # tensors of 1 kB and more
    if location != "m.onnx.data":  # moved where the model now points, as a hostile model's author would
        target = Path(location) if Path(location).is_absolute() else folder / location
        target.parent.mkdir(parents=True, exist_ok=True)
        (folder / "m.onnx.data").rename(target)
        proto = onnx.load(str(out), load_external_data=False)
        for tensor in proto.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = location
        onnx.save_model(proto, str(out))
    return out


def test_external_data_must_be_beside_the_model(tmp_path, store, model):
    # issue 28: a model whose external data points outside its folder was accepted by predict() and failed on the
    # workers at compute() with onnxruntime's raw "Fail: External data path validation failed"
    from dask_dl.export import read_model_info

    _, path = model
    ds = dask_dl.open_dataset(store)
    expected = predict(ds, path).compute()
    for name, location in {"beside": "m.onnx.data", "below": "weights/m.onnx.data"}.items():
        good = _with_external_data(path, tmp_path / name, location)
        weights = onnx.load(str(good), load_external_data=False).graph.initializer
        assert sum(onnx.external_data_helper.uses_external_data(t) for t in weights) >= 2  # the convolutions
        np.testing.assert_array_equal(predict(ds, good).compute(), expected)
    outside = {
        "up": "../secret.bin",
        "deep": "weights/../../secret.bin",
        "absolute": str(tmp_path / "elsewhere" / "secret.bin"),
    }
    for name, location in outside.items():
        bad = _with_external_data(path, tmp_path / name, location)
        message = rf"m\.onnx': the weights of .* are in the external data file '{location}', outside the model's folder"
        with pytest.raises(ExportError, match=message + r".*keep external data files beside the model, inside its"):
            predict(ds, bad)  # when the graph is built, not when a worker computes
        with pytest.raises(ExportError, match=message):
            read_model_info(bad)
    (tmp_path / "beside" / "m.onnx.data").unlink()  # a model copied without its weights
    with pytest.raises(ExportError, match=r"external data file 'm\.onnx\.data', which is not in the model's folder"):
        predict(ds, tmp_path / "beside" / "m.onnx")


def test_the_auroc_of_every_split_is_its_own_column():
    """Scores of the images a model trained on are no measure of it: ``dask-dl predict`` of a whole store prints
    one AUROC column per split, and says which one measures the model."""
    from click.testing import CliRunner

    from dask_dl.cli.models import _echo_auroc

    table = pd.DataFrame(
        {
            "split": ["train"] * 4 + ["test"] * 4 + ["val"] * 2,
            "a": [1, 0, 1, 0, 1, 1, 0, 0, 1, 1],
            "p_a": [0.9, 0.1, 0.8, 0.2, 0.4, 0.9, 0.3, 0.8, 0.5, 0.6],
            "b": [0, 0, 1, 1, 0, 0, 0, 0, 1, 0],
            "p_b": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.1],
        }
    )
    result = CliRunner().invoke(click_command(lambda: _echo_auroc(table, ["a", "b"])))
    assert result.output.splitlines() == [
        f"  {'AUROC':24s}   train     val    test",
        f"  {'a':24s}  1.0000       -  0.7500",  # test: 0.4 and 0.9 against 0.3 and 0.8, 3 of 4 pairs in order
        f"  {'b':24s}  1.0000  1.0000       -",
        f"  {'mean':24s}  1.0000  1.0000  0.7500",
        "  -: no AUROC, the split's images all have that label or all lack it",
        "  train and val: images the model learned from or was chosen on; test measures it",
    ]


def click_command(body):
    import click

    return click.command()(body)
