"""The dask_dl store contract: how a store written by :func:`dask_dl.ingest` is laid out, in one place.

A store is a Zarr 3 group:

==============  =====================  ==========================================================================
array           shape, dtype           notes
==============  =====================  ==========================================================================
``image``       (n, S, S) uint8        dims ``sample, y, x``; chunks ``(chunk, S, S)`` inside shards of
                                       ``chunk * shard`` images; rejected rows stay all zero. A colour store
                (n, S, S, 3) uint8     (``channels=3``) adds a last dimension ``channel`` (R, G, B): chunks
                                       ``(chunk, S, S, 3)``; a grey store has no channel dimension
``label``       (n, n_labels) uint8    dims ``sample, finding``
``valid``       (n,) bool              False for rejected rows
coordinates     (n,) str               ``image_id``, ``patient_id``, ``split``, ``site``; ``finding`` (labels);
                                       ``sample`` int64 = row number 0..n-1
``_dask_dl/     (n,) int64             the catalog row each sample came from (:func:`catalog_rows`)
catalog_row``
==============  =====================  ==========================================================================

Sample order: with ``order="shuffled"`` (the default, ``dask-dl.ingest.order``) row ``i`` of the store holds row
``catalog_row[i]`` of the validated catalog, a seeded random permutation (``order_seed``). The loader reads whole
chunks and mixes a few of them per batch, so the labels of a chunk must already be mixed as a full shuffle mixes
them: in catalog order, a collection of class folders puts every class in a run of its own and the batches hold
one or two classes. ``order="catalog"`` keeps the catalog's order (stores written before the order existed read
as such).

Grey stores keep exactly the layout of the first format (no ``channel`` axis of length 1), so every store written
before colour existed reads as it did. Colour is channel-last, like an RGB image file, Pillow and scikit-image
(``channel_axis=-1``): ``ds.image[0]`` is an ordinary ``(y, x, 3)`` picture; the loader hands the models
``(B, C, S, S)``.

The group attribute ``dask_dl`` is a :class:`StoreLayout` (:meth:`StoreLayout.to_dict`); ``dask_dl_ingest``
holds the ingest options that decide which rows are rejected. Beside the arrays, ``_dask_dl/`` holds one status
file per finished shard and the rejects table. Everything here uses zarr's public API and fsspec only; the chunk
keys follow the Zarr 3 specification's ``default`` encoding with ``/``, which the image array is created with.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dask_dl.errors import StoreError, StoreNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import zarr

__all__ = [
    "ATTRIBUTE",
    "COORDS",
    "FORMAT",
    "INGEST_ATTRIBUTE",
    "META_GROUP",
    "REJECTS_KEY",
    "STATUS_PREFIX",
    "StoreLayout",
    "catalog_rows",
    "open_store",
]

#: Version of the layout below; stores of another format are refused.
FORMAT = 1
#: Group attribute holding the :class:`StoreLayout`.
ATTRIBUTE = "dask_dl"
#: Group attribute holding the ingest options (min_size, compressor, hash of the image ids).
INGEST_ATTRIBUTE = "dask_dl_ingest"
IMAGE, LABEL, VALID, SAMPLE, FINDING = "image", "label", "valid", "sample", "finding"
#: Per-sample string coordinates, in the order they are written.
COORDS: tuple[str, ...] = ("image_id", "patient_id", "split", "site")
#: Dimension names of every array of the contract.
DIMS: dict[str, tuple[str, ...]] = {
    IMAGE: (SAMPLE, "y", "x"),
    LABEL: (SAMPLE, FINDING),
    VALID: (SAMPLE,),
    SAMPLE: (SAMPLE,),
    FINDING: (FINDING,),
    **{name: (SAMPLE,) for name in COORDS},
}
CHANNEL = "channel"
#: Dimensions of a colour store's ``image`` array (``channels=3``); grey stores use ``DIMS[IMAGE]``.
COLOUR_IMAGE_DIMS: tuple[str, ...] = (SAMPLE, "y", "x", CHANNEL)
META_GROUP = "_dask_dl"
STATUS_PREFIX = f"{META_GROUP}/status/"
REJECTS_KEY = f"{META_GROUP}/rejects.parquet"
LEASE_KEY = f"{META_GROUP}/lease.json"
TASKS: tuple[str, ...] = ("multilabel", "multiclass")
#: Sample orders of a store: a seeded permutation of the catalog, or the catalog's own order.
ORDERS: tuple[str, ...] = ("shuffled", "catalog")
#: The array (in :data:`META_GROUP`) holding each sample's catalog row.
CATALOG_ROW = "catalog_row"


@dataclass(frozen=True)
class StoreLayout:
    """What a dask_dl store holds and how it is cut: the ``dask_dl`` attribute of the store's group.

    Parameters
    ----------
    size
        Side of the square images.
    chunk
        Images per Zarr chunk (the unit a loader decodes).
    shard
        Chunks per Zarr shard (the unit one ingest task writes).
    labels
        Names of the label columns (the ``finding`` coordinate).
    task
        ``"multilabel"`` or ``"multiclass"``.
    n
        Rows (samples) in the store, rejected ones included.
    channels
        Image channels: 1 (grey, ``image(sample, y, x)``) or 3 (RGB, ``image(sample, y, x, channel)``).
    order, order_seed
        ``"shuffled"``: sample ``i`` is row ``catalog_rows()[i]`` of the catalog, a permutation seeded by
        ``order_seed``; ``"catalog"``: the catalog's order.
    complete
        True once every shard is written and verified, ``valid`` and the rejects table are final.
    format
        The contract's version, :data:`FORMAT`.

    Examples
    --------
    >>> layout = StoreLayout(size=32, chunk=4, shard=2, labels=("a", "b"), task="multilabel", n=20)
    >>> layout.shard_rows, layout.n_shards, layout.shard_key(1)
    (8, 3, 'image/c/1/0/0')
    >>> StoreLayout.from_dict(layout.to_dict()) == layout
    True
    """

    size: int
    chunk: int
    shard: int
    labels: tuple[str, ...]
    task: str
    n: int
    channels: int = 1
    order: str = "catalog"
    order_seed: int = 0
    complete: bool = False
    format: int = field(default=FORMAT)

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(str(label) for label in self.labels))

    @property
    def shard_rows(self) -> int:
        """Images per shard."""
        return self.chunk * self.shard

    @property
    def image_dims(self) -> tuple[str, ...]:
        """Dimension names of the ``image`` array: ``(sample, y, x)``, plus ``channel`` for colour."""
        return DIMS[IMAGE] if self.channels == 1 else COLOUR_IMAGE_DIMS

    @property
    def image_shape(self) -> tuple[int, ...]:
        """Shape of one image: ``(S, S)`` grey, ``(S, S, channels)`` colour."""
        return (self.size, self.size) if self.channels == 1 else (self.size, self.size, self.channels)

    @property
    def n_shards(self) -> int:
        """Shards of the image array."""
        return -(-self.n // self.shard_rows)

    def catalog_rows(self) -> np.ndarray:
        """The catalog row each sample holds, in sample order (what ingest writes, as ``_dask_dl/catalog_row``)."""
        import numpy as np

        if self.order == "catalog":
            return np.arange(self.n, dtype=np.int64)
        return np.random.default_rng([self.order_seed, self.n]).permutation(self.n).astype(np.int64)

    def shard_rows_of(self, shard: int) -> range:
        """The rows of shard ``shard``."""
        start = shard * self.shard_rows
        return range(start, min(start + self.shard_rows, self.n))

    def shard_key(self, shard: int) -> str:
        """Key of shard ``shard``'s file under the store (Zarr 3 ``default`` chunk key encoding, ``/``)."""
        return f"{IMAGE}/c/{int(shard)}/0/0" + ("/0" if self.channels != 1 else "")

    @staticmethod
    def status_key(shard: int) -> str:
        """Key of shard ``shard``'s status file (written after the shard)."""
        return f"{STATUS_PREFIX}shard-{int(shard):06d}.json"

    def replace(self, **changes: Any) -> StoreLayout:
        """A copy with ``changes`` applied."""
        return StoreLayout(**{**asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """The JSON form stored in the group attribute ``dask_dl``."""
        out = asdict(self)
        out["labels"] = list(self.labels)
        return out

    @classmethod
    def from_dict(cls, meta: Any, *, where: str = "the store") -> StoreLayout:
        """Read the ``dask_dl`` attribute back; a StoreError names what is missing or wrong."""
        if not isinstance(meta, dict) or "size" not in meta:
            raise StoreError(
                f"{where} is a Zarr group but not a dask_dl store (no 'dask_dl' attribute); write it with "
                "dask_dl.ingest(catalog, store)"
            )
        if meta.get("format", FORMAT) != FORMAT:
            raise StoreError(
                f"{where} has store format {meta.get('format')!r}; this dask_dl reads format {FORMAT}: ingest the "
                "collection again with this version"
            )
        try:
            return cls(
                size=int(meta["size"]),
                chunk=int(meta["chunk"]),
                shard=int(meta["shard"]),
                labels=tuple(meta["labels"]),
                task=str(meta.get("task", "multilabel")),
                n=int(meta["n"]),
                channels=int(meta.get("channels", 1)),
                order=str(meta.get("order", "catalog")),
                order_seed=int(meta.get("order_seed", 0)),
                complete=bool(meta.get("complete", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(
                f"the 'dask_dl' attribute of {where} is damaged ({type(exc).__name__}: {exc}); ingest again with "
                "overwrite=True"
            ) from None


# ---- the arrays, as ingest creates them ---------------------------------------------------------------------

#: label/valid/coordinate arrays are small: chunked by at least this many rows to keep the file count low
META_ROWS = 65536


def create_image(group: zarr.Group, layout: StoreLayout, *, compressor: str) -> None:
    """Create the empty ``image`` array of ``layout`` in ``group``: chunks of ``chunk`` images inside shards of
    ``shard`` chunks, zstd level 3 (``compressor="zstd"``) or none (``"none"``), zeros where nothing is written."""
    from zarr.codecs import ZstdCodec

    image = layout.image_shape
    group.create_array(
        IMAGE,
        shape=(layout.n, *image),
        dtype="uint8",
        chunks=(layout.chunk, *image),
        shards=(layout.shard_rows, *image),
        # spelled out: shard_key and dask_dl.data.shards rely on this encoding of the Zarr 3 specification
        chunk_key_encoding={"name": "default", "separator": "/"},
        compressors=ZstdCodec(level=3) if compressor == "zstd" else None,
        fill_value=0,
        dimension_names=layout.image_dims,
        attributes={"coordinates": " ".join(COORDS)},
    )


def write_sample_arrays(
    group: zarr.Group, layout: StoreLayout, *, label: np.ndarray, coords: dict[str, np.ndarray]
) -> None:
    """(Re)write every array but ``image``: ``label`` ``(n, n_labels)``, ``valid`` (all False until ingest
    finishes), ``sample``, ``finding``, the string coordinates ``coords`` (one per name of :data:`COORDS`) and
    ``_dask_dl/catalog_row``."""
    import numpy as np

    n = layout.n
    rows = min(n, -(-META_ROWS // layout.shard_rows) * layout.shard_rows)

    def create(name: str, values: np.ndarray, **kwargs: Any) -> None:
        dims = DIMS[name]
        array = group.create_array(
            name,
            shape=values.shape,
            dtype=values.dtype if values.dtype.kind != "U" else str,
            chunks=(rows, *values.shape[1:]) if dims[0] == SAMPLE else values.shape,
            dimension_names=dims,
            overwrite=True,
            **kwargs,
        )
        array[...] = values

    attributes = {"coordinates": " ".join(COORDS)}
    create(LABEL, np.asarray(label, dtype=np.uint8), attributes=attributes)
    create(VALID, np.zeros(n, bool), attributes=attributes)
    create(SAMPLE, np.arange(n, dtype=np.int64))
    create(FINDING, np.array(layout.labels, dtype=str))
    for name in COORDS:
        create(name, np.asarray(coords[name], dtype=str))
    meta = group.require_group(META_GROUP)
    meta.create_array(CATALOG_ROW, shape=(n,), dtype=np.int64, chunks=(rows,), overwrite=True)[...] = (
        layout.catalog_rows()
    )


# ---- files beside the arrays (fsspec, no zarr internals) ---------------------------------------------------


def write_whole(path: str, data: bytes) -> None:
    """Write ``data`` to the local file ``path`` under a temporary name, then rename it into place.

    A reader never sees half a file: a write stopped on the way (Ctrl-C, a kill, a full disk) leaves the previous
    file, or none, and no temporary file (a full disk's half file is never a look-alike of a finished one).
    """
    temporary = f"{path}.{uuid.uuid4().hex}.partial"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


class StoreFiles:
    """The files of a store at ``url`` (local path or fsspec URL), read and written with fsspec.

    Writes are atomic: a local file is written under a temporary name and renamed; object-store puts are atomic.
    """

    def __init__(self, url: str | os.PathLike) -> None:
        import fsspec

        from dask_dl.cluster.storage import absolute

        self.url = os.fspath(url)
        self.fs, self.root = fsspec.core.url_to_fs(absolute(self.url))
        self.local = "file" in _protocols(self.fs)

    def path(self, key: str) -> str:
        return posixpath.join(self.root, key) if not self.local else os.path.join(self.root, *key.split("/"))

    def exists(self) -> bool:
        return self.fs.exists(self.root)

    def is_empty(self) -> bool:
        """True when nothing (or an empty folder, or only an ingest's lease) is at the store's path."""
        if not self.fs.exists(self.root):
            return True
        if not self.fs.isdir(self.root):
            return False
        names = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False)]
        if names == [META_GROUP]:
            inside = self.fs.ls(self.path(META_GROUP), detail=False)
            return [posixpath.basename(p.rstrip("/")) for p in inside] == [LEASE_KEY.rsplit("/", 1)[-1]]
        return not names

    def get(self, key: str) -> bytes | None:
        try:
            return self.fs.cat_file(self.path(key))
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        target = self.path(key)
        self.fs.makedirs(posixpath.dirname(target) if not self.local else os.path.dirname(target), exist_ok=True)
        if not self.local:
            self.fs.pipe_file(target, data)
            return
        write_whole(target, data)

    def delete(self, key: str) -> None:
        if self.fs.exists(self.path(key)):  # a missing file is what was asked for
            self.fs.rm_file(self.path(key))

    def clear(self, *, keep: str) -> None:
        """Delete everything in the store but the file ``keep`` (a key such as :data:`LEASE_KEY`).

        What an overwrite does under the lease: Zarr's ``mode="w"`` would delete the lease too, and for that moment
        a second ingest could take it.
        """
        if not self.fs.exists(self.root):
            return
        self._clear(self.root, keep.strip("/").split("/"))

    def _clear(self, folder: str, keep: list[str]) -> None:
        for entry in self.fs.ls(folder, detail=True):
            name = posixpath.basename(entry["name"].rstrip("/"))
            if len(keep) == 1 and name.startswith(f"{keep[0]}.") and name.endswith(".partial"):
                continue  # the kept file being rewritten by put(): its rename must find it
            if name != keep[0]:
                self.fs.rm(entry["name"], recursive=entry["type"] == "directory")
            elif len(keep) > 1 and entry["type"] == "directory":
                self._clear(entry["name"], keep[1:])
            elif len(keep) > 1:  # a file where the kept file's folder belongs
                self.fs.rm_file(entry["name"])

    def list(self, prefix: str) -> list[str]:
        """Names of the files directly under the folder ``prefix`` (``"_dask_dl/status/"``)."""
        folder = self.path(prefix.rstrip("/"))
        try:
            entries = self.fs.ls(folder, detail=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e["type"] == "file")

    def size(self, key: str) -> int | None:
        try:
            return int(self.fs.size(self.path(key)))
        except FileNotFoundError:
            return None


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def zarr_store(url: str | os.PathLike, *, read_only: bool = False) -> Any:
    """The zarr store object of ``url``: a LocalStore for paths, an FsspecStore for URLs."""
    from zarr.storage import FsspecStore, LocalStore

    url = os.fspath(url)
    if "://" in url and not url.startswith("file://"):
        return FsspecStore.from_url(url, read_only=read_only)
    return LocalStore(url.removeprefix("file://"), read_only=read_only)


# ---- open and verify ---------------------------------------------------------------------------------------


def open_store(store: Any, *, require_complete: bool = True) -> tuple[str, zarr.Group, StoreLayout]:
    """Open a dask_dl store for reading and check it against the contract.

    Parameters
    ----------
    store
        A path or fsspec URL, an open ``zarr.Group``, or a dataset from :func:`dask_dl.open_dataset` (its
        ``encoding["source"]`` names the store).
    require_complete
        Refuse a store whose ingest did not finish (its unfinished shards read as zeros).

    Returns
    -------
    (str, zarr.Group, StoreLayout)
        The store's path or URL, its group, its layout.

    Raises
    ------
    StoreNotFoundError
        Nothing at ``store``.
    StoreError
        Not a Zarr group, not a dask_dl store (no ``dask_dl`` attribute or no image/label arrays), another
        format, or incomplete while ``require_complete``.
    """
    import zarr

    if isinstance(store, zarr.Group):
        group, url = store, str(store.store)
    else:
        if hasattr(store, "encoding") and hasattr(store, "data_vars"):  # an xarray.Dataset from open_dataset
            if "source" not in store.encoding:
                raise StoreError(
                    "the dataset does not say which store it came from (no encoding['source']); "
                    "pass the store path instead, e.g. 'path/to/store.zarr'"
                )
            store = store.encoding["source"]
        from dask_dl.cluster.storage import absolute

        url = absolute(store)  # the workers that read it may run in another folder
        group = _open_group(url)
    layout = StoreLayout.from_dict(dict(group.attrs).get(ATTRIBUTE), where=repr(url))
    missing = [name for name in (IMAGE, LABEL) if name not in group]
    if missing:
        raise StoreError(
            f"{url!r} is not a dask_dl store: it lacks the {' and '.join(missing)} array(s); write it with "
            "dask_dl.ingest(catalog, store)"
        )
    if require_complete and not layout.complete:
        raise StoreError(
            f"the store {url!r} is incomplete: an ingest into it did not finish, so some images would read as "
            f"zeros. Run ingest again to resume it (same catalog and options): dask_dl.ingest(catalog, {url!r}) "
            "writes only the missing shards"
        )
    return url, group, layout


def _open_group(url: str) -> zarr.Group:
    import zarr

    try:
        return zarr.open_group(url, mode="r")
    except FileNotFoundError:
        if "://" not in url and os.path.exists(url):
            raise StoreError(
                f"{url!r} exists but is not a Zarr store; open a store written by dask_dl.ingest(catalog, store)"
            ) from None
        raise StoreNotFoundError(
            f"no Zarr store at {url!r}; write one with dask_dl.ingest(catalog, {url!r}) or `dask-dl ingest SOURCE "
            f"{url}`"
        ) from None
    except (ValueError, TypeError) as exc:
        raise StoreError(f"{url!r} is not a Zarr 3 group ({exc}); open a store written by dask_dl.ingest") from None


def catalog_rows(store: Any) -> np.ndarray:
    """The row of the ingested catalog each sample of ``store`` came from: ``catalog.iloc[catalog_rows(store)]``
    lines the catalog up with the store's samples, ``np.argsort(catalog_rows(store))`` gives the samples in catalog
    order.

    Parameters
    ----------
    store
        What :func:`open_store` takes.
    """
    import numpy as np

    _, group, layout = open_store(store, require_complete=False)
    key = f"{META_GROUP}/{CATALOG_ROW}"
    if key not in group:  # a store in catalog order written before the order was recorded
        return layout.catalog_rows()
    return np.asarray(group[key][:], dtype=np.int64)


def lost_shards(files: StoreFiles, layout: StoreLayout) -> list[int]:
    """Shards whose status file says they hold pixels but whose file is missing.

    zarr writes no file for an all-zero shard, so a missing file is only a loss when the shard's status file
    says it was not empty (a status file without that flag counts as not empty when a row is valid).
    """
    import json

    lost = []
    for shard in range(layout.n_shards):
        if files.size(layout.shard_key(shard)) is not None:
            continue
        data = files.get(layout.status_key(shard))
        if data is None:
            continue  # not written yet: an unfinished shard, not a lost one
        record = json.loads(data)
        empty = record.get("empty")
        if empty is None:
            empty = not any(record.get("status", {}).get("ok", []))
        if not empty:
            lost.append(shard)
    return lost
