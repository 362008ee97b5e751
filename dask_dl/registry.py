"""One way to register named things: models, gradient compressors, catalog layouts.

A room keeps one :class:`Registry` and registers its entries at the bottom of the module that defines them, as
zarr registers codecs. Entries can be given lazily as ``"module:attribute"`` so that a registry can be listed (for
the CLI's choices and help) without importing torch. Lookups of unknown names raise a ConfigurationError that lists
the names and shows the fix.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dask_dl.errors import ConfigurationError

__all__ = ["Entry", "Registry"]


@dataclass(frozen=True)
class Entry:
    """A registered name: its target (an object, or ``"module:attribute"`` imported on first use) and a help line."""

    name: str
    target: Any
    help: str = ""

    def load(self) -> Any:
        """Return the registered object, importing it when it was registered by dotted path."""
        if isinstance(self.target, str):
            module, _, attribute = self.target.partition(":")
            return getattr(importlib.import_module(module), attribute)
        return self.target


class Registry:
    """Names of one kind (``"model"``, ``"compressor"``, ``"layout"``) mapped to what builds or reads them.

    Parameters
    ----------
    kind
        What the names are, for messages: ``unknown model 'x'``.
    argument
        The argument users pass the name in, for the fix in messages: ``pass e.g. model='small_cnn'``.

    Examples
    --------
    >>> shapes = Registry("shape", argument="shape")
    >>> @shapes.register("square", help="four equal sides")
    ... def square(side):
    ...     return side * side
    >>> shapes.get("square")(3)
    9
    >>> shapes.names()
    ['square']
    >>> shapes.get("circle")
    Traceback (most recent call last):
    ...
    dask_dl.errors.ConfigurationError: unknown shape 'circle': the shapes are square; pass e.g. shape='square'
    """

    def __init__(self, kind: str, *, argument: str | None = None) -> None:
        self.kind = kind
        self.argument = argument or kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, target: Any = None, *, help: str = "") -> Any:
        """Register ``target`` under ``name``; without ``target``, return a decorator that registers its argument.

        Raises
        ------
        ValueError
            When ``name`` is taken already (a programming error, not a user's).
        """
        if target is None:

            def decorator(obj: Any) -> Any:
                self.register(name, obj, help=help)
                return obj

            return decorator
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered already (as {self._entries[name].target!r})")
        self._entries[name] = Entry(name, target, help)
        return target

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def entry(self, name: str) -> Entry:
        """The :class:`Entry` of ``name``; a ConfigurationError listing the names when there is none."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            example = next(iter(self._entries), "...")
            raise ConfigurationError(
                f"unknown {self.kind} {name!r}: the {self.kind}s are {', '.join(self._entries) or 'none'}; "
                f"pass e.g. {self.argument}={example!r}"
            ) from None

    def get(self, name: str) -> Any:
        """The object registered as ``name`` (imported on first use when registered by path)."""
        return self.entry(name).load()

    def help(self) -> dict[str, str]:
        """``{name: help line}`` of every entry, for CLI help and docs."""
        return {e.name: e.help for e in self._entries.values()}

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"
