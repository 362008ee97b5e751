"""A sweep's search space, checked against :func:`dask_dl.fit`'s options before any trial starts.

A space is a dict from ``fit`` keyword names to Optuna distributions, or a function of an ``optuna.Trial`` that
returns ``fit`` keywords (define-by-run, for conditional spaces). :func:`check_space` refuses, with one error
each, a key ``fit`` does not take (naming the nearest option), a key the sweep sets itself, an empty space and a
number distribution on an option that takes no number. :func:`space_from_yaml` reads the YAML form of the CLI.

YAML form: a list is a choice (``model: [small_cnn, resnet18]``); a mapping with ``low`` and ``high`` is a
range, of integers when both bounds are integers (``epochs: {low: 1, high: 5, step: 1}``), else of floats
(``lr: {low: 1e-4, high: 0.3, log: true}``); anything else is fixed for every trial (``batch_size: 16``,
``model_kwargs: {width: 8}``).
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from dask_dl.errors import ConfigurationError, import_optional

__all__ = ["SWEEP_SET", "check_fixed", "check_space", "fit_options", "space_from_yaml"]

#: fit keywords the sweep sets for every trial, with what to use instead
SWEEP_SET: dict[str, str] = {
    "client": "pass client= to sweep",
    "wait": "pass wait= to sweep",
    "workers": "the sweep gives each trial its own group of workers",
    "trainers": "pass trainers_per_trial= to sweep",
    "resume": "pass resume=True to sweep to continue a sweep",
    "checkpoint_dir": "checkpoint_dir= given to sweep is the folder of the trials' own checkpoint folders",
}


def fit_options() -> dict[str, str]:
    """``{keyword: annotation}`` of :func:`dask_dl.fit`'s options (annotations as written: ``float | None``)."""
    from dask_dl.train.run import fit

    params = inspect.signature(fit).parameters
    return {name: str(p.annotation) for name, p in params.items() if name != "dataset"}


def _nearest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}? " if close else ""


def check_key(key: Any, options: Mapping[str, str], *, where: str) -> None:
    """Raise a ConfigurationError when ``key`` is not an option of ``fit`` the sweep lets a trial choose."""
    if not isinstance(key, str) or key not in options:
        raise ConfigurationError(
            f"{where} has the key {key!r}, which is not an option of dask_dl.fit; {_nearest(str(key), list(options))}"
            f"the options are {', '.join(sorted(options))}"
        )
    if key in SWEEP_SET:
        raise ConfigurationError(f"{where} sets {key!r}, which the sweep sets for each trial: {SWEEP_SET[key]}")


def _takes(annotation: str) -> tuple[bool, bool]:
    """(takes an int, takes a float) from an annotation string."""
    return bool(re.search(r"\bint\b", annotation)), bool(re.search(r"\bfloat\b", annotation))


def check_space(space: Any) -> dict[str, Any] | Callable[[Any], dict[str, Any]]:
    """Return ``space`` checked: a dict of Optuna distributions over ``fit`` options, or a define-by-run function.

    Raises
    ------
    ConfigurationError
        An empty space, a key ``fit`` does not take (with the nearest option), a key the sweep sets itself, a
        value that is no Optuna distribution, or a number range on an option that takes no number (or a float
        range on one that takes only integers).
    """
    import_optional("optuna", extra="sweep", purpose="a sweep's space")
    from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

    if callable(space) and not isinstance(space, Mapping):
        return space
    if not isinstance(space, Mapping):
        raise ConfigurationError(
            f"space must be a dict of fit options to Optuna distributions or a function of an optuna.Trial, got "
            f"{type(space).__name__}; pass e.g. space={{'lr': FloatDistribution(1e-4, 0.3, log=True)}}"
        )
    if not space:
        raise ConfigurationError(
            "space is empty: there is nothing to search; pass e.g. space={'lr': "
            "optuna.distributions.FloatDistribution(1e-4, 0.3, log=True)}"
        )
    options = fit_options()
    for key, dist in space.items():
        check_key(key, options, where="space")
        if not isinstance(dist, BaseDistribution):
            raise ConfigurationError(
                f"space[{key!r}] is {dist!r}, not an Optuna distribution; pass e.g. "
                f"optuna.distributions.CategoricalDistribution([{dist!r}]) (or fix the value with {key}= to sweep)"
            )
        takes_int, takes_float = _takes(options[key])
        if isinstance(dist, IntDistribution) and not (takes_int or takes_float):
            raise ConfigurationError(
                f"space[{key!r}] is {dist!r}, but fit's {key} takes no number ({options[key]}); "
                f"list its values: CategoricalDistribution([...])"
            )
        if isinstance(dist, FloatDistribution) and not takes_float:
            what, fix = (
                ("takes no float", "use IntDistribution")
                if takes_int
                else ("takes no number", "list its values: CategoricalDistribution([...])")
            )
            raise ConfigurationError(f"space[{key!r}] is {dist!r}, but fit's {key} {what} ({options[key]}); {fix}")
        if isinstance(dist, CategoricalDistribution) and not dist.choices:
            raise ConfigurationError(f"space[{key!r}] has no choices; list at least one value")
    return dict(space)


def check_fixed(fit_kwargs: Mapping[str, Any], space: Any) -> dict[str, Any]:
    """Return the fit keywords fixed for every trial, checked; keys also in a dict ``space`` are refused."""
    options = fit_options()
    for key in fit_kwargs:
        check_key(key, options, where="sweep's fit keywords")
    if isinstance(space, Mapping):
        both = sorted(set(space) & set(fit_kwargs))
        if both:
            raise ConfigurationError(
                f"{', '.join(both)} is both searched (in space) and fixed (a keyword of sweep); keep one of them"
            )
    return dict(fit_kwargs)


def _number(key: str, name: str, value: Any) -> int | float:
    if isinstance(value, bool):
        raise ConfigurationError(f"space {key!r}: {name} is {value!r}, not a number")
    if isinstance(value, int | float):
        return value
    try:  # YAML 1.1 reads 1e-4 (no dot) as a string
        return float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"space {key!r}: {name} is {value!r}, not a number; write e.g. {name}: 0.001"
        ) from None


def _scalar(value: Any) -> Any:
    """A YAML value, with ``1e-4`` read as the number it means (YAML 1.1 wants ``1.0e-4`` and reads a string)."""
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value):
        return float(value)
    return value


def space_from_yaml(mapping: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return ``(space, fixed)`` from the YAML form of a space (see the module's docstring).

    Raises
    ------
    ConfigurationError
        Not a mapping, a range without ``low`` and ``high`` or with unknown fields, bounds that are no numbers.
    """
    import_optional("optuna", extra="sweep", purpose="dask-dl sweep --space")
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if not isinstance(mapping, Mapping):
        raise ConfigurationError(
            f"a space file holds a mapping of fit options, got {type(mapping).__name__}; write e.g.\n"
            "lr: {low: 1.0e-4, high: 0.3, log: true}\nmodel: [small_cnn, resnet18]"
        )
    space: dict[str, Any] = {}
    fixed: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, list):
            space[key] = CategoricalDistribution([_scalar(v) for v in value])
        elif isinstance(value, Mapping) and ({"low", "high"} & set(value)):
            unknown = sorted(set(value) - {"low", "high", "log", "step"})
            if unknown or not {"low", "high"} <= set(value):
                raise ConfigurationError(
                    f"space {key!r}: a range has low, high and optionally log and step, got {dict(value)!r}; "
                    "write e.g. {low: 1.0e-4, high: 0.3, log: true}"
                )
            low, high = _number(key, "low", value["low"]), _number(key, "high", value["high"])
            step = None if value.get("step") is None else _number(key, "step", value["step"])
            log = bool(value.get("log", False))
            if all(isinstance(v, int) for v in (low, high)) and (step is None or isinstance(step, int)):
                space[key] = IntDistribution(low, high, log=log, step=step or 1)
            else:
                space[key] = FloatDistribution(float(low), float(high), log=log, step=step)
        else:
            fixed[key] = _scalar(value)
    return space, fixed
