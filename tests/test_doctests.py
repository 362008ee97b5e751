"""The Examples sections of dask_dl's docstrings run, as doctests: an example that drifts from the code fails here.

Examples that need a store, a cluster or a GPU that a reader would have are marked ``# doctest: +SKIP``; the rest
run as written (a few start an in-process cluster, as a reader would).
"""

from __future__ import annotations

import doctest
import importlib
import sys
from pathlib import Path

import pytest

import dask_dl
from dask_dl.registry import Registry

PACKAGE = Path(dask_dl.__file__).parent


def _modules_with_examples() -> list[str]:
    """The dask_dl modules whose source has a ``>>>`` line, found without importing them."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py" or ">>> " not in path.read_text():
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def test_the_package_has_examples_to_run():
    assert len(MODULES) >= 40, MODULES  # a finder that found none would pass every test below


def _registries() -> list[tuple[Registry, dict]]:
    """Every registry of the dask_dl modules imported so far, with a copy of its entries."""
    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("dask_dl"):
            for value in list(vars(module).values()):
                if isinstance(value, Registry):
                    found[id(value)] = (value, dict(value._entries))
    return list(found.values())


# an example's LocalCluster asks for the dashboard's usual port, 8787, which a cluster of another test process
# (pytest -n 2) may hold: distributed then serves it on another port and says so
@pytest.mark.filterwarnings("ignore:Port 8787 is already in use:UserWarning")
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in doctest.DocTestFinder(exclude_empty=True).find(module, name) if t.examples]
    before = _registries()
    try:
        for test in tests:
            runner.run(test, out=report.append)
    finally:  # an example that registers a model must not add it for the tests after it (registries are global)
        for registry, entries in before:
            registry._entries.clear()
            registry._entries.update(entries)
    assert runner.failures == 0, "".join(report)
