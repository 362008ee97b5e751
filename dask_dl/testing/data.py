"""Tiny collections and stores for the data room's tests (and anyone else's): real files, real Zarr stores.

Everything here writes real PNG, DICOM and Zarr files into a folder the caller gives (a pytest ``tmp_path``), so
that tests build what they need in a line instead of copying helpers from one another:

- :func:`write_png`, :func:`png_collection`: smooth-noise PNGs and their catalog, with chosen rows broken;
- :func:`class_folders`: a ``root/<class>/<image>.png`` collection of small images (MNIST-, CIFAR-sized);
- :func:`write_dicom`: one uncompressed single-frame DICOM file (needs pydicom);
- :func:`write_store`: a store laid out exactly as :func:`dask_dl.ingest` writes it, without a cluster, where
  image ``i`` carries its row number in its first two pixels;
- :func:`corrupt_shard`: damage one shard's chunk bytes, keeping its index;
- :func:`png_bomb`: a small PNG that decodes to hundreds of megabytes.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dask_dl.data import store as contract
from dask_dl.data.schema import make_catalog
from dask_dl.data.store import StoreFiles, StoreLayout

__all__ = [
    "class_folders",
    "corrupt_shard",
    "png_bomb",
    "png_collection",
    "row_pattern",
    "write_dicom",
    "write_png",
    "write_store",
]

#: How :func:`png_collection` breaks a row's file.
BREAKS: tuple[str, ...] = ("missing", "truncated", "garbage", "too_small", "empty")


def write_png(path: str | os.PathLike, seed: int, shape: tuple[int, int] = (96, 96), *, sigma: float = 4) -> Path:
    """Write a smooth random grayscale PNG (Gaussian-filtered noise stretched to 0..255) and return its path."""
    from PIL import Image
    from scipy.ndimage import gaussian_filter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    noise = gaussian_filter(np.random.default_rng(seed).random(shape), sigma)
    Image.fromarray(np.rint((noise - noise.min()) / np.ptp(noise) * 255).astype(np.uint8)).save(path)
    return path


def png_collection(
    root: str | os.PathLike,
    n: int = 36,
    *,
    labels: Sequence[str] = ("Effusion", "Mass", "Nodule"),
    bad: Mapping[int, str] | None = None,
    per_patient: int = 3,
) -> pd.DataFrame:
    """Write ``n`` PNGs (80-112 x 96 px) under ``root`` and return their multilabel catalog.

    Row ``i``: patient ``i // per_patient``; sites ``north``/``south`` and splits train, train, val, test by
    patient; label ``k`` is bit ``k`` of ``i``; an ``age`` column. ``bad`` maps rows to one of :data:`BREAKS`;
    ``too_small`` writes a 6 x 96 image, under the default ``min_size`` of ``size // 4`` for sizes from 28.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    labels = list(labels)
    rows = []
    for i in range(n):
        path = write_png(root / f"{i:05d}.png", seed=i, shape=(80 + 8 * (i % 5), 96))
        patient = i // per_patient
        rows.append(
            {
                "image_id": f"img{i:05d}",
                "path": str(path),
                "patient_id": f"p{patient:03d}",
                "site": "north" if patient % 2 else "south",
                "split": ("train", "train", "val", "test")[patient % 4],
                **{label: int((i >> k) & 1) for k, label in enumerate(labels)},
                "age": 20 + i,
            }
        )
    for i, kind in (bad or {}).items():
        _break(Path(rows[i]["path"]), kind, seed=i)
    return make_catalog(pd.DataFrame(rows), labels)


def _break(path: Path, kind: str, *, seed: int) -> None:
    if kind == "missing":
        path.unlink()
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif kind == "garbage":
        path.write_bytes(b"\x89PNG but not really" * 20)
    elif kind == "too_small":
        write_png(path, seed=seed, shape=(6, 96))
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        raise ValueError(f"unknown break {kind!r}; use one of {BREAKS}")


def class_folders(
    root: str | os.PathLike,
    *,
    classes: Sequence[str] = ("0", "1", "2"),
    per_class: int = 6,
    size: int = 32,
    mode: str = "L",
) -> Path:
    """Write ``root/<class>/<k>.png`` images of ``size x size`` px (``mode`` ``L`` or ``RGB``) and return ``root``.

    Class ``c`` (its index) is a bright square whose side grows with ``c`` on smooth noise, so the images differ
    and a model can tell the classes apart.
    """
    from PIL import Image

    root = Path(root)
    for c, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            rng = np.random.default_rng([c, k])
            image = rng.integers(0, 96, (size, size), dtype=np.uint8)
            side = max(2, size * (c + 1) // (len(classes) + 2))
            top = int(rng.integers(0, size - side + 1))
            image[top : top + side, top : top + side] = 230
            out = Image.fromarray(image)
            out = out.convert("RGB") if mode == "RGB" else out
            out.save(folder / f"{k:04d}.png")
    return root


def write_dicom(
    path: str | os.PathLike,
    pixels: np.ndarray,
    *,
    bits: int = 12,
    photometric: str = "MONOCHROME2",
    uid: str | None = None,
    patient: str | None = "P1",
    **elements: Any,
) -> str:
    """Write ``pixels`` as an uncompressed single-frame DICOM; ``elements`` are extra header keywords.

    ``(H, W, 3)`` uint8 ``pixels`` are RGB: written as ``photometric`` ``"RGB"``, or converted to ``"YBR_FULL"``
    with pydicom's ``convert_color_space`` (pass ``photometric="YBR_FULL"``). Returns the SOP Instance UID.
    """
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    path = Path(path)
    uid = uid or generate_uid()
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = SecondaryCaptureImageStorage
    ds.SOPInstanceUID = uid
    if patient is not None:
        ds.PatientID = patient
    ds.Modality = "CR"
    colour = pixels.ndim == 3
    if colour:
        from pydicom.pixels import convert_color_space

        photometric = "RGB" if photometric == "MONOCHROME2" else photometric
        pixels = pixels if photometric == "RGB" else convert_color_space(pixels, "RGB", photometric)
        bits, ds.PlanarConfiguration = 8, 0
    ds.SamplesPerPixel = 3 if colour else 1
    ds.PhotometricInterpretation = photometric
    ds.Rows, ds.Columns = pixels.shape[:2]
    ds.BitsAllocated = 16 if bits > 8 else 8
    ds.BitsStored = bits
    ds.HighBit = bits - 1
    signed = pixels.dtype.kind == "i"
    ds.PixelRepresentation = int(signed)
    dtype = {(16, False): "<u2", (16, True): "<i2", (8, False): "u1", (8, True): "i1"}[(ds.BitsAllocated, signed)]
    ds.PixelData = pixels.astype(dtype).tobytes()
    for key, value in elements.items():
        setattr(ds, key, value)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return uid


def row_pattern(i: int, size: int) -> np.ndarray:
    """The image of row ``i`` in :func:`write_store`: random bytes, row number in pixels (0, 0) and (0, 1)."""
    image = np.random.default_rng(i).integers(0, 256, (size, size), dtype=np.uint8)
    image[0, 0], image[0, 1] = i % 256, i // 256
    return image


def write_store(
    path: str | os.PathLike,
    *,
    n: int = 50,
    size: int = 8,
    chunk: int = 4,
    shard: int = 2,
    labels: Sequence[str] = ("Atelectasis", "Effusion", "Mass"),
    rejected: Sequence[int] = (),
    split_of: Callable[[int], str] = lambda i: "train",
    site: str = "nih",
    complete: bool = True,
) -> Path:
    """Write a store exactly as :func:`dask_dl.ingest` lays it out (sharded, zstd, dims, coordinates), fast.

    Image ``i`` is :func:`row_pattern` (rows in ``rejected`` are all zero and not valid); label ``j`` of row
    ``i`` is bit ``j`` of ``i``; ``image_id`` is ``f"{i:08d}_000.png"``, patient ``f"p{i}"``. The status file of
    every shard is written, and the rejects table when ``complete``.
    """
    import zarr
    from zarr.codecs import ZstdCodec

    path = Path(path)
    labels = list(labels)
    layout = StoreLayout(size=size, chunk=chunk, shard=shard, labels=labels, task="multilabel", n=n)
    group = zarr.open_group(path, mode="w", zarr_format=3)
    images = np.stack([row_pattern(i, size) for i in range(n)])
    valid = np.ones(n, bool)
    valid[list(rejected)] = False
    images[~valid] = 0
    coords = {"coordinates": " ".join(contract.COORDS)}
    image = group.create_array(
        contract.IMAGE,
        shape=images.shape,
        chunks=(chunk, size, size),
        shards=(layout.shard_rows, size, size),
        chunk_key_encoding={"name": "default", "separator": "/"},
        dtype="uint8",
        dimension_names=contract.DIMS[contract.IMAGE],
        compressors=ZstdCodec(),
        attributes=coords,
    )
    image[:] = images
    bits = np.array([[(i >> j) & 1 for j in range(len(labels))] for i in range(n)], np.uint8)
    strings = {
        "image_id": [f"{i:08d}_000.png" for i in range(n)],
        "patient_id": [f"p{i}" for i in range(n)],
        "split": [split_of(i) for i in range(n)],
        "site": [site] * n,
    }
    arrays = {
        contract.LABEL: bits.reshape(n, len(labels)),
        contract.VALID: valid,
        contract.SAMPLE: np.arange(n, dtype=np.int64),
        contract.FINDING: np.array(labels, dtype=str),
        **{name: np.array(values, dtype=str) for name, values in strings.items()},
    }
    for name, data in arrays.items():
        array = group.create_array(
            name,
            shape=data.shape,
            dtype=data.dtype if data.dtype.kind != "U" else str,
            dimension_names=contract.DIMS[name],
            attributes=coords if name in (contract.LABEL, contract.VALID) else None,
        )
        array[...] = data
    # the side files: a status file per shard, and the rejects table of a finished store
    group.require_group(contract.META_GROUP)
    files = StoreFiles(path)
    for shard in range(layout.n_shards):
        rows = list(layout.shard_rows_of(shard))
        status = {
            "row": rows,
            "image_id": [strings["image_id"][i] for i in rows],
            "ok": [bool(valid[i]) for i in rows],
            "reason": ["" if valid[i] else "undecodable" for i in rows],
            "message": ["" if valid[i] else "written rejected by write_store" for i in rows],
        }
        record = {"shard": shard, "start": rows[0], "empty": not images[rows].any(), "status": status}
        files.put(layout.status_key(shard), json.dumps(record).encode())
    if complete:
        bad = [i for i in range(n) if not valid[i]]
        rejects = pd.DataFrame(
            {
                "row": np.array(bad, dtype=np.int64),
                "image_id": [strings["image_id"][i] for i in bad],
                "path": [f"/nowhere/{strings['image_id'][i]}" for i in bad],
                **{name: [strings[name][i] for i in bad] for name in ("patient_id", "split", "site")},
                "reason": ["undecodable"] * len(bad),
                "message": ["written rejected by write_store"] * len(bad),
            }
        )
        buffer = io.BytesIO()
        rejects.to_parquet(buffer, index=False)
        files.put(contract.REJECTS_KEY, buffer.getvalue())
    group.attrs[contract.ATTRIBUTE] = layout.replace(complete=complete).to_dict()
    return path


def corrupt_shard(store: str | os.PathLike, shard: int) -> None:
    """Overwrite the chunk bytes of a shard file, keeping its index (16 bytes per chunk + a CRC), so decoding fails."""
    import zarr

    layout = StoreLayout.from_dict(zarr.open_group(store, mode="r").attrs[contract.ATTRIBUTE])
    path = Path(store, *layout.shard_key(shard).split("/"))
    data = bytearray(path.read_bytes())
    index_bytes = 16 * layout.shard + 4
    data[: len(data) - index_bytes] = b"\xff" * (len(data) - index_bytes)
    path.write_bytes(bytes(data))


def png_bomb(path: str | os.PathLike, *, side: int = 9000) -> Path:
    """Write a 16-bit RGBA PNG of ``side x side`` black pixels: under 1 MB on disk, 8 x side**2 bytes decoded.

    At 9000 px it stays under Pillow's pixel limit yet needs 648 MB (3.7 GiB through a float pipeline) to decode:
    a decompression bomb.
    """
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    # Every run of rows compresses to the same bytes after a full flush (which resets the window), so one run is
    # compressed and repeated: the zlib stream is built in well under a second instead of deflating 648 MB.
    rows = next(k for k in (100, 64, 50, 10, 8, 5, 4, 2, 1) if side % k == 0)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    piece = deflate.compress(bytes((1 + side * 8) * rows)) + deflate.flush(zlib.Z_FULL_FLUSH)
    final = zlib.compressobj(9, zlib.DEFLATED, -15).flush(zlib.Z_FINISH)
    adler = (((1 + side * 8) * side % 65521) << 16) | 1  # Adler-32 of n zero bytes: a = 1, b = n mod 65521
    data = b"\x78\xda" + piece * (side // rows) + final + struct.pack(">I", adler)
    ihdr = struct.pack(">IIBBBBB", side, side, 16, 6, 0, 0, 0)
    path = Path(path)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", data) + chunk(b"IEND", b""))
    return path
