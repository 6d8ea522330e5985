"""The optional oneDNN convolutions, pooling, ReLU and InnerProduct products
(``purine.backend.onednn``): on float32 they match the numpy kernels (forward, backward data,
backward weight, on named geometries and on 40 drawn ones of either layout, a Deconvolution
layer, MAX pooling's maxima and mask bit for bit, AVE pooling's averages with Caffe's
divisors on named geometries and 60 drawn ones, ReLU's values and gradients bit for bit, the
InnerProduct ops with and without transpose and bias, and whole LeNet and CIFAR-10 quick
training steps), float64 and small products stay on numpy, and without a usable library purine
falls back to numpy, with one warning when an installed one fails to load.

The suite runs with ``PURINE_ONEDNN=0`` (tests/conftest.py); these tests turn oneDNN on
(``onednn.use``), and check that OpenBLAS's thread count is given back when it goes off."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purine.backend import onednn, set_blas_threads
from purine.caffe import TRAIN, Net
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import filter_net, read_net, replace_data_layers
from purine.ops import activation, conv, pooling
from purine.ops import inner_product as ip
from purine.ops.conv import ConvGeometry
from purine.ops.pooling import PoolGeometry
from tests.gradcheck import layer_net

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOT_INSTALLED = ("no oneDNN CPU wheel installed (pip install 'purine-caffe[onednn]', "
                 f"one of {', '.join(onednn.DISTRIBUTIONS)})")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


# oneDNN at AVX-512, not capped (ONEDNN_MAX_CPU_ISA): there it has vectorized average
# pooling on plain NCHW with 4 or more planes per sample and vectorized NHWC convolutions;
# below it some of those are scalar loops, which stay on numpy.
AVX512 = "avx512f" in _cpu_flags() and not os.environ.get("ONEDNN_MAX_CPU_ISA")


@pytest.fixture
def turned_on() -> Iterator[None]:
    """oneDNN turned on for the test, and back to the suite's setting after it."""
    before = onednn.use(True)
    yield
    onednn.use(before)


@pytest.fixture
def dnnl(turned_on: None) -> onednn.Dnnl:
    """oneDNN turned on for the test; skipped where it is not installed."""
    if onednn.find_library() is None:
        pytest.skip(NOT_INSTALLED)
    d = onednn.get()
    assert d is not None, "oneDNN is installed but did not load: see the warning above"
    return d


@pytest.fixture
def every_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """Products of any size through oneDNN (small ones stay on numpy by default)."""
    monkeypatch.setattr(onednn, "MATMUL_MIN_MACS", 0)


@pytest.fixture
def fresh() -> Iterator[None]:
    """A test that changes how the library is found: forget the loaded state around it."""
    onednn.reset()
    yield
    onednn.reset()


def on_numpy(monkeypatch: pytest.MonkeyPatch, fn: Callable[..., Any], *args: Any,
             **kwargs: Any) -> Any:
    with monkeypatch.context() as m:
        m.setattr(onednn.SETTINGS, "enabled", False)
        return fn(*args, **kwargs)


def assert_close(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    """|got - want| within ``rel`` times want's largest magnitude."""
    scale = float(np.max(np.abs(want)))
    assert scale > 0
    worst = float(np.max(np.abs(got.astype(np.float64) - want))) / scale
    assert worst <= rel, f"relative difference {worst:.2e} > {rel:.0e}"


GEOMETRIES = {
    "cifar10_quick conv2": ConvGeometry(100, 32, 16, 16, 32, 5, 5, pad_h=2, pad_w=2),
    # 20 -> 50 channels: on NHWC, where oneDNN's blocks would pad them to 32 and 64
    "lenet conv2": ConvGeometry(8, 20, 12, 12, 50, 5, 5),
    # Caffe's floored output drops the last row/column: oneDNN's right padding is negative.
    "stride 2 pad 1": ConvGeometry(4, 6, 9, 11, 8, 3, 3, stride_h=2, stride_w=2, pad_h=1),
    "group 2": ConvGeometry(3, 4, 10, 10, 6, 3, 3, pad_h=1, pad_w=1, group=2),
    "dilation 2x3": ConvGeometry(2, 3, 12, 12, 4, 3, 3, dilation_h=2, dilation_w=3),
    "1x1": ConvGeometry(5, 8, 7, 7, 16, 1, 1),
    "3x2 kernel, stride 3x1": ConvGeometry(2, 5, 8, 9, 7, 3, 2, stride_h=3, pad_w=1),
}


def conv_arrays(g: ConvGeometry, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((g.num, g.channels, g.height, g.width)).astype(dtype),
        "w": rng.standard_normal((g.num_output, g.channels // g.group, g.kernel_h,
                                  g.kernel_w)).astype(dtype),
        "b": rng.standard_normal(g.num_output).astype(dtype),
        "dy": rng.standard_normal((g.num, g.num_output, g.out_h, g.out_w)).astype(dtype),
    }


def run_ops(g: ConvGeometry, a: dict[str, np.ndarray], bias: bool) -> dict[str, np.ndarray]:
    """y, dx and dw (from one (x, dy) pair, and from two: the sum) of ``g`` on ``a``."""
    y, dx = np.empty_like(a["dy"]), np.empty_like(a["x"])
    dw, dw2 = np.empty_like(a["w"]), np.empty_like(a["w"])
    conv.conv_forward(a["x"], a["w"], *([a["b"]] if bias else []), y, geom=g)
    conv.conv_backward_data(a["dy"], a["w"], dx, geom=g)
    conv.conv_backward_weight(a["x"], a["dy"], dw, geom=g)
    conv.conv_backward_weight(a["x"], a["dy"], a["x"], 2 * a["dy"], dw2, geom=g)
    return {"y": y, "dx": dx, "dw": dw, "dw of two pairs": dw2}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_kernels_match_numpy(dnnl, monkeypatch, name, bias):
    g = GEOMETRIES[name]
    a = conv_arrays(g)
    before = dnnl.calls
    got = run_ops(g, a, bias)
    assert dnnl.calls - before == 5  # forward, backward data, three weight gradients
    want = on_numpy(monkeypatch, run_ops, g, a, bias)
    for k in want:
        assert_close(got[k], want[k], 1e-5)


def test_channels_the_blocks_would_pad_run_on_nhwc(dnnl):
    """LeNet's conv2 (20 -> 50 channels) would be padded to whole blocks (32 and 64 on
    AVX-512, 24 and 56 on AVX2): its activations go NHWC, with oneDNN's own kernels, not
    its reference loops. CIFAR-10 quick's 32 -> 32 fills the blocks and keeps them."""
    lenet, cifar = GEOMETRIES["lenet conv2"], GEOMETRIES["cifar10_quick conv2"]
    tag = dnnl._activation_tag(lenet)
    # (capped at SSE4.1, oneDNN's own layouts for it pad nothing and stay)
    assert tag == onednn._TAG_NHWC or (not AVX512 and tag == onednn._TAG_ANY)
    assert dnnl._activation_tag(cifar) == onednn._TAG_ANY
    if tag == onednn._TAG_NHWC:
        for op in ("fwd", "bwd_data", "bwd_w"):
            assert not dnnl._impl(dnnl._pd(op, lenet, onednn._TAG_NHWC)).startswith("ref")


@st.composite
def conv_geometries(draw: st.DrawFn) -> ConvGeometry:
    """Small convolutions of any channel counts (blocked and NHWC layouts alike), groups,
    strides, padding and dilation with a positive output."""
    group = draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    dh, dw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    ph, pw = draw(st.integers(0, kh - 1)), draw(st.integers(0, kw - 1))
    h = draw(st.integers(max(1, dh * (kh - 1) + 1 - 2 * ph), 9))
    w = draw(st.integers(max(1, dw * (kw - 1) + 1 - 2 * pw), 9))
    return ConvGeometry(draw(st.integers(1, 3)), group * draw(st.integers(1, 24)), h, w,
                        group * draw(st.integers(1, 24)), kh, kw, draw(st.integers(1, 3)),
                        draw(st.integers(1, 3)), ph, pw, dh, dw, group)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(g=conv_geometries())
def test_any_geometry_matches_numpy(dnnl, g):
    """Whatever layout the geometry gets (``_activation_tag``), oneDNN's forward with bias,
    backward data and weight gradients give numpy's results."""
    a = conv_arrays(g)
    got = run_ops(g, a, True)
    before = onednn.use(False)
    try:
        want = run_ops(g, a, True)
    finally:
        onednn.use(before)
    for k in want:
        assert_close(got[k], want[k], 2e-5)


def test_float64_stays_on_numpy(dnnl, monkeypatch):
    g = GEOMETRIES["group 2"]
    a = conv_arrays(g, np.float64)
    before = dnnl.calls
    got = run_ops(g, a, True)
    assert dnnl.calls == before
    want = on_numpy(monkeypatch, run_ops, g, a, True)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_non_contiguous_arrays_stay_on_numpy(dnnl, monkeypatch):
    g = GEOMETRIES["1x1"]
    a = conv_arrays(g)
    x = np.asfortranarray(a["x"])
    y, want = np.empty_like(a["dy"]), np.empty_like(a["dy"])
    before = dnnl.calls
    conv.conv_forward(x, a["w"], y, geom=g)
    assert dnnl.calls == before
    on_numpy(monkeypatch, conv.conv_forward, x, a["w"], want, geom=g)
    np.testing.assert_array_equal(y, want)


def test_blocked_copies_share_one_scratch_buffer(dnnl):
    """A call's blocked copies lie side by side, aligned and disjoint, in one buffer as large
    as the largest call needs (not one buffer per operand position, each as large as the
    largest copy at that position)."""
    for name in ("cifar10_quick conv2", "1x1"):
        run_ops(GEOMETRIES[name], conv_arrays(GEOMETRIES[name]), True)
    prim = dnnl._get("fwd_bias", GEOMETRIES["cifar10_quick conv2"])
    blocked = [op for op in prim.ops if op.blocked_bytes]
    if len(blocked) < 2:
        pytest.skip("oneDNN reads this CPU's convolution operands in NCHW: nothing to share")
    ends = [0] + [op.offset + op.blocked_bytes for op in blocked]
    assert all(op.offset % onednn._ALIGN == 0 and op.offset >= end
               for op, end in zip(blocked, ends))
    assert ends[-1] <= prim.scratch_bytes
    largest = max(p.scratch_bytes for p in dnnl._prims.values() if p is not None)
    assert dnnl._scratch.size == largest + onednn._ALIGN


def layer_step(net: Net, x: np.ndarray, dy: np.ndarray) -> dict[str, np.ndarray]:
    net.forward(x=x)
    net.backward(y=dy)
    w, b = net.params["l"]
    return {"y": net.blobs["y"].data.copy(), "dx": net.blobs["x"].diff.copy(),
            "dw": w.diff.copy(), "db": b.diff.copy()}


def test_deconvolution_layer_matches_numpy(dnnl, monkeypatch):
    layer = ('name: "l" type: "Deconvolution" bottom: "x" top: "y" convolution_param { '
             'num_output: 6 kernel_size: 3 stride: 2 pad: 1 group: 2 '
             'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" '
             'std: 0.5 } }')
    net = Net(layer_net(layer, {"x": (3, 4, 5, 6)}), phase=TRAIN)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
    dy = rng.standard_normal(net.blobs["y"].data.shape).astype(np.float32)
    before = dnnl.calls
    got = layer_step(net, x, dy)
    assert dnnl.calls - before == 3  # forward (backward data), backward data, weights
    want = on_numpy(monkeypatch, layer_step, net, x, dy)
    for k in want:
        assert_close(got[k], want[k], 1e-5)


def train_step(net: Net, data: np.ndarray, label: np.ndarray) -> dict[str, np.ndarray]:
    net.forward(data=data, label=label)
    net.backward()
    out = {"loss": np.array(net.blobs["loss"].data, np.float64).reshape(-1)}
    for name, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            out[f"{name}[{i}]"] = blob.diff.copy()
    return out


# (prototxt, data shape, oneDNN calls of a step, seed of the inputs). A ReLU input within
# rounding of zero takes either side with the summation order and moves a whole gradient row
# (LeNet's seed 2 puts one of ip1's at 1.2e-7, which 1 against 2 OpenBLAS threads flips on
# numpy alone): these seeds keep every ip1 input above 1e-4 of the largest.
STEPS = {
    # convolutions: three forwards, three weight gradients, two backward datas (conv1's
    # bottom is data); pool1's MAX forward and backward; ip1 and ip2: forward, weight
    # gradient and backward data each; relu1-relu3 forward and backward (each of at least
    # ELTWISE_MIN values); and pool2's and pool3's AVE where oneDNN has vectorized kernels
    "cifar10_quick": ("models/cifar10_quick/cifar10_quick_train_test.prototxt",
                      (16, 3, 32, 32), 8 + 2 + 6 + 6, 2),
    # two convolutions (2 + 2 + 1), two MAX pools (forward and backward), two inner
    # products (3 + 3)
    "lenet": ("models/lenet/lenet_train_test.prototxt", (8, 1, 28, 28), 5 + 4 + 6, 4),
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_training_step_matches_numpy(dnnl, every_matmul, monkeypatch, name):
    path, shape, calls, seed = STEPS[name]
    param = filter_net(read_net(os.path.join(ROOT, path)), pb.NetState(phase=pb.TRAIN))
    net = Net(replace_data_layers(param, {"data": shape, "label": shape[:1]}), phase=TRAIN,
              seed=1)
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(shape).astype(np.float32)
    label = rng.integers(0, 10, shape[0]).astype(np.float32)
    before = dnnl.calls
    got = train_step(net, data, label)
    ave = sum(p is not None for k, p in dnnl._prims.items()
              if k[0] == "ave_pool" and k[1].num == shape[0])
    if name == "cifar10_quick" and AVX512:
        assert ave == 4
    assert dnnl.calls - before == calls + ave
    want = on_numpy(monkeypatch, train_step, net, data, label)
    assert set(got) == set(want)
    for k in want:
        assert_close(got[k], want[k], 1e-4)


def ip_arrays(m: int, k: int, n: int, transpose: bool, x_shape: tuple[int, ...],
              dtype: Any = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"x": rng.standard_normal(x_shape).astype(dtype),
            "w": rng.standard_normal((k, n) if transpose else (n, k)).astype(dtype),
            "b": rng.standard_normal(n).astype(dtype),
            "dy": rng.standard_normal((m, n)).astype(dtype)}


def run_ip(a: dict[str, np.ndarray], m: int, transpose: bool, bias: bool
           ) -> dict[str, np.ndarray]:
    """y, dx, dw and db of the InnerProduct ops, each output first filled with 7s (the ops
    write their outputs, never add to them)."""
    out = {"y": np.full(a["dy"].shape, 7, a["dy"].dtype), "dx": np.full_like(a["x"], 7),
           "dw": np.full_like(a["w"], 7), "db": np.full_like(a["b"], 7)}
    ip.inner_product_forward(a["x"], a["w"], *([a["b"]] if bias else []), out["y"], m=m,
                             transpose=transpose)
    ip.inner_product_backward_data(a["dy"], a["w"], out["dx"], m=m, transpose=transpose)
    ip.inner_product_backward_weight(a["x"], a["dy"], out["dw"], m=m, transpose=transpose)
    ip.inner_product_backward_bias(a["dy"], out["db"], m=m)
    return out


IP_SHAPES = {
    # (m, k, n, x's shape): LeNet's ip1 (x is pool2's (64, 50, 4, 4)), an odd small one,
    # one wider than tall
    "lenet ip1": (64, 800, 500, (64, 50, 4, 4)),
    "3x5 to 7": (3, 5, 7, (3, 5)),
    "m 2, k 300, n 1000": (2, 300, 1000, (2, 3, 100)),
}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("transpose", [False, True], ids=["W (N, K)", "transpose"])
@pytest.mark.parametrize("name", sorted(IP_SHAPES))
def test_inner_product_matches_numpy(dnnl, every_matmul, monkeypatch, name, transpose, bias):
    m, k, n, x_shape = IP_SHAPES[name]
    a = ip_arrays(m, k, n, transpose, x_shape)
    before = dnnl.calls
    got = run_ip(a, m, transpose, bias)
    assert dnnl.calls - before == 3  # forward, backward data, weight gradient
    want = on_numpy(monkeypatch, run_ip, a, m, transpose, bias)
    for key in want:
        assert got[key].shape == want[key].shape
        assert_close(got[key], want[key], 1e-5)
    # and against float64 products, so that both paths are checked, not only their agreement
    x2 = a["x"].reshape(m, k).astype(np.float64)
    w_nk = (a["w"].T if transpose else a["w"]).astype(np.float64)
    assert_close(got["y"], x2 @ w_nk.T + (a["b"] if bias else 0), 1e-5)
    assert_close(got["dx"].reshape(m, k), a["dy"] @ w_nk, 1e-5)
    dw_nk = a["dy"].T.astype(np.float64) @ x2
    assert_close(got["dw"], dw_nk.T if transpose else dw_nk, 1e-5)


def test_inner_product_float64_and_empty_batch_stay_on_numpy(dnnl, every_matmul):
    a = ip_arrays(3, 5, 7, True, (3, 5), np.float64)
    before = dnnl.calls
    got = run_ip(a, 3, True, True)
    assert dnnl.calls == before
    np.testing.assert_array_equal(got["y"], a["x"] @ a["w"] + a["b"])
    assert got["y"].dtype == np.float64
    # An empty batch: no product to run, and dW is all zeros, as on numpy.
    a = ip_arrays(0, 5, 7, False, (0, 5))
    got = run_ip(a, 0, False, True)
    assert dnnl.calls == before
    assert got["y"].shape == (0, 7)
    np.testing.assert_array_equal(got["dw"], np.zeros((7, 5), np.float32))


def test_small_products_stay_on_numpy(dnnl, monkeypatch):
    """LeNet's ip2 (64x500x10 multiply-adds) is faster on one OpenBLAS thread than through
    oneDNN; its ip1 (64x800x500) goes to oneDNN."""
    a = ip_arrays(64, 500, 10, False, (64, 500))
    before = dnnl.calls
    got = run_ip(a, 64, False, True)
    assert dnnl.calls == before
    want = on_numpy(monkeypatch, run_ip, a, 64, False, True)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    assert 64 * 800 * 500 >= onednn.MATMUL_MIN_MACS > 64 * 500 * 10
    run_ip(ip_arrays(64, 800, 500, False, (64, 800)), 64, False, True)
    assert dnnl.calls - before == 3


def test_transposed_inner_product_layer_matches_numpy(dnnl, every_matmul, monkeypatch):
    layer = ('name: "l" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { '
             'num_output: 6 axis: 2 transpose: true '
             'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" '
             'std: 0.5 } }')
    net = Net(layer_net(layer, {"x": (3, 4, 5, 2)}), phase=TRAIN)
    assert net.params["l"][0].data.shape == (10, 6)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 4, 5, 2)).astype(np.float32)
    dy = rng.standard_normal((3, 4, 6)).astype(np.float32)
    before = dnnl.calls
    got = layer_step(net, x, dy)
    assert dnnl.calls - before == 3
    want = on_numpy(monkeypatch, layer_step, net, x, dy)
    for key in want:
        assert_close(got[key], want[key], 1e-5)


def pool_geometry(num: int, channels: int, height: int, width: int, kernel: tuple[int, int],
                  stride: tuple[int, int] = (1, 1), pad: tuple[int, int] = (0, 0)
                  ) -> PoolGeometry:
    """Caffe's output size: rounded up, less a last window that would start in the padding."""
    pooled = []
    for size, k, s, p in zip((height, width), kernel, stride, pad, strict=True):
        n = -(-(size + 2 * p - k) // s) + 1
        pooled.append(n - 1 if p and (n - 1) * s >= size + p else n)
    return PoolGeometry(num, channels, height, width, *kernel, *stride, *pad, *pooled)


POOLS = {
    # 32 -> 16: the last window overhangs the image by a column and a row.
    "cifar10_quick pool1": pool_geometry(100, 32, 32, 32, (3, 3), (2, 2)),
    "pad 1, ceil overhang": pool_geometry(3, 4, 10, 9, (3, 3), (2, 2), (1, 1)),
    "stride 1": pool_geometry(2, 3, 8, 7, (3, 3)),
    "2x2 stride 2": pool_geometry(4, 5, 12, 12, (2, 2), (2, 2)),
    "3x2 kernel, stride 2x1, pad 1x0": pool_geometry(2, 3, 9, 8, (3, 2), (2, 1), (1, 0)),
    "global 6x6": pool_geometry(3, 8, 6, 6, (6, 6)),
    # 289 kernel offsets: more than a byte of workspace each.
    "global 17x17": pool_geometry(2, 4, 17, 17, (17, 17)),
}


def relu_ties(shape: tuple[int, ...], seed: int = 3) -> np.ndarray:
    """After-ReLU values rounded to a few levels: windows of zeros and repeated maxima."""
    rng = np.random.default_rng(seed)
    return np.maximum(np.round(2 * rng.standard_normal(shape)), 0).astype(np.float32) / 2


def max_pool(g: PoolGeometry, x: np.ndarray, mask_type: Any) -> tuple[np.ndarray, np.ndarray]:
    shape = (g.num, g.channels, g.pooled_h, g.pooled_w)
    y, mask = np.empty(shape, np.float32), np.empty(shape, mask_type)
    pooling.max_pool_forward(x, y, mask, geom=g)
    return y, mask


@pytest.mark.parametrize("mask_type", [np.int32, np.float32])
@pytest.mark.parametrize("name", sorted(POOLS))
def test_max_pool_forward_matches_numpy_bit_for_bit(dnnl, monkeypatch, name, mask_type):
    g = POOLS[name]
    shape = (g.num, g.channels, g.height, g.width)
    rng = np.random.default_rng(4)
    inputs = {"ties": relu_ties(shape), "zeros": np.zeros(shape, np.float32),
              "normal": rng.standard_normal(shape).astype(np.float32)}
    for what, x in inputs.items():
        before = dnnl.calls
        got = max_pool(g, x, mask_type)
        assert dnnl.calls - before == 1, what
        want = on_numpy(monkeypatch, max_pool, g, x, mask_type)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b, err_msg=f"{name}, {what}")


def test_max_pool_ties_take_the_first_maximum(dnnl):
    g = pool_geometry(1, 1, 3, 4, (2, 2), (1, 2))
    x = np.array([[0, 5, 5, 1],
                  [5, 5, 0, 5],
                  [0, 0, 0, 0]], np.float32).reshape(1, 1, 3, 4)
    y, mask = max_pool(g, x, np.int32)
    assert y.reshape(2, 2).tolist() == [[5, 5], [5, 5]]
    assert mask.reshape(2, 2).tolist() == [[1, 2], [4, 7]]
    # All equal: the window's first element inside the image (padding never wins).
    g = pool_geometry(1, 1, 3, 3, (3, 3), (2, 2), (1, 1))
    y, mask = max_pool(g, np.zeros((1, 1, 3, 3), np.float32), np.int32)
    assert y.reshape(-1).tolist() == [0, 0, 0, 0]
    assert mask.reshape(-1).tolist() == [0, 1, 3, 4]


def test_max_pool_windows_outside_the_image_stay_on_numpy(dnnl, monkeypatch):
    # Stride 4 over kernel 2 with ceil rounding: the last window starts past the image.
    g = pool_geometry(2, 3, 7, 7, (2, 2), (4, 4))
    assert g.empty_rows == g.empty_cols == 1
    x = relu_ties((2, 3, 7, 7))
    before = dnnl.calls
    got = max_pool(g, x, np.float32)
    assert dnnl.calls == before
    assert got[1][0, 0, -1].tolist() == [-1, -1, -1]
    want = on_numpy(monkeypatch, max_pool, g, x, np.float32)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


EMPTY_WINDOWS = pool_geometry(2, 3, 7, 7, (2, 2), (4, 4))  # the last window starts past


def offset_pool(g: PoolGeometry, x: np.ndarray, dy: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y, the kernel offsets and dx of MAX pooling as the host's layers run it."""
    y, dx = np.empty(dy.shape, x.dtype), np.full_like(x, np.nan)
    offsets = np.empty(dy.shape, pooling.offset_dtype(g))
    pooling.max_pool_forward_offsets(x, y, offsets, geom=g)
    pooling.max_pool_backward_offsets(dy, offsets, dx, geom=g)
    return y, offsets, dx


def pool_inputs(g: PoolGeometry) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    shape = (g.num, g.channels, g.height, g.width)
    rng = np.random.default_rng(5)
    dy = rng.standard_normal((g.num, g.channels, g.pooled_h, g.pooled_w)).astype(np.float32)
    yield "ties", relu_ties(shape), dy
    yield "normal", rng.standard_normal(shape).astype(np.float32), dy


@pytest.mark.parametrize("name", sorted(POOLS) + ["empty windows"])
def test_offset_pooling_is_caffes_mask_pooling(name):
    """On numpy (the suite's kernels), the host's MAX pooling with kernel offsets gives the
    maxima and gradient bits of Caffe's plane-index mask pooling (max_pool_forward and
    max_pool_backward, which the layer tests hold to Caffe), and offsets that are that mask
    (the empty-window mark where Caffe's mask is -1)."""
    assert not onednn.SETTINGS.enabled
    g = POOLS.get(name, EMPTY_WINDOWS)
    for what, x, dy in pool_inputs(g):
        y, offsets, dx = offset_pool(g, x, dy)
        want_y, mask = max_pool(g, x, np.int32)
        want_dx = np.empty_like(x)
        pooling.max_pool_backward(dy, mask, want_dx, geom=g)
        np.testing.assert_array_equal(y, want_y, err_msg=what)
        np.testing.assert_array_equal(pooling._plane_index(offsets, g), mask, err_msg=what)
        np.testing.assert_array_equal(dx.view(np.uint32), want_dx.view(np.uint32),
                                      err_msg=what)
    if name == "empty windows":
        assert (offsets[:, :, -1] == 4).all() and (offsets[..., -1] == 4).all()
        assert (offsets[:, :, :-1, :-1] < 4).all()


@pytest.mark.parametrize("name", sorted(POOLS))
def test_offset_pooling_on_onednn_matches_numpy(dnnl, monkeypatch, name):
    """oneDNN's forward writes numpy's maxima and offsets bit for bit, and its backward reads
    them: numpy's gradient bit for bit where windows do not overlap, within float32's
    rounding of a sum where they do (the order of the additions differs)."""
    g = POOLS[name]
    for what, x, dy in pool_inputs(g):
        before = dnnl.calls
        got = offset_pool(g, x, dy)
        assert dnnl.calls - before == 2, what
        want = on_numpy(monkeypatch, offset_pool, g, x, dy)
        np.testing.assert_array_equal(got[0], want[0], err_msg=what)
        np.testing.assert_array_equal(got[1], want[1], err_msg=what)
        if g.overlapping:
            assert_close(got[2], want[2], 1e-6)
        else:
            np.testing.assert_array_equal(got[2], want[2], err_msg=what)


def assert_stays_on_numpy(dnnl: onednn.Dnnl, monkeypatch: pytest.MonkeyPatch,
                          run: Callable[..., tuple[np.ndarray, ...]], g: PoolGeometry,
                          x: np.ndarray, dy: np.ndarray) -> None:
    """``run(g, x, dy)`` calls no oneDNN primitive and gives numpy's bits."""
    before = dnnl.calls
    got = run(g, x, dy)
    assert dnnl.calls == before
    for a, b in zip(got, on_numpy(monkeypatch, run, g, x, dy), strict=True):
        np.testing.assert_array_equal(a, b)


def test_offset_pooling_with_empty_windows_stays_on_numpy(dnnl, monkeypatch):
    assert_stays_on_numpy(dnnl, monkeypatch, offset_pool, EMPTY_WINDOWS,
                          *next(pool_inputs(EMPTY_WINDOWS))[1:])


def test_max_pool_float64_stays_on_numpy(dnnl):
    g = POOLS["stride 1"]
    x = relu_ties((g.num, g.channels, g.height, g.width)).astype(np.float64)
    shape = (g.num, g.channels, g.pooled_h, g.pooled_w)
    y, mask = np.empty(shape), np.empty(shape, np.int32)
    before = dnnl.calls
    pooling.max_pool_forward(x, y, mask, geom=g)
    assert dnnl.calls == before
    # The first output row: the maxima of the 3x3 windows of rows 0-2, by hand.
    rows = x[0, 0, :3]
    np.testing.assert_array_equal(y[0, 0, 0], [rows[:, j:j + 3].max() for j in range(5)])
    assert y.dtype == np.float64


def ave_pool(g: PoolGeometry, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y, dx = np.full(dy.shape, np.nan, x.dtype), np.full_like(x, np.nan)
    pooling.ave_pool_forward(x, y, geom=g)
    pooling.ave_pool_backward(dy, dx, geom=g)
    return y, dx


def ave_primitives(dnnl: onednn.Dnnl, g: PoolGeometry) -> int:
    """How many of AVE pooling's two directions of ``g`` oneDNN made primitives for (each
    runs once per call)."""
    return sum(dnnl._prims.get(("ave_pool", g, backward)) is not None
               for backward in (False, True))



# At least 8 planes per sample: for fewer, oneDNN picks scalar kernels, which stay on numpy
# (test_scalar_ave_pool_kernels_stay_on_numpy).
AVE_POOLS = {**{name: replace(g, channels=max(g.channels, 8)) for name, g in POOLS.items()},
             # every window inside the padded image: the kernel's area divides
             "pad 1, no overhang": pool_geometry(2, 8, 9, 9, (3, 3), (2, 2), (1, 1)),
             "AlexNet-sized, pad 1": pool_geometry(4, 16, 13, 13, (3, 3), (2, 2), (1, 1))}


@pytest.mark.parametrize("name", sorted(AVE_POOLS))
def test_ave_pool_on_onednn_matches_numpy(dnnl, monkeypatch, name):
    """oneDNN's averages divide as Caffe does (numpy's separable matrices hold Caffe's
    divisors): without padding by the window's part in the image, with padding by the
    kernel's area where no window overhangs the padded image; a padded geometry whose last
    window overhangs it (Caffe divides that one by less than the kernel's area) stays on
    numpy."""
    g = AVE_POOLS[name]
    on = onednn.ave_algorithm(g) is not None
    assert on == (name != "pad 1, ceil overhang")
    for what, x, dy in pool_inputs(g):
        before = dnnl.calls
        got = ave_pool(g, x, dy)
        made = ave_primitives(dnnl, g)
        assert dnnl.calls - before == made, what
        if not on:
            assert made == 0, what
        elif AVX512:
            assert made == 2, what
        want = on_numpy(monkeypatch, ave_pool, g, x, dy)
        for a, b in zip(got, want, strict=True):
            assert_close(a, b, 1e-6)


@st.composite
def pool_geometries(draw: st.DrawFn) -> PoolGeometry:
    """Windows of any kernel, stride and padding (below the kernel, as Caffe requires) over
    small images, with Caffe's ceil-rounded output size: some overhang the padded image,
    some start past it; from 1 to 20 planes per sample."""
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    ph, pw = draw(st.integers(0, kh - 1)), draw(st.integers(0, kw - 1))
    h = draw(st.integers(max(1, kh - 2 * ph), 12))
    w = draw(st.integers(max(1, kw - 2 * pw), 12))
    return pool_geometry(draw(st.integers(1, 3)), draw(st.integers(1, 20)), h, w, (kh, kw),
                         (draw(st.integers(1, 4)), draw(st.integers(1, 4))), (ph, pw))


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(g=pool_geometries())
def test_any_ave_pool_geometry_matches_numpy(dnnl, g):
    """Each direction runs on oneDNN exactly when it made a primitive for it, which it does
    only where ``ave_algorithm`` gives an average (and no window lies wholly outside the
    image), and there it gives numpy's values; the rest run numpy's code."""
    shape = (g.num, g.channels, g.height, g.width)
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal((g.num, g.channels, g.pooled_h, g.pooled_w)).astype(np.float32)
    before = dnnl.calls
    got = ave_pool(g, x, dy)
    made = [dnnl._prims.get(("ave_pool", g, backward)) is not None
            for backward in (False, True)]
    assert dnnl.calls - before == sum(made) == ave_primitives(dnnl, g)
    if onednn.ave_algorithm(g) is None or g.empty_rows or g.empty_cols:
        assert not any(made)
    previous = onednn.use(False)
    try:
        want = ave_pool(g, x, dy)
    finally:
        onednn.use(previous)
    for a, b, on in zip(got, want, made, strict=True):
        if on:
            assert_close(a, b, 1e-6)
        else:  # the same code: the same bits, Caffe's NaN of an empty window included
            np.testing.assert_array_equal(a, b)


def test_ave_pool_divisors_by_hand(dnnl):
    ones = np.ones((1, 8, 3, 3), np.float32)
    # pad 1, kernel 3, stride 2 over 3x3: each window holds 4 image values and 5 of padding,
    # and Caffe divides by all 9.
    g = pool_geometry(1, 8, 3, 3, (3, 3), (2, 2), (1, 1))
    before = dnnl.calls
    y, dx = ave_pool(g, ones, np.ones((1, 8, 2, 2), np.float32))
    assert dnnl.calls - before == ave_primitives(dnnl, g)
    assert ave_primitives(dnnl, g) == 2 or not AVX512
    np.testing.assert_allclose(y, np.full((1, 8, 2, 2), 4 / 9), rtol=1e-7)
    # the centre value lies in all four windows, the corners in one
    np.testing.assert_allclose(dx[0, 5], [[1 / 9, 2 / 9, 1 / 9], [2 / 9, 4 / 9, 2 / 9],
                                          [1 / 9, 2 / 9, 1 / 9]], rtol=1e-6)
    # no padding, kernel 3, stride 2 over 4x4: the last windows overhang by one row and
    # column and are divided by their 6 (or 4) image values
    g = pool_geometry(1, 8, 4, 4, (3, 3), (2, 2))
    x = np.broadcast_to(np.arange(16, dtype=np.float32).reshape(4, 4), (1, 8, 4, 4)).copy()
    before = dnnl.calls
    y, _ = ave_pool(g, x, np.zeros((1, 8, 2, 2), np.float32))
    assert dnnl.calls - before == ave_primitives(dnnl, g)
    assert ave_primitives(dnnl, g) == 2 or not AVX512
    np.testing.assert_allclose(y[0], np.broadcast_to([[5, 6.5], [11, 12.5]], (8, 2, 2)),
                               rtol=1e-7)


def test_ave_pool_float64_non_contiguous_and_empty_windows_stay_on_numpy(dnnl, monkeypatch):
    g1 = AVE_POOLS["stride 1"]
    x1, dy1 = next(pool_inputs(g1))[1:]
    wide = np.zeros(x1.shape[:-1] + (2 * x1.shape[-1],), np.float32)
    wide[..., ::2] = x1
    assert_stays_on_numpy(dnnl, monkeypatch, ave_pool, g1, x1.astype(np.float64),
                          dy1.astype(np.float64))
    assert_stays_on_numpy(dnnl, monkeypatch, ave_pool, EMPTY_WINDOWS,
                          *next(pool_inputs(EMPTY_WINDOWS))[1:])
    # every other column of a wider array: the forward reads it on numpy
    y = np.empty(dy1.shape, np.float32)
    before = dnnl.calls
    pooling.ave_pool_forward(wide[..., ::2], y, geom=g1)
    assert dnnl.calls == before
    np.testing.assert_array_equal(y, on_numpy(monkeypatch, ave_pool, g1, x1, dy1)[0])


def test_scalar_ave_pool_kernels_stay_on_numpy(dnnl, monkeypatch):
    """Where oneDNN offers only scalar loops ("simple_nchw", "ref"), numpy's products run."""
    g = pool_geometry(3, 9, 11, 10, (3, 3), (2, 2))
    monkeypatch.setattr(dnnl, "_prims", {})  # made afresh here, the cache back after
    monkeypatch.setattr(dnnl, "_impl", lambda pd: "simple_nchw:any")
    assert_stays_on_numpy(dnnl, monkeypatch, ave_pool, g, *next(pool_inputs(g))[1:])


def relu_arrays(n: int, dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """x and dy of n values with zeros and negative zeros among them."""
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((2, n)).astype(dtype)
    x[::97], x[::101], dy[::89] = 0.0, -0.0, -0.0
    return x, dy


@pytest.mark.parametrize("in_place", [False, True], ids=["out of place", "in place"])
def test_relu_matches_numpy_bit_for_bit(dnnl, monkeypatch, in_place):
    """Forward max(x, 0) and backward dy * (x > 0), with x the bottom or (in place, as
    Caffe's nets use ReLU) the top, give numpy's bits, +0 and -0 included."""
    x, dy = relu_arrays(onednn.ELTWISE_MIN + 5)
    want_y = np.maximum(x, 0)
    want_dx = np.multiply(dy, x > 0)
    before = dnnl.calls
    y = x.copy() if in_place else np.empty_like(x)
    activation.relu_forward(y if in_place else x, y)
    sign = y if in_place else x
    dx = dy.copy() if in_place else np.full_like(dy, np.nan)
    activation.relu_backward(sign, dx if in_place else dy, dx)
    assert dnnl.calls - before == 2
    np.testing.assert_array_equal(y.view(np.uint32), want_y.view(np.uint32))
    np.testing.assert_array_equal(dx.view(np.uint32), want_dx.view(np.uint32))


@pytest.mark.parametrize("why", ["small", "float64", "leaky"])
def test_small_float64_and_leaky_relus_stay_on_numpy(dnnl, why):
    n = onednn.ELTWISE_MIN - 1 if why == "small" else onednn.ELTWISE_MIN
    x, dy = relu_arrays(n, np.float64 if why == "float64" else np.float32)
    slope = 0.1 if why == "leaky" else 0.0
    y, dx = np.empty_like(x), np.empty_like(x)
    before = dnnl.calls
    activation.relu_forward(x, y, negative_slope=slope)
    activation.relu_backward(x, dy, dx, negative_slope=slope)
    assert dnnl.calls == before
    np.testing.assert_array_equal(y, np.where(x > 0, x, x * x.dtype.type(slope)))
    np.testing.assert_array_equal(dx, dy * np.where(x > 0, 1, slope).astype(x.dtype))


def test_describe_names_the_library(dnnl):
    assert onednn.describe() == f"oneDNN {dnnl.version} ({dnnl.runtime})"
    assert dnnl.version.startswith("3.")
    assert onednn.available()


def test_purine_onednn_0_turns_it_off(turned_on):
    assert not onednn.Settings.from_environ({"PURINE_ONEDNN": "0"}).enabled
    assert onednn.Settings.from_environ({"PURINE_ONEDNN": "1"}).enabled
    assert onednn.Settings.from_environ({}).enabled
    assert onednn.use(False) is True
    assert onednn.get() is None
    assert not onednn.available()
    assert onednn.describe() == "numpy"


def test_blas_threads_are_one_while_a_pass_runs_and_given_back_after(fresh):
    if onednn.find_library() is None:
        pytest.skip(NOT_INSTALLED)
    original = set_blas_threads(2)
    if original is None:
        pytest.skip("numpy has no OpenBLAS here: no thread count to take")
    before = onednn.use(True)
    try:
        assert onednn.get() is not None and blas_threads() == 2  # between passes: the user's
        with onednn.pass_scope():
            assert blas_threads() == 1
            with onednn.pass_scope():  # nested (a dispatcher's run in another's)
                assert blas_threads() == 1
            assert blas_threads() == 1
            onednn.use(False)
            assert blas_threads() == 2
            onednn.use(True)
            assert blas_threads() == 1
            onednn.reset()
            assert blas_threads() == 2
            assert onednn.get() is not None and blas_threads() == 1  # loaded mid-pass
        assert blas_threads() == 2
    finally:
        onednn.use(before)
        set_blas_threads(original)


def test_a_dispatcher_pass_holds_the_blas_threads_and_gives_them_back(fresh):
    if onednn.find_library() is None:
        pytest.skip(NOT_INSTALLED)
    from purine.graph import CPU, Graph
    from purine.runtime.dispatcher import Dispatcher

    original = set_blas_threads(2)
    if original is None:
        pytest.skip("numpy has no OpenBLAS here: no thread count to take")
    before = onednn.use(True)
    seen: list[int] = []
    try:
        assert onednn.get() is not None
        g = Graph()
        x = g.blob("x", (1,), location=CPU)
        y = g.blob("y", (1,), location=CPU)
        g.op("look", "Look", [x], [y], lambda ins, outs: seen.append(blas_threads()))
        d = Dispatcher(g)
        d.run()
        d.run_sequential()
        assert seen == [1, 1] and blas_threads() == 2
    finally:
        onednn.use(before)
        set_blas_threads(original)


def blas_threads() -> int:
    """OpenBLAS's thread count now (read by setting it and putting it back)."""
    n = set_blas_threads(1)
    set_blas_threads(n)
    return n


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                lines.append(record.getMessage())

    handler = Keep()
    log = logging.getLogger("purine")
    log.addHandler(handler)
    yield lines
    log.removeHandler(handler)


@pytest.mark.parametrize("system, machine, why", [
    ("Linux", "x86_64", "oneDNN is not installed (pip install onednn-cpu-gomp==2023.2.0, a "
                        "dependency of purine-caffe here)"),
    ("Darwin", "arm64", "no oneDNN CPU wheel exists for Darwin arm64 (Linux x86-64 only)")])
def test_not_installed_is_numpy_after_one_warning(monkeypatch, fresh, turned_on,
                                                  warnings_logged, system, machine, why):
    monkeypatch.setattr(onednn, "find_library", lambda: None)
    monkeypatch.setattr(onednn.platform, "system", lambda: system)
    monkeypatch.setattr(onednn.platform, "machine", lambda: machine)
    assert onednn.get() is None
    assert onednn.get() is None
    assert warnings_logged == [f"{why}: convolutions run on numpy, about 1.3-2x slower"]


def test_a_broken_library_warns_once_and_falls_back(monkeypatch, fresh, turned_on,
                                                    warnings_logged, tmp_path):
    broken = tmp_path / "libdnnl.so.3"
    broken.write_bytes(b"not a shared library")
    monkeypatch.setattr(onednn, "find_library", lambda: str(broken))
    assert onednn.get() is None
    assert onednn.get() is None
    assert len(warnings_logged) == 1
    assert warnings_logged[0].startswith(
        f"oneDNN at {broken} is not used, convolutions run on numpy: ")
    # ... and the convolutions and inner products still run, on numpy.
    g = GEOMETRIES["1x1"]
    a = conv_arrays(g)
    got = run_ops(g, a, True)
    want = on_numpy(monkeypatch, run_ops, g, a, True)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    a = ip_arrays(64, 800, 500, True, (64, 800))
    got = run_ip(a, 64, True, True)
    want = on_numpy(monkeypatch, run_ip, a, 64, True, True)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_a_system_without_libgomp_is_told_what_to_install(monkeypatch, fresh, turned_on,
                                                         warnings_logged):
    """The OpenMP build's one system library: the loader's error becomes the package to
    install, said once; the nets run on numpy."""
    def no_gomp(path: str) -> None:
        raise OSError("libgomp.so.1: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(onednn, "find_library", lambda: "/site-packages/libdnnl.so.3")
    monkeypatch.setattr(onednn, "_load", no_gomp)
    assert onednn.get() is None and onednn.get() is None
    assert warnings_logged == [
        "oneDNN needs the GNU OpenMP runtime libgomp.so.1, which this system lacks (apt-get "
        "install libgomp1; dnf install libgomp); convolutions run on numpy"]
    assert onednn.describe() == "numpy"


def test_the_wheel_is_found_through_its_file_list():
    path = onednn.find_library()
    if path is None:
        pytest.skip(NOT_INSTALLED)
    assert os.path.basename(path) == onednn.LIBRARY
    assert os.path.exists(path)
