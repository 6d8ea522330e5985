"""Caffe protobuf schema (proto/caffe.proto) and its bindings (purine/formats/caffe_pb2.py).

Of the project only ``purine.formats.caffe_pb2`` is imported (plus ``google.protobuf``), so
this file also runs in the venvs of tests/protobuf_compat.sh, which hold just protobuf and
pytest: purine/__init__.py and purine/formats/__init__.py import nothing.
"""

import ast
import importlib.util
import os
import pickle
import struct
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2, text_format

from purine.formats import caffe_pb2 as pb

# Labels/types are read from the embedded FileDescriptorProto: FieldDescriptor.label
# is gone in protobuf 7 and FieldDescriptor.is_repeated is missing in 4.21.
FD = descriptor_pb2.FieldDescriptorProto

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _embedded_fdp():
    return descriptor_pb2.FileDescriptorProto.FromString(pb._SERIALIZED_DESCRIPTOR)


_MESSAGES = {m.name: m for m in _embedded_fdp().message_type}


def _field(msg_cls, name):
    """FieldDescriptorProto of ``msg_cls.name`` (number, label, type, default_value, options)."""
    (f,) = [f for f in _MESSAGES[msg_cls.DESCRIPTOR.name].field if f.name == name]
    return f


def _fields(msg_cls):
    return _MESSAGES[msg_cls.DESCRIPTOR.name].field


# --------------------------------------------------------------------------- staleness


def test_embedded_descriptor_matches_proto_source():
    pytest.importorskip(
        "grpc_tools",
        reason="grpc_tools is not installed (pip install grpcio-tools); staleness check skipped",
    )
    spec = importlib.util.spec_from_file_location(
        "_purine_proto_generate", os.path.join(REPO_ROOT, "proto", "generate.py")
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.compile_descriptor()
    embedded = _embedded_fdp()
    assert fresh == embedded, (
        "purine/formats/caffe_pb2.py is stale relative to proto/caffe.proto: "
        "run `python proto/generate.py`"
    )
    assert [m.name for m in fresh.message_type] == [m.name for m in embedded.message_type]


# --------------------------------------------------------------------------- module shape


EXPECTED_MESSAGES = [
    "BlobShape",
    "BlobProto",
    "BlobProtoVector",
    "Datum",
    "FillerParameter",
    "NetParameter",
    "SolverParameter",
    "SolverState",
    "NetState",
    "NetStateRule",
    "ParamSpec",
    "LayerParameter",
    "TransformationParameter",
    "LossParameter",
    "AccuracyParameter",
    "ArgMaxParameter",
    "ClipParameter",
    "ConcatParameter",
    "BatchNormParameter",
    "BiasParameter",
    "ContrastiveLossParameter",
    "ConvolutionParameter",
    "CropParameter",
    "DataParameter",
    "DropoutParameter",
    "DummyDataParameter",
    "EltwiseParameter",
    "ELUParameter",
    "EmbedParameter",
    "ExpParameter",
    "FlattenParameter",
    "HDF5DataParameter",
    "HDF5OutputParameter",
    "HingeLossParameter",
    "ImageDataParameter",
    "InfogainLossParameter",
    "InnerProductParameter",
    "InputParameter",
    "LogParameter",
    "LRNParameter",
    "MemoryDataParameter",
    "MVNParameter",
    "ParameterParameter",
    "PoolingParameter",
    "PowerParameter",
    "PythonParameter",
    "RecurrentParameter",
    "ReductionParameter",
    "ReLUParameter",
    "ReshapeParameter",
    "ScaleParameter",
    "SigmoidParameter",
    "SliceParameter",
    "SoftmaxParameter",
    "SwishParameter",
    "TanHParameter",
    "TileParameter",
    "ThresholdParameter",
    "WindowDataParameter",
    "SPPParameter",
    "V1LayerParameter",
    "V0LayerParameter",
    "PReLUParameter",
]

# Appended after BVLC's messages: the Caffe forks' (SSD, Faster R-CNN, R-FCN, DeepLab,
# ShuffleNet, SegNet; see tests/formats/test_fork_schema.py for their fields).
FORK_MESSAGES = [
    "LabelMapItem", "LabelMap", "Sampler", "SampleConstraint", "BatchSampler",
    "EmitConstraint", "NormalizedBBox", "Annotation", "AnnotationGroup", "AnnotatedDatum",
    "ResizeParameter", "SaltPepperParameter", "NoiseParameter", "DistortionParameter",
    "ExpansionParameter", "AnnotatedDataParameter", "NonMaximumSuppressionParameter",
    "SaveOutputParameter", "MultiBoxLossParameter", "PermuteParameter",
    "NormalizeBBoxParameter", "PriorBoxParameter", "DetectionOutputParameter",
    "DetectionEvaluateParameter", "ROIPoolingParameter", "SmoothL1LossParameter",
    "ProposalParameter", "PSROIPoolingParameter", "InterpParameter",
    "ShuffleChannelParameter", "UpsampleParameter",
]
# LayerParameter fields the forks add (numbers asserted in tests/formats/test_fork_schema.py).
FORK_LAYER_FIELDS = {
    "annotated_data_param", "permute_param", "detection_output_param",
    "detection_evaluate_param", "norm_param", "prior_box_param", "multibox_loss_param",
    "roi_pooling_param", "smooth_l1_loss_param", "proposal_param", "psroi_pooling_param",
    "interp_param", "shuffle_channel_param", "upsample_param",
}


def test_descriptor_inventory():
    fdp = _embedded_fdp()
    assert fdp.package == "caffe"
    assert pb.DESCRIPTOR.package == "caffe"
    assert [m.name for m in fdp.message_type] == EXPECTED_MESSAGES + FORK_MESSAGES
    assert [e.name for e in fdp.enum_type] == ["Phase"]
    bvlc_enums = sum(len(m.enum_type) for m in fdp.message_type if m.name in EXPECTED_MESSAGES)
    assert bvlc_enums == 25
    # EmitConstraint 1, AnnotatedDatum 1, ResizeParameter 3, MultiBoxLoss 4, PriorBox 1
    assert sum(len(m.enum_type) for m in fdp.message_type) == 25 + 10
    for name in EXPECTED_MESSAGES + FORK_MESSAGES:
        cls = getattr(pb, name)
        assert cls.DESCRIPTOR.full_name == "caffe." + name
        assert cls.__module__ == pb.__name__ == "purine.formats.caffe_pb2"


def test_module_uses_only_portable_protobuf_apis():
    path = pb.__file__
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    assert source.startswith("# Generated by proto/generate.py")
    assert "python proto/generate.py" in source.splitlines()[1]
    assert "ValidateProtobufRuntimeVersion" not in source
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert imported == {"google.protobuf", "google.protobuf.internal"}


def test_importing_bindings_does_not_load_codegen_tools():
    code = "import sys, purine.formats.caffe_pb2; print('grpc_tools' in sys.modules)"
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_enum_constants_exposed_like_protoc_output():
    assert (pb.TRAIN, pb.TEST) == (0, 1)
    assert pb.Phase.Value("TEST") == 1 and pb.Phase.Name(0) == "TRAIN"
    assert pb.PoolingParameter.MAX == 0
    assert pb.PoolingParameter.AVE == 1
    assert pb.PoolingParameter.STOCHASTIC == 2
    assert pb.SolverParameter.GPU == 1 and pb.SolverParameter.CPU == 0
    assert pb.SolverParameter.BINARYPROTO == 1 and pb.SolverParameter.HDF5 == 0
    assert pb.SolverParameter.ADAM == 5
    assert pb.ConvolutionParameter.CUDNN == 2
    assert pb.DataParameter.LMDB == 1
    assert pb.EltwiseParameter.SUM == 1
    assert pb.LossParameter.VALID == 1 and pb.LossParameter.BATCH_SIZE == 2
    assert pb.ParamSpec.PERMISSIVE == 1
    assert pb.FillerParameter.AVERAGE == 2
    assert pb.ReductionParameter.MEAN == 4
    assert pb.HingeLossParameter.L2 == 2


def test_messages_pickle():
    net = pb.NetParameter(name="lenet")
    net.layer.add(name="ip", type="InnerProduct").inner_product_param.num_output = 10
    again = pickle.loads(pickle.dumps(net))
    assert again == net
    assert again.layer[0].inner_product_param.num_output == 10


# --------------------------------------------------------------------------- BVLC facts


def test_layer_parameter_field_numbers():
    expected = {
        "name": 1,
        "type": 2,
        "bottom": 3,
        "top": 4,
        "loss_weight": 5,
        "param": 6,
        "blobs": 7,
        "include": 8,
        "exclude": 9,
        "phase": 10,
        "propagate_down": 11,
        "transform_param": 100,
        "loss_param": 101,
        "accuracy_param": 102,
        "argmax_param": 103,
        "concat_param": 104,
        "convolution_param": 106,
        "data_param": 107,
        "dropout_param": 108,
        "eltwise_param": 110,
        "inner_product_param": 117,
        "lrn_param": 118,
        "pooling_param": 121,
        "relu_param": 123,
        "softmax_param": 125,
        "python_param": 130,
        "prelu_param": 131,
        "flatten_param": 135,
        "batch_norm_param": 139,
        "elu_param": 140,
        "bias_param": 141,
        "scale_param": 142,
        "input_param": 143,
        "crop_param": 144,
        "parameter_param": 145,
        "recurrent_param": 146,
        "swish_param": 147,
        "clip_param": 148,
    }
    got = {n: _field(pb.LayerParameter, n).number for n in expected}
    assert got == expected
    names = {f.name for f in _fields(pb.LayerParameter)}
    assert len(names - FORK_LAYER_FIELDS) == 60 and FORK_LAYER_FIELDS <= names
    assert len(pb.LayerParameter.DESCRIPTOR.fields) == len(_fields(pb.LayerParameter)) == 74
    for name in ("bottom", "top", "blobs", "param", "include", "exclude", "loss_weight"):
        assert _field(pb.LayerParameter, name).label == FD.LABEL_REPEATED
    assert _field(pb.LayerParameter, "phase").type_name == ".caffe.Phase"
    assert _field(pb.NetParameter, "layer").number == 100
    assert _field(pb.NetParameter, "layers").number == 2
    assert _field(pb.NetParameter, "layers").type_name == ".caffe.V1LayerParameter"
    assert _field(pb.NetParameter, "input_shape").number == 8


def test_convolution_and_pooling_defaults():
    c = pb.ConvolutionParameter()
    assert c.bias_term is True
    assert c.group == 1
    assert c.axis == 1
    assert c.engine == pb.ConvolutionParameter.DEFAULT
    assert c.pad_h == 0 and c.stride_h == 0 and not c.HasField("stride_h")
    assert not _field(pb.ConvolutionParameter, "stride_h").HasField("default_value")
    for name, number in (("pad", 3), ("kernel_size", 4), ("stride", 6), ("dilation", 18)):
        f = _field(pb.ConvolutionParameter, name)
        assert (f.number, f.label, f.type) == (number, FD.LABEL_REPEATED, FD.TYPE_UINT32)

    p = pb.PoolingParameter()
    assert p.pool == pb.PoolingParameter.MAX
    assert p.stride == 1 and p.pad == 0
    assert p.global_pooling is False
    assert p.round_mode == pb.PoolingParameter.CEIL
    assert _field(pb.PoolingParameter, "round_mode").number == 13
    assert _field(pb.PoolingParameter, "kernel_size").label == FD.LABEL_OPTIONAL


def test_lrn_and_misc_layer_defaults():
    lrn = pb.LRNParameter()
    assert lrn.local_size == 5
    assert lrn.alpha == 1.0
    assert lrn.beta == pytest.approx(0.75)
    assert lrn.k == 1.0
    assert lrn.norm_region == pb.LRNParameter.ACROSS_CHANNELS

    f = pb.FillerParameter()
    assert (f.type, f.value, f.min, f.max) == ("constant", 0, 0, 1)
    assert (f.mean, f.std, f.sparse) == (0, 1, -1)
    assert f.variance_norm == pb.FillerParameter.FAN_IN

    assert pb.DropoutParameter().dropout_ratio == 0.5
    assert (pb.ParamSpec().lr_mult, pb.ParamSpec().decay_mult) == (1.0, 1.0)
    assert pb.NetState().phase == pb.TEST
    assert pb.LossParameter().normalization == pb.LossParameter.VALID
    bn = pb.BatchNormParameter()
    assert bn.moving_average_fraction == pytest.approx(0.999)
    assert bn.eps == pytest.approx(1e-5)
    assert pb.EltwiseParameter().operation == pb.EltwiseParameter.SUM
    assert pb.EltwiseParameter().stable_prod_grad is True
    d = pb.DataParameter()
    assert (d.backend, d.prefetch, d.batch_size) == (pb.DataParameter.LEVELDB, 4, 0)
    assert pb.TransformationParameter().scale == 1.0
    assert pb.InnerProductParameter().bias_term is True
    assert pb.InnerProductParameter().transpose is False
    assert pb.ConcatParameter().axis == 1
    assert pb.SoftmaxParameter().axis == 1
    assert pb.CropParameter().axis == 2
    assert pb.FlattenParameter().end_axis == -1
    assert pb.ReshapeParameter().num_axes == -1
    assert pb.ScaleParameter().bias_term is False
    assert pb.SwishParameter().beta == 1.0
    assert pb.ELUParameter().alpha == 1.0
    assert pb.ExpParameter().base == -1.0
    assert pb.HingeLossParameter().norm == pb.HingeLossParameter.L1 == 1
    assert pb.ReductionParameter().operation == pb.ReductionParameter.SUM == 1
    assert pb.AccuracyParameter().top_k == 1
    assert pb.ImageDataParameter().batch_size == 1
    assert pb.ImageDataParameter().is_color is True
    assert pb.WindowDataParameter().crop_mode == "warp"
    assert pb.WindowDataParameter().fg_fraction == 0.25
    assert pb.MVNParameter().eps == pytest.approx(1e-9)
    assert pb.ThresholdParameter().threshold == 0.0
    assert pb.InfogainLossParameter().axis == 1
    for name, number in (("min", 1), ("max", 2)):
        f = _field(pb.ClipParameter, name)
        assert (f.number, f.label, f.type) == (number, FD.LABEL_REQUIRED, FD.TYPE_FLOAT)


def test_solver_parameter_defaults_and_numbers():
    s = pb.SolverParameter()
    assert s.solver_mode == pb.SolverParameter.GPU
    assert s.delta == pytest.approx(1e-8, rel=1e-6)
    assert s.momentum2 == pytest.approx(0.999, rel=1e-6)
    assert s.rms_decay == pytest.approx(0.99, rel=1e-6)
    assert s.snapshot_format == pb.SolverParameter.BINARYPROTO
    assert s.average_loss == 1
    assert s.iter_size == 1
    assert s.type == "SGD"
    assert s.clip_gradients == -1.0
    assert s.random_seed == -1
    assert s.regularization_type == "L2"
    assert s.test_initialization is True
    assert s.snapshot_after_train is True
    assert s.layer_wise_reduce is True
    assert s.solver_type == pb.SolverParameter.SGD
    assert (s.base_lr, s.max_iter, s.test_interval, s.device_id) == (0.0, 0, 0, 0)
    numbers = {
        "train_net": 1,
        "test_net": 2,
        "test_iter": 3,
        "test_interval": 4,
        "base_lr": 5,
        "display": 6,
        "max_iter": 7,
        "lr_policy": 8,
        "gamma": 9,
        "power": 10,
        "momentum": 11,
        "weight_decay": 12,
        "stepsize": 13,
        "snapshot": 14,
        "snapshot_prefix": 15,
        "solver_mode": 17,
        "device_id": 18,
        "random_seed": 20,
        "net": 24,
        "net_param": 25,
        "train_state": 26,
        "test_state": 27,
        "regularization_type": 29,
        "solver_type": 30,
        "delta": 31,
        "average_loss": 33,
        "stepvalue": 34,
        "clip_gradients": 35,
        "iter_size": 36,
        "snapshot_format": 37,
        "rms_decay": 38,
        "momentum2": 39,
        "type": 40,
        "layer_wise_reduce": 41,
        "weights": 42,
    }
    assert {n: _field(pb.SolverParameter, n).number for n in numbers} == numbers
    assert _field(pb.SolverParameter, "random_seed").type == FD.TYPE_INT64
    assert _field(pb.SolverParameter, "weights").label == FD.LABEL_REPEATED
    assert {f.name: f.number for f in _fields(pb.SolverState)} == {
        "iter": 1,
        "learned_net": 2,
        "history": 3,
        "current_step": 4,
        # the SSD fork's "plateau" lr policy state
        "minimum_loss": 5,
        "iter_last_event": 6,
    }


def test_blob_proto_layout_and_packed_wire_format():
    numbers = {
        "num": 1,
        "channels": 2,
        "height": 3,
        "width": 4,
        "data": 5,
        "diff": 6,
        "shape": 7,
        "double_data": 8,
        "double_diff": 9,
    }
    assert {n: _field(pb.BlobProto, n).number for n in numbers} == numbers
    packed = sorted(f.name for f in _fields(pb.BlobProto) if f.options.packed)
    assert packed == ["data", "diff", "double_data", "double_diff"]
    dim = _field(pb.BlobShape, "dim")
    assert dim.type == FD.TYPE_INT64 and dim.options.packed
    # Datum.float_data is NOT packed in BVLC's schema
    assert not _field(pb.Datum, "float_data").options.packed

    blob = pb.BlobProto(data=[1.0, 2.0])
    assert blob.SerializeToString() == b"\x2a\x08" + struct.pack("<2f", 1.0, 2.0)
    shape = pb.BlobShape(dim=[2, 3])
    assert shape.SerializeToString() == b"\x0a\x02\x02\x03"
    # proto2 parsers also accept the unpacked encoding (one tag per value)
    unpacked = b"".join(b"\x2d" + struct.pack("<f", v) for v in (4.0, 5.0))
    assert list(pb.BlobProto.FromString(unpacked).data) == [4.0, 5.0]


def test_dummy_data_and_input_parameter_shapes():
    dd = {f.name: f for f in _fields(pb.DummyDataParameter)}
    assert {n: dd[n].number for n in dd} == {
        "data_filler": 1,
        "num": 2,
        "channels": 3,
        "height": 4,
        "width": 5,
        "shape": 6,
    }
    assert all(f.label == FD.LABEL_REPEATED for f in dd.values())
    assert dd["shape"].type_name == ".caffe.BlobShape"
    assert dd["data_filler"].type_name == ".caffe.FillerParameter"
    inp = _field(pb.InputParameter, "shape")
    assert (inp.number, inp.label, inp.type_name) == (1, FD.LABEL_REPEATED, ".caffe.BlobShape")

    layer = text_format.Parse(
        'name: "data" type: "Input" top: "data" top: "label" '
        "input_param { shape { dim: 64 dim: 1 dim: 28 dim: 28 } shape { dim: 64 } }",
        pb.LayerParameter(),
    )
    assert [list(s.dim) for s in layer.input_param.shape] == [[64, 1, 28, 28], [64]]
    dummy = text_format.Parse(
        'data_filler { type: "gaussian" std: 0.5 } shape { dim: 2 dim: 3 }',
        pb.DummyDataParameter(),
    )
    assert dummy.data_filler[0].std == 0.5 and list(dummy.shape[0].dim) == [2, 3]


def test_v1_layer_type_enum_and_numbers():
    lt = pb.V1LayerParameter.LayerType
    expected = {
        "NONE": 0,
        "ACCURACY": 1,
        "BNLL": 2,
        "CONCAT": 3,
        "CONVOLUTION": 4,
        "DATA": 5,
        "DROPOUT": 6,
        "EUCLIDEAN_LOSS": 7,
        "FLATTEN": 8,
        "HDF5_DATA": 9,
        "HDF5_OUTPUT": 10,
        "IM2COL": 11,
        "IMAGE_DATA": 12,
        "INFOGAIN_LOSS": 13,
        "INNER_PRODUCT": 14,
        "LRN": 15,
        "MULTINOMIAL_LOGISTIC_LOSS": 16,
        "POOLING": 17,
        "RELU": 18,
        "SIGMOID": 19,
        "SOFTMAX": 20,
        "SOFTMAX_LOSS": 21,
        "SPLIT": 22,
        "TANH": 23,
        "WINDOW_DATA": 24,
        "ELTWISE": 25,
        "POWER": 26,
        "SIGMOID_CROSS_ENTROPY_LOSS": 27,
        "HINGE_LOSS": 28,
        "MEMORY_DATA": 29,
        "ARGMAX": 30,
        "THRESHOLD": 31,
        "DUMMY_DATA": 32,
        "SLICE": 33,
        "MVN": 34,
        "ABSVAL": 35,
        "SILENCE": 36,
        "CONTRASTIVE_LOSS": 37,
        "EXP": 38,
        "DECONVOLUTION": 39,
    }
    assert {k: lt.Value(k) for k in lt.keys()} == expected
    assert pb.V1LayerParameter.CONVOLUTION == 4
    assert pb.V1LayerParameter.INNER_PRODUCT == 14
    assert pb.V1LayerParameter.SOFTMAX_LOSS == 21
    assert pb.V1LayerParameter.STRICT == 0 and pb.V1LayerParameter.PERMISSIVE == 1
    v1 = {f.name: f for f in _fields(pb.V1LayerParameter)}
    numbers = {
        "layer": 1,
        "bottom": 2,
        "top": 3,
        "name": 4,
        "type": 5,
        "blobs": 6,
        "blobs_lr": 7,
        "weight_decay": 8,
        "concat_param": 9,
        "convolution_param": 10,
        "include": 32,
        "exclude": 33,
        "loss_weight": 35,
        "transform_param": 36,
        "loss_param": 42,
        "param": 1001,
        "blob_share_mode": 1002,
    }
    assert {n: v1[n].number for n in numbers} == numbers
    v0 = {f.name: f for f in _fields(pb.V0LayerParameter)}
    assert (v0["kernelsize"].number, v0["k"].number) == (8, 22)
    assert v0["hdf5_output_param"].number == 1001
    assert pb.V0LayerParameter().biasterm is True


# --------------------------------------------------------------------------- parsing


LENET = """
name: "LeNet"
layer {
  name: "mnist"
  type: "Data"
  top: "data"
  top: "label"
  include { phase: TRAIN }
  transform_param { scale: 0.00390625 }
  data_param { source: "examples/mnist/mnist_train_lmdb" batch_size: 64 backend: LMDB }
}
layer {
  name: "conv1"
  type: "Convolution"
  bottom: "data"
  top: "conv1"
  param { lr_mult: 1 }
  param { lr_mult: 2 }
  convolution_param {
    num_output: 20
    kernel_size: 5
    stride: 1
    weight_filler { type: "xavier" }
    bias_filler { type: "constant" }
  }
}
layer {
  name: "pool1"
  type: "Pooling"
  bottom: "conv1"
  top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 }
}
layer {
  name: "ip1"
  type: "InnerProduct"
  bottom: "pool1"
  top: "ip1"
  inner_product_param { num_output: 500 weight_filler { type: "xavier" } }
}
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer {
  name: "accuracy"
  type: "Accuracy"
  bottom: "ip1"
  bottom: "label"
  top: "accuracy"
  include { phase: TEST }
}
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""

SOLVER = """
net: "examples/mnist/lenet_train_test.prototxt"
test_iter: 100
test_interval: 500
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 100
max_iter: 10000
snapshot: 5000
snapshot_prefix: "examples/mnist/lenet"
solver_mode: CPU
"""


def test_lenet_prototxt_parses():
    net = text_format.Parse(LENET, pb.NetParameter())
    assert net.name == "LeNet"
    assert [l.name for l in net.layer] == [
        "mnist",
        "conv1",
        "pool1",
        "ip1",
        "relu1",
        "accuracy",
        "loss",
    ]
    data, conv, pool, ip, relu, acc, loss = net.layer
    assert data.include[0].phase == pb.TRAIN
    assert data.transform_param.scale == 0.00390625
    assert data.data_param.backend == pb.DataParameter.LMDB
    assert data.data_param.batch_size == 64
    assert [p.lr_mult for p in conv.param] == [1.0, 2.0]
    assert conv.convolution_param.num_output == 20
    assert list(conv.convolution_param.kernel_size) == [5]
    assert conv.convolution_param.weight_filler.type == "xavier"
    assert conv.convolution_param.bias_term is True  # default
    assert pool.pooling_param.pool == pb.PoolingParameter.MAX
    assert (pool.pooling_param.kernel_size, pool.pooling_param.stride) == (2, 2)
    assert ip.inner_product_param.num_output == 500
    assert list(relu.bottom) == list(relu.top) == ["ip1"]
    assert acc.include[0].phase == pb.TEST
    assert list(loss.bottom) == ["ip1", "label"]
    # text output re-parses to the same message
    assert text_format.Parse(text_format.MessageToString(net), pb.NetParameter()) == net


def test_solver_prototxt_parses():
    s = text_format.Parse(SOLVER, pb.SolverParameter())
    assert s.net == "examples/mnist/lenet_train_test.prototxt"
    assert list(s.test_iter) == [100]
    assert s.base_lr == pytest.approx(0.01)
    assert s.lr_policy == "inv"
    assert s.power == pytest.approx(0.75)
    assert s.max_iter == 10000
    assert s.solver_mode == pb.SolverParameter.CPU
    assert s.type == "SGD"  # default when unset


def test_binary_round_trip_with_blobs():
    net = pb.NetParameter(name="tiny")
    layer = net.layer.add(name="ip", type="InnerProduct", bottom=["data"], top=["ip"])
    layer.inner_product_param.num_output = 2
    w = layer.blobs.add()
    w.shape.dim.extend([2, 3])
    w.data.extend([0.5, -1.0, 2.0, 0.25, 3.0, -4.5])
    b = layer.blobs.add(double_data=[1e-300, -2.0])
    b.shape.dim.append(2)

    data = net.SerializeToString()
    back = pb.NetParameter()
    back.ParseFromString(data)
    assert back == net
    assert list(back.layer[0].blobs[0].shape.dim) == [2, 3]
    assert list(back.layer[0].blobs[0].data) == [0.5, -1.0, 2.0, 0.25, 3.0, -4.5]
    assert list(back.layer[0].blobs[1].double_data) == [1e-300, -2.0]
    assert back.layer[0].inner_product_param.num_output == 2
    # `layer` is field 100 (varint tag 0xa2 0x06) and is written after field 1 (name)
    assert data.startswith(b"\x0a\x04tiny\xa2\x06")

    state = pb.SolverState(iter=7, learned_net="x.caffemodel", history=[w])
    assert pb.SolverState.FromString(state.SerializeToString()) == state


def test_hand_encoded_caffemodel_bytes_parse():
    # NetParameter { layer { name: "c" blobs { shape { dim: 2 } data: [1.5, -2] } } },
    # encoded by hand from the BVLC field numbers.
    shape = b"\x0a\x01\x02"  # BlobShape.dim packed
    blob = b"\x3a" + bytes([len(shape)]) + shape  # BlobProto.shape = 7
    blob += b"\x2a\x08" + struct.pack("<2f", 1.5, -2.0)  # BlobProto.data = 5 packed
    layer = b"\x0a\x01c" + b"\x3a" + bytes([len(blob)]) + blob  # name = 1, blobs = 7
    raw = b"\xa2\x06" + bytes([len(layer)]) + layer  # NetParameter.layer = 100
    net = pb.NetParameter.FromString(raw)
    assert net.layer[0].name == "c"
    assert list(net.layer[0].blobs[0].shape.dim) == [2]
    assert list(net.layer[0].blobs[0].data) == [1.5, -2.0]


def test_v1_layers_snippet_parses():
    text = """
    name: "old"
    layers {
      name: "conv1"
      type: CONVOLUTION
      bottom: "data"
      top: "conv1"
      blobs_lr: 1
      blobs_lr: 2
      weight_decay: 1
      weight_decay: 0
      convolution_param { num_output: 96 kernel_size: 11 stride: 4 }
    }
    layers { name: "loss" type: SOFTMAX_LOSS bottom: "conv1" bottom: "label" }
    """
    net = text_format.Parse(text, pb.NetParameter())
    assert len(net.layer) == 0 and len(net.layers) == 2
    conv = net.layers[0]
    assert conv.type == pb.V1LayerParameter.CONVOLUTION
    assert list(conv.blobs_lr) == [1.0, 2.0]
    assert list(conv.weight_decay) == [1.0, 0.0]
    assert list(conv.convolution_param.kernel_size) == [11]
    assert net.layers[1].type == pb.V1LayerParameter.SOFTMAX_LOSS
    assert pb.NetParameter.FromString(net.SerializeToString()) == net


def test_v0_layers_snippet_parses():
    text = """
    name: "ancient"
    input: "data"
    input_dim: 10 input_dim: 3 input_dim: 227 input_dim: 227
    layers {
      layer {
        name: "conv1"
        type: "conv"
        num_output: 96
        kernelsize: 11
        stride: 4
        weight_filler { type: "gaussian" std: 0.01 }
        blobs_lr: 1.
        weight_decay: 1.
      }
      bottom: "data"
      top: "conv1"
    }
    """
    net = text_format.Parse(text, pb.NetParameter())
    assert list(net.input) == ["data"] and list(net.input_dim) == [10, 3, 227, 227]
    v0 = net.layers[0].layer
    assert (v0.name, v0.type, v0.num_output) == ("conv1", "conv", 96)
    assert (v0.kernelsize, v0.stride) == (11, 4)
    assert v0.weight_filler.std == pytest.approx(0.01)
    assert v0.biasterm is True and v0.group == 1  # defaults
    assert list(net.layers[0].bottom) == ["data"]
