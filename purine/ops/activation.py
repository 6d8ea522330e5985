"""Elementwise activations (Caffe's neuron layers), forward and backward side by side.

Every kernel fills its output in place and tolerates ``y is x`` (in-place forward) and
``dx is dy`` (in-place gradients): whatever a kernel still needs from an input is read into a
temporary before the output is written. ReLU's float32 host passes of at least
``onednn.ELTWISE_MIN`` values run on oneDNN where it is installed, with numpy's bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from purine.backend import RandomStream, device_variant, get_array_module, onednn
from purine.ops.tensor import elementwise

Array = Any

# Fused GPU kernels (inputs, outputs, body) for the hot elementwise paths: one pass each, and
# the same roundings, in the same order, as the numpy path's separate operations.
FUSED: dict[str, tuple[str, str, str]] = {
    "relu_leaky": ("T x, float64 slope", "T y", "y = x * (x > (T)0 ? (T)1 : (T)slope);"),
    "relu_backward": ("T x, T dy, float64 slope", "T dx",
                      "dx = dy * (x > (T)0 ? (T)1 : (T)slope);"),
    "dropout": ("T x, M mask, float64 scale", "T y", "y = (x * (T)mask) * (T)scale;"),
}


def _fused(name: str) -> Any:
    return elementwise(name, *FUSED[name])

BNLL_THRESHOLD = 50.0
"""Caffe clamps the BNLL input at this value before exp() in the backward pass."""


# -- ReLU ----------------------------------------------------------------------------------
def _relu_forward_gpu(x: Array, y: Array, *, negative_slope: float = 0.0) -> None:
    if negative_slope == 0:
        get_array_module(x).maximum(x, 0, out=y)
    else:
        _fused("relu_leaky")(x, float(negative_slope), y)


@device_variant(_relu_forward_gpu)
def relu_forward(x: Array, y: Array, *, negative_slope: float = 0.0) -> None:
    if negative_slope == 0:
        dnnl = onednn.get()
        if dnnl is None or not dnnl.relu_forward(x, y):
            np.maximum(x, 0, out=y)
    else:
        np.multiply(x, np.where(x > 0, 1, negative_slope).astype(x.dtype), out=y)


def _relu_backward_gpu(x: Array, dy: Array, dx: Array, *, negative_slope: float = 0.0) -> None:
    _fused("relu_backward")(x, dy, float(negative_slope), dx)


@device_variant(_relu_backward_gpu)
def relu_backward(x: Array, dy: Array, dx: Array, *, negative_slope: float = 0.0) -> None:
    """``x`` may be the top (in-place use): its sign is the bottom's sign."""
    if negative_slope == 0:
        dnnl = onednn.get()
        if dnnl is None or not dnnl.relu_backward(x, dy, dx):
            np.multiply(dy, x > 0, out=dx)
    else:
        np.multiply(dy, np.where(x > 0, 1, negative_slope).astype(dy.dtype), out=dx)


# -- PReLU ---------------------------------------------------------------------------------
def _per_channel(slope: Array, ndim: int) -> Array:
    """The slope broadcast against an (N, C, ...) blob; a 0-d slope is channel-shared."""
    if slope.ndim == 0:
        return slope
    return slope.reshape((1, -1) + (1,) * (ndim - 2))


def prelu_forward(x: Array, slope: Array, y: Array) -> None:
    """y = max(x, 0) + slope[c] * min(x, 0)."""
    xp = get_array_module(x)
    neg = xp.minimum(x, 0)
    neg *= _per_channel(slope, x.ndim)
    xp.maximum(x, 0, out=y)
    y += neg


def prelu_backward_data(x: Array, slope: Array, dy: Array, dx: Array) -> None:
    """dx = dy * (x > 0 ? 1 : slope[c]); ``x`` is the original bottom."""
    xp = get_array_module(x)
    factor = xp.where(x > 0, xp.ones((), dtype=dx.dtype), _per_channel(slope, x.ndim))
    xp.multiply(dy, factor, out=dx)


def prelu_backward_slope(x: Array, dy: Array, dslope: Array) -> None:
    """dslope[c] = sum over every axis but the channel of dy * x * (x <= 0)."""
    xp = get_array_module(x)
    t = xp.multiply(dy, x)
    t *= x <= 0
    if dslope.ndim == 0:
        dslope[...] = t.sum()
    else:
        xp.sum(t, axis=(0,) + tuple(range(2, x.ndim)), out=dslope)


# -- Sigmoid, TanH, ELU --------------------------------------------------------------------
def sigmoid_forward(x: Array, y: Array) -> None:
    """1 / (1 + e^-x) written through tanh, which neither overflows nor loses precision."""
    xp = get_array_module(x)
    xp.multiply(x, 0.5, out=y)
    xp.tanh(y, out=y)
    y *= 0.5
    y += 0.5


def sigmoid_backward(y: Array, dy: Array, dx: Array) -> None:
    """dx = dy * y * (1 - y), from the top as Caffe does (right in place too)."""
    t = 1 - y
    t *= y
    get_array_module(y).multiply(dy, t, out=dx)


def tanh_forward(x: Array, y: Array) -> None:
    get_array_module(x).tanh(x, out=y)


def tanh_backward(y: Array, dy: Array, dx: Array) -> None:
    """dx = dy * (1 - y^2), from the top as Caffe does."""
    t = y * y
    xp = get_array_module(y)
    xp.subtract(1, t, out=t)
    xp.multiply(dy, t, out=dx)


def elu_forward(x: Array, y: Array, *, alpha: float) -> None:
    """y = max(x, 0) + alpha * (exp(min(x, 0)) - 1)."""
    xp = get_array_module(x)
    neg = xp.minimum(x, 0)
    xp.expm1(neg, out=neg)
    neg *= alpha
    xp.maximum(x, 0, out=y)
    y += neg


def elu_backward(x: Array, y: Array, dy: Array, dx: Array, *, alpha: float) -> None:
    """dx = dy * (x > 0 ? 1 : alpha + y). ``x`` only gives the sign, so it may be the top
    when alpha >= 0 (then y > 0 exactly where x > 0)."""
    xp = get_array_module(x)
    factor = xp.where(x > 0, xp.ones((), dtype=dx.dtype), y + alpha)
    xp.multiply(dy, factor, out=dx)


# -- Swish, Clip ---------------------------------------------------------------------------
def swish_forward(x: Array, y: Array, s: Array, *, beta: float) -> None:
    """y = x * sigmoid(beta * x); ``s`` keeps sigmoid(beta * x), which the backward pass
    reads, as Caffe keeps its inner Sigmoid layer's output. ``y`` may be ``x``: the sigmoid
    is taken before ``y`` is written."""
    xp = get_array_module(x)
    xp.multiply(x, beta, out=s)
    sigmoid_forward(s, s)
    xp.multiply(x, s, out=y)


def swish_backward(y: Array, s: Array, dy: Array, dx: Array, *, beta: float) -> None:
    """dx = dy * (beta * y + s * (1 - beta * y)), from the top and the kept sigmoid (right
    in place too)."""
    by = y * beta
    t = 1 - by
    t *= s
    t += by
    get_array_module(y).multiply(dy, t, out=dx)


def clip_forward(x: Array, y: Array, *, lo: float, hi: float) -> None:
    """y = max(lo, min(x, hi)) in Caffe's order: with lo > hi every output is lo, and a NaN
    input gives lo (``fmax`` drops the NaN that ``minimum`` keeps)."""
    xp = get_array_module(x)
    xp.minimum(x, hi, out=y)
    xp.fmax(y, lo, out=y)


def clip_backward(x: Array, dy: Array, dx: Array, *, lo: float, hi: float) -> None:
    """dx = dy where lo <= x <= hi (both bounds pass the gradient), else 0; ``x`` is the
    original bottom."""
    xp = get_array_module(x)
    inside = x >= lo
    inside &= x <= hi
    xp.multiply(dy, inside, out=dx)


# -- AbsVal, BNLL, Threshold ---------------------------------------------------------------
def absval_forward(x: Array, y: Array) -> None:
    get_array_module(x).abs(x, out=y)


def absval_backward(x: Array, dy: Array, dx: Array) -> None:
    """dx = sign(x) * dy, with sign(0) = 0 as Caffe's caffe_cpu_sign."""
    xp = get_array_module(x)
    xp.multiply(dy, xp.sign(x), out=dx)


def bnll_forward(x: Array, y: Array) -> None:
    """log(1 + e^x) as Caffe's stable form: x > 0 ? x + log(1 + e^-x) : log(1 + e^x),
    i.e. max(x, 0) + log1p(exp(-|x|))."""
    xp = get_array_module(x)
    t = xp.abs(x)
    xp.negative(t, out=t)
    xp.exp(t, out=t)
    xp.log1p(t, out=t)
    xp.maximum(x, 0, out=y)
    y += t


def bnll_backward(x: Array, dy: Array, dx: Array) -> None:
    """dx = dy * e / (e + 1) with e = exp(min(x, 50)); ``x`` is the original bottom."""
    xp = get_array_module(x)
    e = xp.minimum(x, BNLL_THRESHOLD)
    xp.exp(e, out=e)
    d = e + 1
    xp.divide(e, d, out=e)
    xp.multiply(dy, e, out=dx)


def threshold_forward(x: Array, y: Array, *, threshold: float) -> None:
    """y = x > threshold ? 1 : 0 (Caffe defines no gradient)."""
    y[...] = x > threshold


# -- Power, Exp, Log -----------------------------------------------------------------------
def power_forward(x: Array, y: Array, *, power: float, scale: float, shift: float) -> None:
    """y = (shift + scale * x) ^ power; with power * scale == 0 the input is ignored, as in
    Caffe: y = 1 for power 0, else shift ^ power."""
    xp = get_array_module(x)
    if power * scale == 0:
        y[...] = 1.0 if power == 0 else float(np.power(np.float64(shift), power))
        return
    if scale != 1:
        xp.multiply(x, scale, out=y)
    elif y is not x:
        y[...] = x
    if shift != 0:
        y += shift
    if power != 1:
        xp.power(y, power, out=y)


def power_backward(x: Array, dy: Array, dx: Array, *, power: float, scale: float,
                   shift: float) -> None:
    """dx = dy * power * scale * (shift + scale * x) ^ (power - 1) for power not in {0, 1}
    and scale != 0 (the other cases are ``power_backward_linear``); ``x`` is the original
    bottom. Caffe divides y by (shift + scale * x) instead, which is the same number except
    where the base is 0, where Caffe gets 0/0."""
    xp = get_array_module(x)
    base = xp.multiply(x, scale)
    if shift != 0:
        base += shift
    if power != 2:
        xp.power(base, power - 1, out=base)
    base *= power * scale
    xp.multiply(dy, base, out=dx)


def power_backward_linear(dy: Array, dx: Array, *, diff_scale: float) -> None:
    """Power's gradient when it does not depend on x: power == 1 gives dx = scale * dy;
    power * scale == 0 gives dx = 0 whatever dy holds (Caffe sets it, no product)."""
    if diff_scale == 0:
        dx[...] = 0
    else:
        get_array_module(dy).multiply(dy, diff_scale, out=dx)


def exp_forward(x: Array, y: Array, *, inner_scale: float, outer_scale: float) -> None:
    """y = base ^ (shift + scale * x) = outer_scale * exp(inner_scale * x), with
    inner_scale = ln(base) * scale and outer_scale = base ^ shift."""
    xp = get_array_module(x)
    if inner_scale == 1:
        xp.exp(x, out=y)
    else:
        xp.multiply(x, inner_scale, out=y)
        xp.exp(y, out=y)
    if outer_scale != 1:
        y *= outer_scale


def exp_backward(y: Array, dy: Array, dx: Array, *, inner_scale: float) -> None:
    """dx = dy * y * inner_scale, from the top as Caffe does (right in place too)."""
    xp = get_array_module(y)
    xp.multiply(dy, y, out=dx)
    if inner_scale != 1:
        dx *= inner_scale


def log_forward(x: Array, y: Array, *, scale: float, shift: float, base_scale: float) -> None:
    """y = log_base(shift + scale * x) = ln(shift + scale * x) * base_scale, with
    base_scale = 1 / ln(base)."""
    xp = get_array_module(x)
    if scale == 1 and shift == 0:
        xp.log(x, out=y)
    else:
        xp.multiply(x, scale, out=y)
        if shift != 0:
            y += shift
        xp.log(y, out=y)
    if base_scale != 1:
        y *= base_scale


def log_backward(x: Array, dy: Array, dx: Array, *, scale: float, shift: float,
                 base_scale: float) -> None:
    """dx = dy * scale * base_scale / (shift + scale * x); ``x`` is the original bottom."""
    xp = get_array_module(x)
    t = xp.multiply(x, scale)
    if shift != 0:
        t += shift
    xp.divide(dy, t, out=dx)
    if scale * base_scale != 1:
        dx *= scale * base_scale


# -- Dropout -------------------------------------------------------------------------------
def _dropout_scale(ratio: float, scale_train: bool) -> float:
    """Caffe's 1 / (1 - ratio); 1 where the Fast R-CNN fork's ``scale_train: false`` leaves
    training outputs unscaled (its test outputs are scaled by 1 - ratio instead)."""
    return 1.0 / (1.0 - ratio) if scale_train else 1.0


def _dropout_forward_gpu(x: Array, y: Array, mask: Array, *, ratio: float,
                         rng: RandomStream, scale_train: bool = True) -> None:
    xp = get_array_module(x)
    draw = (rng.uniform(x.shape) < 1.0 - ratio).astype(mask.dtype)
    if mask.flags.c_contiguous:
        mask.set(draw, stream=xp.cuda.get_current_stream())
    else:
        mask[...] = xp.asarray(draw)
    _fused("dropout")(x, mask, _dropout_scale(ratio, scale_train), y)


@device_variant(_dropout_forward_gpu)
def dropout_forward(x: Array, y: Array, mask: Array, *, ratio: float,
                    rng: RandomStream, scale_train: bool = True) -> None:
    """Training-time dropout: mask ~ Bernoulli(1 - ratio), y = x * mask / (1 - ratio)
    (without the division under ``scale_train=False``).

    The mask is drawn from the layer's own host stream at every call (then moved to the
    array's device), so a net gives the same masks on every device and thread schedule. On a
    GPU that costs a host-to-device copy of the mask (one byte per element) per call, queued
    on the op's stream. A tower or replica of the layer draws its part of the whole layer's
    mask (``RandomStream.uniform``), so a split net drops what the unsplit net drops."""
    mask[...] = rng.uniform(x.shape) < 1.0 - ratio
    np.multiply(x, mask, out=y)
    if scale_train:
        y *= 1.0 / (1.0 - ratio)


def _dropout_backward_gpu(mask: Array, dy: Array, dx: Array, *, ratio: float,
                          scale_train: bool = True) -> None:
    _fused("dropout")(dy, mask, _dropout_scale(ratio, scale_train), dx)


@device_variant(_dropout_backward_gpu)
def dropout_backward(mask: Array, dy: Array, dx: Array, *, ratio: float,
                     scale_train: bool = True) -> None:
    """dx = dy * mask / (1 - ratio) (dy * mask under ``scale_train=False``), through the
    mask the last forward drew."""
    np.multiply(dy, mask, out=dx)
    if scale_train:
        dx *= 1.0 / (1.0 - ratio)
