"""NIH at full resolution: dask_dl.ingest of N 1024x1024 NIH PNGs against the decode floor, in the same run.

    python bench/nih_full.py [--images 10000 --cache /tmp/dask_dl_bench_nih_full --workers 2 --size 224]

1. **The collection** (written once into ``--cache``, in parallel, and reused): N 8-bit grayscale PNGs of
   1024x1024 in the NIH layout (``images/<Image Index>`` beside ``Data_Entry_2017_v2020.csv``), with the rows,
   labels and patients of the first N rows of the real NIH table when ``../shared/data`` holds it. Each image is
   one of the two real NIH PNGs there (512 px copies) upscaled to 1088 px, cropped at a random offset, maybe
   mirrored, with its own Gaussian noise (sigma 1 grey level), and written as those files are (filter None on
   every row, zlib level 9, a gAMA chunk), so that every file is distinct and costs per pixel what
   a real one costs: the bench prints bytes per pixel and decode time per megapixel of both.
2. **The decode floor**: the cluster's workers decode and resize the same files in tasks of the same size as
   ingest's (one task per shard's worth of rows), holding the same allocator settings, writing nothing.
3. **dask_dl.ingest** of the catalog that :func:`dask_dl.read_nih` reads from the cache, into a Zarr store in a
   temporary folder (deleted at the end), at ingest's default size, chunk and shard.

The floor and ingest alternate ``--repeat`` times; the ratio is ingest's best time over the floor's best time
(target <= 1.1). Beside it, the workers' CPU seconds per image (psutil; the best pass of each), which other
processes' load moves less than wall time on a shared machine. A thread samples the workers' RSS (psutil on
their pids) every 0.2 s; the peaks of the first and of the last quarter of the first ingest, and of the last
quarter of the last one, show whether memory stays flat. The time for NIH's 112,120 images is extrapolated from
ingest's rate: per-image worker time x 112,120 / workers. Cluster start-up and the workers' first imports are
not counted (a small ingest and floor run first), and the page cache is warmed by reading every file once.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import dask_dl
from dask_dl import config
from dask_dl.data.images import load_image
from dask_dl.data.nih import NIH_HEADER

SHARED = Path(os.environ.get("DASK_DL_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
REAL = ("00000001_000.png", "00027426_000.png")
TABLE = "Data_Entry_2017_v2020.csv"
NIH_IMAGES = 112_120
#: what the generator writes; a cache written with other settings is written again
RECIPE = {"version": 1, "source": list(REAL), "pad": 64, "noise": 1.0, "zlib": 9, "filter": "none"}


def _bench_ingest():
    """bench/ingest.py, for its timed ``with_dask`` (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_ingest", Path(__file__).with_name("ingest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the collection -----------------------------------------------------------------------------------------


def png_bytes(pixels: np.ndarray, *, level: int = 9) -> bytes:
    """An 8-bit grey PNG as NIH's files are written: filter None on every row, one zlib stream, a gAMA chunk."""
    height, width = pixels.shape
    raw = np.zeros((height, width + 1), np.uint8)  # each row starts with its filter byte, 0 (None)
    raw[:, 1:] = pixels

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
        + chunk(b"gAMA", struct.pack(">I", 45455))
        + chunk(b"IDAT", zlib.compress(raw.tobytes(), level))
        + chunk(b"IEND", b"")
    )


def _sources(shared: Path, side: int) -> list[np.ndarray]:
    """The real NIH PNGs upscaled to ``side + pad`` (bicubic), from which each image is a crop."""
    from PIL import Image

    big = side + RECIPE["pad"] * side // 1024
    return [
        np.asarray(Image.open(shared / "nih" / name).convert("L").resize((big, big), Image.Resampling.BICUBIC))
        for name in REAL
    ]


def make_image(index: int, sources: list[np.ndarray], side: int) -> np.ndarray:
    """Image ``index``: a crop of one real image at a random offset, maybe mirrored, with noise of its own."""
    rng = np.random.default_rng([index, 29])
    source = sources[index % len(sources)]
    dy, dx = rng.integers(0, source.shape[0] - side + 1, 2)
    crop = source[dy : dy + side, dx : dx + side].astype(np.float32)
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    noisy = crop + rng.normal(0.0, RECIPE["noise"], crop.shape).astype(np.float32)
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8)


def _write_block(block: list[tuple[int, str]], folder: str, shared: Path, side: int) -> int:
    """Write the images of ``block`` that are not there yet (a process of the pool); how many it wrote."""
    sources, written = _sources(shared, side), 0
    for index, name in block:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            continue
        data = png_bytes(make_image(index, sources, side), level=RECIPE["zlib"])
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)  # a killed run leaves no half-written PNG under the real name
        written += 1
    return written


def nih_table(n: int, shared: Path) -> pd.DataFrame:
    """The first ``n`` rows of the real NIH table, or invented rows (one image per patient) without it."""
    path = shared / "nih" / f"{TABLE}.gz"
    if path.exists():
        table = pd.read_csv(path, dtype=str, keep_default_na=False, nrows=n)
        if len(table) == n:
            return table
    ids = np.arange(n)
    return pd.DataFrame(
        {
            "Image Index": [f"{i + 1:08d}_000.png" for i in ids],
            "Finding Labels": np.where(ids % 3 == 0, "Cardiomegaly|Effusion", "No Finding"),
            "Follow-up #": 0,
            "Patient ID": ids + 1,
            "Patient Age": 50,
            "Patient Gender": "M",
            "View Position": "PA",
            "w": 2048,
            "h": 2048,
            "x": 0.143,
            "y": 0.143,
        }
    )


def write_collection(
    cache: str | os.PathLike, n: int, *, shared: Path = SHARED, side: int = 1024, processes: int | None = None
) -> Path:
    """Write (or complete) the NIH-layout collection of ``n`` images in ``cache`` from the real ones in
    ``shared``; its root."""
    missing = [name for name in REAL if not (shared / "nih" / name).exists()]
    if missing:
        raise SystemExit(
            f"the real NIH PNGs {missing} are not in {shared / 'nih'}: the images are made from them; set "
            "DASK_DL_SHARED_DATA to the folder that holds nih/00000001_000.png"
        )
    root = Path(cache)
    recipe = {**RECIPE, "side": side}
    stamp = root / "recipe.json"
    if stamp.exists() and json.loads(stamp.read_text()) != recipe:
        shutil.rmtree(root / "images")  # written another way: those files would not be what this run says
    (root / "images").mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(recipe))
    table = nih_table(n, shared)
    with open(root / TABLE, "w") as f:  # rewritten for each n: read_nih reads every row of it
        f.write(NIH_HEADER + "\n")
        table.to_csv(f, header=False, index=False)
    names = list(enumerate(table["Image Index"]))
    processes = processes or os.cpu_count() or 1
    blocks = [names[i : i + 64] for i in range(0, len(names), 64)]
    if any(not (root / "images" / name).exists() for _, name in names):
        with ProcessPoolExecutor(processes) as pool:
            list(
                pool.map(functools.partial(_write_block, folder=str(root / "images"), shared=shared, side=side), blocks)
            )
    return root


def decode_cost(*groups: list[str], repeat: int = 5) -> list[tuple[float, float]]:
    """Per group of ``paths``: mean bytes per pixel and PNG decode milliseconds per megapixel, in this process.

    The groups are decoded in turns and each file's best of ``repeat`` is kept, so that load from other processes
    hits the groups alike and counts as little as it can.
    """
    import imagecodecs

    files = [[Path(path).read_bytes() for path in paths] for paths in groups]
    best = [[np.inf] * len(group) for group in files]
    for _ in range(repeat):
        for g, group in enumerate(files):
            for i, data in enumerate(group):
                started = time.perf_counter()
                pixels = imagecodecs.png_decode(data)
                best[g][i] = min(best[g][i], (time.perf_counter() - started) * 1e3 / (pixels.size / 1e6))
    return [
        (float(np.mean([len(data) / imagecodecs.png_decode(data).size for data in group])), float(np.median(ms)))
        for group, ms in zip(files, best, strict=True)
    ]


# ---- the passes -----------------------------------------------------------------------------------------------


def _decode_rows(paths: list[str], size: int) -> int:
    """The floor's task: decode and resize each file as ingest does, under ingest's allocator settings."""
    from dask_dl import allocator
    from dask_dl.data.images import release_buffers

    with allocator.kept_freed_memory():
        try:
            checksum = 0
            for path in paths:
                checksum += int(load_image(path, size=size)[0, 0])  # read a pixel: the work cannot be skipped
            return checksum
        finally:
            release_buffers()


def decode_floor(client, paths: list[str], *, size: int, rows: int) -> float:
    """Seconds for the cluster's workers to decode and resize ``paths`` in tasks of ``rows`` files."""
    from distributed import wait

    groups = [paths[i : i + rows] for i in range(0, len(paths), rows)]
    started = time.perf_counter()
    futures = client.map(_decode_rows, groups, size=size, pure=False)
    wait(futures)
    seconds = time.perf_counter() - started
    client.gather(futures)  # a failed task raises here
    return seconds


class MemorySampler:
    """The RSS of the workers' processes (psutil on their pids), every ``interval`` seconds, on a thread."""

    def __init__(self, client, interval: float = 0.2):
        import psutil

        self.processes = {addr: psutil.Process(pid) for addr, pid in client.run(os.getpid).items()}
        self.interval, self.samples = interval, []  # (time, {worker: rss bytes})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def cpu(self) -> float:
        """CPU seconds (user + system) the workers' processes have used so far."""
        return sum(sum(p.cpu_times()[:2]) for p in self.processes.values())

    def sample(self) -> None:
        """One sample now (also at the start and end of each pass, so that a short pass has some)."""
        self.samples.append((time.perf_counter(), {a: p.memory_info().rss for a, p in self.processes.items()}))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def quarters(self, start: float, end: float) -> tuple[float, float]:
        """Peak RSS (MiB, the largest worker) in the first and in the last quarter of ``start..end``."""
        quarter = (end - start) / 4

        def peak(a: float, b: float) -> float:
            inside = [max(rss.values()) for t, rss in self.samples if a <= t <= b]
            before = [max(rss.values()) for t, rss in self.samples if t < a]
            return max(inside or before[-1:]) / 2**20

        return peak(start, start + quarter), peak(end - quarter, end)


def run(
    root: Path, store: str, client, *, size: int | None = None, repeat: int = 2, shared: Path = SHARED
) -> dict[str, Any]:
    """The floor and ingest, alternated ``repeat`` times on ``client``'s workers; the figures as a dict (each
    time and CPU time the best of its passes)."""
    size = int(config.get("ingest.size", size))
    chunk, shard = int(config.get("ingest.chunk")), int(config.get("ingest.shard"))
    catalog = dask_dl.read_nih(root)
    paths = catalog["path"].tolist()
    for path in paths:  # warm the page cache: both passes read from memory, neither from disk first
        Path(path).read_bytes()
    with_dask = _bench_ingest().with_dask
    if __name__ != "__main__":  # imported (by the tests): the floor's tasks name this module, so the workers need it
        client.upload_file(__file__)
    workers = len(client.scheduler_info()["workers"])
    warm = catalog.iloc[: chunk * workers]  # the workers' first imports, not counted
    with_dask(warm, store, size=size, chunk=chunk, shard=shard, client=client)
    decode_floor(client, paths[: chunk * workers], size=size, rows=chunk)
    passes: dict[str, list[tuple[float, tuple[float, float], float]]] = {"floor": [], "ingest": []}
    with MemorySampler(client) as memory:
        for name in ["floor", "ingest"] * repeat:  # alternated, so that other processes' load hits both alike
            memory.sample()
            started, cpu = time.perf_counter(), memory.cpu()
            if name == "ingest":
                seconds = len(catalog) / with_dask(catalog, store, size=size, chunk=chunk, shard=shard, client=client)
            else:
                seconds = decode_floor(client, paths, size=size, rows=chunk * shard)
            ended, cpu = time.perf_counter(), memory.cpu() - cpu
            memory.sample()
            passes[name].append((seconds, memory.quarters(started, ended), cpu))
    idle = max(memory.samples[0][1].values()) / 2**20  # before the first pass
    floor, ingest_s = (min(t for t, _, _ in passes[name]) for name in ("floor", "ingest"))
    floor_cpu, ingest_cpu = (min(c for _, _, c in passes[name]) for name in ("floor", "ingest"))
    first = passes["ingest"][0][1]  # the first ingest: the workers' memory before any other ingest ran
    last_peak = max(q[1] for _, q, _ in passes["ingest"])
    sizes = [os.path.getsize(p) for p in paths]
    real = [str(shared / "nih" / name) for name in REAL]
    (real_bpp, real_ms), (made_bpp, made_ms) = decode_cost(real, paths[:8])
    return {
        "images": len(catalog),
        "side": _side(paths[0]),
        "size": size,
        "workers": workers,
        "mean_file_mb": float(np.mean(sizes)) / 1e6,
        "real_file_mb": [os.path.getsize(p) / 1e6 for p in real],
        "real_bytes_per_pixel": real_bpp,
        "bytes_per_pixel": made_bpp,
        "real_decode_ms_per_mpx": real_ms,
        "decode_ms_per_mpx": made_ms,
        "repeat": repeat,
        "floor_s": [t for t, _, _ in passes["floor"]],
        "ingest_s": [t for t, _, _ in passes["ingest"]],
        "floor_rate": len(catalog) / floor,
        "ingest_rate": len(catalog) / ingest_s,
        "ratio": ingest_s / floor,
        "floor_cpu_ms": floor_cpu / len(catalog) * 1e3,
        "ingest_cpu_ms": ingest_cpu / len(catalog) * 1e3,
        "cpu_ratio": ingest_cpu / floor_cpu if floor_cpu else float("nan"),  # psutil counts in 10 ms ticks
        "rss_idle_mib": idle,
        "rss_ingest_mib": list(first),
        "rss_ingest_last_mib": last_peak,
        "rss_floor_mib": list(passes["floor"][0][1]),
        "nih_hours": NIH_IMAGES / (len(catalog) / ingest_s) / 3600,
        "load": os.getloadavg()[0],
    }


def _side(path: str) -> int:
    with open(path, "rb") as f:
        return struct.unpack(">I", f.read(24)[16:20])[0]  # IHDR's width


def report(f: dict[str, Any]) -> list[str]:
    """The lines the bench prints."""
    per_image_s = f["workers"] / f["ingest_rate"]
    growth = f["rss_ingest_mib"][1] / f["rss_ingest_mib"][0]
    return [
        f"{f['images']} NIH-layout PNGs {f['side']}x{f['side']} -> {f['size']}x{f['size']}, {f['workers']} workers "
        f"(load {f['load']:.1f})",
        f"files: mean {f['mean_file_mb']:.3f} MB, {f['bytes_per_pixel']:.2f} bytes/pixel, PNG decode "
        f"{f['decode_ms_per_mpx']:.2f} ms/Mpx; the real NIH copies: "
        + ", ".join(f"{mb:.3f} MB" for mb in f["real_file_mb"])
        + f" (512 px), {f['real_bytes_per_pixel']:.2f} bytes/pixel, {f['real_decode_ms_per_mpx']:.2f} ms/Mpx",
        f"decode floor            {f['floor_rate']:8.1f} images/s (best of "
        + ", ".join(f"{t:.1f}" for t in f["floor_s"])
        + " s)",
        f"dask_dl.ingest          {f['ingest_rate']:8.1f} images/s (best of "
        + ", ".join(f"{t:.1f}" for t in f["ingest_s"])
        + " s)",
        f"ingest / floor (time)   {f['ratio']:8.3f}  (target <= 1.1)",
        f"workers' CPU per image: floor {f['floor_cpu_ms']:.2f} ms, ingest {f['ingest_cpu_ms']:.2f} ms, ratio "
        f"{f['cpu_ratio']:.3f} (what other processes' load moves less than time)",
        f"worker RSS, largest worker: idle {f['rss_idle_mib']:.0f} MiB; ingest first-quarter peak "
        f"{f['rss_ingest_mib'][0]:.0f} MiB, last-quarter peak {f['rss_ingest_mib'][1]:.0f} MiB (x{growth:.3f}), "
        f"last quarter of the last ingest {f['rss_ingest_last_mib']:.0f} MiB; floor {f['rss_floor_mib'][0]:.0f} -> "
        f"{f['rss_floor_mib'][1]:.0f} MiB",
        f"NIH's {NIH_IMAGES:,} images: {per_image_s * 1e3:.2f} ms per image per worker x {NIH_IMAGES:,} / "
        f"{f['workers']} workers = {f['nih_hours'] * 60:.1f} min (assumes this rate holds: flat memory, the files "
        f"in page cache or read at {f['ingest_rate'] * f['mean_file_mb']:.0f} MB/s, cores as fast as these)",
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "dask_dl_bench_nih_full"))
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--size", type=int, default=None, help="output side; default dask-dl.ingest.size (224)")
    parser.add_argument("--repeat", type=int, default=2, help="floor and ingest passes, alternated")
    parser.add_argument("--side", type=int, default=1024, help="side of the PNGs written (NIH's: 1024)")
    parser.add_argument("--shared", type=Path, default=SHARED, help="the folder holding nih/ (real table, PNGs)")
    args = parser.parse_args(argv)
    from distributed import Client, LocalCluster

    started = time.perf_counter()
    root = write_collection(args.cache, args.images, shared=args.shared, side=args.side)
    print(f"collection ready in {args.cache} ({time.perf_counter() - started:.0f} s)", flush=True)
    with (
        tempfile.TemporaryDirectory(prefix="dask_dl_nih_full_") as tmp,  # the store goes with it
        LocalCluster(n_workers=args.workers, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        figures = run(root, f"{tmp}/nih.zarr", client, size=args.size, repeat=args.repeat, shared=args.shared)
    for line in report(figures):
        print(line)
    return figures


if __name__ == "__main__":
    sys.exit(main() and None)
