"""Settings of dask_dl, kept in ``dask.config`` under the ``dask-dl`` key.

The defaults ship in ``dask-dl.yaml`` beside this module. Users override them the usual Dask ways: a
``~/.config/dask/dask-dl.yaml``, environment variables such as ``DASK_DASK_DL__TRAIN__EPOCHS=10`` (dask strips
one ``DASK_``), or ``dask.config.set({"dask-dl.train.epochs": 10})``. Functions take ``None`` for an option to
mean "from config".
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

_FN = os.path.join(os.path.dirname(__file__), "dask-dl.yaml")

with open(_FN) as _f:
    _defaults = yaml.safe_load(_f)

dask.config.update_defaults(_defaults)


def get(key: str, value: Any = None) -> Any:
    """Return ``value`` if it is not None, else the ``dask-dl.<key>`` setting.

    Examples
    --------
    >>> get("ingest.size")
    224
    >>> get("ingest.size", 128)
    128
    """
    if value is not None:
        return value
    return dask.config.get(f"dask-dl.{key}")
