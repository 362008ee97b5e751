"""Collection roots: a folder, local or behind an fsspec URL, listed the fast way for each."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

__all__ = ["CollectionRoot"]


class CollectionRoot:
    """A collection folder, local or behind an fsspec URL (``s3://``, ``gs://``, ``memory://`` ...).

    Local paths stay plain absolute OS paths in the catalog; remote ones are full URLs, so that workers can
    open them with fsspec.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        text = os.fspath(root)
        if "://" not in text:
            text = str(Path(text).expanduser().absolute())
        self.fs, path = fsspec.core.url_to_fs(text)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.path = path.rstrip("/") or "/"

    def join(self, *parts: str) -> str:
        return (os.path.join if self.local else posixpath.join)(self.path, *parts)

    def url(self, path: str) -> str:
        return path if self.local else self.fs.unstrip_protocol(path)

    def __str__(self) -> str:
        return self.url(self.path)

    def isdir(self, *parts: str) -> bool:
        return self.fs.isdir(self.join(*parts))

    def isfile(self, *parts: str) -> bool:
        return self.fs.isfile(self.join(*parts))

    def names(self) -> list[str]:
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.path, detail=False))

    def files_in(self, folder: str) -> dict[str, str]:
        """File name -> path or URL for the files directly in ``folder``."""
        if self.local:  # os.scandir lists the 112,120 NIH images in a fraction of a second
            with os.scandir(folder) as entries:
                return {e.name: e.path for e in entries if e.is_file()}
        listing = self.fs.ls(folder, detail=True)
        return {posixpath.basename(e["name"]): self.url(e["name"]) for e in listing if e["type"] == "file"}
