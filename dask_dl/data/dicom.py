"""DICOM files: pixels as 8-bit grayscale (or RGB) and headers as catalog metadata, through pydicom.

pydicom is an optional dependency (the ``dicom`` extra); it is imported when a function here is first called,
so that reading PNG collections never needs it.
"""

from __future__ import annotations

import io
import logging
import os
import re
import stat
import sys
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pandas as pd

from dask_dl import config
from dask_dl.checks import one_of
from dask_dl.data import dicom_gdcm
from dask_dl.data.labels import NO_FINDING, parse_findings
from dask_dl.data.layouts import LAYOUTS
from dask_dl.data.schema import METADATA_COLUMNS, NIH_LABELS, REQUIRED_COLUMNS
from dask_dl.data.splits import split_by_patient
from dask_dl.errors import CatalogError, ConfigurationError, DatasetError, StoreNotFoundError, missing_dependency

__all__ = [
    "DICOM_SUFFIXES",
    "HeaderTooLarge",
    "is_dicom",
    "is_dicom_file",
    "read_colour_pixels",
    "read_dicom",
    "read_header",
    "read_image_header",
    "read_pixels",
]

#: Colour photometric interpretations :func:`read_colour_pixels` converts to RGB.
COLOUR_PHOTOMETRIC: tuple[str, ...] = ("RGB", "YBR_FULL", "YBR_FULL_422", "YBR_ICT", "YBR_RCT", "YBR_PARTIAL_420")

logger = logging.getLogger(__name__)

#: File name endings taken as DICOM without looking inside.
DICOM_SUFFIXES: tuple[str, ...] = (".dcm", ".dicom")
_MAGIC = b"DICM"  # at byte 128, after the preamble (PS3.10 7.1)

#: Header fields read for the catalog; reading only these skips the pixel data.
HEADER_TAGS: tuple[str, ...] = (
    "SOPInstanceUID",
    "PatientID",
    "PatientAge",
    "PatientSex",
    "ViewPosition",
    "Rows",
    "Columns",
    "PixelSpacing",
    "ImagerPixelSpacing",
)


def _pydicom(purpose: str) -> Any:
    try:
        import pydicom
    except ImportError:  # pragma: no cover - pydicom is installed in the test environment
        raise missing_dependency("pydicom", "dicom", purpose) from None
    return pydicom


def is_dicom(name: str, head: bytes | None = None) -> bool:
    """True if ``name`` ends in ``.dcm``/``.dicom``, or ``head`` (the file's first bytes) has the ``DICM`` magic.

    Examples
    --------
    >>> is_dicom("chest.DCM"), is_dicom("chest", bytes(128) + b"DICM"), is_dicom("chest.png", b"")
    (True, True, False)
    """
    if name.lower().endswith(DICOM_SUFFIXES):
        return True
    return head is not None and head[128:132] == _MAGIC


def is_dicom_file(path: str) -> bool:
    """Return True if ``path`` is a DICOM file: a ``.dcm``/``.dicom`` name or the ``DICM`` magic at byte 128.

    Only extension-less files are opened and sniffed: other extensions (.png, .csv, ...) are not DICOM.
    """
    if is_dicom(path) or os.path.splitext(path)[1]:
        return is_dicom(path)
    try:  # O_NONBLOCK and a regular-file check: a FIFO in a collection must not hang the listing
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        return is_dicom(path, os.pread(fd, 132, 0))
    except OSError:
        return False
    finally:
        os.close(fd)


_PIXEL_TAGS = (0x7FE00010, 0x7FE00009, 0x7FE00008)  # Pixel Data, Double and Float Pixel Data
_DEFLATED = "1.2.840.10008.1.2.1.99"  # Deflated Explicit VR Little Endian (PS3.5 A.5)


class HeaderTooLarge(ValueError):
    """A deflated DICOM file whose header alone inflates beyond the limit given to :func:`read_image_header`."""


class _Inflating(io.RawIOBase):
    """The deflated dataset of a DICOM file, inflated only as far as it is read (and kept, for pydicom's seeks)."""

    def __init__(self, source: BinaryIO, *, limit: int | None) -> None:
        self._source, self._limit = source, limit
        self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
        self._out, self._pos = bytearray(), 0

    def _fill(self, end: int) -> None:
        while len(self._out) < end and not self._zlib.eof:
            chunk = self._zlib.unconsumed_tail or self._source.read(1 << 16)
            if not chunk:  # the file ends early: pydicom reports the short read
                return
            self._out += self._zlib.decompress(chunk, 1 << 16)
            if self._limit is not None and len(self._out) > self._limit:
                raise HeaderTooLarge(f"the deflated header inflates to more than {self._limit} bytes")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        end = self._pos + size if size is not None and size >= 0 else (self._limit or sys.maxsize)
        self._fill(end)
        out = bytes(self._out[self._pos : end])
        self._pos += len(out)
        return out

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            raise io.UnsupportedOperation("a deflated dataset is read from its start")
        self._pos = max(0, offset + (self._pos if whence == io.SEEK_CUR else 0))
        return self._pos


def read_image_header(
    source: str | os.PathLike | BinaryIO, *, specific_tags: Sequence[str] | None = None, limit: int | None = None
) -> Any:
    """Read the header of a DICOM file up to its pixel data, which is neither read nor decoded, nor inflated.

    pydicom inflates a deflated file (Deflated Explicit VR Little Endian, ``1.2.840.10008.1.2.1.99``, where the
    whole dataset after the file meta is one deflate stream) in one piece before it reads its first element, even
    with ``stop_before_pixels``: a 0.8 MB file of zeros can inflate to 800 MB of pixels. Here a deflated dataset is
    inflated as it is parsed, and parsing stops at the Pixel Data element, so the header's Rows, Columns,
    BitsAllocated, SamplesPerPixel and NumberOfFrames are known before the pixels take any memory. Other transfer
    syntaxes are read by pydicom's ``dcmread(..., stop_before_pixels=True)``.

    Parameters
    ----------
    source
        A DICOM file: path or binary file object positioned at its start.
    specific_tags
        Read only these elements (keywords), as ``dcmread``'s ``specific_tags``.
    limit
        Refuse a deflated header that inflates to more than this many bytes (a huge element before the pixels).

    Returns
    -------
    pydicom.Dataset
        The header, with ``file_meta``.

    Raises
    ------
    HeaderTooLarge
        A deflated header over ``limit``.
    pydicom.errors.InvalidDicomError, ...
        What pydicom raises for a file it cannot read.
    """
    if isinstance(source, str | os.PathLike):
        with open(source, "rb") as f:
            return read_image_header(f, specific_tags=specific_tags, limit=limit)
    pydicom = _pydicom("reading DICOM headers")
    from pydicom.dataset import FileMetaDataset
    from pydicom.filereader import read_dataset, read_preamble
    from pydicom.tag import Tag

    start = source.tell()
    if read_preamble(source, True) is not None:  # the File Meta Information follows the DICM marker
        meta = read_dataset(source, False, True, stop_when=lambda tag, vr, length: tag.group != 2)
        if str(meta.get("TransferSyntaxUID", "")) == _DEFLATED:
            tags = [Tag(t) for t in specific_tags] if specific_tags is not None else None
            ds = read_dataset(_Inflating(source, limit=limit), False, True, stop_when=_at_pixels, specific_tags=tags)
            ds.file_meta = FileMetaDataset(meta)
            return ds
    source.seek(start)
    return pydicom.dcmread(source, stop_before_pixels=True, specific_tags=specific_tags)


def _at_pixels(tag: Any, vr: str | None, length: int) -> bool:
    return int(tag) in _PIXEL_TAGS


def _output_range(ds: Any) -> tuple[float, float]:
    """The value range pydicom's ``apply_voi_lut`` maps onto, mirroring its rules (PS3.3 C.11.2)."""
    if ds.get("VOILUTSequence") and ds.VOILUTSequence[0].get("LUTDescriptor") is not None:
        bits = int(ds.VOILUTSequence[0].LUTDescriptor[2])
        return 0.0, float(2**bits - 1)
    bits_stored = int(ds.BitsStored)
    if ds.get("ModalityLUTSequence"):
        lo, hi = 0.0, float(2 ** int(ds.ModalityLUTSequence[0].LUTDescriptor[2]) - 1)
    elif int(ds.get("PixelRepresentation", 0)) == 0:
        lo, hi = 0.0, float(2**bits_stored - 1)
    else:
        lo, hi = float(-(2 ** (bits_stored - 1))), float(2 ** (bits_stored - 1) - 1)
    slope, intercept = ds.get("RescaleSlope"), ds.get("RescaleIntercept")
    if slope is not None and intercept is not None:
        lo, hi = lo * float(slope) + float(intercept), hi * float(slope) + float(intercept)
    return min(lo, hi), max(lo, hi)


def _to_uint8(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    if hi <= lo:  # a constant image carries no contrast to keep
        return np.zeros(values.shape, dtype=np.uint8)
    scaled = (values.astype(np.float64) - lo) * (255.0 / (hi - lo))
    return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)


def read_pixels(path: str | os.PathLike | BinaryIO, *, reject_degenerate: bool = False) -> np.ndarray:
    """Read a DICOM image as a 2-D ``uint8`` array, as a radiologist would see it.

    The stored values go through the modality LUT (rescale slope/intercept), then the VOI LUT or window
    (pydicom's ``apply_voi_lut``) mapped from its output range onto 0..255; a file without VOI LUT or window is
    min-max scaled instead. ``MONOCHROME1`` images (where high values are dark) are inverted, so that bone is
    always bright. 12- and 16-bit images end up 8-bit.

    Parameters
    ----------
    path : str, path or binary file object
        A DICOM file (a file object lets callers read remote files through fsspec).
    reject_degenerate : bool
        Raise a DatasetError for an image with non-finite values after the modality LUT (a broken
        ``RescaleSlope``) or without contrast after scaling (constant stored values, or a window that maps
        everything to black or white), instead of returning it.

    Returns
    -------
    numpy.ndarray
        ``uint8`` array of shape ``(Rows, Columns)``.

    Raises
    ------
    CatalogError
        If the file holds a colour or multi-frame image.
    DatasetError
        With ``reject_degenerate``, for a degenerate image (the message says which way).
    MissingDependencyError
        If pydicom is not installed.

    Examples
    --------
    On a DICOM file of yours (not run as a doctest: it needs the file):

    >>> image = read_pixels("chest.dcm")  # doctest: +SKIP
    >>> image.dtype, image.ndim  # doctest: +SKIP
    (dtype('uint8'), 2)
    """
    pydicom = _pydicom("reading DICOM pixels")
    from pydicom.pixels import apply_modality_lut, apply_voi_lut

    ds = pydicom.dcmread(path)
    dicom_gdcm.use_for(ds)  # 12-bit JPEG: GDCM, which pydicom's own plugins leave out
    photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2")).upper()
    if photometric not in ("MONOCHROME1", "MONOCHROME2") or int(ds.get("NumberOfFrames", 1) or 1) != 1:
        raise CatalogError(
            f"{_where(path)}not a single-frame grayscale DICOM "
            f"(PhotometricInterpretation {photometric!r}, "
            f"NumberOfFrames {ds.get('NumberOfFrames', 1)}); dask_dl reads single-frame MONOCHROME1/2 images: "
            "remove the file from the collection or convert it"
        )
    values = apply_modality_lut(ds.pixel_array, ds)
    where = _where(path)
    if reject_degenerate and not np.all(np.isfinite(values)):
        raise DatasetError(
            f"{where}the modality LUT (RescaleSlope {ds.get('RescaleSlope')!r}, RescaleIntercept "
            f"{ds.get('RescaleIntercept')!r}) gives non-finite values; fix the header or remove the file"
        )
    has_voi = bool(ds.get("VOILUTSequence")) or (
        ds.get("WindowCenter") is not None and ds.get("WindowWidth") is not None
    )
    if has_voi:
        values = apply_voi_lut(values, ds)
        lo, hi = _output_range(ds)
    else:
        lo, hi = float(np.min(values)), float(np.max(values))
    image = _to_uint8(values, lo, hi)
    if reject_degenerate and image.size and image.min() == image.max():
        raise DatasetError(
            f"{where}the image is constant after scaling (every pixel {int(image.flat[0])}; stored values "
            f"{_range(ds.pixel_array)}, window {ds.get('WindowCenter')!r}/{ds.get('WindowWidth')!r}, rescale "
            f"{ds.get('RescaleSlope')!r}/{ds.get('RescaleIntercept')!r}): no contrast is left to learn from"
        )
    if photometric == "MONOCHROME1":
        image = 255 - image
    return image


def read_colour_pixels(path: str | os.PathLike | BinaryIO, *, reject_degenerate: bool = False) -> np.ndarray:
    """Read a colour DICOM image (``RGB`` or ``YBR_*``) as an ``(Rows, Columns, 3)`` uint8 RGB array.

    ``YBR_FULL``/``YBR_FULL_422`` (the colour space of JPEG-compressed colour DICOM: dermoscopy, endoscopy,
    whole-slide and fundus images) are converted to RGB by pydicom (``pixel_array``'s ``as_rgb``, pydicom 3; its
    ``convert_color_space`` before); ``YBR_ICT`` and ``YBR_RCT`` (JPEG 2000) are converted by the decoder.
    Samples of more than 8 bits are stretched from the image's min..max (over all three channels) onto 0..255.

    Parameters
    ----------
    path : str, path or binary file object
        A DICOM file.
    reject_degenerate : bool
        Raise a DatasetError for a constant image instead of returning it.

    Returns
    -------
    numpy.ndarray
        ``uint8`` array of shape ``(Rows, Columns, 3)``.

    Raises
    ------
    CatalogError
        A grey (``MONOCHROME*``), palette, multi-frame image or an unknown colour space; read grey images with
        :func:`read_pixels`.
    DatasetError
        With ``reject_degenerate``, for a constant image.
    MissingDependencyError
        If pydicom is not installed.
    """
    pydicom = _pydicom("reading DICOM pixels")
    ds = pydicom.dcmread(path)
    dicom_gdcm.use_for(ds)
    photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2")).upper()
    if photometric not in COLOUR_PHOTOMETRIC or int(ds.get("NumberOfFrames", 1) or 1) != 1:
        raise CatalogError(
            f"{_where(path)}not a single-frame colour DICOM (PhotometricInterpretation {photometric!r}, "
            f"NumberOfFrames {ds.get('NumberOfFrames', 1)}); colour stores read single-frame "
            f"{'/'.join(COLOUR_PHOTOMETRIC)} images: remove the file from the collection or convert it"
        )
    values = np.asarray(ds.pixel_array)
    if photometric.startswith("YBR_FULL") and int(pydicom.__version__.split(".")[0]) < 3:  # pragma: no cover
        from pydicom.pixel_data_handlers.util import convert_color_space

        values = convert_color_space(values, photometric, "RGB")  # pydicom 3 returns RGB itself (as_rgb=True)
    if values.ndim != 3 or values.shape[2] != 3:
        raise CatalogError(f"{_where(path)}colour pixel data of shape {values.shape}; need (Rows, Columns, 3)")
    if values.dtype != np.uint8:
        values = _to_uint8(values, float(values.min()), float(values.max()))
    if reject_degenerate and values.size and values.min() == values.max():
        raise DatasetError(
            f"{_where(path)}the image is constant (every sample {int(values.flat[0])}): no contrast is left to "
            "learn from"
        )
    return values


def _where(path: Any) -> str:
    """``'chest.dcm': `` to start a message; nothing for an unnamed file object (its repr holds a memory address,
    which would make ingest's status files differ from run to run)."""
    name = path if isinstance(path, str | os.PathLike) else getattr(path, "name", None)
    return f"{os.fspath(name)!r}: " if isinstance(name, str | os.PathLike) else ""


def _range(values: np.ndarray) -> str:
    return f"{values.min()}..{values.max()}" if values.size else "none"


def _age(value: Any) -> float:
    """DICOM ages are ``nnnD/W/M/Y`` strings; return years (NaN when absent)."""
    match = re.fullmatch(r"\s*(\d+)\s*([DWMY]?)\s*", str(value or ""))
    if not match:
        return float("nan")
    per_year = {"D": 365.25, "W": 52.18, "M": 12.0, "Y": 1.0, "": 1.0}[match.group(2)]
    return float(int(match.group(1)) / per_year)


def read_header(path: str) -> dict[str, Any]:
    """Read the catalog fields of one DICOM file without decoding its pixels.

    Returns
    -------
    dict
        ``sop_uid``, ``patient_id`` (``""`` when absent), ``age`` (years, NaN when absent), ``sex``, ``view``,
        ``orig_width``, ``orig_height``, ``spacing_x``, ``spacing_y`` (mm, NaN when absent).
    """
    limit = int(config.get("ingest.max-image-bytes"))  # a deflated header is inflated at most this far
    # pydicom warns about header values it reads anyway (a VR other than the transfer syntax's, a malformed number):
    # news for the file's author, not for the one cataloguing it; a field that cannot be read raises
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        ds = read_image_header(path, specific_tags=list(HEADER_TAGS), limit=limit)
        spacing = ds.get("PixelSpacing") or ds.get("ImagerPixelSpacing")
        # PixelSpacing is (row spacing, column spacing): the first value is along y.
        spacing_y, spacing_x = (float(spacing[0]), float(spacing[1])) if spacing else (np.nan, np.nan)
        return {
            "sop_uid": str(ds.get("SOPInstanceUID", "") or ""),
            "patient_id": str(ds.get("PatientID", "") or "").strip(),
            "age": _age(ds.get("PatientAge")),
            "sex": str(ds.get("PatientSex", "") or ""),
            "view": str(ds.get("ViewPosition", "") or ""),
            "orig_width": int(ds.get("Columns", 0) or 0),
            "orig_height": int(ds.get("Rows", 0) or 0),
            "spacing_x": spacing_x,
            "spacing_y": spacing_y,
        }


def _dicom_files(root: Path) -> list[Path]:
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(s.startswith(".") for s in p.relative_to(root).parts) and is_dicom_file(str(p))
    )


def _labels_from_csv(path: Path, frame: pd.DataFrame, labels: Sequence[str] | None) -> tuple[pd.DataFrame, list[str]]:
    """Label columns for ``frame`` from a CSV keyed (first column) by SOP UID, file name or path under root."""
    if not path.is_file():
        raise StoreNotFoundError(f"no labels table at {str(path)!r}")
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    key = table.columns[0]
    table[key] = table[key].str.strip()
    if table[key].duplicated().any():
        raise CatalogError(
            f"{str(path)!r}: {table.loc[table[key].duplicated(), key].iloc[0]!r} appears twice in its key column "
            f"{key!r}; the first column names each image once (SOP Instance UID, file name or path under the root)"
        )
    position = pd.Series(np.arange(len(table)), index=table[key])
    row = frame["sop_uid"].map(position)
    for candidate in (frame["file_name"], frame["relative"]):
        row = row.fillna(candidate.map(position))
    if row.isna().any():
        missing = list(frame.loc[row.isna(), "file_name"][:5])
        raise CatalogError(
            f"{int(row.isna().sum())} DICOM file(s) have no row in {str(path)!r}, e.g. {missing}; its first column "
            f"({key!r}) must name each image by SOP Instance UID, file name or path under the root: add the rows, "
            "or move the unlabeled files out of the collection"
        )
    rows = table.iloc[row.astype(int).to_numpy()].reset_index(drop=True)
    if "Finding Labels" in rows.columns:
        findings = rows["Finding Labels"]
        if labels is None:
            seen = {f.strip() for text in findings for f in str(text).split("|")} - {NO_FINDING, ""}
            labels = list(NIH_LABELS) if seen <= set(NIH_LABELS) else sorted(seen)
        return parse_findings(findings, labels=labels, image_ids=frame["image_id"]), list(labels)
    columns = [c for c in table.columns if c != key] if labels is None else list(labels)
    absent = [c for c in columns if c not in rows.columns]
    if absent or not columns:
        raise CatalogError(
            f"{str(path)!r} has no column 'Finding Labels' and lacks label column(s) {absent or columns}; "
            f"it has {list(table.columns)}. Give 'Finding Labels' (pipe-separated) or one 0/1 column per label"
        )
    return rows[columns].reset_index(drop=True), list(columns)


def read_dicom(
    root: str | os.PathLike,
    *,
    labels_csv: str | os.PathLike | None = None,
    labels: Sequence[str] | None = None,
    site: str | None = None,
    id_from: str = "uid",
    seed: int | None = None,
    val_fraction: float | None = None,
    test_fraction: float | None = None,
) -> pd.DataFrame:
    """Read every DICOM file under ``root`` into a catalog, with metadata from the headers.

    Parameters
    ----------
    root : str or path
        Folder searched recursively for DICOM files (``.dcm``/``.dicom`` names, or extension-less files with
        the ``DICM`` marker).
    labels_csv : str or path, optional
        Labels table. Its first column names each image by SOP Instance UID, file name or path under ``root``;
        then either a ``Finding Labels`` column (pipe-separated, ``No Finding`` for none) or one 0/1 column per
        label. Without it the catalog has no label columns (for prediction only).
    labels : sequence of str, optional
        The label columns, in order. Default: NIH's 14 labels when every finding is one of them, else the
        findings found, sorted; for a table of 0/1 columns, all columns after the first.
    site : str, optional
        Value of the ``site`` column. Default: the name of ``root``.
    id_from : {"uid", "path"}
        ``image_id`` from the SOP Instance UID (default) or the path under ``root``, for collections where
        copies of one instance share a UID.
    seed, val_fraction, test_fraction
        Passed to :func:`~dask_dl.data.splits.split_by_patient`.

    Returns
    -------
    pandas.DataFrame
        A ``multilabel`` catalog of the files whose header can be read (the others, each with its reason, are
        logged and listed in ``catalog.attrs["skipped"]``), with ``patient_id`` from PatientID (the image id when
        absent), ``age`` (years), ``sex``, ``view``, ``orig_width``, ``orig_height``, ``spacing_x``, ``spacing_y``
        from the headers.

    Raises
    ------
    StoreNotFoundError
        If ``root`` or ``labels_csv`` does not exist.
    CatalogError
        If ``root`` holds no DICOM files, two files share a SOP Instance UID, or images lack labels.
    MissingDependencyError
        If pydicom is not installed.

    Examples
    --------
    >>> catalog = read_dicom("/data/dicom", labels_csv="/data/labels.csv")  # doctest: +SKIP
    """
    _pydicom("reading a DICOM collection")
    root = Path(root).expanduser().absolute()
    if not root.is_dir():
        raise StoreNotFoundError(f"the DICOM collection {str(root)!r} is not a directory")
    one_of("id_from", id_from, ("uid", "path"))
    if labels is not None and labels_csv is None:
        raise ConfigurationError("labels= names columns of a labels table: pass labels_csv= too")
    files = _dicom_files(root)
    if not files:
        raise CatalogError(f"no DICOM files (.dcm, .dicom or with the DICM marker) under {str(root)!r}")
    headers, skipped = [], []
    for p in files:
        try:
            headers.append(read_header(str(p)))
        except Exception as exc:  # pydicom raises many kinds of errors for broken headers: one file, one skip
            skipped.append({"path": str(p), "reason": f"{type(exc).__name__}: {exc}"})
    files = [p for p in files if str(p) not in {s["path"] for s in skipped}]
    if skipped:
        logger.warning(
            "read_dicom(%r): skipped %d file(s) whose header cannot be read (listed in catalog.attrs['skipped']), "
            "e.g. %s: %s",
            str(root),
            len(skipped),
            skipped[0]["path"],
            skipped[0]["reason"],
        )
    if not files:
        raise CatalogError(
            f"none of the {len(skipped)} DICOM files under {str(root)!r} has a readable header, e.g. "
            f"{skipped[0]['path']}: {skipped[0]['reason']}"
        )
    frame = pd.DataFrame(headers)
    relative = pd.Series([p.relative_to(root).as_posix() for p in files])
    frame["file_name"] = [p.name for p in files]
    frame["relative"] = relative
    if id_from == "uid":
        no_uid = frame["sop_uid"] == ""
        if no_uid.any():
            raise CatalogError(
                f"{relative[no_uid].iloc[0]!r} has no SOP Instance UID; pass id_from='path' (dask-dl catalog "
                "--id-from path) to name images by path"
            )
        dup = frame["sop_uid"].duplicated(keep=False)
        if dup.any():
            uid = frame.loc[dup, "sop_uid"].iloc[0]
            raise CatalogError(
                f"the files {list(relative[frame['sop_uid'] == uid])} share the SOP Instance UID {uid!r}; "
                "image ids must be unique: remove the copies, or pass id_from='path' (dask-dl catalog --id-from path "
                "-o catalog.parquet, then ingest that) to name images by path"
            )
        frame["image_id"] = frame["sop_uid"]
    else:
        frame["image_id"] = relative
    frame["path"] = [str(p) for p in files]
    # Without a PatientID each image is its own patient: nothing better is known about it.
    frame["patient_id"] = frame["patient_id"].where(frame["patient_id"] != "", frame["image_id"])
    frame["site"] = str(site) if site is not None else root.name
    frame["split"] = "train"
    label_frame, label_names = (
        _labels_from_csv(Path(labels_csv), frame, labels) if labels_csv is not None else (pd.DataFrame(), [])
    )
    meta = [c for c in METADATA_COLUMNS if c != "follow_up"]  # a DICOM file has no follow-up number
    catalog = pd.concat(
        [frame[list(REQUIRED_COLUMNS)], label_frame.set_axis(frame.index), frame[meta]],
        axis=1,
    )
    catalog.attrs = {"labels": label_names, "task": "multilabel", **({"skipped": skipped} if skipped else {})}
    return split_by_patient(catalog, seed=seed, val_fraction=val_fraction, test_fraction=test_fraction)


LAYOUTS.register("dicom", read_dicom, help="a folder of DICOM files, labels from a CSV (labels_csv=)")
