"""The HDF5Data layer's source: a list of .h5 files whose datasets are named like the layer's
tops; rows are read file after file (in a new random file order and row order every epoch
when shuffling), a whole file loaded at a time, as Caffe's HDF5DataLayer does. Also the
HDF5Output layer's file, which holds the batch of one forward pass."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from purine.backend import to_host
from purine.data import DataError
from purine.data.prefetch import Batch, BufferPool, stream_batch
from purine.formats.files import read_bounded_text
from purine.formats.hdf5_snapshot import H5_ERRORS, H5Reader, hdf5_reason

_SHUFFLE = 0x5E1F


def h5py_module(layer: str = "HDF5Data") -> ModuleType:
    try:
        import h5py
    except ImportError:
        raise DataError(f"{layer} needs the h5py package: pip install purine-caffe[hdf5]"
                        ) from None
    return h5py


def read_file_list(source: str | os.PathLike) -> list[str]:
    """The whitespace-separated file names of a list file; a relative name is taken from
    the working directory, as Caffe does, else from the list file's directory."""
    source = os.fspath(source)
    names = read_bounded_text(source, what="the HDF5 list", error=DataError).split()
    if not names:
        raise DataError(f"HDF5 list '{source}' lists no files")
    base = os.path.dirname(source)
    return [n if os.path.isabs(n) or os.path.exists(n) or not os.path.exists(
        os.path.join(base, n)) else os.path.join(base, n) for n in names]


class HDF5Source:
    """The files of one HDF5Data layer, checked when the net is built (before iteration 0):
    every file has a dataset per top, of integers or floats (Caffe's rule) with at least one
    axis and every value stored, with one row count across the tops and the first file's row
    shape. Links that loop or lead to a missing file are refused here too."""

    def __init__(self, source: str | os.PathLike, tops: Sequence[str], *, shuffle: bool,
                 dtype: str, seed: int = 0, index: int = 0):
        self.h5py = h5py_module()
        self.source, self.tops = os.fspath(source), list(tops)
        self.files = read_file_list(self.source)
        self.shuffle, self.dtype, self.seed, self.index = shuffle, np.dtype(dtype), seed, index
        self.rows: list[int] = []
        self.row_shapes: list[tuple[int, ...]] = []
        for path in self.files:
            r = self._reader(path)
            with self._open(r, path) as f:
                shapes = [self._shape(r, f, path, t) for t in self.tops]
            n = shapes[0][0]
            for t, s in zip(self.tops, shapes):
                if s[0] != n:
                    raise DataError(f"HDF5 file '{path}': dataset '{t}' has {s[0]} rows, "
                                    f"dataset '{self.tops[0]}' has {n}")
            if n == 0:
                raise DataError(f"HDF5 file '{path}' has no rows")
            if self.row_shapes:
                for t, s, want in zip(self.tops, shapes, self.row_shapes):
                    if s[1:] != want:
                        raise DataError(f"HDF5 file '{path}': dataset '{t}' rows are {s[1:]}, "
                                        f"in '{self.files[0]}' they are {want}")
            else:
                self.row_shapes = [s[1:] for s in shapes]
            self.rows.append(n)
        self.total = sum(self.rows)

    def _reader(self, path: str) -> H5Reader:
        return H5Reader(self.h5py, f"HDF5 file '{path}' (listed in '{self.source}')", DataError)

    @staticmethod
    def _open(r: H5Reader, path: str) -> Any:
        try:
            return r.h5py.File(path, "r")
        except H5_ERRORS as e:
            r.fail(f"cannot be read: {hdf5_reason(e)}")

    def _shape(self, r: H5Reader, f: Any, path: str, top: str) -> tuple[int, ...]:
        """The checked shape of the dataset for ``top``, read from its header only."""
        if r.member(f, top, top, "a dataset") is None:
            r.fail(f"has no dataset '{top}' for top '{top}'")
        shape = r.numbers(r.dataset(f, top, top), top)
        if not shape:
            raise DataError(f"HDF5 file '{path}': dataset '{top}' is a scalar; it needs at "
                            "least 1 axis")
        return shape

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.files))
        return np.random.default_rng([self.seed, self.index, _SHUFFLE, epoch]).permutation(
            len(self.files))

    def _row_perm(self, epoch: int, f: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.index, _SHUFFLE, epoch, f])
        return rng.permutation(self.rows[f])

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file index, row) of each stream position."""
        files = np.empty(len(positions), np.int64)
        rows = np.empty(len(positions), np.int64)
        epochs, offsets = np.divmod(positions, self.total)
        for e in np.unique(epochs):
            sel = epochs == e
            order = self._order(int(e))
            ends = np.cumsum(np.asarray(self.rows)[order])
            slot = np.searchsorted(ends, offsets[sel], side="right")
            files[sel] = order[slot]
            rows[sel] = offsets[sel] - (ends[slot] - np.asarray(self.rows)[order[slot]])
            if self.shuffle:
                for f in np.unique(files[sel]):
                    both = sel & (files == f)
                    rows[both] = self._row_perm(int(e), int(f))[rows[both]]
        return files, rows

    def load(self, f: int) -> list[np.ndarray]:
        """File ``f``'s datasets, whole, in the net's dtype; checked again (a file may have
        changed since the net was built), and the rows it had then."""
        path = self.files[f]
        r = self._reader(path)
        out = []
        with self._open(r, path) as h:
            for t, rows in zip(self.tops, self.row_shapes):
                ds = r.dataset(h, t, t)
                if r.numbers(ds, t) != (self.rows[f],) + rows:
                    r.fail(f"dataset '{t}' has changed shape since the net was built")
                with np.errstate(over="ignore"):  # float64 past float32's range: inf
                    out.append(r.read(ds, t).astype(self.dtype, copy=False))
        return out


class HDF5Batches:
    """Batch k of replica r of R holds stream positions [(k*R + r)*batch_size, ...)."""

    def __init__(self, source: HDF5Source, batch_size: int,
                 replica: tuple[int, int] = (0, 1)):
        self.source, self.batch_size, self.replica = source, batch_size, replica

    def reader(self, pool: BufferPool | None = None) -> Callable[[int], Batch]:
        cache: dict[int, list[np.ndarray]] = {}
        pool = pool or BufferPool(0)

        def read(k: int) -> Batch:
            first = stream_batch(k, self.replica) * self.batch_size
            files, rows = self.source.locate(first + np.arange(self.batch_size))
            outs = [pool.array((self.batch_size,) + s, self.source.dtype)
                    for s in self.source.row_shapes]
            for f in dict.fromkeys(files.tolist()):  # in the order the batch reaches them
                if f not in cache:
                    cache.clear()  # one file in memory at a time, as in Caffe
                    cache[f] = self.source.load(f)
                sel = files == f
                for out, data in zip(outs, cache[f]):
                    out[sel] = data[rows[sel]]
            return tuple(outs)

        return read


class HDF5Output:
    """The HDF5Output layer's file, created (emptied if it exists) when the net is built.
    A forward pass writes its bottoms as datasets "data" and "label" of the net's dtype,
    each padded to Caffe's 4 legacy axes (num, channels, height, width). Caffe creates
    the datasets anew at every forward pass, which fails once they exist: a file holds
    one batch, and a second forward pass is an error here too."""

    DATA, LABEL = "data", "label"

    def __init__(self, path: str | os.PathLike):
        self.h5py = h5py_module("HDF5Output")
        self.path = os.fspath(path)
        try:
            self.h5py.File(self.path, "w").close()
        except OSError as e:
            raise DataError(f"HDF5 output file '{self.path}' cannot be created: {e}") from None

    def write(self, data: np.ndarray, label: np.ndarray) -> None:
        try:
            with self.h5py.File(self.path, "r+") as f:
                if self.DATA in f or self.LABEL in f:
                    raise DataError(
                        f"HDF5 output file '{self.path}' already holds the datasets '{self.DATA}'"
                        f" and '{self.LABEL}' of an earlier forward pass; as in Caffe, the file "
                        "takes one batch (rebuild the net to write another)")
                for name, value in ((self.DATA, data), (self.LABEL, label)):
                    value = to_host(value)
                    f.create_dataset(name, data=value.reshape(legacy_shape(value.shape)))
        except OSError as e:
            raise DataError(f"HDF5 output file '{self.path}' cannot be written: {e}") from None


def legacy_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """A shape of at most 4 axes as Caffe's (num, channels, height, width), 1 past its axes."""
    return tuple(shape) + (1,) * (4 - len(shape))


def write_output(data: np.ndarray, label: np.ndarray, *, output: HDF5Output) -> None:
    """The HDF5Output layer's forward kernel."""
    output.write(data, label)
