"""How long does a run take to train again after a trainer is killed, and how many steps does it lose?

A LocalCluster of 3 single-threaded worker processes (with nannies); ``dask_dl.fit`` trains small_cnn with 2
trainers (onebit, batch 1 per trainer) on the tiny squares collection (``--images`` training images at 32 px)
with a ``checkpoint_dir``. For each step-checkpoint interval (``0``: epoch checkpoints only) one run is started,
its rank 1 worker is SIGKILLed ``--kill-after`` seconds into epoch 1, and the run recovers by itself (the spare
worker, or the nanny's restarted one, takes the lost trainer's place). Prints per interval: seconds from the kill to
training again (the new group formed and loaded the checkpoint), the driver's share of it (failure noticed to
training again), the steps lost (done after the checkpoint the run went on from), and whether the run finished.
Worker imports are warmed by one short fit first, and again before each run (a nanny's restarted worker is a new
process): a replacement worker that must first import torch adds some 5-15 s on a loaded machine.

    python bench/recovery.py                              # intervals 0 (epoch only), 64, 16, 4
    python bench/recovery.py --intervals 0 32 8 --images 1024
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path


def one_run(client, dataset, *, interval: int, kill_after: float, directory: str) -> dict:
    import dask_dl

    run = dask_dl.fit(
        dataset,
        model="small_cnn",
        model_kwargs={"width": 8},
        epochs=2,
        batch_size=1,
        trainers=2,
        lr=0.05,
        compression="onebit",
        warmup_steps=2,
        seed=0,
        checkpoint_dir=directory,
        client=client,
        wait=False,
        checkpoint_every_steps=interval or None,
        checkpoint_every_seconds=0,
        max_restarts=2,
    )
    deadline = time.monotonic() + 300
    while len(run.history) < 1 and not run.done and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(kill_after)
    victim = run.workers[1]
    pid = client.run(os.getpid, workers=[victim])[victim]
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    run.wait(timeout=600)
    row = run.restarts.iloc[0]
    return {
        "interval": interval or "epoch",
        "kill_to_training_s": row["at"] - killed,
        "driver_s": row["seconds"],
        "steps_lost": int(row["steps_lost"]),
        "killed_at": f"epoch {row['failed_epoch']} step {row['failed_step']}",
        "resumed_from": f"epoch {row['resumed_epoch']} step {row['resumed_step']}",
        "status": run.status,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--intervals", type=int, nargs="+", default=[0, 64, 16, 4])
    parser.add_argument("--images", type=int, default=512, help="training images (steps per epoch: half that)")
    parser.add_argument("--kill-after", type=float, default=1.5, help="seconds into epoch 1")
    args = parser.parse_args()

    import pandas as pd
    from distributed import Client, LocalCluster

    import dask_dl
    from dask_dl.testing.train import squares_collection

    root = Path(tempfile.mkdtemp(prefix="dask-dl-bench-recovery-"))
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        store = str(root / "squares.zarr")
        catalog = squares_collection(root, n_train=args.images, n_val=32)
        dask_dl.ingest(catalog, store, size=32, chunk=16, shard=4, client=client, progress=False)
        dataset = dask_dl.open_dataset(store)
        client.run(lambda: __import__("torch"))
        dask_dl.fit(
            dataset, model="small_cnn", model_kwargs={"width": 8}, epochs=1, batch_size=16, trainers=3, client=client
        )  # warms every worker
        rows = []
        for interval in args.intervals:
            client.wait_for_workers(3, timeout=300)
            client.run(lambda: __import__("dask_dl.train.actor"))  # the nanny's restarted worker too: warm
            rows.append(
                one_run(
                    client,
                    dataset,
                    interval=interval,
                    kill_after=args.kill_after,
                    directory=str(root / f"ck-{interval}"),
                )
            )
            print(rows[-1], flush=True)
    table = pd.DataFrame(rows).set_index("interval")
    print(f"\nrecovery after a SIGKILLed trainer ({args.images // 2} steps per epoch, 2 trainers + 1 spare worker)")
    print(table.to_string(float_format=lambda v: f"{v:.2f}"))


if __name__ == "__main__":
    main()
