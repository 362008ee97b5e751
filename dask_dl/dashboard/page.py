"""The Bokeh document of the dask_dl page: a comparison of every run, then one panel per run.

The document lives in the scheduler's Bokeh server, like every page of the Dask dashboard, and reads the runs
the scheduler keeps once a second (:func:`~dask_dl.dashboard.events.scheduler_runs`), redrawing what changed.
Each run is checked (:func:`~dask_dl.dashboard.events.check_run`) and drawn on its own: a malformed run shows
its problems in a red box in its panel and is left out of the comparison, and every other run is drawn as usual.

Figures use Bokeh's SVG backend, so axis labels, tick values and bar values are text a browser (and a test)
can read.
"""

from __future__ import annotations

import html
import logging
import math
from typing import Any

from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, Div, FactorRange, HoverTool, Range1d
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from dask_dl.dashboard.events import check_run, scheduler_runs

logger = logging.getLogger("dask_dl.dashboard")

TITLE = "dask_dl training runs"
_STATUS_COLORS = {"running": "#1f77b4", "finished": "#2ca02c", "stopped": "#ff7f0e", "failed": "#d62728"}
_FIGURE = {"output_backend": "svg", "toolbar_location": "above", "tools": "pan,box_zoom,reset,save"}
_WIDTH = 330
_STYLE = """<style>
.ddl-facts{border-collapse:collapse;font-size:13px}
.ddl-facts th,.ddl-facts td{border:1px solid #ddd;padding:2px 6px;text-align:right;white-space:nowrap}
.ddl-facts th{background:#f5f5f5;font-weight:600}
.ddl-error{border:2px solid #d62728;background:#fdecea;color:#8a1c1c;padding:6px 10px;border-radius:4px;
 font-size:13px;max-width:640px}
</style>"""


def dashboard_doc(scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    """Fill ``doc`` with the full dask_dl page, inside the Dask dashboard's template (its menu on top)."""
    fill_document(doc, RunsPage(lambda: scheduler_runs(scheduler)), TITLE, extra)


def individual_doc(scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    """Fill ``doc`` with the dask_dl page alone, for JupyterLab's Dask panel (which adds no menu)."""
    fill_document(doc, RunsPage(lambda: scheduler_runs(scheduler)), TITLE)


def fill_document(doc: Any, page: Any, title: str, extra: dict[str, Any] | None = None) -> None:
    """Show ``page`` (its ``root``, redrawn by its ``update`` every second) in the Bokeh document ``doc``.

    With ``extra`` (the dashboard's template variables) the page sits inside the Dask dashboard's template, its
    menu on top; without, it stands alone, as JupyterLab's Dask panels want it.
    """
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    page.update()
    doc.title = f"Dask: {title}"
    doc.add_root(page.root)
    doc.add_periodic_callback(page.update, 1000)
    if extra is not None:
        doc.template = env.get_template("simple.html")
        doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


class RunsPage:
    """The page's models, redrawn by :meth:`update` from ``source``, which returns ``(version, {run_id: run})``."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self._seen: Any = None
        self.panels: dict[str, RunPanel] = {}
        self.empty = Div(text="<p>No runs yet: start one with <code>dask_dl.fit(...)</code>.</p>")
        self.comparison = Comparison()
        self.grid = column()
        header = Div(text=f"{_STYLE}<h2 style='margin:4px 0'>{TITLE}</h2>")
        self.root = column(header, self.empty, self.comparison.root, self.grid)

    def update(self) -> None:
        """Redraw what changed since the last call (nothing when the version is the same)."""
        version, runs = self._source()
        if version == self._seen:
            return
        self._seen = version
        runs = dict(runs)  # the scheduler's store goes on changing; this call draws one moment of it
        problems = {run_id: check_run(run) for run_id, run in runs.items()}
        new = [run_id for run_id in runs if run_id not in self.panels]
        gone = [run_id for run_id in self.panels if run_id not in runs]  # beyond dask-dl.dashboard.max-runs
        for run_id in new:
            self.panels[run_id] = RunPanel(run_id)
        for run_id in gone:
            del self.panels[run_id]
            self.comparison.remove(run_id)
        for run_id, run in runs.items():
            self.panels[run_id].update(run, problems[run_id])
        self.comparison.update(runs, problems)
        self.empty.visible = not runs
        self.comparison.root.visible = bool(runs)
        if new or gone:  # newest first, two runs side by side
            panels = [self.panels[run_id].root for run_id in reversed(runs)]
            self.grid.children = [row(*panels[i : i + 2]) for i in range(0, len(panels), 2)]


class RunPanel:
    """One run: its facts, loss and mean AUROC curves per epoch, and the per-label AUROC of the latest epoch."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._last: Any = None
        self.facts = Div(text=_heading(run_id, "?"))
        self.error = Div(visible=False)
        self.curves = ColumnDataSource({"epoch": [], "train_loss": [], "val_loss": [], "val_auroc_mean": []})
        self.labels = ColumnDataSource({"label": [], "auroc": [], "text_at": [], "text": []})

        self.plots: Any = None  # the figures, made when the run is first drawn (a malformed run needs none)
        self.root = column(self.facts, self.error, styles={"margin": "0 24px 24px 0"})

    def _make_plots(self) -> None:
        self.loss = figure(title="loss", width=_WIDTH, height=230, x_axis_label="epoch", y_axis_label="loss", **_FIGURE)
        for key, color, name in (("train_loss", "#1f77b4", "train"), ("val_loss", "#ff7f0e", "validation")):
            self.loss.line("epoch", key, source=self.curves, color=color, line_width=2, legend_label=name)
            self.loss.scatter("epoch", key, source=self.curves, color=color, size=5, legend_label=name)
        self.loss.legend.location = "top_right"
        self.loss.add_tools(HoverTool(tooltips=[("epoch", "@epoch"), ("train", "@train_loss"), ("val", "@val_loss")]))

        self.auroc = figure(
            title="mean AUROC (validation)",
            width=_WIDTH,
            height=230,
            x_axis_label="epoch",
            y_axis_label="mean AUROC",
            y_range=Range1d(0, 1),
            **_FIGURE,
        )
        self.auroc.line("epoch", "val_auroc_mean", source=self.curves, color="#2ca02c", line_width=2)
        self.auroc.scatter("epoch", "val_auroc_mean", source=self.curves, color="#2ca02c", size=5)
        self.auroc.add_tools(HoverTool(tooltips=[("epoch", "@epoch"), ("mean AUROC", "@val_auroc_mean")]))

        self.per_label = figure(
            title="per-label AUROC, latest epoch",
            width=2 * _WIDTH,
            height=120,
            x_axis_label="AUROC",
            x_range=Range1d(0, 1.12),
            y_range=FactorRange(),
            **_FIGURE,
        )
        self.per_label.hbar(y="label", right="auroc", height=0.7, source=self.labels, color="#9467bd")
        values = self.per_label.text(x="text_at", y="label", text="text", source=self.labels, x_offset=4)
        values.glyph.text_baseline = "middle"
        values.glyph.text_font_size = "11px"
        self.per_label.visible = False
        for fig in (self.loss, self.auroc):
            fig.xaxis.ticker.min_interval = 1  # whole epochs
        self.plots = column(row(self.loss, self.auroc), self.per_label)
        self.root.children.append(self.plots)

    def update(self, run: dict[str, Any], problems: list[str]) -> None:
        """Draw ``run`` (its folded state); with ``problems``, an error box instead of the curves."""
        if run == self._last:
            return
        self._last = dict(run)  # a copy: the scheduler's store updates the run in place
        try:
            if problems:
                raise _Malformed(problems)
            if self.plots is None:
                self._make_plots()
            self._draw(run)
            self.error.visible = False
            self.plots.visible = True
        except Exception as exc:  # a run's problem stays in its panel: the page and the other runs go on
            if not isinstance(exc, _Malformed):
                logger.warning("dask_dl dashboard: cannot draw run %s", self.run_id, exc_info=True)
                problems = [f"{type(exc).__name__}: {exc}"]
            status = run.get("status") if isinstance(run, dict) and isinstance(run.get("status"), str) else "?"
            self.facts.text = _heading(self.run_id, status)
            self.error.text = _error_box(self.run_id, problems)
            self.error.visible = True
            if self.plots is not None:
                self.plots.visible = False

    def _draw(self, run: dict[str, Any]) -> None:
        history = run.get("history") or []
        self.facts.text = _heading(self.run_id, run["status"]) + _facts(run)
        self.curves.data = {
            "epoch": [entry["epoch"] + 1 for entry in history],  # completed epochs, as the run's view counts them
            "train_loss": [_num(entry.get("train_loss")) for entry in history],
            "val_loss": [_num(entry.get("val_loss")) for entry in history],
            "val_auroc_mean": [_num(entry.get("val_auroc_mean")) for entry in history],
        }
        epoch, aurocs = _latest_aurocs(history)
        if aurocs:
            names = list(aurocs)
            self.per_label.y_range.factors = names[::-1]  # first label on top
            self.per_label.height = 70 + 22 * len(names)
            self.per_label.title.text = f"per-label AUROC, epoch {epoch + 1}"
            self.labels.data = {
                "label": names,
                "auroc": [_num(v) for v in aurocs.values()],
                "text_at": [0.0 if math.isnan(_num(v)) else v for v in aurocs.values()],  # "n/a" where none
                "text": [_fmt(v, ".3f") for v in aurocs.values()],
            }
        self.per_label.visible = bool(aurocs)


class Comparison:
    """Every run side by side: a table of their latest figures and their curves in shared axes."""

    def __init__(self) -> None:
        self.table = Div()
        self.sources: dict[str, ColumnDataSource] = {}
        opts = {"width": 520, "height": 260, "x_axis_label": "epoch", **_FIGURE}
        self.loss = figure(title="train loss, all runs", y_axis_label="train loss", **opts)
        self.auroc = figure(title="mean AUROC, all runs", y_axis_label="mean AUROC", y_range=Range1d(0, 1), **opts)
        for fig in (self.loss, self.auroc):
            fig.xaxis.ticker.min_interval = 1  # whole epochs
        self.error = Div(visible=False)
        self.root = column(self.table, self.error, row(self.loss, self.auroc), visible=False)

    def update(self, runs: dict[str, dict[str, Any]], problems: dict[str, list[str]]) -> None:
        """Redraw the table and the shared curves; malformed runs are named in the table only."""
        failed = []
        for run_id, run in runs.items():
            if problems[run_id]:
                continue
            try:
                if run_id not in self.sources:
                    self._add(run_id)
                history = run.get("history") or []
                self.sources[run_id].data = {
                    "epoch": [entry["epoch"] + 1 for entry in history],
                    "train_loss": [_num(entry.get("train_loss")) for entry in history],
                    "val_auroc_mean": [_num(entry.get("val_auroc_mean")) for entry in history],
                }
            except Exception as exc:  # this run's curves only; the table and the other runs go on
                logger.warning("dask_dl dashboard: cannot draw run %s in the comparison", run_id, exc_info=True)
                failed.append(f"{run_id}: {type(exc).__name__}: {exc}")
        self.table.text = _comparison_table(runs, problems)
        self.error.text = _error_box("the comparison", failed) if failed else ""
        self.error.visible = bool(failed)

    def remove(self, run_id: str) -> None:
        """Take a run's curves out of the shared figures."""
        source = self.sources.pop(run_id, None)
        for fig in (self.loss, self.auroc):
            fig.renderers = [r for r in fig.renderers if getattr(r, "data_source", None) is not source]
            for legend in fig.legend:
                legend.items = [item for item in legend.items if all(r in fig.renderers for r in item.renderers)]

    def _add(self, run_id: str) -> None:
        color = Category10_10[len(self.sources) % len(Category10_10)]
        source = self.sources[run_id] = ColumnDataSource({"epoch": [], "train_loss": [], "val_auroc_mean": []})
        for fig, key in ((self.loss, "train_loss"), (self.auroc, "val_auroc_mean")):
            fig.line("epoch", key, source=source, color=color, line_width=2, legend_label=run_id)
            fig.scatter("epoch", key, source=source, color=color, size=4, legend_label=run_id)
            fig.legend.click_policy = "hide"  # click a run's name to hide its curve
            fig.legend.label_text_font_size = "11px"
        self.auroc.legend.location = "bottom_right"


class _Malformed(Exception):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


# ---- the text parts ------------------------------------------------------------------------------------------


def _heading(run_id: str, status: str) -> str:
    color = _STATUS_COLORS.get(status, "#555")
    return (
        f"<h3 style='margin:4px 0'>{html.escape(run_id)} "
        f"<span style='color:{color};font-weight:normal'>{html.escape(status)}</span></h3>"
    )


def _facts(run: dict[str, Any]) -> str:
    cells = {
        "model": html.escape(str(run.get("model", ""))),
        "compression": html.escape(str(run.get("compression", ""))),
        "trainers": _fmt(run.get("trainers")),
        "epoch": _of(run.get("epoch"), run.get("epochs"), one_based=True),
        "step": _of(run.get("step"), run.get("steps_per_epoch")),
        "global batch": _fmt(_global_batch(run)),
        "loss": _fmt(run.get("loss"), ".4g"),
        "images/s": _fmt(run.get("images_per_s"), ",.1f"),
        "data wait": _percent(run.get("data_wait_share")),
        "bytes sent": _bytes(run.get("bytes_sent")),
        "vs fp32": _vs_fp32(run.get("bytes_sent"), run.get("bytes_uncompressed")),
    }
    table = (
        "<table class='ddl-facts'><tr>"
        + "".join(f"<th>{k}</th>" for k in cells)
        + "</tr><tr>"
        + "".join(f"<td>{v}</td>" for v in cells.values())
        + "</tr></table>"
    )
    if run.get("error"):
        table += f"<div class='ddl-error'>{html.escape(str(run['error']))}</div>"
    return table


def _comparison_table(runs: dict[str, dict[str, Any]], problems: dict[str, list[str]]) -> str:
    head = ("run", "status", "model", "compression", "epoch", "global batch", "images/s", "data wait", "vs fp32")
    head += ("train loss", "mean AUROC")
    lines = ["<table class='ddl-facts'><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for run_id, run in reversed(runs.items()):
        try:
            cells = _comparison_row(run_id, run) if not problems[run_id] else None
        except Exception as exc:  # one run's row; the table goes on
            logger.warning("dask_dl dashboard: cannot show run %s in the table", run_id, exc_info=True)
            problems = {**problems, run_id: [f"{type(exc).__name__}: {exc}"]}
            cells = None
        if cells is None:
            cells = [html.escape(run_id), "<span style='color:#d62728'>malformed: see its panel</span>"]
            cells += [""] * (len(head) - 2)
        lines.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "<h3 style='margin:4px 0'>runs side by side</h3>" + "".join(lines) + "</table>"


def _comparison_row(run_id: str, run: dict[str, Any]) -> list[str]:
    last = (run.get("history") or [{}])[-1]
    status = run["status"]
    return [
        html.escape(run_id),
        f"<span style='color:{_STATUS_COLORS.get(status, '#555')}'>{html.escape(status)}</span>",
        html.escape(str(run.get("model", ""))),
        html.escape(str(run.get("compression", ""))),
        _of(run.get("epoch"), run.get("epochs"), one_based=True),
        _fmt(_global_batch(run)),
        _fmt(run.get("images_per_s"), ",.1f"),
        _percent(run.get("data_wait_share")),
        _vs_fp32(run.get("bytes_sent"), run.get("bytes_uncompressed")),
        _fmt(last.get("train_loss"), ".4g"),
        _fmt(last.get("val_auroc_mean"), ".3f"),
    ]


def _error_box(what: str, problems: list[str]) -> str:
    items = "".join(f"<li>{html.escape(p)}</li>" for p in problems)
    return (
        f"<div class='ddl-error'><b>{html.escape(what)} cannot be drawn:</b><ul style='margin:4px 0'>{items}</ul>"
        "The other runs are not affected.</div>"
    )


def _latest_aurocs(history: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """The per-label AUROC of the latest epoch that has one (a stopped epoch has no validation)."""
    for entry in reversed(history):
        aurocs = {k.removeprefix("val_auroc_"): v for k, v in entry.items() if k.startswith("val_auroc_")}
        aurocs.pop("mean", None)
        if any(v is not None for v in aurocs.values()):
            return entry["epoch"], aurocs
    return -1, {}


def _global_batch(run: dict[str, Any]) -> Any:
    if run.get("global_batch") is not None:
        return run["global_batch"]
    history = run.get("history") or []
    return history[-1].get("global_batch") if history else None


def _num(value: Any) -> float:
    """A number for a figure: NaN (a gap) for what is missing or not finite, which would break the axes' range."""
    if value is None or not math.isfinite(value):
        return math.nan
    return float(value)


def _fmt(value: Any, spec: str = ",") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def _of(value: Any, total: Any, *, one_based: bool = False) -> str:
    if value is None:
        return "n/a"
    shown = _fmt(value + 1 if one_based else value)
    return f"{shown} / {_fmt(total)}" if total is not None else shown


def _percent(share: Any) -> str:
    return "n/a" if share is None else f"{100 * share:.1f}%"


def _bytes(n: Any) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} GB"


def _vs_fp32(sent: Any, fp32: Any) -> str:
    """Bytes sent over what an uncompressed fp32 exchange would have sent (n/a when the run does not say)."""
    if sent is None or not fp32:
        return "n/a"
    return f"{100 * sent / fp32:.1f}% of {_bytes(fp32)}"
