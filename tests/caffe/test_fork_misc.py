"""The forks' Interp, ShuffleChannel, ConvolutionDepthwise / DepthwiseConvolution, ReLU6,
Mish, Upsample and Axpy: forward against OpenCV's Caffe importer where it reads the layer as
the fork does, against numpy transcriptions of the forks' loops and numbers by hand
elsewhere, and float64 gradient checks."""

from __future__ import annotations

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.errors import LayerError, PurineError
from purine.formats import caffe_pb2 as pb
from tests.gradcheck import check_gradients, forward_layer, gaussian, layer_net, layer_spec

needs_schema = pytest.mark.skipif(
    not all(hasattr(pb.LayerParameter(), f)
            for f in ("interp_param", "shuffle_channel_param", "upsample_param")),
    reason="the forks' fields are not in caffe.proto yet")


def top_of(net: Net) -> np.ndarray:
    return net.blobs[net.builder.layers[-1].param.top[0]].data.copy()


# -- OpenCV ---------------------------------------------------------------------------------
GAUSS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'
OPENCV_CASES = {
    # OpenCV's Interp reads zoom_factor, or height and width (not shrink_factor, pad_beg,
    # pad_end or a second bottom: those are checked against the fork's rule below).
    "interp_zoom": 'layer { name: "i" type: "Interp" bottom: "data" top: "i" '
                   'interp_param { zoom_factor: 3 } }',
    "interp_size": 'layer { name: "i" type: "Interp" bottom: "data" top: "i" '
                   'interp_param { height: 11 width: 4 } }',
    "shuffle": 'layer { name: "s" type: "ShuffleChannel" bottom: "data" top: "s" '
               'shuffle_channel_param { group: 3 } }',
    "depthwise": f'layer {{ name: "dw" type: "ConvolutionDepthwise" bottom: "data" top: "dw" '
                 f'convolution_param {{ num_output: 6 kernel_size: 3 stride: 2 pad: 1 '
                 f'{GAUSS} }} }}',
    "depthwise_multiplier": f'layer {{ name: "dw" type: "ConvolutionDepthwise" bottom: "data" '
                            f'top: "dw" convolution_param {{ num_output: 12 kernel_h: 3 '
                            f'kernel_w: 2 dilation: 2 pad: 2 {GAUSS} }} }}',
    "relu6_mish": 'layer { name: "r6" type: "ReLU6" bottom: "data" top: "r6" }\n'
                  'layer { name: "m" type: "Mish" bottom: "data" top: "m" }',
    "chain": f'layer {{ name: "dw" type: "ConvolutionDepthwise" bottom: "data" top: "dw" '
             f'convolution_param {{ num_output: 6 kernel_size: 3 pad: 1 group: 6 {GAUSS} }} }}\n'
             'layer { name: "r6" type: "ReLU6" bottom: "dw" top: "r6" }\n'
             'layer { name: "s" type: "ShuffleChannel" bottom: "r6" top: "s" '
             'shuffle_channel_param { group: 2 } }\n'
             'layer { name: "i" type: "Interp" bottom: "s" top: "i" '
             'interp_param { zoom_factor: 2 } }\n'
             'layer { name: "m" type: "Mish" bottom: "i" top: "m" }',
}


def opencv_outputs(tmp_path, body: str, x: np.ndarray, names: list[str] | None = None,
                   opencv_body: str | None = None) -> tuple[dict, dict]:
    """Our TEST-phase outputs and OpenCV's for the net ``Input data`` + ``body``, with the
    weights we fill written as a .caffemodel (OpenCV runs ``opencv_body`` if given)."""
    cv2 = pytest.importorskip("cv2")
    if not hasattr(cv2, "dnn") or not hasattr(cv2.dnn, "readNetFromCaffe"):
        pytest.skip("this OpenCV has no Caffe importer")
    head = ('name: "f"\nlayer { name: "data" type: "Input" top: "data" input_param { shape { '
            + " ".join(f"dim: {d}" for d in x.shape) + " } } }\n")
    ours_path, theirs_path = tmp_path / "ours.prototxt", tmp_path / "theirs.prototxt"
    ours_path.write_text(head + body)
    theirs_path.write_text(head + (opencv_body or body))
    net = Net(str(ours_path), phase=TEST, seed=5)
    weights = tmp_path / "net.caffemodel"
    net.save(weights)
    names = names or list(net.outputs)
    ours = net.forward(data=x, blobs=names)
    cv = cv2.dnn.readNetFromCaffe(str(theirs_path), str(weights))
    cv.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    theirs = {}
    for name in names:
        cv.setInput(x)
        theirs[name] = cv.forward(name)
    return {n: ours[n] for n in names}, theirs


def assert_close_per_blob(ours: dict, theirs: dict) -> None:
    for name, value in ours.items():
        assert theirs[name].shape == value.shape, name
        scale = max(float(np.abs(theirs[name]).max()), 1e-30)
        np.testing.assert_allclose(value, theirs[name], rtol=1e-4, atol=1e-4 * scale,
                                   err_msg=name)


@needs_schema
@pytest.mark.parametrize("case", sorted(OPENCV_CASES))
def test_forward_matches_opencv(tmp_path, case):
    x = (np.random.default_rng(3).standard_normal((2, 6, 7, 5)) * 4).astype(np.float32)
    body = OPENCV_CASES[case]  # every layer's top is named after the layer, as OpenCV
    # names a layer's output (so no layer runs in place here)
    names = [line.split('top: "')[1].split('"')[0] for line in body.splitlines()]
    ours, theirs = opencv_outputs(tmp_path, body, x, names=list(dict.fromkeys(names)))
    assert_close_per_blob(ours, theirs)


def test_depthwise_convolution_spelling_matches_opencv(tmp_path):
    """OpenCV has no DepthwiseConvolution type: it runs the same layer as
    ConvolutionDepthwise, with our weights."""
    x = np.random.default_rng(4).standard_normal((2, 4, 9, 8)).astype(np.float32)
    body = (f'layer {{ name: "dw" type: "DepthwiseConvolution" bottom: "data" top: "dw" '
            f'convolution_param {{ num_output: 4 group: 4 kernel_size: 3 stride: 2 '
            f'{GAUSS} }} }}')
    ours, theirs = opencv_outputs(tmp_path, body, x, ["dw"],
                                  body.replace("DepthwiseConvolution", "ConvolutionDepthwise"))
    assert_close_per_blob(ours, theirs)


# -- Interp ---------------------------------------------------------------------------------
def fork_interp(x: np.ndarray, out_h: int, out_w: int, pad_beg: int = 0,
                pad_end: int = 0) -> np.ndarray:
    """DeepLab's InterpLayer forward, pixel by pixel: crop by pad_beg/pad_end, then
    bilinear with the corners aligned, positions in float32 as caffe_cpu_interp2."""
    n, c, h, w = x.shape
    h1, w1 = h + pad_beg + pad_end, w + pad_beg + pad_end
    src = x[:, :, -pad_beg:-pad_beg + h1, -pad_beg:-pad_beg + w1]
    f32 = np.float32
    rh = f32(h1 - 1) / f32(out_h - 1) if out_h > 1 else f32(0)
    rw = f32(w1 - 1) / f32(out_w - 1) if out_w > 1 else f32(0)
    y = np.zeros((n, c, out_h, out_w))
    for i in range(out_h):
        hr = rh * f32(i)
        hi = int(hr)
        hp = 1 if hi < h1 - 1 else 0
        lh1 = float(hr - f32(hi))
        lh0 = 1 - lh1
        for j in range(out_w):
            wr = rw * f32(j)
            wi = int(wr)
            wp = 1 if wi < w1 - 1 else 0
            lw1 = float(wr - f32(wi))
            lw0 = 1 - lw1
            y[:, :, i, j] = (lh0 * (lw0 * src[:, :, hi, wi] + lw1 * src[:, :, hi, wi + wp])
                             + lh1 * (lw0 * src[:, :, hi + hp, wi]
                                      + lw1 * src[:, :, hi + hp, wi + wp]))
    return y


def interp(params: str, x: np.ndarray, ref: np.ndarray | None = None) -> np.ndarray:
    bottoms = ["x"] + (["r"] if ref is not None else [])
    spec = layer_spec("i", "Interp", bottoms, ["y"], f"interp_param {{ {params} }}")
    feeds = {"x": x} | ({"r": ref} if ref is not None else {})
    return top_of(forward_layer(spec, **feeds))


@needs_schema
def test_interp_by_hand():
    x = np.array([[[[0.0, 1.0], [2.0, 3.0]]]])
    np.testing.assert_allclose(interp("zoom_factor: 2", x)[0, 0],
                               [[0, 0.5, 1], [1, 1.5, 2], [2, 2.5, 3]])
    grid = np.arange(25.0).reshape(1, 1, 5, 5)
    # shrink 2: (5 - 1) / 2 + 1 = 3 rows and columns, which land on inputs 0, 2, 4
    np.testing.assert_allclose(interp("shrink_factor: 2", grid)[0, 0], grid[0, 0, ::2, ::2])
    # shrink 2 then zoom 2: 5 -> 3 -> 5, the input itself
    np.testing.assert_allclose(interp("shrink_factor: 2 zoom_factor: 2", grid), grid)
    # pad_beg = pad_end = -1 crop the 3x3 centre; zoom 2 gives 5x5 over it
    centre = interp("zoom_factor: 2 pad_beg: -1 pad_end: -1", grid)[0, 0]
    assert centre.shape == (5, 5)
    np.testing.assert_allclose(centre[::2, ::2], grid[0, 0, 1:4, 1:4])
    np.testing.assert_allclose(centre[1, 1], (6 + 7 + 11 + 12) / 4)
    # a second bottom gives the size; a width of 1 takes the first column
    out = interp("", grid, np.zeros((1, 1, 3, 1)))
    np.testing.assert_allclose(out[0, 0, :, 0], [0, 10, 20])


@needs_schema
@pytest.mark.parametrize("params, size", [
    ("zoom_factor: 3", None), ("shrink_factor: 3", None), ("height: 9 width: 4", (9, 4)),
    ("shrink_factor: 2 zoom_factor: 3", None), ("zoom_factor: 2 pad_beg: -2 pad_end: -1", None),
    ("height: 3 width: 13 pad_beg: -1", (3, 13)),
])
def test_interp_matches_the_fork_rule(params, size):
    x = gaussian(2, 3, 7, 8, seed=1)
    got = interp(params, x)
    words = params.replace(":", "").split()
    fields = {k: int(v) for k, v in zip(words[::2], words[1::2], strict=True)}
    beg, end = fields.get("pad_beg", 0), fields.get("pad_end", 0)
    h, w = 7 + beg + end, 8 + beg + end
    if size is None:  # the fork's size rule: shrink first, then zoom
        if "shrink_factor" in fields:
            s = fields["shrink_factor"]
            h, w = (h - 1) // s + 1, (w - 1) // s + 1
        z = fields.get("zoom_factor", 1)
        size = (h + (h - 1) * (z - 1), w + (w - 1) * (z - 1))
    assert got.shape == (2, 3) + size
    np.testing.assert_allclose(got, fork_interp(x, *size, beg, end), rtol=1e-12, atol=1e-12)


@needs_schema
@pytest.mark.parametrize("params", ["zoom_factor: 2 pad_beg: -1 pad_end: -2",
                                    "height: 4 width: 3", "height: 6 width: 1"])
def test_interp_gradients(params):
    spec = layer_spec("i", "Interp", ["x"], ["y"], f"interp_param {{ {params} }}")
    check_gradients(spec, {"x": gaussian(2, 2, 5, 6)})


@needs_schema
def test_interp_second_bottom_size_and_zero_gradient():
    spec = layer_spec("i", "Interp", ["x", "r"], ["y"])
    net = check_gradients(spec, {"x": gaussian(1, 2, 4, 3), "r": gaussian(1, 5, 7, 6)},
                          check=["x"])
    assert net.blobs["y"].data.shape == (1, 2, 7, 6)
    np.testing.assert_array_equal(net.blobs["r"].diff, 0)


@needs_schema
@pytest.mark.parametrize("params, bottoms, message", [
    ("zoom_factor: 2 pad_beg: 1", ["x"], "must be <= 0"),
    ("", ["x"], "needs zoom_factor"),
    ("zoom_factor: 0", ["x"], "zoom_factor must be at least 1"),
    ("zoom_factor: 2 pad_beg: -3 pad_end: -3", ["x"], "to nothing"),
])
def test_interp_errors(params, bottoms, message):
    spec = layer_spec("i", "Interp", bottoms, ["y"], f"interp_param {{ {params} }}")
    with pytest.raises(LayerError, match=message):
        Net(layer_net(spec, {"x": (1, 1, 5, 5)}), phase=TEST)


# -- ShuffleChannel -------------------------------------------------------------------------
@needs_schema
@pytest.mark.parametrize("group, order", [(2, [0, 3, 1, 4, 2, 5]), (3, [0, 2, 4, 1, 3, 5]),
                                          (1, [0, 1, 2, 3, 4, 5]), (6, [0, 1, 2, 3, 4, 5])])
def test_shuffle_channel_by_hand(group, order):
    x = gaussian(2, 6, 3, 2)
    spec = layer_spec("s", "ShuffleChannel", ["x"], ["y"],
                      f"shuffle_channel_param {{ group: {group} }}")
    np.testing.assert_array_equal(top_of(forward_layer(spec, x=x)), x[:, order])


@needs_schema
@pytest.mark.parametrize("group", [2, 3])
def test_shuffle_channel_gradient_is_the_inverse(group):
    spec = layer_spec("s", "ShuffleChannel", ["x"], ["y"],
                      f"shuffle_channel_param {{ group: {group} }}")
    net = check_gradients(spec, {"x": gaussian(2, 6, 2, 3)})
    dy = gaussian(2, 6, 2, 3, seed=9)
    dx = net.backward(y=dy)["x"]
    order = np.arange(6).reshape(group, -1).T.reshape(-1)  # top channel k = bottom order[k]
    want = np.empty_like(dy)
    want[:, order] = dy
    np.testing.assert_array_equal(dx, want)


@needs_schema
def test_shuffle_channel_group_must_divide():
    spec = layer_spec("s", "ShuffleChannel", ["x"], ["y"], "shuffle_channel_param { group: 4 }")
    with pytest.raises(LayerError, match="divide the 6 channels"):
        Net(layer_net(spec, {"x": (1, 6, 2, 2)}), phase=TEST)


# -- depthwise convolution ------------------------------------------------------------------
def dw_spec(type_: str, conv: str) -> str:
    return layer_spec("c", type_, ["x"], ["y"], f"convolution_param {{ {conv} {GAUSS} }}")


@pytest.mark.parametrize("type_", ["ConvolutionDepthwise", "DepthwiseConvolution"])
def test_depthwise_by_hand(type_):
    """1x1 kernels: each channel scaled by its own weight, plus its bias."""
    x = gaussian(2, 3, 4, 5)
    net = Net(layer_net(dw_spec(type_, "num_output: 3 kernel_size: 1"), {"x": x.shape}),
              phase=TEST, dtype="float64")
    w, b = net.params["c"]
    assert w.data.shape == (3, 1, 1, 1)  # one filter per channel: group = channels
    w.data[:, 0, 0, 0] = [2.0, -1.0, 0.5]
    b.data[...] = [1.0, 0.0, -3.0]
    y = net.forward(x=x)["y"]
    np.testing.assert_allclose(y, x * np.array([2, -1, 0.5])[:, None, None]
                               + np.array([1, 0, -3])[:, None, None])


@pytest.mark.parametrize("type_", ["ConvolutionDepthwise", "DepthwiseConvolution"])
@pytest.mark.parametrize("conv", ["num_output: 3 kernel_size: 3 stride: 2 pad: 1",
                                  "num_output: 6 kernel_h: 2 kernel_w: 3 dilation: 2 pad: 1",
                                  "num_output: 3 group: 3 kernel_size: 3 bias_term: false"])
def test_depthwise_gradients(type_, conv):
    check_gradients(dw_spec(type_, conv), {"x": gaussian(2, 3, 6, 5)})


def test_depthwise_keeps_its_own_message(tmp_path):
    """The group is forced for the build only: the saved .caffemodel writes the layer as
    the prototxt gave it, and a second build sees no group either."""
    spec = dw_spec("ConvolutionDepthwise", "num_output: 4 kernel_size: 3")
    net = Net(layer_net(spec, {"x": (1, 4, 5, 5)}), phase=TEST)
    net.save(tmp_path / "w.caffemodel")
    saved = pb.NetParameter()
    saved.ParseFromString((tmp_path / "w.caffemodel").read_bytes())
    layer = [lp for lp in saved.layer if lp.name == "c"][0]
    assert not layer.convolution_param.HasField("group")
    assert tuple(layer.blobs[0].shape.dim) == (4, 1, 3, 3)


@pytest.mark.parametrize("conv, message", [
    ("num_output: 4 group: 2 kernel_size: 1", "group 2 differs from the 4 channels"),
    ("num_output: 6 kernel_size: 1", "positive multiple of the 4 channels"),
])
def test_depthwise_errors(conv, message):
    with pytest.raises(LayerError, match=message):
        Net(layer_net(dw_spec("ConvolutionDepthwise", conv), {"x": (1, 4, 5, 5)}), phase=TEST)


# -- ReLU6, Mish ----------------------------------------------------------------------------
def test_relu6_and_mish_by_hand():
    x = np.array([-1.0, 0.0, 0.5, 1.0, 3.0, 6.0, 6.5])
    relu6 = top_of(forward_layer(layer_spec("r", "ReLU6", ["x"], ["y"]), x=x))
    np.testing.assert_array_equal(relu6, [0, 0, 0.5, 1, 3, 6, 6])
    mish = top_of(forward_layer(layer_spec("m", "Mish", ["x"], ["y"]), x=x[:4]))
    # x tanh(ln(1 + e^x)): at -1, tanh(ln(1 + 1/e)) = 0.30340146...; at 1, 0.86509838...
    np.testing.assert_allclose(mish, [-0.30340146137410895, 0, 0.5 * np.tanh(np.log1p(
        np.exp(0.5))), 0.8650983882673103], rtol=1e-14)
    big = top_of(forward_layer(layer_spec("m", "Mish", ["x"], ["y"]),
                               x=np.array([-800.0, 800.0])))
    np.testing.assert_allclose(big, [0, 800])  # no overflow on either side


def test_relu6_gradient_is_zero_at_and_beyond_the_bounds():
    x = np.array([-1.0, 0.0, 3.0, 6.0, 7.0])
    net = forward_layer(layer_spec("r", "ReLU6", ["x"], ["y"]), x=x)
    np.testing.assert_array_equal(net.backward(y=np.ones(5))["x"], [0, 0, 1, 0, 0])


@pytest.mark.parametrize("type_", ["ReLU6", "Mish"])
@pytest.mark.parametrize("in_place", [False, True])
def test_activation_gradients(type_, in_place):
    x = gaussian(2, 3, 4, 5) * 4
    if type_ == "ReLU6":  # away from the kinks at 0 and 6
        x = np.where(np.abs(x) < 0.01, 0.5, x)
        x = np.where(np.abs(x - 6) < 0.01, 5.5, x)
    spec = layer_spec("a", type_, ["x"], ["x" if in_place else "y"])
    check_gradients(spec, {"x": x})


# -- Upsample -------------------------------------------------------------------------------
def fork_upsample(x: np.ndarray, mask: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """SegNet's UpsampleLayer forward, value by value: zeros, then each bottom value
    written at its mask's place in its plane (later writes win)."""
    n, c, h, w = x.shape
    y = np.zeros((n, c, out_h * out_w))
    for i in range(n):
        for j in range(c):
            for k in range(h * w):
                y[i, j, int(mask[i, j].flat[k])] = x[i, j].flat[k]
    return y.reshape(n, c, out_h, out_w)


def upsample(params: str, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    spec = layer_spec("u", "Upsample", ["x", "m"], ["y"], f"upsample_param {{ {params} }}")
    return top_of(forward_layer(spec, x=x, m=mask))


@needs_schema
def test_upsample_by_hand():
    x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    mask = np.array([[[[0.0, 3.0], [9.0, 15.0]]]])
    y = upsample("scale: 2", x, mask)
    want = np.zeros(16)
    want[[0, 3, 9, 15]] = [1, 2, 3, 4]
    np.testing.assert_array_equal(y, want.reshape(1, 1, 4, 4))
    # one place named twice: the later value (in scan order) stays, as the fork's loop
    y = upsample("scale: 2", x, np.array([[[[5.0, 5.0], [5.0, 1.0]]]]))
    np.testing.assert_array_equal(y.reshape(-1)[[1, 5]], [4, 3])


@needs_schema
@pytest.mark.parametrize("params, size", [
    ("scale: 2", (6, 8)), ("scale_h: 3 scale_w: 2", (9, 8)),
    ("scale: 2 pad_out_h: true", (5, 8)), ("upsample_h: 5 upsample_w: 7", (5, 7)),
])
def test_upsample_matches_the_fork_rule(params, size):
    rng = np.random.default_rng(2)
    x = gaussian(2, 3, 3, 4)
    mask = np.stack([rng.permutation(size[0] * size[1])[:12] for _ in range(6)])
    mask = mask.reshape(2, 3, 3, 4).astype(np.float64)
    np.testing.assert_array_equal(upsample(params, x, mask), fork_upsample(x, mask, *size))


@needs_schema
def test_upsample_gradient():
    rng = np.random.default_rng(4)
    mask = np.stack([rng.permutation(48)[:12] for _ in range(4)]).reshape(2, 2, 3, 4)
    spec = layer_spec("u", "Upsample", ["x", "m"], ["y"], "upsample_param { scale: 2 }")
    net = check_gradients(spec, {"x": gaussian(2, 2, 3, 4), "m": mask.astype(np.float64)},
                          check=["x"])
    np.testing.assert_array_equal(net.blobs["m"].diff, 0)


SEGNET = """force_backward: true
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 2 dim: 5 dim: 6 } } }
layer { name: "pool" type: "Pooling" bottom: "x" top: "p" top: "mask"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "up" type: "Upsample" bottom: "p" bottom: "mask" top: "u"
  upsample_param { scale: 2 upsample_h: 5 upsample_w: 6 } }
"""


@needs_schema
def test_pooling_mask_feeds_upsample():
    """SegNet's pair: MAX Pooling's second top is each maximum's flat index in its plane;
    unpooling puts each maximum back where it was and zeros elsewhere, and the gradient
    reaches exactly the maxima."""
    x = gaussian(2, 2, 5, 6, seed=7)
    net = Net(SEGNET, phase=TRAIN, dtype="float64")
    net.forward(x=x)
    mask = net.blobs["mask"].data
    assert mask.shape == (2, 2, 3, 3)  # ceil((5 - 2) / 2) + 1 = 3 rows
    # the window at pooled (0, 1) covers rows 0-1, columns 2-3
    win = x[0, 0, 0:2, 2:4]
    r, c = np.unravel_index(np.argmax(win), (2, 2))
    assert mask[0, 0, 0, 1] == r * 6 + (2 + c)
    # every maximum back in place: x where it is its window's maximum, else 0
    is_max = np.zeros_like(x, dtype=bool)
    for i in range(3):
        for j in range(3):
            block = x[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2]
            flat = block.reshape(2, 2, -1)
            hit = flat == flat.max(axis=2, keepdims=True)
            is_max[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2] |= hit.reshape(block.shape)
    np.testing.assert_array_equal(net.blobs["u"].data, np.where(is_max, x, 0))
    dy = gaussian(2, 2, 5, 6, seed=8)
    np.testing.assert_array_equal(net.backward(u=dy)["x"], np.where(is_max, dy, 0))


@needs_schema
def test_upsample_mask_out_of_range():
    spec = layer_spec("u", "Upsample", ["x", "m"], ["y"], "upsample_param { scale: 2 }")
    with pytest.raises(PurineError, match="index 16, outside the top's plane of 16"):
        forward_layer(spec, x=np.ones((1, 1, 2, 2)), m=np.array([[[[0.0, 1], [2, 16]]]]))


@needs_schema
@pytest.mark.parametrize("params, message", [
    ("scale: 1", "must be greater than 1"),
    ("scale_h: 2", "scale_h and scale_w together"),
    ("scale: 3 pad_out_w: true", "pad_out_w needs scale_w 2"),
])
def test_upsample_errors(params, message):
    spec = layer_spec("u", "Upsample", ["x", "m"], ["y"], f"upsample_param {{ {params} }}")
    with pytest.raises(LayerError, match=message):
        Net(layer_net(spec, {"x": (1, 1, 2, 2), "m": (1, 1, 2, 2)}), phase=TEST)


@needs_schema
def test_upsample_one_bottom_is_nearest_neighbour():
    """The YOLOv3 ports' Upsample: no mask, each value copied into a scale x scale block;
    its gradient sums each block."""
    x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    spec = layer_spec("u", "Upsample", ["x"], ["y"], "upsample_param { scale: 3 }")
    y = top_of(forward_layer(spec, x=x))
    np.testing.assert_array_equal(y[0, 0], [[1, 1, 1, 2, 2, 2]] * 3 + [[3, 3, 3, 4, 4, 4]] * 3)
    check_gradients(layer_spec("u", "Upsample", ["x"], ["y"], "upsample_param { scale: 2 }"),
                    {"x": gaussian(2, 3, 2, 3)})


# -- Axpy -----------------------------------------------------------------------------------
def test_axpy_by_hand():
    a = np.array([[[[2.0]], [[-1.0]]]])
    x = np.array([[[[1.0, 2.0]], [[3.0, 4.0]]]])
    y = np.array([[[[10.0, 20.0]], [[30.0, 40.0]]]])
    spec = layer_spec("ax", "Axpy", ["a", "x", "y"], ["z"])
    got = top_of(forward_layer(spec, a=a, x=x, y=y))
    np.testing.assert_array_equal(got, [[[[12, 24]], [[27, 36]]]])


@pytest.mark.parametrize("scale_shape, in_place", [((2, 3, 1, 1), False), ((2, 3), False),
                                                   ((2, 3, 1, 1), True)])
def test_axpy_gradients(scale_shape, in_place):
    spec = layer_spec("ax", "Axpy", ["a", "x", "y"], ["y" if in_place else "z"])
    bottoms = {"a": gaussian(*scale_shape, seed=1), "x": gaussian(2, 3, 4, 5, seed=2),
               "y": gaussian(2, 3, 4, 5, seed=3)}
    check_gradients(spec, bottoms, check=["a", "x"] if in_place else None)


def test_axpy_in_place_gradient_of_y_is_the_top_gradient():
    spec = layer_spec("ax", "Axpy", ["a", "x", "y"], ["y"])
    net = forward_layer(spec, a=gaussian(1, 2, 1, 1), x=gaussian(1, 2, 3, 3),
                        y=gaussian(1, 2, 3, 3, seed=4))
    dy = gaussian(1, 2, 3, 3, seed=5)
    np.testing.assert_array_equal(net.backward(y=dy)["y"], dy)


@pytest.mark.parametrize("shapes, top, message", [
    ({"a": (2, 3, 2, 1), "x": (2, 3, 4, 4), "y": (2, 3, 4, 4)}, "z", "must be \\(N, C\\)"),
    ({"a": (2, 3), "x": (2, 3, 4, 4), "y": (2, 3, 4, 5)}, "z", "one shape"),
    ({"a": (2, 3), "x": (2, 3, 4, 4), "y": (2, 3, 4, 4)}, "x", "only the third bottom"),
])
def test_axpy_errors(shapes, top, message):
    spec = layer_spec("ax", "Axpy", ["a", "x", "y"], [top])
    with pytest.raises(LayerError, match=message):
        Net(layer_net(spec, shapes), phase=TEST)
