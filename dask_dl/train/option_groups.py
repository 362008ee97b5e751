"""The options of :func:`dask_dl.fit`, each defined once, in the groups users think in.

Every option is a field of one group, a frozen dataclass (:class:`Training`, :class:`Optimization`,
:class:`ScaleOut`, :class:`Memory`, :class:`Recovery`, :class:`FineTuning`, :class:`Reporting`). Its
:class:`Option` metadata says where its default comes from (a ``dask-dl.train`` config key, or the group's default),
how a value is checked on its own, its one-line help and its flags on ``dask-dl train``. From these:

- ``fit`` takes each option as a flat keyword, or whole groups (``fit(ds, recovery=Recovery(max_restarts=5))``):
  :func:`flat_options` merges both and says when they disagree;
- :func:`dask_dl.train.options.check_run` fills each from the config and runs its check (:func:`resolve`), then
  the checks that take several options at once;
- :class:`~dask_dl.train.options.RunOptions` has one field per option (and per :data:`SETTINGS` entry), and the
  trainers' spec is made of those fields;
- the ``train`` command of the CLI makes one option per :func:`cli_options` entry.

``tests/train/test_options.py`` checks ``fit``'s signature and docstring, the config file and the CLI against these
definitions. Adding an option is one field here (with its keyword and paragraph in ``fit``, which that test asks
for), then its behaviour. Nothing here imports torch.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from dask_dl.checks import byte_count, one_of, positive_int
from dask_dl.errors import ConfigurationError

__all__ = [
    "AUGMENT_ON",
    "GROUPS",
    "OPTIMIZERS",
    "OPTIONS",
    "PRECISIONS",
    "SETTINGS",
    "VIEWS",
    "FineTuning",
    "Memory",
    "Optimization",
    "Option",
    "Recovery",
    "Reporting",
    "ScaleOut",
    "Setting",
    "Training",
    "cli_options",
    "flat_options",
    "resolve",
]

OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
VIEWS: tuple[str, ...] = ("none", "auto", "notebook", "terminal", "log")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
#: where a trainer augments and normalizes its batches (:func:`dask_dl.train.feed.where_to_augment`)
AUGMENT_ON: tuple[str, ...] = ("auto", "cpu", "device")


@dataclass(frozen=True)
class Option:
    """What dask_dl knows of one option of ``fit`` besides its name, group and default.

    Attributes
    ----------
    help
        One line: the ``dask-dl train --help`` text of its flag.
    config
        Key under ``dask-dl.train`` whose value a None passed to ``fit`` stands for; None: the default is the group's.
    check
        ``check(name, value) -> value`` for a value given or configured (None is not checked): the checks of one
        value alone. Those that need other options or the data are in :func:`dask_dl.train.options.check_run`.
    flags
        Its flags on ``dask-dl train`` (the first is the long one); empty: not on the command line.
    cli
        The flag's kind: ``int``, ``float``, ``str``, ``"flag"`` (on/off), or a function returning the names
        it takes (called when the command is built).
    metavar
        What the flag's value is called in the help, when not its kind's.
    """

    help: str
    config: str | None = None
    check: Callable[[str, Any], Any] | None = None
    flags: tuple[str, ...] = ()
    cli: Any = None
    metavar: str | None = None
    name: str = ""
    group: str = ""


def option(default: Any = None, *, help: str, **meta: Any) -> Any:
    """A field of a group carrying its :class:`Option` (the default is ``fit``'s)."""
    return field(default=default, metadata={"option": Option(help=help, **meta)})


# ---- checks of one value ----------------------------------------------------------------------------------


def positive_real(name: str, value: Any, *, example: float) -> float:
    """``value`` as a float when it is a finite number above 0, else a ConfigurationError with an example."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0 and math.isfinite(value):
        return float(value)
    raise ConfigurationError(f"{name} must be a positive number, got {value!r}; pass e.g. {name}={example}")


def non_negative_real(name: str, value: Any) -> float:
    """``value`` as a float when it is a finite number >= 0, else a ConfigurationError."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0 and math.isfinite(value):
        return float(value)
    raise ConfigurationError(f"{name} must be a number >= 0, got {value!r}")


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as an int when it is an integer >= 0, else a ConfigurationError with an example."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise ConfigurationError(f"{name} must be an integer >= 0, got {value!r}; pass e.g. {name}=0")


def _count(example: int | None) -> Callable[[str, Any], int]:
    return lambda name, value: positive_int(name, value, example=example)


def _real(example: float) -> Callable[[str, Any], float]:
    return lambda name, value: positive_real(name, value, example=example)


def _choice(choices: Callable[[], tuple[str, ...]]) -> Callable[[str, Any], str]:
    return lambda name, value: one_of(name, value, tuple(choices()))


def _switch(name: str, value: Any) -> bool:
    return bool(value)


def _text(name: str, value: Any) -> str:
    return str(value)


def _mapping(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{name} must be a dict of keyword arguments, got {type(value).__name__}: {value!r}")
    return dict(value)


def _every(example: float, *, whole: bool) -> Callable[[str, Any], Any]:
    """Checkpoint intervals: 0 is off (None), else a positive count of steps or seconds."""

    def check(name: str, value: Any) -> Any:
        if value == 0 and not isinstance(value, bool):
            return None
        return positive_int(name, value, example=int(example)) if whole else positive_real(name, value, example=example)

    return check


def _directory(name: str, value: Any) -> str:
    from dask_dl.cluster.storage import absolute

    return absolute(value)  # rank 0 writes there, from another working directory


def _weights(name: str, value: Any) -> str:
    if not isinstance(value, str | os.PathLike):
        raise ConfigurationError(
            f"{name} must be a path or URL of a weights file, got {type(value).__name__}; pass e.g. "
            "weights='pretrained.pt' (torch.save(model.state_dict(), 'pretrained.pt'))"
        )
    return os.fspath(value)


def _schedule(name: str, value: Any) -> dict[str, Any]:
    from dask_dl.train.tuning import check_schedule

    return check_schedule(value)


def _compressors() -> tuple[str, ...]:
    from dask_dl.train.compressors import choices

    return tuple(choices())


def _models() -> tuple[str, ...]:
    from dask_dl.models import MODELS

    return tuple(MODELS.names())


def _parallel_modes() -> tuple[str, ...]:
    from dask_dl.train.parallel import PARALLEL

    return tuple(PARALLEL)


def _schedules() -> tuple[str, ...]:
    from dask_dl.train.tuning import SCHEDULES

    return tuple(SCHEDULES)


# ---- the groups -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Training:
    """What to train: the model and its loss, for how long, on which batches of which pixels."""

    model: Any = option(help="Model.", config="model", flags=("--model", "-m"), cli=_models)
    model_kwargs: dict[str, Any] | None = option(help="Keyword arguments of the model's builder.", check=_mapping)
    loss: Any = option(help="bce (multi-label), ce (single-label) or a function (logits, targets) -> loss.")
    epochs: int | None = option(
        help="Epochs in all (a resumed run continues up to it).",
        config="epochs",
        check=_count(None),
        flags=("--epochs", "-e"),
        cli=int,
    )
    batch_size: int | None = option(
        help="Images per step on each trainer.",
        config="batch-size",
        check=_count(32),
        flags=("--batch-size", "-b"),
        cli=int,
    )
    seed: int | None = option(
        help="Seed of weights, data order and augmentation.",
        config="seed",
        check=non_negative_int,
        flags=("--seed",),
        cli=int,
    )
    augment: bool = option(
        False,
        help="Random affine and brightness/contrast augmentation.",
        check=_switch,
        flags=("--augment",),
        cli="flag",
    )
    augment_on: str = option(
        "auto",
        help="Where batches are augmented and normalized: auto (device on a GPU trainer, else cpu), cpu, device.",
        check=_choice(lambda: AUGMENT_ON),
        flags=("--augment-on",),
        cli=lambda: AUGMENT_ON,
    )
    normalization: dict[str, Any] | None = option(
        help="Pixels as (x / 255 - MEAN) / STD: numbers, or one per channel separated by commas "
        "(0.485,0.456,0.406:0.229,0.224,0.225); imagenet: those, for ImageNet weights; stats: measured on the train "
        "split, one pass on the cluster. Default 0.5:0.25.",
        flags=("--normalization",),
        cli=str,
        metavar="MEAN:STD|imagenet|stats",
    )


@dataclass(frozen=True)
class Optimization:
    """How the weights move: optimizer, learning rate and its schedule, micro-batches per step."""

    lr: float | None = option(help="Learning rate.", config="lr", check=_real(0.01), flags=("--lr",), cli=float)
    optimizer: str | None = option(
        help="Optimizer (default: config).",
        config="optimizer",
        check=_choice(lambda: OPTIMIZERS),
        flags=("--optimizer",),
        cli=lambda: OPTIMIZERS,
    )
    schedule: str | dict[str, Any] | None = option(
        help="Learning-rate schedule.", config="schedule", check=_schedule, flags=("--schedule",), cli=_schedules
    )
    accumulate: int | None = option(
        help="Micro-batches per optimizer step.",
        config="accumulate",
        check=_count(4),
        flags=("--accumulate",),
        cli=int,
    )


@dataclass(frozen=True)
class ScaleOut:
    """Over how many trainers, sharing the model how, sending gradients how."""

    trainers: int | None = option(
        help="Data-parallel trainers, one per worker.",
        config="trainers",
        check=_count(2),
        flags=("--trainers", "-t"),
        cli=int,
    )
    compression: str | None = option(
        help="Gradient compressor.", config="compression", flags=("--compression", "-c"), cli=_compressors
    )
    compression_options: dict[str, Any] | None = option(help="Keyword arguments of the compressor.", check=_mapping)
    warmup_steps: int | None = option(
        help="Uncompressed steps before a compressor starts.", config="warmup-steps", check=non_negative_int
    )
    parallel: str | None = option(
        help="How the trainers share the model: ddp (each all of it), fsdp (sharded), pipeline (stages).",
        config="parallel",
        flags=("--parallel",),
        cli=_parallel_modes,
    )
    stages: int | None = option(help="Pipeline stages (--parallel pipeline; default 2).", flags=("--stages",), cli=int)
    microbatches: int | None = option(
        help="Micro-batches per pipeline batch (default: stages).", flags=("--microbatches",), cli=int
    )


@dataclass(frozen=True)
class Memory:
    """Number formats and memory: precision, memory layout, recomputed activations, the model state's budget."""

    precision: str | None = option(
        help="fp32, bf16, or fp16 (GPU only).",
        config="precision",
        check=_choice(lambda: PRECISIONS),
        flags=("--precision",),
        cli=lambda: PRECISIONS,
    )
    channels_last: bool = option(False, help="Channels-last memory format on GPU trainers.", check=_switch)
    activation_checkpointing: bool = option(
        False, help="Recompute the blocks' activations in backward to save memory.", check=_switch
    )
    memory_budget: int | str | None = option(
        help="Model state one trainer may hold, e.g. '2 GiB'; checked first.",
        config="memory-budget",
        flags=("--memory-budget",),
        cli=str,
    )


@dataclass(frozen=True)
class Recovery:
    """Where checkpoints go and how often, and what a lost trainer costs."""

    checkpoint_dir: str | None = option(
        help="Directory or fsspec URL for one checkpoint per epoch.",
        config="checkpoint-dir",
        check=_directory,
        flags=("--checkpoint-dir",),
        cli=str,
    )
    resume: bool = option(
        False,
        help="Continue from the latest checkpoint in --checkpoint-dir.",
        check=_switch,
        flags=("--resume",),
        cli="flag",
    )
    max_restarts: int | None = option(
        help="Restarts after a lost trainer before failing (0: none).",
        config="max-restarts",
        check=non_negative_int,
        flags=("--max-restarts",),
        cli=int,
    )
    min_trainers: int | None = option(
        help="Fewest trainers a restarted run goes on with.",
        config="min-trainers",
        check=_count(1),
        flags=("--min-trainers",),
        cli=int,
    )
    checkpoint_every_steps: int | None = option(
        help="Also checkpoint every N steps inside epochs.",
        config="checkpoint-every-steps",
        check=_every(100, whole=True),
        flags=("--checkpoint-every",),
        cli=int,
    )
    checkpoint_every_seconds: float | None = option(
        help="Also checkpoint every T seconds inside epochs.",
        config="checkpoint-every-seconds",
        check=_every(300, whole=False),
    )


@dataclass(frozen=True)
class FineTuning:
    """Starting from other weights: which, and how long and how fast the head trains alone."""

    weights: str | os.PathLike | None = option(
        help="Start weights: a state dict file or checkpoint (path or fsspec URL).",
        check=_weights,
        flags=("--weights",),
        cli=str,
    )
    freeze_epochs: int = option(
        0,
        help="Epochs training only the head (backbone frozen).",
        check=non_negative_int,
        flags=("--freeze-epochs",),
        cli=int,
    )
    head_lr: float | None = option(
        help="Learning rate of the head (default: --lr).", check=_real(0.01), flags=("--head-lr",), cli=float
    )


@dataclass(frozen=True)
class Reporting:
    """How the run is watched while it goes on, besides ``run.history``."""

    view: str = option("none", help="Live view of the progress.", check=_choice(lambda: VIEWS))
    tensorboard: str | None = option(help="Directory of TensorBoard scalars.", check=_text)


#: ``fit``'s keyword of each group, in the order of the groups' fields in ``fit``'s signature
GROUPS: dict[str, type] = {
    "training": Training,
    "optimization": Optimization,
    "scale_out": ScaleOut,
    "memory": Memory,
    "recovery": Recovery,
    "fine_tuning": FineTuning,
    "reporting": Reporting,
}


def _collect() -> dict[str, Option]:
    found: dict[str, Option] = {}
    for group, cls in GROUPS.items():
        for f in fields(cls):
            assert f.name not in found, f"option {f.name!r} is defined in two groups"
            found[f.name] = replace(f.metadata["option"], name=f.name, group=group)
    return found


#: every option of ``fit``, by name, in the order of the groups
OPTIONS: dict[str, Option] = _collect()
#: ``fit``'s default of every option (None: the config key's value)
DEFAULTS: dict[str, Any] = {f.name: f.default for cls in GROUPS.values() for f in fields(cls)}


@dataclass(frozen=True)
class Setting:
    """A ``dask-dl.train`` config key that is no keyword of ``fit``: set for every run of a session or site."""

    key: str
    #: the :class:`~dask_dl.train.options.RunOptions` field it fills; None: read where it is used
    field: str | None
    check: Callable[[str, Any], Any] | None = None


#: the ``dask-dl.train`` keys that only the config sets (docs/reference/config.md, dask-dl.yaml)
SETTINGS: tuple[Setting, ...] = (
    Setting("momentum", "momentum", non_negative_real),
    Setting("weight-decay", "weight_decay", non_negative_real),
    Setting("timeout", "timeout_s", _real(120)),
    Setting("hang-grace", "hang_grace_s", _real(30)),
    Setting("restart-wait", "restart_wait_s", _real(60)),
    Setting("check-every", "check_every", _count(8)),
    Setting("prefetch", "prefetch"),
    Setting("shuffle-window", "window"),
    Setting("cache", "cache", lambda name, value: byte_count(name, value)),
    Setting("deterministic", "deterministic", _switch),
    Setting("pipeline-schedule", "pipeline_schedule"),  # checked with the other pipeline options
    Setting("fused-kernels", None),  # read by dask_dl.train.compression
)


def flat_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every option by name from ``fit``'s keywords: flat ones and groups (``recovery=Recovery(...)``) merged.

    A flat keyword left at its default takes the group's value; one set to something else wins over a group that
    leaves it at its default.

    Raises
    ------
    ConfigurationError
        An unknown keyword, a group of the wrong class, or an option set both flat and in its group to different
        values.
    """
    unknown = sorted(set(given) - set(OPTIONS) - set(GROUPS))
    if unknown:
        import difflib

        hints = [
            f"{name!r} (did you mean {close[0]!r}?)"
            if (close := difflib.get_close_matches(name, OPTIONS, 1))
            else repr(name)
            for name in unknown
        ]
        raise ConfigurationError(f"fit has no option {', '.join(hints)}; see help(dask_dl.fit) for its options")
    out = {name: given.get(name, DEFAULTS[name]) for name in OPTIONS}
    for keyword, cls in GROUPS.items():
        group = given.get(keyword)
        if group is None:
            continue
        if not isinstance(group, cls):
            raise ConfigurationError(
                f"{keyword} must be a dask_dl.{cls.__name__}(...), got {type(group).__name__}: {group!r}; pass e.g. "
                f"{keyword}=dask_dl.{cls.__name__}() or its options as keywords of fit"
            )
        for f in fields(cls):
            value = getattr(group, f.name)
            if value is f.default or value == f.default:
                continue
            flat = out[f.name]
            if flat is not f.default and flat != value:
                raise ConfigurationError(
                    f"{f.name}={flat!r} and {keyword}={cls.__name__}({f.name}={value!r}) set {f.name} twice; pass it "
                    f"once, as a keyword of fit or in {keyword}"
                )
            out[f.name] = value
    return out


def resolve(options: Mapping[str, Any]) -> dict[str, Any]:
    """Fill every option that is None from its config key, check it alone, and add the :data:`SETTINGS`."""
    from dask_dl import config

    out: dict[str, Any] = {}
    for name, opt in OPTIONS.items():
        value = options[name]
        if value is None and opt.config is not None:
            value = config.get(f"train.{opt.config}")
        if value is not None and opt.check is not None:
            value = opt.check(name, value)
        out[name] = value
    for setting in SETTINGS:
        if setting.field is None:
            continue
        value = config.get(f"train.{setting.key}")
        if value is not None and setting.check is not None:
            value = setting.check(f"dask-dl.train.{setting.key}", value)
        out[setting.field] = value
    return out


def cli_options() -> list[Option]:
    """The options that are flags of ``dask-dl train``, in the groups' order."""
    return [opt for opt in OPTIONS.values() if opt.flags]
