"""What a test does when a server or tool it needs is missing: skip it, except under CI, where that is a failure.

CI (``CI=true``, as ``.ci/run`` runs) installs and starts everything the suite needs: a dask-gateway server, a
single-node SLURM, an S3 server, Chromium. There, a server that does not start is a broken setup, and a skip would
let the run pass with the cluster tests not run. On a developer's machine it stays a skip that says why.
"""

from __future__ import annotations

import os
from typing import NoReturn

__all__ = ["in_ci", "unavailable"]


def in_ci() -> bool:
    """Whether this run is CI's: ``CI`` set to ``true`` (or ``1``, ``yes``), as CI services and ``.ci/run`` set it."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip the calling test (or fixture) because ``reason``; under CI fail it instead, with the same words."""
    import pytest

    if in_ci():
        pytest.fail(f"{reason} (CI=true: everything the suite needs must be there; see .ci/run)", pytrace=False)
    pytest.skip(reason)
