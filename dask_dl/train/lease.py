"""One live run per checkpoint directory: the lease file of :mod:`dask_dl.data.lease`, taken by ``fit``.

Two runs writing ``epoch-NNNN.pt`` into one directory would overwrite each other's checkpoints and history. The
driver's process holds ``_dask_dl/lease.json`` in ``checkpoint_dir`` (host, pid, heartbeat) from the start of a
run to its end; a second run is refused with a message naming the holder, unless the lease is stale (the holding
process is gone, or its heartbeat is older than ``dask-dl.ingest.lease-stale`` seconds on another host).
"""

from __future__ import annotations

import time
from typing import Any

from dask_dl.data import store as contract
from dask_dl.data.lease import StoreLease
from dask_dl.errors import TrainingError

__all__ = ["CheckpointLease"]


class CheckpointLease(StoreLease):
    """The right to write checkpoints into one directory, held by a training run's driver process."""

    def _held(self, holder: dict[str, Any]) -> TrainingError:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("heartbeat", 0))))
        return TrainingError(
            f"another training run is writing checkpoints to checkpoint_dir={self.url!r} (host "
            f"{holder.get('host')}, pid {holder.get('pid')}, alive at {since}); two live runs cannot share a "
            "checkpoint_dir: wait for that run or stop it (run.stop()), or pass another checkpoint_dir. If that "
            f"process is gone, delete {contract.LEASE_KEY} in the directory"
        )
