"""Builders of layers from the Caffe forks that published models need: DeepLab/PSPNet's
Interp, ShuffleNet's ShuffleChannel, the MobileNet ports' depthwise convolution types, ReLU6,
Mish, SegNet's Upsample (unpooling by a max-pool mask; with one bottom, the YOLOv3 ports'
nearest-neighbour Upsample) and SENet's Axpy."""

from __future__ import annotations

import numpy as np

from purine.caffe.layer import LayerBuild, register
from purine.caffe.layers import vision
from purine.caffe.layers.common import canonical_axis
from purine.caffe.layers.neuron import _neuron, _unary
from purine.formats import caffe_pb2 as pb
from purine.graph import Blob
from purine.ops import fork_activation as fact
from purine.ops import fork_array as farr
from purine.ops import interp, tensor

MOBILENET = "the MobileNet ports"


def _four_axes(L: LayerBuild, i: int) -> Blob:
    b = L.bottom(i)
    if len(b.shape) != 4:
        raise L.error(f"bottom '{b.name}' {b.shape} must have 4 axes (num, channels, "
                      "height, width)")
    return b


# -- Interp (DeepLab v2, PSPNet) ------------------------------------------------------------
def _interp_size(L: LayerBuild, h: int, w: int) -> tuple[int, int]:
    """The fork's output size from the cropped input size (h, w), rules tried in its order:
    shrink only, zoom only, height and width, shrink then zoom, a second bottom."""
    p = L.param.interp_param
    shrink, zoom = p.HasField("shrink_factor"), p.HasField("zoom_factor")
    for name, on in (("shrink_factor", shrink), ("zoom_factor", zoom)):
        if on and getattr(p, name) < 1:
            raise L.error(f"interp_param.{name} must be at least 1, got {getattr(p, name)}")

    def shrunk(n: int) -> int:
        return (n - 1) // p.shrink_factor + 1

    def zoomed(n: int) -> int:
        return n + (n - 1) * (p.zoom_factor - 1)

    if shrink and not zoom:
        return shrunk(h), shrunk(w)
    if zoom and not shrink:
        return zoomed(h), zoomed(w)
    if p.HasField("height") and p.HasField("width"):
        return p.height, p.width
    if shrink and zoom:
        return zoomed(shrunk(h)), zoomed(shrunk(w))
    if len(L.bottoms) == 2:
        return _four_axes(L, 1).shape[2:]
    raise L.error("interp_param needs zoom_factor, shrink_factor, or height and width "
                  "(or a second bottom whose height and width the top takes)")


def _interp_scratch(planes: int, size_in: tuple[int, int], size_out: tuple[int, int],
                    item: int) -> int:
    """Bytes interp's kernels hold beside the blobs: the two (out, in) matrices with their
    float32/int64 row data, and per plane the half-done product (out_h, in_w) or
    (in_h, out_w) and the finished one before it is copied into place."""
    (hi, wi), (ho, wo) = size_in, size_out
    matrices = (ho * hi + wo * wi) * item + 40 * (ho + wo)
    return matrices + planes * (max(ho * wi, hi * wo) + max(ho * wo, hi * wi)) * item


@register("Interp", fork="DeepLab / PSPNet", export="interp")
def interp_layer(L: LayerBuild):
    L.expect((1, 2), 1)
    vision._no_in_place(L)
    x = _four_axes(L, 0)
    n, c, h, w = x.shape
    p = L.param.interp_param
    if p.pad_beg > 0 or p.pad_end > 0:
        raise L.error(f"interp_param.pad_beg {p.pad_beg} and pad_end {p.pad_end} must be "
                      "<= 0 (they crop the input; padding is not supported, as in the fork)")
    # pad_beg crops the top rows and the left columns alike, pad_end the bottom and right.
    h_eff, w_eff = h + p.pad_beg + p.pad_end, w + p.pad_beg + p.pad_end
    if h_eff < 1 or w_eff < 1:
        raise L.error(f"pad_beg {p.pad_beg} and pad_end {p.pad_end} crop bottom "
                      f"'{x.name}' {x.shape} to nothing ({h_eff} x {w_eff})")
    out = _interp_size(L, h_eff, w_eff)
    if min(out) < 1:
        raise L.error(f"output size {tuple(out)} is not positive ({L.shapes()})")
    crop = (-p.pad_beg, -p.pad_beg, h_eff, w_eff)
    y = L.top(0, (n, c) + tuple(out))
    scratch = _interp_scratch(n * c, (h_eff, w_eff), tuple(out), np.dtype(y.dtype).itemsize)
    what = f"Interp's {h_eff}x{w_eff} -> {out[0]}x{out[1]} matrices and products"
    if n * c:  # an empty batch builds no matrix
        L.net.require_scratch(L.location, scratch, what)
    L.forward(interp.interp_forward, [x], [y], crop=crop)
    L.no_force_backward.add(1)

    def backward():
        if L.needs_diff(0):  # the same matrices and products (checked beside every blob)
            L.backward(interp.interp_backward, [L.top_diff(0)], [L.bottom_diff(0)], crop=crop)
        if len(L.bottoms) == 2:
            L.zero_diff((1,), "InterpZeroDiff")
    return backward


# -- ShuffleChannel (ShuffleNet) ------------------------------------------------------------
@register("ShuffleChannel", fork="ShuffleNet", export="shuffle_channel")
def shuffle_channel_layer(L: LayerBuild):
    L.expect(1, 1)
    vision._no_in_place(L)
    x = L.bottom(0)
    group = L.param.shuffle_channel_param.group
    if len(x.shape) < 2:
        raise L.error(f"bottom '{x.name}' {x.shape} needs 2 or more axes (N, C, ...)")
    if group < 1 or x.shape[1] % group:
        raise L.error(f"shuffle_channel_param.group {group} must be positive and divide "
                      f"the {x.shape[1]} channels of bottom '{x.name}' {x.shape}")
    y = L.top(0, x.shape)
    L.forward(farr.shuffle_channel, [x], [y], op_type="ShuffleChannelForward", group=group)

    def backward():
        if L.needs_diff(0):  # the inverse permutation: C/group groups
            L.backward(farr.shuffle_channel, [L.top_diff(0)], [L.bottom_diff(0)],
                       op_type="ShuffleChannelBackward", group=x.shape[1] // group)
    return backward


# -- depthwise convolution (MobileNet ports) ------------------------------------------------
@register("ConvolutionDepthwise", "DepthwiseConvolution", fork=MOBILENET,
          **vision.CONVOLUTION_FACTS)
def depthwise_convolution(L: LayerBuild):
    """Convolution with group = the bottom's channels, given or not (the forks' prototxts
    often leave group out); num_output must be a multiple of the channels (1 filter per
    channel in the forks, more is a channel multiplier, as OpenCV reads these layers)."""
    p = L.param.convolution_param
    L.expect((1, None), (1, None))
    x = L.bottom(0)
    channels = x.shape[canonical_axis(L, p.axis, len(x.shape))]
    if p.HasField("group") and p.group != channels:
        raise L.error(f"convolution_param.group {p.group} differs from the {channels} "
                      f"channels of bottom '{x.name}' {x.shape}; a depthwise convolution "
                      "has one group per channel (leave group out or give the channels)")
    if channels < 1 or p.num_output < 1 or p.num_output % channels:
        raise L.error(f"convolution_param.num_output {p.num_output} must be a positive "
                      f"multiple of the {channels} channels of bottom '{x.name}' {x.shape}")
    # The Convolution builder reads the group from the parameter message: it builds from
    # a copy with the group forced, and the layer keeps its own message (a saved
    # .caffemodel writes it as given).
    own = L.param
    forced = pb.LayerParameter()
    forced.CopyFrom(own)
    forced.convolution_param.group = channels
    L.param = forced
    try:
        return vision.convolution(L)
    finally:
        L.param = own


# -- ReLU6, Mish ----------------------------------------------------------------------------
@register("ReLU6", fork=MOBILENET, export="relu6")
def relu6(L: LayerBuild):
    x, _ = _neuron(L)
    y = L.top(0, x.shape)
    # The top tells 0 < x < 6 as well as the bottom does: in place needs no copy.
    return _unary(L, fact.relu6_forward, fact.relu6_backward, x, [y], [y])


@register("Mish", fork="the YOLOv4 ports", export="mish")
def mish(L: LayerBuild):
    x, _ = _neuron(L)
    src = L.saved(0)  # the gradient needs the bottom, which an in-place forward overwrites
    y = L.top(0, x.shape)
    return _unary(L, fact.mish_forward, fact.mish_backward, x, [y], [src])


# -- Upsample (SegNet) ----------------------------------------------------------------------
def _upsample_size(L: LayerBuild, h: int, w: int) -> tuple[int, int]:
    """upsample_h and upsample_w, else the bottom's size times scale_h/scale_w (or scale),
    less one where pad_out_h / pad_out_w (only with a scale of 2), as the fork's set-up."""
    p = L.param.upsample_param
    if p.HasField("upsample_h") and p.HasField("upsample_w"):
        if p.upsample_h < 2 or p.upsample_w < 2:
            raise L.error(f"upsample_h {p.upsample_h} and upsample_w {p.upsample_w} must "
                          "be greater than 1")
        return p.upsample_h, p.upsample_w
    has_h, has_w = p.HasField("scale_h"), p.HasField("scale_w")
    if has_h or has_w:
        if p.HasField("scale") or not (has_h and has_w):
            raise L.error("upsample_param needs upsample_h and upsample_w, or scale, or "
                          "scale_h and scale_w together (not with scale)")
        sh, sw = p.scale_h, p.scale_w
    else:
        sh = sw = p.scale
    if sh < 2 or sw < 2:
        raise L.error(f"upsample_param scale {sh} x {sw} must be greater than 1")
    for pad, s, axis in ((p.pad_out_h, sh, "h"), (p.pad_out_w, sw, "w")):
        if pad and s != 2:
            raise L.error(f"pad_out_{axis} needs scale_{axis} 2 (got {s}); otherwise the "
                          "output size is ill-defined")
    return h * sh - int(p.pad_out_h), w * sw - int(p.pad_out_w)


def _upsample_nearest(L: LayerBuild):
    """The YOLOv3 ports' Upsample: one bottom, each value repeated scale x scale times."""
    x = _four_axes(L, 0)
    scale = L.param.upsample_param.scale
    if scale < 1:
        raise L.error(f"upsample_param.scale must be positive, got {scale}")
    n, c, h, w = x.shape
    y = L.top(0, (n, c, h * scale, w * scale))
    L.forward(interp.upsample_nearest_forward, [x], [y], op_type="UpsampleNearestForward",
              scale=scale)

    def backward():
        if L.needs_diff(0):
            # the block sums are made apart from the bottom's gradient, then copied into it
            L.net.require_scratch(L.location, x.count * np.dtype(x.dtype).itemsize,
                                  f"Upsample's block sums for bottom '{x.name}' {x.shape}")
            L.backward(interp.upsample_nearest_backward, [L.top_diff(0)], [L.bottom_diff(0)],
                       op_type="UpsampleNearestBackward", scale=scale)
    return backward


@register("Upsample", fork="SegNet / the YOLOv3 ports", export="upsample")
def upsample_layer(L: LayerBuild):
    """SegNet's unpooling with a mask bottom; with one bottom, the YOLOv3 ports' layer."""
    L.expect((1, 2), 1)
    vision._no_in_place(L)
    if len(L.bottoms) == 1:
        return _upsample_nearest(L)
    x, mask = _four_axes(L, 0), _four_axes(L, 1)
    if mask.shape != x.shape:
        raise L.error(f"the mask '{mask.name}' {mask.shape} must have the shape of bottom "
                      f"'{x.name}' {x.shape} (the two tops of one MAX Pooling)")
    n, c, h, w = x.shape
    y = L.top(0, (n, c) + _upsample_size(L, h, w))
    # the mask's int64 flat indices, their plane offsets and the values read back
    scratch = x.count * (24 + np.dtype(x.dtype).itemsize)
    what = f"Upsample's indices into the top for bottom '{x.name}' {x.shape}"
    L.net.require_scratch(L.location, scratch, what)
    L.forward(interp.upsample_forward, [x, mask], [y])
    L.no_force_backward.add(1)

    def backward():
        if L.needs_diff(0):  # the same indices (checked beside every blob)
            L.backward(interp.upsample_backward, [L.top_diff(0), mask], [L.bottom_diff(0)])
        L.zero_diff((1,), "UpsampleZeroDiff")
    return backward


# -- Axpy (SENet) ---------------------------------------------------------------------------
@register("Axpy", fork="SENet", export="axpy")
def axpy_layer(L: LayerBuild):
    L.expect(3, 1)
    a, x, y_in = L.bottoms
    top = L.param.top[0]
    if top in L.param.bottom[:2]:
        raise L.error(f"top '{top}' may replace only the third bottom (in place), not the "
                      "scale or the scaled blob")
    if len(x.shape) < 2 or x.shape != y_in.shape:
        raise L.error(f"bottoms 2 and 3 must have one shape (N, C, ...); got {L.shapes()}")
    nc = x.shape[:2]
    if tuple(a.shape[:2]) != nc or (len(a.shape) == 4 and a.shape[2:] != (1, 1)) \
            or len(a.shape) not in (2, 4):
        raise L.error(f"the scale '{a.name}' {a.shape} must be (N, C) or (N, C, 1, 1) with "
                      f"the (N, C) = {nc} of '{x.name}' {x.shape}")
    y = L.top(0, x.shape)
    L.forward(farr.axpy_forward, [a, x, y_in], [y])

    def backward():
        dy = L.top_diff(0)
        # The scale's and x's gradients read dy first: in place, y_in's gradient is dy.
        if L.needs_diff(0):
            L.backward(farr.axpy_backward_scale, [x, dy], [L.bottom_diff(0)])
        if L.needs_diff(1):
            L.backward(farr.axpy_backward_x, [a, dy], [L.bottom_diff(1)])
        if L.needs_diff(2) and L.bottom_diff(2) is not dy:
            L.backward(tensor.copy, [dy], [L.bottom_diff(2)], op_type="AxpyBackwardY")
    return backward
