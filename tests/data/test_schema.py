"""The canonical catalog table (dask_dl.data.schema): validation, dtypes, Parquet with attrs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dask_dl.data.schema import (
    NIH_LABELS,
    labels_of,
    make_catalog,
    read_parquet_catalog,
    task_of,
    validate_catalog,
    write_catalog,
)
from dask_dl.errors import CatalogError, StoreNotFoundError


def frame(n: int = 6) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "image_id": [f"img{i}.png" for i in range(n)],
            "path": [f"/data/img{i}.png" for i in range(n)],
            "patient_id": [f"p{i // 2}" for i in range(n)],
            "site": "A",
            "split": (["train", "train", "val", "val", "test", "test"] * n)[:n],
            "Mass": [1, 0, 0, 1, 0, 0][:n] + [0] * max(0, n - 6),
            "Nodule": [0, 1, 1, 0, 0, 1][:n] + [0] * max(0, n - 6),
            "age": np.arange(n, dtype=np.float64) + 40,
        }
    )


def test_nih_labels_are_the_published_fourteen():
    assert len(NIH_LABELS) == 14 and len(set(NIH_LABELS)) == 14
    assert NIH_LABELS[0] == "Atelectasis" and NIH_LABELS[3] == "Infiltration" and NIH_LABELS[-1] == "Hernia"


def test_make_catalog_canonical_dtypes():
    raw = frame()
    raw["patient_id"] = [0, 0, 1, 1, 2, 2]  # ints become strings
    raw["Mass"] = raw["Mass"].astype("int64")
    raw["Nodule"] = raw["Nodule"].astype(float)
    catalog = make_catalog(raw, ["Mass", "Nodule"])
    assert catalog.attrs == {"labels": ["Mass", "Nodule"], "task": "multilabel"}
    assert labels_of(catalog) == ["Mass", "Nodule"] and task_of(catalog) == "multilabel"
    assert catalog["Mass"].dtype == np.uint8 and catalog["Nodule"].dtype == np.uint8
    assert catalog["patient_id"].tolist() == ["0", "0", "1", "1", "2", "2"]
    assert catalog["Nodule"].tolist() == [0, 1, 1, 0, 0, 1]
    assert catalog["age"].dtype == np.float64  # metadata kept as is
    assert raw.attrs == {} and raw["Mass"].dtype == np.int64  # the input is not changed


def test_extra_attrs_survive_validation():
    raw = frame()
    raw.attrs = {"labels": ["Mass"], "task": "multilabel", "source": "test"}
    assert validate_catalog(raw).attrs == {"labels": ["Mass"], "task": "multilabel", "source": "test"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.drop(columns="site"), r"lacks the column\(s\) \['site'\]"),
        (lambda f: f.drop(columns="Nodule"), r"lacks the column\(s\) \['Nodule'\]"),
        (
            lambda f: f.assign(image_id=["a", "b", "a", "c", "d", "e"]),
            r"image_id 'a' appears more than once \(rows 0, 2\)",
        ),
        (lambda f: f.assign(split=["train", "valid"] * 3), r"split 'valid' in rows 1, 3, 5 is not one of"),
        (lambda f: f.assign(split=["train", "test"] * 3), r"patient 'p0' is in more than one split.*split_by_patient"),
        (lambda f: f.assign(Mass=[0, 1, 2, 0, 0, 0]), r"'Mass' has values other than 0/1 in rows 2 \(e.g. 2\)"),
        (lambda f: f.assign(Mass=[0, 1, np.nan, 0, 0, 0]), r"'Mass' has values other than 0/1 in rows 2"),
        (lambda f: f.assign(patient_id=["p0", "p0", None, "p1", "p2", "p2"]), r"'patient_id' is empty in rows 2"),
        (lambda f: f.assign(path=["", "x", "x", "x", "x", "x"]), r"'path' is empty in rows 0"),
    ],
)
def test_validate_errors(change, message):
    with pytest.raises(CatalogError, match=message):
        make_catalog(change(frame()), ["Mass", "Nodule"])


def test_patients_compare_as_strings():
    raw = frame()
    raw["patient_id"] = pd.Series([1, "1", 2, 2, 3, 3], dtype=object)  # 1 and "1" are one patient
    raw["split"] = ["train", "val", "val", "val", "test", "test"]
    with pytest.raises(CatalogError, match="patient '1' is in more than one split"):
        make_catalog(raw, ["Mass"])


def test_attrs_errors():
    raw = frame()
    with pytest.raises(CatalogError, match=r"no label names in catalog.attrs\['labels'\]"):
        validate_catalog(raw)
    with pytest.raises(CatalogError, match="task'] is 'regression'"):
        make_catalog(raw, ["Mass"], task="regression")
    with pytest.raises(CatalogError, match=r"names \['Mass'\] more than once"):
        make_catalog(raw, ["Mass", "Mass"])


def test_multiclass_needs_one_label_per_row():
    raw = frame()
    raw["Nodule"] = 1 - raw["Mass"]
    assert make_catalog(raw, ["Mass", "Nodule"], task="multiclass").attrs["task"] == "multiclass"
    raw.loc[4, "Nodule"] = 0
    with pytest.raises(CatalogError, match="exactly one label per row; rows 4 have 0"):
        make_catalog(raw, ["Mass", "Nodule"], task="multiclass")


def test_parquet_round_trip(tmp_path):
    catalog = make_catalog(frame(), ["Mass", "Nodule"], task="multilabel")
    catalog.attrs["source"] = "unit test"
    write_catalog(catalog, str(tmp_path / "c.parquet"))
    back = read_parquet_catalog(str(tmp_path / "c.parquet"))
    assert back.attrs == {"labels": ["Mass", "Nodule"], "task": "multilabel", "source": "unit test"}
    pd.testing.assert_frame_equal(back, catalog)
    relabelled = read_parquet_catalog(str(tmp_path / "c.parquet"), labels=["Nodule"])
    assert relabelled.attrs["labels"] == ["Nodule"]


def test_write_validates(tmp_path):
    bad = make_catalog(frame(), ["Mass"])
    bad.loc[0, "split"] = "holdout"
    with pytest.raises(CatalogError, match="split 'holdout'"):
        write_catalog(bad, str(tmp_path / "bad.parquet"))
    assert not (tmp_path / "bad.parquet").exists()


def test_foreign_parquet(tmp_path):
    path = str(tmp_path / "foreign.parquet")
    pq.write_table(pa.Table.from_pandas(frame(), preserve_index=False), path)
    with pytest.raises(CatalogError, match=r"no dask_dl metadata.*pass labels=\[...\]"):
        read_parquet_catalog(path)
    catalog = read_parquet_catalog(path, labels=["Mass", "Nodule"], task="multilabel")
    assert catalog.attrs == {"labels": ["Mass", "Nodule"], "task": "multilabel"}
    assert catalog["Mass"].dtype == np.uint8


def test_missing_and_broken_parquet(tmp_path):
    with pytest.raises(StoreNotFoundError, match="no Parquet catalog"):
        read_parquet_catalog(str(tmp_path / "absent.parquet"))
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(CatalogError, match="is not a Parquet file"):
        read_parquet_catalog(str(tmp_path / "text.parquet"))
