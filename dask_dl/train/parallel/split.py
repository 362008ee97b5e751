"""A model as a sequence of blocks: what pipeline stages cut and FSDP shards one by one.

A model is split when it is an ``nn.Sequential`` (its children are the blocks), when it has a
``pipeline_blocks()`` method returning the blocks in order (``x -> blocks[-1](...blocks[0](x))`` must equal
``model(x)``), or when it is one of the registry's networks, whose blocks are listed here from their ``forward``.
Blocks are the model's own submodules (plus parameter-free glue such as ``nn.Flatten``), so the parameter names of
a stage map back to the model's own names (:func:`stage_names`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from dask_dl.errors import ConfigurationError

logger = logging.getLogger("dask_dl.train")

__all__ = ["assign_stages", "blocks", "check_split", "stage_names"]


def blocks(model: nn.Module, *, name: str = "model") -> list[nn.Module]:
    """Return ``model`` as a list of blocks applied one after another.

    Raises
    ------
    ConfigurationError
        When the model is neither an ``nn.Sequential``, nor has ``pipeline_blocks()``, nor is a registry network.
    """
    listed = getattr(model, "pipeline_blocks", None)
    if callable(listed):
        found = list(listed())
    elif isinstance(model, nn.Sequential):
        found = list(model.children())
    else:
        found = _registry_blocks(model)
    if found is None:
        raise ConfigurationError(
            f"model {name!r} ({type(model).__name__}) cannot be split into pipeline stages: it is not an "
            "nn.Sequential and has no pipeline_blocks() method; make it an nn.Sequential, or give it a method "
            "pipeline_blocks(self) -> list[nn.Module] returning blocks whose composition equals forward(), or "
            "train it with parallel='fsdp'"
        )
    bad = [type(b).__name__ for b in found if not isinstance(b, nn.Module)]
    if bad or not found:
        raise ConfigurationError(
            f"model {name!r}: pipeline_blocks() must return a non-empty list of nn.Module, got {bad or 'none'}"
        )
    return found


def assign_stages(parts: list[nn.Module], stages: int, *, name: str = "model") -> list[list[nn.Module]]:
    """Cut ``parts`` into ``stages`` consecutive, non-empty groups of about equal parameter count.

    Raises
    ------
    ConfigurationError
        Fewer blocks than stages.
    """
    if len(parts) < stages:
        raise ConfigurationError(
            f"model {name!r} has {len(parts)} blocks, fewer than stages={stages}; pass stages<={len(parts)}"
        )
    sizes = [sum(p.numel() for p in b.parameters()) for b in parts]
    n = len(parts)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the smallest largest stage when the first i blocks make k stages (contiguous partition)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    bounds.reverse()
    groups = [parts[bounds[k] : bounds[k + 1]] for k in range(stages)]
    return groups


def check_split(
    model_name: str, model_kwargs: dict[str, Any], *, num_outputs: int, in_channels: int, stages: int
) -> None:
    """Check, before anything is placed, that the model ``model_name`` splits into ``stages`` stages.

    The model is built on torch's ``meta`` device (no memory, no initialization cost; see :func:`build_bare`).

    Raises
    ------
    ConfigurationError
        The model cannot be split, or has fewer blocks than stages.
    """
    model = build_bare(model_name, model_kwargs, num_outputs=num_outputs, in_channels=in_channels)
    assign_stages(blocks(model, name=model_name), stages, name=model_name)


def build_bare(model_name: str, model_kwargs: dict[str, Any], *, num_outputs: int, in_channels: int) -> nn.Module:
    """Build a model for looking at its structure: on torch's ``meta`` device, without memory or initialization.

    A builder that cannot run on ``meta`` (one that reads a file into its tensors, say) is run on the CPU instead.
    """
    from dask_dl.models import build_model

    try:
        with torch.device("meta"):
            return build_model(model_name, num_outputs=num_outputs, in_channels=in_channels, **model_kwargs)
    except ConfigurationError:
        raise
    except Exception as exc:  # the builder needs real tensors: build it for real, once
        logger.debug(
            "model %r cannot be built on the meta device (%s: %s); building it on the CPU",
            model_name,
            type(exc).__name__,
            exc,
        )
        return build_model(model_name, num_outputs=num_outputs, in_channels=in_channels, **model_kwargs)


def stage_names(model: nn.Module, stage: nn.Module) -> dict[str, str]:
    """Map the state-dict names of ``stage`` (built from ``model``'s blocks) to ``model``'s own names."""
    own = {id(t): n for n, t in model.state_dict(keep_vars=True).items()}
    return {n: own[id(t)] for n, t in stage.state_dict(keep_vars=True).items() if id(t) in own}


class _ReLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def _registry_blocks(model: nn.Module) -> list[nn.Module] | None:
    """The blocks of a registry network, in the order of its ``forward`` (None for any other model)."""
    from dask_dl.models import nets

    if type(model) is nets.SmallCNN:
        return [*model.features, model.pool, nn.Flatten(), model.dropout, model.fc]
    if type(model) is nets.AlexNet:
        return [*model.features, model.avgpool, nn.Flatten(), *model.classifier]
    if type(model) is nets.ResNet:
        head: list[Any] = [model.conv1, model.bn1, model.relu, model.maxpool]
        layers = [*model.layer1, *model.layer2, *model.layer3, *model.layer4]
        return [*head, *layers, model.avgpool, nn.Flatten(), model.fc]
    if type(model) is nets.DenseNet:
        return [*model.features, _ReLU(), nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), model.classifier]
    return None
