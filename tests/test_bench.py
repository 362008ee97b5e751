"""The benchmarks in bench/ still import what they use from dask_dl (they import inside functions, on workers,
where a moved module shows only when the benchmark runs)."""

from __future__ import annotations

import ast
import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def dask_dl_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every import of dask_dl in ``path``, at any depth (``name`` None: the module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and node.module.split(".")[0] == "dask_dl"
        ):
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "dask_dl"]
    return found


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_benchmark_imports_resolve(path):
    imports = dask_dl_imports(path)
    missing = []
    for line, module, name in imports:
        try:
            imported = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{path.name}:{line}: import {module} ({exc})")
            continue
        if name is not None and not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{path.name}:{line}: from {module} import {name}")
    assert not missing, "\n".join(missing)


def test_the_check_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "b.py"
    source.write_text("def f():\n    from dask_dl.train import allocator\n    import dask_dl.data\n")
    assert dask_dl_imports(source) == [(2, "dask_dl.train", "allocator"), (3, "dask_dl.data", None)]
    with pytest.raises(AssertionError, match=r"b.py:2: from dask_dl.train import allocator"):
        test_benchmark_imports_resolve(source)


# ---- bench/nih_full.py at a tiny size ---------------------------------------------------------------------------


def load_bench(name: str):
    """A bench script as the module ``name`` (bench/ is a folder of scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_nih_full_figures_and_store(cluster_client, shared_data, tmp_path):
    import pandas as pd

    import dask_dl
    from dask_dl.data.images import load_image

    bench = load_bench("nih_full")
    root = bench.write_collection(tmp_path / "cache", 8, shared=shared_data, side=256, processes=2)
    names = sorted(p.name for p in (root / "images").iterdir())
    table = pd.read_csv(shared_data / "nih" / "Data_Entry_2017_v2020.csv.gz", nrows=8)
    assert names == sorted(table["Image Index"])  # the real table's first rows, one file each
    data = [(root / "images" / name).read_bytes() for name in names]
    assert len(set(data)) == 8 and all(d[16:24] == bytes.fromhex("0000010000000100") for d in data)  # 256x256
    figures = bench.run(root, str(tmp_path / "nih.zarr"), cluster_client, size=32, shared=shared_data)
    assert figures["images"] == 8 and figures["side"] == 256 and figures["workers"] == 2
    assert 0 < figures["ratio"] < 20 and figures["floor_rate"] > 0 and figures["ingest_rate"] > 0
    assert figures["ratio"] == pytest.approx(figures["floor_rate"] / figures["ingest_rate"])
    # CPU time comes in 10 ms ticks: 8 small images' floor may read 0, and then the ratio is NaN, not a division
    assert figures["ingest_cpu_ms"] > 0 and figures["floor_cpu_ms"] >= 0
    if figures["floor_cpu_ms"]:
        assert figures["cpu_ratio"] == pytest.approx(figures["ingest_cpu_ms"] / figures["floor_cpu_ms"])
    else:
        assert math.isnan(figures["cpu_ratio"])
    assert all(100 < mib < 4000 for mib in (figures["rss_idle_mib"], *figures["rss_ingest_mib"]))
    assert figures["nih_hours"] == pytest.approx(112_120 / figures["ingest_rate"] / 3600)
    assert figures["real_file_mb"] == [pytest.approx(0.182547), pytest.approx(0.178781)]
    lines = bench.report(figures)
    assert any(line.startswith("ingest / floor (time)") for line in lines)
    assert any("last-quarter peak" in line for line in lines) and "112,120" in lines[-1]
    # the store: 8 images, each the resized file, with the labels of its row of the real table
    ds = dask_dl.open_dataset(tmp_path / "nih.zarr")
    assert ds.image.shape == (8, 32, 32) and bool(ds.valid.all())
    findings = dict(zip(table["Image Index"], table["Finding Labels"], strict=True))
    for i, image_id in enumerate(ds.image_id.values):
        np.testing.assert_array_equal(ds.image.values[i], load_image(root / "images" / image_id, size=32))
        expected = set(findings[image_id].split("|")) - {"No Finding"}
        assert {str(f) for f in ds.finding.values[ds.label.values[i] == 1]} == expected


@pytest.mark.slow
def test_nih_full_command_prints_and_cleans_up(shared_data, tmp_path, monkeypatch, capsys):
    import tempfile

    bench = load_bench("nih_full")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    argv = ["--images", "4", "--side", "128", "--size", "32", "--workers", "1", "--cache", str(tmp_path / "cache")]
    figures = bench.main([*argv, "--shared", str(shared_data)])
    out = capsys.readouterr().out
    assert "4 NIH-layout PNGs 128x128 -> 32x32, 1 workers" in out and f"{figures['ratio']:8.3f}" in out
    assert list((tmp_path / "tmp").glob("dask_dl_nih_full_*")) == []  # the store went with its temporary folder
    assert len(list((tmp_path / "cache" / "images").iterdir())) == 4  # the collection stays for the next run
