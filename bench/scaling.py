"""How does throughput scale from one trainer to two? Images per second of fit() with 1 and 2 trainers.

Both runs use the same model, store and per-trainer batch size (so two trainers take twice the images per step),
on a LocalCluster of two single-threaded worker processes. The ratio is images/s with 2 trainers over images/s
with 1 (2.0 is perfect scaling). On a 2-core machine the two trainers also compete with the loaders' threads and
with each other's gloo all-reduce, so expect less than 2.

The same question is put to a hand-written ``torchrun`` DDP loop (``bench/peers.py``'s: plain zarr reads, DDP,
SGD) on the same store, model and batch, with 1 and 2 processes, in the same run: its ratio is what DDP itself
reaches on this machine, the ceiling the dask_dl ratio is judged against.

    python bench/scaling.py                                  # small_cnn, 64 px, batch 32, compression none
    python bench/scaling.py --compression none,fp16,onebit   # a ratio per compressor
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from overhead import make_store, training_parser  # noqa: E402
from peers import run_ddp  # noqa: E402


def main() -> None:
    parser = training_parser(__doc__, epochs=3)
    parser.add_argument("--compression", default="none", help="comma-separated compressors to measure")
    args = parser.parse_args()

    from distributed import Client, LocalCluster

    import dask_dl

    rows = []
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        store = make_store(args.root, images=args.images, size=args.size, client=client)
        ds = dask_dl.open_dataset(store)
        for compression in args.compression.split(","):
            speed = {}
            for trainers in (1, 2):
                run = dask_dl.fit(
                    ds,
                    model=args.model,
                    epochs=args.epochs,
                    batch_size=args.batch_size,
                    trainers=trainers,
                    compression=compression,
                    warmup_steps=0,
                    lr=0.01,
                    client=client,
                )
                h = run.history.iloc[1:] if len(run.history) > 1 else run.history  # epoch 0 warms up
                speed[trainers] = float(np.median(h["images_per_s"]))
                comm = float(np.median(h["comm_s"] / (h["compute_s"] + h["comm_s"] + h["data_wait_s"])))
                rows.append((compression, trainers, speed[trainers], comm, int(h["bytes_sent"].median())))
            rows.append((compression, "ratio", speed[2] / speed[1], None, None))
        with tempfile.TemporaryDirectory() as tmp:
            plain = argparse.Namespace(epochs=args.epochs, batch_size=args.batch_size, lr=0.01, seed=0)
            ddp = {n: run_ddp(plain, store, os.path.join(tmp, f"ddp{n}.json"), ranks=n)["images_per_s"] for n in (1, 2)}
    print(f"model {args.model}, {args.size} px, batch {args.batch_size} per trainer, {os.cpu_count()} CPUs")
    print(f"{'compression':12s} {'trainers':>8s} {'images/s':>10s} {'comm share':>10s} {'bytes/epoch':>12s}")
    for compression, trainers, value, comm, sent in rows:
        if trainers == "ratio":
            print(f"{compression:12s} {'2 vs 1':>8s} {value:10.3f}")
        else:
            print(f"{compression:12s} {trainers:>8d} {value:10.1f} {100 * comm:9.1f}% {sent:12,d}")
    print(f"{'torchrun DDP':12s} {1:8d} {ddp[1]:10.1f}")
    print(f"{'torchrun DDP':12s} {2:8d} {ddp[2]:10.1f}")
    print(f"{'torchrun DDP':12s} {'2 vs 1':>8s} {ddp[2] / ddp[1]:10.3f}")
    ratios = ", ".join(f"{c} {v:.3f}" for c, t, v, _, _ in rows if t == "ratio")
    print(
        f"images/s, 2 trainers vs 1 (load {os.getloadavg()[0]:.1f}): {ratios} (target >= 1.85); "
        f"hand-written torchrun DDP in this run {ddp[2] / ddp[1]:.3f}"
    )


if __name__ == "__main__":
    main()
