"""Do ``fit``'s defaults learn? Validation AUROC on the README's collection with no option, beside candidates.

The README's collection (2000 synthetic NIH-like images drawn at 256 px, ingested at 128 px) is trained with
``fit(ds)`` as it comes (the defaults of ``dask-dl.train``), then with each candidate's options on top, in the same
run on the same store. A candidate is ``name:key=value,key=value`` (values parsed as YAML).

    python bench/defaults.py                                  # defaults, adamw 1e-3, adamw 3e-3, sgd 0.05
    python bench/defaults.py --epochs 2 --candidates "adamw:optimizer=adamw,lr=0.001"
    python bench/defaults.py --common trainers=2,compression=onebit   # the README's train command
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import yaml

CANDIDATES = [
    "adamw 1e-3:optimizer=adamw,lr=0.001",
    "adamw 3e-3:optimizer=adamw,lr=0.003",
    "sgd 0.05:optimizer=sgd,lr=0.05",
]


def options(text: str) -> dict:
    """``key=value,key=value`` as fit keywords (values parsed as YAML)."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    return {key.strip(): yaml.safe_load(value) for key, value in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=None, help="default: dask-dl.train.epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--common", default="", help="options for every run, e.g. trainers=2,compression=onebit")
    parser.add_argument("--candidates", nargs="*", default=CANDIDATES)
    parser.add_argument("--store", help="an existing store to train on (default: synthesize and ingest)")
    parser.add_argument("--skip-defaults", action="store_true", help="run the candidates only")
    args = parser.parse_args()

    from distributed import Client, LocalCluster

    import dask_dl

    common = options(args.common) | ({"epochs": args.epochs} if args.epochs else {})
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(n_workers=2, threads_per_worker=1) as cluster,
        Client(cluster) as client,
    ):
        store = args.store
        if store is None:
            dask_dl.synthesize(Path(tmp) / "raw", n_images=args.images, size=256, seed=args.seed, client=client)
            store = str(Path(tmp) / "cxr.zarr")
            dask_dl.ingest(dask_dl.read_catalog(Path(tmp) / "raw"), store, size=128, client=client, progress=False)
        ds = dask_dl.open_dataset(store)
        print(f"{ds.sizes['sample']} images at 128 px; every run: {common or 'no option'}", flush=True)
        for candidate in [*([] if args.skip_defaults else ["defaults:"]), *args.candidates]:
            name, _, text = candidate.partition(":")
            started = time.perf_counter()
            run = dask_dl.fit(ds, seed=args.seed, client=client, **common, **options(text))
            last = run.history.iloc[-1]
            print(
                f"{name:14s} val AUROC {last['val_auroc_mean']:.3f}  train loss {last['train_loss']:.3f}  "
                f"epochs {len(run.history)}  {time.perf_counter() - started:.0f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
