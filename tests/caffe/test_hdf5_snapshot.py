"""snapshot_format: HDF5: Caffe's .caffemodel.h5 / .solverstate.h5 layout read back with h5py,
bit-identical resume from .h5, files in Caffe's layout written by hand loading into Net, and
BVLC's cifar10_quick solver training and snapshotting unchanged through the command."""

import os

import h5py
import numpy as np
import pytest

from purine.caffe import TEST, Net
from purine.caffe.solver import Solver, snapshot_seed
from purine.cli import main
from purine.errors import PurineError

# ip2 shares ip1's weight (its blob 0 is written by ip1 only); relu has no parameters;
# Dropout draws from a random stream the snapshot must carry.
NET = """
name: "shared"
layer { name: "data" type: "DummyData" top: "x" top: "y" dummy_data_param {
  shape { dim: 6 dim: 4 } shape { dim: 6 dim: 3 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "h1" param { name: "w" }
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 }
  bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "relu" type: "ReLU" bottom: "h1" top: "h1" }
layer { name: "ip2" type: "InnerProduct" bottom: "x" top: "h2" param { name: "w" }
  param { lr_mult: 2 } inner_product_param { num_output: 3
  bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "sum" type: "Eltwise" bottom: "h1" bottom: "h2" top: "p" }
layer { name: "drop" type: "Dropout" bottom: "p" top: "p" dropout_param { dropout_ratio: 0.3 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }
"""


def solver_text(tmp_path, **fields) -> str:
    base = dict(type='"Adam"', base_lr=0.01, momentum=0.9, momentum2=0.999,
                lr_policy='"multistep"', gamma=0.5, stepvalue=4, max_iter=8, random_seed=3,
                weight_decay=0.01, snapshot_format="HDF5", snapshot_prefix=f'"{tmp_path}/s"')
    base.update(fields)
    body = "\n".join(f"{k}: {v}" for k, v in base.items())
    return f"net_param {{ {NET} }}\n{body}\n"


def params_of(net) -> dict:
    return {name: [v.data.copy() for v in views] for name, views in net.params.items()}


def test_snapshot_writes_caffes_hdf5_layout(tmp_path):
    s = Solver(solver_text(tmp_path))
    s.step(5)
    model, state = s.snapshot()
    assert model == f"{tmp_path}/s_iter_5.caffemodel.h5"
    assert state == f"{tmp_path}/s_iter_5.solverstate.h5"
    assert sorted(os.listdir(tmp_path)) == ["s_iter_5.caffemodel.h5", "s_iter_5.solverstate.h5"]
    w, b1 = s.net.params["ip1"][0].data, s.net.params["ip1"][1].data
    b2 = s.net.params["ip2"][1].data
    with h5py.File(model, "r") as f:
        assert list(f) == ["data"]  # no "diff" group: Caffe writes it only for snapshot_diff
        assert set(f["data"]) == {"data", "ip1", "relu", "ip2", "sum", "drop", "loss"}
        assert list(f["data/relu"]) == []
        assert sorted(f["data/ip1"]) == ["0", "1"]
        assert list(f["data/ip2"]) == ["1"]  # the shared weight is its owner's to write
        assert f["data/ip1/0"].shape == (3, 4) and f["data/ip1/0"].dtype == np.float32
        assert f["data/ip1/1"].shape == (3,) and f["data/ip2/1"].shape == (3,)
        assert np.array_equal(f["data/ip1/0"][()], w)
        assert np.array_equal(f["data/ip1/1"][()], b1)
        assert np.array_equal(f["data/ip2/1"][()], b2)
    d = s.net.dispatcher
    with h5py.File(state, "r") as f:
        assert f["iter"].shape == (1,) and f["iter"].dtype == np.int32 and f["iter"][0] == 5
        assert f["current_step"][0] == 1  # multistep: stepvalue 4 passed
        ln = f["learned_net"]
        assert ln.shape == () and ln[()] == model.encode()
        # Caffe's reader sizes its buffer from the type and needs the NUL inside it.
        tid = ln.id.get_type()
        assert tid.get_size() == len(model) + 1 and tid.get_strpad() == h5py.h5t.STR_NULLTERM
        # Adam: every parameter's m, then every one's v; the shared weight counts once.
        assert sorted(f["history"], key=int) == [str(i) for i in range(6)]
        shapes = [f[f"history/{i}"].shape for i in range(6)]
        assert shapes == [(3, 4), (3,), (3,)] * 2
        for i, h in enumerate(s._history()):
            assert np.array_equal(f[f"history/{i}"][()], d.array(h))
        assert not np.array_equal(f["history/0"][()], np.zeros((3, 4)))
    assert snapshot_seed(state) == 3


def test_resume_from_hdf5_is_bit_identical(tmp_path):
    text = solver_text(tmp_path)
    straight = Solver(text)
    straight.step(8)
    half = Solver(text)
    half.step(3)
    _, state = half.snapshot()
    resumed = Solver(text)
    resumed.restore(state)
    assert resumed.iter == 3
    resumed.step(5)
    for name, arrays in params_of(straight.net).items():
        for a, b in zip(arrays, params_of(resumed.net)[name]):
            assert np.array_equal(a, b), name
    for h1, h2 in zip(straight._history(), resumed._history()):
        assert np.array_equal(straight.net.dispatcher.array(h1),
                              resumed.net.dispatcher.array(h2))
    # Without the private dataset (a file as Caffe writes it) the dropout masks start over,
    # so the weights part: the dataset is what made the resume exact.
    with h5py.File(state, "a") as f:
        del f["purine_state"]
    caffes = Solver(text)
    caffes.restore(state)
    assert caffes.iter == 3
    caffes.step(5)
    assert not np.array_equal(caffes.net.params["ip1"][0].data,
                              straight.net.params["ip1"][0].data)


def write_caffe_h5(path, arrays: dict) -> None:
    """A .caffemodel.h5 laid out as Caffe's Net::ToHDF5 writes it, made with h5py alone."""
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        for layer, blobs in arrays.items():
            g = data.create_group(layer)
            for k, a in blobs.items():
                g.create_dataset(str(k), data=a)


DEPLOY = """name: "deploy"
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 4 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "h1" param { name: "w" }
  inner_product_param { num_output: 3 } }
layer { name: "ip2" type: "InnerProduct" bottom: "x" top: "h2" param { name: "w" }
  inner_product_param { num_output: 3 } }
layer { name: "sum" type: "Eltwise" bottom: "h1" bottom: "h2" top: "p" }
"""


def test_a_caffe_layout_file_written_by_h5py_loads_into_net(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    b1, b2 = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3)
    path = tmp_path / "m.caffemodel.h5"
    # float64 and an unknown layer: Caffe converts the one and ignores the other
    write_caffe_h5(path, {"ip1": {0: w, 1: b1}, "ip2": {1: b2}, "gone": {0: np.ones(2)},
                          "sum": {}})
    for net in (Net(DEPLOY, weights=str(path), phase=TEST), Net(DEPLOY, str(path), TEST)):
        assert np.array_equal(net.params["ip1"][0].data, w)
        assert np.array_equal(net.params["ip2"][0].data, w)  # shared
        assert np.array_equal(net.params["ip1"][1].data, b1)
        assert np.array_equal(net.params["ip2"][1].data, b2.astype(np.float32))
        x = rng.standard_normal((2, 4)).astype(np.float32)
        out = net.forward(x=x)["p"]
        expected = (x @ w.T + b1) + (x @ w.T + b2.astype(np.float32))
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    # Caffe tells HDF5 by the file's signature, not its name.
    other = tmp_path / "weights.caffemodel"
    other.write_bytes(path.read_bytes())
    net = Net(DEPLOY, phase=TEST)
    net.copy_from(other)
    assert np.array_equal(net.params["ip1"][0].data, w)


def test_net_save_hdf5_round_trips(tmp_path):
    net = Net(DEPLOY, phase=TEST)
    for views in net.params.values():
        for v in views:
            v.data[...] = np.random.default_rng(v.data.size).standard_normal(v.shape)
    net.save_hdf5(tmp_path / "n.caffemodel.h5")
    other = Net(DEPLOY, phase=TEST)
    other.load_hdf5(tmp_path / "n.caffemodel.h5")
    for name, arrays in params_of(net).items():
        for a, b in zip(arrays, params_of(other)[name]):
            assert np.array_equal(a, b)



def test_a_float64_net_round_trips_in_double_datasets(tmp_path):
    """A float64 net writes double datasets, as Caffe's double nets do, and reads them back
    bit for bit; a float32 net reading the same file rounds each value to float32."""
    net = Net(DEPLOY, phase=TEST, dtype="float64")
    for views in net.params.values():
        for v in views:
            v.data[...] = np.random.default_rng(v.data.size).standard_normal(v.shape) / 3
    path = tmp_path / "d.caffemodel.h5"
    net.save_hdf5(path)
    with h5py.File(path, "r") as f:
        assert {f[f"data/{k}"].dtype for k in ("ip1/0", "ip1/1", "ip2/1")} == {np.dtype("<f8")}
        assert np.array_equal(f["data/ip1/0"][()], net.params["ip1"][0].data)
    other = Net(DEPLOY, phase=TEST, dtype="float64")
    other.load_hdf5(path)
    single = Net(DEPLOY, phase=TEST)
    single.load_hdf5(path)
    for name, arrays in params_of(net).items():
        for a, b, c in zip(arrays, params_of(other)[name], params_of(single)[name],
                           strict=True):
            assert b.dtype == np.float64 and np.array_equal(a, b)
            assert c.dtype == np.float32 and np.array_equal(c, a.astype(np.float32))
            assert not np.array_equal(c.astype(np.float64), a)  # the double bits were kept


REPEATED = """name: "repeat"
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 4 } } }
layer { name: "a" type: "InnerProduct" bottom: "x" top: "y"
  inner_product_param { num_output: 3 } }
layer { name: "a" type: "ReLU" bottom: "y" top: "z" }
layer { name: "b" type: "Sigmoid" bottom: "z" top: "s" }
layer { name: "b" type: "TanH" bottom: "s" top: "t" }
"""


def test_a_repeated_layer_name_writes_its_parameters_once(tmp_path):
    """Caffe lets a parameter-free layer repeat a name: the .caffemodel.h5 has one group per
    name (the first layer's), the .caffemodel every layer with its own blobs (none for the
    repeats), and both load back."""
    from purine.formats import caffe_pb2 as pb

    net = Net(REPEATED, phase=TEST)
    w = net.params["a"][0].data
    w[...] = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    net.save_hdf5(tmp_path / "r.caffemodel.h5")
    with h5py.File(tmp_path / "r.caffemodel.h5", "r") as f:
        assert sorted(f["data"]) == ["a", "b", "in"]
        assert sorted(f["data/a"]) == ["0", "1"] and list(f["data/b"]) == []
        assert np.array_equal(f["data/a/0"][()], w)
    net.save(tmp_path / "r.caffemodel")
    saved = pb.NetParameter()
    saved.ParseFromString((tmp_path / "r.caffemodel").read_bytes())
    assert [(lp.name, lp.type, len(lp.blobs)) for lp in saved.layer] == [
        ("in", "Input", 0), ("a", "InnerProduct", 2), ("a", "ReLU", 0),
        ("b", "Sigmoid", 0), ("b", "TanH", 0)]
    assert saved.name == "repeat"
    for weights in ("r.caffemodel.h5", "r.caffemodel"):
        other = Net(REPEATED, phase=TEST)
        other.copy_from(tmp_path / weights)
        assert np.array_equal(other.params["a"][0].data, w), weights


@pytest.mark.parametrize("arrays,match", [
    ({"ip1": {0: np.zeros((4, 3)), 1: np.zeros(3)}},
     r"layer 'ip1' parameter 0 has shape \(4, 3\) in the file, the net expects \(3, 4\)"),
    ({"ip1": {1: np.zeros(3)}}, r"layer 'ip1' has no dataset data/ip1/0"),
    ({"ip1": {0: np.zeros((3, 4)), 1: np.zeros(3), 2: np.zeros(1)}},
     r"layer 'ip1' has 3 datasets, the net expects at most 2"),
])
def test_hdf5_weights_that_do_not_fit_are_named(tmp_path, arrays, match):
    path = tmp_path / "bad.caffemodel.h5"
    write_caffe_h5(path, arrays)
    with pytest.raises(PurineError, match=match):
        Net(DEPLOY, weights=str(path), phase=TEST)


def test_a_caffe_written_solverstate_h5_restores(tmp_path):
    """A .solverstate.h5 without our private dataset, made with h5py as Caffe lays it out."""
    s = Solver(solver_text(tmp_path))
    model = tmp_path / "c.caffemodel.h5"
    w = np.full((3, 4), 0.25, np.float32)
    write_caffe_h5(model, {"ip1": {0: w, 1: np.ones(3)}, "ip2": {1: np.ones(3)}})
    history = [np.full(sh, k, np.float32) for k, sh in enumerate([(3, 4), (3,), (3,)] * 2)]
    with h5py.File(tmp_path / "c.solverstate.h5", "w") as f:
        f.create_dataset("iter", data=np.array([7], np.int32))
        f.create_dataset("learned_net", data=np.bytes_(str(model)))
        f.create_dataset("current_step", data=np.array([1], np.int32))
        g = f.create_group("history")
        for i, a in enumerate(history):
            g.create_dataset(str(i), data=a)
    s.restore(tmp_path / "c.solverstate.h5")
    assert s.iter == 7
    assert np.array_equal(s.net.params["ip2"][0].data, w)
    for h, a in zip(s._history(), history):
        assert np.array_equal(s.net.dispatcher.array(h), a)
    with h5py.File(tmp_path / "c.solverstate.h5", "a") as f:
        del f["history/5"]
    with pytest.raises(PurineError, match="5 history datasets, the 'Adam' solver of this net "
                                          "needs 6"):
        s.restore(tmp_path / "c.solverstate.h5")


# -- BVLC's cifar10_quick solver (snapshot_format: HDF5) on stand-in data ------------------
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CIFAR = os.path.join(ROOT, "models", "cifar10_quick")


@pytest.fixture(scope="module")
def cifar_files(tmp_path_factory):
    from purine.converters.convert_imageset import write_images
    from purine.formats.prototxt import read_net

    tmp = tmp_path_factory.mktemp("cifar")
    rng = np.random.default_rng(1)
    records = ((f"{i:08d}", rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), i % 10)
               for i in range(40))
    write_images(tmp / "lmdb", records, total=40)
    net = read_net(os.path.join(CIFAR, "cifar10_quick_train_test.prototxt"))
    for layer in net.layer:
        if layer.type == "Data":  # stand-in images; no mean file was computed for them
            layer.data_param.source = str(tmp / "lmdb")
            layer.data_param.batch_size = 4
            layer.transform_param.ClearField("mean_file")
    (tmp / "train_test.prototxt").write_text(str(net))
    text = open(os.path.join(CIFAR, "cifar10_quick_solver.prototxt")).read()
    assert "snapshot_format: HDF5" in text and "solver_mode: GPU" in text
    for old, new in (('"models/cifar10_quick/cifar10_quick_train_test.prototxt"',
                      f'"{tmp}/train_test.prototxt"'),
                     ("max_iter: 4000", "max_iter: 4"), ("snapshot: 4000", "snapshot: 2"),
                     ("test_iter: 100", "test_iter: 2"),
                     ('"models/cifar10_quick/cifar10_quick"', f'"{tmp}/cifar10_quick"')):
        assert old in text
        text = text.replace(old, new)
    (tmp / "solver.prototxt").write_text(text)
    return tmp


CIFAR_SHAPES = {"conv1": [(32, 3, 5, 5), (32,)], "conv2": [(32, 32, 5, 5), (32,)],
                "conv3": [(64, 32, 5, 5), (64,)], "ip1": [(64, 1024), (64,)],
                "ip2": [(10, 64), (10,)]}


def test_cifar10_quick_solver_trains_and_snapshots_hdf5(cifar_files, log_lines, tmp_path):
    tmp = cifar_files
    assert main(["train", "--solver", str(tmp / "solver.prototxt")]) == 0
    names = sorted(n for n in os.listdir(tmp) if n.startswith("cifar10_quick_iter"))
    assert names == [f"cifar10_quick_iter_{i}.{k}.h5" for i in (2, 4)
                     for k in ("caffemodel", "solverstate")]
    assert f"Snapshotting to HDF5 file {tmp}/cifar10_quick_iter_4.caffemodel.h5" in log_lines
    with h5py.File(tmp / "cifar10_quick_iter_4.caffemodel.h5", "r") as f:
        for layer, shapes in CIFAR_SHAPES.items():
            assert [f[f"data/{layer}/{k}"].shape for k in range(2)] == shapes
    with h5py.File(tmp / "cifar10_quick_iter_4.solverstate.h5", "r") as f:
        assert f["iter"][0] == 4 and len(f["history"]) == 10
        assert f["learned_net"][()].decode() == f"{tmp}/cifar10_quick_iter_4.caffemodel.h5"
        assert f["history/6"].shape == (64, 1024)
    # Resuming from the iteration-2 state reaches the same weights at 4, bit for bit.
    with h5py.File(tmp / "cifar10_quick_iter_4.caffemodel.h5", "r") as f:
        straight = {k: f[f"data/{k}/0"][()] for k in CIFAR_SHAPES}
    os.remove(tmp / "cifar10_quick_iter_4.caffemodel.h5")
    assert main(["train", "--solver", str(tmp / "solver.prototxt"), "--snapshot",
                 str(tmp / "cifar10_quick_iter_2.solverstate.h5")]) == 0
    with h5py.File(tmp / "cifar10_quick_iter_4.caffemodel.h5", "r") as f:
        for k, a in straight.items():
            assert np.array_equal(f[f"data/{k}/0"][()], a), k
    # --weights and `test` read the .caffemodel.h5 as well.
    model = str(tmp / "cifar10_quick_iter_4.caffemodel.h5")
    log_lines.clear()
    assert main(["test", "--model", str(tmp / "train_test.prototxt"), "--weights", model,
                 "--iterations", "1"]) == 0
    assert any(line.startswith("accuracy = ") for line in log_lines)
    prefix = f'"{tmp}/cifar10_quick"'
    fine = (tmp / "solver.prototxt").read_text().replace(prefix, f'"{tmp_path}/ft"')
    fine = fine.replace("max_iter: 4", "max_iter: 0").replace("snapshot: 2", "snapshot: 0")
    (tmp_path / "ft.prototxt").write_text(fine)  # snapshot_after_train writes iteration 0
    log_lines.clear()
    assert main(["train", "--solver", str(tmp_path / "ft.prototxt"), "--weights", model]) == 0
    assert f"Finetuning from {model}" in log_lines
    with h5py.File(tmp_path / "ft_iter_0.caffemodel.h5", "r") as f:
        for k, a in straight.items():
            assert np.array_equal(f[f"data/{k}/0"][()], a), k
