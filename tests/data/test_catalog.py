"""Catalog readers (dask_dl.data.catalog): NIH tables small and real, class folders, dispatch, splits, CLI."""

from __future__ import annotations

import gzip
import hashlib
import shutil
from pathlib import Path

import dask.config
import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from PIL import Image

from dask_dl.cli import cli
from dask_dl.data.catalog import NIH_HEADER, parse_findings, read_catalog, read_folders, read_nih, split_by_patient
from dask_dl.data.schema import NIH_LABELS, validate_catalog, write_catalog
from dask_dl.errors import CatalogError, ConfigurationError, StoreNotFoundError

# Counts published with ChestX-ray14 (and in the v2020 table).
PUBLISHED = {
    "Atelectasis": 11559,
    "Cardiomegaly": 2776,
    "Effusion": 13317,
    "Infiltration": 19894,
    "Mass": 5782,
    "Nodule": 6331,
    "Pneumonia": 1431,
    "Pneumothorax": 5302,
    "Consolidation": 4667,
    "Edema": 2303,
    "Emphysema": 2516,
    "Fibrosis": 1686,
    "Pleural_Thickening": 3385,
    "Hernia": 227,
}

# image, findings, follow-up, patient, age, sex, view, width, height, spacing x, spacing y
ROWS = [
    ("00000001_000.png", "Cardiomegaly", 0, 1, 57, "M", "PA", 2682, 2749, 0.143, 0.143),
    ("00000001_001.png", "Cardiomegaly|Emphysema", 1, 1, 58, "M", "PA", 2894, 2729, 0.143, 0.143),
    ("00000002_000.png", "No Finding", 0, 2, 80, "M", "PA", 2500, 2048, 0.171, 0.171),
    ("00000003_000.png", "Hernia", 0, 3, 74, "F", "PA", 2500, 2048, 0.168, 0.168),
    ("00000003_001.png", "Hernia|Infiltration|Pleural_Thickening", 1, 3, 75, "F", "AP", 2048, 2500, 0.168, 0.168),
    ("00000004_000.png", "Mass|Nodule", 0, 4, 82, "M", "AP", 2500, 2048, 0.168, 0.168),
    ("00000005_000.png", "No Finding", 0, 5, 69, "F", "PA", 2048, 2500, 0.168, 0.168),
    ("00030805_000.png", "Effusion", 0, 30805, 39, "M", "PA", 2048, 2500, 0.168, 0.168),
]


def write_nih(
    root: Path,
    rows=ROWS,
    *,
    trailing_comma: bool = True,
    name: str = "Data_Entry_2017.csv",
    lists: tuple[list[str], list[str]] | None = None,
    missing: tuple[str, ...] = ("00000005_000.png",),
) -> Path:
    """An NIH root: the table, tiny PNGs spread over images_001/ and images_002/, optional official lists."""
    root.mkdir(parents=True, exist_ok=True)
    end = "," if trailing_comma else ""
    lines = [NIH_HEADER] + [",".join(str(v) for v in row) + end for row in rows]
    text = "\n".join(lines) + "\n"
    if name.endswith(".gz"):
        with gzip.open(root / name, "wt") as f:
            f.write(text)
    else:
        (root / name).write_text(text)
    for i, row in enumerate(rows):
        if row[0] in missing:
            continue
        folder = root / f"images_{1 + i % 2:03d}" / "images"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((8, 8), i * 10, np.uint8)).save(folder / row[0])
    if lists is not None:
        (root / "train_val_list.txt").write_text("\n".join(lists[0]) + "\n")
        (root / "test_list.txt").write_text("\n".join(lists[1]) + "\n")
    return root


def official_lists(test_patients=(3, 30805)) -> tuple[list[str], list[str]]:
    test = [r[0] for r in ROWS if r[3] in test_patients]
    return [r[0] for r in ROWS if r[3] not in test_patients], test


# ---- small NIH collections --------------------------------------------------------------------------------


def test_nih_columns_labels_paths(tmp_path):
    root = write_nih(tmp_path / "nih")
    catalog = read_nih(root, seed=0)
    assert list(catalog.columns) == [
        "image_id",
        "path",
        "patient_id",
        "site",
        "split",
        *NIH_LABELS,
        "follow_up",
        "age",
        "sex",
        "view",
        "orig_width",
        "orig_height",
        "spacing_x",
        "spacing_y",
    ]
    assert catalog.attrs == {"labels": list(NIH_LABELS), "task": "multilabel"}
    assert list(catalog["image_id"]) == [r[0] for r in ROWS]
    assert list(catalog["patient_id"]) == ["00000001"] * 2 + ["00000002"] + ["00000003"] * 2 + [
        "00000004",
        "00000005",
        "00030805",
    ]
    assert set(catalog["site"]) == {"NIH"}
    for row, (_, entry) in zip(ROWS, catalog.iterrows(), strict=True):
        findings = set(row[1].split("|")) - {"No Finding"}
        assert {label for label in NIH_LABELS if entry[label] == 1} == findings
        assert (entry["follow_up"], entry["age"], entry["sex"], entry["view"]) == row[2:3] + row[4:7]
        assert (entry["orig_width"], entry["orig_height"], entry["spacing_x"], entry["spacing_y"]) == row[7:]
    assert (catalog[list(NIH_LABELS)].dtypes == np.uint8).all()
    paths = dict(zip(catalog["image_id"], catalog["path"], strict=True))
    assert paths["00000001_000.png"] == str(root / "images_001" / "images" / "00000001_000.png")
    assert paths["00000001_001.png"] == str(root / "images_002" / "images" / "00000001_001.png")
    assert all(Path(p).is_file() for i, p in paths.items() if i != "00000005_000.png")
    # Listed but absent: where it would be, so that ingest rejects it as missing.
    assert paths["00000005_000.png"] == str(root / "images" / "00000005_000.png")


def test_nih_trailing_comma_gzip_and_images_folder_agree(tmp_path):
    old = read_nih(write_nih(tmp_path / "a"), seed=1)
    new = read_nih(write_nih(tmp_path / "b", trailing_comma=False, name="Data_Entry_2017_v2020.csv.gz"), seed=1)
    flat = tmp_path / "c"
    write_nih(flat, trailing_comma=False)
    (flat / "images").mkdir()
    for png in flat.glob("images_*/images/*.png"):
        png.rename(flat / "images" / png.name)
    flat_catalog = read_nih(flat, seed=1)
    assert flat_catalog["path"].map(lambda p: Path(p).is_file()).sum() == len(ROWS) - 1
    assert flat_catalog["path"].str.startswith(str(flat / "images")).all()
    columns = [c for c in old.columns if c != "path"]
    pd.testing.assert_frame_equal(old[columns], new[columns])
    pd.testing.assert_frame_equal(old[columns], flat_catalog[columns])


def test_nih_from_fsspec_url(tmp_path):
    import fsspec

    train_val, test = official_lists()
    local = write_nih(tmp_path / "nih", name="Data_Entry_2017.csv.gz", lists=(train_val, test))
    fs = fsspec.filesystem("memory")
    try:
        fs.put(str(local), "/nih-url", recursive=True)
        catalog = read_catalog("memory://nih-url", site="remote")
        paths = catalog.set_index("image_id")["path"]
        # fsspec spells memory URLs with the root slash: memory:///nih-url/...
        assert paths["00000001_001.png"] == "memory:///nih-url/images_002/images/00000001_001.png"
        assert paths["00000005_000.png"] == "memory:///nih-url/images/00000005_000.png"
        with fsspec.open(paths["00000001_001.png"], "rb") as f:
            assert Image.open(f).size == (8, 8)
        expected = read_nih(local, site="remote")
        columns = [c for c in catalog.columns if c != "path"]
        pd.testing.assert_frame_equal(catalog[columns], expected[columns])
        with pytest.raises(StoreNotFoundError, match="memory:///nih-absent.* is not a directory"):
            read_nih("memory://nih-absent")
    finally:
        fs.rm("/nih-url", recursive=True)


def test_nih_prefers_v2020(tmp_path):
    root = write_nih(tmp_path / "nih", name="Data_Entry_2017_v2020.csv", trailing_comma=False)
    write_nih(root, ROWS[:2])  # an older Data_Entry_2017.csv beside it
    assert len(read_nih(root)) == len(ROWS)


def test_nih_official_lists(tmp_path):
    train_val, test = official_lists()
    root = write_nih(tmp_path / "nih", lists=(train_val, test))
    catalog = read_nih(root, val_fraction=0.0)
    assert set(catalog.loc[catalog["split"] == "test", "image_id"]) == set(test)
    assert set(catalog.loc[catalog["split"] == "train", "image_id"]) == set(train_val)
    # val comes out of train_val only, whole patients, by the seeded hash.
    for seed in range(6):
        split = read_nih(root, val_fraction=0.5, seed=seed).set_index("image_id")["split"]
        assert set(split[test]) == {"test"}
        assert set(split[train_val]) <= {"train", "val"}
        assert split["00000001_000.png"] == split["00000001_001.png"]
    splits = {tuple(read_nih(root, val_fraction=0.5, seed=s)["split"]) for s in range(6)}
    assert len(splits) > 1  # the seed matters
    assert set(read_nih(root, val_fraction=0.99)["split"]) == {"val", "test"}


def test_nih_list_conflicts(tmp_path):
    train_val, test = official_lists()
    root = write_nih(tmp_path / "both", lists=(train_val + [test[0]], test))
    with pytest.raises(CatalogError, match=r"1 image\(s\) are in both .*00000003_000.png.*remove it from the other"):
        read_nih(root)
    split_patient = (train_val + ["00000003_000.png"], [t for t in test if t != "00000003_000.png"])
    root = write_nih(tmp_path / "patient", lists=split_patient)
    with pytest.raises(CatalogError, match=r"patient '00000003' has images in both.*00000003_001.png.*one list"):
        read_nih(root)
    root = write_nih(tmp_path / "unlisted", lists=(train_val[1:], test))
    with pytest.raises(CatalogError, match=r"1 image\(s\) of the table are in neither.*00000001_000.png"):
        read_nih(root)
    root = write_nih(tmp_path / "one", lists=(train_val, test))
    (root / "test_list.txt").unlink()
    with pytest.raises(CatalogError, match="has train_val_list.txt but no test_list.txt"):
        read_nih(root)
    # Images listed but not in the table (a subset of the table) are fine.
    root = write_nih(tmp_path / "subset", rows=ROWS[:5], lists=official_lists())
    assert len(read_nih(root)) == 5


def test_nih_unknown_label_and_label_map(tmp_path):
    rows = list(ROWS)
    rows[3] = ("00000003_000.png", "Hernia|Infiltrate", *ROWS[3][2:])
    root = write_nih(tmp_path / "nih", rows)
    with pytest.raises(CatalogError) as info:
        read_nih(root)
    message = str(info.value)
    assert "unknown label 'Infiltrate' in row 3 (image '00000003_000.png')" in message
    assert "labels are Atelectasis, Cardiomegaly" in message
    assert "label_map={'Infiltrate': 'Infiltration'}" in message
    catalog = read_nih(root, label_map={"Infiltrate": "Infiltration"})
    assert catalog.loc[3, ["Hernia", "Infiltration"]].tolist() == [1, 1]
    assert catalog.loc[3, list(NIH_LABELS)].sum() == 2


def test_nih_malformed_tables(tmp_path):
    rows = list(ROWS)
    rows[2] = ("00000002_000.png", "No Finding|Mass", *ROWS[2][2:])
    with pytest.raises(CatalogError, match="row 2 .*'No Finding' together with findings"):
        read_nih(write_nih(tmp_path / "nf", rows))
    rows = list(ROWS)
    rows[1] = ("00000001_001.png", "", *ROWS[1][2:])
    with pytest.raises(CatalogError, match="row 1 .* has no finding labels"):
        read_nih(write_nih(tmp_path / "empty", rows))
    root = write_nih(tmp_path / "header")
    text = (root / "Data_Entry_2017.csv").read_text().replace("Patient Gender", "Sex", 1)
    (root / "Data_Entry_2017.csv").write_text(text)
    with pytest.raises(CatalogError, match="does not start with the NIH header"):
        read_nih(root)
    root = write_nih(tmp_path / "extra")
    lines = (root / "Data_Entry_2017.csv").read_text().splitlines()
    lines[4] += "surprise"
    (root / "Data_Entry_2017.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(CatalogError, match="row 3 .* has more than 11 fields"):
        read_nih(root)
    with pytest.raises(StoreNotFoundError, match="is not a directory"):
        read_nih(tmp_path / "absent")
    (tmp_path / "bare").mkdir()
    with pytest.raises(StoreNotFoundError, match="no NIH table"):
        read_nih(tmp_path / "bare")


def test_parse_findings_strips_and_merges():
    findings = pd.Series(["Mass | Nodule", "Infiltrate|Infiltration", "No Finding"])
    out = parse_findings(findings, labels=["Mass", "Nodule", "Infiltration"], label_map={"Infiltrate": "Infiltration"})
    assert out.to_numpy().tolist() == [[1, 1, 0], [0, 0, 1], [0, 0, 0]]


# ---- the real NIH table -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_nih(shared_data, tmp_path_factory) -> tuple[Path, pd.DataFrame]:
    root = tmp_path_factory.mktemp("nih")
    shutil.copy(shared_data / "nih" / "Data_Entry_2017_v2020.csv.gz", root)
    (root / "images").mkdir()
    for png in ("00000001_000.png", "00027426_000.png"):
        shutil.copy(shared_data / "nih" / png, root / "images")
    return root, read_nih(root)


def test_real_table_counts(real_nih, shared_data):
    _, catalog = real_nih
    assert len(catalog) == 112_120
    assert catalog["patient_id"].nunique() == 30_805
    assert int((catalog[list(NIH_LABELS)].sum(axis=1) == 0).sum()) == 60_361
    counts = catalog[list(NIH_LABELS)].sum().astype(int).to_dict()
    assert counts == PUBLISHED
    # And independently of pandas: the Finding Labels field of the raw text.
    with gzip.open(shared_data / "nih" / "Data_Entry_2017_v2020.csv.gz", "rt") as f:
        fields = [line.split(",")[1].split("|") for line in f.read().splitlines()[1:]]
    assert sum(f == ["No Finding"] for f in fields) == 60_361
    assert {label: sum(label in f for f in fields) for label in NIH_LABELS} == counts


def test_real_table_splits(real_nih):
    root, catalog = real_nih
    validate_catalog(catalog)
    assert (catalog.groupby("patient_id")["split"].nunique() == 1).all()
    shares = catalog.drop_duplicates("patient_id")["split"].value_counts(normalize=True)
    assert abs(shares["test"] - 0.2) < 0.01 and abs(shares["val"] - 0.1) < 0.01
    # The hash is stable (BLAKE2b keyed by the seed, not Python's salted hash()): pinned values, and the
    # documented rule recomputed here.
    split = catalog.drop_duplicates("patient_id").set_index("patient_id")["split"]
    pinned = ["00000001", "00000002", "00000003", "00000004", "00030805"]
    assert split[pinned].tolist() == ["val", "train", "test", "train", "train"]
    for pid in pinned:
        u = int.from_bytes(hashlib.blake2b(pid.encode(), digest_size=8, key=b"0").digest(), "little") / 2**64
        assert split[pid] == ("test" if u < 0.2 else "val" if u < 0.3 else "train")
    paths = catalog.set_index("image_id")["path"]
    assert Path(paths["00027426_000.png"]).is_file()
    assert paths["00000002_000.png"] == str(root / "images" / "00000002_000.png")
    other = split_by_patient(catalog, seed=1)
    assert (other["split"] != catalog["split"]).mean() > 0.2


# ---- split_by_patient -------------------------------------------------------------------------------------


def _plain(n_patients: int = 400, per_patient: int = 3) -> pd.DataFrame:
    pid = np.repeat([f"p{i}" for i in range(n_patients)], per_patient)
    frame = pd.DataFrame({"image_id": [f"i{i}" for i in range(len(pid))], "path": "x", "patient_id": pid})
    frame["site"], frame["split"] = "A", "train"
    frame.attrs = {"labels": [], "task": "multilabel"}
    return frame


def test_split_by_patient_fractions_and_config():
    catalog = split_by_patient(_plain(), seed=5, val_fraction=0.25, test_fraction=0.25)
    assert (catalog.groupby("patient_id")["split"].nunique() == 1).all()
    shares = catalog["split"].value_counts(normalize=True)
    assert all(abs(shares[s] - f) < 0.08 for s, f in [("train", 0.5), ("val", 0.25), ("test", 0.25)])
    assert set(split_by_patient(_plain(), val_fraction=0, test_fraction=0)["split"]) == {"train"}
    with dask.config.set({"dask-dl.split.seed": 5, "dask-dl.split.val-fraction": 0.25}):
        from_config = split_by_patient(_plain(), test_fraction=0.25)
    pd.testing.assert_series_equal(from_config["split"], catalog["split"])
    # A patient's split does not depend on who else is in the catalog.
    half = split_by_patient(_plain().iloc[::2], seed=5, val_fraction=0.25, test_fraction=0.25)
    assert half.set_index("image_id")["split"].equals(catalog.set_index("image_id")["split"].loc[half["image_id"]])


def test_split_by_patient_bad_fractions():
    with pytest.raises(ConfigurationError, match=r"val_fraction=1.5 is not a fraction"):
        split_by_patient(_plain(), val_fraction=1.5)
    with pytest.raises(ConfigurationError, match="leave no patients for training"):
        split_by_patient(_plain(), val_fraction=0.5, test_fraction=0.5)


# ---- class folders ----------------------------------------------------------------------------------------


def _png(path: Path, value: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((6, 6), value, np.uint8)).save(path)


def test_read_folders(tmp_path):
    root = tmp_path / "xrays"
    for name in ("normal/a.png", "normal/b.PNG", "normal/deep/c.jpg", "pneumonia/d.png", "covid/e.jpeg"):
        _png(root / name)
    (root / "normal" / "notes.txt").write_text("skip me")
    (root / "README.md").write_text("top-level files are not images of a class")
    catalog = read_folders(root, seed=0)
    assert catalog.attrs == {"labels": ["covid", "normal", "pneumonia"], "task": "multiclass"}
    assert list(catalog["image_id"]) == [
        "covid/e.jpeg",
        "normal/a.png",
        "normal/b.PNG",
        "normal/deep/c.jpg",
        "pneumonia/d.png",
    ]
    assert catalog[["covid", "normal", "pneumonia"]].to_numpy().tolist() == [
        [1, 0, 0],
        [0, 1, 0],
        [0, 1, 0],
        [0, 1, 0],
        [0, 0, 1],
    ]
    assert list(catalog["patient_id"]) == ["e", "a", "b", "c", "d"]
    assert set(catalog["site"]) == {"xrays"}
    assert catalog["path"].map(lambda p: Path(p).is_file()).all()
    assert len(read_folders(root, extensions=(".png",))) == 3
    assert set(read_folders(root, site="B")["site"]) == {"B"}


def test_read_folders_split_layout_and_patients(tmp_path):
    root = tmp_path / "split"
    for name in ("train/cat/1.png", "train/dog/2.png", "val/dog/3.png", "test/cat/4.png", "test/bird/5.png"):
        _png(root / name)
    catalog = read_folders(root)
    assert catalog.attrs["labels"] == ["bird", "cat", "dog"]
    assert dict(zip(catalog["image_id"], catalog["split"], strict=True)) == {
        "test/bird/5.png": "test",
        "test/cat/4.png": "test",
        "train/cat/1.png": "train",
        "train/dog/2.png": "train",
        "val/dog/3.png": "val",
    }
    # A patients table keeps a patient's images together; here it puts one patient in two splits.
    pd.DataFrame({"image_id": ["train/cat/1.png", "test/cat/4.png"], "patient_id": ["P", "P"]}).to_csv(
        root / "patients.csv", index=False
    )
    with pytest.raises(CatalogError, match="patient 'P' is in more than one split"):
        read_folders(root)
    flat = tmp_path / "flat"
    for i in range(40):
        _png(flat / ("a" if i % 2 else "b") / f"{i}.png")
    pd.DataFrame({"image_id": [f"{'a' if i % 2 else 'b'}/{i}.png" for i in range(40)], "patient_id": "same"}).to_csv(
        tmp_path / "pat.csv", index=False
    )
    catalog = read_folders(flat, patients=tmp_path / "pat.csv", val_fraction=0.3, test_fraction=0.3)
    assert set(catalog["patient_id"]) == {"same"} and catalog["split"].nunique() == 1
    with pytest.raises(StoreNotFoundError, match="no patients table"):
        read_folders(flat, patients=tmp_path / "absent.csv")
    (tmp_path / "badpat.csv").write_text("file,patient\nx,y\n")
    with pytest.raises(CatalogError, match=r"lacks the column\(s\) \['image_id', 'patient_id'\]"):
        read_folders(flat, patients=tmp_path / "badpat.csv")


def test_read_folders_empty(tmp_path):
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    (tmp_path / "empty" / "cls" / "x.txt").write_text("no image")
    with pytest.raises(CatalogError, match=r"no images with extensions .* root/<class>/<image>"):
        read_folders(tmp_path / "empty")
    with pytest.raises(StoreNotFoundError):
        read_folders(tmp_path / "absent")


# ---- read_catalog and Parquet -----------------------------------------------------------------------------


def test_read_catalog_dispatch(tmp_path, shared_data):
    nih = write_nih(tmp_path / "nih")
    assert read_catalog(nih).equals(read_nih(nih))
    assert read_catalog(nih / "Data_Entry_2017.csv").equals(read_nih(nih))
    assert read_catalog(nih, site="X", seed=4)["site"].eq("X").all()
    _png(tmp_path / "folders" / "a" / "1.png")
    assert read_catalog(tmp_path / "folders").attrs["task"] == "multiclass"
    dicom = read_catalog(shared_data / "dicom", id_from="path")
    assert sorted(dicom["image_id"]) == sorted(p.name for p in (shared_data / "dicom").glob("*.dcm"))
    assert read_catalog(tmp_path / "folders", layout="folders").equals(read_folders(tmp_path / "folders"))


def test_read_catalog_errors(tmp_path):
    with pytest.raises(StoreNotFoundError, match="does not exist"):
        read_catalog(tmp_path / "absent")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "notes.txt").write_text("x")
    (odd / "sub").mkdir()
    with pytest.raises(CatalogError, match=r"not a collection dask_dl understands; it holds \['notes.txt', 'sub/'\]"):
        read_catalog(odd)
    sites = tmp_path / "sites"
    write_nih(sites / "A")
    write_nih(sites / "B")
    with pytest.raises(CatalogError, match=r"NIH collections in \['A', 'B'\].*read_nih\(root / 'A', site='A'\)"):
        read_catalog(sites)
    assert set(read_catalog(sites / "A", site="A")["site"]) == {"A"}
    with pytest.raises(ConfigurationError, match=r"option\(s\) \['labels_csv'\] do not apply to a nih source"):
        read_catalog(sites / "A", labels_csv="x.csv")
    with pytest.raises(ConfigurationError, match="unknown layout 'zarr': the layouts are ") as info:
        read_catalog(sites / "A", layout="zarr")
    assert all(name in str(info.value) for name in ("parquet", "nih", "dicom", "folders"))


def test_parquet_round_trip(tmp_path):
    catalog = read_nih(write_nih(tmp_path / "nih"))
    write_catalog(catalog, tmp_path / "c.parquet")
    back = read_catalog(tmp_path / "c.parquet")
    assert back.attrs == catalog.attrs
    pd.testing.assert_frame_equal(back, catalog)
    folders = tmp_path / "f"
    _png(folders / "x" / "1.png")
    _png(folders / "y" / "2.png")
    multiclass = read_folders(folders)
    write_catalog(multiclass, str(tmp_path / "m.parquet"))
    assert read_catalog(str(tmp_path / "m.parquet")).attrs == {"labels": ["x", "y"], "task": "multiclass"}


def test_cli_catalog(tmp_path):
    train_val, test = official_lists()
    root = write_nih(tmp_path / "nih", lists=(train_val, test))
    out = tmp_path / "c.parquet"
    result = CliRunner().invoke(cli, ["catalog", str(root), "--out", str(out), "--val-fraction", "0"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "8 images, 6 patients, 1 site(s)"
    assert lines[1].split() == ["split", "train", "test"]
    assert lines[2].split() == ["images", "5", "3"]
    assert ["Hernia", "0", "2"] in [line.split() for line in lines]
    assert ["Cardiomegaly", "2", "0"] in [line.split() for line in lines]
    pd.testing.assert_frame_equal(read_catalog(out), read_nih(root, val_fraction=0))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "notes.txt").write_text("x")
    result = CliRunner().invoke(cli, ["catalog", str(tmp_path / "odd")])
    assert result.exit_code == 1 and "not a collection dask_dl understands" in result.output
    help_text = CliRunner().invoke(cli, ["catalog", "--help"]).output
    for option in ("--out", "--layout", "--site", "--seed", "--val-fraction", "--test-fraction", "--labels-csv"):
        assert option in help_text
