"""``fit()`` and :class:`TrainingRun`: the driver of a data-parallel training run on a Dask cluster.

``fit`` checks its input, places one :class:`~dask_dl.train.actor.TrainingActor` per trainer (GPU workers first,
see :mod:`dask_dl.train.placement`) and drives them from a background thread: process group, then per epoch
train, validate (metrics over the predictions of all ranks together) and checkpoint. The user holds a
:class:`TrainingRun` whose ``history`` grows as epochs finish, and which can be stopped, waited on and asked for
the model at any time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from dask_dl import config
from dask_dl.errors import ConfigurationError, DatasetError, TrainingError
from dask_dl.train.placement import place_trainers

if TYPE_CHECKING:  # pragma: no cover
    import torch
    import xarray as xr
    from distributed import Client

__all__ = ["TrainingRun", "fit"]

logger = logging.getLogger("dask_dl.train")

OPTIMIZERS = ("sgd", "adamw")
_POLL_S = 0.25  # how often the driver looks at running epochs (errors, live progress, stop requests)


def fit(
    dataset: xr.Dataset,
    *,
    model: str | None = None,
    epochs: int | None = None,
    batch_size: int | None = None,
    trainers: int | None = None,
    compression: str | None = None,
    lr: float | None = None,
    optimizer: str | None = None,
    warmup_steps: int | None = None,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    seed: int | None = None,
    augment: bool = False,
    model_kwargs: dict[str, Any] | None = None,
    compression_options: dict[str, Any] | None = None,
    view: str = "none",
    tensorboard: str | None = None,
    client: Client | None = None,
    wait: bool = True,
) -> TrainingRun:
    """Train a model on ``dataset`` with synchronous data-parallel SGD over Dask workers.

    Parameters
    ----------
    dataset : xarray.Dataset
        From :func:`dask_dl.open_dataset`; needs ``train`` and ``val`` samples. Only its coordinates are read
        here: every trainer reads the images straight from the store named by ``dataset.encoding["source"]``.
    model : str, optional
        A name from :func:`dask_dl.list_models`. Default ``dask-dl.train.model``.
    epochs, batch_size, lr, warmup_steps : optional
        Epochs in all (a resumed run continues up to this number), images per step *per trainer*, learning
        rate, uncompressed steps before a compressor starts. Defaults from ``dask-dl.train``.
    trainers : int, optional
        Data-parallel trainers, one per worker. Default ``dask-dl.train.trainers``.
    compression : str, optional
        Gradient compressor (``none``, ``fp16``, ``bf16``, ``powersgd``, ``onebit``, ``onebit2``).
    optimizer : {"sgd", "adamw"}, optional
        SGD with momentum ``dask-dl.train.momentum``, or AdamW. Default ``dask-dl.train.optimizer``.
    checkpoint_dir : str, optional
        Local directory or fsspec URL the trainers can write to; one ``epoch-NNNN.pt`` per epoch.
    resume : bool
        Continue from the latest checkpoint in ``checkpoint_dir`` (start afresh when there is none yet).
    seed : int, optional
        Seeds initial weights, data order and augmentation; equal seeds give equal runs.
    augment : bool
        Random affine and brightness/contrast augmentation of training images.
    model_kwargs, compression_options : dict, optional
        Passed to :func:`dask_dl.build_model` and to the compressor.
    view : {"none", "auto", "notebook", "terminal", "log"}
        Live view of the progress (:class:`dask_dl.train.view.RunView`).
    tensorboard : str, optional
        Also write each epoch's numbers as TensorBoard scalars under ``tensorboard/<run_id>`` (needs the
        ``tensorboard`` package). The history always goes to ``checkpoint_dir/history.parquet`` too.
    client : distributed.Client, optional
        Cluster to train on (see :func:`dask_dl.get_client`).
    wait : bool
        Block until training ends (True), or return the running :class:`TrainingRun` at once (False).

    Returns
    -------
    TrainingRun

    Raises
    ------
    DatasetError
        No ``train`` or ``val`` samples, no labels, or a batch larger than one trainer's share of the data.
    ConfigurationError
        Unknown model, compressor or optimizer, or a non-positive number.
    ClusterError
        Fewer workers than trainers.
    TrainingError
        (from ``wait``) a non-finite loss, a trainer that failed or timed out.

    Examples
    --------
    >>> run = fit(ds, model="resnet18", epochs=10, trainers=2, compression="onebit", wait=False)  # doctest: +SKIP
    >>> run.history[["epoch", "train_loss", "val_auroc_mean"]]  # doctest: +SKIP
    """
    from dask_dl.cluster import check_visible, get_client
    from dask_dl.train.actor import TrainerSpec

    spec_args, meta = _check_dataset(dataset)
    model = config.get("train.model", model)
    epochs = _positive_int("epochs", config.get("train.epochs", epochs))
    batch_size = _positive_int("batch_size", config.get("train.batch-size", batch_size))
    trainers = _positive_int("trainers", config.get("train.trainers", trainers))
    compression = config.get("train.compression", compression)
    lr = float(config.get("train.lr", lr))
    if not lr > 0 or not np.isfinite(lr):
        raise ConfigurationError(f"lr must be a positive number, got {lr!r}; pass e.g. lr=0.01")
    optimizer = config.get("train.optimizer", optimizer)
    if optimizer not in OPTIMIZERS:
        raise ConfigurationError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    warmup_steps = int(config.get("train.warmup-steps", warmup_steps))
    seed = int(config.get("train.seed", seed))
    checkpoint_dir = config.get("train.checkpoint-dir", checkpoint_dir)
    if resume and checkpoint_dir is None:
        raise ConfigurationError("resume=True needs checkpoint_dir=... (the directory the earlier run wrote to)")
    _check_model(model, len(spec_args["labels"]), model_kwargs or {})
    _check_compression(compression, warmup_steps, compression_options or {})
    n_train = len(spec_args["train_samples"])
    if n_train // trainers < batch_size:
        raise DatasetError(
            f"batch_size={batch_size} is larger than one trainer's share of the training split "
            f"({n_train} samples / {trainers} trainers = {n_train // trainers}); use batch_size <= "
            f"{max(n_train // trainers, 1)} or fewer trainers"
        )

    resume_from, history = None, []
    if resume:
        resume_from, history = _resume_point(checkpoint_dir, model, spec_args["labels"], trainers)
    client = get_client(client)
    workers = place_trainers(client, trainers)
    check_visible(client, spec_args["store"], workers=workers)  # the trainers open the store themselves

    spec = TrainerSpec(
        **spec_args,
        model_name=model,
        model_kwargs=dict(model_kwargs or {}),
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        momentum=float(config.get("train.momentum")),
        weight_decay=float(config.get("train.weight-decay")),
        compression=compression,
        compression_options=dict(compression_options or {}),
        warmup_steps=warmup_steps,
        seed=seed,
        augment=augment,
        window=config.get("train.shuffle-window"),
        prefetch=config.get("train.prefetch"),
        timeout_s=float(config.get("train.timeout")),
        resume_from=resume_from,
    )
    run = TrainingRun(
        client,
        spec,
        workers=workers,
        epochs=epochs,
        checkpoint_dir=checkpoint_dir,
        history=history,
        view=view,
        tensorboard=tensorboard,
    )
    _install_dashboard(client)
    run._start()
    if wait:
        run.wait()
    return run


class TrainingRun:
    """A training run in progress or finished; made by :func:`fit`.

    Attributes
    ----------
    run_id : str
        Name of the run (also the prefix of its actors' keys on the scheduler).
    status : str
        ``starting``, ``running``, ``finished``, ``stopped`` or ``failed``.
    error : BaseException or None
        Why the run failed.
    """

    def __init__(
        self,
        client: Client,
        spec: Any,
        *,
        workers: list[str],
        epochs: int,
        checkpoint_dir: str | None,
        history: list[dict[str, Any]],
        view: str = "none",
        tensorboard: str | None = None,
    ) -> None:
        from dask_dl.train.history import HistoryWriter
        from dask_dl.train.view import RunView

        self.run_id = f"fit-{uuid.uuid4().hex[:8]}"
        self.client, self.spec, self.workers = client, spec, list(workers)
        self.epochs, self.checkpoint_dir = epochs, checkpoint_dir
        self.status, self.error = "starting", None
        self.steps_per_epoch: int | None = None
        self.gpu = False
        self._rows = [dict(r) for r in history]
        self._resumed = bool(history) or spec.resume_from is not None
        self._epoch = len(history)
        self._live: dict[str, Any] = {}
        self._checkpoint: dict[str, Any] | None = None
        self._stop_requested = threading.Event()
        self._finished = threading.Event()
        self._actor_futures: list[Any] = []
        self._actors: list[Any] = []
        self._lock = threading.Lock()
        self._view = RunView(view)
        self._history_writer = HistoryWriter(checkpoint_dir, tensorboard=tensorboard, run_id=self.run_id)
        self._thread = threading.Thread(target=self._drive, name=f"dask-dl-{self.run_id}", daemon=True)

    # ---- public ---------------------------------------------------------------------------------------

    @property
    def history(self) -> pd.DataFrame:
        """One row per epoch finished so far (also the epochs of the run this one resumed)."""
        with self._lock:
            return pd.DataFrame(list(self._rows))

    @property
    def done(self) -> bool:
        """True once the run has finished, stopped or failed and released its workers."""
        return self._finished.is_set()

    def stop(self) -> TrainingRun:
        """Ask every trainer to stop after its current step; returns at once (``wait()`` to block until free).

        The epoch in progress is not checkpointed: the latest checkpoint stays that of the last completed epoch.
        """
        self._stop_requested.set()
        for actor in list(self._actors):
            with contextlib.suppress(Exception):
                actor.request_stop()  # async actor method: answered while the epoch runs
        return self

    def wait(self, timeout: float | None = None) -> TrainingRun:
        """Block until the run ends; stop it on KeyboardInterrupt (then re-raise it).

        Raises
        ------
        TrainingError
            When the run failed (non-finite loss, a trainer error or timeout).
        TimeoutError
            When ``timeout`` seconds passed and the run still goes on.
        """
        try:
            self._wait_finished(timeout)
        except KeyboardInterrupt:
            self.stop()
            self._wait_finished(None)
            raise
        if not self._finished.is_set():
            raise TimeoutError(f"{self.run_id} still runs after {timeout} s (epoch {self._epoch + 1}/{self.epochs})")
        if self.error is not None:
            if isinstance(self.error, TrainingError):
                raise self.error
            raise TrainingError(f"{self.run_id} failed: {type(self.error).__name__}: {self.error}") from self.error
        return self

    def _wait_finished(self, timeout: float | None) -> None:
        # an Event polled in short waits, not Thread.join: a KeyboardInterrupt inside join() marks a running
        # thread as finished on Python 3.11 (bpo-45274's fix), and short waits let Ctrl-C in on every platform
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._finished.wait(0.2):
            if deadline is not None and time.monotonic() >= deadline:
                return

    def checkpoint(self) -> dict[str, Any]:
        """Return the latest checkpoint (the contract's dict) of this run, from memory or ``checkpoint_dir``."""
        if self._checkpoint is not None:
            return self._checkpoint
        if self.checkpoint_dir is not None:
            from dask_dl.train.checkpoint import latest_checkpoint, load_checkpoint

            if latest_checkpoint(self.checkpoint_dir) is not None:
                return load_checkpoint(self.checkpoint_dir)
        raise TrainingError(f"{self.run_id} has no checkpoint yet: no epoch has completed ({self.status})")

    def model(self) -> torch.nn.Module:
        """Return the model with the weights of the latest checkpoint, on the CPU, in eval mode."""
        from dask_dl.models import build_model

        ck = self.checkpoint()
        net = build_model(ck["model_name"], num_outputs=len(ck["labels"]), in_channels=1, **ck["model_kwargs"])
        net.load_state_dict(ck["model"])
        return net.eval()

    def snapshot(self) -> dict[str, Any]:
        """Where the run is, as the plain dict :mod:`dask_dl.train.view` and the dashboard draw."""
        with self._lock:
            rows = list(self._rows)
        live = dict(self._live)
        snap: dict[str, Any] = {
            "run_id": self.run_id,
            "status": self.status,
            "model": self.spec.model_name,
            "compression": self.spec.compression,
            "trainers": len(self.workers),
            "epoch": min(self._epoch, self.epochs - 1),
            "epochs": self.epochs,
            "step": live.get("step", 0),
            "steps_per_epoch": self.steps_per_epoch or live.get("steps") or 0,
            "loss": live.get("loss", rows[-1]["train_loss"] if rows else None),
            "images_per_s": live.get("images_per_s", rows[-1]["images_per_s"] if rows else None),
            "bytes_sent": int(sum(r.get("bytes_sent", 0) for r in rows)),
            "history": rows,
        }
        if rows and rows[-1].get("seconds"):
            snap["data_wait_share"] = rows[-1]["data_wait_s"] / rows[-1]["seconds"]
        if self.error is not None:
            snap["error"] = f"{type(self.error).__name__}: {self.error}"
        return snap

    def __repr__(self) -> str:
        with self._lock:
            last = self._rows[-1] if self._rows else None
            completed = sum(1 for r in self._rows if r.get("event") != "stopped")
        parts = [self.run_id, self.spec.model_name, f"status={self.status}", f"epochs {completed}/{self.epochs}"]
        if last is not None:
            parts += [f"train_loss={last['train_loss']:.4g}", f"val_auroc_mean={last['val_auroc_mean']:.3f}"]
        return f"TrainingRun({', '.join(parts)})"

    def _repr_html_(self) -> str:
        from dask_dl.train.view import snapshot_html

        return snapshot_html(self.snapshot())

    # ---- the driving thread ---------------------------------------------------------------------------

    def _start(self) -> None:
        self._thread.start()

    def _drive(self) -> None:
        try:
            self._form_group()
            self.status = "running"
            self._publish()
            for epoch in range(self._epoch, self.epochs):
                if self._stop_requested.is_set() or not self._run_epoch(epoch):
                    self.status = "stopped"
                    break
            else:
                self.status = "finished"
        except BaseException as exc:  # handed to wait(); the thread must not die silently
            self.status, self.error = "failed", exc
        finally:
            try:
                self._release()
                self._publish()
                self._view.update(self.snapshot())
                self._view.close()
                self._history_writer.close()
            finally:
                self._finished.set()

    def _form_group(self) -> None:
        from dask_dl.train.actor import TrainingActor

        client, n = self.client, len(self.workers)
        self._actor_futures = [
            client.submit(
                TrainingActor,
                actor=True,
                workers=[address],
                allow_other_workers=False,
                pure=False,
                key=f"dask-dl-trainer-{self.run_id}-{rank}",
            )
            for rank, address in enumerate(self.workers)
        ]
        self._actors = [f.result() for f in self._actor_futures]
        if self._stop_requested.is_set():  # stop() came before the actors existed
            self.stop()
        init_method = self._actors[0].free_address().result()
        # all ranks must call init_process_group at once: start every setup before awaiting any
        infos = self._gather(
            [a.setup(self.spec, init_method=init_method, rank=r, world_size=n) for r, a in enumerate(self._actors)]
        )
        self.steps_per_epoch = infos[0]["steps_per_epoch"]
        self.gpu = any(i["gpu"] for i in infos)
        self._epoch = infos[0]["start_epoch"]

    def _run_epoch(self, epoch: int) -> bool:
        """Train, validate and checkpoint one epoch; False when it was stopped part way."""
        self._epoch = epoch
        started = time.perf_counter()
        trained = self._gather([a.train_epoch(epoch) for a in self._actors], live=True)
        if any(t["stopped"] for t in trained):
            self._append(self._row(epoch, trained, None, time.perf_counter() - started, event="stopped"))
            return False
        scored = self._gather([a.validate(epoch) for a in self._actors])
        event = "resumed" if self._resumed else ""
        self._resumed = False
        row = self._row(epoch, trained, scored, time.perf_counter() - started, event=event)
        with self._lock:
            history = [*self._rows, row]
        checkpoints = self._gather(
            [a.checkpoint(epoch, history=history, directory=self.checkpoint_dir) for a in self._actors]
        )
        self._checkpoint = checkpoints[0]
        self._live = {}
        self._append(row)
        return True

    def _append(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._rows.append(row)
            rows = list(self._rows)
        self._history_writer.write(rows)
        self._publish()
        self._view.update(self.snapshot())

    def _gather(self, futures: list[Any], *, live: bool = False) -> list[Any]:
        """Results of actor calls; raises the first error at once instead of waiting for the other ranks."""
        last_poll = 0.0
        while True:
            for rank, f in enumerate(futures):
                if f.done():
                    self._result(rank, f)  # raises the rank's error now; the others time out in their collectives
            if all(f.done() for f in futures):
                return [f.result() for f in futures]
            if live and time.monotonic() - last_poll > 1.0:
                last_poll = time.monotonic()
                with contextlib.suppress(Exception):
                    self._live = self._actors[0].progress().result(timeout=5)
                    self._view.update(self.snapshot())
                    self._publish()
            time.sleep(_POLL_S)

    def _result(self, rank: int, future: Any) -> Any:
        try:
            return future.result()
        except TrainingError:
            raise
        except Exception as exc:
            raise TrainingError(
                f"{self.run_id}: trainer {rank} on {self.workers[rank]} failed in epoch {self._epoch}: "
                f"{type(exc).__name__}: {exc}. Every trainer was stopped; the checkpoint of the last completed "
                "epoch is kept, and fit(..., checkpoint_dir=..., resume=True) continues from it"
            ) from exc

    def _row(self, epoch: int, trained: list[dict], scored: list[dict] | None, seconds: float, *, event: str) -> dict:
        from dask_dl.metrics import auroc

        steps = max(t["steps"] for t in trained)
        train_seconds = max(t["seconds"] for t in trained)
        row: dict[str, Any] = {
            "epoch": epoch,
            "steps": steps,
            "train_loss": sum(t["loss_sum"] for t in trained) / max(sum(t["steps"] for t in trained), 1),
            "val_loss": float("nan"),
            "val_auroc_mean": float("nan"),
        }
        labels = self.spec.labels
        if scored is not None:
            samples = np.concatenate([s["samples"] for s in scored])
            order = np.argsort(samples, kind="stable")
            scores = np.concatenate([s["scores"] for s in scored])[order]
            truth = np.concatenate([s["labels"] for s in scored])[order]
            per_label = np.atleast_1d(auroc(truth, scores))
            row["val_loss"] = sum(s["loss_sum"] for s in scored) / max(len(samples), 1)
            row["val_auroc_mean"] = float(np.nanmean(per_label)) if np.isfinite(per_label).any() else float("nan")
            row.update({f"val_auroc_{k}": float(v) for k, v in zip(labels, per_label, strict=True)})
            if self.spec.task == "multiclass":
                row["val_accuracy"] = float(np.mean(scores.argmax(1) == truth.argmax(1)))
        n = len(trained)
        price = config.get("cost.gpu-worker-hour" if self.gpu else "cost.cpu-worker-hour")
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
                "cost": seconds / 3600.0 * n * float(price),
                "event": event,
            }
        )
        return row

    def _release(self) -> None:
        """Leave the process group on every trainer and delete the actors, also after errors."""
        actors, self._actors = self._actors, []
        if actors:
            calls = []
            for actor in actors:
                with contextlib.suppress(Exception):
                    calls.append(actor.teardown())
            # a rank stuck in a collective answers after the collective's timeout
            deadline = time.monotonic() + float(self.spec.timeout_s) + 30
            for call in calls:
                with contextlib.suppress(Exception):
                    call.result(timeout=max(deadline - time.monotonic(), 1))
        futures, self._actor_futures = self._actor_futures, []
        # each Actor proxy holds a Future of its own for the actor's key, and distributed's call closures put the
        # proxy in reference cycles, so it would hold the actor until a garbage collection: release it now
        futures += [getattr(actor, "_future", None) for actor in actors]
        for future in futures:
            if future is None:
                continue
            with contextlib.suppress(Exception):
                future.release()
        del actors, futures

    def _publish(self) -> None:
        with contextlib.suppress(Exception):
            from dask_dl.dashboard import publish

            snap = self.snapshot()
            snap.pop("run_id")
            publish(self.client, self.run_id, snap)


def _install_dashboard(client: Client) -> None:
    """Serve the /dask-dl/ page on the scheduler's dashboard; training goes on without it if that fails."""
    from dask_dl.dashboard import install

    try:
        install(client)
    except Exception as exc:  # e.g. a scheduler that refuses plugins: the page is a convenience
        logger.warning("dask_dl dashboard page not installed on the scheduler: %s", exc)


# ---- checks ---------------------------------------------------------------------------------------------------


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_dataset(dataset: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return the data part of a TrainerSpec (store, samples, labels, task, size) from an open_dataset result."""
    if not (hasattr(dataset, "data_vars") and hasattr(dataset, "encoding")):
        raise DatasetError(
            f"fit takes the xarray.Dataset of dask_dl.open_dataset(store), got {type(dataset).__name__}; "
            "pass ds = dask_dl.open_dataset('cxr.zarr')"
        )
    meta = dataset.attrs.get("dask_dl")
    source = dataset.encoding.get("source")
    if not isinstance(meta, dict) or source is None:
        raise DatasetError(
            "the dataset lacks the dask_dl attribute or encoding['source'] (the store it came from); "
            "open it with dask_dl.open_dataset(store)"
        )
    labels = tuple(meta.get("labels") or ())
    if not labels:
        raise DatasetError(f"the store {source!r} has no labels; ingest a catalog with label columns to train on it")
    if "split" not in dataset.coords:
        raise DatasetError("the dataset has no 'split' coordinate; open it with dask_dl.open_dataset(store)")
    split = np.asarray(dataset["split"].values).astype(str)
    sample = np.asarray(dataset["sample"].values, dtype=np.int64)
    found = sorted(set(split.tolist()))
    parts = {}
    for name in ("train", "val"):
        rows = sample[split == name]
        if len(rows) == 0:
            raise DatasetError(
                f"the dataset has no {name!r} samples (splits present: {', '.join(found) or 'none'}); fit needs "
                "train and val splits: open the whole store (open_dataset(store) without split=) or make the "
                "catalog with dask_dl.split_by_patient"
            )
        parts[name] = rows
    task = meta.get("task", "multilabel")
    data = {
        "store": str(source),
        "train_samples": parts["train"],
        "val_samples": parts["val"],
        "labels": labels,
        "task": task,
        "input_size": int(meta.get("size") or dataset["image"].shape[-1]),
    }
    return data, meta


def _check_model(name: str, num_outputs: int, kwargs: dict[str, Any]) -> None:
    from dask_dl.models import build_model, list_models

    if name not in list_models():
        build_model(name, num_outputs=num_outputs)  # raises the registry's ConfigurationError listing the names


def _check_compression(name: str, warmup_steps: int, options: dict[str, Any]) -> None:
    from dask_dl.train.compression import make_compressor

    make_compressor(name, warmup_steps=warmup_steps, **options)  # the registry's error for unknown names


def _resume_point(
    directory: str, model: str, labels: tuple[str, ...], trainers: int
) -> tuple[str | None, list[dict[str, Any]]]:
    from dask_dl.train.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(directory)
    if path is None:
        return None, []
    ck = load_checkpoint(path)
    if ck["model_name"] != model or list(ck["labels"]) != list(labels):
        raise TrainingError(
            f"the checkpoint {path!r} is of model {ck['model_name']!r} with labels {list(ck['labels'])}, not "
            f"{model!r} with {list(labels)}; resume with model={ck['model_name']!r} on the same store, or use a "
            "new checkpoint_dir"
        )
    if len(ck["compressor"]) != trainers:
        raise TrainingError(
            f"the checkpoint {path!r} was written by {len(ck['compressor'])} trainers; resume with "
            f"trainers={len(ck['compressor'])} (error-feedback residuals are per trainer)"
        )
    return path, [dict(r) for r in ck["history"]]
