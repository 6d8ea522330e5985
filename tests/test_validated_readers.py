"""Hostile files meet one validated reader per kind: BlobProto (caffemodel, mean file,
solver history, npz and HDF5 arrays), the solver state's private JSON, and Datum records.
Each refusal is a PurineError subclass whose one-line message names the file (and layer,
blob, key) and what was expected; Caffe-valid files load as before."""

import io
import json
import re
import zipfile

import cv2
import h5py
import numpy as np
import pytest

from purine.caffe import TEST, Net
from purine.caffe.solver import PRIVATE_STATE_FIELD, Solver, snapshot_seed
from purine.converters import ConvertError
from purine.converters.binaryproto import convert
from purine.converters.caffemodel_npz import caffemodel_to_npz, read_npz
from purine.converters.compute_image_mean import compute_image_mean
from purine.converters.summary import summarize
from purine.data import DataError
from purine.data.datum import datum_image, read_mean
from purine.data.memory import MemoryFeed
from purine.data.prefetch import Prefetcher
from purine.errors import LayerError, ProtoError, PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import blob_to_array, load_weights
from purine.formats.hdf5_snapshot import read_state, read_weights
from purine.formats.wire import len_field
from purine.pycaffe import io as caffe_io
from tests.data.helpers import data_net, images, raw_datum, write_lmdb


def exactly(message: str) -> str:
    """A pytest ``match`` pattern for exactly ``message``."""
    return "^" + re.escape(message) + "$"


# -- BlobProto ---------------------------------------------------------------------------
def blob(dims=None, data=(), double=(), **legacy) -> pb.BlobProto:
    b = pb.BlobProto(data=data, double_data=double, **legacy)
    if dims is not None:
        b.shape.dim.extend(dims)
    return b


@pytest.mark.parametrize("b, message", [
    # negative dims whose product matches the count: numpy's reshape refused them
    (blob([-2, -3], data=range(6)),
     "BlobProto of shape (-2, -3) has dimension 0 = -2; dimensions are 0 or more"),
    (blob(num=-1, channels=-1, height=1, width=1, data=[5]),
     "BlobProto of shape (-1, -1, 1, 1) has dimension 0 = -1; dimensions are 0 or more"),
    # 2**62 * 4 wraps to 0 in int64, as many values as an empty blob holds
    (blob([2**62, 4]), "BlobProto of shape (4611686018427387904, 4) has 18446744073709551616 "
                       "values, more than the 1099511627776 a blob may hold"),
    (blob([2**20, 2**21]), "BlobProto of shape (1048576, 2097152) has 2199023255552 values, "
                           "more than the 1099511627776 a blob may hold"),
    (blob([2, 2], data=[1, 2, 3]), "BlobProto of shape (2, 2) holds 3 values"),
    (blob([1] * 33, data=[1]), "BlobProto has 33 axes; a blob has at most 32"),
    (blob([3], data=[1, 2, 3], double=[1, 2]),
     "BlobProto holds 3 data and 2 double_data values; expected one of the two"),
])
def test_blob_to_array_refuses_shapes_that_cannot_hold_the_values(b, message):
    with pytest.raises(ProtoError, match=exactly(message)):
        blob_to_array(b)


def test_caffe_valid_blobs_load_as_before():
    assert blob_to_array(blob([0, 3])).shape == (0, 3)
    assert blob_to_array(blob([1] * 32, data=[7])).shape == (1,) * 32
    legacy = blob_to_array(blob(num=1, channels=2, height=1, width=2, data=[1, 2, 3, 4]))
    assert legacy.shape == (1, 2, 1, 2) and legacy.ravel().tolist() == [1, 2, 3, 4]
    # data and double_data of one count: double_data, as Caffe's double nets wrote it
    both = blob_to_array(blob([2], data=[1, 2], double=[0.5, 0.25]))
    assert both.dtype == np.float32 and both.tolist() == [0.5, 0.25]
    assert blob_to_array(blob(data=[1, 2, 3])).shape == (3,)


def write_caffemodel(path, blobs) -> str:
    net = pb.NetParameter(name="n")
    layer = net.layer.add(name="ip", type="InnerProduct")
    layer.blobs.extend(blobs)
    path.write_bytes(net.SerializeToString())
    return str(path)


BAD_BLOB = "BlobProto of shape (-2, -3) has dimension 0 = -2; dimensions are 0 or more"


def test_caffemodel_readers_name_the_file_layer_and_blob(tmp_path):
    path = write_caffemodel(tmp_path / "w.caffemodel",
                            [blob([2], data=[1, 2]), blob([-2, -3], data=range(6))])
    want = exactly(f"{path}: layer 'ip' blob 1: {BAD_BLOB}")
    with pytest.raises(ProtoError, match=want):
        load_weights(path)
    with pytest.raises(ProtoError, match=want):
        summarize(path)
    with pytest.raises(ProtoError, match=want):
        caffemodel_to_npz(path, tmp_path / "w.npz")


def test_net_copy_from_names_the_file_and_layer(tmp_path):
    path = write_caffemodel(tmp_path / "w.caffemodel", [blob([-2, -3], data=range(6))])
    net = Net('input: "x" input_shape { dim: 1 dim: 6 }\nlayer { name: "ip" '
              'type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 } }',
              phase=TEST)
    with pytest.raises(ProtoError, match=re.escape(f"{path}: layer 'ip' blob 0: ") + ".*" +
                       re.escape(BAD_BLOB)):
        net.copy_from(path)


def test_mean_and_binaryproto_files_are_named(tmp_path):
    path = tmp_path / "m.binaryproto"
    path.write_bytes(blob([-2, -3], data=range(6)).SerializeToString())
    with pytest.raises(DataError, match=exactly(f"mean file '{path}': {BAD_BLOB}")):
        read_mean(path)
    with pytest.raises(ConvertError, match=exactly(f"{path}: {BAD_BLOB}")):
        convert(path, tmp_path / "m.npy")
    path.write_bytes(blob([1, 2, 2, 2], data=range(8)).SerializeToString())
    assert read_mean(path).shape == (2, 2, 2)


def test_pycaffe_blobproto_to_array_keeps_its_order_and_refuses_bad_shapes():
    # pycaffe's order: the legacy fields win over shape; data only, as float64
    b = blob([4], data=[1, 2, 3, 4], num=1, channels=1, height=2, width=2)
    assert caffe_io.blobproto_to_array(b).shape == (1, 1, 2, 2)
    with pytest.raises(ProtoError, match=exactly(
            "BlobProto data of shape (-1, -2) has dimension 0 = -1; dimensions are 0 or more")):
        caffe_io.blobproto_to_array(blob([-1, -2], data=[1, 2]))
    with pytest.raises(ProtoError, match=exactly("BlobProto diff of shape (2,) holds 1 values")):
        caffe_io.blobproto_to_array(pb.BlobProto(shape=pb.BlobShape(dim=[2]), diff=[1]),
                                    return_diff=True)
    vec = pb.BlobProtoVector(blobs=[blob([1], data=[1]), blob([3], data=[1])])
    with pytest.raises(ProtoError, match=exactly(
            "BlobProtoVector blob 1: BlobProto data of shape (3,) holds 1 values")):
        caffe_io.blobprotovector_str_to_arraylist(vec.SerializeToString())
    with pytest.raises(ProtoError, match="^not a serialized BlobProtoVector \\(2 bytes: "):
        caffe_io.blobprotovector_str_to_arraylist(b"\xff\xff")
    d = pb.Datum(channels=-1, height=-2, width=1, data=b"\0\0")
    with pytest.raises(DataError, match=exactly(
            "Datum of shape (-1, -2, 1) has dimension 0 = -1; dimensions are 0 or more")):
        caffe_io.datum_to_array(d)


# -- npz ---------------------------------------------------------------------------------
def npy_bytes(shape, descr="<f4", data=b"") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False,
                                               "shape": shape})
    return buf.getvalue() + data


def test_npz_members_are_checked_before_they_are_loaded(tmp_path):
    def npz(name, members) -> str:
        path = tmp_path / name
        with zipfile.ZipFile(path, "w") as z:
            for member, content in members.items():
                z.writestr(member, content)
        return str(path)

    # a header claiming 2**41 floats in a file of a few bytes: refused, never allocated
    path = npz("huge.npz", {"ip/0.npy": npy_bytes((2**41,))})
    with pytest.raises(ConvertError, match=exactly(
            f"{path}: array 'ip/0' of shape (2199023255552,) has 2199023255552 values, more "
            "than the 1099511627776 a blob may hold")):
        read_npz(path)
    path = npz("neg.npz", {"ip/0.npy": npy_bytes((-1, 2))})
    with pytest.raises(ConvertError, match=exactly(
            f"{path}: array 'ip/0' of shape (-1, 2) has dimension 0 = -1; dimensions are 0 or "
            "more")):
        read_npz(path)
    path = npz("raw.npz", {"ip/0": b"not an array"})
    with pytest.raises(ConvertError, match=exactly(f"{path}: member 'ip/0' is not a .npy array")):
        read_npz(path)
    path = npz("digit.npz", {"ip/\u00b2.npy": npy_bytes((1,), data=b"\0" * 4)})
    with pytest.raises(ConvertError, match=exactly(
            f"{path}: key 'ip/\u00b2' is not 'layer/index' (e.g. 'conv1/0' for conv1's "
            "weights)")):
        read_npz(path)
    np.savez(tmp_path / "axes.npz", **{"ip/0": np.zeros((1,) * 33, np.float32)})
    with pytest.raises(ConvertError, match=exactly(
            f"{tmp_path / 'axes.npz'}: array 'ip/0' has 33 axes; a blob has at most 32")):
        read_npz(tmp_path / "axes.npz")
    np.savez(tmp_path / "obj.npz", **{"ip/0": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(ConvertError, match=re.escape(
            f"{tmp_path / 'obj.npz'}: array 'ip/0' is not a plain array (")):
        read_npz(tmp_path / "obj.npz")
    np.savez(tmp_path / "ok.npz", **{"a/b/1": np.arange(3.0)})
    assert read_npz(tmp_path / "ok.npz")[("a/b", 1)].tolist() == [0, 1, 2]


# -- HDF5 snapshots ----------------------------------------------------------------------
def test_hdf5_weights_need_numeric_datasets_of_sane_shapes(tmp_path):
    path = str(tmp_path / "w.caffemodel.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("data/ip/0", shape=(2**41,), dtype="<f4", chunks=(1024,))
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: dataset '/data/ip/0' of shape (2199023255552,) has 2199023255552 "
            "values, more than the 1099511627776 a blob may hold")):
        read_weights(path)
    with h5py.File(path, "w") as f:
        f.create_group("data/ip/0")
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: 'data/ip/0' is a group; expected a dataset")):
        read_weights(path)
    with h5py.File(path, "w") as f:
        f.create_group("data/ip")["0"] = h5py.SoftLink("/nowhere")
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: 'data/ip/0' is missing (a dangling link); expected a dataset")):
        read_weights(path)
    with h5py.File(path, "w") as f:
        f.create_dataset("data/ip/0", data=h5py.Empty("f4"))
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: dataset '/data/ip/0' has a null dataspace; expected an array")):
        read_weights(path)
    with h5py.File(path, "w") as f:
        f.create_dataset("data/ip/0", data=np.arange(6, dtype="<f4").reshape(2, 3))
        f.create_dataset("data/ip/1", data=np.arange(2, dtype="<i4"))
    w = read_weights(path)["ip"]
    assert w["0"].dtype == np.float32 and w["1"].dtype == np.float64
    assert w["1"].tolist() == [0, 1]


@pytest.mark.parametrize("datasets, message", [
    (dict(iter="group"), "'iter' is a group; expected a dataset"),
    (dict(iter=np.array([np.nan])), "dataset 'iter' holds nan; expected an integer in the "
                                    "32-bit range"),
    (dict(iter=np.array([2**40], "<i8")), "dataset 'iter' holds 1099511627776; expected an "
                                          "integer in the 32-bit range"),
    (dict(learned_net=np.bytes_(b"\xff\xfe")), "dataset 'learned_net' is not UTF-8 text"),
    (dict(learned_net=np.array([b"a", b"b"])), "dataset 'learned_net' holds 2 values; "
                                               "expected one string"),
])
def test_hdf5_solver_state_fields_are_checked(tmp_path, datasets, message):
    path = str(tmp_path / "s.solverstate.h5")
    with h5py.File(path, "w") as f:
        f.create_group("history")
        f.create_dataset("current_step", data=np.array([0], "<i4"))
        if "iter" not in datasets:
            f.create_dataset("iter", data=np.array([3], "<i4"))
        for name, value in datasets.items():
            if isinstance(value, str):
                f.create_group(name)
            else:
                f.create_dataset(name, data=value)
    with pytest.raises(ProtoError, match=exactly(f"{path}: {message}")):
        read_state(path)


def test_hdf5_history_entries_must_be_datasets(tmp_path):
    path = str(tmp_path / "s.solverstate.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("iter", data=np.array([3], "<i4"))
        f.create_dataset("current_step", data=np.array([0], "<i4"))
        f.create_group("history/0")
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: 'history/0' is a group; expected a dataset")):
        read_state(path)


# -- the solver state's private JSON -----------------------------------------------------
NET = """
name: "regression"
layer { name: "data" type: "DummyData" top: "x" top: "y" dummy_data_param {
  shape { dim: 6 dim: 4 } shape { dim: 6 dim: 3 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
layer { name: "drop" type: "Dropout" bottom: "x" top: "xd" }
layer { name: "ip" type: "InnerProduct" bottom: "xd" top: "p"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }
"""
SOLVER = f'net_param {{ {NET} }}\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 10\n' \
         "random_seed: 5\n"


def state_file(tmp_path, solver: Solver, payload: bytes | str, name="s.solverstate") -> str:
    """A .solverstate as the solver writes it, with ``payload`` as its private field."""
    chunks = solver.encode_state("", private={})[:-3]  # without the private field
    if isinstance(payload, str):
        payload = payload.encode()
    path = tmp_path / name
    path.write_bytes(b"".join(bytes(c) for c in chunks + len_field(PRIVATE_STATE_FIELD,
                                                                   payload)))
    return str(path)


def private(stateful: dict, seed=5) -> str:
    return json.dumps({"seed": seed, "stateful": stateful})


GOOD = {"data/random#0": {"count": 4}, "data/random#1": {"count": 4},
        "drop/random#0": {"count": 4}}


@pytest.mark.parametrize("payload, problem", [
    ("[" * 100000, "JSON nested too deeply"),
    ('{"seed": 5, "stateful": {"drop/random#0": ' + "[" * 100000,
     "JSON nested too deeply"),
    ("{oops", "not valid JSON (Expecting property name enclosed in double quotes: line 1 "
              "column 2 (char 1))"),
    ('{"seed": 5, "stateful": {}, "x": ' + "9" * 5000 + "}", None),  # Python's digit limit
    ("[]", "a list; expected an object with keys 'seed' and 'stateful'"),
    ('{"seed": 5}', "an object; expected an object with keys 'seed' and 'stateful'"),
    (private(GOOD, seed=-1), "seed is -1; expected null or an integer from 0 to "
                             "9223372036854775807"),
    (private(GOOD, seed="5"), 'seed is "5"; expected null or an integer from 0 to '
                              "9223372036854775807"),
    (private(GOOD, seed=True), "seed is true; expected null or an integer from 0 to "
                               "9223372036854775807"),
    ('{"seed": 5, "stateful": []}', "stateful is a list; expected an object"),
    (private({"drop/random#0": 3}), "'drop/random#0' is an integer; expected an object"),
    (private({"drop/random#0": {"count": "4"}}),
     "'drop/random#0': 'count' is a string; expected an integer"),
    (private({"drop/random#0": {"count": 4.0}}),
     "'drop/random#0': 'count' is a number; expected an integer"),
    (private({"drop/random#0": {"count": True}}),
     "'drop/random#0': 'count' is a boolean; expected an integer"),
    (private({"drop/random#0": {"count": None}}),
     "'drop/random#0': 'count' is null; expected an integer"),
    (private({"drop/random#0": {"count": [4]}}),
     "'drop/random#0': 'count' is a list; expected an integer"),
    (private({"drop/random#0": {"count": 2**64}}),
     "'drop/random#0': 'count' is 18446744073709551616, outside the 64-bit integer range"),
    (private({"drop/random#0": {"count": 4, "extra": 1}}),
     "'drop/random#0': the state has keys ['count', 'extra']; expected ['count']"),
    (private({"drop/random#0": {"cnt": 4}}),
     "'drop/random#0': the state has keys ['cnt']; expected ['count']"),
    (private({"drop/random#0": {}}), "'drop/random#0': the state lacks 'count'"),
])
def test_a_bad_private_state_is_refused_naming_the_file_and_key(tmp_path, payload, problem):
    s = Solver(SOLVER)
    path = state_file(tmp_path, s, payload)
    where = f"{path}: purine state (field {PRIVATE_STATE_FIELD}): "
    if problem is None:  # the message is Python's own; its start is ours
        pattern = "^" + re.escape(where + "not valid JSON (") + ".*digits.*\\)$"
    else:
        pattern = exactly(where + problem)
    with pytest.raises(PurineError, match=pattern):
        s.restore(path)
    assert s.iter == 0
    if problem and "': " in problem:  # inside an entry: only restore knows its schema
        assert snapshot_seed(path) == 5
    else:  # the top level: the CLI's seed lookup refuses the file as restore does
        with pytest.raises(PurineError, match=pattern):
            snapshot_seed(path)


def test_nothing_is_restored_unless_every_entry_passes(tmp_path):
    s = Solver(SOLVER)
    before = {k: obj.state() for k, obj in s.state_objects().items()}
    bad = dict(GOOD, **{"drop/random#0": {"count": "x"}})
    with pytest.raises(PurineError, match="'drop/random#0': 'count' is a string"):
        s.restore(state_file(tmp_path, s, private(bad)))
    assert {k: obj.state() for k, obj in s.state_objects().items()} == before


def test_a_valid_private_state_restores_and_unknown_keys_are_ignored(tmp_path):
    s = Solver(SOLVER)
    stateful = dict(GOOD, **{"replica3/drop/random#0": {"anything": ["goes", {"here": 1}]},
                             "test0/x/cursor": {"batch": -1}})
    path = state_file(tmp_path, s, private(stateful, seed=2**40))
    assert snapshot_seed(path) == 2**40
    s.restore(path)
    assert {k: obj.state() for k, obj in s.state_objects().items()} == GOOD
    assert snapshot_seed(state_file(tmp_path, s, private(GOOD, seed=None), "n")) is None


def test_the_hdf5_private_dataset_is_checked_alike(tmp_path):
    text = SOLVER + f'snapshot_prefix: "{tmp_path}/h"\nsnapshot_format: HDF5\n'
    s = Solver(text)
    s.step(1)
    _, path = s.snapshot()
    with h5py.File(path, "a") as f:
        del f["purine_state"]
        f["purine_state"] = np.bytes_(private({"drop/random#0": {"count": -0.5}}).encode())
    with pytest.raises(PurineError, match=exactly(
            f"{path}: purine state (dataset 'purine_state'): 'drop/random#0': 'count' is a "
            "number; expected an integer")):
        Solver(text).restore(path)


def test_history_blobs_are_read_by_the_blob_reader(tmp_path):
    s = Solver(SOLVER + "momentum: 0.9\n")
    state = pb.SolverState(iter=1, history=[blob([-3, -1], data=[0, 0, 0]), blob([3])])
    path = tmp_path / "h.solverstate"
    path.write_bytes(state.SerializeToString())
    with pytest.raises(ProtoError, match=exactly(
            f"{path}: history blob 0: BlobProto of shape (-3, -1) has dimension 0 = -3; "
            "dimensions are 0 or more")):
        s.restore(path)


MEMORY_NET = """
layer { name: "mem" type: "MemoryData" top: "x" top: "y"
  memory_data_param { batch_size: 2 channels: 4 height: 1 width: 1 } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "p"
  inner_product_param { num_output: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }
"""


def test_a_cursor_below_zero_is_refused_by_its_source(tmp_path):
    s = Solver(f'net_param {{ {MEMORY_NET} }}\nbase_lr: 0.1\nlr_policy: "fixed"\n'
               "max_iter: 10\nrandom_seed: 5\n")
    assert s._private_state()["stateful"] == {"mem/cursor": {"pos": 0, "added": 0}}
    path = state_file(tmp_path, s, private({"mem/cursor": {"pos": -2, "added": 0}}))
    with pytest.raises(PurineError, match=exactly(
            f"{path}: purine state (field {PRIVATE_STATE_FIELD}): 'mem/cursor': refused: "
            "MemoryData layer 'mem': pos -2 and added 0; both are 0 or more")):
        s.restore(path)
    p = Prefetcher(lambda pool: (lambda k: (np.zeros(1),)), 0, "layer 'd'")
    with pytest.raises(DataError, match=exactly("layer 'd': batch -1; a data cursor is 0 or "
                                                "more")):
        p.restore({"batch": -1})
    p.restore({"batch": 7})
    assert p.state() == {"batch": 7}
    p.close()
    feed = MemoryFeed("m", 2, (1, 1, 1), "float32", transformer=None)
    feed.restore({"pos": 4, "added": 1})
    assert feed.state() == {"pos": 4, "added": 1}


CARRY_NET = """
layer { name: "data" type: "DummyData" top: "x" top: "cont" top: "y" dummy_data_param {
  shape { dim: 3 dim: 2 dim: 4 } shape { dim: 3 dim: 2 } shape { dim: 3 dim: 2 dim: 3 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 }
  data_filler { type: "gaussian" std: 1 } } }
layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h"
  recurrent_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "h" bottom: "y" top: "loss" }
"""


@pytest.mark.parametrize("change, problem", [
    (dict(dtype="|O"), "refused: dtype '|O' is not a floating-point type"),
    (dict(dtype="<U2"), "refused: dtype '<U2' is not a floating-point type"),
    (dict(dtype="nonsense"), "refused: data type 'nonsense' not understood"),
    (dict(data="AAAA"), "refused: buffer size must be a multiple of element size"),
    (dict(data="AAAAAA=="), "refused: cannot reshape array of size 1 into shape (1,2,3)"),
    (dict(data="!!"), "refused: Only base64 data is allowed"),
    (dict(shape=[1, "2", 3]), "'shape[1]' is a string; expected an integer"),
])
def test_a_recurrent_layers_carried_state_is_checked(tmp_path, change, problem):
    s = Solver(f'net_param {{ {CARRY_NET} }}\nbase_lr: 0.1\nlr_policy: "fixed"\n'
               "max_iter: 10\nrandom_seed: 5\n")
    states = s._private_state()["stateful"]
    carried = states["lstm/state#0"]
    assert carried["shape"] == [1, 2, 3] and carried["dtype"] == "<f4"
    states["lstm/state#0"] = dict(carried, **change)
    path = state_file(tmp_path, s, private(states))
    with pytest.raises(PurineError, match=exactly(
            f"{path}: purine state (field {PRIVATE_STATE_FIELD}): 'lstm/state#0': {problem}")):
        s.restore(path)


# -- Datum records -----------------------------------------------------------------------
@pytest.mark.parametrize("datum, problem", [
    (pb.Datum(channels=3, height=8, width=9, encoded=True),
     "encoded Datum with no data bytes; expected an image file's bytes (JPEG, PNG, ...)"),
    (pb.Datum(channels=-1, height=-2, width=3, data=b"\0" * 6),
     "raw Datum with channels, height, width = (-1, -2, 3); each must be 1 or more"),
    (pb.Datum(channels=2**31 - 1, height=2**31 - 1, width=2**31 - 1, data=b"\0"),
     "1 data bytes for channels x height x width = (2147483647, 2147483647, 2147483647), "
     "which needs 9903520300447984150353281023"),
    (pb.Datum(channels=1, height=1, width=2, data=b"\0\0", float_data=[1, 2]),
     "Datum holds both data (2 bytes) and float_data (2 values); expected one of them"),
])
def test_datum_records_are_checked_before_decoding(tmp_path, datum, problem):
    with pytest.raises(DataError, match=exactly(f"db key 'k': {problem}")):
        datum_image(datum, cv2.IMREAD_UNCHANGED, "db key 'k'")
    db = write_lmdb(tmp_path / "db", [raw_datum(images(1, (1, 1, 2))[0]), datum])
    net = data_net(db, batch=1)
    net.forward()
    with pytest.raises(DataError, match=exactly(
            f"op 'data/Data': LMDB '{db}': record '00000001': {problem}")):
        net.forward()
    net.close()
    first = write_lmdb(tmp_path / "first", [datum])
    with pytest.raises(LayerError, match=re.escape(f"LMDB '{first}': record '00000000': "
                                                   f"{problem}") + "$"):
        data_net(first, batch=1)


@pytest.mark.parametrize("datum, error, problem", [
    (pb.Datum(channels=3, height=8, width=9, encoded=True), DataError,
     "encoded Datum with no data bytes; expected an image file's bytes (JPEG, PNG, ...)"),
    (pb.Datum(channels=1, height=1, width=-2, data=b"\0\0"), DataError,
     "raw Datum with channels, height, width = (1, 1, -2); each must be 1 or more"),
    (pb.Datum(channels=1, height=1, width=2, data=b"\0\0", float_data=[1, 2]), DataError,
     "Datum holds both data (2 bytes) and float_data (2 values); expected one of them"),
    (pb.Datum(channels=2**31 - 1, height=2**31 - 1, width=2, data=b"\0\0"), ConvertError,
     "incorrect data field size 2 for CxHxW 2147483647x2147483647x2 = 9223372028264841218"),
])
def test_compute_image_mean_names_the_database_and_record(tmp_path, datum, error, problem):
    db = write_lmdb(tmp_path / "db", [datum])
    with pytest.raises(error, match=exactly(f"{db}: record b'00000000': {problem}")):
        compute_image_mean(db)
    if error is DataError:  # a later record too
        db = write_lmdb(tmp_path / "later", [raw_datum(images(1, (1, 1, 2))[0]), datum])
        with pytest.raises(error, match=exactly(f"{db}: record b'00000001': {problem}")):
            compute_image_mean(db)
