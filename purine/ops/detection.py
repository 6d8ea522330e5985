"""SSD's kernels (weiliu89's Caffe fork): Normalize (L2 over channels or a whole sample, times a
learned scale) and Permute with their backward passes, prior boxes, box encoding and decoding
(CORNER, CENTER_SIZE, CORNER_SIZE), Jaccard overlap, greedy NMS, and DetectionOutput's rows.
Boxes are (..., 4) arrays of (xmin, ymin, xmax, ymax) in image-normalized coordinates."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from purine.backend import assign, get_array_module, stable_argsort, to_host
from purine.errors import PurineError

Array = Any

# PriorBoxParameter.CodeType's values in the fork's caffe.proto.
CORNER, CENTER_SIZE, CORNER_SIZE = 1, 2, 3


# -- Normalize --------------------------------------------------------------------------------
# The bottom is viewed as (N, C, S). ``norm`` keeps sqrt(sum x^2 + eps): one per sample
# (across_spatial, shape (N, 1)) or one per spatial position (shape (N, S)).

def _ncs(a: Array, channels: int) -> Array:
    # S from the axes past C, not from the count: with N = 0 or C = 0 the count says nothing
    return a.reshape(a.shape[0], channels, math.prod(a.shape[2:]))


def _scale_view(scale: Array) -> Array:
    """A channel-shared scale (one value) or a per-channel one, broadcast over (N, C, S)."""
    return scale.reshape(1, -1, 1)


def normalize_forward(x: Array, scale: Array, y: Array, norm: Array, *, channels: int,
                      across_spatial: bool, eps: float) -> None:
    """y = scale * x / sqrt(sum(x^2) + eps), the sum over (C, S) per sample when
    ``across_spatial``, else over C per position; ``y`` may be ``x``."""
    xp = get_array_module(x)
    if x.size == 0:  # a sum of nothing (einsum would still walk the empty axes' partners)
        norm[...] = math.sqrt(eps)
        return
    x3 = _ncs(x, channels)
    sq = xp.einsum("ncs,ncs->ns", x3, x3)
    if across_spatial:
        sq = sq.sum(axis=1, keepdims=True)
    xp.sqrt(sq + eps, out=norm)
    y3 = _ncs(y, channels)
    xp.divide(x3, norm[:, None, :], out=y3)
    y3 *= _scale_view(scale)


def normalize_backward_data(x: Array, scale: Array, norm: Array, dy: Array, dx: Array, *,
                            channels: int, across_spatial: bool) -> None:
    """With xhat = x / norm and g = scale * dy: dx = (g - xhat * sum(xhat * g)) / norm, the
    sum over the norm's group. The exact gradient: the fork leaves the scale out of the sum
    (exact only for a channel-shared scale). ``dx`` may be ``dy``."""
    if dx.size == 0:
        return
    xp = get_array_module(x)
    n = norm[:, None, :]
    xhat = _ncs(x, channels) / n
    g = _ncs(dy, channels) * _scale_view(scale)
    dot = xp.einsum("ncs,ncs->ns", xhat, g)
    if across_spatial:
        dot = dot.sum(axis=1, keepdims=True)
    xhat *= dot[:, None, :]  # in place: two bottoms' worth of temporaries, not three
    g -= xhat
    g /= n
    _ncs(dx, channels)[...] = g


def normalize_backward_scale(x: Array, norm: Array, dy: Array, dscale: Array, *,
                             channels: int) -> None:
    """dscale = sum of xhat * dy, over everything (a channel-shared scale) or per channel."""
    if x.size == 0:  # an empty batch (or map, or no channel): a sum over no sample
        dscale[...] = 0
        return
    xp = get_array_module(x)
    # A channel-shared scale sums straight to one value: no per-channel vector of C values
    # (2^31-1 channels over an empty batch would ask 8 GiB for a sum of nothing).
    spec = "ncs,ncs->" if dscale.size == 1 else "ncs,ncs->c"
    total = xp.einsum(spec, _ncs(x, channels) / norm[:, None, :], _ncs(dy, channels))
    dscale[...] = total.reshape(dscale.shape)


# -- Permute ----------------------------------------------------------------------------------

def permute_forward(x: Array, y: Array, *, order: Sequence[int]) -> None:
    """y = x with its axes in ``order`` (y's axis i is x's axis order[i])."""
    y[...] = get_array_module(x).transpose(x, order)


def permute_backward(dy: Array, dx: Array, *, order: Sequence[int]) -> None:
    """The inverse permutation of the top's gradient."""
    dx[...] = get_array_module(dy).transpose(dy, np.argsort(order))


# -- PriorBox ---------------------------------------------------------------------------------

def aspect_ratios(ratios: Sequence[float], flip: bool) -> list[float]:
    """The fork's list: 1 first, then each given ratio not within 1e-6 of one already
    listed, followed by its reciprocal when ``flip``."""
    out = [1.0]
    for r in ratios:
        if all(abs(r - a) >= 1e-6 for a in out):
            out.append(float(r))
            if flip:
                out.append(float(np.float32(1.0 / r)))  # the fork keeps them as floats
    return out


def prior_sizes(min_sizes: Sequence[float], max_sizes: Sequence[float],
                ratios: Sequence[float], flip: bool) -> list[tuple[float, float]]:
    """(width, height) in pixels of each prior at one cell, in the fork's order: per min
    size, the square of min_size, the square of sqrt(min_size * max_size) when max sizes
    are given, then min_size * (sqrt(r), 1 / sqrt(r)) for each aspect ratio r != 1. The fork
    reads each min and max size into an int, so fractional sizes are truncated."""
    sizes = []
    ars = aspect_ratios(ratios, flip)
    for k, mn in enumerate(min_sizes):
        lo = int(mn)
        sizes.append((float(lo), float(lo)))
        if max_sizes:
            s = math.sqrt(lo * int(max_sizes[k]))
            sizes.append((s, s))
        for r in ars:
            if abs(r - 1.0) >= 1e-6:
                root = np.sqrt(np.float32(r))
                sizes.append((float(lo * root), float(lo / root)))
    return sizes


def prior_boxes(layer_h: int, layer_w: int, img_h: int, img_w: int,
                sizes: Sequence[tuple[float, float]], *, step_h: float = 0.0,
                step_w: float = 0.0, offset: float = 0.5, clip: bool = False,
                variance: Sequence[float] = (0.1,)) -> np.ndarray:
    """PriorBox's top as a float64 (2, layer_h * layer_w * P * 4) array: row 0 the boxes
    (cell by cell in row-major order, the ``sizes`` at each cell, each box (xmin, ymin, xmax,
    ymax) divided by the image size, clipped to [0, 1] when ``clip``), row 1 the variance
    (one value for all four coordinates, or four). A zero step is the image size over the
    layer size. Centres are ((w + offset) * step_w, (h + offset) * step_h)."""
    if layer_h * layer_w * len(sizes) == 0:  # a map of no cell has no prior, as in the fork
        return np.zeros((2, 0))
    if step_h == 0 or step_w == 0:
        step_w, step_h = img_w / layer_w, img_h / layer_h
    # The fork computes centres in single precision.
    cx = (np.arange(layer_w, dtype=np.float32) + np.float32(offset)) * np.float32(step_w)
    cy = (np.arange(layer_h, dtype=np.float32) + np.float32(offset)) * np.float32(step_h)
    wh = np.asarray(sizes, dtype=np.float32).astype(np.float64) / 2.0  # (P, 2) half sizes
    cx = np.broadcast_to(cx.astype(np.float64)[None, :, None], (layer_h, layer_w, len(sizes)))
    cy = np.broadcast_to(cy.astype(np.float64)[:, None, None], (layer_h, layer_w, len(sizes)))
    hw, hh = wh[:, 0], wh[:, 1]
    boxes = np.stack([(cx - hw) / img_w, (cy - hh) / img_h,
                      (cx + hw) / img_w, (cy + hh) / img_h], axis=-1).reshape(-1)
    if clip:
        np.clip(boxes, 0.0, 1.0, out=boxes)
    var = np.broadcast_to(np.asarray(variance, dtype=np.float32).astype(np.float64),
                          (boxes.size // 4, 4)).reshape(-1)
    return np.stack([boxes, var])


def prior_box_forward(y: Array, *, layer_h: int, layer_w: int, img_h: int, img_w: int,
                      sizes: Sequence[tuple[float, float]], step_h: float, step_w: float,
                      offset: float, clip: bool, variance: Sequence[float]) -> None:
    """Write ``prior_boxes`` into the top (1, 2, H * W * P * 4); it reads no bottom."""
    # kept once per shape when small; a large set (checked as the layer's scratch) is made
    # at each pass, so none outlives its net
    make = _prior_boxes_once if y.size <= 1 << 20 else _prior_boxes_once.__wrapped__
    assign(y, make(layer_h, layer_w, img_h, img_w, tuple(map(tuple, sizes)), step_h, step_w,
                   offset, clip, tuple(variance)).reshape(y.shape))


@functools.lru_cache(maxsize=64)  # the boxes follow from the shapes: once per shape, not pass
def _prior_boxes_once(layer_h: int, layer_w: int, img_h: int, img_w: int,
                      sizes: tuple[tuple[float, float], ...], step_h: float, step_w: float,
                      offset: float, clip: bool, variance: tuple[float, ...]) -> np.ndarray:
    boxes = prior_boxes(layer_h, layer_w, img_h, img_w, sizes, step_h=step_h, step_w=step_w,
                        offset=offset, clip=clip, variance=variance)
    boxes.flags.writeable = False
    return boxes


# -- Boxes ------------------------------------------------------------------------------------

def box_size(boxes: Array, normalized: bool = True) -> Array:
    """Areas of (..., 4) boxes; zero for a box with xmax < xmin or ymax < ymin. Boxes in
    pixels (``normalized`` false, OpenCV's option) count both end pixels: (w + 1) * (h + 1)."""
    xp = get_array_module(boxes)
    w = boxes[..., 2] - boxes[..., 0]
    h = boxes[..., 3] - boxes[..., 1]
    one = 0 if normalized else 1
    return xp.where((w < 0) | (h < 0), 0, (w + one) * (h + one))


def jaccard(a: Array, b: Array, normalized: bool = True) -> Array:
    """The (len(a), len(b)) matrix of intersection over union of boxes ``a`` (N, 4) and
    ``b`` (M, 4); zero where the intersection has no positive width and height (the fork's
    JaccardOverlap on normalized boxes). Pixel boxes (``normalized`` false, OpenCV's
    JaccardOverlap<false>) overlap down to a zero width, sized as ``box_size`` does."""
    xp = get_array_module(a, b)
    a, b = a[:, None, :], b[None, :, :]
    iw = xp.minimum(a[..., 2], b[..., 2]) - xp.maximum(a[..., 0], b[..., 0])
    ih = xp.minimum(a[..., 3], b[..., 3]) - xp.maximum(a[..., 1], b[..., 1])
    one = 0 if normalized else 1
    hit = (iw > 0) & (ih > 0) if normalized else (iw >= 0) & (ih >= 0)
    inter = xp.where(hit, (iw + one) * (ih + one), 0)
    union = box_size(a, normalized) + box_size(b, normalized) - inter
    return xp.where(hit, inter / xp.where(hit, union, 1), 0)


def _center_size(boxes: Array) -> tuple[Array, Array, Array, Array]:
    w = boxes[..., 2] - boxes[..., 0]
    h = boxes[..., 3] - boxes[..., 1]
    return (boxes[..., 0] + boxes[..., 2]) / 2, (boxes[..., 1] + boxes[..., 3]) / 2, w, h


def _check_code_type(code_type: int) -> None:
    if code_type not in (CORNER, CENTER_SIZE, CORNER_SIZE):
        raise PurineError(f"unknown code_type {code_type}; expected CORNER (1), CENTER_SIZE "
                          "(2) or CORNER_SIZE (3)")


def decode_boxes(loc: Array, priors: Array, variances: Array | None, *, code_type: int,
                 variance_encoded_in_target: bool = False, normalized: bool = True) -> Array:
    """Boxes from location predictions ``loc`` (..., P, 4) against ``priors`` (P, 4) with
    their ``variances`` (P, 4), as the fork's DecodeBBox (without clipping):
    CORNER adds var * loc to the corners; CORNER_SIZE adds var * loc scaled by the prior's
    width / height; CENTER_SIZE moves the centre by var * loc[:2] * size and scales the size
    by exp(var * loc[2:]). ``variance_encoded_in_target``: the variances are taken as 1
    (and may be None). Pixel priors (``normalized`` false, OpenCV's option, CENTER_SIZE):
    a prior is one pixel wider and taller, its centre half a pixel further."""
    _check_code_type(code_type)
    xp = get_array_module(loc)
    d = loc if variance_encoded_in_target else loc * variances
    if code_type == CORNER:
        return priors + d
    pcx, pcy, pw, ph = _center_size(priors)
    if code_type == CORNER_SIZE:
        return priors + d * xp.stack([pw, ph, pw, ph], axis=-1)
    if not normalized:
        pw, ph = pw + 1, ph + 1
        pcx, pcy = priors[..., 0] + pw / 2, priors[..., 1] + ph / 2
    cx = d[..., 0] * pw + pcx
    cy = d[..., 1] * ph + pcy
    w = xp.exp(d[..., 2]) * pw
    h = xp.exp(d[..., 3]) * ph
    return xp.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=-1)


def encode_boxes(boxes: Array, priors: Array, variances: Array, *, code_type: int,
                 variance_encoded_in_target: bool = False) -> Array:
    """The location targets that ``decode_boxes`` turns back into ``boxes`` (..., P, 4),
    as the fork's EncodeBBox: the inverse of each code type, divided by the variances
    unless ``variance_encoded_in_target``. CENTER_SIZE needs boxes and priors of positive
    width and height (it takes logarithms of their ratios)."""
    _check_code_type(code_type)
    xp = get_array_module(boxes)
    if code_type == CORNER:
        t = boxes - priors
    elif code_type == CORNER_SIZE:
        _, _, pw, ph = _center_size(priors)
        t = (boxes - priors) / xp.stack([pw, ph, pw, ph], axis=-1)
    else:
        pcx, pcy, pw, ph = _center_size(priors)
        bcx, bcy, bw, bh = _center_size(boxes)
        t = xp.stack([(bcx - pcx) / pw, (bcy - pcy) / ph, xp.log(bw / pw),
                      xp.log(bh / ph)], axis=-1)
    return t if variance_encoded_in_target else t / variances


# -- NMS and DetectionOutput --------------------------------------------------------------------

NMS_MATRIX = 1024  # candidates up to which nms computes all their overlaps at once


def nms(boxes: Array, scores: Array, *, nms_threshold: float,
        score_threshold: float = -math.inf, eta: float = 1.0, top_k: int = -1,
        normalized: bool = True, max_keep: int | None = None) -> Array:
    """The fork's ApplyNMSFast: the indices of the boxes kept, best score first. Candidates
    are the scores above ``score_threshold``, sorted by score (ties by index), the first
    ``top_k`` of them when top_k > -1; one is kept when its overlap with every box kept
    before it is at most the threshold, which is multiplied by ``eta`` after each keep while
    it is above 0.5; at most ``max_keep`` are kept (None: no limit). The loop runs once per
    kept box: between two keeps the threshold and
    the kept set stay fixed, so the next keep is the first candidate whose largest overlap
    with the kept boxes is within the threshold."""
    xp = get_array_module(boxes, scores)
    cand = xp.nonzero(scores > score_threshold)[0]
    order = cand[stable_argsort(-scores[cand])]
    if top_k > -1:
        order = order[:top_k]
    b = boxes[order]
    m = order.shape[0]
    # The overlap table costs m^2 values; past NMS_MATRIX candidates, one row per keep.
    table = jaccard(b, b, normalized) if m <= NMS_MATRIX else None
    worst = xp.full(m, -xp.inf, dtype=boxes.dtype)  # each one's max overlap with the kept
    threshold = np.float32(nms_threshold)  # the fork keeps it in single precision
    kept: list[int] = []
    start = 0
    while start < m and (max_keep is None or len(kept) < max_keep):
        ok = worst[start:] <= threshold
        j = int(xp.argmax(ok))
        if not bool(ok[j]):
            break
        j += start
        kept.append(j)
        row = (table[j, j + 1:] if table is not None
               else jaccard(b[j:j + 1], b[j + 1:], normalized)[0])
        xp.maximum(worst[j + 1:], row, out=worst[j + 1:])
        start = j + 1
        if eta < 1 and threshold > 0.5:
            threshold = np.float32(threshold * np.float32(eta))
    return order[xp.asarray(kept, dtype=np.int64)]


def detection_output(loc: np.ndarray, conf: np.ndarray, prior: np.ndarray, *,
                     num_classes: int, share_location: bool = True,
                     background_label_id: int = 0, code_type: int = CORNER,
                     variance_encoded_in_target: bool = False, keep_top_k: int = -1,
                     confidence_threshold: float = -math.inf, nms_threshold: float = 0.3,
                     eta: float = 1.0, top_k: int = -1,
                     normalized_bbox: bool = True) -> np.ndarray:
    """DetectionOutput's rows (R, 7): image id, label, score, xmin, ymin, xmax, ymax.

    ``loc`` (N, P * L * 4) with L = 1 (share_location) or num_classes, ``conf``
    (N, P * num_classes) class probabilities, ``prior`` PriorBox's (1, 2, P * 4) (or only its
    box row, (1, 1, P * 4), with variance_encoded_in_target, as OpenCV takes it). Per image
    and non-background class: decode, NMS; then, when the image has more than
    ``keep_top_k`` > -1 detections, only its best keep_top_k by score (ties: lower label,
    then NMS order). Rows come by image, then label ascending, then score descending (the
    fork's order). With no detection at all: one row (i, -1, ..., -1) per image.
    ``normalized_bbox`` false (OpenCV's option): priors and boxes in pixels, decoded and
    overlapped as ``decode_boxes`` and ``jaccard`` say."""
    n = loc.shape[0]
    p = prior.shape[-1] // 4
    loc_classes = 1 if share_location else num_classes
    if loc.size != n * p * loc_classes * 4 or conf.size != n * p * num_classes:
        raise PurineError(f"DetectionOutput: {p} priors need location predictions of "
                          f"{p * loc_classes * 4} and confidences of {p * num_classes} per "
                          f"image, got {loc.shape} and {conf.shape}")
    priors = prior.reshape(-1, p, 4)  # the variance row may be absent where it is not read
    variances = priors[1] if priors.shape[0] > 1 else None
    boxes = decode_boxes(loc.reshape(n, p, loc_classes, 4).transpose(0, 2, 1, 3), priors[0],
                         variances, code_type=code_type,
                         variance_encoded_in_target=variance_encoded_in_target,
                         normalized=normalized_bbox)
    scores = conf.reshape(n, p, num_classes)
    found = []
    for i in range(n):
        labels, index = [], []
        for c in range(num_classes):
            if c == background_label_id:
                continue
            keep = nms(boxes[i, 0 if share_location else c], scores[i, :, c],
                       score_threshold=confidence_threshold, nms_threshold=nms_threshold,
                       eta=eta, top_k=top_k, normalized=normalized_bbox)
            labels.append(np.full(keep.size, c))
            index.append(keep)
        label = np.concatenate(labels) if labels else np.zeros(0, np.int64)
        idx = np.concatenate(index) if index else np.zeros(0, np.int64)
        score = scores[i, idx, label]
        if -1 < keep_top_k < idx.size:
            # The best keep_top_k by score; kept in label, then NMS order for the rows.
            best = np.sort(stable_argsort(-score)[:keep_top_k])
            label, idx, score = label[best], idx[best], score[best]
        b = boxes[i, 0 if share_location else label, idx] if idx.size else np.zeros((0, 4))
        found.append(np.column_stack([np.full(idx.size, i), label, score, b]))
    rows = np.concatenate(found) if found else np.zeros((0, 7))
    if rows.shape[0] == 0:
        rows = np.full((n, 7), -1.0)
        rows[:, 0] = np.arange(n)
    return rows.astype(loc.dtype)


def detection_output_forward(loc: Array, conf: Array, prior: Array, *rest: Array,
                             cache: dict, **params: Any) -> None:
    """Write ``detection_output``'s rows into the top (1, 1, R, 7), on the host (NMS is a
    sequential loop). The rows the net computed to settle the top's shape right before this
    op are taken from ``cache``; elsewhere (a replica, whose shapes stay as built) they are
    computed here, and a count other than the top holds is an error."""
    y = rest[-1]  # a fourth bottom (the image, for the fork's visualize) is not read
    rows = cache.pop("rows", None)
    if rows is None or rows.shape[0] != y.shape[2]:
        rows = detection_output(to_host(loc), to_host(conf), to_host(prior), **params)
    if rows.shape[0] != y.shape[2]:
        raise PurineError(f"DetectionOutput found {rows.shape[0]} rows, but its top was built "
                          f"for {y.shape[2]}, and where this layer runs (a data-parallel "
                          "replica) the net's shapes stay those it was built with")
    assign(y, rows.reshape(y.shape))
