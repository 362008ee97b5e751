"""Catalogs and score tables as Dask DataFrames (dask_dl.data.frames).

The pandas backend is tested here in full. The cudf backend needs cudf, dask-cudf and a GPU: here (no GPU, no
cudf) only its refusal is tested, which must name the ``gpu`` extra; the cudf tables themselves are tested in
tests/cluster/test_cluster_gpu.py, which runs where CUDA and cudf exist.
"""

from __future__ import annotations

import importlib.util

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import xarray as xr

from dask_dl import ConfigurationError, MissingDependencyError, make_catalog, scores_table, to_dask_dataframe

LABELS = ["Effusion", "Mass"]

no_cudf = pytest.mark.skipif(
    importlib.util.find_spec("cudf") is not None and importlib.util.find_spec("dask_cudf") is not None,
    reason="cudf and dask-cudf are installed here: the refusal without them cannot be tested",
)


def assert_same_table(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Equal rows, index and values; equal dtypes but for strings, which Dask keeps as its own string dtype."""
    pd.testing.assert_frame_equal(got, want, check_dtype=False)
    for column in want.columns:
        if not pd.api.types.is_string_dtype(want[column]):
            assert got[column].dtype == want[column].dtype, column
        else:
            assert pd.api.types.is_string_dtype(got[column]), column


@pytest.fixture
def catalog() -> pd.DataFrame:
    frame = pd.DataFrame(
        {
            "image_id": [f"img{i}.png" for i in range(7)],
            "path": [f"/data/img{i}.png" for i in range(7)],
            "patient_id": ["p0", "p0", "p1", "p2", "p2", "p3", "p4"],
            "site": ["A", "A", "B", "B", "A", "B", "A"],
            "split": ["train", "train", "val", "test", "test", "train", "val"],
            "Effusion": [1, 0, 0, 1, 1, 0, 0],
            "Mass": [0, 0, 1, 0, 1, 1, 0],
            "age": [34.0, 35.0, 61.0, 7.0, 8.0, 50.0, 44.0],
        }
    )
    return make_catalog(frame, LABELS)


def test_a_catalog_becomes_a_dask_dataframe_of_the_same_rows_and_labels(catalog):
    frame = to_dask_dataframe(catalog, backend="pandas", npartitions=3)
    assert isinstance(frame, dd.DataFrame) and frame.npartitions == 3
    assert frame.attrs == {"labels": LABELS, "task": "multilabel"}
    assert_same_table(frame.compute(), catalog)
    # a real Dask computation over the partitions agrees with pandas
    by_site = frame.groupby("site")["Effusion"].sum().compute().sort_index()
    expected = catalog.groupby("site")["Effusion"].sum().sort_index()
    pd.testing.assert_series_equal(by_site, expected, check_index_type=False)


def test_rows_keep_their_order_and_index_and_small_tables_are_one_partition(catalog):
    shuffled = catalog.iloc[[4, 0, 6, 2, 1, 5, 3]]
    frame = to_dask_dataframe(shuffled)  # dask's dataframe.backend: pandas
    assert frame.npartitions == 1
    assert_same_table(frame.compute(), shuffled)
    assert list(to_dask_dataframe(shuffled, npartitions=2).compute().index) == [4, 0, 6, 2, 1, 5, 3]


def test_bad_backend_and_partitions_are_configuration_errors(catalog):
    with pytest.raises(ConfigurationError, match=r"unknown backend 'polars': use one of pandas, cudf"):
        to_dask_dataframe(catalog, backend="polars")
    with pytest.raises(ConfigurationError, match=r"npartitions must be a positive integer, got 0"):
        to_dask_dataframe(catalog, npartitions=0)


@no_cudf
def test_cudf_without_the_gpu_extra_says_what_to_install(catalog):
    with pytest.raises(MissingDependencyError) as info:
        to_dask_dataframe(catalog, backend="cudf")
    assert str(info.value).startswith("a table with the cudf backend needs the 'cudf-cu12' package")
    assert "pip install 'dask-dl[gpu]'" in str(info.value)
    assert isinstance(info.value, ImportError)
    # the default follows Dask's own switch: a site that set dataframe.backend: cudf asks for cudf
    with dask.config.set({"dataframe.backend": "cudf"}), pytest.raises(MissingDependencyError, match="dask-dl"):
        to_dask_dataframe(catalog)


def _scored_dataset(n: int = 6) -> tuple[xr.Dataset, np.ndarray]:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=(n, len(LABELS)), dtype=np.uint8)
    ds = xr.Dataset(
        {"label": (("sample", "finding"), labels)},
        coords={
            "sample": np.arange(10, 10 + n),
            "finding": LABELS,
            "image_id": ("sample", [f"i{i}" for i in range(n)]),
            "patient_id": ("sample", [f"p{i // 2}" for i in range(n)]),
            "split": ("sample", ["test"] * n),
            "site": ("sample", ["A", "B"] * (n // 2)),
        },
    )
    return ds, rng.random((n, len(LABELS)), dtype=np.float32)


def test_scores_table_as_a_dask_dataframe(catalog):
    ds, probs = _scored_dataset()
    table = scores_table(ds, probs)
    frame = scores_table(ds, da.from_array(probs, chunks=(4, 2)), backend="pandas")
    assert isinstance(table, pd.DataFrame) and isinstance(frame, dd.DataFrame)
    assert frame.attrs == {"labels": LABELS}
    assert_same_table(frame.compute(), table)
    assert frame["p_Mass"].dtype == np.float32 and frame["Mass"].dtype == np.uint8


@no_cudf
def test_scores_table_refuses_cudf_before_computing_the_scores():
    ds, probs = _scored_dataset()

    def boom(block):
        raise AssertionError("the scores were computed before the backend was checked")

    lazy = da.from_array(probs, chunks=(3, 2)).map_blocks(boom, dtype=np.float32)
    with pytest.raises(MissingDependencyError, match=r"pip install 'dask-dl\[gpu\]'"):
        scores_table(ds, lazy, backend="cudf")
