"""History rows: what every rank reported for an epoch, turned into one row of ``run.history``.

Validation metrics are computed over the predictions of all ranks together (never averaged across ranks), times
are per-trainer means, throughput is all trainers' images over the slowest trainer's time, and the cost is the
run's wall time on all its workers at the ``dask-dl.cost`` price.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dask_dl import config

__all__ = ["epoch_row", "worker_hour_price"]


def worker_hour_price(*, gpu: bool) -> float:
    """Price of one worker for an hour, from ``dask-dl.cost.{cpu,gpu}-worker-hour`` (read where fit is called)."""
    return float(config.get("cost.gpu-worker-hour" if gpu else "cost.cpu-worker-hour"))


def epoch_row(
    epoch: int,
    trained: list[dict[str, Any]],
    scored: list[dict[str, Any]] | None,
    *,
    seconds: float,
    labels: tuple[str, ...],
    task: str,
    global_batch: int,
    price: float,
    event: str = "",
) -> dict[str, Any]:
    """Return the history row of ``epoch`` from every rank's training report and, unless stopped, validation.

    Parameters
    ----------
    trained
        One :meth:`~dask_dl.train.actor.TrainingActor.train_epoch` result per rank.
    scored
        One :meth:`~dask_dl.train.actor.TrainingActor.validate` result per rank, or None for an epoch stopped part
        way (its validation columns are NaN).
    seconds
        Wall time of the epoch (training, validation and checkpoint).
    global_batch
        Images per optimizer step over all trainers.
    price
        Price of one worker for an hour (:func:`worker_hour_price`).
    """
    from dask_dl.metrics import auroc

    steps = max(t["steps"] for t in trained)
    train_seconds = max(t["seconds"] for t in trained)
    row: dict[str, Any] = {
        "epoch": epoch,
        "steps": steps,
        "global_batch": int(global_batch),
        "train_loss": sum(t["loss_sum"] for t in trained) / max(sum(t["steps"] for t in trained), 1),
        "val_loss": float("nan"),
        "val_auroc_mean": float("nan"),
    }
    if scored is not None:
        samples = np.concatenate([s["samples"] for s in scored])
        order = np.argsort(samples, kind="stable")
        scores = np.concatenate([s["scores"] for s in scored])[order]
        truth = np.concatenate([s["labels"] for s in scored])[order]
        per_label = np.atleast_1d(auroc(truth, scores))
        row["val_loss"] = sum(s["loss_sum"] for s in scored) / max(len(samples), 1)
        row["val_auroc_mean"] = float(np.nanmean(per_label)) if np.isfinite(per_label).any() else float("nan")
        row.update({f"val_auroc_{k}": float(v) for k, v in zip(labels, per_label, strict=True)})
        if task == "multiclass":
            row["val_accuracy"] = float(np.mean(scores.argmax(1) == truth.argmax(1)))
    n = len(trained)
    row.update(
        {
            # images of all trainers over the slowest trainer's time: the throughput of the whole run
            "images_per_s": sum(t["examples"] for t in trained) / train_seconds if train_seconds else 0.0,
            # per-trainer means: each trainer spends its own step time this way
            "compute_s": sum(t["compute_s"] for t in trained) / n,
            "comm_s": sum(t["comm_s"] for t in trained) / n,
            "data_wait_s": sum(t["data_wait_s"] for t in trained) / n,
            "bytes_sent": int(sum(t["bytes_sent"] for t in trained)),
            "seconds": seconds,
            "cost": seconds / 3600.0 * n * price,
            "event": event,
        }
    )
    auto = trained[0].get("auto")
    if auto:  # compression="auto": what the trainers chose, and why (rank 0 chose for all)
        row.update(compression=auto["name"], compression_reason=auto["reason"])
    return row
