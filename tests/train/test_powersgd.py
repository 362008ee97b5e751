"""``compression/powersgd.py``: torch's PowerSGD hook with our counters, checks and per-name state.

Its distributed behaviour (bytes per step, DDP training, exact resume) is checked with the other compressors in
``test_hooks.py``'s gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

from dask_dl.errors import ConfigurationError
from dask_dl.testing.compression import FakeBucket, numel
from dask_dl.train.compression import make_compressor


def test_powersgd_needs_warmup_and_a_process_group():
    with pytest.raises(ConfigurationError, match="warmup_steps >= 2, got 0"):
        make_compressor("powersgd")
    with pytest.raises(ConfigurationError, match="rank must be an integer >= 1, got 0"):
        make_compressor("powersgd", warmup_steps=2, rank=0)
    compressor = make_compressor("powersgd", warmup_steps=2)
    shapes = [(6, 20), (7,)]
    with pytest.raises(ConfigurationError, match="needs a torch.distributed process group"):
        compressor.hook(compressor.state, FakeBucket(shapes, torch.ones(numel(shapes)))).wait()


def test_powersgd_without_memories_needs_no_warmup():
    compressor = make_compressor("powersgd", error_feedback=False, warm_start=False)
    assert compressor.state.powersgd.start_powerSGD_iter == 0
