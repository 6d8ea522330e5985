"""Releasing data sources: a closed net or solver has joined its prefetch threads and given its
databases back (a LevelDB opens again at once), on success and on error, in the library, the
CLI and extract_features; closing twice is harmless, running a closed net is an error, a
database two nets share is counted; LevelDB skips step over keys and read no values."""

import lmdb
import numpy as np
import plyvel
import pytest

from purine import cli
from purine.caffe import TEST, Net
from purine.caffe.solver import Solver
from purine.data import DataError
from purine.data.leveldb_source import LevelDBSource
from purine.data.lmdb_source import LMDBSource
from purine.data.prefetch import Prefetcher
from purine.errors import LayerError, PurineError
from tests.data.helpers import batches, data_layer, data_net, images, raw_datum, write_lmdb

HELD = "already held by process"  # LevelDB's lock refusal


def write_leveldb(path, n=7, shape=(1, 2, 2)):
    """``n`` raw Datums labelled 0..n-1, keyed 00000000, ..."""
    db = plyvel.DB(str(path), create_if_missing=True)
    for i, im in enumerate(images(n, shape, seed=3)):
        db.put(f"{i:08d}".encode(), raw_datum(im, i).SerializeToString())
    db.close()
    return str(path)


def opens_now(path) -> bool:
    """Whether plyvel opens the LevelDB this instant (no retry, no collection)."""
    try:
        db = plyvel.DB(str(path))
    except plyvel.IOError as e:
        assert HELD in str(e)
        return False
    db.close()
    return True


def leveldb_net(path, batch=3, **kw) -> Net:
    return data_net(path, batch=batch, backend="LEVELDB", **kw)


def labels(net, n):
    return [lab.astype(int).tolist() for _, lab in batches(net, n)]


# -- Net.close -------------------------------------------------------------------------------
def test_net_close_joins_the_thread_and_frees_the_leveldb_at_once(tmp_path):
    path = write_leveldb(tmp_path / "db")
    net = leveldb_net(path)
    assert labels(net, 2) == [[0, 1, 2], [3, 4, 5]]
    cursor = net.builder.stateful["data/cursor"]
    thread = cursor._thread
    assert thread.is_alive() and not opens_now(path)
    net.close()
    assert not thread.is_alive() and cursor.closed
    assert opens_now(path)
    net.close()  # twice: nothing more to do
    assert opens_now(path)


def test_running_a_closed_net_is_an_error(tmp_path):
    path = write_leveldb(tmp_path / "db")
    with leveldb_net(path) as net:
        net.forward()
    assert net.closed and opens_now(path)
    with pytest.raises(PurineError, match="net '' is closed: its data sources are released"):
        net.forward()
    with pytest.raises(PurineError, match="is closed"):
        net.backward()
    with pytest.raises(PurineError, match="is closed"):
        net.reshape()
    with pytest.raises(DataError, match="layer 'data': the data source is closed"):
        net.builder.stateful["data/cursor"].next()


@pytest.mark.parametrize("prefetch", [0, 4])
def test_two_nets_on_one_leveldb_closing_one_leaves_the_other_reading(tmp_path, prefetch):
    path = write_leveldb(tmp_path / "db")
    a = leveldb_net(path, extra=f"prefetch: {prefetch}")
    b = leveldb_net(path, extra=f"prefetch: {prefetch}")
    assert a.builder.stateful["data/cursor"].make_reader.__self__.source.handle is \
        b.builder.stateful["data/cursor"].make_reader.__self__.source.handle
    assert labels(a, 1) == labels(b, 1) == [[0, 1, 2]]
    a.close()
    assert not opens_now(path)  # b still holds it
    assert labels(b, 2) == [[3, 4, 5], [6, 0, 1]]
    b.close()
    assert opens_now(path)
    c = leveldb_net(path)  # opened anew after the last close
    assert labels(c, 1) == [[0, 1, 2]]
    c.close()


def test_two_nets_on_one_lmdb_share_a_counted_environment(tmp_path):
    path = write_lmdb(tmp_path / "db", [raw_datum(im, i) for i, im in
                                        enumerate(images(5, (1, 2, 2)))])
    a, b = data_net(path, batch=2), data_net(path, batch=2)
    env = a.builder.stateful["data/cursor"].make_reader.__self__.source.env
    assert labels(a, 1) == labels(b, 1) == [[0, 1]]
    a.close()
    assert labels(b, 2) == [[2, 3], [4, 0]] and int(env.stat()["entries"]) == 5
    b.close()
    with pytest.raises(lmdb.Error):  # the last close closed the environment
        env.stat()
    fresh = LMDBSource(path)
    assert fresh.env is not env and fresh.count == 5
    fresh.close()
    with pytest.raises(DataError, match=r"LMDB '.*db' is closed: its net was closed"):
        fresh.reader()


def test_reshape_keeps_the_data_layers_source_open_once(tmp_path):
    path = write_leveldb(tmp_path / "db")
    net = leveldb_net(path)
    assert labels(net, 1) == [[0, 1, 2]]
    cursor = net.builder.stateful["data/cursor"]
    net.reshape()  # every build of the net reads from the one source (LevelDB locks it)
    assert not cursor.closed and net.builder.stateful["data/cursor"] is cursor
    assert labels(net, 1) == [[3, 4, 5]]  # the cursor goes on
    net.close()
    assert cursor.closed and opens_now(path)


def test_a_net_that_fails_to_build_releases_its_data_layers(tmp_path):
    path = write_leveldb(tmp_path / "db")
    text = data_layer(path, batch=3, backend="LEVELDB") + (
        ' layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
        "inner_product_param { num_output: 2 axis: 7 } }")
    with pytest.raises(LayerError, match="layer 'ip'"):
        Net(text, phase=TEST)
    assert opens_now(path)


# -- the prefetcher --------------------------------------------------------------------------
class Batches:
    """make_reader's owner: ``read(k)`` gives (k,); counts the closes of both."""

    def __init__(self):
        self.closed = self.readers_closed = 0

    def reader(self, pool):
        def read(k):
            return (np.array([k]),)

        def close():
            self.readers_closed += 1

        read.close = close
        return read

    def close(self):
        self.closed += 1


@pytest.mark.parametrize("depth", [0, 3])
def test_prefetcher_close_ends_the_reader_then_releases_the_source(depth):
    b = Batches()
    p = Prefetcher(b.reader, depth, "layer 'x'")
    assert [int(p.next()[0][0]) for _ in range(3)] == [0, 1, 2]
    thread = p._thread
    p.close()
    assert (b.readers_closed, b.closed) == (1, 1)
    assert thread is None or not thread.is_alive()
    p.close()
    assert (b.readers_closed, b.closed) == (1, 1)
    with pytest.raises(DataError, match="layer 'x': the data source is closed"):
        p.next()


# -- Solver.close ----------------------------------------------------------------------------
def solver_files(tmp_path, db, extra=""):
    (tmp_path / "net.prototxt").write_text(
        'name: "tiny"\n' + data_layer(db, batch=3, backend="LEVELDB")
        + '\nlayer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
          'inner_product_param { num_output: 7 weight_filler { type: "gaussian" std: 0.1 } } }'
          '\nlayer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" '
          'top: "loss" }\n')
    solver = tmp_path / "solver.prototxt"
    solver.write_text(
        f'net: "{tmp_path}/net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 3\n'
        f'test_iter: 2\ntest_interval: 2\nrandom_seed: 2\nsnapshot_prefix: "{tmp_path}/snap"\n'
        + extra)
    return str(solver)


def test_solver_close_frees_the_database_its_train_and_test_nets_share(tmp_path):
    path = write_leveldb(tmp_path / "db")
    s = Solver(solver_files(tmp_path, path))
    s.step(3)  # tests at iteration 2: both nets have read
    assert [len(n.builder.stateful) for n in (s.net, *s.test_nets)] == [1, 1]
    assert not opens_now(path)
    s.close()
    assert opens_now(path) and s.net.closed and s.test_nets[0].closed
    s.close()
    with pytest.raises(PurineError, match=r"solver .*solver.prototxt is closed"):
        s.step(1)
    with Solver(solver_files(tmp_path, path)) as again:  # the context manager closes too
        again.step(1)
    assert opens_now(path)


def test_a_solver_that_fails_to_build_releases_its_nets(tmp_path):
    path = write_leveldb(tmp_path / "db")
    files = solver_files(tmp_path, path, extra=f'weights: "{tmp_path}/none.caffemodel"\n')
    with pytest.raises(PurineError, match="none.caffemodel"):
        Solver(files)
    assert opens_now(path)


# -- the command line ------------------------------------------------------------------------
@pytest.fixture
def leveldb_model(tmp_path):
    """A LevelDB, the net prototxt over it and a caffemodel of its weights."""
    path = write_leveldb(tmp_path / "db")
    solver = solver_files(tmp_path, path)
    with Net(str(tmp_path / "net.prototxt"), phase=TEST) as net:
        net.save(tmp_path / "w.caffemodel")
    return path, str(tmp_path / "net.prototxt"), str(tmp_path / "w.caffemodel"), solver


@pytest.mark.parametrize("args", [
    ["test", "--model", "{model}", "--weights", "{weights}", "--iterations", "2"],
    ["time", "--model", "{model}", "--iterations", "1"],
    ["train", "--solver", "{solver}"],
    ["extract_features", "{weights}", "{model}", "ip", "{tmp}/feat", "2", "lmdb"],
])
def test_commands_leave_their_database_free(leveldb_model, tmp_path, args):
    path, model, weights, solver = leveldb_model
    argv = [a.format(model=model, weights=weights, solver=solver, tmp=tmp_path) for a in args]
    assert cli.main(argv) == 0
    assert opens_now(path)


@pytest.mark.parametrize("args, error", [
    (["test", "--model", "{model}", "--weights", "{tmp}/none.caffemodel"], "none.caffemodel"),
    (["extract_features", "{weights}", "{model}", "nothing", "{tmp}/feat", "1", "lmdb"],
     "Unknown feature blob name 'nothing'"),
])
def test_commands_that_fail_leave_their_database_free(leveldb_model, tmp_path, capsys, args,
                                                      error):
    path, model, weights, _ = leveldb_model
    argv = [a.format(model=model, weights=weights, tmp=tmp_path) for a in args]
    assert cli.main(argv) == 1
    assert error in capsys.readouterr().err
    assert opens_now(path)


# -- LevelDB skips read keys only ------------------------------------------------------------
class CountingDB:
    """A plyvel DB whose iterators count the values they hand out; ``drop`` deletes that
    key just before values are read (a record gone between the walk and the read)."""

    def __init__(self, db, drop=None):
        self.db, self.drop, self.values = db, drop, 0

    def iterator(self, include_value=True):
        if include_value and self.drop is not None:
            self.db.delete(self.drop)
        return CountingIterator(self, self.db.iterator(include_value=include_value),
                                include_value)


class CountingIterator:
    def __init__(self, owner, it, counts):
        self.owner, self.it, self.counts = owner, it, counts

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.it.close()

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.it)
        self.owner.values += self.counts
        return item

    def seek(self, key):
        self.it.seek(key)

    def seek_to_start(self):
        self.it.seek_to_start()


def test_skips_step_over_keys_and_read_only_the_values_returned(tmp_path):
    db = plyvel.DB(str(tmp_path / "db"), create_if_missing=True)
    for i in range(10):
        db.put(f"k{i:02d}".encode(), f"v{i}".encode())
    db.close()
    src = LevelDBSource(tmp_path / "db")
    counting = CountingDB(src.handle)
    src.handle = counting
    r = src.reader()
    # 26 records ahead, wrapping twice on the way (the count is learned at the first wrap).
    assert r.records(26, 2) == [(b"k06", b"v6"), (b"k07", b"v7")]
    assert counting.values == 2 and src.count == 10
    # A batch over the wrap: two runs, each one seek.
    assert r.records(38, 4) == [(b"k08", b"v8"), (b"k09", b"v9"), (b"k00", b"v0"),
                                (b"k01", b"v1")]
    assert counting.values == 6
    assert [k for k, _ in r.records(3, 12)] == [f"k{i % 10:02d}".encode()
                                                for i in range(3, 15)]
    assert counting.values == 18
    r.close()
    src.handle = counting.db
    src.close()


def test_a_record_gone_between_the_walk_and_the_read(tmp_path):
    db = plyvel.DB(str(tmp_path / "db"), create_if_missing=True)
    for i in range(5):
        db.put(f"k{i}".encode(), b"v")
    db.close()
    src = LevelDBSource(tmp_path / "db")
    real = src.handle
    src.handle = CountingDB(real, drop=b"k3")
    with pytest.raises(DataError, match=r"LevelDB '.*db': record 'k3' changed while it was "
                                        "read"):
        src.reader().records(2, 3)
    src.handle = real
    src.close()
    assert opens_now(tmp_path / "db")
