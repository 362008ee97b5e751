"""The Optuna study of a sweep: where it is kept, and whether a storage holds this sweep or another one.

Only the client writes the study (Optuna runs there, ask-and-tell). ``storage=`` a path is an SQLite file
(``sqlite:///PATH``), anything with ``://`` an Optuna RDB URL, None a study in memory. The study records what the
sweep is (metric, direction, store, space) as user attributes, so that ``resume=True`` continues only the same
sweep, and a storage that holds another one is refused before any trial.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from dask_dl.errors import ConfigurationError

__all__ = ["STUDY_NAME", "open_study", "quiet_optuna", "storage_url"]

STUDY_NAME = "dask-dl-sweep"


@contextmanager
def quiet_optuna() -> Iterator[None]:
    """Leave out Optuna's INFO lines while a sweep opens its studies ("A new study created in memory with name:
    no-name-...", "Using an existing study ..."): the sweep's table and the command's lines say what happened.
    Optuna's verbosity is set back after, for the user's own studies."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(max(verbosity, optuna.logging.WARNING))
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def storage_url(storage: str | os.PathLike | None) -> str | None:
    """The Optuna storage URL of ``storage``: a path becomes ``sqlite:///ABSOLUTE_PATH``."""
    if storage is None:
        return None
    text = os.fspath(storage)
    if "://" in text:
        return text
    return "sqlite:///" + os.path.abspath(text)


def describe(*, metric: str, direction: str, store: str, space: Any) -> dict[str, Any]:
    """What identifies a sweep in its study's user attributes (plain JSON values)."""
    from optuna.distributions import distribution_to_json

    if isinstance(space, Mapping):
        shape: Any = {k: json.loads(distribution_to_json(v)) for k, v in sorted(space.items())}
    else:
        shape = f"define-by-run {getattr(space, '__qualname__', type(space).__name__)}"
    return {
        "metric": metric,
        "direction": direction,
        "store": os.path.abspath(store) if "://" not in store else store,
        "space": shape,
    }


def open_study(
    storage: str | os.PathLike | None,
    *,
    resume: bool,
    sampler: Any,
    pruner: Any,
    identity: dict[str, Any],
) -> Any:
    """Create the sweep's study, or load it to continue (``resume=True``).

    Raises
    ------
    ConfigurationError
        ``resume=True`` without a storage; a storage that holds a study of another name or another sweep (another
        metric, direction, store or space); a storage that holds this sweep's trials without ``resume=True``.
    """
    import optuna

    url = storage_url(storage)
    if url is None:
        if resume:
            raise ConfigurationError("resume=True continues a sweep kept in a storage; pass storage='sweep.db'")
        with quiet_optuna():
            study = optuna.create_study(sampler=sampler, pruner=pruner, direction=identity["direction"])
        return _created(study, identity)
    names = [s.study_name for s in optuna.study.get_all_study_summaries(url, include_best_trial=False)]
    others = [n for n in names if n != STUDY_NAME]
    if others:
        raise ConfigurationError(
            f"storage {os.fspath(storage)!r} holds another study ({', '.join(others)}), not a dask_dl sweep; pass "
            "a new storage path"
        )
    if not names:
        with quiet_optuna():
            study = optuna.create_study(
                storage=url, study_name=STUDY_NAME, sampler=sampler, pruner=pruner, direction=identity["direction"]
            )
        return _created(study, identity)
    with quiet_optuna():
        study = optuna.load_study(study_name=STUDY_NAME, storage=url, sampler=sampler, pruner=pruner)
    recorded = {key: study.user_attrs.get(key) for key in identity}
    differ = [key for key in identity if recorded[key] != identity[key]]
    if differ:
        shown = "; ".join(f"{k}: stored {recorded[k]!r}, asked {identity[k]!r}" for k in differ)
        raise ConfigurationError(
            f"storage {os.fspath(storage)!r} holds another sweep ({shown}); pass a new storage path, or the "
            "same metric, direction, dataset and space to continue it"
        )
    if not resume:
        raise ConfigurationError(
            f"storage {os.fspath(storage)!r} holds this sweep already ({len(study.trials)} trials); pass "
            "resume=True to continue it, or a new storage path to start afresh"
        )
    return study


def _created(study: Any, identity: dict[str, Any]) -> Any:
    for key, value in identity.items():
        study.set_user_attr(key, value)
    return study
