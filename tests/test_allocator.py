"""glibc's allocator settings for a worker's hot loops, in processes started as Dask's nanny starts workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dask_dl import allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")

# 200 steps that each allocate, fill and free a 1 MiB buffer (an activation; under 2 MiB, so no transparent huge
# page can back it and hide the faults): minor page faults counted per mode
FAULTS = """
import resource, sys
import numpy as np
from dask_dl import allocator
mode = sys.argv[1]
if mode == "held":
    assert allocator.keep_freed_memory()
if mode == "restored":
    assert allocator.keep_freed_memory() and allocator.restore()
if mode == "held twice, let go once":
    assert allocator.keep_freed_memory() and allocator.keep_freed_memory()
    assert allocator.restore() is False  # the other holder still keeps the settings
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    buffer = np.empty(2**20, np.uint8)
    buffer.fill(1)
    del buffer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

# 48 MiB in 1 MiB buffers, all alive at once, then freed under a small buffer allocated after them and still alive
# (so that trimming the top of the heap cannot give them back): what the process holds before, while held, after
RESIDENT = """
import numpy as np
from dask_dl import allocator
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 // 2**20
base = resident()
with allocator.kept_freed_memory() as held:
    assert held
    buffers = [np.ones(2**20, np.uint8) for _ in range(48)]
    pin = np.ones(2**18, np.uint8)
    del buffers
    kept = resident()
print(base, kept, resident())
"""


def run(program: str, *args: str) -> str:
    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="65536")  # what distributed's nanny sets for every worker
    out = subprocess.run([sys.executable, "-c", program, *args], env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def test_freed_memory_is_reused_instead_of_faulted_in_again():
    pages = 200 * 2**20 // 4096
    nanny, held, restored = (int(run(FAULTS, mode)) for mode in ("nanny", "held", "restored"))
    assert nanny > pages // 2  # every buffer is a fresh mapping: its pages fault in again
    assert held < pages // 20  # the heap keeps the freed buffer and hands it out again
    assert restored > pages // 2  # letting go puts the nanny's behaviour back


def test_settings_stay_until_the_last_holder_lets_go():
    # a trainer's teardown must not undo an ingest task's settings on the same worker, nor the other way round
    assert int(run(FAULTS, "held twice, let go once")) < 200 * 2**20 // 4096 // 20


def test_the_last_holder_hands_freed_memory_back():
    base, kept, after = (int(mb) for mb in run(RESIDENT).split())
    assert kept >= base + 40  # kept for the next allocation while held
    assert after <= base + 8  # not left to the worker's memory reading once nothing holds it


def test_settings_apply_in_this_process():
    assert allocator.keep_freed_memory() is True
    assert allocator.restore() is True
    assert allocator.restore() is False  # nothing held: nothing to let go of
    with allocator.kept_freed_memory() as held:
        assert held is True
