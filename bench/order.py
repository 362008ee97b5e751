"""Does ``fit`` learn from a class-folder collection as a plain, fully shuffled PyTorch loop does?

scikit-learn's bundled handwritten digits (1797 images, no download) are written as class folders of PNGs
(``root/<digit>/<n>.png``, upsampled to 32 px), read with :func:`dask_dl.read_folders` and ingested: the most
common layout of a user's own images, where the catalog lists every class in a run of its own. Then, on the same
images, net, batch, learning rate and number of steps:

- ``fit``: 1 trainer, SGD with momentum;
- ``plain, full shuffle``: a torch loop over a fresh permutation of the training samples each epoch (the baseline);
- ``plain, loader order``: the same loop given the rows in the order the loader serves them.

    python bench/order.py                 # seeds 0 1 2, 6 epochs
    python bench/order.py --seeds 0 --epochs 3
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from dask_dl.testing.digits import plain_accuracy, write_digits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    from distributed import Client, LocalCluster

    import dask_dl
    from dask_dl.data.loader import ChunkLoader

    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(n_workers=1, threads_per_worker=1) as cluster,
        Client(cluster) as client,
    ):
        catalog = dask_dl.read_folders(write_digits(Path(tmp) / "digits"))
        store = str(Path(tmp) / "digits.zarr")
        dask_dl.ingest(catalog, store, size=32, client=client, progress=False)
        train = dask_dl.open_dataset(store, split="train").sample.values
        print(
            f"{len(catalog)} digits, {len(train)} for training; batch {args.batch_size}, lr {args.lr}, "
            f"{args.epochs} epochs"
        )
        rows = []
        for seed in args.seeds:
            run = dask_dl.fit(
                dask_dl.open_dataset(store),
                model="small_cnn",
                epochs=args.epochs,
                batch_size=args.batch_size,
                trainers=1,
                lr=args.lr,
                optimizer="sgd",
                seed=seed,
                client=client,
            )
            fitted = float(run.history["val_accuracy"].iloc[-1])
            loader = ChunkLoader(store, train, batch_size=args.batch_size, seed=seed)
            same = {
                "epochs": args.epochs,
                "steps": loader.steps_per_epoch,
                "batch_size": args.batch_size,
                "lr": args.lr,
                "seed": seed,
            }
            shuffle = np.random.default_rng(seed)
            shuffled = plain_accuracy(store, lambda e, rng=shuffle: rng.permutation(train), **same)
            ordered = plain_accuracy(store, loader.order, **same)
            rows.append((fitted, shuffled, ordered))
            print(
                f"seed {seed}: fit {fitted:.3f}  plain, full shuffle {shuffled:.3f}  plain, loader order "
                f"{ordered:.3f}  fit - shuffle {fitted - shuffled:+.3f}",
                flush=True,
            )
        mean = np.mean(rows, axis=0)
        print(
            f"mean:   fit {mean[0]:.3f}  plain, full shuffle {mean[1]:.3f}  plain, loader order {mean[2]:.3f}  "
            f"fit - shuffle {mean[0] - mean[1]:+.3f}"
        )


if __name__ == "__main__":
    main()
