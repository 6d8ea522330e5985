"""Caffe's dataset tools (convert_mnist_data, convert_cifar_data, convert_mnist_siamese_data):
IDX files and CIFAR batches written here from the formats' specs, records compared with
Datum bytes built by hand from the protobuf wire format, the siamese draw against a plain
transcription of MT19937, the databases read back through the Data layer, and bad input."""

import gzip
import os
import struct

import numpy as np
import plyvel
import pytest

from purine.caffe import TEST
from purine.cli import main
from purine.converters import ConvertError, caffe_datasets
from purine.converters.caffe_datasets import (
    convert_cifar_data,
    convert_mnist_data,
    convert_mnist_siamese_data,
    mt19937_draws,
    read_mnist,
)
from purine.converters.caffe_datasets import main as tool_main
from tests.converters.helpers import Lines, read_lmdb
from tests.data.helpers import data_net

# Three 2 x 3 digits (rows 2, cols 3: not square, so a row/column swap shows) and labels.
IMAGES = np.array([[[0, 1, 2], [3, 4, 5]],
                   [[255, 128, 7], [9, 10, 11]],
                   [[20, 21, 22], [23, 24, 25]]], np.uint8)
LABELS = [7, 0, 9]


# -- input files from the format specs ------------------------------------------------------
def write_idx(folder, images, labels, *, gz=False, image_magic=2051, label_magic=2049,
              n_labels=None, stem="train"):
    """An MNIST pair: images (magic, count, rows, cols as big-endian u32, then pixels row by
    row) and labels (magic, count, then one byte each)."""
    images = np.asarray(images, np.uint8)
    n, rows, cols = images.shape
    img = struct.pack(">IIII", image_magic, n, rows, cols) + images.tobytes()
    lab = struct.pack(">II", label_magic, len(labels) if n_labels is None else n_labels) \
        + bytes(labels)
    suffix = ".gz" if gz else ""
    paths = (folder / f"{stem}-images-idx3-ubyte{suffix}",
             folder / f"{stem}-labels-idx1-ubyte{suffix}")
    for path, data in zip(paths, (img, lab)):
        path.write_bytes(gzip.compress(data) if gz else data)
    return paths


def cifar_batch(seed, n):
    """``n`` CIFAR-10 records: (labels, (n, 3072) pixel planes)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 10, n).tolist(), rng.integers(0, 256, (n, 3072), dtype=np.uint8)


def write_cifar(folder, sizes=(3, 2, 1, 0, 2), n_test=2):
    """data_batch_1..5.bin with ``sizes`` records and test_batch.bin: each record one label
    byte and 3072 pixel bytes. Returns {file name: (labels, pixels)}."""
    folder.mkdir(exist_ok=True)
    batches = {}
    names = [f"data_batch_{k}.bin" for k in range(1, 6)] + ["test_batch.bin"]
    for seed, (name, n) in enumerate(zip(names, (*sizes, n_test))):
        labels, pixels = cifar_batch(seed, n)
        (folder / name).write_bytes(b"".join(bytes([lab]) + row.tobytes()
                                             for lab, row in zip(labels, pixels)))
        batches[name] = (labels, pixels)
    return batches


# -- the expected bytes, from the wire format -----------------------------------------------
def varint(n):
    n &= (1 << 64) - 1  # int32 negatives go out sign-extended to 64 bits
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def datum_bytes(channels, height, width, data, label):
    """Datum fields 1 channels, 2 height, 3 width (varints, tags 0x08 0x10 0x18), 4 data
    (length-delimited, tag 0x22), 5 label (tag 0x28); encoded (7) unset, as Caffe's tools."""
    return (b"\x08" + varint(channels) + b"\x10" + varint(height) + b"\x18" + varint(width)
            + b"\x22" + varint(len(data)) + bytes(data) + b"\x28" + varint(label))


def read_leveldb(path):
    db = plyvel.DB(str(path))
    try:
        return [(bytes(k), bytes(v)) for k, v in db]
    finally:
        db.close()


def read_db(path):
    return read_leveldb(path) if (path / "CURRENT").exists() else read_lmdb(path)


MNIST_EXPECTED = [
    (b"00000000", b"\x08\x01\x10\x02\x18\x03\x22\x06\x00\x01\x02\x03\x04\x05\x28\x07"),
    (b"00000001", b"\x08\x01\x10\x02\x18\x03\x22\x06\xff\x80\x07\x09\x0a\x0b\x28\x00"),
    (b"00000002", b"\x08\x01\x10\x02\x18\x03\x22\x06\x14\x15\x16\x17\x18\x19\x28\x09"),
]


def test_wire_helpers_agree_with_literal_bytes():
    assert datum_bytes(1, 2, 3, IMAGES[0].tobytes(), 7) == MNIST_EXPECTED[0][1]
    assert varint(784) == b"\x90\x06" and varint(3072) == b"\x80\x18"
    assert varint(-56) == b"\xc8" + b"\xff" * 8 + b"\x01"


# -- convert_mnist_data ---------------------------------------------------------------------
def test_mnist_lmdb_through_the_cli_is_byte_equal(tmp_path, capsys):
    images, labels = write_idx(tmp_path, IMAGES, LABELS)
    db = tmp_path / "mnist_train_lmdb"
    # create_mnist.sh's order: the flag after the three arguments
    assert main(["convert_mnist_data", str(images), str(labels), str(db),
                 "--backend=lmdb"]) == 0
    assert read_lmdb(db) == MNIST_EXPECTED
    assert (db / "data.mdb").exists()


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_leveldb_plain_and_gzip(tmp_path, gz):
    images, labels = write_idx(tmp_path, IMAGES, LABELS, gz=gz)
    log = Lines()
    assert convert_mnist_data(images, labels, tmp_path / "db", backend="leveldb",
                              log=log.log) == 3
    assert read_leveldb(tmp_path / "db") == MNIST_EXPECTED
    assert "A total of 3 items." in log.lines and "Rows: 2 Cols: 3" in log.lines


def test_gzip_found_beside_the_plain_name_and_one_dash_flags(tmp_path):
    # get_mnist.sh's names without .gz, while only the downloaded .gz files are there
    images, labels = write_idx(tmp_path, IMAGES, LABELS, gz=True)
    plain = [str(p)[:-3] for p in (images, labels)]
    assert main(["convert_mnist_data", "-backend", "leveldb", *plain,
                 str(tmp_path / "db")]) == 0
    assert read_leveldb(tmp_path / "db") == MNIST_EXPECTED


def test_signed_label_bytes_as_caffe_char(tmp_path):
    images, labels = write_idx(tmp_path, IMAGES[:1], [200])
    convert_mnist_data(images, labels, tmp_path / "db")
    [(_, value)] = read_lmdb(tmp_path / "db")
    assert value.endswith(b"\x28\xc8" + b"\xff" * 8 + b"\x01")  # label -56, as x86 Caffe


def test_mnist_lmdb_reads_back_through_the_data_layer(tmp_path):
    rng = np.random.default_rng(3)
    digits = rng.integers(0, 256, (4, 28, 28), dtype=np.uint8)
    images, labels = write_idx(tmp_path, digits, [3, 1, 4, 1], gz=True)
    assert tool_main(["convert_mnist_data", str(images), str(labels),
                      str(tmp_path / "db")]) == 0
    records = read_lmdb(tmp_path / "db")
    assert records[0][1] == b"\x08\x01\x10\x1c\x18\x1c\x22\x90\x06" + digits[0].tobytes() \
        + b"\x28\x03"
    net = data_net(tmp_path / "db", phase=TEST, batch=4)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, digits[:, None].astype(np.float32))
    np.testing.assert_array_equal(net.blobs["label"].data, [3, 1, 4, 1])


def test_read_mnist_arrays(tmp_path):
    images, labels = write_idx(tmp_path, IMAGES, LABELS)
    pixels, labs = read_mnist(images, labels)
    np.testing.assert_array_equal(pixels, IMAGES)
    assert labs.tolist() == LABELS


# -- convert_cifar_data ---------------------------------------------------------------------
def cifar_expected(batches):
    """Train and test records: keys %05d of (batch - 1) * 10000 + index, and the index."""
    train = []
    for k in range(1, 6):
        labels, pixels = batches[f"data_batch_{k}.bin"]
        train += [(f"{(k - 1) * 10000 + i:05d}".encode(),
                   b"\x08\x03\x10\x20\x18\x20\x22\x80\x18" + pixels[i].tobytes()
                   + b"\x28" + bytes([labels[i]])) for i in range(len(labels))]
    labels, pixels = batches["test_batch.bin"]
    test = [(f"{i:05d}".encode(), datum_bytes(3, 32, 32, pixels[i].tobytes(), labels[i]))
            for i in range(len(labels))]
    return train, test


def test_cifar_lmdb_through_the_cli_is_byte_equal_and_reads_back(tmp_path):
    batches = write_cifar(tmp_path / "data")
    out = tmp_path / "examples"
    out.mkdir()
    assert main(["convert_cifar_data", str(tmp_path / "data"), str(out), "lmdb"]) == 0
    train, test = cifar_expected(batches)
    assert [k for k, _ in train] == [b"00000", b"00001", b"00002", b"10000", b"10001",
                                     b"20000", b"40000", b"40001"]
    assert read_lmdb(out / "cifar10_train_lmdb") == train
    assert read_lmdb(out / "cifar10_test_lmdb") == test
    assert sorted(os.listdir(out)) == ["cifar10_test_lmdb", "cifar10_train_lmdb"]
    # the Data layer gets the planes as stored (R, G, B: Caffe keeps CIFAR's order)
    net = data_net(out / "cifar10_test_lmdb", phase=TEST, batch=2)
    net.forward()
    labels, pixels = batches["test_batch.bin"]
    np.testing.assert_array_equal(net.blobs["data"].data, pixels.reshape(2, 3, 32, 32))
    np.testing.assert_array_equal(net.blobs["label"].data, labels)


def test_cifar_leveldb(tmp_path):
    batches = write_cifar(tmp_path / "data", sizes=(1, 1, 0, 0, 1), n_test=1)
    assert convert_cifar_data(tmp_path / "data", tmp_path, "leveldb") == (3, 1)
    train, test = cifar_expected(batches)
    assert read_leveldb(tmp_path / "cifar10_train_leveldb") == train
    assert read_leveldb(tmp_path / "cifar10_test_leveldb") == test
    net = data_net(tmp_path / "cifar10_train_leveldb", phase=TEST, batch=3,
                   backend="LEVELDB")
    net.forward()
    np.testing.assert_array_equal(net.blobs["label"].data,
                                  [batches[f"data_batch_{k}.bin"][0][0] for k in (1, 2, 5)])


# -- convert_mnist_siamese_data and MT19937 -------------------------------------------------
def mt19937_reference(seed, count):
    """MT19937 as published (Matsumoto & Nishimura, init_genrand), one output at a time."""
    mt = [seed]
    for i in range(1, 624):
        mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
    out, index = [], 624
    while len(out) < count:
        if index == 624:
            for k in range(624):
                y = (mt[k] & 0x80000000) | (mt[(k + 1) % 624] & 0x7FFFFFFF)
                mt[k] = mt[(k + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            index = 0
        y = mt[index]
        index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        out.append(y)
    return out


def test_mt19937_matches_the_published_outputs():
    # The default seed 5489: first output 3499211612; the 10000th is 4123659995, the value
    # the C++ standard requires of a default-constructed mt19937 (boost's is the same).
    reference = mt19937_reference(5489, 10000)
    assert reference[0] == 3499211612 and reference[-1] == 4123659995
    draws = mt19937_draws(5489, 10000)
    assert draws[0] == 3499211612 and draws[-1] == 4123659995
    for seed in (0, 1, 1234, 2**32 - 1):
        assert mt19937_draws(seed, 700).tolist() == mt19937_reference(seed, 700)


SIAMESE_IMAGES = np.arange(5 * 2 * 3, dtype=np.uint8).reshape(5, 2, 3) * 7
SIAMESE_LABELS = [1, 1, 2, 3, 1]


def siamese_expected(seed):
    draws = mt19937_reference(seed, 10)
    out = []
    for k in range(5):
        i, j = draws[2 * k] % 5, draws[2 * k + 1] % 5
        pair = SIAMESE_IMAGES[i].tobytes() + SIAMESE_IMAGES[j].tobytes()
        out.append((f"{k:08d}".encode(),
                    datum_bytes(2, 2, 3, pair, int(SIAMESE_LABELS[i] == SIAMESE_LABELS[j]))))
    return out


def test_siamese_leveldb_through_the_cli_with_a_seed(tmp_path):
    images, labels = write_idx(tmp_path, SIAMESE_IMAGES, SIAMESE_LABELS)
    db = tmp_path / "mnist_siamese_train_leveldb"
    assert main(["convert_mnist_siamese_data", str(images), str(labels), str(db),
                 "--seed=1234"]) == 0
    expected = siamese_expected(1234)
    assert read_leveldb(db) == expected
    assert {v[-1] for _, v in expected} == {0, 1}  # this draw has both kinds of pair
    # reads back as 2-channel records, as the siamese net's Slice layer expects
    net = data_net(db, phase=TEST, batch=5, backend="LEVELDB")
    net.forward()
    assert net.blobs["data"].data.shape == (5, 2, 2, 3)


def test_siamese_default_seed_and_lmdb(tmp_path):
    images, labels = write_idx(tmp_path, SIAMESE_IMAGES, SIAMESE_LABELS, gz=True)
    assert convert_mnist_siamese_data(images, labels, tmp_path / "db", backend="lmdb") == 5
    assert read_lmdb(tmp_path / "db") == siamese_expected(5489)


# -- bad input: one line, nothing left behind ------------------------------------------------
def run_one_line(capsys, argv):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("case, expected", [
    ("image_magic", "magic number 2049 (0x00000801) is not 2051, that of an MNIST image file "
                    "(IDX unsigned bytes); it is a label file: are the image and label "
                    "arguments swapped?"),
    ("label_magic", "magic number 7 (0x00000007) is not 2049, that of an MNIST label file"),
    ("count", "holds 3 images but"),
    ("truncated", "truncated: the header announces 3 images x 2 x 3 = 18 bytes after the "
                  "16-byte header, the file has 17"),
    ("header", "truncated: 10 bytes, but the IDX header alone is 16 bytes"),
    ("longer", "longer than its header says: the header announces 3 labels = 3 bytes"),
    ("bad_gzip", "starts as a gzip file but cannot be gunzipped"),
    ("gzip_bomb", "gunzips to more than 64 bytes; an MNIST file is at most 47 MB"),
    ("missing", "cannot open the file: No such file or directory"),
    ("device", "/dev/zero: cannot open the file: it is not a regular file (a device)"),
    ("backend", "unknown backend 'rocksdb'; use lmdb or leveldb"),
    ("exists", "already exists; remove it or choose another name"),
])
def test_mnist_bad_input(tmp_path, capsys, monkeypatch, case, expected):
    kw = {"image_magic": 2049} if case == "image_magic" else \
        {"label_magic": 7} if case == "label_magic" else \
        {"n_labels": 4} if case == "count" else {}
    images, labels = write_idx(tmp_path, IMAGES, LABELS, **kw)
    db = tmp_path / "db"
    flags = []
    if case == "truncated":
        images.write_bytes(images.read_bytes()[:-1])
    elif case == "header":
        images.write_bytes(images.read_bytes()[:10])
    elif case == "longer":
        labels.write_bytes(labels.read_bytes() + b"\x00")
    elif case == "bad_gzip":
        images.write_bytes(gzip.compress(images.read_bytes())[:30])
    elif case == "gzip_bomb":  # 65 bytes of pixels past a bound of 64: refused, not inflated
        monkeypatch.setattr(caffe_datasets, "BINARY_LIMIT", 64)
        images.write_bytes(gzip.compress(images.read_bytes() + bytes(65)))
    elif case == "missing":
        images = tmp_path / "nope"
    elif case == "device":
        images = "/dev/zero"
    elif case == "backend":
        flags = ["--backend=rocksdb"]
    elif case == "exists":
        db.mkdir()
    err = run_one_line(capsys, ["convert_mnist_data", *flags, str(images), str(labels),
                                str(db)])
    assert err.startswith("purine-caffe convert_mnist_data: ") and expected in err, err
    assert db.exists() == (case == "exists")  # nothing half-written is left


@pytest.mark.parametrize("case, expected", [
    ("missing", "data_batch_3.bin: cannot open the CIFAR-10 batch"),
    ("odd_size", "data_batch_2.bin: 6147 bytes is not a whole number of 3073-byte CIFAR-10 "
                 "records"),
    ("too_many", "test_batch.bin: 10001 records; a CIFAR-10 batch holds at most 10000"),
    ("no_output", "the output folder does not exist"),
    ("db_type", "unknown backend 'lmbd'; use lmdb or leveldb"),
    ("test_exists", "cifar10_test_lmdb: already exists"),
])
def test_cifar_bad_input(tmp_path, capsys, case, expected):
    data, out = tmp_path / "data", tmp_path / "out"
    write_cifar(data, sizes=(1, 2, 1, 0, 0), n_test=1)
    out.mkdir()
    db_type = "lmbd" if case == "db_type" else "lmdb"
    if case == "missing":
        (data / "data_batch_3.bin").unlink()
    elif case == "odd_size":
        with open(data / "data_batch_2.bin", "ab") as f:
            f.write(b"\x01")
    elif case == "too_many":
        os.truncate(data / "test_batch.bin", 10001 * 3073)  # sparse: cheap
    elif case == "no_output":
        out.rmdir()
    elif case == "test_exists":
        (out / "cifar10_test_lmdb").mkdir()
    err = run_one_line(capsys, ["convert_cifar_data", str(data), str(out), db_type])
    assert err.startswith("purine-caffe convert_cifar_data: ") and expected in err, err
    # every input is checked before the train database is made
    assert not (out / "cifar10_train_lmdb").exists()


def test_siamese_seed_out_of_range(tmp_path, capsys):
    images, labels = write_idx(tmp_path, IMAGES, LABELS)
    err = run_one_line(capsys, ["convert_mnist_siamese_data", "--seed=-1", str(images),
                                str(labels), str(tmp_path / "db")])
    assert err == ("purine-caffe convert_mnist_siamese_data: --seed -1: boost::mt19937 takes "
                   "a seed in [0, 2^32 - 1]")
    with pytest.raises(ConvertError, match="2\\^32"):
        mt19937_draws(2**32, 1)
