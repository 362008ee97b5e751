"""The user's code on the workers: modules a run ships by reference, checked on the workers before work is sent.

A model passed as ``"mymodels:build_net"``, a module of a class defined in ``mymodels.py``, or a loss function
from an importable module travels to the workers as a reference (cloudpickle's rule for anything importable):
each worker imports ``mymodels`` itself. A worker that cannot would fail inside the first call, with distributed's
tracebacks and no word of the fix. :func:`check_importable` asks the workers first and names the module, the
workers and the fix (install it there, or ``client.upload_file``).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from dask_dl.cluster.workers import ask_workers
from dask_dl.errors import ClusterError

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["check_importable"]


def _find(names: list[str]) -> dict[str, str | None]:
    """On a worker: for each module name, None when it can be imported, else why not (nothing is run)."""
    import importlib.util

    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = None if importlib.util.find_spec(name) is not None else f"no module named {name!r}"
        except Exception as exc:  # a probe: a parent package that fails to import is an answer too
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


def _how_to_send(name: str) -> str:
    """``client.upload_file(...)`` with the driver's file of ``name`` when it is one plain module."""
    path = getattr(sys.modules.get(name), "__file__", None)
    if name.partition(".")[0] != name or not path or os.path.basename(path) == "__init__.py":
        package = name.partition(".")[0]
        return f"client.upload_file('{package}.zip') with the package zipped (dask-dl train --upload {package}.zip)"
    return f"client.upload_file({path!r}) (dask-dl train --upload {path})"


def check_importable(client: Client, needs: dict[str, str], *, workers: list[str] | None = None) -> None:
    """Make sure every worker (or ``workers``) can import each module of ``needs``, before any work is sent.

    A worker lost while it is asked is left out (:func:`~dask_dl.cluster.workers.ask_workers`): it takes no work.

    Parameters
    ----------
    client
        Client of the cluster.
    needs
        ``{module name: what needs it}``, e.g. ``{"mymodels": "model 'mymodels:build_net'"}``.
    workers
        Only ask these workers (e.g. the trainers); default all.

    Raises
    ------
    ClusterError
        A worker cannot import a module; the message names the module, what needs it, the workers and why, and
        the fix.
    """
    names = sorted(n for n in needs if n and n != "__main__")
    if not names:
        return
    answers = ask_workers(client, _find, names, workers=workers)
    for name in names:
        missing = {w: found[name] for w, found in sorted(answers.items()) if found.get(name)}
        if missing:
            where = "; ".join(f"worker {w}: {why}" for w, why in missing.items())
            raise ClusterError(
                f"{needs[name]} needs module {name!r}, which {len(missing)} of {len(answers)} worker(s) cannot "
                f"import ({where}). Install it where those workers run (or start them with it on their PYTHONPATH), or "
                f"send it to them from Python before the run: {_how_to_send(name)}"
            )
