"""Images per second of ChunkLoader (chunk shuffle + prefetch) against naive per-sample random access.

The naive reader does what a map-style torch Dataset over the store would do: ``image[i]`` for a random
permutation of the samples, which decodes a whole chunk for every image. Both paths hand out the same normalized
float32 batches, on the same store, in the same run.

    python bench/loader.py                      # a synthetic 224 x 224 store in a temporary folder
    python bench/loader.py --store data.zarr    # an existing dask_dl store (e.g. written by dask_dl.ingest)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr

from dask_dl.data.loader import ChunkLoader
from dask_dl.normalize import normalize


def write_store(path: Path, *, n: int, size: int = 224, chunk: int = 32, shard: int = 8) -> Path:
    """A store in the dask_dl layout whose images compress like radiographs (smooth shapes plus film noise)."""
    rng = np.random.default_rng(0)
    group = zarr.open_group(path, mode="w", zarr_format=3)
    image = group.create_array(
        "image",
        shape=(n, size, size),
        chunks=(chunk, size, size),
        shards=(chunk * shard, size, size),
        dtype="uint8",
        dimension_names=["sample", "y", "x"],
        compressors=zarr.codecs.ZstdCodec(),
    )
    yy, xx = np.mgrid[0:size, 0:size] / size
    step = chunk * shard
    for start in range(0, n, step):  # one shard at a time: whole-shard writes, like ingest
        k = min(step, n - start)
        phase = rng.uniform(0, 2 * np.pi, (k, 1, 1))
        smooth = 110 + 70 * np.sin(3 * xx + phase) * np.cos(2 * yy + phase)
        image[start : start + k] = (smooth + rng.normal(0, 6, (k, size, size))).clip(0, 255).astype(np.uint8)
    label = group.create_array("label", shape=(n, 14), dtype="uint8", dimension_names=["sample", "finding"])
    label[:] = rng.integers(0, 2, (n, 14), dtype=np.uint8)
    valid = group.create_array("valid", shape=(n,), dtype="bool", dimension_names=["sample"])
    valid[:] = True
    group.attrs["dask_dl"] = {
        "format": 1,
        "size": size,
        "chunk": chunk,
        "shard": shard,
        "labels": [f"label{j}" for j in range(14)],
        "task": "multilabel",
        "n": n,
        "complete": True,
    }
    return path


def chunk_loader_rate(store: Path, samples: np.ndarray, *, batch_size: int, augment: bool) -> float:
    loader = ChunkLoader(store, samples, batch_size=batch_size, augment=augment)
    t0 = time.perf_counter()
    n = sum(len(y) for _, y in loader.epoch(0))
    return n / (time.perf_counter() - t0)


def naive_rate(store: Path, samples: np.ndarray, *, batch_size: int, limit: int) -> float:
    image = zarr.open_group(store, mode="r")["image"]
    order = np.random.default_rng(0).permutation(samples)[:limit]
    t0 = time.perf_counter()
    for b in range(0, len(order), batch_size):
        normalize(np.stack([image[i] for i in order[b : b + batch_size]]))
    return len(order) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, help="an existing dask_dl store (default: write a synthetic one)")
    parser.add_argument("--n", type=int, default=4096, help="images in the synthetic store")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--naive-limit", type=int, default=512, help="images the naive reader reads (it is slow)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or write_store(Path(tmp) / "bench.zarr", n=args.n)
        group = zarr.open_group(store, mode="r")
        valid = np.asarray(group["valid"][:]) if "valid" in group else np.ones(group["image"].shape[0], bool)
        samples = np.flatnonzero(valid)
        image = group["image"]
        print(f"store {store}: {image.shape[0]} images {image.shape[1]}x{image.shape[2]}, chunks {image.chunks}")
        naive = naive_rate(store, samples, batch_size=args.batch_size, limit=args.naive_limit)
        chunked = chunk_loader_rate(store, samples, batch_size=args.batch_size, augment=False)
        augmented = chunk_loader_rate(store, samples, batch_size=args.batch_size, augment=True)
        print(f"naive random access   {naive:10.0f} images/s  (baseline, {args.naive_limit} images)")
        print(f"ChunkLoader           {chunked:10.0f} images/s  x{chunked / naive:.1f}")
        print(f"ChunkLoader + augment {augmented:10.0f} images/s  x{augmented / naive:.1f}")


if __name__ == "__main__":
    main()
