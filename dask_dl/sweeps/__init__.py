"""Sweeps: :func:`sweep` searches ``fit``'s options with Optuna (on the client, ask-and-tell), trials side by side
on disjoint groups of workers, losers pruned from their per-epoch history, the study resumable from its storage.

Modules: :mod:`~dask_dl.sweeps.space` (the space, checked against ``fit``; its YAML form),
:mod:`~dask_dl.sweeps.choices` (samplers and pruners by name), :mod:`~dask_dl.sweeps.study` (storage and resume),
:mod:`~dask_dl.sweeps.scheduler` (trials on worker groups), :mod:`~dask_dl.sweeps.run` (``sweep`` and
:class:`Sweep`), :mod:`~dask_dl.sweeps.view` (table and curves), :mod:`~dask_dl.sweeps.command` (``dask-dl sweep``).
"""

from __future__ import annotations

from dask_dl.sweeps.run import Best, Sweep, sweep

__all__ = ["Best", "Sweep", "sweep"]
