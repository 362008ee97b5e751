"""``import dask_dl`` must stay cheap: no torch, onnx, onnxruntime or cupy until they are used."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import dask_dl

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


def test_api_page_and_exports_agree():
    """docs/reference/api.md documents exactly ``dask_dl.__all__`` (before its "From their modules" section)."""
    import importlib
    import re
    from pathlib import Path

    import dask_dl

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "api.md").read_text()
    exported_part = page.split("## From their modules")[0]
    documented = re.findall(r"^::: (dask_dl[\w.]*)\.(\w+)$", exported_part, flags=re.M)
    names = {name for _, name in documented if name != "errors"}
    errors = {n for n in dask_dl.__all__ if n.endswith("Error")}
    expected = set(dask_dl.__all__) - errors - {"__version__"}
    assert names - expected == set(), "documented as importable from dask_dl but not exported"
    assert expected - names == set(), "exported by dask_dl but not documented in docs/reference/api.md"
    assert ("dask_dl", "errors") in documented  # the errors' page documents every error class
    for module, name in documented:
        if name != "errors":  # the page points at the object dask_dl exports, not a namesake
            assert getattr(importlib.import_module(module), name) is getattr(dask_dl, name), f"{module}.{name}"


@pytest.mark.slow
def test_scoring_does_not_import_torch():
    """predict and read_model_info need onnxruntime only: every scoring process (dask-dl predict, its workers)
    would otherwise pay torch's import (1.5 s here) for nothing."""
    code = "import sys, dask_dl, dask_dl.inference; dask_dl.read_model_info; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def _module_imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The dask_dl modules ``name`` imports, at the top or inside a function (made when first needed), but not
    under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # ``from package import module`` imports that module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def test_imports_run_one_way():
    """No import circle among dask_dl's modules: a drawing of the tree's imports has every arrow pointing down."""
    root = Path(dask_dl.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: _module_imports(path, name, set(paths)) for name, path in paths.items()}
    circles, state = [], {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                circles.append(" -> ".join(trail[trail.index(other) :] + [other]))
            elif other not in state:
                visit(other, trail + [other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, circles
