"""Builders of Caffe's array layers: Concat, Slice, Eltwise, Flatten, Reshape, Crop, ArgMax,
Silence, Reduction, Tile, Embed, Parameter, Filter and BatchReindex. Shape rules, defaults and
errors follow BVLC Caffe's Reshape/LayerSetUp checks; the kernels are in purine.ops.array."""

from __future__ import annotations

import math

from purine.caffe.layer import LayerBuild, Settler, register
from purine.caffe.layers.common import canonical_axis
from purine.formats import caffe_pb2 as pb
from purine.graph import Blob
from purine.ops import array as arr
from purine.ops import tensor


def _not_in_place(L: LayerBuild, why: str) -> None:
    for t in L.param.top:
        if t in L.param.bottom:
            raise L.error(f"cannot run in place (top '{t}' is also a bottom): {why}")


def _axis(L: LayerBuild, axis: int, x: Blob, what: str = "axis") -> int:
    """Caffe's CanonicalAxisIndex on bottom ``x``, which must have an axis to index."""
    if not x.shape:
        raise L.error(f"bottom '{x.name}' has no axes; {L.type} needs at least one")
    return canonical_axis(L, axis, len(x.shape), what)


def _legacy_axis(L: LayerBuild, msg, axis_field: str, legacy_field: str, x: Blob) -> int:
    """The axis of Concat / Slice: the legacy unsigned ``*_dim`` field, or ``axis``."""
    if msg.HasField(axis_field) and msg.HasField(legacy_field):
        raise L.error(f"give either {axis_field} or {legacy_field}, not both")
    n = len(x.shape)
    if msg.HasField(legacy_field):
        axis = getattr(msg, legacy_field)
        if axis >= n:
            raise L.error(f"{legacy_field} {axis} is out of range for bottom '{x.name}' "
                          f"{x.shape} of {n} axes")
        return axis
    return _axis(L, getattr(msg, axis_field), x)


def _alias(L: LayerBuild):
    """One bottom, one top of the same shape: as Caffe shares the data, the top names the
    bottom's blob; the gradient, a blob of its own unless in place, is copied back."""
    L.alias_top(0, L.bottom(0))

    def backward():
        if L.needs_diff(0) and L.param.top[0] != L.param.bottom[0]:
            L.backward(tensor.copy, [L.top_diff(0)], [L.bottom_diff(0)],
                       op_type=f"{L.type}Backward")
    return backward


@register("Concat", export="concat")
def concat(L: LayerBuild):
    L.expect((1, None), 1)
    xs = L.bottoms
    first = xs[0]
    axis = _legacy_axis(L, L.param.concat_param, "axis", "concat_dim", first)
    if len(xs) == 1:
        return _alias(L)
    for x in xs[1:]:
        if len(x.shape) != len(first.shape):
            raise L.error(f"bottom '{first.name}' {first.shape} and bottom '{x.name}' "
                          f"{x.shape} have different numbers of axes (bottoms: {L.shapes()})")
        for j, (a, b) in enumerate(zip(first.shape, x.shape, strict=True)):
            if j != axis and a != b:
                raise L.error(f"bottom '{first.name}' {first.shape} and bottom '{x.name}' "
                              f"{x.shape} differ in axis {j}; bottoms may differ only in the "
                              f"concat axis {axis} (bottoms: {L.shapes()})")
    shape = list(first.shape)
    shape[axis] = sum(x.shape[axis] for x in xs)
    y = L.top(0, shape)
    L.forward(arr.concat_forward, xs, [y], axis=axis)

    def backward():
        dy, start = L.top_diff(0), 0
        for i, x in enumerate(xs):
            if L.needs_diff(i):
                L.backward(arr.take_slice, [dy], [L.bottom_diff(i)], op_type="ConcatBackward",
                           axis=axis, start=start)
            start += x.shape[axis]
    return backward


@register("Slice")
def slice_layer(L: LayerBuild):
    L.expect(1, (1, None))
    p = L.param.slice_param
    x = L.bottom(0)
    axis = _legacy_axis(L, p, "axis", "slice_dim", x)
    dim, n = x.shape[axis], len(L.param.top)
    points = list(p.slice_point)
    if points:
        if len(points) != n - 1:
            raise L.error(f"{len(points)} slice_point values for {n} tops; give one fewer "
                          "than the tops")
        if n > dim:
            raise L.error(f"{n} tops cannot slice axis {axis} of size {dim} of bottom "
                          f"'{x.name}' {x.shape}")
        bounds = [0] + points + [dim]
        if any(b <= a for a, b in zip(bounds[:-2], bounds[1:-1], strict=True)) or points[-1] > dim:
            raise L.error(f"slice_point {points} must increase strictly from above 0 and "
                          f"stay within axis {axis} of size {dim} of bottom '{x.name}' "
                          f"{x.shape}")
        sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    else:
        if dim % n:
            raise L.error(f"{n} tops do not evenly divide axis {axis} of size {dim} of "
                          f"bottom '{x.name}' {x.shape}; give slice_point")
        sizes = [dim // n] * n
    if n == 1:
        return _alias(L)
    ys = []
    for i, size in enumerate(sizes):
        shape = list(x.shape)
        shape[axis] = size
        ys.append(L.top(i, shape))
    L.forward(arr.slice_forward, [x], ys, axis=axis)

    def backward():
        if not L.needs_diff(0):
            return
        # Like Caffe, every top's diff is read: one that no layer writes stays zero, or
        # holds what the caller set on a net output.
        L.backward(arr.slice_backward, [L.top_diff(i) for i in range(n)], [L.bottom_diff(0)],
                   axis=axis)
    return backward


_ELTWISE = pb.EltwiseParameter


@register("Eltwise", export="eltwise")
def eltwise(L: LayerBuild):
    L.expect((2, None), 1)
    _not_in_place(L, "Caffe's Eltwise overwrites a bottom it still has to read")
    p = L.param.eltwise_param
    xs = L.bottoms
    for x in xs[1:]:
        if x.shape != xs[0].shape:
            raise L.error(f"bottom '{xs[0].name}' {xs[0].shape} and bottom '{x.name}' "
                          f"{x.shape} differ; Eltwise needs bottoms of one shape")
    if p.coeff and len(p.coeff) != len(xs):
        raise L.error(f"{len(p.coeff)} coeff values for {len(xs)} bottoms; give one per "
                      "bottom")
    if p.operation == _ELTWISE.PROD and p.coeff:
        raise L.error("coeff applies to operation SUM only, not PROD")
    y = L.top(0, xs[0].shape)
    op = p.operation
    coeffs = [float(c) for c in p.coeff] or [1.0] * len(xs)
    winner = None
    if op == _ELTWISE.SUM:
        L.forward(arr.eltwise_sum, xs, [y], coeffs=coeffs)
    elif op == _ELTWISE.PROD:
        L.forward(arr.eltwise_prod, xs, [y])
    elif op == _ELTWISE.MAX:
        winner = L.scratch("argmax", xs[0].shape, "int32")
        L.forward(arr.eltwise_max, xs, [y, winner])
    else:
        raise L.error(f"unknown operation {op}")

    def backward():
        dy = L.top_diff(0)
        for i, x in enumerate(xs):
            if not L.needs_diff(i):
                continue
            dx = L.bottom_diff(i)
            if op == _ELTWISE.SUM:
                L.backward(arr.eltwise_sum_backward, [dy], [dx], coeff=coeffs[i])
            elif op == _ELTWISE.PROD and p.stable_prod_grad:
                others = [xj for j, xj in enumerate(xs) if j != i]
                L.backward(arr.eltwise_prod_backward, others + [dy], [dx])
            elif op == _ELTWISE.PROD:
                L.backward(arr.eltwise_prod_backward_quotient, [y, x, dy], [dx])
            else:
                L.backward(arr.eltwise_max_backward, [winner, dy], [dx], index=i)
    return backward


def _reshaped(L: LayerBuild, shape: tuple[int, ...]):
    """Top 0 as bottom 0's data in ``shape``. Caffe shares the memory; here the top is a
    blob of its own, filled by a copy, and the gradient is copied back."""
    x = L.bottom(0)
    if math.prod(shape) != x.count:
        raise L.error(f"top shape {shape} has {math.prod(shape)} entries, bottom "
                      f"'{x.name}' {x.shape} has {x.count}")
    y = L.top(0, shape)
    L.forward(arr.reshape_copy, [x], [y], op_type=L.type)

    def backward():
        if L.needs_diff(0):
            L.backward(arr.reshape_copy, [L.top_diff(0)], [L.bottom_diff(0)],
                       op_type=f"{L.type}Backward")
    return backward


@register("Flatten", export="flatten")
def flatten(L: LayerBuild):
    L.expect(1, 1)
    _not_in_place(L, "Caffe's Flatten does not allow it")
    p = L.param.flatten_param
    shape = L.bottom(0).shape
    start = _axis(L, p.axis, L.bottom(0))
    end = _axis(L, p.end_axis, L.bottom(0), "end_axis")
    if end < start:
        raise L.error(f"end_axis {p.end_axis} comes before axis {p.axis} in bottom "
                      f"'{L.bottom(0).name}' {shape}")
    return _reshaped(L, shape[:start] + (math.prod(shape[start:end + 1]),) + shape[end + 1:])


@register("Reshape", export="reshape")
def reshape(L: LayerBuild):
    L.expect(1, 1)
    _not_in_place(L, "Caffe's Reshape does not allow it")
    p = L.param.reshape_param
    x = L.bottom(0)
    n = len(x.shape)
    dims = list(p.shape.dim)
    where = f"reshape_param.shape {dims} for bottom '{x.name}' {x.shape}"
    if dims.count(-1) > 1:
        raise L.error(f"{where} has more than one -1; at most one dimension is inferred")
    if any(d < -1 for d in dims):
        raise L.error(f"{where} has a negative dimension other than -1")
    start = p.axis if p.axis >= 0 else n + p.axis + 1
    if not 0 <= start <= n:
        raise L.error(f"axis {p.axis} is out of range for {where}")
    if p.num_axes < -1:
        raise L.error(f"num_axes {p.num_axes} must be >= 0, or -1 for all")
    end = n if p.num_axes == -1 else start + p.num_axes
    if end > n:
        raise L.error(f"axis {p.axis} + num_axes {p.num_axes} = {end} is out of range for "
                      f"{where}")
    new = list(dims)
    for i, d in enumerate(dims):
        if d == 0:
            if start + i >= n:
                raise L.error(f"{where}: dimension {i} is 0 (copy), but the bottom has no "
                              f"axis {start + i} to copy")
            new[i] = x.shape[start + i]
    if -1 in new:
        known = math.prod(x.shape[:start]) * math.prod(x.shape[end:]) * math.prod(
            d for d in new if d != -1)
        if known == 0 or x.count % known:
            raise L.error(f"{where}: the bottom's {x.count} entries are not divisible by "
                          f"the product of the other dimensions ({known})")
        new[new.index(-1)] = x.count // known
    return _reshaped(L, x.shape[:start] + tuple(new) + x.shape[end:])


@register("Crop")
def crop(L: LayerBuild):
    L.expect(2, 1)
    _not_in_place(L, "Caffe's Crop backward would zero the gradient it reads")
    p = L.param.crop_param
    x, ref = L.bottoms
    n = len(x.shape)
    axis = _axis(L, p.axis, x)
    if len(p.offset) > 1 and axis + len(p.offset) != n:
        raise L.error(f"{len(p.offset)} offsets for axes {axis}..{n - 1} of bottom "
                      f"'{x.name}' {x.shape}; give one offset, or one per cropped axis")
    if len(ref.shape) < n:
        raise L.error(f"bottom '{ref.name}' {ref.shape} has fewer axes than bottom "
                      f"'{x.name}' {x.shape}")
    offsets, shape = [0] * n, list(x.shape)
    for i in range(axis, n):
        offsets[i] = p.offset[0] if len(p.offset) == 1 else (
            p.offset[i - axis] if p.offset else 0)
        shape[i] = ref.shape[i]
        if x.shape[i] - offsets[i] < ref.shape[i]:
            raise L.error(f"crop of axis {i} to size {ref.shape[i]} at offset {offsets[i]} "
                          f"is out of bounds for bottom '{x.name}' {x.shape} (reference "
                          f"bottom '{ref.name}' {ref.shape})")
    y = L.top(0, shape)
    L.forward(arr.crop_forward, [x], [y], offsets=offsets)

    def backward():
        if L.needs_diff(0):
            L.backward(arr.crop_backward, [L.top_diff(0)], [L.bottom_diff(0)],
                       offsets=offsets)
        # Only the reference bottom's shape is used: its gradient is zero (Caffe leaves
        # that diff untouched).
        L.zero_diff((1,), "CropZeroDiff")
    return backward


@register("ArgMax")
def argmax(L: LayerBuild):
    L.expect(1, 1)
    p = L.param.argmax_param
    x = L.bottom(0)
    k = p.top_k
    if k < 1:
        raise L.error("top_k must be at least 1")
    if p.HasField("axis"):
        axis = _axis(L, p.axis, x)
        if k > x.shape[axis]:
            raise L.error(f"top_k {k} exceeds axis {axis} of size {x.shape[axis]} of bottom "
                          f"'{x.name}' {x.shape}")
        shape = list(x.shape)
        shape[axis] = k
    else:
        axis = None
        if not x.shape:
            raise L.error(f"bottom '{x.name}' has no axes; without argmax_param.axis "
                          "ArgMax needs a sample axis 0")
        if k > math.prod(x.shape[1:]):
            raise L.error(f"top_k {k} exceeds the {math.prod(x.shape[1:])} entries per "
                          f"sample of bottom '{x.name}' {x.shape}")
        # Caffe's top has at least 3 axes: (N, 1, top_k, 1...), or (N, 2, top_k, 1...)
        # with out_max_val: indices, then values.
        shape = [1] * max(len(x.shape), 3)
        shape[0], shape[1], shape[2] = x.shape[0], 2 if p.out_max_val else 1, k
    y = L.top(0, shape)
    L.forward(arr.argmax_forward, [x], [y], axis=axis, top_k=k, out_max_val=p.out_max_val)
    # Caffe's ArgMax has no backward pass: force_backward must not ask it for one.
    L.no_force_backward.add(0)

    def backward():
        if L.needs_diff(0):
            raise L.error(f"has no backward pass, but the gradient of bottom '{x.name}' is "
                          "needed; set propagate_down: false for it")
    return backward


@register("Silence", export="silence")
def silence(L: LayerBuild):
    L.expect((1, None), 0)

    def backward():
        L.zero_diff(range(len(L.bottoms)), "SilenceBackward")
    return backward


_REDUCTION = pb.ReductionParameter


@register("Reduction")
def reduction(L: LayerBuild):
    L.expect(1, 1)
    p = L.param.reduction_param
    x = L.bottom(0)
    axis = _axis(L, p.axis, x)
    op = _REDUCTION.ReductionOp.Name(p.operation)
    coeff = float(p.coeff)
    if op == "MEAN":
        coeff /= math.prod(x.shape[axis:])
    y = L.top(0, x.shape[:axis])
    L.forward(arr.reduction_forward, [x], [y], op=op, coeff=coeff)

    def backward():
        if L.needs_diff(0):
            ins = [L.top_diff(0)] if op in ("SUM", "MEAN") else [x, L.top_diff(0)]
            L.backward(arr.reduction_backward, ins, [L.bottom_diff(0)], op=op, coeff=coeff)
    return backward


@register("Tile")
def tile(L: LayerBuild):
    L.expect(1, 1)
    p = L.param.tile_param
    x = L.bottom(0)
    axis = _axis(L, p.axis, x)
    if not p.HasField("tiles"):
        raise L.error("tile_param.tiles must be given")
    if p.tiles <= 0:
        raise L.error(f"tile_param.tiles must be positive, got {p.tiles}")
    shape = list(x.shape)
    shape[axis] *= p.tiles
    y = L.top(0, shape)
    L.forward(arr.tile_forward, [x], [y], axis=axis, tiles=p.tiles)

    def backward():
        if L.needs_diff(0):
            L.backward(arr.tile_backward, [L.top_diff(0)], [L.bottom_diff(0)], axis=axis,
                       tiles=p.tiles)
    return backward


@register("Embed")
def embed(L: LayerBuild):
    L.expect(1, 1)
    p = L.param.embed_param
    x = L.bottom(0)
    if p.num_output <= 0:
        raise L.error("embed_param.num_output must be positive")
    if p.input_dim <= 0:
        raise L.error("embed_param.input_dim must be positive")
    k, n = p.input_dim, p.num_output
    w = L.add_param((k, n), p.weight_filler)
    b = L.add_param((n,), p.bias_filler) if p.bias_term else None
    y = L.top(0, x.shape + (n,))
    L.forward(arr.embed_forward, [x, w] + ([b] if b else []), [y], input_dim=k)
    # The bottom holds indices: Caffe cannot propagate to it, so force_backward skips it.
    L.no_force_backward.add(0)

    def backward():
        if L.needs_diff(0):
            raise L.error(f"cannot propagate a gradient to its index bottom '{x.name}'; "
                          "set propagate_down: false for it")
        dy = L.top_diff(0)
        if L.needs_param_diff(0):
            L.backward(arr.embed_backward_weight, [x, dy], [L.param_diff(0)], input_dim=k)
        if b is not None and L.needs_param_diff(1):
            L.backward(arr.embed_backward_bias, [dy], [L.param_diff(1)])
    return backward


@register("Parameter")
def parameter(L: LayerBuild):
    L.expect(0, 1)
    dims = list(L.param.parameter_param.shape.dim)
    if any(d < 0 for d in dims):
        raise L.error(f"parameter_param.shape {dims} has a negative dimension")
    # Caffe leaves the blob zero until a caffemodel or a solver fills it: no filler.
    w = L.add_param(dims, None)
    # The top is the parameter's data, as Caffe shares it; the top's gradient (summed by a
    # Split when several layers read it) is the parameter's.
    L.alias_top(0, w)

    def backward():
        if L.needs_param_diff(0):
            L.backward(tensor.copy, [L.top_diff(0)], [L.param_diff(0)],
                       op_type="ParameterBackward")
    return backward


class _FilterCount(Settler):
    """Filter's top shapes at each pass: as many items as the selector (the last bottom)
    selects, the other axes the bottoms'."""

    def before(self, bottoms: list) -> tuple[tuple[int, ...], ...]:
        *xs, sel = bottoms
        n = arr.filter_count(sel)
        return tuple((n,) + tuple(x.shape[1:]) for x in xs)


@register("Filter")
def filter_layer(L: LayerBuild):
    L.expect((2, None), (1, None))
    *xs, sel = L.bottoms
    if len(L.param.top) != len(xs):
        raise L.error(f"{len(xs)} bottom(s) to filter and a selector need {len(xs)} top(s), "
                      f"got {len(L.param.top)}")
    _not_in_place(L, "a top has fewer items than its bottom in Caffe")
    if not sel.shape or any(d != 1 for d in sel.shape[1:]):
        raise L.error(f"the selector (last bottom) '{sel.name}' {sel.shape} must be (N,) or "
                      "(N, 1, ...): one value per item")
    for x in xs:
        if not x.shape or x.shape[0] != sel.shape[0]:
            raise L.error(f"bottom '{x.name}' {x.shape} must have as many items (axis 0) as "
                          f"the selector '{sel.name}' {sel.shape} has values "
                          f"({sel.shape[0]})")
    # Caffe sizes the tops to the full batch at set-up and to the selected count at every
    # forward: the net settles that count right before the forward op (_FilterCount) and
    # builds the layer for it.
    decided = L.decided()
    rows = decided[0][0] if decided else sel.shape[0]
    ys = [L.top(i, (rows,) + x.shape[1:]) for i, x in enumerate(xs)]
    L.forward(arr.filter_forward, [*xs, sel], ys, bottoms=len(xs))
    L.settles(_FilterCount())
    L.no_force_backward.add(len(xs))

    def backward():
        if L.needs_diff(len(xs)):
            raise L.error(f"cannot propagate a gradient to its selector bottom '{sel.name}'; "
                          "set propagate_down: false for it")
        for i in range(len(xs)):
            if L.needs_diff(i):
                L.backward(arr.filter_backward, [sel, L.top_diff(i)], [L.bottom_diff(i)])
    return backward


@register("BatchReindex")
def batch_reindex(L: LayerBuild):
    L.expect(2, 1)
    _not_in_place(L, "the top is gathered from the bottom's items")
    x, permut = L.bottoms
    if not x.shape:
        raise L.error(f"bottom '{x.name}' has no axes; BatchReindex picks items along axis 0")
    if len(permut.shape) != 1:
        raise L.error(f"the index bottom '{permut.name}' {permut.shape} must have exactly one "
                      "axis: (M,) indices into the first axis of bottom "
                      f"'{x.name}' {x.shape}")
    y = L.top(0, permut.shape + x.shape[1:])
    L.forward(arr.batch_reindex_forward, [x, permut], [y])
    L.no_force_backward.add(1)

    def backward():
        if L.needs_diff(1):
            raise L.error(f"cannot propagate a gradient to its index bottom '{permut.name}'; "
                          "set propagate_down: false for it")
        if L.needs_diff(0):
            L.backward(arr.batch_reindex_backward, [permut, L.top_diff(0)],
                       [L.bottom_diff(0)])
    return backward
