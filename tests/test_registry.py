"""dask_dl.registry: one registration pattern for models, compressors and catalog layouts."""

from __future__ import annotations

import pytest

from dask_dl.errors import ConfigurationError
from dask_dl.registry import Registry


def test_register_lookup_and_lazy_entries():
    reg = Registry("thing", argument="thing")
    reg.register("dumps", "json:dumps", help="JSON text")
    reg.register("len", len)
    assert reg.names() == ["dumps", "len"]
    assert reg.get("dumps")([1]) == "[1]"  # imported on first use
    assert reg.get("len")("abc") == 3
    assert reg.help() == {"dumps": "JSON text", "len": ""}
    assert "len" in reg and "nope" not in reg and len(reg) == 2


def test_unknown_names_list_the_choices_and_taken_names_are_refused():
    reg = Registry("model", argument="model")
    reg.register("a", object())
    with pytest.raises(ConfigurationError, match=r"unknown model 'b': the models are a; pass e.g. model='a'"):
        reg.get("b")
    with pytest.raises(ConfigurationError, match="unknown model"):
        reg.get(["unhashable"])
    with pytest.raises(ValueError, match="registered already"):
        reg.register("a", object())
