"""Why ingest rejects an image: one reason per row of the rejects table, never a failed job; and when a run's
rejects are too many (an :class:`~dask_dl.errors.IngestError` that says why and what to do)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from dask_dl.errors import DaskDLError, IngestError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["REJECT_REASONS", "ImageRejected", "RejectReason", "check_share"]

#: Why an image can be rejected, in the order the checks run.
RejectReason = Literal[
    "refused",
    "missing",
    "unreadable",
    "too_large",
    "undecodable",
    "truncated",
    "too_small",
    "unsupported",
    "degenerate",
]
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


# what to do about the most frequent reject reason, for the IngestError message
_FIXES = {
    "too_small": "pass a smaller min_size= (or --min-size), e.g. min_size={min_side}, or ingest at a smaller size=",
    "missing": "the files are not where the catalog's path column says: check the paths (workers must see them)",
    "unreadable": "the files cannot be read: check permissions and that the workers can reach the storage",
    "undecodable": "the files are not images dask_dl can decode: check the collection (see read_rejects(store))",
    "truncated": "the files are damaged (cut short): copy the collection again",
    "unsupported": "the images are of a kind dask_dl does not read (see the messages in read_rejects(store))",
    "too_large": "the decoded images exceed dask-dl.ingest.max-image-bytes: raise it if the workers have the memory",
    "refused": "the paths point where dask-dl.ingest.allowed-roots/allowed-schemes does not allow: allow them",
    "degenerate": "the images are constant (no contrast): check the files and their DICOM rescale/window values",
}


def check_share(*, store: str, n: int, rejects: pd.DataFrame, share: float, min_size: int) -> None:
    """Raise an IngestError when an ingest of ``n`` images kept none or rejected more than ``share`` of them.

    The message counts the reasons, shows the first rejected rows (of the ``rejects`` table) and the fix for the
    most frequent reason.
    """
    table, rejected = rejects, len(rejects)
    if rejected == 0 or (rejected < n and rejected <= share * n):
        return
    counts = {str(k): int(v) for k, v in table["reason"].value_counts().items()}
    reasons = ", ".join(f"{reason} {count}" for reason, count in counts.items())
    shown = "\n".join(
        f"  row {row.row} {row.image_id!r} ({row.path}): {row.reason}: {row.message}"
        for row in table.head(3).itertuples()
    )
    top = next(iter(counts))
    fix = _FIXES.get(top, "see read_rejects(store) for each image's reason").format(
        min_side=_smallest_side(table) or max(1, min_size // 2)
    )
    kept = (
        "no image was kept"
        if rejected == n
        else f"{rejected / n:.0%} were rejected, more than max_reject_share={share:g} (dask-dl.ingest.max-reject-share)"
    )
    accept = "" if rejected == n else " To keep the store as it is, pass max_reject_share=1.0."
    raise IngestError(
        f"ingest into {store!r} rejected {rejected} of {n} images ({reasons}): {kept}. First rejected rows:\n"
        f"{shown}\nFix: {fix}; then ingest again with overwrite=True.{accept} The store and its rejects table "
        f"are written: dask_dl.data.ingest.read_rejects({store!r})",
        rejects=table,
        counts=counts,
    )


def _smallest_side(rejects: pd.DataFrame) -> int | None:
    """The smallest side among the too_small rejects (their message says ``WxH pixels``)."""
    sides = rejects.loc[rejects["reason"] == "too_small", "message"].str.extract(r"(\d+)x(\d+) pixels")
    sides = sides.dropna().astype(int)
    return int(sides.min(axis=1).min()) if len(sides) else None
