"""Builders of the structural layers: Input, DummyData, Split, InnerProduct."""

from __future__ import annotations

import math

import numpy as np

from purine.caffe.facts import SplitRefused, TowerSplit
from purine.caffe.fillers import check_filler, fill
from purine.caffe.layer import LayerBuild, register
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.ops import inner_product as ip
from purine.ops import tensor


def _ip_towers(lp: pb.LayerParameter, n: int) -> TowerSplit:
    """An InnerProduct in ``n`` towers: each computes num_output/n outputs from the whole
    bottom; a transposed weight (K, num_output) splits along its second axis."""
    p = lp.inner_product_param
    if p.axis != 1:
        raise SplitRefused(f"its axis is {p.axis}; towers split axis 1")
    if p.num_output % n:
        raise SplitRefused(f"num_output {p.num_output} is not a multiple of {n}")

    def tower(t: pb.LayerParameter) -> None:
        t.inner_product_param.num_output //= n

    return TowerSplit(False, (1 if p.transpose else 0,) + ((0,) if p.bias_term else ()), tower)


def _ip_label(lp: pb.LayerParameter) -> list[str]:
    return [f"num_output {lp.inner_product_param.num_output}"]


def canonical_axis(L: LayerBuild, axis: int, num_axes: int, what: str = "axis") -> int:
    if not -num_axes <= axis < max(num_axes, 1):
        raise L.error(f"{what} {axis} is out of range for a blob of {num_axes} axes "
                      f"(bottoms: {L.shapes()})")
    return axis % num_axes if num_axes else 0


def _shapes(L: LayerBuild, shapes, n: int) -> list[tuple[int, ...]]:
    if len(shapes) not in (1, n):
        raise L.error(f"{len(shapes)} shapes for {n} tops; give one shape, or one per top")
    return [tuple(shapes[i if len(shapes) > 1 else 0].dim) for i in range(n)]


@register("Input", export="input")
def input_layer(L: LayerBuild):
    L.expect(0, (1, None))
    shapes = _shapes(L, L.param.input_param.shape, len(L.param.top))
    for i, (name, shape) in enumerate(zip(L.param.top, shapes)):
        L.top(i, L.net.input_shapes.get(name, shape))
    L.no_force_backward.update(range(len(L.param.top)))
    return None


@register("DummyData")
def dummy_data(L: LayerBuild):
    p = L.param.dummy_data_param
    n = len(L.param.top)
    L.expect(0, (1, None))
    if p.shape:
        shapes = _shapes(L, p.shape, n)
    else:  # legacy num/channels/height/width lists
        legacy = [p.num, p.channels, p.height, p.width]
        if any(len(v) not in (1, n) for v in legacy):
            raise L.error("num, channels, height and width need one value, or one per top")
        shapes = [tuple(v[i if len(v) > 1 else 0] for v in legacy) for i in range(n)]
    fillers = list(p.data_filler) or [pb.FillerParameter()]
    if len(fillers) not in (1, n):
        raise L.error(f"{len(fillers)} data_filler entries for {n} tops")
    for i, shape in enumerate(shapes):
        f = fillers[i if len(fillers) > 1 else 0]
        top = L.top(i, shape)
        if f.type == "constant":
            value = np.float32(f.value)
            L.forward(tensor.fill, [], [top], value=value)
        else:  # refilled at every forward, as Caffe does for non-constant fillers
            try:
                check_filler(f, shape, f"data_filler {i if len(fillers) > 1 else 0}")
            except PurineError as e:
                raise L.error(str(e)) from None
            stream = L.random_stream()
            L.forward(tensor.fill_random, [], [top],
                      draw=lambda s=shape, f=f, r=stream: fill(f, s, r.next(), L.name))
    return None


@register("Split", export="split")
def split(L: LayerBuild):
    L.expect(1, (1, None))
    x = L.bottom(0)
    for i in range(len(L.param.top)):
        L.alias_top(i, x)

    def backward():
        if not L.needs_diff(0):
            return
        written = [L.top_diff(i) for i in range(len(L.param.top))
                   if L.net.graph.writers(L.top_diff(i))]
        if written:
            L.backward(tensor.sum, written, [L.bottom_diff(0)], op_type="SplitBackward")
    return backward


@register("InnerProduct", split=_ip_towers, export="inner_product", colour="#CC33FF",
          label=_ip_label, num_output=lambda lp: lp.inner_product_param.num_output)
def inner_product(L: LayerBuild):
    L.expect(1, 1)
    p = L.param.inner_product_param
    x = L.bottom(0)
    axis = canonical_axis(L, p.axis, len(x.shape))
    m, k = math.prod(x.shape[:axis]), math.prod(x.shape[axis:])
    n = p.num_output
    if n <= 0:
        raise L.error("inner_product_param.num_output must be positive")
    w = L.add_param((k, n) if p.transpose else (n, k), p.weight_filler)
    b = L.add_param((n,), p.bias_filler) if p.bias_term else None
    y = L.top(0, x.shape[:axis] + (n,))
    L.forward(ip.inner_product_forward, [x, w] + ([b] if b else []), [y], m=m,
              transpose=p.transpose)

    def backward():
        dy = L.top_diff(0)
        if L.needs_param_diff(0):
            L.backward(ip.inner_product_backward_weight, [x, dy], [L.param_diff(0)], m=m,
                       transpose=p.transpose)
        if b is not None and L.needs_param_diff(1):
            L.backward(ip.inner_product_backward_bias, [dy], [L.param_diff(1)], m=m)
        if L.needs_diff(0):
            L.backward(ip.inner_product_backward_data, [dy, w], [L.bottom_diff(0)], m=m,
                       transpose=p.transpose)
    return backward
