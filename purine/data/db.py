"""The registry of Datum databases (LMDB, LevelDB, and any backend registered later): each
backend says whether a path is its own, opens it for the Data layer, walks it for the tools,
and writes a new one in Caffe's batches; its name and DataParameter.DB value live here only."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator

from purine.data import DataError
from purine.data.leveldb_source import LevelDBSource, message, plyvel_module
from purine.data.lmdb_source import DatumSource, LMDBSource
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb

COMMIT_EVERY = 1000  # records per transaction, as Caffe's tools commit
ErrorType = type[PurineError]  # the error a caller wants (the tools raise ConvertError)


# -- writing ------------------------------------------------------------------------------
Records = list[tuple[bytes, bytes]]


class DatumWriter:
    """A new database (Caffe's ``db::NEW``): ``put`` buffers a record and commits every
    COMMIT_EVERY records, as Caffe's tools do; ``commit`` writes the buffered ones in one
    transaction (``write``, or the ``transact(writer, records)`` a tool passes to see
    them); ``close`` commits the rest; ``abort`` removes what was written. The folder must
    not exist. A backend subclasses it with ``_open``, ``write`` and ``_close``."""

    def __init__(self, path: str | os.PathLike, error: ErrorType = DataError,
                 transact: Callable[[DatumWriter, Records], None] | None = None):
        self.path, self.error = os.fspath(path), error
        self._transact = transact or type(self).write
        self.pending: Records = []
        try:
            os.mkdir(self.path)
        except FileExistsError:
            raise error(f"{self.path}: already exists; remove it or choose another name "
                        "(Caffe's tools never write into an existing database)") from None
        except OSError as e:
            raise error(f"{self.path}: cannot create the database folder: "
                        f"{e.strerror}") from None
        try:
            self._open()
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def check_key(self, key: bytes) -> None:
        """Refuse a key the database cannot store."""

    def put(self, key: str | bytes, value: bytes) -> bool:
        """Buffer one record; True when it completed a batch, which is then committed."""
        k = key if isinstance(key, bytes) else key.encode("utf-8", "surrogateescape")
        self.check_key(k)
        self.pending.append((k, value))
        if len(self.pending) < COMMIT_EVERY:
            return False
        self.commit()
        return True

    def commit(self) -> None:
        if self.pending:
            batch, self.pending = self.pending, []
            self._transact(self, batch)

    def close(self) -> None:
        """Commit what is pending and close the database."""
        try:
            self.commit()
        finally:
            self._close()

    def abort(self) -> None:
        """Close without committing and remove the half-written database."""
        self._close()
        shutil.rmtree(self.path, ignore_errors=True)

    def _open(self) -> None:
        raise NotImplementedError

    def write(self, records: Records) -> None:
        """Write ``records`` in one transaction."""
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


# -- the backend interface and the registry -----------------------------------------------
class Backend:
    """One kind of database: ``name`` (the tools' --backend), ``kind`` and ``article`` (in
    messages), ``layout`` (what detect looks for, in messages), ``enum`` (its
    DataParameter.DB value, None when Caffe has none), and the classes that read
    (``source_class``, a DatumSource) and write (``writer_class``, a DatumWriter) it."""

    name = ""
    kind = ""
    article = ""
    layout = ""
    enum: int | None = None
    source_class: type[DatumSource] = DatumSource
    writer_class: type[DatumWriter] = DatumWriter

    def detect(self, path: str) -> bool:
        """Whether ``path`` holds a database of this kind."""
        raise NotImplementedError

    def source(self, path: str | os.PathLike) -> DatumSource:
        """The Datum source a Data layer reads."""
        return self.source_class(path)

    def writer(self, path: str | os.PathLike, error: ErrorType = DataError,
               transact: Callable[[DatumWriter, Records], None] | None = None) -> DatumWriter:
        """A new database at ``path``, which must not exist (DatumWriter's arguments)."""
        return self.writer_class(path, error, transact)

    def walk(self, path: str, error: ErrorType = DataError) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) record in key order, once (compute_image_mean's pass)."""
        src = self.source(path)
        try:
            count = getattr(src, "count", None)
            if count is None:
                raise error(f"{path}: a {self.kind} source keeps no record count to walk")
            reader = src.reader()
            try:
                for start in range(0, count, COMMIT_EVERY):
                    yield from reader.records(start, min(COMMIT_EVERY, count - start))
            finally:
                reader.close()
        finally:
            src.close()

    def count(self, path: str) -> int | None:  # noqa: ARG002
        """The record count, when the database keeps one cheaply (progress bars)."""
        return None


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend under its name; detect tries them in registration order."""
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered backends' names, as the tools' --backend takes them."""
    return tuple(_REGISTRY)


def names_text() -> str:
    """``lmdb or leveldb``: the names for a message."""
    n = names()
    return n[0] if len(n) == 1 else f"{', '.join(n[:-1])} or {n[-1]}"


def get(name: str) -> Backend | None:
    return _REGISTRY.get(name)


def require(name: str, error: type[PurineError] = DataError) -> Backend:
    """The backend named ``name``; ``error`` (the caller's error class) naming the
    registered ones when there is none."""
    found = _REGISTRY.get(name)
    if found is None:
        raise error(f"unknown backend '{name}'; use {names_text()}")
    return found


def by_enum(value: int) -> Backend:
    """The backend of a DataParameter.DB value."""
    for b in _REGISTRY.values():
        if b.enum == value:
            return b
    raise DataError(f"data_param.backend {value} names no database backend")


def neither() -> str:
    """What every backend looks for, for a path that holds none of them."""
    return "neither " + " nor ".join(f"{b.article} ({b.layout})" for b in _REGISTRY.values())


def detect(path: str | os.PathLike) -> str | None:
    """The name of the backend whose database ``path`` holds, or None."""
    path = os.fspath(path)
    for b in _REGISTRY.values():
        if b.detect(path):
            return b.name
    return None


def open_source(path: str | os.PathLike, backend: str) -> DatumSource:
    """A Datum source of the backend named ``backend``."""
    return require(backend).source(path)


# -- LMDB ---------------------------------------------------------------------------------
# Caffe asks LMDB for a 1 TB map: address space only on 64-bit, the file grows as written.
# A full map is still handled, by doubling it and retrying the transaction.
MAP_SIZE = 1 << 40 if sys.maxsize > 2**32 else 1 << 30
LMDB_MAX_KEY = 511  # bytes, LMDB's compiled-in limit


class LMDBWriter(DatumWriter):
    def _open(self) -> None:
        import lmdb

        try:
            self._env = lmdb.open(self.path, map_size=MAP_SIZE, subdir=True)
        except lmdb.Error as e:
            raise self.error(f"{self.path}: cannot open the lmdb: {e}") from None

    def check_key(self, key: bytes) -> None:
        if not 0 < len(key) <= LMDB_MAX_KEY:
            raise self.error(f"key {key!r} is {len(key)} bytes; LMDB keys are 1 to "
                             f"{LMDB_MAX_KEY} bytes")

    def write(self, records: Records) -> None:
        import lmdb

        try:
            while True:
                try:
                    with self._env.begin(write=True) as txn:
                        txn.cursor().putmulti(records)
                    return
                except lmdb.MapFullError:
                    # The transaction was aborted: grow the map (as newer Caffe does), redo it.
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
        except lmdb.Error as e:
            raise self.error(f"{self.path}: writing the lmdb failed: {e}") from None

    def _close(self) -> None:
        if getattr(self, "_env", None) is not None:
            self._env.close()
        self._env = None


class LMDB(Backend):
    name, kind, article, layout = "lmdb", "LMDB", "an LMDB", "a folder with data.mdb"
    enum = pb.DataParameter.LMDB
    source_class, writer_class = LMDBSource, LMDBWriter

    def detect(self, path: str) -> bool:
        # A folder with data.mdb, or a single-file LMDB (subdir=False).
        return os.path.isfile(path) or os.path.isfile(os.path.join(path, "data.mdb"))

    def _env(self, path: str):
        import lmdb

        return lmdb.open(path, readonly=True, lock=False, subdir=os.path.isdir(path))

    def walk(self, path: str, error: ErrorType = DataError) -> Iterator[tuple[bytes, bytes]]:
        import lmdb

        try:
            env = self._env(path)
        except lmdb.Error as e:
            raise error(f"{path}: cannot open the lmdb: {e}") from None
        try:
            with env.begin(buffers=False) as txn:
                yield from txn.cursor()
        except lmdb.Error as e:  # a damaged file found while walking it
            raise error(f"{path}: cannot read the lmdb: {e}") from None
        finally:
            env.close()

    def count(self, path: str) -> int | None:
        """The count LMDB keeps; None when it cannot be opened (walking it says why)."""
        import lmdb

        if not self.detect(path):
            return None
        try:
            env = self._env(path)
        except lmdb.Error:
            return None
        try:
            return env.stat()["entries"]
        finally:
            env.close()


# -- LevelDB ------------------------------------------------------------------------------
# What Caffe asks of a new LevelDB: a 256 MB write buffer and 64 KiB blocks.
LEVELDB_WRITE_BUFFER = 256 << 20
LEVELDB_BLOCK = 64 << 10


class LevelDBWriter(DatumWriter):
    def __init__(self, path: str | os.PathLike, error: ErrorType = DataError,
                 transact: Callable[[DatumWriter, Records], None] | None = None):
        plyvel_module()  # before any folder is made
        super().__init__(path, error, transact)

    def _open(self) -> None:
        plyvel = plyvel_module()
        try:
            self._db = plyvel.DB(self.path, create_if_missing=True, error_if_exists=True,
                                 write_buffer_size=LEVELDB_WRITE_BUFFER,
                                 block_size=LEVELDB_BLOCK)
        except plyvel.Error as e:
            raise self.error(f"{self.path}: cannot open the leveldb: {message(e)}") from None

    def write(self, records: Records) -> None:
        plyvel = plyvel_module()
        try:
            with self._db.write_batch(transaction=True) as batch:
                for k, v in records:
                    batch.put(k, v)
        except plyvel.Error as e:
            raise self.error(f"{self.path}: writing the leveldb failed: {message(e)}") from None

    def _close(self) -> None:
        if getattr(self, "_db", None) is not None:
            self._db.close()
        self._db = None


class LevelDB(Backend):
    name, kind, article, layout = "leveldb", "LevelDB", "a LevelDB", "a folder with CURRENT"
    enum = pb.DataParameter.LEVELDB
    source_class, writer_class = LevelDBSource, LevelDBWriter

    def detect(self, path: str) -> bool:
        return os.path.isfile(os.path.join(path, "CURRENT"))  # names the manifest

    def walk(self, path: str, error: ErrorType = DataError) -> Iterator[tuple[bytes, bytes]]:
        plyvel = plyvel_module()
        try:
            db = plyvel.DB(path, create_if_missing=False)
        except plyvel.Error as e:
            raise error(f"{path}: cannot open the leveldb: {message(e)}") from None
        try:
            yield from db
        except plyvel.Error as e:  # a damaged table found while walking it
            raise error(f"{path}: cannot read the leveldb: {message(e)}") from None
        finally:
            db.close()


register(LMDB())
register(LevelDB())
