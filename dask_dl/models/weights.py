"""Start weights from a file: a state dict or a dask_dl checkpoint, local or any fsspec URL, read safely.

``fit(..., weights=PATH_OR_URL)`` has every trainer call :func:`load_weights` right after building its model.
The file is read through :func:`dask_dl.checkpoint.read_checkpoint_bytes` (regular files only, at most
``dask-dl.checkpoint.max-bytes``) and unpickled with ``torch.load(weights_only=True)``: tensors and plain data only.

Names are matched after removing a ``module.`` prefix (DDP) and unwrapping ``{"state_dict": ...}`` or
``{"model": ...}``. Two layers may differ in shape, because fine-tuning changes them on purpose:

- the first convolution, when the file was trained on another number of channels: RGB weights summed to one grey
  channel, or one grey channel repeated over C channels (divided by C), so a brightness still gives the same
  response; any other change re-initialises it;
- the head (the last linear layer, timm's classifier): a head of another size is re-initialised.

Any other shape difference is an error naming each tensor and both shapes. The report (``missing``,
``unexpected``, ``adapted``, ``reinitialized``) goes into the run's ``run.info["weights"]`` and a log line.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from typing import TYPE_CHECKING

from dask_dl.errors import CheckpointError, ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

__all__ = ["load_weights", "read_state_dict"]

logger = logging.getLogger("dask_dl.models")


def read_state_dict(source: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Return the tensors of a weights file: a state dict, or the ``model`` of a dask_dl checkpoint.

    Parameters
    ----------
    source
        Local path or fsspec URL of a ``torch.save`` file.

    Returns
    -------
    dict
        Parameter and buffer names (without a ``module.`` prefix) to tensors, on the CPU.

    Raises
    ------
    CheckpointError
        Not a regular file, too large, not readable by ``torch.load(weights_only=True)``, or holding no tensors.
    """
    import torch

    from dask_dl.checkpoint import read_checkpoint_bytes

    name = os.fspath(source)
    data = read_checkpoint_bytes(name)
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"weights {name!r} are refused: the file holds objects other than tensors and plain data, and unpickling "
            "them could run code; save the weights with torch.save(model.state_dict(), path)"
        ) from None
    except (EOFError, RuntimeError, ValueError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"weights {name!r} are not a torch file torch.load can read ({first})") from None
    for key in ("model", "state_dict"):  # a dask_dl checkpoint, or a training script's {"state_dict": ...}
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    state = {str(k).removeprefix("module."): v for k, v in obj.items()} if isinstance(obj, dict) else {}
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not state:
        raise CheckpointError(
            f"weights {name!r} hold no tensors (found a {type(obj).__name__}); pass a file saved with "
            "torch.save(model.state_dict(), path) or a dask_dl checkpoint (epoch-NNNN.pt)"
        )
    return state


def load_weights(model: nn.Module, source: str | os.PathLike, *, name: str = "model") -> dict[str, list[str]]:
    """Load the weights file ``source`` into ``model`` (in place), adapting its first layer and head.

    Parameters
    ----------
    model
        The freshly built model (its head and first layer already sized for the data).
    source
        Local path or fsspec URL of a state dict file or a dask_dl checkpoint.
    name
        The model's name, for messages.

    Returns
    -------
    dict
        ``missing`` (the model's tensors the file lacks: they keep their initial values), ``unexpected`` (the
        file's tensors the model lacks), ``adapted`` (first-layer weights converted to the data's channels) and
        ``reinitialized`` (tensors of another shape in the file, left initialized: the head, the first layer).

    Raises
    ------
    ConfigurationError
        Tensors other than the first layer's and the head's differ in shape (each one named, with both shapes).
    CheckpointError
        The file cannot be read safely (see :func:`read_state_dict`).
    """
    from dask_dl.models.source import first_conv_name, head_name

    state = read_state_dict(source)
    own = model.state_dict()
    first, head = first_conv_name(model), head_name(model)
    loadable, adapted, reinitialized, wrong = {}, [], [], []
    for key, tensor in state.items():
        if key not in own:
            continue
        want = own[key]
        if tuple(tensor.shape) == tuple(want.shape):
            loadable[key] = tensor
        elif key == f"{first}.weight" and (converted := _convert_channels(tensor, want)) is not None:
            loadable[key] = converted
            adapted.append(key)
        elif (first is not None and key.startswith(f"{first}.")) or (head is not None and key.startswith(f"{head}.")):
            reinitialized.append(key)
        else:
            wrong.append(f"{key}: file {tuple(tensor.shape)}, model {tuple(want.shape)}")
    if wrong:
        raise ConfigurationError(
            f"the weights {os.fspath(source)!r} do not fit model {name!r}: {len(wrong)} tensor(s) differ in shape "
            f"beyond the first layer ({first}) and the head ({head}), which are adapted: "
            + "; ".join(wrong[:8])
            + ("; ..." if len(wrong) > 8 else "")
            + ". Build the model the weights were saved from (same "
            "architecture and options), or pass weights of this model"
        )
    result = model.load_state_dict(loadable, strict=False)
    report = {
        "missing": sorted(k for k in result.missing_keys if k not in reinitialized),
        "unexpected": sorted(k for k in state if k not in own),
        "adapted": sorted(adapted),
        "reinitialized": sorted(reinitialized),
    }
    return report


def describe(report: dict[str, list[str]], source: str) -> str:
    """One line for the log: how many tensors were loaded, adapted, re-initialised, missing and unexpected."""
    parts = [
        f"{len(report[k])} {k}"
        + (f" ({', '.join(report[k][:4])}{', ...' if len(report[k]) > 4 else ''})" if report[k] else "")
        for k in ("adapted", "reinitialized", "missing", "unexpected")
    ]
    return f"weights {source!r}: " + ", ".join(parts)


def _convert_channels(tensor: torch.Tensor, want: torch.Tensor) -> torch.Tensor | None:
    """First-layer weights of ``c`` input channels as ``want``'s channels: RGB summed to grey, grey repeated."""
    if tensor.ndim != 4 or tensor.shape[0] != want.shape[0] or tuple(tensor.shape[2:]) != tuple(want.shape[2:]):
        return None
    have, need = tensor.shape[1], want.shape[1]
    if need == 1:
        return tensor.sum(dim=1, keepdim=True)
    if have == 1:
        return tensor.repeat(1, need, 1, 1) / need
    return None
