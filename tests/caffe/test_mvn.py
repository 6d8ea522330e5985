"""MVN: forward values against a numpy reference and numbers by hand over the four
normalize_variance / across_channels combinations and 1- to 4-axis bottoms, float64 gradient
checks, Caffe's backward formula where eps is large, the 4-axis top, and the errors."""

from __future__ import annotations

import numpy as np
import pytest

from purine.caffe import TRAIN, Net
from purine.errors import LayerError
from tests.gradcheck import check_gradients, layer_net

F32_1E9 = float(np.float32(1e-9))  # the default eps, a proto float
COMBOS = [(True, False), (True, True), (False, False), (False, True)]


def _x(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape) * 3 + 1


def _layer(nv: bool, ac: bool, eps: float | None = None, in_place: bool = False) -> str:
    e = "" if eps is None else f" eps: {eps!r}"
    top = "x" if in_place else "y"
    return (f'name: "m" type: "MVN" bottom: "x" top: "{top}" mvn_param {{ '
            f"normalize_variance: {str(nv).lower()} across_channels: {str(ac).lower()}{e} }}")


def _legacy(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape[i] if i < len(shape) else 1 for i in range(4))


def mvn_reference(x: np.ndarray, nv: bool, ac: bool, eps: float = F32_1E9) -> np.ndarray:
    """Per (n, c) plane of the (N, C, H, W) view, or per n across channels: subtract the
    mean, then divide by the biased standard deviation plus eps."""
    v = x.reshape(_legacy(x.shape))
    axes = (1, 2, 3) if ac else (2, 3)
    d = v - v.mean(axis=axes, keepdims=True)
    if nv:
        d = d / (np.sqrt((d ** 2).mean(axis=axes, keepdims=True)) + eps)
    return d


def _net(spec: str, shape: tuple[int, ...]) -> Net:
    return Net(layer_net(spec, {"x": shape}, True), phase=TRAIN, dtype="float64")


def test_mvn_forward_by_hand():
    # One plane [1, 2, 3, 4]: mean 2.5, variance 1.25, std sqrt(1.25) = 1.118033988749895.
    x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    net = _net('name: "m" type: "MVN" bottom: "x" top: "y"', x.shape)
    y = net.forward(x=x)["y"]
    np.testing.assert_allclose(y.reshape(-1), [-1.3416407864998738, -0.4472135954999579,
                                               0.4472135954999579, 1.3416407864998738],
                               rtol=1e-8)
    net = _net(_layer(False, False), x.shape)
    np.testing.assert_array_equal(net.forward(x=x)["y"].reshape(-1), [-1.5, -0.5, 0.5, 1.5])


def test_mvn_across_channels_by_hand():
    # Two channels, one sample: [0, 2] and [4, 6] normalised together (mean 3, var 5) or
    # each on its own (means 1 and 5, var 1).
    x = np.array([[[[0.0, 2.0]], [[4.0, 6.0]]]])
    across = _net(_layer(True, True, eps=0.0), x.shape).forward(x=x)["y"]
    np.testing.assert_allclose(across.reshape(-1), np.array([-3, -1, 1, 3]) / np.sqrt(5),
                               rtol=1e-14)
    per_plane = _net(_layer(True, False, eps=0.0), x.shape).forward(x=x)["y"]
    np.testing.assert_allclose(per_plane.reshape(-1), [-1, 1, -1, 1], rtol=1e-14)


@pytest.mark.parametrize("nv, ac", COMBOS)
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 4), (2, 3, 5), (6,), (1, 1, 1, 7)])
def test_mvn_forward_against_numpy(nv, ac, shape):
    x = _x(*shape)
    y = _net(_layer(nv, ac), shape).forward(x=x)["y"]
    assert y.shape == _legacy(shape)
    np.testing.assert_allclose(y, mvn_reference(x, nv, ac), rtol=1e-12, atol=1e-12)


def test_mvn_eps_is_added_after_the_root():
    x = np.array([[[[1.0, 3.0]]]])  # mean 2, std 1
    y = _net(_layer(True, False, eps=0.5), x.shape).forward(x=x)["y"]
    np.testing.assert_allclose(y.reshape(-1), [-1 / 1.5, 1 / 1.5], rtol=1e-14)


def test_mvn_top_takes_the_four_axis_view():
    """Caffe shapes the top (num, channels, height, width): a 2-axis bottom gives 4 axes, and
    without across_channels each (n, c) "plane" is one entry, which normalises to 0."""
    x = _x(3, 4)
    net = _net(_layer(True, False), x.shape)
    assert net.blobs["y"].shape == (3, 4, 1, 1)
    np.testing.assert_array_equal(net.forward(x=x)["y"], np.zeros((3, 4, 1, 1)))
    across = _net(_layer(True, True), x.shape).forward(x=x)["y"]
    np.testing.assert_allclose(across[:, :, 0, 0], mvn_reference(x, True, True)[:, :, 0, 0],
                               rtol=1e-12)
    np.testing.assert_allclose(across.mean(axis=1), 0, atol=1e-15)
    np.testing.assert_allclose(across.std(axis=1), 1, rtol=1e-8)


@pytest.mark.parametrize("nv, ac", COMBOS)
@pytest.mark.parametrize("shape", [(2, 3, 3, 2), (3, 4), (2, 3, 4), (5,)])
def test_mvn_gradient(nv, ac, shape):
    check_gradients(_layer(nv, ac), {"x": _x(*shape, seed=1)})


@pytest.mark.parametrize("nv, ac", COMBOS)
def test_mvn_gradient_in_place(nv, ac):
    check_gradients(_layer(nv, ac, in_place=True), {"x": _x(2, 2, 3, 2, seed=2)}, tops=["x"])


@pytest.mark.parametrize("ac", [False, True])
def test_mvn_backward_is_caffes_formula_with_a_large_eps(ac):
    """With eps 0.5 Caffe's gradient is not the exact one: it divides by (std + eps) but
    treats the top's own dependence on the std as if eps were 0. The layer gives Caffe's."""
    x, dy = _x(2, 3, 2, 2, seed=4), _x(2, 3, 2, 2, seed=5)
    net = _net(_layer(True, ac, eps=0.5), x.shape)
    y = net.forward(x=x)["y"]
    dx = net.backward(y=dy)["x"]
    groups = 2 if ac else 6
    y2, dy2 = y.reshape(groups, -1), dy.reshape(groups, -1)
    x2 = x.reshape(groups, -1)
    std = x2.std(axis=1, keepdims=True) + 0.5
    dim = y2.shape[1]
    want = (dy2 - (y2 * (y2 * dy2).sum(1, keepdims=True) + dy2.sum(1, keepdims=True)) / dim)
    np.testing.assert_allclose(dx.reshape(groups, -1), want / std, rtol=1e-12)
    # ... which differs from central differences of the forward pass.
    h = 1e-6
    i = (0, 1, 0, 1)
    xp, xm = x.copy(), x.copy()
    xp[i] += h
    xm[i] -= h
    numeric = ((net.forward(x=xp)["y"] - net.forward(x=xm)["y"]) * dy).sum() / (2 * h)
    assert abs(numeric - dx[i]) > 1e-3


def test_mvn_mean_only_gradient_by_hand():
    """dx = dy - mean(dy) per plane."""
    x = _x(1, 2, 1, 2)
    dy = np.array([[[[1.0, 3.0]], [[-2.0, 6.0]]]])
    net = _net(_layer(False, False), x.shape)
    net.forward(x=x)
    np.testing.assert_array_equal(net.backward(y=dy)["x"], [[[[-1, 1]], [[-4, 4]]]])


@pytest.mark.parametrize("spec, shape, match", [
    (_layer(True, False), (2, 3, 2, 2, 2), r"bottom 'x' \(2, 3, 2, 2, 2\) has 5 axes; MVN "
                                           r"reads it as \(num, channels, height, width\)"),
    (_layer(True, False), (0, 3), r"bottom 'x' \(0, 3\) is empty"),
    (_layer(True, False, in_place=True), (3, 4),
     r"in-place top 'x' would change shape \(3, 4\) -> \(3, 4, 1, 1\)"),
])
def test_mvn_errors(spec, shape, match):
    with pytest.raises(LayerError, match=r"layer 'm' \(type MVN\): " + match):
        _net(spec, shape)
