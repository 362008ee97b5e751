"""Samplers and pruners by name: what ``sweep(sampler=..., pruner=...)`` and ``dask-dl sweep --pruner`` take.

Pruners see one intermediate value per epoch (step = the epoch's number), so their resources are epochs.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from dask_dl.errors import ConfigurationError

__all__ = ["PRUNERS", "SAMPLERS", "make_pruner", "make_sampler"]

SAMPLERS: tuple[str, ...] = ("tpe", "random", "grid")
PRUNERS: tuple[str, ...] = ("asha", "hyperband", "median", "none")


def _unknown(kind: str, value: Any, names: tuple[str, ...]) -> ConfigurationError:
    close = difflib.get_close_matches(str(value), names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigurationError(
        f"unknown {kind} {value!r}; {hint}pass one of {', '.join(names)} or an optuna.{kind}s object"
    )


def make_sampler(sampler: Any, space: Any, *, seed: int | None = None) -> Any:
    """Return an Optuna sampler for a name of :data:`SAMPLERS` (or the sampler given).

    ``grid`` walks every combination of a dict space's choices (categorical and integer distributions only).
    """
    import optuna
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(sampler, optuna.samplers.BaseSampler):
        return sampler
    if sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sampler != "grid":
        raise _unknown("sampler", sampler, SAMPLERS)
    if not isinstance(space, Mapping):
        raise ConfigurationError("sampler='grid' needs a dict space (its grid); a define-by-run space has none")
    grid: dict[str, list[Any]] = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            grid[key] = list(dist.choices)
        elif isinstance(dist, IntDistribution) and not dist.log:
            grid[key] = list(range(dist.low, dist.high + 1, dist.step))
        else:
            raise ConfigurationError(
                f"sampler='grid' takes choices and integer ranges, but space[{key!r}] is {dist!r}; list the values "
                f"to try: CategoricalDistribution([...])"
            )
    return optuna.samplers.GridSampler(grid, seed=seed)


def grid_size(sampler: Any) -> int | None:
    """The number of points of a grid sampler, None for other samplers."""
    import optuna

    if not isinstance(sampler, optuna.samplers.GridSampler):
        return None
    return len(sampler._all_grids)


def make_pruner(pruner: Any, *, epochs: int | None = None) -> Any:
    """Return an Optuna pruner for a name of :data:`PRUNERS` (or the pruner given).

    ``asha`` is successive halving with a reduction factor of 3 (asynchronous: at each rung, 1, 3, 9 ... epochs,
    a trial goes on only if it is in the best third of the trials that reached the rung so far; it never waits
    for the others); ``hyperband`` runs several such brackets over 1 to
    ``epochs`` epochs; ``median`` stops a trial below the median of earlier trials at the same epoch.
    """
    import optuna

    if isinstance(pruner, optuna.pruners.BasePruner):
        return pruner
    if pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    if pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=epochs or "auto", reduction_factor=3)
    if pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    if pruner in ("none", None):
        return optuna.pruners.NopPruner()
    raise _unknown("pruner", pruner, PRUNERS)
