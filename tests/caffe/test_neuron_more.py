"""Swish and Clip: forward values against numpy and numbers by hand, float64 gradient checks
over their parameters (in place too), Clip's gradient at the bounds, and the errors."""

from __future__ import annotations

import numpy as np
import pytest

from purine.caffe import TRAIN, Net
from purine.errors import LayerError
from tests.gradcheck import check_gradients, layer_net

X7 = [-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0]


def layer(type_: str, params: str = "", in_place: bool = False) -> str:
    top = "x" if in_place else "y"
    return f'name: "n" type: "{type_}" bottom: "x" top: "{top}" {params}'


def run(spec: str, x, dy=None) -> tuple[np.ndarray, np.ndarray | None]:
    """The top after a forward pass and, given ``dy``, the bottom's gradient."""
    x = np.asarray(x, dtype=np.float64)
    net = Net(layer_net(spec, {"x": x.shape}, True), phase=TRAIN, dtype="float64")
    net.forward(x=x)
    top = net.builder.layers[-1].param.top[0]
    y = net.blobs[top].data.copy()
    if dy is None:
        return y, None
    return y, net.backward(**{top: np.asarray(dy, dtype=np.float64)})["x"].copy()


def _x(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape) * 2


# -- Swish ---------------------------------------------------------------------------------
def swish_reference(x: np.ndarray, beta: float) -> np.ndarray:
    return x / (1 + np.exp(-beta * x))


def test_swish_forward_by_hand():
    # x * sigmoid(x) at 0, +-1, 2: sigmoid(1) = 0.7310585786300049, sigmoid(2) = 0.8807970779778823
    y, _ = run(layer("Swish"), [0.0, 1.0, -1.0, 2.0])
    np.testing.assert_allclose(y, [0.0, 0.7310585786300049, -0.2689414213699951,
                                   1.7615941559557646], rtol=1e-14)


@pytest.mark.parametrize("beta", [1.0, 1.5, float(np.float32(0.3)), -0.5, 0.0])
@pytest.mark.parametrize("in_place", [False, True])
def test_swish_forward_against_numpy(beta, in_place):
    x = _x(3, 4)
    y, _ = run(layer("Swish", f"swish_param {{ beta: {beta!r} }}", in_place), x)
    np.testing.assert_allclose(y, swish_reference(x, beta), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("beta", [1.0, 1.5, -0.5, 0.0, 4.0])
@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 2, 2)])
@pytest.mark.parametrize("in_place", [False, True])
def test_swish_gradient(beta, shape, in_place):
    top = "x" if in_place else "y"
    check_gradients(layer("Swish", f"swish_param {{ beta: {beta} }}", in_place),
                    {"x": _x(*shape)}, tops=[top])


def test_swish_backward_is_caffes_formula():
    """dx = dy * (beta y + sigmoid(beta x) (1 - beta y)), written out for beta 2."""
    x = np.array([-1.5, 0.0, 0.25, 2.0])
    dy = np.array([1.0, -2.0, 0.5, 3.0])
    s = 1 / (1 + np.exp(-2 * x))
    y = x * s
    _, dx = run(layer("Swish", "swish_param { beta: 2 }"), x, dy)
    np.testing.assert_allclose(dx, dy * (2 * y + s * (1 - 2 * y)), rtol=1e-13)


def test_swish_in_place_needs_no_copy_of_the_bottom():
    net = Net(layer_net(layer("Swish", in_place=True), {"x": (2, 3)}, True), phase=TRAIN,
              dtype="float64")
    assert [op.type for op in net.builder.layers[-1].forward_ops] == ["SwishForward"]


# -- Clip ----------------------------------------------------------------------------------
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("params, want", [
    ("clip_param { min: -1 max: 1 }", [-1, -1, -0.5, 0, 0.5, 1, 1]),
    ("clip_param { min: 0 max: 0.5 }", [0, 0, 0, 0, 0.5, 0.5, 0.5]),
    ("clip_param { min: -2.5 max: 10 }", [-2.5, -1, -0.5, 0, 0.5, 1, 3]),
    # min > max: max(min, min(x, max)) is min everywhere.
    ("clip_param { min: 2 max: -2 }", [2, 2, 2, 2, 2, 2, 2]),
])
def test_clip_forward_by_hand(params, want, in_place):
    y, _ = run(layer("Clip", params, in_place), X7)
    np.testing.assert_array_equal(y, want)


def test_clip_nan_becomes_min():
    y, dx = run(layer("Clip", "clip_param { min: -1 max: 1 }"), [np.nan, 0.25], [1.0, 1.0])
    np.testing.assert_array_equal(y, [-1.0, 0.25])
    np.testing.assert_array_equal(dx, [0.0, 1.0])  # NaN is within no bounds


@pytest.mark.parametrize("in_place", [False, True])
def test_clip_gradient_passes_at_both_bounds(in_place):
    dy = np.arange(1.0, 8.0)
    _, dx = run(layer("Clip", "clip_param { min: -1 max: 1 }", in_place), X7, dy)
    # x = -3 and 3 are outside; x = -1 and 1 sit on the bounds, which pass the gradient.
    np.testing.assert_array_equal(dx, [0, 2, 3, 4, 5, 6, 0])


@pytest.mark.parametrize("lo, hi", [(-0.5, 0.5), (-1.0, 2.0), (0.0, 0.25), (-10.0, 10.0)])
@pytest.mark.parametrize("shape", [(3, 4), (2, 2, 3)])
@pytest.mark.parametrize("in_place", [False, True])
def test_clip_gradient(lo, hi, shape, in_place):
    x = _x(*shape, seed=3)
    assert np.abs(x[..., None] - np.array([lo, hi])).min() > 1e-4  # no kink within eps
    top = "x" if in_place else "y"
    check_gradients(layer("Clip", f"clip_param {{ min: {lo} max: {hi} }}", in_place),
                    {"x": x}, tops=[top])


@pytest.mark.parametrize("params, match", [
    ("", r"clip_param.min and clip_param.max must be given"),
    ("clip_param { min: -1 }", r"clip_param.max must be given"),
    ("clip_param { max: 1 }", r"clip_param.min must be given"),
])
def test_clip_needs_both_bounds(params, match):
    with pytest.raises(LayerError, match=r"layer 'n' \(type Clip\): " + match):
        Net(layer_net(layer("Clip", params), {"x": (2, 3)}), phase=TRAIN)


@pytest.mark.parametrize("type_", ["Swish", "Clip"])
def test_one_bottom_one_top(type_):
    spec = (f'name: "n" type: "{type_}" bottom: "x" bottom: "z" top: "y" '
            'clip_param { min: 0 max: 1 }')
    with pytest.raises(LayerError, match=rf"layer 'n' \(type {type_}\): needs 1 bottom "
                                         r"blob\(s\), got 2"):
        Net(layer_net(spec, {"x": (2,), "z": (2,)}), phase=TRAIN)
