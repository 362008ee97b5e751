"""The trainer's glibc allocator settings, in a process started as Dask's nanny starts workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dask_dl.train import allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")

# 200 steps that each allocate, fill and free a 1 MiB buffer (an activation; under 2 MiB, so no transparent huge
# page can back it and hide the faults): minor page faults counted per mode
PROGRAM = """
import resource, sys
import numpy as np
from dask_dl.train import allocator
mode = sys.argv[1]
if mode == "tuned":
    assert allocator.keep_freed_memory()
if mode == "restored":
    assert allocator.keep_freed_memory() and allocator.restore()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    buffer = np.empty(2**20, np.uint8)
    buffer.fill(1)
    del buffer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="65536")  # what distributed's nanny sets for every worker
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], env=env, check=True, capture_output=True, text=True)
    return int(out.stdout.strip())


def test_freed_memory_is_reused_instead_of_faulted_in_again():
    nanny, tuned, restored = faults("nanny"), faults("tuned"), faults("restored")
    pages = 200 * 2**20 // 4096
    assert nanny > pages // 2  # every buffer is a fresh mapping: its pages fault in again
    assert tuned < pages // 20  # the heap keeps the freed buffer and hands it out again
    assert restored > pages // 2  # teardown puts the nanny's behaviour back


def test_settings_apply_in_this_process():
    assert allocator.keep_freed_memory() is True
    assert allocator.restore() is True
