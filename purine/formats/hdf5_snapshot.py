"""Caffe's HDF5 snapshot layout (snapshot_format: HDF5): ``.caffemodel.h5`` holds
``data/<layer>/<i>`` datasets, ``.solverstate.h5`` holds ``iter``, ``learned_net``,
``current_step`` and ``history/<i>``. Files are written atomically; h5py is the optional extra
``purine-caffe[hdf5]``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from purine.errors import ProtoError, PurineError
from purine.formats.caffemodel import atomic_file, shape_problem

INSTALL_HINT = "pip install purine-caffe[hdf5]"
# A dataset Caffe's reader never opens: the run-time state Caffe's SolverState has no place
# for (random streams, data cursors), as JSON, so a resume from .h5 is bit-identical.
PRIVATE_DATASET = "purine_state"
_SIGNATURE = b"\x89HDF\r\n\x1a\n"


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


def _dataset(path: str, group, name: str):
    """Dataset ``name`` of ``group``: a group, a dangling link or anything else there is an
    error naming it."""
    import h5py

    obj = group.get(name)  # None for a missing or dangling link, where group[name] raises
    if not isinstance(obj, h5py.Dataset):
        what = ("missing (a dangling link)" if obj is None else
                "a group" if isinstance(obj, h5py.Group) else f"a {type(obj).__name__}")
        raise ProtoError(f"{path}: '{_full_name(group, name)}' is {what}; expected a dataset")
    return obj


def _full_name(group, name: str) -> str:
    return f"{group.name.rstrip('/')}/{name}".lstrip("/")


def _load_string(path: str, f, name: str) -> str:
    ds = _dataset(path, f, name)
    if ds.size != 1:  # None for a null dataspace
        raise ProtoError(f"{path}: dataset '{name}' holds {ds.size or 0} values; expected one "
                         "string")
    value = ds[()]
    if isinstance(value, np.ndarray):  # a 1-element array instead of a scalar
        value = value.reshape(-1)[0]
    if not isinstance(value, bytes | str):
        raise ProtoError(f"{path}: dataset '{name}' is not a string")
    try:
        return value.decode() if isinstance(value, bytes) else value
    except UnicodeDecodeError:
        raise ProtoError(f"{path}: dataset '{name}' is not UTF-8 text") from None


def _save_int(group, name: str, value: int) -> None:
    """A 1-element native int, as Caffe's hdf5_save_int."""
    group.create_dataset(name, data=np.array([value], dtype="<i4"))


def _load_int(path: str, f, name: str) -> int:
    """A 1-element integer dataset (a float one holding a whole number also does), within
    int32, the type of Caffe's hdf5_load_int and of SolverState's fields."""
    if name not in f:
        raise ProtoError(f"{path}: no dataset '{name}'; is it a Caffe .solverstate.h5?")
    ds = _dataset(path, f, name)
    if ds.size != 1 or ds.dtype.kind not in "iuf":  # checked before the values are read
        raise ProtoError(f"{path}: dataset '{name}' should hold one integer, found "
                         f"{ds.dtype} of shape {ds.shape}")
    v = np.asarray(ds[()]).reshape(-1)[0]
    if not (np.isfinite(v) and v == int(v) and -2**31 <= int(v) < 2**31):
        raise ProtoError(f"{path}: dataset '{name}' holds {v}; expected an integer in the "
                         "32-bit range")
    return int(v)


def _float_array(a: np.ndarray) -> np.ndarray:
    """A blob as Caffe's float and double nets write it: in its own precision (a float16 or
    integer array, which no Caffe blob holds, as float32), little-endian."""
    a = np.asarray(a)
    dtype = a.dtype if a.dtype in (np.float32, np.float64) else np.dtype(np.float32)
    return np.asarray(a, dtype=dtype.newbyteorder("<"))


def _load_array(path: str, ds) -> np.ndarray:
    """A dataset in the precision it was written in (integer classes, which Caffe's reader
    also accepts, as float64): assigning it to a blob converts it to the blob's dtype, as
    Caffe's reader converts to its net's. Type and shape are checked before any value is
    read, by the rules of the BlobProto reader (shape_problem)."""
    if ds.dtype.kind not in "iuf":
        raise ProtoError(f"{path}: dataset '{ds.name}' holds {ds.dtype}; expected numbers")
    if ds.shape is None:  # h5py's Empty: a null dataspace, no values at all
        raise ProtoError(f"{path}: dataset '{ds.name}' has a null dataspace; expected an array")
    problem = shape_problem(ds.shape)
    if problem:
        raise ProtoError(f"{path}: dataset '{ds.name}' {problem}")
    try:
        a = np.asarray(ds[()])
    except (OSError, MemoryError) as e:  # damaged storage, or more than this machine has
        raise ProtoError(f"{path}: dataset '{ds.name}' cannot be read: {e}") from None
    return a if a.dtype.kind == "f" else a.astype(np.float64)


def _open_caffe_file(h5py: ModuleType, path: str, group: str, kind: str):
    """``path`` opened for reading, once it is seen to hold the top-level ``group`` that
    every Caffe ``kind`` file has."""
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise ProtoError(f"{path}: cannot read as HDF5: {e}") from None
    if not isinstance(f.get(group), h5py.Group):
        f.close()
        raise ProtoError(f"{path}: no group '{group}'; is it a Caffe {kind}?")
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


def read_weights(path: str | os.PathLike) -> dict[str, dict[str, np.ndarray]]:
    """``data/<layer>/<dataset>`` arrays by layer name and dataset name."""
    path = os.fspath(path)
    h5py = h5py_module(f"reading {path}")
    with _open_caffe_file(h5py, path, "data", ".caffemodel.h5") as f:
        out: dict[str, dict[str, np.ndarray]] = {}
        data = f["data"]
        for name in data:
            group = data.get(name)
            if not isinstance(group, h5py.Group):
                raise ProtoError(f"{path}: data/{name} is not a layer group")
            out[name] = {k: _load_array(path, _dataset(path, group, k)) for k in group}
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


def read_state(path: str | os.PathLike) -> SolverStateH5:
    path = os.fspath(path)
    h5py = h5py_module(f"reading {path}")
    with _open_caffe_file(h5py, path, "history", ".solverstate.h5") as f:
        group = f["history"]
        names = sorted(group, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
        if names != [str(i) for i in range(len(names))]:
            raise ProtoError(f"{path}: history datasets should be named 0..{len(names) - 1}, "
                             f"found {', '.join(names)}")
        return SolverStateH5(
            iter=_load_int(path, f, "iter"),
            learned_net=_load_string(path, f, "learned_net") if "learned_net" in f else None,
            current_step=_load_int(path, f, "current_step"),
            history=[_load_array(path, _dataset(path, group, k)) for k in names],
            private=(_load_string(path, f, PRIVATE_DATASET) if PRIVATE_DATASET in f
                     else None))


def read_private(path: str | os.PathLike) -> str | None:
    """Only the private dataset (None without h5py or for a file that lacks it)."""
    if not have_h5py():
        return None
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return _load_string(os.fspath(path), f, PRIVATE_DATASET) \
                if PRIVATE_DATASET in f else None
    except (OSError, ProtoError):
        return None
