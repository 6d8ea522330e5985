"""Builders of the R-CNN forks' layers: ROIPooling and SmoothL1Loss (Fast / Faster R-CNN,
rbgirshick/caffe-fast-rcnn), PSROIPooling (R-FCN), and Proposal as OpenCV's Caffe importer
runs it (py-faster-rcnn's Python layer made native; inference only)."""

from __future__ import annotations

import numpy as np

from purine.caffe.facts import DEPLOY
from purine.caffe.layer import LayerBuild, register
from purine.caffe.layers.loss import _loss_layer
from purine.graph import Blob
from purine.ops import roi

# py-faster-rcnn's anchors when the prototxt lists none (OpenCV requires them).
FAST_RCNN = "Fast R-CNN, rbgirshick/caffe-fast-rcnn"  # the fork of ROIPooling, SmoothL1Loss
DEFAULT_RATIOS = (0.5, 1.0, 2.0)
DEFAULT_SCALES = (8.0, 16.0, 32.0)


def _features(L: LayerBuild) -> Blob:
    x = L.bottom(0)
    if len(x.shape) != 4:
        raise L.error(f"bottom '{x.name}' {x.shape} must have 4 axes (num, channels, height, "
                      "width)")
    return x


def _rois(L: LayerBuild) -> Blob:
    r = L.bottom(1)
    if len(r.shape) < 2 or r.count != r.shape[0] * 5:
        raise L.error(f"bottom '{r.name}' {r.shape} must hold one row of 5 values per ROI "
                      "([batch_index, x1, y1, x2, y2], shape (R, 5) or (R, 5, 1, 1))")
    return r


@register("ROIPooling", fork=FAST_RCNN, export="roi_pooling")
def roi_pooling(L: LayerBuild):
    L.expect(2, 1)
    x, rois = _features(L), _rois(L)
    p = L.param.roi_pooling_param
    if p.pooled_h < 1 or p.pooled_w < 1:
        raise L.error(f"roi_pooling_param.pooled_h and pooled_w must be positive, got "
                      f"{p.pooled_h} and {p.pooled_w}")
    k = dict(pooled_h=p.pooled_h, pooled_w=p.pooled_w, spatial_scale=p.spatial_scale,
             layer=L.param.name)  # an ROI's bad batch index names the layer
    y = L.top(0, (rois.shape[0], x.shape[1], p.pooled_h, p.pooled_w))
    r, c, item = rois.shape[0], x.shape[1], np.dtype(y.dtype).itemsize
    what = f"ROIPooling's bins ({r} ROIs of {p.pooled_h}x{p.pooled_w}, {c} channels)"
    if y.count:  # an empty top sizes no bin
        # per ROI its bins' bounds (int64, with float edges); per bin its running maximum,
        # argmax and the values compared, channel vectors of the bottom's dtype
        bins = r * p.pooled_h * p.pooled_w
        L.net.require_scratch(L.location, 48 * r * (p.pooled_h + p.pooled_w + 2)
                              + bins * (32 + c * (7 * item + 8)), what)
    argmax = L.scratch("argmax", y.shape, "int32")  # Caffe's max_idx_
    L.forward(roi.roi_pool_forward, [x, rois], [y, argmax], **k)
    L.no_force_backward.add(1)

    def backward():
        if L.needs_diff(0):
            # beside the gradients: per ROI and channel its plane's offset, per top value
            # whether it has a source, its int64 index and its gradient
            if y.count:
                L.net.require_scratch(L.location, 8 * r * c + y.count * (17 + item),
                                      what + " (backward)")
            L.backward(roi.roi_pool_backward, [rois, argmax, L.top_diff(0)],
                       [L.bottom_diff(0)], layer=L.param.name)
        L.zero_diff((1,), f"{L.type}NoGradient")
    return backward


@register("PSROIPooling", fork="R-FCN, daijifeng001/caffe-rfcn")
def psroi_pooling(L: LayerBuild):
    L.expect(2, 1)
    x, rois = _features(L), _rois(L)
    p = L.param.psroi_pooling_param
    for field in ("spatial_scale", "output_dim", "group_size"):
        if not p.HasField(field):
            raise L.error(f"psroi_pooling_param.{field} is required")
    dim, group = p.output_dim, p.group_size
    if dim < 1 or group < 1:
        raise L.error(f"psroi_pooling_param.output_dim and group_size must be positive, got "
                      f"{dim} and {group}")
    if x.shape[1] != dim * group * group:
        raise L.error(f"bottom '{x.name}' {x.shape} needs output_dim * group_size^2 = "
                      f"{dim} * {group}^2 = {dim * group * group} channels")
    k = dict(output_dim=dim, group_size=group, spatial_scale=p.spatial_scale,
             layer=L.param.name)
    y = L.top(0, (rois.shape[0], dim, group, group))
    n, c, h, w = x.shape
    # the float64 summed-area (difference) table and its two prefix sums, and per output
    # value its int64 plane, corner indices and float64 sums
    scratch = 24 * n * c * (h + 1) * (w + 1) + 64 * y.count
    what = (f"PSROIPooling's summed-area table of bottom '{x.name}' {x.shape} and its "
            f"{y.count} bins")
    if y.count and x.count:  # else no table is built
        L.net.require_scratch(L.location, scratch, what)
    L.forward(roi.psroi_pool_forward, [x, rois], [y], **k)
    L.no_force_backward.add(1)

    def backward():
        if L.needs_diff(0):  # the difference table: the same bytes (checked beside every blob)
            L.backward(roi.psroi_pool_backward, [rois, L.top_diff(0)], [L.bottom_diff(0)],
                       **k)
        L.zero_diff((1,), f"{L.type}NoGradient")
    return backward


@register("SmoothL1Loss", fork=FAST_RCNN,
          train_only="a training layer (the box regression loss)" + DEPLOY)
def smooth_l1_loss(L: LayerBuild):
    _loss_layer(L, bottoms=(2, 4))
    if len(L.bottoms) == 3:
        raise L.error("with weights, give both inside and outside weights (4 bottoms: "
                      "prediction, target, inside_weights, outside_weights); got 3 bottoms")
    # The fork lets prediction and target both take a forced gradient, not the weights.
    L.no_force_backward.discard(1)
    L.no_force_backward.update((2, 3))
    a = L.bottom(0)
    for b in L.bottoms[1:]:
        if b.shape != a.shape:
            raise L.error(f"bottom '{b.name}' {b.shape} must have the prediction's shape "
                          f"('{a.name}' {a.shape})")
    sigma = L.param.smooth_l1_loss_param.sigma
    if sigma <= 0:
        raise L.error(f"smooth_l1_loss_param.sigma must be positive, got {sigma}")
    loss = L.top(0, ())
    L.forward(roi.smooth_l1_loss_forward, L.bottoms, [loss], sigma=sigma)

    def backward():
        for i, sign in ((0, 1.0), (1, -1.0)):
            if L.needs_diff(i):
                L.backward(roi.smooth_l1_loss_backward, [*L.bottoms, L.top_diff(0)],
                           [L.bottom_diff(i)], sigma=sigma, sign=sign)
        L.zero_diff(range(2, len(L.bottoms)), f"{L.type}NoGradient")
    return backward


@register("Proposal", fork="Faster R-CNN's Python layer as OpenCV's Caffe importer runs it")
def proposal(L: LayerBuild):
    L.expect(3, (1, 2))
    scores, deltas, info = L.bottoms
    p = L.param.proposal_param
    ratios = list(p.ratio) or list(DEFAULT_RATIOS)
    scales = list(p.scale) or list(DEFAULT_SCALES)
    a = len(ratios) * len(scales)
    if len(scores.shape) != 4 or scores.shape[0] != 1 or scores.shape[1] != 2 * a:
        raise L.error(f"bottom '{scores.name}' {scores.shape} must be (1, 2 * {a}, H, W): "
                      f"background then object scores of {a} anchors (ratios {ratios}, "
                      f"scales {scales}) for one image")
    want = (1, 4 * a) + scores.shape[2:]
    if deltas.shape != want:
        raise L.error(f"bottom '{deltas.name}' {deltas.shape} must be {want}: 4 box deltas "
                      f"per anchor at each cell of '{scores.name}'")
    if info.count < 2:
        raise L.error(f"bottom '{info.name}' {info.shape} must hold the image's height and "
                      "width (im_info)")
    if p.feat_stride < 1 or p.base_size < 1 or p.post_nms_topn < 1 or not p.nms_thresh > 0:
        raise L.error(f"proposal_param needs positive feat_stride, base_size, post_nms_topn "
                      f"and nms_thresh; got {p.feat_stride}, {p.base_size}, "
                      f"{p.post_nms_topn} and {p.nms_thresh}")
    widths, heights = roi.anchor_sizes(p.base_size, ratios, scales)
    tops = [L.top(0, (p.post_nms_topn, 5))]
    if len(L.param.top) > 1:
        tops.append(L.top(1, (p.post_nms_topn, 1)))
    L.forward(roi.proposal_forward, [scores, deltas, info], tops, feat_stride=p.feat_stride,
              base_size=p.base_size, widths=widths, heights=heights,
              pre_nms_topn=p.pre_nms_topn, post_nms_topn=p.post_nms_topn,
              nms_thresh=p.nms_thresh)
    L.no_force_backward.update((0, 1, 2))

    def backward():
        # as py-faster-rcnn's layer: no gradient passes
        L.zero_diff((0, 1, 2), f"{L.type}NoGradient")
    return backward
