"""Array layers (Concat, Slice, Eltwise, Flatten, Reshape, Crop, ArgMax, Silence, Reduction,
Tile, Embed): forward values against numbers worked out by hand or plain numpy, float64
gradient checks, and Caffe's parameter and shape errors."""

from __future__ import annotations

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.errors import LayerError, PurineError
from tests.gradcheck import check_gradients, gaussian, layer_net, layer_spec


def _forward(layer: str, phase=TEST, force_backward: bool = False, **inputs: np.ndarray) -> Net:
    shapes = {n: np.shape(v) for n, v in inputs.items()}
    net = Net(layer_net(layer, shapes, force_backward=force_backward), phase=phase,
              dtype="float64")
    net.forward(**inputs)
    return net


def _build(layer: str, **shapes) -> Net:
    return Net(layer_net(layer, shapes), phase=TRAIN, dtype="float64")


# -- Concat ---------------------------------------------------------------------------------
@pytest.mark.parametrize("axis, shapes", [
    (0, [(1, 3, 2), (2, 3, 2)]),
    (1, [(2, 1, 2), (2, 3, 2), (2, 2, 2)]),
    (2, [(2, 2, 1), (2, 2, 3)]),
    (-1, [(2, 2, 2), (2, 2, 1), (2, 2, 3)]),
])
def test_concat_gradient(axis, shapes):
    names = "abc"[: len(shapes)]
    bottoms = {n: gaussian(*s, seed=i) for i, (n, s) in enumerate(zip(names, shapes, strict=True))}
    net = check_gradients(
        layer_spec("cat", "Concat", names, ["y"], f"concat_param {{ axis: {axis} }}"), bottoms)
    net.forward(**bottoms)  # the check leaves the last perturbed forward in the tops
    np.testing.assert_array_equal(net.blobs["y"].data,
                                  np.concatenate(list(bottoms.values()), axis=axis))


def test_concat_default_axis_and_legacy_concat_dim():
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    b = np.array([[5.0], [6.0]])
    net = _forward(layer_spec("cat", "Concat", "ab", ["y"]), a=a, b=b)
    np.testing.assert_array_equal(net.blobs["y"].data, [[1, 2, 5], [3, 4, 6]])
    c = np.array([[7.0, 8.0]])
    net = _forward(layer_spec("cat", "Concat", "ac", ["y"], "concat_param { concat_dim: 0 }"),
                   a=a, c=c)
    np.testing.assert_array_equal(net.blobs["y"].data, [[1, 2], [3, 4], [7, 8]])


@pytest.mark.parametrize("type_, params", [("Concat", ""), ("Slice", "slice_param { axis: 0 }")])
@pytest.mark.parametrize("top", ["y", "x"])
def test_single_blob_concat_and_slice_share_the_bottom(type_, params, top):
    x = gaussian(2, 3)
    net = check_gradients(layer_spec("one", type_, ["x"], [top], params), {"x": x}, tops=[top])
    net.forward(x=x)
    np.testing.assert_array_equal(net.blobs[top].data, x)
    assert not net.builder.layers[-1].forward_ops  # the top is the bottom's blob


def test_concat_shape_mismatch_names_layer_bottoms_and_shapes():
    with pytest.raises(LayerError, match=r"layer 'cat' \(type Concat\): bottom 'a' \(2, 3, 4\) "
                                         r"and bottom 'b' \(2, 5, 5\) differ in axis 2"):
        _build(layer_spec("cat", "Concat", "ab", ["y"]), a=(2, 3, 4), b=(2, 5, 5))
    with pytest.raises(LayerError, match=r"'cat'.*'a' \(2, 3\) and bottom 'b' \(2, 3, 1\) "
                                         r"have different numbers of axes"):
        _build(layer_spec("cat", "Concat", "ab", ["y"]), a=(2, 3), b=(2, 3, 1))
    with pytest.raises(LayerError, match="give either axis or concat_dim"):
        _build(layer_spec("cat", "Concat", "ab", ["y"], "concat_param { axis: 1 concat_dim: 1 }"),
               a=(2, 3), b=(2, 3))
    with pytest.raises(LayerError, match=r"concat_dim 2 is out of range.*\(2, 3\)"):
        _build(layer_spec("cat", "Concat", "ab", ["y"], "concat_param { concat_dim: 2 }"),
               a=(2, 3), b=(2, 3))


# -- Slice ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, params, sizes, axis", [
    ((2, 6, 2), "slice_param { slice_point: 1 slice_point: 4 }", [1, 3, 2], 1),
    ((2, 6, 2), "", [3, 3], 1),
    ((6, 2, 2), "slice_param { axis: 0 }", [2, 2, 2], 0),
    ((2, 2, 5), "slice_param { axis: -1 slice_point: 2 }", [2, 3], 2),
    ((4, 3), "slice_param { slice_dim: 0 slice_point: 3 }", [3, 1], 0),
])
def test_slice_gradient(shape, params, sizes, axis):
    x = gaussian(*shape)
    tops = [f"t{i}" for i in range(len(sizes))]
    net = check_gradients(layer_spec("sl", "Slice", ["x"], tops, params), {"x": x})
    net.forward(x=x)
    parts = np.split(x, np.cumsum(sizes)[:-1], axis=axis)
    for t, part in zip(tops, parts, strict=True):
        np.testing.assert_array_equal(net.blobs[t].data, part)


def test_slice_forward_values():
    x = np.arange(12.0).reshape(2, 6)
    net = _forward(layer_spec("sl", "Slice", ["x"], ["p", "q"], "slice_param { slice_point: 2 }"),
                   x=x)
    np.testing.assert_array_equal(net.blobs["p"].data, [[0, 1], [6, 7]])
    np.testing.assert_array_equal(net.blobs["q"].data, [[2, 3, 4, 5], [8, 9, 10, 11]])


@pytest.mark.parametrize("params, tops, pattern", [
    ("", 4, r"4 tops do not evenly divide axis 1 of size 6 of bottom 'x' \(2, 6\)"),
    ("slice_param { slice_point: 2 }", 3, r"1 slice_point values for 3 tops"),
    ("slice_param { slice_point: 4 slice_point: 2 }", 3,
     r"slice_point \[4, 2\] must increase.*axis 1 of size 6 of bottom 'x' \(2, 6\)"),
    ("slice_param { slice_point: 7 }", 2, r"slice_point \[7\].*size 6"),
    ("slice_param { axis: 1 slice_dim: 1 }", 2, "give either axis or slice_dim"),
])
def test_slice_bad_parameters(params, tops, pattern):
    names = [f"t{i}" for i in range(tops)]
    with pytest.raises(LayerError, match=r"layer 'sl' \(type Slice\): " + pattern):
        _build(layer_spec("sl", "Slice", ["x"], names, params), x=(2, 6))


# -- Eltwise --------------------------------------------------------------------------------
def _distinct(n: int, shape, seed: int = 0) -> list[np.ndarray]:
    """n arrays with no two entries closer than 0.1, so that MAX has no ties."""
    size = int(np.prod(shape))
    values = np.random.default_rng(seed).permutation(n * size) * 0.1 - 0.05 * n * size
    return [v.reshape(shape) for v in values.reshape(n, size)]


@pytest.mark.parametrize("n, params", [
    (2, ""),
    (3, "eltwise_param { operation: SUM coeff: 0.5 coeff: -2 coeff: 3 }"),
    (2, "eltwise_param { operation: PROD }"),
    (3, "eltwise_param { operation: PROD }"),
    (3, "eltwise_param { operation: PROD stable_prod_grad: false }"),
    (2, "eltwise_param { operation: MAX }"),
    (3, "eltwise_param { operation: MAX }"),
])
def test_eltwise_gradient(n, params):
    xs = _distinct(n, (2, 3, 2))
    names = "abc"[:n]
    check_gradients(layer_spec("el", "Eltwise", names, ["y"], params),
                    dict(zip(names, xs, strict=True)))


def test_eltwise_forward_values():
    a, b, c = np.array([1.0, -2.0, 3.0]), np.array([4.0, 5.0, -6.0]), np.array([0.5, 7.0, 2.0])
    y = lambda p: _forward(  # noqa: E731
        layer_spec("el", "Eltwise", "abc", ["y"], p), a=a, b=b, c=c)
    np.testing.assert_allclose(y("").blobs["y"].data, [5.5, 10, -1])
    np.testing.assert_allclose(
        y("eltwise_param { coeff: 1 coeff: -1 coeff: 2 }").blobs["y"].data, [-2, 7, 13])
    np.testing.assert_allclose(y("eltwise_param { operation: PROD }").blobs["y"].data,
                               [2, -70, -36])
    np.testing.assert_allclose(y("eltwise_param { operation: MAX }").blobs["y"].data,
                               [4, 7, 3])


def test_eltwise_max_ties_follow_caffe():
    # Caffe's CPU loop: bottom 1 wins a tie with bottom 0; a later bottom must beat the
    # running maximum strictly.
    a, b, c = np.array([2.0, 1.0]), np.array([2.0, 3.0]), np.array([0.0, 3.0])
    layer = layer_spec("el", "Eltwise", "abc", ["y"], "eltwise_param { operation: MAX }")
    net = Net(layer_net(layer, {"a": (2,), "b": (2,), "c": (2,)}), phase=TRAIN,
              dtype="float64")
    net.forward(a=a, b=b, c=c)
    net.backward(y=np.array([10.0, 20.0]))
    np.testing.assert_array_equal(net.blobs["a"].diff, [0, 0])
    np.testing.assert_array_equal(net.blobs["b"].diff, [10, 20])
    np.testing.assert_array_equal(net.blobs["c"].diff, [0, 0])


def test_eltwise_prod_gradient_with_a_zero_factor():
    layer = lambda stable: layer_spec(  # noqa: E731
        "el", "Eltwise", "ab", ["y"],
        f"eltwise_param {{ operation: PROD stable_prod_grad: {stable} }}")
    diffs = {}
    for stable in ("true", "false"):
        net = Net(layer_net(layer(stable), {"a": (2,), "b": (2,)}), phase=TRAIN,
                  dtype="float64")
        net.forward(a=np.array([2.0, 0.0]), b=np.array([3.0, 5.0]))
        with np.errstate(invalid="ignore", divide="ignore"):
            net.backward(y=np.array([1.0, 1.0]))
        diffs[stable] = net.blobs["a"].diff.copy()
    np.testing.assert_array_equal(diffs["true"], [3, 5])
    # Caffe's quotient form divides the top by the zero bottom.
    assert diffs["false"][0] == 3 and np.isnan(diffs["false"][1])


@pytest.mark.parametrize("shapes, params, pattern", [
    ({"a": (2, 3), "b": (2, 4)}, "", r"bottom 'a' \(2, 3\) and bottom 'b' \(2, 4\) differ"),
    ({"a": (2, 3), "b": (2, 3)}, "eltwise_param { coeff: 1 }",
     "1 coeff values for 2 bottoms"),
    ({"a": (2, 3), "b": (2, 3)}, "eltwise_param { operation: PROD coeff: 1 coeff: 2 }",
     "coeff applies to operation SUM only"),
])
def test_eltwise_errors(shapes, params, pattern):
    with pytest.raises(LayerError, match=r"layer 'el' \(type Eltwise\): " + pattern):
        _build(layer_spec("el", "Eltwise", list(shapes), ["y"], params), **shapes)


def test_eltwise_refuses_in_place():
    with pytest.raises(LayerError, match="cannot run in place"):
        _build(layer_spec("el", "Eltwise", "ab", ["a"]), a=(2,), b=(2,))


# -- Flatten / Reshape ----------------------------------------------------------------------
@pytest.mark.parametrize("params, shape", [
    ("", (2, 60)),
    ("flatten_param { axis: 2 }", (2, 3, 20)),
    ("flatten_param { axis: 0 end_axis: 1 }", (6, 4, 5)),
    ("flatten_param { axis: 1 end_axis: -2 }", (2, 12, 5)),
    ("flatten_param { axis: -1 }", (2, 3, 4, 5)),
])
def test_flatten_shapes(params, shape):
    x = gaussian(2, 3, 4, 5)
    net = _forward(layer_spec("fl", "Flatten", ["x"], ["y"], params), x=x)
    np.testing.assert_array_equal(net.blobs["y"].data, x.reshape(shape))


@pytest.mark.parametrize("params", ["", "flatten_param { axis: 0 end_axis: 1 }"])
def test_flatten_gradient(params):
    check_gradients(layer_spec("fl", "Flatten", ["x"], ["y"], params), {"x": gaussian(2, 3, 2)})


def test_flatten_errors():
    with pytest.raises(LayerError, match=r"'fl'.*end_axis 1 comes before axis 2.*\(2, 3, 4\)"):
        _build(layer_spec("fl", "Flatten", ["x"], ["y"], "flatten_param { axis: 2 end_axis: 1 }"),
               x=(2, 3, 4))
    with pytest.raises(LayerError, match="cannot run in place"):
        _build(layer_spec("fl", "Flatten", ["x"], ["x"]), x=(2, 3))


@pytest.mark.parametrize("params, shape", [
    ("shape { dim: 0 dim: -1 }", (2, 60)),
    ("shape { dim: 3 dim: 2 dim: 0 dim: 5 }", (3, 2, 4, 5)),
    ("shape { dim: -1 dim: 0 dim: 2 }", (20, 3, 2)),
    ("shape { dim: 0 dim: 0 dim: 0 dim: 0 }", (2, 3, 4, 5)),
    ("axis: 1 shape { dim: -1 }", (2, 60)),
    ("axis: 1 num_axes: 2 shape { dim: 12 }", (2, 12, 5)),
    ("axis: -1 num_axes: 0 shape { dim: 1 }", (2, 3, 4, 5, 1)),
    ("axis: 0 num_axes: 0 shape { dim: 1 dim: 1 }", (1, 1, 2, 3, 4, 5)),
    ("axis: 2 num_axes: 1 shape { dim: 2 dim: -1 }", (2, 3, 2, 2, 5)),
    ("axis: -3 num_axes: 2 shape { dim: 0 dim: 1 dim: -1 }", (2, 3, 4, 1, 5)),
])
def test_reshape_shapes(params, shape):
    x = gaussian(2, 3, 4, 5)
    net = _forward(layer_spec("rs", "Reshape", ["x"], ["y"], f"reshape_param {{ {params} }}"), x=x)
    np.testing.assert_array_equal(net.blobs["y"].data, x.reshape(shape))


@pytest.mark.parametrize("params", ["shape { dim: 0 dim: -1 }", "axis: 1 shape { dim: 2 dim: 3 }"])
def test_reshape_gradient(params):
    check_gradients(layer_spec("rs", "Reshape", ["x"], ["y"], f"reshape_param {{ {params} }}"),
                    {"x": gaussian(2, 6)})


@pytest.mark.parametrize("params, pattern", [
    ("shape { dim: -1 dim: -1 }", r"more than one -1"),
    ("shape { dim: 7 dim: -1 }", r"\[7, -1\] for bottom 'x' \(2, 3, 4\).*24 entries are not "
                                 r"divisible by.*\(7\)"),
    ("shape { dim: 5 dim: 5 }", r"top shape \(5, 5\) has 25 entries, bottom 'x' \(2, 3, 4\) "
                                r"has 24"),
    ("axis: 2 shape { dim: 0 dim: 0 }", r"dimension 1 is 0 \(copy\), but the bottom has no "
                                        r"axis 3"),
    ("axis: 4 shape { dim: 1 }", r"axis 4 is out of range.*\(2, 3, 4\)"),
    ("axis: 1 num_axes: 3 shape { dim: 1 }", r"num_axes 3 = 4 is out of range"),
    ("shape { dim: -2 dim: 12 }", "negative dimension other than -1"),
])
def test_reshape_bad_parameters(params, pattern):
    layer = layer_spec("rs", "Reshape", ["x"], ["y"], f"reshape_param {{ {params} }}")
    with pytest.raises(LayerError, match=r"layer 'rs' \(type Reshape\): .*" + pattern):
        _build(layer, x=(2, 3, 4))


def test_reshape_refuses_in_place():
    with pytest.raises(LayerError, match="cannot run in place"):
        _build(layer_spec("rs", "Reshape", ["x"], ["x"], "reshape_param { shape { dim: 0 } }"),
               x=(2,))


# -- Crop -----------------------------------------------------------------------------------
@pytest.mark.parametrize("params, ref, index", [
    ("", (2, 3, 2, 3), np.s_[:, :, 0:2, 0:3]),
    ("crop_param { offset: 1 }", (2, 3, 2, 2), np.s_[:, :, 1:3, 1:3]),
    ("crop_param { axis: 1 offset: 1 offset: 0 offset: 2 }", (2, 2, 3, 2),
     np.s_[:, 1:3, 0:3, 2:4]),
    ("crop_param { axis: -1 offset: 1 }", (2, 3, 4, 3), np.s_[:, :, :, 1:4]),
    ("crop_param { axis: 0 offset: 1 }", (1, 1, 1, 1, 9), np.s_[1:2, 1:2, 1:2, 1:2]),
])
def test_crop_gradient(params, ref, index):
    x = gaussian(2, 3, 4, 4)
    r = gaussian(*ref, seed=1)
    net = check_gradients(layer_spec("cr", "Crop", ["x", "r"], ["y"], params), {"x": x, "r": r})
    net.forward(x=x, r=r)
    np.testing.assert_array_equal(net.blobs["y"].data, x[index])
    np.testing.assert_array_equal(net.blobs["r"].diff, 0)


def test_crop_backward_writes_zeros_around():
    layer = layer_spec("cr", "Crop", ["x", "r"], ["y"], "crop_param { axis: 0 offset: 1 }")
    net = Net(layer_net(layer, {"x": (4,), "r": (2,)}), phase=TRAIN, dtype="float64")
    net.forward(x=np.array([1.0, 2.0, 3.0, 4.0]), r=np.zeros(2))
    np.testing.assert_array_equal(net.blobs["y"].data, [2, 3])
    net.blobs["x"].diff[...] = 9
    net.backward(y=np.array([5.0, 6.0]))
    np.testing.assert_array_equal(net.blobs["x"].diff, [0, 5, 6, 0])


def test_crop_errors():
    with pytest.raises(LayerError, match=r"'cr'.*crop of axis 3 to size 3 at offset 2 is out "
                                         r"of bounds for bottom 'x' \(2, 3, 4, 4\)"):
        _build(layer_spec("cr", "Crop", ["x", "r"], ["y"], "crop_param { offset: 2 }"),
               x=(2, 3, 4, 4), r=(2, 3, 2, 3))
    with pytest.raises(LayerError, match=r"3 offsets for axes 2..3"):
        _build(layer_spec("cr", "Crop", ["x", "r"], ["y"],
                          "crop_param { offset: 0 offset: 0 offset: 0 }"),
               x=(2, 3, 4, 4), r=(2, 3, 2, 3))


# -- ArgMax ---------------------------------------------------------------------------------
def _caffe_top_k(values, k):
    """Caffe's partial_sort of (value, index) pairs with std::greater."""
    pairs = sorted(((v, j) for j, v in enumerate(values)), reverse=True)
    return pairs[:k]


def test_argmax_values_hand_computed():
    x = np.array([[0.1, 0.7, 0.2, 0.7], [0.5, -1.0, 0.9, 0.0]])
    net = _forward(layer_spec("am", "ArgMax", ["x"], ["y"], "argmax_param { top_k: 2 }"), x=x)
    assert net.blobs["y"].shape == (2, 1, 2)
    # The tie at 0.7 goes to the larger index, as Caffe's pair ordering puts it first.
    np.testing.assert_array_equal(net.blobs["y"].data, [[[3, 1]], [[2, 0]]])
    net = _forward(layer_spec("am", "ArgMax", ["x"], ["y"], "argmax_param { out_max_val: true }"),
                   x=x)
    assert net.blobs["y"].shape == (2, 2, 1)
    np.testing.assert_array_equal(net.blobs["y"].data, [[[3], [0.7]], [[2], [0.9]]])


@pytest.mark.parametrize("axis, k, out_val", [
    (None, 1, False), (None, 3, False), (None, 1, True), (None, 4, True),
    (1, 1, False), (1, 2, False), (1, 3, True), (-1, 2, False), (0, 1, True), (2, 4, False),
])
def test_argmax_against_reference(axis, k, out_val):
    # Rounded values make ties, which Caffe breaks towards the larger index.
    x = np.round(gaussian(2, 3, 4) * 2) / 2
    params = f"top_k: {k} out_max_val: {str(out_val).lower()}"
    if axis is not None:
        params += f" axis: {axis}"
    net = _forward(layer_spec("am", "ArgMax", ["x"], ["y"], f"argmax_param {{ {params} }}"), x=x)
    if axis is not None:
        moved = np.moveaxis(x, axis, -1)
        want = np.zeros(moved.shape[:-1] + (k,))
        for idx in np.ndindex(moved.shape[:-1]):
            want[idx] = [v if out_val else j for v, j in _caffe_top_k(moved[idx], k)]
        want = np.moveaxis(want, -1, axis)
    else:
        want = np.zeros((2, 2 if out_val else 1, k))
        for i in range(2):
            top = _caffe_top_k(x[i].reshape(-1), k)
            want[i, 0] = [j for _, j in top]
            if out_val:
                want[i, 1] = [v for v, _ in top]
    np.testing.assert_array_equal(net.blobs["y"].data, want)


def test_argmax_4d_top_shape_and_force_backward():
    net = _forward(layer_spec("am", "ArgMax", ["x"], ["y"], "argmax_param { top_k: 2 }"),
                   force_backward=True, x=gaussian(2, 3, 2, 2))
    assert net.blobs["y"].shape == (2, 1, 2, 1)


def test_argmax_errors():
    with pytest.raises(LayerError, match=r"top_k 7 exceeds the 6 entries.*'x' \(2, 3, 2\)"):
        _build(layer_spec("am", "ArgMax", ["x"], ["y"], "argmax_param { top_k: 7 }"), x=(2, 3, 2))
    net = """
    layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "ip" type: "InnerProduct" bottom: "x" top: "h"
            inner_product_param { num_output: 4 } }
    layer { name: "am" type: "ArgMax" bottom: "h" top: "y" loss_weight: 1 }
    """
    with pytest.raises(LayerError, match=r"layer 'am' \(type ArgMax\): has no backward pass"):
        Net(net, phase=TRAIN)


# -- Silence --------------------------------------------------------------------------------
def test_silence_writes_zero_diffs():
    layer = layer_spec("si", "Silence", ["a", "b"], [])
    net = Net(layer_net(layer, {"a": (2, 3), "b": (4,)}), phase=TRAIN, dtype="float64")
    assert net.outputs == []
    net.forward(a=gaussian(2, 3), b=gaussian(4))
    net.blobs["a"].diff[...] = 7
    net.blobs["b"].diff[...] = 7
    net.backward()
    np.testing.assert_array_equal(net.blobs["a"].diff, 0)
    np.testing.assert_array_equal(net.blobs["b"].diff, 0)


def test_silence_branch_adds_nothing_to_a_split_gradient():
    net = Net("""
    force_backward: true
    layer { name: "in" type: "Input" top: "x" top: "z" input_param { shape { dim: 3 } } }
    layer { name: "si" type: "Silence" bottom: "x" }
    layer { name: "sc" type: "Eltwise" bottom: "x" bottom: "z" top: "y"
            eltwise_param { coeff: 2 coeff: 1 } }
    """, phase=TRAIN, dtype="float64")
    net.forward(x=np.ones(3), z=np.ones(3))
    net.backward(y=np.array([1.0, 2.0, 3.0]))
    np.testing.assert_array_equal(net.blobs["x"].diff, [2, 4, 6])


# -- Reduction ------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["SUM", "ASUM", "SUMSQ", "MEAN"])
@pytest.mark.parametrize("axis, coeff", [(0, 1.0), (1, -0.5), (-1, 2.0)])
def test_reduction_gradient(op, axis, coeff):
    x = gaussian(2, 3, 2)
    x += np.sign(x) * 0.1  # keep ASUM away from the kink at 0
    params = f"reduction_param {{ operation: {op} axis: {axis} coeff: {coeff} }}"
    net = check_gradients(layer_spec("rd", "Reduction", ["x"], ["y"], params), {"x": x})
    net.forward(x=x)
    a = axis % 3
    blocks = x.reshape(int(np.prod(x.shape[:a])), -1)
    f = {"SUM": blocks.sum(1), "ASUM": np.abs(blocks).sum(1), "SUMSQ": (blocks ** 2).sum(1),
         "MEAN": blocks.mean(1)}[op]
    np.testing.assert_allclose(net.blobs["y"].data, (coeff * f).reshape(x.shape[:a]))


def test_reduction_forward_hand_computed():
    x = np.array([[1.0, -2.0, 3.0], [-4.0, 5.0, -6.0]])
    cases = {"": 3.0 - 6.0, "operation: ASUM": 21.0, "operation: SUMSQ": 91.0,
             "operation: MEAN coeff: 2": 2 * -3.0 / 6}
    for params, want in cases.items():
        net = _forward(
            layer_spec("rd", "Reduction", ["x"], ["y"], f"reduction_param {{ {params} }}"), x=x)
        assert net.blobs["y"].shape == ()
        assert net.blobs["y"].data == pytest.approx(want)
    net = _forward(layer_spec("rd", "Reduction", ["x"], ["y"],
                              "reduction_param { operation: ASUM axis: 1 }"), x=x)
    np.testing.assert_array_equal(net.blobs["y"].data, [6, 15])


# -- Tile -----------------------------------------------------------------------------------
@pytest.mark.parametrize("axis, tiles", [(0, 2), (1, 3), (2, 2), (-1, 1)])
def test_tile_gradient(axis, tiles):
    x = gaussian(2, 2, 3)
    net = check_gradients(
        layer_spec("ti", "Tile", ["x"], ["y"], f"tile_param {{ axis: {axis} tiles: {tiles} }}"),
        {"x": x})
    net.forward(x=x)
    a = axis % 3
    # Caffe repeats each whole block from the axis on: tiling the flattened trailing part.
    outer = int(np.prod(x.shape[:a]))
    want = np.tile(x.reshape(outer, 1, -1), (1, tiles, 1))
    shape = list(x.shape)
    shape[a] *= tiles
    np.testing.assert_array_equal(net.blobs["y"].data, want.reshape(shape))


def test_tile_forward_hand_computed_and_errors():
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    net = _forward(layer_spec("ti", "Tile", ["x"], ["y"], "tile_param { tiles: 2 }"), x=x)
    np.testing.assert_array_equal(net.blobs["y"].data, [[1, 2, 1, 2], [3, 4, 3, 4]])
    net = _forward(layer_spec("ti", "Tile", ["x"], ["y"], "tile_param { axis: 0 tiles: 2 }"), x=x)
    np.testing.assert_array_equal(net.blobs["y"].data, [[1, 2], [3, 4], [1, 2], [3, 4]])
    with pytest.raises(LayerError, match=r"'ti'.*tiles must be given"):
        _build(layer_spec("ti", "Tile", ["x"], ["y"]), x=(2, 2))
    with pytest.raises(LayerError, match=r"tiles must be positive"):
        _build(layer_spec("ti", "Tile", ["x"], ["y"], "tile_param { tiles: 0 }"), x=(2, 2))


# -- Embed ----------------------------------------------------------------------------------
_EMBED = ('embed_param {{ num_output: 3 input_dim: 5 bias_term: {bias} '
          'weight_filler {{ type: "gaussian" }} bias_filler {{ type: "gaussian" }} }}')


@pytest.mark.parametrize("bias", ["true", "false"])
@pytest.mark.parametrize("indices", [[[0.0, 3.0], [3.0, 1.0]], [4.0, 4.0, 4.0, 0.0]])
def test_embed_gradient(bias, indices):
    net = check_gradients(layer_spec("em", "Embed", ["x"], ["y"], _EMBED.format(bias=bias)),
                          {"x": np.array(indices)}, check=[])
    net.forward(x=np.array(indices))
    w = net.params["em"][0].data
    assert w.shape == (5, 3)
    want = w[np.array(indices, dtype=int)]
    if bias == "true":
        assert net.params["em"][1].shape == (3,)
        want = want + net.params["em"][1].data
    np.testing.assert_allclose(net.blobs["y"].data, want)


def test_embed_weight_gradient_sums_repeated_indices():
    layer = layer_spec("em", "Embed", ["x"], ["y"], _EMBED.format(bias="true"))
    net = Net(layer_net(layer, {"x": (3,)}), phase=TRAIN, dtype="float64")
    net.forward(x=np.array([2.0, 0.0, 2.0]))
    net.backward(y=np.array([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [100.0, 200.0, 300.0]]))
    dw = net.params["em"][0].diff
    np.testing.assert_array_equal(dw[2], [101, 202, 303])
    np.testing.assert_array_equal(dw[0], [10, 20, 30])
    np.testing.assert_array_equal(dw[[1, 3, 4]], 0)
    np.testing.assert_array_equal(net.params["em"][1].diff, [111, 222, 333])


@pytest.mark.parametrize("value", [5.0, -1.0, 1.5])
def test_embed_bad_index_is_a_run_time_error(value):
    layer = layer_spec("em", "Embed", ["x"], ["y"], _EMBED.format(bias="true"))
    net = Net(layer_net(layer, {"x": (2,)}, force_backward=False), phase=TEST)
    with pytest.raises(PurineError, match=r"op 'em/EmbedForward'.*holds "
                                          rf"{value!r} at flat position 1.*\[0, 5\)"):
        net.forward(x=np.array([0.0, value]))


def test_embed_cannot_propagate_to_its_indices():
    net = """
    layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "ip" type: "InnerProduct" bottom: "x" top: "h"
            inner_product_param { num_output: 4 } }
    layer { name: "em" type: "Embed" bottom: "h" top: "y" loss_weight: 1
            embed_param { num_output: 3 input_dim: 5 } }
    """
    with pytest.raises(LayerError, match=r"'em' \(type Embed\): cannot propagate a gradient "
                                         r"to its index bottom 'h'"):
        Net(net, phase=TRAIN)
    Net(net.replace("loss_weight: 1", "loss_weight: 1 propagate_down: false"), phase=TRAIN)
