"""Caffe's Datum records and images: the one Datum encoder (the bytes Caffe's tools write),
parsing, raw (``data`` bytes or ``float_data``) and encoded (JPEG/PNG decoded by OpenCV as
Caffe's DecodeDatumToCVMat does) payloads, the ``.binaryproto`` mean file, and stacking
decoded images into a batch."""

from __future__ import annotations

import operator
import os
import struct
import sys
import tempfile
import threading
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import cv2
import numpy as np
from google.protobuf.message import DecodeError

from purine.data import DataError
from purine.errors import ProtoError, one_line
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import blob_to_array
from purine.formats.prototxt import read_binary
from purine.formats.wire import len_field, varint
from purine.log import get_logger

Image = np.ndarray
"""A decoded image: ``(C, H, W)``, possibly a transposed view of OpenCV's ``(H, W, C)``."""


def show_key(key: bytes) -> str:
    return key.decode("utf-8", "backslashreplace")


# -- encoding: the field layout Caffe's tools write (CVMatToDatum, EncodeCVMatToDatum,
# extract_features), built from bytes so that float rows need no per-value protobuf call.
# A float_data value is unpacked, as Caffe writes it: its tag byte, then the float.
_FLOAT_FIELD = np.dtype([("tag", "u1"), ("value", "<f4")])
_FLOAT_TAG = 6 << 3 | 5
_INT32 = (-(1 << 31), (1 << 31) - 1)


def _int_field(number: int, value: int, what: str) -> bytes:
    """A varint field of an int32 (a negative one as its 64-bit two's complement)."""
    value = operator.index(value)  # an integer type; a float label is refused, as protobuf does
    if not _INT32[0] <= value <= _INT32[1]:
        raise DataError(f"Datum {what} {value} does not fit the int32 field")
    return varint(number << 3) + varint(value & 0xFFFF_FFFF_FFFF_FFFF)


def encode_datums(pixels: np.ndarray, labels: Sequence[int] | None = None, *,
                  encoded: bool | None = None) -> list[bytes]:
    """The serialized Datums of the N records of ``pixels`` (N, C, H, W): channels, height,
    width, then uint8 pixels as ``data`` or any other type as ``float_data`` (through
    float64, as pycaffe converts), each record's label when ``labels`` are given, and
    ``encoded`` when not None (Caffe's convert_imageset writes ``encoded: false``)."""
    pixels = np.asarray(pixels)
    if pixels.ndim != 4:
        raise DataError(f"Datum pixels are (N, channels, height, width), got shape "
                        f"{pixels.shape}")
    n, c, h, w = pixels.shape
    head = (_int_field(1, c, "channels") + _int_field(2, h, "height")
            + _int_field(3, w, "width"))
    tail = b"" if encoded is None else varint(7 << 3) + (b"\x01" if encoded else b"\x00")
    label_fields = ([b""] * n if labels is None
                    else [_int_field(5, label, "label") for label in labels])
    if len(label_fields) != n:
        raise DataError(f"{len(label_fields)} labels for {n} Datum records")
    if pixels.dtype == np.uint8:
        rows = np.ascontiguousarray(pixels).reshape(n, c * h * w)
        head += varint(4 << 3 | 2) + varint(rows.shape[1])  # data: tag, length
        return [b"".join((head, rows[k].tobytes(), label_fields[k], tail)) for k in range(n)]
    fields = np.empty((n, c * h * w), _FLOAT_FIELD)
    fields["tag"] = _FLOAT_TAG
    fields["value"] = pixels.reshape(n, c * h * w)  # cast to float32 as it is stored
    body, size = fields.tobytes(), c * h * w * _FLOAT_FIELD.itemsize
    return [b"".join([head, label_fields[k], body[k * size:(k + 1) * size], tail])
            for k in range(n)]


def encode_datum(pixels: np.ndarray | bytes, label: int | None = None, *,
                 encoded: bool | None = None) -> bytes:
    """One serialized Datum: of a (C, H, W) array as ``encode_datums`` writes it, or of an
    encoded image's bytes (PNG, JPEG): ``data``, the label, ``encoded: true`` and no
    channels, height or width, as Caffe's EncodeCVMatToDatum stores it."""
    labels = None if label is None else [label]
    if isinstance(pixels, (bytes, bytearray, memoryview)):
        return b"".join([*len_field(4, bytes(pixels)),
                         b"" if label is None else _int_field(5, label, "label"),
                         varint(7 << 3), b"\x01"])
    pixels = np.asarray(pixels)
    if pixels.ndim != 3:
        raise DataError(f"a Datum holds a (channels, height, width) array, got shape "
                        f"{pixels.shape}")
    return encode_datums(pixels[None], labels, encoded=encoded)[0]


def parse_datum(value: bytes, where: str) -> pb.Datum:
    d = pb.Datum()
    try:
        d.ParseFromString(value)
    except DecodeError as e:
        raise DataError(f"{where}: not a serialized Datum ({len(value)} bytes: {e})") from None
    return d


def decode_flag(force_color: bool, force_gray: bool) -> int:
    """OpenCV's read flag for an encoded record: Caffe decodes natively (keeping the stored
    channels) unless force_color or force_gray asks for 3 or 1 channels."""
    if force_color:
        return cv2.IMREAD_COLOR
    if force_gray:
        return cv2.IMREAD_GRAYSCALE
    return cv2.IMREAD_UNCHANGED


def chw(img: np.ndarray) -> Image:
    """OpenCV's (H, W) or (H, W, C) as a (C, H, W) view."""
    return img[None] if img.ndim == 2 else img.transpose(2, 0, 1)


# -- decoding without foreign text --------------------------------------------------------
# OpenCV logs its codecs' complaints (libtiff, OpenJPEG, its own PNG and BMP readers) through
# its logger, which is silenced around a decode. libpng and libjpeg print straight to file
# descriptor 2; a PNG or JPEG whose structure is damaged (checked below in microseconds)
# is decoded with that descriptor captured, so the codec's words end up in our one line.
_quiet_lock = threading.Lock()
_quiet_depth = 0
_quiet_saved = 0


@contextmanager
def opencv_quiet() -> Iterator[None]:
    """Silence OpenCV's own log lines while the block runs. Blocks may nest and run in
    several threads at once: the first one in saves OpenCV's level, the last one out
    restores it."""
    global _quiet_depth, _quiet_saved
    with _quiet_lock:
        if _quiet_depth == 0:
            _quiet_saved = cv2.utils.logging.getLogLevel()
            cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                cv2.utils.logging.setLogLevel(_quiet_saved)


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_sound(buf: bytes) -> bool:
    """Whether a PNG's chunks are whole, start with IHDR, end with IEND and match their CRCs
    (what libpng would otherwise complain of on stderr)."""
    at, first = 8, True
    while at + 12 <= len(buf):
        n, kind = struct.unpack_from(">I4s", buf, at)
        end = at + 12 + n
        if n > 2**31 - 1 or end > len(buf) or (first and kind != b"IHDR"):
            return False
        crc = struct.unpack_from(">I", buf, end - 4)[0]
        if zlib.crc32(memoryview(buf)[at + 4:end - 4]) != crc:
            return False
        if kind == b"IEND":
            return True
        at, first = end, False
    return False


def _jpeg_sound(buf: bytes) -> bool:
    """Whether a JPEG's marker segments up to its first scan are whole and an EOI marker
    follows (what libjpeg would otherwise complain of on stderr: "Premature end of JPEG
    file" ...). The entropy-coded data itself is not walked: that would cost as much as a
    fifth of the decode."""
    at, n = 2, len(buf)
    while at + 1 < n:
        if buf[at] != 0xFF:
            return False
        marker = buf[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in (0xD8, 0xD9) or 0xD0 <= marker <= 0xD7 or marker == 0x01:
            return False  # no standalone marker belongs before the first scan
        if at + 4 > n:
            return False
        end = at + 2 + (buf[at + 2] << 8 | buf[at + 3])
        if end > n or end < at + 4:
            return False
        if marker == 0xDA:  # start of scan
            return buf.rfind(b"\xff\xd9") >= end
        at = end
    return False


def _looks_sound(buf: bytes) -> bool:
    if buf.startswith(_PNG_SIGNATURE):
        return _png_sound(buf)
    if buf.startswith(b"\xff\xd8"):
        return _jpeg_sound(buf)
    return True  # other formats: OpenCV's logger carries their codecs' words


_fd2_lock = threading.Lock()


def _imdecode_captured(data: np.ndarray, flag: int) -> tuple[np.ndarray | None, str]:
    """cv2.imdecode with file descriptor 2 sent to a temporary file: (the image or None,
    what the codec printed). Only damaged files come here, one at a time; a line another
    thread writes to stderr meanwhile lands in the captured text rather than vanish."""
    with _fd2_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            img = cv2.imdecode(data, flag)
        except cv2.error as e:
            img, error = None, " ".join(str(e).split())
        else:
            error = ""
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        said = tmp.read(4096).decode("utf-8", "replace")
    return img, " ".join((" ".join(said.split()) + " " + error).split())


def imdecode_quiet(buf: bytes | np.ndarray, flag: int) -> tuple[np.ndarray | None, str]:
    """``cv2.imdecode`` of a non-empty buffer with no codec writing to stderr: the image
    (None where it cannot be decoded) and what the codec said, in one line ("" if nothing)."""
    data = np.frombuffer(buf, np.uint8)
    head = bytes(data[:8])
    sound = not (head.startswith(_PNG_SIGNATURE) or head.startswith(b"\xff\xd8")) \
        or _looks_sound(data.tobytes() if isinstance(buf, np.ndarray) else bytes(buf))
    with opencv_quiet():
        if not sound:
            return _imdecode_captured(data, flag)
        try:
            return cv2.imdecode(data, flag), ""
        except cv2.error as e:
            return None, " ".join(str(e).split())


def decode_image(buf: bytes | np.ndarray, flag: int, where: str) -> Image:
    """An encoded image (JPEG, PNG, ...) decoded by OpenCV as (C, H, W) uint8. No codec
    writes to stderr: a damaged image is our one DataError, or (when OpenCV still decodes
    it, as Caffe would use it) one warning in the log naming the record."""
    if len(buf) == 0:  # OpenCV asserts on an empty buffer instead of failing the decode
        raise DataError(f"{where}: encoded Datum with no data bytes; expected an image "
                        "file's bytes (JPEG, PNG, ...)")
    img, said = imdecode_quiet(buf, flag)
    if img is None:
        raise DataError(f"{where}: cannot decode the encoded image ({len(buf)} bytes); "
                        "the record is truncated or not an image OpenCV reads"
                        + (f" ({said})" if said else ""))
    if said:
        get_logger().warning("%s: the encoded image is damaged; decoded anyway, as Caffe "
                             "does (%s)", one_line(where), said)
    return check_depth(img, where)


def check_depth(img: np.ndarray, where: str) -> Image:
    if img.dtype != np.uint8:
        raise DataError(f"{where}: image of type {img.dtype}; Caffe's transformer takes 8-bit "
                        "images only")
    return chw(img)


def check_payload(d: pb.Datum, where: str) -> None:
    """What every reader checks before decoding a record: one payload, ``data`` (bytes, or
    an encoded image) or ``float_data``, not both."""
    if d.data and d.float_data:
        raise DataError(f"{where}: Datum holds both data ({len(d.data)} bytes) and float_data "
                        f"({len(d.float_data)} values); expected one of them")


def raw_dims(d: pb.Datum, where: str) -> tuple[int, int, int]:
    """The channels, height and width of a raw Datum, each 1 or more (int32 fields: their
    product, a Python integer, cannot wrap)."""
    shape = (d.channels, d.height, d.width)
    if min(shape) <= 0:
        raise DataError(f"{where}: raw Datum with channels, height, width = {shape}; each "
                        "must be 1 or more")
    return shape


def datum_image(d: pb.Datum, flag: int, where: str) -> Image:
    """The record's pixels as (C, H, W): uint8 for ``data``, float32 for ``float_data``."""
    check_payload(d, where)
    if d.encoded:
        return decode_image(d.data, flag, where)
    shape = raw_dims(d, where)
    n = shape[0] * shape[1] * shape[2]
    if d.data:
        if len(d.data) != n:
            raise DataError(f"{where}: {len(d.data)} data bytes for channels x height x width "
                            f"= {shape}, which needs {n}")
        return np.frombuffer(d.data, np.uint8).reshape(shape)
    if len(d.float_data) != n:
        raise DataError(f"{where}: {len(d.float_data)} float_data values for channels x height"
                        f" x width = {shape}, which needs {n}")
    return np.asarray(d.float_data, dtype=np.float32).reshape(shape)


def read_mean(path: str | os.PathLike) -> np.ndarray:
    """A mean file (.binaryproto BlobProto, as compute_image_mean writes) as (C, H, W)."""
    path = os.fspath(path)
    try:
        blob = read_binary(path, pb.BlobProto())
    except ProtoError as e:  # names the file already
        raise DataError(f"mean file {e}") from None
    try:
        mean = blob_to_array(blob)
    except ProtoError as e:
        raise DataError(f"mean file '{path}': {e}") from None
    if mean.ndim == 4 and mean.shape[0] == 1:
        mean = mean[0]
    if mean.ndim != 3:
        raise DataError(f"mean file '{path}': shape {mean.shape}; a mean image is "
                        "(1, channels, height, width)")
    return mean


def _hwc(im: Image) -> np.ndarray | None:
    """The (H, W, C) array ``im`` is the transposed view of, if it is one."""
    b = im.base
    if isinstance(b, np.ndarray) and b.ndim == 3 and b.shape == im.shape[1:] + im.shape[:1] \
            and b.flags.c_contiguous and im.strides[0] == b.itemsize:
        return b
    return None


def stack(images: Sequence[Image]) -> np.ndarray:
    """Images of one shape as a (B, C, H, W) array; OpenCV images are stacked as they are,
    (B, H, W, C), and viewed as (B, C, H, W), so that stacking is a plain copy."""
    dtype = np.result_type(*(im.dtype for im in images))
    bases = [_hwc(im) for im in images]
    if all(b is not None for b in bases):
        return np.stack(bases).astype(dtype, copy=False).transpose(0, 3, 1, 2)
    return np.stack(images).astype(dtype, copy=False)
