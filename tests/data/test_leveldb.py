"""LevelDB sources: positions in key order with wrap-around (the record count learned on the
first wrap), the Data layer over a LevelDB from convert_imageset giving the batches of the
same data in LMDB, a LevelDB written with plyvel alone, compute_image_mean, replicas, cursor
resume from a .solverstate, backend mismatch warnings, and the errors (no plyvel, no
Datum, neither database)."""

import logging
import sys
from functools import partial

import cv2
import numpy as np
import plyvel
import pytest

from purine.caffe import TEST, TRAIN
from purine.caffe.solver import Solver
from purine.converters.compute_image_mean import compute_image_mean
from purine.converters.compute_image_mean import main as mean_main
from purine.converters.convert_imageset import convert_imageset
from purine.converters.convert_imageset import main as convert_main
from purine.data import DataError
from purine.data.leveldb_source import LevelDBSource
from purine.errors import LayerError, PurineError
from tests.converters.helpers import Lines, make_imageset, read_lmdb
from tests.data import helpers
from tests.data.helpers import (
    batches,
    images,
    match_transform,
    raw_datum,
    replica_labels,
    train_step,
    write_lmdb,
)


def write_leveldb(path, records):
    """records: Datum messages (keyed 00000000, ...) or (key, bytes) pairs; written in
    reverse order, so that reading in key order is the reader's doing."""
    db = plyvel.DB(str(path), create_if_missing=True)
    items = [r if isinstance(r, tuple) else (f"{i:08d}".encode(), r.SerializeToString())
             for i, r in enumerate(records)]
    for key, value in reversed(items):
        db.put(key, value)
    db.close()
    return str(path)


# Data layers over a LevelDB unless told otherwise, three records a batch.
data_layer = partial(helpers.data_layer, batch=3, backend="LEVELDB")
data_net = partial(helpers.data_net, batch=3, backend="LEVELDB")


@pytest.fixture
def warnings():
    """The purine logger's messages at WARNING and above."""
    lines = Lines("leveldb-test")
    lines.setLevel(logging.WARNING)
    log = logging.getLogger("purine")
    log.addHandler(lines)
    yield lines.lines
    log.removeHandler(lines)


# -- the source ------------------------------------------------------------------------------
def test_positions_wrap_seek_and_count_learned_on_the_first_wrap(tmp_path):
    path = write_leveldb(tmp_path / "db", [(f"k{i:03d}".encode(), f"v{i}".encode())
                                           for i in range(7)])
    src = LevelDBSource(path)
    assert src.count is None  # not counted at open: that would read the whole database
    r = src.reader()
    assert r.records(0, 3) == [(b"k000", b"v0"), (b"k001", b"v1"), (b"k002", b"v2")]
    assert [k for k, _ in r.records(1, 2)] == [b"k001", b"k002"]  # backwards, count unknown
    assert src.count is None
    assert [k for k, _ in r.records(7 * 3 + 4, 1)] == [b"k004"]  # walks round, learns 7
    assert src.count == 7
    assert [k for k, _ in r.records(5, 4)] == [b"k005", b"k006", b"k000", b"k001"]
    assert [k for k, _ in r.records(6, 8)] == [b"k006"] + [f"k{i:03d}".encode()
                                                           for i in range(7)]
    other = src.reader()  # a second reader uses the count the first one learned
    assert [k for k, _ in other.records(7 * 5 + 2, 2)] == [b"k002", b"k003"]
    assert src.first() == (b"k000", b"v0")
    r.close()
    other.close()


def test_missing_empty_locked_and_not_a_database(tmp_path):
    with pytest.raises(DataError, match="LevelDB '.*nowhere' does not exist"):
        LevelDBSource(tmp_path / "nowhere")
    empty = write_leveldb(tmp_path / "empty", [])
    with pytest.raises(DataError, match="LevelDB '.*empty' has no records"):
        LevelDBSource(empty)
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="LevelDB '.*dir' cannot be opened: .*does not exist"):
        LevelDBSource(tmp_path / "dir")
    path = write_leveldb(tmp_path / "db", [(b"a", b"1")])
    writer = plyvel.DB(path)
    with pytest.raises(DataError, match="LevelDB '.*db' is open elsewhere in this process"):
        LevelDBSource(path)
    writer.close()
    a, b = LevelDBSource(path), LevelDBSource(path)  # one handle, shared
    assert a.handle is b.handle and a.first() == b.first() == (b"a", b"1")


# -- the Data layer --------------------------------------------------------------------------
@pytest.fixture
def both(tmp_path):
    """One image folder converted to an LMDB and a LevelDB by convert_imageset; the images
    as OpenCV reads them, (N, C, H, W)."""
    listfile, entries = make_imageset(tmp_path / "images", n=5, shape=(6, 7), seed=5)
    dbs = {}
    for backend in ("lmdb", "leveldb"):
        dbs[backend] = str(tmp_path / backend)
        n = convert_imageset(tmp_path / "images", listfile, dbs[backend], backend=backend,
                             log=Lines().log)
        assert n == 5
    imgs = np.stack([cv2.imread(str(tmp_path / "images" / name)).transpose(2, 0, 1)
                     for name, _, _ in entries])
    return dbs, imgs


def test_convert_imageset_writes_the_lmdb_records_to_a_leveldb(both, tmp_path, capsys):
    dbs, _ = both
    db = plyvel.DB(dbs["leveldb"])
    records = list(db)
    db.close()
    assert records == read_lmdb(dbs["lmdb"])  # same keys (%08d_name), same Datum bytes
    assert [k for k, _ in records][:2] == [b"00000000_a/img0.png", b"00000001_a/img1.png"]
    listfile = tmp_path / "images" / "list.txt"
    assert convert_main(["--backend=leveldb", str(tmp_path / "images") + "/", str(listfile),
                         dbs["leveldb"]]) == 1
    assert "leveldb: already exists" in capsys.readouterr().err


@pytest.mark.parametrize("phase, transform", [
    (TRAIN, "crop_size: 4 mirror: true scale: 0.5"),
    (TEST, "crop_size: 4 mirror: true mean_value: 10 mean_value: 20 mean_value: 30"),
    (TRAIN, ""),
])
def test_leveldb_batches_equal_lmdb_batches(both, phase, transform):
    dbs, imgs = both
    got = {}
    for backend in ("lmdb", "leveldb"):
        net = data_net(dbs[backend], phase=phase, seed=3, transform=transform,
                       backend=backend.upper())
        got[backend] = batches(net, 4)  # 12 records of 5: wraps twice
    for (a, la), (b, lb) in zip(got["lmdb"], got["leveldb"]):
        assert a.dtype == b.dtype and np.array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
    labels = [lab.tolist() for _, lab in got["leveldb"]]
    assert labels == [[10, 11, 12], [13, 14, 10], [11, 12, 13], [14, 10, 11]]
    if not transform:
        np.testing.assert_array_equal(got["leveldb"][1][0], imgs[[3, 4, 0]])
    elif phase == TEST:  # the centre crop of (6, 7) for 4; Caffe mirrors in TEST too
        seen = {match_transform(got["leveldb"][0][0][i], imgs[i], False, crop=4, mirror=True,
                                mean_values=[10, 20, 30]) for i in range(3)}
        assert {(h, w) for h, w, _ in seen} == {(1, 1)}


def test_leveldb_written_with_plyvel_alone(tmp_path):
    imgs = images(5, (2, 3, 4), seed=7)
    path = write_leveldb(tmp_path / "ldb", [raw_datum(im, 20 + i) for i, im in enumerate(imgs)])
    net = data_net(path, batch=2, dtype="float64")
    got = batches(net, 3)
    assert [lab.tolist() for _, lab in got] == [[20, 21], [22, 23], [24, 20]]
    np.testing.assert_array_equal(got[2][0], imgs[[4, 0]].astype(np.float64))
    # float_data records, and the default backend (unset: LEVELDB) reads it without a word.
    vals = np.random.default_rng(8).normal(size=(3, 1, 2, 2)).astype(np.float32)
    fpath = write_leveldb(tmp_path / "float", [raw_datum(v, i) for i, v in enumerate(vals)])
    fnet = data_net(fpath, batch=3, backend=None)
    np.testing.assert_array_equal(batches(fnet, 1)[0][0], vals)


def test_replicas_and_rand_skip(tmp_path):
    path = write_leveldb(tmp_path / "db", [raw_datum(im, i) for i, im in
                                           enumerate(images(12, (1, 2, 2)))])
    text = data_layer(path, batch=2)
    # Replica r's batch k is database batch k*R + r, as over an LMDB.
    assert [replica_labels(text, r, 3, 2) for r in range(3)] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]],
                                                   [[4, 5], [10, 11]]]
    skips = set()
    for seed in range(6):
        first = batches(data_net(path, batch=5, extra="rand_skip: 4", seed=seed), 3)
        s = int(first[0][1][0])
        assert 0 <= s < 4 and first[2][1].tolist() == [(s + i) % 12 for i in range(10, 15)]
        skips.add(s)
    assert len(skips) > 1


def test_cursor_restores_on_a_fresh_source_and_from_a_solverstate(tmp_path):
    imgs = images(7, (1, 5, 5), seed=9)
    path = write_leveldb(tmp_path / "db", [raw_datum(im, i % 3) for i, im in enumerate(imgs)])
    t = "crop_size: 4 mirror: true"
    straight = batches(data_net(path, transform=t, seed=4), 6)
    fresh = data_net(path, transform=t, seed=4)
    fresh.builder.stateful["data/cursor"].restore({"batch": 4})  # past the end, count unknown
    for (a, la), (b, lb) in zip(batches(fresh, 2), straight[4:]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
    del fresh

    (tmp_path / "net.prototxt").write_text(
        'name: "tiny"\n' + data_layer(path, batch=3, transform="crop_size: 4 mirror: true")
        + '\nlayer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param '
          '{ num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }\nlayer { name: "loss" '
          'type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n')
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path}/net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 10\n'
        f'random_seed: 2\nsnapshot_prefix: "{tmp_path}/snap"\n')

    a = Solver(str(tmp_path / "solver.prototxt"))
    for _ in range(2):
        train_step(a)
    _, state = a.snapshot()
    want = [train_step(a) for _ in range(3)]
    weights = a.net.params["ip"][0].data.copy()
    del a  # LevelDB allows one opener: the resumed run opens it anew

    b = Solver(str(tmp_path / "solver.prototxt"))
    b.restore(state)
    assert b.net.builder.stateful["data/cursor"].state() == {"batch": 2}
    for (data, label), (wd, wl) in zip([train_step(b) for _ in range(3)], want):
        np.testing.assert_array_equal(data, wd)
        np.testing.assert_array_equal(label, wl)
    np.testing.assert_array_equal(b.net.params["ip"][0].data, weights)


def test_backend_mismatch_reads_what_the_folder_holds_and_warns(tmp_path, warnings):
    imgs = images(3, (1, 2, 2), seed=1)
    lm = write_lmdb(tmp_path / "lmdb", [raw_datum(im, i) for i, im in enumerate(imgs)])
    ld = write_leveldb(tmp_path / "leveldb", [raw_datum(im, i) for i, im in enumerate(imgs)])
    for path, backend, setting, found in ((lm, None, "LEVELDB (the default)", "an LMDB"),
                                          (lm, "LEVELDB", "LEVELDB", "an LMDB"),
                                          (ld, "LMDB", "LMDB", "a LevelDB")):
        warnings.clear()
        net = data_net(path, batch=3, backend=backend)
        assert warnings == [f"layer 'data': data_param.backend is {setting} but '{path}' is "
                            f"{found}: reading it as one (Caffe would not); add 'backend: "
                            f"{'LMDB' if found == 'an LMDB' else 'LEVELDB'}' to data_param"]
        np.testing.assert_array_equal(batches(net, 1)[0][0], imgs)
        net.close()  # the next round opens the same database (py-lmdb: once per process)
    warnings.clear()
    data_net(ld, batch=3, backend=None)
    assert warnings == []


# -- errors ----------------------------------------------------------------------------------
def test_neither_database(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x.txt").write_text("x")
    with pytest.raises(LayerError, match=r"layer 'data' \(type Data\): '.*plain' is neither an "
                                         r"LMDB \(a folder with data.mdb\) nor a LevelDB \(a "
                                         r"folder with CURRENT\); data_param.backend is "
                                         r"LEVELDB \(the default\)"):
        data_net(tmp_path / "plain", backend=None)
    with pytest.raises(LayerError, match="layer 'data'.*LevelDB '.*nowhere' does not exist"):
        data_net(tmp_path / "nowhere")


def test_records_that_are_not_datums(tmp_path):
    good = raw_datum(images(1, (1, 2, 2))[0], 1).SerializeToString()
    bad = write_leveldb(tmp_path / "bad", [(b"key-0", b"\xff\xfe not a datum"), (b"key-1", good)])
    with pytest.raises(LayerError, match=f"layer 'data' .*LevelDB '{bad}': record 'key-0': "
                                         "not a serialized Datum"):
        data_net(bad, batch=1)
    later = write_leveldb(tmp_path / "later", [(b"a", good), (b"b", good),
                                               (b"c", b"\xff\xfe not a datum")])
    net = data_net(later, batch=2, extra="prefetch: 0")
    net.forward()
    with pytest.raises(PurineError, match=f"LevelDB '{later}': record 'c': not a serialized "
                                          "Datum"):
        net.forward()


def test_without_plyvel(tmp_path, monkeypatch, capsys):
    path = write_leveldb(tmp_path / "db", [raw_datum(images(1, (1, 2, 2))[0], 1)])
    listfile, _ = make_imageset(tmp_path / "images", n=2)
    monkeypatch.setitem(sys.modules, "plyvel", None)  # import plyvel now fails
    with pytest.raises(LayerError, match=r"layer 'data' .*LevelDB databases need the plyvel "
                                         r"package: pip install purine-caffe\[leveldb\] \(or "
                                         r"pip install plyvel\)"):
        data_net(path, batch=1)
    out = str(tmp_path / "out")
    assert convert_main(["--backend", "leveldb", str(tmp_path / "images") + "/", str(listfile),
                         out]) == 1
    assert "pip install purine-caffe[leveldb]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # no empty folder left behind
    assert mean_main(["--backend", "leveldb", path]) == 1
    assert "pip install purine-caffe[leveldb]" in capsys.readouterr().err


# -- compute_image_mean ----------------------------------------------------------------------
def test_compute_image_mean_of_a_leveldb(both, tmp_path):
    dbs, imgs = both
    lines = Lines()
    mean = compute_image_mean(dbs["leveldb"], tmp_path / "m.binaryproto", backend="leveldb",
                              log=lines.log)
    assert mean.shape == (1, 3, 6, 7) and mean.dtype == np.float32
    np.testing.assert_array_equal(mean[0], imgs.mean(axis=0, dtype=np.float64)
                                  .astype(np.float32))
    assert "Processed 5 files." in lines.lines
    np.testing.assert_array_equal(
        mean, compute_image_mean(dbs["lmdb"], backend="lmdb", log=Lines().log))
    with pytest.raises(PurineError, match="is a LevelDB, not an LMDB: give --backend leveldb"):
        compute_image_mean(dbs["leveldb"], log=Lines().log)
    bad = write_leveldb(tmp_path / "bad", [(b"x", b"\xff\xfe")])
    with pytest.raises(PurineError, match=r"record b'x' is not a Datum"):
        compute_image_mean(bad, backend="leveldb", log=Lines().log)
