"""Where a catalog's paths may point, and reading them safely: regular files only, with a size limit.

A catalog can come from elsewhere (a Parquet file someone sent), and its ``path`` column decides what the workers
open. :class:`PathPolicy` says which URL schemes and which roots are allowed (``dask-dl.ingest.allowed-schemes``,
``dask-dl.ingest.allowed-roots``) and how large a file may be (``dask-dl.ingest.max-file-bytes``);
:meth:`PathPolicy.read` returns a file's bytes or raises :class:`~dask_dl.data.rejects.ImageRejected`, so each bad
path is one reject row: a FIFO is never opened for a blocking read, ``/dev/zero`` is not a regular file, a path
with a NUL byte is refused, ``http://`` is refused unless allowed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dask_dl import config
from dask_dl.checks import positive_int
from dask_dl.data.rejects import ImageRejected
from dask_dl.errors import ConfigurationError

__all__ = ["PathPolicy"]

_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a folder",
    stat.S_IFSOCK: "a socket",
}


@dataclass(frozen=True)
class PathPolicy:
    """Which paths ingest may read, and how much of each.

    Parameters
    ----------
    schemes
        Allowed URL schemes; ``file`` covers plain local paths. Default ``dask-dl.ingest.allowed-schemes``.
    roots
        When not empty, every path (after resolving symbolic links and ``..``) must lie under one of these
        folders or URL prefixes. Default ``dask-dl.ingest.allowed-roots``.
    max_file_bytes
        Largest file read. Default ``dask-dl.ingest.max-file-bytes``.

    Examples
    --------
    >>> policy = PathPolicy(schemes=("file", "s3"), roots=(), max_file_bytes=1024)
    >>> policy.check("http://example.org/x.png")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dask_dl.data.rejects.ImageRejected: refused: http://example.org/x.png: the scheme 'http' is not allowed ...
    """

    schemes: tuple[str, ...] = ("file", "s3", "gs", "gcs", "az", "abfs", "abfss")
    roots: tuple[str, ...] = ()
    max_file_bytes: int = 256 * 2**20

    @classmethod
    def from_config(
        cls,
        *,
        schemes: Sequence[str] | None = None,
        roots: Sequence[str] | None = None,
        max_file_bytes: int | None = None,
    ) -> PathPolicy:
        """The policy of the arguments, falling back to ``dask-dl.ingest.*``; a ConfigurationError when malformed."""
        schemes = config.get("ingest.allowed-schemes", schemes)
        roots = config.get("ingest.allowed-roots", roots) or ()
        if isinstance(schemes, str) or isinstance(roots, str):
            raise ConfigurationError(
                "dask-dl.ingest.allowed-schemes and allowed-roots are lists, e.g. ['file', 's3'] and ['/data']"
            )
        resolved = tuple(r if "://" in str(r) else os.path.realpath(os.path.expanduser(str(r))) for r in roots)
        return cls(
            schemes=tuple(str(s).lower() for s in schemes),
            roots=resolved,
            max_file_bytes=positive_int(
                "max_file_bytes", config.get("ingest.max-file-bytes", max_file_bytes), example=256 * 2**20
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"schemes": list(self.schemes), "roots": list(self.roots), "max_file_bytes": self.max_file_bytes}

    def check(self, path: str) -> str:
        """Return the path to open (local paths resolved) or raise ImageRejected('refused')."""
        if "\x00" in path:
            raise ImageRejected("refused", path.replace("\x00", "\\x00"), "the path holds a NUL byte")
        scheme, local = _scheme(path)
        if scheme not in self.schemes:
            raise ImageRejected(
                "refused",
                path,
                f"the scheme {scheme!r} is not allowed (dask-dl.ingest.allowed-schemes is {list(self.schemes)}); "
                f"allow it with dask.config.set({{'dask-dl.ingest.allowed-schemes': {[*self.schemes, scheme]!r}}})",
            )
        target = os.path.realpath(local) if local is not None else path
        if self.roots and not any(_under(target, root) for root in self.roots):
            raise ImageRejected(
                "refused",
                path,
                f"{target} is outside the allowed roots {list(self.roots)} (dask-dl.ingest.allowed-roots); "
                "add its folder there to allow it",
            )
        return target

    def read(self, path: str) -> bytes:
        """The bytes of the file at ``path``: a regular file (or object) of at most ``max_file_bytes``.

        Raises
        ------
        ImageRejected
            ``refused`` (scheme, root, NUL byte), ``missing``, ``unreadable`` (not a regular file, I/O error),
            ``too_large``.
        """
        target = self.check(path)
        if "://" in target:
            return self._read_remote(target)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then tells what was opened
            fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise ImageRejected("missing", path, "no such file") from None
        except OSError as exc:
            raise ImageRejected("unreadable", path, f"{type(exc).__name__}: {exc.strerror or exc}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
                raise ImageRejected("unreadable", path, f"{kind}, not a regular file: only files are read")
            if info.st_size > self.max_file_bytes:
                raise ImageRejected("too_large", path, self._too_large(info.st_size))
            with os.fdopen(os.dup(fd), "rb") as f:
                # read(n) allocates n bytes up front: ask for the file's size, not for max_file_bytes (a fresh
                # 256 MiB mapping per image, page-faulted in as it fills)
                data = f.read(info.st_size + 1)
                if len(data) > info.st_size:  # it grew after fstat
                    data += f.read(self.max_file_bytes + 1 - len(data))
        except OSError as exc:
            raise ImageRejected("unreadable", path, f"{type(exc).__name__}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        if len(data) > self.max_file_bytes:  # it grew after fstat
            raise ImageRejected("too_large", path, self._too_large(len(data)))
        return data

    def _read_remote(self, url: str) -> bytes:
        import fsspec

        try:
            fs, inner = fsspec.core.url_to_fs(url)
            info = fs.info(inner)
            if info.get("type", "file") != "file":
                raise ImageRejected("unreadable", url, f"a {info.get('type')}, not a file: only files are read")
            size = info.get("size")
            if size is not None and size > self.max_file_bytes:
                raise ImageRejected("too_large", url, self._too_large(int(size)))
            with fs.open(inner, "rb") as f:
                data = f.read(self.max_file_bytes + 1)
        except FileNotFoundError:
            raise ImageRejected("missing", url, "no such file") from None
        except ImageRejected:
            raise
        except Exception as exc:  # fsspec backends raise their own errors (aiohttp, botocore, ...)
            raise ImageRejected("unreadable", url, f"{type(exc).__name__}: {exc}") from None
        if len(data) > self.max_file_bytes:
            raise ImageRejected("too_large", url, self._too_large(len(data)))
        return data

    def _too_large(self, size: int) -> str:
        return (
            f"the file has {size} bytes, over dask-dl.ingest.max-file-bytes = {self.max_file_bytes}; raise it if "
            "such files are images you want"
        )


def _scheme(path: str) -> tuple[str, str | None]:
    """``(scheme, local path or None)``: ``file`` with the path for local files, else the URL's scheme."""
    if path.startswith("file://"):
        return "file", path.removeprefix("file://")
    if "://" in path:
        return path.split("://", 1)[0].lower(), None
    return "file", os.path.expanduser(path)


def _under(target: str, root: str) -> bool:
    if "://" in root:
        return target.startswith(root.rstrip("/") + "/")
    return target == root or target.startswith(root.rstrip(os.sep) + os.sep)
