"""How far a store's sample order is from shuffled, as the loader sees it, and the warning when it is far.

The loader reads whole chunks and mixes the samples of ``window`` chunks into batches (:mod:`dask_dl.data.loader`).
When the store keeps a sorted catalog's order (class folders list every class in a run of its own), each chunk
holds one class and each window a few: the model trains on near single-class batches and learns far worse than
from a full shuffle. :func:`dask_dl.ingest` writes samples in a seeded random permutation (``dask-dl.ingest.order``),
so this only happens with stores written in catalog order.

The measure: the label mix of a window (per label, the share of its samples that have it) against the split's, as
half the sum of absolute differences (the total variation distance for single-label data), averaged over the
windows of one epoch, beside the same measure for the split's samples fully shuffled into windows of the same
sizes. Only labels are read, no image.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from dask_dl import config
from dask_dl.data import store as contract
from dask_dl.data.store import open_store

__all__ = ["LabelMix", "SampleOrderWarning", "label_mix", "warn_if_sorted"]

#: A window's label mix counts as far from the split's when its distance exceeds a full shuffle's by this much.
#: Class-sorted digits in chunks of 32 (windows of 4): 0.60 against 0.13 shuffled; a shuffled store: 0.13 and 0.11.
FAR = 0.2


class SampleOrderWarning(UserWarning):
    """A store's sample order gives the loader batches whose labels are far from a shuffle's mix."""


@dataclass(frozen=True)
class LabelMix:
    """How the windows the loader mixes compare with their split (:func:`label_mix`).

    Attributes
    ----------
    store, split
        Where the samples come from.
    window, chunk
        Chunks mixed per window, samples per chunk.
    distance
        Mean distance of a window's label mix from the split's.
    shuffled
        The same for the split's samples fully shuffled: what a good order reaches.
    split_mix, example_mix
        Label -> share of samples with it, in the split and in the window farthest from it.
    """

    store: str
    split: str
    window: int
    chunk: int
    distance: float
    shuffled: float
    split_mix: dict[str, float]
    example_mix: dict[str, float]

    @property
    def far(self) -> bool:
        """Whether the order is far from shuffled (the loader's batches would hold a few labels each)."""
        return self.distance - self.shuffled > FAR

    def message(self) -> str:
        """What :func:`warn_if_sorted` says: where, the measure, an example window, the fix."""
        return (
            f"the {self.split} samples of the store {self.store!r} are in an order far from shuffled: the windows of "
            f"{self.window} chunks ({self.window * self.chunk} samples) that the loader mixes into batches have a "
            f"label mix {self.distance:.2f} away from the split's on average, where a full shuffle is "
            f"{self.shuffled:.2f} away; e.g. a window holds {_shares(self.example_mix)} where the split holds "
            f"{_shares(self.split_mix)}. A model learns far worse from such batches. The store keeps its catalog's "
            "order (e.g. class folders, one class after another); ingest it again to store the samples shuffled: "
            f"dask_dl.ingest(catalog, {self.store!r}, overwrite=True) (dask-dl.ingest.order: shuffled, the default)"
        )


def _shares(mix: dict[str, float], *, top: int = 4) -> str:
    present = {name: share for name, share in mix.items() if share > 0}
    shown = sorted(present.items(), key=lambda item: -item[1])[:top]
    more = f" and {len(present) - top} more" if len(present) > top else ""
    return ", ".join(f"{name!r} {share:.0%}" for name, share in shown) + more


def _distance(mixes: np.ndarray, split_mix: np.ndarray, sizes: np.ndarray) -> tuple[float, int]:
    per_window = 0.5 * np.abs(mixes - split_mix).sum(axis=1)
    return float(np.average(per_window, weights=sizes)), int(per_window.argmax())


def _window_mixes(labels: np.ndarray, groups: list[np.ndarray], order: np.ndarray, window: int):
    mixes, sizes = [], []
    for start in range(0, len(order), window):
        rows = np.concatenate([groups[i] for i in order[start : start + window]])
        mixes.append(labels[rows].mean(axis=0))
        sizes.append(len(rows))
    return np.array(mixes), np.array(sizes)


def label_mix(store: Any, *, split: str = "train", window: int | None = None, seed: int = 0) -> LabelMix | None:
    """Measure how the label mix of the loader's windows over ``split`` compares with the split's.

    Parameters
    ----------
    store
        A store path or URL, or a dataset from :func:`dask_dl.open_dataset`.
    split
        The split whose samples are served (``"train"``).
    window
        Chunks per window; default ``dask-dl.train.shuffle-window``.
    seed
        Seed of the chunk order of the epoch measured.

    Returns
    -------
    LabelMix or None
        None when the split has no valid sample.
    """
    url, group, layout = open_store(store)
    window = int(config.get("train.shuffle-window", window))
    labels = np.asarray(group[contract.LABEL][:], dtype=np.float64)
    keep = np.asarray(np.asarray(group["split"][:]).tolist(), dtype=str) == split
    if contract.VALID in group:
        keep &= np.asarray(group[contract.VALID][:], dtype=bool)
    samples = np.flatnonzero(keep)
    if not len(samples):
        return None
    _, first = np.unique(samples // layout.chunk, return_index=True)
    groups = np.split(samples, first[1:])
    rng = np.random.default_rng([seed, len(samples)])
    split_mix = labels[samples].mean(axis=0)
    mixes, sizes = _window_mixes(labels, groups, rng.permutation(len(groups)), window)
    distance, worst = _distance(mixes, split_mix, sizes)
    # the same windows filled from a full shuffle of the split: a distance the best order reaches too
    shuffled_groups = np.split(rng.permutation(samples), np.cumsum([len(g) for g in groups])[:-1])
    shuffled_mixes, _ = _window_mixes(labels, shuffled_groups, np.arange(len(groups)), window)
    shuffled, _ = _distance(shuffled_mixes, split_mix, sizes)
    names = list(layout.labels)
    return LabelMix(
        store=url,
        split=split,
        window=window,
        chunk=layout.chunk,
        distance=distance,
        shuffled=shuffled,
        split_mix=dict(zip(names, split_mix.round(4).tolist(), strict=True)),
        example_mix=dict(zip(names, mixes[worst].round(4).tolist(), strict=True)),
    )


def warn_if_sorted(store: Any, *, split: str = "train", stacklevel: int = 2) -> LabelMix | None:
    """Warn (:class:`SampleOrderWarning`) when the loader's windows over ``split`` mix labels far from a shuffle.

    Returns what :func:`label_mix` measured.
    """
    mix = label_mix(store, split=split)
    if mix is not None and mix.far:
        warnings.warn(mix.message(), SampleOrderWarning, stacklevel=stacklevel + 1)
    return mix
