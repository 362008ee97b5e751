"""Training curves: one run's loss, AUROC, learning rate and throughput per epoch, or several runs side by side.

A run is a :class:`~dask_dl.TrainingRun` or its ``history`` table (also one read back from
``checkpoint_dir/history.parquet``), so anything that holds runs (a sweep's trials) hands them over as a list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from dask_dl.errors import ConfigurationError, DatasetError
from dask_dl.interpretation.figures import pyplot

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["compare", "plot_run"]

#: history events drawn as vertical lines: where training went on after a lost trainer or a resume
MARKS = {"restarted": ("tab:red", "--"), "resumed": ("tab:gray", ":")}


def plot_run(run: Any) -> Figure:
    """Loss, validation AUROC, learning rate and images/s per epoch of one run, restarts and resumes marked.

    Parameters
    ----------
    run
        A :class:`~dask_dl.TrainingRun` (also ``run.plot()``) or its history table.

    Returns
    -------
    matplotlib.figure.Figure
    """
    name, history = _history(run, "run")
    fig, axes = pyplot("dask_dl run plots").subplots(2, 2, figsize=(10, 6.5), sharex=True)
    (loss, auc), (lr, speed) = axes
    loss.plot(history["epoch"], history["train_loss"], "o-", label="train")
    loss.plot(history["epoch"], history["val_loss"], "o-", label="validation")
    loss.set(ylabel="loss", title="loss")
    for column in [c for c in history.columns if c.startswith("val_auroc_") and c != "val_auroc_mean"]:
        auc.plot(history["epoch"], history[column], lw=0.8, alpha=0.35, label="_" + column)
    auc.plot(history["epoch"], history["val_auroc_mean"], "o-", color="black", label="mean (one line per label)")
    auc.set(ylabel="AUROC", title="validation AUROC")
    _optional(lr, history, "lr", "learning rate")
    _optional(speed, history, "images_per_s", "images/s")
    for ax in axes.flat:
        _mark_events(ax, history)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("epoch")
    fig.suptitle(name)
    fig.tight_layout()
    return fig


def compare(runs: Sequence[Any] | Mapping[str, Any], *, metric: str = "val_auroc_mean") -> Figure:
    """Curves of several runs on one figure: ``metric`` and the validation loss per epoch, one line per run.

    Parameters
    ----------
    runs
        :class:`~dask_dl.TrainingRun` objects or their history tables, as a list (named by their ``run_id``,
        else ``run 0``, ``run 1``...) or a ``{name: run}`` mapping.
    metric
        The history column of the first panel.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    ConfigurationError
        No run, or a history without ``metric`` (the message lists its columns).

    Examples
    --------
    >>> dask_dl.compare({"no compression": run_a, "1-bit": run_b})  # doctest: +SKIP
    """
    named = list(runs.items()) if isinstance(runs, Mapping) else [(None, run) for run in runs]
    if not named:
        raise ConfigurationError("compare needs at least one run: pass [run_a, run_b] or {'name': run}")
    fig, (first, second) = pyplot("dask_dl.compare").subplots(1, 2, figsize=(11, 4))
    for i, (given, run) in enumerate(named):
        name, history = _history(run, given or f"run {i}")
        if metric not in history.columns:
            raise ConfigurationError(
                f"{name} has no {metric!r} in its history; its columns are {list(history.columns)}: pass metric=..."
            )
        (line,) = first.plot(history["epoch"], history[metric], "o-", label=name)
        second.plot(history["epoch"], history["val_loss"], "o-", color=line.get_color(), label=name)
        second.plot(history["epoch"], history["train_loss"], ":", color=line.get_color(), label="_train " + name)
    first.set(xlabel="epoch", ylabel=metric, title=metric)
    second.set(xlabel="epoch", ylabel="loss", title="validation loss (dotted: training)")
    first.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _history(run: Any, default: str) -> tuple[str, pd.DataFrame]:
    """A run's name and its history without epochs stopped part way (their validation is missing)."""
    history = run.history if hasattr(run, "history") else run
    if not isinstance(history, pd.DataFrame):
        raise ConfigurationError(f"a run must be a TrainingRun or its history DataFrame; got {type(run).__name__}")
    missing = [c for c in ("epoch", "train_loss", "val_loss", "val_auroc_mean") if c not in history.columns]
    if history.empty or missing:
        raise DatasetError(
            f"{getattr(run, 'run_id', default)} has no epoch to draw yet"
            + (f" (its history lacks {missing})" if missing and not history.empty else "")
            + ": wait until an epoch has finished"
        )
    if "event" in history.columns:
        history = history[history["event"].fillna("") != "stopped"]
    return str(getattr(run, "run_id", default)), history.reset_index(drop=True)


def _optional(ax: Any, history: pd.DataFrame, column: str, title: str) -> None:
    if column in history.columns and np.isfinite(history[column].to_numpy(np.float64)).any():
        ax.plot(history["epoch"], history[column], "o-")
    else:
        ax.text(0.5, 0.5, f"no {title} recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set(ylabel=title, title=title)


def _mark_events(ax: Any, history: pd.DataFrame) -> None:
    if "event" not in history.columns:
        return
    for event, (color, style) in MARKS.items():
        for i, epoch in enumerate(history.loc[history["event"] == event, "epoch"]):
            ax.axvline(epoch - 0.5, color=color, ls=style, lw=1, label=event if i == 0 else "_" + event)
