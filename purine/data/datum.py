"""Caffe's Datum records and images: parsing, raw (``data`` bytes or ``float_data``) and
encoded (JPEG/PNG decoded by OpenCV as Caffe's DecodeDatumToCVMat does) payloads, the
``.binaryproto`` mean file, and stacking decoded images into a batch."""

from __future__ import annotations

import os
from collections.abc import Sequence

import cv2
import numpy as np
from google.protobuf.message import DecodeError

from purine.data import DataError
from purine.errors import ProtoError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import blob_to_array
from purine.formats.prototxt import read_binary

Image = np.ndarray
"""A decoded image: ``(C, H, W)``, possibly a transposed view of OpenCV's ``(H, W, C)``."""


def show_key(key: bytes) -> str:
    return key.decode("utf-8", "backslashreplace")


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


def decode_image(buf: bytes | np.ndarray, flag: int, where: str) -> Image:
    """An encoded image (JPEG, PNG, ...) decoded by OpenCV as (C, H, W) uint8."""
    if len(buf) == 0:  # OpenCV asserts on an empty buffer instead of failing the decode
        raise DataError(f"{where}: encoded Datum with no data bytes; expected an image "
                        "file's bytes (JPEG, PNG, ...)")
    try:
        img = cv2.imdecode(np.frombuffer(buf, np.uint8), flag)
    except cv2.error as e:
        raise DataError(f"{where}: cannot decode the encoded image ({len(buf)} bytes): "
                        f"{' '.join(str(e).split())}") from None
    if img is None:
        raise DataError(f"{where}: cannot decode the encoded image ({len(buf)} bytes); "
                        "the record is truncated or not an image OpenCV reads")
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
