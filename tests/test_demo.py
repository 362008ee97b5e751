"""``dask-dl demo`` end to end, as a user runs it: a real local cluster, real files, the printed report."""

import re
import subprocess
import sys

import pandas as pd
import pytest

import dask_dl


@pytest.mark.slow
def test_demo_command_end_to_end(tmp_path, cpu_hog):
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "dask_dl.cli",
        "demo",
        str(out),
        "--images",
        "400",
        "--size",
        "32",
        "--epochs",
        "2",
        "--quiet",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = proc.stdout
    # a successful job ends quietly, busy machine or not: no traceback, no worker killed at shutdown
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert "still alive" not in proc.stderr, proc.stderr
    assert not re.search(r"\b\w+Warning: ", proc.stdout + proc.stderr), proc.stderr  # e.g. a trainer's FutureWarning
    assert re.search(r"training\s+2 trainers, global batch 64, compression onebit", report), report

    data = re.search(r"data\s+([\d,]+) images \((\d+) rejected\), 32x32", report)
    assert data and int(data[1].replace(",", "")) == 400 and int(data[2]) == 0
    network = re.search(r"network\s+([\d,]+) bytes sent by the trainers in (\d+) steps vs ([\d,]+) for fp32", report)
    assert network, report
    sent, steps, full = int(network[1].replace(",", "")), int(network[2]), int(network[3].replace(",", ""))
    n_params = sum(p.numel() for p in dask_dl.build_model("small_cnn", num_outputs=14).parameters())
    assert full == 4 * n_params * steps * 2  # the uncompressed count it prints: fp32 gradients of 2 trainers
    assert 0 < sent < full / 25  # 1-bit SGD from the first step

    aurocs = [float(v) for v in re.findall(r"^\s+\w+\s+(\d\.\d{3})$", report, flags=re.M)]
    assert aurocs and all(0.0 <= v <= 1.0 for v in aurocs)
    assert re.search(r"test AUROC \(mean (\d\.\d{3})\)", report)

    for name in ("cxr.zarr", "model.onnx", "scores.parquet", "checkpoints"):
        assert (out / name).exists(), name
    scores = pd.read_parquet(out / "scores.parquet")
    test = dask_dl.open_dataset(out / "cxr.zarr", split="test")
    assert list(scores["image_id"]) == list(test.image_id.values)  # every test image scored once, in order


def test_the_report_prints_a_dash_and_says_why_for_a_label_without_auroc():
    """A test split where a rare label has no positive image (small demos) has no AUROC for it: the report prints
    ``-`` and the line that says why, as ``dask-dl evaluate`` and ``dask-dl train`` do, not ``nan``."""
    from pathlib import Path

    from dask_dl.demo import DemoReport
    from dask_dl.metrics import NO_AUROC_NOTE

    figures = dict(n_images=400, n_rejected=0, image_size=32, store_bytes=1, ingest_images_per_s=1.0)
    figures |= dict(train_images_per_s=1.0, compute_s=1.0, comm_s=0.1, data_wait_s=0.0, bytes_sent=1)
    figures |= dict(bytes_uncompressed=32, steps=1, compression="onebit", trainers=2, cost=0.0, currency="USD")
    auroc = pd.Series({"Effusion": 0.8125, "Hernia": float("nan")})
    report = DemoReport(out=Path("demo"), test_auroc=auroc, history=pd.DataFrame(), **figures)
    lines = str(report).splitlines()
    assert "  Effusion             0.812" in lines
    assert "  Hernia               -" in lines
    assert lines[lines.index("  Hernia               -") + 1] == f"  {NO_AUROC_NOTE}"
    assert "test AUROC (mean 0.812):" in lines  # the mean of the labels that have one
    assert NO_AUROC_NOTE not in str(
        DemoReport(out=Path("demo"), test_auroc=auroc.dropna(), history=pd.DataFrame(), **figures)
    )
