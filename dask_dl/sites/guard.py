"""A guard that keeps every site's data on its own workers of one shared cluster, and audits what moved.

A site is a worker resource (``site-A``, declared with a large amount so that it never limits concurrency). Dask
alone does not keep data in place: a task restricted to site B that needs site A's chunks gets them copied,
annotations can be dropped by graph optimization, ``replicate``, ``rebalance`` and retiring a worker move keys, and
P2P rechunk and shuffle move data outside the scheduler's restrictions. While a :class:`SiteGuard` is active:

- a task without a site restriction whose inputs live on site X runs on X's workers (the scheduler plugin restricts
  it when its graph arrives and again as its inputs land, so no annotation has to survive optimization);
- a task whose inputs come from two sites, or that is restricted to another site than its inputs', errs with a
  :class:`~dask_dl.errors.CrossSiteError` naming the keys and sites; keys named ``dask-dl-weights-*`` (model
  weights) may cross;
- ``client.replicate`` copies a key only to workers of its own site (and refuses ``workers=`` of another site),
  ``client.rebalance`` moves keys only among the workers of one site, and the active memory manager (which retiring
  a worker uses) puts a key only on a worker of its site; a key with no such worker stays where it is, so the
  retirement of a site's last worker holding unique data is given up;
- rechunk and shuffle are task-based on the client and the workers, and P2P tasks are refused;
- every key that reached a worker without being computed there is noted (:mod:`dask_dl.sites.audit`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from time import time
from typing import TYPE_CHECKING, Any

from distributed.core import error_message
from distributed.diagnostics.plugin import SchedulerPlugin

from dask_dl.errors import ClusterError, ConfigurationError, CrossSiteError
from dask_dl.sites.audit import TASK_BASED, TOPIC, ArrivalLog, Audit, TransferAudit, as_key, audit_from, is_weights

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["SiteGuard", "SiteGuardPlugin", "guard_sites", "site_workers"]

logger = logging.getLogger("dask_dl.sites")

#: A worker address no worker has: a refused task restricted to it waits in ``no-worker`` until the guard errs it.
NOWHERE = "dask-dl-site-guard://refused"


def _names(keys: list[Any], most: int = 3) -> str:
    shown = ", ".join(repr(key) for key in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _site_name(site: str | None) -> str:
    return f"site {site!r}" if site is not None else "no site"


class SiteGuardPlugin(SchedulerPlugin):
    """Scheduler plugin of a :class:`SiteGuard`: pins tasks to their inputs' site, refuses crossings, audits.

    Parameters
    ----------
    sites
        Site name to worker resource.
    enforce
        Pin, refuse and block; False only audits (to see what Dask alone would move).
    """

    name = "dask-dl-site-guard"

    def __init__(self, sites: Mapping[str, str], *, enforce: bool = True) -> None:
        self.sites = dict(sites)
        self.enforce = enforce

    # -- life cycle ---------------------------------------------------------------------------------------------

    async def start(self, scheduler: Any) -> None:
        """Learn the workers' and keys' sites, and (enforcing) take over replicate, rebalance and AMM placement."""
        self.scheduler = scheduler
        self.log = ArrivalLog(self.sites)
        self.planned: dict[Any, str | None] = {}  # site of a task not yet in memory
        self.own: dict[Any, frozenset | None] = {}  # sites a task's own restrictions allow (None: any)
        self.pins: dict[Any, str] = {}  # resource this plugin added to a task's restrictions
        self.refused: dict[Any, str] = {}  # key -> message, until the task is forgotten
        self.handlers: dict[str, Any] = {}
        for address, ws in scheduler.workers.items():
            self.log.worker_joined(address, ws.resources)
        for key, ts in scheduler.tasks.items():
            if ts.state == "memory":
                self.log.computed(key, [ws.address for ws in ts.who_has or ()])
        if self.enforce:
            ours = {
                "replicate": self._replicate,
                "rebalance": self._rebalance,
                "shuffle_get_or_create": self._refuse_p2p,  # every P2P rechunk, shuffle and merge starts here
                "shuffle_get": self._refuse_p2p,
            }
            self.handlers = {name: scheduler.handlers[name] for name in ours if name in scheduler.handlers}
            scheduler.handlers.update({name: ours[name] for name in self.handlers})
            _hook_amm()

    def restore(self) -> None:
        """Give replicate, rebalance and the AMM's placement back to Dask (idempotent)."""
        for name, handler in self.handlers.items():
            self.scheduler.handlers[name] = handler
        if self.handlers:
            _unhook_amm()
        self.handlers = {}

    async def close(self) -> None:
        """The scheduler is closing: restore what the plugin changed."""
        if hasattr(self, "scheduler"):
            self.restore()

    def add_worker(self, scheduler: Any, worker: str) -> None:
        """Remember the site of a worker that joined."""
        self.log.worker_joined(worker, scheduler.workers[worker].resources)

    def log_event(self, topic: str, msg: Any) -> None:
        """Keep the workers' notes as they arrive."""
        if topic == TOPIC and hasattr(self, "log"):
            self.log.receive(msg)

    # -- placement ----------------------------------------------------------------------------------------------

    def update_graph(self, scheduler: Any, *, tasks: list | None = None, **kwargs: Any) -> None:
        """Refuse P2P tasks; pin (or refuse) the new tasks, inputs before the tasks that need them."""
        if not self.enforce or not tasks:
            return
        states = [scheduler.tasks[key] for key in tasks if key in scheduler.tasks]
        self._refuse_p2p_tasks(states)
        for ts in _topological(states):
            if ts.state in ("released", "waiting", "no-worker"):
                self._decide(ts)

    def transition(self, key: Any, start: str, finish: str, *args: Any, stimulus_id: str = "", **kwargs: Any) -> None:
        """Note where keys are computed; re-decide the tasks waiting on a key that landed; err refused tasks."""
        ts = self.scheduler.tasks.get(key)
        if ts is None:
            return
        if finish == "memory":
            self.log.computed(key, [kwargs["worker"]] if "worker" in kwargs else [w.address for w in ts.who_has or ()])
            if self.enforce:
                for dts in ts.dependents:
                    if dts.state in ("released", "waiting") and dts.key not in self.refused:
                        self._decide(dts)
        elif finish == "no-worker" and key in self.refused:
            asyncio.get_running_loop().call_soon(self._err, key)
        elif finish == "forgotten":
            for table in (self.planned, self.own, self.pins, self.refused):
                table.pop(key, None)

    def _decide(self, ts: Any) -> None:
        """Pin ``ts`` to the one site of its inputs, or refuse it when its inputs or restrictions disagree."""
        if ts.key in self.refused:
            return
        if ts.key not in self.own:
            self.own[ts.key] = self._restriction_sites(ts)
        own = self.own[ts.key]
        inputs: dict[str, list] = {}
        for dts in ts.dependencies:
            if is_weights(dts.key):
                continue
            site = self.log.key_site(dts.key) if dts.state == "memory" else self.planned.get(dts.key)
            if site is not None:
                inputs.setdefault(site, []).append(dts.key)
        if len(inputs) > 1:
            parts = " and ".join(f"{_site_name(site)} ({_names(keys)})" for site, keys in sorted(inputs.items()))
            self._refuse(
                ts,
                f"task {ts.key!r} mixes data of {parts}; the site guard keeps each site's data on its own workers: "
                f"compute per site and combine only model weights across sites (keys named 'dask-dl-weights-...')",
            )
        elif inputs:
            ((site, keys),) = inputs.items()
            if own is not None and site not in own:
                allowed = ", ".join(_site_name(s) for s in sorted(own, key=str)) or "no running worker"
                self._refuse(
                    ts,
                    f"task {ts.key!r} is restricted to {allowed} but its inputs {_names(keys)} live on "
                    f"{_site_name(site)}; the site guard does not copy a site's data to another site's workers: "
                    f"drop the task's workers=/resources= restriction (it then runs on {_site_name(site)}) or "
                    f"restrict it to {_site_name(site)}",
                )
            else:
                self._pin(ts, site)
        else:
            self.planned[ts.key] = next(iter(own)) if own is not None and len(own) == 1 else None

    def _restriction_sites(self, ts: Any) -> frozenset | None:
        """The sites the task's own restrictions allow (None stands for workers of no site); None: unrestricted."""
        named = {site for site, resource in self.sites.items() if resource in (ts.resource_restrictions or {})}
        if named:
            return frozenset(named)
        if ts.worker_restrictions or ts.host_restrictions:
            return frozenset(self.log.workers.get(ws.address) for ws in self.scheduler.valid_workers(ts) or ())
        return None

    def _pin(self, ts: Any, site: str) -> None:
        resource = self.sites[site]
        restrictions = dict(ts.resource_restrictions or {})
        if self.pins.get(ts.key) not in (None, resource):
            restrictions.pop(self.pins.pop(ts.key), None)  # pinned to a planned site that turned out otherwise
        if resource not in restrictions:
            restrictions[resource] = 0  # needs the resource, uses none of it: never limits the site's concurrency
            self.pins[ts.key] = resource
        ts.resource_restrictions = restrictions
        ts.loose_restrictions = False
        self.planned[ts.key] = site

    def _refuse(self, ts: Any, message: str, what: str = "task") -> None:
        self.refused[ts.key] = message
        self.planned[ts.key] = None
        ts.worker_restrictions = {NOWHERE}
        ts.loose_restrictions = False
        self.log.refuse(what, [ts.key], message)
        if ts.state == "no-worker":
            asyncio.get_running_loop().call_soon(self._err, ts.key)

    def _err(self, key: Any) -> None:
        """Err a refused task that reached ``no-worker`` (outside the scheduler's transitions)."""
        from distributed.protocol import pickle

        ts = self.scheduler.tasks.get(key)
        message = self.refused.get(key)  # kept until forgotten: a retried refused task errs again
        if ts is None or message is None or ts.state != "no-worker":
            return
        stimulus_id = f"dask-dl-site-guard-{time()}"
        recommendations = self.scheduler.transition(
            key,
            "erred",
            stimulus_id=stimulus_id,
            cause=key,
            exception=pickle.dumps(CrossSiteError(message)),
            traceback=None,
            exception_text=message,
            traceback_text="",
        )
        self.scheduler.transitions(recommendations, stimulus_id)

    # -- P2P, replicate, rebalance, AMM ------------------------------------------------------------------------

    def _refuse_p2p_tasks(self, states: list[Any]) -> None:
        """Refuse each P2P barrier and the transfer tasks behind it (through aliases), so that none runs."""
        from dask._task_spec import Alias
        from distributed.shuffle._core import P2PBarrierTask

        for barrier in states:
            if not isinstance(barrier.run_spec, P2PBarrierTask) or barrier.key in self.refused:
                continue
            message = (
                f"{barrier.key!r} is a P2P rechunk or shuffle, which moves data between workers outside the "
                f"scheduler's restrictions; with a site guard active build the collection anew (the guard sets "
                f"{TASK_BASED}) or pass method='tasks' to rechunk / shuffle_method='tasks' to shuffle"
            )
            todo, seen = [barrier], set()
            while todo:
                ts = todo.pop()
                if ts in seen:
                    continue
                seen.add(ts)
                self._refuse(ts, message, what="p2p")
                if ts is barrier or isinstance(ts.run_spec, Alias):
                    todo.extend(ts.dependencies)  # the barrier's inputs are transfer tasks, maybe behind aliases

    def _refuse_p2p(self, *, worker: str, key: Any = None, **kwargs: Any) -> dict:
        """Refuse to start a P2P run (a backstop: a transfer task that ran anyway errs before it sends data)."""
        message = (
            f"task {key!r} starts a P2P rechunk or shuffle, which moves data between workers outside the "
            f"scheduler's restrictions; with a site guard active build the collection anew (the guard sets "
            f"{TASK_BASED}) or pass method='tasks' to rechunk / shuffle_method='tasks' to shuffle"
        )
        self.log.refuse("p2p", [key] if key is not None else [], message)
        return error_message(CrossSiteError(message))

    def site_workers(self, site: str | None) -> list[str]:
        """Addresses of the running workers of ``site`` (None: of no site)."""
        running = self.scheduler.running
        return [ws.address for ws in running if self.log.workers.get(ws.address) == site]

    async def _replicate(self, keys: list, n: int | None = None, workers: Any = None, **kwargs: Any) -> Any:
        """``Scheduler.replicate``, one site at a time onto that site's workers."""
        chosen = self.scheduler.workers_list(workers) if workers is not None else None
        groups: dict[str | None, list] = {}
        for key in map(as_key, keys):
            groups.setdefault(None if is_weights(key) else self.log.key_site(key), []).append(key)
        plan = {}
        for site, group in groups.items():
            if site is None:  # weights, and keys of no site: anywhere asked
                plan[site] = (group, chosen)
                continue
            pool = chosen if chosen is not None else self.site_workers(site)
            targets = [address for address in pool if self.log.workers.get(address) == site]
            if not targets:
                message = (
                    f"replicate would copy {_site_name(site)}'s keys {_names(group)} to workers of another site "
                    f"({_names(chosen or [])}); the site guard copies a key only to workers of its own site: "
                    f"pass workers=dask_dl.sites.guard.site_workers(client, {self.sites[site]!r}) or no workers="
                )
                self.log.refuse("replicate", group, message)
                # an error reply: the client raises it, and the scheduler logs no traceback for an expected refusal
                return error_message(CrossSiteError(message), status="uncaught-error")
            plan[site] = (group, targets)
        result: Any = None
        for group, targets in plan.values():
            result = await self.handlers["replicate"](keys=group, n=n, workers=targets, **kwargs)
            if isinstance(result, dict) and result.get("status") != "OK":
                return result
        return result

    async def _rebalance(self, keys: Any = None, workers: Any = None, stimulus_id: str | None = None) -> dict:
        """``Scheduler.rebalance``, among the workers of one site at a time."""
        chosen = self.scheduler.workers_list(workers) if workers is not None else list(self.scheduler.workers)
        groups: dict[str | None, list[str]] = {}
        for address in chosen:
            groups.setdefault(self.log.workers.get(address), []).append(address)
        failed: list = []
        for group in groups.values():
            result = await self.handlers["rebalance"](keys=keys, workers=group, stimulus_id=stimulus_id)
            failed += result.get("keys", [])
        return {"status": "partial-fail", "keys": failed} if failed else {"status": "OK"}

    def replica_candidates(self, ts: Any, candidates: set | None) -> set | None:
        """Narrow the AMM's candidate recipients of a replica of ``ts`` to the workers of the key's site."""
        site = self.log.key_site(ts.key)
        if site is None or is_weights(ts.key):
            return candidates
        pool = candidates if candidates is not None else self.scheduler.running
        narrowed = {ws for ws in pool if self.log.workers.get(ws.address) == site}
        held = set(ts.who_has or ())
        if pool - held and not narrowed - held:
            holders = sorted(ws.address for ws in ts.who_has or ())
            self.log.refuse(
                "replica",
                [ts.key],
                f"no other running worker of {_site_name(site)} can take a replica of {ts.key!r} (held by "
                f"{_names(holders)}); it stays where it is, and a retirement of its holder is given up",
            )
        return narrowed


def _topological(states: list[Any]) -> list[Any]:
    """``states`` ordered so that each task comes after its dependencies among them."""
    chosen = set(states)
    waiting = {ts: sum(1 for dts in ts.dependencies if dts in chosen) for ts in states}
    ready = [ts for ts, count in waiting.items() if count == 0]
    ordered = []
    while ready:
        ts = ready.pop()
        ordered.append(ts)
        for dts in ts.dependents:
            if dts in waiting:
                waiting[dts] -= 1
                if waiting[dts] == 0:
                    ready.append(dts)
    return ordered


_amm_users = 0
_amm_original: Any = None


def _hook_amm() -> None:
    """Let a guard narrow where the active memory manager (retirement, replication policies) puts replicas.

    The hook lives on the class (retirement may run an AMM of its own) and consults the guard of the AMM's own
    scheduler, so schedulers without a guard in the same process are untouched.
    """
    global _amm_users, _amm_original
    from distributed.active_memory_manager import ActiveMemoryManagerExtension

    if _amm_users == 0:
        _amm_original = original = ActiveMemoryManagerExtension._find_recipient

        def _find_recipient(self: Any, ts: Any, candidates: Any, pending_repl: Any) -> Any:
            guard = self.scheduler.plugins.get(SiteGuardPlugin.name)
            if isinstance(guard, SiteGuardPlugin) and guard.enforce:
                candidates = guard.replica_candidates(ts, candidates)
            return original(self, ts, candidates, pending_repl)

        ActiveMemoryManagerExtension._find_recipient = _find_recipient
    _amm_users += 1


def _unhook_amm() -> None:
    global _amm_users
    from distributed.active_memory_manager import ActiveMemoryManagerExtension

    _amm_users -= 1
    if _amm_users == 0:
        ActiveMemoryManagerExtension._find_recipient = _amm_original


class SiteGuard:
    """An active site guard on one cluster; a context manager. Made by :func:`guard_sites`.

    Attributes
    ----------
    sites
        Site name to worker resource.
    enforce
        Whether the guard pins, refuses and blocks (False: it only audits).
    """

    def __init__(self, client: Client, sites: Mapping[str, str], *, enforce: bool) -> None:
        self.client = client
        self.sites = dict(sites)
        self.enforce = enforce
        self._config: Any = None
        self._final: Audit | None = None

    def __enter__(self) -> SiteGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("enforcing" if self.enforce else "auditing")
        return f"<SiteGuard {state} sites={self.sites}>"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._final is not None

    def audit(self) -> Audit:
        """Collect the audit: every key that reached a worker without being computed there, and the refusals.

        Returns
        -------
        Audit
            ``.records`` (key, worker, worker's site, key's site, how it arrived), ``.violations`` (the records
            whose key left its site, model weights aside) and ``.refusals``. After :meth:`close`, the audit
            collected when the guard closed.
        """
        if self._final is not None:
            return self._final
        notes = []
        for address, found in self.client.run(_worker_notes, on_error="return").items():
            if isinstance(found, list):
                notes += found
            else:  # a worker leaving now: its notes already went to the scheduler as events
                logger.info("site audit: worker %s did not answer (%r); using the notes it sent", address, found)
        snapshot = self.client.run_on_scheduler(_scheduler_audit, notes=notes)
        return audit_from(snapshot)

    def close(self) -> Audit:
        """Collect the final audit, uninstall the plugins and restore the rechunk and shuffle settings.

        Returns
        -------
        Audit
            The final audit (also what :meth:`audit` returns from then on). Closing twice returns it again.
        """
        if self._final is not None:
            return self._final
        try:
            final = self.audit()
        finally:
            try:
                self.client.run_on_scheduler(_uninstall)
                self.client.unregister_worker_plugin(TransferAudit.name)
            finally:
                if self._config is not None:
                    self._config.__exit__(None, None, None)
                    self._config = None
        self._final = final
        return final


def guard_sites(client: Client, sites: Mapping[str, str], *, enforce: bool = True) -> SiteGuard:
    """Keep every site's data on its own workers of ``client``'s cluster until the guard closes, and audit it.

    Parameters
    ----------
    client
        A :class:`distributed.Client` of the shared cluster.
    sites
        Site name to the worker resource that marks its workers, e.g. ``{"A": "site-A", "B": "site-B"}``. Start a
        site's workers with the resource in a large amount (``dask worker ADDRESS --resources site-A=1e6``) so that
        it never limits how many tasks run at once.
    enforce
        Keyword-only. True (default): pin tasks to their inputs' site, refuse crossings, make replicate, rebalance
        and retirement site-safe, switch rechunk and shuffle to task-based. False: only audit (what would Dask
        alone move?).

    Returns
    -------
    SiteGuard
        A context manager; ``.audit()`` collects the audit, ``.close()`` uninstalls the guard.

    Raises
    ------
    ConfigurationError
        ``sites`` is empty, not a mapping of names to resource names, or names one resource twice.
    ClusterError
        A site has no worker, a worker advertises two sites' resources, or a guard is already active on the
        cluster.

    Examples
    --------
    On a cluster whose workers belong to sites (not run as a doctest: it needs that cluster):

    >>> with guard_sites(client, {"A": "site-A", "B": "site-B"}) as guard:  # doctest: +SKIP
    ...     a = client.persist(images_a, resources={"site-A": 1})
    ...     means = a.mean(axis=(1, 2)).compute()  # runs on site A's workers, pinned by its inputs
    >>> guard.audit().violations  # doctest: +SKIP
    ()
    """
    sites = _check_sites(sites)
    if not isinstance(enforce, bool):
        raise ConfigurationError(f"enforce must be True or False, got {enforce!r}")
    workers, active = client.run_on_scheduler(_cluster_sites)
    if active:
        raise ClusterError(
            "a site guard is already active on this cluster; close it (guard.close(), or leave its with-block) "
            "before starting another"
        )
    _check_workers(workers, sites)
    guard = SiteGuard(client, sites, enforce=enforce)
    client.register_plugin(SiteGuardPlugin(sites, enforce=enforce), name=SiteGuardPlugin.name)
    try:
        client.register_plugin(TransferAudit(sites, task_based=enforce), name=TransferAudit.name)
    except Exception:
        client.run_on_scheduler(_uninstall)
        raise
    if enforce:
        import dask

        guard._config = dask.config.set(TASK_BASED)
    return guard


def site_workers(client: Client, resource: str) -> list[str]:
    """The addresses of the workers that advertise ``resource`` (a site's workers), sorted.

    Parameters
    ----------
    client
        A :class:`distributed.Client`.
    resource
        The site's worker resource, e.g. ``"site-A"``.

    Returns
    -------
    list of str

    Raises
    ------
    ClusterError
        No worker advertises ``resource``; the message lists the resources the workers do advertise.
    """
    workers, _ = client.run_on_scheduler(_cluster_sites)
    found = sorted(address for address, resources in workers.items() if resource in resources)
    if not found:
        advertised = sorted({name for resources in workers.values() for name in resources})
        raise ClusterError(
            f"no worker advertises the resource {resource!r} (the workers advertise {advertised or 'none'}); "
            f"start the site's workers with: dask worker SCHEDULER --resources {resource}=1e6"
        )
    return found


def _check_sites(sites: Any) -> dict[str, str]:
    if not isinstance(sites, Mapping) or not sites:
        raise ConfigurationError(
            f"sites must map each site's name to the worker resource of its workers, got {sites!r}; "
            "pass e.g. sites={'A': 'site-A', 'B': 'site-B'}"
        )
    bad = {name: res for name, res in sites.items() if not (isinstance(name, str) and isinstance(res, str) and res)}
    if bad:
        raise ConfigurationError(f"sites must map names to resource names (strings), got {bad!r}")
    resources = list(sites.values())
    twice = sorted({resource for resource in resources if resources.count(resource) > 1})
    if twice:
        raise ConfigurationError(f"sites name the resource(s) {twice} for more than one site; give each site its own")
    return dict(sites)


def _check_workers(workers: Mapping[str, Mapping[str, Any]], sites: Mapping[str, str]) -> None:
    both = {a: sorted(s for s, r in sites.items() if r in res) for a, res in workers.items()}
    both = {a: found for a, found in both.items() if len(found) > 1}
    if both:
        raise ClusterError(f"workers advertise the resources of several sites: {both}; a worker belongs to one site")
    empty = [site for site, resource in sites.items() if not any(resource in res for res in workers.values())]
    if empty:
        raise ClusterError(
            f"site(s) {empty} have no worker: no worker advertises "
            f"{[sites[site] for site in empty]}; start each site's workers with: "
            f"dask worker SCHEDULER --resources {sites[empty[0]]}=1e6"
        )


def _cluster_sites(dask_scheduler: Any) -> tuple[dict[str, dict[str, Any]], bool]:
    """(worker address -> resources, whether a guard is active), run on the scheduler."""
    workers = {address: dict(ws.resources) for address, ws in dask_scheduler.workers.items()}
    return workers, SiteGuardPlugin.name in dask_scheduler.plugins


def _worker_notes(dask_worker: Any) -> list[dict[str, Any]]:
    """The audit notes of one worker, run on each worker."""
    plugin = dask_worker.plugins.get(TransferAudit.name)
    return list(plugin.records) if plugin is not None else []


def _scheduler_audit(dask_scheduler: Any, notes: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the workers' notes into the guard's log and return its snapshot, run on the scheduler."""
    plugin = dask_scheduler.plugins.get(SiteGuardPlugin.name)
    if plugin is None:
        raise ClusterError("no site guard is active on this cluster (it was closed, or the scheduler restarted)")
    for note in notes:
        plugin.log.receive(note)
    return plugin.log.snapshot()


def _uninstall(dask_scheduler: Any) -> None:
    """Restore what the guard changed and remove its plugin, run on the scheduler."""
    plugin = dask_scheduler.plugins.get(SiteGuardPlugin.name)
    if plugin is not None:
        plugin.restore()
        dask_scheduler.remove_plugin(SiteGuardPlugin.name)
