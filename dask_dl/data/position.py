"""Where a training epoch stands: the loader position a step checkpoint stores, so a resumed epoch neither repeats
nor skips a sample.

An epoch is cut into *segments*: the ranks of one world size take batches of one size for a number of steps. A
fresh epoch is one segment, whose rank ``r`` serves the rows of
:meth:`~dask_dl.data.loader.ChunkLoader.order` (the seeded chunk order and window mix of ``(seed, epoch, r)``).
When training resumes at the world size and batch size of the last segment, that segment simply goes on at its
step: every rank serves exactly the batches it would have served, which is what makes a resumed run bit-identical
to an uninterrupted one. When the world size (or batch size) changed, a new segment starts: the rows the last
segment's ranks had not served yet (in rank order, then batch order) are cut into one contiguous piece per new
rank, and each piece into the same number of batches on every rank (``ceil(shortest piece / batch_size)``), so
every remaining sample is served exactly once and every rank takes the same number of steps; batches then hold
``batch_size`` images, or one more or fewer. The rows a full epoch drops to fill whole batches
(``drop_last``) are not part of the epoch, before or after a restart.

Everything here is pure: it reads no store and needs only the per-rank row orders of the epoch's first segment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dask_dl.errors import CheckpointError

__all__ = ["EpochPosition", "Segment"]


@dataclass(frozen=True)
class Segment:
    """A part of an epoch: ``world_size`` ranks took ``steps`` batches of (about) ``batch_size`` rows each."""

    world_size: int
    batch_size: int
    steps: int

    def to_dict(self) -> dict[str, int]:
        return {"world_size": int(self.world_size), "batch_size": int(self.batch_size), "steps": int(self.steps)}


@dataclass(frozen=True)
class EpochPosition:
    """How far epoch ``epoch`` of a run seeded ``seed`` got: its segments, the last one in progress.

    Parameters
    ----------
    epoch : int
        The epoch (0-based).
    seed : int
        The loader's seed (with ``epoch`` it fixes the first segment's row orders).
    segments : tuple of Segment
        The parts of the epoch so far; the last one's ``steps`` are the steps done in it.
    """

    epoch: int
    seed: int
    segments: tuple[Segment, ...]

    @classmethod
    def start(cls, epoch: int, *, seed: int, world_size: int, batch_size: int) -> EpochPosition:
        """The position at the start of a fresh epoch."""
        return cls(int(epoch), int(seed), (Segment(int(world_size), int(batch_size), 0),))

    @property
    def step(self) -> int:
        """Steps done in the current (last) segment."""
        return self.segments[-1].steps

    @property
    def fresh(self) -> bool:
        """True at the very start of an epoch (nothing served yet)."""
        return len(self.segments) == 1 and self.segments[0].steps == 0

    def advanced(self, steps: int = 1) -> EpochPosition:
        """The position ``steps`` steps later in the current segment."""
        last = self.segments[-1]
        moved = Segment(last.world_size, last.batch_size, last.steps + int(steps))
        return EpochPosition(self.epoch, self.seed, (*self.segments[:-1], moved))

    def resumed(self, *, world_size: int, batch_size: int) -> EpochPosition:
        """The position to go on from with ``world_size`` ranks of ``batch_size``: same segment, or a new one."""
        world_size, batch_size = int(world_size), int(batch_size)
        if self.fresh:
            return EpochPosition.start(self.epoch, seed=self.seed, world_size=world_size, batch_size=batch_size)
        last = self.segments[-1]
        if (world_size, batch_size) == (last.world_size, last.batch_size):
            return self
        kept = self.segments if last.steps else self.segments[:-1]  # a segment that took no step leaves no trace
        return EpochPosition(self.epoch, self.seed, (*kept, Segment(world_size, batch_size, 0)))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint (``torch.load(weights_only=True)`` reads it)."""
        return {"epoch": int(self.epoch), "seed": int(self.seed), "segments": [s.to_dict() for s in self.segments]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpochPosition:
        """Read what :meth:`to_dict` wrote.

        Raises
        ------
        CheckpointError
            When ``data`` is not a position (missing keys, no segments, counts below zero).
        """
        try:
            segments = tuple(
                Segment(int(s["world_size"]), int(s["batch_size"]), int(s["steps"])) for s in data["segments"]
            )
            position = cls(int(data["epoch"]), int(data["seed"]), segments)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"the checkpoint's loader position {data!r} is malformed ({exc}); it was not "
                "written by dask_dl.fit: resume from an epoch checkpoint"
            ) from None
        if not segments or any(s.world_size < 1 or s.batch_size < 1 or s.steps < 0 for s in segments):
            raise CheckpointError(f"the checkpoint's loader position {data!r} has no or impossible segments")
        return position

    # ---- the rows of each segment -----------------------------------------------------------------------------

    def batches(self, first_orders: Callable[[int, int, int], np.ndarray]) -> list[list[np.ndarray]]:
        """Every rank's batches (row arrays) of the current segment, from its first step.

        Parameters
        ----------
        first_orders
            ``first_orders(rank, world_size, batch_size)``: the rows rank ``rank`` serves in a fresh epoch
            (:meth:`~dask_dl.data.loader.ChunkLoader.order` for this epoch).
        """
        first = self.segments[0]
        per_rank = [
            _cut(first_orders(r, first.world_size, first.batch_size), first.batch_size) for r in range(first.world_size)
        ]
        for done, nxt in zip(self.segments[:-1], self.segments[1:], strict=True):
            per_rank = _reshard(_rest(per_rank, done.steps), nxt.world_size, nxt.batch_size)
        return per_rank

    def served(self, first_orders: Callable[[int, int, int], np.ndarray]) -> np.ndarray:
        """The rows served so far in this epoch by all ranks of all segments (each once)."""
        first = self.segments[0]
        per_rank = [
            _cut(first_orders(r, first.world_size, first.batch_size), first.batch_size) for r in range(first.world_size)
        ]
        parts = []
        for i, segment in enumerate(self.segments):
            parts += [b for batches in per_rank for b in batches[: segment.steps]]
            if i + 1 < len(self.segments):
                nxt = self.segments[i + 1]
                per_rank = _reshard(_rest(per_rank, segment.steps), nxt.world_size, nxt.batch_size)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _cut(rows: np.ndarray, batch_size: int) -> list[np.ndarray]:
    return [rows[i : i + batch_size] for i in range(0, len(rows) - batch_size + 1, batch_size)]


def _rest(per_rank: Sequence[list[np.ndarray]], steps: int) -> np.ndarray:
    parts = [b for batches in per_rank for b in batches[steps:]]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _reshard(rest: np.ndarray, world_size: int, batch_size: int) -> list[list[np.ndarray]]:
    pieces = np.array_split(rest, world_size)
    shortest = min(len(p) for p in pieces)
    if shortest == 0:  # fewer rows left than ranks: not one step for every rank; nothing more of this epoch
        return [[] for _ in pieces]
    steps = math.ceil(shortest / batch_size)
    return [list(np.array_split(p, steps)) for p in pieces]
