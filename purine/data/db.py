"""The two database kinds Caffe's data layers and tools read and write, LMDB and LevelDB:
which one a path holds (by the files each keeps) and opening a Datum source of either."""

from __future__ import annotations

import os

from purine.data import DataError
from purine.data.leveldb_source import LevelDBSource
from purine.data.lmdb_source import LMDBSource

BACKENDS = ("lmdb", "leveldb")
"""Caffe's names (the tools' --backend, DataParameter.DB in lower case)."""


def detect(path: str | os.PathLike) -> str | None:
    """"lmdb" (a data.mdb in the folder, or a single-file LMDB), "leveldb" (a CURRENT file
    naming its manifest) or None when the path holds neither."""
    path = os.fspath(path)
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "data.mdb")):
        return "lmdb"
    if os.path.isfile(os.path.join(path, "CURRENT")):
        return "leveldb"
    return None


def open_source(path: str | os.PathLike, backend: str) -> LMDBSource | LevelDBSource:
    """A Datum source of ``backend`` ("lmdb" or "leveldb")."""
    if backend == "lmdb":
        return LMDBSource(path)
    if backend == "leveldb":
        return LevelDBSource(path)
    raise DataError(f"unknown database backend '{backend}'; expected lmdb or leveldb")

