"""pycaffe's net specification (caffe.NetSpec, caffe.layers, caffe.params, caffe.to_proto):
LeNet as Caffe's notebook writes it against Caffe's own generated prototxt, CaffeNet from
Caffe's caffenet.py builder with its 60,965,224 parameters, keyword routing, naming and
ordering, the errors, and a generated net that trains through caffe.SGDSolver."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

import purine.pycaffe as caffe
from purine.datasets.mnist import split_mnist_5k, write_mnist_lmdb
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net
from purine.pycaffe import layers as L
from purine.pycaffe import params as P
from purine.pycaffe.net_spec import param_name_dict
from purine.zoo import model_file
from tests.pycaffe.helpers import write_layers

# Caffe's examples/mnist/lenet_auto_train.prototxt: what Caffe's net_spec wrote for the
# notebook's lenet('examples/mnist/mnist_train_lmdb', 64). Caffe's protobuf printed the
# float scale as the double 1/255 to 12 digits; ours prints the float32 it stores to its
# shortest round-tripping form. The two parse to the same float32.
LENET_AUTO_TRAIN = """layer {
  name: "data"
  type: "Data"
  top: "data"
  top: "label"
  transform_param {
    scale: 0.00392156862745
  }
  data_param {
    source: "examples/mnist/mnist_train_lmdb"
    batch_size: 64
    backend: LMDB
  }
}
layer {
  name: "conv1"
  type: "Convolution"
  bottom: "data"
  top: "conv1"
  convolution_param {
    num_output: 20
    kernel_size: 5
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "pool1"
  type: "Pooling"
  bottom: "conv1"
  top: "pool1"
  pooling_param {
    pool: MAX
    kernel_size: 2
    stride: 2
  }
}
layer {
  name: "conv2"
  type: "Convolution"
  bottom: "pool1"
  top: "conv2"
  convolution_param {
    num_output: 50
    kernel_size: 5
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "pool2"
  type: "Pooling"
  bottom: "conv2"
  top: "pool2"
  pooling_param {
    pool: MAX
    kernel_size: 2
    stride: 2
  }
}
layer {
  name: "ip1"
  type: "InnerProduct"
  bottom: "pool2"
  top: "ip1"
  inner_product_param {
    num_output: 500
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "relu1"
  type: "ReLU"
  bottom: "ip1"
  top: "ip1"
}
layer {
  name: "ip2"
  type: "InnerProduct"
  bottom: "ip1"
  top: "ip2"
  inner_product_param {
    num_output: 10
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "loss"
  type: "SoftmaxWithLoss"
  bottom: "ip2"
  bottom: "label"
  top: "loss"
}
"""


def lenet(lmdb, batch_size):
    """The notebook's builder (examples/01-learning-lenet.ipynb)."""
    n = caffe.NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, backend=P.Data.LMDB, source=lmdb,
                             transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type="xavier"))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.ip1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label)
    return n.to_proto()


def parse(text):
    return text_format.Parse(text, pb.NetParameter())


# -- LeNet as the notebook writes it ------------------------------------------------------------
def test_lenet_gives_caffes_lenet_auto_train_prototxt():
    ours = str(lenet("examples/mnist/mnist_train_lmdb", 64))
    assert parse(ours) == parse(LENET_AUTO_TRAIN)
    mine, caffes = ours.splitlines(), LENET_AUTO_TRAIN.splitlines()
    assert len(mine) == len(caffes) == 99
    differ = [(a, b) for a, b in zip(mine, caffes) if a != b]
    assert differ == [("    scale: 0.00392156886", "    scale: 0.00392156862745")]
    assert ours.endswith("}\n")


def test_lenet_test_net_differs_only_in_source_and_batch():
    train, test = lenet("train_lmdb", 64), lenet("test_lmdb", 100)
    assert (test.layer[0].data_param.source, test.layer[0].data_param.batch_size) == (
        "test_lmdb", 100)
    test.layer[0].data_param.source, test.layer[0].data_param.batch_size = "train_lmdb", 64
    assert test == train


# -- CaffeNet from Caffe's examples/pycaffe/caffenet.py (stored unchanged beside the other
# BVLC examples; loaded with purine.pycaffe standing as `caffe`) ----------------------------
def _caffenet_builder():
    names = ("caffe", "caffe.proto", "caffe.proto.caffe_pb2")
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update({"caffe": caffe, "caffe.proto": caffe.proto,
                        "caffe.proto.caffe_pb2": caffe.proto.caffe_pb2})
    try:
        path = Path(__file__).parent / "examples" / "pycaffe" / "caffenet.py"
        spec = importlib.util.spec_from_file_location("bvlc_caffenet_example", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return module.caffenet


caffenet = _caffenet_builder()


CAFFENET_NAMES = [
    "Data1", "Convolution1", "ReLU1", "Pooling1", "LRN1", "Convolution2", "ReLU2", "Pooling2",
    "LRN2", "Convolution3", "ReLU3", "Convolution4", "ReLU4", "Convolution5", "ReLU5",
    "Pooling3", "InnerProduct1", "ReLU6", "Dropout1", "InnerProduct2", "ReLU7", "Dropout2",
    "InnerProduct3", "SoftmaxWithLoss1", "Accuracy1"]


def test_caffenet_builder_names_layers_and_tops_as_caffe():
    net = caffenet("/path/to/caffe-val-lmdb", batch_size=50, include_acc=True)
    assert [l.name for l in net.layer] == CAFFENET_NAMES
    data = net.layer[0]
    assert list(data.top) == ["Data1", "Data2"]
    assert list(data.transform_param.mean_value) == [104, 117, 123]
    assert (data.transform_param.crop_size, data.transform_param.mirror) == (227, True)
    assert (data.data_param.batch_size, data.data_param.backend) == (50, pb.DataParameter.LMDB)
    relu6 = net.layer[CAFFENET_NAMES.index("ReLU6")]
    assert list(relu6.bottom) == list(relu6.top) == ["InnerProduct1"]
    assert list(net.layer[-1].bottom) == ["InnerProduct3", "Data2"]
    assert [l.name for l in caffenet("x").layer] == CAFFENET_NAMES[:-1]


def test_caffenet_builder_matches_the_zoo_caffenet_layer_by_layer():
    ours = [l for l in caffenet("x").layer if l.type not in ("Data", "Accuracy")]
    zoo = [l for l in read_net(model_file("bvlc_reference_caffenet/train_val.prototxt")).layer
           if l.type not in ("Data", "Accuracy")]
    assert [l.type for l in ours] == [l.type for l in zoo]
    for a, b in zip(ours, zoo):
        for field in ("pooling_param", "lrn_param"):
            assert getattr(a, field) == getattr(b, field), b.name
        ca, cb = a.convolution_param, b.convolution_param
        assert (ca.num_output, ca.group, ca.kernel_size) == (cb.num_output, cb.group,
                                                             cb.kernel_size)
        # caffenet.py spells out stride=1 / pad=0 where the zoo file leaves Caffe's defaults.
        for field, default in (("stride", 1), ("pad", 0)):
            assert (list(getattr(ca, field)) or [default]) == (list(getattr(cb, field))
                                                               or [default]), b.name
        assert a.inner_product_param.num_output == b.inner_product_param.num_output


def test_caffenet_builds_with_60965224_parameters_and_zero_weights_give_log_1000():
    net_param = caffenet("unused")
    data = net_param.layer[0]
    data.type = "DummyData"  # stand in for the LMDB: same tops, zeros
    data.ClearField("data_param")
    data.ClearField("transform_param")
    data.dummy_data_param.shape.add(dim=[2, 3, 227, 227])
    data.dummy_data_param.shape.add(dim=[2])
    net = caffe.Net(net_param, caffe.TEST)
    shapes = {k: [b.data.shape for b in v] for k, v in net.params.items()}
    assert shapes == {
        "Convolution1": [(96, 3, 11, 11), (96,)], "Convolution2": [(256, 48, 5, 5), (256,)],
        "Convolution3": [(384, 256, 3, 3), (384,)], "Convolution4": [(384, 192, 3, 3), (384,)],
        "Convolution5": [(256, 192, 3, 3), (256,)], "InnerProduct1": [(4096, 9216), (4096,)],
        "InnerProduct2": [(4096, 4096), (4096,)], "InnerProduct3": [(1000, 4096), (1000,)]}
    assert sum(b.data.size for v in net.params.values() for b in v) == 60_965_224
    # No fillers in caffenet.py: Caffe's default constant 0, so every class scores 0.
    assert float(net.forward()["SoftmaxWithLoss1"]) == pytest.approx(math.log(1000), rel=1e-6)


# -- keyword routing ----------------------------------------------------------------------------
def test_param_name_dict_comes_from_the_parameter_message_names():
    names = param_name_dict()
    assert names["Convolution"] == "convolution"
    assert names["InnerProduct"] == "inner_product"
    assert names["TanH"] == "tanh"
    assert names["HDF5Data"] == "hdf5_data"
    assert names["Transformation"] == "transform"
    assert names["Python"] == "python"
    assert names["Recurrent"] == "recurrent"
    # Types whose settings live in another type's message have no entry, as in pycaffe.
    assert {"Deconvolution", "LSTM", "RNN", "SoftmaxWithLoss"}.isdisjoint(names)
    assert len(names) == len([f for f in pb.LayerParameter.DESCRIPTOR.fields
                              if f.name.endswith("_param")])


def test_lists_dicts_repeated_fields_and_layer_level_keywords():
    x = L.Input(shape=dict(dim=[2, 3, 8, 8]))
    conv = L.Convolution(x, kernel_size=[3, 5], pad=(1, 2), num_output=4, name="myconv",
                         param=[dict(lr_mult=1, decay_mult=1), dict(lr_mult=2, decay_mult=0)],
                         weight_filler=dict(type="gaussian", std=0.01),
                         bias_filler=dict(type="constant", value=0.5),
                         include=dict(phase=caffe.TRAIN), loss_weight=0)
    layer = caffe.to_proto(conv).layer[1]
    assert layer.name == "myconv"  # name= renames the layer, not its top
    assert list(layer.top) == ["Convolution1"]
    c = layer.convolution_param
    assert (list(c.kernel_size), list(c.pad), c.num_output) == ([3, 5], [1, 2], 4)
    assert [(p.lr_mult, p.decay_mult) for p in layer.param] == [(1, 1), (2, 0)]
    assert (c.weight_filler.type, c.weight_filler.std) == ("gaussian", pytest.approx(0.01))
    assert (c.bias_filler.type, c.bias_filler.value) == ("constant", 0.5)
    assert [r.phase for r in layer.include] == [caffe.TRAIN]
    assert list(layer.loss_weight) == [0]
    input_layer = caffe.to_proto(conv).layer[0]
    assert list(input_layer.input_param.shape[0].dim) == [2, 3, 8, 8]


def test_explicit_param_messages_and_types_without_their_own_message():
    x = L.Input(shape=dict(dim=[2, 3, 4, 4]))
    deconv = L.Deconvolution(x, convolution_param=dict(num_output=3, kernel_size=2, stride=2))
    lstm = L.LSTM(L.Input(shape=dict(dim=[5, 2, 3])), L.Input(shape=dict(dim=[5, 2])),
                  recurrent_param=dict(num_output=7))
    net = caffe.to_proto(deconv, lstm)
    assert [l.name for l in net.layer] == ["Input1", "Deconvolution1", "Input2", "Input3",
                                           "LSTM1"]
    assert net.layer[1].convolution_param.stride == [2]
    assert net.layer[4].recurrent_param.num_output == 7
    assert list(net.layer[4].bottom) == ["Input2", "Input3"]


def test_enum_params_resolve_from_the_parameter_messages():
    assert (P.Pooling.MAX, P.Pooling.AVE, P.Pooling.STOCHASTIC) == (0, 1, 2)
    assert (P.Data.LEVELDB, P.Data.LMDB) == (0, 1)
    assert (P.Eltwise.PROD, P.Eltwise.SUM, P.Eltwise.MAX) == (0, 1, 2)
    assert P.LRN.WITHIN_CHANNEL == 1
    assert P.Loss.VALID == pb.LossParameter.VALID == 1
    with pytest.raises(AttributeError):
        P.Pooling.MEDIAN  # noqa: B018
    pool = L.Pooling(L.Input(shape=dict(dim=[1, 1, 4, 4])), pool=P.Pooling.AVE, kernel_size=2)
    assert "pool: AVE" in str(pool.to_proto())


def test_python_layer_keywords_go_to_python_param(tmp_path, monkeypatch):
    module = write_layers(tmp_path, monkeypatch)
    n = caffe.NetSpec()
    n.x, n.y = L.Python(module=module, layer="DataLayer", ntop=2,
                        param_str=json.dumps({"batch": 4, "seed": 3, "pool": 16}))
    n.pred = L.InnerProduct(n.x, num_output=3, weight_filler=dict(type="gaussian", std=0.5))
    n.loss = L.Python(n.pred, n.y, python_param=dict(module=module, layer="EuclideanLossLayer"),
                      loss_weight=1)
    proto = n.to_proto()
    data = proto.layer[0].python_param
    assert (data.module, data.layer) == (module, "DataLayer")
    assert json.loads(data.param_str) == {"batch": 4, "seed": 3, "pool": 16}
    assert proto.layer[2].python_param.layer == "EuclideanLossLayer"
    net = caffe.Net(str(proto), caffe.TRAIN)
    net.forward()
    x, y = net.blobs["x"].data, net.blobs["y"].data
    w, b = (p.data for p in net.params["pred"])
    expect = np.sum((x @ w.T + b - y) ** 2) / 4 / 2
    assert net.blobs["loss"].data.shape == (1,)
    assert net.blobs["loss"].data[0] == pytest.approx(expect, rel=1e-5)
    assert expect > 0


# -- ntop, in_place, naming and order -----------------------------------------------------------
def test_in_place_ntop_and_automatic_names():
    x = L.Input(shape=dict(dim=[2, 3]))
    ip = L.InnerProduct(x, num_output=4)
    relu = L.ReLU(ip, in_place=True)
    out = L.InnerProduct(relu, num_output=2)
    net = out.to_proto()
    assert [(l.name, list(l.bottom), list(l.top)) for l in net.layer] == [
        ("Input1", [], ["Input1"]),
        ("InnerProduct1", ["Input1"], ["InnerProduct1"]),
        ("ReLU1", ["InnerProduct1"], ["InnerProduct1"]),
        ("InnerProduct2", ["InnerProduct1"], ["InnerProduct2"])]
    a, b, c = L.Slice(x, ntop=3, slice_point=[1, 2])
    assert isinstance(a, caffe.net_spec.Top) and (a.n, b.n, c.n) == (0, 1, 2)
    assert a.fn is b.fn is c.fn and a.fn.ntop == 3
    layer = caffe.to_proto(c).layer[1]
    assert list(layer.top) == ["Slice1", "Slice2", "Slice3"]
    assert list(layer.slice_param.slice_point) == [1, 2]


def test_names_follow_the_depth_first_walk_not_creation_order():
    x = L.Input(shape=dict(dim=[2, 3]))
    first = L.InnerProduct(x, num_output=3)   # created first, reached second
    second = L.InnerProduct(x, num_output=4)  # created second, reached first
    cat = L.Concat(second, first)
    net = caffe.to_proto(cat)
    assert [(l.name, l.inner_product_param.num_output) for l in net.layer] == [
        ("Input1", 0), ("InnerProduct1", 4), ("InnerProduct2", 3), ("Concat1", 0)]
    assert list(net.layer[3].bottom) == ["InnerProduct1", "InnerProduct2"]


def test_netspec_names_assigned_tops_and_counts_only_unnamed_ones():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3]))
    hidden = L.InnerProduct(n.data, num_output=4)  # never assigned: named automatically
    n["relu"] = L.ReLU(hidden, in_place=True)
    n.out = L.InnerProduct(n.relu, num_output=2)
    n.sil = L.Silence(n.out, ntop=0)
    net = n.to_proto()
    assert [(l.name, list(l.bottom), list(l.top)) for l in net.layer] == [
        ("data", [], ["data"]),
        ("InnerProduct1", ["data"], ["InnerProduct1"]),
        ("relu", ["InnerProduct1"], ["InnerProduct1"]),
        ("out", ["InnerProduct1"], ["out"]),
        ("sil", ["out"], [])]
    assert isinstance(n.sil, caffe.net_spec.Function) and n.sil.tops == ()
    assert n.keys() == ["data", "relu", "out", "sil"]
    assert n.vals()[2] is n["out"]


def test_ntop_zero_layer_without_a_name_counts_its_own_type():
    x = L.Input(shape=dict(dim=[2, 3]))
    n = caffe.NetSpec()
    n.a = L.InnerProduct(x, num_output=2)
    n.s1 = L.Silence(n.a, ntop=0)
    n.s2 = L.Silence(x, ntop=0)
    assert [l.name for l in n.to_proto().layer] == ["Input1", "a", "s1", "s2"]
    silences = caffe.to_proto(L.Silence(x, ntop=0), L.Silence(n.a, ntop=0))
    assert [l.name for l in silences.layer] == ["Input1", "Silence1", "InnerProduct1",
                                                 "Silence2"]


def test_netspec_update_delete_and_missing_names():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3]))
    n.ip = L.InnerProduct(n.data, num_output=2)
    n.update("ip", dict(num_output=7, bias_term=False))
    layer = n.to_proto().layer[1]
    assert (layer.inner_product_param.num_output, layer.inner_product_param.bias_term) == (
        7, False)
    del n["ip"]
    assert [l.name for l in n.to_proto().layer] == ["data"]
    assert not hasattr(n, "ip")
    with pytest.raises(KeyError, match="no top 'ip'"):
        n["ip"]
    with pytest.raises(AttributeError, match="no top 'ip'"):
        n.ip  # noqa: B018


def test_a_layer_shared_by_two_requested_tops_is_emitted_once():
    x = L.Input(shape=dict(dim=[2, 3]))
    ip = L.InnerProduct(x, num_output=10)
    label = L.Input(shape=dict(dim=[2]))
    net = caffe.to_proto(L.SoftmaxWithLoss(ip, label), L.Accuracy(ip, label))
    assert [l.name for l in net.layer] == ["Input1", "InnerProduct1", "Input2",
                                           "SoftmaxWithLoss1", "Accuracy1"]


# -- errors -------------------------------------------------------------------------------------
def test_an_unknown_keyword_is_an_attribute_error_naming_type_and_keyword():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 5, 5]))
    n.conv1 = L.Convolution(n.data, kernel=3, num_output=2)
    with pytest.raises(AttributeError, match=r"Convolution layer 'conv1': unknown keyword "
                       r"'kernel' \(no field 'kernel' in ConvolutionParameter or "
                       r"LayerParameter\)"):
        n.to_proto()
    with pytest.raises(AttributeError, match="SoftmaxWithLoss layer 'SoftmaxWithLoss1': "
                       "unknown keyword 'normalize' .no field 'normalize' in LayerParameter"):
        caffe.to_proto(L.SoftmaxWithLoss(n.data, n.data, normalize=False))
    with pytest.raises(AttributeError, match="Deconvolution layer .*'num_output'"):
        caffe.to_proto(L.Deconvolution(n.data, num_output=2))


def test_nested_and_misshapen_values_are_reported_with_the_keyword():
    x = L.Input(shape=dict(dim=[1, 1, 5, 5]))
    with pytest.raises(AttributeError, match="Convolution layer 'Convolution1': keyword "
                       "'weight_filler': FillerParameter has no field 'tpye'"):
        caffe.to_proto(L.Convolution(x, num_output=2, weight_filler=dict(tpye="xavier")))
    with pytest.raises(AttributeError, match="'weight_filler' needs a dict for "
                       "ConvolutionParameter.weight_filler"):
        caffe.to_proto(L.Convolution(x, num_output=2, weight_filler="xavier"))
    with pytest.raises(TypeError, match="Convolution layer 'Convolution1': keyword "
                       "'num_output'=2.5"):
        caffe.to_proto(L.Convolution(x, num_output=2.5))
    with pytest.raises(AttributeError, match="keyword 'param': ParamSpec has no field 'lr'"):
        caffe.to_proto(L.InnerProduct(x, num_output=2, param=[dict(lr=1)]))


def test_a_bottom_that_is_not_a_top_is_a_type_error():
    with pytest.raises(TypeError, match="Convolution input 1 is not a Top"):
        L.Convolution(L.Input(shape=dict(dim=[1, 1, 5, 5])), "data", num_output=2)


# -- the generated text loads and trains --------------------------------------------------------
@pytest.fixture(scope="module")
def mnist_lmdb(tmp_path_factory):
    x, y, _, _ = split_mnist_5k(n_test=1000)
    path = str(tmp_path_factory.mktemp("mnist") / "train_lmdb")
    write_mnist_lmdb(path, x[:320], y[:320])
    return path


SOLVER = """train_net: "{net}"
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
max_iter: 5
random_seed: 7
snapshot_prefix: "{prefix}"
"""


def train_five(tmp_path, name, text):
    net = tmp_path / f"{name}.prototxt"
    net.write_text(text)
    solver = tmp_path / f"{name}_solver.prototxt"
    solver.write_text(SOLVER.format(net=net, prefix=tmp_path / name))
    s = caffe.SGDSolver(str(solver))
    losses = []
    for _ in range(5):
        s.step(1)
        losses.append(float(s.net.blobs["loss"].data))
    return s, losses


def test_generated_lenet_trains_five_iterations_as_caffes_own_file(tmp_path, mnist_lmdb):
    ours, ours_losses = train_five(tmp_path, "ours", str(lenet(mnist_lmdb, 64)))
    caffes_text = LENET_AUTO_TRAIN.replace("examples/mnist/mnist_train_lmdb", mnist_lmdb)
    caffes, caffes_losses = train_five(tmp_path, "caffes", caffes_text)
    assert ours.iter == caffes.iter == 5
    assert [(k, v[0].data.shape) for k, v in ours.net.params.items()] == [
        ("conv1", (20, 1, 5, 5)), ("conv2", (50, 20, 5, 5)), ("ip1", (500, 800)),
        ("ip2", (10, 500))]
    assert ours.net.blobs["data"].data.shape == (64, 1, 28, 28)
    assert 0.0 <= ours.net.blobs["data"].data.min() < ours.net.blobs["data"].data.max() <= 1.0
    # Same net, same seed: the same losses and weights, bit for bit.
    assert ours_losses == caffes_losses
    for name, blobs in ours.net.params.items():
        for a, b in zip(blobs, caffes.net.params[name]):
            np.testing.assert_array_equal(a.data, b.data)
    # Ten classes from xavier weights start near log(10); SGD brings the loss down.
    assert ours_losses[0] == pytest.approx(math.log(10), abs=0.35)
    assert ours_losses[-1] < ours_losses[0]
