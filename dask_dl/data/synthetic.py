"""Synthetic chest X-ray collections written in the NIH ChestX-ray14 on-disk layout (for the demo and the tests).

:func:`synthesize` writes ``images/<patient>_<follow-up>.png``, ``Data_Entry_2017.csv`` (the 2017 original form,
trailing comma included), ``train_val_list.txt`` and ``test_list.txt``, so every NIH reader can be exercised
without downloading 45 GB. The images are drawn, not sampled from real ones: a chest-like background (lungs,
mediastinum, spine, heart, ribs, clavicles, soft tissue, exposure and noise) with one visual signature per NIH
finding, at a strength that varies per image, so a model can learn the labels but not trivially.

Labels follow NIH's own statistics: combinations are drawn from :func:`_nih_combinations` (the real table's
most frequent label combinations), raked so that each label keeps its real frequency, or taken straight from a
real table (``label_source=``). Everything is a function of ``seed``: images are drawn in blocks of
:data:`_BLOCK` rows, each block from its own ``numpy.random.SeedSequence(seed, spawn_key=(1, block))``, so the
files are byte-identical whether the blocks run in this process or as tasks on a Dask cluster.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import io
import os
import string
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from PIL import Image

from dask_dl.checks import positive_int
from dask_dl.data.labels import NO_FINDING
from dask_dl.data.nih import NIH_HEADER
from dask_dl.data.radiograph import draw_with_boxes
from dask_dl.data.schema import METADATA_COLUMNS, NIH_LABELS, REQUIRED_COLUMNS
from dask_dl.data.store import write_whole
from dask_dl.data.swatches import make_collection
from dask_dl.errors import CatalogError, ConfigurationError, StoreNotFoundError
from dask_dl.interrupt import Interrupted

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["make_collection", "synthesize"]

_BLOCK = 64  # images per task; fixed, so that seeds (and files) do not depend on how the work is spread
_CORRUPT_KINDS = ("truncated", "empty", "garbage")


#: Share of the real NIH images carrying each label, in the order of NIH_LABELS (all 112,120 rows).
_NIH_FREQUENCIES = (
    0.10309,
    0.02476,
    0.11877,
    0.17743,
    0.05157,
    0.05647,
    0.01276,
    0.04729,
    0.04163,
    0.02054,
    0.02244,
    0.01504,
    0.03019,
    0.00202,
)
_NIH_NO_FINDING = 0.53836  # share of real NIH images with No Finding
#: Real NIH patients with 1, 2, ..., 30 images; the 1.6% of images belonging to patients with more are left
#: out so that a small synthetic collection is not one patient's.
_IMAGES_PER_PATIENT = (
    17503,
    4113,
    2100,
    1330,
    938,
    787,
    608,
    494,
    387,
    320,
    281,
    235,
    165,
    181,
    121,
    120,
    91,
    77,
    77,
    74,
    68,
    39,
    50,
    51,
    45,
    35,
    38,
    27,
    25,
    28,
)
#: Real NIH images per 5-year age bin: 0-4, 5-9, ..., 95-99.
_AGE_HISTOGRAM = (
    341,
    1197,
    2005,
    3503,
    6155,
    6700,
    8668,
    7870,
    9943,
    11959,
    13205,
    14136,
    10891,
    8074,
    4325,
    2129,
    713,
    242,
    63,
    1,
)
#: The most common original detector formats: (width, height, pixel spacing in mm, share); a width of 0 means
#: "2500-3000 pixels each way", as the many 0.143 mm images of the real table are.
_ORIGINAL_FORMATS = (
    (2500, 2048, 0.168, 0.33),
    (2992, 2991, 0.143, 0.20),
    (3056, 2544, 0.139, 0.14),
    (0, 0, 0.143, 0.16),
    (2500, 2048, 0.171, 0.09),
    (2048, 2500, 0.168, 0.08),
)
_FOLLOW_UP_KEEP = 0.4  # chance that a follow-up image keeps the previous image's findings (patients stay ill)
_TEST_FRACTION = 0.2  # share of patients in test_list.txt, as in NIH


# ---- labels ------------------------------------------------------------------------------------------------


@functools.cache
def _nih_combinations() -> dict[str, int]:
    """The 150 most frequent label combinations of the real NIH table (Data_Entry_2017_v2020.csv, 112,120 rows)
    and their image counts, labels in NIH order (``nih_combinations.csv`` beside this module).

    They cover 109,706 rows (97.8%); the rest are rarer combinations that would leave the rarest labels (Hernia,
    Pneumonia) under-represented, which :func:`_combination_table` corrects by raking the weights to the real
    label and No Finding shares.
    """
    with importlib.resources.files(__package__).joinpath("nih_combinations.csv").open(encoding="utf-8") as f:
        table = pd.read_csv(f, dtype={"finding_labels": str, "images": np.int64})
    return dict(zip(table["finding_labels"], table["images"].tolist(), strict=True))


@functools.cache
def _combination_table() -> tuple[np.ndarray, np.ndarray]:
    """The embedded combinations as a ``(k, 14)`` bool matrix and their probabilities ``(k,)``.

    Iterative proportional fitting (one label at a time, scaling the combinations with and without it) moves
    the truncated table's label frequencies to the real ones while keeping which labels occur together.
    """
    combinations = _nih_combinations()
    masks = np.array([[name in combo.split("|") for name in NIH_LABELS] for combo in combinations])
    p = np.array(list(combinations.values()), dtype=np.float64)
    p /= p.sum()
    margins = np.column_stack([masks, ~masks.any(axis=1)])  # the 14 labels and No Finding
    target = np.array([*_NIH_FREQUENCIES, _NIH_NO_FINDING])
    for _ in range(100):
        for j, t in enumerate(target):
            has = margins[:, j]
            f = p[has].sum()
            p[has] *= t / f
            p[~has] *= (1 - t) / (1 - f)
    return masks, p / p.sum()


def _site_label_weights(log_weights: np.ndarray | None) -> np.ndarray:
    """Probabilities of the combinations at a site whose label ``j`` is ``exp(log_weights[j])`` times as likely."""
    masks, p = _combination_table()
    if log_weights is None:
        return p
    w = p * np.exp(masks @ log_weights[:-1] + (~masks.any(axis=1)) * log_weights[-1])
    return w / w.sum()


def _sample_labels(rng: np.random.Generator, n: int, *, probabilities: np.ndarray | None = None) -> np.ndarray:
    """Draw ``n`` independent label rows ``(n, 14) uint8`` from the NIH combination table."""
    masks, p = _combination_table()
    if probabilities is not None:
        p = probabilities
    return masks[rng.choice(len(p), size=n, p=p)].astype(np.uint8)


def _finding_labels(labels: np.ndarray) -> list[str]:
    """``Finding Labels`` strings: the names of a row's labels in NIH order joined by ``|``, or ``No Finding``."""
    names = np.array(NIH_LABELS)
    return ["|".join(names[row.astype(bool)]) or NO_FINDING for row in labels]


def _read_label_source(path: str | os.PathLike) -> pd.DataFrame:
    """Read a real NIH table (2017 or v2020 form, ``.csv`` or ``.csv.gz``) into one row per image, by patient."""
    if not os.path.exists(path):
        raise StoreNotFoundError(f"label_source {os.fspath(path)!r} does not exist; pass the path of an NIH table")
    # index_col=False: the 2017 file ends each data line with one comma more than its header has
    table = pd.read_csv(path, index_col=False)
    needed = ["Finding Labels", "Follow-up #", "Patient ID", "Patient Age", "Patient Gender", "View Position"]
    missing = [c for c in needed if c not in table.columns]
    if missing or len(table.columns) < 11:
        raise CatalogError(
            f"label_source {os.fspath(path)!r} is not an NIH Data_Entry table: it lacks {missing or 'the size'} "
            f"columns (it has {list(table.columns)[:12]}); pass Data_Entry_2017.csv or Data_Entry_2017_v2020.csv"
        )
    dummies = table["Finding Labels"].astype(str).str.get_dummies(sep="|")
    unknown = sorted(set(dummies.columns) - set(NIH_LABELS) - {NO_FINDING})
    if unknown:
        raise CatalogError(
            f"label_source {os.fspath(path)!r} has unknown finding(s) {unknown}; the NIH findings are "
            f"{', '.join(NIH_LABELS)} and {NO_FINDING!r}"
        )
    age = pd.to_numeric(table["Patient Age"].astype(str).str.extract(r"(\d+)")[0], errors="coerce")
    size = table.iloc[:, 7:11].to_numpy()
    out = pd.DataFrame(
        {
            "source_patient": table["Patient ID"].to_numpy(),
            "follow_up": table["Follow-up #"].astype(int).to_numpy(),
            "age": age.fillna(age.median()).clip(0, 100).astype(int).to_numpy(),
            "sex": table["Patient Gender"].astype(str).to_numpy(),
            "view": table["View Position"].astype(str).to_numpy(),
            "orig_width": size[:, 0].astype(int),
            "orig_height": size[:, 1].astype(int),
            "spacing_x": size[:, 2].astype(float),
            "spacing_y": size[:, 3].astype(float),
        }
    )
    for name in NIH_LABELS:
        out[name] = dummies[name].to_numpy(np.uint8) if name in dummies else np.uint8(0)
    return out.sort_values(["source_patient", "follow_up"], kind="stable").reset_index(drop=True)


# ---- the table -------------------------------------------------------------------------------------------


def _site_names(sites: int | Sequence[str] | None) -> list[str] | None:
    if sites is None:
        return None
    if isinstance(sites, int | np.integer) and not isinstance(sites, bool):
        if not 1 <= sites <= 26:
            raise ConfigurationError(f"sites={sites} is not between 1 and 26; pass a count or a list of names")
        return [f"site-{c}" for c in string.ascii_uppercase[:sites]]
    if isinstance(sites, str):
        sites = sites.split(",")
    names = [str(s).strip() for s in sites]
    bad = [s for s in names if not s or os.sep in s or s in (".", "..", "images")]
    if bad or len(set(names)) != len(names) or not names:
        raise ConfigurationError(
            f"sites={list(sites)!r} must be distinct, non-empty directory names (not 'images'); "
            "e.g. sites=['A', 'B', 'C'] or sites=3"
        )
    return names


def _site_profile(seed: int, index: int | None) -> dict:
    """Label mix (log weights of the 14 labels and of No Finding) and exposure of a site; neutral without sites."""
    if index is None:
        return {"log_weights": None, "gain": 1.0, "gamma": 1.0, "noise": 1.0}
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(2, index)))
    return {
        "log_weights": np.append(rng.normal(0.0, 0.8, len(NIH_LABELS)), rng.normal(0.0, 0.3)),
        "gain": rng.uniform(0.85, 1.12),
        "gamma": rng.uniform(0.85, 1.2),
        "noise": rng.uniform(0.5, 2.0),
    }


def _spread(total: int, parts: int) -> list[int]:
    return [total // parts + (j < total % parts) for j in range(parts)]


def _invent_patients(rng: np.random.Generator, n: int, n_patients: int | None, profile: dict) -> pd.DataFrame:
    """``n`` images of invented patients with NIH-like follow-up counts, ages, sexes, views and formats."""
    pmf = np.array(_IMAGES_PER_PATIENT, dtype=np.float64)
    pmf /= pmf.sum()
    if n_patients is None:
        counts = np.empty(0, dtype=np.int64)
        while counts.sum() < n:
            counts = np.append(counts, rng.choice(len(pmf), size=n // 3 + 1, p=pmf) + 1)
        counts = counts[: np.searchsorted(np.cumsum(counts), n) + 1]
        counts[-1] -= counts.sum() - n
    else:
        draws = rng.choice(len(pmf), size=n_patients, p=pmf).astype(np.float64)
        counts = 1 + rng.multinomial(n - n_patients, draws / draws.sum())
    n_pat = len(counts)
    patient = np.repeat(np.arange(n_pat), counts)
    follow_up = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
    fresh = _sample_labels(rng, n, probabilities=_site_label_weights(profile["log_weights"]))
    keep = (follow_up > 0) & (rng.random(n) < _FOLLOW_UP_KEEP)
    labels = fresh[np.maximum.accumulate(np.where(keep, 0, np.arange(n)))]
    ages = np.array(_AGE_HISTOGRAM, dtype=np.float64)
    base_age = rng.choice(len(ages), size=n_pat, p=ages / ages.sum()) * 5 + rng.integers(0, 5, n_pat)
    ageing = rng.uniform(0.0, 0.5, n_pat)  # years per follow-up
    age = np.minimum(base_age[patient] + np.floor(follow_up * ageing[patient]), 99).astype(int)
    sex = np.where(rng.random(n_pat) < 0.565, "M", "F")[patient]
    p_ap = rng.beta(0.8, 1.2, n_pat)  # inpatients are mostly imaged AP, outpatients PA; 40% AP overall
    view = np.where(rng.random(n) < p_ap[patient], "AP", "PA")
    fmt = np.array(_ORIGINAL_FORMATS)
    kind = rng.choice(len(fmt), size=n, p=fmt[:, 3] / fmt[:, 3].sum())
    free = rng.integers(2500, 3001, size=(n, 2))
    width = np.where(fmt[kind, 0] > 0, fmt[kind, 0], free[:, 0]).astype(int)
    height = np.where(fmt[kind, 1] > 0, fmt[kind, 1], free[:, 1]).astype(int)
    frame = pd.DataFrame(
        {
            "patient": patient,
            "follow_up": follow_up,
            "age": age,
            "sex": sex,
            "view": view,
            "orig_width": width,
            "orig_height": height,
            "spacing_x": fmt[kind, 2],
            "spacing_y": fmt[kind, 2],
        }
    )
    frame[list(NIH_LABELS)] = labels
    return frame


def _take_patients(rng: np.random.Generator, source: pd.DataFrame, n: int, profile: dict, used: np.ndarray):
    """``n`` images of real patients of ``source`` (whole patients, the last one cut), weighted by the site's mix."""
    codes, first = np.unique(source["source_patient"].to_numpy(), return_index=True)
    counts = np.diff(np.append(first, len(source)))
    score = np.ones(len(source))
    if profile["log_weights"] is not None:
        labels = source[list(NIH_LABELS)].to_numpy()
        lw = profile["log_weights"]
        score = np.exp(labels @ lw[:-1] + (labels.sum(axis=1) == 0) * lw[-1])
    weight = np.add.reduceat(score, first) / counts
    # weighted sampling without replacement: sort by log-weight plus Gumbel noise
    key = np.where(used, -np.inf, np.log(weight) + rng.gumbel(size=len(codes)))
    order = np.argsort(-key, kind="stable")
    order = order[~used[order]]
    if counts[order].sum() < n:
        raise ConfigurationError(
            f"the label_source has {int(counts[order].sum())} images left for this site but {n} were asked; "
            "ask for fewer images"
        )
    chosen = order[: np.searchsorted(np.cumsum(counts[order]), n) + 1]
    used[chosen] = True
    rows = np.concatenate([np.arange(first[p], first[p] + counts[p]) for p in chosen])[:n]
    frame = source.iloc[rows].drop(columns="source_patient").reset_index(drop=True)
    frame.insert(0, "patient", np.repeat(np.arange(len(chosen)), counts[chosen])[:n])
    frame["follow_up"] = frame.groupby("patient").cumcount()  # renumbered: a cut patient has no gaps
    return frame


def _plan(
    root: str,
    n_images: int,
    *,
    seed: int,
    n_patients: int | None,
    label_source: str | os.PathLike | None,
    sites: list[str] | None,
    rgba_fraction: float,
    corrupt_fraction: float,
) -> pd.DataFrame:
    """The whole table, every decision but the pixels: patients, labels, splits, files, RGBA and corrupt rows."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
    source = _read_label_source(label_source) if label_source is not None else None
    used = np.zeros(source["source_patient"].nunique() if source is not None else 0, dtype=bool)
    names = sites or [None]
    images = _spread(n_images, len(names))
    patients = _spread(n_patients, len(names)) if n_patients is not None else [None] * len(names)
    frames, next_patient = [], 1
    for index, name in enumerate(names):
        profile = _site_profile(seed, None if sites is None else index)
        if source is None:
            frame = _invent_patients(rng, images[index], patients[index], profile)
        else:
            frame = _take_patients(rng, source, images[index], profile, used)
        n_pat = int(frame["patient"].max()) + 1
        test = np.zeros(n_pat, dtype=bool)
        n_test = max(1, round(_TEST_FRACTION * n_pat)) if n_pat > 1 else 0
        test[rng.permutation(n_pat)[:n_test]] = True
        frame["split"] = np.where(test[frame["patient"]], "test", "train_val")
        frame["patient"] += next_patient
        next_patient += n_pat
        site_root = root if name is None else os.path.join(root, name)
        frame["site"] = "" if name is None else name
        frame["site_root"] = site_root
        for key in ("gain", "gamma", "noise"):
            frame[key] = profile[key]
        frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    if next_patient > 10**8:  # pragma: no cover - 100 million patients
        raise ConfigurationError("more than 99,999,999 patients do not fit NIH's 8-digit patient ids")
    table["image_id"] = [f"{p:08d}_{f:03d}.png" for p, f in zip(table["patient"], table["follow_up"], strict=True)]
    table["path"] = [os.path.join(r, "images", i) for r, i in zip(table["site_root"], table["image_id"], strict=True)]
    n = len(table)
    order = rng.permutation(n)
    n_corrupt = round(corrupt_fraction * n)
    n_rgba = min(round(rgba_fraction * n), n - n_corrupt)
    kind = np.full(n, "", dtype=object)
    kind[order[:n_corrupt]] = rng.choice(_CORRUPT_KINDS, size=n_corrupt)
    rgba = np.zeros(n, dtype=bool)
    rgba[order[n_corrupt : n_corrupt + n_rgba]] = True
    table["rgba"] = rgba
    table["corrupt"] = kind != ""
    table["corrupt_kind"] = kind.astype(str)
    table["finding_labels"] = _finding_labels(table[list(NIH_LABELS)].to_numpy())
    return table


_TABLES = ("Data_Entry_2017.csv", "train_val_list.txt", "test_list.txt", "BBox_List_2017.csv")


def _clear_tables(table: pd.DataFrame) -> None:
    """Make every site root's image folder and delete its tables, which an earlier synthesis may have left.

    The tables are written last, once every image is: a synthesis stopped on the way (Ctrl-C, a lost worker)
    leaves a root without ``Data_Entry_2017.csv``, which no reader takes for a collection, instead of a table that
    lists images not written (or written by the earlier synthesis).
    """
    for site_root in table["site_root"].unique():
        os.makedirs(os.path.join(site_root, "images"), exist_ok=True)
        for name in _TABLES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(site_root, name))


def _write_tables(table: pd.DataFrame) -> None:
    """Write the two split lists, then ``Data_Entry_2017.csv``, of every site root (after its images)."""
    for site_root, frame in table.groupby("site_root", sort=False):
        for split, fn in (("train_val", "train_val_list.txt"), ("test", "test_list.txt")):
            ids = sorted(frame.loc[frame["split"] == split, "image_id"])
            with open(os.path.join(site_root, fn), "w", newline="") as f:
                f.write("".join(i + "\n" for i in ids))
        lines = [NIH_HEADER]
        for row in frame.itertuples(index=False):
            lines.append(
                f"{row.image_id},{row.finding_labels},{row.follow_up},{row.patient},{row.age},{row.sex},"
                f"{row.view},{row.orig_width},{row.orig_height},{row.spacing_x:g},{row.spacing_y:g},"
            )
        write_whole(os.path.join(site_root, "Data_Entry_2017.csv"), ("\n".join(lines) + "\n").encode())


_BLOCK_COLUMNS = ("path", "view", "gain", "gamma", "noise", "rgba", "corrupt_kind", *NIH_LABELS)


def _write_block(rows: pd.DataFrame, *, size: int, seed: int, block: int) -> tuple[int, list[tuple]]:
    """Draw and write the PNGs of one block of rows; every image's randomness comes from ``(seed, block, i)``.

    Returns the number of images and the boxes of their findings, ``(path, finding, x, y, w, h)`` rows (none for
    corrupt files: there is nothing to point at).
    """
    labels = rows[list(NIH_LABELS)].to_numpy().astype(bool)
    boxes = []
    for i, row in enumerate(rows.itertuples(index=False)):
        key = (1, block, i)
        pixels, found = draw_with_boxes(
            size, labels[i], seed=seed, key=key, view=row.view, gain=row.gain, gamma=row.gamma, noise=row.noise
        )
        _save_png(row.path, pixels, rgba=row.rgba, corrupt=row.corrupt_kind, seed=seed, key=key)
        if not row.corrupt_kind:
            boxes.extend((row.path, *box) for box in found)
    return len(rows), boxes


#: Header of NIH's ``BBox_List_2017.csv``; its data lines have the six values only.
NIH_BOX_HEADER = "Image Index,Finding Label,Bbox [x,y,w,h],,,"


def _write_boxes(table: pd.DataFrame, boxes: list[tuple]) -> None:
    """Write ``BBox_List_2017.csv`` of every site root: NIH's form, coordinates in pixels of the written images."""
    by_path = {}
    for path, finding, x, y, w, h in boxes:
        by_path.setdefault(path, []).append((finding, x, y, w, h))
    for site_root, frame in table.groupby("site_root", sort=False):
        lines = [NIH_BOX_HEADER]
        for image_id, path in zip(frame["image_id"], frame["path"], strict=True):
            for finding, x, y, w, h in by_path.get(path, ()):
                name = "Infiltrate" if finding == "Infiltration" else finding  # as NIH spells it in this table
                lines.append(f"{image_id},{name},{x:g},{y:g},{w:g},{h:g}")
        with open(os.path.join(site_root, "BBox_List_2017.csv"), "w", newline="") as f:
            f.write("\n".join(lines) + "\n")


def _save_png(path: str, pixels: np.ndarray, *, rgba: bool, corrupt: str, seed: int, key: tuple) -> None:
    if rgba:  # NIH's RGBA files are gray images with an opaque alpha channel
        image = Image.fromarray(np.dstack([pixels, pixels, pixels, np.full_like(pixels, 255)]))
    else:
        image = Image.fromarray(pixels)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)  # noise compresses badly anyway; level 1 is 3x faster
    data = buffer.getvalue()
    if corrupt == "truncated":  # the header survives, so it opens but fails to decode
        data = data[: len(data) // 2]
    elif corrupt == "empty":
        data = b""
    elif corrupt == "garbage":
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(*key, 99)))
        data = b"garbage\x00" + rng.bytes(int(rng.integers(100, 2000)))
    write_whole(path, data)


def synthesize(
    root: str | os.PathLike,
    *,
    n_images: int = 1000,
    size: int = 256,
    seed: int = 0,
    n_patients: int | None = None,
    label_source: str | os.PathLike | None = None,
    sites: int | Sequence[str] | None = None,
    rgba_fraction: float = 0.0,
    corrupt_fraction: float = 0.0,
    client: Client | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Write a synthetic chest X-ray collection in the NIH ChestX-ray14 on-disk layout.

    ``root/images/<8-digit patient>_<3-digit follow-up>.png`` (8-bit grayscale, ``size`` x ``size``),
    ``root/Data_Entry_2017.csv`` in the published 2017 form (its header, and one trailing comma on every data
    line), ``root/train_val_list.txt`` and ``root/test_list.txt`` (about 20% of the patients in test), and
    ``root/BBox_List_2017.csv`` in NIH's form with the box of every drawn finding NIH boxes (Atelectasis,
    Cardiomegaly, Effusion, Infiltrate, Mass, Nodule, Pneumonia, Pneumothorax; coordinates in pixels of the
    written ``size`` x ``size`` images: read it with ``read_boxes(path, image_size=size)``). With
    ``sites`` each site is a complete NIH root of its own, ``root/<site>/...``. The same arguments write
    byte-identical files, with or without a Dask ``client``.

    Parameters
    ----------
    root
        Directory to write into (created if needed; files already there are overwritten). The tables are
        written last, after every image: a synthesis stopped on the way leaves no ``Data_Entry_2017.csv``.
    n_images
        Number of images, over all sites together.
    size
        Side of the square images in pixels, at least 64.
    seed
        Seed of everything: patients, labels, splits and pixels.
    n_patients
        Number of patients; default: as many as NIH-like follow-up counts give (about 2.9 images each).
    label_source
        A real NIH table (``Data_Entry_2017.csv`` or ``_v2020.csv``, may be gzipped) whose patients are taken
        whole: their labels, ages, sexes, views, image formats and follow-up counts (patient ids renumbered).
        Default: label combinations drawn from the real table's frequencies, embedded in this module.
    sites
        A number of sites (named ``site-A``, ``site-B``, ...) or a list of site names. Patients belong to one
        site; each site has its own label mix and exposure (gain, contrast, noise).
    rgba_fraction
        Share of the images saved as RGBA PNGs, as some NIH images are.
    corrupt_fraction
        Share of the images written corrupt (truncated PNG, empty file or garbage bytes) but listed as usual.
    client
        Dask client to draw the images on, one task per block of 64 images (the workers must see ``root``).
        Default: draw them in this process.
    progress
        Show a progress bar.

    Returns
    -------
    pandas.DataFrame
        One row per image, in table order: ``image_id``, ``path``, ``patient_id`` (8 digits), ``site`` (``""`` without
        sites), ``split`` (``train_val`` or ``test``, as the list files say), ``follow_up``, ``age``, ``sex``,
        ``view``, ``orig_width``, ``orig_height``, ``spacing_x``, ``spacing_y``, ``finding_labels``, one uint8
        column per NIH label, ``rgba``, ``corrupt`` and ``corrupt_kind``.

    Raises
    ------
    ConfigurationError
        For a size under 64, a share outside [0, 1], fewer images than sites or patients, bad site names.
    StoreNotFoundError, CatalogError
        When ``label_source`` does not exist or is not an NIH table.

    Examples
    --------
    >>> import tempfile
    >>> table = synthesize(tempfile.mkdtemp(), n_images=8, size=64, seed=1)
    >>> len(table), table["image_id"].iloc[0]
    (8, '00000001_000.png')
    """
    from dask_dl.cluster.storage import absolute, is_url

    _check_options(n_images, size, n_patients, rgba_fraction, corrupt_fraction)
    if is_url(root):
        raise ConfigurationError(
            f"synthesize writes a folder of files, not to {os.fspath(root)!r}: write it to a local or shared "
            "folder, then copy it up (e.g. fsspec.filesystem('s3').put('raw', 'bucket/raw', recursive=True)); "
            "ingest and read_catalog read collections on object storage"
        )
    root = absolute(root)
    names = _site_names(sites)
    n_sites = len(names or [None])
    if n_images < n_sites or (n_patients is not None and n_patients < n_sites):
        raise ConfigurationError(
            f"n_images={n_images} and n_patients={n_patients} cannot fill {n_sites} sites: every site needs "
            f"an image and a patient; ask for at least {n_sites} of each or for fewer sites"
        )
    table = _plan(
        root,
        n_images,
        seed=seed,
        n_patients=n_patients,
        label_source=label_source,
        sites=names,
        rgba_fraction=rgba_fraction,
        corrupt_fraction=corrupt_fraction,
    )
    _clear_tables(table)  # a table says its collection is complete: there is none until every image is written
    blocks = [table.iloc[start : start + _BLOCK][list(_BLOCK_COLUMNS)] for start in range(0, len(table), _BLOCK)]
    try:
        boxes = _run_blocks(blocks, size=size, seed=seed, client=client, progress=progress)
    except KeyboardInterrupt:
        raise Interrupted(
            f"synthesis into {root!r} stopped by Ctrl-C before its tables were written (they come last, so the "
            "images written so far are no collection); run the same synthesis again to write it"
        ) from None
    _write_boxes(table, boxes)
    _write_tables(table)
    return _result(table)


def _check_options(n_images, size, n_patients, rgba_fraction, corrupt_fraction) -> None:
    positive_int("n_images", n_images, example=1000)
    if positive_int("size", size, example=256) < 64:
        raise ConfigurationError(f"size={size!r} is too small: images are at least 64 pixels wide, e.g. size=256")
    if n_patients is not None and not 1 <= n_patients <= n_images:
        raise ConfigurationError(
            f"n_patients={n_patients!r} must be between 1 and n_images={n_images}; every patient has an image"
        )
    for name, value in (("rgba_fraction", rgba_fraction), ("corrupt_fraction", corrupt_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ConfigurationError(f"{name}={value!r} is a share of the images: pass a value in [0, 1]")


def _run_blocks(blocks: list[pd.DataFrame], *, size: int, seed: int, client, progress: bool) -> list[tuple]:
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(b) for b in blocks), desc="synthesize", unit="image")
    boxes: list[list[tuple]] = [[] for _ in blocks]
    if client is None:
        for block, rows in enumerate(blocks):
            done, boxes[block] = _write_block(rows, size=size, seed=seed, block=block)
            if bar is not None:
                bar.update(done)
    else:
        from distributed import as_completed

        from dask_dl.cluster.workers import cpu_workers

        workers = cpu_workers(client)  # on a cluster with GPU workers, leave them to the trainers
        futures = [
            client.submit(_write_block, rows, size=size, seed=seed, block=block, pure=False, workers=workers)
            for block, rows in enumerate(blocks)
        ]
        index = {future.key: block for block, future in enumerate(futures)}
        for future in as_completed(futures):
            done, boxes[index[future.key]] = future.result()  # re-raises a task's error here
            if bar is not None:
                bar.update(done)
    if bar is not None:
        bar.close()
    return [box for block in boxes for box in block]


def _result(table: pd.DataFrame) -> pd.DataFrame:
    out = table.rename(columns={"patient": "patient_id"})
    out["patient_id"] = [f"{p:08d}" for p in out["patient_id"]]  # as read_nih spells them
    columns = [*REQUIRED_COLUMNS, *METADATA_COLUMNS, "finding_labels", *NIH_LABELS, "rgba", "corrupt", "corrupt_kind"]
    out = out[columns].reset_index(drop=True)
    out.attrs = {"labels": list(NIH_LABELS), "task": "multilabel"}
    return out
