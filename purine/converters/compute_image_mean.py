"""Caffe's compute_image_mean: the mean image of an LMDB or a LevelDB of Datums (raw, float
or encoded), written as a BlobProto (1, C, H, W) in the legacy num/channels/height/width
form Caffe writes, and the per-channel means logged as Caffe logs them."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

import cv2
import numpy as np
from google.protobuf import message

from purine.converters import ConvertError, flag, run_main
from purine.converters.progress import Progress, wanted
from purine.data import db as backends
from purine.data.datum import check_payload, decode_image, raw_dims
from purine.data.db import Backend
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import atomic_write
from purine.formats.wire import len_field, varint
from purine.log import get_logger

BATCH = 256  # raw datums summed per numpy call
LOG_EVERY = 10000  # Caffe logs "Processed N files." every 10000


def _decode(datum: pb.Datum, where: str) -> pb.Datum:
    """Caffe's DecodeDatumNative: an encoded datum becomes a raw one, channels as stored."""
    image = decode_image(datum.data, cv2.IMREAD_UNCHANGED, where)
    c, h, w = image.shape
    return pb.Datum(channels=c, height=h, width=w, label=datum.label,
                    data=np.ascontiguousarray(image).tobytes())


def _records(path: str, backend: Backend) -> Iterator[tuple[bytes, bytes]]:
    """The (key, value) records of the database in key order."""
    found = backends.detect(path)
    if found is None:
        if not os.path.exists(path):
            raise ConvertError(f"{path}: no such {backend.kind} folder")
        raise ConvertError(f"{path}: {backends.neither()}")
    if found != backend.name:
        raise ConvertError(f"{path}: is {backends.get(found).article}, not {backend.article}: "
                           f"give --backend {found}")
    yield from backend.walk(path, ConvertError)


def _datums(path: str, backend: Backend) -> Iterator[tuple[bytes, pb.Datum]]:
    for key, value in _records(path, backend):
        datum = pb.Datum()
        try:
            datum.ParseFromString(value)
        except message.DecodeError:
            raise ConvertError(f"{path}: record {key!r} is not a Datum") from None
        yield key, datum


def compute_image_mean(db: str | os.PathLike, output: str | os.PathLike | None = None, *,
                       backend: str = "lmdb", log=None) -> np.ndarray:
    """The mean over all datums of the ``backend`` database ``db`` (lmdb, leveldb or another
    registered backend) as a float32 array (1, C, H, W); written
    to ``output`` (a .binaryproto) when given. uint8 data is summed exactly (as integers):
    the result equals Caffe's float32 accumulation up to 65,793 images and is closer to the
    true mean beyond; float_data is summed in float64."""
    log = log or get_logger()
    kind = backends.require(backend, ConvertError)
    path = os.fspath(db)
    shape = None
    size = count = 0
    int_sum: np.ndarray | None = None  # uint8 data, summed exactly
    float_sum: np.ndarray | None = None  # float_data, in float64
    pending: list[bytes] = []

    def flush() -> None:
        nonlocal int_sum
        if pending:
            block = np.frombuffer(b"".join(pending), np.uint8).reshape(len(pending), size)
            int_sum += block.sum(axis=0, dtype=np.int64)
            pending.clear()

    total = kind.count(path) if wanted() else None
    label = os.path.basename(os.path.normpath(path))
    with Progress(total, label, unit="record", log=log) as progress:
        for key, datum in _datums(path, kind):
            where = f"{path}: record {key!r}"
            check_payload(datum, where)
            if datum.encoded:
                if shape is None:
                    log.info("Decoding Datum")
                datum = _decode(datum, where)
            dims = raw_dims(datum, where)
            n = max(len(datum.data), len(datum.float_data))
            if shape is None:
                shape, size = dims, dims[0] * dims[1] * dims[2]
                if n != size:  # before the sums are allocated: the dims may be huge
                    raise ConvertError(f"{where}: incorrect data field size {n} for CxHxW "
                                       f"{'x'.join(map(str, shape))} = {size}")
                int_sum = np.zeros(size, np.int64)
                float_sum = np.zeros(size, np.float64)
                log.info("Starting Iteration")
            if n != size:
                raise ConvertError(f"{where}: incorrect data field size {n}; the "
                                   f"first datum is {'x'.join(map(str, shape))} (CxHxW) = {size}")
            if datum.data:
                pending.append(datum.data)
                if len(pending) == BATCH:
                    flush()
            else:
                float_sum += np.asarray(datum.float_data, dtype=np.float32)
            count += 1
            progress.update(count)
            if count % LOG_EVERY == 0:
                log.info("Processed %d files.", count)
    if shape is None:
        raise ConvertError(f"{path}: the database holds no records")
    flush()
    if count % LOG_EVERY != 0:
        log.info("Processed %d files.", count)
    mean = ((int_sum + float_sum) / count).astype(np.float32).reshape(1, *shape)
    if output is not None:
        log.info("Write to %s", os.fspath(output))
        try:
            atomic_write(output, mean_blob_bytes(mean))
        except OSError as e:
            raise ConvertError(f"{os.fspath(output)}: cannot write: {e.strerror}") from None
    log.info("Number of channels: %d", shape[0])
    for c, v in enumerate(mean[0].reshape(shape[0], -1).mean(axis=1, dtype=np.float64)):
        log.info("mean_value channel [%d]:%g", c, v)
    return mean


def mean_blob_bytes(mean: np.ndarray) -> bytes:
    """A 4-D array as BlobProto bytes in Caffe's legacy form: num, channels, height, width
    (fields 1-4) and packed float data (field 5), byte for byte what Caffe's tool writes."""
    mean = np.asarray(mean, dtype="<f4")
    if mean.ndim != 4:
        raise ConvertError(f"a mean blob is (1, C, H, W), got shape {mean.shape}")
    dims = b"".join(varint(field << 3) + varint(int(d))
                    for field, d in enumerate(mean.shape, 1))
    return dims + b"".join(len_field(5, np.ascontiguousarray(mean).tobytes()))


# -- the command --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Caffe's compute_image_mean flags and arguments."""
    if parser.description is None:
        parser.description = ("Compute the mean_image of a set of images given by an lmdb or a "
                              "leveldb.")
    flag(parser, "backend", default="lmdb",
         help="the db backend: lmdb or leveldb (leveldb needs the plyvel package)")
    parser.add_argument("db", metavar="INPUT_DB", help="the database of Datums")
    parser.add_argument("output", metavar="OUTPUT_FILE", nargs="?", default=None,
                        help="the .binaryproto to write (optional)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    compute_image_mean(args.db, args.output, backend=args.backend)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("compute_image_mean", add_arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
