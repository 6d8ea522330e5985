"""Loss and accuracy kernels (Caffe's SoftmaxWithLoss, EuclideanLoss, SigmoidCrossEntropyLoss,
HingeLoss, MultinomialLogisticLoss, InfogainLoss, ContrastiveLoss, Accuracy), forward and backward
side by side. A loss is a 0-d array; a backward
kernel reads the loss's diff (the loss weight) and overwrites the bottom's diff."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from purine.backend import assign, device_variant, get_array_module
from purine.errors import LabelError, PurineError

Array = Any

# Caffe clamps probabilities at FLT_MIN before the log, whatever the Dtype.
FLT_MIN = 1.1754943508222875e-38

# Caffe's kLOG_THRESHOLD of MultinomialLogisticLoss and InfogainLoss: a float constant, so a
# double net clamps at float(1e-20) widened to double, not at the double 1e-20.
LOG_THRESHOLD = float(np.float32(1e-20))

NORMALIZATIONS = ("FULL", "VALID", "BATCH_SIZE", "NONE")


# -- shared helpers ------------------------------------------------------------------------
def _split(x: Array, axis: int) -> Array:
    """``x`` viewed as (outer, classes, inner) around ``axis``."""
    outer = 1
    for d in x.shape[:axis]:
        outer *= d
    return x.reshape(outer, x.shape[axis], math.prod(x.shape[axis + 1:]))  # -1: not if empty


def _class_labels(xp: Any, label: Array, outer: int, classes: int, inner: int,
                  ignore_label: int | None) -> tuple[Array, Array, Array | None]:
    """The labels as (outer, inner) class indices, the mask of labels that count, and (on a
    GPU) the mask of labels out of range. Caffe casts a label to int, which truncates toward
    zero; ignored positions get index 0 so that gathers stay in range, and the mask removes
    them. On the host a label out of range is an error; on a GPU, reading that verdict back
    would stall the stream, so such a label counts as ignored and its kernel's result becomes
    NaN instead (``_poison``)."""
    value = xp.trunc(label.reshape(outer, inner))
    valid = xp.ones(value.shape, dtype=bool) if ignore_label is None else value != ignore_label
    # A NaN label fails both comparisons and is reported as out of range.
    bad = valid & ~((value >= 0) & (value < classes))
    return _checked_labels(value, valid, bad, label, classes, ignore_label)


def _checked_labels_gpu(value: Array, valid: Array, bad: Array,
                        label: Array, classes: int, ignore_label: int | None,  # noqa: ARG001
                        ) -> tuple[Array, Array, Array | None]:
    xp = get_array_module(value)
    valid &= ~bad
    return xp.where(valid, value, 0).astype(xp.int64), valid, bad


@device_variant(_checked_labels_gpu)
def _checked_labels(value: Array, valid: Array, bad: Array, label: Array, classes: int,
                    ignore_label: int | None) -> tuple[Array, Array, Array | None]:
    """``_class_labels``' result from the truncated labels, the mask of those that count and
    the mask of those out of range: an error on the host, NaN results on a GPU."""
    if bool(bad.any()):
        first = int(bad.reshape(-1).argmax())
        where = tuple(int(i) for i in _unravel(first, label.shape))
        raw = float(label.reshape(-1)[first])
        ignore = "" if ignore_label is None else f", and it is not the ignore_label {ignore_label}"
        raise LabelError(f"label value {raw:g} at index {where} of the label blob "
                         f"{tuple(label.shape)} is outside [0, {classes}){ignore} "
                         f"({int(bad.sum())} bad label(s) in all)")
    index = np.where(valid, value, 0).astype(np.int64)
    return index, valid, None


def _poison(xp: Any, value: Array, bad: Array | None) -> Array:
    """``value``, or NaN when any label was out of range (GPU only; the host raises)."""
    return value if bad is None else xp.where(bad.any(), xp.nan, value)


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for d in reversed(shape):
        out.append(flat % d)
        flat //= d
    return out[::-1]


def _normalizer(xp: Any, mode: str, valid: Array | None, full: int, batch: int,
                dtype: Any) -> Any:
    """Caffe's get_normalizer: the divisor of a loss, at least 1 so that a batch whose labels
    are all ignored gives 0 rather than NaN."""
    if mode == "FULL":
        return float(max(full, 1))
    if mode == "VALID":
        if valid is None:
            return float(max(full, 1))
        return xp.maximum(valid.sum(dtype=dtype), 1)
    if mode == "BATCH_SIZE":
        return float(max(batch, 1))
    if mode == "NONE":
        return 1.0
    raise PurineError(f"unknown loss normalization {mode!r}; expected one of {NORMALIZATIONS}")


def _not_ignored(xp: Any, target: Array, ignore_label: int | None) -> Array | None:
    if ignore_label is None:
        return None
    return xp.trunc(target) != ignore_label


# -- SoftmaxWithLoss -----------------------------------------------------------------------
def softmax_loss_forward(prob: Array, label: Array, loss: Array, *, axis: int,
                         ignore_label: int | None = None, normalization: str = "VALID") -> None:
    """``loss = -sum log(max(prob[label], FLT_MIN)) / normalizer`` over the labels that count;
    ``prob`` is the softmax along ``axis``."""
    xp = get_array_module(prob)
    p3 = _split(prob, axis)
    outer, classes, inner = p3.shape
    index, valid, bad = _class_labels(xp, label, outer, classes, inner, ignore_label)
    picked = xp.take_along_axis(p3, index[:, None, :], axis=1)[:, 0, :]
    nll = xp.where(valid, -xp.log(xp.maximum(picked, FLT_MIN)), 0)
    loss[...] = _poison(xp, nll.sum() / _normalizer(xp, normalization, valid, outer * inner,
                                                    outer, prob.dtype), bad)


def softmax_loss_backward(prob: Array, label: Array, dloss: Array, dx: Array, *, axis: int,
                          ignore_label: int | None = None, normalization: str = "VALID") -> None:
    """``dx = (prob - onehot(label)) * dloss / normalizer``, zero where the label is ignored."""
    xp = get_array_module(prob)
    p3, d3 = _split(prob, axis), _split(dx, axis)
    outer, classes, inner = p3.shape
    index, valid, bad = _class_labels(xp, label, outer, classes, inner, ignore_label)
    scale = dloss / _normalizer(xp, normalization, valid, outer * inner, outer, prob.dtype)
    _softmax_loss_gradient(p3, index, valid, bad, scale, d3)


def _softmax_loss_gradient_gpu(p3: Array, index: Array, valid: Array, bad: Array | None,
                               scale: Array, d3: Array) -> None:
    xp = get_array_module(p3)
    factor = xp.where(bad, xp.nan, xp.where(valid, scale, 0)).astype(d3.dtype)
    _softmax_loss_grad()(p3, index[:, None, :], factor[:, None, :],
                         xp.arange(p3.shape[1], dtype=xp.int64)[None, :, None], d3)


@device_variant(_softmax_loss_gradient_gpu)
def _softmax_loss_gradient(p3: Array, index: Array, valid: Array, bad: Array | None,  # noqa: ARG001
                           scale: Array, d3: Array) -> None:
    """d3 = (p3 - onehot(index)) * scale, zero where the label does not count; ``p3`` and
    ``d3`` are (outer, classes, inner), the others (outer, inner) or 0-d."""
    onehot = np.arange(p3.shape[1])[None, :, None] == index[:, None, :]
    np.subtract(p3, onehot, out=d3)
    d3 *= np.where(valid, scale, 0).astype(d3.dtype)[:, None, :]


SOFTMAX_LOSS_GRAD = ("T p, int64 label, T factor, int64 c", "T dx",
                     "dx = (p - (c == label ? (T)1 : (T)0)) * factor;")
"""The GPU's fused softmax-loss gradient: one pass instead of a one-hot temporary, a subtract
and a broadcast multiply; the same two roundings as the host path."""


def _softmax_loss_grad() -> Any:
    from purine.ops.tensor import elementwise

    return elementwise("softmax_loss_grad", *SOFTMAX_LOSS_GRAD)


# -- EuclideanLoss -------------------------------------------------------------------------
def euclidean_loss_forward(a: Array, b: Array, loss: Array) -> None:
    """``loss = sum((a - b)^2) / num / 2`` with ``num = a.shape[0]``; ``b`` need only have
    ``a``'s count (Caffe compares count(1))."""
    diff = (a - b.reshape(a.shape)).reshape(-1)
    loss[...] = diff.dot(diff) / a.shape[0] / 2


def euclidean_loss_backward(a: Array, b: Array, dloss: Array, dx: Array, *,
                            sign: float) -> None:
    """``dx = sign * (a - b) * dloss / num``: sign +1 for the first bottom, -1 for the second."""
    xp = get_array_module(a)
    xp.subtract(a.reshape(dx.shape), b.reshape(dx.shape), out=dx)
    dx *= (sign * dloss / dx.shape[0]).astype(dx.dtype)


# -- SigmoidCrossEntropyLoss ---------------------------------------------------------------
def sigmoid_cross_entropy_loss_forward(x: Array, target: Array, loss: Array, *,
                                       ignore_label: int | None = None,
                                       normalization: str = "BATCH_SIZE") -> None:
    """Cross-entropy of ``sigmoid(x)`` against targets in [0, 1], in Caffe's stable form
    ``log(1 + exp(-|x|)) - x * (target - [x >= 0])`` summed over the targets that count."""
    xp = get_array_module(x)
    t = target.reshape(x.shape)
    valid = _not_ignored(xp, t, ignore_label)
    per = xp.log1p(xp.exp(-xp.abs(x))) - x * (t - (x >= 0))
    if valid is not None:
        per = xp.where(valid, per, 0)
    loss[...] = per.sum() / _normalizer(xp, normalization, valid, x.size, x.shape[0], x.dtype)


def sigmoid_cross_entropy_loss_backward(x: Array, target: Array, dloss: Array, dx: Array, *,
                                        ignore_label: int | None = None,
                                        normalization: str = "BATCH_SIZE") -> None:
    """``dx = (sigmoid(x) - target) * dloss / normalizer``, zero where the target is ignored."""
    xp = get_array_module(x)
    t = target.reshape(x.shape)
    valid = _not_ignored(xp, t, ignore_label)
    # tanh form of the sigmoid: no overflow for large |x| (Caffe's Sigmoid uses it too).
    xp.tanh(x * 0.5, out=dx)
    dx *= 0.5
    dx += 0.5
    dx -= t
    scale = dloss / _normalizer(xp, normalization, valid, x.size, x.shape[0], x.dtype)
    if valid is not None:
        dx *= xp.where(valid, scale, 0).astype(dx.dtype)
    else:
        dx *= scale.astype(dx.dtype)


# -- HingeLoss -----------------------------------------------------------------------------
def _hinge_margins(x: Array, label: Array) -> tuple[Array, Array]:
    """``max(0, 1 + s * x)`` with ``s`` = -1 at the label's entry and +1 elsewhere, and ``s``;
    ``x`` is (num, dim) after flattening the axes after the first."""
    xp = get_array_module(x)
    num = x.shape[0]
    x2 = x.reshape(num, -1)
    dim = x2.shape[1]
    index, _, bad = _class_labels(xp, label, num, dim, 1, None)
    sign = xp.where(xp.arange(dim)[None, :] == index, -1, 1).astype(x.dtype)
    if bad is not None:
        sign = xp.where(bad, xp.nan, sign).astype(x.dtype)
    return xp.maximum(1 + sign * x2, 0), sign


def hinge_loss_forward(x: Array, label: Array, loss: Array, *, norm: str = "L1") -> None:
    """L1: ``sum(margins) / num``; L2: ``sum(margins^2) / num``."""
    t, _ = _hinge_margins(x, label)
    t = t.reshape(-1)
    total = t.sum() if norm == "L1" else t.dot(t)
    loss[...] = total / x.shape[0]


def hinge_loss_backward(x: Array, label: Array, dloss: Array, dx: Array, *,
                        norm: str = "L1") -> None:
    """L1: ``sign(margin) * s * dloss / num`` (0 where the margin is 0, as caffe_cpu_sign);
    L2: ``2 * margin * s * dloss / num``."""
    xp = get_array_module(x)
    t, sign = _hinge_margins(x, label)
    scale = (dloss / x.shape[0]).astype(dx.dtype)
    d2 = dx.reshape(t.shape)
    if norm == "L1":
        xp.multiply(t > 0, sign, out=d2)
    else:
        xp.multiply(t, sign, out=d2)
        d2 *= 2
    d2 *= scale


# -- MultinomialLogisticLoss -----------------------------------------------------------------
def _picked_prob(prob: Array, label: Array) -> tuple[Array, Array, Array | None]:
    """``max(prob[i, label_i], LOG_THRESHOLD)`` per sample with ``prob`` seen as (num, dim),
    the class indices (num, 1), and the GPU's out-of-range mask."""
    xp = get_array_module(prob)
    num = prob.shape[0]
    p2 = prob.reshape(num, -1)
    index, _, bad = _class_labels(xp, label, num, p2.shape[1], 1, None)
    picked = xp.take_along_axis(p2, index, axis=1)[:, 0]
    return xp.maximum(picked, LOG_THRESHOLD), index, bad


def multinomial_logistic_loss_forward(prob: Array, label: Array, loss: Array) -> None:
    """``loss = -sum_i log(max(prob[i, label_i], LOG_THRESHOLD)) / num``: the bottom is
    already a probability (no softmax here)."""
    xp = get_array_module(prob)
    picked, _, bad = _picked_prob(prob, label)
    loss[...] = _poison(xp, -xp.log(picked).sum() / prob.shape[0], bad)


def multinomial_logistic_loss_backward(prob: Array, label: Array, dloss: Array,
                                       dx: Array) -> None:
    """``dx[i, label_i] = -dloss / num / max(prob[i, label_i], LOG_THRESHOLD)``, 0 elsewhere."""
    xp = get_array_module(prob)
    picked, index, bad = _picked_prob(prob, label)
    value = (-dloss / prob.shape[0]) / picked
    if bad is not None:
        value = xp.where(bad[:, 0], xp.nan, value)
    d2 = dx.reshape(prob.shape[0], -1)
    onehot = xp.arange(d2.shape[1])[None, :] == index
    xp.multiply(onehot, value.astype(dx.dtype)[:, None], out=d2)


# -- InfogainLoss ------------------------------------------------------------------------------
def infogain_matrix(h: Array, *, value: np.ndarray) -> None:
    """Write the layer's H, read once from its source file, into its blob: the blob is
    written at every forward, so the memory planner may lend its buffer between passes."""
    assign(h, value)


def infogain_loss_forward(prob: Array, label: Array, h: Array, loss: Array, *, axis: int,
                          ignore_label: int | None = None,
                          normalization: str = "VALID") -> None:
    """``loss = -sum_k H[label, k] log(max(prob_k, LOG_THRESHOLD)) / normalizer`` summed over
    the labels that count; ``prob`` is the softmax along ``axis``, ``h`` holds C x C values."""
    xp = get_array_module(prob)
    p3 = _split(prob, axis)
    outer, classes, inner = p3.shape
    index, valid, bad = _class_labels(xp, label, outer, classes, inner, ignore_label)
    rows = h.reshape(classes, classes)[index]  # (outer, inner, classes): H's row per label
    per = -(xp.moveaxis(rows, 2, 1) * xp.log(xp.maximum(p3, LOG_THRESHOLD))).sum(axis=1)
    per = xp.where(valid, per, 0)
    loss[...] = _poison(xp, per.sum() / _normalizer(xp, normalization, valid, outer * inner,
                                                    outer, prob.dtype), bad)


def infogain_loss_backward(prob: Array, label: Array, h: Array, dloss: Array, dx: Array, *,
                           axis: int, ignore_label: int | None = None,
                           normalization: str = "VALID") -> None:
    """The gradient with respect to the softmax's input: ``dx_k = (prob_k * sum_j H[label, j]
    - H[label, k]) * dloss / normalizer``, zero where the label is ignored. (Caffe uses this
    form, which does not see the LOG_THRESHOLD clamp of the forward pass.)"""
    xp = get_array_module(prob)
    p3, d3 = _split(prob, axis), _split(dx, axis)
    outer, classes, inner = p3.shape
    index, valid, bad = _class_labels(xp, label, outer, classes, inner, ignore_label)
    h2 = h.reshape(classes, classes)
    xp.multiply(p3, h2.sum(axis=1)[index][:, None, :], out=d3)
    d3 -= xp.moveaxis(h2[index], 2, 1)
    scale = dloss / _normalizer(xp, normalization, valid, outer * inner, outer, prob.dtype)
    factor = xp.where(valid, scale, 0)
    if bad is not None:
        factor = xp.where(bad, xp.nan, factor)
    d3 *= factor.astype(dx.dtype)[:, None, :]


# -- ContrastiveLoss ---------------------------------------------------------------------------
# Caffe keeps the dissimilar-pair gradient finite at distance 0 with this term.
CONTRASTIVE_EPS = 1e-4


def _pairs(a: Array, b: Array, y: Array) -> tuple[Array, Array, Array]:
    """``a - b`` as (num, channels), the squared distances and the similar-pair mask; as
    Caffe casts y to int, any y in (-1, 1) marks a dissimilar pair."""
    xp = get_array_module(a)
    num = a.shape[0]
    d = (a - b.reshape(a.shape)).reshape(num, math.prod(a.shape[1:]))  # num may be 0
    return d, (d * d).sum(axis=1), xp.trunc(y.reshape(num)) != 0


def contrastive_loss_forward(a: Array, b: Array, y: Array, loss: Array, *, margin: float,
                             legacy_version: bool = False) -> None:
    """``loss = sum_i l_i / num / 2``: ``l = d^2`` for a similar pair, else
    ``max(margin - d, 0)^2`` (legacy: ``max(margin - d^2, 0)``), d the Euclidean distance.
    With no pairs (num = 0) the loss is 0 / 0 = NaN, as Caffe's float division gives it."""
    xp = get_array_module(a)
    _, dist_sq, similar = _pairs(a, b, y)
    if legacy_version:
        apart = xp.maximum(margin - dist_sq, 0)
    else:
        apart = xp.maximum(margin - xp.sqrt(dist_sq), 0) ** 2
    with np.errstate(invalid="ignore", divide="ignore"):  # num = 0: NaN, no warning
        loss[...] = xp.where(similar, dist_sq, apart).sum() / a.shape[0] / 2


def contrastive_loss_backward(a: Array, b: Array, y: Array, dloss: Array, dx: Array, *,
                              margin: float, legacy_version: bool = False,
                              sign: float) -> None:
    """``dx_i = c_i * (a_i - b_i)`` with ``alpha = sign * dloss / num`` (sign +1 for a, -1
    for b) and ``c = alpha`` for a similar pair; for a dissimilar one inside the margin
    ``c = -alpha`` (legacy) or ``-alpha * (margin - d) / (d + 1e-4)``, and 0 outside it."""
    xp = get_array_module(a)
    d, dist_sq, similar = _pairs(a, b, y)
    with np.errstate(invalid="ignore", divide="ignore"):  # num = 0: no pair reads alpha
        alpha = sign * dloss / a.shape[0]
    if legacy_version:
        inside = margin - dist_sq
        apart = -alpha * xp.ones_like(dist_sq)
    else:
        dist = xp.sqrt(dist_sq)
        inside = margin - dist
        apart = -alpha * inside / (dist + CONTRASTIVE_EPS)
    coef = xp.where(similar, alpha, xp.where(inside > 0, apart, 0)).astype(dx.dtype)
    xp.multiply(d, coef[:, None], out=dx.reshape(d.shape))


# -- Accuracy ------------------------------------------------------------------------------
def accuracy_forward(x: Array, label: Array, accuracy: Array, *per_class: Array, axis: int,
                     top_k: int = 1, ignore_label: int | None = None) -> None:
    """The fraction of counted labels whose class is among the ``top_k`` best scores along
    ``axis``; with a second output, that fraction per class (0 for a class with no labels).
    As Caffe, a label is right when at most ``top_k`` classes (itself included) score at least
    its score, so a tie counts against it."""
    xp = get_array_module(x)
    x3 = _split(x, axis)
    outer, classes, inner = x3.shape
    index, valid, bad = _class_labels(xp, label, outer, classes, inner, ignore_label)
    true_score = xp.take_along_axis(x3, index[:, None, :], axis=1)
    at_least = (x3 >= true_score).sum(axis=1)
    correct = valid & (at_least <= top_k)
    count = valid.sum()
    accuracy[...] = _poison(xp, xp.where(count > 0, correct.sum() / xp.maximum(count, 1), 0),
                            bad)
    if per_class:
        member = (xp.arange(classes)[None, :, None] == index[:, None, :]) & valid[:, None, :]
        nums = member.sum(axis=(0, 2))
        hits = (member & correct[:, None, :]).sum(axis=(0, 2))
        per_class[0][...] = _poison(xp, xp.where(nums > 0, hits / xp.maximum(nums, 1), 0), bad)
