"""Hypothesis fuzzing of the catalog readers and the image/DICOM decoders.

Whatever bytes a collection holds, a reader returns a catalog or raises a dask_dl error, and the decoder returns a
``(size, size)`` uint8 image or raises ImageRejected: never another exception (which would fail a whole ingest
task) and never a hang (the per-test timeout). The normal suite runs a few hundred cases; ``-m fuzz`` runs many more.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from dask_dl.data.catalog import parse_findings, read_nih
from dask_dl.data.images import ImageRejected, load_image
from dask_dl.data.nih import NIH_HEADER
from dask_dl.data.schema import NIH_LABELS, read_parquet_catalog
from dask_dl.errors import DaskDLError
from dask_dl.testing.data import write_dicom

SIZE = 16
# the autouse fixture below only skips; it holds no state between examples
_CHECKS = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
QUICK = settings(max_examples=60, deadline=None, suppress_health_check=_CHECKS, derandomize=True)
LONG = settings(max_examples=2000, deadline=None, suppress_health_check=_CHECKS)
WORK = Path(tempfile.mkdtemp(prefix="dask-dl-fuzz-"))


@pytest.fixture(autouse=True)
def _long_runs_only_when_asked(request):
    if request.node.get_closest_marker("fuzz") and "fuzz" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("long fuzzing run: select it with -m fuzz")


def _seeds() -> dict[str, bytes]:
    """Valid small files of every format the decoder reads: the starting points of the mutations."""
    rng = np.random.default_rng(0)
    gray = rng.integers(0, 256, (24, 20), dtype=np.uint8)
    out = {}
    for name, image, fmt in [
        ("gray.png", Image.fromarray(gray), "PNG"),
        ("rgba.png", Image.fromarray(np.dstack([gray] * 4)), "PNG"),
        ("sixteen.png", Image.fromarray(gray.astype(np.uint16) * 257), "PNG"),
        ("palette.gif", Image.fromarray(gray).convert("P"), "GIF"),
        ("photo.jpg", Image.fromarray(np.dstack([gray] * 3)), "JPEG"),
        ("scan.bmp", Image.fromarray(gray), "BMP"),
        ("scan.tif", Image.fromarray(gray), "TIFF"),
    ]:
        buffer = io.BytesIO()
        image.save(buffer, format=fmt)
        out[name] = buffer.getvalue()
    path = WORK / "seed.dcm"
    write_dicom(path, (gray.astype(np.uint16) * 16), WindowCenter=2048, WindowWidth=4096)
    out["chest.dcm"] = path.read_bytes()
    return out


SEEDS = _seeds()


@st.composite
def mutated(draw) -> tuple[str, bytes]:
    """A seed file with some bytes changed, inserted or cut, or plain random bytes behind a magic number."""
    name = draw(st.sampled_from(sorted(SEEDS)))
    data = bytearray(SEEDS[name])
    if draw(st.integers(0, 9)) == 0:
        magic = draw(st.sampled_from([b"\x89PNG\r\n\x1a\n", bytes(128) + b"DICM", b"BM", b"II*\x00", b""]))
        return name, magic + draw(st.binary(max_size=400))
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return name, bytes(data)


def check_decoder(case: tuple[str, bytes]) -> None:
    name, data = case
    path = WORK / f"case-{name}"
    path.write_bytes(data)
    try:
        image = load_image(path, size=SIZE)
    except ImageRejected as exc:
        assert exc.reason in ("undecodable", "truncated", "too_small", "unsupported", "too_large", "degenerate")
        return
    assert image.shape == (SIZE, SIZE) and image.dtype == np.uint8


@st.composite
def nih_lines(draw) -> str:
    """Data lines of an NIH table: well-formed ones with fuzzed fields, and arbitrary text."""
    field = st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\r"), max_size=12)
    lines = []
    for i in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            findings = draw(st.sampled_from(["No Finding", "Mass", "Mass|Edema", "Infiltrate", "", "Mass|No Finding"]))
            values = [f"{i:08d}_000.png", findings, "0", str(i), "58", "M", "PA", "2500", "2048", "0.14", "0.14"]
            for _ in range(draw(st.integers(0, 2))):
                values[draw(st.integers(0, 10))] = draw(field)
            lines.append(",".join(values) + ("," if draw(st.booleans()) else ""))
        else:
            lines.append(draw(field))
    return "\n".join([NIH_HEADER, *lines]) + "\n"


def check_nih(text: str) -> None:
    root = Path(tempfile.mkdtemp(dir=WORK))
    (root / "Data_Entry_2017.csv").write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        catalog = read_nih(root)
    except DaskDLError:
        return
    assert list(catalog.attrs["labels"]) == list(NIH_LABELS)


def check_parquet(data: bytes) -> None:
    path = WORK / "fuzz.parquet"
    path.write_bytes(data)
    with pytest.raises(DaskDLError):
        read_parquet_catalog(str(path))


def check_findings(values: list[str]) -> None:
    try:
        out = parse_findings(pd.Series(values, dtype=object), labels=NIH_LABELS)
    except DaskDLError:
        return
    assert out.shape == (len(values), len(NIH_LABELS)) and set(np.unique(out.to_numpy())) <= {0, 1}


# ---- the normal suite: a few hundred cases, derandomized ------------------------------------------------------


@pytest.mark.timeout(240)
@QUICK
@given(mutated())
def test_decoder_survives_mutated_files(case):
    check_decoder(case)


@pytest.mark.timeout(240)
@QUICK
@given(nih_lines())
def test_nih_reader_survives_fuzzed_tables(text):
    check_nih(text)


@pytest.mark.timeout(120)
@QUICK
@given(st.one_of(st.binary(max_size=300), st.binary(max_size=300).map(lambda b: b"PAR1" + b + b"PAR1")))
def test_parquet_reader_refuses_garbage(data):
    check_parquet(data)


@pytest.mark.timeout(120)
@QUICK
@given(st.lists(st.text(max_size=30), min_size=1, max_size=6))
@pytest.mark.slow
def test_findings_parser_survives_any_text(values):
    check_findings(values)


# ---- -m fuzz: many more ---------------------------------------------------------------------------------------


@pytest.mark.fuzz
@pytest.mark.timeout(3600)
@LONG
@given(mutated())
def test_decoder_fuzz_long(case):
    check_decoder(case)


@pytest.mark.fuzz
@pytest.mark.timeout(3600)
@LONG
@given(nih_lines())
def test_nih_reader_fuzz_long(text):
    check_nih(text)
