"""The checked options of a training run: every argument of :func:`dask_dl.fit` is checked here, before anything
is placed on the cluster.

:func:`check_run` turns ``fit``'s arguments (with the ``dask-dl.train`` config defaults) and the dataset into one
frozen :class:`RunOptions`, or raises: a bad argument is a ConfigurationError, bad data a DatasetError. Nothing
here touches the cluster or imports torch, so a mistake costs no actor, no key on the scheduler and no wait.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dask_dl import config
from dask_dl.checks import byte_count, one_of, positive_int
from dask_dl.cluster.storage import absolute
from dask_dl.errors import ConfigurationError, DatasetError
from dask_dl.normalize import DEFAULT_NORMALIZATION, check_normalization
from dask_dl.train.parallel import check_parallel

__all__ = ["OPTIMIZERS", "PRECISIONS", "VIEWS", "RunOptions", "check_dataset", "check_run"]

OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
VIEWS: tuple[str, ...] = ("none", "auto", "notebook", "terminal", "log")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class RunOptions:
    """What one training run does: the data, the model, the optimization and where results go."""

    store: str
    train_samples: np.ndarray = field(repr=False)
    val_samples: np.ndarray = field(repr=False)
    labels: tuple[str, ...]
    task: str
    input_size: int
    model: str
    model_kwargs: dict[str, Any]
    epochs: int
    batch_size: int
    trainers: int
    compression: str
    compression_options: dict[str, Any]
    lr: float
    optimizer: str
    momentum: float
    weight_decay: float
    warmup_steps: int
    seed: int
    augment: bool
    checkpoint_dir: str | None
    resume: bool
    view: str
    tensorboard: str | None
    window: int | None
    prefetch: int | None
    cache: int | str | None
    timeout_s: float
    check_every: int
    #: ``dask-dl.train.deterministic``: the trainers use torch's deterministic algorithms only
    deterministic: bool = False
    #: image channels of the store (1 grey, 3 RGB): the models' first layer takes this many
    channels: int = 1
    #: ``{"mean": m, "std": s}``, numbers or one per channel, applied by the loader and written to checkpoints
    normalization: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_NORMALIZATION))
    #: how the trainers share the model (:mod:`dask_dl.train.parallel`)
    parallel: str = "ddp"
    stages: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    memory_budget: int | None = None
    max_restarts: int = 0
    min_trainers: int = 1
    restart_wait_s: float = 60.0
    #: seconds past a failed collective a trainer may take to answer the driver before its worker counts as hung
    hang_grace_s: float = 30.0
    checkpoint_every_steps: int | None = None
    checkpoint_every_seconds: float | None = None
    #: FedProx's proximal term weight (for :func:`dask_dl.fit_sites`)
    proximal_mu: float = 0.0

    #: what the model is and how to rebuild it (:class:`dask_dl.models.source.ModelSource`)
    model_source: Any = field(default=None, repr=False)
    loss: Any = "bce"
    weights: str | None = None
    freeze_epochs: int = 0
    head_lr: float | None = None
    #: the learning-rate schedule (:func:`dask_dl.train.tuning.check_schedule`); ``schedule`` is the pipeline's
    lr_schedule: dict[str, Any] = field(default_factory=lambda: {"name": "constant"})
    precision: str = "fp32"
    channels_last: bool = False
    accumulate: int = 1
    activation_checkpointing: bool = False

    @property
    def global_batch(self) -> int:
        """Images per optimizer step over all trainers: ``batch_size`` is per trainer (per pipeline with stages),
        ``accumulate`` micro-batches per step."""
        return self.batch_size * (self.trainers // self.stages) * self.accumulate

    @property
    def steps_per_epoch(self) -> int:
        """Steps every trainer takes per epoch (the loader drops what does not fill a step on every rank)."""
        return len(self.train_samples) // (self.batch_size * self.trainers)

    def to_dict(self) -> dict[str, Any]:
        """The options as plain values (the sample lists as counts)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["train_samples"], out["val_samples"] = len(self.train_samples), len(self.val_samples)
        out["labels"] = list(self.labels)
        out.pop("model_source")
        if callable(out["loss"]):
            out["loss"] = getattr(out["loss"], "__name__", "callable")
        return out


def check_run(
    dataset: Any,
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
    normalization: dict[str, Any] | None = None,
    parallel: str | None = None,
    stages: int | None = None,
    microbatches: int | None = None,
    memory_budget: int | str | None = None,
    max_restarts: int | None = None,
    min_trainers: int | None = None,
    checkpoint_every_steps: int | None = None,
    checkpoint_every_seconds: float | None = None,
    loss: Any = None,
    weights: str | None = None,
    freeze_epochs: int = 0,
    head_lr: float | None = None,
    schedule: Any = None,
    precision: str | None = None,
    channels_last: bool = False,
    accumulate: int | None = None,
    activation_checkpointing: bool = False,
    proximal_mu: float = 0.0,
) -> RunOptions:
    """Check every argument of :func:`dask_dl.fit` and return the run's options (config fills what is None).

    Raises
    ------
    ConfigurationError
        An unknown model, model option, compressor, compressor option, optimizer or view; a number out of range;
        ``resume=True`` without ``checkpoint_dir``; a ``normalization`` that is not one, or has per-channel values
        for another number of channels than the dataset's; a ``parallel`` mode the compressor, trainers or batch
        do not fit; a model over ``memory_budget`` per trainer; ``min_trainers`` above ``trainers``; step
        checkpoints (``checkpoint_every_*``) with ``parallel`` other than ``"ddp"``.
    DatasetError
        Not a dataset of :func:`dask_dl.open_dataset`, no ``train``/``val`` samples or labels, or a batch larger
        than one trainer's share of the training split.
    """
    data = check_dataset(dataset)
    model = config.get("train.model", model)
    epochs = positive_int("epochs", config.get("train.epochs", epochs))
    batch_size = positive_int("batch_size", config.get("train.batch-size", batch_size), example=32)
    trainers = positive_int("trainers", config.get("train.trainers", trainers), example=2)
    lr = _positive_real("lr", config.get("train.lr", lr), example=0.01)
    optimizer = one_of("optimizer", config.get("train.optimizer", optimizer), OPTIMIZERS)
    warmup_steps = _non_negative_int("warmup_steps", config.get("train.warmup-steps", warmup_steps))
    seed = _non_negative_int("seed", config.get("train.seed", seed))
    view = one_of("view", view, VIEWS)
    checkpoint_dir = config.get("train.checkpoint-dir", checkpoint_dir)
    if resume and checkpoint_dir is None:
        raise ConfigurationError("resume=True needs checkpoint_dir=... (the directory the earlier run wrote to)")
    model_kwargs, compression_options = dict(model_kwargs or {}), dict(compression_options or {})
    tuned = _check_tuning(
        data, model, model_kwargs, loss=loss, weights=weights, freeze_epochs=freeze_epochs, head_lr=head_lr,
        schedule=schedule, precision=precision, channels_last=channels_last, accumulate=accumulate,
        activation_checkpointing=activation_checkpointing,
    )  # fmt: skip
    data["task"] = tuned.pop("task")
    compression = config.get("train.compression", compression)
    _check_compression(compression, warmup_steps, compression_options)
    plan = check_parallel(config.get("train.parallel", parallel), trainers=trainers, batch_size=batch_size,
                          compression=compression, stages=stages, microbatches=microbatches,
                          schedule=config.get("train.pipeline-schedule"))  # fmt: skip
    _check_combination(plan["parallel"], tuned, config.get("train.memory-budget", memory_budget))
    readers = trainers // plan["stages"]  # a pipeline's stages read the same batches
    n_train = len(data["train_samples"])
    if n_train // readers < batch_size:
        raise DatasetError(
            f"batch_size={batch_size} is larger than one trainer's share of the training split "
            f"({n_train} samples / {readers} trainers = {n_train // readers}); use batch_size <= "
            f"{max(n_train // readers, 1)} or fewer trainers"
        )
    if plan["parallel"] == "pipeline":  # a model that cannot be cut into the stages fails here, not on a trainer
        from dask_dl.train.parallel.split import check_split

        check_split(
            model, model_kwargs, num_outputs=len(data["labels"]), in_channels=data["channels"], stages=plan["stages"]
        )
    momentum = _non_negative_real("dask-dl.train.momentum", config.get("train.momentum"))
    memory_budget = _check_memory(config.get("train.memory-budget", memory_budget), model, model_kwargs, data,
                                  plan=plan, trainers=trainers, optimizer=optimizer, momentum=momentum)  # fmt: skip
    recovery = _check_recovery(trainers, max_restarts, min_trainers, checkpoint_every_steps, checkpoint_every_seconds,
                               stages=plan["stages"] if plan["parallel"] == "pipeline" else None)  # fmt: skip
    if n_train // (trainers * batch_size) < tuned["accumulate"]:
        raise DatasetError(
            f"accumulate={tuned['accumulate']} micro-batches per step need {tuned['accumulate']} batches of "
            f"{batch_size} on each of {trainers} trainers, but the training split fills only "
            f"{n_train // (trainers * batch_size)}; use a smaller accumulate or batch_size"
        )
    return RunOptions(
        **data,
        **tuned,
        model=tuned["model_source"].name,
        model_kwargs=model_kwargs,
        epochs=epochs,
        batch_size=batch_size,
        trainers=trainers,
        compression=compression,
        compression_options=compression_options,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        weight_decay=_non_negative_real("dask-dl.train.weight-decay", config.get("train.weight-decay")),
        warmup_steps=warmup_steps,
        seed=seed,
        augment=bool(augment),
        checkpoint_dir=None if checkpoint_dir is None else absolute(checkpoint_dir),  # rank 0 writes it there
        resume=bool(resume),
        view=view,
        tensorboard=None if tensorboard is None else str(tensorboard),
        window=config.get("train.shuffle-window"),
        prefetch=config.get("train.prefetch"),
        cache=byte_count("dask-dl.train.cache", config.get("train.cache")),
        timeout_s=_positive_real("dask-dl.train.timeout", config.get("train.timeout"), example=120),
        check_every=positive_int("dask-dl.train.check-every", config.get("train.check-every"), example=8),
        deterministic=bool(config.get("train.deterministic")),
        normalization=check_normalization(normalization, channels=data["channels"]),
        memory_budget=memory_budget,
        proximal_mu=_non_negative_real("proximal_mu", proximal_mu),
        **plan,
        **recovery,
    )


def _check_recovery(
    trainers: int,
    max_restarts: int | None,
    min_trainers: int | None,
    every_steps: int | None,
    every_seconds: float | None,
    *,
    stages: int | None = None,
) -> dict[str, Any]:
    """The recovery options (:mod:`dask_dl.train.recovery`), config filling what is None.

    A pipeline (``stages``) restarts on whole pipelines: ``min_trainers`` is a multiple of ``stages`` (the stages
    are cut as before; fewer replicas share the data).
    """
    max_restarts = _non_negative_int("max_restarts", config.get("train.max-restarts", max_restarts))
    min_trainers = config.get("train.min-trainers", min_trainers)
    min_trainers = trainers if min_trainers is None else positive_int("min_trainers", min_trainers, example=1)
    if min_trainers > trainers:
        raise ConfigurationError(
            f"min_trainers={min_trainers} is more than trainers={trainers}: a restarted run never has more trainers "
            f"than it started with; pass min_trainers <= {trainers}"
        )
    if stages is not None and min_trainers % stages:
        raise ConfigurationError(
            f"min_trainers={min_trainers} with parallel='pipeline' and stages={stages}: a pipeline restarts on whole "
            f"pipelines of {stages} trainers (one per stage); pass "
            f"min_trainers={max(min_trainers // stages, 1) * stages}"
        )
    every_steps = config.get("train.checkpoint-every-steps", every_steps) or None  # 0: off
    every_seconds = config.get("train.checkpoint-every-seconds", every_seconds) or None
    return {
        "max_restarts": max_restarts,
        "min_trainers": min_trainers,
        "restart_wait_s": _positive_real("dask-dl.train.restart-wait", config.get("train.restart-wait"), example=60),
        "hang_grace_s": _positive_real("dask-dl.train.hang-grace", config.get("train.hang-grace"), example=30),
        "checkpoint_every_steps": None
        if every_steps is None
        else positive_int("checkpoint_every_steps", every_steps, example=100),  # fmt: skip
        "checkpoint_every_seconds": None
        if every_seconds is None
        else _positive_real("checkpoint_every_seconds", every_seconds, example=300),  # fmt: skip
    }


def check_dataset(dataset: Any) -> dict[str, Any]:
    """Return the data part of the options (store, samples, labels, task, size, channels) from an open_dataset result.

    Raises
    ------
    DatasetError
        Not an open_dataset result, no labels, or no ``train`` or ``val`` samples.
    """
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
    return {
        "store": str(source),
        "train_samples": parts["train"],
        "val_samples": parts["val"],
        "labels": labels,
        "task": meta.get("task", "multilabel"),
        "input_size": int(meta.get("size") or dataset["image"].sizes["y"]),
        # a grey store has no channel dimension; a colour one says so in its layout and in `image`'s dims
        "channels": int(meta.get("channels") or dataset["image"].sizes.get("channel", 1)),
    }


def _check_tuning(data: dict[str, Any], model: Any, model_kwargs: dict[str, Any], **options: Any) -> dict[str, Any]:
    """The model, loss, weights, fine-tuning and precision options (:mod:`dask_dl.train.tuning`, ``precision``)."""
    import os

    from dask_dl.models.source import check_fits, model_source
    from dask_dl.train.losses import check_loss
    from dask_dl.train.tuning import check_schedule

    source = model_source(model, model_kwargs)
    loss, task = check_loss(options["loss"], data["task"])
    if source.kind == "module":  # built already: a model that does not fit the data fails here, at no cost
        channels = int(data.get("channels", 1))
        check_fits(source.target, name=source.name, in_channels=channels, input_size=data["input_size"],
                   labels=data["labels"])  # fmt: skip
    weights = options["weights"]
    if weights is not None and not isinstance(weights, str | os.PathLike):
        raise ConfigurationError(
            f"weights must be a path or URL of a weights file, got {type(weights).__name__}; pass e.g. "
            "weights='pretrained.pt' (torch.save(model.state_dict(), 'pretrained.pt'))"
        )
    head_lr = options["head_lr"]
    precision = one_of("precision", config.get("train.precision", options["precision"]), PRECISIONS)
    return {
        "model_source": source,
        "loss": loss,
        "task": task,
        "weights": None if weights is None else os.fspath(weights),
        "freeze_epochs": _non_negative_int("freeze_epochs", options["freeze_epochs"]),
        "head_lr": None if head_lr is None else _positive_real("head_lr", head_lr, example=0.01),
        "lr_schedule": check_schedule(config.get("train.schedule", options["schedule"])),
        "precision": precision,
        "channels_last": bool(options["channels_last"]),
        "accumulate": positive_int("accumulate", config.get("train.accumulate", options["accumulate"]), example=4),
        "activation_checkpointing": bool(options["activation_checkpointing"]),
    }


def _check_compression(name: Any, warmup_steps: int, options: dict[str, Any]) -> None:
    from dask_dl.train.compressors import COMPRESSORS

    COMPRESSORS.entry(name)
    from dask_dl.train.compression import make_compressor  # the options' checks (imports torch)

    make_compressor(name, warmup_steps=warmup_steps, **options)


def _check_combination(parallel: str, tuned: dict[str, Any], budget: Any) -> None:
    """Own models, fine-tuning and memory options are built for DDP: refuse what fsdp/pipeline would not honour."""
    source = tuned["model_source"]
    if source.kind != "registry" and (parallel != "ddp" or budget is not None):
        what = f"parallel={parallel!r}" if parallel != "ddp" else "memory_budget="
        raise ConfigurationError(
            f"{what} needs a model of dask_dl's registry (it is split or sized by name); model {source.name!r} is "
            f"a {source.kind} model: train it with parallel='ddp' and no memory_budget"
        )
    if parallel == "ddp":
        return
    defaults = {
        "accumulate": 1,
        "precision": "fp32",
        "freeze_epochs": 0,
        "head_lr": None,
        "channels_last": False,
        "activation_checkpointing": False,
    }
    used = [f"{k}={tuned[k]!r}" for k, off in defaults.items() if tuned[k] != off]
    if used:
        raise ConfigurationError(
            f"{', '.join(used)} apply to parallel='ddp' only (DDP's no_sync, autocast around its forward, the head's "
            f"parameter group); with parallel={parallel!r} leave them at their defaults, or train with parallel='ddp'"
        )


def _check_memory(budget: Any, model: str, options: dict[str, Any], data: dict[str, Any], *, plan: dict[str, Any],
                  trainers: int, optimizer: str, momentum: float) -> int | None:  # fmt: skip
    from dask_dl.train.parallel.memory import check_memory_budget, parse_budget

    budget = parse_budget(budget)
    if budget is not None:
        check_memory_budget(model, options, num_outputs=len(data["labels"]), in_channels=data["channels"],
                            budget=budget, parallel=plan["parallel"], trainers=trainers, stages=plan["stages"],
                            optimizer=optimizer, momentum=momentum)  # fmt: skip
    return budget


def _positive_real(name: str, value: Any, *, example: float) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0 and math.isfinite(value):
        return float(value)
    raise ConfigurationError(f"{name} must be a positive number, got {value!r}; pass e.g. {name}={example}")


def _non_negative_real(name: str, value: Any) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0 and math.isfinite(value):
        return float(value)
    raise ConfigurationError(f"{name} must be a number >= 0, got {value!r}")


def _non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise ConfigurationError(f"{name} must be an integer >= 0, got {value!r}; pass e.g. {name}=0")
