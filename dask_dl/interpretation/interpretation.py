"""What a model gets right and wrong on a split: its worst images, ROC/PR and calibration curves, confusion.

:func:`interpret` scores the split with :func:`~dask_dl.predict` (a run or checkpoint is exported to a temporary
ONNX file first) and keeps the scores on the cluster. The worst images are found chunk by chunk
(:mod:`~dask_dl.interpretation.losses`); the curves gather the scores (images x labels floats), never the images.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import dask.array as da
import numpy as np
import pandas as pd

from dask_dl.checks import positive_int
from dask_dl.errors import ConfigurationError, DatasetError
from dask_dl.interpretation import curves
from dask_dl.interpretation.figures import label_names, pyplot
from dask_dl.interpretation.losses import per_label_losses, sample_losses, top_positions

if TYPE_CHECKING:  # pragma: no cover
    import xarray as xr
    from distributed import Client
    from matplotlib.figure import Figure

__all__ = ["Interpretation", "interpret"]

T = TypeVar("T")


def interpret(
    ds: xr.Dataset | str | os.PathLike,
    model: Any,
    *,
    split: str | None = "test",
    client: Client | None = None,
) -> Interpretation:
    """Score a split with a model over the cluster, to look at what it gets wrong.

    Parameters
    ----------
    ds
        A dataset from :func:`~dask_dl.open_dataset` (with labels), or the store's path.
    model
        A :class:`~dask_dl.TrainingRun`, a checkpoint (dict, ``epoch-NNNN.pt`` file or checkpoint directory) or an
        ``.onnx`` file from :func:`~dask_dl.export_onnx`. A run or checkpoint is exported to a temporary ONNX file
        on this machine, which the workers must be able to read; on a cluster that does not share this machine's
        disk, export it to shared storage first and pass the file.
    split
        Look at this split only (None: every image).
    client
        The cluster that scores; default the current client, else Dask's local scheduler.

    Returns
    -------
    Interpretation

    Raises
    ------
    DatasetError
        The dataset has no labels, lacks some of the model's labels, or has no image in ``split``.

    Examples
    --------
    >>> interp = dask_dl.interpret("cxr.zarr", run, split="test")  # doctest: +SKIP
    >>> interp.top_losses(5)  # doctest: +SKIP
    >>> interp.plot_roc().savefig("roc.png")  # doctest: +SKIP
    """
    from dask_dl.data.dataset import open_dataset
    from dask_dl.inference import predict
    from dask_dl.onnx_info import read_model_info

    ds = ds if hasattr(ds, "data_vars") else open_dataset(ds, split=split)
    if split is not None:
        present = sorted(set(ds["split"].values.astype(str).tolist()))
        if split not in present:
            raise DatasetError(f"the dataset has no image in split {split!r}; it has {present}: pass split=None or one")
        ds = ds.isel(sample=np.flatnonzero(ds["split"].values == split))
    if "label" not in ds:
        raise DatasetError("the dataset has no labels: interpret compares the model's scores with them")
    workdir = None
    if _is_onnx(model):
        onnx_path = os.fspath(model)
    else:
        from dask_dl.export import export_onnx

        workdir = tempfile.TemporaryDirectory(prefix="dask-dl-interpret-")
        onnx_path = os.fspath(export_onnx(model, os.path.join(workdir.name, "model.onnx")))
    info = read_model_info(onnx_path)
    labels = list(info.labels)
    missing = sorted(set(labels) - set(label_names(ds["finding"].values)))
    if missing:
        raise DatasetError(
            f"the model's labels {missing} are not in the dataset (it has {label_names(ds['finding'].values)}); "
            "interpret the model on a store of its own labels"
        )
    client = client or _current_client()
    probs = predict(ds, onnx_path, client=client)  # with a client: persisted on its workers
    if client is None:
        probs = probs.persist()  # Dask's local scheduler: keep the scores rather than score again per question
    truth = ds["label"].sel(finding=labels).data
    return Interpretation(
        ds,
        model,
        onnx_path=onnx_path,
        probs=probs,
        truth=truth,
        labels=labels,
        task=info.task,
        workdir=workdir,
        client=client,
    )


def _is_onnx(model: Any) -> bool:
    return isinstance(model, str | os.PathLike) and os.fspath(model).lower().endswith(".onnx")


def _current_client() -> Client | None:
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        return None


def _on_its_client(method: Callable[..., T]) -> Callable[..., T]:
    """Run ``method`` with the interpretation's client as the current one.

    The scores are futures of that client: computed through another (a notebook's ``with Client(...)`` block, a
    second cluster), the graph would name keys that scheduler has not got, or has not got yet, and Dask would
    cancel it for "lost dependencies".
    """

    @functools.wraps(method)
    def on_its_client(self: Interpretation, *args: Any, **kwargs: Any) -> T:
        with self.client.as_current() if self.client is not None else contextlib.nullcontext():
            return method(self, *args, **kwargs)

    return on_its_client


class Interpretation:
    """A model's scores on a dataset, and the tables and figures that say where it goes wrong.

    Made by :func:`interpret`. ``probs`` (images x labels) and ``losses`` (per image) are Dask arrays held on
    the cluster of ``client``; ``scores`` is the :func:`~dask_dl.scores_table`, gathered when first used. Every
    table and figure is computed through ``client``, where the scores are, whichever client is current.
    """

    def __init__(
        self,
        ds: xr.Dataset,
        model: Any,
        *,
        onnx_path: str,
        probs: da.Array,
        truth: da.Array,
        labels: Sequence[str],
        task: str = "multilabel",
        workdir: Any = None,
        client: Client | None = None,
    ) -> None:
        self.ds, self.model, self.onnx_path, self.client = ds, model, onnx_path, client
        self.probs, self.truth, self.labels, self.task = probs, truth, list(labels), task
        self.losses = sample_losses(probs, truth, task=task)
        self._workdir = workdir  # the exported model lives as long as this object

    def __repr__(self) -> str:
        return f"Interpretation({self.ds.sizes['sample']} images, {len(self.labels)} labels, model {self.onnx_path})"

    # ---- tables ------------------------------------------------------------------------------------------

    @functools.cached_property
    @_on_its_client
    def scores(self) -> pd.DataFrame:
        """The :func:`~dask_dl.scores_table` of the dataset: ids, ``p_<label>`` scores and true labels."""
        from dask_dl.inference import scores_table

        return scores_table(self.ds, self.probs, labels=self.labels)

    @functools.cached_property
    def auroc(self) -> pd.Series:
        """AUROC per label (:func:`~dask_dl.evaluate`), NaN for a label with one class in the dataset."""
        from dask_dl.inference import evaluate

        return evaluate(self.scores, labels=self.labels)

    @_on_its_client
    def top_losses(self, k: int = 9) -> pd.DataFrame:
        """The ``k`` images with the highest loss, highest first, found chunk by chunk on the cluster.

        Returns
        -------
        pandas.DataFrame
            ``position`` (row in the dataset), ``image_id``, ``patient_id``, ``split``, ``loss``, ``worst`` (the
            label the image's loss comes most from), then ``p_<label>`` and ``<label>`` per label.
        """
        positions = top_positions(self.losses, positive_int("k", k))
        order = np.argsort(positions)  # read in store order, then put back in loss order
        picked = [v[order.argsort()] for v in _rows(positions[order], self.losses, self.probs, self.truth)]
        losses, probs, truth = picked
        table = pd.DataFrame({"position": positions})
        for name in ("image_id", "patient_id", "split"):
            table[name] = self.ds[name].values[positions].astype(str)
        table["loss"] = losses
        table["worst"] = [self.labels[j] for j in per_label_losses(probs, truth).argmax(axis=1)]
        for j, label in enumerate(self.labels):
            table[f"p_{label}"] = probs[:, j]
            table[label] = truth[:, j].astype(np.uint8)
        return table

    def confusion(self, label: str, threshold: float = 0.5) -> pd.DataFrame:
        """Counts of images by truth (rows) and prediction at ``threshold`` (columns) for one label."""
        self._check_label(label)
        truth = self.scores[label].to_numpy().astype(bool)
        predicted = self.scores[f"p_{label}"].to_numpy() >= threshold
        counts = [[int(np.sum((truth == t) & (predicted == p))) for p in (False, True)] for t in (False, True)]
        names = pd.Index(["negative", "positive"])
        return pd.DataFrame(counts, index=names.rename(f"true {label}"), columns=names.rename(f"p >= {threshold:g}"))

    def per_label(self) -> pd.DataFrame:
        """Per label: images, positives, AUROC and average precision (NaN where a label has one class)."""
        rows = []
        for label in self.labels:
            truth, scores = self._label(label)
            both = 0 < truth.sum() < len(truth)
            rows.append(
                {
                    "label": label,
                    "images": len(truth),
                    "positives": int(truth.sum()),
                    "auroc": self.auroc[label],
                    "average_precision": curves.average_precision(truth, scores) if both else np.nan,
                }
            )
        return pd.DataFrame(rows).set_index("label")

    # ---- figures -----------------------------------------------------------------------------------------

    @_on_its_client
    def plot_top_losses(
        self, k: int = 9, *, explain: bool = True, method: str | None = None, columns: int = 3
    ) -> Figure:
        """The ``k`` worst images with prediction, truth and loss, each under its worst label's explanation map.

        Parameters
        ----------
        k
            How many images.
        explain
            Lay each image's explanation map (:func:`~dask_dl.explain`) of its worst label over it.
        method
            ``"gradcam"`` or ``"occlusion"``; default Grad-CAM, occlusion for a model given as an ONNX file.
        columns
            Images per row.
        """
        from dask_dl.explanation.show import show

        table = self.top_losses(k)
        subset = self.ds.isel(sample=table["position"].to_numpy())
        maps = self._worst_maps(subset, table["worst"].tolist(), method) if explain else None
        fig = show(subset, maps, n=len(table), samples=np.arange(len(table)), columns=positive_int("columns", columns))
        for ax, row in zip(fig.axes, table.to_dict("records"), strict=False):
            ax.set_title(self._loss_title(row), fontsize=7)
        fig.suptitle(f"top {len(table)} losses" + (f" ({maps.attrs['method']} of the worst label)" if explain else ""))
        fig.tight_layout()
        return fig

    def plot_roc(self) -> Figure:
        """One ROC curve per label with both classes; the legend gives its AUROC (:func:`~dask_dl.evaluate`)."""
        fig, ax = self._curves("false positive rate", "true positive rate", "ROC per label")
        for label in self._both_classes():
            fpr, tpr = curves.roc_curve(*self._label(label))
            ax.plot(fpr, tpr, lw=1.2, label=f"{label} (AUROC {self.auroc[label]:.3f})")
        ax.plot([0, 1], [0, 1], "k:", lw=1, label="_chance")
        return _finish(fig, ax)

    def plot_pr(self) -> Figure:
        """One precision-recall curve per label with both classes; the legend gives its average precision."""
        fig, ax = self._curves("recall", "precision", "precision-recall per label")
        for label in self._both_classes():
            truth, scores = self._label(label)
            recall, precision = curves.pr_curve(truth, scores)
            ap = curves.average_precision(truth, scores)
            ax.step(
                recall, precision, where="post", lw=1.2, label=f"{label} (AP {ap:.3f}, prevalence {truth.mean():.2f})"
            )
        return _finish(fig, ax)

    def plot_calibration(self, *, bins: int = 10) -> Figure:
        """Observed share of positives against the mean predicted probability, in ``bins`` bins, per label."""
        fig, ax = self._curves("mean predicted probability", "observed share of positives", "calibration")
        for label in self._both_classes():
            predicted, observed = curves.calibration(*self._label(label), bins=positive_int("bins", bins))
            ax.plot(predicted, observed, "o-", ms=3, lw=1, label=label)
        ax.plot([0, 1], [0, 1], "k:", lw=1, label="_perfect")
        return _finish(fig, ax)

    # ---- helpers -----------------------------------------------------------------------------------------

    def _label(self, label: str) -> tuple[np.ndarray, np.ndarray]:
        return self.scores[label].to_numpy(), self.scores[f"p_{label}"].to_numpy()

    def _both_classes(self) -> list[str]:
        return [label for label in self.labels if 0 < self.scores[label].sum() < len(self.scores)]

    def _check_label(self, label: str) -> None:
        if label not in self.labels:
            raise ConfigurationError(f"unknown label {label!r}: the model's labels are {self.labels}")

    def _curves(self, xlabel: str, ylabel: str, title: str) -> tuple[Figure, Any]:
        fig, ax = pyplot("Interpretation plots").subplots(figsize=(6, 5.5))
        split = ", ".join(sorted(set(self.scores["split"]))) if "split" in self.scores else ""
        ax.set(
            xlabel=xlabel,
            ylabel=ylabel,
            title=f"{title} ({split}, {len(self.scores)} images)",
            xlim=(-0.01, 1.01),
            ylim=(-0.01, 1.01),
        )
        return fig, ax

    def _worst_maps(self, subset: xr.Dataset, worst: list[str], method: str | None) -> xr.DataArray:
        """Each image's map of its own worst label, as one finding named ``worst`` that :func:`show` draws."""
        from dask_dl.explanation.maps import explain

        given_onnx = _is_onnx(self.model)
        method = method or ("occlusion" if given_onnx else "gradcam")
        model = self.onnx_path if given_onnx else self.model
        chosen = list(dict.fromkeys(worst))
        maps = explain(subset, model, labels=chosen, method=method).compute()
        picked = np.stack([maps.values[i, chosen.index(label)] for i, label in enumerate(worst)])[:, None]
        return maps.isel(finding=[0]).copy(data=picked).assign_coords(finding=["worst"])

    def _loss_title(self, row: dict[str, Any]) -> str:
        truth = ", ".join(label for label in self.labels if row[label]) or "No Finding"
        worst = row["worst"]
        return f"{row['image_id']}\nloss {row['loss']:.3f} · {worst} p={row['p_' + worst]:.2f}\ntrue: {truth}"


def _rows(positions: np.ndarray, *arrays: da.Array) -> list[np.ndarray]:
    """The rows at sorted ``positions`` of each array: only their chunks are read."""
    import dask

    return [np.asarray(v) for v in dask.compute(*(a[positions] for a in arrays))]


def _finish(fig: Figure, ax: Any) -> Figure:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig
