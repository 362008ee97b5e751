"""Is dask_dl as fast as hand-written DDP? The same job as a ``torchrun`` DDP loop and as ``dask_dl.fit``.

Both sides train small_cnn on the same synthetic store (2000 NIH-like images drawn at 64 px and stored at 32 px,
five findings whose signatures the network learns, a third of the patients for validation) with 2 ranks of one
thread each, gloo, the same initial weights (``torch.manual_seed(seed)`` before ``build_model``), the same global
batch (``--batch-size`` per rank), SGD with momentum 0.9 and the same learning rate and epochs. Each validates
every epoch (each rank half of the validation split, gathered on rank 0) and reports the mean validation AUROC
of the last epoch.

- **DDP**: this file run by ``python -m torch.distributed.run --nproc-per-node 2``; each rank reads its
  contiguous half of the epoch's training rows (the rows of a seeded permutation, the same on both ranks) from
  the Zarr store with plain zarr and numpy (one slice over its rows' chunk range per epoch, no dask_dl loader),
  normalizes with the same mean/std and steps through DDP.
- **dask_dl**: ``dask_dl.fit(..., trainers=2, compression="none")`` on a LocalCluster of 2 single-threaded worker
  processes (cluster start-up not counted, the workers' first imports warmed by one short fit).

Prints, for both: training images/s (median over epochs after the first, which warms up), wall time (the
``fit()`` call against the ``torchrun`` command, process start and imports included) and the final validation
AUROC, each the median of ``--repeat`` runs made alternately; then the ratios dask_dl / DDP (target for images/s
>= 1.0). Single runs on a shared 2-core machine move by 15 % either way.

    python bench/peers.py                         # 2000 images, 32 px, batch 16 per rank, 4 epochs
    python bench/peers.py --epochs 6 --batch-size 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

LEARN_LABELS = ["Effusion", "Infiltration", "Consolidation", "Edema", "Emphysema"]


def make_store(root: str, *, images: int, size: int, client) -> str:
    """The synthetic collection of ``tests/train/test_fit.py``'s learning test (reused when already there)."""
    import dask_dl
    from dask_dl.data.schema import NIH_LABELS, make_catalog

    store = os.path.join(root, f"peers-{images}-{size}.zarr")
    if not os.path.exists(os.path.join(store, "zarr.json")):
        nih = os.path.join(root, f"peers-nih-{images}")
        dask_dl.synthesize(nih, n_images=images, size=64, seed=0, client=client)
        catalog = dask_dl.split_by_patient(dask_dl.read_nih(nih), val_fraction=0.35, test_fraction=0.05)
        catalog = make_catalog(catalog.drop(columns=[k for k in NIH_LABELS if k not in LEARN_LABELS]), LEARN_LABELS)
        dask_dl.ingest(catalog, store, size=size, chunk=16, shard=2, client=client, progress=False, overwrite=True)
    return store


# ---- the hand-written DDP side (run by torchrun) ---------------------------------------------------------------


def ddp_main(args: argparse.Namespace) -> None:
    """One rank of the plain DDP job: zarr + numpy reads, DDP, SGD; rank 0 writes the figures to ``--out``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import zarr
    from torch.nn.parallel import DistributedDataParallel

    from dask_dl.metrics import auroc
    from dask_dl.models import build_model
    from dask_dl.normalize import normalize

    begun = time.perf_counter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = zarr.open_group(args.store, mode="r")
    image = group["image"]
    split = np.asarray(group["split"][:], dtype=object)
    valid = np.asarray(group["valid"][:], dtype=bool) if "valid" in group else np.ones(len(split), bool)
    labels = np.asarray(group["label"][:], dtype=np.float32)
    train = np.flatnonzero((split == "train") & valid)
    val = np.flatnonzero((split == "val") & valid)

    torch.manual_seed(args.seed)
    model = build_model("small_cnn", num_outputs=labels.shape[1], in_channels=1)
    ddp = DistributedDataParallel(model) if world > 1 else model  # one rank: a plain loop
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    per_rank = len(train) // world // args.batch_size * args.batch_size

    def rows_of(rows: np.ndarray) -> np.ndarray:
        rows = np.sort(rows)
        return np.asarray(image[rows[0] : rows[-1] + 1])[rows - rows[0]], rows

    speeds, auc = [], float("nan")
    for epoch in range(args.epochs):
        dist.barrier()
        started = time.perf_counter()
        order = np.random.default_rng([args.seed, epoch]).permutation(train)
        mine = order[rank * per_rank : (rank + 1) * per_rank]
        pixels, rows = rows_of(mine)
        shuffle = np.random.default_rng([args.seed, epoch, rank]).permutation(len(rows))
        pixels, rows = pixels[shuffle], rows[shuffle]
        ddp.train()
        for b in range(0, per_rank, args.batch_size):
            x = normalize(pixels[b : b + args.batch_size])
            y = torch.from_numpy(labels[rows[b : b + args.batch_size]])
            opt.zero_grad(set_to_none=True)
            loss = F.binary_cross_entropy_with_logits(ddp(x), y)
            loss.backward()
            opt.step()
        dist.barrier()
        speeds.append(per_rank * world / (time.perf_counter() - started))
        # validation: each rank scores its contiguous half, rank 0 gathers and computes AUROC
        q, r = divmod(len(val), world)
        lo = rank * q + min(rank, r)
        part = val[lo : lo + q + (rank < r)]
        model.eval()
        with torch.no_grad():
            pixels, rows = rows_of(part)
            scores = torch.cat([model(normalize(pixels[b : b + 256])).sigmoid() for b in range(0, len(rows), 256)])
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((rows, scores.numpy()), gathered, dst=0)
        if rank == 0:
            rows = np.concatenate([g[0] for g in gathered])
            scores = np.concatenate([g[1] for g in gathered])
            auc = float(np.nanmean(auroc(labels[rows], scores)))
    if rank == 0:
        later = speeds[1:] or speeds
        with open(args.out, "w") as f:
            json.dump({"images_per_s": float(np.median(later)), "auroc": auc, "job_s": time.perf_counter() - begun}, f)
    dist.destroy_process_group()


def run_ddp(args: argparse.Namespace, store: str, out: str, *, ranks: int = 2) -> dict:
    """Run the hand-written job under ``torchrun`` with ``ranks`` processes; its figures and wall time."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        __file__,
        "--ddp",
        "--store",
        store,
        "--out",
        out,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        str(args.lr),
        "--seed",
        str(args.seed),
    ]
    # glibc's defaults, as a user's torchrun job has them: a LocalCluster in this process put the nanny's
    # MALLOC_TRIM_THRESHOLD_ into os.environ, which switches off glibc's dynamic mmap threshold (twice the step
    # time for small_cnn; dask_dl's trainers undo it, see dask_dl/allocator.py)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["OMP_NUM_THREADS"] = "1"
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env)
    wall = time.perf_counter() - started
    with open(out) as f:
        result = json.load(f)
    return {**result, "wall_s": wall}


def run_fit(args: argparse.Namespace, store: str, client) -> dict:
    import dask_dl

    ds = dask_dl.open_dataset(store)
    options = dict(
        model="small_cnn",
        batch_size=args.batch_size,
        trainers=2,
        lr=args.lr,
        optimizer="sgd",
        compression="none",
        seed=args.seed,
        client=client,
    )
    started = time.perf_counter()
    run = dask_dl.fit(ds, epochs=args.epochs, **options)
    wall = time.perf_counter() - started
    h = run.history.iloc[1:] if len(run.history) > 1 else run.history
    auc = float(run.history["val_auroc_mean"].iloc[-1])
    return {"images_per_s": float(np.median(h["images_per_s"])), "auroc": auc, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16, help="images per rank per step")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side, alternating; medians are printed")
    parser.add_argument("--root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "dask-dl-bench"))
    parser.add_argument("--ddp", action="store_true", help=argparse.SUPPRESS)  # one rank, under torchrun
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp:
        ddp_main(args)
        return

    import tempfile

    from distributed import Client, LocalCluster

    import dask_dl

    os.makedirs(args.root, exist_ok=True)
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
        tempfile.TemporaryDirectory() as tmp,
    ):
        store = make_store(args.root, images=args.images, size=args.size, client=client)
        ds = dask_dl.open_dataset(store)
        dask_dl.fit(ds, model="small_cnn", epochs=1, batch_size=args.batch_size, trainers=2, client=client)  # warm
        runs: dict[str, list[dict]] = {"ddp": [], "ours": []}
        for _ in range(args.repeat):  # alternating, so that load from other processes hits both alike
            runs["ddp"].append(run_ddp(args, store, os.path.join(tmp, "ddp.json")))
            runs["ours"].append(run_fit(args, store, client))
        ddp, ours = ({k: float(np.median([r[k] for r in rs])) for k in rs[0]} for rs in runs.values())

    print(
        f"small_cnn, {args.size} px, {args.images} images, batch {args.batch_size} x 2 ranks, {args.epochs} epochs, "
        f"SGD momentum lr {args.lr}, gloo, 1 thread per rank, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':22s} {'images/s':>9s} {'wall s':>8s} {'val AUROC':>10s}")
    for name, r in (("torchrun DDP loop", ddp), ("dask_dl.fit", ours)):
        print(f"{name:22s} {r['images_per_s']:9.1f} {r['wall_s']:8.2f} {r['auroc']:10.3f}")
    print(
        f"dask_dl / DDP: images/s {ours['images_per_s'] / ddp['images_per_s']:.3f} (target >= 1.0), "
        f"wall {ours['wall_s'] / ddp['wall_s']:.3f}, AUROC {ours['auroc'] - ddp['auroc']:+.3f}"
    )
    each = ", ".join(f"{o['images_per_s'] / d['images_per_s']:.3f}" for d, o in zip(*runs.values(), strict=True))
    print(f"images/s ratio of each run, in order: {each}")


if __name__ == "__main__":
    main()
