"""Region kernels of the R-CNN forks: Fast R-CNN's ROIPooling (max over rounded bins, argmax
kept for the backward pass), R-FCN's PSROIPooling (position-sensitive bin averages),
py-faster-rcnn's SmoothL1Loss, the Proposal layer as OpenCV's Caffe importer runs it, and the
fork's Dropout without train-time scaling. Written once over an array module ``xp``."""

from __future__ import annotations

from typing import Any

import numpy as np

from purine.backend import get_array_module, scatter_add
from purine.errors import PurineError
from purine.ops.detection import CENTER_SIZE, decode_boxes, nms

Array = Any


def _round_away(xp: Any, v: Array) -> Array:
    """C's round(): halves go away from zero (numpy's rint sends them to the even side)."""
    t = xp.trunc(v)
    return t + xp.where(xp.abs(v - t) >= 0.5, xp.sign(v), 0).astype(v.dtype)


def _batch_index(xp: Any, rois: Array, num: int, layer: str = "") -> Array:
    """Column 0 of the (R, 5) ROIs, truncated to int as the forks' C casts do, checked to
    name an image of the batch (an error names ``layer``, where given)."""
    b = rois[:, 0].astype(xp.int64)
    bad = (b < 0) | (b >= num)
    if rois.shape[0] and bool(bad.any()):
        first = int(bad.argmax())
        where = f"layer '{layer}': " if layer else ""
        raise PurineError(f"{where}ROI {first} has batch index {float(rois[first, 0]):g}, outside "
                          f"[0, {num}) for a feature blob of {num} image(s); ROIs are rows "
                          "[batch_index, x1, y1, x2, y2]")
    return b


def _clip(xp: Any, v: Array, limit: int) -> Array:
    return xp.minimum(xp.maximum(v, 0), limit)


# -- ROIPooling (Fast R-CNN) ----------------------------------------------------------------
def _roi_bins(xp: Any, dt: Any, pooled: int, start: Array, end: Array, limit: int
              ) -> tuple[Array, Array]:
    """Fast R-CNN's bins along one axis: the ROI spans the rounded corners' cells (at least
    one), bin p covers [floor(p * size / pooled), ceil((p + 1) * size / pooled)) of it, with
    the bin size in the blob's precision as the fork computes it, clipped to the map."""
    size = xp.maximum(end - start + 1, 1)
    step = size.astype(dt) / dt.type(pooled)
    edges = xp.arange(pooled + 1, dtype=dt)[None, :] * step[:, None]
    lo = xp.floor(edges[:, :-1]).astype(xp.int64) + start[:, None]
    hi = xp.ceil(edges[:, 1:]).astype(xp.int64) + start[:, None]
    return _clip(xp, lo, limit), _clip(xp, hi, limit)


def _roi_geometry(x: Array, rois: Array, pooled_h: int, pooled_w: int, spatial_scale: float,
                  layer: str = "") -> tuple[Array, Array, Array, Array, Array]:
    """Per ROI its batch index and per bin its row and column bounds, (R, pooled) each."""
    xp = get_array_module(x)
    n, _, h, w = x.shape
    r = rois.reshape(-1, 5)
    corners = _round_away(xp, r[:, 1:] * r.dtype.type(spatial_scale)).astype(xp.int64)
    hs, he = _roi_bins(xp, r.dtype, pooled_h, corners[:, 1], corners[:, 3], h)
    ws, we = _roi_bins(xp, r.dtype, pooled_w, corners[:, 0], corners[:, 2], w)
    return _batch_index(xp, r, n, layer), hs, he, ws, we


def roi_pool_forward(x: Array, rois: Array, y: Array, argmax: Array, *, pooled_h: int,
                     pooled_w: int, spatial_scale: float, layer: str = "") -> None:
    """y[r, c, ph, pw] = the max of bin (ph, pw) of ROI r in channel c of its image, 0 for an
    empty bin; ``argmax`` holds where in the (H, W) plane it was (first in row-major order,
    -1 for an empty bin). One step per offset inside a bin, each over every (ROI, bin) that
    reaches that far, reading whole channel vectors of a channels-last copy: the work is
    the pooled area times the channels."""
    xp = get_array_module(x)
    n, c, h, w = x.shape
    if y.size == 0:  # no ROI or no channel: no bin to size (pooled sizes may be huge)
        _batch_index(xp, rois.reshape(-1, 5), n, layer)
        return
    b, hs, he, ws, we = _roi_geometry(x, rois, pooled_h, pooled_w, spatial_scale, layer)
    bins = b.shape[0] * pooled_h * pooled_w
    # Caffe starts every bin at -FLT_MAX and takes strictly larger values.
    best = xp.full((bins, c), np.finfo(np.float32).min, dtype=y.dtype)
    arg = xp.full((bins, c), -1, dtype=xp.int32)
    if bins:
        cells = x.transpose(0, 2, 3, 1).reshape(n * h * w, c)
        index = xp.arange(bins).reshape(-1, pooled_h, pooled_w)
        image = xp.broadcast_to(b[:, None, None] * (h * w), index.shape)
        for i in range(int((he - hs).max())):
            row = hs + i
            row_in = (row < he)[:, :, None]
            for j in range(int((we - ws).max())):
                col = ws + j
                inside = row_in & (col < we)[:, None, :]  # (R, PH, PW)
                pos = (row[:, :, None] * w + col[:, None, :])[inside]
                at = index[inside]
                v, cur = cells[image[inside] + pos], best[at]
                take = v > cur
                best[at] = xp.where(take, v, cur)
                arg[at] = xp.where(take, pos[:, None].astype(xp.int32), arg[at])
    shape = (b.shape[0], pooled_h, pooled_w, c)
    empty = ((he <= hs)[:, :, None] | (we <= ws)[:, None, :])[:, None]
    y[...] = xp.where(empty, 0, best.reshape(shape).transpose(0, 3, 1, 2))
    argmax[...] = arg.reshape(shape).transpose(0, 3, 1, 2)


def roi_pool_backward(rois: Array, argmax: Array, dy: Array, dx: Array, *,
                      layer: str = "") -> None:
    """dx[b, c, argmax] += dy for every ROI and bin (nothing for empty bins): each pooled
    value's gradient goes to the cell it came from, summed over overlapping ROIs."""
    xp = get_array_module(dy)
    n, c, h, w = dx.shape
    dx[...] = 0
    b = _batch_index(xp, rois.reshape(-1, 5), n, layer)
    if dy.size == 0:  # no ROI or no channel: nothing to scatter (C may be 2^31-1)
        return
    hit = argmax >= 0
    plane = (b[:, None] * c + xp.arange(c)[None, :])[:, :, None, None] * (h * w)
    scatter_add(dx.reshape(-1), (plane + argmax)[hit], dy[hit])


# -- PSROIPooling (R-FCN) -------------------------------------------------------------------
def _psroi_bins(xp: Any, dt: Any, scale: float, group: int, first: Array, last: Array,
                limit: int) -> tuple[Array, Array]:
    """R-FCN's bins along one axis: the corners are rounded before scaling, the far one
    past its cell (+1), the extent is at least 0.1, and bin p covers
    [floor(start + p * bin), ceil(start + (p + 1) * bin)), clipped to the map."""
    s = dt.type(scale)
    start = first * s
    size = xp.maximum((last + 1) * s - start, dt.type(0.1))
    edges = xp.arange(group + 1, dtype=dt)[None, :] * (size / dt.type(group))[:, None]
    edges = edges + start[:, None]
    lo = xp.floor(edges[:, :-1]).astype(xp.int64)
    hi = xp.ceil(edges[:, 1:]).astype(xp.int64)
    return _clip(xp, lo, limit), _clip(xp, hi, limit)


def _psroi_geometry(shape: tuple[int, ...], rois: Array, output_dim: int, group_size: int,
                    spatial_scale: float, layer: str = ""
                    ) -> tuple[Array, Array, Array, Array, Array]:
    """Per output value (R, D, G, G): the flat index of its (image, channel) plane in the
    bottom, and its bin's row and column bounds broadcast to that shape."""
    xp = get_array_module(rois)
    n, c, h, w = shape
    r = rois.reshape(-1, 5)
    corners = _round_away(xp, r[:, 1:])
    hs, he = _psroi_bins(xp, r.dtype, spatial_scale, group_size, corners[:, 1], corners[:, 3],
                         h)
    ws, we = _psroi_bins(xp, r.dtype, spatial_scale, group_size, corners[:, 0], corners[:, 2],
                         w)
    b = _batch_index(xp, r, n, layer)
    g = group_size
    # Output channel d at bin (ph, pw) reads bottom channel (d * G + ph) * G + pw.
    channel = xp.arange(output_dim * g * g).reshape(output_dim, g, g)
    plane = b[:, None, None, None] * c + channel[None]
    rows = (hs[:, None, :, None], he[:, None, :, None])
    cols = (ws[:, None, None, :], we[:, None, None, :])
    return plane, rows[0], rows[1], cols[0], cols[1]


def psroi_pool_forward(x: Array, rois: Array, y: Array, *, output_dim: int, group_size: int,
                       spatial_scale: float, layer: str = "") -> None:
    """y[r, d, ph, pw] = the mean of bin (ph, pw) of ROI r in bottom channel
    (d * G + ph) * G + pw, 0 for an empty bin. Bin sums come from a float64 summed-area
    table, four reads per output whatever the bin size."""
    xp = get_array_module(x)
    n, c, h, w = x.shape
    if y.size == 0 or x.size == 0:
        # No output, or a map of no cell (every bin empty: 0): the tables are not built.
        _batch_index(xp, rois.reshape(-1, 5), n, layer)
        y[...] = 0
        return
    plane, hs, he, ws, we = _psroi_geometry(x.shape, rois, output_dim, group_size,
                                            spatial_scale, layer)
    table = xp.zeros((n * c, h + 1, w + 1), dtype=xp.float64)
    table[:, 1:, 1:] = x.reshape(n * c, h, w).cumsum(axis=1, dtype=xp.float64).cumsum(axis=2)
    flat = table.reshape(-1)
    base = plane * ((h + 1) * (w + 1))

    def at(row: Array, col: Array) -> Array:
        return flat[base + row * (w + 1) + col]

    total = at(he, we) - at(hs, we) - at(he, ws) + at(hs, ws)
    area = (he - hs) * (we - ws)
    y[...] = xp.where(area > 0, total / xp.maximum(area, 1), 0)


def psroi_pool_backward(rois: Array, dy: Array, dx: Array, *, output_dim: int,
                        group_size: int, spatial_scale: float, layer: str = "") -> None:
    """Each output's gradient, divided by its bin's area, goes to every cell of the bin,
    summed over ROIs: scattered as +-g at the bin's four corners into a float64 difference
    table whose 2-d prefix sum is dx."""
    xp = get_array_module(dy)
    n, c, h, w = dx.shape
    if dy.size == 0 or dx.size == 0:
        _batch_index(xp, rois.reshape(-1, 5), n, layer)
        dx[...] = 0
        return
    plane, hs, he, ws, we = _psroi_geometry(dx.shape, rois, output_dim, group_size,
                                            spatial_scale, layer)
    area = (he - hs) * (we - ws)
    g = xp.where(area > 0, dy.astype(xp.float64) / xp.maximum(area, 1), 0)
    diff = xp.zeros((n * c, h + 1, w + 1), dtype=xp.float64)
    base = plane * ((h + 1) * (w + 1))
    shape = g.shape
    for row, col, sign in ((hs, ws, 1), (hs, we, -1), (he, ws, -1), (he, we, 1)):
        index = xp.broadcast_to(base + row * (w + 1) + col, shape)
        scatter_add(diff.reshape(-1), index.reshape(-1), (sign * g).reshape(-1))
    dx[...] = diff.cumsum(axis=1).cumsum(axis=2)[:, :h, :w].reshape(dx.shape)


# -- SmoothL1Loss (py-faster-rcnn) ----------------------------------------------------------
def _smooth_l1_terms(xp: Any, ins: tuple[Array, ...], sigma: float
                     ) -> tuple[Array, Array, float]:
    """d = w_in * (pred - target) (w_in = 1 without weights), whether |d| < 1 / sigma^2,
    and sigma^2."""
    pred, target = ins[0], ins[1].reshape(ins[0].shape)
    d = pred - target
    if len(ins) == 4:
        d = d * ins[2].reshape(d.shape)
    s2 = float(sigma) * float(sigma)
    return d, xp.abs(d) < 1.0 / s2, s2


def smooth_l1_loss_forward(*arrays: Array, sigma: float) -> None:
    """Inputs pred, target and optionally inside and outside weights, then the loss:
    sum(w_out * f(w_in * (pred - target))) / num, f(d) = 0.5 * sigma^2 * d^2 where
    |d| < 1 / sigma^2, else |d| - 0.5 / sigma^2; num is pred's first axis."""
    *ins, loss = arrays
    xp = get_array_module(ins[0])
    d, small, s2 = _smooth_l1_terms(xp, tuple(ins), sigma)
    per = xp.where(small, (0.5 * s2) * d * d, xp.abs(d) - 0.5 / s2)
    if len(ins) == 4:
        per = per * ins[3].reshape(d.shape)
    loss[...] = per.sum() / ins[0].shape[0]


def smooth_l1_loss_backward(*arrays: Array, sigma: float, sign: float) -> None:
    """Inputs as the forward's, then the loss's diff; output the gradient of pred (sign +1)
    or target (sign -1): sign * dloss / num * w_in * w_out * f'(d), f'(d) = sigma^2 * d
    where |d| < 1 / sigma^2, else sign(d)."""
    *ins, dloss, dx = arrays
    xp = get_array_module(ins[0])
    d, small, s2 = _smooth_l1_terms(xp, tuple(ins), sigma)
    g = xp.where(small, s2 * d, xp.sign(d))
    if len(ins) == 4:
        g = g * ins[2].reshape(d.shape) * ins[3].reshape(d.shape)
    dx[...] = (g * (sign * dloss / ins[0].shape[0])).reshape(dx.shape)


# -- Proposal (as OpenCV's Caffe importer runs it) ------------------------------------------
def anchor_sizes(base_size: int, ratios: list[float], scales: list[float]
                 ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The anchors' widths and heights, ratio-major: w = round(base / sqrt(ratio)),
    h = round(w * ratio) (halves up, in float32 as OpenCV), both times the scale."""
    f = np.float32
    widths, heights = [], []
    for ratio in ratios:
        w = np.floor(f(base_size) / np.sqrt(f(ratio)) + f(0.5))
        h = np.floor(w * f(ratio) + f(0.5))
        for scale in scales:
            widths.append(float(f(scale) * w))
            heights.append(float(f(scale) * h))
    return tuple(widths), tuple(heights)


def proposal_forward(scores: Array, deltas: Array, im_info: Array, *tops: Array,
                     feat_stride: int, base_size: int, widths: tuple[float, ...],
                     heights: tuple[float, ...], pre_nms_topn: int, post_nms_topn: int,
                     nms_thresh: float) -> None:
    """Region proposals for one image: anchors of every size centred on every feature cell,
    shifted by the predicted deltas, clipped to the image (im_info: height, width), the
    pre_nms_topn best by object score (scores <= 0 dropped), greedy NMS keeping at most
    post_nms_topn; rows [0, x1, y1, x2, y2] by falling score, zero rows after the last.
    The optional second top gets the scores. min_size filtering is not done, as in OpenCV."""
    xp = get_array_module(scores)
    dt = scores.dtype
    f = dt.type
    a = len(widths)
    _, _, h, w = scores.shape
    score = scores[0, a:].transpose(1, 2, 0).reshape(-1)  # (H, W, A) order, as the priors
    delta = deltas[0].reshape(a, 4, h, w).transpose(2, 3, 0, 1).reshape(-1, 4)
    # Priors as OpenCV's PriorBox makes them: centre (cell + base / 2 / stride) * stride.
    offset = f(0.5 * base_size / feat_stride)
    cx = ((xp.arange(w, dtype=dt) + offset) * f(feat_stride))[None, :, None]
    cy = ((xp.arange(h, dtype=dt) + offset) * f(feat_stride))[:, None, None]
    half_w, half_h = xp.asarray(widths, dtype=dt) * f(0.5), xp.asarray(heights, dtype=dt) * f(0.5)
    x1 = xp.broadcast_to(cx - half_w, (h, w, a)).reshape(-1)
    y1 = xp.broadcast_to(cy - half_h, (h, w, a)).reshape(-1)
    x2 = xp.broadcast_to(cx + half_w - f(1), (h, w, a)).reshape(-1)
    y2 = xp.broadcast_to(cy + half_h - f(1), (h, w, a)).reshape(-1)
    priors = xp.stack([x1, y1, x2, y2], axis=1)
    decoded = decode_boxes(delta, priors, None, code_type=CENTER_SIZE,
                           variance_encoded_in_target=True, normalized=False)
    info = [float(v) for v in im_info.reshape(-1)[:2]]
    xmax, ymax = f(int(info[1]) - 1), f(int(info[0]) - 1)
    limit = xp.asarray([xmax, ymax, xmax, ymax], dtype=dt)
    boxes = xp.maximum(xp.minimum(decoded, limit), 0).astype(dt)
    keep = nms(boxes, score, nms_threshold=nms_thresh, score_threshold=0,
               top_k=max(pre_nms_topn, 0), max_keep=max(post_nms_topn, 0), normalized=False)
    rois = tops[0]
    rois[...] = 0
    rois[:len(keep), 1:] = boxes[keep]
    if len(tops) > 1:
        tops[1][...] = 0
        tops[1][:len(keep)] = score[keep].reshape(-1, *tops[1].shape[1:])
