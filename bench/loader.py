"""Images per second of ChunkLoader (chunk shuffle + prefetch) against naive per-sample random access, and the CPU
cores one GPU needs to be fed, with augmentation on the CPU or on the GPU.

The naive reader does what a map-style torch Dataset over the store would do: ``image[i]`` for a random
permutation of the samples, which decodes a whole chunk for every image. Both paths hand out the same normalized
float32 batches, on the same store, in the same run.

Per core: images per CPU-second of this process (``time.process_time``, every thread counted) with one torch
thread and the reads in the consumer's thread, for (a) decode only (and with the CPU path's normalization),
(b) decode + CPU augmentation, (c) decode for device augmentation (what a GPU trainer's cores do: read, draw each
image's parameters, hand over uint8) and (d) (c) with the device augmentation's ops run here on CPU tensors. From
(b) and (c): the cores one GPU needs, for the published GPU rates in PUBLISHED and for ``--steps-per-s`` x
``--step-batch``.

    python bench/loader.py                      # a synthetic 224 x 224 store in a temporary folder
    python bench/loader.py --store data.zarr    # an existing dask_dl store (e.g. written by dask_dl.ingest)
    python bench/loader.py --device cuda        # also the GPU's side: device augmentation, pinned prefetch
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr

from dask_dl.data.device_augment import finish_batch
from dask_dl.data.loader import Augmentation, ChunkLoader
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


#: images/s of one GPU training a model, for the cores-per-GPU table. ResNet-50: NVIDIA's DeepLearningExamples
#: (PyTorch/Classification/ConvNets/resnet50v1.5/README.md) measure 2,470 images/s on one A100 80GB with mixed
#: precision; an H200-class GPU trains it at roughly 3,000 (issue 29). AlexNet-sized: several times faster (5x
#: taken here, an assumption; bench/gpu.py measures both models when a GPU is lent).
PUBLISHED = {"resnet50": 3000.0, "alexnet-sized": 15000.0}


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


def per_core_rate(store: Path, samples: np.ndarray, *, batch_size: int, path: str) -> float:
    """Images per CPU-second of one epoch of ``path``: ``decode`` (uint8 batches), ``normalize`` (the CPU path
    without augmentation), ``cpu`` (augment), ``deferred`` (augment on the device: parameters drawn, uint8 handed
    over) or ``device-ops`` (deferred, finished here on CPU tensors)."""
    augment_on = "cpu" if path in ("normalize", "cpu") else "device"
    augment = path not in ("decode", "normalize")
    loader = ChunkLoader(store, samples, batch_size=batch_size, augment=augment, augment_on=augment_on, prefetch=0)
    t0, n = time.process_time(), 0
    for item in loader.epoch(0):
        if path == "device-ops":
            finish_batch(item[0], item[2], normalization=loader.normalization)
        n += len(item[1])
    return n / (time.process_time() - t0)


def cores_table(rates: dict[str, float], *, cpu_rate: float, device_rate: float, batch: int) -> list[str]:
    lines = [
        "cores one GPU needs (its images/s / images/s per core)",
        f"  {'model':24s} {'images/s':>9s} {'steps/s x batch':>16s} {'CPU augmentation':>17s} "
        f"{'device augmentation':>20s}",
    ]
    for name, rate in rates.items():
        lines.append(
            f"  {name:24s} {rate:9.0f} {rate / batch:9.1f} x {batch:<4d} {rate / cpu_rate:17.1f} "
            f"{rate / device_rate:20.1f}"
        )
    return lines


def gpu_side(store: Path, samples: np.ndarray, *, batch_size: int) -> list[str]:
    """Images/s of the device augmentation on the GPU, and of an epoch fed pinned and ahead (DeviceFeed) against
    plain pageable copies of CPU-augmented batches; the model's work is left out, so these are the feed's ceiling."""
    import torch

    from dask_dl.train.feed import DeviceFeed

    device = torch.device("cuda", torch.cuda.current_device())
    lines = [f"on {torch.cuda.get_device_name(device)}"]
    size = zarr.open_group(store, mode="r")["image"].shape[-1]
    pixels = torch.randint(0, 256, (batch_size, 1, size, size), dtype=torch.uint8, device=device)
    drawn = torch.from_numpy(Augmentation().draw(batch_size, np.random.default_rng(0))).to(device)
    finish_batch(pixels, drawn, normalization={"mean": 0.5, "std": 0.25})  # warm-up: kernels, allocator
    torch.cuda.synchronize(device)
    t0, reps = time.perf_counter(), 50
    for _ in range(reps):
        finish_batch(pixels, drawn, normalization={"mean": 0.5, "std": 0.25})
    torch.cuda.synchronize(device)
    gpu_rate = reps * batch_size / (time.perf_counter() - t0)
    lines.append(f"  device augmentation + normalize on the GPU {gpu_rate:12.0f} images/s (batch {batch_size})")
    host = torch.empty((batch_size, 1, size, size), dtype=torch.float32)
    for pinned in (False, True):
        src = host.pin_memory() if pinned else host
        src.to(device, non_blocking=pinned)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(20):
            src.to(device, non_blocking=pinned)
        torch.cuda.synchronize(device)
        gbps = 20 * src.nbytes / (time.perf_counter() - t0) / 1e9
        lines.append(f"  copy of a float32 batch to the GPU, {'pinned  ' if pinned else 'pageable'} {gbps:9.1f} GB/s")

    def drain(batches) -> float:
        t0, n = time.perf_counter(), 0
        for _, y, _ in batches:
            n += len(y)
        torch.cuda.synchronize(device)
        return n / (time.perf_counter() - t0)

    plain = ChunkLoader(store, samples, batch_size=batch_size, augment=True)
    pageable = drain((x.to(device), y.to(device), r) for x, y, r in plain.epoch(0, with_samples=True))
    deferred = ChunkLoader(store, samples, batch_size=batch_size, augment=True, augment_on="device", pin_memory=True)
    feed = DeviceFeed(device, normalization=deferred.normalization, deferred=True)
    fed = drain(feed(deferred.epoch(0, with_samples=True)))
    lines.append(f"  epoch, CPU augmentation, pageable copies  {pageable:12.0f} images/s  (baseline)")
    lines.append(f"  epoch, device augmentation, pinned feed   {fed:12.0f} images/s  x{fed / pageable:.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, help="an existing dask_dl store (default: write a synthetic one)")
    parser.add_argument("--n", type=int, default=4096, help="images in the synthetic store")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--naive-limit", type=int, default=512, help="images the naive reader reads (it is slow)")
    parser.add_argument("--steps-per-s", type=float, help="also the cores for this many steps/s of --step-batch")
    parser.add_argument("--step-batch", type=int, default=256, help="a GPU step's batch in the cores table")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: also the GPU's side")
    args = parser.parse_args()
    import torch

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

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        paths = {
            "decode": "(a) decode only (uint8 batches)",
            "normalize": "    (a) + normalize (float32 batches)",
            "cpu": "(b) decode + CPU augmentation",
            "deferred": "(c) decode for device augmentation",
            "device-ops": "(d) (c) + its ops on CPU tensors",
        }
        per_core_rate(store, samples, batch_size=args.batch_size, path="decode")  # warm-up: page cache, allocator
        per_core = dict.fromkeys(paths, 0.0)
        for _ in range(3):  # round robin, best of 3: a busy machine's drift spreads over all paths alike
            for p in paths:
                per_core[p] = max(per_core[p], per_core_rate(store, samples, batch_size=args.batch_size, path=p))
        torch.set_num_threads(threads)
        print("images/s per core (per CPU-second of this process, one torch thread; best of 3 epochs)")
        for p, label in paths.items():
            print(f"  {label:38s} {per_core[p]:8.0f}   x{per_core[p] / per_core['decode']:.2f} of (a)")
        rates = dict(PUBLISHED)
        if args.steps_per_s:
            rates[f"{args.steps_per_s:g} steps/s x {args.step_batch}"] = args.steps_per_s * args.step_batch
        for line in cores_table(
            rates, cpu_rate=per_core["cpu"], device_rate=per_core["deferred"], batch=args.step_batch
        ):
            print(line)
        print(f"  device / CPU augmentation: x{per_core['cpu'] / per_core['deferred']:.2f} the cores")
        if args.device == "cuda":
            for line in gpu_side(store, samples, batch_size=args.batch_size):
                print(line)


if __name__ == "__main__":
    main()
