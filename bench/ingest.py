"""How well does ingest scale? dask_dl.ingest on W workers against a single-process loop, same images, same run.

    python bench/ingest.py [--images 320 --size 224 --workers 2 --source-size 1024]

Writes the source PNGs once (smooth random images with noise, NIH-sized, cached in the temp dir), then times
(1) a plain loop in this process: load_image (decode, grayscale, resize) of every file and whole-shard writes
into a Zarr store of the same layout, and (2) dask_dl.ingest on a LocalCluster of W single-threaded worker
processes (cluster start-up and the workers' first imports not counted). Prints images/s of both and the
parallel efficiency ``(dask rate / loop rate) / W``; 1.0 would be perfect scaling. Each rate is the best of
``--repeat`` runs, alternating loop and Dask so that load from other processes hits both alike. On a machine
shared with other work the W workers get less than W cores while the loop still gets one, so run it idle.
(3) The ceiling, in the same run: W separate processes without Dask, each running the loop on its share of
the shards, started together: how far this machine scales W decoders at all.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import zarr
from PIL import Image

import dask_dl
from dask_dl.data.images import load_image
from dask_dl.data.schema import make_catalog


def write_sources(n: int, side: int) -> pd.DataFrame:
    root = Path(tempfile.gettempdir()) / f"dask_dl_bench_ingest_{n}_{side}"
    rng = np.random.default_rng(0)
    rows = []
    root.mkdir(exist_ok=True)
    for i in range(n):
        path = root / f"{i:05d}.png"
        if not path.exists():
            low = Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).resize((side, side), Image.BICUBIC)
            noisy = np.asarray(low, np.float32) + rng.normal(0, 4, (side, side))
            Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(path.with_suffix(".tmp.png"))
            os.replace(path.with_suffix(".tmp.png"), path)
        rows.append(
            {
                "image_id": path.name,
                "path": str(path),
                "patient_id": f"p{i}",
                "site": "bench",
                "split": "train",
                "Finding": i % 2,
            }
        )
    return make_catalog(pd.DataFrame(rows), ["Finding"])


def single_process(catalog: pd.DataFrame, store: str, *, size: int, chunk: int, shard: int) -> float:
    """The baseline: the same decode + resize + whole-shard Zarr writes, one image after another, no Dask."""
    shutil.rmtree(store, ignore_errors=True)
    started = time.perf_counter()
    n, rows = len(catalog), chunk * shard
    image = zarr.create_array(
        store,
        shape=(n, size, size),
        dtype="uint8",
        chunks=(chunk, size, size),
        shards=(rows, size, size),
        compressors=zarr.codecs.ZstdCodec(level=3),
        dimension_names=("sample", "y", "x"),
    )
    for start in range(0, n, rows):
        paths = catalog["path"].iloc[start : start + rows]
        image[start : start + len(paths)] = np.stack([load_image(p, size=size) for p in paths])
    return n / (time.perf_counter() - started)


def _share(catalog: pd.DataFrame, store: str, size: int, chunk: int, shard: int, start: float) -> float:
    """One of :func:`independent`'s processes: wait for ``start``, run the loop on its share; its seconds."""
    while time.time() < start:
        time.sleep(0.001)
    return len(catalog) / single_process(catalog, store, size=size, chunk=chunk, shard=shard)


def independent(catalog: pd.DataFrame, tmp: str, *, workers: int, size: int, chunk: int, shard: int) -> float:
    """The ceiling: ``workers`` separate processes, no Dask, each running the loop on its share of whole shards,
    started together; images/s of all of them over the slowest one's time."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    rows = chunk * shard
    shards = [catalog.iloc[i : i + rows] for i in range(0, len(catalog), rows)]
    parts = [pd.concat(shards[w::workers]) for w in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        list(pool.map(time.sleep, [0.1] * workers))  # started and imported before the clock
        start = time.time() + 0.5
        futures = [
            pool.submit(_share, part, f"{tmp}/part{w}.zarr", size, chunk, shard, start) for w, part in enumerate(parts)
        ]
        seconds = max(f.result() for f in futures)
    return len(catalog) / seconds


def with_dask(catalog: pd.DataFrame, store: str, *, size: int, chunk: int, shard: int, client) -> float:
    shutil.rmtree(store, ignore_errors=True)
    result = dask_dl.ingest(catalog, store, size=size, chunk=chunk, shard=shard, client=client, progress=False)
    assert result.n_rejected == 0 and result.shards_written == -(-len(catalog) // (chunk * shard))
    return len(catalog) / result.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=320)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--source-size", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--shard", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from distributed import Client, LocalCluster

    catalog = write_sources(args.images, args.source_size)
    layout = {"size": args.size, "chunk": args.chunk, "shard": args.shard}
    loop, parallel, ceiling = 0.0, 0.0, 0.0
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(n_workers=args.workers, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        with_dask(catalog.iloc[: args.chunk * args.shard * args.workers], f"{tmp}/warm.zarr", **layout, client=client)
        for _ in range(args.repeat):  # alternate, so that both see the same load from other processes
            loop = max(loop, single_process(catalog, f"{tmp}/loop.zarr", **layout))
            parallel = max(parallel, with_dask(catalog, f"{tmp}/dask.zarr", **layout, client=client))
            ceiling = max(ceiling, independent(catalog, tmp, workers=args.workers, **layout))
    shards = -(-args.images // (args.chunk * args.shard))
    print(f"{args.images} PNGs {args.source_size}x{args.source_size} -> {args.size}x{args.size}, {shards} shards")
    print(f"single process loop      {loop:8.1f} images/s")
    print(f"dask_dl.ingest, {args.workers} workers {parallel:8.1f} images/s")
    print(f"{args.workers} separate loops (no Dask) {ceiling:8.1f} images/s")
    speedup = parallel / loop
    print(
        f"speed-up {speedup:.2f}x; parallel efficiency (speed-up / workers) {speedup / args.workers:.2f} "
        f"(target >= 0.90; load {os.getloadavg()[0]:.1f}); {args.workers} separate processes reach "
        f"{ceiling / loop / args.workers:.2f} on this machine in this run"
    )
    print(
        f"dask_dl.ingest / {args.workers} separate processes: {parallel / ceiling:.2f} (what the cluster's own "
        "processes, the driver's work before and after the tasks and Dask's per-task cost leave of the machine)"
    )


if __name__ == "__main__":
    main()
