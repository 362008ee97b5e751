"""Averaging model weights: the one arithmetic step of federated averaging.

:func:`average_weights` is the sample-weighted mean of state dicts, computed in float64 and cast back, so that the
average of identical models is that model bit for bit and the average of two is their weighted mean to float
precision. Integer buffers (BatchNorm's ``num_batches_tracked``, a count of training steps) get the weighted mean
rounded to the nearest integer: averaged running statistics go with an averaged count.
"""

from __future__ import annotations

import numbers
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

from dask_dl.errors import ConfigurationError, TrainingError

__all__ = ["average_weights", "state_nbytes"]


def average_weights(states: Sequence[Mapping[str, Any]], weights: Sequence[float] | None = None) -> dict[str, Any]:
    """Return the weighted mean of model ``state_dict``\\ s.

    Parameters
    ----------
    states
        State dicts of one architecture (same keys, shapes and dtypes), e.g. what each site trained.
    weights
        One non-negative weight per state, e.g. its site's training samples (FedAvg); default equal weights.

    Returns
    -------
    dict of str to torch.Tensor
        Floating tensors: ``sum(w_i * s_i) / sum(w_i)`` in float64, cast back to their dtype. Integer and bool
        tensors: that mean rounded to the nearest integer (``num_batches_tracked``: the average step count).

    Raises
    ------
    ConfigurationError
        No states, a weight count that differs from the state count, negative or all-zero weights.
    TrainingError
        States of different architectures (keys, shapes or dtypes differ).

    Examples
    --------
    >>> import torch
    >>> average_weights([{"w": torch.tensor([1.0])}, {"w": torch.tensor([4.0])}], [2, 1])["w"]
    tensor([2.])
    """
    import torch

    if not states:
        raise ConfigurationError("average_weights needs at least one state dict")
    weights = [1.0] * len(states) if weights is None else list(weights)
    if len(weights) != len(states):
        raise ConfigurationError(f"{len(weights)} weights for {len(states)} state dicts; pass one weight per state")
    for w in weights:
        if not isinstance(w, numbers.Real) or isinstance(w, bool) or not w >= 0:
            raise ConfigurationError(f"weights must be numbers >= 0 (e.g. sample counts), got {weights!r}")
    total = float(sum(weights))
    if total <= 0:
        raise ConfigurationError(f"weights {weights!r} sum to zero; at least one state must carry weight")
    first = states[0]
    for i, state in enumerate(states[1:], start=1):
        if set(state) != set(first):
            diff = sorted(set(state) ^ set(first))
            raise TrainingError(f"state {i} has other keys than state 0 ({diff[:5]}...): not the same model")
        for key, value in state.items():
            if value.shape != first[key].shape or value.dtype != first[key].dtype:
                raise TrainingError(
                    f"state {i}'s {key!r} is {tuple(value.shape)} {value.dtype}, state 0's "
                    f"{tuple(first[key].shape)} {first[key].dtype}: not the same model"
                )
    out = {}
    for key, value in first.items():
        acc = torch.zeros(value.shape, dtype=torch.float64)
        for w, state in zip(weights, states, strict=True):
            if w:
                acc += float(w) * state[key].detach().cpu().to(torch.float64)
        mean = acc / total
        if not (value.is_floating_point() or value.is_complex()):
            mean = torch.round(mean)
        out[key] = mean.to(value.dtype)
    return out


def state_nbytes(obj: Any) -> int:
    """Bytes of ``obj`` as sent between processes (tensors, dicts, frames): its pickled structure plus the data
    of each tensor.

    A tensor counts as its data (``numel * element_size``) and a small fixed record, not as its pickled form:
    torch pickles a storage under a key made of its memory address, whose number of digits varies from one
    allocation to the next, so the same state dict would count a few bytes more or less each time.
    """
    import io

    import torch

    data = 0

    class _Counting(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            nonlocal data
            if isinstance(value, torch.Tensor):
                data += value.numel() * value.element_size()
                return (str(value.dtype), tuple(value.shape))
            return None

    buffer = io.BytesIO()
    _Counting(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return len(buffer.getvalue()) + data
