"""Tests of dask_dl.data.synthetic: the NIH on-disk layout, determinism, label statistics and drawn findings."""

from __future__ import annotations

import gzip
import hashlib
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from PIL import Image
from scipy import ndimage

from dask_dl.cli import cli
from dask_dl.data.nih import NIH_HEADER
from dask_dl.data.radiograph import _Chest
from dask_dl.data.radiograph import draw as _draw
from dask_dl.data.schema import NIH_LABELS
from dask_dl.data.synthetic import (
    _IMAGES_PER_PATIENT,
    _NIH_FREQUENCIES,
    _nih_combinations,
    _plan,
    _sample_labels,
    _site_profile,
    synthesize,
)
from dask_dl.errors import CatalogError, ConfigurationError, StoreNotFoundError

LABELS = list(NIH_LABELS)


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def real_table(shared_data) -> pd.DataFrame:
    return pd.read_csv(shared_data / "nih" / "Data_Entry_2017_v2020.csv.gz")


@pytest.fixture(scope="module")
def real_labels(real_table) -> np.ndarray:
    sets = real_table["Finding Labels"].str.split("|")
    return np.array([[name in s for name in NIH_LABELS] for s in sets])


def _conditional(labels: np.ndarray, given: str, then: str) -> float:
    rows = labels[:, LABELS.index(given)].astype(bool)
    return float(labels[rows, LABELS.index(then)].mean())


# ---- files and table ---------------------------------------------------------------------------------------


def test_same_seed_writes_identical_bytes(tmp_path):
    options = dict(n_images=70, size=64, rgba_fraction=0.1, corrupt_fraction=0.1)
    synthesize(tmp_path / "a", seed=3, **options)
    synthesize(tmp_path / "b", seed=3, **options)
    synthesize(tmp_path / "c", seed=4, **options)
    a, b, c = _hashes(tmp_path / "a"), _hashes(tmp_path / "b"), _hashes(tmp_path / "c")
    assert len(a) == 70 + 4  # images, Data_Entry_2017.csv, the two split lists, BBox_List_2017.csv
    assert a == b
    assert a["Data_Entry_2017.csv"] != c["Data_Entry_2017.csv"]
    tables = {"Data_Entry_2017.csv", "train_val_list.txt", "test_list.txt", "BBox_List_2017.csv"}
    common = sorted(set(a) & set(c) - tables)
    assert sum(a[k] != c[k] for k in common) > 0.9 * len(common)


@pytest.mark.slow
def test_parallel_on_a_cluster_equals_serial(client, tmp_path):
    options = dict(n_images=150, size=64, seed=5, sites=2, rgba_fraction=0.05, corrupt_fraction=0.05)
    serial = synthesize(tmp_path / "serial", **options)
    parallel = synthesize(tmp_path / "parallel", client=client, **options)
    assert _hashes(tmp_path / "serial") == _hashes(tmp_path / "parallel")
    pd.testing.assert_frame_equal(
        serial.drop(columns="path"), parallel.drop(columns="path"), check_exact=True, check_like=False
    )


TABLES = ["BBox_List_2017.csv", "Data_Entry_2017.csv", "test_list.txt", "train_val_list.txt"]


@pytest.mark.slow
def test_a_stopped_synthesis_leaves_no_table_and_running_it_again_writes_it_whole(tmp_path, monkeypatch):
    """The tables are written last: a root with a table is complete, also over an earlier synthesis."""
    import dask_dl
    from dask_dl.data import synthetic

    root = tmp_path / "root"
    synthesize(root, n_images=100, size=64, seed=1)  # an earlier, complete collection
    write_block = synthetic._write_block

    def ctrl_c_at_block_2(rows, *, size, seed, block):
        if block == 2:
            raise KeyboardInterrupt  # what Ctrl-C raises in the loop over blocks
        return write_block(rows, size=size, seed=seed, block=block)

    with monkeypatch.context() as patch:
        patch.setattr(synthetic, "_write_block", ctrl_c_at_block_2)
        with pytest.raises(
            KeyboardInterrupt,
            match=r"synthesis into '.*root' stopped by Ctrl-C before its tables "
            r"were written .* run the same synthesis again to write it",
        ):
            synthesize(root, n_images=300, size=64, seed=2)
    assert sorted(p.name for p in root.iterdir()) == ["images"]  # the earlier tables are gone, no new one
    assert not list(root.rglob("*.partial"))
    with pytest.raises(CatalogError, match=r"has an images/ folder and no Data_Entry_2017.csv .*Run the synthesis "):
        dask_dl.read_catalog(root)  # not a class-folder collection with one class, "images"

    table = synthesize(root, n_images=300, size=64, seed=2)
    fresh = tmp_path / "fresh"
    synthesize(fresh, n_images=300, size=64, seed=2)
    written = _hashes(root)
    assert {name: written[name] for name in _hashes(fresh)} == _hashes(fresh)  # what it lists, as a fresh one
    assert sorted(p.name for p in root.iterdir()) == sorted([*TABLES, "images"])
    assert len(dask_dl.read_catalog(root)) == len(table) == 300


def test_an_image_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Synthesis (and the store's own files) write through store.write_whole: a stopped write leaves the old file."""
    from dask_dl.data import store

    path = tmp_path / "00000001_000.png"
    path.write_bytes(b"an earlier image")

    def stopped(source, target):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(store.os, "replace", stopped)
        with pytest.raises(KeyboardInterrupt):
            store.write_whole(str(path), b"\x89PNG new bytes")
    assert path.read_bytes() == b"an earlier image" and sorted(tmp_path.iterdir()) == [path]
    store.write_whole(str(path), b"\x89PNG new bytes")
    assert path.read_bytes() == b"\x89PNG new bytes" and sorted(tmp_path.iterdir()) == [path]


def test_table_is_the_2017_nih_form(tmp_path):
    table = synthesize(tmp_path, n_images=120, size=64, seed=1)
    lines = (tmp_path / "Data_Entry_2017.csv").read_text().split("\n")
    assert lines[0] == NIH_HEADER
    assert lines[0] == (
        "Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position,"
        "OriginalImage[Width,Height],OriginalImagePixelSpacing[x,y]"
    )
    assert lines[-1] == "" and len(lines) == 1 + 120 + 1
    vocabulary = set(NIH_LABELS) | {"No Finding"}
    for line, row in zip(lines[1:-1], table.itertuples(index=False), strict=True):
        fields = line.split(",")
        assert len(fields) == 12 and fields[-1] == "", line  # 11 values and the 2017 file's trailing comma
        image, findings, follow_up, patient, age, sex, view, width, height, sx, sy = fields[:11]
        assert re.fullmatch(r"\d{8}_\d{3}\.png", image) and image == f"{int(patient):08d}_{int(follow_up):03d}.png"
        names = findings.split("|")
        assert set(names) <= vocabulary and ("No Finding" not in names or names == ["No Finding"])
        assert names == sorted(names, key=lambda n: LABELS.index(n) if n in LABELS else -1)  # NIH order
        assert [LABELS[j] for j in range(14) if getattr(row, LABELS[j])] == [n for n in names if n != "No Finding"]
        assert 0 <= int(age) <= 100 and sex in ("M", "F") and view in ("PA", "AP")
        assert 2000 <= int(width) <= 3100 and 2000 <= int(height) <= 3100
        assert sx == sy and 0.139 <= float(sx) <= 0.171
        assert (row.image_id, row.patient_id, row.follow_up) == (image, patient.zfill(8), int(follow_up))
    # NIH's pandas reading of the 2017 file: the trailing comma makes no extra named column
    frame = pd.read_csv(tmp_path / "Data_Entry_2017.csv", index_col=False)
    assert list(frame.columns[:7]) == NIH_HEADER.split(",")[:7] and len(frame) == 120


@pytest.mark.slow
def test_patients_follow_ups_and_split_lists(tmp_path):
    table = synthesize(tmp_path, n_images=400, size=64, seed=2)
    per_patient = table.groupby("patient_id")["follow_up"].agg(list)
    assert all(f == list(range(len(f))) for f in per_patient)  # follow-ups 0, 1, 2, ... per patient
    assert per_patient.map(len).max() > 1 and (per_patient.map(len) == 1).any()
    assert set(table["view"]) == {"PA", "AP"} and set(table["sex"]) == {"M", "F"}
    train_val = (tmp_path / "train_val_list.txt").read_text().split()
    test = (tmp_path / "test_list.txt").read_text().split()
    assert sorted(train_val + test) == sorted(table["image_id"]) and not set(train_val) & set(test)
    assert train_val == sorted(train_val) and test == sorted(test)
    test_patients = {i[:8] for i in test}
    assert not test_patients & {i[:8] for i in train_val}  # split by patient
    assert len(test_patients) == round(0.2 * table["patient_id"].nunique())
    assert set(table.loc[table["split"] == "test", "image_id"]) == set(test)
    for path in table["path"].iloc[:20]:
        with Image.open(path) as image:
            assert (image.mode, image.size, image.format) == ("L", (64, 64), "PNG")


def test_n_patients(tmp_path):
    table = synthesize(tmp_path, n_images=50, size=64, seed=0, n_patients=7)
    assert len(table) == 50 and table["patient_id"].nunique() == 7


def test_rgba_and_corrupt_files_are_what_the_table_says(tmp_path):
    table = synthesize(tmp_path, n_images=60, size=64, seed=8, rgba_fraction=0.2, corrupt_fraction=0.25)
    assert table["rgba"].sum() == 12 and table["corrupt"].sum() == 15
    assert not (table["rgba"] & table["corrupt"]).any()
    assert set(table.loc[table["corrupt"], "corrupt_kind"]) == {"truncated", "empty", "garbage"}
    listed = set((tmp_path / "Data_Entry_2017.csv").read_text().split("\n")[1:-1])
    assert len(listed) == 60  # corrupt images are listed as usual
    for row in table.itertuples(index=False):
        data = Path(row.path).read_bytes()
        if row.corrupt:
            assert (len(data) == 0) == (row.corrupt_kind == "empty")
            assert data.startswith(b"\x89PNG") == (row.corrupt_kind == "truncated")
            with pytest.raises((OSError, SyntaxError)), Image.open(row.path) as image:
                image.load()
            continue
        with Image.open(row.path) as image:
            image.load()
            pixels = np.asarray(image)
            assert image.mode == ("RGBA" if row.rgba else "L")
        if row.rgba:
            assert (pixels[..., 3] == 255).all()
            assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()


# ---- labels --------------------------------------------------------------------------------------------------


def test_label_marginals_close_to_nih():
    n = 20_000
    labels = _sample_labels(np.random.default_rng(0), n)
    assert labels.shape == (n, 14) and labels.dtype == np.uint8
    expected = np.array(_NIH_FREQUENCIES)
    tolerance = 5 * np.sqrt(expected * (1 - expected) / n) + 0.002
    np.testing.assert_array_less(np.abs(labels.mean(axis=0) - expected), tolerance)
    assert abs((labels.sum(axis=1) == 0).mean() - 60361 / 112120) < 0.02  # No Finding


@pytest.mark.slow
def test_embedded_statistics_are_the_real_ones(real_table, real_labels):
    real = real_labels
    np.testing.assert_allclose(np.array(_NIH_FREQUENCIES), real.mean(axis=0), atol=1e-5)
    combos = pd.Series(
        ["|".join(n for n, v in zip(NIH_LABELS, row, strict=True) if v) or "No Finding" for row in real]
    ).value_counts()
    assert _nih_combinations() == combos.iloc[:150].to_dict()
    patients = real_table["Patient ID"].value_counts()
    assert list(_IMAGES_PER_PATIENT) == [int((patients == k).sum()) for k in range(1, 31)]


@pytest.mark.parametrize(
    ("given", "then"),
    [("Atelectasis", "Effusion"), ("Effusion", "Infiltration"), ("Cardiomegaly", "Effusion"), ("Mass", "Nodule")],
)
def test_co_occurrence_is_kept(real_labels, given, then):
    real = _conditional(real_labels, given, then)
    sampled = _conditional(_sample_labels(np.random.default_rng(1), 60_000), given, then)
    assert abs(sampled - real) < 0.03, (given, then, sampled, real)
    # and not what independent labels would give
    independent = _NIH_FREQUENCIES[LABELS.index(then)]
    assert abs(real - independent) > 0.05


@pytest.mark.slow
def test_label_source_takes_real_patients(shared_data, real_table, tmp_path):
    source = shared_data / "nih" / "Data_Entry_2017_v2020.csv.gz"
    table = synthesize(tmp_path, n_images=150, size=64, seed=3, label_source=source)
    columns = ["Finding Labels", "Patient Age", "Patient Gender", "View Position"]
    real = real_table[columns].copy()
    real["Finding Labels"] = real["Finding Labels"].str.split("|").map(frozenset)
    real_rows = list(real.itertuples(index=False, name=None))
    starting_with: dict[tuple, list] = {}  # real patients by their first image
    for index in real_table.groupby("Patient ID").indices.values():
        starting_with.setdefault(real_rows[index[0]], []).append(index)
    mine = table[["finding_labels", "age", "sex", "view"]].copy()
    mine["finding_labels"] = mine["finding_labels"].str.split("|").map(frozenset)
    for rows in table.groupby("patient_id").indices.values():
        seq = list(mine.iloc[rows].itertuples(index=False, name=None))
        # a real patient's images, in order (the last patient may be cut short)
        assert any([real_rows[i] for i in index[: len(seq)]] == seq for index in starting_with[seq[0]])
    # over many patients the label statistics are the real ones
    plan = _plan(
        str(tmp_path),
        20_000,
        seed=0,
        n_patients=None,
        label_source=source,
        sites=None,
        rgba_fraction=0,
        corrupt_fraction=0,
    )
    freq = plan[LABELS].to_numpy().mean(axis=0)
    np.testing.assert_allclose(freq, _NIH_FREQUENCIES, atol=0.02)


def test_label_source_errors(tmp_path):
    with pytest.raises(StoreNotFoundError, match="does not exist"):
        synthesize(tmp_path / "x", n_images=5, size=64, label_source=tmp_path / "missing.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(CatalogError, match="not an NIH Data_Entry table"):
        synthesize(tmp_path / "x", n_images=5, size=64, label_source=bad)
    unknown = tmp_path / "unknown.csv.gz"
    with gzip.open(unknown, "wt") as f:
        f.write(NIH_HEADER + "\n00000001_000.png,Infiltrate,0,1,50,M,PA,2500,2048,0.168,0.168,\n")
    with pytest.raises(CatalogError, match="Infiltrate"):
        synthesize(tmp_path / "x", n_images=1, size=64, label_source=unknown)


# ---- sites --------------------------------------------------------------------------------------------------


def test_sites_are_complete_roots_with_their_own_patients_and_mix(tmp_path):
    table = synthesize(tmp_path, n_images=90, size=64, seed=4, sites=["A", "B", "C"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A", "B", "C"]
    patients = {}
    for site in "ABC":
        root = tmp_path / site
        assert {p.name for p in root.iterdir()} == {
            "images",
            "Data_Entry_2017.csv",
            "train_val_list.txt",
            "test_list.txt",
            "BBox_List_2017.csv",
        }
        frame = pd.read_csv(root / "Data_Entry_2017.csv", index_col=False)
        assert len(frame) == 30 and len(list((root / "images").iterdir())) == 30
        patients[site] = set(frame["Patient ID"])
        assert set(table.loc[table["site"] == site, "image_id"]) == set(frame["Image Index"])
    assert not (patients["A"] & patients["B"] or patients["A"] & patients["C"] or patients["B"] & patients["C"])
    # label mix: on many rows the sites differ far beyond sampling noise
    plan = _plan(
        str(tmp_path),
        9000,
        seed=4,
        n_patients=None,
        label_source=None,
        sites=["A", "B", "C"],
        rgba_fraction=0,
        corrupt_fraction=0,
    )
    mix = plan.groupby("site")[LABELS].mean()
    assert (mix.max() - mix.min()).max() > 0.05
    assert plan.groupby("patient")["site"].nunique().max() == 1
    profiles = [_site_profile(4, i) for i in range(3)]
    assert len({round(p["gain"], 6) for p in profiles}) == 3 and len({round(p["noise"], 6) for p in profiles}) == 3


def test_sites_as_a_count(tmp_path):
    table = synthesize(tmp_path, n_images=20, size=64, seed=0, sites=2)
    assert sorted(table["site"].unique()) == ["site-A", "site-B"]
    assert (tmp_path / "site-B" / "Data_Entry_2017.csv").exists()


# ---- drawing -------------------------------------------------------------------------------------------------

SIZE = 120  # under 128 the anatomy is drawn at full resolution, so its masks line up with the pixels


def _pair(name: str, key: int, view: str = "PA") -> tuple[np.ndarray, _Chest, np.ndarray, np.ndarray]:
    """Pixel difference (with the finding minus without it) and the geometry of the chest without it."""
    without = _draw(SIZE, [], seed=7, key=(key,), view=view).astype(int)
    with_ = _draw(SIZE, [name], seed=7, key=(key,), view=view, strength=STRENGTH).astype(int)
    chest = _Chest(SIZE, np.random.default_rng(np.random.SeedSequence(7, spawn_key=(key, 0))), view)
    chest.draw_anatomy()
    return with_ - without, chest, without, with_


KEYS = range(6)
STRENGTH = 0.7  # a clear case; strength varies from faint to obvious in the collections


def test_finding_strength_varies_per_image():
    darkening = []
    for key in range(8):
        diff = _draw(SIZE, ["Emphysema"], seed=7, key=(key,)).astype(int) - _draw(SIZE, [], seed=7, key=(key,))
        chest = _Chest(SIZE, np.random.default_rng(np.random.SeedSequence(7, spawn_key=(key, 0))), "PA")
        chest.draw_anatomy()
        darkening.append(-diff[chest.lung > 0.5].mean())
    assert min(darkening) > 2 and max(darkening) > 2 * min(darkening)  # always there, faint to obvious
    faint = _draw(SIZE, ["Nodule"], seed=7, key=(0,), strength=0.0).astype(int) - _draw(SIZE, [], seed=7, key=(0,))
    strong = _draw(SIZE, ["Nodule"], seed=7, key=(0,), strength=1.0).astype(int) - _draw(SIZE, [], seed=7, key=(0,))
    assert 5 < faint.max() < strong.max() / 2


def _shape(diff: np.ndarray, chest: _Chest) -> dict[str, float]:
    """What the changed pixels (``diff > 5``) look like: size, extent, elongation, pieces, evenness, place."""
    changed = diff > 5
    assert changed.sum() >= 3, "the finding brightened (almost) no pixel"
    x, y = chest.X[changed], chest.Y[changed]
    small, large = np.linalg.eigvalsh(np.cov(np.vstack([x, y])))
    touched = diff > 2
    return {
        "area": changed.mean(),
        "extent": max(np.ptp(x), np.ptp(y)),  # in normalized units: the image is 2 wide
        "elongation": np.sqrt(large / max(small, 1e-9)),
        "pieces": ndimage.label(changed)[1],
        "unevenness": diff[touched].std() / diff[touched].mean(),
        "heart_distance": np.percentile(ndimage.distance_transform_edt(chest.heart_mask < 0.5)[changed], 90),
        "q": np.median(chest.q[changed]),
    }


def test_background_is_the_same_with_and_without_findings():
    a = _draw(SIZE, [], seed=1, key=(3,))
    assert a.dtype == np.uint8 and a.shape == (SIZE, SIZE)
    assert np.array_equal(a, _draw(SIZE, [], seed=1, key=(3,)))
    assert not np.array_equal(a, _draw(SIZE, [], seed=1, key=(4,)))
    both = _draw(SIZE, ["Nodule", "Mass"], seed=1, key=(3,)).astype(int) - a
    nodule = _draw(SIZE, ["Nodule"], seed=1, key=(3,)).astype(int) - a
    mass = _draw(SIZE, ["Mass"], seed=1, key=(3,)).astype(int) - a
    assert np.abs(both - nodule - mass).max() <= 2  # independent findings; only rounding and clipping couple them


def test_looks_like_a_chest():
    image = _draw(256, [], seed=0, key=(0,)).astype(float)
    chest = _Chest(256, np.random.default_rng(np.random.SeedSequence(0, spawn_key=(0, 0))), "PA")
    chest.draw_anatomy()
    lung = np.kron(chest.lung > 0.5, np.ones((2, 2), bool))
    central = np.abs(np.kron(chest.X, np.ones((2, 2)))) < 0.08
    assert image[lung].mean() + 60 < image[central].mean()  # dark lungs, bright mediastinum and spine
    assert image[:8, :8].mean() < 40  # air above the shoulders


@pytest.mark.parametrize("key", KEYS)
def test_nodule_raises_a_small_local_maximum(key):
    diff, chest, without, with_ = _pair("Nodule", key)
    peak = np.unravel_index(np.argmax(diff), diff.shape)
    assert diff[peak] > 30 and chest.lung_behind_heart[peak] > 0.5
    shape = _shape(diff, chest)
    assert shape["area"] < 0.005 and shape["extent"] < 0.1 and shape["elongation"] < 1.4
    y, x = peak
    ring = np.zeros_like(diff, bool)
    yy, xx = np.ogrid[: diff.shape[0], : diff.shape[1]]
    ring[((yy - y) ** 2 + (xx - x) ** 2 >= 25) & ((yy - y) ** 2 + (xx - x) ** 2 <= 49)] = True
    assert with_[y, x] - np.median(with_[ring]) > without[y, x] - np.median(without[ring]) + 25


@pytest.mark.parametrize("key", KEYS)
def test_mass_is_a_larger_opacity_in_a_lung(key):
    diff, chest, *_ = _pair("Mass", key)
    shape = _shape(diff, chest)
    assert 0.005 < shape["area"] < 0.02 and 0.12 < shape["extent"] < 0.3 and shape["elongation"] < 1.4
    assert shape["pieces"] == 1 and shape["q"] > 0.2 and shape["unevenness"] < 0.8
    assert chest.lung_behind_heart[np.unravel_index(np.argmax(diff), diff.shape)] > 0.5


@pytest.mark.parametrize("key", KEYS)
def test_effusion_fills_the_base(key):
    diff, chest, *_ = _pair("Effusion", key)
    lung = chest.lung > 0.5
    assert diff[lung & (chest.t > 0.8)].mean() > 15
    assert diff[lung & (chest.t < 0.4)].max() == 0


@pytest.mark.parametrize("key", KEYS)
def test_cardiomegaly_widens_the_central_bright_region(key):
    diff, chest, without, with_ = _pair("Cardiomegaly", key)
    rows = slice(int((chest.heart[1] / 2 + 0.5) * SIZE) - 3, int((chest.heart[1] / 2 + 0.5) * SIZE) + 3)
    threshold = (np.median(without[chest.lung > 0.5]) + without[rows, SIZE // 2].mean()) / 2
    before, after = (without[rows] > threshold).sum(axis=1), (with_[rows] > threshold).sum(axis=1)
    assert (after - before).mean() > 0.05 * SIZE
    assert _shape(diff, chest)["heart_distance"] < 0.2 * SIZE / 2  # the change hugs the heart
    assert diff[(chest.lung > 0.5) & (chest.q > 0.6)].mean() < 1  # lateral lungs untouched


@pytest.mark.parametrize("key", KEYS)
def test_pneumothorax_darkens_the_apex(key):
    diff, chest, *_ = _pair("Pneumothorax", key)
    lung = chest.lung > 0.5
    apex = [diff[lung & (chest.t < 0.3) & (chest.right == side)].mean() for side in (0, 1)]
    assert min(apex) < -5 and max(apex) > -0.5  # one side only
    assert diff[lung & (chest.t > 0.85)].mean() > -0.5
    assert (diff > 0).sum() < (diff < 0).sum()


@pytest.mark.parametrize("key", KEYS)
def test_atelectasis_is_a_dense_band_low_in_a_lung(key):
    diff, chest, *_ = _pair("Atelectasis", key)
    band = diff > 10
    assert 0.002 < band.mean() < 0.03
    assert chest.t[band].mean() > 0.45 and chest.Y[band].std() < 0.1
    shape = _shape(diff, chest)
    assert shape["elongation"] > 1.6 and shape["extent"] < 0.4 and shape["pieces"] == 1


@pytest.mark.parametrize("key", KEYS)
def test_infiltration_is_patchy_haze(key):
    diff, chest, *_ = _pair("Infiltration", key)
    lung = chest.lung > 0.5
    assert diff[lung].max() > 20 and diff.min() >= 0
    shape = _shape(diff, chest)
    assert shape["area"] > 0.012 and 0.53 < shape["unevenness"] < 0.78 and shape["q"] < 0.95


@pytest.mark.parametrize("key", KEYS)
def test_consolidation_fills_part_of_one_lung(key):
    diff, chest, *_ = _pair("Consolidation", key)
    lung = chest.lung > 0.5
    sides = sorted(diff[lung & (chest.right == side)].mean() for side in (0, 1))
    assert sides[0] < 1 and sides[1] > 15
    shape = _shape(diff, chest)
    assert shape["unevenness"] < 0.48 and shape["extent"] > 0.5 and shape["pieces"] == 1


@pytest.mark.parametrize("key", KEYS)
def test_edema_is_bilateral_and_perihilar(key):
    diff, chest, *_ = _pair("Edema", key)
    lung = chest.lung > 0.5
    hilar = lung & (chest.q < 0.4) & (chest.t > 0.3) & (chest.t < 0.7)
    for side in (0, 1):
        assert diff[hilar & (chest.right == side)].mean() > 8
    assert diff[hilar].mean() > diff[lung & (chest.t < 0.15)].mean() + 3
    assert _shape(diff, chest)["heart_distance"] > 0.25 * SIZE / 2


@pytest.mark.parametrize("key", KEYS)
def test_emphysema_makes_the_lungs_hyperlucent(key):
    diff, chest, *_ = _pair("Emphysema", key)
    assert diff[chest.lung > 0.5].mean() < -15


@pytest.mark.parametrize("key", KEYS)
def test_fibrosis_is_reticular_peripheral_and_basal(key):
    diff, chest, *_ = _pair("Fibrosis", key)
    lung = chest.lung > 0.5
    zone = lung & (chest.q > 0.6) & (chest.t > 0.6)
    assert diff[zone].mean() > 3 * max(diff[lung & (chest.q < 0.3) & (chest.t < 0.4)].mean(), 0.3)
    assert 0.1 < (diff[zone] > 5).mean() < 0.9  # lines, not a uniform haze
    assert _shape(diff, chest)["pieces"] > 30


@pytest.mark.parametrize("key", KEYS)
def test_pleural_thickening_is_a_rim_at_the_lung_edge(key):
    diff, chest, *_ = _pair("Pleural_Thickening", key)
    changed = diff > 5
    assert changed.sum() > 10
    assert np.median(chest.q[changed]) > 0.85
    shape = _shape(diff, chest)
    assert shape["elongation"] > 3 and shape["pieces"] <= 3


@pytest.mark.parametrize("key", KEYS)
def test_hernia_is_a_rounded_opacity_behind_the_heart(key):
    diff, chest, *_ = _pair("Hernia", key)
    changed = diff > 5
    assert changed.sum() > 20
    assert np.abs(chest.X[changed] - chest.midline).mean() < 0.12
    assert chest.heart_mask[changed].mean() > 0.5 and chest.Y[changed].mean() > chest.heart[1]


@pytest.mark.parametrize("key", KEYS)
def test_pneumonia_is_focal(key):
    diff, chest, *_ = _pair("Pneumonia", key)
    changed = diff > 5
    assert 0.005 < changed.mean() < 0.1
    assert chest.X[changed].std() < 0.15 and chest.Y[changed].std() < 0.15
    shape = _shape(diff, chest)
    assert shape["unevenness"] > 0.9 and 0.25 < shape["extent"] < 0.6 and shape["elongation"] < 1.5


def test_ap_view_magnifies_the_heart():
    pa = _Chest(SIZE, np.random.default_rng(0), "PA")
    ap = _Chest(SIZE, np.random.default_rng(0), "AP")
    assert ap.heart[2] == pytest.approx(1.12 * pa.heart[2]) and ap.clavicle < pa.clavicle
    assert not np.array_equal(_draw(SIZE, [], seed=0, view="PA"), _draw(SIZE, [], seed=0, view="AP"))


@pytest.mark.parametrize("size", [64, 97, 128, 301])
def test_any_size_from_64(size):
    image = _draw(size, ["Effusion", "Nodule"], seed=0)
    assert image.shape == (size, size) and image.dtype == np.uint8 and 20 < image.mean() < 230


# ---- options, errors and the CLI --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"size": 63}, "size=63 is too small"),
        ({"n_images": 0}, "n_images must be a positive integer, got 0; pass e.g. n_images=1000"),
        ({"n_images": 2.0}, "n_images must be a positive integer, got 2.0"),
        ({"size": 64.5}, "size must be a positive integer, got 64.5"),
        ({"rgba_fraction": 1.5}, r"rgba_fraction=1.5 .* \[0, 1\]"),
        ({"corrupt_fraction": -0.1}, "corrupt_fraction"),
        ({"n_patients": 50}, "n_patients=50"),
        ({"sites": ["A", "A"]}, "distinct"),
        ({"sites": 0}, "sites=0"),
        ({"sites": 20}, "cannot fill 20 sites"),
        ({"sites": 3, "n_patients": 2}, "n_patients=2 cannot fill 3 sites"),
    ],
)
def test_bad_options_say_what_to_do(tmp_path, options, match):
    with pytest.raises(ConfigurationError, match=match):
        synthesize(tmp_path, **{"n_images": 10, **options})


def test_cli_synth(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["synth", "--help"])
    assert result.exit_code == 0
    for option in ("--images", "--size", "--seed", "--label-source", "--sites", "--rgba", "--corrupt"):
        assert option in result.output
    args = ["synth", str(tmp_path), "--images", "30", "--size", "64", "--seed", "2", "--sites", "A,B"]
    result = runner.invoke(cli, [*args, "--rgba", "0.1", "--corrupt", "0.1", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "wrote 30 images" in result.output and "3 RGBA" in result.output and "3 corrupt" in result.output
    assert len(list((tmp_path / "A" / "images").iterdir())) == 15
    same = synthesize(
        tmp_path / "api", n_images=30, size=64, seed=2, sites=["A", "B"], rgba_fraction=0.1, corrupt_fraction=0.1
    )
    assert _hashes(tmp_path / "A") == _hashes(tmp_path / "api" / "A") and len(same) == 30
    result = runner.invoke(cli, ["synth", str(tmp_path / "small"), "--size", "32"])
    assert result.exit_code == 1 and "size=32 is too small" in result.output


def test_read_nih_reads_the_output(tmp_path):
    from dask_dl.data import catalog as catalog_module

    table = synthesize(tmp_path, n_images=200, size=64, seed=6, sites=["A", "B"], corrupt_fraction=0.05)
    for site in ("A", "B"):
        catalog = catalog_module.read_nih(tmp_path / site, site=site).set_index("image_id")
        expected = table[table["site"] == site].set_index("image_id")
        assert sorted(catalog.index) == sorted(expected.index)
        catalog = catalog.loc[expected.index]
        assert catalog.attrs["labels"] == LABELS
        np.testing.assert_array_equal(catalog[LABELS].to_numpy(), expected[LABELS].to_numpy())
        assert ((catalog["split"] == "test") == (expected["split"] == "test")).all()
        assert set(catalog.loc[expected["split"] == "train_val", "split"]) <= {"train", "val"}
        assert (catalog["patient_id"] == expected["patient_id"]).all()
        assert (
            catalog["path"].map(lambda p: Path(p).resolve()) == expected["path"].map(lambda p: Path(p).resolve())
        ).all()
        assert (catalog["view"] == expected["view"]).all() and (catalog["sex"] == expected["sex"]).all()


def test_a_url_is_refused_not_written_to_a_local_folder_named_after_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigurationError,
        match=r"^synthesize writes a folder of files, not to 's3://bucket/raw': "
        r"write it to a local or shared folder, then copy it up",
    ):
        synthesize("s3://bucket/raw", n_images=4, size=64)
    assert list(tmp_path.iterdir()) == []  # before: a folder 's3:' here
    table = synthesize(f"file://{tmp_path / 'raw'}", n_images=4, size=64)
    assert (tmp_path / "raw" / "images" / table["image_id"].iloc[0]).is_file()
