"""Caffe's .binaryproto blobs (mean files, a BlobProto each) to and from numpy's .npy: the
direction follows the input's suffix. 4-D arrays are written in the legacy
num/channels/height/width form Caffe's compute_image_mean writes; others use ``shape``."""

from __future__ import annotations

import argparse
import io
import os
import sys

import numpy as np

from purine.converters import ConvertError, run_main
from purine.converters.compute_image_mean import mean_blob_bytes
from purine.errors import ProtoError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import atomic_write, blob_to_array, encode_blob
from purine.formats.prototxt import read_binary


def read_binaryproto(path: str | os.PathLike) -> np.ndarray:
    """The float32 array of a binary BlobProto file, shaped by ``shape`` or the legacy
    num/channels/height/width fields."""
    path = os.fspath(path)
    blob = read_binary(path, pb.BlobProto())
    if not (blob.data or blob.double_data or blob.HasField("shape") or blob.HasField("num")):
        raise ConvertError(f"{path}: the BlobProto holds no data")
    try:
        return blob_to_array(blob)
    except ProtoError as e:
        raise ConvertError(f"{path}: {e}") from None


def blobproto_bytes(array: np.ndarray) -> bytes:
    """BlobProto bytes for ``array`` (stored as float32): legacy 4-D fields for a 4-D array,
    as Caffe's mean files have them (every Caffe version reads those), else ``shape``."""
    array = np.asarray(array)
    if array.ndim == 4:
        return mean_blob_bytes(array)
    return encode_blob(array)


def write_binaryproto(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write ``array`` as a BlobProto file (temporary file + rename)."""
    atomic_write(path, blobproto_bytes(array))


def read_npy(path: str | os.PathLike) -> np.ndarray:
    """A numeric array from a .npy file (never unpickles)."""
    path = os.fspath(path)
    try:
        array = np.load(path, allow_pickle=False)
    except OSError as e:
        raise ConvertError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:
        raise ConvertError(f"{path}: not a plain .npy array ({e})") from None
    if not isinstance(array, np.ndarray):
        raise ConvertError(f"{path}: holds several arrays (.npz); give one .npy")
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_) \
            or np.iscomplexobj(array):
        raise ConvertError(f"{path}: dtype {array.dtype} is not a real number type")
    return array


def write_npy(path: str | os.PathLike, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(array), allow_pickle=False)
    atomic_write(path, buf.getvalue())


def convert(src: str | os.PathLike, dst: str | os.PathLike) -> np.ndarray:
    """.npy -> .binaryproto when ``src`` ends in .npy, else .binaryproto -> .npy; returns the
    array."""
    src, dst = os.fspath(src), os.fspath(dst)
    try:
        if src.lower().endswith(".npy"):
            array = read_npy(src)
            write_binaryproto(dst, array)
        else:
            array = read_binaryproto(src)
            write_npy(dst, array)
    except OSError as e:
        raise ConvertError(f"{dst}: cannot write: {e.strerror}") from None
    return array


# -- the command --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    if parser.description is None:
        parser.description = ("Convert a Caffe .binaryproto blob (a mean file) to a numpy "
                              ".npy, or a .npy to a .binaryproto: the input's suffix decides.")
    parser.add_argument("input", metavar="INPUT", help="a .binaryproto or a .npy")
    parser.add_argument("output", metavar="OUTPUT", help="the .npy or .binaryproto to write")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    array = convert(args.input, args.output)
    print(f"{args.input} -> {args.output}: shape {tuple(array.shape)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("binaryproto", add_arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
