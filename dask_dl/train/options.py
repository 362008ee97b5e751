"""The checked options of a training run: every argument of :func:`dask_dl.fit` is checked here, before anything
is placed on the cluster.

:func:`check_run` turns ``fit``'s options (:mod:`dask_dl.train.option_groups`, with the ``dask-dl.train`` config
defaults) and the dataset into one frozen :class:`RunOptions`, or raises: a bad argument is a ConfigurationError,
bad data a DatasetError. Each option is checked alone where it is defined; here are the checks that take several
options, or the data, at once. Nothing here touches the cluster or imports torch, so a mistake costs no actor, no
key on the scheduler and no wait.
"""

from __future__ import annotations

from dataclasses import field, make_dataclass
from typing import Any

import numpy as np

from dask_dl.errors import ConfigurationError, DatasetError
from dask_dl.normalize import check_normalization
from dask_dl.train.option_groups import (
    OPTIMIZERS,
    OPTIONS,
    PRECISIONS,
    SETTINGS,
    VIEWS,
    flat_options,
    resolve,
)
from dask_dl.train.parallel import check_parallel

__all__ = ["OPTIMIZERS", "PRECISIONS", "VIEWS", "RunOptions", "check_dataset", "check_run"]

#: the fields of the data part of :class:`RunOptions` (:func:`check_dataset`, and the model as built)
DATA_FIELDS: tuple[tuple[str, Any, Any], ...] = (
    ("store", str, field()),
    ("train_samples", np.ndarray, field(repr=False)),
    ("val_samples", np.ndarray, field(repr=False)),
    ("labels", tuple, field()),
    ("task", str, field()),
    ("input_size", int, field()),
    #: image channels of the store (1 grey, 3 RGB): the models' first layer takes this many
    ("channels", int, field()),
    #: what the model is and how to rebuild it (:class:`dask_dl.models.source.ModelSource`); ``model`` is its name
    ("model_source", Any, field(repr=False)),
)


def _global_batch(self: Any) -> int:
    """Images per optimizer step over all trainers: ``batch_size`` is per trainer (per pipeline with stages),
    ``accumulate`` micro-batches per step."""
    return self.batch_size * (self.trainers // self.stages) * self.accumulate


def _steps_per_epoch(self: Any) -> int:
    """Steps every trainer takes per epoch (the loader drops what does not fill a step on every rank)."""
    return len(self.train_samples) // (self.batch_size * self.trainers)


def _to_dict(self: Any) -> dict[str, Any]:
    """The options as plain values (the sample lists as counts)."""
    out = {k: getattr(self, k) for k in self.__dataclass_fields__}
    out["train_samples"], out["val_samples"] = len(self.train_samples), len(self.val_samples)
    out["labels"] = list(self.labels)
    out.pop("model_source")
    if callable(out["loss"]):
        out["loss"] = getattr(out["loss"], "__name__", "callable")
    return out


#: What one training run does: the data, the model, every option of ``fit`` as checked (``model`` by name,
#: ``schedule`` the learning rate's as a dict, ``memory_budget`` in bytes, ``checkpoint_dir`` absolute) and every
#: :data:`~dask_dl.train.option_groups.SETTINGS` field. Its fields are made from those definitions.
RunOptions = make_dataclass(
    "RunOptions",
    [*DATA_FIELDS, *((name, Any) for name in OPTIONS), *((s.field, Any) for s in SETTINGS if s.field)],
    namespace={
        "__doc__": "What one training run does: the data, the model, the optimization and where results go.\n\n"
        "One field per option of :func:`dask_dl.fit` (checked, config filled in) and per ``dask-dl.train`` "
        "setting (:mod:`dask_dl.train.option_groups`), besides the data's.",
        "global_batch": property(_global_batch),
        "steps_per_epoch": property(_steps_per_epoch),
        "to_dict": _to_dict,
    },
    frozen=True,
)
RunOptions.__module__ = __name__  # pickled by name: the trainers' spec derives from it


def check_run(dataset: Any, **given: Any) -> RunOptions:
    """Check every option of :func:`dask_dl.fit` (flat keywords or groups) and return the run's options.

    Config fills what is None (:func:`dask_dl.train.option_groups.resolve`).

    Raises
    ------
    ConfigurationError
        An unknown option, model, model option, compressor, compressor option, optimizer or view; a number out of
        range; ``resume=True`` without ``checkpoint_dir``; a ``normalization`` that is not one, or has per-channel
        values for another number of channels than the dataset's; a ``parallel`` mode the compressor, trainers or
        batch do not fit; a model over ``memory_budget`` per trainer; ``min_trainers`` above ``trainers``; an
        option set both flat and in its group.
    DatasetError
        Not a dataset of :func:`dask_dl.open_dataset`, no ``train``/``val`` samples or labels, or a batch larger
        than one trainer's share of the training split.
    """
    data = check_dataset(dataset)
    o = resolve(flat_options(given))
    if o["resume"] and o["checkpoint_dir"] is None:
        raise ConfigurationError("resume=True needs checkpoint_dir=... (the directory the earlier run wrote to)")
    o["model_kwargs"], o["compression_options"] = dict(o["model_kwargs"] or {}), dict(o["compression_options"] or {})
    o["resume"], o["augment"] = bool(o["resume"]), bool(o["augment"])
    source = _check_model(data, o)
    _check_compression(o["compression"], o["warmup_steps"], o["compression_options"])
    plan = check_parallel(
        o["parallel"],
        trainers=o["trainers"],
        batch_size=o["batch_size"],
        compression=o["compression"],
        stages=o["stages"],
        microbatches=o["microbatches"],
        schedule=o["pipeline_schedule"],
    )
    plan["pipeline_schedule"] = plan.pop("schedule")
    o.update(plan)
    _check_combination(source, o)
    trainers, batch_size, accumulate = o["trainers"], o["batch_size"], o["accumulate"]
    readers = trainers // o["stages"]  # a pipeline's stages read the same batches
    n_train = len(data["train_samples"])
    if n_train // readers < batch_size:
        raise DatasetError(
            f"batch_size={batch_size} is larger than one trainer's share of the training split "
            f"({n_train} samples / {readers} trainers = {n_train // readers}); use batch_size <= "
            f"{max(n_train // readers, 1)} or fewer trainers"
        )
    if o["parallel"] == "pipeline":  # a model that cannot be cut into the stages fails here, not on a trainer
        from dask_dl.train.parallel.split import check_split

        check_split(
            o["model"],
            o["model_kwargs"],
            num_outputs=len(data["labels"]),
            in_channels=data["channels"],
            stages=o["stages"],
        )
    o["memory_budget"] = _check_memory(o, data)
    _check_recovery(o)
    if n_train // (trainers * batch_size) < accumulate:
        raise DatasetError(
            f"accumulate={accumulate} micro-batches per step need {accumulate} batches of "
            f"{batch_size} on each of {trainers} trainers, but the training split fills only "
            f"{n_train // (trainers * batch_size)}; use a smaller accumulate or batch_size"
        )
    o["normalization"] = check_normalization(o["normalization"], channels=data["channels"])
    return RunOptions(**data, **{**o, "model": source.name})


def _check_recovery(o: dict[str, Any]) -> None:
    """The recovery options against the trainers (:mod:`dask_dl.train.recovery`); ``min_trainers`` None: all.

    A pipeline restarts on whole pipelines: ``min_trainers`` is a multiple of ``stages`` (the stages are cut as
    before; fewer replicas share the data).
    """
    trainers, min_trainers = o["trainers"], o["min_trainers"]
    min_trainers = o["min_trainers"] = trainers if min_trainers is None else min_trainers
    if min_trainers > trainers:
        raise ConfigurationError(
            f"min_trainers={min_trainers} is more than trainers={trainers}: a restarted run never has more trainers "
            f"than it started with; pass min_trainers <= {trainers}"
        )
    stages = o["stages"]
    if o["parallel"] == "pipeline" and min_trainers % stages:
        raise ConfigurationError(
            f"min_trainers={min_trainers} with parallel='pipeline' and stages={stages}: a pipeline restarts on whole "
            f"pipelines of {stages} trainers (one per stage); pass "
            f"min_trainers={max(min_trainers // stages, 1) * stages}"
        )


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


def _check_model(data: dict[str, Any], o: dict[str, Any]) -> Any:
    """The model's source (:mod:`dask_dl.models.source`) and the loss, which may change the data's task."""
    from dask_dl.models.source import check_fits, model_source
    from dask_dl.train.losses import check_loss

    source = model_source(o["model"], o["model_kwargs"])
    o["loss"], data["task"] = check_loss(o["loss"], data["task"])
    if source.kind == "module":  # built already: a model that does not fit the data fails here, at no cost
        check_fits(
            source.target,
            name=source.name,
            in_channels=int(data.get("channels", 1)),
            input_size=data["input_size"],
            labels=data["labels"],
        )
    data["model_source"] = source
    return source


def _check_compression(name: Any, warmup_steps: int, options: dict[str, Any]) -> None:
    from dask_dl.train.compressors import AUTO, COMPRESSORS

    if name == AUTO:
        if options:
            raise ConfigurationError(
                f"compression_options={options!r} are one compressor's options; compression='auto' chooses the "
                "compressor at run start: pass no compression_options, or name the compressor (e.g. "
                "compression='powersgd', compression_options={'rank': 2})"
            )
        return
    COMPRESSORS.entry(name)
    from dask_dl.train.compression import make_compressor  # the options' checks (imports torch)

    make_compressor(name, warmup_steps=warmup_steps, **options)


def _check_combination(source: Any, o: dict[str, Any]) -> None:
    """Own models, fine-tuning and memory options are built for DDP: refuse what fsdp/pipeline would not honour."""
    parallel = o["parallel"]
    if source.kind != "registry" and (parallel != "ddp" or o["memory_budget"] is not None):
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
    used = [f"{k}={o[k]!r}" for k, off in defaults.items() if o[k] != off]
    if used:
        raise ConfigurationError(
            f"{', '.join(used)} apply to parallel='ddp' only (DDP's no_sync, autocast around its forward, the head's "
            f"parameter group); with parallel={parallel!r} leave them at their defaults, or train with parallel='ddp'"
        )


def _check_memory(o: dict[str, Any], data: dict[str, Any]) -> int | None:
    from dask_dl.train.parallel.memory import check_memory_budget, parse_budget

    budget = parse_budget(o["memory_budget"])
    if budget is not None:
        check_memory_budget(
            o["model"],
            o["model_kwargs"],
            num_outputs=len(data["labels"]),
            in_channels=data["channels"],
            budget=budget,
            parallel=o["parallel"],
            trainers=o["trainers"],
            stages=o["stages"],
            optimizer=o["optimizer"],
            momentum=o["momentum"],
        )
    return budget
