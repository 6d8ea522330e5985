"""Caffe's old formats: V1 and V0 versions of Caffe's own example nets upgrade to exactly their
current-format twins, build, and compute what the twins compute with the same weights; old
caffemodels keep their blobs; solver_type upgrades; the converter tools; the errors."""

import logging

import numpy as np
import pytest
from google.protobuf import text_format

from purine.caffe import TEST, TRAIN, Net
from purine.caffe.solver import read_solver
from purine.converters import upgrade as tools
from purine.datasets.mnist import load_mnist_5k, write_mnist_lmdb
from purine.errors import ProtoError
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import parse_text, read_net, replace_data_layers
from purine.formats.upgrade import V1_TYPE_NAMES, upgrade_net, upgrade_net_inputs, upgrade_solver
from purine.log import get_logger
from purine.zoo import model_file

V1 = pb.V1LayerParameter


def net_text(text):
    return parse_text(text, pb.NetParameter())


def assert_same(got, want):
    assert text_format.MessageToString(got) == text_format.MessageToString(want)
    assert got == want


def transfer_weights(src: Net, dst: Net, tmp_path):
    path = tmp_path / "weights.caffemodel"
    src.save(path)
    dst.copy_from(path)


def assert_same_blobs(a: Net, b: Net):
    assert list(a.blobs) == list(b.blobs)
    for name in a.blobs:
        assert np.array_equal(a.blobs[name].data, b.blobs[name].data), name


@pytest.fixture
def log_lines():
    """Messages of the project's logger during the test."""
    log = get_logger()
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log.addHandler(handler)
    yield lines
    log.removeHandler(handler)


# -- V1: Caffe's LeNet (examples/mnist/lenet_train_test.prototxt, 2014 form) ------------------
# The TRAIN data layer has the transformation field in data_param, as before transform_param;
# the TEST one already has transform_param.
LENET_V1 = """
name: "LeNet"
layers {
  name: "mnist"
  type: DATA
  top: "data"
  top: "label"
  data_param {
    source: "examples/mnist/mnist_train_lmdb"
    backend: LMDB
    batch_size: 64
    scale: 0.00390625
  }
  include: { phase: TRAIN }
}
layers {
  name: "mnist"
  type: DATA
  top: "data"
  top: "label"
  data_param {
    source: "examples/mnist/mnist_test_lmdb"
    backend: LMDB
    batch_size: 100
  }
  transform_param {
    scale: 0.00390625
  }
  include: { phase: TEST }
}
layers {
  name: "conv1"
  type: CONVOLUTION
  bottom: "data"
  top: "conv1"
  blobs_lr: 1
  blobs_lr: 2
  convolution_param {
    num_output: 20
    kernel_size: 5
    stride: 1
    weight_filler { type: "xavier" }
    bias_filler { type: "constant" }
  }
}
layers {
  name: "pool1"
  type: POOLING
  bottom: "conv1"
  top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 }
}
layers {
  name: "conv2"
  type: CONVOLUTION
  bottom: "pool1"
  top: "conv2"
  blobs_lr: 1
  blobs_lr: 2
  convolution_param {
    num_output: 50
    kernel_size: 5
    stride: 1
    weight_filler { type: "xavier" }
    bias_filler { type: "constant" }
  }
}
layers {
  name: "pool2"
  type: POOLING
  bottom: "conv2"
  top: "pool2"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 }
}
layers {
  name: "ip1"
  type: INNER_PRODUCT
  bottom: "pool2"
  top: "ip1"
  blobs_lr: 1
  blobs_lr: 2
  inner_product_param {
    num_output: 500
    weight_filler { type: "xavier" }
    bias_filler { type: "constant" }
  }
}
layers { name: "relu1" type: RELU bottom: "ip1" top: "ip1" }
layers {
  name: "ip2"
  type: INNER_PRODUCT
  bottom: "ip1"
  top: "ip2"
  blobs_lr: 1
  blobs_lr: 2
  inner_product_param {
    num_output: 10
    weight_filler { type: "xavier" }
    bias_filler { type: "constant" }
  }
}
layers {
  name: "accuracy"
  type: ACCURACY
  bottom: "ip2"
  bottom: "label"
  top: "accuracy"
  include: { phase: TEST }
}
layers {
  name: "loss"
  type: SOFTMAX_LOSS
  bottom: "ip2"
  bottom: "label"
  top: "loss"
}
"""


def lenet_twin():
    """Caffe's own current-format LeNet, as the project ships it."""
    return read_net(model_file("lenet/lenet_train_test.prototxt"))


def test_v1_lenet_upgrades_to_caffes_current_lenet():
    assert_same(upgrade_net(net_text(LENET_V1)), lenet_twin())


@pytest.fixture(scope="module")
def mnist_lmdb(tmp_path_factory):
    images, labels = load_mnist_5k()
    order = np.random.default_rng(1).permutation(len(labels))[:100]
    path = tmp_path_factory.mktemp("mnist") / "lmdb"
    write_mnist_lmdb(path, images[order], labels[order])
    return str(path), images[order], labels[order]


def with_source(net, source):
    for layer in net.layer:
        if layer.type == "Data":
            layer.data_param.source = source
    return net


@pytest.mark.parametrize("phase", [TRAIN, TEST])
def test_v1_lenet_builds_and_computes_what_the_twin_does(tmp_path, mnist_lmdb, phase):
    source, images, labels = mnist_lmdb
    old = Net(with_source(read_net(LENET_V1), source), phase=phase, seed=3)  # via read_net
    twin = Net(with_source(lenet_twin(), source), phase=phase, seed=4)
    transfer_weights(twin, old, tmp_path)
    old.forward()
    twin.forward()
    assert_same_blobs(old, twin)
    batch = 64 if phase == TRAIN else 100
    # The scale moved into transform_param still applies: pixels / 256.
    assert np.allclose(old.blobs["data"].data[:, 0], images[:batch] / 256.0)
    assert np.array_equal(old.blobs["label"].data, labels[:batch])
    assert old.loss == twin.loss and np.isfinite(old.loss)
    assert ("accuracy" in old.blobs) == (phase == TEST)


def v1_caffemodel(param: pb.NetParameter, weights: dict[str, list[np.ndarray]], *,
                  v0: bool = False) -> bytes:
    """An old caffemodel: the net's V1 (or V0) layers with their blobs in the legacy 4-d
    num/channels/height/width form, as Caffe wrote them before N-d blobs."""
    model = pb.NetParameter()
    model.CopyFrom(param)
    for layer in model.layers:
        name = layer.layer.name if v0 else layer.name
        for a in weights.get(name, []):
            shape = (1,) * (4 - a.ndim) + a.shape
            blob = pb.BlobProto(num=shape[0], channels=shape[1], height=shape[2],
                                width=shape[3], data=a.ravel().tolist())
            (layer.layer.blobs if v0 else layer.blobs).add().CopyFrom(blob)
    return model.SerializeToString()


def test_v1_caffemodel_upgrades_with_its_blobs_and_loads(tmp_path, mnist_lmdb):
    source = mnist_lmdb[0]
    twin = Net(with_source(lenet_twin(), source), phase=TEST, seed=5)
    weights = {name: [v.data.copy() for v in views] for name, views in twin.params.items()}
    old_path = tmp_path / "lenet_v1.caffemodel"
    old_path.write_bytes(v1_caffemodel(net_text(LENET_V1), weights))

    old = pb.NetParameter()
    old.ParseFromString(old_path.read_bytes())
    upgraded = upgrade_net(old)
    assert not upgraded.layers and [l.name for l in upgraded.layer] == [
        l.name for l in old.layers]
    for v1, layer in zip(old.layers, upgraded.layer):
        assert list(layer.blobs) == list(v1.blobs)

    new_path = tmp_path / "lenet.caffemodel"
    assert tools.main(["upgrade_net_proto_binary", str(old_path), str(new_path)]) == 0
    for path in (new_path, old_path):  # the upgraded file, and the V1 one read directly
        net = Net(with_source(lenet_twin(), source), phase=TEST, seed=6)
        net.copy_from(path)
        for name, arrays in weights.items():
            for v, a in zip(net.params[name], arrays):
                assert np.array_equal(v.data, a)
        net.forward()
        twin.forward()
        assert_same_blobs(net, twin)


# -- V1: parameter sharing, rules, every *_param ---------------------------------------------
SHARED_V1 = """
name: "SharedToy"
input: "pair"
input_dim: 4 input_dim: 6 input_dim: 1 input_dim: 1
layers { name: "slice" type: SLICE bottom: "pair" top: "a" top: "b"
         slice_param { slice_dim: 1 slice_point: 3 } }
layers { name: "ip_a" type: INNER_PRODUCT bottom: "a" top: "fa"
         param: "w" param: "bias" blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
         inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 }
                               bias_filler { type: "gaussian" std: 0.5 } } }
layers { name: "ip_b" type: INNER_PRODUCT bottom: "b" top: "fb"
         param: "w" param: "bias" blob_share_mode: PERMISSIVE
         blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
         inner_product_param { num_output: 5 } }
layers { name: "relu" type: RELU bottom: "fa" top: "fa" relu_param { negative_slope: 0.1 } }
layers { name: "tanh" type: TANH bottom: "fb" top: "fb" }
layers { name: "diff" type: ELTWISE bottom: "fa" bottom: "fb" top: "d"
         eltwise_param { operation: SUM coeff: 1 coeff: -1 } }
layers { name: "pow" type: POWER bottom: "d" top: "p"
         power_param { power: 2 scale: 0.5 shift: 1 } }
layers { name: "cat" type: CONCAT bottom: "fa" bottom: "p" top: "cat"
         concat_param { concat_dim: 1 } }
layers { name: "drop" type: DROPOUT bottom: "cat" top: "cat" dropout_param { dropout_ratio: 0.3 }
         include { phase: TRAIN } }
layers { name: "sig" type: SIGMOID bottom: "cat" top: "s"
         exclude { phase: TRAIN stage: "nosig" } }
layers { name: "loss" type: EUCLIDEAN_LOSS bottom: "fa" bottom: "fb" top: "loss"
         loss_weight: 0.5 }
"""

SHARED_V2 = """
name: "SharedToy"
input: "pair"
input_dim: 4 input_dim: 6 input_dim: 1 input_dim: 1
layer { name: "slice" type: "Slice" bottom: "pair" top: "a" top: "b"
        slice_param { slice_dim: 1 slice_point: 3 } }
layer { name: "ip_a" type: "InnerProduct" bottom: "a" top: "fa"
        param { name: "w" lr_mult: 1 decay_mult: 1 } param { name: "bias" lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "ip_b" type: "InnerProduct" bottom: "b" top: "fb"
        param { name: "w" share_mode: PERMISSIVE lr_mult: 1 decay_mult: 1 }
        param { name: "bias" lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 5 } }
layer { name: "relu" type: "ReLU" bottom: "fa" top: "fa" relu_param { negative_slope: 0.1 } }
layer { name: "tanh" type: "TanH" bottom: "fb" top: "fb" }
layer { name: "diff" type: "Eltwise" bottom: "fa" bottom: "fb" top: "d"
        eltwise_param { operation: SUM coeff: 1 coeff: -1 } }
layer { name: "pow" type: "Power" bottom: "d" top: "p"
        power_param { power: 2 scale: 0.5 shift: 1 } }
layer { name: "cat" type: "Concat" bottom: "fa" bottom: "p" top: "cat"
        concat_param { concat_dim: 1 } }
layer { name: "drop" type: "Dropout" bottom: "cat" top: "cat" dropout_param { dropout_ratio: 0.3 }
        include { phase: TRAIN } }
layer { name: "sig" type: "Sigmoid" bottom: "cat" top: "s"
        exclude { phase: TRAIN stage: "nosig" } }
layer { name: "loss" type: "EuclideanLoss" bottom: "fa" bottom: "fb" top: "loss"
        loss_weight: 0.5 }
"""


def test_v1_shared_params_and_rules_upgrade_exactly():
    assert_same(upgrade_net(net_text(SHARED_V1)), net_text(SHARED_V2))


@pytest.mark.parametrize("phase,stages", [(TEST, ()), (TRAIN, ("nosig",)), (TRAIN, ())])
def test_v1_shared_net_computes_what_the_twin_does(tmp_path, phase, stages):
    # One seed: Dropout's masks come from it (and the layer's index).
    old = Net(SHARED_V1, phase=phase, stages=stages, seed=7)
    twin = Net(SHARED_V2, phase=phase, stages=stages, seed=7)
    transfer_weights(twin, old, tmp_path)
    assert np.shares_memory(old.params["ip_a"][0].data, old.params["ip_b"][0].data)
    assert ("drop" in old.layer_names) == (phase == TRAIN)
    assert ("sig" in old.layer_names) == (stages != ("nosig",))
    x = np.random.default_rng(0).standard_normal((4, 6, 1, 1)).astype(np.float32)
    old.forward(pair=x)
    twin.forward(pair=x)
    assert_same_blobs(old, twin)
    assert old.loss == twin.loss > 0
    old.backward()
    twin.backward()
    for name in old.params:
        for p, q in zip(old.params[name], twin.params[name]):
            assert np.array_equal(p.diff, q.diff)
    assert np.abs(old.params["ip_a"][0].diff).sum() > 0


DATA_V1 = """
name: "OldData"
layers { name: "d" type: DATA top: "data" top: "label"
         data_param { source: "train_lmdb" backend: LMDB batch_size: 8 scale: 0.5
                      mean_file: "mean.binaryproto" crop_size: 4 mirror: true }
         include { phase: TRAIN min_level: 1 max_level: 3 stage: "s" not_stage: "t" } }
layers { name: "img" type: IMAGE_DATA top: "data" top: "label"
         image_data_param { source: "list.txt" batch_size: 2 new_height: 8 scale: 0.25
                            crop_size: 6 }
         transform_param { mirror: true mean_value: 104 } include { phase: TEST } }
layers { name: "win" type: WINDOW_DATA top: "wdata" top: "wlabel"
         window_data_param { source: "windows.txt" batch_size: 4 mean_file: "m.binaryproto"
                             mirror: false fg_threshold: 0.6 } }
layers { name: "mem" type: MEMORY_DATA top: "m" top: "ml"
         memory_data_param { batch_size: 1 channels: 1 height: 2 width: 2 }
         transform_param { scale: 2 } }
layers { name: "h5" type: HDF5_DATA top: "h" hdf5_data_param { source: "h5.txt" batch_size: 3 } }
"""

DATA_V2 = """
name: "OldData"
layer { name: "d" type: "Data" top: "data" top: "label"
        data_param { source: "train_lmdb" backend: LMDB batch_size: 8 }
        transform_param { scale: 0.5 mean_file: "mean.binaryproto" crop_size: 4 mirror: true }
        include { phase: TRAIN min_level: 1 max_level: 3 stage: "s" not_stage: "t" } }
layer { name: "img" type: "ImageData" top: "data" top: "label"
        image_data_param { source: "list.txt" batch_size: 2 new_height: 8 }
        transform_param { mirror: true mean_value: 104 scale: 0.25 crop_size: 6 }
        include { phase: TEST } }
layer { name: "win" type: "WindowData" top: "wdata" top: "wlabel"
        window_data_param { source: "windows.txt" batch_size: 4 fg_threshold: 0.6 }
        transform_param { mean_file: "m.binaryproto" mirror: false } }
layer { name: "mem" type: "MemoryData" top: "m" top: "ml"
        memory_data_param { batch_size: 1 channels: 1 height: 2 width: 2 }
        transform_param { scale: 2 } }
layer { name: "h5" type: "HDF5Data" top: "h" hdf5_data_param { source: "h5.txt" batch_size: 3 } }
"""


def test_v1_data_layers_move_transformation_fields_into_transform_param():
    assert_same(upgrade_net(net_text(DATA_V1)), net_text(DATA_V2))


# Caffe's UpgradeV1LayerType, written out from its switch.
CAFFE_V1_TYPES = """NONE: ; ABSVAL:AbsVal; ACCURACY:Accuracy; ARGMAX:ArgMax; BNLL:BNLL;
CONCAT:Concat; CONTRASTIVE_LOSS:ContrastiveLoss; CONVOLUTION:Convolution;
DECONVOLUTION:Deconvolution; DATA:Data; DROPOUT:Dropout; DUMMY_DATA:DummyData;
EUCLIDEAN_LOSS:EuclideanLoss; ELTWISE:Eltwise; EXP:Exp; FLATTEN:Flatten; HDF5_DATA:HDF5Data;
HDF5_OUTPUT:HDF5Output; HINGE_LOSS:HingeLoss; IM2COL:Im2col; IMAGE_DATA:ImageData;
INFOGAIN_LOSS:InfogainLoss; INNER_PRODUCT:InnerProduct; LRN:LRN; MEMORY_DATA:MemoryData;
MULTINOMIAL_LOGISTIC_LOSS:MultinomialLogisticLoss; MVN:MVN; POOLING:Pooling; POWER:Power;
RELU:ReLU; SIGMOID:Sigmoid; SIGMOID_CROSS_ENTROPY_LOSS:SigmoidCrossEntropyLoss;
SILENCE:Silence; SOFTMAX:Softmax; SOFTMAX_LOSS:SoftmaxWithLoss; SPLIT:Split; SLICE:Slice;
TANH:TanH; WINDOW_DATA:WindowData; THRESHOLD:Threshold"""


@pytest.mark.parametrize("pair", [p.strip() for p in CAFFE_V1_TYPES.split(";")])
def test_every_v1_type_gets_caffes_string(pair):
    enum_name, expected = pair.split(":")
    net = pb.NetParameter()
    net.layers.add(name="x", type=V1.LayerType.Value(enum_name))
    assert upgrade_net(net).layer[0].type == expected
    assert V1_TYPE_NAMES[V1.LayerType.Value(enum_name)] == expected


def test_every_v1_param_message_is_copied():
    names = [f.name for f in V1.DESCRIPTOR.fields if f.name.endswith("_param")]
    assert len(names) == 30
    net = pb.NetParameter()
    v1 = net.layers.add(name="x", type=V1.CONVOLUTION)
    for name in names:
        getattr(v1, name).SetInParent()
    v1.convolution_param.num_output = 7
    v1.loss_param.ignore_label = 3
    layer = upgrade_net(net).layer[0]
    assert all(layer.HasField(name) for name in names)
    assert layer.convolution_param.num_output == 7 and layer.loss_param.ignore_label == 3


# -- V0: an ImageNet-style net with padding layers (Caffe's 2013 imagenet.prototxt form) ------
IMAGENET_V0 = """
name: "CaffeNet"
layers {
  layer { name: "data" type: "data" source: "ilsvrc12_train_leveldb"
          meanfile: "imagenet_mean.binaryproto" batchsize: 4 cropsize: 31 mirror: true }
  top: "data" top: "label"
}
layers {
  layer { name: "conv1" type: "conv" num_output: 8 kernelsize: 5 stride: 2
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0 }
          blobs_lr: 1. blobs_lr: 2. weight_decay: 1. weight_decay: 0. }
  bottom: "data" top: "conv1"
}
layers { layer { name: "relu1" type: "relu" } bottom: "conv1" top: "conv1" }
layers { layer { name: "pool1" type: "pool" pool: MAX kernelsize: 3 stride: 2 }
         bottom: "conv1" top: "pool1" }
layers { layer { name: "norm1" type: "lrn" local_size: 5 alpha: 0.0001 beta: 0.75 }
         bottom: "pool1" top: "norm1" }
layers { layer { name: "pad2" type: "padding" pad: 2 } bottom: "norm1" top: "pad2" }
layers {
  layer { name: "conv2" type: "conv" num_output: 8 group: 2 kernelsize: 5
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 1 }
          blobs_lr: 1. blobs_lr: 2. weight_decay: 1. weight_decay: 0. }
  bottom: "pad2" top: "conv2"
}
layers { layer { name: "relu2" type: "relu" } bottom: "conv2" top: "conv2" }
layers { layer { name: "pool2" type: "pool" pool: MAX kernelsize: 3 stride: 2 }
         bottom: "conv2" top: "pool2" }
layers { layer { name: "pad3" type: "padding" pad: 1 } bottom: "pool2" top: "pad3" }
layers {
  layer { name: "conv3" type: "conv" num_output: 12 kernelsize: 3
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0 }
          blobs_lr: 1. blobs_lr: 2. weight_decay: 1. weight_decay: 0. }
  bottom: "pad3" top: "conv3"
}
layers { layer { name: "relu3" type: "relu" } bottom: "conv3" top: "conv3" }
layers { layer { name: "pad4" type: "padding" pad: 1 } bottom: "conv3" top: "pad4" }
layers {
  layer { name: "conv4" type: "conv" num_output: 8 group: 2 kernelsize: 3 biasterm: false
          weight_filler { type: "gaussian" std: 0.1 } blobs_lr: 1. weight_decay: 1. }
  bottom: "pad4" top: "conv4"
}
layers { layer { name: "relu4" type: "relu" } bottom: "conv4" top: "conv4" }
layers { layer { name: "pad5" type: "padding" pad: 1 } bottom: "conv4" top: "pad5" }
layers { layer { name: "pool5" type: "pool" pool: AVE kernelsize: 3 stride: 2 }
         bottom: "pad5" top: "pool5" }
layers {
  layer { name: "fc6" type: "innerproduct" num_output: 16
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 1 }
          blobs_lr: 1. blobs_lr: 2. weight_decay: 1. weight_decay: 0. }
  bottom: "pool5" top: "fc6"
}
layers { layer { name: "relu6" type: "relu" } bottom: "fc6" top: "fc6" }
layers { layer { name: "drop6" type: "dropout" dropout_ratio: 0.5 } bottom: "fc6" top: "fc6" }
layers {
  layer { name: "fc8" type: "innerproduct" num_output: 10
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0 }
          blobs_lr: 1. blobs_lr: 2. weight_decay: 1. weight_decay: 0. }
  bottom: "fc6" top: "fc8"
}
layers { layer { name: "prob" type: "softmax" } bottom: "fc8" top: "prob" }
layers { layer { name: "accuracy" type: "accuracy" } bottom: "prob" bottom: "label"
         top: "accuracy" }
layers { layer { name: "loss" type: "softmax_loss" } bottom: "fc8" bottom: "label" }
"""

IMAGENET_V2 = """
name: "CaffeNet"
layer { name: "data" type: "Data" top: "data" top: "label"
        transform_param { mirror: true crop_size: 31 mean_file: "imagenet_mean.binaryproto" }
        data_param { source: "ilsvrc12_train_leveldb" batch_size: 4 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 8 kernel_size: 5 stride: 2
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1"
        lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }
layer { name: "conv2" type: "Convolution" bottom: "norm1" top: "conv2"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 8 pad: 2 kernel_size: 5 group: 2
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv3" type: "Convolution" bottom: "pool2" top: "conv3"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 12 pad: 1 kernel_size: 3
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0 } } }
layer { name: "relu3" type: "ReLU" bottom: "conv3" top: "conv3" }
layer { name: "conv4" type: "Convolution" bottom: "conv3" top: "conv4"
        param { lr_mult: 1 decay_mult: 1 }
        convolution_param { num_output: 8 bias_term: false pad: 1 kernel_size: 3 group: 2
          weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu4" type: "ReLU" bottom: "conv4" top: "conv4" }
layer { name: "pool5" type: "Pooling" bottom: "conv4" top: "pool5"
        pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "fc6" type: "InnerProduct" bottom: "pool5" top: "fc6"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 16
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 1 } } }
layer { name: "relu6" type: "ReLU" bottom: "fc6" top: "fc6" }
layer { name: "drop6" type: "Dropout" bottom: "fc6" top: "fc6" dropout_param { dropout_ratio: 0.5 } }
layer { name: "fc8" type: "InnerProduct" bottom: "fc6" top: "fc8"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 10
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0 } } }
layer { name: "prob" type: "Softmax" bottom: "fc8" top: "prob" }
layer { name: "accuracy" type: "Accuracy" bottom: "prob" bottom: "label" top: "accuracy" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc8" bottom: "label" }
"""

IMAGENET_SHAPES = {"data": (4, 3, 31, 31), "label": (4,)}


def test_v0_imagenet_upgrades_exactly_with_padding_folded():
    v0 = net_text(IMAGENET_V0)
    assert sum(l.layer.type == "padding" for l in v0.layers) == 4
    assert_same(upgrade_net(v0), net_text(IMAGENET_V2))


@pytest.mark.parametrize("phase", [TRAIN, TEST])
def test_v0_imagenet_computes_what_the_twin_does(tmp_path, phase):
    old = Net(replace_data_layers(read_net(IMAGENET_V0), IMAGENET_SHAPES), phase=phase, seed=1)
    twin = Net(replace_data_layers(net_text(IMAGENET_V2), IMAGENET_SHAPES), phase=phase,
               seed=1)  # one seed: Dropout's masks come from it
    transfer_weights(twin, old, tmp_path)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(IMAGENET_SHAPES["data"]).astype(np.float32)
    y = rng.integers(0, 10, 4).astype(np.float32)
    old.forward(data=x, label=y)
    twin.forward(data=x, label=y)
    assert_same_blobs(old, twin)
    assert old.blobs["conv2"].shape == (4, 8, 7, 7)  # the pad of 2 keeps pool1's 7 x 7
    assert old.blobs["pool5"].shape == (4, 8, 2, 2)  # the pool took pad 1: ceil(2/2) + 1
    assert old.loss == twin.loss and np.isfinite(old.loss)


def test_v0_caffemodel_keeps_its_blobs(tmp_path):
    twin = Net(replace_data_layers(net_text(IMAGENET_V2), IMAGENET_SHAPES), phase=TEST, seed=9)
    weights = {name: [v.data.copy() for v in views] for name, views in twin.params.items()}
    old_path, new_path = tmp_path / "v0.caffemodel", tmp_path / "new.caffemodel"
    old_path.write_bytes(v1_caffemodel(net_text(IMAGENET_V0), weights, v0=True))
    assert tools.upgrade_net_proto_binary(old_path, new_path) == []
    new = pb.NetParameter()
    new.ParseFromString(new_path.read_bytes())
    assert not new.layers
    assert [(l.name, len(l.blobs)) for l in new.layer if l.blobs] == [
        ("conv1", 2), ("conv2", 2), ("conv3", 2), ("conv4", 1), ("fc6", 2), ("fc8", 2)]
    net = Net(replace_data_layers(read_net(IMAGENET_V0), IMAGENET_SHAPES), phase=TEST, seed=10)
    net.copy_from(new_path)
    for name, arrays in weights.items():
        for v, a in zip(net.params[name], arrays):
            assert np.array_equal(v.data, a)


# V0 deploy LeNet (Caffe's 2013 examples/lenet/lenet.prototxt): net-level input fields.
LENET_DEPLOY_V0 = """
name: "LeNet"
input: "data"
input_dim: 64
input_dim: 1
input_dim: 28
input_dim: 28
layers {
  layer { name: "conv1" type: "conv" num_output: 20 kernelsize: 5 stride: 1
          weight_filler { type: "xavier" } bias_filler { type: "constant" }
          blobs_lr: 1. blobs_lr: 2. }
  bottom: "data" top: "conv1"
}
layers { layer { name: "pool1" type: "pool" kernelsize: 2 stride: 2 pool: MAX }
         bottom: "conv1" top: "pool1" }
layers {
  layer { name: "conv2" type: "conv" num_output: 50 kernelsize: 5 stride: 1
          weight_filler { type: "xavier" } bias_filler { type: "constant" }
          blobs_lr: 1. blobs_lr: 2. }
  bottom: "pool1" top: "conv2"
}
layers { layer { name: "pool2" type: "pool" kernelsize: 2 stride: 2 pool: MAX }
         bottom: "conv2" top: "pool2" }
layers {
  layer { name: "ip1" type: "innerproduct" num_output: 500
          weight_filler { type: "xavier" } bias_filler { type: "constant" }
          blobs_lr: 1. blobs_lr: 2. }
  bottom: "pool2" top: "ip1"
}
layers { layer { name: "relu1" type: "relu" } bottom: "ip1" top: "ip1" }
layers {
  layer { name: "ip2" type: "innerproduct" num_output: 10
          weight_filler { type: "xavier" } bias_filler { type: "constant" }
          blobs_lr: 1. blobs_lr: 2. }
  bottom: "ip1" top: "ip2"
}
layers { layer { name: "prob" type: "softmax" } bottom: "ip2" top: "prob" }
"""


def lenet_deploy_twin():
    """Caffe's own current deploy LeNet; Caffe's input upgrade names its Input layer
    "input" where the shipped file says "data"."""
    twin = read_net(model_file("lenet/lenet.prototxt"))
    twin.layer[0].name = "input"
    return twin


def test_v0_lenet_deploy_upgrades_to_caffes_current_lenet(tmp_path):
    upgraded = upgrade_net(net_text(LENET_DEPLOY_V0))
    assert list(upgraded.input) == ["data"] and list(upgraded.input_dim) == [64, 1, 28, 28]
    assert_same(upgrade_net_inputs(upgraded), lenet_deploy_twin())

    old = Net(LENET_DEPLOY_V0, phase=TEST, seed=1)
    twin = Net(lenet_deploy_twin(), phase=TEST, seed=2)
    transfer_weights(twin, old, tmp_path)
    x = np.random.default_rng(2).uniform(0, 1, (64, 1, 28, 28)).astype(np.float32)
    old.forward(data=x)
    twin.forward(data=x)
    assert_same_blobs(old, twin)


BATCH_NORM_OLD = """name: "bn"
input: "a" input_shape { dim: 2 dim: 3 }
layer { name: "bn" type: "BatchNorm" bottom: "a" top: "b"
        param { lr_mult: 1 name: "m" } param { lr_mult: 1 } param { decay_mult: 2 } }
layer { name: "bn2" type: "BatchNorm" bottom: "a" top: "c" param { lr_mult: 0 } }
"""


def test_batch_norm_with_three_param_specs_gets_zero_multipliers(tmp_path):
    out = upgrade_net(net_text(BATCH_NORM_OLD))
    assert [(p.name, p.lr_mult, p.decay_mult) for p in out.layer[0].param] == [
        ("m", 0, 0), ("", 0, 0), ("", 0, 0)]
    assert out.layer[1] == net_text(BATCH_NORM_OLD).layer[1]  # not the old form: kept
    src, dst = tmp_path / "bn.prototxt", tmp_path / "bn_new.prototxt"
    src.write_text(BATCH_NORM_OLD)
    assert tools.main(["upgrade_net_proto_text", str(src), str(dst)]) == 0
    new = parse_text(dst.read_text(), pb.NetParameter())
    assert [l.name for l in new.layer] == ["input", "bn", "bn2"]
    assert [(p.lr_mult, p.decay_mult) for p in new.layer[1].param] == [(0, 0)] * 3
    net = Net(str(dst), phase=TRAIN)
    assert [p.count for p in net.params["bn"]] == [3, 3, 1]


def test_layer_entries_beside_v1_layers_are_dropped_with_a_warning():
    net = net_text("""name: "mixed"
        layers { name: "x" type: RELU bottom: "a" top: "a" }
        layer { name: "y" type: "ReLU" bottom: "a" top: "b" }
        layer { name: "z" type: "ReLU" bottom: "a" top: "c" }""")
    problems = []
    out = upgrade_net(net, problems)
    assert [l.name for l in out.layer] == ["x"]
    assert problems == ["net 'mixed': has both V1 'layers' and current 'layer' entries; the 2 "
                        "'layer' entries are ignored"]


def test_input_without_dims_is_dropped_as_caffe_does_for_old_caffemodels():
    net = net_text('input: "data" layer { name: "r" type: "ReLU" bottom: "x" top: "x" }')
    assert not upgrade_net_inputs(net).input
    net = net_text('input: "data" input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4')
    out = upgrade_net_inputs(net)
    assert not out.input and not out.input_dim
    assert out.layer[0].name == "input" and list(out.layer[0].input_param.shape[0].dim) == [
        1, 2, 3, 4]


# -- what Caffe warns about and what it stops on ------------------------------------------------
def test_v0_fields_a_type_has_no_use_for_are_dropped_with_a_warning(log_lines):
    net = net_text("""name: "w"
        input: "x" input_dim: 1 input_dim: 1 input_dim: 2 input_dim: 2
        layers { layer { name: "r" type: "relu" num_output: 3 kernelsize: 2 mirror: true }
                 bottom: "x" top: "x" }""")
    problems = []
    out = upgrade_net(net, problems)
    assert problems == [
        "net 'w': layer 'r': V0 parameter num_output does not apply to V0 type 'relu'; dropped",
        "net 'w': layer 'r': V0 parameter kernelsize does not apply to V0 type 'relu'; dropped"]
    assert out.layer[0].type == "ReLU" and out.layer[0].transform_param.mirror
    assert not log_lines
    upgrade_net(net)  # without a list: logged
    assert log_lines == problems


@pytest.mark.parametrize("text,message", [
    ('layers { layer { name: "c" type: "conv3d" } bottom: "x" top: "y" }',
     "net 'bad': layer 'c': unknown V0 layer type 'conv3d'; known types: accuracy, bnll"),
    ('layers { layer { name: "p" type: "padding" pad: 1 } bottom: "x" top: "xp" }'
     'layers { layer { name: "r" type: "relu" } bottom: "xp" top: "y" }',
     "net 'bad': layer 'r': padding layer 'p' feeds a layer of V0 type 'relu'; only conv and "
     "pool layers can take its pad"),
    ('layers { layer { name: "p" type: "padding" pad: 1 } bottom: "x" top: "xp" }'
     'layers { layer { name: "c" type: "conv" } bottom: "xp" bottom: "x" top: "y" }',
     "net 'bad': layer 'c': a conv layer fed by padding layer 'p' takes one bottom, it has 2"),
    ('layers { layer { name: "p" type: "padding" pad: 1 } bottom: "x" bottom: "x" top: "xp" }'
     'layers { layer { name: "c" type: "pool" } bottom: "xp" top: "y" }',
     "net 'bad': layer 'p': a padding layer takes one bottom and makes one top, it has 2 and 1"),
    ('layers { layer { name: "c" type: "conv" } bottom: "nowhere" top: "y" }',
     "net 'bad': layer 'c': unknown bottom blob 'nowhere' (bottom 0); no net input or earlier "
     "layer has it as a top"),
])
def test_what_caffe_stops_on_raises_naming_net_and_layer(text, message):
    net = net_text('name: "bad" input: "x" input_dim: 1 input_dim: 1 input_dim: 4 '
                   'input_dim: 4 ' + text)
    with pytest.raises(ProtoError) as e:
        upgrade_net(net)
    assert str(e.value).startswith(message)


def test_read_net_reports_an_upgrade_error_through_net():
    with pytest.raises(ProtoError, match="net 'bad': layer 'c': unknown V0 layer type"):
        Net('name: "bad" layers { layer { name: "c" type: "conv3d" } top: "y" }')


# -- solver -----------------------------------------------------------------------------------
@pytest.mark.parametrize("old,new", [("SGD", "SGD"), ("NESTEROV", "Nesterov"),
                                     ("ADAGRAD", "AdaGrad"), ("RMSPROP", "RMSProp"),
                                     ("ADADELTA", "AdaDelta"), ("ADAM", "Adam")])
def test_solver_type_enum_becomes_the_type_string(old, new):
    param = parse_text(f'base_lr: 0.01 solver_type: {old}', pb.SolverParameter())
    out = upgrade_solver(param)
    assert out.type == new and not out.HasField("solver_type")
    assert out.base_lr == pytest.approx(0.01)
    assert param.HasField("solver_type")  # the argument is left as it was


def test_solver_upgrade_keeps_current_solvers_and_refuses_both_fields():
    current = parse_text('type: "Adam" base_lr: 0.1', pb.SolverParameter())
    assert upgrade_solver(current) == current
    both = parse_text('type: "Adam" solver_type: NESTEROV', pb.SolverParameter())
    with pytest.raises(ProtoError, match=r"solver: both the old solver_type field \(NESTEROV\) "
                                         r"and the new type field \('Adam'\)"):
        upgrade_solver(both)


# -- converter commands ---------------------------------------------------------------------
def test_upgrade_net_proto_text_writes_the_current_form(tmp_path, log_lines):
    src, dst = tmp_path / "old.prototxt", tmp_path / "new.prototxt"
    src.write_text(LENET_V1)
    assert tools.main(["upgrade_net_proto_text", str(src), str(dst)]) == 0
    assert_same(read_net(dst), lenet_twin())
    assert "layers {" not in dst.read_text() and sorted(p.name for p in tmp_path.iterdir()) == [
        "new.prototxt", "old.prototxt"]
    assert log_lines[-1] == f"Wrote upgraded NetParameter text proto to {dst}"

    src.write_text(LENET_DEPLOY_V0)  # input fields become Caffe's Input layer
    assert tools.main(["upgrade_net_proto_text", str(src), str(dst)]) == 0
    assert_same(parse_text(dst.read_text(), pb.NetParameter()), lenet_deploy_twin())


def test_upgrade_net_proto_text_on_a_current_net_says_so_and_copies_it(tmp_path, log_lines):
    dst = tmp_path / "same.prototxt"
    src = model_file("lenet/lenet_train_test.prototxt")
    assert tools.main(["upgrade_net_proto_text", src, str(dst)]) == 0
    assert log_lines[0] == f"File already in latest proto format: {src}"
    assert_same(parse_text(dst.read_text(), pb.NetParameter()), lenet_twin())


def test_upgrade_with_problems_still_writes_and_exits_1(tmp_path, log_lines):
    src, dst = tmp_path / "old.prototxt", tmp_path / "new.prototxt"
    src.write_text('name: "w" input: "x" layers { layer { name: "r" type: "relu" group: 2 } '
                   'bottom: "x" top: "y" }')
    assert tools.main(["upgrade_net_proto_text", str(src), str(dst)]) == 1
    assert "net 'w': layer 'r': V0 parameter group does not apply to V0 type 'relu'; dropped" \
        in log_lines
    assert parse_text(dst.read_text(), pb.NetParameter()).layer[0].type == "ReLU"


def test_upgrade_solver_proto_text(tmp_path, log_lines):
    src, dst = tmp_path / "old_solver.prototxt", tmp_path / "solver.prototxt"
    src.write_text('net: "lenet_train_test.prototxt"\nbase_lr: 0.01\nmomentum: 0.9\n'
                   'solver_type: NESTEROV\nmax_iter: 10\n')
    assert tools.main(["upgrade_solver_proto_text", str(src), str(dst)]) == 0
    assert "solver_type" not in dst.read_text()
    param = read_solver(str(dst))
    assert param.type == "Nesterov" and param.momentum == pytest.approx(0.9)
    assert tools.main(["upgrade_solver_proto_text", str(dst), str(tmp_path / "again")]) == 0
    assert log_lines[-2] == f"File already in latest proto format: {dst}"


def test_converter_errors_name_the_file(tmp_path, capsys):
    missing = tmp_path / "missing.prototxt"
    assert tools.main(["upgrade_net_proto_text", str(missing), str(tmp_path / "o")]) == 1
    assert f"upgrade: {missing}: cannot read: No such file or directory" in capsys.readouterr().err
    bad = tmp_path / "bad.prototxt"
    bad.write_text('name: "x"\nlayers { nonsense: 1 }\n')
    assert tools.main(["upgrade_net_proto_text", str(bad), str(tmp_path / "o")]) == 1
    assert f"{bad}:2:" in capsys.readouterr().err
    garbage = tmp_path / "garbage.caffemodel"
    garbage.write_bytes(b"\xff\xff\xff\xff")
    assert tools.main(["upgrade_net_proto_binary", str(garbage), str(tmp_path / "o")]) == 1
    assert f"{garbage}: not a binary NetParameter" in capsys.readouterr().err
    both = tmp_path / "both.prototxt"
    both.write_text('type: "SGD" solver_type: ADAM')
    assert tools.main(["upgrade_solver_proto_text", str(both), str(tmp_path / "o")]) == 1
    assert f"solver {both}: both the old solver_type field (ADAM)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert tools.main(["upgrade_net_proto_text", str(bad)]) == 2  # usage: argparse says why
