"""Per-rank batch iterator over the chunks of a dask_dl Zarr store.

A Zarr chunk is compressed as a whole, so reading one image decodes all ``chunk`` images beside it: random access
per image reads each chunk ``chunk`` times. :class:`ChunkLoader` therefore shuffles at two levels:

1. each epoch, a seeded permutation of the chunks that hold the requested samples, the same on every rank; the
   samples in that order are cut into one contiguous, equally long piece per rank, so each rank reads whole chunks
   (only the two ends of a piece may share a chunk with the neighbouring rank) and every rank takes exactly the
   same number of steps even when chunks hold different numbers of requested samples;
2. within a window of ``window`` consecutive chunks, the samples of those chunks are mixed together.

Each chunk is read at most once per epoch per rank, with one chunk-aligned slice of the ``image`` array: on a
sharded array that reads the shard index and the inner chunk's bytes only, not the whole shard. A background thread
keeps ``prefetch`` chunk reads in flight and builds finished batches (normalized, optionally augmented) while the
trainer computes; ``wait_s`` says how long the trainer still waited.

Validation and prediction (``shuffle=False, drop_last=False``): chunks in store order, no mixing, no dropping; the
ranks together cover every sample exactly once, each rank a contiguous run of the sorted samples. Ranks then may
take different numbers of batches (at most one apart), so a validation loop must not run collectives per batch:
each rank returns its predictions with the sample numbers (``epoch(e, with_samples=True)``) to the driver through
Dask, or gathers them once at the end with ``torch.distributed.all_gather_object``.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from dask_dl import config
from dask_dl.checks import byte_count, one_of, positive_int
from dask_dl.data import store as contract
from dask_dl.data.device_augment import augment_batch, draw_parameters
from dask_dl.data.position import EpochPosition
from dask_dl.data.shards import ShardReader
from dask_dl.data.store import open_store
from dask_dl.errors import ConfigurationError, DatasetError, StoreError
from dask_dl.normalize import check_normalization, normalize

__all__ = ["Augmentation", "ChunkLoader"]

# The tags keep the random streams of one (seed, epoch) apart: chunk order (shared by all ranks), the window mix
# and the augmentation (per rank).
_ORDER, _MIX, _AUGMENT = 0, 1, 2
_THREAD_PREFIX = "dask-dl-loader"


@dataclass(frozen=True)
class Augmentation:
    """Ranges of the random augmentation a :class:`ChunkLoader` applies with ``augment=True``.

    Each image gets its own affine transform (rotation, scale, shift; pixels moved in from outside are black) and
    brightness/contrast jitter, drawn uniformly from ``[-value, value]`` around the identity.

    Horizontal flips are off by default: chest X-rays are not left-right symmetric (the heart, the aortic arch and
    the gastric bubble sit on the left, and the film markers are lettered), so a flipped radiograph shows anatomy
    that is a finding in itself (dextrocardia, situs inversus) rather than a plausible variant of the same image.

    Parameters
    ----------
    rotation : float
        Largest rotation in degrees.
    scale : float
        Largest relative zoom in or out (0.05 = 5 %).
    shift : float
        Largest shift as a fraction of the image side.
    brightness : float
        Largest brightness offset as a fraction of full scale.
    contrast : float
        Largest relative contrast change around the image mean.
    hflip : bool
        Flip half the images left-right (see above for why this is off).
    """

    rotation: float = 5.0
    scale: float = 0.05
    shift: float = 0.05
    brightness: float = 0.1
    contrast: float = 0.1
    hflip: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def skip(self, n: int, rng: np.random.Generator) -> None:
        """Draw from ``rng`` what :meth:`apply` draws for ``n`` images, without images (a resumed epoch's skip)."""
        rng.uniform(-1.0, 1.0, size=(6, n))
        if self.hflip:
            rng.random(n)

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """The parameters of ``n`` images, one row each (:func:`dask_dl.data.device_augment.draw_parameters`)."""
        return draw_parameters(self, n, rng)

    def apply(self, images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Return augmented copies of the uint8 ``images`` ``(B, S, S)`` or ``(B, S, S, C)``, drawing from ``rng``.

        Every channel of an image moves with the same transform and jitter (colours are not shifted apart).
        """
        colour = images.ndim == 4
        # Augment in 0..1 so that grid_sample's zero padding is black, then back to uint8: the model sees the same
        # pixel grid and the same normalize() as at inference time.
        x = torch.from_numpy(images)
        x = (x.permute(0, 3, 1, 2) if colour else x.unsqueeze(1)).to(torch.float32).div_(255.0)
        x = augment_batch(x, self.draw(len(images), rng))
        x = x.mul_(255.0).round_().to(torch.uint8)
        return np.ascontiguousarray(x.permute(0, 2, 3, 1).numpy()) if colour else x.squeeze(1).numpy()


class ChunkLoader:
    """Batches of one rank's share of ``samples``, read chunk by chunk from a dask_dl Zarr store.

    Parameters
    ----------
    store : str, os.PathLike, zarr.Group or xarray.Dataset
        The store written by :func:`dask_dl.ingest` (a path or URL, an open group, or the dataset from
        :func:`dask_dl.open_dataset`, whose ``encoding["source"]`` names the store).
    samples : array of int
        Physical row numbers to serve, e.g. ``open_dataset(store, split="train").sample.values``.
    batch_size : int
        Images per batch on this rank.
    rank, world_size : int
        This trainer's rank and the number of trainers; each rank gets its own share.
    seed : int
        Seed of the chunk order, the window mix and the augmentation; runs with the same seed are identical.
    shuffle : bool
        Shuffle chunk order and mix samples within windows. False: store order (validation, prediction).
    window : int, optional
        Chunks whose samples are mixed together. Default ``dask-dl.train.shuffle-window``.
    prefetch : int, optional
        Chunk reads kept in flight by the background thread. 0 reads in the consumer's thread (no thread), as
        does a process that may run on one CPU only (its affinity) reading local files: a thread cannot overlap
        anything there. Default ``dask-dl.train.prefetch``.
    augment : bool or Augmentation
        Random affine and brightness/contrast jitter, seeded by (seed, epoch, rank); True uses
        :class:`Augmentation` defaults.
    augment_on : {"cpu", "device"}
        Where the pixel work after decoding happens. ``"cpu"``: here, batches come augmented and normalized.
        ``"device"``: batches come as uint8 pixels with each image's augmentation parameters (drawn here, from the
        same stream as ``"cpu"``'s), for :func:`dask_dl.data.device_augment.finish_batch` to augment and normalize
        on the trainer's device (a GPU trainer's cores then only decode, and a quarter of the bytes cross to it).
    pin_memory : bool
        Put batches in page-locked memory (on the background thread), so that copies to a GPU can be
        asynchronous. Needs CUDA.
    drop_last : bool
        Drop the samples that do not fill a batch on every rank, so all ranks take ``steps_per_epoch`` full
        batches. False serves every sample exactly once across ranks (the last batch of a rank may be short and
        ranks may differ by one batch).
    normalization : dict, optional
        ``{"mean": m, "std": s}``, numbers or one per channel (:func:`dask_dl.normalize.check_normalization`);
        default :data:`dask_dl.normalize.DEFAULT_NORMALIZATION`.
    cache : int or str, optional
        Bytes of decoded chunks this loader keeps in memory from one epoch to the next, e.g. ``"1 GiB"``: a chunk
        is read from the store once while the kept chunks fit, and served from memory in later epochs (the
        batches are the same). 0 reads every chunk every epoch. Default ``dask-dl.train.cache``. ``reads``
        counts the chunks read from the store.

    Raises
    ------
    ConfigurationError
        ``batch_size``, ``world_size``, ``window`` or ``prefetch`` is not a count, ``rank`` or ``seed`` out of range,
        ``cache`` is not a number of bytes, ``normalization`` is not one (or has another number of channels than
        the store), ``augment_on`` is neither ``"cpu"`` nor ``"device"``, ``pin_memory`` without CUDA.
    StoreNotFoundError
        Nothing at ``store``.
    StoreError
        ``store`` is not a complete dask_dl store.
    DatasetError
        ``samples`` has rows outside the store, repeated or rejected rows, or cannot fill one batch per rank.

    Examples
    --------
    >>> loader = ChunkLoader(store, ds.sample.values, batch_size=32, rank=0, world_size=2)  # doctest: +SKIP
    >>> for x, y in loader.epoch(0):  # doctest: +SKIP
    ...     loss = criterion(model(x), y)
    """

    def __init__(
        self,
        store: Any,
        samples: Any,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        window: int | None = None,
        prefetch: int | None = None,
        augment: bool | Augmentation = False,
        augment_on: str = "cpu",
        pin_memory: bool = False,
        drop_last: bool = True,
        normalization: dict[str, Any] | None = None,
        cache: int | str | None = None,
    ) -> None:
        self.batch_size = positive_int("batch_size", batch_size, example=32)
        self.world_size = positive_int("world_size", world_size)
        if not isinstance(rank, int | np.integer) or not 0 <= rank < world_size:
            raise ConfigurationError(
                f"rank {rank!r} is not in 0..{world_size - 1}; pass the trainer's rank < world_size"
            )
        if not isinstance(seed, int | np.integer) or isinstance(seed, bool) or seed < 0:
            raise ConfigurationError(f"seed must be a non-negative integer, got {seed!r}; pass e.g. seed=0")
        self.rank, self.seed = int(rank), int(seed)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.window = positive_int("window", config.get("train.shuffle-window", window), example=4)
        self.prefetch = _non_negative("prefetch", config.get("train.prefetch", prefetch))
        self.cache_bytes = byte_count("cache", config.get("train.cache", cache))
        self.augmentation = Augmentation() if augment is True else (augment or None)
        if self.augmentation is not None and not isinstance(self.augmentation, Augmentation):
            raise ConfigurationError(f"augment must be True, False or an Augmentation(...), got {augment!r}")
        self.augment_on = one_of("augment_on", augment_on, ("cpu", "device"))
        if pin_memory and not torch.cuda.is_available():
            raise ConfigurationError(
                "pin_memory=True needs CUDA (page-locked memory is for copies to a GPU), and torch sees none here; "
                "pass pin_memory=False"
            )
        self.pin_memory = bool(pin_memory)

        self.source, group, layout = open_store(store)
        self._image = group[contract.IMAGE]
        self._shards = ShardReader.of(self.source, self._image, layout)
        self.chunk = layout.chunk
        self.image_size = layout.size
        self.channels = layout.channels
        self.image_shape = layout.image_shape
        self.normalization = check_normalization(normalization, channels=self.channels)
        self.labels = list(layout.labels)
        # Labels of the whole store are n x n_labels bytes: read them once rather than once per chunk.
        self._label = np.asarray(group[contract.LABEL][:], dtype=np.float32)
        valid = np.asarray(group[contract.VALID][:], dtype=bool) if contract.VALID in group else None
        self.samples = _check_samples(samples, n=self._image.shape[0], valid=valid, source=self.source)

        n, per_step = len(self.samples), self.batch_size * self.world_size
        if self.drop_last:
            self.steps_per_epoch = n // per_step
            if self.steps_per_epoch == 0:
                raise DatasetError(
                    f"{n} samples cannot fill one batch of {self.batch_size} on each of {self.world_size} ranks; "
                    f"use batch_size <= {max(n // self.world_size, 1)} or drop_last=False"
                )
            self._start = self.rank * self.steps_per_epoch * self.batch_size
            self._stop = self._start + self.steps_per_epoch * self.batch_size
        else:
            q, r = divmod(n, self.world_size)
            self._start = self.rank * q + min(self.rank, r)
            self._stop = self._start + q + (self.rank < r)
            self.steps_per_epoch = math.ceil((self._stop - self._start) / self.batch_size)
        # Requested samples grouped by the chunk that holds them (samples are sorted, so groups are runs).
        chunk_of = self.samples // self.chunk
        self._chunks, first = np.unique(chunk_of, return_index=True)
        self._groups = np.split(self.samples, first[1:])
        self.wait_s = 0.0
        self.reads = 0  # chunks read from the store
        self._kept: dict[int, np.ndarray] = {}  # decoded chunks kept across epochs (read-only), within cache_bytes
        self._kept_bytes = 0
        self._lock = threading.Lock()
        self._position_key: tuple | None = None  # the position whose batches _position_cache holds
        self._position_cache: list[np.ndarray] = []
        self._running: set[_Producer] = set()
        self._closed = False

    # ---- public -----------------------------------------------------------------------------------------------

    @property
    def n_labels(self) -> int:
        """Number of labels (columns of ``y``)."""
        return len(self.labels)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __repr__(self) -> str:
        return (
            f"ChunkLoader({self.source!r}, samples={len(self.samples)}, batch_size={self.batch_size}, "
            f"rank={self.rank}/{self.world_size}, steps_per_epoch={self.steps_per_epoch})"
        )

    def plan(self, epoch: int, *, piece: tuple[int, int] | None = None) -> list[tuple[int, np.ndarray]]:
        """Return this rank's reads of ``epoch`` in order: ``(chunk index, physical rows it serves)``.

        Every rank computes the same chunk order from ``(seed, epoch)`` and takes its own contiguous piece, so the
        plan needs no communication.
        """
        if self.shuffle:
            rng = np.random.default_rng([self.seed, int(epoch), _ORDER, 0])
            order = rng.permutation(len(self._chunks))
            # Shuffle inside each chunk as well: it decides which samples of a chunk shared by two ranks go where.
            stream = np.concatenate([rng.permutation(self._groups[i]) for i in order])
        else:
            stream = self.samples
        start, stop = (self._start, self._stop) if piece is None else piece
        mine = stream[start:stop]
        if len(mine) == 0:
            return []
        chunk_of = mine // self.chunk
        cuts = np.flatnonzero(np.diff(chunk_of)) + 1
        return [(int(rows[0] // self.chunk), rows) for rows in np.split(mine, cuts)]

    def order(
        self, epoch: int, *, rank: int | None = None, world_size: int | None = None, batch_size: int | None = None
    ) -> np.ndarray:
        """Return the rows rank ``rank`` of ``world_size`` serves in a fresh ``epoch``, in the order it serves them.

        The same rows :meth:`epoch` yields (``drop_last=True``), computed without reading an image; other ranks and
        world sizes than this loader's are allowed (a resumed epoch re-shards what the old ranks had left, see
        :mod:`dask_dl.data.position`). Defaults: this loader's rank, world size and batch size.
        """
        rank = self.rank if rank is None else int(rank)
        world_size = self.world_size if world_size is None else int(world_size)
        batch_size = self.batch_size if batch_size is None else int(batch_size)
        steps = len(self.samples) // (batch_size * world_size)
        start = rank * steps * batch_size
        plan = self.plan(epoch, piece=(start, start + steps * batch_size))
        mix = np.random.default_rng([self.seed, int(epoch), _MIX, rank])
        out, window = [], []
        for i, (_, rows) in enumerate(plan):
            window.append(rows)
            if len(window) < self.window and i + 1 < len(plan):
                continue
            s = np.concatenate(window)
            out.append(s[mix.permutation(len(s))] if self.shuffle else s)
            window = []
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def steps_from(self, position: EpochPosition) -> int:
        """Steps this rank takes to finish the epoch from ``position`` (:meth:`epoch` with ``position=``)."""
        batches = self._position_batches(position)
        return len(batches) - position.step

    def _position_batches(self, position: EpochPosition) -> list[np.ndarray]:
        last = position.segments[-1]
        if (last.world_size, last.batch_size) != (self.world_size, self.batch_size):
            raise DatasetError(
                f"the epoch position's last segment is of {last.world_size} ranks x batch {last.batch_size}, this "
                f"loader is of {self.world_size} x {self.batch_size}: resume with position.resumed(world_size="
                f"{self.world_size}, batch_size={self.batch_size})"
            )
        key = (position.epoch, position.seed, position.segments[:-1], last.world_size, last.batch_size)
        if self._position_key != key:
            orders = lambda r, w, b: self.order(position.epoch, rank=r, world_size=w, batch_size=b)  # noqa: E731
            self._position_key, self._position_cache = key, position.batches(orders)[self.rank]
        return self._position_cache

    def read_chunk(self, chunk: int) -> np.ndarray:
        """Return all images of chunk ``chunk`` (one chunk-aligned read, one decode), uint8 ``(k, S, S)`` grey or
        ``(k, S, S, 3)`` colour (the store's layout)."""
        start = chunk * self.chunk
        stop = min(start + self.chunk, self._image.shape[0])
        if self._shards is not None:
            return self._shards.read(chunk)[: stop - start]
        return np.asarray(self._image[start:stop])

    def epoch(
        self, epoch: int, *, with_samples: bool = False, position: EpochPosition | None = None
    ) -> Iterator[tuple]:
        """Iterate over this rank's batches of ``epoch``.

        Parameters
        ----------
        epoch : int
            Epoch number (0-based): with ``seed``, it fixes the chunk order, the mix and the augmentation.
        with_samples : bool
            Also yield the physical row numbers (int64 numpy array) of each batch.
        position : EpochPosition, optional
            Go on from this point of the epoch (a step checkpoint's, made ``resumed`` for this loader's world and
            batch size): serve the batches of the position's last segment from its step on. At the world and batch
            size the position was saved at, these are exactly the batches (images, order, augmentation) an
            uninterrupted epoch serves from that step; see :mod:`dask_dl.data.position` for a changed world size.

        Yields
        ------
        x : torch.Tensor
            float32 ``(B, C, S, S)`` (``C`` the store's channels: 1 grey, 3 RGB, channels first), normalized per
            channel by :func:`dask_dl.normalize.normalize`; with ``augment_on="device"``, the uint8 pixels
            ``(B, C, S, S)``, neither augmented nor normalized.
        y : torch.Tensor
            float32 ``(B, n_labels)``, 0 or 1.
        samples : numpy.ndarray
            Only with ``with_samples=True``.
        parameters : torch.Tensor or None
            Only with ``augment_on="device"``: float64 ``(B, 7)``, each image's augmentation
            (:data:`dask_dl.data.device_augment.COLUMNS`); None without augmentation.

        Raises
        ------
        StoreError
            A chunk could not be read; the message names the chunk and its rows.
        """
        if self._closed:
            raise DatasetError("this ChunkLoader is closed; make a new one")
        self.wait_s = 0.0
        if position is None or position.fresh:
            batches = self._batches(int(epoch))
        else:
            if position.epoch != int(epoch):
                raise DatasetError(f"the position is in epoch {position.epoch}, not {epoch}: pass {position.epoch}")
            batches = self._resumed_batches(position)
        producer = None
        if self._in_flight():
            producer = _Producer(batches, name=f"{_THREAD_PREFIX}-rank{self.rank}-epoch{epoch}")
            self._running.add(producer)
            batches = producer
        try:
            while True:
                t0 = time.perf_counter()
                item = next(batches, None)
                self.wait_s += time.perf_counter() - t0
                if item is None:
                    return
                yield item if with_samples else (*item[:2], *item[3:])
        finally:
            if producer is not None:
                producer.stop()
                self._running.discard(producer)
            else:
                batches.close()

    def close(self) -> None:
        """Stop the background threads of epochs in progress and drop the kept chunks; the loader cannot start new
        epochs afterwards."""
        self._closed = True
        for producer in list(self._running):
            producer.stop()
        self._running.clear()
        self._kept.clear()
        self._kept_bytes = 0

    def __enter__(self) -> ChunkLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------------------------

    def _in_flight(self) -> int:
        """Chunk reads to keep in flight: ``prefetch``, or none (read in the consumer's thread) when the store is
        local files and this process may run on one CPU only: there a thread overlaps nothing, and switching to
        it cost 2-4 % of a small model's step (small_cnn at 64 px, batch 32, one pinned core)."""
        if self.prefetch and self._shards is not None and _one_cpu():
            return 0
        return self.prefetch

    def _read(self, chunk: int) -> np.ndarray:
        """Chunk ``chunk``'s images: kept from an earlier epoch, or read (and kept while ``cache_bytes`` allows)."""
        kept = self._kept.get(chunk)
        if kept is not None:
            return kept
        images = self._read_store(chunk)
        with self._lock:  # reads run on the prefetch pool's threads
            self.reads += 1
            if chunk not in self._kept and self._kept_bytes + images.nbytes <= self.cache_bytes:
                images.flags.writeable = False  # batches are copies (indexed or stacked); nothing may change these
                self._kept[chunk] = images
                self._kept_bytes += images.nbytes
        return images

    def _read_store(self, chunk: int) -> np.ndarray:
        try:
            return self.read_chunk(chunk)
        except Exception as exc:
            start = chunk * self.chunk
            raise StoreError(
                f"reading chunk {chunk} (rows {start}..{start + self.chunk - 1}) of {self.source}/image failed: "
                f"{type(exc).__name__}: {exc}. Check that the store is reachable; if a shard is damaged, delete "
                "it and run dask_dl.ingest(catalog, store) again, which rewrites missing shards"
            ) from exc

    def _reads(
        self, plan: list[tuple[int, np.ndarray]], *, whole: bool = False
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(rows, images)`` per planned chunk, with ``prefetch`` reads in flight (``whole``: all its images)."""
        in_flight = self._in_flight()
        if not in_flight:
            for chunk, rows in plan:
                images = self._read(chunk)
                yield rows, images if whole else images[rows - chunk * self.chunk]
            return
        pool = ThreadPoolExecutor(min(in_flight, 4), thread_name_prefix=f"{_THREAD_PREFIX}-read")
        pending: deque[tuple[int, np.ndarray, Future]] = deque()
        todo = iter(plan)
        try:
            for chunk, rows in todo:
                pending.append((chunk, rows, pool.submit(self._read, chunk)))
                if len(pending) >= in_flight:
                    break
            while pending:
                chunk, rows, future = pending.popleft()
                for nxt, nxt_rows in todo:
                    pending.append((nxt, nxt_rows, pool.submit(self._read, nxt)))
                    break
                images = future.result()
                yield rows, images if whole else images[rows - chunk * self.chunk]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _batches(self, epoch: int) -> Iterator[tuple]:
        mix = np.random.default_rng([self.seed, epoch, _MIX, self.rank])
        augment_rng = np.random.default_rng([self.seed, epoch, _AUGMENT, self.rank])
        carry_x, carry_s = np.empty((0, *self.image_shape), np.uint8), np.empty(0, np.int64)
        window_x: list[np.ndarray] = []
        window_s: list[np.ndarray] = []
        plan = self.plan(epoch)
        for i, (rows, images) in enumerate(self._reads(plan)):
            window_x.append(images)
            window_s.append(rows)
            if len(window_s) < self.window and i + 1 < len(plan):
                continue
            # A window is complete: mix its samples, put the previous window's leftover in front, cut batches.
            x, s = np.concatenate(window_x), np.concatenate(window_s)
            if self.shuffle:
                order = mix.permutation(len(s))
                x, s = x[order], s[order]
            x, s = np.concatenate([carry_x, x]), np.concatenate([carry_s, s])
            n_full = len(s) // self.batch_size * self.batch_size
            for b in range(0, n_full, self.batch_size):
                yield self._finish(x[b : b + self.batch_size], s[b : b + self.batch_size], augment_rng)
            carry_x, carry_s = x[n_full:], s[n_full:]
            window_x, window_s = [], []
        if len(carry_s):  # only with drop_last=False: with drop_last the plan holds whole batches
            yield self._finish(carry_x, carry_s, augment_rng)

    def _resumed_batches(self, position: EpochPosition) -> Iterator[tuple]:
        """The batches of ``position``'s segment from its step on; each chunk read once, kept until its last use."""
        skip, segment = position.step, len(position.segments) - 1
        batches = self._position_batches(position)[skip:]
        tags = [self.seed, position.epoch, _AUGMENT, self.rank] + ([segment] if segment else [])
        augment_rng = np.random.default_rng(tags)
        if self.augmentation is not None:
            for rows in self._position_batches(position)[:skip]:  # the draws of the batches already served
                self.augmentation.skip(len(rows), augment_rng)
        last_use: dict[int, int] = {}
        first_use: list[int] = []
        for i, rows in enumerate(batches):
            for chunk in np.unique(rows // self.chunk).tolist():
                if chunk not in last_use:
                    first_use.append(chunk)
                last_use[chunk] = i
        reads = self._reads([(c, np.arange(c * self.chunk, c * self.chunk + 1)) for c in first_use], whole=True)
        try:
            yield from self._cached_batches(batches, reads, last_use, augment_rng)
        finally:
            reads.close()  # shuts the read pool down, also when the epoch is left early

    def _cached_batches(
        self, batches: list[np.ndarray], reads: Iterator, last_use: dict[int, int], augment_rng: np.random.Generator
    ) -> Iterator[tuple]:
        cache: dict[int, np.ndarray] = {}
        for i, rows in enumerate(batches):
            chunks = rows // self.chunk
            for chunk in np.unique(chunks).tolist():
                while chunk not in cache:
                    got, images = next(reads)
                    cache[int(got[0]) // self.chunk] = images
            images = np.stack([cache[int(c)][int(r) - int(c) * self.chunk] for r, c in zip(rows, chunks, strict=True)])
            for chunk in np.unique(chunks).tolist():
                if last_use[chunk] == i:
                    del cache[chunk]
            yield self._finish(images, rows, augment_rng)

    def _finish(self, images: np.ndarray, rows: np.ndarray, rng: np.random.Generator) -> tuple:
        y = torch.from_numpy(self._label[rows])
        if self.augment_on == "device":  # the trainer's device augments and normalizes: hand over pixels and draws
            drawn = self.augmentation.draw(len(rows), rng) if self.augmentation is not None else None
            parameters = None if drawn is None else torch.from_numpy(drawn)
            x = torch.from_numpy(images)
            x = (x.permute(0, 3, 1, 2) if x.ndim == 4 else x.unsqueeze(1)).contiguous()
            if self.pin_memory:
                x, y = x.pin_memory(), y.pin_memory()
                parameters = None if parameters is None else parameters.pin_memory()
            return x, y, rows, parameters
        if self.augmentation is not None:
            images = self.augmentation.apply(images, rng)
        x = torch.from_numpy(images)
        if x.ndim == 4:  # the store is channel-last like an image file; the models take channels first
            x = x.permute(0, 3, 1, 2)
        x = normalize(x, mean=self.normalization["mean"], std=self.normalization["std"]).contiguous()
        if self.pin_memory:
            x, y = x.pin_memory(), y.pin_memory()
        return x, y, rows


class _Producer:
    """Runs a batch generator on a daemon thread, handing results and errors to the consumer through a queue."""

    def __init__(self, batches: Iterator, *, name: str, maxsize: int = 2) -> None:
        self._batches = batches
        self._queue: queue.Queue = queue.Queue(maxsize)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._batches:
                if not self._put(("batch", item)):
                    return
            self._put(("done", None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put(("error", exc))
        finally:
            self._batches.close()  # shuts the read pool down

    def _put(self, item: tuple) -> bool:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> _Producer:
        return self

    def __next__(self) -> tuple:
        while True:
            # Checked before the queue too: batches made before a close() are not handed out after it.
            if self._stopped.is_set():
                raise DatasetError("the ChunkLoader was closed while this epoch was in progress")
            try:
                kind, value = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        if kind == "batch":
            return value
        if kind == "error":
            raise value
        raise StopIteration

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


# ---- checks -------------------------------------------------------------------------------------------------------


def _one_cpu() -> bool:
    """Whether this process may run on one CPU only (its affinity; not a cgroup quota)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return affinity is not None and len(affinity(0)) == 1


def _non_negative(name: str, value: Any) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
        raise ConfigurationError(f"{name} must be an integer >= 0, got {value!r}; pass e.g. {name}=2")
    return int(value)


def _check_samples(samples: Any, *, n: int, valid: np.ndarray | None, source: str) -> np.ndarray:
    rows = np.asarray(samples)
    if rows.ndim != 1 or not (np.issubdtype(rows.dtype, np.integer) or rows.size == 0):
        raise DatasetError(
            f"samples must be a 1-D array of row numbers, got dtype {rows.dtype} and shape {rows.shape}; "
            "pass e.g. open_dataset(store, split='train').sample.values"
        )
    if rows.size == 0:
        raise DatasetError("samples is empty: there is nothing to load; check the split or site you selected")
    rows = np.sort(rows.astype(np.int64))
    outside = rows[(rows < 0) | (rows >= n)]
    if outside.size:
        raise DatasetError(
            f"sample rows {outside[:5].tolist()} are outside the store {source!r}, which has rows 0..{n - 1}; "
            "use the sample coordinate of open_dataset(store)"
        )
    repeated = rows[1:][rows[1:] == rows[:-1]]
    if repeated.size:
        raise DatasetError(
            f"sample rows {np.unique(repeated)[:5].tolist()} are given more than once; each epoch serves each "
            "sample once: pass np.unique(samples)"
        )
    if valid is not None and not valid[rows].all():
        bad = rows[~valid[rows]]
        raise DatasetError(
            f"sample rows {bad[:5].tolist()} are rejected images of {source!r} (valid is False, the image is empty); "
            "take samples from open_dataset(store), which drops rejected rows"
        )
    return rows
