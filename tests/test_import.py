"""``import dask_dl`` must stay cheap: no torch, onnx, onnxruntime or cupy until they are used."""

import subprocess
import sys

HEAVY = ("torch", "onnx", "onnxruntime", "cupy", "torchvision", "skimage", "zarr", "xarray")


def test_import_is_cheap():
    code = (
        "import sys, dask_dl; "
        "dask_dl.__all__; dask_dl.DaskDLError; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import dask_dl imported {out.stdout.strip()}"


def test_public_names_resolve():
    import dask_dl

    for name in dask_dl.__all__:
        assert getattr(dask_dl, name) is not None, name


def test_cli_import_is_cheap():
    code = "import sys, dask_dl.cli; print(','.join(m for m in ('torch', 'onnx', 'zarr') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
