"""The benchmarks in bench/ still import what they use from dask_dl (they import inside functions, on workers,
where a moved module shows only when the benchmark runs)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

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
