"""Argument checks shared by every room.

One rule for errors: a bad *argument* (a value the caller passed or configured) is a
:class:`~dask_dl.errors.ConfigurationError`; bad *data* (a store, a table, an image) is a
:class:`~dask_dl.errors.DatasetError` or one of its siblings. The checks here are for arguments.
"""

from __future__ import annotations

import numbers
from typing import Any

from dask_dl.errors import ConfigurationError

__all__ = ["byte_count", "one_of", "positive_int"]


def positive_int(name: str, value: Any, *, example: int | None = None) -> int:
    """Return ``value`` as an ``int`` when it is an integer >= 1, else raise a ConfigurationError.

    Booleans and floats are refused even when integral (``True`` or ``2.0`` for a count is a bug in the caller).

    Parameters
    ----------
    name
        The argument's name as the user wrote it (``"epochs"``, ``"--images"``).
    value
        What was passed.
    example
        A value to suggest in the message; default 1 or the nearest positive integer.

    Raises
    ------
    ConfigurationError

    Examples
    --------
    >>> positive_int("epochs", 3)
    3
    >>> positive_int("epochs", 0)
    Traceback (most recent call last):
    ...
    dask_dl.errors.ConfigurationError: epochs must be a positive integer, got 0; pass e.g. epochs=1
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
        return int(value)
    if example is None:
        example = max(int(value), 1) if isinstance(value, numbers.Real) and value == value else 1
    raise ConfigurationError(f"{name} must be a positive integer, got {value!r}; pass e.g. {name}={example}")


def byte_count(name: str, value: Any, *, example: str = "1 GiB") -> int:
    """Return ``value`` as a number of bytes >= 0: an integer, or a size such as ``"512 MiB"``.

    Examples
    --------
    >>> byte_count("cache", "1 KiB")
    1024
    >>> byte_count("cache", 0)
    0

    Anything else (``"lots"``, ``-1``, ``1.5``, ``True``) raises a ConfigurationError that shows the value and
    an example.
    """
    from dask.utils import parse_bytes

    parsed: Any = value
    if isinstance(value, str):
        try:
            parsed = parse_bytes(value)
        except ValueError:
            parsed = None
    if isinstance(parsed, numbers.Integral) and not isinstance(parsed, bool) and parsed >= 0:
        return int(parsed)
    raise ConfigurationError(
        f"{name} must be a number of bytes >= 0 or a size such as {example!r}, got {value!r}; "
        f"pass e.g. {name}={example!r}"
    )


def one_of(name: str, value: Any, choices: Any) -> Any:
    """Return ``value`` when it is among ``choices``, else raise a ConfigurationError listing them.

    Examples
    --------
    >>> one_of("optimizer", "sgd", ("sgd", "adamw"))
    'sgd'
    """
    choices = list(choices)
    if value in choices:
        return value
    raise ConfigurationError(f"unknown {name} {value!r}: use one of {', '.join(map(str, choices))}")
