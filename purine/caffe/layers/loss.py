"""Builders of the loss family: Softmax, SoftmaxWithLoss, EuclideanLoss,
SigmoidCrossEntropyLoss, HingeLoss, and Accuracy (a metric that is not a loss). Loss tops are
scalars of shape (); a loss layer's backward reads its top's diff, the loss weight."""

from __future__ import annotations

import math

from purine.caffe import caffe_pb2 as pb
from purine.caffe.layer import LayerBuild, register
from purine.caffe.layers.common import canonical_axis
from purine.ops import loss as ls
from purine.ops import softmax as sm


def _loss_layer(L: LayerBuild, tops: tuple[int, int] = (1, 1)) -> None:
    """Caffe's LossLayer set-up: two bottoms, a loss weight of 1 unless the prototxt gives
    one, no forced gradient for the labels, and a top made up when the prototxt names none
    (Caffe's AutoTopBlobs, which old prototxts rely on)."""
    if not L.param.top:
        name = "(automatic)"
        if name in L.net.data:
            name = f"(automatic) {L.name}"
        L.param.top.append(name)
    L.expect(2, tops)
    if not L.loss_weights:
        L.loss_weights = [1.0]
    L.no_force_backward.add(1)
    a, b = L.bottom(0), L.bottom(1)
    if not a.shape or not b.shape or a.shape[0] != b.shape[0]:
        raise L.error(f"bottom '{a.name}' {a.shape} and bottom '{b.name}' {b.shape} differ in "
                      "axis 0; the data and the labels need the same first dimension")


def _normalization(L: LayerBuild, default: int) -> str:
    """The normalization mode: ``normalization`` when given, else the deprecated
    ``normalize`` (true: VALID, false: BATCH_SIZE), else the layer's default."""
    p = L.param.loss_param
    if p.HasField("normalization"):
        mode = p.normalization
    elif p.HasField("normalize"):
        mode = pb.LossParameter.VALID if p.normalize else pb.LossParameter.BATCH_SIZE
    else:
        mode = default
    return pb.LossParameter.NormalizationMode.Name(mode)


def _ignore_label(param) -> int | None:
    return param.ignore_label if param.HasField("ignore_label") else None


def _label_count(L: LayerBuild, axis: int) -> None:
    """Caffe's check that there is one label per (outer, inner) position around ``axis``."""
    x, label = L.bottom(0), L.bottom(1)
    outer, inner = math.prod(x.shape[:axis]), math.prod(x.shape[axis + 1:])
    if outer * inner != label.count:
        raise L.error(
            f"bottom '{label.name}' {label.shape} holds {label.count} labels, but bottom "
            f"'{x.name}' {x.shape} with axis {axis} needs {outer} x {inner} = {outer * inner} "
            f"(one per position; class values in 0..{x.shape[axis] - 1})")


@register("Softmax")
def softmax(L: LayerBuild):
    L.expect(1, 1)
    x = L.bottom(0)
    axis = canonical_axis(L, L.param.softmax_param.axis, len(x.shape))
    y = L.top(0, x.shape)
    L.forward(sm.softmax_forward, [x], [y], axis=axis)

    def backward():
        # Only the top is read, so in-place use needs no saved copy.
        L.backward(sm.softmax_backward, [y, L.top_diff(0)], [L.bottom_diff(0)], axis=axis)
    return backward


@register("SoftmaxWithLoss")
def softmax_with_loss(L: LayerBuild):
    _loss_layer(L, (1, 2))
    x, label = L.bottom(0), L.bottom(1)
    axis = canonical_axis(L, L.param.softmax_param.axis, len(x.shape))
    _label_count(L, axis)
    params = dict(axis=axis, ignore_label=_ignore_label(L.param.loss_param),
                  normalization=_normalization(L, pb.LossParameter.VALID))
    loss = L.top(0, ())
    # The optional second top is the softmax itself, as Caffe shares prob's data with it.
    prob = L.top(1, x.shape) if len(L.param.top) > 1 else L.scratch("prob", x.shape)
    L.forward(sm.softmax_forward, [x], [prob], axis=axis)
    L.forward(ls.softmax_loss_forward, [prob, label], [loss], **params)

    def backward():
        # As Caffe, a gradient arriving through the prob top is not propagated.
        if L.needs_diff(0):
            L.backward(ls.softmax_loss_backward, [prob, label, L.top_diff(0)],
                       [L.bottom_diff(0)], **params)
        if L.needs_diff(1):
            raise L.error(f"cannot backpropagate to the labels '{label.name}'")
    return backward


@register("EuclideanLoss")
def euclidean_loss(L: LayerBuild):
    _loss_layer(L)
    L.no_force_backward.discard(1)  # Caffe lets both bottoms take a forced gradient
    a, b = L.bottom(0), L.bottom(1)
    if a.count != b.count:
        raise L.error(f"bottom '{a.name}' {a.shape} and bottom '{b.name}' {b.shape} differ in "
                      "count; the inputs must have the same dimension")
    loss = L.top(0, ())
    L.forward(ls.euclidean_loss_forward, [a, b], [loss])

    def backward():
        for i, sign in ((0, 1.0), (1, -1.0)):
            if L.needs_diff(i):
                L.backward(ls.euclidean_loss_backward, [a, b, L.top_diff(0)],
                           [L.bottom_diff(i)], sign=sign)
    return backward


@register("SigmoidCrossEntropyLoss")
def sigmoid_cross_entropy_loss(L: LayerBuild):
    _loss_layer(L)
    x, target = L.bottom(0), L.bottom(1)
    if x.count != target.count:
        raise L.error(f"bottom '{x.name}' {x.shape} and bottom '{target.name}' {target.shape} "
                      "differ in count; the inputs must have the same count")
    # Unlike SoftmaxWithLoss, Caffe keeps this layer's old default, the batch size.
    params = dict(ignore_label=_ignore_label(L.param.loss_param),
                  normalization=_normalization(L, pb.LossParameter.BATCH_SIZE))
    loss = L.top(0, ())
    L.forward(ls.sigmoid_cross_entropy_loss_forward, [x, target], [loss], **params)

    def backward():
        if L.needs_diff(0):
            L.backward(ls.sigmoid_cross_entropy_loss_backward, [x, target, L.top_diff(0)],
                       [L.bottom_diff(0)], **params)
        if L.needs_diff(1):
            raise L.error(f"cannot backpropagate to the targets '{target.name}'")
    return backward


@register("HingeLoss")
def hinge_loss(L: LayerBuild):
    _loss_layer(L)
    x, label = L.bottom(0), L.bottom(1)
    if label.count != x.shape[0]:
        raise L.error(f"bottom '{label.name}' {label.shape} holds {label.count} labels, but "
                      f"bottom '{x.name}' {x.shape} needs one per sample ({x.shape[0]})")
    norm = pb.HingeLossParameter.Norm.Name(L.param.hinge_loss_param.norm)
    loss = L.top(0, ())
    L.forward(ls.hinge_loss_forward, [x, label], [loss], norm=norm)

    def backward():
        if L.needs_diff(0):
            L.backward(ls.hinge_loss_backward, [x, label, L.top_diff(0)], [L.bottom_diff(0)],
                       norm=norm)
        if L.needs_diff(1):
            raise L.error(f"cannot backpropagate to the labels '{label.name}'")
    return backward


@register("Accuracy")
def accuracy(L: LayerBuild):
    L.expect(2, (1, 2))
    p = L.param.accuracy_param
    x, label = L.bottom(0), L.bottom(1)
    axis = canonical_axis(L, p.axis, len(x.shape))
    classes = x.shape[axis] if x.shape else 0
    if label.count and p.top_k > x.count // label.count:
        raise L.error(f"top_k {p.top_k} is more than the {x.count // label.count} classes of "
                      f"bottom '{x.name}' {x.shape} per label of '{label.name}' {label.shape}")
    _label_count(L, axis)
    # Accuracy has no gradient; Caffe would abort in Backward under force_backward, here the
    # bottoms are simply left out of it.
    L.no_force_backward.update((0, 1))
    tops = [L.top(0, ())]
    if len(L.param.top) > 1:
        tops.append(L.top(1, (classes,)))
    L.forward(ls.accuracy_forward, [x, label], tops, axis=axis, top_k=p.top_k,
              ignore_label=_ignore_label(p))

    def backward():
        raise L.error("has no gradient: Accuracy cannot be used as a loss, but the net needs "
                      f"the gradient of its bottom(s) through it (tops {list(L.param.top)})")
    return backward
