"""Reading and writing .caffemodel files (NetParameter with BlobProto parameters).

Writing encodes each blob's packed float field straight from the array's bytes: protobuf's
own repeated-field ``extend`` converts element by element and takes seconds on AlexNet.
Files are written to a temporary name and renamed, so a crash never leaves half a file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np

from purine.errors import ProtoError
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_binary
from purine.formats.wire import len_field, varint


def blob_to_array(blob: pb.BlobProto) -> np.ndarray:
    """The array of a BlobProto: ``shape`` if set, else legacy num/channels/height/width."""
    if blob.HasField("shape"):
        shape = tuple(blob.shape.dim)
    elif blob.HasField("num") or blob.HasField("channels") or blob.HasField("height") \
            or blob.HasField("width"):
        shape = (blob.num, blob.channels, blob.height, blob.width)
    else:
        shape = (len(blob.data) or len(blob.double_data),)
    values = blob.double_data if len(blob.double_data) else blob.data
    a = np.array(values, dtype=np.float32)
    if a.size != int(np.prod(shape)):
        raise ProtoError(f"BlobProto of shape {shape} holds {a.size} values")
    return a.reshape(shape)


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
            try:
                out[layer.name] = [blob_to_array(b) for b in layer.blobs]
            except ProtoError as e:
                raise ProtoError(f"{os.fspath(path)}: layer '{layer.name}': {e}") from None
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


def atomic_write(path: str | os.PathLike, data: bytes | Iterable[bytes | memoryview]) -> None:
    """Write ``data`` (bytes or chunks) to ``path`` through ``atomic_file``."""
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        for chunk in [data] if isinstance(data, bytes | bytearray) else data:
            f.write(chunk)


def save_net(name: str, layers: Iterable[pb.LayerParameter],
             params: Mapping[str, Sequence[np.ndarray]], path: str | os.PathLike) -> None:
    atomic_write(path, net_chunks(name, layers, params))
