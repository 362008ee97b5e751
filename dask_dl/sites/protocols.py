"""The protocols of cross-site training, each a loop of visits and evaluations over a :class:`Coordinator`.

``ensemble``
    one model per site, trained at the same time, each from its own weights (Chang et al. 2018); the model is the
    mean of their probabilities.
``incremental``
    institutional incremental learning: train at each site in turn, epoch after epoch, until its validation AUROC
    has not improved for ``patience`` epochs (or ``rounds`` epochs passed), keep its best weights and pass them on;
    once round the sites. The model is the last site's best weights.
``cyclic``
    cyclical weight transfer: ``rounds`` cycles round the sites (fixed or reshuffled order), ``local_epochs``
    epochs or ``steps`` steps per visit, with Balachandar et al.'s options: steps proportional to site size, a
    cyclical learning rate (cosine from ``lr`` down to ``cyclic_lr * lr`` over each cycle), a site-weighted loss
    (each site's loss scaled by its share of the samples, applied as the equivalent scale of SGD's learning rate).
``fedavg`` / ``fedprox``
    every round each site trains ``local_epochs`` epochs from the global weights, in parallel; the new global
    weights are the sample-weighted average (:func:`dask_dl.sites.weights.average_weights`) of the sites that
    answered (at least ``min_sites``); ``fedprox`` adds ``mu/2 ||w - w_global||^2`` to each site's loss.

Every round ends with an evaluation of the round's model on every site's validation split and the test split; the
rows go to the run (its ``history``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dask_dl.errors import TrainingError
from dask_dl.sites.visits import Coordinator, Visit, VisitPlan
from dask_dl.sites.weights import average_weights

__all__ = ["PROTOCOLS", "Plan", "run_protocol"]

PROTOCOLS: tuple[str, ...] = ("ensemble", "incremental", "cyclic", "fedavg", "fedprox")
ORDERS: tuple[str, ...] = ("fixed", "shuffled")
ON_LOST: tuple[str, ...] = ("continue", "stop")


@dataclass(frozen=True)
class Plan:
    """The checked protocol options of a :func:`dask_dl.fit_sites` run."""

    protocol: str
    rounds: int
    local_epochs: int = 1
    steps: int | None = None
    order: str = "fixed"
    proportional_steps: bool = False
    cyclic_lr: float | None = None
    site_weighted_loss: bool = False
    mu: float = 0.0
    min_sites: int = 1
    on_lost: str = "continue"
    patience: int = 1
    lr: float = 0.01
    seed: int = 0


#: what a protocol reports to the run: ``report(round, visits, scores, state_or_states)``
Report = Callable[[int, list[Visit], dict[str, dict[str, Any]], Any], None]
#: what a protocol that finished names as its model when that is not the last round's: ``keep(round, state)``
Keep = Callable[[int, Any], None]


def run_protocol(plan: Plan, coordinator: Coordinator, report: Report, keep: Keep) -> str:
    """Run ``plan`` to its end; return its status. The weights of every round go to ``report`` as it ends.

    Status is ``finished``, ``stopped`` (by ``run.stop()``) or ``stopped-sites-lost`` (``on_lost="stop"``). The
    run's weights are those of the last round reported (none if stopped in the first), except that a finished
    ``incremental`` run hands over the last site's best round with ``keep``.
    """
    if plan.protocol == "incremental":
        return _incremental(plan, coordinator, report, keep)
    loop = {"ensemble": _ensemble, "cyclic": _cyclic}.get(plan.protocol, _fedavg)
    return loop(plan, coordinator, report)


def _seed(plan: Plan, round_: int, index: int) -> int:
    return plan.seed + 1000 * (round_ + 1) + index


def _check_lost(plan: Plan, coordinator: Coordinator, visits: list[Visit]) -> bool:
    """True when the run must stop: a site was lost and ``on_lost="stop"``, or no site is left."""
    lost = [v for v in visits if not v.ok and v.error != "stopped"]
    if not coordinator.live:
        raise TrainingError("every site was lost: " + "; ".join(f"{s.name}: {s.lost}" for s in coordinator.sites))
    return bool(lost) and plan.on_lost == "stop"


def _ensemble(plan: Plan, co: Coordinator, report: Report) -> str:
    states: dict[str, Any] = {s.name: co.initial for s in co.sites}
    for r in range(plan.rounds):
        sites = co.live
        plans = [
            VisitPlan(s, states[s.name], epochs=plan.local_epochs, lr=plan.lr, seed=_seed(plan, r, i))
            for i, s in enumerate(sites)
        ]
        visits = co.visit_many(plans)
        if co.stop_requested.is_set():
            return "stopped"
        for v in visits:
            if v.ok:
                states[v.site.name] = v.state
        members = _kept(states)
        report(r, visits, co.evaluate(members), members)
        if _check_lost(plan, co, visits):
            return "stopped-sites-lost"
    return "finished"


def _kept(states: dict[str, Any]) -> list[Any]:
    return [s for s in states.values() if s is not None]


def _incremental(plan: Plan, co: Coordinator, report: Report, keep: Keep) -> str:
    state, r, best_round = co.initial, 0, None
    for i, site in enumerate(list(co.sites)):
        best, best_auroc, since = state, -math.inf, 0
        for _ in range(plan.rounds):
            if site.lost is not None:
                break
            visit = co.visit(VisitPlan(site, state, epochs=1, lr=plan.lr, seed=_seed(plan, r, i)))
            if co.stop_requested.is_set():
                return "stopped"
            if visit.ok:
                state = visit.state
            scores = co.evaluate([state]) if state is not None else {}
            report(r, [visit], scores, state)
            r += 1
            if _check_lost(plan, co, [visit]):
                return "stopped-sites-lost"
            auroc = scores.get(site.name, {}).get("auroc_mean", math.nan)
            if visit.ok and np.isfinite(auroc) and auroc > best_auroc:
                best, best_auroc, best_round, since = state, auroc, r - 1, 0  # r - 1: the round just reported
            else:
                since += 1
                if since >= plan.patience:
                    break
        state = best  # the best weights of this site are passed on; the last site's are the model
    if best_round is not None:
        keep(best_round, state)
    return "finished"


def _cyclic(plan: Plan, co: Coordinator, report: Report) -> str:
    state = co.initial
    rng = np.random.default_rng(plan.seed)
    sizes = {s.name: s.n_train for s in co.sites}
    mean_size = float(np.mean(list(sizes.values())))
    for r in range(plan.rounds):
        order = list(co.sites)
        if plan.order == "shuffled":
            order = [order[k] for k in rng.permutation(len(order))]
        visits = []
        for k, site in enumerate(order):
            if site.lost is not None:
                continue  # skipped this cycle (and every later one)
            lr = plan.lr
            if plan.cyclic_lr is not None:  # cosine from lr down to cyclic_lr * lr over the cycle
                low = plan.cyclic_lr * plan.lr
                lr = low + (plan.lr - low) * (1 + math.cos(math.pi * k / len(order))) / 2
            if plan.site_weighted_loss:  # loss x n_site / mean n: for SGD the same step as lr x n_site / mean n
                lr *= sizes[site.name] / mean_size
            steps = plan.steps
            if steps is not None and plan.proportional_steps:
                steps = max(1, round(steps * sizes[site.name] / mean_size))
            index = co.sites.index(site)
            visit = co.visit(
                VisitPlan(
                    site,
                    state,
                    epochs=1 if steps else plan.local_epochs,
                    steps=steps,
                    lr=lr,
                    seed=_seed(plan, r, index),
                )
            )
            if co.stop_requested.is_set():
                return "stopped"
            visits.append(visit)
            if visit.ok:
                state = visit.state
            elif plan.on_lost == "stop":
                break
        report(r, visits, co.evaluate([state]) if state is not None else {}, state)
        if _check_lost(plan, co, visits):
            return "stopped-sites-lost"
    return "finished"


def _fedavg(plan: Plan, co: Coordinator, report: Report) -> str:
    state = co.initial
    mu = plan.mu if plan.protocol == "fedprox" else 0.0
    for r in range(plan.rounds):
        sites = co.live
        plans = [
            VisitPlan(s, state, epochs=plan.local_epochs, lr=plan.lr, mu=mu, seed=_seed(plan, r, i))
            for i, s in enumerate(sites)
        ]
        visits = co.visit_many(plans)
        if co.stop_requested.is_set():
            return "stopped"
        answered = [v for v in visits if v.ok]
        if len(answered) < plan.min_sites:
            lost = "; ".join(f"{v.site.name}: {v.error}" for v in visits if not v.ok)
            raise TrainingError(
                f"round {r}: only {len(answered)} of {len(visits)} sites answered, fewer than min_sites="
                f"{plan.min_sites} ({lost}); the weights of round {r - 1} are kept in run.state()"
            )
        state = average_weights([v.state for v in answered], [v.samples for v in answered])
        report(r, visits, co.evaluate([state]), state)
        if _check_lost(plan, co, visits):
            return "stopped-sites-lost"
    return "finished"
