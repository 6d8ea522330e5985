"""Caffe's vision layers (Convolution, Deconvolution, Pooling, LRN): forward values against
hand-computed numbers and against plain loop transcriptions of Caffe's CPU code, float64
gradient checks over the parameters, every internal code path of the conv kernels, and the
errors for bad parameters."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.errors import LayerError
from purine.ops import conv as conv_ops
from tests.gradcheck import check_gradients, layer_net

FLT_MAX = float(np.finfo(np.float32).max)


# -- plain loop references (Caffe's CPU loops, one output element at a time) ---------------
def conv_ref(x, w, b, stride=(1, 1), pad=(0, 0), dilation=(1, 1), group=1):
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    oh = (h + 2 * pad[0] - (dilation[0] * (kh - 1) + 1)) // stride[0] + 1
    ow = (wd + 2 * pad[1] - (dilation[1] * (kw - 1) + 1)) // stride[1] + 1
    y = np.zeros((n, m, oh, ow))
    for i_n in range(n):
        for i_m in range(m):
            g = i_m // (m // group)
            for a in range(oh):
                for bb in range(ow):
                    s = 0.0 if b is None else b[i_m]
                    for i_c in range(cg):
                        for i in range(kh):
                            for j in range(kw):
                                r = a * stride[0] - pad[0] + i * dilation[0]
                                q = bb * stride[1] - pad[1] + j * dilation[1]
                                if 0 <= r < h and 0 <= q < wd:
                                    s += x[i_n, g * cg + i_c, r, q] * w[i_m, i_c, i, j]
                    y[i_n, i_m, a, bb] = s
    return y


def deconv_ref(x, w, b, stride=(1, 1), pad=(0, 0), dilation=(1, 1), group=1):
    """Each input pixel adds its kernel-weighted copy into the output (col2im's view)."""
    n, c, h, wd = x.shape
    _, mg, kh, kw = w.shape
    m, cg = mg * group, c // group
    oh = stride[0] * (h - 1) + dilation[0] * (kh - 1) + 1 - 2 * pad[0]
    ow = stride[1] * (wd - 1) + dilation[1] * (kw - 1) + 1 - 2 * pad[1]
    y = np.zeros((n, m, oh, ow))
    if b is not None:
        y += np.asarray(b).reshape(1, m, 1, 1)
    for i_n in range(n):
        for i_c in range(c):
            g = i_c // cg
            for r in range(h):
                for q in range(wd):
                    for i_m in range(mg):
                        for i in range(kh):
                            for j in range(kw):
                                a = r * stride[0] - pad[0] + i * dilation[0]
                                bb = q * stride[1] - pad[1] + j * dilation[1]
                                if 0 <= a < oh and 0 <= bb < ow:
                                    y[i_n, g * mg + i_m, a, bb] += (x[i_n, i_c, r, q]
                                                                    * w[i_c, i_m, i, j])
    return y


def pooled_size(size, k, s, p, ceil=True):
    span = (size + 2 * p - k) / s
    out = (math.ceil(span) if ceil else math.floor(span)) + 1
    if p and (out - 1) * s >= size + p:
        out -= 1
    return out


def pool_ref(x, method, kernel, stride=(1, 1), pad=(0, 0), ceil=True):
    """Caffe's Forward_cpu loops; returns (top, mask) with mask -1 where MAX saw nothing."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, pad
    n, c, h, w = x.shape
    oh, ow = pooled_size(h, kh, sh, ph, ceil), pooled_size(w, kw, sw, pw, ceil)
    y = np.zeros((n, c, oh, ow))
    mask = np.full((n, c, oh, ow), -1)
    for i_n in range(n):
        for i_c in range(c):
            for a in range(oh):
                for b in range(ow):
                    hs, ws = a * sh - ph, b * sw - pw
                    if method == "MAX":
                        he, we = min(hs + kh, h), min(ws + kw, w)
                        best = -FLT_MAX
                        for r in range(max(hs, 0), he):
                            for q in range(max(ws, 0), we):
                                if x[i_n, i_c, r, q] > best:
                                    best = x[i_n, i_c, r, q]
                                    mask[i_n, i_c, a, b] = r * w + q
                        y[i_n, i_c, a, b] = best
                    else:
                        he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
                        size = (he - hs) * (we - ws)
                        total = sum(x[i_n, i_c, r, q] for r in range(max(hs, 0), min(he, h))
                                    for q in range(max(ws, 0), min(we, w)))
                        y[i_n, i_c, a, b] = total / size
    return y, mask


def lrn_ref(x, size, alpha, beta, k, region):
    n, c, h, w = x.shape
    half = (size - 1) // 2
    y = np.empty_like(x)
    for i_c in range(c):
        for r in range(h):
            for q in range(w):
                if region == "ACROSS_CHANNELS":
                    lo, hi = max(0, i_c - half), min(c, i_c + half + 1)
                    scale = k + alpha / size * (x[:, lo:hi, r, q] ** 2).sum(axis=1)
                else:  # Caffe's AVE pool of x^2 (pad half, divides by size^2), then power
                    box = x[:, i_c, max(0, r - half):r + half + 1, max(0, q - half):q + half + 1]
                    scale = 1 + alpha * (box ** 2).sum(axis=(1, 2)) / size ** 2
                y[:, i_c, r, q] = x[:, i_c, r, q] * scale ** -beta
    return y


# -- helpers ---------------------------------------------------------------------------------
def spec(type_: str, params: str, bottoms=("x",), tops=("y",), name="l") -> str:
    bt = " ".join(f'bottom: "{b}"' for b in bottoms) + " " + " ".join(f'top: "{t}"'
                                                                      for t in tops)
    return f'name: "{name}" type: "{type_}" {bt} {params}'


def conv_params(num_output, kernel, stride=(1, 1), pad=(0, 0), dilation=(1, 1), group=1,
                bias=True, extra=""):
    """A convolution_param in the _h/_w form where the two differ, else the repeated form."""
    parts = [f"num_output: {num_output}", f"group: {group}", f"bias_term: {str(bias).lower()}"]
    for name, (a, b) in (("kernel", kernel), ("stride", stride), ("pad", pad)):
        field = "kernel_size" if name == "kernel" else name
        parts.append(f"{name}_h: {a} {name}_w: {b}" if a != b else f"{field}: {a}")
    parts.append(" ".join(f"dilation: {d}" for d in dilation) if dilation[0] != dilation[1]
                 else f"dilation: {dilation[0]}")
    fill = ('weight_filler { type: "gaussian" std: 0.5 } '
            'bias_filler { type: "gaussian" std: 0.5 }')
    return f"convolution_param {{ {' '.join(parts)} {fill} {extra} }}"


def distinct(shape, seed=0):
    """Values at least 0.05 apart (no ties, so MAX pooling's argmax is stable under the
    finite-difference step), of both signs."""
    n = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    return (rng.permutation(n) - n / 2).reshape(shape) * 0.05 + rng.uniform(0, 1e-3, shape)


def run_forward(layer: str, bottoms: dict[str, np.ndarray], phase=TRAIN) -> Net:
    net = Net(layer_net(layer, {k: v.shape for k, v in bottoms.items()}, False), phase=phase,
              dtype="float64")
    net.forward(**bottoms)
    return net


# -- hand-computed examples ------------------------------------------------------------------
X33 = np.arange(1.0, 10.0).reshape(1, 1, 3, 3)  # [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_convolution_by_hand():
    layer = spec("Convolution", "convolution_param { num_output: 1 kernel_size: 2 }")
    net = Net(layer_net(layer, {"x": X33.shape}, False), dtype="float64")
    net.params["l"][0].data[...] = [[[[1, 2], [3, 4]]]]
    net.params["l"][1].data[...] = [0.5]
    y = net.forward(x=X33)["y"]
    # 1*1 + 2*2 + 4*3 + 5*4 = 37, and so on, plus the bias.
    np.testing.assert_allclose(y, [[[[37.5, 47.5], [67.5, 77.5]]]])

    padded = spec("Convolution", "convolution_param { num_output: 1 kernel_size: 2 pad: 1 "
                                 "stride: 2 bias_term: false }")
    net = Net(layer_net(padded, {"x": X33.shape}, False), dtype="float64")
    net.params["l"][0].data[...] = 1.0
    # Windows at padded (0,0) (0,2) (2,0) (2,2): {1}, {2, 3}, {4, 7}, {5, 6, 8, 9}.
    np.testing.assert_allclose(net.forward(x=X33)["y"], [[[[1, 5], [11, 28]]]])


@pytest.mark.parametrize("type_,weight_shape", [("Convolution", (6, 2, 3, 2)),
                                                ("Deconvolution", (4, 3, 3, 2))])
def test_parameter_shapes_and_fillers(type_, weight_shape):
    params = ("convolution_param { num_output: 6 group: 2 kernel_h: 3 kernel_w: 2 "
              "weight_filler { type: 'constant' value: 0.5 } "
              "bias_filler { type: 'constant' value: 0.25 } }")
    net = Net(layer_net(spec(type_, params), {"x": (1, 4, 5, 5)}), dtype="float64")
    w, b = net.params["l"]
    assert w.shape == weight_shape and b.shape == (6,)
    np.testing.assert_array_equal(w.data, np.full(weight_shape, 0.5))
    np.testing.assert_array_equal(b.data, np.full(6, 0.25))
    # Caffe's default filler is constant 0.
    net = Net(layer_net(spec(type_, "convolution_param { num_output: 2 kernel_size: 1 }"),
                        {"x": (1, 2, 2, 2)}), dtype="float64")
    assert not net.params["l"][0].data.any() and not net.params["l"][1].data.any()


def test_deconvolution_by_hand():
    x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    layer = spec("Deconvolution", "convolution_param { num_output: 1 kernel_size: 2 "
                                  "bias_term: false }")
    net = Net(layer_net(layer, {"x": x.shape}, False), dtype="float64")
    net.params["l"][0].data[...] = 1.0
    # Each input value spreads over the 2x2 block it maps to; the blocks overlap.
    np.testing.assert_allclose(net.forward(x=x)["y"], [[[[1, 3, 2], [4, 10, 6], [3, 7, 4]]]])

    strided = spec("Deconvolution", "convolution_param { num_output: 1 kernel_size: 2 "
                                    "stride: 2 }")
    net = Net(layer_net(strided, {"x": x.shape}, False), dtype="float64")
    net.params["l"][0].data[...] = [[[[1, 10], [100, 1000]]]]
    net.params["l"][1].data[...] = [0.5]
    want = np.kron(x[0, 0], [[1, 10], [100, 1000]]) + 0.5
    np.testing.assert_allclose(net.forward(x=x)["y"], [[want]])


def test_pooling_by_hand():
    def pool(x, params, tops=("y",)):
        return run_forward(spec("Pooling", f"pooling_param {{ {params} }}", tops=tops),
                           {"x": x})

    np.testing.assert_array_equal(pool(X33, "pool: MAX kernel_size: 2 stride: 1")
                                  .blobs["y"].data, [[[[5, 6], [8, 9]]]])
    np.testing.assert_array_equal(pool(X33, "pool: AVE kernel_size: 2 stride: 1")
                                  .blobs["y"].data, [[[[3, 4], [6, 7]]]])
    x55 = np.arange(25.0).reshape(1, 1, 5, 5)
    # 5x5, kernel 3, stride 2: ceil((5 - 3) / 2) + 1 = 2.
    assert pool(x55, "kernel_size: 3 stride: 2").blobs["y"].shape == (1, 1, 2, 2)
    # Kernel 2, stride 2: ceil(3 / 2) + 1 = 3; the last windows hang over the edge.
    net = pool(x55, "pool: MAX kernel_size: 2 stride: 2", tops=("y", "mask"))
    np.testing.assert_array_equal(net.blobs["y"].data,
                                  [[[[6, 8, 9], [16, 18, 19], [21, 23, 24]]]])
    # The mask top holds Caffe's plane index h * W + w of each maximum.
    np.testing.assert_array_equal(net.blobs["mask"].data,
                                  [[[[6, 8, 9], [16, 18, 19], [21, 23, 24]]]])
    # AVE divides by the window clipped to the image (no padding here): 4, 2 or 1 pixels.
    np.testing.assert_allclose(pool(x55, "pool: AVE kernel_size: 2 stride: 2").blobs["y"].data,
                               [[[[3, 5, 6.5], [13, 15, 16.5], [20.5, 22.5, 24]]]])
    # With pad 1, windows count the padding: the corner window {0} over 4, and so on.
    x44 = np.arange(16.0).reshape(1, 1, 4, 4)
    got = pool(x44, "pool: AVE kernel_size: 2 stride: 3 pad: 1").blobs["y"].data
    # ceil((4 + 2 - 2) / 3) + 1 = 3, but the 3rd window would start in the padding: 2.
    np.testing.assert_allclose(got, [[[[0 / 4, (2 + 3) / 4],
                                       [(8 + 12) / 4, (10 + 11 + 14 + 15) / 4]]]])
    got = pool(x44, "pool: MAX kernel_size: 2 stride: 3 pad: 1").blobs["y"].data
    np.testing.assert_array_equal(got, [[[[0, 3], [12, 15]]]])


def test_lrn_by_hand():
    x = np.array([1.0, 2.0, 3.0])
    # Across channels, alpha / n = 1: scale = 1 + the squares of the channel and its
    # neighbours: 6, 15, 14.
    across = run_forward(spec("LRN", "lrn_param { local_size: 3 alpha: 3 beta: 1 }"),
                         {"x": x.reshape(1, 3, 1, 1)}).blobs["y"].data
    np.testing.assert_allclose(across.ravel(), [1 / 6, 2 / 15, 3 / 14], rtol=1e-7)
    # Within a channel, alpha / n^2 = 1 and the 3x3 box of a 1x3 image holds the row
    # neighbours: the same numbers; k plays no part there (Caffe's shift is 1).
    within = run_forward(spec("LRN", "lrn_param { local_size: 3 alpha: 9 beta: 1 k: 5 "
                                     "norm_region: WITHIN_CHANNEL }"),
                         {"x": x.reshape(1, 1, 1, 3)}).blobs["y"].data
    np.testing.assert_allclose(within.ravel(), [1 / 6, 2 / 15, 3 / 14], rtol=1e-7)
    # k and beta: scale = 2 + (1 + 4) / 1 ... with alpha 3, n 3: 2 + 5 = 7 for channel 0.
    got = run_forward(spec("LRN", "lrn_param { local_size: 3 alpha: 3 beta: 0.5 k: 2 }"),
                      {"x": x.reshape(1, 3, 1, 1)}).blobs["y"].data
    np.testing.assert_allclose(got.ravel(), [1 / 7 ** 0.5, 2 / 16 ** 0.5, 3 / 15 ** 0.5],
                               rtol=1e-7)


# -- forward values against the loop references ----------------------------------------------
CONV_CASES = [
    # (bottom shape, num_output, kernel, stride, pad, dilation, group, bias)
    ((2, 3, 6, 5), 4, (3, 3), (1, 1), (0, 0), (1, 1), 1, True),
    ((2, 4, 7, 6), 6, (3, 2), (2, 1), (1, 2), (1, 1), 2, True),
    ((1, 6, 9, 8), 3, (2, 3), (2, 3), (1, 0), (2, 1), 3, False),
    ((3, 2, 5, 5), 2, (3, 3), (1, 1), (2, 2), (2, 2), 1, True),
    ((2, 4, 4, 4), 4, (1, 1), (1, 1), (0, 0), (1, 1), 2, True),  # 1x1: no im2col
    ((2, 2, 6, 6), 3, (1, 1), (2, 2), (1, 1), (1, 1), 1, False),  # 1x1 with stride and pad
    ((2, 3, 5, 4), 2, (5, 4), (1, 1), (0, 0), (1, 1), 1, True),  # the kernel fills the image
]


@pytest.mark.parametrize("shape,num_output,kernel,stride,pad,dilation,group,bias", CONV_CASES)
def test_convolution_forward_matches_reference(shape, num_output, kernel, stride, pad,
                                               dilation, group, bias):
    layer = spec("Convolution", conv_params(num_output, kernel, stride, pad, dilation, group,
                                            bias))
    x = np.random.default_rng(1).standard_normal(shape)
    net = run_forward(layer, {"x": x})
    w = net.params["l"][0].data
    assert w.shape == (num_output, shape[1] // group) + kernel
    b = net.params["l"][1].data if bias else None
    assert len(net.params["l"]) == (2 if bias else 1)
    np.testing.assert_allclose(net.blobs["y"].data,
                               conv_ref(x, w, b, stride, pad, dilation, group), atol=1e-12)


@pytest.mark.parametrize("shape,num_output,kernel,stride,pad,dilation,group,bias", CONV_CASES)
def test_deconvolution_forward_matches_reference(shape, num_output, kernel, stride, pad,
                                                 dilation, group, bias):
    layer = spec("Deconvolution", conv_params(num_output, kernel, stride, pad, dilation,
                                              group, bias))
    x = np.random.default_rng(2).standard_normal(shape)
    net = run_forward(layer, {"x": x})
    w = net.params["l"][0].data
    assert w.shape == (shape[1], num_output // group) + kernel
    b = net.params["l"][1].data if bias else None
    want = deconv_ref(x, w, b, stride, pad, dilation, group)
    assert net.blobs["y"].shape == want.shape
    np.testing.assert_allclose(net.blobs["y"].data, want, atol=1e-12)


POOL_CASES = [
    # (bottom shape, kernel, stride, pad, FLOOR rounding)
    ((2, 3, 5, 5), (3, 3), (2, 2), (0, 0), False),
    ((2, 2, 6, 7), (2, 2), (2, 2), (0, 0), False),
    ((1, 2, 7, 6), (3, 2), (2, 3), (1, 1), False),
    ((2, 2, 5, 7), (3, 3), (1, 1), (2, 1), False),
    ((1, 3, 4, 4), (2, 2), (3, 3), (1, 1), False),  # the padded last window is dropped
    ((1, 2, 6, 5), (3, 3), (3, 3), (1, 1), False),
    ((1, 2, 8, 9), (3, 3), (2, 2), (1, 1), True),
    ((2, 1, 3, 3), (4, 4), (2, 2), (0, 0), False),  # kernel over the edge: ceil(-0.5) + 1
]


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("shape,kernel,stride,pad,floor", POOL_CASES)
def test_pooling_forward_matches_reference(method, shape, kernel, stride, pad, floor):
    x = np.random.default_rng(3).standard_normal(shape)
    params = (f"pool: {method} kernel_h: {kernel[0]} kernel_w: {kernel[1]} "
              f"stride_h: {stride[0]} stride_w: {stride[1]} pad_h: {pad[0]} pad_w: {pad[1]}"
              + (" round_mode: FLOOR" if floor else ""))
    tops = ("y", "mask") if method == "MAX" else ("y",)
    net = run_forward(spec("Pooling", f"pooling_param {{ {params} }}", tops=tops), {"x": x})
    want, mask = pool_ref(x, method, kernel, stride, pad, ceil=not floor)
    assert net.blobs["y"].shape == want.shape
    np.testing.assert_allclose(net.blobs["y"].data, want, atol=1e-12)
    if method == "MAX":
        np.testing.assert_array_equal(net.blobs["mask"].data, mask)


def test_max_pooling_ties_take_the_first_in_scan_order():
    x = np.random.default_rng(4).integers(0, 3, (2, 3, 7, 7)).astype(float)
    net = run_forward(spec("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 "
                                      "pad: 1 }", tops=("y", "mask")), {"x": x})
    want, mask = pool_ref(x, "MAX", (3, 3), (2, 2), (1, 1))
    np.testing.assert_array_equal(net.blobs["y"].data, want)
    np.testing.assert_array_equal(net.blobs["mask"].data, mask)


def test_pooling_windows_outside_the_image_keep_caffes_values():
    # Stride 3 > kernel 1 without padding: ceil(4 / 3) + 1 = 3 windows, the last starts at
    # 6 >= 5 and sees nothing. Caffe leaves MAX at -FLT_MAX with mask -1; AVE divides
    # 0 by the extent min(7, 5) - 6 = -1 in each axis.
    x = np.arange(1.0, 26.0).reshape(1, 1, 5, 5)
    net = run_forward(spec("Pooling", "pooling_param { pool: MAX kernel_size: 1 stride: 3 }",
                           tops=("y", "mask")), {"x": x})
    np.testing.assert_array_equal(net.blobs["y"].data[0, 0],
                                  [[1, 4, -FLT_MAX], [16, 19, -FLT_MAX], [-FLT_MAX] * 3])
    np.testing.assert_array_equal(net.blobs["mask"].data[0, 0],
                                  [[0, 3, -1], [15, 18, -1], [-1, -1, -1]])
    net.blobs["y"].diff[...] = 1.0
    ave = run_forward(spec("Pooling", "pooling_param { pool: AVE kernel_size: 1 stride: 3 }"),
                      {"x": x})
    np.testing.assert_array_equal(ave.blobs["y"].data[0, 0], [[1, 4, 0], [16, 19, 0], [0, 0, 0]])
    # The backward pass sends nothing to (or from) the empty windows.
    for method in ("MAX", "AVE"):
        layer = spec("Pooling", f"pooling_param {{ pool: {method} kernel_size: 1 stride: 3 }}")
        net = Net(layer_net(layer, {"x": x.shape}), dtype="float64")
        net.forward(x=x)
        dx = net.backward(y=np.arange(1.0, 10.0).reshape(1, 1, 3, 3))["x"]
        want = np.zeros((5, 5))
        want[np.ix_([0, 3], [0, 3])] = [[1, 2], [4, 5]]
        np.testing.assert_array_equal(dx[0, 0], want)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_global_pooling(method):
    x = distinct((2, 3, 4, 5))
    net = run_forward(spec("Pooling", f"pooling_param {{ pool: {method} global_pooling: true }}"),
                      {"x": x})
    flat = x.reshape(2, 3, -1)
    want = flat.max(axis=2) if method == "MAX" else flat.mean(axis=2)
    np.testing.assert_allclose(net.blobs["y"].data, want[:, :, None, None], rtol=1e-12)
    check_gradients(spec("Pooling", f"pooling_param {{ pool: {method} global_pooling: true }}"),
                    {"x": x})


LRN_CASES = [
    # (bottom shape, local_size, alpha, beta, k)
    ((2, 7, 3, 4), 5, 0.3, 0.75, 2.0),
    ((2, 3, 4, 5), 3, 2.0, 0.6, 1.0),
    ((1, 2, 3, 3), 5, 1.0, 0.5, 1.5),  # window wider than the blob
    ((1, 4, 2, 3), 1, 0.5, 1.0, 1.0),
]


@pytest.mark.parametrize("region", ["ACROSS_CHANNELS", "WITHIN_CHANNEL"])
@pytest.mark.parametrize("shape,size,alpha,beta,k", LRN_CASES)
def test_lrn_forward_matches_reference(region, shape, size, alpha, beta, k):
    x = np.random.default_rng(5).standard_normal(shape)
    layer = spec("LRN", f"lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} k: {k} "
                        f"norm_region: {region} }}")
    got = run_forward(layer, {"x": x}).blobs["y"].data
    # The prototxt's floats are float32: compare with the parameters as Caffe reads them.
    alpha, beta, k = (float(np.float32(v)) for v in (alpha, beta, k))
    np.testing.assert_allclose(got, lrn_ref(x, size, alpha, beta, k, region), rtol=1e-12)


# -- gradient checks -------------------------------------------------------------------------
GRAD_CONV = [
    ((2, 3, 5, 5), 4, (3, 3), (1, 1), (1, 1), (1, 1), 1, True),
    ((2, 4, 5, 6), 4, (3, 2), (2, 1), (0, 1), (1, 1), 2, True),
    ((1, 4, 7, 7), 2, (3, 3), (2, 2), (2, 2), (2, 2), 2, False),
    ((2, 2, 4, 5), 3, (2, 3), (1, 2), (1, 0), (1, 2), 1, True),
    ((2, 4, 3, 3), 6, (1, 1), (1, 1), (0, 0), (1, 1), 2, True),
]


@pytest.mark.parametrize("type_", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("shape,num_output,kernel,stride,pad,dilation,group,bias", GRAD_CONV)
def test_convolution_gradients(type_, shape, num_output, kernel, stride, pad, dilation, group,
                               bias):
    layer = spec(type_, conv_params(num_output, kernel, stride, pad, dilation, group, bias))
    check_gradients(layer, {"x": np.random.default_rng(6).standard_normal(shape)})


@pytest.mark.parametrize("type_", ["Convolution", "Deconvolution"])
def test_convolution_several_bottoms_share_the_weights(type_):
    layer = spec(type_, conv_params(3, (2, 2), pad=(1, 1), group=1), bottoms=("a", "b"),
                 tops=("ya", "yb"))
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 4, 3))
    net = check_gradients(layer, {"a": a, "b": b})
    w, bias = net.params["l"][0].data, net.params["l"][1].data
    ref = conv_ref if type_ == "Convolution" else deconv_ref
    for x, top in ((a, "ya"), (b, "yb")):
        np.testing.assert_allclose(net.blobs[top].data, ref(x, w, bias, pad=(1, 1)),
                                   atol=1e-12)


def test_convolution_1d_and_channel_axis():
    # A 1-d convolution over (N, C, L), and a channel axis 2 with the leading axes folded
    # into the batch, as Caffe's num_ = count(0, channel_axis).
    x = np.random.default_rng(8).standard_normal((2, 3, 7))
    layer = spec("Convolution", "convolution_param { num_output: 2 kernel_size: 3 stride: 2 "
                                "pad: 1 dilation: 1 weight_filler { type: 'gaussian' } "
                                "bias_filler { type: 'gaussian' } }")
    net = check_gradients(layer, {"x": x})
    w, b = net.params["l"][0].data, net.params["l"][1].data
    assert w.shape == (2, 3, 3)
    want = conv_ref(x[:, :, None, :], w[:, :, None, :], b, (1, 2), (0, 1))[:, :, 0, :]
    np.testing.assert_allclose(net.blobs["y"].data, want, atol=1e-12)

    layer = spec("Deconvolution", "convolution_param { num_output: 2 kernel_size: 3 "
                                  "stride: 2 pad: 1 weight_filler { type: 'gaussian' } }")
    net = check_gradients(layer, {"x": x})
    w, b = net.params["l"][0].data, net.params["l"][1].data
    assert net.blobs["y"].shape == (2, 2, 2 * 6 + 3 - 2)
    want = deconv_ref(x[:, :, None, :], w[:, :, None, :], b, (1, 2), (0, 1))[:, :, 0, :]
    np.testing.assert_allclose(net.blobs["y"].data, want, atol=1e-12)

    x5 = np.random.default_rng(9).standard_normal((2, 1, 2, 4, 3))
    layer = spec("Convolution", "convolution_param { num_output: 3 kernel_size: 2 axis: 2 "
                                "weight_filler { type: 'gaussian' } }")
    net = check_gradients(layer, {"x": x5})
    w, b = net.params["l"][0].data, net.params["l"][1].data
    assert net.blobs["y"].shape == (2, 1, 3, 3, 2)
    want = conv_ref(x5.reshape(2, 2, 4, 3), w, b).reshape(2, 1, 3, 3, 2)
    np.testing.assert_allclose(net.blobs["y"].data, want, atol=1e-12)


GRAD_POOL = [
    ((2, 2, 5, 5), (3, 3), (2, 2), (0, 0)),
    ((2, 2, 6, 6), (2, 2), (2, 2), (0, 0)),
    ((1, 3, 7, 6), (3, 2), (2, 3), (1, 1)),
    ((2, 2, 5, 7), (3, 3), (1, 1), (2, 1)),
    ((1, 2, 4, 4), (2, 2), (3, 3), (1, 1)),
]


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("shape,kernel,stride,pad", GRAD_POOL)
def test_pooling_gradients(method, shape, kernel, stride, pad):
    params = (f"pool: {method} kernel_h: {kernel[0]} kernel_w: {kernel[1]} "
              f"stride_h: {stride[0]} stride_w: {stride[1]} pad_h: {pad[0]} pad_w: {pad[1]}")
    check_gradients(spec("Pooling", f"pooling_param {{ {params} }}"), {"x": distinct(shape)})


def test_max_pooling_gradient_through_the_mask_top():
    layer = spec("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }",
                 tops=("y", "mask"))
    check_gradients(layer, {"x": distinct((2, 2, 6, 5))}, tops=["y"])


@pytest.mark.parametrize("region", ["ACROSS_CHANNELS", "WITHIN_CHANNEL"])
@pytest.mark.parametrize("shape,size,alpha,beta,k", LRN_CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_lrn_gradients(region, shape, size, alpha, beta, k, in_place):
    layer = spec("LRN", f"lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} k: {k} "
                        f"norm_region: {region} }}", tops=("x",) if in_place else ("y",))
    x = np.random.default_rng(10).standard_normal(shape)
    net = check_gradients(layer, {"x": x})
    if in_place:
        got = net.blobs["x"].data
        alpha, beta, k = (float(np.float32(v)) for v in (alpha, beta, k))
        np.testing.assert_allclose(got, lrn_ref(x, size, alpha, beta, k, region), rtol=1e-12)


def test_lrn_beta_fast_paths_match_pow():
    # beta 0.75 and 0.5 use square roots instead of pow: same values.
    x = np.random.default_rng(11).standard_normal((2, 5, 3, 3))
    for beta in (0.75, 0.5, 1.0, 0.8):
        got = run_forward(spec("LRN", f"lrn_param {{ local_size: 3 alpha: 0.5 beta: {beta} }}"),
                          {"x": x}).blobs["y"].data
        b = float(np.float32(beta))
        np.testing.assert_allclose(got, lrn_ref(x, 3, 0.5, b, 1.0, "ACROSS_CHANNELS"),
                                   rtol=1e-13)


# -- the conv kernels' internal paths: layouts, chunks, full correlation ----------------------
COLS = dict(ROW_RUN_MIN=10 ** 9, SAMPLE_PIXELS_MIN=10 ** 9)  # the (K, n*P) column layout
ROWS = dict(ROW_RUN_MIN=0, ROW_OUTPUTS_MAX=10 ** 9)  # channels-last (n*P, K) rows
SAMPLES = dict(ROW_RUN_MIN=10 ** 9, SAMPLE_PIXELS_MIN=0)  # per-sample (K, P) GEMMs
PATHS = {
    "batch_first": dict(COLS, BATCH_LAST_BELOW=0, FULL_CORRELATION_RATIO=0.0),
    "batch_last": dict(COLS, BATCH_LAST_BELOW=10 ** 6, FULL_CORRELATION_RATIO=0.0),
    "full_correlation_batch_first": dict(COLS, BATCH_LAST_BELOW=0,
                                         FULL_CORRELATION_RATIO=1e9),
    "full_correlation_batch_last": dict(COLS, BATCH_LAST_BELOW=10 ** 6,
                                        FULL_CORRELATION_RATIO=1e9),
    "rows": dict(ROWS, FULL_CORRELATION_RATIO=0.0),
    "rows_full_correlation": dict(ROWS, FULL_CORRELATION_RATIO=1e9),
    "samples": dict(SAMPLES, FULL_CORRELATION_RATIO=0.0),
    "samples_full_correlation": dict(SAMPLES, FULL_CORRELATION_RATIO=1e9),
}
KERNEL_CASES = [
    (3, 4, 7, 6, 6, 3, 2, 2, 1, 1, 1, 1, 1, 2),
    (3, 4, 9, 9, 4, 3, 3, 1, 1, 2, 2, 2, 2, 2),
    (5, 3, 6, 7, 5, 2, 3, 1, 1, 1, 2, 1, 1, 1),
    (3, 2, 5, 5, 3, 3, 3, 1, 1, 0, 0, 1, 1, 1),
    (4, 6, 4, 4, 6, 1, 1, 1, 1, 0, 0, 1, 1, 3),
    (3, 2, 9, 11, 3, 3, 3, 1, 2, 1, 1, 2, 2, 1),  # row stride 1, column stride 2, dilated
    (2, 4, 6, 8, 4, 2, 3, 1, 3, 1, 0, 1, 2, 2),
]


def conv_weight_ref(x, dy, kernel, stride, pad, dilation, group):
    """dw[m, c, i, j] = sum over n and output pixels of dy * the input under tap (i, j)."""
    n, c, h, w = x.shape
    m, oh, ow = dy.shape[1:]
    cg = c // group
    dw = np.zeros((m, cg) + kernel)
    for i_m in range(m):
        g = i_m // (m // group)
        for i_c in range(cg):
            for i in range(kernel[0]):
                for j in range(kernel[1]):
                    for a in range(oh):
                        for b in range(ow):
                            r = a * stride[0] - pad[0] + i * dilation[0]
                            q = b * stride[1] - pad[1] + j * dilation[1]
                            if 0 <= r < h and 0 <= q < w:
                                dw[i_m, i_c, i, j] += np.dot(dy[:, i_m, a, b],
                                                             x[:, g * cg + i_c, r, q])
    return dw


@functools.cache
def kernel_case(args):
    """Inputs and loop-reference results of one geometry, shared by all its paths."""
    g = conv_ops.ConvGeometry(*args)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((g.num, g.channels, g.height, g.width))
    w = rng.standard_normal((g.num_output, g.channels // g.group, g.kernel_h, g.kernel_w))
    b = rng.standard_normal(g.num_output)
    dy = rng.standard_normal((g.num, g.num_output, g.out_h, g.out_w))
    geo = dict(stride=(g.stride_h, g.stride_w), pad=(g.pad_h, g.pad_w),
               dilation=(g.dilation_h, g.dilation_w), group=g.group)
    y = conv_ref(x, w, b, **geo)
    dw = conv_weight_ref(x, dy, (g.kernel_h, g.kernel_w), **geo)
    return g, x, w, b, dy, y, y - b.reshape(1, -1, 1, 1), dw


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("chunk", [1, 2, None])
@pytest.mark.parametrize("args", KERNEL_CASES)
def test_conv_kernel_paths(monkeypatch, path, chunk, args):
    g, x, w, b, dy, want_y, linear, want_dw = kernel_case(args)
    for name, value in PATHS[path].items():
        monkeypatch.setattr(conv_ops, name, value)
    if chunk is not None:  # chunks of `chunk` samples; 2 leaves a short last chunk
        per_sample = g.channels * g.kernel_h * g.kernel_w * g.out_h * g.out_w
        monkeypatch.setattr(conv_ops, "COL_BUDGET", chunk * per_sample)
        monkeypatch.setattr(conv_ops, "MIN_COLUMNS", 0)
    ws = conv_ops._Workspace(np, g, np.float64)
    assert len(ws.chunks) == (1 if chunk is None else -(-g.num // chunk))
    layout = path.split("_")[0] if path.startswith(("rows", "samples")) else "cols"
    assert conv_ops._layout(g, forward=True) == layout
    y = np.empty_like(dy)
    conv_ops.conv_forward(x, w, b, y, geom=g)
    np.testing.assert_allclose(y, want_y, atol=1e-12)
    # Backward data is the adjoint of the forward map: <W^T dy, x> = <dy, W x>.
    dx = np.empty_like(x)
    conv_ops.conv_backward_data(dy, w, dx, geom=g)
    np.testing.assert_allclose(np.vdot(dx, x), np.vdot(dy, linear), rtol=1e-12)
    dw = np.empty_like(w)
    conv_ops.conv_backward_weight(x, dy, x, dy, dw, geom=g)  # two pairs: dw doubles
    np.testing.assert_allclose(dw, 2 * want_dw, atol=1e-10)
    db = np.empty_like(b)
    conv_ops.conv_backward_bias(dy, dy, db, num=g.num)
    np.testing.assert_allclose(db, 2 * dy.sum(axis=(0, 2, 3)), atol=1e-12)


@pytest.mark.parametrize("path", [COLS, ROWS, SAMPLES])
def test_conv_kernels_keep_float32(monkeypatch, path):
    for name, value in path.items():
        monkeypatch.setattr(conv_ops, name, value)
    g = conv_ops.ConvGeometry(2, 3, 6, 6, 4, 3, 3, pad_h=1, pad_w=1)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    y = np.empty((2, 4, 6, 6), np.float32)
    conv_ops.conv_forward(x, w, b, y, geom=g)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, conv_ref(x.astype(float), w.astype(float), b.astype(float),
                                           pad=(1, 1)), rtol=1e-4, atol=1e-4)
    dw = np.empty_like(w)
    conv_ops.conv_backward_weight(x, y, dw, geom=g)
    want = conv_weight_ref(x.astype(float), y.astype(float), (3, 3), (1, 1), (1, 1), (1, 1), 1)
    np.testing.assert_allclose(dw, want, rtol=1e-4, atol=1e-3)


# -- errors ----------------------------------------------------------------------------------
ERRORS = [
    ("Pooling", "pooling_param { kernel_size: 2 kernel_h: 2 kernel_w: 2 }", (1, 1, 4, 4),
     "not both"),
    ("Pooling", "pooling_param { kernel_h: 2 }", (1, 1, 4, 4), "given together"),
    ("Pooling", "pooling_param { stride: 2 }", (1, 1, 4, 4), "kernel_size"),
    ("Pooling", "pooling_param { kernel_size: 2 pad: 2 }", (1, 1, 4, 4), "smaller than"),
    ("Pooling", "pooling_param { global_pooling: true kernel_size: 2 }", (1, 1, 4, 4),
     "cannot be given"),
    ("Pooling", "pooling_param { global_pooling: true stride: 2 }", (1, 1, 4, 4), "stride 1"),
    ("Pooling", "pooling_param { kernel_size: 2 }", (2, 4, 4), "4 axes"),
    ("Pooling", "pooling_param { pool: AVE kernel_size: 5 round_mode: FLOOR }", (1, 1, 3, 3),
     "not positive"),
    ("LRN", "lrn_param { local_size: 4 }", (1, 3, 2, 2), "must be odd"),
    ("LRN", "", (3, 2, 2), "4 axes"),
    ("Convolution", "convolution_param { num_output: 2 kernel_size: 2 }", (1, 1, 3, 3, 3),
     "1-d and 2-d convolution only"),
    ("Convolution", "convolution_param { num_output: 2 kernel_size: 2 group: 2 }",
     (1, 3, 4, 4), "group 2 must divide"),
    ("Convolution", "convolution_param { num_output: 3 kernel_size: 1 group: 2 }",
     (1, 4, 4, 4), "group 2 must divide"),
    ("Convolution", "convolution_param { num_output: 2 }", (1, 1, 4, 4), "kernel_size"),
    ("Convolution", "convolution_param { num_output: 2 kernel_size: 2 kernel_h: 2 "
                    "kernel_w: 2 }", (1, 1, 4, 4), "not both"),
    ("Convolution", "convolution_param { num_output: 2 kernel_h: 2 }", (1, 1, 4, 4),
     "must be positive"),
    ("Convolution", "convolution_param { num_output: 2 kernel_size: 2 kernel_size: 2 "
                    "kernel_size: 2 }", (1, 1, 4, 4), "once per spatial axis"),
    ("Convolution", "convolution_param { kernel_size: 2 }", (1, 1, 4, 4), "num_output"),
    ("Convolution", "convolution_param { num_output: 1 kernel_size: 5 }", (1, 1, 4, 4),
     "exceeds the padded input"),
    ("Convolution", "convolution_param { num_output: 1 kernel_size: 2 stride: 0 }",
     (1, 1, 4, 4), "stride must be positive"),
    ("Deconvolution", "convolution_param { num_output: 1 kernel_size: 2 pad: 3 }",
     (1, 1, 2, 2), "not positive"),
]


@pytest.mark.parametrize("type_,params,shape,message", ERRORS)
def test_errors(type_, params, shape, message):
    with pytest.raises(LayerError, match=message):
        Net(layer_net(spec(type_, params), {"x": shape}), dtype="float64")


@pytest.mark.parametrize("type_,params", [
    ("Convolution", "convolution_param { num_output: 2 kernel_size: 1 }"),
    ("Pooling", "pooling_param { kernel_size: 1 }"),
])
def test_in_place_is_refused(type_, params):
    with pytest.raises(LayerError, match="cannot run in place"):
        Net(layer_net(spec(type_, params, tops=("x",)), {"x": (1, 2, 3, 3)}), dtype="float64")


def test_convolution_needs_one_top_per_bottom_of_one_shape():
    with pytest.raises(LayerError, match="one top per bottom"):
        Net(layer_net(spec("Convolution", "convolution_param { num_output: 1 kernel_size: 1 }",
                           bottoms=("a", "b")), {"a": (1, 1, 2, 2), "b": (1, 1, 2, 2)}))
    with pytest.raises(LayerError, match="one shape"):
        Net(layer_net(spec("Convolution", "convolution_param { num_output: 1 kernel_size: 1 }",
                           bottoms=("a", "b"), tops=("c", "d")),
                      {"a": (1, 1, 2, 2), "b": (1, 1, 3, 2)}))


def test_max_pooling_only_has_a_mask_top():
    with pytest.raises(LayerError, match="top"):
        Net(layer_net(spec("Pooling", "pooling_param { pool: AVE kernel_size: 2 }",
                           tops=("y", "m")), {"x": (1, 1, 4, 4)}))


def test_test_phase_forward_needs_no_backward():
    x = distinct((2, 3, 8, 8))
    layers = (spec("Convolution", conv_params(4, (3, 3), pad=(1, 1)), name="c", tops=("c",))
              + " } layer { " + spec("Pooling", "pooling_param { kernel_size: 3 stride: 2 }",
                                     bottoms=("c",), tops=("p",), name="p")
              + " } layer { " + spec("LRN", "lrn_param { local_size: 3 }", bottoms=("p",),
                                     tops=("n",), name="n"))
    net = Net(layer_net(layers, {"x": x.shape}, False), phase=TEST, dtype="float64")
    out = net.forward(x=x)["n"]
    w, b = net.params["c"][0].data, net.params["c"][1].data
    c = conv_ref(x, w, b, pad=(1, 1))
    p, _ = pool_ref(c, "MAX", (3, 3), (2, 2))
    np.testing.assert_allclose(out, lrn_ref(p, 3, 1.0, 0.75, 1.0, "ACROSS_CHANNELS"),
                               rtol=1e-12)
