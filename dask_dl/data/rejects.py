"""Why ingest rejects an image: one reason per row of the rejects table, never a failed job."""

from __future__ import annotations

import re
from typing import Literal

from dask_dl.errors import DaskDLError

__all__ = ["REJECT_REASONS", "ImageRejected", "RejectReason"]

#: Why an image can be rejected, in the order the checks run.
RejectReason = Literal[
    "refused", "missing", "unreadable", "too_large", "undecodable", "truncated", "too_small", "unsupported",
    "degenerate",
]  # fmt: skip
REJECT_REASONS: tuple[str, ...] = (
    "refused",  # the path points where dask-dl.ingest.allowed-schemes / allowed-roots do not allow
    "missing",  # no such file
    "unreadable",  # not a regular file (FIFO, device, folder), or an I/O error
    "too_large",  # the file, or its decoded pixels (from the header), exceed the configured budget
    "undecodable",  # not an image format dask_dl reads, or the decoder reported an error or warning
    "truncated",  # the pixel data ends early
    "too_small",  # a side under min_size
    "unsupported",  # a kind of image dask_dl does not read (colour or multi-frame DICOM, ...)
    "degenerate",  # no contrast left (a constant image) or non-finite values before scaling
)


class ImageRejected(DaskDLError, ValueError):
    """An image that cannot be ingested; ``reason`` is one of :data:`REJECT_REASONS`."""

    def __init__(self, reason: str, path: str, detail: str) -> None:
        self.reason = reason
        self.path = path
        # decoders name in-memory files by their repr, a memory address: keep status files the same from run to run
        self.detail = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "the file", detail)
        super().__init__(f"{reason}: {path}: {self.detail}")
