"""LMDB records by position: key order, wrap-around, seeking back and forth, the errors of
a missing or empty database, and two readers of one database in one process."""

import shutil

import lmdb
import pytest

from purine.data import DataError
from purine.data.lmdb_source import LMDBSource


def make(tmp_path, n, name="db"):
    path = str(tmp_path / name)
    env = lmdb.open(path, map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i in reversed(range(n)):  # written out of order: reading is in key order
            txn.put(f"k{i:03d}".encode(), f"v{i}".encode())
    env.close()
    return path


def test_positions_wrap_and_seek(tmp_path):
    src = LMDBSource(make(tmp_path, 7))
    assert src.count == 7
    r = src.reader()
    assert r.records(0, 3) == [(b"k000", b"v0"), (b"k001", b"v1"), (b"k002", b"v2")]
    assert [k for k, _ in r.records(5, 4)] == [b"k005", b"k006", b"k000", b"k001"]
    assert [k for k, _ in r.records(1, 2)] == [b"k001", b"k002"]  # backwards
    assert [k for k, _ in r.records(7 * 3 + 4, 1)] == [b"k004"]  # modulo the count
    assert [k for k, _ in r.records(6, 8)] == [b"k006"] + [f"k{i:03d}".encode()
                                                           for i in range(7)]
    assert src.first() == (b"k000", b"v0")
    r.close()


def test_missing_empty_and_not_a_database(tmp_path):
    with pytest.raises(DataError, match="LMDB '.*nowhere' does not exist"):
        LMDBSource(tmp_path / "nowhere")
    empty = make(tmp_path, 0, "empty")
    with pytest.raises(DataError, match="LMDB '.*empty' has no records"):
        LMDBSource(empty)
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="LMDB '.*dir' cannot be opened"):
        LMDBSource(tmp_path / "dir")


def test_two_sources_of_one_database(tmp_path):
    # py-lmdb opens an environment once per process: train and test nets share it.
    path = make(tmp_path, 3)
    a, b = LMDBSource(path), LMDBSource(path)
    assert a.env is b.env
    assert a.reader().records(2, 1) == b.reader().records(2, 1)


def test_database_rewritten_in_place_is_read_anew(tmp_path):
    old = LMDBSource(make(tmp_path, 2))
    shutil.rmtree(tmp_path / "db")
    new = LMDBSource(make(tmp_path, 5))
    assert (old.count, new.count) == (2, 5) and old.env is not new.env
