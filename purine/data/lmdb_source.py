"""An LMDB of Caffe Datum records read by position (record i in key order, wrapping at the
end, as Caffe's DataLayer cursor walks it), and the batches of a Data layer over it or a
LevelDB: batch k of replica r of R holds records [(k*R + r)*batch_size, ...) after the
rand_skip offset."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import lmdb
import numpy as np

from purine.data import DataError
from purine.data.datum import datum_image, decode_flag, parse_datum, show_key
from purine.data.prefetch import Batch, BufferPool, data_span, stream_batch
from purine.data.transformer import Transformer


class SharedHandles:
    """Handles opened once per process and key (an LMDB environment, a LevelDB), counted by
    the sources that use them: the last source to close (or to be collected) closes the
    handle, so that the database is free again at once."""

    def __init__(self, close: Callable[[Any], None]):
        self._close = close
        self._open: dict[Any, list] = {}  # key -> [handle, users]
        # Reentrant: a collection inside acquire() may run a dropped source's release.
        self._lock = threading.RLock()

    def acquire(self, key: Any, opener: Callable[[], Any]) -> Any:
        """The handle open under ``key``, else ``opener()``'s; a None key is never shared."""
        with self._lock:
            entry = self._open.get(key) if key is not None else None
            if entry is None:
                entry = [opener(), 0]
                self._open[key if key is not None else object()] = entry
            entry[1] += 1
            return entry[0]

    def release(self, handle: Any) -> None:
        """One user of ``handle`` is done with it; the last one closes it."""
        with self._lock:
            for key, entry in list(self._open.items()):
                if entry[0] is handle:
                    entry[1] -= 1
                    if entry[1] > 0:
                        return
                    del self._open[key]
                    break
            else:
                return
        self._close(handle)


# py-lmdb refuses to open one database file twice in a process, and a train net and a test
# net (or two nets in a test) may read the same database: they share one environment.
# Keyed by the data file's inode, so a database rewritten in place is new.
_ENVS = SharedHandles(lambda env: env.close())


def _open(path: str) -> lmdb.Environment:
    subdir = os.path.isdir(path)
    try:
        st = os.stat(os.path.join(path, "data.mdb") if subdir else path)
        key = (st.st_dev, st.st_ino)
    except OSError:
        key = None  # lmdb.open says what is wrong
    # lock=False: a database on a read-only medium opens too, as Caffe retries with
    # MDB_NOLOCK; there are readers only, so they need no lock between them.
    return _ENVS.acquire(key, lambda: lmdb.open(path, readonly=True, lock=False, subdir=subdir,
                                                max_readers=512))


class DatumReader(Protocol):
    """One thread's cursor over a DatumSource (LMDBReader, LevelDBReader)."""

    def records(self, start: int, n: int) -> list[tuple[bytes, bytes]]:
        """Records ``start, start+1, ...`` (modulo the record count) as (key, value)."""
        ...

    def close(self) -> None: ...


class DatumSource:
    """A database of Datum records that DatumBatches reads, an LMDB or a LevelDB: ``kind``
    and ``path`` name it in messages, ``reader()`` gives each thread a cursor of its own."""

    kind = ""
    one_opener = ""  # why a second opener in this process is refused
    opened_as = ""  # what the user holds open and must close then

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._release: weakref.finalize | None = None
        if not os.path.exists(self.path):
            raise DataError(f"{self.kind} '{self.path}' does not exist")

    def _hold(self, handles: SharedHandles, handle: Any) -> None:
        """Give ``handle`` back on close(), or when this source is collected unclosed."""
        self._release = weakref.finalize(self, handles.release, handle)
        # Not at exit: a daemon prefetch thread may still be reading through it then.
        self._release.atexit = False

    def close(self) -> None:
        """Give the database handle back; the last source of a database closes it. A
        reader's thread must be done with it first. Closing twice does nothing."""
        if self._release is not None:
            self._release()

    @property
    def closed(self) -> bool:
        return self._release is not None and not self._release.alive

    def check_open(self) -> None:
        if self.closed:
            raise DataError(f"{self.kind} '{self.path}' is closed: its net was closed")

    def cannot_open(self, detail: str, elsewhere: bool) -> DataError:
        """The error for a database that would not open; ``elsewhere``: because this process
        holds it open already."""
        if elsewhere:
            return DataError(f"{self.kind} '{self.path}' is open elsewhere in this process "
                             f"({self.one_opener}): close that {self.opened_as} before a "
                             "data layer reads it")
        return DataError(f"{self.kind} '{self.path}' cannot be opened: {detail}")

    def reader(self) -> DatumReader:
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
        self._hold(_ENVS, self.env)
        self.count = int(self.env.stat()["entries"])
        if self.count == 0:
            self.close()
            raise DataError(f"LMDB '{self.path}' has no records")

    def reader(self) -> LMDBReader:
        return LMDBReader(self)


class LMDBReader:
    """A read transaction and a cursor; ``records(start, n)`` walks forward from where the
    last call stopped, so consecutive batches cost one step per record."""

    def __init__(self, source: LMDBSource):
        source.check_open()
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
        self.source.check_open()
        self._seek(start % self.source.count)
        out = []
        for _ in range(n):
            out.append(self.cursor.item())
            self._step()
        return out

    def close(self) -> None:
        if self.txn is not None and not self.source.closed:
            self.txn.abort()
        self.txn = self.cursor = None


class DatumBatches:
    """The batches of one Data layer over an LMDB or a LevelDB source: ``reader()`` gives a
    thread its ``read(k)``."""

    def __init__(self, source: DatumSource, batch_size: int,
                 transformer: Transformer, *, labels: bool, dtype: str,
                 seed: int, index: int, replica: tuple[int, int] = (0, 1), skip: int = 0):
        self.source, self.batch_size, self.transformer = source, batch_size, transformer
        self.labels, self.dtype = labels, np.dtype(dtype)
        self.seed, self.index, self.replica, self.skip = seed, index, replica, skip
        self.flag = decode_flag(transformer.force_color, transformer.force_gray)

    def where(self, key: bytes) -> str:
        return f"{self.source.kind} '{self.source.path}': record '{show_key(key)}'"

    def reader(self, pool: BufferPool | None = None) -> Callable[[int], Batch]:
        """``read(k)``, with a ``close()`` that ends its cursor (the prefetch thread calls
        it as it exits, so that a closed database has no reader left)."""
        r, pool = self.source.reader(), pool or BufferPool(0)

        def read(k: int) -> Batch:
            return self.read(r, k, pool)

        read.close = r.close  # type: ignore[attr-defined]
        return read

    def close(self) -> None:
        """Release the source (its database handle); the readers must be done."""
        self.source.close()

    def read(self, r: DatumReader, k: int, pool: BufferPool) -> Batch:
        g = stream_batch(k, self.replica)  # the batch's number in database order
        # The three stages as spans of a trace (no cost when none is taken).
        with data_span("read"):
            recs = r.records(self.skip + g * self.batch_size, self.batch_size)
        with data_span("decode"):
            images, labels = [], np.empty(self.batch_size, self.dtype)
            for i, (key, value) in enumerate(recs):
                where = self.where(key)
                d = parse_datum(value, where)
                images.append(datum_image(d, self.flag, where))
                labels[i] = d.label
        with data_span("transform"):
            # Caffe shapes each batch by its first record (records of one batch must agree):
            # a net reshaped at every pass takes records of any size, one per batch.
            shape = self.transformer.output_shape(images[0].shape, self.where(recs[0][0]))
            out = pool.array((self.batch_size,) + shape, self.dtype)
            rng = (np.random.default_rng([self.seed, self.index, g])
                   if self.transformer.random else None)
            self.transformer(images, out, rng, lambda i: self.where(recs[i][0]))
        return (out, labels) if self.labels else (out,)
