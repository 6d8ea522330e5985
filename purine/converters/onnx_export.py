"""``caffe_to_onnx``: a deploy net and its weights as an ONNX model, for the layers ONNX can
express exactly at inference. Shapes are the net's own except the batch axis, symbolic by
default (``--batch N`` fixes it); every node reproduces Caffe's arithmetic, and a layer whose
Caffe result ONNX cannot reproduce is refused."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from purine.caffe.facts import facts, types_with
from purine.caffe.layers.vision import pool_values, spatial_values
from purine.converters import ConvertError, flag, run_main
from purine.converters.deploy import (
    axis_index,
    computed_top,
    copy_every_layer,
    unsupported,
)
from purine.converters.progress import Progress
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import atomic_write

if TYPE_CHECKING:
    from purine.caffe.layer import LayerBuild
    from purine.caffe.net import Net

# onnxruntime 1.14 and later run every operator here at opset 17, which carries the
# single-axis Softmax of opset 13 (Caffe's) and Pad with pads as an input.
OPSET = 17
IR_VERSION = 8  # the IR version that came with opset 17
ONNX_EXTRA = "pip install onnx onnxruntime  (or: pip install 'purine-caffe[onnx]')"
BATCH = "batch"  # the dim_param of the symbolic batch axis (axis 0 of every input)
BATCH_KEY = "purine.batch"  # the model's metadata entry saying how the batch axis was written

_POOL = pb.PoolingParameter


def _onnx():
    try:
        import onnx
    except ImportError:
        raise ConvertError(f"ONNX export needs the onnx package: {ONNX_EXTRA}") from None
    return onnx


class _Exporter:
    """Walks the built net's layers in order and emits ONNX nodes. A Caffe blob written
    several times (in-place layers) becomes one ONNX tensor per write; the last write keeps
    the Caffe name, so the graph's outputs are named as the net's."""

    def __init__(self, net: Net, probe: dict[str, tuple[int, ...]] | None = None,
                 batch: tuple[int, int] | None = None):
        self.onnx = _onnx()
        self.net = net
        # With a symbolic batch: every blob's shape at another batch size (``probe``) and
        # the two sizes (``batch``: the net's, the probe's); a dim that differs scales with it.
        self.probe = probe or {}
        self.batch = batch
        self.builder = net.builder
        self.layers = self.builder.layers
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.inputs: list[Any] = []
        self.outputs: list[Any] = []
        self.cur: dict[str, str] = {}  # Caffe blob name -> the ONNX tensor it is now
        self.used: set[str] = set()
        self.node_names: set[str] = set()  # apart from tensor names; only unique
        self.reserved = {t for L in self.layers for t in L.param.top}
        # Layers that only rename (Dropout, Split) write no tensor of their own, so the
        # Caffe name goes to the last layer that computes the blob.
        self.last_writer = {t: i for i, L in enumerate(self.layers) if not _is_alias(L)
                            for t in L.param.top}
        self.skip: set[int] = set()
        self.index = 0

    # -- names, tensors, nodes ----------------------------------------------------------
    def fresh(self, base: str) -> str:
        name, n = base, 1
        while name in self.used or name in self.reserved:
            n += 1
            name = f"{base}#{n}"
        self.used.add(name)
        return name

    def define(self, L: LayerBuild, i: int, index: int | None = None) -> str:
        """A new tensor for top ``i`` of ``L`` (written at layer ``index``, default L's)."""
        caffe = L.param.top[i]
        index = self.index if index is None else index
        if self.last_writer[caffe] == index and caffe not in self.used:
            name = caffe
            self.used.add(name)
        else:
            name = self.fresh(f"{caffe}/{self.layers[index].name}")
        self.cur[caffe] = name
        return name

    def bottom(self, L: LayerBuild, i: int) -> str:
        return self.cur[L.param.bottom[i]]

    def alias(self, L: LayerBuild, i: int, tensor: str) -> None:
        self.cur[L.param.top[i]] = tensor

    def const(self, base: str, value: np.ndarray, dtype: Any = np.float32) -> str:
        name = self.fresh(base)
        a = np.ascontiguousarray(value, dtype=dtype)
        self.initializers.append(self.onnx.numpy_helper.from_array(a, name))
        return name

    def param(self, L: LayerBuild, k: int) -> np.ndarray:
        return np.array(self.net.dispatcher.array(L.params[k]), dtype=np.float32)

    def node(self, op: str, inputs: Sequence[str], outputs: Sequence[str], name: str,
             **attrs: Any) -> None:
        self.nodes.append(self.onnx.helper.make_node(op, list(inputs), list(outputs),
                                                     name=self.fresh_node(name), **attrs))

    def fresh_node(self, base: str) -> str:
        name, n = base, 1
        while name in self.node_names:
            n += 1
            name = f"{base}#{n}"
        self.node_names.add(name)
        return name

    def shape_of(self, caffe: str) -> tuple[int, ...]:
        return self.builder.data[caffe].shape

    def probe_of(self, caffe: str) -> tuple[int, ...]:
        """Blob ``caffe``'s shape at the probe's batch size (its own shape when static)."""
        return self.probe.get(caffe, self.shape_of(caffe))

    def reshape(self, L: LayerBuild, x: str, shape: Sequence[int], out: str,
                probe: Sequence[int] | None = None) -> None:
        """A Reshape to ``shape``; the one axis that differs in ``probe`` (the shape at the
        other batch size) is written -1, so ONNX computes it from the batch at run time."""
        target = list(shape)
        moving = [d for d, (a, b) in enumerate(zip(shape, probe or shape)) if a != b]
        if len(moving) > 1:
            raise _unsupported(L, f"its output {tuple(shape)} changes with the batch size in "
                                  f"{len(moving)} axes, which one ONNX Reshape cannot follow; "
                                  "export a fixed batch size (--batch N)")
        for d in moving:
            target[d] = -1
        const = self.const(f"{L.name}/shape", np.array(target, np.int64), np.int64)
        self.node("Reshape", [x, const], [out], f"{L.name}/Reshape")

    def dims(self, caffe: str) -> list[int | str | None]:
        """Blob ``caffe``'s ONNX dims: the batch axis named, other batch-dependent axes left
        unknown (a Concat over axis 0 doubles it), the rest as built."""
        shape, other = self.shape_of(caffe), self.probe_of(caffe)
        if self.batch is None:
            return list(shape)
        return [d if d == o else BATCH if (d, o) == self.batch else None
                for d, o in zip(shape, other)]

    # -- the walk -----------------------------------------------------------------------
    def run(self) -> Any:
        with Progress(len(self.layers), "caffe_to_onnx", unit="layer") as progress:
            for i, L in enumerate(self.layers):
                if i not in self.skip:  # a Scale folded into the BatchNorm before it
                    self.index = i
                    handler = _handler(L)
                    if handler is None:
                        raise _unsupported(L)
                    handler(self, L)
                progress.update(i + 1)
        for name in self.net.outputs:
            tensor = self.cur[name]
            if tensor != name:
                # An alias (Dropout, Split) or an input passed through: give the output
                # the Caffe name where it is free.
                out = name if name not in self.used else self.fresh(f"{name}/output")
                self.used.add(out)
                self.node("Identity", [tensor], [out], f"{name}/output")
                tensor = out
            self.outputs.append(self.value_info(tensor, self.dims(name)))
        helper = self.onnx.helper
        graph = helper.make_graph(self.nodes, self.builder.param.name or "net", self.inputs,
                                  self.outputs, self.initializers)
        model = helper.make_model(graph, producer_name="purine-caffe",
                                  opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = IR_VERSION
        try:
            self.onnx.checker.check_model(model)
            # Strict inference must reach the net's own output shapes.
            self.onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        except Exception as e:  # onnx's ValidationError and InferenceError types
            raise ConvertError(f"the exported graph fails ONNX's checks (a bug in "
                               f"caffe_to_onnx, please report it): {e}") from None
        return model

    def value_info(self, name: str, shape: Sequence[int | str | None]) -> Any:
        return self.onnx.helper.make_tensor_value_info(name, self.onnx.TensorProto.FLOAT,
                                                       list(shape))


def _unsupported(L: LayerBuild, why: str = "") -> ConvertError:
    return unsupported(L, "ONNX", supported(), why or _REFUSED.get(L.type, ""))


def _handler(L: LayerBuild) -> Callable[[_Exporter, LayerBuild], None] | None:
    """The handler of the export form ``L``'s type declares (None: no ONNX form)."""
    return _FORMS.get(facts(L.type).export)


def supported() -> list[str]:
    """The layer types whose declared export form this exporter writes."""
    return types_with(lambda f: f.export in _FORMS)


def _is_alias(L: LayerBuild) -> bool:
    form = facts(L.type).export
    return form in ("dropout", "split", "silence") or (
        form == "concat" and len(L.param.bottom) == 1) or (
        form == "permute" and _order(L) == list(range(len(L.bottoms[0].shape))))


def _axis(L: LayerBuild, axis: int, ndim: int) -> int:
    return axis_index(L, axis, ndim, "ONNX")


# -- layer handlers -----------------------------------------------------------------------
def _input(ex: _Exporter, L: LayerBuild) -> None:
    for i, t in enumerate(L.param.top):
        name = ex.define(L, i)
        ex.inputs.append(ex.value_info(name, ex.dims(t)))


def _split(ex: _Exporter, L: LayerBuild) -> None:
    for i in range(len(L.param.top)):
        ex.alias(L, i, ex.bottom(L, 0))


def _dropout(ex: _Exporter, L: LayerBuild) -> None:
    # Caffe's Dropout passes its bottom through unchanged outside TRAIN.
    ex.alias(L, 0, ex.bottom(L, 0))


def _silence(ex: _Exporter, L: LayerBuild) -> None:
    pass


def _convolution(ex: _Exporter, L: LayerBuild) -> None:
    p = L.param.convolution_param
    ndim = len(L.bottoms[0].shape)
    if _axis(L, p.axis, ndim) != 1:
        raise _unsupported(L, f"convolution_param.axis {p.axis}: ONNX convolves with the "
                              "channels on axis 1 only")
    weight = ex.param(L, 0)
    spatial = weight.ndim - 2
    pad = spatial_values(L, p, "pad", spatial, 0)
    # The depthwise types convolve each channel alone, group given or not (as they build).
    group = L.bottoms[0].shape[1] if L.type in _DEPTHWISE else p.group
    attrs = dict(kernel_shape=list(weight.shape[2:]),
                 strides=spatial_values(L, p, "stride", spatial, 1), pads=pad + pad,
                 dilations=spatial_values(L, p, "dilation", spatial, 1), group=group)
    ins = [ex.const(f"{L.name}/weight", weight)]
    if p.bias_term:
        ins.append(ex.const(f"{L.name}/bias", ex.param(L, 1)))
    # Caffe's deconvolution weight (channels, num_output / group, kh, kw) is ONNX's
    # ConvTranspose layout, and with these pads its output size is Caffe's.
    op = "ConvTranspose" if L.type == "Deconvolution" else "Conv"
    for i in range(len(L.bottoms)):
        x = ex.bottom(L, i)
        ex.node(op, [x] + ins, [ex.define(L, i)], f"{L.name}/{op}", **attrs)


def _pool_axis(L: LayerBuild, what: str, size: int, k: int, s: int, pad: int, pooled: int
               ) -> tuple[int, np.ndarray]:
    """The end padding that makes ONNX's floor-rounded output size Caffe's ``pooled``, and
    per output position the ratio (cells inside the input) / (Caffe's AVE divisor)."""
    last = (pooled - 1) * s - pad
    if last >= size:
        raise _unsupported(L, f"the last pooling window along the {what} starts at {last}, "
                              f"past the input of size {size} (kernel {k}, stride {s}, pad "
                              f"{pad}): Caffe pools an empty window there (-FLT_MAX for MAX, "
                              "0/0 for AVE), which ONNX cannot reproduce")
    end = max(0, (pooled - 1) * s + k - size - pad)
    if (size + pad + end - k) // s + 1 != pooled:  # cannot happen for Caffe's sizes
        raise _unsupported(L, f"no ONNX padding gives Caffe's {pooled} outputs along the "
                              f"{what}")
    starts = np.arange(pooled) * s - pad
    # Caffe's AVE divides by the window clipped to the padded input (size + pad) only;
    # ONNX's count_include_pad=0 divides by the cells inside the input.
    divisor = np.minimum(starts + k, size + pad) - starts
    inside = np.minimum(starts + k, size) - np.maximum(starts, 0)
    return end, inside / divisor


def _pooling(ex: _Exporter, L: LayerBuild) -> None:
    p = L.param.pooling_param
    if p.pool not in (_POOL.MAX, _POOL.AVE):
        raise _unsupported(L, f"pool {_POOL.PoolMethod.Name(p.pool)} has no ONNX form")
    if len(L.param.top) > 1:
        raise _unsupported(L, "the argmax (second) top of MAX pooling is not exported; "
                              "remove that top")
    x, is_max = ex.bottom(L, 0), p.pool == _POOL.MAX
    y = ex.define(L, 0)
    if p.global_pooling:
        op = "GlobalMaxPool" if is_max else "GlobalAveragePool"
        ex.node(op, [x], [y], f"{L.name}/{op}")
        return
    _, _, h, w = L.bottoms[0].shape
    _, _, ph, pw = ex.shape_of(L.param.top[0])
    kernel = pool_values(L, p, "kernel", None)
    stride = pool_values(L, p, "stride", p.stride)
    pad = pool_values(L, p, "pad", p.pad)
    end_h, ratio_h = _pool_axis(L, "height", h, kernel[0], stride[0], pad[0], ph)
    end_w, ratio_w = _pool_axis(L, "width", w, kernel[1], stride[1], pad[1], pw)
    # Explicit end padding with floor rounding, not ceil_mode: where a ceil-rounded last
    # window would start in the padding, onnx's shape inference keeps it and onnxruntime
    # drops it (as Caffe does), e.g. size 3, kernel 2, stride 2, pad 1 (onnx 1.23, ORT 1.31).
    attrs = dict(kernel_shape=list(kernel), strides=list(stride),
                 pads=[pad[0], pad[1], end_h, end_w], ceil_mode=0)
    if is_max:  # ONNX's MaxPool never picks a padding cell, as Caffe's clipped window
        ex.node("MaxPool", [x], [y], f"{L.name}/MaxPool", **attrs)
        return
    ratio = np.outer(ratio_h, ratio_w)
    if np.all(ratio == 1):
        ex.node("AveragePool", [x], [y], f"{L.name}/AveragePool", count_include_pad=0,
                **attrs)
        return
    mean = ex.fresh(f"{L.name}/mean_inside")
    ex.node("AveragePool", [x], [mean], f"{L.name}/AveragePool", count_include_pad=0, **attrs)
    ex.node("Mul", [mean, ex.const(f"{L.name}/divisor_ratio", ratio)], [y],
            f"{L.name}/CaffeDivisor")


def _lrn(ex: _Exporter, L: LayerBuild) -> None:
    """Caffe's scale = shift + alpha / norm * window_sum(x^2), y = x * scale^-beta. A window
    wider than the blob is cut to it (the cells past the edge are zeros), alpha scaled to
    keep Caffe's divisor, so no operator pads a window of 2^31 cells."""
    p = L.param.lrn_param
    x = ex.bottom(L, 0)
    _, channels, height, width = L.bottoms[0].shape
    n = L.name
    if p.norm_region == pb.LRNParameter.ACROSS_CHANNELS:
        kc = _window(p.local_size, channels)
        alpha = p.alpha * kc / p.local_size if kc < p.local_size else p.alpha
        # onnxruntime refuses an LRN whose alpha or beta is not positive (onnx.checker
        # passes it): those get the explicit form below, which it runs.
        if np.float32(alpha) > 0 and p.beta > 0:
            ex.node("LRN", [x], [ex.define(L, 0)], f"{n}/LRN", size=kc, alpha=float(alpha),
                    beta=p.beta, bias=p.k)
            return
        # The window mean over channels: a (kc, 1, 1) AveragePool of x^2 with a unit axis
        # put before the channels, zeros counted at the edges.
        sq, wide, pooled, mean = (ex.fresh(f"{n}/{s}") for s in ("square", "wide", "pooled",
                                                                 "mean"))
        half = (kc - 1) // 2
        ex.node("Mul", [x, x], [sq], f"{n}/Square")
        axes = ex.const(f"{n}/axes", np.array([1]), np.int64)
        ex.node("Unsqueeze", [sq, axes], [wide], f"{n}/Unsqueeze")
        ex.node("AveragePool", [wide], [pooled], f"{n}/AveragePool", kernel_shape=[kc, 1, 1],
                strides=[1, 1, 1], pads=[half, 0, 0, half, 0, 0], count_include_pad=1)
        ex.node("Squeeze", [pooled, axes], [mean], f"{n}/Squeeze")
        _lrn_scale(ex, L, x, mean, p.alpha * kc / p.local_size, p.k)
        return
    # WITHIN_CHANNEL: x * (1 + alpha * mean of x^2 over the size x size box)^-beta, the
    # mean always over size^2 cells (zeros outside), as Caffe's padded AVE pool gives.
    kh, kw = _window(p.local_size, height), _window(p.local_size, width)
    hh, hw = (kh - 1) // 2, (kw - 1) // 2
    sq, padded, mean = (ex.fresh(f"{n}/{s}") for s in ("square", "padded", "mean"))
    ex.node("Mul", [x, x], [sq], f"{n}/Square")
    pads = ex.const(f"{n}/pads", np.array([0, 0, hh, hw, 0, 0, hh, hw]), np.int64)
    ex.node("Pad", [sq, pads], [padded], f"{n}/Pad")
    ex.node("AveragePool", [padded], [mean], f"{n}/AveragePool", kernel_shape=[kh, kw],
            strides=[1, 1])
    _lrn_scale(ex, L, x, mean, p.alpha * (kh * kw) / float(p.local_size) ** 2, 1.0)


def _window(size: int, extent: int) -> int:
    """An odd LRN window of ``size`` cut to what reaches an axis of ``extent`` cells from
    any of them: 2 * extent - 1 at most."""
    return max(1, min(size, 2 * extent - 1))


def _lrn_scale(ex: _Exporter, L: LayerBuild, x: str, mean: str, alpha: float,
               shift: float) -> None:
    """y = x * (shift + alpha * mean)^-beta, the tail both LRN regions share."""
    n = L.name
    scaled, shifted, factor = (ex.fresh(f"{n}/{s}") for s in ("scaled", "shifted", "factor"))
    ex.node("Mul", [mean, ex.const(f"{n}/alpha", np.float32(alpha))], [scaled], f"{n}/Alpha")
    ex.node("Add", [scaled, ex.const(f"{n}/shift", np.float32(shift))], [shifted],
            f"{n}/Shift")
    ex.node("Pow", [shifted, ex.const(f"{n}/minus_beta", np.float32(-L.param.lrn_param.beta))],
            [factor], f"{n}/Pow")
    ex.node("Mul", [x, factor], [ex.define(L, 0)], f"{n}/Mul")


def _inner_product(ex: _Exporter, L: LayerBuild) -> None:
    p = L.param.inner_product_param
    shape = L.bottoms[0].shape
    axis = _axis(L, p.axis, len(shape))
    outer = math.prod(shape[:axis])
    x = ex.bottom(L, 0)
    if len(shape) != 2 or axis != 1:
        flat = ex.fresh(f"{L.name}/flat")
        # Flatten(axis=0) would give (1, count); Caffe's outer size is then 1 too.
        ex.node("Flatten", [x], [flat], f"{L.name}/Flatten", axis=axis)
        x = flat
    ins = [x, ex.const(f"{L.name}/weight", ex.param(L, 0))]
    if p.bias_term:
        ins.append(ex.const(f"{L.name}/bias", ex.param(L, 1)))
    top_shape = ex.shape_of(L.param.top[0])
    # Caffe's weight is (num_output, K), or (K, num_output) with transpose: true.
    if top_shape == (outer, p.num_output):
        ex.node("Gemm", ins, [ex.define(L, 0)], f"{L.name}/Gemm", transB=0 if p.transpose
                else 1)
        return
    mat = ex.fresh(f"{L.name}/matrix")
    ex.node("Gemm", ins, [mat], f"{L.name}/Gemm", transB=0 if p.transpose else 1)
    ex.reshape(L, mat, top_shape, ex.define(L, 0), ex.probe_of(L.param.top[0]))


def _relu(ex: _Exporter, L: LayerBuild) -> None:
    slope = L.param.relu_param.negative_slope
    x = ex.bottom(L, 0)
    if slope:
        ex.node("LeakyRelu", [x], [ex.define(L, 0)], f"{L.name}/LeakyRelu", alpha=slope)
    else:
        ex.node("Relu", [x], [ex.define(L, 0)], f"{L.name}/Relu")


def _unary(op: str) -> Callable[[_Exporter, LayerBuild], None]:
    def handler(ex: _Exporter, L: LayerBuild) -> None:
        ex.node(op, [ex.bottom(L, 0)], [ex.define(L, 0)], f"{L.name}/{op}")
    return handler


def _softmax(ex: _Exporter, L: LayerBuild) -> None:
    axis = _axis(L, L.param.softmax_param.axis, len(L.bottoms[0].shape))
    ex.node("Softmax", [ex.bottom(L, 0)], [ex.define(L, 0)], f"{L.name}/Softmax", axis=axis)


def _concat(ex: _Exporter, L: LayerBuild) -> None:
    p = L.param.concat_param
    ndim = len(L.bottoms[0].shape)
    axis = p.concat_dim if p.HasField("concat_dim") else _axis(L, p.axis, ndim)
    xs = [ex.bottom(L, i) for i in range(len(L.bottoms))]
    if len(xs) == 1:
        ex.alias(L, 0, xs[0])
        return
    ex.node("Concat", xs, [ex.define(L, 0)], f"{L.name}/Concat", axis=axis)


def _eltwise(ex: _Exporter, L: LayerBuild) -> None:
    p = L.param.eltwise_param
    E = pb.EltwiseParameter
    xs = [ex.bottom(L, i) for i in range(len(L.bottoms))]
    if p.operation == E.MAX:
        ex.node("Max", xs, [ex.define(L, 0)], f"{L.name}/Max")
    elif p.operation == E.PROD:
        acc = xs[0]
        for j, x in enumerate(xs[1:], 1):
            out = ex.define(L, 0) if j == len(xs) - 1 else ex.fresh(f"{L.name}/product{j}")
            ex.node("Mul", [acc, x], [out], f"{L.name}/Mul")
            acc = out
    else:
        terms = []
        for j, (x, c) in enumerate(zip(xs, list(p.coeff) or [1.0] * len(xs))):
            if c != 1.0:
                t = ex.fresh(f"{L.name}/term{j}")
                ex.node("Mul", [x, ex.const(f"{L.name}/coeff{j}", np.float32(c))], [t],
                        f"{L.name}/Coeff")
                x = t
            terms.append(x)
        ex.node("Sum", terms, [ex.define(L, 0)], f"{L.name}/Sum")


def _broadcast_shape(L: LayerBuild, operand: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """``operand`` applied from ``axis`` of bottom 0, padded with trailing 1s so that
    ONNX's right-aligned broadcasting lines it up as Caffe does."""
    ndim = len(L.bottoms[0].shape)
    if not operand:
        return operand
    axis = _axis(L, axis, ndim)
    return operand + (1,) * (ndim - axis - len(operand))


def _scale(ex: _Exporter, L: LayerBuild) -> None:
    p = L.param.scale_param
    x = ex.bottom(L, 0)
    n = L.name
    if len(L.bottoms) == 2:
        s_shape = L.bottoms[1].shape
        target = _broadcast_shape(L, s_shape, p.axis)
        s = ex.bottom(L, 1)
        if target != s_shape:
            r = ex.fresh(f"{n}/scale")
            ex.reshape(L, s, target, r,
                       _broadcast_shape(L, ex.probe_of(L.param.bottom[1]), p.axis))
            s = r
        bias_k = 0
    else:
        w = ex.param(L, 0)
        s = ex.const(f"{n}/scale", w.reshape(_broadcast_shape(L, w.shape, p.axis)))
        bias_k = 1
    if not p.bias_term:
        ex.node("Mul", [x, s], [ex.define(L, 0)], f"{n}/Mul")
        return
    b = ex.param(L, bias_k)
    scaled = ex.fresh(f"{n}/scaled")
    ex.node("Mul", [x, s], [scaled], f"{n}/Mul")
    bias = ex.const(f"{n}/bias", b.reshape(_broadcast_shape(L, b.shape, p.axis)))
    ex.node("Add", [scaled, bias], [ex.define(L, 0)], f"{n}/Add")


def _bias(ex: _Exporter, L: LayerBuild) -> None:
    p = L.param.bias_param
    n = L.name
    if len(L.bottoms) == 2:
        b_shape = L.bottoms[1].shape
        target = _broadcast_shape(L, b_shape, p.axis)
        b = ex.bottom(L, 1)
        if target != b_shape:
            r = ex.fresh(f"{n}/bias")
            ex.reshape(L, b, target, r,
                       _broadcast_shape(L, ex.probe_of(L.param.bottom[1]), p.axis))
            b = r
    else:
        w = ex.param(L, 0)
        b = ex.const(f"{n}/bias", w.reshape(_broadcast_shape(L, w.shape, p.axis)))
    ex.node("Add", [ex.bottom(L, 0), b], [ex.define(L, 0)], f"{n}/Add")


def _batch_norm(ex: _Exporter, L: LayerBuild) -> None:
    p = L.param.batch_norm_param
    shape = L.bottoms[0].shape
    if p.HasField("use_global_stats") and not p.use_global_stats:
        raise _unsupported(L, "use_global_stats: false normalizes by each batch's own "
                              "statistics; ONNX's BatchNormalization uses stored ones")
    if len(shape) < 2:
        raise _unsupported(L, f"bottom {shape}: ONNX's BatchNormalization needs (N, C, ...)")
    c = shape[1]
    mean_sum, var_sum, factor = (ex.param(L, k) for k in range(3))
    # Caffe keeps sums and their moving-average weight; a weight of 0 means no statistics.
    f = 0.0 if factor.ravel()[0] == 0 else 1.0 / float(factor.ravel()[0])
    mean, var = mean_sum.reshape(c) * f, var_sum.reshape(c) * f
    zero = np.flatnonzero(var.astype(np.float32) + np.float32(p.eps) == 0)
    if zero.size:
        # Caffe divides by sqrt(0) there (x / 0 = +-inf); onnxruntime's BatchNormalization
        # gives NaN instead.
        raise _unsupported(L, f"channel {int(zero[0])} has variance + eps = 0 (eps {p.eps}): "
                              "Caffe's +-inf there is NaN in ONNX's BatchNormalization")
    gamma, beta = np.ones(c, np.float32), np.zeros(c, np.float32)
    top_layer, top_index = L, ex.index
    nxt = ex.index + 1
    if nxt < len(ex.layers) and _folds(L, ex.layers[nxt], c):
        S = ex.layers[nxt]
        gamma = ex.param(S, 0).reshape(c)
        if S.param.scale_param.bias_term:
            beta = ex.param(S, 1).reshape(c)
        top_layer, top_index = S, nxt
        ex.skip.add(nxt)
    n = L.name
    ins = [ex.bottom(L, 0), ex.const(f"{n}/scale", gamma), ex.const(f"{n}/bias", beta),
           ex.const(f"{n}/mean", mean), ex.const(f"{n}/var", var)]
    ex.node("BatchNormalization", ins, [ex.define(top_layer, 0, top_index)],
            f"{n}/BatchNormalization", epsilon=p.eps)


def _folds(bn: LayerBuild, S: LayerBuild, channels: int) -> bool:
    """A Scale right after a BatchNorm, reading only its top with a learned per-channel
    factor, becomes the BatchNormalization's scale and bias (any other reader of the
    BatchNorm's top would go through a Split, so the Scale's bottom would differ)."""
    if S.type != "Scale" or len(S.param.bottom) != 1 or S.param.bottom[0] != bn.param.top[0]:
        return False
    return len(S.bottoms[0].shape) >= 2 and all(b.shape == (channels,) for b in S.params) \
        and _axis(S, S.param.scale_param.axis, len(S.bottoms[0].shape)) == 1


def _reshape(ex: _Exporter, L: LayerBuild) -> None:
    # Flatten and Reshape: the top's shape is known, so a static Reshape reproduces both.
    top = L.param.top[0]
    ex.reshape(L, ex.bottom(L, 0), ex.shape_of(top), ex.define(L, 0), ex.probe_of(top))


# -- the forks' layers --------------------------------------------------------------------
_DEPTHWISE = ("ConvolutionDepthwise", "DepthwiseConvolution")


def _relu6(ex: _Exporter, L: LayerBuild) -> None:
    lo, hi = (ex.const(f"{L.name}/{k}", np.float32(v)) for k, v in (("min", 0), ("max", 6)))
    ex.node("Clip", [ex.bottom(L, 0), lo, hi], [ex.define(L, 0)], f"{L.name}/Clip")


def _mish(ex: _Exporter, L: LayerBuild) -> None:
    # ONNX's Mish op came with opset 18; at opset 17 it is spelt out, x * tanh(softplus(x)).
    x, n = ex.bottom(L, 0), L.name
    soft, tanh = ex.fresh(f"{n}/softplus"), ex.fresh(f"{n}/tanh")
    ex.node("Softplus", [x], [soft], f"{n}/Softplus")
    ex.node("Tanh", [soft], [tanh], f"{n}/Tanh")
    ex.node("Mul", [x, tanh], [ex.define(L, 0)], f"{n}/Mul")


def _order(L: LayerBuild) -> list[int]:
    """Permute's whole axis order: the axes it names, then the others in their order."""
    named = list(L.param.permute_param.order)
    return named + [i for i in range(len(L.bottoms[0].shape)) if i not in named]


def _permute(ex: _Exporter, L: LayerBuild) -> None:
    order = _order(L)
    if order == sorted(order):  # the builder names the bottom's blob: no tensor of its own
        ex.alias(L, 0, ex.bottom(L, 0))
        return
    ex.node("Transpose", [ex.bottom(L, 0)], [ex.define(L, 0)], f"{L.name}/Transpose",
            perm=order)


def _shuffle_channel(ex: _Exporter, L: LayerBuild) -> None:
    # The channels read as a (group, C / group) grid and transposed: pure data movement.
    group, n = L.param.shuffle_channel_param.group, L.name
    shape, top = L.bottoms[0].shape, L.param.top[0]
    other = ex.probe_of(L.param.bottom[0])
    grid, swapped = ex.fresh(f"{n}/grid"), ex.fresh(f"{n}/swapped")

    def grid_shape(s: Sequence[int]) -> tuple[int, ...]:
        return (s[0], group, s[1] // group, math.prod(s[2:]))

    ex.reshape(L, ex.bottom(L, 0), grid_shape(shape), grid, grid_shape(other))
    ex.node("Transpose", [grid], [swapped], f"{n}/Transpose", perm=[0, 2, 1, 3])
    ex.reshape(L, swapped, ex.shape_of(top), ex.define(L, 0), ex.probe_of(top))


def _axpy(ex: _Exporter, L: LayerBuild) -> None:
    a, x, y = (ex.bottom(L, i) for i in range(3))
    n = L.name
    extra = len(L.bottoms[1].shape) - len(L.bottoms[0].shape)
    if extra:  # an (N, C) scale lined up with x's (N, C, ...)
        axes = ex.const(f"{n}/axes", np.arange(2, 2 + extra), np.int64)
        lined = ex.fresh(f"{n}/scale")
        ex.node("Unsqueeze", [a, axes], [lined], f"{n}/Unsqueeze")
        a = lined
    scaled = ex.fresh(f"{n}/scaled")
    ex.node("Mul", [a, x], [scaled], f"{n}/Mul")
    ex.node("Add", [scaled, y], [ex.define(L, 0)], f"{n}/Add")


def _sizes(ex: _Exporter, L: LayerBuild, x: str, plane: Sequence[int]) -> str:
    """Resize's sizes input: x's (N, C), whatever the batch, then ``plane``."""
    n = L.name
    nc = ex.fresh(f"{n}/num_channels")
    ex.node("Shape", [x], [nc], f"{n}/Shape", start=0, end=2)
    sizes = ex.fresh(f"{n}/sizes")
    ex.node("Concat", [nc, ex.const(f"{n}/plane", np.array(plane), np.int64)], [sizes],
            f"{n}/Sizes", axis=0)
    return sizes


def _interp(ex: _Exporter, L: LayerBuild) -> None:
    p, n = L.param.interp_param, L.name
    x = ex.bottom(L, 0)
    h, w = L.bottoms[0].shape[2:]
    if p.pad_beg or p.pad_end:  # both <= 0: a crop of the input before the resize
        begin = ex.const(f"{n}/crop_begin", np.array([-p.pad_beg] * 2), np.int64)
        end = ex.const(f"{n}/crop_end", np.array([h + p.pad_end, w + p.pad_end]), np.int64)
        axes = ex.const(f"{n}/crop_axes", np.array([2, 3]), np.int64)
        cropped = ex.fresh(f"{n}/cropped")
        ex.node("Slice", [x, begin, end, axes], [cropped], f"{n}/Crop")
        x = cropped
    # The fork's bilinear weights with the corners aligned: position o * (in - 1) / (out - 1)
    # along each axis, which is Resize's align_corners transform.
    sizes = _sizes(ex, L, x, ex.shape_of(L.param.top[0])[2:])
    ex.node("Resize", [x, "", "", sizes], [ex.define(L, 0)], f"{n}/Resize", mode="linear",
            coordinate_transformation_mode="align_corners")


def _upsample(ex: _Exporter, L: LayerBuild) -> None:
    if len(L.bottoms) == 2:
        raise _unsupported(L, "the SegNet form (a mask bottom) puts each value where a MAX "
                              "Pooling's argmax top says, and that top is not exported "
                              "(ONNX's MaxPool indices count over the whole tensor); only the "
                              "one-bottom nearest-neighbour Upsample is")
    s = L.param.upsample_param.scale
    scales = ex.const(f"{L.name}/scales", np.array([1, 1, s, s], np.float32))
    # Output cell i reads input floor(i / scale): the asymmetric transform, rounded down.
    ex.node("Resize", [ex.bottom(L, 0), "", scales], [ex.define(L, 0)], f"{L.name}/Resize",
            mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")


def _normalize(ex: _Exporter, L: LayerBuild) -> None:
    # y = scale * x / sqrt(sum(x^2) + eps): eps inside the root, as the fork adds it.
    p, n = L.param.norm_param, L.name
    x = ex.bottom(L, 0)
    ndim = len(L.bottoms[0].shape)
    axes = list(range(1, ndim)) if p.across_spatial else [1]
    sq, shifted, norm, unit = (ex.fresh(f"{n}/{k}") for k in ("sum_sq", "plus_eps", "norm",
                                                             "unit"))
    ex.node("ReduceSumSquare", [x], [sq], f"{n}/ReduceSumSquare", axes=axes, keepdims=1)
    ex.node("Add", [sq, ex.const(f"{n}/eps", np.float32(p.eps))], [shifted], f"{n}/Eps")
    ex.node("Sqrt", [shifted], [norm], f"{n}/Sqrt")
    ex.node("Div", [x, norm], [unit], f"{n}/Div")
    scale = ex.param(L, 0)  # () when channel_shared, else (C,) lined up with axis 1
    scale = scale.reshape(scale.shape + (1,) * (ndim - 2) if scale.ndim else ())
    ex.node("Mul", [unit, ex.const(f"{n}/scale", scale)], [ex.define(L, 0)], f"{n}/Scale")


def _prior_box(ex: _Exporter, L: LayerBuild) -> None:
    # The boxes depend on the blobs' shapes and the parameters alone: the layer's own kernel
    # computes them once, here, into a Constant.
    tensor = ex.onnx.numpy_helper.from_array(computed_top(L), f"{L.name}/boxes")
    ex.node("Constant", [], [ex.define(L, 0)], f"{L.name}/Constant", value=tensor)


def _roi_pooling(ex: _Exporter, L: LayerBuild) -> None:
    # MaxRoiPool is Fast R-CNN's ROIPooling: corners rounded half away from zero after
    # scaling, at least one cell, bin p over [floor(p * size / pooled), ceil((p + 1) * size /
    # pooled)) in float32, clipped, 0 for an empty bin.
    p, n = L.param.roi_pooling_param, L.name
    rois = ex.bottom(L, 1)
    if len(L.bottoms[1].shape) != 2:  # (R, 5, 1, 1) as (R, 5)
        rows = ex.fresh(f"{n}/rois")
        ex.node("Reshape", [rois, ex.const(f"{n}/rows", np.array([-1, 5]), np.int64)], [rows],
                f"{n}/Rows")
        rois = rows
    ex.node("MaxRoiPool", [ex.bottom(L, 0), rois], [ex.define(L, 0)], f"{n}/MaxRoiPool",
            pooled_shape=[p.pooled_h, p.pooled_w], spatial_scale=p.spatial_scale)


_REFUSED = {
    "DetectionOutput": "the fork's per-class top_k, NMS (with eta's shrinking threshold) and "
                       "keep_top_k across classes give a data-dependent number of rows in "
                       "its own order (image, label, NMS order); ONNX's NonMaxSuppression "
                       f"(opset {OPSET}) has no eta and no pre-NMS top_k, and its rows come in "
                       "another order; export the net up to the loc, conf and prior blobs "
                       "and run the detection step outside",
    "Proposal": "its NMS measures boxes in pixels with +1 widths ((x2 - x1 + 1)(y2 - y1 + 1) "
                "areas) and pads the rows to post_nms_topn, which ONNX's NonMaxSuppression "
                "(continuous areas, a data-dependent count) does not reproduce",
    "PSROIPooling": "position-sensitive average pooling (bin (i, j) of output channel d reads "
                    "input channel (d * group + i) * group + j) has no ONNX operator; "
                    "RoiAlign samples bilinearly instead of averaging the bin's cells",
}


# The export forms (a layer type declares its form where it is registered) written here.
_FORMS: dict[str, Callable[[_Exporter, LayerBuild], None]] = {
    "input": _input, "split": _split, "dropout": _dropout, "silence": _silence,
    "convolution": _convolution, "pooling": _pooling, "lrn": _lrn,
    "inner_product": _inner_product, "relu": _relu, "sigmoid": _unary("Sigmoid"),
    "tanh": _unary("Tanh"), "softmax": _softmax, "concat": _concat, "eltwise": _eltwise,
    "batch_norm": _batch_norm, "scale": _scale, "bias": _bias, "flatten": _reshape,
    "reshape": _reshape, "relu6": _relu6, "mish": _mish, "permute": _permute,
    "shuffle_channel": _shuffle_channel, "axpy": _axpy, "interp": _interp,
    "upsample": _upsample, "normalize": _normalize, "prior_box": _prior_box,
    "roi_pooling": _roi_pooling,
}


# -- entry points -------------------------------------------------------------------------
def _resize_inputs(net: Net, batch: int) -> None:
    """Every input blob of ``net`` with ``batch`` on axis 0, and the net built for that."""
    for name in net.inputs:
        shape = net.blobs[name].shape
        net.blobs[name].reshape((batch,) + tuple(shape[1:]))
    net.reshape()


def _probe(net: Net) -> tuple[dict[str, tuple[int, ...]], tuple[int, int]] | str:
    """Every blob's shape with the inputs' batch axis at another size, and the two sizes;
    or why the batch axis stays fixed. The net is back at its own shapes afterwards."""
    shapes = [net.blobs[n].shape for n in net.inputs]
    if not shapes or any(len(s) == 0 for s in shapes):
        return "the net has no input with a batch axis"
    firsts = sorted({s[0] for s in shapes})
    if len(firsts) > 1:
        return ("its inputs differ in their first axis (" + ", ".join(
            f"{n} {s[0]}" for n, s in zip(net.inputs, shapes)) + ")")
    n0 = firsts[0]
    if n0 < 1:
        return f"its inputs' batch size is {n0}"
    other = 1 if n0 > 1 else 2  # the smaller probe allocates the least
    kept = {n: np.array(net.blobs[n].data) for n in net.inputs}  # reshaping zeroes them
    try:
        _resize_inputs(net, other)
        probe = {name: tuple(b.shape) for name, b in net.builder.data.items()}
    except PurineError as e:
        return f"the net does not build at batch size {other}: {e}"
    finally:
        _resize_inputs(net, n0)
        for n, a in kept.items():
            net.blobs[n].data[...] = a
    return probe, (n0, other)


def net_to_onnx(net: Net, batch: int | None = None) -> Any:
    """The ONNX ModelProto of a built net with its current parameters (build the net in
    phase TEST: Dropout is then the identity and BatchNorm uses its stored statistics).
    ``batch`` None gives axis 0 of every input the symbolic size 'batch' (kept fixed, with
    the reason in the model's ``purine.batch`` metadata, where the net cannot follow it);
    an integer builds the net at that batch size and writes every shape fixed."""
    for L in net.builder.layers:  # a layer with no ONNX form is refused before any probe
        if _handler(L) is None:
            raise _unsupported(L)
    if batch is not None:
        if batch < 1:
            raise ConvertError(f"--batch {batch}: expected a batch size of at least 1")
        _resize_inputs(net, batch)
        note = f"batch {batch} (fixed by --batch)"
        ex = _Exporter(net)
    else:
        probed = _probe(net)
        if isinstance(probed, str):
            size = net.blobs[net.inputs[0]].shape[:1] if net.inputs else ()
            fixed = f"batch {size[0]}" if size else "no batch axis"
            note = f"{fixed} (fixed: {probed})"
            ex = _Exporter(net)
        else:
            note = f"batch axis symbolic ('{BATCH}'; built at {probed[1][0]})"
            ex = _Exporter(net, *probed)
    model = ex.run()
    ex.onnx.helper.set_model_props(model, {BATCH_KEY: note})
    return model


def batch_note(model: Any) -> str:
    """What ``net_to_onnx`` wrote about the batch axis of ``model`` ('' if nothing)."""
    return next((p.value for p in model.metadata_props if p.key == BATCH_KEY), "")


def caffe_to_onnx(model: str | os.PathLike | pb.NetParameter, weights: str | os.PathLike,
                  output: str | os.PathLike, batch: int | None = None) -> Any:
    """Export deploy net ``model`` with the parameters of caffemodel ``weights`` to the ONNX
    file ``output``; returns the ModelProto. ``batch``: as ``net_to_onnx``'s."""
    from purine.caffe.net import Net

    _onnx()  # say what to install before building a large net
    net = Net(model, phase=pb.TEST)
    copy_every_layer(net, weights)
    proto = net_to_onnx(net, batch)
    try:
        atomic_write(output, proto.SerializeToString())
    except OSError as e:
        raise ConvertError(f"{os.fspath(output)}: cannot write: {e.strerror}") from None
    return proto


# -- the command --------------------------------------------------------------------------
def _batch(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a batch size, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a batch size of at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``caffe_to_onnx --model DEPLOY.prototxt --weights W.caffemodel [--batch N] OUT.onnx``."""
    if parser.description is None:
        parser.description = (f"Export a deploy net and its weights to ONNX (opset {OPSET}). "
                              "The batch axis (axis 0 of the inputs) is symbolic unless "
                              "--batch fixes it. Supported layers: "
                              + ", ".join(supported()) + ".")
    flag(parser, "model", required=True, help="the deploy prototxt (Input layers)")
    flag(parser, "weights", required=True, help="the .caffemodel with the parameters")
    flag(parser, "batch", type=_batch, default=None, metavar="N",
         help="write every shape fixed, at batch size N (default: a symbolic batch axis, "
              "'batch', so the model runs at any batch size)")
    parser.add_argument("output", metavar="OUT.onnx", help="the ONNX file to write")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    proto = caffe_to_onnx(args.model, args.weights, args.output, args.batch)
    g = proto.graph
    print(f"{args.model} + {args.weights} -> {args.output}: {len(g.node)} nodes, inputs "
          f"{', '.join(i.name for i in g.input)}, outputs {', '.join(o.name for o in g.output)}"
          f", {batch_note(proto)} (opset {OPSET})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("caffe_to_onnx", add_arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
