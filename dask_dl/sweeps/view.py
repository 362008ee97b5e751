"""What a sweep looks like: one curve of the metric per trial (pruned ones marked), and the notebook's HTML.

Both draw from ``Sweep.results`` alone, so they show a finished sweep read back from its storage as they show a
live one.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import TYPE_CHECKING

import pandas as pd

from dask_dl.interpretation.figures import pyplot

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["plot_trials", "results_html"]

#: state -> (colour, line style) of a trial's curve
STYLES = {
    "complete": ("tab:blue", "-"),
    "running": ("tab:green", "-"),
    "pruned": ("tab:gray", "--"),
    "failed": ("tab:red", ":"),
    "stopped": ("tab:orange", ":"),
}


def plot_trials(results: pd.DataFrame, *, metric: str, best: int | None = None) -> Figure:
    """The metric per epoch of every trial; pruned trials dashed and ended with an x, the best one thick."""
    fig, ax = pyplot("dask_dl sweep plots").subplots(figsize=(7, 4))
    seen: set[str] = set()
    for _, row in results.iterrows():
        curve = row[metric]
        if not curve:
            continue
        colour, style = STYLES.get(row["state"], ("black", "-"))
        label = row["state"] if row["state"] not in seen else None
        seen.add(row["state"])
        epochs = list(range(1, len(curve) + 1))
        width = 3 if row["number"] == best else 1.2
        ax.plot(epochs, curve, style, color=colour, lw=width, marker="o", ms=3, label=label)
        if row["state"] == "pruned":
            ax.plot(epochs[-1], curve[-1], "x", color="black", ms=8)
        ax.annotate(str(row["number"]), (epochs[-1], curve[-1]), fontsize=7, xytext=(3, 0), textcoords="offset points")
    ax.set(
        xlabel="epochs trained",
        ylabel=metric,
        title=f"{metric} per trial" + (f" (best: {best})" if best is not None else ""),
    )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    if seen:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, dict):
        return html.escape(", ".join(f"{k}={_cell(v)}" for k, v in value.items()))
    return html.escape("" if value is None else str(value))


def results_html(results: pd.DataFrame, *, metric: str, title: str, best: int | None = None) -> str:
    """The sweep's table (params, state, best metric, epochs, seconds, error) and its curves as one HTML block."""
    import matplotlib.pyplot as plt

    columns = ["number", "state", "params", "best", "epochs", "seconds", "error"]
    head = "".join(f"<th>{c}</th>" for c in columns)
    body = "".join(
        ("<tr style='font-weight:bold'>" if row["number"] == best else "<tr>")
        + "".join(f"<td>{_cell(row[c])}</td>" for c in columns)
        + "</tr>"
        for _, row in results.iterrows()
    )
    image = ""
    if len(results) and any(len(c) for c in results[metric]):
        fig = plot_trials(results, metric=metric, best=best)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=80)
        plt.close(fig)
        data = base64.b64encode(buffer.getvalue()).decode("ascii")
        image = f"<img alt='{html.escape(metric)} per trial' src='data:image/png;base64,{data}'>"
    return (
        f"<div><b>{html.escape(title)}</b><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        f"{image}</div>"
    )
