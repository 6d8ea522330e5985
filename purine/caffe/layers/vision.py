"""Builders of the vision layers: Convolution and Deconvolution (one weight shared by every
bottom/top pair, as in Caffe), Pooling (MAX with its argmax mask, AVE, STOCHASTIC; Caffe's
ceil-rounded output size), SPP (pooling pyramids), Im2col and LRN."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from purine.caffe.facts import CHANNELS, SplitRefused, TowerSplit
from purine.caffe.layer import LayerBuild, register
from purine.caffe.layers.common import canonical_axis
from purine.formats import caffe_pb2 as pb
from purine.graph import Blob
from purine.ops import array as arr
from purine.ops import conv, im2col, lrn, pooling, tensor


# -- facts: tower splits and Caffe's drawing (purine.caffe.facts) ----------------------------
def conv_towers(lp: pb.LayerParameter, n: int) -> TowerSplit:
    """A Convolution in ``n`` towers: each takes its share of the groups where ``group`` is a
    multiple of ``n``, else (group 1) computes num_output/n outputs from every channel."""
    p = lp.convolution_param
    if p.axis != 1:
        raise SplitRefused(f"its channel axis is {p.axis}; towers split axis 1")
    if p.num_output % n:
        raise SplitRefused(f"num_output {p.num_output} is not a multiple of {n}")
    axes = (0, 0) if p.bias_term else (0,)
    if p.group % n and p.group != 1:
        raise SplitRefused(f"group {p.group} is neither a multiple of {n} (each tower takes "
                           "its share of the groups) nor 1 (each tower sees every channel)")
    group = p.group // n if p.group % n == 0 else 1

    def tower(t: pb.LayerParameter) -> None:
        t.convolution_param.num_output //= n
        t.convolution_param.group = group

    return TowerSplit(p.group % n == 0, axes, tower)


def lrn_towers(lp: pb.LayerParameter, n: int) -> TowerSplit:  # noqa: ARG001
    """LRN within channels splits as a per-channel layer; across channels it does not."""
    if lp.lrn_param.norm_region == pb.LRNParameter.ACROSS_CHANNELS:
        raise SplitRefused("LRN across channels mixes neighbouring channels of two towers; "
                           "leave it whole (or use norm_region: WITHIN_CHANNEL)")
    return TowerSplit(True)


def _x(values: list[int]) -> str:
    return "x".join(map(str, values))


def _size(values: list[int]) -> str:
    # One number when every axis agrees (Caffe's draw_net label), "HxW" when they differ.
    return str(values[0]) if len(set(values)) <= 1 else _x(values)


def conv_label(lp: pb.LayerParameter) -> list[str]:
    """The layer view's lines under a convolution's name: window, num_output, group."""
    p = lp.convolution_param
    k = list(p.kernel_size) or [p.kernel_h, p.kernel_w]
    s = list(p.stride) or ([p.stride_h, p.stride_w] if p.HasField("stride_h") else [1])
    pad = list(p.pad) or ([p.pad_h, p.pad_w] if p.HasField("pad_h") else [0])
    return [f"kernel {_x(k)}, stride {_x(s)}, pad {_x(pad)}",
            f"num_output {p.num_output}" + (f", group {p.group}" if p.group > 1 else "")]


def conv_window(lp: pb.LayerParameter) -> tuple[str, str, str]:
    """pycaffe draw's kernel, stride and pad of a convolution, as the layer uses them."""
    p = lp.convolution_param
    kernel = list(p.kernel_size) or ([p.kernel_h, p.kernel_w] if p.HasField("kernel_h")
                                     else [1])
    stride = list(p.stride) or ([p.stride_h, p.stride_w] if p.HasField("stride_h") else [1])
    pad = list(p.pad) or ([p.pad_h, p.pad_w] if p.HasField("pad_h") else [0])
    return _size(kernel), _size(stride), _size(pad)


def pool_label(lp: pb.LayerParameter) -> list[str]:
    p = lp.pooling_param
    method = pb.PoolingParameter.PoolMethod.Name(p.pool)
    if p.global_pooling:
        return [f"{method}, global"]
    k = p.kernel_size if p.HasField("kernel_size") else f"{p.kernel_h}x{p.kernel_w}"
    s = p.stride if not p.HasField("stride_h") else f"{p.stride_h}x{p.stride_w}"
    return [f"{method} {k}, stride {s}, pad {p.pad}"]


def pool_window(lp: pb.LayerParameter) -> tuple[str, str, str]:
    p = lp.pooling_param
    kernel = "global" if p.global_pooling else _size(
        [p.kernel_h, p.kernel_w] if p.HasField("kernel_h") else [p.kernel_size])
    stride = [p.stride_h, p.stride_w] if p.HasField("stride_h") else [p.stride]
    pad = [p.pad_h, p.pad_w] if p.HasField("pad_h") else [p.pad]
    return kernel, _size(stride), _size(pad)


# What every convolution type (Caffe's two, the MobileNet ports' depthwise) declares.
CONVOLUTION_FACTS = {"export": "convolution", "colour": "#FF5050", "label": conv_label,
                     "window": conv_window,
                     "num_output": lambda lp: lp.convolution_param.num_output}


def _require_scratch(L: LayerBuild, nbytes: int, what: str) -> None:
    """Refuse, when the layer is built, an op workspace that cannot fit beside the net's
    blobs (the kernels allocate it at every run; a stride or pad of 2^31-1 asks exabytes)."""
    L.net.require_scratch(L.location, nbytes, what)


def _no_in_place(L: LayerBuild) -> None:
    for t in L.param.top:
        if t in L.param.bottom:
            raise L.error(f"cannot run in place (top '{t}' is also a bottom); give the top "
                          "its own name")


def spatial_values(L: LayerBuild, p: pb.ConvolutionParameter, name: str, spatial: int,
                    default: int) -> list[int]:
    """Caffe's kernel_size / stride / pad / dilation: the _h/_w pair (2-d only), else the
    repeated field given once or once per spatial axis, else ``default``."""
    repeated = list(getattr(p, name if name != "kernel" else "kernel_size"))
    field = "kernel_size" if name == "kernel" else name
    if name != "dilation" and (p.HasField(f"{name}_h") or p.HasField(f"{name}_w")):
        if spatial != 2:
            raise L.error(f"{name}_h and {name}_w are for 2-d convolution only; the bottom "
                          f"has {spatial} spatial axes ({L.shapes()})")
        if repeated:
            raise L.error(f"give either {field} or {name}_h/{name}_w, not both")
        return [getattr(p, f"{name}_h"), getattr(p, f"{name}_w")]
    if not repeated:
        if default < 0:
            raise L.error("kernel_size (or kernel_h and kernel_w) is required")
        return [default] * spatial
    if len(repeated) not in (1, spatial):
        raise L.error(f"{field} must be given once or once per spatial axis; it is given "
                      f"{len(repeated)} times for {spatial} spatial axes ({L.shapes()})")
    return [repeated[0 if len(repeated) == 1 else i] for i in range(spatial)]


def _conv_window(L: LayerBuild, p: pb.ConvolutionParameter, spatial: int
                 ) -> tuple[list[int], list[int], list[int], list[int]]:
    """Kernel size, stride, pad and dilation per spatial axis, as a convolution_param gives
    them; all but the pad must be positive."""
    kernel = spatial_values(L, p, "kernel", spatial, -1)
    stride = spatial_values(L, p, "stride", spatial, 1)
    pad = spatial_values(L, p, "pad", spatial, 0)
    dilation = spatial_values(L, p, "dilation", spatial, 1)
    for what, values in (("kernel size", kernel), ("stride", stride), ("dilation", dilation)):
        if min(values) < 1:
            raise L.error(f"{what} must be positive, got {values}")
    return kernel, stride, pad, dilation


def _conv_setup(L: LayerBuild, deconv: bool) -> tuple[conv.ConvGeometry, tuple[int, ...],
                                                         tuple[int, ...]]:
    """Check a (De)Convolution layer; returns the geometry of its convolution (for a
    Deconvolution: the convolution that maps its top back to its bottom), its weight
    shape and its top shape."""
    L.expect((1, None), (1, None))
    if len(L.param.top) != len(L.bottoms):
        raise L.error(f"needs one top per bottom; got {len(L.bottoms)} bottoms and "
                      f"{len(L.param.top)} tops")
    _no_in_place(L)
    x = L.bottom(0)
    for b in L.bottoms[1:]:
        if b.shape != x.shape:
            raise L.error(f"all bottoms must have one shape; '{x.name}' {x.shape} and "
                          f"'{b.name}' {b.shape} differ")
    p = L.param.convolution_param
    axis = canonical_axis(L, p.axis, len(x.shape))
    spatial = len(x.shape) - axis - 1
    if spatial not in (1, 2):
        raise L.error(f"supports 1-d and 2-d convolution only; bottom '{x.name}' {x.shape} "
                      f"with channel axis {axis} has {spatial} spatial axes")
    kernel, stride, pad, dilation = _conv_window(L, p, spatial)
    channels, n = x.shape[axis], p.num_output
    if n <= 0:
        raise L.error("convolution_param.num_output must be positive")
    if channels == 0:  # a (num_output, 0, kh, kw) weight: nothing to convolve
        raise L.error(f"bottom '{x.name}' {x.shape} has no channels along axis {axis}")
    if p.group < 1 or channels % p.group or n % p.group:
        raise L.error(f"group {p.group} must divide the bottom's {channels} channels "
                      f"('{x.name}' {x.shape}) and num_output {n}")
    size = list(x.shape[axis + 1:])
    extent = [d * (k - 1) + 1 for k, d in zip(kernel, dilation, strict=True)]
    if deconv:
        out = [s * (i - 1) + e - 2 * q
               for i, s, e, q in zip(size, stride, extent, pad, strict=True)]
        if min(out) < 1:
            raise L.error(f"output size {out} of bottom '{x.name}' {x.shape} is not positive "
                          f"(kernel {kernel}, stride {stride}, pad {pad}, dilation {dilation})")
    else:
        if any(i + 2 * q < e for i, q, e in zip(size, pad, extent, strict=True)):
            raise L.error(f"kernel extent {extent} exceeds the padded input: bottom "
                          f"'{x.name}' {x.shape} with pad {pad}")
        out = [(i + 2 * q - e) // s + 1
               for i, q, e, s in zip(size, pad, extent, stride, strict=True)]
    if spatial == 1:  # a 1-d convolution is the 2-d one with height 1
        size, out = [1] + size, [1] + out
        kernel, stride, pad, dilation = ([1] + kernel, [1] + stride, [0] + pad,
                                         [1] + dilation)
    # The convolution's input side is the bottom (Deconvolution: the top).
    conv_in, conv_out = (n, channels) if deconv else (channels, n)
    in_size = out if deconv else size
    geom = conv.ConvGeometry(
        num=math.prod(x.shape[:axis]), channels=conv_in, height=in_size[0], width=in_size[1],
        num_output=conv_out, kernel_h=kernel[0], kernel_w=kernel[1], stride_h=stride[0],
        stride_w=stride[1], pad_h=pad[0], pad_w=pad[1], dilation_h=dilation[0],
        dilation_w=dilation[1], group=p.group)
    k_shape = tuple(kernel[-spatial:])
    weight = (conv_out, conv_in // p.group) + k_shape
    top = x.shape[:axis] + (n,) + tuple(out[-spatial:])
    return geom, weight, top


@register("Convolution", split=conv_towers, **CONVOLUTION_FACTS)
@register("Deconvolution", **CONVOLUTION_FACTS)
def convolution(L: LayerBuild):
    # Deconvolution is Caffe's transposed convolution: its forward is the convolution's
    # backward-data and its backward-data the convolution's forward, with the weight
    # (channels, num_output / group, kh, kw) and the roles of x and dy swapped.
    deconv = L.type == "Deconvolution"
    forward, backward_data = ((conv.deconv_forward, conv.conv_forward) if deconv
                              else (conv.conv_forward, conv.conv_backward_data))
    kind = "Deconv" if deconv else "Conv"
    geom, weight, top_shape = _conv_setup(L, deconv=deconv)
    _require_scratch(L, conv.workspace_bytes(geom, np.dtype(L.net.dtype).itemsize),
                     f"im2col scratch for {L.bottom(0).shape} (kernel {geom.kernel_h}x"
                     f"{geom.kernel_w}, pad {geom.pad_h}x{geom.pad_w})")
    p = L.param.convolution_param
    w = L.add_param(weight, p.weight_filler)
    b = L.add_param((p.num_output,), p.bias_filler) if p.bias_term else None
    xs = L.bottoms
    ys = [L.top(i, top_shape) for i in range(len(xs))]
    for x, y in zip(xs, ys, strict=True):
        L.forward(forward, [x, w] + ([b] if b else []), [y], op_type=f"{kind}Forward",
                  geom=geom)

    def backward():
        dys = [L.top_diff(i) for i in range(len(xs))]
        if L.needs_param_diff(0):
            pairs = [a for x, dy in zip(xs, dys, strict=True)
                     for a in ((dy, x) if deconv else (x, dy))]
            L.backward(conv.conv_backward_weight, pairs, [L.param_diff(0)], geom=geom,
                       op_type=f"{kind}BackwardWeight")
        if b is not None and L.needs_param_diff(1):
            L.backward(conv.conv_backward_bias, dys, [L.param_diff(1)], num=geom.num,
                       op_type=f"{kind}BackwardBias")
        for i, dy in enumerate(dys):
            if L.needs_diff(i):
                L.backward(backward_data, [dy, w], [L.bottom_diff(i)], geom=geom,
                           op_type=f"{kind}BackwardData")
    return backward


def pool_values(L: LayerBuild, p: pb.PoolingParameter, name: str, default: int | None
                 ) -> tuple[int, int]:
    """Caffe's ``name`` OR ``name``_h and ``name``_w, not both."""
    single, has_h, has_w = (p.HasField(name if name != "kernel" else "kernel_size"),
                            p.HasField(f"{name}_h"), p.HasField(f"{name}_w"))
    field = "kernel_size" if name == "kernel" else name
    if single and (has_h or has_w):
        raise L.error(f"give either {field} or {name}_h and {name}_w, not both")
    if has_h != has_w:
        raise L.error(f"{name}_h and {name}_w must be given together")
    if has_h:
        return getattr(p, f"{name}_h"), getattr(p, f"{name}_w")
    if not single and default is None:
        raise L.error("kernel_size (or kernel_h and kernel_w) is required")
    value = getattr(p, field) if single else default
    return value, value


def _pooled(size: int, kernel: int, stride: int, pad: int, ceil: bool) -> int:
    """Caffe's output size: rounded up (CEIL, the default) or down; with padding, a last
    window that would start in the padding is dropped."""
    span = (size + 2 * pad - kernel) / stride
    pooled = (math.ceil(span) if ceil else math.floor(span)) + 1
    if pad and (pooled - 1) * stride >= size + pad:
        pooled -= 1
    return pooled


PoolBackward = Callable[[Blob, Blob], object]  # adds the backward op (dy, dx)


def _pool(L: LayerBuild, x: Blob, y: Blob, geom: pooling.PoolGeometry, method: int,
          mask: Blob | None = None, tag: str = "") -> PoolBackward:
    """Add the forward op pooling ``x`` into ``y`` (any shape of ``geom``'s output count);
    returns the function that adds its backward op from a top gradient to a bottom one.
    ``mask`` is MAX's optional mask top; ``tag`` tells apart the scratch blobs of several
    poolings in one layer."""
    P = pb.PoolingParameter
    shape = (geom.num, geom.channels, geom.pooled_h, geom.pooled_w)
    _require_scratch(L, geom.workspace_bytes(np.dtype(x.dtype).itemsize, method == P.AVE),
                     f"scratch for pooling {x.shape} (window {geom.kernel_h}x{geom.kernel_w}, "
                     f"stride {geom.stride_h}x{geom.stride_w})")
    if method == P.MAX:
        if mask is None and L.location.device == "cpu":
            # Caffe's private max_idx_, kept as kernel offsets on the host: the form oneDNN's
            # passes read and write, so neither converts it.
            offsets = L.scratch(f"mask{tag}", shape, np.dtype(pooling.offset_dtype(geom)).name)
            L.forward(pooling.max_pool_forward_offsets, [x], [y, offsets], geom=geom)
            return lambda dy, dx: L.backward(pooling.max_pool_backward_offsets, [dy, offsets],
                                             [dx], geom=geom)
        # The argmax as Caffe's plane indices: its max_idx_ on a GPU, or the optional second
        # top (as floats).
        m = mask if mask is not None else L.scratch(f"mask{tag}", shape, "int32")
        L.forward(pooling.max_pool_forward, [x], [y, m], geom=geom)
        return lambda dy, dx: L.backward(pooling.max_pool_backward, [dy, m], [dx], geom=geom)
    if method == P.AVE:
        L.forward(pooling.ave_pool_forward, [x], [y], geom=geom)
        return lambda dy, dx: L.backward(pooling.ave_pool_backward, [dy], [dx], geom=geom)
    if L.phase == pb.TRAIN:
        # Caffe's rand_idx_: where each window's sample was taken, for the backward pass.
        index = L.scratch(f"rand_idx{tag}", shape, "int32")
        L.forward(pooling.stochastic_pool_forward_train, [x], [y, index], geom=geom,
                  rng=L.random_stream())
        return lambda dy, dx: L.backward(pooling.stochastic_pool_backward, [dy, index], [dx],
                                         geom=geom)
    L.forward(pooling.stochastic_pool_forward_test, [x], [y], geom=geom)
    return lambda dy, dx: L.backward(pooling.stochastic_pool_backward_test, [x, dy], [dx],
                                     geom=geom)


def _four_axes(L: LayerBuild) -> Blob:
    x = L.bottom(0)
    if len(x.shape) != 4:
        raise L.error(f"bottom '{x.name}' {x.shape} must have 4 axes (num, channels, "
                      "height, width)")
    return x


@register("Pooling", split=CHANNELS, export="pooling", colour="#FF9900", label=pool_label,
          window=pool_window)
def pooling_layer(L: LayerBuild):
    p = L.param.pooling_param
    is_max = p.pool == pb.PoolingParameter.MAX
    L.expect(1, (1, 2 if is_max else 1))
    _no_in_place(L)
    x = _four_axes(L)
    n, c, h, w = x.shape
    if p.global_pooling:
        if p.HasField("kernel_size") or p.HasField("kernel_h") or p.HasField("kernel_w"):
            raise L.error("with global_pooling: true the kernel size cannot be given")
        kernel = (h, w)
    else:
        kernel = pool_values(L, p, "kernel", None)
    pad = pool_values(L, p, "pad", p.pad)
    stride = pool_values(L, p, "stride", p.stride)
    if p.global_pooling and (pad != (0, 0) or stride != (1, 1)):
        raise L.error(f"with global_pooling: true only pad 0 and stride 1 are allowed, got "
                      f"pad {pad} and stride {stride}")
    if min(kernel) < 1 or min(stride) < 1:
        raise L.error(f"kernel size {kernel} and stride {stride} must be positive")
    if p.pool == pb.PoolingParameter.STOCHASTIC and pad != (0, 0):
        raise L.error(f"padding is implemented for MAX and AVE pooling only; STOCHASTIC "
                      f"pooling got pad {pad}")
    if pad[0] >= kernel[0] or pad[1] >= kernel[1]:
        raise L.error(f"pad {pad} must be smaller than the kernel {kernel}")
    ceil = p.round_mode == pb.PoolingParameter.CEIL
    pooled = (_pooled(h, kernel[0], stride[0], pad[0], ceil),
              _pooled(w, kernel[1], stride[1], pad[1], ceil))
    if min(pooled) < 1:
        raise L.error(f"output size {pooled} is not positive: bottom '{x.name}' {x.shape}, "
                      f"kernel {kernel}, stride {stride}, pad {pad}")
    geom = pooling.PoolGeometry(n, c, h, w, *kernel, *stride, *pad, *pooled)
    y = L.top(0, (n, c) + pooled)
    mask = L.top(1, y.shape) if len(L.param.top) > 1 else None
    pool_backward = _pool(L, x, y, geom, p.pool, mask)

    def backward():
        if L.needs_diff(0):
            pool_backward(L.top_diff(0), L.bottom_diff(0))
    return backward


def _spp_level(L: LayerBuild, x: Blob, level: int, stochastic: bool) -> pooling.PoolGeometry:
    """Caffe's pooling of pyramid level ``level``: 2^level bins a side, the kernel the
    bin size rounded up, as stride too, and padding to cover what the bins overhang."""
    n, c, h, w = x.shape
    bins = 2 ** level
    kernel = (-(-h // bins), -(-w // bins))
    pad = ((kernel[0] * bins - h + 1) // 2, (kernel[1] * bins - w + 1) // 2)
    where = f"pyramid level {level} ({bins}x{bins} bins) of bottom '{x.name}' {x.shape}"
    if pad[0] >= kernel[0] or pad[1] >= kernel[1]:
        raise L.error(f"{where} needs kernel {kernel} and pad {pad}, but pooling needs the "
                      "pad smaller than the kernel; use a lower pyramid_height or a larger "
                      "input")
    if stochastic and pad != (0, 0):
        raise L.error(f"{where} needs pad {pad}, but STOCHASTIC pooling has no padding; "
                      f"height and width must be multiples of {bins}")
    pooled = (_pooled(h, kernel[0], kernel[0], pad[0], True),
              _pooled(w, kernel[1], kernel[1], pad[1], True))
    return pooling.PoolGeometry(n, c, h, w, *kernel, *kernel, *pad, *pooled)


@register("SPP")
def spp_layer(L: LayerBuild):
    # Caffe's SPP is split, pooling, flatten and concat layers; here the pooling ops write
    # their (num, channels * bins^2) level blobs directly, one concat op joins them, and
    # the backward pass sums the levels' bottom gradients as Caffe's split does.
    L.expect(1, 1)
    _no_in_place(L)
    x = _four_axes(L)
    p = L.param.spp_param
    if p.pyramid_height < 1:
        raise L.error(f"spp_param.pyramid_height must be at least 1, got {p.pyramid_height}")
    S, P = pb.SPPParameter, pb.PoolingParameter
    method = {S.MAX: P.MAX, S.AVE: P.AVE, S.STOCHASTIC: P.STOCHASTIC}[p.pool]
    geoms = [_spp_level(L, x, level, method == P.STOCHASTIC)
             for level in range(p.pyramid_height)]
    n, c = x.shape[:2]
    if len(geoms) == 1:  # one global pooling straight into the top, 4-d as in Caffe
        pool_backward = _pool(L, x, L.top(0, (n, c, 1, 1)), geoms[0], method)

        def backward_one():
            if L.needs_diff(0):
                pool_backward(L.top_diff(0), L.bottom_diff(0))
        return backward_one

    levels = [L.scratch(f"level{i}", (n, c * g.pooled_h * g.pooled_w))
              for i, g in enumerate(geoms)]
    pool_backwards = [_pool(L, x, lv, g, method, tag=str(i))
                      for i, (lv, g) in enumerate(zip(levels, geoms, strict=True))]
    y = L.top(0, (n, sum(lv.shape[1] for lv in levels)))
    L.forward(arr.concat_forward, levels, [y], op_type="SPPConcat", axis=1)

    def backward():
        if not L.needs_diff(0):
            return
        dy, start, dxs = L.top_diff(0), 0, []
        for i, (lv, pool_backward) in enumerate(zip(levels, pool_backwards, strict=True)):
            dlevel = L.scratch(f"level{i}@diff", lv.shape)
            L.backward(arr.take_slice, [dy], [dlevel], op_type="SPPConcatBackward", axis=1,
                       start=start)
            start += lv.shape[1]
            dxs.append(L.scratch(f"level{i}@bottom_diff", x.shape))
            pool_backward(dlevel, dxs[-1])
        L.backward(tensor.sum, dxs, [L.bottom_diff(0)], op_type="SPPSplitBackward")
    return backward


@register("Im2col")
def im2col_layer(L: LayerBuild):
    # Caffe's Im2col reads kernel, stride, pad, dilation and axis from convolution_param
    # and ignores the rest (num_output, group, bias); force_nd_im2col changes only which
    # of Caffe's loops runs, not the result, and every number of spatial axes is served.
    L.expect(1, 1)
    _no_in_place(L)
    x = L.bottom(0)
    p = L.param.convolution_param
    axis = canonical_axis(L, p.axis, len(x.shape))
    spatial = len(x.shape) - axis - 1
    if spatial < 1:
        raise L.error(f"bottom '{x.name}' {x.shape} has no spatial axis after its channel "
                      f"axis {axis}")
    kernel, stride, pad, dilation = _conv_window(L, p, spatial)
    geom = im2col.Im2colGeometry(
        num=math.prod(x.shape[:axis]), channels=x.shape[axis], size=x.shape[axis + 1:],
        kernel=tuple(kernel), stride=tuple(stride), pad=tuple(pad), dilation=tuple(dilation))
    if min(geom.out) < 1:
        extent = [d * (k - 1) + 1 for k, d in zip(kernel, dilation, strict=True)]
        raise L.error(f"kernel extent {extent} exceeds the padded input: bottom "
                      f"'{x.name}' {x.shape} with pad {pad}")
    y = L.top(0, x.shape[:axis] + (x.shape[axis] * math.prod(kernel),) + geom.out)
    _require_scratch(L, geom.workspace_bytes(np.dtype(x.dtype).itemsize),
                     f"scratch for a padded copy of {x.shape} (pad {tuple(pad)})")
    L.forward(im2col.im2col_forward, [x], [y], geom=geom)

    def backward():
        if L.needs_diff(0):
            L.backward(im2col.im2col_backward, [L.top_diff(0)], [L.bottom_diff(0)],
                       geom=geom)
    return backward


@register("LRN", split=lrn_towers, export="lrn")
def lrn_layer(L: LayerBuild):
    L.expect(1, 1)
    p = L.param.lrn_param
    x = _four_axes(L)
    if p.local_size % 2 == 0:
        raise L.error(f"local_size must be odd, got {p.local_size}")
    within = p.norm_region == pb.LRNParameter.WITHIN_CHANNEL
    # WITHIN_CHANNEL is Caffe's pool / power / product composition, whose shift is 1.
    params = dict(size=p.local_size, alpha=p.alpha, beta=p.beta, within=within)
    saved = L.saved(0)
    y = L.top(0, x.shape)
    scale = L.scratch("scale", x.shape)
    L.forward(lrn.lrn_forward, [x], [y, scale], shift=1.0 if within else p.k, **params)

    def backward():
        if L.needs_diff(0):
            L.backward(lrn.lrn_backward, [saved, y, scale, L.top_diff(0)], [L.bottom_diff(0)],
                       **params)
    return backward

