"""How much sooner does a sweep end with ASHA and trials side by side, and does it find as good a trial?

A LocalCluster of ``--workers`` single-threaded worker processes; ``dask_dl.sweep`` runs ``--trials`` trials of
small_cnn for ``--epochs`` epochs each on the synthetic NIH-like demo collection (``--images`` images at 32 px:
a task where learning rates and optimizers differ, unlike the squares the tests use, which most trials learn to an
AUROC of 1, and ties are all promoted),
learning rate and optimizer sampled at random (seeded), one trainer per trial, as many trials at once as there are
workers, ASHA pruning. The baseline trains the very same trials (the sweep's own parameters) to the end one after
another with ``fit``, as a hand-written loop does. Prints both wall times, their ratio (target: <= 0.4) and the
best validation AUROC of each (target: within 0.01). Worker imports are warmed by one short fit first. Each
trial's fit costs a couple of seconds to start (placement, process group): epochs far shorter than that (a few
hundred images) make the ratio that start-up's, not the pruner's. Measured on a shared 2-core machine: 12 x 6,
3000 images: 35 of 72 epochs trained, ratio 0.27, best AUROC 0.810 both.

    python bench/sweep.py                          # 12 trials x 6 epochs on 2 workers
    python bench/sweep.py --trials 20 --epochs 8 --workers 4 --images 6000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", type=int, default=3000, help="images of the collection (all splits)")
    args = parser.parse_args()

    from distributed import Client, LocalCluster
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    import dask_dl

    root = Path(tempfile.mkdtemp(prefix="dask-dl-bench-sweep-"))
    fixed = dict(model="small_cnn", model_kwargs={"width": 8}, epochs=args.epochs, batch_size=16, seed=0)
    space = {
        "lr": FloatDistribution(1e-5, 0.3, log=True),
        "optimizer": CategoricalDistribution(["sgd", "adamw"]),
    }
    with (
        LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        store = str(root / "cxr.zarr")
        dask_dl.synthesize(root / "raw", n_images=args.images, size=64, seed=1, client=client)
        dask_dl.ingest(dask_dl.read_catalog(root / "raw"), store, size=32, client=client, progress=False)
        dataset = dask_dl.open_dataset(store)
        client.run(lambda: __import__("torch"))
        dask_dl.fit(dataset, **{**fixed, "epochs": 1}, trainers=args.workers, client=client)  # warms every worker

        start = time.perf_counter()
        swept = dask_dl.sweep(
            dataset,
            space,
            trials=args.trials,
            sampler="random",
            pruner="asha",
            client=client,
            checkpoint_dir=str(root / "sweep"),
            **fixed,
        )
        sweep_s = time.perf_counter() - start
        results = swept.results

        start = time.perf_counter()
        best_loop = float("-inf")
        for number, params in zip(results["number"], results["params"], strict=True):
            run = dask_dl.fit(
                dataset,
                **fixed,
                **params,
                trainers=1,
                client=client,
                checkpoint_dir=str(root / "loop" / f"trial-{number:04d}"),
            )
            best_loop = max(best_loop, float(run.history["val_auroc_mean"].max()))
        loop_s = time.perf_counter() - start

    states = results["state"].value_counts().to_dict()
    print(f"{args.trials} trials x {args.epochs} epochs, {args.workers} workers, {args.images} images")
    print(f"sweep (ASHA, {args.workers} at a time): {sweep_s:7.1f} s, {int(results['epochs'].sum())} epochs, {states}")
    print(f"one after another, to the end:  {loop_s:7.1f} s, {args.trials * args.epochs} epochs")
    print(f"wall time ratio: {sweep_s / loop_s:.2f} (target <= 0.4)")
    print(
        f"best val_auroc_mean: sweep {swept.best.metric:.4f}, loop {best_loop:.4f}, "
        f"difference {best_loop - swept.best.metric:+.4f} (target within 0.01)"
    )


if __name__ == "__main__":
    main()
