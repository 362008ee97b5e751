"""ONNX export of trained models, with everything a reader needs in the file itself.

The exported graph takes ``image``: float32 pixels 0-255, shape ``(batch, in_channels, S, S)`` with a dynamic
batch axis, and returns ``probabilities``: float32 ``(batch, n_labels)``. Normalization (``(x / 255 - mean) / std``)
and the output activation (sigmoid for multilabel, softmax for multiclass) are inside the graph, so
:func:`dask_dl.predict` or any onnxruntime user needs nothing but the file: uint8 images only need a cast. Label
names, input size, channel layout, normalization, task and output kind are in the model's ``metadata_props``:
the key ``dask_dl`` holds them all as JSON (read back by :func:`read_model_info`), and the flat keys ``labels``,
``input_size``, ``normalization``, ``task`` and ``output`` repeat them for other tools.

torch's dynamo-based exporter (``torch.onnx.export(..., dynamo=True)``, onnxscript) is used: it exports all five
registry models, while the legacy TorchScript exporter refuses AlexNet's adaptive pooling to 6x6 at sizes that
are not multiples of 6.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import pickle
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from dask_dl._version import __version__
from dask_dl.errors import ConfigurationError, ExportError, StoreNotFoundError, TrainingError
from dask_dl.models.source import build_from_checkpoint
from dask_dl.normalize import DEFAULT_NORMALIZATION, check_normalization, scale
from dask_dl.onnx_info import ACTIVATIONS, INPUT_NAME, OUTPUT_NAME, ModelInfo, read_model_info

__all__ = ["INPUT_NAME", "OUTPUT_NAME", "ModelInfo", "export_onnx", "read_model_info"]

#: largest absolute difference of probabilities between torch and onnxruntime that passes the parity check
PARITY_ATOL = 1e-4
_NEEDED_KEYS = ("model_name", "model_kwargs", "model", "labels", "task", "input_size")


class _Scored(nn.Module):
    """The network between pixels 0-255 and probabilities: what the ONNX graph holds."""

    def __init__(self, net: nn.Module, mean: Any, std: Any, activation: str) -> None:
        super().__init__()
        self.net = net
        self.activation = activation
        # numbers stay numbers (the graph of a grey model is what it always was); per-channel values are constants
        # of shape (C, 1, 1) that broadcast over (batch, C, S, S)
        for name, value in (("mean", mean), ("std", std)):
            if isinstance(value, list | tuple):
                self.register_buffer(name, torch.tensor(value, dtype=torch.float32).view(-1, 1, 1), persistent=False)
            else:
                setattr(self, name, float(value))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        # dask_dl.normalize's arithmetic, the loader's too: the graph sees what training saw
        logits = self.net(scale(image, self.mean, self.std))
        return torch.sigmoid(logits) if self.activation == "sigmoid" else torch.softmax(logits, dim=1)


# ---- reading sources ---------------------------------------------------------------------------------------


def _load_checkpoint_file(source: str | os.PathLike) -> dict[str, Any]:
    import fsspec

    from dask_dl.checkpoint import load_checkpoint
    from dask_dl.errors import TrainingError

    fs, fpath = fsspec.core.url_to_fs(os.fspath(source))
    if not fs.exists(fpath):
        raise StoreNotFoundError(f"no checkpoint file or directory at {os.fspath(source)!r}")
    try:
        return load_checkpoint(source)
    except TrainingError as exc:
        raise ExportError(f"cannot export {os.fspath(source)!r}: {exc}") from exc
    except (pickle.UnpicklingError, EOFError, RuntimeError) as exc:
        raise ExportError(
            f"{os.fspath(source)!r} is not a checkpoint torch.load(weights_only=True) can read "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); pass a file written by "
            "dask_dl.fit (epoch-NNNN.pt) or its checkpoint directory"
        ) from exc


def _from_checkpoint(ck: dict[str, Any], model: Any = None) -> tuple[nn.Module, dict[str, Any]]:
    missing = [k for k in _NEEDED_KEYS if k not in ck]
    if missing:
        raise ExportError(
            f"the checkpoint lacks {missing}; a dask_dl checkpoint has {list(_NEEDED_KEYS)} among its keys "
            f"(it has {sorted(ck)})"
        )
    labels = list(ck["labels"])
    in_channels = int(ck.get("in_channels", 1))
    try:
        net = build_from_checkpoint(ck, model=model)
    except TrainingError as exc:  # a user's model that only the user's code can rebuild
        raise ExportError(str(exc)) from None
    # DDP wraps the module as `module`; the contract says it is stripped, but tolerate checkpoints that did not
    state = {k.removeprefix("module."): v for k, v in ck["model"].items()}
    try:
        net.load_state_dict(state)
    except RuntimeError as exc:
        raise ExportError(f"the checkpoint's weights do not fit model {ck['model_name']!r}: {exc}") from exc
    meta = {
        "labels": labels,
        "input_size": int(ck["input_size"]),
        "in_channels": in_channels,
        "normalization": dict(ck.get("normalization") or DEFAULT_NORMALIZATION),
        "task": ck["task"],
        "model_name": ck["model_name"],
        "model_kwargs": dict(ck["model_kwargs"]),
        "epoch": int(ck["epoch"]) if "epoch" in ck else None,
    }
    return net, meta


def _first_in_channels(net: nn.Module) -> int:
    """Input channels of a module's first convolution (1 when it has none: a grey model, as dask_dl trains)."""
    for module in net.modules():
        if isinstance(module, nn.Conv2d | nn.Conv1d | nn.Conv3d):
            return int(module.in_channels)
    return 1


def _resolve(source: Any, model: Any = None) -> tuple[nn.Module, dict[str, Any]]:
    if isinstance(source, nn.Module):
        if any(p.device.type != "cpu" for p in source.parameters()):
            source = copy.deepcopy(source).cpu()  # export and check on the CPU; leave the caller's model where it is
        return source, {
            "in_channels": _first_in_channels(source),
            "model_name": type(source).__name__,
            "model_kwargs": {},
        }
    if isinstance(source, dict):
        return _from_checkpoint(source, model)
    if isinstance(source, str | os.PathLike):
        return _from_checkpoint(_load_checkpoint_file(os.fspath(source)), model)
    if callable(getattr(source, "checkpoint", None)):
        spec_model = getattr(getattr(source, "spec", None), "model_source", None)
        if model is None and spec_model is not None and spec_model.kind in ("module", "factory"):
            model = spec_model.target  # a run of this process knows its user's model
        return _from_checkpoint(source.checkpoint(), model)
    raise ExportError(
        f"cannot export a {type(source).__name__}; pass a TrainingRun, a checkpoint dict, a checkpoint file or "
        "directory, or a torch.nn.Module (with labels= and input_size=)"
    )


# ---- export ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_exporter():
    """Silence the exporter's chatter (torchvision ops it skips, deprecations inside torch)."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.onnx._internal.exporter._registration")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(None):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _example_batch(info: ModelInfo, example: Any, n: int = 3) -> torch.Tensor:
    if example is None:
        # noise and smooth images: parity must hold for both; seeded, so an export is reproducible
        rng = np.random.default_rng(0)
        s = info.input_size
        noise = rng.integers(0, 256, (n - 1, info.in_channels, s, s))
        ramp = np.add.outer(np.arange(s), np.arange(s)) * (255.0 / max(1, 2 * s - 2))
        batch = np.concatenate([noise, np.broadcast_to(ramp, (1, info.in_channels, s, s))])
        return torch.from_numpy(batch.astype(np.float32))
    batch = torch.as_tensor(np.asarray(example)).to(torch.float32)
    if batch.ndim == 3:
        batch = batch.unsqueeze(1)
    elif batch.ndim == 4 and batch.shape[-1] == info.in_channels != batch.shape[1]:
        batch = batch.permute(0, 3, 1, 2)  # channel-last, as a colour store holds images
    if tuple(batch.shape[1:]) != info.image_shape:
        raise ExportError(
            f"the example batch has images of shape {tuple(batch.shape[1:])}; the model takes {info.image_shape} "
            "(channels, y, x), pixels 0-255"
        )
    return batch


def _check_parity(path: Path, scored: nn.Module, batch: torch.Tensor) -> float:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run([OUTPUT_NAME], {INPUT_NAME: batch.numpy()})[0]
    with torch.no_grad():
        want = scored(batch).numpy()
    if got.shape != want.shape:
        raise ExportError(f"onnxruntime returned shape {got.shape}, torch {want.shape}: the export is broken")
    diff = np.abs(got.astype(np.float64) - want)
    worst = float(np.nan_to_num(diff, nan=np.inf).max())
    if not worst <= PARITY_ATOL:
        i, j = np.unravel_index(np.nan_to_num(diff, nan=np.inf).argmax(), diff.shape)
        raise ExportError(
            f"parity check failed: onnxruntime and torch differ by {worst:.3g} (allowed {PARITY_ATOL:g}) on "
            f"image {i}, output {j} (onnxruntime {got[i, j]:.6g}, torch {want[i, j]:.6g}); try another opset=, "
            "or export with check=False to inspect the file"
        )
    return worst


def export_onnx(
    source: Any,
    path: str | os.PathLike,
    *,
    labels: list[str] | None = None,
    input_size: int | None = None,
    normalization: dict[str, float] | None = None,
    task: str | None = None,
    opset: int | None = None,
    overwrite: bool = False,
    check: bool = True,
    example: Any = None,
    model: Any = None,
    register: str | None = None,
) -> Path | str:
    """Write a trained model as ONNX, with its labels and preprocessing, and check it against torch.

    Parameters
    ----------
    source
        A :class:`~dask_dl.TrainingRun` (anything with a ``checkpoint()`` method), a checkpoint dict, a checkpoint
        file, a checkpoint directory (its highest ``epoch-NNNN.pt``), or a ``torch.nn.Module`` returning logits
        (then ``labels`` and ``input_size`` are required).
    path
        The ``.onnx`` file to write (atomically: a reader never sees half a file); a local path or an fsspec URL
        (``s3://...``: written and checked locally, then uploaded whole).
    labels, input_size, normalization, task
        Override what the checkpoint says. ``normalization`` defaults to
        :data:`dask_dl.normalize.DEFAULT_NORMALIZATION`, ``task`` to ``"multilabel"``.
    opset
        ONNX opset; default the exporter's.
    overwrite
        Replace an existing file.
    check
        Run onnxruntime on a batch and compare with torch (probabilities within 1e-4).
    example
        Images (pixels 0-255, ``(B, S, S)``, ``(B, C, S, S)`` or a colour store's ``(B, S, S, C)``) for the parity
        check, e.g. a batch of the dataset; default three seeded images (noise and a ramp).
    model
        The architecture for a checkpoint of a user's model that cannot be rebuilt from what it records (a
        ``torch.nn.Module`` passed to ``fit`` by value, or a factory without an import path): the module, or the
        function that builds it. Its weights are replaced by the checkpoint's.
    register
        For a run tracked in MLflow (``fit(..., tracking=...)``): a model registry name. The ONNX file becomes
        a new version of it, tagged with its labels, normalization, input size and task. Without it, a tracked
        run's export still uploads the file to the run (under ``onnx/``).

    Returns
    -------
    pathlib.Path or str
        The file written (the URL, for object storage).

    Raises
    ------
    ExportError
        ``path`` exists and ``overwrite`` is False; the source lacks what is needed; the parity check fails.
    ConfigurationError
        ``register`` for a source that is not a tracked run.
    dask_dl.tracking.TrackingError
        The tracking server did not register the model.
    StoreNotFoundError
        A checkpoint path that does not exist.

    Examples
    --------
    From a checkpoint of yours (not run as a doctest: it needs the checkpoint):

    >>> path = export_onnx("checkpoints/", "cxr.onnx")  # doctest: +SKIP
    >>> read_model_info(path).labels[:2]  # doctest: +SKIP
    ('Atelectasis', 'Cardiomegaly')
    """
    from dask_dl.cluster.storage import exists, is_url, publish

    if register is not None and getattr(source, "tracker", None) is None:
        raise ConfigurationError(
            f"register={register!r} puts the model into the MLflow registry of the run it was trained in, and this "
            f"{type(source).__name__} was not tracked; train with fit(..., tracking='http://127.0.0.1:5000') (or "
            "set dask-dl.tracking.uri), then export_onnx(run, path, register=...)"
        )
    if exists(path) and not overwrite:
        raise ExportError(f"{os.fspath(path)!r} exists already; pass overwrite=True (CLI: --overwrite) to replace it")
    if is_url(path):  # object storage: write and check a local file, then upload it whole
        with tempfile.TemporaryDirectory(prefix="dask-dl-export-") as tmp:
            local = export_onnx(
                source,
                Path(tmp) / os.path.basename(os.fspath(path)),
                labels=labels,
                input_size=input_size,
                normalization=normalization,
                task=task,
                opset=opset,
                check=check,
                example=example,
                model=model,
                register=register,
            )
            publish(local, os.fspath(path))
        return os.fspath(path)
    path = Path(path)
    net, meta = _resolve(source, model)
    for key, value in (("labels", labels), ("input_size", input_size), ("normalization", normalization)):
        if value is not None:
            meta[key] = value
    if task is not None or "task" not in meta:
        meta["task"] = task or "multilabel"
    info = _info(meta)
    scored = _Scored(net, info.normalization["mean"], info.normalization["std"], info.activation)
    batch = _example_batch(info, example)
    was_training = net.training
    net.eval()  # BatchNorm statistics and no dropout, in the export and in the parity check alike
    try:
        _check_outputs(scored, batch, info)
        model = _to_onnx(scored, batch[:2], opset)
        _annotate(model, info)
        onnx.checker.check_model(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            onnx.save_model(model, temporary)
            if check:
                _check_parity(temporary, scored, batch)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    finally:
        net.train(was_training)
    if getattr(source, "tracker", None) is not None:
        from dask_dl.tracking.runs import track_export

        track_export(source, path, info, register)
    return path


def _check_outputs(scored: nn.Module, batch: torch.Tensor, info: ModelInfo) -> None:
    with torch.no_grad():
        try:
            out = scored(batch[:2])
        except RuntimeError as exc:
            raise ExportError(f"the model fails on input of shape {tuple(batch[:2].shape)}: {exc}") from exc
    if out.ndim != 2 or out.shape[1] != len(info.labels):
        raise ExportError(
            f"the model returns shape {tuple(out.shape)} for 2 images, but {len(info.labels)} labels were given: "
            f"{list(info.labels)}; it must return (batch, n_labels) logits"
        )


def _info(meta: dict[str, Any]) -> ModelInfo:
    if meta.get("labels") is None or meta.get("input_size") is None:
        raise ExportError(
            "exporting a torch.nn.Module needs labels= and input_size=, e.g. "
            "export_onnx(model, 'model.onnx', labels=['Atelectasis', ...], input_size=224)"
        )
    task = meta["task"]
    if task not in ACTIVATIONS:
        raise ExportError(f"task {task!r} is not one of {list(ACTIVATIONS)}")
    size = meta["input_size"]
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 32:
        raise ExportError(f"input_size must be an integer of at least 32; got {size!r}")
    try:
        norm = check_normalization(meta.get("normalization"), channels=int(meta.get("in_channels", 1)))
    except ConfigurationError as exc:
        raise ExportError(str(exc)) from None
    return ModelInfo(
        labels=tuple(str(label) for label in meta["labels"]),
        input_size=int(size),
        in_channels=int(meta.get("in_channels", 1)),
        normalization=norm,
        task=task,
        activation=ACTIVATIONS[task],
        model_name=meta.get("model_name"),
        model_kwargs=meta.get("model_kwargs") or {},
        epoch=meta.get("epoch"),
    )


def _to_onnx(scored: nn.Module, batch: torch.Tensor, opset: int | None) -> onnx.ModelProto:
    with _quiet_exporter():
        try:
            program = torch.onnx.export(
                scored,
                (batch,),
                dynamo=True,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_shapes={"image": {0: torch.export.Dim("batch", min=1)}},
                opset_version=opset,
                verbose=False,
            )
        except Exception as exc:  # the exporter raises many types; all mean the same to the user
            raise ExportError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}") from exc
    return program.model_proto


def _annotate(model: onnx.ModelProto, info: ModelInfo) -> None:
    props = {
        "dask_dl": json.dumps({**info.to_dict(), "dask_dl_version": __version__}),
        "labels": json.dumps(list(info.labels)),
        "input_size": str(info.input_size),
        "normalization": json.dumps(info.normalization),
        "task": info.task,
        "output": f"{info.output} ({info.activation})",
    }
    del model.metadata_props[:]
    for key, value in props.items():
        model.metadata_props.add(key=key, value=value)
    model.doc_string = (
        f"dask_dl {info.model_name or 'model'}: input '{INPUT_NAME}' float32 pixels 0-255 "
        f"(batch, {info.in_channels}, {info.input_size}, {info.input_size}); output '{OUTPUT_NAME}' "
        f"{info.activation} probabilities of {len(info.labels)} labels"
    )
