"""The coordinator's two moves, on any site: a training visit (built on :func:`dask_dl.fit`) and an evaluation.

A :class:`Coordinator` holds the connected sites, the run's training options and the ledger of what it received
(:class:`~dask_dl.sites.transfers.Transfers`). :meth:`Coordinator.visit` trains on one site from given weights
with ``fit_visit(..., start_state=, proximal_mu=, workers=, weights_only=True)`` (:func:`~dask_dl.train.run.fit`
with a visit's options) and brings back the new weights and the visit's history rows;
:meth:`Coordinator.visit_many` runs several visits at once (sites in parallel, sharing a cluster's workers in waves
when they must); :meth:`Coordinator.evaluate` scores weights on every site's validation split with a task on that
site (:func:`dask_dl.sites.score.score`) and on the pooled test split. A site that fails is marked lost and
reported; the protocol decides what follows.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dask_dl.cluster.workers import scheduler_workers
from dask_dl.errors import ConfigurationError, DatasetError
from dask_dl.sites.score import ModelSpec, score
from dask_dl.sites.site import Connected
from dask_dl.sites.transfers import Transfers

__all__ = ["Coordinator", "Visit", "VisitPlan"]

logger = logging.getLogger("dask_dl.sites")


@dataclass(frozen=True)
class VisitPlan:
    """One visit to ask for: the site, the weights to start from and how long and how fast to train."""

    site: Connected
    state: dict[str, Any] | None
    epochs: int = 1
    steps: int | None = None  #: train this many steps (a slice of the site's training samples), not epochs
    lr: float = 0.01
    mu: float = 0.0
    seed: int = 0


@dataclass
class Visit:
    """What came back from a visit: new weights and history rows, or why the site was lost."""

    site: Connected
    state: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    samples: int = 0
    steps: int = 0
    lr: float = 0.0
    seconds: float = 0.0
    workers: list[str] = field(default_factory=list)  #: the workers the visit trained on
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def train_loss(self) -> float:
        losses = [r["train_loss"] for r in self.rows if r.get("event") != "stopped"]
        return float(losses[-1]) if losses else float("nan")


class Coordinator:
    """Training visits and evaluations on the sites of one :func:`dask_dl.fit_sites` run."""

    def __init__(
        self,
        sites: list[Connected],
        *,
        model: ModelSpec,
        fit_options: dict[str, Any],
        trainers: int,
        transfers: Transfers,
        test: Any = None,
        test_client: Any = None,
    ) -> None:
        self.sites, self.model, self.fit_options, self.trainers = sites, model, dict(fit_options), trainers
        self.transfers, self.test, self.test_client = transfers, test, test_client
        self.stop_requested = threading.Event()
        #: the weights every protocol starts from (built once, seeded, on the coordinator)
        self.initial: dict[str, Any] | None = None
        #: the run's MLflow run (:class:`dask_dl.tracking.Tracker`): each visit is a run nested in it
        self.tracker: Any = None
        self._visits: dict[str, int] = {}
        self._active: list[Any] = []
        self._lock = threading.Lock()
        self._cursor: dict[str, int] = {}
        self._share_workers()

    @property
    def live(self) -> list[Connected]:
        return [s for s in self.sites if s.lost is None]

    def stop(self) -> None:
        """Stop the visits in progress (their trainers stop within a few steps) and start no more."""
        self.stop_requested.set()
        with self._lock:
            runs = list(self._active)
        for run in runs:
            run.stop()

    # ---- training visits ---------------------------------------------------------------------------------

    def visit(self, plan: VisitPlan) -> Visit:
        """Train on one site; see :meth:`visit_many`."""
        return self.visit_many([plan])[0]

    def visit_many(self, plans: list[VisitPlan]) -> list[Visit]:
        """Run the visits at once (in waves where sites share workers); a failed site comes back with ``error``."""
        results: dict[int, Visit] = {}
        for wave in self._waves(plans):
            started = []
            try:
                for i in wave:
                    started.append((i, *self._start(plans[i])))
            except BaseException:
                for _, run, _ in started:  # the visits already started would go on alone
                    if run is not None:
                        run.stop()
                raise
            for i, run, visit in started:
                results[i] = self._finish(plans[i], run, visit)
        return [results[i] for i in range(len(plans))]

    def _start(self, plan: VisitPlan) -> tuple[Any, Visit]:
        from dask_dl.train.run import fit_visit

        site = plan.site
        visit = Visit(site, lr=plan.lr)
        if self.stop_requested.is_set():
            visit.error = "stopped"
            return None, visit
        dataset = site.dataset if plan.steps is None else self._slice(site, plan.steps, plan.seed)
        tracking: Any = False  # an untracked cross-site run has untracked visits, whatever the environment says
        if self.tracker is not None:  # the visits of a site are its rounds, in every protocol
            n = self._visits[site.name] = self._visits.get(site.name, -1) + 1
            tracking = self.tracker.nested(
                f"{site.name} round {n}", tags={"dask_dl.site": site.name, "dask_dl.round": n}
            )
        try:
            run = fit_visit(
                dataset,
                epochs=plan.epochs,
                lr=plan.lr,
                seed=plan.seed,
                trainers=self.trainers,
                client=site.client,
                workers=site.workers,
                start_state=plan.state,
                proximal_mu=plan.mu,
                weights_only=True,
                view="none",
                wait=False,
                tracking=tracking,
                **self.fit_options,
            )
        except (ConfigurationError, DatasetError) as exc:  # the arguments or the site's data: the user's to fix
            raise type(exc)(f"site {site.name!r}: {exc}") from exc
        except Exception as exc:  # the site's cluster is gone, or refuses the work: reported, not raised
            visit.error = f"{type(exc).__name__}: {exc}"
            return None, visit
        with self._lock:
            self._active.append(run)
        visit.samples = len(run.options.train_samples)
        visit.workers = list(run.workers)
        visit.seconds = time.perf_counter()
        return run, visit

    def _finish(self, plan: VisitPlan, run: Any, visit: Visit) -> Visit:
        if run is None:
            return self._lost(visit)
        try:
            run.wait()
            if run.status == "stopped":
                visit.error = "stopped"
                return visit
            checkpoint = run.checkpoint()
            visit.state = self.transfers.receive(visit.site.name, "weights", checkpoint["model"])
        except Exception as exc:  # the site went away mid-visit
            visit.error = f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._active.remove(run)
        visit.rows = self.transfers.receive(visit.site.name, "metrics", run.history.to_dict("records"))
        visit.steps = int(sum(r.get("steps", 0) for r in visit.rows))
        visit.seconds = time.perf_counter() - visit.seconds
        return visit if visit.ok else self._lost(visit)

    def _lost(self, visit: Visit) -> Visit:
        if visit.error != "stopped" and not self.stop_requested.is_set():
            visit.site.lost = visit.error
            logger.warning("site %s was lost: %s", visit.site.name, visit.error)
        return visit

    def _slice(self, site: Connected, steps: int, seed: int) -> Any:
        """The site's dataset with ``steps`` global batches of its training samples (next in a seeded cycle)."""
        n = min(steps * int(self.fit_options["batch_size"]) * self.trainers, site.n_train)
        order = np.random.default_rng([seed, len(site.name)]).permutation(site.n_train)
        start = self._cursor.get(site.name, 0)
        take = np.take(order, np.arange(start, start + n), mode="wrap")
        self._cursor[site.name] = (start + n) % site.n_train
        keep = np.isin(site.dataset["sample"].values, np.concatenate([site.train_samples[take], site.val_samples]))
        return site.dataset.isel(sample=np.flatnonzero(keep))

    def _share_workers(self) -> None:
        """Sites of one shared cluster with no resource of their own get disjoint workers, as far as they go."""
        by_client: dict[int, list[Connected]] = {}
        for site in self.sites:
            if site.workers is None and not site.owns_client:
                by_client.setdefault(id(site.client), []).append(site)
        for group in by_client.values():
            if len(group) < 2:
                continue
            workers = sorted(scheduler_workers(group[0].client))
            slots = max(len(workers) // self.trainers, 1)
            for i, site in enumerate(group):
                slot = i % slots
                site.workers = workers[slot * self.trainers : (slot + 1) * self.trainers] or workers

    def _waves(self, plans: list[VisitPlan]) -> list[list[int]]:
        waves: list[list[int]] = []
        busy: list[set] = []
        for i, plan in enumerate(plans):
            site = plan.site
            needs = {(id(site.client), w) for w in site.workers} if site.workers else {(id(site.client), None)}
            for wave, taken in zip(waves, busy, strict=True):
                if not needs & taken:
                    wave.append(i)
                    taken |= needs
                    break
            else:
                waves.append([i])
                busy.append(set(needs))
        return waves

    # ---- evaluation --------------------------------------------------------------------------------------

    def evaluate(self, states: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Score ``states`` (a model, or an ensemble) on every live site's validation split and on the test split.

        Returns a dict of site name (and ``"test"``) to metrics, or to ``{"error": ...}`` for a site lost now.
        """
        futures = {}
        for site in self.live:
            try:
                futures[site.name] = site.client.submit(
                    score,
                    site.store,
                    site.val_samples,
                    states,
                    self.model,
                    workers=site.workers,
                    key=f"dask-dl-score-{site.name}-{uuid.uuid4().hex[:8]}",
                    pure=False,
                )
            except Exception as exc:  # a site gone since the visits
                futures[site.name] = exc
        out: dict[str, dict[str, Any]] = {}
        for site in self.live:
            future = futures[site.name]
            try:
                if isinstance(future, Exception):
                    raise future
                out[site.name] = self.transfers.receive(site.name, "metrics", future.result())
            except Exception as exc:
                site.lost = f"{type(exc).__name__}: {exc}"
                logger.warning("site %s was lost while scoring: %s", site.name, site.lost)
                out[site.name] = {"error": site.lost}
        if self.test is not None:
            out["test"] = self._score_test(states)
        return out

    def _score_test(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        store, samples = self.test
        if self.test_client is None:
            return score(store, samples, states, self.model)
        return self.test_client.submit(score, store, samples, states, self.model, pure=False).result()
