"""Where a run's history goes besides memory: a Parquet file next to the checkpoints, and TensorBoard.

The driver hands :meth:`HistoryWriter.write` the whole history after every epoch. ``history.parquet`` in the
checkpoint directory is rewritten atomically each time, so it always holds every finished epoch and can be read
while the run goes on (``pandas.read_parquet("ckpt/history.parquet")``). With ``tensorboard=DIR`` each new row's
numbers are also written as TensorBoard scalars (``train/loss``, ``val/auroc_mean``, ``val/auroc/<label>``,
``perf/images_per_s``, ...) under ``DIR/<run_id>``.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

import pandas as pd

from dask_dl.errors import missing_dependency
from dask_dl.train.checkpoint import write_atomic

HISTORY_FILE = "history.parquet"

# history column -> TensorBoard tag
_TAGS = {
    "train_loss": "train/loss",
    "val_loss": "val/loss",
    "val_auroc_mean": "val/auroc_mean",
    "val_accuracy": "val/accuracy",
    "images_per_s": "perf/images_per_s",
    "compute_s": "perf/compute_s",
    "comm_s": "perf/comm_s",
    "data_wait_s": "perf/data_wait_s",
    "bytes_sent": "perf/bytes_sent",
    "cost": "perf/cost",
}


def _tag(column: str) -> str | None:
    if column in _TAGS:
        return _TAGS[column]
    if column.startswith("val_auroc_"):
        return "val/auroc/" + column.removeprefix("val_auroc_")
    return None


class HistoryWriter:
    """Write a run's history to ``checkpoint_dir/history.parquet`` and, optionally, TensorBoard event files."""

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike | None,
        *,
        tensorboard: str | os.PathLike | None = None,
        run_id: str = "run",
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self._writer = None
        self._written = 0
        if tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # torch's writer needs the tensorboard package
                raise missing_dependency("tensorboard", "tensorboard", "fit(..., tensorboard=...)") from None
            self._writer = SummaryWriter(log_dir=os.path.join(os.fspath(tensorboard), run_id))

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Record the history ``rows`` (all epochs so far; rows already written to TensorBoard are skipped)."""
        if self.checkpoint_dir is not None and rows:
            buffer = io.BytesIO()
            pd.DataFrame(rows).to_parquet(buffer, index=False)
            write_atomic(self.checkpoint_dir, HISTORY_FILE, buffer.getbuffer())
        if self._writer is not None:
            for row in rows[self._written :]:
                step = int(row.get("epoch", self._written))
                for column, value in row.items():
                    tag = _tag(column)
                    if tag is not None and isinstance(value, int | float) and math.isfinite(value):
                        self._writer.add_scalar(tag, value, global_step=step)
            self._writer.flush()
        self._written = len(rows)

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
