"""The data-backend registry and the one Datum encoder: a third backend registered here (a
folder of one file per record) is detected, read by the Data layer, written by
convert_imageset and walked by compute_image_mean with no other change; the encoder's bytes
against hand-built wire bytes; LMDB writers commit in Caffe's batches and grow a full map."""

import logging
import os
import struct

import lmdb
import numpy as np
import pytest

from purine.caffe import TEST
from purine.converters import ConvertError
from purine.converters.compute_image_mean import compute_image_mean
from purine.converters.convert_imageset import convert_imageset
from purine.data import DataError, db
from purine.data.datum import encode_datum, encode_datums
from purine.data.db import Backend, DatumWriter
from purine.data.lmdb_source import DatumSource
from purine.formats import caffe_pb2 as pb
from tests.converters.helpers import Lines, make_imageset, read_lmdb
from tests.data.helpers import batches, data_net


# -- a third backend: one file per record, named by the key's hex, and a marker file -------
class FolderSource(DatumSource):
    kind = "record folder"

    def __init__(self, path):
        super().__init__(path)
        names = sorted(os.listdir(os.path.join(self.path, "records")))
        self.keys = [bytes.fromhex(n) for n in names]
        self.count = len(self.keys)

    def reader(self):
        return FolderReader(self)


class FolderReader:
    def __init__(self, source):
        self.source = source

    def records(self, start, n):
        out = []
        for i in range(start, start + n):
            key = self.source.keys[i % self.source.count]
            with open(os.path.join(self.source.path, "records", key.hex()), "rb") as f:
                out.append((key, f.read()))
        return out

    def close(self):
        pass


class FolderWriter(DatumWriter):
    def _open(self):
        os.mkdir(os.path.join(self.path, "records"))
        open(os.path.join(self.path, "FOLDERDB"), "w").close()

    def write(self, records):
        for key, value in records:
            with open(os.path.join(self.path, "records", key.hex()), "wb") as f:
                f.write(value)

    def _close(self):
        pass


class Folder(Backend):
    name, kind, article, layout = "folder", "record folder", "a record folder", "FOLDERDB"
    source_class, writer_class = FolderSource, FolderWriter

    def detect(self, path):
        return os.path.isfile(os.path.join(path, "FOLDERDB"))


@pytest.fixture
def folder_backend():
    db.register(Folder())
    yield
    db.unregister("folder")


@pytest.fixture
def warnings():
    lines = Lines("backends-test")
    lines.setLevel(logging.WARNING)
    log = logging.getLogger("purine")
    log.addHandler(lines)
    yield lines.lines
    log.removeHandler(lines)


def test_a_registered_backend_is_written_detected_read_and_walked(tmp_path, folder_backend,
                                                                   warnings):
    # Three PNGs (lossless), 6 x 5 BGR, labels 10, 11, 12.
    listfile, entries = make_imageset(tmp_path / "images", n=3)
    out = tmp_path / "out"
    assert db.names_text() == "lmdb, leveldb or folder"
    assert convert_imageset(tmp_path / "images", listfile, out, backend="folder",
                            log=Lines().log) == 3
    assert db.detect(out) == "folder" and db.detect(tmp_path / "images") is None
    # The records on disk: the keys and the Datum bytes Caffe's convert_imageset writes.
    names = sorted(os.listdir(out / "records"))
    assert [bytes.fromhex(n).decode() for n in names] == [
        "00000000_a/img0.png", "00000001_a/img1.png", "00000002_b/img 2.png"]
    for n, (_, label, bgr) in zip(names, entries, strict=True):
        expected = pb.Datum(channels=3, height=6, width=5, label=label, encoded=False,
                            data=bgr.transpose(2, 0, 1).tobytes()).SerializeToString()
        assert (out / "records" / n).read_bytes() == expected
    # The Data layer reads it (no data_param.backend: it warns that Caffe has none such).
    with data_net(out, phase=TEST, batch=2, backend=None) as net:
        (d0, l0), (d1, l1) = batches(net, 2)
    assert warnings == ["layer 'data': data_param.backend is LEVELDB (the default) but "
                        f"'{out}' is a record folder: reading it as one (Caffe would not); "
                        "Caffe has no such backend"]
    chw = [bgr.transpose(2, 0, 1).astype(np.float32) for _, _, bgr in entries]
    np.testing.assert_array_equal(d0, np.stack(chw[:2]))
    np.testing.assert_array_equal(d1, np.stack([chw[2], chw[0]]))  # wraps to the first
    assert l0.tolist() == [10, 11] and l1.tolist() == [12, 10]
    # compute_image_mean walks it through the backend's source.
    mean = compute_image_mean(out, backend="folder", log=Lines().log)
    np.testing.assert_allclose(mean[0], sum(c.astype(np.float64) for c in chw) / 3,
                               rtol=1e-6)


def test_messages_name_every_registered_backend(tmp_path, folder_backend):
    (tmp_path / "x").mkdir()
    with pytest.raises(ConvertError, match="unknown backend 'rocksdb'; use lmdb, leveldb or "
                                           "folder"):
        convert_imageset(tmp_path, tmp_path / "list.txt", tmp_path / "db", backend="rocksdb")
    with pytest.raises(ConvertError, match=r"x: neither an LMDB \(a folder with data.mdb\) "
                                           r"nor a LevelDB \(a folder with CURRENT\) nor a "
                                           r"record folder \(FOLDERDB\)"):
        compute_image_mean(tmp_path / "x", backend="folder", log=Lines().log)
    with pytest.raises(DataError, match="unknown backend 'x'; use lmdb, leveldb "
                                        "or folder"):
        db.open_source(tmp_path, "x")


def test_backend_names_and_dataparameter_enum_in_one_place():
    assert db.names() == ("lmdb", "leveldb")
    assert db.by_enum(pb.DataParameter.LMDB).name == "lmdb"
    assert db.by_enum(pb.DataParameter.LEVELDB).name == "leveldb"
    assert (pb.DataParameter.LEVELDB, pb.DataParameter.LMDB) == (0, 1)  # Caffe's values
    with pytest.raises(DataError, match="data_param.backend 7 names no database backend"):
        db.by_enum(7)


# -- the Datum encoder, against bytes built by hand from the wire format -----------------
def test_raw_datum_bytes():
    img = np.array([[[1, 2, 3]], [[4, 5, 6]]], np.uint8)  # C=2, H=1, W=3
    assert encode_datum(img, 3, encoded=False) == (
        b"\x08\x02\x10\x01\x18\x03"          # channels 2, height 1, width 3
        b"\x22\x06\x01\x02\x03\x04\x05\x06"  # data: 6 bytes, C x H x W order
        b"\x28\x03\x38\x00")                 # label 3, encoded false
    # No label, no encoded field unless asked (pycaffe's array_to_datum, Caffe's MNIST tools).
    assert encode_datum(img) == b"\x08\x02\x10\x01\x18\x03\x22\x06\x01\x02\x03\x04\x05\x06"
    # A negative int32 label is ten varint bytes (its 64-bit two's complement).
    assert encode_datum(img[:1, :, :1], -1).endswith(b"\x28" + b"\xff" * 9 + b"\x01")


def test_float_and_encoded_datum_bytes():
    arr = np.array([[[0.5, -2.0]]])  # float64: stored as float32, one tagged value each
    assert encode_datum(arr, 1) == (b"\x08\x01\x10\x01\x18\x02\x28\x01"
                                    + b"\x35" + struct.pack("<f", 0.5)
                                    + b"\x35" + struct.pack("<f", -2.0))
    assert encode_datum(b"\x89PNG", 7) == b"\x22\x04\x89PNG\x28\x07\x38\x01"
    rows = encode_datums(np.arange(4, dtype=np.uint8).reshape(2, 1, 1, 2), [5, 6])
    assert rows == [b"\x08\x01\x10\x01\x18\x02\x22\x02\x00\x01\x28\x05",
                    b"\x08\x01\x10\x01\x18\x02\x22\x02\x02\x03\x28\x06"]


def test_encoder_refusals():
    with pytest.raises(DataError, match="label 2147483648 does not fit the int32 field"):
        encode_datum(np.zeros((1, 1, 1), np.uint8), 2**31)
    with pytest.raises(DataError, match=r"\(channels, height, width\) array, got shape \(2,\)"):
        encode_datum(np.zeros(2, np.uint8))
    with pytest.raises(DataError, match="1 labels for 2 Datum records"):
        encode_datums(np.zeros((2, 1, 1, 1), np.uint8), [0])


# -- the LMDB writer: Caffe's batches, a full map grown -----------------------------------
def test_lmdb_writer_commits_every_1000_records(tmp_path):
    seen = []

    def transact(writer, batch):
        seen.append(len(batch))
        writer.write(batch)

    w = db.get("lmdb").writer(tmp_path / "db", transact=transact)
    due = [w.put(f"{i:05d}", b"v%d" % i) for i in range(2345)]
    w.close()
    assert [i for i, d in enumerate(due) if d] == [999, 1999] and seen == [1000, 1000, 345]
    items = read_lmdb(tmp_path / "db")
    assert len(items) == 2345 and items[1234] == (b"01234", b"v1234")
    with pytest.raises(DataError, match="db: already exists"):
        db.get("lmdb").writer(tmp_path / "db")


def test_lmdb_writer_grows_a_full_map_and_aborts(tmp_path, monkeypatch):
    monkeypatch.setattr(db, "MAP_SIZE", 1 << 16)
    w = db.get("lmdb").writer(tmp_path / "db")
    for i in range(300):
        w.put(f"{i:03d}", bytes([i % 256]) * 2700)  # 810 kB: the 64 kB map must grow
    w.close()
    env = lmdb.open(str(tmp_path / "db"), readonly=True, lock=False)
    assert env.stat()["entries"] == 300 and env.info()["map_size"] > 1 << 16
    env.close()
    w = db.get("lmdb").writer(tmp_path / "db2")
    w.put("k", b"v")
    w.abort()
    assert not (tmp_path / "db2").exists()
