"""An LMDB of Caffe Datum records read by position (record i in key order, wrapping at the
end, as Caffe's DataLayer cursor walks it), and the batches of a Data layer over it or a
LevelDB: batch k of replica r of R holds records [(k*R + r)*batch_size, ...) after the
rand_skip offset."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import lmdb
import numpy as np

from purine.data import DataError
from purine.data.datum import datum_image, decode_flag, parse_datum, show_key
from purine.data.prefetch import Batch, BufferPool, stream_batch
from purine.data.transformer import Shape, Transformer

if TYPE_CHECKING:
    from purine.data.leveldb_source import LevelDBReader

# py-lmdb refuses to open one database file twice in a process, and a train net and a test
# net (or two nets in a test) may read the same database: they share one environment while
# either lives. Keyed by the data file's inode, so a database rewritten in place is new.
_ENVS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_ENVS_LOCK = threading.Lock()


def _open(path: str) -> lmdb.Environment:
    subdir = os.path.isdir(path)
    try:
        st = os.stat(os.path.join(path, "data.mdb") if subdir else path)
        key = (st.st_dev, st.st_ino)
    except OSError:
        key = None  # lmdb.open says what is wrong
    with _ENVS_LOCK:
        env = _ENVS.get(key) if key else None
        if env is None:
            # lock=False: a database on a read-only medium opens too, as Caffe retries with
            # MDB_NOLOCK; there are readers only, so they need no lock between them.
            env = lmdb.open(path, readonly=True, lock=False, subdir=subdir, max_readers=512)
            if key:
                _ENVS[key] = env
        return env


class DatumSource:
    """A database of Datum records that DatumBatches reads, an LMDB or a LevelDB: ``kind``
    and ``path`` name it in messages, ``reader()`` gives each thread a cursor of its own."""

    kind = ""
    one_opener = ""  # why a second opener in this process is refused
    opened_as = ""  # what the user holds open and must close then

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise DataError(f"{self.kind} '{self.path}' does not exist")

    def cannot_open(self, detail: str, elsewhere: bool) -> DataError:
        """The error for a database that would not open; ``elsewhere``: because this process
        holds it open already."""
        if elsewhere:
            return DataError(f"{self.kind} '{self.path}' is open elsewhere in this process "
                             f"({self.one_opener}): close that {self.opened_as} before a "
                             "data layer reads it")
        return DataError(f"{self.kind} '{self.path}' cannot be opened: {detail}")

    def reader(self) -> LMDBReader | LevelDBReader:
        raise NotImplementedError

    def first(self) -> tuple[bytes, bytes]:
        r = self.reader()
        try:
            return r.records(0, 1)[0]
        finally:
            r.close()


class LMDBSource(DatumSource):
    """A read-only LMDB; every thread reads through its own ``reader()``."""

    kind = "LMDB"
    one_opener = "py-lmdb opens a database once per process"
    opened_as = "environment"

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        try:
            self.env = _open(self.path)
        except lmdb.Error as e:
            raise self.cannot_open(str(e), "already open" in str(e)) from None
        self.count = int(self.env.stat()["entries"])
        if self.count == 0:
            raise DataError(f"LMDB '{self.path}' has no records")

    def reader(self) -> LMDBReader:
        return LMDBReader(self)


class LMDBReader:
    """A read transaction and a cursor; ``records(start, n)`` walks forward from where the
    last call stopped, so consecutive batches cost one step per record."""

    def __init__(self, source: LMDBSource):
        self.source = source
        self.txn = source.env.begin(buffers=False)
        self.cursor = self.txn.cursor()
        self.cursor.first()
        self.pos = 0  # the record the cursor is on

    def _seek(self, i: int) -> None:
        n = self.source.count
        ahead = (i - self.pos) % n
        if ahead > i:  # cheaper to walk from the first record
            self.cursor.first()
            self.pos, ahead = 0, i
        for _ in range(ahead):
            self._step()

    def _step(self) -> None:
        if not self.cursor.next():
            self.cursor.first()
        self.pos = (self.pos + 1) % self.source.count

    def records(self, start: int, n: int) -> list[tuple[bytes, bytes]]:
        """Records ``start, start+1, ...`` (modulo the record count) as (key, value)."""
        self._seek(start % self.source.count)
        out = []
        for _ in range(n):
            out.append(self.cursor.item())
            self._step()
        return out

    def close(self) -> None:
        self.txn.abort()


class DatumBatches:
    """The batches of one Data layer over an LMDB or a LevelDB source: ``reader()`` gives a
    thread its ``read(k)``."""

    def __init__(self, source: DatumSource, batch_size: int,
                 transformer: Transformer, shape: Shape, *, labels: bool, dtype: str,
                 seed: int, index: int, replica: tuple[int, int] = (0, 1), skip: int = 0):
        self.source, self.batch_size, self.transformer = source, batch_size, transformer
        self.shape, self.labels, self.dtype = shape, labels, np.dtype(dtype)
        self.seed, self.index, self.replica, self.skip = seed, index, replica, skip
        self.flag = decode_flag(transformer.force_color, transformer.force_gray)

    def where(self, key: bytes) -> str:
        return f"{self.source.kind} '{self.source.path}': record '{show_key(key)}'"

    def reader(self, pool: BufferPool | None = None) -> Callable[[int], Batch]:
        r, pool = self.source.reader(), pool or BufferPool(0)
        return lambda k: self.read(r, k, pool)

    def read(self, r: LMDBReader | LevelDBReader, k: int, pool: BufferPool) -> Batch:
        g = stream_batch(k, self.replica)  # the batch's number in database order
        recs = r.records(self.skip + g * self.batch_size, self.batch_size)
        images, labels = [], np.empty(self.batch_size, self.dtype)
        for i, (key, value) in enumerate(recs):
            where = self.where(key)
            d = parse_datum(value, where)
            images.append(datum_image(d, self.flag, where))
            labels[i] = d.label
        out = pool.array((self.batch_size,) + self.shape, self.dtype)
        rng = (np.random.default_rng([self.seed, self.index, g])
               if self.transformer.random else None)
        self.transformer(images, out, rng, lambda i: self.where(recs[i][0]))
        return (out, labels) if self.labels else (out,)
