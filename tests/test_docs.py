"""The documentation builds with mkdocs in strict mode: every page, link and API reference resolves."""

import subprocess
import sys
from pathlib import Path

import pytest

# A strict mkdocs build of the whole site: for the full run only.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    for command in ("demo", "synth", "catalog", "ingest", "summary", "train", "export", "predict", "info"):
        assert f"dask-dl {command}" in cli_page, command  # the CLI reference is generated from the CLI itself
    api_page = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "open_dataset" in api_page and "export_onnx" in api_page
