"""Hostile .caffemodel.h5 and .solverstate.h5 files: links that loop or lead nowhere, names
that are not UTF-8, types that are not numbers, a float numpy cannot hold, bit flips, and
datasets declaring gigabytes that the reader must refuse from their header without reading.
Each is one ProtoError line naming the file and the object."""

import re
import resource
import tracemalloc
import zlib

import h5py
import numpy as np
import pytest

from purine.errors import ProtoError, PurineError
from purine.formats.hdf5_snapshot import (
    SolverStateH5,
    read_private,
    read_state,
    read_weights,
    write_state,
    write_weights,
)


def exactly(text: str) -> str:
    return "^" + re.escape(text) + "$"


def weights_file(tmp_path, build) -> str:
    """A .caffemodel.h5 whose ``data/ip`` group ``build`` fills."""
    path = str(tmp_path / "w.caffemodel.h5")
    with h5py.File(path, "w") as f:
        build(f.create_group("data/ip"))
    return path


@pytest.mark.parametrize("links", [{"0": "/data/ip/0"}, {"0": "/data/ip/1", "1": "/data/ip/0"}],
                         ids=["itself", "cycle"])
def test_a_soft_link_that_loops_is_named(tmp_path, links):
    def build(g):
        for name, target in links.items():
            g[name] = h5py.SoftLink(target)

    path = weights_file(tmp_path, build)
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: 'data/ip/0' cannot be read: a soft or external link that loops "
            "(too many links)")):
        read_weights(path)


def test_an_external_link_to_a_missing_file_is_named(tmp_path):
    path = weights_file(tmp_path, lambda g: g.__setitem__(
        "0", h5py.ExternalLink(str(tmp_path / "gone.h5"), "/w")))
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: 'data/ip/0' is an external link to '/w' in '{tmp_path / 'gone.h5'}', "
            "which cannot be opened; expected a dataset")):
        read_weights(path)


def test_an_external_link_to_a_file_that_exists_is_followed(tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["w"] = np.array([1.5, -2.0], "<f4")
    path = weights_file(tmp_path, lambda g: g.__setitem__("0", h5py.ExternalLink(
        str(other), "/w")))
    assert read_weights(path)["ip"]["0"].tolist() == [1.5, -2.0]


@pytest.mark.parametrize("where", ["data", "data/ip"])
def test_a_link_name_that_is_not_utf8_is_named(tmp_path, where):
    path = str(tmp_path / "w.caffemodel.h5")
    with h5py.File(path, "w") as f:
        f.create_group("data/ip")[b"ok"] = np.zeros(2, "<f4")
        f[where].create_group(b"\xff\xfe")
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: '{where}' holds a link named b'\\xff\\xfe'; expected UTF-8 names")):
        read_weights(path)


@pytest.mark.parametrize("dtype, what", [
    (np.dtype([("a", "<f4"), ("b", "<i4")]), "compound values"),
    (h5py.string_dtype(), "strings"),
    (np.dtype("S3"), "strings"),
    (h5py.vlen_dtype("<f4"), "variable-length sequences"),
    (np.dtype(bool), "enumerated values (h5py's booleans)"),
    (np.dtype("(2,)<f4"), "fixed-size arrays"),
    (h5py.ref_dtype, "object references"),
])
def test_datasets_that_are_not_numbers_are_refused_by_type(tmp_path, dtype, what):
    path = weights_file(tmp_path, lambda g: g.create_dataset("0", shape=(3,), dtype=dtype))
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: dataset '/data/ip/0' holds {what}; expected integers or floats")):
        read_weights(path)


def test_a_float_numpy_cannot_hold_is_named(tmp_path):
    # IEEE quadruple precision: a 112-bit mantissa, more than x86's long double has.
    quad = h5py.h5t.IEEE_F64LE.copy()
    quad.set_size(16)
    quad.set_precision(128)
    quad.set_fields(127, 112, 15, 0, 112)
    quad.set_ebias(16383)
    path = weights_file(tmp_path, lambda g: h5py.h5d.create(
        g.id, b"0", quad, h5py.h5s.create_simple((2,))))
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: 'data/ip/0' cannot be read: damaged or not supported (Insufficient "
            "precision in available types to represent (127, 112, 15, 0, 112))")):
        read_weights(path)


def test_a_chunked_dataset_never_written_is_refused_from_its_header(tmp_path):
    # 2^28 float32 values (1 GiB) declared in a file of a few kilobytes.
    path = weights_file(tmp_path, lambda g: g.create_dataset(
        "0", shape=(2**28,), dtype="<f4", chunks=(2**16,)))
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: dataset '/data/ip/0' of shape (268435456,) is stored in 4096 chunks, "
            "the file holds 0 of them; expected every value written")):
        with peak_growth() as grew:
            read_weights(path)
    assert grew() < 4 << 20
    # A contiguous dataset never written: no storage at all.
    path = weights_file(tmp_path, lambda g: g.create_dataset("0", shape=(3, 4), dtype="<f8"))
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: dataset '/data/ip/0' of shape (3, 4) needs 96 bytes, the file stores 0 "
            "of them; expected every value written")):
        read_weights(path)


class peak_growth:
    """Peak memory growth inside the block: numpy's allocations (tracemalloc sees them) and
    the process's peak resident size, the larger of the two."""

    def __enter__(self):
        self.rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        tracemalloc.start()
        self.result = None
        return lambda: self.result

    def __exit__(self, *exc):
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.rss
        self.result = max(peak, rss)


def compressed_zeros(path, name: str, count: int, chunk: int = 2**22) -> None:
    """A dataset of ``count`` float32 zeros, every chunk written (deflate, each the same
    compressed bytes), so that the file is small but reading it allocates ``4 * count``."""
    raw = zlib.compress(bytes(4 * chunk))
    with h5py.File(path, "a") as f:
        ds = f.create_dataset(name, shape=(count,), dtype="<f4", chunks=(chunk,),
                              compression="gzip")
        for start in range(0, count, chunk):
            ds.id.write_direct_chunk((start,), raw)


def test_the_net_s_shapes_are_checked_before_a_value_is_read(tmp_path):
    path = str(tmp_path / "w.caffemodel.h5")
    compressed_zeros(path, "data/ip/0", 2**28)
    with h5py.File(path, "a") as f:
        f["data/ip/1"] = np.arange(4, dtype="<f4")
    assert (tmp_path / "w.caffemodel.h5").stat().st_size < 2 << 20
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: layer 'ip' parameter 0 has shape (268435456,) in the file, the net "
            "expects (4, 12)")):
        with peak_growth() as grew:
            read_weights(path, {"ip": [(4, 12), (4,)]})
    assert grew() < 4 << 20
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: layer 'ip' has 2 datasets, the net expects at most 1 parameter blobs")):
        read_weights(path, {"ip": [(4,)]})
    # A layer the net does not have is listed unread; a good file reads whole.
    assert read_weights(path, {"conv": [(2,)]}) == {"ip": {}}
    with h5py.File(path, "w") as f:
        f["data/ip/0"] = np.arange(6, dtype="<f4").reshape(2, 3)
        f["data/ip/x"] = np.zeros(5, "<f4")  # not a parameter's name: not read
        f.create_group("data/relu")
    w = read_weights(path, {"ip": [(2, 3), (2,)], "relu": []})
    assert w["relu"] == {} and list(w["ip"]) == ["0"]
    assert w["ip"]["0"].tolist() == [[0, 1, 2], [3, 4, 5]]


def solver_state(path, history) -> None:
    write_state(path, SolverStateH5(iter=7, learned_net="m.caffemodel.h5", current_step=1,
                                    history=history, private='{"seed": 3}'))


def test_history_is_checked_against_the_solver_before_a_value_is_read(tmp_path):
    path = str(tmp_path / "s.solverstate.h5")
    solver_state(path, [np.ones((2, 3), "<f4"), np.full(2, 0.5, "<f4")])
    state = read_state(path, [("w", (2, 3)), ("b", (2,))])
    assert (state.iter, state.current_step, state.learned_net) == (7, 1, "m.caffemodel.h5")
    assert state.history[1].tolist() == [0.5, 0.5] and state.private == '{"seed": 3}'
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: 2 history datasets, the 'SGD' solver of this net needs 3")):
        read_state(path, [("w", (2, 3)), ("b", (2,)), ("c", (1,))], "the 'SGD' solver of this net")
    with h5py.File(path, "a") as f:
        del f["history/0"]
    compressed_zeros(path, "history/0", 2**28)
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: history/0 (of parameter 'w') has shape (268435456,) in the file, the net "
            "expects (2, 3)")):
        with peak_growth() as grew:
            read_state(path, [("w", (2, 3)), ("b", (2,))])
    assert grew() < 4 << 20


@pytest.mark.parametrize("field, value, message", [
    ("learned_net", np.array([1.0]), "dataset 'learned_net' is not a string"),
    ("learned_net", np.dtype(h5py.string_dtype()), "dataset 'learned_net' holds 0 values; "
                                                   "expected one string"),
    ("iter", np.array(["7"], "S1"), "dataset 'iter' should hold one integer, found strings "
                                    "of shape (1,)"),
    ("iter", np.zeros((2,), "<i4"), "dataset 'iter' should hold one integer, found integers "
                                    "of shape (2,)"),
])
def test_solver_state_fields_of_the_wrong_type(tmp_path, field, value, message):
    path = str(tmp_path / "s.solverstate.h5")
    solver_state(path, [])
    with h5py.File(path, "a") as f:
        del f[field]
        if isinstance(value, np.dtype):
            f.create_dataset(field, shape=(0,), dtype=value)
        else:
            f[field] = value
    with pytest.raises(ProtoError, match=exactly(f"{path}: {message}")):
        read_state(path)


def test_bit_flips_give_a_state_or_one_line_naming_the_file(tmp_path):
    """Every 29th byte of a small .caffemodel.h5 and .solverstate.h5 XORed with 0xFF in turn:
    h5py's RuntimeErrors (link iteration, group info), ValueErrors and TypeErrors must all
    arrive as one ProtoError line that names the file."""
    model, state = tmp_path / "m.caffemodel.h5", tmp_path / "s.solverstate.h5"
    write_weights(model, [("conv", [np.ones((3, 2, 3, 3), "f4"), np.ones(3, "f4")]),
                          ("ip", [np.ones((4, 12), "f4")])])
    solver_state(state, [np.ones((3, 2), "f4"), np.ones(3, "f4")])
    damaged = 0
    for good, read in ((model, read_weights), (state, read_state)):
        data = good.read_bytes()
        path = tmp_path / f"flip-{good.name}"
        for i in range(0, len(data), 29):
            path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
            try:
                read(path)
            except PurineError as e:
                assert str(e).startswith(f"{path}: ") and "\n" not in str(e), str(e)
                damaged += "damaged or not supported" in str(e)
            assert read_private(path) in (None, '{"seed": 3}')
    assert damaged > 5  # HDF5's own errors were reached, not only our checks


def test_net_copy_from_refuses_a_huge_dataset_from_its_shape(tmp_path):
    from purine.caffe import TEST, Net

    net = """layer { name: "data" type: "Input" top: "data"
      input_param { shape { dim: 2 dim: 12 } } }
    layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
      inner_product_param { num_output: 4 } }"""
    path = str(tmp_path / "w.caffemodel.h5")
    compressed_zeros(path, "data/ip/0", 2**28)
    compressed_zeros(path, "data/gone/0", 2**28)  # a layer the net lacks: never read
    with Net(net, phase=TEST) as n:
        with pytest.raises(PurineError, match=exactly(
                f"{path}: layer 'ip' parameter 0 has shape (268435456,) in the file, the net "
                "expects (4, 12)")):
            with peak_growth() as grew:
                n.copy_from(path)
        assert grew() < 4 << 20
