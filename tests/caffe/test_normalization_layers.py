"""BatchNorm, Scale and Bias: float64 gradient checks over parameter combinations (in place
too), forward values by hand, BatchNorm's running statistics, shape rules and errors."""

from __future__ import annotations

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.errors import LayerError
from tests.gradcheck import check_gradients, layer_net, numeric_gradient, objective

F32_EPS = float(np.float32(1e-5))  # eps and moving_average_fraction are proto floats
F32_MAF = float(np.float32(0.999))


def _x(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _net(layer: str, shapes: dict, phase: int = TRAIN, force_backward: bool = True) -> Net:
    return Net(layer_net(layer, shapes, force_backward), phase=phase, dtype="float64")


def _check_net(net: Net, inputs: dict[str, np.ndarray], tops: list[str],
               params: tuple[tuple[str, int], ...] = (), eps: float = 1e-6) -> None:
    """Central differences for the bottoms and the listed (layer, index) parameters of a net
    whose state was set up by the caller (gradcheck.check_gradients would also perturb the
    BatchNorm statistics, which change the output once they are fixed)."""
    rng = np.random.default_rng(7)
    net.forward(**inputs)
    weights = {t: rng.standard_normal(net.blobs[t].shape) for t in tops}
    net.backward(**weights)
    analytic = {n: net.blobs[n].diff.copy() for n in inputs}
    analytic.update({pk: net.params[pk[0]][pk[1]].diff.copy() for pk in params})

    def run() -> float:
        net.forward(**inputs)
        return objective(net, weights)

    arrays = {**inputs, **{pk: net.params[pk[0]][pk[1]].data for pk in params}}
    for key, array in arrays.items():
        want = numeric_gradient(run, array, eps).reshape(-1)
        np.testing.assert_allclose(analytic[key].reshape(-1), want, rtol=1e-5, atol=1e-7,
                                   err_msg=f"gradient of {key}")
    net.forward(**inputs)  # leave the unperturbed outputs for the caller


def _bn_by_hand(x: np.ndarray) -> np.ndarray:
    """Per channel (axis 1), statistics over every other axis, biased variance."""
    c = 1 if x.ndim == 1 else x.shape[1]
    x3 = x.reshape(x.shape[0], c, -1)
    y = np.empty_like(x3)
    for ch in range(c):
        v = x3[:, ch, :]
        y[:, ch, :] = (v - v.mean()) / np.sqrt(v.var() + F32_EPS)
    return y.reshape(x.shape)


# -- BatchNorm ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 3, 2, 2), (4, 3), (5,), (3, 2, 3)])
@pytest.mark.parametrize("in_place", [False, True])
def test_batch_norm_gradient_train(shape, in_place):
    top = "x" if in_place else "y"
    x = _x(*shape) * 2 + 1
    net = check_gradients(f'name: "bn" type: "BatchNorm" bottom: "x" top: "{top}"', {"x": x},
                          check=["x"], tops=[top])
    np.testing.assert_allclose(net.blobs[top].data, _bn_by_hand(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(2, 3, 2, 2), (4, 3)])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("phase,explicit", [(TRAIN, True), (TEST, False)])
def test_batch_norm_gradient_global_stats(shape, in_place, phase, explicit):
    top = "x" if in_place else "y"
    flag = "batch_norm_param { use_global_stats: true }" if explicit else ""
    net = _net(f'name: "bn" type: "BatchNorm" bottom: "x" top: "{top}" {flag}', {"x": shape},
               phase)
    c = shape[1]
    mean, var, factor = net.params["bn"]
    mean.data[...] = np.linspace(-1, 2, c)
    var.data[...] = np.linspace(0.5, 3, c)
    factor.data[...] = 2.0
    x = _x(*shape)
    _check_net(net, {"x": x}, [top])
    # The statistics are fixed: the gradient is dy / sqrt(var / factor + eps) per channel.
    bshape = (1, c) + (1,) * (len(shape) - 2)
    scale = 1 / np.sqrt(var.data / 2 + F32_EPS).reshape(bshape)
    want = (x - (mean.data / 2).reshape(bshape)) * scale
    np.testing.assert_allclose(net.blobs[top].data, want, rtol=1e-12)
    np.testing.assert_allclose(factor.data, [2.0])


def test_batch_norm_in_place_followed_by_in_place_scale():
    """Backward must read the saved normalised output, not the top that Scale overwrote."""
    proto = ('force_backward: true\n'
             'layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 3 dim: 2 '
             'dim: 2 } } }\n'
             'layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x" }\n'
             'layer { name: "sc" type: "Scale" bottom: "x" top: "x" scale_param { '
             'bias_term: true filler { type: "gaussian" } bias_filler { type: "gaussian" } } }\n')
    net = Net(proto, phase=TRAIN, dtype="float64")
    _check_net(net, {"x": _x(3, 2, 2) * 3}, ["x"], params=(("sc", 0), ("sc", 1)))


def test_batch_norm_train_forward_by_hand():
    x = np.array([[1.0, 2.0], [3.0, 6.0], [5.0, 10.0], [7.0, 2.0]])
    net = _net('name: "bn" type: "BatchNorm" bottom: "x" top: "y"', {"x": (4, 2)})
    y = net.forward(x=x)["y"]
    # channel 0: mean 4, biased variance 5; channel 1: mean 5, biased variance 11
    want = np.array([[-3 / np.sqrt(5 + F32_EPS), -3 / np.sqrt(11 + F32_EPS)],
                     [-1 / np.sqrt(5 + F32_EPS), 1 / np.sqrt(11 + F32_EPS)],
                     [1 / np.sqrt(5 + F32_EPS), 5 / np.sqrt(11 + F32_EPS)],
                     [3 / np.sqrt(5 + F32_EPS), -3 / np.sqrt(11 + F32_EPS)]])
    np.testing.assert_allclose(y, want, rtol=1e-12)
    mean, var, factor = (p.data for p in net.params["bn"])
    # running variance: unbiased, m / (m - 1) = 4 / 3
    np.testing.assert_allclose(mean, [4.0, 5.0])
    np.testing.assert_allclose(var, [20 / 3, 44 / 3])
    np.testing.assert_allclose(factor, [1.0])

    x2 = np.array([[0.0, 1.0], [2.0, 1.0], [4.0, 1.0], [10.0, 5.0]])
    net.forward(x=x2)
    maf = F32_MAF
    np.testing.assert_allclose(factor, [maf + 1])
    np.testing.assert_allclose(mean, [4 * maf + 4, 5 * maf + 2])
    # x2 channel 0: mean 4, biased variance (16+4+0+36)/4 = 14; channel 1: mean 2, variance 3
    np.testing.assert_allclose(var, [20 / 3 * maf + 14 * 4 / 3, 44 / 3 * maf + 3 * 4 / 3])


def test_batch_norm_running_statistics_4d():
    """Two forwards of a 4-D blob against the update formula, with a set fraction."""
    net = _net('name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
               'batch_norm_param { moving_average_fraction: 0.5 eps: 0.001 }', {"x": (2, 3, 2, 2)})
    eps = float(np.float32(0.001))
    xs = [_x(2, 3, 2, 2, seed=1), _x(2, 3, 2, 2, seed=2) + 1]
    m_sum, v_sum, f_sum = np.zeros(3), np.zeros(3), 0.0
    for x in xs:
        y = net.forward(x=x)["y"]
        mu, v = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
        np.testing.assert_allclose(
            y, (x - mu[None, :, None, None]) / np.sqrt(v + eps)[None, :, None, None], rtol=1e-10)
        f_sum = f_sum * 0.5 + 1
        m_sum = m_sum * 0.5 + mu
        v_sum = v_sum * 0.5 + v * 8 / 7  # m = 2 * 2 * 2
    mean, var, factor = (p.data for p in net.params["bn"])
    np.testing.assert_allclose(factor, [f_sum])
    np.testing.assert_allclose(mean, m_sum, rtol=1e-12)
    np.testing.assert_allclose(var, v_sum, rtol=1e-12)


def test_batch_norm_test_phase_uses_global_stats():
    net = _net('name: "bn" type: "BatchNorm" bottom: "x" top: "y"', {"x": (2, 2)}, TEST)
    mean, var, factor = net.params["bn"]
    mean.data[...] = [2.0, 4.0]
    var.data[...] = [8.0, 18.0]
    factor.data[...] = 2.0
    x = np.array([[1.0, 2.0], [3.0, 5.0]])
    y = net.forward(x=x)["y"]
    want = (x - [1.0, 2.0]) / np.sqrt(np.array([4.0, 9.0]) + F32_EPS)
    np.testing.assert_allclose(y, want, rtol=1e-12)
    np.testing.assert_allclose(mean.data, [2.0, 4.0])  # not updated
    np.testing.assert_allclose(factor.data, [2.0])
    # factor 0 (never trained): Caffe's scale is 0, so mean and variance are 0
    factor.data[...] = 0.0
    y = net.forward(x=x)["y"]
    np.testing.assert_allclose(y, x / np.sqrt(F32_EPS), rtol=1e-12)


def test_batch_norm_test_phase_can_use_batch_stats():
    net = _net('name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
               'batch_norm_param { use_global_stats: false }', {"x": (4, 2)}, TEST)
    x = _x(4, 2)
    np.testing.assert_allclose(net.forward(x=x)["y"], _bn_by_hand(x), rtol=1e-10)
    np.testing.assert_allclose(net.params["bn"][2].data, [1.0])


def test_batch_norm_parameters():
    net = _net('name: "bn" type: "BatchNorm" bottom: "x" top: "y"', {"x": (2, 5, 3)})
    ps = net.builder.layers[1].params
    assert [p.shape for p in ps] == [(5,), (5,), (1,)]
    assert [p.meta["lr_mult"] for p in ps] == [0.0, 0.0, 0.0]
    assert all(np.all(v.data == 0) for v in net.params["bn"])
    # Caffe prototxts spell the zero rates out; anything else is refused
    _net('name: "bn" type: "BatchNorm" bottom: "x" top: "y" param { lr_mult: 0 } '
         'param { lr_mult: 0 } param { lr_mult: 0 }', {"x": (2, 5)})
    with pytest.raises(LayerError, match="lr_mult"):
        _net('name: "bn" type: "BatchNorm" bottom: "x" top: "y" param { lr_mult: 1 }',
             {"x": (2, 5)})


# -- Scale ----------------------------------------------------------------------------------

SHAPE = (2, 3, 2, 2)


@pytest.mark.parametrize("axis,num_axes,param_shape", [
    (1, 1, (3,)), (0, 1, (2,)), (0, 2, (2, 3)), (1, 2, (3, 2)), (1, -1, (3, 2, 2)),
    (0, -1, SHAPE), (1, 0, ()), (0, 0, ()), (-1, 1, (2,)), (-3, 2, (3, 2))])
@pytest.mark.parametrize("bias_term", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_scale_gradient_learned(axis, num_axes, param_shape, bias_term, in_place):
    top = "x" if in_place else "y"
    layer = (f'name: "sc" type: "Scale" bottom: "x" top: "{top}" scale_param {{ axis: {axis} '
             f'num_axes: {num_axes} bias_term: {str(bias_term).lower()} '
             'filler { type: "gaussian" } bias_filler { type: "gaussian" } }')
    net = check_gradients(layer, {"x": _x(*SHAPE)}, tops=[top])
    assert [p.shape for p in net.params["sc"]] == [param_shape] * (1 + bias_term)


@pytest.mark.parametrize("axis,s_shape", [
    (1, (3,)), (0, (2,)), (0, (2, 3)), (1, (3, 2)), (1, (3, 2, 2)), (0, SHAPE), (1, ()),
    (-2, (2, 2)), (3, (2,))])
@pytest.mark.parametrize("bias_term", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_scale_gradient_two_bottoms(axis, s_shape, bias_term, in_place):
    top = "x" if in_place else "y"
    layer = (f'name: "sc" type: "Scale" bottom: "x" bottom: "s" top: "{top}" scale_param {{ '
             f'axis: {axis} bias_term: {str(bias_term).lower()} '
             'bias_filler { type: "gaussian" } }')
    net = check_gradients(layer, {"x": _x(*SHAPE), "s": _x(*s_shape, seed=3)}, tops=[top])
    # the bias is the layer's only parameter (index 0), shaped like the second bottom
    assert [p.shape for p in net.params.get("sc", [])] == [s_shape] * bias_term


def test_scale_forward_by_hand():
    x = np.arange(6.0).reshape(2, 3)
    net = _net('name: "sc" type: "Scale" bottom: "x" top: "y" scale_param { bias_term: true }',
               {"x": (2, 3)})
    scale, bias = net.params["sc"]
    np.testing.assert_array_equal(scale.data, [1, 1, 1])  # default: identity
    np.testing.assert_array_equal(bias.data, [0, 0, 0])
    scale.data[...] = [1.0, -2.0, 0.5]
    bias.data[...] = [10.0, 20.0, 30.0]
    np.testing.assert_allclose(net.forward(x=x)["y"], [[10, 18, 31], [13, 12, 32.5]])

    net = _net('name: "sc" type: "Scale" bottom: "x" bottom: "s" top: "y" '
               'scale_param { axis: 0 }', {"x": (2, 3), "s": (2,)})
    y = net.forward(x=x, s=np.array([2.0, -1.0]))["y"]
    np.testing.assert_allclose(y, [[0, 2, 4], [-3, -4, -5]])

    net = _net('name: "sc" type: "Scale" bottom: "x" top: "y" scale_param { num_axes: 0 '
               'filler { type: "constant" value: 3 } }', {"x": (2, 3)})
    np.testing.assert_allclose(net.forward(x=x)["y"], 3 * x)


def test_scale_in_place_copy_only_where_a_scale_gradient_can_be_needed():
    frozen = ('name: "sc" type: "Scale" bottom: "x" top: "x" param { lr_mult: 0 }')
    net = _net(frozen, {"x": (2, 3)}, force_backward=False)
    assert "sc@saved0" not in net.graph.blobs
    net = _net(frozen, {"x": (2, 3)}, force_backward=True)
    assert "sc@saved0" in net.graph.blobs
    net = _net('name: "sc" type: "Scale" bottom: "x" top: "x"', {"x": (2, 3)},
               force_backward=False)
    assert "sc@saved0" in net.graph.blobs


@pytest.mark.parametrize("layer,shapes,match", [
    ('bottom: "x" bottom: "s" top: "y"', {"x": (2, 3), "s": (4,)}, r"\(4,\).*\(2, 3\)"),
    ('bottom: "x" bottom: "s" top: "y" scale_param { axis: 1 }', {"x": (2, 3), "s": (3, 2)},
     r"\(3, 2\).*\(2, 3\)"),
    ('bottom: "x" top: "y" scale_param { num_axes: -2 }', {"x": (2, 3)}, "num_axes"),
    ('bottom: "x" top: "y" scale_param { num_axes: 3 }', {"x": (2, 3)}, "extends past"),
    ('bottom: "x" top: "y" scale_param { axis: 2 }', {"x": (2, 3)}, "out of range"),
])
def test_scale_errors(layer, shapes, match):
    with pytest.raises(LayerError, match=match):
        _net(f'name: "sc" type: "Scale" {layer}', shapes)


# -- Bias -----------------------------------------------------------------------------------

@pytest.mark.parametrize("axis,num_axes,param_shape", [
    (1, 1, (3,)), (0, 2, (2, 3)), (1, -1, (3, 2, 2)), (0, 0, ()), (2, 2, (2, 2))])
@pytest.mark.parametrize("in_place", [False, True])
def test_bias_gradient_learned(axis, num_axes, param_shape, in_place):
    top = "x" if in_place else "y"
    layer = (f'name: "b" type: "Bias" bottom: "x" top: "{top}" bias_param {{ axis: {axis} '
             f'num_axes: {num_axes} filler {{ type: "gaussian" }} }}')
    net = check_gradients(layer, {"x": _x(*SHAPE)}, tops=[top])
    assert [p.shape for p in net.params["b"]] == [param_shape]


@pytest.mark.parametrize("axis,b_shape", [(1, (3,)), (0, (2, 3)), (1, (3, 2, 2)), (0, ()),
                                          (-1, (2,))])
@pytest.mark.parametrize("in_place", [False, True])
def test_bias_gradient_two_bottoms(axis, b_shape, in_place):
    top = "x" if in_place else "y"
    layer = (f'name: "b" type: "Bias" bottom: "x" bottom: "b" top: "{top}" '
             f'bias_param {{ axis: {axis} }}')
    net = check_gradients(layer, {"x": _x(*SHAPE), "b": _x(*b_shape, seed=4)}, tops=[top])
    assert "b" not in net.params


def test_bias_forward_by_hand():
    x = np.arange(6.0).reshape(2, 3)
    net = _net('name: "b" type: "Bias" bottom: "x" top: "y"', {"x": (2, 3)})
    np.testing.assert_array_equal(net.params["b"][0].data, [0, 0, 0])  # default filler
    net.params["b"][0].data[...] = [1.0, -1.0, 10.0]
    np.testing.assert_allclose(net.forward(x=x)["y"], [[1, 0, 12], [4, 3, 15]])

    net = _net('name: "b" type: "Bias" bottom: "x" bottom: "c" top: "y" bias_param { axis: 0 }',
               {"x": (2, 3), "c": (2,)})
    y = net.forward(x=x, c=np.array([100.0, -100.0]))["y"]
    np.testing.assert_allclose(y, [[100, 101, 102], [-97, -96, -95]])


def test_bias_errors():
    with pytest.raises(LayerError, match=r"\(2, 2\).*\(2, 3\)"):
        _net('name: "b" type: "Bias" bottom: "x" bottom: "c" top: "y" bias_param { axis: 0 }',
             {"x": (2, 3), "c": (2, 2)})
