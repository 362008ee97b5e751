"""What an explanation is computed from, and one cached copy of it per worker process.

:func:`resolve` turns what the user passes (a :class:`~dask_dl.TrainingRun`, a checkpoint dict, file or directory,
a ``torch.nn.Module``, or an ONNX file) into a small :class:`ModelSpec` plus, for torch models, the pickled module
as bytes. The bytes enter the task graph once (one key, as a Dask delayed value), so each worker receives them
once; :func:`get_model` builds the module from them on first use and keeps it for every later chunk, as
:func:`dask_dl.inference.get_session` keeps onnxruntime sessions. ONNX models use those very sessions.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from dask_dl.errors import ConfigurationError, ExportError

__all__ = ["ModelSpec", "get_model", "resolve"]


@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs besides the weights: labels, input, preprocessing, and where to look.

    ``kind`` is ``"torch"`` (``token`` is the hash of the pickled module, ``layer`` the name of the Grad-CAM
    layer) or ``"onnx"`` (``path`` and ``stamp`` as :func:`dask_dl.inference.predict` checks them).
    """

    kind: str
    token: str
    labels: tuple[str, ...]
    input_size: int | None
    in_channels: int = 1
    normalization: dict[str, float] | None = None
    activation: str = "sigmoid"
    layer: str | None = None
    path: str | None = None
    stamp: tuple[int, int] | None = None
    onnx: dict[str, Any] = field(default_factory=dict)
    modules: tuple[str, ...] = ()  # what a worker imports to unpickle the torch module (its class's module)

    @property
    def name(self) -> str:
        return os.path.basename(self.path) if self.path else f"torch model {self.token[:12]}"


def _is_onnx_path(source: Any) -> bool:
    return isinstance(source, str | os.PathLike) and os.fspath(source).lower().endswith(".onnx")


def resolve(
    source: Any, *, labels: list[str] | None, input_size: int | None, layer: Any, gradcam: bool = True
) -> tuple[ModelSpec, bytes | None]:
    """The spec of ``source`` and, for torch models, the pickled module (CPU, eval mode)."""
    if _is_onnx_path(source):
        return _resolve_onnx(source, labels=labels, input_size=input_size), None
    import cloudpickle
    from torch import nn

    from dask_dl.export import _resolve
    from dask_dl.models.source import model_source
    from dask_dl.normalize import DEFAULT_NORMALIZATION
    from dask_dl.onnx_info import ACTIVATIONS

    net, meta = _resolve(source)
    if isinstance(source, nn.Module):
        if labels is None:
            raise ConfigurationError(
                "a torch.nn.Module does not name its outputs: pass labels=[...] naming them, in order, e.g. "
                "explain(ds, model, labels=['Effusion', 'Mass'])"
            )
        meta["labels"], meta["input_size"], meta["task"] = list(labels), input_size, "multilabel"
    net = net.cpu().eval()
    payload = cloudpickle.dumps(net)
    spec = ModelSpec(
        kind="torch",
        token=hashlib.sha256(payload).hexdigest(),
        labels=tuple(str(label) for label in meta["labels"]),
        input_size=meta.get("input_size"),
        in_channels=int(meta.get("in_channels", 1)),
        normalization=dict(meta.get("normalization") or DEFAULT_NORMALIZATION),
        activation=ACTIVATIONS.get(meta.get("task", "multilabel"), "sigmoid"),
        layer=_layer_name(net, layer, meta.get("input_size"), int(meta.get("in_channels", 1))) if gradcam else None,
        modules=model_source(net).modules(),
    )
    return spec, payload


def _resolve_onnx(source: Any, *, labels: list[str] | None, input_size: int | None) -> ModelSpec:
    from dask_dl.cluster.storage import absolute
    from dask_dl.inference import _stamp
    from dask_dl.onnx_info import read_model_info

    path = absolute(source)  # a local file, or a URL the workers fetch as predict's do
    try:
        info = read_model_info(path)
    except ExportError:  # no dask_dl metadata: then labels= names all its outputs and input_size= its input
        if labels is None or input_size is None:
            raise
        info = read_model_info(path, input_size=input_size, labels=list(labels))
    return ModelSpec(
        kind="onnx",
        token=path,
        labels=info.labels,
        input_size=info.input_size,
        in_channels=info.in_channels,
        normalization=None if info.normalization_in_graph else info.normalization,
        activation=info.activation,
        path=path,
        stamp=_stamp(path),
        onnx={
            "input_name": info.input_name,
            "output_name": info.output_name,
            "input_rank": info.input_rank,
            "input_dtype": info.input_dtype,
        },
    )


#: Grad-CAM's map must have at least this many cells a side to point anywhere in particular
MIN_CELLS = 7


def _layer_name(net: Any, layer: Any, input_size: int | None, in_channels: int) -> str:
    """The name of the Grad-CAM layer: ``layer`` (a name or a submodule), or found by :func:`_auto_layer`."""
    from torch import nn

    modules = dict(net.named_modules())
    if layer is None:
        return _auto_layer(net, input_size or 64, in_channels)
    if isinstance(layer, nn.Module):
        for name, module in modules.items():
            if module is layer:
                return name
        raise ConfigurationError(f"layer {type(layer).__name__} is not a submodule of {type(net).__name__}")
    if isinstance(layer, str) and layer in modules and layer:
        return layer
    convs = [name for name, m in modules.items() if isinstance(m, nn.Conv2d)]
    raise ConfigurationError(
        f"layer {layer!r} is not a module of {type(net).__name__}; its convolutions are {convs[-6:]} "
        "(pass layer='<name>' as net.named_modules() spells it)"
    )


def _auto_layer(net: Any, size: int, in_channels: int) -> str:
    """The last activation map of at least :data:`MIN_CELLS` cells a side after the first convolution.

    Of the modules giving maps at that last fine resolution, the outermost one that finishes last is taken.
    A forward pass of one blank image records every module's output in the order they finish (a stage after the
    blocks inside it); modules that run twice (a ReLU a residual block reuses) are skipped, since a hook on them
    would see two maps. This is the last stage of the registry's models at 224 px (``layer4`` of the ResNets,
    ``features`` of DenseNet and small_cnn) and, at the 64 px of tests and demos, the stage before the last:
    at 4 x 4 cells a map points only at a quadrant.
    """
    import torch
    from torch import nn

    calls: dict[str, int] = {}
    seen: list[tuple[str, tuple[int, ...]]] = []
    convs = [name for name, m in net.named_modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        raise ConfigurationError(
            f"{type(net).__name__} has no Conv2d layer to take Grad-CAM at; pass layer='<module name>' or "
            "method='occlusion'"
        )
    hooks = []
    for name, module in net.named_modules():
        if name:

            def hook(module, args, output, name=name):
                calls[name] = calls.get(name, 0) + 1
                if isinstance(output, torch.Tensor):
                    seen.append((name, tuple(output.shape)))

            hooks.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            net(torch.zeros(1, in_channels, size, size))
    finally:
        for handle in hooks:
            handle.remove()
    first = next((i for i, (name, _) in enumerate(seen) if name in convs), 0)
    maps = [(name, shape) for name, shape in seen[first:] if len(shape) == 4 and calls[name] == 1]
    fine = [(name, min(shape[-2:])) for name, shape in maps if min(shape[-2:]) >= MIN_CELLS]
    if not fine:
        return maps[-1][0] if maps else convs[-1]
    # of the maps at the last fine resolution, the outermost (a whole stage rather than a layer inside a block)
    last = [name for name, cells in fine if cells == fine[-1][1]]
    depth = min(name.count(".") for name in last)
    return [name for name in last if name.count(".") == depth][-1]


# ---- one model per worker process --------------------------------------------------------------------------


@dataclass
class _Loaded:
    net: Any
    device: Any
    lock: threading.Lock  # Grad-CAM hooks the module: two threads of one worker must take turns


_MODELS: dict[tuple[str, str], _Loaded] = {}
_MODELS_LOCK = threading.Lock()
_KEEP = 2  # models kept per process (an explanation and the one before it)
#: models this process has built; tests read it on each worker with ``client.run``
MODELS_BUILT = 0


def _device(wanted: str | None):
    import torch

    if wanted is not None:
        return torch.device(wanted)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def get_model(spec: ModelSpec, payload: bytes, device: str | None = None) -> _Loaded:
    """This process's copy of the torch model of ``spec``, built from ``payload`` on first use."""
    global MODELS_BUILT
    import cloudpickle

    where = _device(device)
    key = (spec.token, str(where))
    with _MODELS_LOCK:
        loaded = _MODELS.get(key)
        if loaded is None:
            if hashlib.sha256(payload).hexdigest() != spec.token:
                raise ExportError("the model bytes this worker received do not match their hash; explain again")
            net = cloudpickle.loads(payload).to(where).eval()
            for old in list(_MODELS)[: max(0, len(_MODELS) - _KEEP + 1)]:
                del _MODELS[old]
            loaded = _MODELS[key] = _Loaded(net, where, threading.Lock())
            MODELS_BUILT += 1
        return loaded
