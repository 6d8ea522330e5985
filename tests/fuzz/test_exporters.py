"""Fuzzing the ONNX exporter: small chains of exportable layers with drawn parameters (0, 1,
huge, negative where Caffe takes them). An export is either refused in one PurineError line
or loads in onnxruntime and gives the net's own forward within float32 tolerance."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from purine.caffe import TEST, Net
from purine.errors import PurineError
from tests.fuzz.harness import Draw, check, counted, share

onnx = pytest.importorskip("onnx", reason="ONNX export needs the onnx package "
                                          "(pip install onnx onnxruntime)")
ort = pytest.importorskip("onnxruntime", reason="running exported models needs onnxruntime "
                                                "(pip install onnxruntime)")
from purine.converters.onnx_export import net_to_onnx  # noqa: E402  (needs onnx)

HUGE = 1e30
REALS = (0.0, 1.0, -1.0, 0.5, 1e-4, 2.0, HUGE, -HUGE)
POSITIVE = (1e-4, 1e-5, 1.0, 0.5, 2.0, HUGE)
TOL = 1e-4
"""|onnxruntime - purine| over an output, relative to its largest finite magnitude (at least
1): a dozen float32 operations in another order."""


def _real(draw: Draw, pool: tuple[float, ...] = REALS) -> float:
    return draw(st.one_of(st.sampled_from(pool), st.floats(-3, 3, width=32)))


def _lrn(draw: Draw, c: int) -> str:
    size = draw(st.sampled_from((1, 3, 5, 7, 2 ** 31 - 1)))
    region = draw(st.sampled_from(("ACROSS_CHANNELS", "WITHIN_CHANNEL")))
    return (f'type: "LRN" lrn_param {{ local_size: {size} alpha: {_real(draw)!r} '
            f'beta: {_real(draw)!r} k: {_real(draw)!r} norm_region: {region} }}')


def _relu(draw: Draw, c: int) -> str:
    return f'type: "ReLU" relu_param {{ negative_slope: {_real(draw)!r} }}'


def _pool(draw: Draw, c: int) -> str:
    pool = draw(st.sampled_from(("MAX", "AVE")))
    if draw(st.integers(0, 4)) == 0:
        return f'type: "Pooling" pooling_param {{ pool: {pool} global_pooling: true }}'
    k = draw(st.integers(1, 4))
    return (f'type: "Pooling" pooling_param {{ pool: {pool} kernel_size: {k} '
            f'stride: {draw(st.integers(1, 3))} pad: {draw(st.integers(0, k - 1))} }}')


def _conv(draw: Draw, c: int) -> str:
    k = draw(st.integers(1, 3))
    group = draw(st.sampled_from([g for g in (1, c) if c % g == 0]))
    out = group * draw(st.integers(1, 2))
    return (f'type: "Convolution" convolution_param {{ num_output: {out} kernel_size: {k} '
            f'stride: {draw(st.integers(1, 2))} pad: {draw(st.integers(0, 2))} '
            f'dilation: {draw(st.integers(1, 2))} group: {group} '
            f'bias_term: {str(draw(st.booleans())).lower()} }}')


def _scale(draw: Draw, c: int) -> str:
    return f'type: "Scale" scale_param {{ bias_term: {str(draw(st.booleans())).lower()} }}'


def _batchnorm(draw: Draw, c: int) -> str:
    return (f'type: "BatchNorm" batch_norm_param {{ use_global_stats: true '
            f'eps: {draw(st.sampled_from((0.0, 1e-5, 1.0, HUGE)))!r} }}')


def _eltwise(draw: Draw, c: int) -> str:
    op = draw(st.sampled_from(("SUM", "PROD", "MAX")))
    coeff = ""
    if op == "SUM" and draw(st.booleans()):
        coeff = f" coeff: {_real(draw)!r} coeff: {_real(draw)!r}"
    return f'type: "Eltwise" eltwise_param {{ operation: {op}{coeff} }}'


def _unary(kind: str):
    return lambda draw, c: f'type: "{kind}"'


def _softmax(draw: Draw, c: int) -> str:
    return f'type: "Softmax" softmax_param {{ axis: {draw(st.sampled_from((1, -1, 0)))} }}'


LAYERS = {"lrn": _lrn, "relu": _relu, "pool": _pool, "conv": _conv, "scale": _scale,
          "bn": _batchnorm, "eltwise": _eltwise, "sigmoid": _unary("Sigmoid"),
          "tanh": _unary("TanH"), "softmax": _softmax}


@st.composite
def small_net(draw: Draw) -> tuple[str, int, tuple[int, ...]]:
    """A chain of 1..3 layers over a (2, C, H, W) input, maybe an InnerProduct at the end;
    returns the prototxt, a seed for weights and input, and the input shape."""
    c, h, w = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 5))
    lines = [f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ '
             f'dim: 2 dim: {c} dim: {h} dim: {w} }} }} }}']
    bottom = "data"
    for i in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(sorted(LAYERS)))
        body = LAYERS[kind](draw, c)
        bottoms = f'bottom: "{bottom}"' + (f' bottom: "{bottom}"' if kind == "eltwise" else "")
        lines.append(f'layer {{ name: "l{i}" {bottoms} top: "t{i}" {body} }}')
        bottom = f"t{i}"
        if kind == "conv":
            c = int(body.split("num_output: ")[1].split()[0])
    if draw(st.booleans()):
        lines.append(f'layer {{ name: "ip" type: "InnerProduct" bottom: "{bottom}" top: "ip" '
                     f'inner_product_param {{ num_output: {draw(st.integers(1, 3))} }} }}')
    return "\n".join(lines), draw(st.integers(0, 2 ** 16)), (2, c, h, w)


def _randomize(net: Net, rng: np.random.Generator) -> None:
    """Weights near 1 in size; BatchNorm statistics as sums with a factor that may be 0."""
    for name, views in net.params.items():
        kind = net.layer_types[net.layer_names.index(name)]
        for v in views:
            v.data[...] = rng.standard_normal(v.shape) * 0.7
        if kind == "BatchNorm":
            views[1].data[...] = np.abs(views[1].data)
            views[2].data[...] = rng.choice([0.0, 1.0, 2.5])


def _run(model: object, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds), strict=True))


def _agrees(name: str, got: np.ndarray, want: np.ndarray, own_error: float = 0.0) -> None:
    """``got`` (onnxruntime's) equals ``want`` (our float32 forward) up to TOL of its
    magnitude, or up to 4x ``own_error``: how far our float32 forward is from the same net
    in float64, where a net amplifies rounding (an LRN whose base nears 0) and two float32
    computations of it may differ by that much without either being wrong."""
    assert got.shape == want.shape, f"{name}: shape {got.shape}, the net's {want.shape}"
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{name}: NaN where the net has none, or not"
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite & ~nan], want[~finite & ~nan]), f"{name}: infinities"
    scale = max(1.0, float(np.abs(want[finite]).max(initial=0.0)))
    err = float(np.abs(got[finite] - want[finite]).max(initial=0.0))
    assert err <= max(TOL * scale, 4 * own_error), (
        f"{name}: max error {err} of magnitude {scale} (our float32's own error {own_error})")


def _own_errors(text: str, net: Net, x: np.ndarray, want: dict) -> dict[str, float]:
    """Each output's largest distance between our float32 forward and the same net, with the
    same parameters and input, in float64."""
    with Net(text, phase=TEST, dtype="float64") as twin:
        for name, views in net.params.items():
            for v, w in zip(views, twin.params[name], strict=True):
                w.data[...] = v.data
        with np.errstate(all="ignore"):
            exact = twin.forward(data=x.astype(np.float64))
    return {n: float(np.nan_to_num(np.abs(np.asarray(want[n], np.float64) - exact[n]),
                                   nan=0.0, posinf=0.0).max(initial=0.0)) for n in want}


def export_and_compare(text: str, seed: int, shape: tuple[int, ...]) -> None:
    """Build, export and run one net; a PurineError (build or export) ends the case."""
    with Net(text, phase=TEST) as net:
        rng = np.random.default_rng(seed)
        _randomize(net, rng)
        model = net_to_onnx(net)
        x = rng.standard_normal(shape).astype(np.float32)
        with np.errstate(all="ignore"):
            want = net.forward(data=x)
        got = _run(model, {"data": x})
        # Caffe's MAX pooling skips NaN and never goes below -FLT_MAX; ONNX's MaxPool does
        # neither. Past a non-finite value inside the net only the shapes are compared.
        inside = [n for n in net.blobs if n not in want]
        finite = all(np.isfinite(net.blobs[n].data).all() for n in inside)
        if not finite:
            event("non-finite inside the net: shapes compared")
        if finite:
            try:
                for name, value in want.items():
                    _agrees(name, got[name], np.asarray(value))
            except AssertionError:  # within what float32 itself loses on this net?
                own = _own_errors(text, net, x, want)
                for name, value in want.items():
                    _agrees(name, got[name], np.asarray(value), own[name])
                if currently_in_test_context():  # a hypothesis case, not a regression
                    event("ill-conditioned: within our float32's own error")
        else:
            for name, value in want.items():
                assert got[name].shape == np.shape(value), name


@share(0.08)
@given(case=small_net())
@counted
def test_exported_nets_load_and_match(case: tuple[str, int, tuple[int, ...]]) -> None:
    text, seed, shape = case
    check(lambda: export_and_compare(text, seed, shape), None)


# -- regressions ---------------------------------------------------------------------------
@pytest.mark.parametrize("alpha,beta", [(0.0, 0.75), (-1.0, 0.75), (1e-4, 0.0), (1.0, -1.0)])
def test_lrn_alpha_or_beta_not_positive_loads(alpha: float, beta: float) -> None:
    """Issue 28: LRN with alpha 0 passed onnx.checker, and onnxruntime refused to load it."""
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 '
            'dim: 3 dim: 2 dim: 2 } } }\n'
            f'layer {{ name: "n" type: "LRN" bottom: "data" top: "n" lrn_param {{ '
            f'local_size: 3 alpha: {alpha} beta: {beta} k: 2 }} }}')
    export_and_compare(text, 1, (2, 3, 2, 2))
    # y = x * (2 + alpha / 3 * window sum of x^2)^-beta, by hand for one x.
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2) / 8
    with Net(text, phase=TEST) as net:
        got = _run(net_to_onnx(net), {"data": x})["n"]
    sq = x.astype(np.float64) ** 2
    window = sq + np.pad(sq, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :3] \
        + np.pad(sq, ((0, 0), (0, 1), (0, 0), (0, 0)))[:, 1:]
    np.testing.assert_allclose(got, x * (2 + alpha / 3 * window) ** -beta, rtol=1e-5)


def test_an_ill_conditioned_net_is_held_to_float32s_own_error() -> None:
    """A long run's find: an LRN with k 0 and alpha -1 (its base nears 0) made onnxruntime
    and our float32 forward differ by 1.6e-4 of the output's magnitude, past TOL; both were
    that far from the float64 forward, so neither is wrong."""
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 '
            'dim: 3 dim: 3 dim: 4 } } }\n'
            'layer { name: "l0" bottom: "data" top: "t0" type: "Scale" scale_param { '
            'bias_term: true } }\n'
            'layer { name: "l1" bottom: "t0" top: "t1" type: "LRN" lrn_param { local_size: 5 '
            'alpha: -1.0 beta: 1.0 k: 0.0 norm_region: WITHIN_CHANNEL } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "t1" top: "ip" '
            'inner_product_param { num_output: 1 } }')
    export_and_compare(text, 390, (2, 3, 3, 4))
    with pytest.raises(AssertionError, match="our float32's own error 0.0"):
        _agrees("y", np.ones(3, np.float32) * 1.001, np.ones(3, np.float32), 0.0)


def test_export_refusal_is_one_line() -> None:
    """A pooling window past the input is refused at export, in one line naming the layer."""
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 '
            'dim: 1 dim: 6 dim: 6 } } }\n'
            'layer { name: "p" type: "Pooling" bottom: "data" top: "p" pooling_param { '
            'pool: AVE kernel_size: 2 stride: 3 } }')
    with pytest.raises(PurineError, match=r"^layer 'p' \(type Pooling\): no exact ONNX form"):
        export_and_compare(text, 0, (1, 1, 6, 6))
    assert math.isfinite(TOL)
