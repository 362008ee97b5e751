"""What an ONNX model takes and returns, read without torch: :class:`ModelInfo` and :func:`read_model_info`.

Scoring (``dask_dl.predict``, ``dask-dl predict``) needs only these and onnxruntime: keeping them apart from
:mod:`dask_dl.export`, which builds models with torch, spares every scoring process torch's import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from dask_dl.errors import ExportError, StoreNotFoundError
from dask_dl.normalize import DEFAULT_NORMALIZATION, check_normalization

__all__ = ["INPUT_NAME", "OUTPUT_NAME", "ModelInfo", "load_onnx", "read_model_info"]

INPUT_NAME = "image"
OUTPUT_NAME = "probabilities"
FORMAT = 1
ACTIVATIONS = {"multilabel": "sigmoid", "multiclass": "softmax"}  # of the exported graph, per task


@dataclass(frozen=True)
class ModelInfo:
    """What an ONNX model takes and returns: the ``dask_dl`` entry of its metadata.

    ``normalization_in_graph`` is False only for models dask_dl did not export (described by the caller); their
    ``normalization`` is then applied outside the graph, if any.
    """

    labels: tuple[str, ...]
    input_size: int
    in_channels: int = 1
    normalization: dict[str, Any] | None = field(default_factory=lambda: dict(DEFAULT_NORMALIZATION))
    task: str = "multilabel"
    activation: str = "sigmoid"
    output: str = "probabilities"
    channel_layout: str = "NCHW"
    input_name: str = INPUT_NAME
    output_name: str = OUTPUT_NAME
    input_rank: int = 4
    input_dtype: str = "float32"
    input_range: tuple[float, float] = (0.0, 255.0)
    normalization_in_graph: bool = True
    model_name: str | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    epoch: int | None = None
    format: int = FORMAT

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["labels"] = list(self.labels)
        out["input_range"] = list(self.input_range)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelInfo:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known["labels"] = tuple(known["labels"])
        if "input_range" in known:
            known["input_range"] = tuple(known["input_range"])
        return cls(**known)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(channels, y, x)`` of one input image."""
        return (self.in_channels, self.input_size, self.input_size)


# ---- reading models ----------------------------------------------------------------------------------------


def load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    """Read an ONNX file (weights not loaded from external files), or raise a clear error."""
    from dask_dl.cluster.storage import exists, fetch, is_url

    if is_url(path):  # onnx reads local files: a model on object storage is fetched into a local cache
        if not exists(path):
            raise StoreNotFoundError(f"no ONNX model file at {os.fspath(path)!r}")
        path = fetch(path)
    path = Path(path)
    if not path.is_file():
        raise StoreNotFoundError(f"no ONNX model file at {str(path)!r}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ExportError(f"{str(path)!r} is not an ONNX model: {type(exc).__name__}: {exc}") from exc
    # protobuf parses some arbitrary bytes without error: a real model has an IR version and a graph
    if model.ir_version < 1 or not model.graph.input or not model.graph.output:
        raise ExportError(f"{str(path)!r} is not an ONNX model: it has no IR version or no graph inputs/outputs")
    _check_operators(str(path), model)
    _check_external_data(path, model)
    return model


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of ``graph`` that may keep its data in a file: initializers and attributes, subgraphs too."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attribute in node.attribute:
            yield from (attribute.t, *attribute.tensors)
            for subgraph in (attribute.g, *attribute.graphs):
                yield from _tensors(subgraph)


def _check_external_data(path: Path, model: onnx.ModelProto) -> None:
    """Refuse external data outside the model's folder, or missing, before onnxruntime meets it on a worker.

    onnxruntime reads external data only from the model's folder and below (a model must not make a scoring
    process read ``../secret.bin`` or ``/etc/shadow``), and it finds out only when a worker opens its session.
    """
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    folder = path.parent
    for tensor in _tensors(model.graph):
        if not uses_external_data(tensor):
            continue
        location = ExternalDataInfo(tensor).location
        where = f"{str(path)!r}: the weights of {tensor.name!r} are in the external data file {location!r}"
        fix = (
            "keep external data files beside the model, inside its folder (onnx.save_model(model, path, "
            "save_as_external_data=True, location='model.onnx.data') writes them there), or embed the weights"
        )
        normal = os.path.normpath(location)
        if os.path.isabs(location) or normal == os.pardir or normal.startswith(os.pardir + os.sep):
            raise ExportError(f"{where}, outside the model's folder {str(folder)!r}, which onnxruntime refuses; {fix}")
        if not (folder / normal).is_file():
            raise ExportError(f"{where}, which is not in the model's folder {str(folder)!r}; {fix}")


# operator domains onnxruntime implements beyond the ONNX standard ones
_RUNTIME_DOMAINS = ("com.microsoft", "com.microsoft.nchwc", "com.ms.internal.nhwc")


def _check_operators(name: str, model: onnx.ModelProto) -> None:
    """Refuse a model using an operator neither ONNX, onnxruntime nor the model's own functions define."""
    local = {(f.domain, f.name) for f in model.functions}
    unknown = sorted(
        {
            f"{node.domain or 'ai.onnx'}::{node.op_type}"
            for node in model.graph.node
            if (node.domain, node.op_type) not in local
            and node.domain not in _RUNTIME_DOMAINS
            and not onnx.defs.has(node.op_type, node.domain)
        }
    )
    if unknown:
        raise ExportError(
            f"{name!r} uses operators no ONNX runtime here knows: {unknown}; export the model with standard ONNX "
            "operators (dask_dl.export_onnx does) or register the custom operators' library"
        )


def _graph_input_dims(model: onnx.ModelProto) -> list[int | None]:
    shape = model.graph.input[0].type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in shape.dim]


def _metadata_info(name: str, model: onnx.ModelProto, raw: str) -> ModelInfo:
    """Parse and check the ``dask_dl`` metadata entry against the model's graph."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ExportError(
            f"{name!r} has a 'dask_dl' metadata entry that is not JSON ({exc}); the file was altered after "
            "dask_dl.export_onnx wrote it: export the checkpoint again"
        ) from None
    if not isinstance(data, dict):
        raise ExportError(f"{name!r} has a 'dask_dl' metadata entry that is a {type(data).__name__}, not a JSON object")
    missing = [k for k in ("labels", "input_size") if k not in data]
    if missing:
        raise ExportError(
            f"{name!r} has dask_dl metadata without {missing}; it cannot be scored safely: export the checkpoint "
            "again with dask_dl.export_onnx"
        )
    labels, size = data["labels"], data["input_size"]
    if not isinstance(labels, list) or not labels or not all(isinstance(v, str) for v in labels):
        raise ExportError(f"{name!r}: metadata labels must be a non-empty list of strings; found {labels!r}")
    channels = data.get("in_channels", 1)
    for key, value in (("input_size", size), ("in_channels", channels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ExportError(f"{name!r}: metadata {key} must be a positive integer; found {value!r}")
    try:
        info = ModelInfo.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{name!r} has dask_dl metadata ModelInfo cannot read: {exc}") from None
    graph_in, graph_out = model.graph.input[0], model.graph.output[0]
    if (graph_in.name, graph_out.name) != (info.input_name, info.output_name):
        raise ExportError(
            f"{name!r}: metadata names input {info.input_name!r} and output {info.output_name!r}, but the graph has "
            f"{graph_in.name!r} and {graph_out.name!r}"
        )
    dims = _graph_input_dims(model)
    expected = [None, info.in_channels, info.input_size, info.input_size][-len(dims) :] if len(dims) in (3, 4) else None
    if expected is None or any(d is not None and d != e for d, e in zip(dims[1:], expected[1:], strict=True)):
        raise ExportError(
            f"{name!r}: metadata says images of {info.in_channels} x {info.input_size} x {info.input_size}, but the "
            f"graph input {graph_in.name!r} has shape {['?' if d is None else d for d in dims]}; the metadata does "
            "not describe this model: export it again"
        )
    out_shape = graph_out.type.tensor_type.shape.dim
    if len(out_shape) == 2 and out_shape[1].HasField("dim_value") and out_shape[1].dim_value not in (0, len(labels)):
        raise ExportError(
            f"{name!r}: metadata lists {len(labels)} labels, but the graph outputs {out_shape[1].dim_value} values "
            "per image"
        )
    return info


def read_model_info(
    path: str | os.PathLike,
    *,
    input_size: int | None = None,
    labels: list[str] | None = None,
    normalization: dict[str, float] | None = None,
) -> ModelInfo:
    """Read what an ONNX model takes and returns from its ``dask_dl`` metadata.

    Parameters
    ----------
    path
        An ONNX file.
    input_size, labels
        Describe a model without dask_dl metadata (both required then; its input is fed pixels 0-255 in its
        input's element type). For a dask_dl model they must agree with the metadata.
    normalization
        ``{"mean": m, "std": s}`` to apply before a model without dask_dl metadata (default: none, raw pixels).
        A dask_dl model normalizes inside its graph and refuses this.

    Raises
    ------
    ExportError
        Not an ONNX file; an operator no runtime knows; external data outside the model's folder (or missing);
        no dask_dl metadata and no ``input_size``/``labels``;
        dask_dl metadata that is not JSON, lacks ``labels`` or ``input_size``, or disagrees with the graph's input
        and output shapes; disagreement between the arguments and the metadata.
    StoreNotFoundError
        No file at ``path``.
    """
    model = load_onnx(path)
    props = {p.key: p.value for p in model.metadata_props}
    if "dask_dl" in props:
        info = _metadata_info(str(path), model, props["dask_dl"])
        if input_size is not None and int(input_size) != info.input_size:
            raise ExportError(f"{str(path)!r} takes {info.input_size} px images, not input_size={input_size}")
        if labels is not None and list(labels) != list(info.labels):
            raise ExportError(f"{str(path)!r} predicts {list(info.labels)}, not labels={list(labels)}")
        if normalization is not None:
            raise ExportError(
                f"{str(path)!r} normalizes inside its graph with {info.normalization}; do not pass normalization="
            )
        return info
    if input_size is None or labels is None:
        raise ExportError(
            f"{str(path)!r} has no dask_dl metadata (it was not written by dask_dl.export_onnx), so its input size "
            "and labels are unknown; pass input_size= and labels= (CLI: export it with dask-dl export)"
        )
    graph_input = model.graph.input[0]
    elem = graph_input.type.tensor_type.elem_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in graph_input.type.tensor_type.shape.dim]
    if len(dims) not in (3, 4):
        raise ExportError(
            f"{str(path)!r} takes input {graph_input.name!r} of rank {len(dims)}; image models take "
            "(batch, y, x) or (batch, channels, y, x)"
        )
    if normalization is not None:
        normalization = check_normalization(normalization)
    return ModelInfo(
        labels=tuple(str(label) for label in labels),
        input_size=int(input_size),
        in_channels=int(dims[1] or 1) if len(dims) == 4 else 1,
        normalization=dict(normalization) if normalization is not None else None,
        task="unknown",
        activation="unknown",
        output="unknown",
        input_name=graph_input.name,
        output_name=model.graph.output[0].name,
        input_rank=len(dims),
        input_dtype=str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))),
        normalization_in_graph=False,
    )
