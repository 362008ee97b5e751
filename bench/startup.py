"""What a run costs beyond its steps: short fits on a warm cluster, against the time their steps took.

A sweep's trials, a site's visits in cross-site training and the tests are many short runs on one cluster: the
time from ``fit(...)`` to its return that is not training (placing the trainers, forming the process group,
the driver noticing that an epoch ended, leaving the group) is paid by every one of them. This bench trains
small_cnn on the squares collection (64 train and 32 validation images at 32 px, 2 trainers, batch 8, 1 and 3
epochs) ``--runs`` times each on a 2-worker LocalCluster whose workers trained once before, and prints, per run,
the wall time, the steps' own time (compute + exchange + data wait, from the history) and the fixed cost (the
difference); last, the median fixed cost and ``fixed cost / steps`` ratio.

Last it prints what a new trainer's first run costs: the first fit on the new cluster (spawned workers, as users
get them, torch already imported on them) against the median 1-epoch fit on the same workers warm. The first run
pays the imports of dask_dl's trainer and of TorchDynamo (the constructor of DistributedDataParallel imports it),
and the first process group and model.

    python bench/startup.py              # about 60 s
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fits per epoch count")
    args = parser.parse_args()

    from distributed import Client, LocalCluster

    import dask_dl
    from dask_dl.testing.train import squares_collection

    options = dict(
        model="small_cnn",
        model_kwargs={"width": 8},
        batch_size=8,
        trainers=2,
        lr=0.05,
        optimizer="sgd",
        compression="none",
        warmup_steps=0,
        seed=5,
    )
    root = Path(tempfile.mkdtemp(prefix="dask-dl-startup-"))
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        store = str(root / "squares.zarr")
        dask_dl.ingest(squares_collection(root), store, size=32, chunk=8, shard=2, client=client, progress=False)
        dataset = dask_dl.open_dataset(store)
        client.run(lambda: __import__("torch"))  # torch's own import is not the trainer's to pay
        start = time.perf_counter()
        dask_dl.fit(dataset, epochs=1, client=client, **options)  # new workers: the trainers' first run
        first = time.perf_counter() - start
        fixed, steps_s, warm = [], [], []
        print("epochs  wall s  steps s  fixed s")
        for epochs in (1, 3):
            for _ in range(args.runs):
                start = time.perf_counter()
                history = dask_dl.fit(dataset, epochs=epochs, client=client, **options).history
                wall = time.perf_counter() - start
                steps = float((history.compute_s + history.comm_s + history.data_wait_s).sum())
                fixed.append(wall - steps)
                if epochs == 1:
                    warm.append(wall)
                steps_s.append(steps)
                print(f"{epochs:6d}  {wall:6.3f}  {steps:7.3f}  {wall - steps:7.3f}", flush=True)
    median = statistics.median(fixed)
    print(
        f"fixed cost per run: median {median:.3f} s (min {min(fixed):.3f}, max {max(fixed):.3f}); "
        f"fixed / steps {median / statistics.median(steps_s):.1f}x; load average {os.getloadavg()[0]:.1f}"
    )
    warm_median = statistics.median(warm)
    print(f"first fit on new workers {first:.2f} s, warm {warm_median:.2f} s: {first / warm_median:.1f}x")


if __name__ == "__main__":
    main()
