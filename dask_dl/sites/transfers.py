"""What the coordinator received from each site: a ledger of kinds and bytes.

Every result :func:`dask_dl.fit_sites` takes from a site passes through :meth:`Transfers.receive`, which records
its site, its kind and its pickled size. The kinds are:

``weights``
    a model's ``state_dict`` after a site's visit (read from the site's own checkpoint by a task on the site);
``metrics``
    numbers about a model: history rows of a visit (losses, AUROC), and the metrics of an evaluation task;
``manifest``
    what ``fit`` needs to place a visit: the store's attributes (labels, size) and the sample numbers and split
    name of each row. No pixels, no labels of samples, no patient or image ids.

No other result is taken from a site, so ``run.transfers`` lists these kinds only; the tests assert it. Not
listed are the control messages of ``fit`` itself while a visit runs (the worker list, each trainer's setup
report and live progress: addresses, counts, a running loss), which carry no data of the site either.
"""

from __future__ import annotations

import threading
from typing import Any

import pandas as pd

from dask_dl.sites.weights import state_nbytes

__all__ = ["KINDS", "Transfers"]

KINDS: tuple[str, ...] = ("weights", "metrics", "manifest")


class Transfers:
    """Thread-safe ledger of the objects received from sites."""

    def __init__(self) -> None:
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def receive(self, site: str, kind: str, obj: Any) -> Any:
        """Record ``obj`` as received from ``site`` as ``kind`` (one of :data:`KINDS`) and return it."""
        if kind not in KINDS:
            raise ValueError(f"unknown transfer kind {kind!r}; kinds are {KINDS}")
        with self._lock:
            self._records.append({"site": site, "kind": kind, "bytes": state_nbytes(obj)})
        return obj

    def frame(self) -> pd.DataFrame:
        """One row per object received: ``site``, ``kind``, ``bytes``."""
        with self._lock:
            return pd.DataFrame(list(self._records), columns=["site", "kind", "bytes"])

    def summary(self) -> pd.DataFrame:
        """Objects and bytes received per site and kind."""
        frame = self.frame()
        if frame.empty:
            return pd.DataFrame(columns=["site", "kind", "objects", "bytes"])
        grouped = frame.groupby(["site", "kind"], sort=True)["bytes"]
        return grouped.agg(objects="count", bytes="sum").reset_index()
