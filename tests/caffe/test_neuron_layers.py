"""Caffe's neuron layers: forward values against numbers written down by hand, float64
gradient checks over their parameters (in place too), Dropout's masks, and the errors."""

from __future__ import annotations

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.errors import LayerError
from tests.gradcheck import check_gradients, layer_net

X5 = [-2.0, -0.5, 0.0, 0.5, 2.0]
POS5 = [0.5, 1.0, 2.0, 4.0, 8.0]


def layer(type_: str, params: str = "", in_place: bool = False, name: str = "n") -> str:
    top = "x" if in_place else "y"
    return f'name: "{name}" type: "{type_}" bottom: "x" top: "{top}" {params}'


def forward(spec: str, x, phase: int = TRAIN, force_backward: bool = False) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    net = Net(layer_net(spec, {"x": x.shape}, force_backward), phase=phase, dtype="float64")
    net.forward(x=x)
    return net.blobs[net.builder.layers[-1].param.top[0]].data.copy()


# -- forward values ------------------------------------------------------------------------
FORWARD = [
    ("ReLU", "", X5, [0, 0, 0, 0.5, 2]),
    ("ReLU", "relu_param { negative_slope: 0.1 }", X5, [-0.2, -0.05, 0, 0.5, 2]),
    ("PReLU", "", X5, [-0.5, -0.125, 0, 0.5, 2]),
    ("PReLU", "prelu_param { channel_shared: true }", X5, [-0.5, -0.125, 0, 0.5, 2]),
    ("Sigmoid", "", X5, [0.11920292202211755, 0.3775406687981454, 0.5, 0.6224593312018546,
                         0.8807970779778823]),
    ("TanH", "", X5, [-0.9640275800758169, -0.46211715726000974, 0, 0.46211715726000974,
                      0.9640275800758169]),
    ("ELU", "", X5, [-0.8646647167633873, -0.3934693402873666, 0, 0.5, 2]),
    ("ELU", "elu_param { alpha: 0.5 }", X5,
     [-0.43233235838169365, -0.1967346701436833, 0, 0.5, 2]),
    ("AbsVal", "", X5, [2, 0.5, 0, 0.5, 2]),
    ("BNLL", "", X5, [0.1269280110429725, 0.4740769841801067, 0.6931471805599453,
                      0.9740769841801067, 2.1269280110429727]),
    ("BNLL", "", [-1000.0, 1000.0], [0, 1000]),
    ("Threshold", "", X5, [0, 0, 0, 1, 1]),
    ("Threshold", "threshold_param { threshold: 0.5 }", X5, [0, 0, 0, 0, 1]),
    ("Threshold", "threshold_param { threshold: -1 }", X5, [0, 1, 1, 1, 1]),
    ("Power", "", X5, X5),
    ("Power", "power_param { power: 2 scale: 2 shift: 1 }", X5, [9, 0, 1, 4, 25]),
    ("Power", "power_param { power: 1 scale: 3 shift: -1 }", X5, [-7, -2.5, -1, 0.5, 5]),
    ("Power", "power_param { power: 0 scale: 3 shift: -1 }", X5, [1, 1, 1, 1, 1]),
    ("Power", "power_param { power: 3 scale: 0 shift: 2 }", X5, [8, 8, 8, 8, 8]),
    ("Power", "power_param { power: 0.5 }", [0.25, 1, 4, 9], [0.5, 1, 2, 3]),
    ("Power", "power_param { power: -1 shift: 3 }", X5,
     [1, 0.4, 0.3333333333333333, 0.2857142857142857, 0.2]),
    ("Exp", "", X5, [0.1353352832366127, 0.6065306597126334, 1, 1.6487212707001282,
                     7.38905609893065]),
    ("Exp", "exp_param { shift: 1 }", X5, [0.36787944117144233, 1.6487212707001282,
                                           2.718281828459045, 4.4816890703380645,
                                           20.085536923187668]),
    ("Exp", "exp_param { base: 2 }", X5, [0.25, 0.7071067811865476, 1, 1.4142135623730951, 4]),
    ("Exp", "exp_param { base: 2 scale: 2 shift: 1 }", X5, [0.125, 1, 2, 4, 32]),
    ("Exp", "exp_param { base: 1 scale: 5 }", X5, [1, 1, 1, 1, 1]),
    ("Log", "", POS5, [-0.6931471805599453, 0, 0.6931471805599453, 1.3862943611198906,
                       2.0794415416798357]),
    ("Log", "log_param { base: 2 }", POS5, [-1, 0, 1, 2, 3]),
    ("Log", "log_param { base: 10 scale: 2 shift: 2 }", POS5,
     [0.47712125471966244, 0.6020599913279624, 0.7781512503836436, 1, 1.255272505103306]),
    ("Dropout", "", X5, X5),  # TEST phase: the identity
]


@pytest.mark.parametrize("type_,params,x,want,in_place", [
    (*case, in_place) for case in FORWARD for in_place in (False, True)
    if not (in_place and case[0] == "AbsVal")])  # AbsVal refuses in place: tested below
def test_forward_values(type_, params, x, want, in_place):
    phase = TEST if type_ == "Dropout" else TRAIN
    got = forward(layer(type_, params, in_place), [x], phase=phase)
    # Prototxt parameters are float32 (0.1 is 0.100000001...), hence rtol 1e-6.
    np.testing.assert_allclose(got, [want], rtol=1e-6, atol=1e-12)


def test_prelu_per_channel_slopes_and_fillers():
    spec = layer("PReLU", name="p")
    net = Net(layer_net(spec, {"x": (1, 2, 2)}), phase=TRAIN, dtype="float64")
    assert net.params["p"][0].shape == (2,)
    np.testing.assert_array_equal(net.params["p"][0].data, [0.25, 0.25])
    net.params["p"][0].data[...] = [0.1, 0.5]
    out = net.forward(x=np.array([[[-1.0, 2.0], [-4.0, 3.0]]]))["y"]
    np.testing.assert_allclose(out, [[[-0.1, 2.0], [-2.0, 3.0]]])

    shared = Net(layer_net(layer("PReLU", "prelu_param { channel_shared: true filler { "
                                          'type: "constant" value: 0.3 } }', name="p"),
                           {"x": (2, 3, 4)}), phase=TRAIN, dtype="float64")
    # Caffe's channel-shared slope is a blob of no axes.
    assert shared.params["p"][0].shape == ()
    np.testing.assert_allclose(shared.params["p"][0].data, 0.3, rtol=1e-7)


def test_bnll_gradient_saturates_without_overflow():
    spec = layer("BNLL")
    x = np.array([[-1000.0, -60.0, 60.0, 1000.0]])
    net = Net(layer_net(spec, {"x": x.shape}, True), phase=TRAIN, dtype="float64")
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        net.forward(x=x)
        dx = net.backward(y=np.ones_like(x))["x"]
    np.testing.assert_allclose(net.blobs["y"].data, [[0.0, 8.75651076269652e-27, 60.0, 1000.0]],
                               rtol=1e-12)
    # exp(min(x, 50)) / (exp(min(x, 50)) + 1): 1 - 2e-22 above the threshold, i.e. 1.0.
    np.testing.assert_allclose(dx, [[0.0, 8.75651076269652e-27, 1.0, 1.0]], rtol=1e-12)


def test_power_gradient_is_constant_when_x_drops_out():
    for params, want in [("power_param { power: 0 scale: 3 }", 0.0),
                         ("power_param { power: 4 scale: 0 shift: 2 }", 0.0),
                         ("power_param { power: 1 scale: -3 shift: 7 }", -3.0)]:
        x = np.array([[-1.0, 0.0, 2.0]])
        net = Net(layer_net(layer("Power", params), {"x": x.shape}, True), phase=TRAIN,
                  dtype="float64")
        net.forward(x=x)
        dy = np.array([[1.0, np.inf, -2.0]]) if want == 0 else np.array([[1.0, 0.5, -2.0]])
        dx = net.backward(y=dy)["x"]
        # Caffe sets a zero gradient outright (no product with dy, so no inf * 0).
        np.testing.assert_array_equal(dx, want * dy if want else np.zeros_like(x))


# -- gradient checks -----------------------------------------------------------------------
def away_from_zero(shape, seed=0, lo=0.2, hi=1.5):
    """Inputs of both signs that keep a margin from the kink at 0."""
    rng = np.random.default_rng(seed)
    return rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)


def positive(shape, seed=0, lo=0.2, hi=1.5):
    return np.random.default_rng(seed).uniform(lo, hi, shape)


SHAPE = (2, 3, 2, 2)

GRADIENTS = [
    ("ReLU", "", away_from_zero),
    ("ReLU", "relu_param { negative_slope: 0.1 }", away_from_zero),
    ("ReLU", "relu_param { negative_slope: -0.3 }", away_from_zero),
    ("PReLU", "", away_from_zero),
    ("PReLU", 'prelu_param { filler { type: "uniform" min: -0.5 max: 0.8 } }',
     away_from_zero),
    ("PReLU", "prelu_param { channel_shared: true }", away_from_zero),
    ("PReLU", 'prelu_param { channel_shared: true filler { type: "constant" value: -0.4 } }',
     away_from_zero),
    ("Sigmoid", "", away_from_zero),
    ("TanH", "", away_from_zero),
    ("ELU", "", away_from_zero),
    ("ELU", "elu_param { alpha: 0.5 }", away_from_zero),
    ("ELU", "elu_param { alpha: 2 }", away_from_zero),
    ("ELU", "elu_param { alpha: -0.5 }", away_from_zero),
    ("BNLL", "", lambda s: 3 * away_from_zero(s)),
    ("Power", "", away_from_zero),
    ("Power", "power_param { power: 1 scale: 3 shift: -1 }", away_from_zero),
    ("Power", "power_param { power: 2 }", away_from_zero),
    ("Power", "power_param { power: 2 scale: 0.5 shift: 1 }", away_from_zero),
    ("Power", "power_param { power: 3 scale: -1.5 shift: 0.5 }", away_from_zero),
    ("Power", "power_param { power: 0.5 }", positive),
    ("Power", "power_param { power: 1.5 scale: 2 shift: 1 }", positive),
    ("Power", "power_param { power: -2 scale: 0.5 shift: 2 }", away_from_zero),
    ("Power", "power_param { power: 0 scale: 2 shift: 1 }", away_from_zero),
    ("Power", "power_param { power: 2 scale: 0 shift: 3 }", away_from_zero),
    ("Exp", "", away_from_zero),
    ("Exp", "exp_param { scale: 0.5 shift: 1 }", away_from_zero),
    ("Exp", "exp_param { base: 2 }", away_from_zero),
    ("Exp", "exp_param { base: 2 scale: -1 shift: 0.5 }", away_from_zero),
    ("Log", "", positive),
    ("Log", "log_param { base: 2 scale: 2 shift: 1 }", positive),
    ("Log", "log_param { base: 10 scale: -0.5 shift: 3 }", away_from_zero),
]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("type_,params,draw", GRADIENTS)
def test_gradient(type_, params, draw, in_place):
    check_gradients(layer(type_, params, in_place), {"x": draw(SHAPE)},
                    tops=["x" if in_place else "y"])


def test_gradient_absval():
    check_gradients(layer("AbsVal"), {"x": away_from_zero(SHAPE)})


@pytest.mark.parametrize("in_place", [False, True])
def test_gradient_prelu_bottom_of_two_axes(in_place):
    check_gradients(layer("PReLU", in_place=in_place), {"x": away_from_zero((4, 3))},
                    tops=["x" if in_place else "y"])


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("ratio", [0.5, 0.2])
def test_gradient_dropout_test_phase_is_identity(ratio, in_place):
    spec = layer("Dropout", f"dropout_param {{ dropout_ratio: {ratio} }}", in_place)
    x = away_from_zero(SHAPE)
    net = check_gradients(spec, {"x": x}, tops=["x" if in_place else "y"], phase=TEST)
    net.forward(x=x)
    np.testing.assert_array_equal(net.blobs["x" if in_place else "y"].data, x)


# -- Dropout in TRAIN ----------------------------------------------------------------------
def dropout_net(params: str = "", in_place: bool = False, shape=(100, 200), seed: int = 0):
    spec = layer("Dropout", params, in_place, name="drop")
    return Net(layer_net(spec, {"x": shape}, True), phase=TRAIN, dtype="float64", seed=seed)


def mask_of(net: Net) -> np.ndarray:
    return net.dispatcher.array(net.graph.blobs["drop@mask"])


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("params,ratio", [("", 0.5),
                                          ("dropout_param { dropout_ratio: 0.3 }", 0.3),
                                          ("dropout_param { dropout_ratio: 0.8 }", 0.8)])
def test_dropout_train_scales_and_drops_about_ratio(params, ratio, in_place):
    net = dropout_net(params, in_place)
    top = "x" if in_place else "y"
    x = positive((100, 200), seed=3)
    net.forward(x=x)
    y = net.blobs[top].data.copy()
    mask = mask_of(net).astype(bool)
    # Kept elements are scaled by 1 / (1 - ratio), dropped ones are exactly 0.
    np.testing.assert_allclose(y[mask], x[mask] / (1 - np.float32(ratio)), rtol=1e-12)
    assert np.all(y[~mask] == 0)
    # 20000 Bernoulli draws: the dropped fraction is within 0.02 (over 4 sigma) of ratio.
    assert abs((~mask).mean() - ratio) < 0.02

    # The gradient goes through the very same mask, with the same scale.
    dy = away_from_zero((100, 200), seed=4)
    dx = net.backward(**{top: dy})["x"]
    np.testing.assert_allclose(dx, dy * mask / (1 - np.float32(ratio)), rtol=1e-12)
    assert np.all(dx[~mask] == 0)


def test_dropout_draws_a_fresh_mask_each_forward_and_is_seeded():
    x = positive((50, 40))
    a, b = dropout_net(shape=x.shape, seed=7), dropout_net(shape=x.shape, seed=7)
    a.forward(x=x)
    first = mask_of(a).copy()
    a.forward(x=x)
    second = mask_of(a).copy()
    assert not np.array_equal(first, second)
    b.forward(x=x)
    np.testing.assert_array_equal(mask_of(b), first)  # same net seed, same masks
    c = dropout_net(shape=x.shape, seed=8)
    c.forward(x=x)
    assert not np.array_equal(mask_of(c), first)


def test_dropout_ratio_zero_keeps_everything():
    x = away_from_zero((2, 3, 2, 2))
    net = check_gradients(layer("Dropout", "dropout_param { dropout_ratio: 0 }"), {"x": x})
    net.forward(x=x)
    np.testing.assert_array_equal(net.blobs["y"].data, x)


# -- errors --------------------------------------------------------------------------------
def build(spec: str, shape=(2, 3), force_backward: bool = True, phase: int = TRAIN) -> Net:
    return Net(layer_net(spec, {"x": shape}, force_backward), phase=phase, dtype="float64")


def test_threshold_has_no_backward():
    net = build(layer("Threshold"), force_backward=False)
    out = net.forward(x=np.array([[-1.0, 0.0, 1.0], [2.0, -3.0, 0.5]]))["y"]
    np.testing.assert_array_equal(out, [[0, 0, 1], [1, 0, 1]])
    with pytest.raises(LayerError, match=r"\(type Threshold\).*no backward pass.*'x'"):
        build(layer("Threshold"), force_backward=True)


def test_absval_not_in_place():
    with pytest.raises(LayerError, match=r"\(type AbsVal\).*in-place"):
        build(layer("AbsVal", in_place=True))


@pytest.mark.parametrize("spec,message", [
    (layer("Exp", "exp_param { base: -2 }"), r"exp_param.base must be strictly positive"),
    (layer("Exp", "exp_param { base: 0 }"), r"exp_param.base must be strictly positive"),
    (layer("Log", "log_param { base: -3 }"), r"log_param.base must be strictly positive"),
    (layer("Log", "log_param { base: 1 }"), r"log_param.base 1.0 gives log\(base\) = 0"),
    (layer("Dropout", "dropout_param { dropout_ratio: 1 }"), r"dropout_ratio must be in"),
    (layer("Dropout", "dropout_param { dropout_ratio: -0.1 }"), r"dropout_ratio must be in"),
    ('name: "n" type: "ReLU" bottom: "x" bottom: "x" top: "y"', r"needs 1 bottom"),
])
def test_bad_parameters(spec, message):
    with pytest.raises(LayerError, match=message):
        build(spec)


def test_prelu_needs_two_axes():
    with pytest.raises(LayerError, match=r"\(type PReLU\).*'x' \(6,\) needs 2 or more axes"):
        build(layer("PReLU"), shape=(6,))
