"""A LevelDB of Caffe Datum records read by position through plyvel (the optional extra
``purine-caffe[leveldb]``), with LMDBSource's interface so that DatumBatches reads either:
records in key order, wrapping at the end as Caffe's cursor does."""

from __future__ import annotations

import os
from types import ModuleType

from purine.data import DataError
from purine.data.datum import show_key
from purine.data.lmdb_source import DatumSource, SharedHandles

INSTALL_HINT = "pip install purine-caffe[leveldb] (or pip install plyvel)"


def plyvel_module() -> ModuleType:
    """The plyvel package, or a DataError saying how to install it."""
    try:
        import plyvel
    except ImportError:
        raise DataError(f"LevelDB databases need the plyvel package: {INSTALL_HINT}") from None
    return plyvel


def message(e: Exception) -> str:
    """plyvel's errors carry LevelDB's status as bytes."""
    arg = e.args[0] if e.args else e
    return arg.decode("utf-8", "replace") if isinstance(arg, bytes) else str(arg)


# LevelDB locks its folder, so one process opens a database once: a train net and a test
# net (or two nets in a test) reading one database share the handle, and the last of their
# sources to close closes it. Keyed by the folder's inode, so a database written anew under
# the same name is new.
_DBS = SharedHandles(lambda db: db.close())


def _open(path: str):
    plyvel = plyvel_module()
    st = os.stat(path)
    return _DBS.acquire((st.st_dev, st.st_ino),
                        lambda: plyvel.DB(path, create_if_missing=False))


class LevelDBSource(DatumSource):
    """A LevelDB opened for reading; every thread reads through its own ``reader()``.

    LevelDB keeps no record count, and counting means reading the whole database, so
    ``count`` is None until a reader has walked past the last record once."""

    kind = "LevelDB"
    one_opener = "LevelDB locks a database to one opener"
    opened_as = "database"

    def __init__(self, path: str | os.PathLike):
        plyvel = plyvel_module()
        super().__init__(path)
        try:
            self.handle = _open(self.path)
        except plyvel.Error as e:
            held = isinstance(e, plyvel.IOError) and "already held by process" in message(e)
            raise self.cannot_open(message(e), held) from None
        self._hold(_DBS, self.handle)
        self.count: int | None = None
        with self.handle.iterator(include_value=False) as it:
            empty = next(it, None) is None
        if empty:
            self.close()
            raise DataError(f"LevelDB '{self.path}' has no records")

    def reader(self) -> LevelDBReader:
        return LevelDBReader(self)


class LevelDBReader:
    """A cursor position (the record number and its key); ``records(start, n)`` walks
    forward from where the last call stopped, as LMDBReader does.

    The walk steps over keys only (the records of other replicas, a resumed run's skip):
    values are read for the records returned alone. Each call reads through iterators of
    its own, closed before it returns: a LevelDB iterator must go before its database, and
    one left to the garbage collector (a reader lives in a prefetch thread's closure, which
    a net's reference cycles hold) may be freed after it, which crashes the process."""

    def __init__(self, source: LevelDBSource):
        source.check_open()
        self.source = source
        self.key: bytes | None = None  # the record the cursor is on
        self.pos = 0  # its number
        self._it = None  # a key-only iterator while records() walks

    def _rewind(self) -> None:
        self._it.seek_to_start()
        self.key = next(self._it)
        self.pos = 0

    def _resume(self) -> None:
        if self.key is not None:
            self._it.seek(self.key)
            if next(self._it, None) == self.key:
                return
        self._rewind()

    def _step(self) -> None:
        try:
            self.key = next(self._it)
            self.pos += 1
        except StopIteration:
            if self.source.count is None:
                self.source.count = self.pos + 1
            self._rewind()

    def _seek(self, i: int) -> None:
        if self.source.count is None:  # walk forward; a wrap on the way gives the count
            if i < self.pos:
                self._rewind()
            while self.pos < i and self.source.count is None:
                self._step()
            if self.source.count is None:
                return
        n = self.source.count
        i %= n
        ahead = (i - self.pos) % n
        if ahead > i:  # cheaper to walk from the first record
            self._rewind()
            ahead = i
        for _ in range(ahead):
            self._step()

    def records(self, start: int, n: int) -> list[tuple[bytes, bytes]]:
        """Records ``start, start+1, ...`` (modulo the record count) as (key, value)."""
        self.source.check_open()
        with self.source.handle.iterator(include_value=False) as self._it:
            try:
                self._resume()
                self._seek(start)
                keys = []
                for _ in range(n):
                    keys.append(self.key)
                    self._step()
            finally:
                self._it = None
        return self._values(keys)

    def _values(self, keys: list[bytes]) -> list[tuple[bytes, bytes]]:
        """The records of ``keys``, consecutive in key order but for wraps to the first."""
        out = []
        with self.source.handle.iterator() as it:
            for j, key in enumerate(keys):
                if j == 0 or key <= keys[j - 1]:  # a run starts: one seek, then steps
                    it.seek(key)
                item = next(it, None)
                if item is None or item[0] != key:
                    raise DataError(f"LevelDB '{self.source.path}': record "
                                    f"'{show_key(key)}' changed while it was read")
                out.append(item)
        return out

    def close(self) -> None:
        self.key = None
