"""Caffe's HDF5 snapshot layout (snapshot_format: HDF5): ``.caffemodel.h5`` holds
``data/<layer>/<i>`` datasets, ``.solverstate.h5`` holds ``iter``, ``learned_net``,
``current_step`` and ``history/<i>``. Files are written atomically, and read (also HDF5Data's
sources) by one validated reader, H5Reader: links, types and shapes are checked before a
value is read, and what h5py raises on a damaged file becomes one line naming the file and
the object. h5py is the optional extra ``purine-caffe[hdf5]``."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NoReturn

import numpy as np

from purine.errors import ProtoError, PurineError
from purine.formats.caffemodel import atomic_file, shape_problem

INSTALL_HINT = "pip install purine-caffe[hdf5]"
# A dataset Caffe's reader never opens: the run-time state Caffe's SolverState has no place
# for (random streams, data cursors), as JSON, so a resume from .h5 is bit-identical.
PRIVATE_DATASET = "purine_state"
_SIGNATURE = b"\x89HDF\r\n\x1a\n"
H5_ERRORS = (RuntimeError, ValueError, TypeError, KeyError, IndexError, OverflowError, OSError)
"""What h5py raises on a damaged or hostile file: HDF5's error stack as RuntimeError, OSError
or KeyError, a type numpy cannot hold as ValueError or TypeError ("insufficient precision",
"unknown string encoding"), a name that is not UTF-8 as a TypeError further on."""


def h5py_module(what: str) -> ModuleType:
    """h5py, or an error saying that ``what`` needs it and how to install it."""
    try:
        import h5py
    except ImportError:
        raise PurineError(f"{what} needs the h5py package: {INSTALL_HINT}") from None
    return h5py


def have_h5py() -> bool:
    try:
        import h5py  # noqa: F401
    except ImportError:
        return False
    return True


def is_hdf5(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an HDF5 file, by its signature (the test Caffe's
    CopyTrainedLayersFrom makes); the superblock sits at byte 0 or at 512 * 2^k."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            offset = 0
            while offset + len(_SIGNATURE) <= size:
                f.seek(offset)
                if f.read(len(_SIGNATURE)) == _SIGNATURE:
                    return True
                offset = 512 if offset == 0 else offset * 2
    except OSError:
        return False  # the binary reader reports the file
    return False


# -- the validated reader ------------------------------------------------------------------
def hdf5_reason(e: BaseException) -> str:
    """h5py's text, shortened to HDF5's own reason (the last parenthesis of its message)."""
    if isinstance(e, OSError) and e.errno:  # a file that is missing or unreadable
        return os.strerror(e.errno)
    text = str(e.args[0]) if e.args else type(e).__name__
    if isinstance(e, RuntimeError | OSError | KeyError):
        m = re.search(r"\(([^()]*)\)\s*$", text)
        text = m.group(1) if m else text
    if "too many links" in text:
        return "a soft or external link that loops (too many links)"
    return f"damaged or not supported ({text})"


class H5Reader:
    """Checked access to an HDF5 file: every failure, ours or one h5py raises, is one
    ``error`` line that starts with ``prefix`` (the file) and names the object (``at``, its
    path in the file). Nothing is read before its link, type class and shape are checked."""

    def __init__(self, h5py: ModuleType, prefix: str,
                 error: type[PurineError] = ProtoError):
        self.h5py, self.prefix, self.error = h5py, prefix, error

    def fail(self, text: str) -> NoReturn:
        raise self.error(f"{self.prefix}: {text}")

    @contextmanager
    def guard(self, at: str) -> Iterator[None]:
        """h5py calls on object ``at``: its exceptions become our one line."""
        try:
            yield
        except H5_ERRORS as e:
            self.fail(f"'{at}' cannot be read: {hdf5_reason(e)}")

    def open(self, path: str) -> Any:
        try:
            return self.h5py.File(path, "r")
        except H5_ERRORS as e:
            self.fail(f"cannot be read as HDF5: {hdf5_reason(e)}")

    def names(self, group: Any, at: str) -> list[str]:
        """The link names of ``group`` (h5py hands a name that is not UTF-8 over as bytes,
        which no Caffe name is)."""
        with self.guard(at or "/"):
            names = list(group)
        for n in names:
            if not isinstance(n, str):
                self.fail(f"'{at or '/'}' holds a link named {n!r}; expected UTF-8 names")
        return names

    def member(self, group: Any, name: str, at: str, want: str) -> Any:
        """The object at link ``name`` of ``group``, or None where there is no such link; a
        link that leads nowhere is an error (``want``: what it should lead to)."""
        with self.guard(at):
            link = group.get(name, getlink=True)
            if link is None:
                return None
            obj = group.get(name)  # None for a dangling link, where group[name] raises
        if obj is None:
            if isinstance(link, self.h5py.ExternalLink):
                self.fail(f"'{at}' is an external link to '{link.path}' in '{link.filename}', "
                          f"which cannot be opened; expected {want}")
            self.fail(f"'{at}' is missing (a dangling link); expected {want}")
        return obj

    def dataset(self, group: Any, name: str, at: str) -> Any:
        """Dataset ``name`` of ``group``: a missing one, a group or a dangling link is an
        error naming it."""
        obj = self.member(group, name, at, "a dataset")
        if not isinstance(obj, self.h5py.Dataset):
            what = ("missing" if obj is None else "a group" if isinstance(obj, self.h5py.Group)
                    else f"a {type(obj).__name__}")
            self.fail(f"'{at}' is {what}; expected a dataset")
        return obj

    def numbers(self, ds: Any, at: str, want: tuple[int, ...] | None = None,
                what: str = "") -> tuple[int, ...]:
        """The shape of numeric dataset ``ds``, checked without reading a value: integer or
        float type class (Caffe's rule: no compound, string, vlen, enum, array ...), a real
        dataspace of a blob's shape (``want`` where given: ``what`` is then the name of what
        needs it), and every value (every chunk) stored in the file."""
        h5t = self.h5py.h5t
        with self.guard(at):
            cls = ds.id.get_type().get_class()
            shape = ds.shape
            if cls in (h5t.INTEGER, h5t.FLOAT):
                itemsize = ds.dtype.itemsize  # ValueError for a float numpy cannot hold
        if cls not in (h5t.INTEGER, h5t.FLOAT):
            self.fail(f"dataset '/{at}' holds {_CLASSES.get(cls, f'type class {cls}')}; "
                      "expected integers or floats")
        if shape is None:  # h5py's Empty: a null dataspace, no values at all
            self.fail(f"dataset '/{at}' has a null dataspace; expected an array")
        shape = tuple(int(d) for d in shape)
        problem = shape_problem(shape)
        if problem:
            self.fail(f"dataset '/{at}' {problem}")
        if want is not None and shape != tuple(want):
            self.fail(f"{what} has shape {shape} in the file, the net expects {tuple(want)}")
        with self.guard(at):
            chunks = ds.chunks
            have = ds.id.get_num_chunks() if chunks else ds.id.get_storage_size()
        # A chunk never written reads as the fill value: a file of a few kilobytes could
        # declare gigabytes. Caffe and h5py write every value of the arrays they save.
        if chunks:
            need = math.prod(-(-d // c) for d, c in zip(shape, chunks))
            if have < need:
                self.fail(f"dataset '/{at}' of shape {shape} is stored in {need} chunks, the "
                          f"file holds {have} of them; expected every value written")
        elif have < math.prod(shape) * itemsize:
            self.fail(f"dataset '/{at}' of shape {shape} needs {math.prod(shape) * itemsize} "
                      f"bytes, the file stores {have} of them; expected every value written")
        return shape

    def read(self, ds: Any, at: str) -> np.ndarray:
        """The values of a dataset ``numbers`` has checked."""
        with self.guard(at):
            try:
                return np.asarray(ds[()])
            except MemoryError:  # a compressed dataset larger than this machine's memory
                self.fail(f"dataset '/{at}' of shape {ds.shape} does not fit in memory")


def _class_names() -> dict[int, str]:
    try:
        from h5py import h5t
    except ImportError:
        return {}
    names = {"COMPOUND": "compound values", "STRING": "strings", "VLEN":
             "variable-length sequences", "ENUM": "enumerated values (h5py's booleans)",
             "ARRAY": "fixed-size arrays", "REFERENCE": "object references",
             "OPAQUE": "opaque bytes", "BITFIELD": "bit fields", "TIME": "times",
             "COMPLEX": "complex numbers"}
    return {getattr(h5t, k): v for k, v in names.items() if hasattr(h5t, k)}


_CLASSES = _class_names()


def _save_string(h5py: ModuleType, group, name: str, text: str) -> None:
    """A scalar NUL-terminated fixed-length string, the type Caffe's hdf5_save_string
    writes (its reader sizes a buffer from the type and expects the terminator)."""
    raw = text.encode()
    tid = h5py.h5t.C_S1.copy()
    tid.set_size(len(raw) + 1)
    tid.set_strpad(h5py.h5t.STR_NULLTERM)
    space = h5py.h5s.create(h5py.h5s.SCALAR)
    ds = h5py.h5d.create(group.id, name.encode(), tid, space)
    ds.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(raw, dtype=f"S{len(raw) + 1}"), mtype=tid)


def _load_string(r: H5Reader, f: Any, name: str) -> str:
    ds = r.dataset(f, name, name)
    with r.guard(name):
        cls, size, itemsize = ds.id.get_type().get_class(), ds.size, ds.id.get_type().get_size()
    if cls != r.h5py.h5t.STRING:
        r.fail(f"dataset '{name}' is not a string")
    if size != 1:  # None for a null dataspace
        r.fail(f"dataset '{name}' holds {size or 0} values; expected one string")
    if itemsize > _MAX_STRING:  # a fixed-length type of gigabytes would be allocated
        r.fail(f"dataset '{name}' is a string of {itemsize} bytes; expected at most "
               f"{_MAX_STRING}")
    value = r.read(ds, name)
    value = value.reshape(-1)[0] if value.ndim else value[()]  # a 1-element array too
    if not isinstance(value, bytes | str):
        r.fail(f"dataset '{name}' is not a string")
    try:
        return value.decode() if isinstance(value, bytes) else value
    except UnicodeDecodeError:
        r.fail(f"dataset '{name}' is not UTF-8 text")


_MAX_STRING = 1 << 30  # the private state's JSON holds data cursors and random streams


def _save_int(group, name: str, value: int) -> None:
    """A 1-element native int, as Caffe's hdf5_save_int."""
    group.create_dataset(name, data=np.array([value], dtype="<i4"))


def _load_int(r: H5Reader, f: Any, name: str) -> int:
    """A 1-element integer dataset (a float one holding a whole number also does), within
    int32, the type of Caffe's hdf5_load_int and of SolverState's fields."""
    if r.member(f, name, name, "a dataset") is None:
        r.fail(f"no dataset '{name}'; is it a Caffe .solverstate.h5?")
    ds = r.dataset(f, name, name)
    with r.guard(name):
        size, numeric = ds.size, ds.id.get_type().get_class() in (r.h5py.h5t.INTEGER,
                                                                   r.h5py.h5t.FLOAT)
    if size != 1 or not numeric:  # checked before the values are read
        r.fail(f"dataset '{name}' should hold one integer, found {_describe(r, ds, name)}")
    r.numbers(ds, name)
    v = r.read(ds, name).reshape(-1)[0]
    if not (np.isfinite(v) and v == int(v) and -2**31 <= int(v) < 2**31):
        r.fail(f"dataset '{name}' holds {v}; expected an integer in the 32-bit range")
    return int(v)


def _describe(r: H5Reader, ds: Any, name: str) -> str:
    with r.guard(name):
        cls, shape = ds.id.get_type().get_class(), ds.shape
    kind = {r.h5py.h5t.INTEGER: "integers", r.h5py.h5t.FLOAT: "floats"}.get(
        cls, _CLASSES.get(cls, f"type class {cls}"))
    return f"{kind} of shape {shape}"


def _float_array(a: np.ndarray) -> np.ndarray:
    """A blob as Caffe's float and double nets write it: in its own precision (a float16 or
    integer array, which no Caffe blob holds, as float32), little-endian."""
    a = np.asarray(a)
    dtype = a.dtype if a.dtype in (np.float32, np.float64) else np.dtype(np.float32)
    return np.asarray(a, dtype=dtype.newbyteorder("<"))


def _load_array(r: H5Reader, ds: Any, at: str, want: tuple[int, ...] | None = None,
                what: str = "") -> np.ndarray:
    """A dataset in the precision it was written in (integer classes, which Caffe's reader
    also accepts, as float64): assigning it to a blob converts it to the blob's dtype, as
    Caffe's reader converts to its net's. Type and shape (``want``, where given) are checked
    before any value is read."""
    r.numbers(ds, at, want, what)
    a = r.read(ds, at)
    return a if a.dtype.kind == "f" else a.astype(np.float64)


def _open_caffe_file(r: H5Reader, path: str, group: str, kind: str) -> Any:
    """``path`` opened for reading, once it is seen to hold the top-level ``group`` that
    every Caffe ``kind`` file has."""
    f = r.open(path)
    try:
        if not isinstance(r.member(f, group, group, "a group"), r.h5py.Group):
            r.fail(f"no group '{group}'; is it a Caffe {kind}?")
    except PurineError:
        f.close()
        raise
    return f


# -- .caffemodel.h5 ------------------------------------------------------------------------
def write_weights(path: str | os.PathLike,
                  layers: Sequence[tuple[str, Sequence[np.ndarray | None]]]) -> None:
    """Caffe's Net::ToHDF5 without diffs: a group ``data/<layer>`` per layer, in net order,
    with dataset ``<i>`` per parameter blob in its shape; None marks a blob the layer
    shares from another, which only its owner writes."""
    h5py = h5py_module(f"writing {os.fspath(path)}")
    with atomic_file(path) as tmp, h5py.File(tmp, "w") as f:
        data = f.create_group("data")
        for name, blobs in layers:
            group = data.create_group(name)
            for i, a in enumerate(blobs):
                if a is not None:
                    group.create_dataset(str(i), data=_float_array(a))


def read_weights(path: str | os.PathLike,
                 expect: Mapping[str, Sequence[tuple[int, ...]]] | None = None
                 ) -> dict[str, dict[str, np.ndarray]]:
    """``data/<layer>/<dataset>`` arrays by layer name and dataset name. With ``expect``,
    the parameter shapes of the net's layers by name, each dataset is checked against its
    parameter before any value is read, as Caffe's CopyTrainedLayersFromHDF5 checks: a layer
    with more datasets than parameters, or a dataset ``<k>`` of another shape than parameter
    k, is refused; a layer ``expect`` does not name is listed with no datasets, unread, and
    so are datasets not named 0 .. n-1."""
    path = os.fspath(path)
    r = H5Reader(h5py_module(f"reading {path}"), path)
    with _open_caffe_file(r, path, "data", ".caffemodel.h5") as f:
        out: dict[str, dict[str, np.ndarray]] = {}
        data = r.member(f, "data", "data", "a group")
        for name in r.names(data, "data"):
            group = r.member(data, name, f"data/{name}", "a layer group")
            if not isinstance(group, r.h5py.Group):
                r.fail(f"data/{name} is not a layer group")
            if expect is not None and name not in expect:
                out[name] = {}
                continue
            keys = r.names(group, f"data/{name}")
            if expect is None:
                out[name] = {k: _load_array(r, r.dataset(group, k, f"data/{name}/{k}"),
                                            f"data/{name}/{k}") for k in keys}
                continue
            shapes = expect[name]
            if len(keys) > len(shapes):
                r.fail(f"layer '{name}' has {len(keys)} datasets, the net expects at most "
                       f"{len(shapes)} parameter blobs")
            out[name] = {str(k): _load_array(r, r.dataset(group, str(k), f"data/{name}/{k}"),
                                             f"data/{name}/{k}", shape,
                                             f"layer '{name}' parameter {k}")
                         for k, shape in enumerate(shapes) if str(k) in keys}
        return out


# -- .solverstate.h5 -----------------------------------------------------------------------
@dataclass
class SolverStateH5:
    iter: int
    learned_net: str | None
    current_step: int
    history: list[np.ndarray]
    private: str | None  # our JSON, absent from Caffe's files


def write_state(path: str | os.PathLike, state: SolverStateH5) -> None:
    """Caffe's SnapshotSolverStateToHDF5 layout, plus the private dataset."""
    h5py = h5py_module(f"writing {os.fspath(path)}")
    with atomic_file(path) as tmp, h5py.File(tmp, "w") as f:
        _save_int(f, "iter", state.iter)
        if state.learned_net is not None:
            _save_string(h5py, f, "learned_net", state.learned_net)
        _save_int(f, "current_step", state.current_step)
        history = f.create_group("history")
        for i, a in enumerate(state.history):
            history.create_dataset(str(i), data=_float_array(a))
        if state.private is not None:
            _save_string(h5py, f, PRIVATE_DATASET, state.private)


def read_state(path: str | os.PathLike,
               history: Sequence[tuple[str, tuple[int, ...]]] | None = None,
               solver: str = "the solver of this net") -> SolverStateH5:
    """The state in ``path``. With ``history``, the (name, shape) of the parameter each
    history dataset belongs to, their count and shapes are checked before a value is read
    (``solver`` names who needs them)."""
    path = os.fspath(path)
    r = H5Reader(h5py_module(f"reading {path}"), path)
    with _open_caffe_file(r, path, "history", ".solverstate.h5") as f:
        group = r.member(f, "history", "history", "a group")
        names = sorted(r.names(group, "history"),
                       key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
        if names != [str(i) for i in range(len(names))]:
            r.fail(f"history datasets should be named 0..{len(names) - 1}, found "
                   f"{', '.join(names)}")
        if history is not None and len(names) != len(history):
            r.fail(f"{len(names)} history datasets, {solver} needs {len(history)}")
        # The counters first: a file whose iteration is wrong is refused before its history
        # is read.
        it, step = _load_int(r, f, "iter"), _load_int(r, f, "current_step")
        learned = (_load_string(r, f, "learned_net")
                   if r.member(f, "learned_net", "learned_net", "a dataset") is not None
                   else None)
        arrays = []
        for k in names:
            ds = r.dataset(group, k, f"history/{k}")
            if history is None:
                arrays.append(_load_array(r, ds, f"history/{k}"))
            else:
                param, shape = history[int(k)]
                arrays.append(_load_array(r, ds, f"history/{k}", shape,
                                          f"history/{k} (of parameter '{param}')"))
        private = (_load_string(r, f, PRIVATE_DATASET)
                   if r.member(f, PRIVATE_DATASET, PRIVATE_DATASET, "a dataset") is not None
                   else None)
        return SolverStateH5(iter=it, learned_net=learned, current_step=step,
                             history=arrays, private=private)


def read_private(path: str | os.PathLike) -> str | None:
    """Only the private dataset (None without h5py, for a file that lacks it, and for one
    that cannot be read: the restore reports that file)."""
    if not have_h5py():
        return None
    path = os.fspath(path)
    r = H5Reader(h5py_module(f"reading {path}"), path)
    try:
        with r.open(path) as f:
            if r.member(f, PRIVATE_DATASET, PRIVATE_DATASET, "a dataset") is None:
                return None
            return _load_string(r, f, PRIVATE_DATASET)
    except PurineError:
        return None
