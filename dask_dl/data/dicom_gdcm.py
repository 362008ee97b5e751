"""A pydicom decoding plugin for 12-bit JPEG Extended (``1.2.840.10008.1.2.4.51``) through GDCM (python-gdcm).

pydicom 3's own GDCM plugin refuses JPEG Extended with 12-bit samples, although GDCM decodes it (it carries a
12-bit build of the IJG libjpeg); the only other decoder pydicom knows for it is pylibjpeg-libjpeg, which is
GPL-3.0 and so is not in the ``dicom`` extra. pydicom's plugin interface (``Decoder.add_plugin``) imports this
module and calls :func:`is_available` and :func:`decode_frame`; :func:`use_for` chooses it for a dataset.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["DECODER_DEPENDENCIES", "LABEL", "decode_frame", "is_available", "use_for"]

#: the plugin's name among pydicom's decoders
LABEL = "dask_dl-gdcm-12bit"
_JPEG_EXTENDED = "1.2.840.10008.1.2.4.51"
#: what pydicom names as missing when this plugin is unavailable
DECODER_DEPENDENCIES = {_JPEG_EXTENDED: ("gdcm>=3.0.10",)}
_registering = threading.Lock()  # pydicom's add_plugin is not thread-safe, and Dask workers decode in threads
_registered: list[bool] = []


def is_available(uid: str) -> bool:
    """True for JPEG Extended when python-gdcm 3 is installed."""
    if uid != _JPEG_EXTENDED:
        return False
    try:
        import gdcm
    except ImportError:
        return False
    return int(gdcm.Version.GetVersion().split(".")[0]) >= 3


def decode_frame(src: bytes, runner: Any) -> bytes:
    """One frame's 12-bit JPEG codestream, decoded by GDCM into 16-bit samples (pydicom's ``DecodeRunner``)."""
    import gdcm

    if runner.bits_allocated != 16:
        raise ValueError(f"12-bit JPEG needs Bits Allocated 16, the header says {runner.bits_allocated}")
    fragment = gdcm.Fragment()
    fragment.SetByteStringValue(src)
    fragments = gdcm.SequenceOfFragments.New()
    fragments.AddFragment(fragment)
    element = gdcm.DataElement(gdcm.Tag(0x7FE0, 0x0010))
    element.SetValue(fragments.__ref__())
    image = gdcm.Image()
    image.SetNumberOfDimensions(2)
    image.SetDimensions((runner.columns, runner.rows, 1))
    image.SetDataElement(element)
    pi = gdcm.PhotometricInterpretation.GetPIType(str(runner.photometric_interpretation))
    image.SetPhotometricInterpretation(gdcm.PhotometricInterpretation(pi))
    if runner.samples_per_pixel > 1:
        image.SetPlanarConfiguration(runner.planar_configuration)
    image.SetTransferSyntax(gdcm.TransferSyntax(gdcm.TransferSyntax.GetTSType(_JPEG_EXTENDED)))
    # Bits Allocated 12 makes GDCM take its 12-bit codec at once (the samples still come out 16 bits wide); with 16
    # it tries its 16-bit codec first and prints "Unsupported JPEG data precision 12" on stderr for every image
    image.SetPixelFormat(gdcm.PixelFormat(runner.samples_per_pixel, 12, 12, 11, runner.pixel_representation))
    frame = image.GetBuffer().encode("utf-8", "surrogateescape")  # GDCM hands the buffer over as a str
    expected = runner.rows * runner.columns * runner.samples_per_pixel * 2
    if len(frame) != expected:
        raise ValueError(f"GDCM decoded {len(frame)} bytes of 12-bit JPEG, expected {expected}")
    return frame


def use_for(ds: Any) -> None:
    """Have pydicom decode ``ds`` with this plugin if it is 12-bit JPEG Extended and python-gdcm is installed.

    It is added once to the end of pydicom's decoders for that transfer syntax, and chosen for this dataset
    (``pixel_array_options``): otherwise pydicom would first try its own GDCM and Pillow plugins, which refuse 12-bit
    samples, and log each refusal with a traceback, for every image.
    """
    if str(ds.file_meta.get("TransferSyntaxUID", "")) != _JPEG_EXTENDED or int(ds.get("BitsStored", 8) or 8) <= 8:
        return  # 8-bit JPEG Extended: pydicom's GDCM and Pillow plugins decode it
    if not hasattr(ds, "pixel_array_options"):  # pragma: no cover - pydicom 2 has no plugins (but decodes with GDCM)
        return
    from pydicom.pixels import get_decoder

    decoder = get_decoder(_JPEG_EXTENDED)
    with _registering:
        if not _registered:
            decoder.add_plugin(LABEL, (__name__, "decode_frame"))  # available or not, as is_available says
            _registered.append(True)
    if LABEL in decoder.available_plugins:
        ds.pixel_array_options(decoding_plugin=LABEL)
