"""The audit of a site guard: every key that reached a worker without being computed there.

Three parts, one per place they run:

- :class:`TransferAudit`, a worker plugin on every worker process: it notes each key that enters the worker's
  memory by a transfer (a dependency fetched from a peer, a replica the active memory manager asked for, data that
  ``client.replicate``/``client.rebalance``/``client.scatter`` pushed) and how, and sends each note to the scheduler;
- :class:`ArrivalLog`, kept by the guard's scheduler plugin: the site of every worker the scheduler has seen, the
  site of every key (the site of the worker that computed it), the workers' notes and the guard's refusals;
- :class:`Audit`, what :meth:`dask_dl.sites.guard.SiteGuard.audit` returns: the notes stamped with the key's site,
  the refusals, and :attr:`Audit.violations`, the notes whose key left its site.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from time import time
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["Arrival", "ArrivalLog", "Audit", "Refusal", "TransferAudit", "is_weights", "site_of"]

logger = logging.getLogger("dask_dl.sites")

#: Event topic on which workers send their notes to the scheduler.
TOPIC = "dask-dl-site-audit"
#: Keys whose name starts with this are model weights: they may cross sites.
WEIGHTS_PREFIX = "dask-dl-weights-"
#: Dask settings that keep rechunk and shuffle task-based (P2P moves data outside the scheduler's restrictions).
TASK_BASED = {"array.rechunk.method": "tasks", "dataframe.shuffle.method": "tasks"}


def is_weights(key: Any) -> bool:
    """Whether ``key`` names model weights (``dask-dl-weights-...``, or a tuple key whose name does)."""
    name = key[0] if isinstance(key, tuple) and key else key
    return isinstance(name, str) and name.startswith(WEIGHTS_PREFIX)


def site_of(resources: Mapping[str, Any] | None, sites: Mapping[str, str]) -> str | None:
    """The site whose resource ``resources`` (a worker's) advertises, or None for a worker of no site.

    ``sites`` maps a site name to its resource. A worker advertising the resources of two sites belongs to none
    (:func:`dask_dl.sites.guard.guard_sites` refuses such a cluster; a worker that joins later is logged).
    """
    found = [site for site, resource in sites.items() if resource in (resources or {})]
    return found[0] if len(found) == 1 else None


def as_key(key: Any) -> Any:
    """``key`` with msgpack's lists turned back into tuples (events travel as msgpack)."""
    return tuple(as_key(part) for part in key) if isinstance(key, list) else key


@dataclass(frozen=True)
class Arrival:
    """One key that reached a worker without being computed there.

    ``how``: ``fetch`` (a dependency of a task that ran there, fetched from ``source``), ``acquire-replicas``
    (the active memory manager moved it: retiring a worker, a replication policy), ``gather``
    (``client.replicate`` or ``client.rebalance``), ``scatter`` (``client.scatter`` or a peer's ``update_data``).
    ``key_site`` is the site of the worker that computed the key (None: a worker of no site, or a key from before
    the guard whose holders span several sites).
    """

    key: Any
    worker: str
    worker_site: str | None
    key_site: str | None
    how: str
    source: str | None = None
    time: float = 0.0

    @property
    def weights(self) -> bool:
        """Whether the key is model weights, which may cross sites."""
        return is_weights(self.key)

    @property
    def crossed(self) -> bool:
        """Whether a site's key reached a worker of another site (or of no site), weights aside."""
        return self.key_site is not None and self.key_site != self.worker_site and not self.weights


@dataclass(frozen=True)
class Refusal:
    """Something the guard refused: ``what`` is ``task``, ``p2p``, ``replicate``, ``rebalance`` or ``replica``."""

    what: str
    keys: tuple
    message: str
    time: float = 0.0


@dataclass(frozen=True)
class Audit:
    """What moved between workers while a site guard was active, and what the guard refused.

    Attributes
    ----------
    records
        Every key that reached a worker without being computed there, in the order the scheduler learnt of them.
    refusals
        Tasks, replications and rebalances the guard refused.
    sites
        Site name to worker resource, as the guard was given.
    workers
        Worker address to site (None: a worker of no site), for every worker seen while the guard was active.
    """

    records: tuple[Arrival, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    sites: Mapping[str, str] = field(default_factory=dict)
    workers: Mapping[str, str | None] = field(default_factory=dict)

    @property
    def violations(self) -> tuple[Arrival, ...]:
        """The records whose key left its site (model weights aside)."""
        return tuple(record for record in self.records if record.crossed)

    def to_frame(self) -> pd.DataFrame:
        """The records as a table: key, worker, worker_site, key_site, how, source, time, weights, crossed."""
        import pandas as pd

        columns = ["key", "worker", "worker_site", "key_site", "how", "source", "time", "weights", "crossed"]
        rows = [{**asdict(record), "weights": record.weights, "crossed": record.crossed} for record in self.records]
        return pd.DataFrame(rows, columns=columns)

    def __str__(self) -> str:
        within = sum(1 for record in self.records if not record.crossed)
        return (
            f"site audit of {len(self.workers)} workers ({', '.join(sorted(self.sites))}): "
            f"{len(self.records)} transfers, {within} within a site or of weights, "
            f"{len(self.violations)} across sites, {len(self.refusals)} refused"
        )


class ArrivalLog:
    """The scheduler's side of the audit: sites of workers and keys, the workers' notes, the guard's refusals.

    Parameters
    ----------
    sites
        Site name to worker resource.
    """

    def __init__(self, sites: Mapping[str, str]) -> None:
        self.sites = dict(sites)
        self.workers: dict[str, str | None] = {}
        self.origin: dict[Any, str | None] = {}
        self.records: dict[str, dict[str, Any]] = {}
        self.refusals: deque[Refusal] = deque(maxlen=10_000)
        self._refused: set[tuple] = set()

    def worker_joined(self, address: str, resources: Mapping[str, Any] | None) -> str | None:
        """Remember ``address``'s site (kept after the worker leaves) and return it."""
        found = [site for site, resource in self.sites.items() if resource in (resources or {})]
        if len(found) > 1:
            logger.error("worker %s advertises the resources of sites %s: it counts as of no site", address, found)
        self.workers[address] = site = site_of(resources, self.sites)
        return site

    def computed(self, key: Any, holders: Iterable[str]) -> None:
        """``key`` entered memory on ``holders`` (the worker that computed it, or where it was scattered)."""
        found = {self.workers.get(address) for address in holders}
        self.origin[key] = found.pop() if len(found) == 1 else None

    def key_site(self, key: Any) -> str | None:
        """The site of the worker that computed ``key`` (None when unknown or of no site)."""
        return self.origin.get(key)

    def receive(self, record: Mapping[str, Any]) -> None:
        """Keep one worker note, stamped with its key's site; notes seen twice are kept once."""
        if record["id"] in self.records:
            return
        key = as_key(record["key"])
        self.records[record["id"]] = {**record, "key": key, "key_site": self.key_site(key)}

    def refuse(self, what: str, keys: Iterable[Any], message: str) -> None:
        """Note a refusal once (and log it: the user sees the error, the cluster's log the story)."""
        keys = tuple(keys)
        if (what, keys, message) in self._refused:
            return  # the AMM asks again at every run
        self._refused.add((what, keys, message))
        self.refusals.append(Refusal(what, keys, message, time()))
        logger.info("site guard refused %s: %s", what, message)

    def snapshot(self) -> dict[str, Any]:
        """Everything :class:`Audit` needs, as plain data."""
        records = sorted(self.records.values(), key=lambda record: record["time"])
        return {
            "records": [{name: value for name, value in record.items() if name != "id"} for record in records],
            "refusals": [asdict(refusal) for refusal in self.refusals],
            "sites": dict(self.sites),
            "workers": dict(self.workers),
        }


def audit_from(snapshot: Mapping[str, Any]) -> Audit:
    """Build an :class:`Audit` from :meth:`ArrivalLog.snapshot`'s data."""
    return Audit(
        records=tuple(Arrival(**record) for record in snapshot["records"]),
        refusals=tuple(Refusal(**{**refusal, "keys": tuple(refusal["keys"])}) for refusal in snapshot["refusals"]),
        sites=dict(snapshot["sites"]),
        workers=dict(snapshot["workers"]),
    )


class TransferAudit(WorkerPlugin):
    """Worker plugin: note every key that enters this worker's memory by a transfer, and how.

    Each note goes to the scheduler as an event (so notes of workers that leave are kept) and stays in
    :attr:`records` (so an audit also finds the notes whose event is still on its way).

    Parameters
    ----------
    sites
        Site name to worker resource.
    task_based
        Switch this worker's rechunk and shuffle to the task-based methods while the plugin is installed (graphs
        built on workers, e.g. by tasks that use ``get_client``).
    """

    name = "dask-dl-site-audit"

    def __init__(self, sites: Mapping[str, str], *, task_based: bool = True) -> None:
        self.sites = dict(sites)
        self.task_based = task_based

    def setup(self, worker: Any) -> None:
        """Start noting; switch to task-based rechunk and shuffle when asked."""
        import dask

        self.worker = worker
        self.site = site_of(worker.state.total_resources, self.sites)
        self.records: list[dict[str, Any]] = []
        incarnation = uuid.uuid4().hex  # a restarted worker may reuse its address
        self._ids = (f"{incarnation}-{n}" for n in itertools.count())
        self._fetch_reason: dict[Any, str] = {}
        self._config = dask.config.set(TASK_BASED) if self.task_based else None

    def teardown(self, worker: Any) -> None:
        """Restore the rechunk and shuffle settings this plugin changed."""
        if self._config is not None:
            self._config.__exit__(None, None, None)
            self._config = None

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """Note a key that entered memory without being computed here."""
        if finish == "fetch":
            from distributed.worker_state_machine import AcquireReplicasEvent

            reason = "acquire-replicas" if isinstance(self._stimulus(), AcquireReplicasEvent) else "fetch"
            self._fetch_reason.setdefault(key, reason)
            return
        if finish in ("released", "forgotten"):
            self._fetch_reason.pop(key, None)
        if finish != "memory" or start in ("executing", "long-running"):
            return
        how, source = self._how(key, start)
        if how is None:
            return
        record = {
            "id": next(self._ids),
            "key": key,
            "worker": self.worker.address,
            "worker_site": self.site,
            "how": how,
            "source": source,
            "time": time(),
        }
        self.records.append(record)
        self.worker.log_event(TOPIC, record)

    def _stimulus(self) -> Any:
        """The event the worker's state machine is handling now (None when the stimulus log is off)."""
        log = self.worker.state.stimulus_log
        return log[-1] if log else None

    def _how(self, key: Any, start: str) -> tuple[str | None, str | None]:
        from distributed.worker_state_machine import ExecuteSuccessEvent, GatherDepSuccessEvent, UpdateDataEvent

        stimulus = self._stimulus()
        if isinstance(stimulus, ExecuteSuccessEvent):
            return None, None  # computed here (a resumed task)
        if isinstance(stimulus, GatherDepSuccessEvent):
            return self._fetch_reason.pop(key, "fetch"), stimulus.worker
        if isinstance(stimulus, UpdateDataEvent):
            # Worker.gather (the scheduler's replicate and rebalance) names its stimulus "gather-..."
            return ("gather" if stimulus.stimulus_id.startswith("gather-") else "scatter"), None
        if start == "flight":
            return self._fetch_reason.pop(key, "fetch"), None
        return "scatter", None
