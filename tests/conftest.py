"""Shared fixtures: the real data in ../shared/data, Dask's own cluster fixtures, GPU skipping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Registers dask_dl's config defaults before distributed.utils_test snapshots dask.config: its fixtures reset the
# config to that snapshot, which would otherwise lack the "dask-dl" key.
import dask_dl.config  # noqa: F401  # isort: skip

# distributed's harness: ``client`` gives a Client of a real LocalCluster (2 worker processes) per test,
# ``gen_cluster`` (imported in the tests that use it) an in-process cluster for async tests.
from distributed.utils_test import (  # noqa: F401
    cleanup,
    client,
    cluster_fixture,
    loop,
    loop_in_thread,
)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("DASK_DL_SHARED_DATA", REPO.parent / "shared" / "data"))


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch always installed here
        return False


def pytest_collection_modifyitems(config, items):
    if not any("gpu" in item.keywords for item in items):
        return
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data``: the real NIH table, two NIH images and two DICOM files. Skips when absent."""
    if not (SHARED_DATA / "nih" / "Data_Entry_2017_v2020.csv.gz").exists():
        pytest.skip(f"real data not found at {SHARED_DATA} (set DASK_DL_SHARED_DATA)")
    return SHARED_DATA
