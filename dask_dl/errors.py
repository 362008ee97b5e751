"""Errors raised by dask_dl.

Each error derives from :class:`DaskDLError` and from the builtin a caller would catch anyway, so both
``except dask_dl.DaskDLError`` and ``except ValueError`` work. Messages say what is wrong, show the value and
show the fix.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class DaskDLError(Exception):
    """Base class of every error dask_dl raises on purpose."""


class CatalogError(DaskDLError, ValueError):
    """A collection's table is malformed: missing columns, unknown labels, duplicated ids, split conflicts."""


class StoreError(DaskDLError, ValueError):
    """A Zarr store does not fit the request: another shape, not a dask_dl store, or exists already."""


class StoreNotFoundError(DaskDLError, FileNotFoundError):
    """A store, collection root or file that was asked for does not exist."""


class DatasetError(DaskDLError, ValueError):
    """A dataset cannot be used as asked: a split is missing, labels are absent, a shard is too small."""


class IngestError(DatasetError):
    """An ingest kept no image, or rejected more than ``dask-dl.ingest.max-reject-share`` of them.

    The store and its rejects table are written all the same; ``rejects`` holds that table and ``counts`` the
    number of rejects per reason.
    """

    def __init__(self, message: str, *, rejects: object = None, counts: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.rejects = rejects
        self.counts = dict(counts or {})


class ClusterError(DaskDLError, RuntimeError):
    """The cluster cannot do what was asked, e.g. fewer workers than trainers."""


class CrossSiteError(ClusterError):
    """A site guard refused to move a site's data to another site's workers (a task, replicate or P2P shuffle)."""


class TrainingError(DaskDLError, RuntimeError):
    """Training failed: a non-finite loss, a trainer that died without a replacement, a bad checkpoint.

    ``lost_workers`` lists the addresses of trainer workers the scheduler lost during the run (empty otherwise).
    """

    def __init__(self, message: str = "", *, lost_workers: list[str] | None = None) -> None:
        super().__init__(message)
        self.lost_workers = list(lost_workers or [])


class CheckpointError(TrainingError):
    """A checkpoint file cannot be trusted: damaged, truncated, not a regular file, too large, or holding objects."""


class ConfigurationError(DaskDLError, ValueError):
    """An option has a value dask_dl does not know: unknown model, compressor or backend."""


class ExportError(DaskDLError, ValueError):
    """An ONNX export or ONNX file is not usable: parity failed, metadata missing, not an ONNX file."""


class MissingDependencyError(DaskDLError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def missing_dependency(package: str, extra: str, purpose: str) -> MissingDependencyError:
    """Return the error to raise when ``package`` (from extra ``extra``) is needed for ``purpose``."""
    return MissingDependencyError(
        f"{purpose} needs the '{package}' package, which is not installed; "
        f"install it with: pip install 'dask-dl[{extra}]'"
    )


def import_optional(module: str, *, extra: str, purpose: str, package: str | None = None) -> ModuleType:
    """Import ``module`` of an optional dependency, or raise :func:`missing_dependency`'s error for ``purpose``.

    >>> import_optional("json", extra="none", purpose="a doctest").__name__
    'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing_dependency(package or module.partition(".")[0], extra, purpose) from exc
