"""Fuzzing HDF5 files: a small net's .caffemodel.h5, a solver's .solverstate.h5 and an HDF5Data
source, mutated in their structure with h5py (links removed, renamed, doubled as hard links,
soft links that loop or dangle, external links, datasets of other types, huge chunked or
sparse datasets never written, attributes) and in their bytes, then read by read_weights,
Net.copy_from, read_state and an HDF5Data source's first batches."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from purine.caffe import TEST, Net
from purine.data.hdf5 import HDF5Batches, HDF5Source
from purine.formats.hdf5_snapshot import (
    SolverStateH5,
    read_private,
    read_state,
    read_weights,
    write_state,
)
from tests.fuzz.harness import Draw, check, counted, mutated_bytes, share

NET = """name: "small"
layer { name: "data" type: "Input" top: "data"
  input_param { shape { dim: 2 dim: 2 dim: 5 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
"""
SEED_DIR = Path(tempfile.mkdtemp(prefix="purine-fuzz-hdf5-"))
OTHER = SEED_DIR / "other.h5"  # the target of external links that resolve
CASES = {k: SEED_DIR / f"case.{k}.h5" for k in ("caffemodel", "solverstate", "data")}


def seeds() -> dict[str, bytes]:
    """The three seed files' bytes: the small net's weights, a solver state, a data file."""
    with Net(NET, phase=TEST) as n:
        n.save_hdf5(SEED_DIR / "seed.caffemodel.h5")
    write_state(SEED_DIR / "seed.solverstate.h5", SolverStateH5(
        iter=4, learned_net=str(SEED_DIR / "seed.caffemodel.h5"), current_step=0,
        history=[np.ones((3, 2, 3, 3), "<f4"), np.ones(3, "<f4")], private='{"seed": 1}'))
    with h5py.File(SEED_DIR / "seed.data.h5", "w") as f:
        f["data"] = np.arange(5 * 3, dtype="<f4").reshape(5, 3)
        f["label"] = np.arange(5, dtype="<f8")
    with h5py.File(OTHER, "w") as f:
        f["w"] = np.ones((3, 2, 3, 3), "<f4")
        f["g/0"] = np.zeros(4, "<f4")
    return {k: (SEED_DIR / f"seed.{k}.h5").read_bytes()
            for k in ("caffemodel", "solverstate", "data")}


SEEDS = seeds()


def objects(data: bytes) -> list[str]:
    """The paths of every group and dataset in a seed."""
    found: list[str] = []
    path = SEED_DIR / "scan.h5"
    path.write_bytes(data)
    with h5py.File(path, "r") as f:
        f.visit(found.append)
    return found


OBJECTS = {k: objects(v) for k, v in SEEDS.items()}
NAMES = ("0", "1", "2", "x", "data", "label", "history", "iter", "conv", "ip", "learned_net",
         "purine_state", "current_step")
HUGE = (2**28, 2**31 - 1, 2**31, 2**32 + 1, 2**40, 2**41, 2**62)
DTYPES = ("<i4", "<u1", "<i8", "<f2", ">f4", ">f8", "bool", "compound", "string", "vlen",
          "S4", "array", "enum")


def _dtype(name: str) -> np.dtype:
    return {"compound": np.dtype([("a", "<f4"), ("b", "<i2")]), "string": h5py.string_dtype(),
            "vlen": h5py.vlen_dtype("<f4"), "array": np.dtype("(2,)<f4"),
            "enum": h5py.enum_dtype({"a": 0, "b": 1}, basetype="i1")}.get(name, np.dtype(name))


def _parent(path: str) -> str:
    return path.rpartition("/")[0] or "/"


PICKS = 8  # the most choices one mutation makes


class Pick:
    """One mutation's choices, drawn beforehand: ``pick(options)`` takes the next number
    modulo the options' count, so a pool that the file's state shapes changes which option
    a number names, never what hypothesis draws."""

    def __init__(self, numbers: list[int]):
        self.numbers, self.used = numbers, 0

    def __call__(self, options: tuple | list) -> Any:
        n = self.numbers[self.used % len(self.numbers)]
        self.used += 1
        return options[n % len(options)]


def _remove(pick: Pick, f: h5py.File, pool: list[str]) -> None:
    del f[pick(pool)]


def _rename(pick: Pick, f: h5py.File, pool: list[str]) -> None:
    src = pick(pool)
    f.move(src, f"{_parent(src)}/{pick(NAMES)}")


def _hard_link(pick: Pick, f: h5py.File, pool: list[str]) -> None:
    """One object under a second name (a group linked into itself makes a cycle)."""
    src, dst = pick(pool), pick(pool)
    target = f[dst] if isinstance(f[dst], h5py.Group) else f[_parent(dst)]
    target[pick(NAMES)] = f[src]


def _soft_link(pick: Pick, f: h5py.File, pool: list[str]) -> None:
    """A dataset or group replaced by a soft link: to itself, to another object, to a
    link that leads back, or to nothing."""
    at = pick(pool)
    to = pick(["/" + at, "/nowhere", "/" + at + "/x"] + ["/" + p for p in pool])
    del f[at]
    f[at] = h5py.SoftLink(to)


def _external_link(pick: Pick, f: h5py.File, pool: list[str]) -> None:
    at = pick(pool)
    target = pick([(str(OTHER), "/w"), (str(OTHER), "/g"), (str(OTHER), "/nope"),
                   ("/nonexistent/x.h5", "/w"), ("{self}", "/" + at)])  # itself: a loop
    del f[at]
    f[at] = h5py.ExternalLink(target[0].replace("{self}", f.attrs["case"]), target[1])


def _datasets(f: h5py.File, pool: list[str]) -> list[str]:
    return [p for p in pool if isinstance(f.get(p), h5py.Dataset)] or pool


def _retype(pick: Pick, f: h5py.File, pool: list[str]) -> None:
    """A dataset of the same shape in another type (written where h5py can convert)."""
    at = pick(_datasets(f, pool))
    old = f[at]
    if not isinstance(old, h5py.Dataset):  # no dataset left to retype
        return
    shape = old.shape
    # An earlier _huge may have declared gigabytes: those are retyped empty.
    values = old[()] if shape is not None and old.size <= 4096 else None
    dtype = _dtype(pick(DTYPES))
    del f[at]
    ds = f.create_dataset(at, shape=shape, dtype=dtype)
    if dtype.kind in "iufb" and dtype.names is None and values is not None:
        ds[()] = np.asarray(values).astype(dtype)


def _huge(pick: Pick, f: h5py.File, pool: list[str]) -> None:
    """A chunked dataset of a huge declared shape, never written or with one chunk written,
    compressed or not; or a small one of another shape."""
    at = pick(_datasets(f, pool))
    n = pick(HUGE + (0, 1, 7, 12))
    shape = pick([(n,), (n, 3), (1, n), (2, 3, 3, 3)])
    chunks = tuple(max(1, min(d, 1024)) for d in shape)
    del f[at]
    ds = f.create_dataset(at, shape=shape, dtype="<f4", chunks=chunks,
                          compression=pick((None, "gzip")))
    if pick((False, True)) and 0 not in shape:
        ds[tuple(slice(0, c) for c in chunks)] = 1.0  # one chunk written: the rest are sparse


def _attribute(pick: Pick, f: h5py.File, pool: list[str]) -> None:
    obj = f[pick(pool)]
    obj.attrs[pick(NAMES)] = pick(
        (np.zeros(3), "text", np.bytes_(b"\xff"), 2**40))


def _group(pick: Pick, f: h5py.File, pool: list[str]) -> None:
    """A group where a dataset was, or a new empty group or dataset beside the others."""
    at = pick(pool)
    name = f"{_parent(at)}/{pick(NAMES)}"
    if pick((False, True)):
        del f[at]
        f.create_group(at)
    elif name.lstrip("/") not in f:
        f.create_dataset(name, data=np.zeros(pick((0, 1, 3)), "<f4"))


OPS = (_remove, _rename, _hard_link, _soft_link, _soft_link, _external_link, _retype, _retype,
       _huge, _huge, _attribute, _group)
# What building a mutation may raise (the mutation then is left out, not the case).
BUILD_ERRORS = (KeyError, ValueError, RuntimeError, OSError, TypeError)


@st.composite
def mutated_file(draw: Draw, kind: str) -> bytes:
    """Seed ``kind`` after 1..3 structure mutations, byte mutations, or both."""
    path = SEED_DIR / f"build-{kind}.h5"
    path.write_bytes(SEEDS[kind])
    for case in CASES.values():  # an external link to one must not see an earlier case
        case.unlink(missing_ok=True)
    how = draw(st.sampled_from(("structure", "structure", "bytes", "both")))
    if how != "bytes":
        pool = OBJECTS[kind]
        # Every choice is drawn before the file is touched: what a mutation finds in the
        # file (links resolved through HDF5's caches) must not change what is drawn, or
        # hypothesis's replay of a case draws differently and calls the strategy flaky.
        plans = draw(st.lists(st.tuples(st.sampled_from(OPS), st.lists(
            st.integers(0, 2**16), min_size=PICKS, max_size=PICKS)), min_size=1, max_size=3))
        with h5py.File(path, "a") as f:
            f.attrs["case"] = str(CASES[kind])  # where the case is read from
            for op, numbers in plans:
                try:
                    op(Pick(numbers), f, [p for p in pool if p in f] or pool)
                except BUILD_ERRORS:
                    pass
    data = path.read_bytes()
    if how != "structure":
        data = draw(mutated_bytes(data, max_ops=3))
    return data


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    with Net(NET, phase=TEST) as n:
        yield n


@share(0.1)
@given(data=mutated_file("caffemodel"))
@counted
def test_mutated_caffemodel_h5(net: Net, data: bytes) -> None:
    path = CASES["caffemodel"]
    path.write_bytes(data)
    check(lambda: read_weights(path), path)
    check(lambda: net.copy_from(path), path)


@share(0.1)
@given(data=mutated_file("solverstate"))
@counted
def test_mutated_solverstate_h5(data: bytes) -> None:
    path = CASES["solverstate"]
    path.write_bytes(data)
    check(lambda: read_state(path, [("w", (3, 2, 3, 3)), ("b", (3,))]), path)
    check(lambda: read_state(path), path)
    # What snapshot_seed asks first: never an error (the restore reports the file).
    assert read_private(path) is None or isinstance(read_private(path), str)


@share(0.1)
@given(data=mutated_file("data"))
@counted
def test_mutated_hdf5_data_source(data: bytes) -> None:
    path = CASES["data"]
    path.write_bytes(data)
    listed = SEED_DIR / "case.txt"
    listed.write_text(f"{path}\n")

    def run() -> None:
        source = HDF5Source(listed, ["data", "label"], shuffle=False, dtype="float32")
        read = HDF5Batches(source, 4).reader()
        read(0), read(1)

    check(run, path, also=(str(listed),))
