"""Builders of the normalization family: BatchNorm (statistics kept in three lr_mult-0
parameter blobs, updated by the forward op in TRAIN), MVN (mean and variance normalization per
plane or per sample), Scale and Bias (a learned or second-bottom factor / offset broadcast over
bottom[0] from ``axis`` on)."""

from __future__ import annotations

import math

from purine.caffe.layer import LayerBuild, register
from purine.caffe.layers.common import canonical_axis
from purine.formats import caffe_pb2 as pb
from purine.graph import Blob
from purine.ops import normalization as norm
from purine.ops import tensor


@register("BatchNorm", export="batch_norm", replicates=False)
def batch_norm(L: LayerBuild):
    L.expect(1, 1)
    p = L.param.batch_norm_param
    x = L.bottom(0)
    if not x.shape:
        raise L.error(f"bottom '{x.name}' is a scalar; BatchNorm needs (N, ...) or (N, C, ...)")
    channels = 1 if len(x.shape) == 1 else x.shape[1]
    # mean sum, variance sum, moving-average factor: statistics, never learned.
    stats = [L.add_param(shape, None, lr_mult=0.0)
             for shape in ((channels,), (channels,), (1,))]
    use_global = p.use_global_stats if p.HasField("use_global_stats") else L.phase == pb.TEST
    y = L.top(0, x.shape)
    inv_std = L.scratch("inv_std", (channels,))
    if use_global:
        L.forward(norm.batch_norm_forward_global, [x, *stats], [y, inv_std],
                  channels=channels, eps=p.eps)
    else:
        # The statistics are read and written by the op (in place), so the graph orders
        # their update after every other reader in the iteration.
        x_norm = L.scratch("x_norm", x.shape)
        L.forward(norm.batch_norm_forward_train, [x, *stats], [y, *stats, x_norm, inv_std],
                  channels=channels, moving_average_fraction=p.moving_average_fraction,
                  eps=p.eps)

    def backward():
        # Caffe computes no gradient for the statistics blobs.
        if not L.needs_diff(0):
            return
        if use_global:
            L.backward(norm.batch_norm_backward_global, [L.top_diff(0), inv_std],
                       [L.bottom_diff(0)], channels=channels)
        else:
            L.backward(norm.batch_norm_backward_train, [L.top_diff(0), x_norm, inv_std],
                       [L.bottom_diff(0)], channels=channels)
    return backward


@register("MVN")
def mvn(L: LayerBuild):
    L.expect(1, 1)
    p = L.param.mvn_param
    x = L.bottom(0)
    if len(x.shape) > 4:
        raise L.error(f"bottom '{x.name}' {x.shape} has {len(x.shape)} axes; MVN reads it as "
                      "(num, channels, height, width), so at most 4")
    if x.count == 0:
        raise L.error(f"bottom '{x.name}' {x.shape} is empty; MVN needs at least one entry")
    # Caffe sizes the top by the legacy 4-axis view, so an (N, D) bottom gives (N, D, 1, 1),
    # and normalizes each (n, c) plane, or each sample with across_channels.
    legacy = tuple(x.shape[i] if i < len(x.shape) else 1 for i in range(4))
    groups = legacy[0] if p.across_channels else legacy[0] * legacy[1]
    y = L.top(0, legacy)
    std = [L.scratch("std", (groups,))] if p.normalize_variance else []
    L.forward(norm.mvn_forward, [x], [y, *std], groups=groups, eps=p.eps)

    def backward():
        if not L.needs_diff(0):
            return
        # Both gradients come from the top (and the kept divisor), never the bottom, so in
        # place needs no copy.
        if p.normalize_variance:
            L.backward(norm.mvn_backward, [y, std[0], L.top_diff(0)], [L.bottom_diff(0)],
                       groups=groups)
        else:
            L.backward(norm.mvn_backward_mean, [L.top_diff(0)], [L.bottom_diff(0)],
                       groups=groups)
    return backward


def _learned_shape(L: LayerBuild, x: Blob, axis: int, num_axes: int, what: str
                   ) -> tuple[int, ...]:
    """The shape of a learned scale / bias: bottom[0]'s axes from ``axis``, ``num_axes`` of
    them (-1: all the rest)."""
    axis = canonical_axis(L, axis, len(x.shape))
    if num_axes < -1:
        raise L.error(f"{what}.num_axes must be non-negative, or -1 to extend to the end of "
                      f"bottom[0], got {num_axes}")
    if num_axes >= 0 and axis + num_axes > len(x.shape):
        raise L.error(f"{what} of {num_axes} axes from axis {axis} extends past bottom "
                      f"'{x.name}' {x.shape}")
    return x.shape[axis:] if num_axes == -1 else x.shape[axis:axis + num_axes]


def _broadcast(L: LayerBuild, x: Blob, axis: int, shape: tuple[int, ...], what: str
               ) -> dict[str, int]:
    """(outer, dim, inner) of bottom[0] for an operand of ``shape`` applied from ``axis``;
    a scalar operand takes axis 0, as in Caffe."""
    axis = 0 if not shape else canonical_axis(L, axis, len(x.shape))
    if axis + len(shape) > len(x.shape) or x.shape[axis:axis + len(shape)] != shape:
        raise L.error(f"{what} {shape} does not match bottom '{x.name}' {x.shape} "
                      f"from axis {axis}")
    return {"outer": math.prod(x.shape[:axis]), "dim": math.prod(shape),
            "inner": math.prod(x.shape[axis + len(shape):])}


@register("Scale", export="scale")
def scale(L: LayerBuild):
    L.expect((1, 2), 1)
    p = L.param.scale_param
    x = L.bottom(0)
    two = len(L.bottoms) == 2
    if two:
        s = L.bottom(1)
        dims = _broadcast(L, x, p.axis, s.shape, f"bottom '{s.name}'")
    else:
        identity = pb.FillerParameter(type="constant", value=1.0)
        filler = p.filler if p.HasField("filler") else identity
        s = L.add_param(_learned_shape(L, x, p.axis, p.num_axes, "scale_param"), filler)
        dims = _broadcast(L, x, p.axis, s.shape, "scale")
    bias = None
    if p.bias_term:
        # Caffe's internal Bias layer: same axis, as many axes as the scale has.
        b_axes = len(s.shape) if two else p.num_axes
        bias = L.add_param(_learned_shape(L, x, p.axis, b_axes, "scale_param"), p.bias_filler)
    bias_k = 0 if two else 1
    # An in-place forward overwrites the bottom that the scale's gradient needs; skip the
    # copy only where no scale gradient can be asked for.
    scale_grad_possible = two or s.meta["lr_mult"] != 0 or L.net.force_backward
    x_saved = L.saved(0) if scale_grad_possible else x
    y = L.top(0, x.shape)
    L.forward(norm.scale_forward, [x, s] + ([bias] if bias is not None else []), [y], **dims)

    def backward():
        dy = L.top_diff(0)
        if bias is not None and L.needs_param_diff(bias_k):
            L.backward(norm.bias_backward_bias, [dy], [L.param_diff(bias_k)], **dims)
        if two and L.needs_diff(1):
            L.backward(norm.scale_backward_scale, [x_saved, dy], [L.bottom_diff(1)], **dims)
        elif not two and L.needs_param_diff(0):
            L.backward(norm.scale_backward_scale, [x_saved, dy], [L.param_diff(0)], **dims)
        # Last: in place, the bottom diff overwrites the top diff read above.
        if L.needs_diff(0):
            L.backward(norm.scale_backward_data, [dy, s], [L.bottom_diff(0)], **dims)
    return backward


@register("Bias", export="bias")
def bias(L: LayerBuild):
    L.expect((1, 2), 1)
    p = L.param.bias_param
    x = L.bottom(0)
    two = len(L.bottoms) == 2
    if two:
        b = L.bottom(1)
        dims = _broadcast(L, x, p.axis, b.shape, f"bottom '{b.name}'")
    else:
        b = L.add_param(_learned_shape(L, x, p.axis, p.num_axes, "bias_param"), p.filler)
        dims = _broadcast(L, x, p.axis, b.shape, "bias")
    y = L.top(0, x.shape)
    L.forward(norm.bias_forward, [x, b], [y], **dims)

    def backward():
        dy = L.top_diff(0)
        if two and L.needs_diff(1):
            L.backward(norm.bias_backward_bias, [dy], [L.bottom_diff(1)], **dims)
        elif not two and L.needs_param_diff(0):
            L.backward(norm.bias_backward_bias, [dy], [L.param_diff(0)], **dims)
        # In place the bottom diff is the top diff already.
        if L.needs_diff(0) and L.bottom_diff(0) is not dy:
            L.backward(tensor.copy, [dy], [L.bottom_diff(0)], op_type="BiasBackwardData")
    return backward
