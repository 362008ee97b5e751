"""ONNX export: every registry model, parity with torch in onnxruntime, metadata, sources, refusals."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dask_dl import ExportError, StoreNotFoundError
from dask_dl.export import INPUT_NAME, OUTPUT_NAME, ModelInfo, export_onnx, read_model_info
from dask_dl.models import build_model
from dask_dl.normalize import normalize

LABELS = ["Atelectasis", "Effusion", "Mass"]
SIZE = 64


def _images(n: int, seed: int = 1, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size), dtype=np.uint8)


def _torch_probs(model: torch.nn.Module, images: np.ndarray, *, softmax: bool = False) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        logits = model(normalize(images))
    return (torch.softmax(logits, 1) if softmax else torch.sigmoid(logits)).numpy()


def _ort_probs(path, images: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run([OUTPUT_NAME], {INPUT_NAME: images[:, None].astype(np.float32)})[0]


def _checkpoint(model: torch.nn.Module, name: str, *, epoch: int = 0, task: str = "multilabel", **kw) -> dict:
    """A checkpoint dict as training writes it (the contract's keys)."""
    return {
        "format": 1,
        "model_name": name,
        "model_kwargs": kw,
        "model": model.state_dict(),
        "labels": list(LABELS),
        "task": task,
        "input_size": SIZE,
        "in_channels": 1,
        "normalization": {"mean": 0.5, "std": 0.25},
        "epoch": epoch,
        "optimizer": {},
        "compressor": [],
        "rng": [],
        "history": [],
    }


def _trained_like(name: str, seed: int, **kw) -> torch.nn.Module:
    """A model with non-trivial BatchNorm statistics, as after training (fresh ones are all mean 0, var 1)."""
    torch.manual_seed(seed)
    model = build_model(name, num_outputs=len(LABELS), **kw)
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(normalize(_images(4, seed=seed)))
    return model.eval()


@pytest.mark.parametrize(
    "name",
    [
        "small_cnn",
        "alexnet",
        "resnet18",
        pytest.param("resnet50", marks=pytest.mark.slow),
        pytest.param("densenet121", marks=pytest.mark.slow),
    ],
)
def test_every_registry_model_exports_with_parity(tmp_path, name):
    model = _trained_like(name, seed=0)
    path = export_onnx(_checkpoint(model, name), tmp_path / f"{name}.onnx")
    assert path == tmp_path / f"{name}.onnx"
    onnx.checker.check_model(str(path))
    proto = onnx.load(str(path))
    # dynamic batch axis, fixed image shape
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [1, SIZE, SIZE]
    # our own check, independent of the one inside export_onnx: other images, other batch sizes (1 and 5)
    for n in (1, 5):
        images = _images(n, seed=7)
        got, want = _ort_probs(path, images), _torch_probs(model, images)
        assert got.shape == (n, len(LABELS)) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A small CNN (width 8) exported from a checkpoint dict of epoch 4."""
    model = _trained_like("small_cnn", seed=0, width=8)
    return export_onnx(_checkpoint(model, "small_cnn", epoch=4, width=8), tmp_path_factory.mktemp("m") / "m.onnx")


def test_metadata(exported):
    path = exported
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    meta = json.loads(props["dask_dl"])
    assert meta["labels"] == LABELS and json.loads(props["labels"]) == LABELS
    assert meta["input_size"] == SIZE and props["input_size"] == str(SIZE)
    assert meta["normalization"] == {"mean": 0.5, "std": 0.25}
    assert meta["task"] == "multilabel" and props["task"] == "multilabel"
    assert meta["activation"] == "sigmoid" and meta["output"] == "probabilities"
    assert meta["channel_layout"] == "NCHW" and meta["in_channels"] == 1
    assert meta["input_range"] == [0.0, 255.0] and meta["normalization_in_graph"] is True
    assert meta["model_name"] == "small_cnn" and meta["model_kwargs"] == {"width": 8} and meta["epoch"] == 4
    info = read_model_info(path)
    assert isinstance(info, ModelInfo)
    assert info.labels == tuple(LABELS) and info.image_shape == (1, SIZE, SIZE)


@pytest.mark.slow
def test_sources_file_directory_run_and_multiclass(tmp_path):
    old, new = _trained_like("small_cnn", seed=1), _trained_like("small_cnn", seed=2)
    ckdir = tmp_path / "checkpoints"
    ckdir.mkdir()
    torch.save(_checkpoint(old, "small_cnn", epoch=1), ckdir / "epoch-0001.pt")
    torch.save(_checkpoint(new, "small_cnn", epoch=3), ckdir / "epoch-0003.pt")
    (ckdir / "notes.txt").write_text("not a checkpoint")
    images = _images(4, seed=3)

    # a directory: its highest epoch, not the newest file nor the first
    path = export_onnx(str(ckdir), tmp_path / "dir.onnx")
    np.testing.assert_allclose(_ort_probs(path, images), _torch_probs(new, images), rtol=0, atol=1e-4)
    assert np.abs(_ort_probs(path, images) - _torch_probs(old, images)).max() > 1e-3
    assert read_model_info(path).epoch == 3

    # a file
    path = export_onnx(ckdir / "epoch-0001.pt", tmp_path / "file.onnx")
    np.testing.assert_allclose(_ort_probs(path, images), _torch_probs(old, images), rtol=0, atol=1e-4)

    # anything with checkpoint(), as a TrainingRun; multiclass -> softmax rows summing to one
    class Run:
        def checkpoint(self):
            return _checkpoint(new, "small_cnn", epoch=3, task="multiclass")

    path = export_onnx(Run(), tmp_path / "run.onnx")
    probs = _ort_probs(path, images)
    np.testing.assert_allclose(probs, _torch_probs(new, images, softmax=True), rtol=0, atol=1e-4)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    assert read_model_info(path).activation == "softmax"


@pytest.mark.slow
def test_module_source_needs_labels_and_size(tmp_path):
    model = _trained_like("small_cnn", seed=4)
    with pytest.raises(ExportError, match="needs labels= and input_size="):
        export_onnx(model, tmp_path / "m.onnx")
    with pytest.raises(ExportError, match=r"returns shape \(2, 3\).*2 labels were given"):
        export_onnx(model, tmp_path / "m.onnx", labels=["a", "b"], input_size=SIZE)
    model.train()
    norm = {"mean": 0.4, "std": 0.3}
    path = export_onnx(model, tmp_path / "m.onnx", labels=LABELS, input_size=48, normalization=norm)
    assert model.training  # the caller's module is left as it was
    info = read_model_info(path)
    assert info.input_size == 48 and info.normalization == {"mean": 0.4, "std": 0.3}
    images = _images(3, size=48)
    model.eval()
    with torch.no_grad():
        want = torch.sigmoid(model(normalize(images, mean=0.4, std=0.3))).numpy()
    np.testing.assert_allclose(_ort_probs(path, images), want, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_existing_path_refused_unless_overwrite(tmp_path):
    target = tmp_path / "m.onnx"
    target.write_bytes(b"keep me")
    ck = _checkpoint(_trained_like("small_cnn", seed=0), "small_cnn")
    with pytest.raises(ExportError, match="exists already; pass overwrite=True"):
        export_onnx(ck, target)
    assert target.read_bytes() == b"keep me"
    export_onnx(ck, target, overwrite=True)
    assert read_model_info(target).labels == tuple(LABELS)


@pytest.mark.slow
def test_parity_failure_reports_largest_difference(tmp_path, monkeypatch):
    import dask_dl.export as export

    real = export._to_onnx
    other = _trained_like("small_cnn", seed=9)

    def export_other_weights(scored, batch, opset):
        # a graph that does not compute what the torch model does
        return real(export._Scored(other, 0.5, 0.25, "sigmoid").eval(), batch, opset)

    monkeypatch.setattr(export, "_to_onnx", export_other_weights)
    ck = _checkpoint(_trained_like("small_cnn", seed=0), "small_cnn")
    with pytest.raises(ExportError, match=r"parity check failed: onnxruntime and torch differ by [0-9.e-]+ \(allowed"):
        export_onnx(ck, tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []  # neither the file nor a temporary is left


def test_bad_sources(tmp_path):
    with pytest.raises(StoreNotFoundError, match="no checkpoint file or directory"):
        export_onnx(tmp_path / "missing.pt", tmp_path / "m.onnx")
    (tmp_path / "junk.pt").write_bytes(b"\x00not a torch file")
    with pytest.raises(ExportError, match="junk.pt"):
        export_onnx(tmp_path / "junk.pt", tmp_path / "m.onnx")
    with pytest.raises(ExportError, match="lacks"):
        export_onnx({"model_name": "small_cnn"}, tmp_path / "m.onnx")
    with pytest.raises(ExportError, match="cannot export a list"):
        export_onnx([1, 2], tmp_path / "m.onnx")
    with pytest.raises(ExportError, match="task 'regression'"):
        ck = _checkpoint(_trained_like("small_cnn", seed=0), "small_cnn")
        export_onnx(ck, tmp_path / "m.onnx", task="regression")


def test_read_model_info_errors(tmp_path, exported):
    with pytest.raises(StoreNotFoundError, match="no ONNX model file"):
        read_model_info(tmp_path / "nothing.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_text("this is a text file, not a model\n" * 20)
    with pytest.raises(ExportError, match="is not an ONNX model"):
        read_model_info(junk)
    # a valid ONNX model without dask_dl metadata
    path = exported
    proto = onnx.load(str(path))
    del proto.metadata_props[:]
    bare = tmp_path / "bare.onnx"
    onnx.save(proto, str(bare))
    with pytest.raises(ExportError, match="no dask_dl metadata.*pass input_size= and labels="):
        read_model_info(bare)
    info = read_model_info(bare, input_size=SIZE, labels=LABELS)
    assert info.labels == tuple(LABELS) and info.image_shape == (1, SIZE, SIZE)
    assert not info.normalization_in_graph and info.input_dtype == "float32"
    with pytest.raises(ExportError, match="takes 64 px images, not input_size=32"):
        read_model_info(path, input_size=32)
