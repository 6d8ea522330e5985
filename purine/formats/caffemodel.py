"""Reading and writing .caffemodel files (NetParameter with BlobProto parameters).

Writing encodes each blob's packed float field straight from the array's bytes: protobuf's
own repeated-field ``extend`` converts element by element and takes seconds on AlexNet.
Files are written to a temporary name and renamed, so a crash never leaves half a file.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np

from purine.errors import ProtoError
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_binary
from purine.formats.wire import len_field, varint

# Caffe's kMaxBlobAxes: its Blob::Reshape refuses more axes.
MAX_BLOB_AXES = 32
# The most values a blob read from a file may have. Protobuf caps a message at 2 GiB, so a
# BlobProto holds at most 2**31 values and no readable blob comes near this; the cap keeps
# the count, and the count times 8 bytes, far inside int64, where numpy's sizes and a
# product of int64 dims computed in C would wrap.
MAX_BLOB_COUNT = 2**40


def shape_problem(shape: Sequence[int], count: int | None = None) -> str | None:
    """Why ``shape`` cannot be a blob's (holding ``count`` values, when given), or None:
    at most MAX_BLOB_AXES axes, every dim from 0 to 2^31-1, and their product (Python integers,
    which never wrap) at most MAX_BLOB_COUNT and equal to ``count``."""
    if len(shape) > MAX_BLOB_AXES:
        return f"has {len(shape)} axes; a blob has at most {MAX_BLOB_AXES}"
    shape = tuple(int(d) for d in shape)
    for i, d in enumerate(shape):
        if d < 0:
            return f"of shape {shape} has dimension {i} = {d}; dimensions are 0 or more"
    n = math.prod(shape)
    if n > MAX_BLOB_COUNT:
        return f"of shape {shape} has {n} values, more than the {MAX_BLOB_COUNT} a blob may hold"
    if count is not None and n != count:
        return f"of shape {shape} holds {count} values"
    for i, d in enumerate(shape):
        if d > 2**31 - 1:  # Caffe's blob dims are C ints, an empty blob's too
            return f"of shape {shape} has dimension {i} = {d}; at most 2147483647"
    return None


def blob_shape(blob: pb.BlobProto) -> tuple[int, ...]:
    """A BlobProto's checked shape: ``shape`` if set, else the legacy num/channels/height/
    width, else one axis of its values; ``data`` and ``double_data`` (the one Caffe's
    double nets write) may not both hold values, unless as many."""
    n, nd = len(blob.data), len(blob.double_data)
    if n and nd and n != nd:
        raise ProtoError(f"BlobProto holds {n} data and {nd} double_data values; expected "
                         "one of the two")
    count = nd or n
    if blob.HasField("shape"):
        shape = tuple(blob.shape.dim)
    elif blob.HasField("num") or blob.HasField("channels") or blob.HasField("height") \
            or blob.HasField("width"):
        shape = (blob.num, blob.channels, blob.height, blob.width)
    else:
        shape = (count,)
    problem = shape_problem(shape, count)
    if problem:
        raise ProtoError(f"BlobProto {problem}")
    return shape


def blob_to_array(blob: pb.BlobProto) -> np.ndarray:
    """The float32 array of a BlobProto, shaped by ``blob_shape``; a blob that breaks its
    rules is a ProtoError, which callers prefix with the file (and layer or index)."""
    shape = blob_shape(blob)
    values = blob.double_data if len(blob.double_data) else blob.data
    return np.array(values, dtype=np.float32).reshape(shape)


def blob_arrays(blobs: Iterable[pb.BlobProto], where: str) -> list[np.ndarray]:
    """``blob_to_array`` of each blob; an error names ``where`` (the file and layer) and
    the blob's index."""
    out = []
    for k, blob in enumerate(blobs):
        try:
            out.append(blob_to_array(blob))
        except ProtoError as e:
            raise ProtoError(f"{where} blob {k}: {e}") from None
    return out


def array_to_blob(a: np.ndarray) -> pb.BlobProto:
    blob = pb.BlobProto()
    blob.ParseFromString(encode_blob(a))
    return blob


def read_caffemodel(path: str | os.PathLike) -> pb.NetParameter:
    """A caffemodel (always binary, whatever its suffix); one with no layers is refused."""
    net = read_binary(path, pb.NetParameter(), ".caffemodel (NetParameter)")
    if not net.layer and not net.layers:
        raise ProtoError(f"{os.fspath(path)}: holds no layers; is it a binary .caffemodel "
                         "(not a text prototxt)?")
    return net


def load_weights(path: str | os.PathLike) -> dict[str, list[np.ndarray]]:
    """Parameter arrays by layer name from a caffemodel (current or V1 ``layers`` form);
    a layer name given twice keeps the last, as Caffe's CopyTrainedLayersFrom does."""
    net = read_caffemodel(path)
    out: dict[str, list[np.ndarray]] = {}
    for layer in list(net.layer) + list(net.layers):
        if layer.blobs:
            out[layer.name] = blob_arrays(layer.blobs, f"{os.fspath(path)}: layer "
                                                       f"'{layer.name}'")
    return out


# -- encoding --------------------------------------------------------------------------
# Encoders return lists of byte chunks, the arrays' own memory among them, so a 244 MB
# AlexNet goes to disk without being copied into one bytes object on the way.
Chunks = list[bytes | memoryview]


def _length(chunks: Chunks) -> int:
    return sum(len(c) for c in chunks)


def nested_field(number: int, chunks: Chunks) -> Chunks:
    """A length-delimited field whose payload is ``chunks``."""
    return [varint(number << 3 | 2), varint(_length(chunks))] + chunks


def blob_chunks(a: np.ndarray) -> Chunks:
    """BlobProto: ``shape`` (field 7) and packed float ``data`` (field 5)."""
    a = np.asarray(a, dtype="<f4", order="C")
    dims = b"".join(varint(int(d)) for d in a.shape)
    shape = b"".join(len_field(1, dims)) if a.shape else b""
    return len_field(7, shape) + len_field(5, memoryview(a.reshape(-1)).cast("B"))


def encode_blob(a: np.ndarray) -> bytes:
    return b"".join(blob_chunks(a))


def net_chunks(name: str, layers: Iterable[pb.LayerParameter],
               params: Mapping[str, Sequence[np.ndarray]]) -> Chunks:
    """NetParameter: ``name`` and each layer (field 100) with its parameter blobs."""
    chunks: Chunks = len_field(1, name.encode()) if name else []
    for layer in layers:
        body: Chunks = [layer.SerializeToString()]
        for a in params.get(layer.name, ()):
            body += nested_field(7, blob_chunks(a))
        chunks += nested_field(100, body)
    return chunks


def encode_net(name: str, layers: Iterable[pb.LayerParameter],
               params: Mapping[str, Sequence[np.ndarray]]) -> bytes:
    return b"".join(net_chunks(name, layers, params))


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[str]:
    """A temporary name beside ``path`` for the block to write; on success it is synced and
    renamed to ``path``, on an error removed: a crash at any moment leaves either the old
    file or the complete new one."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=d)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide snapshots from other users
    finally:
        os.close(fd)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def stale_temporaries(prefix: str) -> list[str]:
    """The temporary files ``atomic_file`` leaves when a process is killed while writing a
    snapshot of ``prefix`` (``<prefix>_iter_<N>.<suffix>.<random>.tmp``); nothing else
    matches, so a start may remove them."""
    folder, base = os.path.split(prefix)
    pattern = re.compile(re.escape(base) + r"_iter_\d+\.(caffemodel|solverstate)(\.h5)?"
                         r"\.[A-Za-z0-9_]+\.tmp")
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return []
    return sorted(os.path.join(folder, n) for n in names if pattern.fullmatch(n))


def atomic_write(path: str | os.PathLike, data: bytes | Iterable[bytes | memoryview]) -> None:
    """Write ``data`` (bytes or chunks) to ``path`` through ``atomic_file``."""
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        for chunk in [data] if isinstance(data, bytes | bytearray) else data:
            f.write(chunk)


def save_net(name: str, layers: Iterable[pb.LayerParameter],
             params: Mapping[str, Sequence[np.ndarray]], path: str | os.PathLike) -> None:
    atomic_write(path, net_chunks(name, layers, params))
