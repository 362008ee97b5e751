"""Running a command's work: the cluster it connects to, and following a run until it ends or Ctrl-C stops it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import click

from dask_dl.interrupt import caught_interrupt


@contextlib.contextmanager
def connect(scheduler: str | None, n_workers: int | None) -> Any:
    """The command's cluster (:func:`dask_dl.cluster.connect`), whose workers get this command's storage settings.

    fsspec reads its settings from ``FSSPEC_<PROTOCOL>_<OPTION>`` variables (``FSSPEC_S3_ENDPOINT_URL``,
    ``FSSPEC_S3_KEY``, ...) and ``~/.config/fsspec``; the workers of a gateway, SLURM or remote cluster do not see
    this shell's, so the settings of every remote protocol go to them (``set_storage_options``) before any work.
    """
    import fsspec.config

    from dask_dl.cluster import connect as connect_cluster
    from dask_dl.cluster import set_storage_options

    settings = {
        protocol: dict(values)
        for protocol, values in fsspec.config.conf.items()
        if protocol not in ("file", "local") and isinstance(values, dict) and values
    }
    with connect_cluster(scheduler=scheduler, n_workers=n_workers) as client:
        if settings:
            set_storage_options(client, settings)
        yield client


def follow(run: Any, echo: Callable[[Any], Any], stopping: str, shown: Any = 0) -> bool:
    """Print what ``run`` adds until it ends (``echo(shown) -> shown``, from ``shown``); Ctrl-C stops it and waits
    for its end.

    Returns whether Ctrl-C stopped it: the command then exits with status 130 once it has printed what the run
    did, as shells report a command that Ctrl-C ended, so that a script's next step does not start.
    """
    interrupted = False
    try:
        with caught_interrupt() as interrupt:  # raised here, never lost in a finalizer (dask_dl.interrupt)
            while not run.done:
                time.sleep(0.1)
                interrupt.check()
                shown = echo(shown)
    except KeyboardInterrupt:
        interrupted = True
        click.echo(f"{stopping} within a few steps ...", err=True)
        run.stop()
        while not run.done:
            time.sleep(0.2)
    echo(shown)
    return interrupted
