"""Builders of the loss family: Softmax, SoftmaxWithLoss, EuclideanLoss,
SigmoidCrossEntropyLoss, HingeLoss, MultinomialLogisticLoss, InfogainLoss, ContrastiveLoss, and
Accuracy (a metric that is not a loss). Loss tops are scalars of shape (); a loss layer's
backward reads its top's diff, the loss weight."""

from __future__ import annotations

import math

import numpy as np

from purine.caffe.layer import LayerBuild, register
from purine.caffe.layers.common import canonical_axis
from purine.errors import ProtoError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import blob_to_array
from purine.formats.prototxt import read_binary
from purine.graph import Blob
from purine.ops import loss as ls
from purine.ops import softmax as sm


def _loss_layer(L: LayerBuild, tops: tuple[int, int] = (1, 1),
                bottoms: int | tuple[int, int] = 2) -> None:
    """Caffe's LossLayer set-up: two bottoms (unless told), a loss weight of 1 unless the
    prototxt gives one, no forced gradient for the labels, and a top made up when the prototxt
    names none (Caffe's AutoTopBlobs, which old prototxts rely on)."""
    if not L.param.top:
        name = "(automatic)"
        if name in L.net.data:
            name = f"(automatic) {L.name}"
        L.param.top.append(name)
    L.expect(bottoms, tops)
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


@register("Softmax", export="softmax")
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


def _legacy_dims(L: LayerBuild, b: Blob) -> tuple[int, int, int]:
    """Caffe's channels, height and width of ``b`` (1 past its axes), which exist only for
    blobs of at most 4 axes."""
    if len(b.shape) > 4:
        raise L.error(f"bottom '{b.name}' {b.shape} has {len(b.shape)} axes; {L.type} takes "
                      "blobs of at most 4 axes (num, channels, height, width)")
    c, h, w = (b.shape[i] if i < len(b.shape) else 1 for i in (1, 2, 3))
    return c, h, w


def _one_label_per_sample(L: LayerBuild) -> None:
    """Caffe's check on MultinomialLogisticLoss's labels: (N, 1, 1, 1), or fewer axes."""
    x, label = L.bottom(0), L.bottom(1)
    if _legacy_dims(L, label) != (1, 1, 1):
        raise L.error(f"bottom '{label.name}' {label.shape} must hold one label per sample, "
                      f"shaped (N,) or (N, 1, 1, 1), for bottom '{x.name}' {x.shape}")


@register("MultinomialLogisticLoss")
def multinomial_logistic_loss(L: LayerBuild):
    _loss_layer(L)
    _one_label_per_sample(L)
    prob, label = L.bottom(0), L.bottom(1)
    _legacy_dims(L, prob)
    loss = L.top(0, ())
    # No normalization or ignore_label here: Caffe always divides by the batch size.
    L.forward(ls.multinomial_logistic_loss_forward, [prob, label], [loss])

    def backward():
        if L.needs_diff(0):
            L.backward(ls.multinomial_logistic_loss_backward, [prob, label, L.top_diff(0)],
                       [L.bottom_diff(0)])
        if L.needs_diff(1):
            raise L.error(f"cannot backpropagate to the labels '{label.name}'")
    return backward


def _infogain_source(L: LayerBuild, classes: int, axis: int) -> np.ndarray:
    """H from ``infogain_loss_param.source``, a binary BlobProto of C x C values (its shape
    does not matter, as in Caffe, only its count)."""
    p = L.param.infogain_loss_param
    if not p.HasField("source"):
        raise L.error("needs the infogain matrix H: set infogain_loss_param { source: "
                      "\"H.binaryproto\" } or give H as a third bottom")
    try:
        blob = read_binary(p.source, pb.BlobProto(), ".binaryproto (BlobProto)")
    except ProtoError as e:  # names the file
        raise L.error(f"infogain matrix: {e}") from None
    try:
        h = blob_to_array(blob)
    except ProtoError as e:
        raise L.error(f"infogain matrix '{p.source}': {e}") from None
    if len(blob.double_data):  # kept in double, as Caffe's double nets read it
        h = np.asarray(blob.double_data, dtype=np.float64).reshape(h.shape)
    if h.size != classes * classes:
        raise L.error(f"infogain matrix '{p.source}' has shape {h.shape} ({h.size} values); "
                      f"bottom '{L.bottom(0).name}' {L.bottom(0).shape} has {classes} classes "
                      f"along axis {axis}, so H must be {classes} x {classes}")
    return h.reshape(classes, classes).astype(L.net.dtype)


@register("InfogainLoss")
def infogain_loss(L: LayerBuild):
    _loss_layer(L, (1, 2), bottoms=(2, 3))
    p = L.param.infogain_loss_param
    x, label = L.bottom(0), L.bottom(1)
    axis = canonical_axis(L, p.axis, len(x.shape))
    _label_count(L, axis)
    if L.param.loss_param.HasField("normalize"):
        raise L.error("loss_param.normalize is deprecated and refused by InfogainLoss; use "
                      "loss_param.normalization (FULL, VALID, BATCH_SIZE or NONE)")
    params = dict(axis=axis, ignore_label=_ignore_label(L.param.loss_param),
                  normalization=pb.LossParameter.NormalizationMode.Name(
                      L.param.loss_param.normalization))
    classes = x.shape[axis]
    if len(L.bottoms) == 3:
        h = L.bottom(2)
        if h.count != classes * classes:
            raise L.error(f"bottom '{h.name}' {h.shape} holds {h.count} values; bottom "
                          f"'{x.name}' {x.shape} has {classes} classes along axis {axis}, so "
                          f"H must be {classes} x {classes}")
        # Caffe allows no gradient for H; a forced one is left out rather than refused.
        L.no_force_backward.add(2)
    else:
        h = L.scratch("H", (classes, classes))
        L.forward(ls.infogain_matrix, [], [h], value=_infogain_source(L, classes, axis))
    loss = L.top(0, ())
    # The optional second top is the softmax itself, as Caffe shares prob's data with it.
    prob = L.top(1, x.shape) if len(L.param.top) > 1 else L.scratch("prob", x.shape)
    L.forward(sm.softmax_forward, [x], [prob], axis=axis)
    L.forward(ls.infogain_loss_forward, [prob, label, h], [loss], **params)

    def backward():
        # As Caffe, a gradient arriving through the prob top is not propagated.
        if L.needs_diff(0):
            L.backward(ls.infogain_loss_backward, [prob, label, h, L.top_diff(0)],
                       [L.bottom_diff(0)], **params)
        if L.needs_diff(1):
            raise L.error(f"cannot backpropagate to the labels '{label.name}'")
        if len(L.bottoms) == 3 and L.needs_diff(2):
            raise L.error(f"cannot backpropagate to the infogain matrix '{h.name}'")
    return backward


@register("ContrastiveLoss")
def contrastive_loss(L: LayerBuild):
    _loss_layer(L, bottoms=3)
    # Unlike most losses, both features take a (forced) gradient; the similarity does not.
    L.no_force_backward.clear()
    L.no_force_backward.add(2)
    a, b, y = L.bottoms
    ca, ha, wa = _legacy_dims(L, a)
    cb, hb, wb = _legacy_dims(L, b)
    if (ha, wa, hb, wb) != (1, 1, 1, 1) or ca != cb:
        raise L.error(f"bottoms '{a.name}' {a.shape} and '{b.name}' {b.shape} must be feature "
                      "pairs of one shape (N, C) or (N, C, 1, 1)")
    if _legacy_dims(L, y) != (1, 1, 1) or y.count != a.shape[0]:
        raise L.error(f"bottom '{y.name}' {y.shape} must hold one similarity per pair, shaped "
                      f"({a.shape[0]},) or ({a.shape[0]}, 1, 1, 1)")
    p = L.param.contrastive_loss_param
    params = dict(margin=p.margin, legacy_version=p.legacy_version)
    loss = L.top(0, ())
    L.forward(ls.contrastive_loss_forward, [a, b, y], [loss], **params)

    def backward():
        for i, sign in ((0, 1.0), (1, -1.0)):
            if L.needs_diff(i):
                L.backward(ls.contrastive_loss_backward, [a, b, y, L.top_diff(0)],
                           [L.bottom_diff(i)], sign=sign, **params)
        if L.needs_diff(2):
            raise L.error(f"cannot backpropagate to the similarity labels '{y.name}'")
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
