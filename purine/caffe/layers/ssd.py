"""Builders of SSD's inference layers from weiliu89's Caffe fork: Normalize (L2 norm times a
learned scale) and Permute, which SSD trains through, and PriorBox and DetectionOutput, which
have no backward pass. The kernels (prior boxes, box coding, NMS) are in purine.ops.detection."""

from __future__ import annotations

import math

import numpy as np

from purine.backend import to_host
from purine.caffe.layer import LayerBuild, Settler, register
from purine.formats import caffe_pb2 as pb
from purine.graph import Blob
from purine.ops import detection as det
from purine.ops import tensor

SSD = "SSD, weiliu89/caffe"  # the fork these layers come from


def _legacy(x: Blob, i: int) -> int:
    """Caffe's num / channels / height / width of a blob of up to four axes."""
    return x.shape[i] if i < len(x.shape) else 1


@register("Normalize", fork=SSD, export="normalize")
def normalize(L: LayerBuild):
    L.expect(1, 1)
    p = L.param.norm_param
    x = L.bottom(0)
    if len(x.shape) < 2:
        raise L.error(f"bottom '{x.name}' {x.shape} needs at least 2 axes (num, channels, ...)")
    channels = x.shape[1]
    filler = (p.scale_filler if p.HasField("scale_filler")
              else pb.FillerParameter(type="constant", value=1.0))
    # The fork's scale: one value (a 0-axis blob) when channel_shared, else one per channel.
    s = L.add_param(() if p.channel_shared else (channels,), filler)
    x_saved = L.saved(0)  # a copy only when in place: backward reads the bottom
    y = L.top(0, x.shape)
    spatial = math.prod(x.shape[2:])
    item = np.dtype(L.net.dtype).itemsize
    what = f"Normalize's temporaries for bottom '{x.name}' {x.shape}"
    # The forward's temporaries: the squares summed per position and that sum plus eps.
    L.net.require_scratch(L.location, 2 * x.shape[0] * spatial * item, what)
    norm = L.scratch("norm", (x.shape[0], 1 if p.across_spatial else spatial))
    dims = dict(channels=channels, across_spatial=p.across_spatial)
    L.forward(det.normalize_forward, [x, s], [y, norm], eps=p.eps, **dims)

    def backward():
        # The backward's, beside the gradients: x / norm and the scaled gradient (two
        # bottoms' worth), their products summed per position, and a per-channel scale's
        # gradient of C values.
        L.net.require_scratch(L.location, (2 * x.count + x.shape[0] * spatial
                                           + (0 if p.channel_shared else channels)) * item,
                              what + " (backward)")
        dy = L.top_diff(0)
        if L.needs_param_diff(0):
            L.backward(det.normalize_backward_scale, [x_saved, norm, dy], [L.param_diff(0)],
                       channels=channels)
        # Last: in place, the bottom diff overwrites the top diff read above.
        if L.needs_diff(0):
            L.backward(det.normalize_backward_data, [x_saved, s, norm, dy],
                       [L.bottom_diff(0)], **dims)
    return backward


@register("Permute", fork=SSD, export="permute")
def permute(L: LayerBuild):
    L.expect(1, 1)
    x = L.bottom(0)
    n = len(x.shape)
    order: list[int] = []
    for o in L.param.permute_param.order:
        if o >= n:
            raise L.error(f"permute_param.order {o} is out of range for bottom '{x.name}' "
                          f"{x.shape} of {n} axes")
        if o in order:
            raise L.error(f"permute_param.order names axis {o} twice")
        order.append(o)
    order += [i for i in range(n) if i not in order]  # the axes not named keep their order
    if order == list(range(n)):
        # As the fork, which shares the data and the diff: the top names the bottom's blob.
        L.alias_top(0, x)

        def identity_backward():
            if L.needs_diff(0) and L.param.top[0] != L.param.bottom[0]:
                L.backward(tensor.copy, [L.top_diff(0)], [L.bottom_diff(0)],
                           op_type="PermuteBackward")
        return identity_backward
    if L.param.top[0] in L.param.bottom:
        raise L.error("cannot run in place: the permuted top is read from the bottom")
    y = L.top(0, [x.shape[o] for o in order])
    L.forward(det.permute_forward, [x], [y], order=tuple(order))

    def backward():
        if L.needs_diff(0):
            L.backward(det.permute_backward, [L.top_diff(0)], [L.bottom_diff(0)],
                       order=tuple(order))
    return backward


def _positive(L: LayerBuild, name: str, value: float, bound: float = math.inf) -> float:
    if not 0 < value < bound:
        more = "finite" if bound == math.inf else f"below {bound:.0f}"
        raise L.error(f"prior_box_param.{name} must be positive and {more}, got {value}")
    return value


INT_SIZE = 2.0 ** 31  # the fork reads min_size and max_size into an int


@register("PriorBox", fork=SSD, export="prior_box")
def prior_box(L: LayerBuild):
    L.expect((1, 2), 1)
    p = L.param.prior_box_param
    feat = L.bottom(0)
    if not p.min_size:
        raise L.error("prior_box_param.min_size is required (one or more)")
    for v in p.min_size:
        _positive(L, "min_size", v, INT_SIZE)
    if p.max_size:
        if len(p.max_size) != len(p.min_size):
            raise L.error(f"{len(p.max_size)} max_size values for {len(p.min_size)} min_size "
                          "values; give one per min_size, or none")
        for v in p.max_size:
            _positive(L, "max_size", v, INT_SIZE)
        for lo, hi in zip(p.min_size, p.max_size, strict=True):
            if not hi > lo:
                raise L.error(f"max_size {hi} must be greater than its min_size {lo}")
    for v in p.aspect_ratio:  # flip divides by it; width and height take its square root
        _positive(L, "aspect_ratio", v)
    if len(p.variance) not in (0, 1, 4):
        raise L.error(f"prior_box_param.variance takes 1 or 4 values, got {len(p.variance)}")
    for v in p.variance:
        _positive(L, "variance", v)
    if p.HasField("img_h") or p.HasField("img_w"):
        if p.HasField("img_size"):
            raise L.error("give either img_size or img_h/img_w, not both")
        img_h, img_w = _positive(L, "img_h", p.img_h), _positive(L, "img_w", p.img_w)
    elif p.HasField("img_size"):
        img_h = img_w = _positive(L, "img_size", p.img_size)
    elif len(L.bottoms) == 2:
        img_h, img_w = _legacy(L.bottom(1), 2), _legacy(L.bottom(1), 3)
    else:
        raise L.error("needs the image as bottom[1], or img_size / img_h and img_w")
    if p.HasField("step_h") or p.HasField("step_w"):
        if p.HasField("step"):
            raise L.error("give either step or step_h/step_w, not both")
        step_h, step_w = _positive(L, "step_h", p.step_h), _positive(L, "step_w", p.step_w)
    elif p.HasField("step"):
        step_h = step_w = _positive(L, "step", p.step)
    else:
        step_h = step_w = 0.0  # the image size over the feature map's
    if p.offset_h or p.offset_w or p.width or p.height:
        raise L.error("offset_h / offset_w / width / height are OpenCV's PriorBox fields, not "
                      "the SSD fork's; give min_size (max_size, aspect_ratio) and offset")
    sizes = det.prior_sizes(list(p.min_size), list(p.max_size), list(p.aspect_ratio), p.flip)
    layer_h, layer_w = _legacy(feat, 2), _legacy(feat, 3)
    if layer_h * layer_w and not (img_h > 0 and img_w > 0):
        # as img_size must be positive: every prior is divided by the image's size (a map
        # of no cell has no prior, and runs)
        img = L.bottom(1)
        raise L.error(f"image bottom '{img.name}' {img.shape} has no pixels; the priors of "
                      f"the {layer_h} x {layer_w} map are divided by its height and width")
    y = L.top(0, (1, 2, layer_h * layer_w * len(sizes) * 4))
    # The boxes are made in float64 (kept once per shape), with about three such arrays of
    # temporaries beside them.
    L.net.require_scratch(L.location, 4 * 8 * y.count, f"PriorBox's boxes for a "
                          f"{layer_h} x {layer_w} map ({len(sizes)} priors per cell)")
    # The boxes follow from shapes and parameters alone: the op reads no bottom.
    L.forward(det.prior_box_forward, [], [y], layer_h=layer_h, layer_w=layer_w, img_h=img_h,
              img_w=img_w, sizes=tuple(sizes), step_h=step_h, step_w=step_w,
              offset=p.offset, clip=p.clip, variance=tuple(p.variance) or (0.1,))
    L.no_force_backward.update(range(len(L.bottoms)))
    return None  # the fork's Backward does nothing


class _Detections(Settler):
    """DetectionOutput's top shape at each pass, (1, 1, rows, 7): the rows are computed here
    from the bottoms and left in ``cache`` for the forward op that runs right after."""

    def __init__(self, cache: dict, params: dict):
        self.cache, self.params = cache, params

    def before(self, bottoms: list) -> tuple[tuple[int, ...], ...]:
        loc, conf, prior = (to_host(b) for b in bottoms[:3])
        rows = det.detection_output(loc, conf, prior, **self.params)
        self.cache["rows"] = rows
        return ((1, 1, rows.shape[0], 7),)


@register("DetectionOutput", fork=SSD)
def detection_output(L: LayerBuild):
    L.expect((3, 4), 1)
    p = L.param.detection_output_param
    if not p.HasField("num_classes"):
        raise L.error("detection_output_param.num_classes is required")
    loc, conf, prior = L.bottoms[:3]
    num_loc_classes = 1 if p.share_location else p.num_classes
    num_priors = _legacy(prior, 2) // 4
    if loc.shape[0] != conf.shape[0]:
        raise L.error(f"location bottom '{loc.name}' {loc.shape} and confidence bottom "
                      f"'{conf.name}' {conf.shape} differ in num")
    for b, per, what in ((loc, num_loc_classes * 4, "location predictions"),
                         (conf, p.num_classes, "confidences")):
        if math.prod(b.shape[1:]) != num_priors * per:
            raise L.error(f"bottom '{b.name}' {b.shape} must hold {num_priors * per} {what} "
                          f"per image: {num_priors} priors (prior bottom '{prior.name}' "
                          f"{prior.shape}) times {per}")
    rows = _legacy(prior, 1)
    if rows != 2 and not (rows == 1 and p.variance_encoded_in_target):
        raise L.error(f"prior bottom '{prior.name}' {prior.shape} must be PriorBox's (1, 2, "
                      "P * 4): boxes and variances (the boxes alone, (1, 1, P * 4), only with "
                      "variance_encoded_in_target)")
    nms = p.nms_param
    if nms.nms_threshold < 0:
        raise L.error(f"nms_param.nms_threshold must be non-negative, got {nms.nms_threshold}")
    if not 0 < nms.eta <= 1:
        raise L.error(f"nms_param.eta must be in (0, 1], got {nms.eta}")
    if p.code_type not in (det.CORNER, det.CENTER_SIZE, det.CORNER_SIZE):
        raise L.error(f"unknown code_type {p.code_type}")
    if p.clip:
        raise L.error("clip: true is OpenCV's DetectionOutput option, not the SSD fork's; "
                      "leave it out")
    # normalized_bbox: false (OpenCV's, for Faster R-CNN's pixel rois) decodes as OpenCV does
    if not p.normalized_bbox and p.code_type == det.CORNER_SIZE:
        raise L.error("normalized_bbox: false takes code_type CORNER or CENTER_SIZE (OpenCV "
                      "decodes no other)")
    params = dict(num_classes=p.num_classes, share_location=p.share_location,
                  background_label_id=p.background_label_id, code_type=p.code_type,
                  variance_encoded_in_target=p.variance_encoded_in_target,
                  keep_top_k=p.keep_top_k,
                  confidence_threshold=(p.confidence_threshold
                                        if p.HasField("confidence_threshold") else -math.inf),
                  nms_threshold=nms.nms_threshold, eta=nms.eta,
                  top_k=nms.top_k if nms.HasField("top_k") else -1,
                  normalized_bbox=p.normalized_bbox)
    # The row count is known only once the detections are: the net settles it before the
    # op runs (_Detections); one cache passes the rows on across the net's builds.
    cache = L.kept("detections")
    if cache is None:
        cache = {}
        L.share("detections", cache)
    decided = L.decided()
    y = L.top(0, (1, 1, decided[0][2] if decided else 1, 7))
    L.forward(det.detection_output_forward, L.bottoms, [y], cache=cache, **params)
    L.settles(_Detections(cache, params))
    L.no_force_backward.update(range(len(L.bottoms)))
    return None  # the fork implements no backward
