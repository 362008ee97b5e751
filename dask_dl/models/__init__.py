"""The models dask_dl trains, by name: one :class:`~dask_dl.registry.Registry` of builders.

The architectures live in :mod:`dask_dl.models.nets`; they are registered here by ``"module:attribute"`` path, so
listing the names (the CLI's ``--model`` choices and help) does not import torch. A builder is any callable
``builder(num_outputs, in_channels, **options) -> torch.nn.Module`` whose keyword-only arguments are its options;
:func:`register_model` adds your own.

Models take the float input of :func:`dask_dl.normalize.normalize` (re-exported here: it is the models' input
contract).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_dl.checks import positive_int
from dask_dl.errors import ConfigurationError
from dask_dl.normalize import DEFAULT_NORMALIZATION, normalize
from dask_dl.registry import Registry

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

__all__ = [
    "DEFAULT_NORMALIZATION",
    "MODELS",
    "build_model",
    "list_models",
    "model_options",
    "normalize",
    "register_model",
]

#: model name -> builder; ``dask-dl train --model`` takes its choices and help from here
MODELS = Registry("model", argument="model")


def register_model(name: str, builder: Callable[..., nn.Module] | str | None = None, *, help: str = "") -> Any:
    """Make ``builder`` trainable as ``fit(..., model=name)``; used as a decorator when ``builder`` is omitted.

    Parameters
    ----------
    name
        The name users pass (``model="my_net"``).
    builder
        ``builder(num_outputs, in_channels, **options)`` returning a ``torch.nn.Module`` of logits, or its
        ``"module:attribute"`` path (imported on first use, so on every trainer worker that module must import).
    help
        One line for ``dask-dl train --help``.

    Returns
    -------
    The builder (so that the decorator form leaves it unchanged).

    Raises
    ------
    ValueError
        When ``name`` is taken already.

    Examples
    --------
    >>> @register_model("tiny_linear", help="one linear layer over the pixels")
    ... def tiny_linear(num_outputs, in_channels=1, *, size=32):
    ...     import torch
    ...     return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(in_channels * size * size, num_outputs))
    >>> "tiny_linear" in list_models()
    True
    """
    return MODELS.register(name, builder, help=help)


def list_models() -> list[str]:
    """Return the names :func:`build_model` accepts.

    Examples
    --------
    >>> list_models()[:5]
    ['small_cnn', 'alexnet', 'resnet18', 'resnet50', 'densenet121']
    """
    return MODELS.names()


def model_options(name: str) -> tuple[str, ...]:
    """The keyword options the model ``name`` takes (its builder's keyword-only arguments).

    Raises
    ------
    ConfigurationError
        For an unknown name.
    """
    builder = MODELS.get(name)
    target = builder.__init__ if inspect.isclass(builder) else builder
    kinds = (inspect.Parameter.KEYWORD_ONLY,)
    return tuple(p.name for p in inspect.signature(target).parameters.values() if p.kind in kinds)


def build_model(name: str, *, num_outputs: int, in_channels: int = 1, **kwargs: Any) -> nn.Module:
    """Build a freshly initialized model of the registry.

    Parameters
    ----------
    name : str
        One of :func:`list_models`.
    num_outputs : int
        Size of the head: the number of labels. The model returns logits.
    in_channels : int
        Input channels; dask_dl images are grayscale, so 1.
    **kwargs
        Options of the architecture: ``width``, ``dropout`` (small_cnn); ``dropout`` (alexnet);
        ``zero_init_residual`` (resnets); ``growth_rate``, ``block_config``, ``num_init_features``, ``bn_size``,
        ``drop_rate`` (densenet121).

    Returns
    -------
    torch.nn.Module
        Takes float32 ``(B, in_channels, S, S)`` with ``S >= 32`` (see :func:`normalize`), returns
        ``(B, num_outputs)`` logits.

    Raises
    ------
    ConfigurationError
        For an unknown name or option, or sizes below 1.

    Examples
    --------
    >>> import torch
    >>> model = build_model("small_cnn", num_outputs=14)
    >>> model(torch.zeros(2, 1, 64, 64)).shape
    torch.Size([2, 14])
    """
    builder = MODELS.get(name)
    num_outputs = positive_int("num_outputs", num_outputs, example=14)
    in_channels = positive_int("in_channels", in_channels)
    options = model_options(name)
    unknown = sorted(set(kwargs) - set(options))
    if unknown:
        raise ConfigurationError(
            f"model {name!r} has no option(s) {unknown}; its options are {list(options) or 'none'}"
        )
    return builder(num_outputs, in_channels, **kwargs)


MODELS.register("small_cnn", "dask_dl.models.nets:SmallCNN", help="four conv stages and global pooling; CPU-quick")
MODELS.register("alexnet", "dask_dl.models.nets:AlexNet", help="torchvision's AlexNet (Krizhevsky et al. 2012)")
MODELS.register("resnet18", "dask_dl.models.nets:resnet18", help="torchvision's ResNet-18")
MODELS.register("resnet50", "dask_dl.models.nets:resnet50", help="torchvision's ResNet-50 (v1.5)")
MODELS.register("densenet121", "dask_dl.models.nets:DenseNet", help="torchvision's DenseNet-121 (BC)")
