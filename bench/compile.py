"""What a fresh install pays before its first 1-bit step: numba's cold compile of the kernels, and how fast the
parallel kernels run once compiled.

numba keeps compiled kernels in a cache beside the module, so the cost is paid once per install (and once per
fresh clone in CI). Each compile here runs in a new process with an empty cache (``NUMBA_CACHE_DIR``):

- the serial twins alone (torch on one thread: what one-thread workers compile);
- both twins (torch on two threads: the parallel twins too).

Then quantize + decode of a 4096x6400 bucket (the size of AlexNet's largest layer) by the parallel twins on two
threads, as a multiple of one copy of the bucket into allocated memory, both measured in this run (best of 15).

    python bench/compile.py        # about 1.5 min on 2 cores
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np

_COMPILE = """
import time, torch
torch.set_num_threads({threads})
from dask_dl.train.compression import fused
start = time.perf_counter()
fused.warm_up()
print(time.perf_counter() - start)
"""


def cold_compile(threads: int) -> float:
    """Seconds of ``fused.warm_up`` in a new process whose numba cache starts empty."""
    with tempfile.TemporaryDirectory(prefix="dask-dl-numba-") as cache:
        out = subprocess.run(
            [sys.executable, "-c", _COMPILE.format(threads=threads)],
            env={**os.environ, "NUMBA_CACHE_DIR": cache},
            capture_output=True,
            text=True,
            check=True,
        )
    return float(out.stdout.split()[-1])


def best(call, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def parallel_speed(shape: tuple[int, int] = (4096, 6400)) -> tuple[float, float, float]:
    """Best seconds of one copy, of quantize and of decode of a ``shape`` bucket by the parallel twins."""
    import torch

    from dask_dl.train.compression import fused, kernels
    from dask_dl.train.compression.plan import plan_stripes

    torch.set_num_threads(2)
    fused.warm_up()
    plan = plan_stripes([shape], ["w"], 1)
    values = np.random.default_rng(0).standard_normal(shape[0] * shape[1]).astype(np.float32)
    residual, out, copy = np.zeros_like(values), np.empty_like(values), np.empty_like(values)
    msgs, owed = np.zeros((1, plan.size), dtype=np.uint8), kernels.owed_means(1, plan.columns)  # as the hook
    kernels._FORCE = 0  # the parallel twins whatever the bucket
    try:
        quantize = best(lambda: kernels.quantize(plan.tasks, msgs, plan.columns, grad=values, vals=residual, owed=owed))
        decode = best(lambda: kernels.decode(plan.tasks, msgs, plan.columns, out, average=True))
    finally:
        kernels._FORCE = None
    return best(lambda: np.copyto(copy, values)), quantize, decode


def main() -> None:
    print(f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; cold compile, each in a new process:")
    serial = cold_compile(1)
    both = cold_compile(2)
    print(f"  serial twins        {serial:6.1f} s")
    print(f"  serial + parallel   {both:6.1f} s   (the parallel twins: {both - serial:.1f} s)")
    copy, quantize, decode = parallel_speed()
    print("parallel twins on 2 threads, a 4096x6400 bucket, best of 15, as a multiple of one copy:")
    print(f"  copy {copy * 1e3:.2f} ms; quantize {quantize / copy:.2f}x; decode {decode / copy:.2f}x")


if __name__ == "__main__":
    main()
