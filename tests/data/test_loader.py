"""ChunkLoader against small real Zarr 3 stores written to the dask_dl store contract.

Image ``i`` of the test store carries its row number in its first two pixels, so a batch says exactly which
samples it holds; label ``j`` of row ``i`` is bit ``j`` of ``i``.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from zarr.storage import LocalStore, WrapperStore

from dask_dl.data.loader import Augmentation, ChunkLoader
from dask_dl.errors import ConfigurationError, DatasetError, StoreError
from dask_dl.normalize import DEFAULT_NORMALIZATION
from dask_dl.testing import data as kit
from dask_dl.testing.data import corrupt_shard, row_pattern

N, SIZE, CHUNK, SHARD = 50, 8, 4, 2
LABELS = ["Atelectasis", "Effusion", "Mass"]
REJECTED = (7, 30)


def split_of(i: int) -> str:
    if 12 <= i < 16:  # chunk 3 holds no train rows: a train loader must never read it
        return "test"
    if 40 <= i < 44 or i % 5 == 1:  # so chunks hold different numbers of train rows
        return "val"
    return "train"


def pattern(i: int) -> np.ndarray:
    return row_pattern(i, SIZE)


def write_store(path: Path, *, n: int = N, complete: bool = True) -> Path:
    """A store exactly as dask_dl.ingest lays it out (sharded, zstd, dimension names, coordinates)."""
    return kit.write_store(
        path,
        n=n,
        size=SIZE,
        chunk=CHUNK,
        shard=SHARD,
        labels=LABELS,
        rejected=REJECTED,
        split_of=split_of,
        complete=complete,
    )


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return write_store(tmp_path / "store.zarr")


TRAIN = np.array([i for i in range(N) if split_of(i) == "train" and i not in REJECTED])


def rows_of(x: torch.Tensor) -> np.ndarray:
    """Decode the row numbers written into the first two pixels (requires augment=False)."""
    pixels = ((x[:, 0, 0, :2] * DEFAULT_NORMALIZATION["std"] + DEFAULT_NORMALIZATION["mean"]) * 255).round()
    pixels = pixels.to(torch.int64).numpy()
    return pixels[:, 0] + 256 * pixels[:, 1]


def label_of(rows: np.ndarray) -> np.ndarray:
    return np.array([[(i >> j) & 1 for j in range(len(LABELS))] for i in rows], np.float32)


def run(loader: ChunkLoader, epoch: int = 0) -> list[np.ndarray]:
    """One epoch: the rows of each batch, checked against pixels and labels."""
    batches = []
    for x, y, rows in loader.epoch(epoch, with_samples=True):
        assert x.dtype == torch.float32 and x.shape == (len(rows), 1, SIZE, SIZE)
        assert y.dtype == torch.float32 and y.shape == (len(rows), len(LABELS))
        if loader.augmentation is None:
            np.testing.assert_array_equal(rows_of(x), rows)
        np.testing.assert_array_equal(y.numpy(), label_of(rows))
        batches.append(rows)
    return batches


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dask-dl-loader")]


@pytest.mark.parametrize("world_size, batch_size", [(1, 5), (2, 4), (3, 3), (4, 16)])
def test_validation_covers_every_sample_once_in_store_order(store, world_size, batch_size):
    per_rank = []
    for rank in range(world_size):
        loader = ChunkLoader(
            store, TRAIN, batch_size=batch_size, rank=rank, world_size=world_size, shuffle=False, drop_last=False
        )
        batches = run(loader)
        assert len(batches) == loader.steps_per_epoch
        assert all(len(b) == batch_size for b in batches[:-1]) and 0 < len(batches[-1]) <= batch_size
        per_rank.append(np.concatenate(batches))
    # Rank by rank, in order, the ranks hand out the sorted samples: every sample once, none from outside.
    np.testing.assert_array_equal(np.concatenate(per_rank), TRAIN)
    sizes = [len(r) for r in per_rank]
    assert max(sizes) - min(sizes) <= 1


def test_shuffled_epoch_without_drop_covers_every_sample_once(store):
    seen = np.concatenate(
        [
            np.concatenate(run(ChunkLoader(store, TRAIN, batch_size=4, rank=r, world_size=3, drop_last=False)))
            for r in range(3)
        ]
    )
    np.testing.assert_array_equal(np.sort(seen), TRAIN)
    assert not np.array_equal(seen, TRAIN)  # shuffled


def test_drop_last_gives_every_rank_the_same_full_steps(store):
    world_size, batch_size = 3, 4
    loaders = [ChunkLoader(store, TRAIN, batch_size=batch_size, rank=r, world_size=world_size) for r in range(3)]
    steps = len(TRAIN) // (world_size * batch_size)
    assert [ld.steps_per_epoch for ld in loaders] == [steps] * world_size and len(loaders[0]) == steps
    for epoch in range(3):
        per_rank = [run(ld, epoch) for ld in loaders]
        assert all(len(b) == steps and all(len(x) == batch_size for x in b) for b in per_rank)
        seen = np.concatenate([np.concatenate(b) for b in per_rank])
        assert len(np.unique(seen)) == len(seen) == steps * world_size * batch_size
        assert np.isin(seen, TRAIN).all()


def test_seeded_order_is_reproducible_and_changes_with_epoch_and_seed(store):
    def order(seed, epoch, rank=0):
        return np.concatenate(run(ChunkLoader(store, TRAIN, batch_size=3, rank=rank, world_size=2, seed=seed), epoch))

    np.testing.assert_array_equal(order(0, 1), order(0, 1))
    assert not np.array_equal(order(0, 0), order(0, 1))
    assert not np.array_equal(order(0, 0), order(1, 0))
    assert not np.array_equal(order(0, 0, rank=0), order(0, 0, rank=1))


def test_each_chunk_read_once_per_epoch_and_only_chunks_with_samples(store):
    wanted_chunks = set(TRAIN // CHUNK)
    assert 3 not in wanted_chunks and 10 not in wanted_chunks  # chunks without train rows
    for drop_last in (True, False):
        read_by_all: Counter = Counter()
        for rank in range(2):
            loader = ChunkLoader(
                store, TRAIN, batch_size=3, rank=rank, world_size=2, window=2, drop_last=drop_last, cache=0
            )  # every epoch reads from the store
            real_read = loader.read_chunk
            for epoch in range(2):
                reads: Counter = Counter()

                def counting(chunk, reads=reads, real_read=real_read):
                    reads[chunk] += 1
                    return real_read(chunk)

                loader.read_chunk = counting
                rows = np.concatenate(run(loader, epoch))
                assert max(reads.values()) == 1
                assert set(reads) == set(rows // CHUNK) <= wanted_chunks
                read_by_all.update(reads)
        if not drop_last:  # the two ranks together read every chunk with train rows, each epoch
            assert set(read_by_all) == wanted_chunks
            # a chunk is read twice per epoch in all (once by each rank) only where the ranks' pieces meet
            assert sum(read_by_all.values()) <= 2 * (len(wanted_chunks) + 1)


def test_window_mixes_samples_of_several_chunks(store):
    def chunk_runs(window):
        loader = ChunkLoader(store, TRAIN, batch_size=2, window=window, drop_last=False)
        chunks = np.concatenate(run(loader)) // CHUNK
        return 1 + int(np.count_nonzero(np.diff(chunks)))

    n_chunks = len(set(TRAIN // CHUNK))
    assert chunk_runs(1) == n_chunks  # without mixing, each chunk's samples come as one run
    assert chunk_runs(4) > n_chunks + 5


def test_batches_are_normalized_exactly(store):
    loader = ChunkLoader(store, TRAIN, batch_size=6, shuffle=False)
    x, y, rows = next(loader.epoch(0, with_samples=True))
    raw = torch.from_numpy(np.stack([pattern(i) for i in rows])).to(torch.float32)
    expected = ((raw / 255 - 0.5) / 0.25).unsqueeze(1)
    torch.testing.assert_close(x, expected, rtol=1e-6, atol=1e-6)
    assert float(x.min()) >= -2.0 and float(x.max()) <= 2.0


def test_augmentation_changes_pixels_keeps_labels_and_is_reproducible(store):
    def batches(epoch, augment=True, seed=0):
        loader = ChunkLoader(store, TRAIN, batch_size=4, rank=1, world_size=2, seed=seed, augment=augment)
        return list(loader.epoch(epoch, with_samples=True))

    plain, aug, again = batches(0, augment=False), batches(0), batches(0)
    for (x0, y0, s0), (x1, y1, s1), (x2, _, _) in zip(plain, aug, again, strict=True):
        np.testing.assert_array_equal(s0, s1)  # augmentation does not change which samples come
        torch.testing.assert_close(y0, y1, rtol=0, atol=0)
        assert x1.shape == x0.shape and x1.dtype == torch.float32
        assert (x1 != x0).float().mean() > 0.5
        torch.testing.assert_close(x1, x2, rtol=0, atol=0)
    other_epoch = batches(1)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(aug, other_epoch, strict=True))


def test_augmentation_with_zero_ranges_is_the_identity():
    images = np.stack([pattern(i) for i in range(5)])
    still = Augmentation(rotation=0, scale=0, shift=0, brightness=0, contrast=0)
    np.testing.assert_array_equal(still.apply(images, np.random.default_rng(0)), images)
    # a brightness-only jitter moves every pixel of a mid-gray image by the same amount
    gray = np.full((3, SIZE, SIZE), 128, np.uint8)
    bright = Augmentation(rotation=0, scale=0, shift=0, contrast=0, brightness=0.2).apply(
        gray, np.random.default_rng(1)
    )
    assert all(len(np.unique(im)) == 1 for im in bright) and len(np.unique(bright)) == 3


def test_thread_stops_on_break_and_on_close(store):
    loader = ChunkLoader(store, TRAIN, batch_size=2, prefetch=2)
    for _ in loader.epoch(0):
        assert loader_threads()
        break
    assert loader_threads() == []
    with ChunkLoader(store, TRAIN, batch_size=2, prefetch=3) as loader:
        batches = loader.epoch(0)
        next(batches)
        assert loader_threads()
    assert loader_threads() == []
    with pytest.raises(DatasetError, match="closed"):
        next(batches)
    with pytest.raises(DatasetError, match="closed"):
        next(loader.epoch(1))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_a_one_cpu_process_reads_local_files_in_its_own_thread(store):
    """A thread overlaps nothing on one CPU: no reader threads, and the very batches of a threaded loader."""
    threaded = [(x, y) for x, y in ChunkLoader(store, TRAIN, batch_size=2, prefetch=2, seed=5).epoch(1)]
    everywhere = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(everywhere)})  # this thread only: restored below
    try:
        loader = ChunkLoader(store, TRAIN, batch_size=2, prefetch=2, seed=5)
        inline = []
        for x, y in loader.epoch(1):
            assert loader_threads() == []
            inline.append((x, y))
    finally:
        os.sched_setaffinity(0, everywhere)
    assert len(inline) == len(threaded)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(inline, threaded, strict=True))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_read_error_names_the_chunk_in_the_consumer(store, prefetch):
    corrupt_shard(store, 2)  # chunks 4 and 5
    loader = ChunkLoader(store, np.arange(16, 28), batch_size=2, shuffle=False, prefetch=prefetch)
    with pytest.raises(StoreError, match=r"chunk 4 \(rows 16\.\.19\)") as info:
        for _ in loader.epoch(0):
            pass
    assert info.value.__cause__ is not None
    assert loader_threads() == []


def test_wait_s_is_measured_per_epoch(store):
    loader = ChunkLoader(store, TRAIN, batch_size=4)
    run(loader)
    assert isinstance(loader.wait_s, float) and loader.wait_s > 0.0


def test_sharded_read_fetches_one_inner_chunk(store):
    class Recording(WrapperStore):
        requests: list = []

        async def get(self, key, prototype, byte_range=None):
            Recording.requests.append((key, byte_range))
            return await self._store.get(key, prototype, byte_range)

    loader = ChunkLoader(zarr.open_group(Recording(LocalStore(store, read_only=True)), mode="r"), TRAIN, batch_size=2)
    Recording.requests.clear()
    np.testing.assert_array_equal(loader.read_chunk(5), np.stack([pattern(i) for i in range(20, 24)]))
    keys = {key for key, _ in Recording.requests}
    assert keys == {"image/c/2/0/0"}
    assert all(r is not None for _, r in Recording.requests)  # byte ranges: index and one chunk, not the shard


def test_local_shard_reads_equal_zarr_reads(store, tmp_path):
    """The loader reads a local store's shard files itself (zarr's per-read overhead is most of a small step)."""
    image = zarr.open_group(store, mode="r")["image"]
    loader = ChunkLoader(store, TRAIN, batch_size=2)
    assert loader._shards is not None  # the fast path is taken for what ingest writes
    for chunk in range(-(-N // CHUNK)):  # the last chunk holds 2 rows
        expected = np.asarray(image[chunk * CHUNK : (chunk + 1) * CHUNK])
        np.testing.assert_array_equal(loader.read_chunk(chunk), expected)
    # a store written without a compressor (ingest's compressor="none") reads the same way
    raw = tmp_path / "raw.zarr"
    shutil.copytree(store, raw)
    group = zarr.open_group(raw, mode="r+")
    del group["image"]
    plain = group.create_array(
        "image",
        shape=image.shape,
        chunks=image.chunks,
        shards=image.shards,
        dtype="uint8",
        compressors=None,
        chunk_key_encoding={"name": "default", "separator": "/"},
        dimension_names=image.metadata.dimension_names,
        attributes=dict(image.attrs),
    )
    plain[:] = image[:]
    loader = ChunkLoader(raw, TRAIN, batch_size=2)
    assert loader._shards is not None
    for chunk in range(-(-N // CHUNK)):
        np.testing.assert_array_equal(loader.read_chunk(chunk), np.asarray(image[chunk * CHUNK : (chunk + 1) * CHUNK]))


def test_local_shard_with_a_damaged_index_is_a_store_error(store):
    path = Path(store, "image", "c", "2", "0", "0")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the index: its CRC32C no longer matches
    path.write_bytes(bytes(data))
    loader = ChunkLoader(store, np.arange(16, 28), batch_size=2, shuffle=False)
    with pytest.raises(StoreError, match=r"chunk 4 \(rows 16\.\.19\).*CRC32C"):
        list(loader.epoch(0))


def test_local_shard_missing_file_reads_as_zeros_like_zarr(store):
    Path(store, "image", "c", "1", "0", "0").unlink()  # zarr writes no file for an all-zero shard
    loader = ChunkLoader(store, TRAIN, batch_size=2)
    np.testing.assert_array_equal(loader.read_chunk(2), np.zeros((CHUNK, SIZE, SIZE), np.uint8))
    np.testing.assert_array_equal(loader.read_chunk(2), np.asarray(zarr.open_group(store)["image"][8:12]))


def test_accepts_a_dataset_with_its_source(store):
    import xarray as xr

    dataset = xr.open_zarr(store, consolidated=False)
    loader = ChunkLoader(dataset, TRAIN, batch_size=4, shuffle=False, drop_last=False)
    np.testing.assert_array_equal(np.concatenate(run(loader)), TRAIN)


@pytest.mark.parametrize(
    "samples, options, match",
    [
        (np.array([1, 2, 50]), {}, r"rows \[50\] are outside .* rows 0\.\.49"),
        (np.array([3, 3, 4]), {}, r"rows \[3\] are given more than once"),
        (np.array([6, 7, 8]), {}, r"rows \[7\] are rejected"),
        (np.array([[1, 2]]), {}, "1-D array"),
        (np.array([]), {}, "empty"),
        (TRAIN, {"batch_size": 40, "world_size": 2}, "cannot fill one batch of 40 on each of 2 ranks"),
    ],
)
def test_bad_data_is_explained(store, samples, options, match):
    with pytest.raises(DatasetError, match=match):
        ChunkLoader(store, samples, **{"batch_size": 2, **options})


@pytest.mark.parametrize(
    "options, match",
    [
        ({"rank": 2, "world_size": 2}, r"rank 2 is not in 0\.\.1"),
        ({"window": 0}, "window must be a positive integer, got 0"),
        ({"batch_size": 0}, "batch_size must be a positive integer, got 0; pass e.g. batch_size=32"),
        ({"world_size": True}, "world_size must be a positive integer, got True"),
        ({"prefetch": -1}, "prefetch must be an integer >= 0, got -1"),
        ({"seed": -3}, "seed must be a non-negative integer, got -3"),
        ({"augment": "yes"}, "augment must be True, False or an Augmentation"),
    ],
)
def test_bad_arguments_are_configuration_errors(store, options, match):
    with pytest.raises(ConfigurationError, match=match):
        ChunkLoader(store, TRAIN, **{"batch_size": 2, **options})


def test_incomplete_or_foreign_store_is_refused(tmp_path):
    with pytest.raises(StoreError, match="incomplete"):
        ChunkLoader(write_store(tmp_path / "partial.zarr", complete=False), TRAIN, batch_size=2)
    zarr.open_group(tmp_path / "other.zarr", mode="w")
    with pytest.raises(StoreError, match="not a dask_dl store"):
        ChunkLoader(tmp_path / "other.zarr", TRAIN, batch_size=2)


def test_loads_what_dask_dl_ingest_wrote(tmp_path):
    import pandas as pd
    from distributed import Client, LocalCluster
    from PIL import Image

    from dask_dl.data.dataset import open_dataset
    from dask_dl.data.ingest import ingest
    from dask_dl.data.schema import make_catalog
    from dask_dl.data.store import catalog_rows

    n = 22
    rows = []
    for i in range(n):
        path = tmp_path / f"{i:03d}.png"
        if i != 9:  # row 9's file is missing: ingest rejects it and open_dataset drops it
            Image.fromarray(np.full((64, 64), 10 + 11 * i, np.uint8)).save(path)
        split = "val" if i // 2 in (3, 7) else "train"
        rows.append({"image_id": path.name, "path": str(path), "patient_id": f"p{i // 2}", "site": "a", "split": split})
        rows[-1].update({label: (i >> j) & 1 for j, label in enumerate(LABELS)})
    catalog = make_catalog(pd.DataFrame(rows).astype({label: np.uint8 for label in LABELS}), LABELS)
    store = tmp_path / "cxr.zarr"
    # Our own cluster rather than distributed's ``client`` fixture: that fixture resets dask.config to a snapshot
    # taken before dask_dl registered its defaults.
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        ingest(catalog, store, size=16, chunk=4, shard=2, client=client, progress=False)

    of = catalog_rows(store)  # the catalog row each sample holds: ingest stores a seeded permutation
    assert sorted(of.tolist()) == list(range(n)) and of.tolist() != list(range(n))
    samples = open_dataset(store, split="train").sample.values
    expected = [s for s in range(n) if of[s] != 9 and of[s] // 2 not in (3, 7)]
    np.testing.assert_array_equal(samples, expected)
    seen = []
    for rank in range(2):
        loader = ChunkLoader(store, samples, batch_size=3, rank=rank, world_size=2, shuffle=False, drop_last=False)
        assert loader.labels == LABELS and loader.image_size == 16
        for x, y, batch in loader.epoch(0, with_samples=True):
            pixels = ((x * 0.25 + 0.5) * 255).round().to(torch.int64).numpy()
            np.testing.assert_array_equal(pixels, np.broadcast_to((10 + 11 * of[batch])[:, None, None, None], x.shape))
            np.testing.assert_array_equal(y.numpy(), label_of(of[batch]))
            seen.append(batch)
    np.testing.assert_array_equal(np.concatenate(seen), expected)


def _same_batches(a: ChunkLoader, b: ChunkLoader, epoch: int) -> None:
    first, second = list(a.epoch(epoch, with_samples=True)), list(b.epoch(epoch, with_samples=True))
    assert len(first) == len(second) > 0
    for (x1, y1, s1), (x2, y2, s2) in zip(first, second, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        np.testing.assert_array_equal(s1, s2)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_kept_chunks_are_read_once_and_serve_the_same_batches(store, prefetch):
    """With room for every chunk, each is read from the store once per run, and the batches (augmented,
    shuffled) are those of a loader that reads every epoch."""
    options = dict(batch_size=2, seed=3, augment=True, prefetch=prefetch)
    fresh = ChunkLoader(store, TRAIN, cache=0, **options)
    kept = ChunkLoader(store, TRAIN, cache="1 MiB", **options)
    for epoch in range(3):
        _same_batches(fresh, kept, epoch)
    plans = [[chunk for chunk, _ in fresh.plan(epoch)] for epoch in range(3)]
    assert fresh.reads == sum(len(p) for p in plans)  # every planned chunk, every epoch
    assert kept.reads == len(set().union(*plans)) == len(np.unique(TRAIN // CHUNK))
    kept.close()
    assert kept._kept == {} and kept._kept_bytes == 0  # closing frees the memory


def test_the_cache_keeps_what_fits_and_reads_the_rest_every_epoch(store):
    """A budget of two chunks keeps chunks in the order they are first read while they fit (the last chunk
    holds 2 rows, half a chunk); every other chunk is read again each epoch."""
    budget = 2 * CHUNK * SIZE * SIZE
    kept = ChunkLoader(store, TRAIN, batch_size=2, seed=1, prefetch=0, cache=budget)
    fresh = ChunkLoader(store, TRAIN, batch_size=2, seed=1, prefetch=0, cache=0)
    held: dict[int, int] = {}  # chunk: bytes
    expected = 0
    for epoch in range(3):
        _same_batches(fresh, kept, epoch)
        for chunk, _ in kept.plan(epoch):
            if chunk not in held:
                expected += 1
                nbytes = min(CHUNK, N - chunk * CHUNK) * SIZE * SIZE
                if sum(held.values()) + nbytes <= budget:
                    held[chunk] = nbytes
    assert kept.reads == expected < fresh.reads
    assert sorted(kept._kept) == sorted(held) and kept._kept_bytes == sum(held.values()) <= budget
    assert not any(images.flags.writeable for images in kept._kept.values())  # batches are copies of them


@pytest.mark.parametrize("cache", ["lots", -1, 1.5, True])
def test_cache_must_be_a_number_of_bytes(store, cache):
    with pytest.raises(ConfigurationError, match=r"cache must be a number of bytes >= 0 .*got .*pass e\.g\. cache="):
        ChunkLoader(store, TRAIN, batch_size=2, cache=cache)
