"""Builders of Caffe's neuron layers: elementwise, shape-preserving, usable in place (except
AbsVal, which Caffe forbids in place). A backward pass that needs the original bottom reads
``L.saved(0)``, so in-place use stays right where Caffe's own layers would read the top."""

from __future__ import annotations

import math
from collections.abc import Callable

from purine.caffe.facts import CHANNELS
from purine.caffe.layer import LayerBuild, register
from purine.formats import caffe_pb2 as pb
from purine.graph import Blob
from purine.ops import activation as act
from purine.ops import tensor


def _neuron(L: LayerBuild) -> tuple[Blob, bool]:
    """The bottom of a one-bottom, one-top neuron layer and whether the layer is in place."""
    L.expect(1, 1)
    return L.bottom(0), L.param.top[0] == L.param.bottom[0]


def _unary(L: LayerBuild, forward: Callable[..., None], backward: Callable[..., None],
           x: Blob, outs: list[Blob], keep: list[Blob], **k) -> Callable[[], None]:
    """Wire ``forward(x) -> outs``; returns the backward pass, which gives the bottom's
    gradient as ``backward(*keep, top_diff)``. Both kernels take the parameters ``k``."""
    L.forward(forward, [x], outs, **k)

    def build_backward():
        if L.needs_diff(0):
            L.backward(backward, [*keep, L.top_diff(0)], [L.bottom_diff(0)], **k)
    return build_backward


@register("ReLU", split=CHANNELS, export="relu")
def relu(L: LayerBuild):
    x, _ = _neuron(L)
    slope = L.param.relu_param.negative_slope
    # With slope >= 0 the top's sign is the bottom's sign, so the top serves, in place too
    # (as in Caffe); a negative slope flips it, so keep the bottom (Caffe would read the top).
    saved = L.saved(0) if slope < 0 else None
    y = L.top(0, x.shape)
    sign = y if saved is None else saved
    return _unary(L, act.relu_forward, act.relu_backward, x, [y], [sign], negative_slope=slope)


@register("PReLU", export="prelu")
def prelu(L: LayerBuild):
    x, _ = _neuron(L)
    p = L.param.prelu_param
    if len(x.shape) < 2:
        raise L.error(f"bottom '{x.name}' {x.shape} needs 2 or more axes (N, C, ...)")
    # Caffe's channel-shared slope is a 0-axis blob; per-channel it is (C,).
    shape = () if p.channel_shared else (x.shape[1],)
    filler = p.filler if p.HasField("filler") else pb.FillerParameter(type="constant",
                                                                        value=0.25)
    slope = L.add_param(shape, filler)
    src = L.saved(0)
    y = L.top(0, x.shape)
    L.forward(act.prelu_forward, [x, slope], [y])

    def backward():
        dy = L.top_diff(0)
        # The slope gradient first: in place, the data gradient overwrites dy.
        if L.needs_param_diff(0):
            L.backward(act.prelu_backward_slope, [src, dy], [L.param_diff(0)])
        if L.needs_diff(0):
            L.backward(act.prelu_backward_data, [src, slope, dy], [L.bottom_diff(0)])
    return backward


@register("Sigmoid", split=CHANNELS, export="sigmoid")
def sigmoid(L: LayerBuild):
    x, _ = _neuron(L)
    y = L.top(0, x.shape)
    return _unary(L, act.sigmoid_forward, act.sigmoid_backward, x, [y], [y])


@register("TanH", split=CHANNELS, export="tanh")
def tanh(L: LayerBuild):
    x, _ = _neuron(L)
    y = L.top(0, x.shape)
    return _unary(L, act.tanh_forward, act.tanh_backward, x, [y], [y])


@register("ELU", split=CHANNELS, export="elu")
def elu(L: LayerBuild):
    x, _ = _neuron(L)
    alpha = L.param.elu_param.alpha
    # With alpha >= 0, y > 0 exactly where x > 0, so the top gives the sign, in place too
    # (as in Caffe); a negative alpha breaks that, so keep the bottom.
    saved = L.saved(0) if alpha < 0 else None
    y = L.top(0, x.shape)
    sign = y if saved is None else saved
    return _unary(L, act.elu_forward, act.elu_backward, x, [y], [sign, y], alpha=alpha)


@register("Swish")
def swish(L: LayerBuild):
    x, _ = _neuron(L)
    beta = L.param.swish_param.beta
    y = L.top(0, x.shape)
    # sigmoid(beta x), kept for the backward pass: with the top it gives the gradient
    # without the bottom, so in place needs no copy (as in Caffe).
    s = L.scratch("sigmoid", x.shape)
    return _unary(L, act.swish_forward, act.swish_backward, x, [y, s], [y, s], beta=beta)


@register("Clip")
def clip(L: LayerBuild):
    x, _ = _neuron(L)
    p = L.param.clip_param
    missing = [f for f in ("min", "max") if not p.HasField(f)]
    if missing:
        raise L.error(f"clip_param.{' and clip_param.'.join(missing)} must be given "
                      "(both bounds are required)")
    k = dict(lo=p.min, hi=p.max)
    # The gradient mask needs the bottom: in place, Caffe would test the clipped top, which
    # always lies within the bounds; the copy keeps the mask right.
    src = L.saved(0)
    y = L.top(0, x.shape)
    return _unary(L, act.clip_forward, act.clip_backward, x, [y], [src], **k)


@register("AbsVal", split=CHANNELS)
def absval(L: LayerBuild):
    x, in_place = _neuron(L)
    if in_place:
        raise L.error(f"does not allow in-place computation (top '{x.name}' is its bottom)")
    y = L.top(0, x.shape)
    return _unary(L, act.absval_forward, act.absval_backward, x, [y], [x])


@register("BNLL", split=CHANNELS)
def bnll(L: LayerBuild):
    x, _ = _neuron(L)
    src = L.saved(0)
    y = L.top(0, x.shape)
    return _unary(L, act.bnll_forward, act.bnll_backward, x, [y], [src])


@register("Threshold", split=CHANNELS)
def threshold(L: LayerBuild):
    x, _ = _neuron(L)
    y = L.top(0, x.shape)
    L.forward(act.threshold_forward, [x], [y], threshold=L.param.threshold_param.threshold)

    def backward():
        if L.needs_diff(0):
            raise L.error(f"has no backward pass (Caffe's Backward is not implemented), "
                          f"but the net needs the gradient of its bottom '{x.name}' "
                          "(force_backward, or a learning layer below it)")
    return backward


@register("Power", split=CHANNELS)
def power(L: LayerBuild):
    x, in_place = _neuron(L)
    p = L.param.power_param
    k = dict(power=p.power, scale=p.scale, shift=p.shift)
    diff_scale = p.power * p.scale
    # With power 1, or power * scale 0, the gradient does not depend on x.
    needs_x = diff_scale != 0 and p.power != 1
    src = L.saved(0) if needs_x else x
    y = L.top(0, x.shape)
    L.forward(act.power_forward, [x], [y], **k)

    def backward():
        if not L.needs_diff(0):
            return
        dy, dx = L.top_diff(0), L.bottom_diff(0)
        if needs_x:
            L.backward(act.power_backward, [src, dy], [dx], **k)
        else:
            L.backward(act.power_backward_linear, [dy], [dx], diff_scale=diff_scale)
    return backward


def _ln_base(L: LayerBuild, what: str, base: float) -> float:
    """ln(base), with Caffe's convention that base -1 means e."""
    if base == -1:
        return 1.0
    if not base > 0:
        raise L.error(f"{what}.base must be strictly positive (or -1 for e), got {base}")
    ln = math.log(base)
    if not math.isfinite(ln):
        raise L.error(f"{what}.base {base} gives log(base) = {ln}")
    return ln


@register("Exp", split=CHANNELS)
def exp(L: LayerBuild):
    x, _ = _neuron(L)
    p = L.param.exp_param
    inner_scale = _ln_base(L, "exp_param", p.base) * p.scale
    if p.shift == 0:
        outer_scale = 1.0
    else:
        outer_scale = math.exp(p.shift) if p.base == -1 else p.base ** p.shift
    y = L.top(0, x.shape)
    L.forward(act.exp_forward, [x], [y], inner_scale=inner_scale, outer_scale=outer_scale)

    def backward():
        if L.needs_diff(0):
            L.backward(act.exp_backward, [y, L.top_diff(0)], [L.bottom_diff(0)],
                       inner_scale=inner_scale)
    return backward


@register("Log", split=CHANNELS)
def log(L: LayerBuild):
    x, _ = _neuron(L)
    p = L.param.log_param
    ln = _ln_base(L, "log_param", p.base)
    if ln == 0:
        raise L.error(f"log_param.base {p.base} gives log(base) = 0, so 1/log(base) is "
                      "infinite")
    k = dict(scale=p.scale, shift=p.shift, base_scale=1.0 / ln)
    src = L.saved(0)
    y = L.top(0, x.shape)
    return _unary(L, act.log_forward, act.log_backward, x, [y], [src], **k)


@register("Dropout", split=CHANNELS, export="dropout")
def dropout(L: LayerBuild):
    x, in_place = _neuron(L)
    ratio = L.param.dropout_param.dropout_ratio
    if not 0 <= ratio < 1:
        raise L.error(f"dropout_param.dropout_ratio must be in [0, 1), got {ratio}")
    y = L.top(0, x.shape)
    # Fast R-CNN's fork: scale_train false keeps training outputs unscaled and scales test
    # outputs by 1 - ratio instead (OpenCV's importer makes that a Power layer).
    scaled = L.param.dropout_param.scale_train
    if L.phase != pb.TRAIN and not scaled:
        L.forward(act.power_forward, [x], [y], op_type="DropoutForward", power=1.0,
                  scale=1.0 - ratio, shift=0.0)

        def backward_test_unscaled():
            if L.needs_diff(0):
                L.backward(act.power_backward_linear, [L.top_diff(0)], [L.bottom_diff(0)],
                           op_type="DropoutBackward", diff_scale=1.0 - ratio)
        return backward_test_unscaled
    if L.phase != pb.TRAIN:
        # TEST: the identity, a copy as in Caffe (nothing at all in place).
        if not in_place:
            L.forward(tensor.copy, [x], [y], op_type="DropoutForward")

        def backward_test():
            if L.needs_diff(0) and not in_place:
                L.backward(tensor.copy, [L.top_diff(0)], [L.bottom_diff(0)],
                           op_type="DropoutBackward")
        return backward_test

    mask = L.scratch("mask", x.shape, "uint8")
    unscaled = {} if scaled else {"scale_train": False}
    L.forward(act.dropout_forward, [x], [y, mask], ratio=ratio, rng=L.random_stream(),
              **unscaled)

    def backward():
        if L.needs_diff(0):
            L.backward(act.dropout_backward, [mask, L.top_diff(0)], [L.bottom_diff(0)],
                       ratio=ratio, **unscaled)
    return backward
