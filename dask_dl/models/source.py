"""What a trained model is and how to build it again: a registry name, a torchvision or timm name, a module, a factory.

``fit(model=...)`` takes any of these; :func:`model_source` turns it into one :class:`ModelSource` on the driver.
The trainers call :meth:`ModelSource.build`; the checkpoint stores :meth:`ModelSource.to_dict` (plain data), from
which :func:`build_from_checkpoint` makes the model again for ``run.model()``, ``export_onnx`` and resuming.

=============  ===========================================  ========================================================
kind           ``model=``                                   rebuilt from a checkpoint by
=============  ===========================================  ========================================================
``registry``   ``"small_cnn"`` (:func:`dask_dl.list_models`)  the name and ``model_kwargs``
``torchvision`` ``"torchvision:resnet50"``                   the name (``weights=None``: nothing downloads)
``timm``       ``"timm:convnext_tiny"``                     the name (``pretrained=False``)
``factory``    a callable returning an ``nn.Module``, or    its import path ``module:qualname`` when it has one
               its import path ``"module:function"``
``module``     an ``nn.Module`` (shipped by value)          the user's code only: pass ``model=`` the module again
=============  ===========================================  ========================================================

A factory is called on every trainer (a large model is not pickled through the scheduler) with the keyword
arguments it declares among ``num_outputs`` and ``in_channels``, plus ``model_kwargs``. Torchvision models get
their first convolution rebuilt for the dataset's channels and a head of the dataset's labels; timm builds both
itself (``in_chans``, ``num_classes``).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask_dl.errors import ConfigurationError, TrainingError, import_optional, missing_dependency

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

__all__ = [
    "KINDS",
    "ModelSource",
    "build_from_checkpoint",
    "check_fits",
    "first_conv_name",
    "head_name",
    "import_path",
    "model_source",
    "module_by_reference",
]

KINDS: tuple[str, ...] = ("registry", "torchvision", "timm", "factory", "module")
_PREFIXES = ("torchvision", "timm")


@dataclass(frozen=True)
class ModelSource:
    """One model of a run: what it is (``kind``, ``name``, ``kwargs``) and what builds it (``target``, ``path``).

    ``target`` is the registry's builder (or its path), the module, or the factory; it is not stored in
    checkpoints: ``path`` (an import path ``module:qualname``) is, when there is one.
    """

    kind: str
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    target: Any = field(default=None, repr=False, compare=False)
    path: str | None = None

    def build(self, *, num_outputs: int, in_channels: int) -> nn.Module:
        """Return a freshly initialized model of ``num_outputs`` logits taking ``in_channels`` channels.

        Raises
        ------
        ConfigurationError
            A factory that returns something other than an ``nn.Module``.
        MissingDependencyError
            torchvision or timm is not installed where the model is built.
        """
        from torch import nn

        if self.kind == "registry":
            from dask_dl.models import MODELS, build_model

            if self.name not in MODELS and self.target is not None:  # registered in another process
                MODELS.register(self.name, self.target)
            return build_model(self.name, num_outputs=num_outputs, in_channels=in_channels, **self.kwargs)
        if self.kind == "torchvision":
            return _torchvision(self.name.partition(":")[2], num_outputs, in_channels, self.kwargs)
        if self.kind == "timm":
            timm = import_optional("timm", extra="timm", purpose=f"model={self.name!r}")
            return timm.create_model(
                self.name.partition(":")[2],
                pretrained=False,
                num_classes=num_outputs,
                in_chans=in_channels,
                **self.kwargs,
            )
        if self.kind == "module":
            return copy.deepcopy(self.target)
        factory = self.target if self.target is not None else self._import()
        built = factory(**_factory_arguments(factory, num_outputs, in_channels), **self.kwargs)
        if not isinstance(built, nn.Module):
            raise ConfigurationError(
                f"the model factory {self.name!r} returned a {type(built).__name__}, not a torch.nn.Module; "
                "pass model= a function that returns the network"
            )
        return built

    def modules(self) -> tuple[str, ...]:
        """The modules a worker imports to build this model: torchvision or timm, or the user's module that the
        factory, the module's class or a registered builder is pickled from by reference (none for ``__main__``)."""
        if self.kind in _PREFIXES:
            return (self.kind,)
        sent = {"factory": self.path, "module": type(self.target)}.get(self.kind, self.target)
        module = module_by_reference(sent)
        return () if module is None else (module,)

    def _import(self) -> Any:
        """The factory at ``path`` (a checkpoint's model), or a TrainingError saying where it must import."""
        try:
            return _load_path(self.path)
        except (ImportError, AttributeError) as e:
            raise TrainingError(
                f"the model {'' if self.name == self.path else repr(self.name) + ' '}is built by {self.path!r}, "
                "which does not import here "
                f"({type(e).__name__}: {e}): run where it imports (from the module's folder, or with it on "
                "PYTHONPATH or installed), or pass the model again (export_onnx(checkpoint, path, model=...))"
            ) from e

    def to_dict(self) -> dict[str, Any]:
        """What a checkpoint stores: ``kind``, ``name``, ``kwargs`` and ``path`` (plain data)."""
        return {"kind": self.kind, "name": self.name, "kwargs": dict(self.kwargs), "path": self.path}


def model_source(model: Any, model_kwargs: dict[str, Any] | None = None) -> ModelSource:
    """Return the :class:`ModelSource` of ``fit``'s ``model=`` argument, checked on the driver.

    Parameters
    ----------
    model
        A registry name, ``"torchvision:NAME"``, ``"timm:NAME"``, the import path ``"module:function"`` of a
        function returning a module (imported here and on every trainer), a ``torch.nn.Module`` or a callable
        returning one.
    model_kwargs
        Options of a registry model, torchvision/timm builder keywords, or extra keywords of a factory.

    Returns
    -------
    ModelSource

    Raises
    ------
    ConfigurationError
        An unknown name or option, options for a module passed by value, or something that is no model.
    MissingDependencyError
        A torchvision or timm name when that package is not installed.
    """
    kwargs = dict(model_kwargs or {})
    if isinstance(model, str):
        prefix, sep, rest = model.partition(":")
        if sep and prefix in _PREFIXES:
            if not rest:
                raise ConfigurationError(f"model={model!r} names no model; pass e.g. model='{prefix}:resnet18'")
            if importlib.util.find_spec(prefix) is None:
                raise missing_dependency(prefix, prefix, f"model={model!r}")
            return ModelSource(prefix, model, kwargs)
        if sep:
            return _source_of_path(model, kwargs)
        from dask_dl.models import MODELS, model_options

        entry = MODELS.entry(model)  # unknown names: the registry's error, listing them
        unknown = sorted(set(kwargs) - set(model_options(model)))
        if unknown:
            raise ConfigurationError(
                f"model {model!r} has no option(s) {unknown}; its options are {list(model_options(model)) or 'none'}"
            )
        path = entry.target if isinstance(entry.target, str) else import_path(entry.target)
        return ModelSource("registry", model, kwargs, target=entry.target, path=path)
    is_module = not isinstance(model, type) and hasattr(model, "state_dict") and hasattr(model, "parameters")
    if is_module and callable(model):  # an nn.Module (a class of one is a factory)
        if kwargs:
            raise ConfigurationError(
                f"model_kwargs={kwargs} cannot apply to a model passed as a module ({type(model).__name__}); "
                "build the module with those options, or pass a function that builds it"
            )
        return ModelSource("module", _qualname(type(model)), {}, target=model)
    if callable(model):
        path = import_path(model)
        return ModelSource("factory", path or _qualname(model), kwargs, target=model, path=path)
    raise ConfigurationError(
        f"model must be a name (e.g. 'small_cnn' or 'torchvision:resnet50'), a torch.nn.Module or a function "
        f"returning one, got {type(model).__name__} {model!r}"
    )


def source_of_checkpoint(checkpoint: dict[str, Any]) -> ModelSource:
    """The :class:`ModelSource` a checkpoint records (checkpoints before user models: a registry model)."""
    saved = checkpoint.get("model_source")
    if not saved:
        return ModelSource("registry", checkpoint["model_name"], dict(checkpoint.get("model_kwargs") or {}))
    kind = saved["kind"]
    target = saved.get("path") if kind == "registry" else None
    return ModelSource(kind, saved["name"], dict(saved.get("kwargs") or {}), target=target, path=saved.get("path"))


def build_from_checkpoint(checkpoint: dict[str, Any], *, model: Any = None) -> nn.Module:
    """Build the model of ``checkpoint`` (weights not loaded), from ``model`` when given, else from what it records.

    Parameters
    ----------
    checkpoint
        A dask_dl checkpoint dict.
    model
        The user's model (an ``nn.Module``, a factory or a name) for checkpoints that cannot be rebuilt without it.

    Returns
    -------
    torch.nn.Module

    Raises
    ------
    TrainingError
        The checkpoint's model was passed by value, or by a factory without an import path, and ``model`` is None.
    """
    labels, in_channels = list(checkpoint["labels"]), int(checkpoint.get("in_channels", 1))
    if model is not None:
        saved = checkpoint.get("model_source") or {}
        kwargs = saved.get("kwargs") if "kwargs" in saved else checkpoint.get("model_kwargs")
        by_value = not isinstance(model, type) and hasattr(model, "state_dict")  # a module takes no options
        source = model_source(model, None if by_value else kwargs)
    else:
        source = source_of_checkpoint(checkpoint)
        if source.kind in ("module", "factory") and source.path is None:
            if source.kind == "module":
                how = "passed by value (fit(model=Net(...)))"
            elif source.name.startswith("__main__."):
                how = "made by a function of your script or notebook (__main__), which the workers cannot import"
            else:
                how = "made by a function without an import path (a local function or a lambda)"
            raise TrainingError(
                f"the checkpoint holds the weights of the user model {source.name!r}, {how}: rebuilding it needs your "
                "code. Pass the model again: export_onnx(checkpoint, path, model=...), or build it and call "
                "load_state_dict(checkpoint['model']); a factory importable as 'module:function' is rebuilt by itself"
            )
    return source.build(num_outputs=len(labels), in_channels=in_channels)


def check_fits(model: nn.Module, *, name: str, in_channels: int, input_size: int, labels: tuple[str, ...]) -> None:
    """Run one dummy batch through ``model`` and raise unless it takes the data's images and returns its labels.

    The model's mode is restored and no gradient or BatchNorm statistic is touched (eval mode, ``no_grad``).

    Raises
    ------
    ConfigurationError
        The model fails on images of ``(2, in_channels, input_size, input_size)`` or returns another shape than
        ``(2, len(labels))``; the message has both shapes.
    """
    import torch

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    shape = (2, in_channels, input_size, input_size)
    want = (2, len(labels))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(shape, device=device))
    except (RuntimeError, ValueError) as exc:  # torch's shape errors are RuntimeErrors, a few ValueErrors
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigurationError(
            f"model {name!r} does not take the dataset's images: a batch of shape {shape} (batch, channels, y, x) "
            f"fails with {first!r}; the dataset has {in_channels} channel(s) of {input_size} px, so the model's "
            f"first layer must take {in_channels} channel(s)"
        ) from None
    finally:
        model.train(was_training)
    got = tuple(out.shape) if hasattr(out, "shape") else type(out).__name__
    if got != want:
        raise ConfigurationError(
            f"model {name!r} returns {got} for a batch of shape {shape}; the dataset has {len(labels)} label(s) "
            f"({', '.join(labels[:5])}{', ...' if len(labels) > 5 else ''}), so the model must return {want} logits: "
            f"give it a head of {len(labels)} outputs"
        )


def first_conv_name(model: nn.Module) -> str | None:
    """The name of the model's first 2-d convolution (the layer adapted to the input channels), or None."""
    from torch import nn

    return next((n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), None)


def head_name(model: nn.Module) -> str | None:
    """The name of the model's head: timm's classifier, else the last ``nn.Linear``; None when there is none."""
    from torch import nn

    get = getattr(model, "get_classifier", None)
    if callable(get):
        head = get()
        for n, m in model.named_modules():
            if m is head and isinstance(m, nn.Linear):
                return n
    found = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return found[-1] if found else None


def adapt_first_conv(model: nn.Module, in_channels: int) -> nn.Module:
    """Replace the model's first convolution by one of ``in_channels`` inputs (same shape otherwise), in place."""
    from torch import nn

    name = first_conv_name(model)
    if name is None:
        return model
    conv = model.get_submodule(name)
    if conv.in_channels == in_channels:
        return model
    new = nn.Conv2d(
        in_channels,
        conv.out_channels,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=1,
        bias=conv.bias is not None,
        padding_mode=conv.padding_mode,
    )
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def _torchvision(name: str, num_outputs: int, in_channels: int, kwargs: dict[str, Any]) -> nn.Module:
    models = import_optional("torchvision.models", extra="torchvision", purpose=f"model='torchvision:{name}'")
    if name not in models.list_models():
        raise ConfigurationError(
            f"torchvision has no model {name!r}; its classification models include "
            f"{', '.join(sorted(models.list_models(module=models))[:12])}, ...; pass e.g. model='torchvision:resnet18'"
        )
    if kwargs.get("weights") is not None:
        raise ConfigurationError(
            "torchvision weights are never downloaded by dask_dl; save them once with torchvision, then pass "
            "fit(..., weights='resnet50.pt') (a state dict file)"
        )
    net = models.get_model(name, **{**kwargs, "weights": None, "num_classes": num_outputs})
    return adapt_first_conv(net, in_channels)


def _factory_arguments(factory: Any, num_outputs: int, in_channels: int) -> dict[str, int]:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: call it as it is
        return {}
    wanted = {"num_outputs": num_outputs, "in_channels": in_channels}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return wanted
    return {k: v for k, v in wanted.items() if k in parameters}


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def import_path(obj: Any) -> str | None:
    """``module:qualname`` when importing that gives back ``obj`` itself, else None (locals, lambdas, __main__)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    path = f"{module}:{qualname}"
    try:
        return path if _load_path(path) is obj else None
    except (ImportError, AttributeError):
        return None


def module_by_reference(obj: Any) -> str | None:
    """The module a worker imports to unpickle ``obj`` (an object, or an import path ``module:qualname``), or None
    when cloudpickle sends it by value: ``__main__``, locals, modules registered with ``register_pickle_by_value``."""
    owner = obj if isinstance(obj, str) else import_path(obj)
    if owner is None:
        return None
    module = owner.partition(":")[0]
    import cloudpickle

    by_value = cloudpickle.list_registry_pickle_by_value()
    return None if any(module == m or module.startswith(m + ".") for m in by_value) else module


def _source_of_path(path: str, kwargs: dict[str, Any]) -> ModelSource:
    """``model="module:function"``: what that path imports (a factory, a module class, or a module), on the driver.

    The trainers' workers must import the same module (a local cluster's worker processes get the driver's path).
    """
    module, _, qualname = path.partition(":")
    if (
        not module
        or not qualname
        or not all(part.isidentifier() for part in [*module.split("."), *qualname.split(".")])
    ):
        raise ConfigurationError(
            f"model={path!r} is no import path; pass 'module:function' (a function returning the network, e.g. "
            f"'mymodels:build_net'), 'torchvision:NAME', 'timm:NAME' or a registry name (dask_dl.list_models())"
        )
    try:
        target = _load_path(path)
    except ImportError as e:
        raise ConfigurationError(
            f"model={path!r}: importing {module!r} failed ({type(e).__name__}: {e}); the module must import where "
            "dask-dl runs and on every trainer's worker: run from its folder, put it on PYTHONPATH, or install it"
        ) from e
    except AttributeError:
        raise ConfigurationError(f"model={path!r}: module {module!r} has no {qualname!r}") from None
    if not callable(target):
        raise ConfigurationError(
            f"model={path!r} is a {type(target).__name__}, not a function returning a torch.nn.Module (or a module)"
        )
    source = model_source(target, kwargs)
    if source.kind == "factory" and source.path is None:  # e.g. a functools.partial: no qualname of its own
        return ModelSource("factory", path, kwargs, target=target, path=path)
    return source


def _load_path(path: str | None) -> Any:
    if path is None:
        raise TrainingError("this model has no import path to rebuild it from; pass model= the model itself")
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
