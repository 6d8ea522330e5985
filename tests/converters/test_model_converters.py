"""The model converters: caffemodel <-> .npz round trips and refusals, caffemodel_summary's
counts, and ONNX export checked by running the exported model in onnxruntime against the
purine net's own forward pass, blob by blob."""

import os

import numpy as np
import pytest

from purine.caffe import TEST, Net
from purine.converters import ConvertError
from purine.converters.caffemodel_npz import (
    caffemodel_to_npz,
    layer_type,
    main,
    npz_main,
    npz_to_caffemodel,
    read_npz,
)
from purine.converters.summary import main as summary_main
from purine.converters.summary import summarize
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import load_weights
from purine.formats.prototxt import read_net
from tests.converters.helpers import Lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LENET = os.path.join(ROOT, "models", "lenet", "lenet.prototxt")

SMALL = """name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 6 dim: 6 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "sc" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 5 bias_term: false } }
"""
# conv 4*3*3*3 + 4 = 112; bn 4 + 4 + 1 = 9; sc 4 + 4 = 8; ip 5 * 64 = 320
SMALL_COUNTS = {"conv": 112, "bn": 9, "sc": 8, "ip": 320}

SHARED = """name: "shared"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 4 } } }
layer { name: "a" type: "InnerProduct" bottom: "data" top: "a"
  param { name: "w" } inner_product_param { num_output: 4 bias_term: false } }
layer { name: "b" type: "InnerProduct" bottom: "a" top: "b"
  param { name: "w" } inner_product_param { num_output: 4 bias_term: false } }
"""


def randomize(net, seed=0, scale=1.0):
    """Every parameter blob random (BatchNorm: positive variances, a factor of 2.5)."""
    rng = np.random.default_rng(seed)
    for name, views in net.params.items():
        for v in views:
            v.data[...] = rng.standard_normal(v.shape) * scale
        if net.layer_types[net.layer_names.index(name)] == "BatchNorm":
            views[1].data[...] = rng.uniform(0.5, 2.0, views[1].shape)
            views[2].data[...] = 2.5


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def saved_net(tmp_path, text=SMALL, seed=0):
    model = write(tmp_path, "net.prototxt", text)
    net = Net(model, phase=TEST)
    randomize(net, seed)
    net.save(tmp_path / "w.caffemodel")
    return model, net, str(tmp_path / "w.caffemodel")


# -- caffemodel <-> npz ------------------------------------------------------------------
def test_caffemodel_npz_caffemodel_round_trip(tmp_path, capsys):
    model, net, weights = saved_net(tmp_path)
    assert main([weights, str(tmp_path / "w.npz")]) == 0
    assert "8 arrays of 4 layers" in capsys.readouterr().err
    with np.load(tmp_path / "w.npz", allow_pickle=False) as npz:
        assert sorted(npz.files) == ["bn/0", "bn/1", "bn/2", "conv/0", "conv/1", "ip/0",
                                     "sc/0", "sc/1"]
        for name, views in net.params.items():
            for k, v in enumerate(views):
                a = npz[f"{name}/{k}"]
                assert a.dtype == np.float32 and a.shape == v.shape
                assert a.tobytes() == v.data.astype(np.float32).tobytes()
    out = tmp_path / "back.caffemodel"
    assert npz_main(["--model", model, str(tmp_path / "w.npz"), str(out)]) == 0
    before, after = load_weights(weights), load_weights(out)
    assert before.keys() == after.keys()
    for name in before:
        for a, b in zip(before[name], after[name], strict=True):
            assert a.shape == b.shape and a.tobytes() == b.tobytes()
    # Same layers, same encoder: the very bytes Net.save wrote.
    assert out.read_bytes() == open(weights, "rb").read()
    loaded = Net(model, str(out), phase=TEST)
    x = np.random.default_rng(1).standard_normal((2, 3, 6, 6))
    assert np.array_equal(loaded.forward(data=x)["ip"], net.forward(data=x)["ip"])


def test_npz_layer_names_with_slashes_and_legacy_shapes(tmp_path):
    text = SMALL.replace('name: "ip"', 'name: "head/ip"')
    model = write(tmp_path, "net.prototxt", text)
    net = Net(model, phase=TEST)
    randomize(net)
    arrays = {f"{n}/{k}": v.data.copy() for n, vs in net.params.items()
              for k, v in enumerate(vs)}
    # Old caffemodels store every blob 4-d: (1, 1, 5, 64) for the (5, 64) weights.
    arrays["head/ip/0"] = arrays["head/ip/0"].reshape(1, 1, 5, 64)
    np.savez(tmp_path / "w.npz", **arrays)
    assert read_npz(tmp_path / "w.npz")[("head/ip", 0)].shape == (1, 1, 5, 64)
    npz_to_caffemodel(model, tmp_path / "w.npz", tmp_path / "w.caffemodel")
    w = load_weights(tmp_path / "w.caffemodel")
    assert w["head/ip"][0].shape == (5, 64)
    assert np.array_equal(w["head/ip"][0], net.params["head/ip"][0].data)


def test_npz_errors_name_layer_index_and_shapes(tmp_path, capsys):
    model, net, weights = saved_net(tmp_path)
    arrays = caffemodel_to_npz(weights, tmp_path / "w.npz")

    def save(name, **changes):
        a = dict(arrays)
        for k, v in changes.items():
            k = k.replace("__", "/")
            if v is None:
                del a[k]
            else:
                a[k] = v
        np.savez(tmp_path / name, **a)
        return tmp_path / name

    out = tmp_path / "o.caffemodel"
    with pytest.raises(ConvertError, match=r"no array 'conv/1' for layer 'conv' parameter 1; "
                                           r"the net expects shape \(4,\)"):
        npz_to_caffemodel(model, save("missing.npz", conv__1=None), out)
    with pytest.raises(ConvertError, match=r"array 'ip/0' \(layer 'ip' parameter 0\) has shape "
                                           r"\(64, 5\), the net expects \(5, 64\)"):
        npz_to_caffemodel(model, save("shape.npz", ip__0=np.zeros((64, 5))), out)
    with pytest.raises(ConvertError, match="key 'conv_w' is not 'layer/index'"):
        npz_to_caffemodel(model, save("key.npz", conv_w=np.zeros(2)), out)
    np.savez(tmp_path / "obj.npz", **{"conv/0": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(ConvertError, match="'conv/0' is not a plain array"):
        read_npz(tmp_path / "obj.npz")
    np.savez(tmp_path / "str.npz", **{"conv/0": np.array(["x"])})
    with pytest.raises(ConvertError, match="dtype <U1, not a real number type"):
        read_npz(tmp_path / "str.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ConvertError, match="not an .npz archive"):
        read_npz(tmp_path / "junk.npz")
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(ConvertError, match=r"holds one array \(.npy\)"):
        read_npz(tmp_path / "one.npy")
    assert not out.exists()
    # From the command line: one line and exit 1.
    assert npz_main(["--model", model, str(tmp_path / "missing.npz"), str(out)]) == 1
    assert "npz_to_caffemodel: " in capsys.readouterr().err
    # Arrays no layer takes are reported, and the rest is written.
    lines = Lines("npz-test")
    npz_to_caffemodel(model, save("extra.npz", old__0=np.zeros(2)), out, log=lines.log)
    assert lines.lines and "old/0" in lines.lines[0]
    assert out.exists()


def test_shared_parameters(tmp_path):
    model, net, weights = saved_net(tmp_path, SHARED)
    arrays = caffemodel_to_npz(weights, tmp_path / "w.npz")
    assert np.array_equal(arrays["a/0"], arrays["b/0"])  # Caffe stores it for both layers
    only_owner = {"a/0": arrays["a/0"]}
    np.savez(tmp_path / "owner.npz", **only_owner)
    npz_to_caffemodel(model, tmp_path / "owner.npz", tmp_path / "o.caffemodel")
    w = load_weights(tmp_path / "o.caffemodel")
    assert np.array_equal(w["b"][0], arrays["a/0"])
    np.savez(tmp_path / "differ.npz", **{"a/0": arrays["a/0"], "b/0": arrays["a/0"] + 1})
    with pytest.raises(ConvertError, match="arrays 'a/0' and 'b/0' differ.*ParamSpec name 'w'"):
        npz_to_caffemodel(model, tmp_path / "differ.npz", tmp_path / "o.caffemodel")


def test_caffemodel_refusals(tmp_path, capsys):
    (tmp_path / "text.caffemodel").write_text("name: 'x'\n")
    assert main([str(tmp_path / "text.caffemodel"), str(tmp_path / "o.npz")]) == 1
    err = capsys.readouterr().err
    assert "not a binary .caffemodel" in err or "holds no layers" in err
    empty = pb.NetParameter(name="e", layer=[pb.LayerParameter(name="relu", type="ReLU")])
    (tmp_path / "e.caffemodel").write_bytes(empty.SerializeToString())
    with pytest.raises(ConvertError, match="no layer holds parameter blobs"):
        caffemodel_to_npz(tmp_path / "e.caffemodel", tmp_path / "o.npz")
    assert main([str(tmp_path / "missing.caffemodel"), str(tmp_path / "o.npz")]) == 1
    assert "cannot read" in capsys.readouterr().err


# -- summary ------------------------------------------------------------------------------
def _row(text, layer):
    return next(line.split() for line in text.splitlines() if line.split()[:1] == [layer])


def test_summary_of_a_small_net(tmp_path, capsys):
    model, net, weights = saved_net(tmp_path)
    text = summarize(weights)
    for layer, n in SMALL_COUNTS.items():
        assert _row(text, layer)[-1] == str(n)
    assert _row(text, "conv")[:4] == ["conv", "Convolution", "4x3x3x3,", "4"]
    assert _row(text, "bn")[2:5] == ["4,", "4,", "1"]
    assert _row(text, "relu")[2:] == ["-", "0"]
    assert f"total parameters: {sum(SMALL_COUNTS.values())}" in text
    assert "6 layers, 4 with parameters" in text
    assert summary_main([weights, "--model", model]) == 0
    out = capsys.readouterr().out
    assert _row(out, "conv")[2:4] == ["conv", "2x4x4x4"]
    assert _row(out, "ip")[2:] == ["ip", "2x5", "5x64", "320"]
    assert f"total parameters: {sum(SMALL_COUNTS.values())}" in out


def test_summary_of_lenet(tmp_path):
    net = Net(LENET, phase=TEST)
    randomize(net, scale=0.1)
    net.save(tmp_path / "lenet.caffemodel")
    text = summarize(tmp_path / "lenet.caffemodel", LENET)
    counts = {"conv1": 20 * 25 + 20, "conv2": 50 * 20 * 25 + 50, "ip1": 500 * 800 + 500,
              "ip2": 10 * 500 + 10, "pool1": 0, "relu1": 0, "prob": 0}
    for layer, n in counts.items():
        assert _row(text, layer)[-1] == str(n)
    assert _row(text, "conv1")[2:4] == ["conv1", "64x20x24x24"]
    assert _row(text, "pool2")[2:4] == ["pool2", "64x50x4x4"]
    assert _row(text, "ip1")[4:6] == ["500x800,", "500"]
    assert "total parameters: 431080" in text
    assert "9 layers, 4 with parameters" in text


def test_summary_flags_what_the_net_and_file_disagree_on(tmp_path):
    model, net, weights = saved_net(tmp_path, SHARED)
    text = summarize(weights)
    assert _row(text, "a")[-1] == "16"
    assert _row(text, "b")[-2:] == ["0", "(shared)"]  # one blob, counted once
    assert "total parameters: 16" in text
    other = write(tmp_path, "other.prototxt", SHARED.replace('name: "b"', 'name: "c"'))
    text = summarize(weights, other)
    assert " ".join(_row(text, "b")[2:]) == "- 4x4 0 (shared) not in the net"
    assert " ".join(_row(text, "c")[2:]) == "b 2x4 - 0 not in the file; net: 4x4"
    assert "total parameters: 16\n" in text
    no_b = write(tmp_path, "no_b.prototxt", SHARED.replace('param { name: "w" } ', ""))
    other_model = Net(no_b, phase=TEST)
    other_model.save(tmp_path / "no_share.caffemodel")
    text = summarize(tmp_path / "no_share.caffemodel", other)
    assert "total parameters: 16 (and 16 in layers the net lacks)" in text


def test_summary_flags_shapes_the_net_disagrees_with(tmp_path):
    model, net, weights = saved_net(tmp_path)
    wider = write(tmp_path, "wider.prototxt", SMALL.replace("num_output: 5", "num_output: 6"))
    text = summarize(weights, wider)
    assert " ".join(_row(text, "ip")[2:]) == "ip 2x6 5x64 320 net expects 6x64"
    assert _row(text, "conv")[-1] == "112"  # no note where they agree


def test_v1_layer_types_are_named():
    v1 = pb.V1LayerParameter(name="conv", type=pb.V1LayerParameter.CONVOLUTION)
    assert layer_type(v1) == "CONVOLUTION"
    assert layer_type(pb.LayerParameter(name="c", type="Convolution")) == "Convolution"


# -- ONNX ---------------------------------------------------------------------------------
MIX_A = """name: "mix_a"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" batch_norm_param { eps: 0.001 } }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" relu_param { negative_slope: 0.1 } }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 4 kernel_size: 3 pad: 2 dilation: 2 group: 2 } }
layer { name: "norm" type: "LRN" bottom: "conv1" top: "norm"
  lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 2 } }
layer { name: "cat" type: "Concat" bottom: "conv2" bottom: "norm" top: "cat" }
layer { name: "sum" type: "Eltwise" bottom: "conv2" bottom: "norm" top: "sum"
  eltwise_param { operation: SUM coeff: 0.5 coeff: -1 } }
layer { name: "prod" type: "Eltwise" bottom: "conv2" bottom: "norm" bottom: "sum" top: "prod"
  eltwise_param { operation: PROD } }
layer { name: "max" type: "Eltwise" bottom: "sum" bottom: "prod" top: "max"
  eltwise_param { operation: MAX } }
layer { name: "bn2" type: "BatchNorm" bottom: "max" top: "bn2" }
layer { name: "sc2" type: "Scale" bottom: "bn2" top: "sc2" scale_param { axis: 2 num_axes: 2 } }
# 8 -> ceil(5/2)+1 = 4 (floor would give 3)
layer { name: "pmax" type: "Pooling" bottom: "cat" top: "pmax"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
# 8 -> ceil(7/2)+1 = 5, the last window half in the padding: Caffe divides by 2, not 3 or 1
layer { name: "pave" type: "Pooling" bottom: "cat" top: "pave"
  pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
# 8 -> ceil(8/3)+1 = 4, then the window starting in the padding is dropped: 3
layer { name: "pave2" type: "Pooling" bottom: "sc2" top: "pave2"
  pooling_param { pool: AVE kernel_h: 2 kernel_w: 3 stride_h: 3 stride_w: 2 pad_h: 1 pad_w: 1 } }
layer { name: "pmax2" type: "Pooling" bottom: "sc2" top: "pmax2"
  pooling_param { pool: MAX kernel_size: 2 stride: 3 pad: 1 } }
layer { name: "ip" type: "InnerProduct" bottom: "pave" top: "ip" inner_product_param { num_output: 6 } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""

MIX_B = """name: "mix_b"
layer { name: "data" type: "Input" top: "data" top: "gate"
  input_param { shape { dim: 2 dim: 4 dim: 5 dim: 5 } shape { dim: 2 dim: 4 } } }
layer { name: "sig" type: "Sigmoid" bottom: "data" top: "sig" }
layer { name: "tanh" type: "TanH" bottom: "data" top: "tanh" }
layer { name: "drop" type: "Dropout" bottom: "tanh" top: "tanh" dropout_param { dropout_ratio: 0.3 } }
layer { name: "gated" type: "Scale" bottom: "sig" bottom: "gate" top: "gated" scale_param { axis: 0 } }
layer { name: "bias" type: "Bias" bottom: "gated" top: "biased" }
layer { name: "within" type: "LRN" bottom: "biased" top: "within"
  lrn_param { local_size: 3 alpha: 0.3 beta: 0.6 norm_region: WITHIN_CHANNEL } }
layer { name: "up" type: "Deconvolution" bottom: "within" top: "up"
  convolution_param { num_output: 2 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "gap" type: "Pooling" bottom: "up" top: "gap" pooling_param { pool: AVE global_pooling: true } }
layer { name: "gmp" type: "Pooling" bottom: "tanh" top: "gmp" pooling_param { pool: MAX global_pooling: true } }
layer { name: "flat" type: "Flatten" bottom: "within" top: "flat" flatten_param { axis: 2 } }
layer { name: "ip_axis" type: "InnerProduct" bottom: "flat" top: "ip_axis"
  inner_product_param { num_output: 3 axis: 2 } }
layer { name: "ip_t" type: "InnerProduct" bottom: "tanh" top: "ip_t"
  inner_product_param { num_output: 7 transpose: true } }
layer { name: "shape" type: "Reshape" bottom: "ip_axis" top: "shape"
  reshape_param { shape { dim: 0 dim: -1 } } }
layer { name: "soft" type: "Softmax" bottom: "ip_axis" top: "soft" softmax_param { axis: 1 } }
layer { name: "one" type: "Concat" bottom: "gmp" top: "gmp_alias" }
"""


def onnx_modules():
    onnx = pytest.importorskip("onnx", reason="ONNX export needs the onnx package "
                                              "(pip install onnx onnxruntime)")
    ort = pytest.importorskip("onnxruntime", reason="running exported models needs "
                                                    "onnxruntime (pip install onnxruntime)")
    return onnx, ort


def run_onnx(model, feeds):
    """Every tensor of the exported graph that a node writes, by name, from onnxruntime
    (each output declared with the type shape inference gives it: Resize's sizes are int64;
    the feeds as float32)."""
    onnx, ort = onnx_modules()
    m = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in m.graph.value_info}
    have = {o.name for o in m.graph.output}
    for node in m.graph.node:
        for name in node.output:
            if name not in have:
                m.graph.output.append(onnx.helper.make_tensor_value_info(
                    name, types.get(name, onnx.TensorProto.FLOAT), None))
                have.add(name)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {k: np.asarray(v, np.float32)
                                           for k, v in feeds.items()}), strict=True))


def assert_agrees(model, net, feeds, expect=()):
    """onnxruntime's tensors equal the net's blobs of the same name to 1e-5 of their
    magnitude; returns the names compared (``expect`` must be among them)."""
    ref = net.forward(**feeds)
    got = run_onnx(model, {k: v.astype(np.float32) for k, v in feeds.items()})
    compared = []
    for name in net.blobs:
        if name in got:
            want = net.blobs[name].data
            assert got[name].shape == want.shape, name
            scale = max(float(np.abs(want).max()), 1e-12)
            err = float(np.abs(got[name] - want).max())
            assert err <= 1e-5 * scale, f"{name}: max error {err} of magnitude {scale}"
            compared.append(name)
    for name in ref:  # the net's outputs are the graph's outputs, by name
        assert name in compared
    assert set(expect) <= set(compared), set(expect) - set(compared)
    return compared


def exported(tmp_path, text, seed=0, scale=0.5):
    from purine.converters.onnx_export import OPSET, caffe_to_onnx

    onnx, _ = onnx_modules()
    model = write(tmp_path, "deploy.prototxt", text)
    net = Net(model, phase=TEST)
    randomize(net, seed, scale)
    net.save(tmp_path / "w.caffemodel")
    proto = caffe_to_onnx(model, tmp_path / "w.caffemodel", tmp_path / "net.onnx")
    loaded = onnx.load(str(tmp_path / "net.onnx"))
    assert loaded.opset_import[0].version == OPSET
    return loaded, net, proto


def test_onnx_lenet(tmp_path, capsys):
    from purine.converters.onnx_export import main as onnx_main

    onnx_modules()
    param = read_net(LENET)
    param.layer[0].input_param.shape[0].dim[0] = 3
    text = str(param)
    model, net, _ = exported(tmp_path, text, scale=0.05)
    x = np.random.default_rng(2).standard_normal((3, 1, 28, 28))
    names = assert_agrees(model, net, {"data": x})
    assert names == ["conv1", "pool1", "conv2", "pool2", "ip1", "ip2", "prob"]
    assert [o.name for o in model.graph.output] == ["prob"]
    assert [i.name for i in model.graph.input] == ["data"]
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["Conv", "MaxPool", "Conv", "MaxPool", "Flatten", "Gemm", "Relu", "Gemm",
                   "Softmax"]
    assert onnx_main(["--model", str(tmp_path / "deploy.prototxt"), "--weights",
                      str(tmp_path / "w.caffemodel"), str(tmp_path / "cli.onnx")]) == 0
    assert "outputs prob" in capsys.readouterr().err
    assert (tmp_path / "cli.onnx").read_bytes() == (tmp_path / "net.onnx").read_bytes()
    # The same weights as a .caffemodel.h5 export to the same model.
    pytest.importorskip("h5py", reason="HDF5 caffemodels need h5py (pip install h5py)")
    net.save_hdf5(tmp_path / "w.caffemodel.h5")
    assert onnx_main(["--model", str(tmp_path / "deploy.prototxt"), "--weights",
                      str(tmp_path / "w.caffemodel.h5"), str(tmp_path / "h5.onnx")]) == 0
    assert (tmp_path / "h5.onnx").read_bytes() == (tmp_path / "net.onnx").read_bytes()


def test_onnx_batchnorm_concat_eltwise_lrn_and_ceil_pooling(tmp_path):
    model, net, _ = exported(tmp_path, MIX_A)
    assert net.blobs["pmax"].shape == (2, 8, 4, 4) and net.blobs["pave"].shape == (2, 8, 5, 5)
    assert net.blobs["pave2"].shape == (2, 4, 3, 5) and net.blobs["pmax2"].shape == (2, 4, 3, 3)
    x = np.random.default_rng(3).standard_normal((2, 3, 8, 8))
    assert_agrees(model, net, {"data": x},
                  expect=["conv1", "conv2", "norm", "cat", "sum", "prod", "max", "sc2",
                          "pmax", "pave", "pave2", "pmax2", "ip", "prob"])
    ops = [n.op_type for n in model.graph.node]
    # bn1 + sc1 fold into one BatchNormalization; bn2 is followed by a Scale over other axes.
    assert ops.count("BatchNormalization") == 2 and ops.count("LRN") == 1
    bn1 = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    inits = {t.name: t for t in model.graph.initializer}
    onnx, _ = onnx_modules()
    gamma = onnx.numpy_helper.to_array(inits[bn1.input[1]])
    assert np.array_equal(gamma, net.params["sc1"][0].data)
    # The divisor fix: Caffe's last window in the padding counts 2 cells, 1 inside.
    ratio = next(t for t in model.graph.initializer if t.name.startswith("pave/"))
    r = onnx.numpy_helper.to_array(ratio)
    assert r.shape == (5, 5) and r[4, 4] == 0.25 and r[2, 2] == 1.0
    assert np.isclose(r[0, 0], 4 / 9) and np.isclose(r[4, 0], 1 / 3)


def test_onnx_scale_bias_deconv_within_lrn_flatten_reshape(tmp_path):
    model, net, _ = exported(tmp_path, MIX_B, seed=4)
    rng = np.random.default_rng(5)
    feeds = {"data": rng.standard_normal((2, 4, 5, 5)), "gate": rng.standard_normal((2, 4))}
    assert_agrees(model, net, feeds, expect=["sig", "tanh", "gated", "biased", "within", "up",
                                             "gap", "gmp", "flat", "ip_axis", "ip_t", "shape",
                                             "soft"])
    outs = sorted(o.name for o in model.graph.output)
    assert outs == ["gap", "gmp_alias", "ip_t", "shape", "soft"]
    got = run_onnx(model, {k: v.astype(np.float32) for k, v in feeds.items()})
    assert np.array_equal(got["gmp_alias"], got["gmp"])


@pytest.mark.parametrize("size,kernel,stride,pad", [
    (7, 3, 2, 0), (8, 3, 2, 0), (8, 3, 2, 1), (9, 2, 2, 1), (10, 3, 3, 1), (6, 3, 2, 2),
    (5, 4, 3, 2), (11, 5, 4, 2), (4, 4, 1, 0),
])
@pytest.mark.parametrize("pool", ["MAX", "AVE"])
def test_onnx_pooling_matches_caffe_rounding(tmp_path, size, kernel, stride, pad, pool):
    text = f"""layer {{ name: "data" type: "Input" top: "data"
      input_param {{ shape {{ dim: 2 dim: 3 dim: {size} dim: {size + 1} }} }} }}
    layer {{ name: "pool" type: "Pooling" bottom: "data" top: "pool"
      pooling_param {{ pool: {pool} kernel_size: {kernel} stride: {stride} pad: {pad} }} }}"""
    model, net, _ = exported(tmp_path, text)
    x = np.random.default_rng(size).standard_normal((2, 3, size, size + 1))
    assert_agrees(model, net, {"data": x}, expect=["pool"])


def test_onnx_refusals(tmp_path):
    from purine.converters.onnx_export import caffe_to_onnx, main

    onnx_modules()
    base = """layer { name: "data" type: "Input" top: "data"
      input_param { shape { dim: 1 dim: 2 dim: 6 dim: 6 } } }
    """
    cases = [
        ('layer { name: "act" type: "ELU" bottom: "data" top: "act" }',
         r"layer 'act' \(type ELU\): no exact ONNX form \(supported: Axpy, BatchNorm, .*Convolution, "),
        # Caffe's last window starts at 6, past the input: an empty window.
        ('layer { name: "p" type: "Pooling" bottom: "data" top: "p" '
         'pooling_param { pool: AVE kernel_size: 2 stride: 3 } }',
         "layer 'p' \\(type Pooling\\): no exact ONNX form: the last pooling window along the "
         "height starts at 6"),
        ('layer { name: "p" type: "Pooling" bottom: "data" top: "p" top: "mask" '
         'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }', "argmax"),
        ('layer { name: "bn" type: "BatchNorm" bottom: "data" top: "bn" '
         'batch_norm_param { use_global_stats: false } }', "use_global_stats: false"),
    ]
    for i, (layer, message) in enumerate(cases):
        model = write(tmp_path, f"n{i}.prototxt", base + layer)
        net = Net(model, phase=TEST)
        net.save(tmp_path / f"w{i}.caffemodel")
        with pytest.raises(ConvertError, match=message):
            caffe_to_onnx(model, tmp_path / f"w{i}.caffemodel", tmp_path / f"n{i}.onnx")
        assert not (tmp_path / f"n{i}.onnx").exists()
    # Weights for another net: a layer the file lacks is an error, not filler values.
    conv = base + """layer { name: "c" type: "Convolution" bottom: "data" top: "c"
      convolution_param { num_output: 2 kernel_size: 3 } }"""
    model = write(tmp_path, "conv.prototxt", conv)
    with pytest.raises(ConvertError, match=r"w0.caffemodel: no parameters for layer\(s\) c "):
        caffe_to_onnx(model, tmp_path / "w0.caffemodel", tmp_path / "c.onnx")
    loss = base + """layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
      inner_product_param { num_output: 2 } }
    layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 1 } } }
    layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }"""
    model = write(tmp_path, "loss.prototxt", loss)
    Net(model, phase=TEST).save(tmp_path / "loss.caffemodel")
    assert main(["--model", model, "--weights", str(tmp_path / "loss.caffemodel"),
                 str(tmp_path / "loss.onnx")]) == 1


@pytest.mark.parametrize("region", ["ACROSS_CHANNELS", "WITHIN_CHANNEL"])
@pytest.mark.parametrize("alpha,beta,k,size", [
    (0.0, 0.75, 1.0, 5),  # issue 28: onnxruntime refused LRN with alpha 0
    (0.0, 0.75, 2.0, 3), (-0.5, 0.75, 3.0, 3), (0.3, 0.0, 1.0, 3), (0.3, -0.5, 2.0, 3),
    (0.3, 0.75, 1.0, 2 ** 31 - 1),  # a window of 2^31 cells, cut to the blob
])
def test_onnx_lrn_edges_load_in_onnxruntime(tmp_path, region, alpha, beta, k, size):
    text = f"""layer {{ name: "data" type: "Input" top: "data"
      input_param {{ shape {{ dim: 2 dim: 4 dim: 3 dim: 5 }} }} }}
    layer {{ name: "lrn" type: "LRN" bottom: "data" top: "lrn"
      lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} k: {k}
                   norm_region: {region} }} }}"""
    model, net, _ = exported(tmp_path, text)
    x = np.random.default_rng(7).standard_normal((2, 4, 3, 5))
    assert_agrees(model, net, {"data": x}, expect=["lrn"])
    # The formula by hand: alpha 0 gives y = x / k^beta (WITHIN_CHANNEL's k is 1).
    if alpha == 0:
        shift = k if region == "ACROSS_CHANNELS" else 1.0
        np.testing.assert_allclose(net.blobs["lrn"].data, x * shift ** -beta, rtol=1e-6)
    if beta == 0:
        np.testing.assert_allclose(net.blobs["lrn"].data, x, rtol=1e-6)
    if size > 9:  # every window holds all 4 channels, or the whole 3 x 5 plane
        sq = x ** 2
        if region == "ACROSS_CHANNELS":
            want = x * (k + alpha / size * sq.sum(axis=1, keepdims=True)) ** -beta
        else:
            want = x * (1 + alpha / size ** 2 * sq.sum(axis=(2, 3), keepdims=True)) ** -beta
        np.testing.assert_allclose(net.blobs["lrn"].data, want, rtol=1e-5)


@pytest.mark.parametrize("region", ["ACROSS_CHANNELS", "WITHIN_CHANNEL"])
@pytest.mark.parametrize("alpha,beta,k,size", [
    (0.0, 0.75, 2.0, 5), (-0.5, 0.75, 3.0, 3), (0.3, -0.5, 2.0, 3),
    (0.3, 0.75, 1.0, 2 ** 31 - 1),  # PyTorch padded the channels by 2^30 each side
])
def test_pytorch_lrn_edges(tmp_path, region, alpha, beta, k, size):
    import importlib.util

    torch = pytest.importorskip("torch", reason="running the exported module needs PyTorch "
                                                "(dev only: pip install torch)")
    from purine.converters.pytorch_export import caffe_to_pytorch

    text = f"""layer {{ name: "data" type: "Input" top: "data"
      input_param {{ shape {{ dim: 2 dim: 4 dim: 3 dim: 5 }} }} }}
    layer {{ name: "lrn" type: "LRN" bottom: "data" top: "lrn"
      lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} k: {k}
                   norm_region: {region} }} }}"""
    model = write(tmp_path, "deploy.prototxt", text)
    net = Net(model, phase=TEST)
    net.save(tmp_path / "w.caffemodel")
    ex = caffe_to_pytorch(model, tmp_path / "w.caffemodel", tmp_path / "out")
    # An LRN net has no weights: the module runs without its safetensors file.
    spec = importlib.util.spec_from_file_location(ex.stem, tmp_path / "out" / f"{ex.stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = np.random.default_rng(9).standard_normal((2, 4, 3, 5)).astype(np.float32)
    want = net.forward(data=x)["lrn"]
    with torch.no_grad():
        got = module.Net().eval()(data=torch.from_numpy(x))["lrn"].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if alpha == 0:  # y = x / k^beta, k of WITHIN_CHANNEL being 1
        shift = k if region == "ACROSS_CHANNELS" else 1.0
        np.testing.assert_allclose(got, x * shift ** -beta, rtol=1e-6)
