"""Training batches onto the trainer's device: pinned, copied ahead on a stream of their own, finished there.

A GPU trains an AlexNet-sized model at several thousand images/s, more than a few CPU cores decode and augment, so
on a CUDA trainer the cores only decode: the loader (``augment_on="device"``) hands over uint8 pixels with each
image's augmentation parameters, in page-locked memory (pinned on its background thread). :class:`DeviceFeed` then
keeps ``depth`` batches ahead of the model: their copies (asynchronous, from pinned memory) and their augmentation
and normalization (:func:`~dask_dl.data.device_augment.finish_batch`) run on a CUDA stream of their own, so they
overlap the model's work on the batch before. The model's stream waits for a batch's event before using it.

On a CPU trainer the loader augments as it always did (``augment_on="cpu"``, the default there) and the feed hands
its batches through. ``augment_on="device"`` forced on a CPU trainer runs the device path's ops on CPU tensors, in
the trainer's thread: the same batches as on a GPU, for checking them without one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from dask_dl.checks import one_of
from dask_dl.data.device_augment import finish_batch
from dask_dl.train.option_groups import AUGMENT_ON

__all__ = ["AUGMENT_ON", "DeviceFeed", "where_to_augment"]


def where_to_augment(augment_on: str, *, cuda: bool) -> str:
    """``"cpu"`` or ``"device"``: the loader's ``augment_on`` for the option's value on a trainer with or without
    CUDA.

    Examples
    --------
    >>> where_to_augment("auto", cuda=True), where_to_augment("auto", cuda=False)
    ('device', 'cpu')
    """
    augment_on = one_of("augment_on", augment_on, AUGMENT_ON)
    if augment_on == "auto":
        return "device" if cuda else "cpu"
    return augment_on


class DeviceFeed:
    """Turns a :class:`~dask_dl.data.loader.ChunkLoader` epoch's items into ``(x, y, rows)`` on ``device``.

    Parameters
    ----------
    device : torch.device
        The trainer's device.
    normalization : dict
        The loader's ``{"mean": ..., "std": ...}``, for batches it hands over unnormalized.
    deferred : bool
        The loader's ``augment_on == "device"``: its items are ``(pixels, y, rows, parameters)`` to finish here.
    depth : int
        Batches copied and finished ahead of the one the model takes (CUDA only).
    """

    def __init__(self, device: torch.device, *, normalization: dict[str, Any], deferred: bool, depth: int = 2) -> None:
        self.device = torch.device(device)
        self.normalization = normalization
        self.deferred = bool(deferred)
        self.depth = max(1, int(depth))

    def __call__(self, items: Iterator[tuple]) -> Iterator[tuple[torch.Tensor, torch.Tensor, Any]]:
        if self.device.type == "cuda":
            return self._ahead(items)
        return self._in_line(items)

    def _finish(self, x: torch.Tensor, parameters: Any) -> torch.Tensor:
        return finish_batch(x, parameters, normalization=self.normalization)

    def _in_line(self, items: Iterator[tuple]) -> Iterator[tuple[torch.Tensor, torch.Tensor, Any]]:
        for item in items:
            x = self._finish(item[0], item[3]) if self.deferred else item[0]
            yield x, item[1], item[2]

    def _ahead(self, items: Iterator[tuple]) -> Iterator[tuple[torch.Tensor, torch.Tensor, Any]]:
        stream = torch.cuda.Stream(self.device)
        pending: deque[tuple[torch.Tensor, torch.Tensor, Any, torch.cuda.Event]] = deque()
        try:
            for item in items:
                pending.append(self._submit(item, stream))
                if len(pending) > self.depth:
                    yield self._ready(pending.popleft())
            while pending:
                yield self._ready(pending.popleft())
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()  # stops the loader's thread when the epoch is left early

    def _submit(self, item: tuple, stream: torch.cuda.Stream) -> tuple:
        """Queue ``item``'s copies (and its finishing) on ``stream``; the host goes on at once from pinned memory."""
        with torch.cuda.stream(stream):
            x = item[0].to(self.device, non_blocking=True)
            y = item[1].to(self.device, non_blocking=True)
            if self.deferred:
                parameters = item[3]
                if parameters is not None:
                    parameters = parameters.to(self.device, non_blocking=True)
                x = self._finish(x, parameters)
            ready = torch.cuda.Event()
            ready.record(stream)
        return x, y, item[2], ready

    def _ready(self, entry: tuple) -> tuple[torch.Tensor, torch.Tensor, Any]:
        x, y, rows, ready = entry
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        # made on the feed's stream, used on the model's: the caching allocator must not reuse them before that
        x.record_stream(current)
        y.record_stream(current)
        return x, y, rows
