"""Live views of a training run: an HTML view in notebooks, a progress bar in terminals, log lines in batch jobs.

A run hands :meth:`RunView.update` a *snapshot*, a plain dict describing where it is::

    {"run_id": "fit-3f2a", "status": "running", "model": "small_cnn", "compression": "onebit",
     "trainers": 2, "global_batch": 64, "epoch": 1, "epochs": 5, "step": 12, "steps_per_epoch": 40, "loss": 0.41,
     "images_per_s": 512.0, "data_wait_share": 0.02, "bytes_sent": 123456, "history": [row, ...]}

``history`` holds the finished epochs' rows (``val_auroc_<label>`` columns included). Every key is optional.
The notebook view redraws one output area through an IPython display handle, so it updates while the kernel runs
other cells; nothing here blocks.
"""

from __future__ import annotations

import html
import logging
import sys
from typing import Any

from dask_dl.checks import one_of

logger = logging.getLogger("dask_dl.train")

_COLUMNS = (
    ("epoch", "epoch"),
    ("train_loss", "train loss"),
    ("val_loss", "val loss"),
    ("val_auroc_mean", "AUROC"),
    ("images_per_s", "images/s"),
    ("data_wait_s", "data wait s"),
    ("bytes_sent", "bytes sent"),
)


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return html.escape(str(value))


def snapshot_html(snap: dict[str, Any]) -> str:
    """Return the HTML view of a run snapshot: status line, per-epoch table and the latest per-label AUROC."""
    history = snap.get("history") or []
    status = snap.get("status", "?")
    color = {"running": "#1f77b4", "finished": "#2ca02c", "stopped": "#ff7f0e", "failed": "#d62728"}.get(status, "#555")
    head = [f"<b>{_fmt(snap.get('run_id', 'run'))}</b>", f"<span style='color:{color}'>{_fmt(status)}</span>"]
    for key, label in (
        ("model", "model"),
        ("compression", "compression"),
        ("trainers", "trainers"),
        ("global_batch", "global batch"),
    ):
        if key in snap:
            head.append(f"{label} {_fmt(snap[key])}")
    if "epoch" in snap and "epochs" in snap:
        head.append(f"epoch {snap['epoch'] + 1}/{snap['epochs']}")
    if "step" in snap and "steps_per_epoch" in snap:
        head.append(f"step {snap['step']}/{snap['steps_per_epoch']}")
    for key, label in (("loss", "loss"), ("images_per_s", "images/s"), ("bytes_sent", "bytes sent")):
        if snap.get(key) is not None:
            head.append(f"{label} {_fmt(snap[key])}")
    if snap.get("data_wait_share") is not None:
        head.append(f"data wait {100 * snap['data_wait_share']:.1f}%")
    parts = ["<div class='dask-dl-run'>", "<p>" + " &middot; ".join(head) + "</p>"]
    if history:
        cols = [(k, t) for k, t in _COLUMNS if any(k in row for row in history)]
        parts.append("<table><tr>" + "".join(f"<th>{t}</th>" for _, t in cols) + "</tr>")
        for row in history[-10:]:
            parts.append("<tr>" + "".join(f"<td>{_fmt(row.get(k))}</td>" for k, _ in cols) + "</tr>")
        parts.append("</table>")
        last = history[-1]
        aurocs = {
            k[len("val_auroc_") :]: v for k, v in last.items() if k.startswith("val_auroc_") and k != "val_auroc_mean"
        }
        if aurocs:
            parts.append("<details><summary>per-label AUROC (last epoch)</summary><table>")
            parts.append("".join(f"<tr><td>{html.escape(k)}</td><td>{_fmt(v)}</td></tr>" for k, v in aurocs.items()))
            parts.append("</table></details>")
    if snap.get("error"):
        parts.append(f"<pre style='color:#d62728'>{html.escape(str(snap['error']))}</pre>")
    parts.append("</div>")
    return "".join(parts)


def detect_mode() -> str:
    """``"notebook"`` inside a Jupyter kernel, ``"terminal"`` on an interactive terminal, else ``"log"``."""
    shell = sys.modules.get("IPython") and getattr(sys.modules["IPython"], "get_ipython", lambda: None)()
    if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
        return "notebook"
    if sys.stderr is not None and sys.stderr.isatty():
        return "terminal"
    return "log"


class RunView:
    """Show a run's progress where the user is looking; ``mode`` is ``auto``, ``notebook``, ``terminal``,
    ``log`` or ``none``."""

    def __init__(self, mode: str = "auto") -> None:
        mode = one_of("view", mode, ("auto", "notebook", "terminal", "log", "none"))
        self.mode = detect_mode() if mode == "auto" else mode
        self._handle = None
        self._bar = None
        self._logged_epochs = 0

    def update(self, snap: dict[str, Any]) -> None:
        """Redraw the view for snapshot ``snap``."""
        if self.mode == "notebook":
            self._update_notebook(snap)
        elif self.mode == "terminal":
            self._update_terminal(snap)
        if self.mode in ("terminal", "log"):
            self._log_epochs(snap)

    def close(self) -> None:
        """Finish the view (closes the terminal progress bar)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _update_notebook(self, snap: dict[str, Any]) -> None:
        from IPython.display import HTML, display

        content = HTML(snapshot_html(snap))
        if self._handle is None:
            self._handle = display(content, display_id=True)
        else:
            self._handle.update(content)

    def _update_terminal(self, snap: dict[str, Any]) -> None:
        from tqdm.auto import tqdm

        total = (snap.get("epochs") or 0) * (snap.get("steps_per_epoch") or 0)
        if self._bar is None and total:
            self._bar = tqdm(total=total, desc=str(snap.get("run_id", "training")), unit="step", leave=True)
        if self._bar is None:
            return
        done = snap.get("epoch", 0) * (snap.get("steps_per_epoch") or 0) + snap.get("step", 0)
        self._bar.update(max(done - self._bar.n, 0))
        post = {}
        if snap.get("global_batch"):
            post["batch"] = str(snap["global_batch"])
        for key in ("loss", "images_per_s"):
            if snap.get(key) is not None:
                post[key] = f"{snap[key]:.4g}"
        history = snap.get("history") or []
        if history and history[-1].get("val_auroc_mean") is not None:
            post["auroc"] = f"{history[-1]['val_auroc_mean']:.3f}"
        if snap.get("data_wait_share") is not None:
            post["wait"] = f"{100 * snap['data_wait_share']:.0f}%"
        self._bar.set_postfix(post, refresh=True)

    def _log_epochs(self, snap: dict[str, Any]) -> None:
        history = snap.get("history") or []
        for row in history[self._logged_epochs :]:
            text = " ".join(f"{k}={_fmt(row[k])}" for k, _ in _COLUMNS if k in row)
            message = f"{snap.get('run_id', 'run')} {text}"
            if self._bar is not None:
                self._bar.write(message)
            else:
                logger.info(message)
        self._logged_epochs = len(history)
