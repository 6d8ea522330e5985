"""``caffe_to_pytorch``: a deploy net as a readable PyTorch module (``class Net``, one attribute
per Caffe layer, ``forward`` in Caffe's layer order) and its weights as ``.safetensors``,
written with numpy: this package never imports torch. Every layer keeps Caffe's arithmetic
(pooling sizes and divisors, LRN, BatchNorm's stored sums); a layer without an exact PyTorch
form is refused by name."""

from __future__ import annotations

import argparse
import builtins
import json
import keyword
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING

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
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import atomic_write

if TYPE_CHECKING:
    from purine.caffe.layer import LayerBuild
    from purine.caffe.net import Net
    from purine.graph import Blob

_POOL = pb.PoolingParameter
_LRN = pb.LRNParameter
_ELTWISE = pb.EltwiseParameter
# Data layers of a deploy net whose tops are fed by the caller: they become forward's inputs.
WIDTH = 99  # the generated source stays within ruff's 100 columns where it can

# Names an attribute must not take: nn.Module's own (torch 2.x; the tests check this list
# against the installed torch). Names starting with "_" are never used, so its private ones
# are safe.
_MODULE_NAMES = frozenset("""
    T_destination add_module apply bfloat16 buffers call_super_init children compile cpu cuda
    double dump_patches eval extra_repr float forward get_buffer get_extra_state
    get_parameter get_submodule half ipu load_state_dict modules mtia named_buffers
    named_children named_modules named_parameters parameters register_backward_hook
    register_buffer register_forward_hook register_forward_pre_hook
    register_full_backward_hook register_full_backward_pre_hook
    register_load_state_dict_post_hook register_load_state_dict_pre_hook register_module
    register_parameter register_state_dict_post_hook register_state_dict_pre_hook
    requires_grad_ set_extra_state set_submodule share_memory state_dict to to_empty train
    training type xpu zero_grad""".split())
# Locals of forward must not hide what the generated source refers to by name, nor Python's
# builtins (a blob named 'sum' or 'max').
_LOCAL_NAMES = frozenset({"self", "torch", "nn", "F", "FLT_MAX"} | set(dir(builtins)))


# -- the helpers the generated module defines (only those its layers use) ------------------
_HELPERS: dict[str, str] = {
    "Pooling": '''
FLT_MAX = torch.finfo(torch.float32).max  # Caffe's start value of a MAX window


def caffe_pooled_size(size: int, kernel: int, stride: int, pad: int, ceil: bool) -> int:
    """Caffe's pooling output size: (size + 2 pad - kernel) / stride rounded up (or down with
    round_mode FLOOR), plus 1; with padding, a last window starting in the padding is dropped."""
    span = size + 2 * pad - kernel
    pooled = (-(-span // stride) if ceil else span // stride) + 1
    if pad and (pooled - 1) * stride >= size + pad:
        pooled -= 1
    return pooled


class Pooling(nn.Module):
    """Caffe's MAX / AVE pooling, exactly. PyTorch's ceil_mode does not always give Caffe's
    output size, so the input is padded by hand up to the end of Caffe's last window: MAX pads
    with -FLT_MAX (Caffe's start value, kept by a window with no image cell), AVE with zeros
    and divides each window's sum by Caffe's count, the window clipped to the padded image
    (padding counts, the overhang of a rounded-up last window does not)."""

    def __init__(self, method: str, kernel: tuple[int, int] = (1, 1),
                 stride: tuple[int, int] = (1, 1), pad: tuple[int, int] = (0, 0),
                 ceil: bool = True, global_pooling: bool = False) -> None:
        super().__init__()
        self.method, self.kernel, self.stride, self.pad = method, kernel, stride, pad
        self.ceil, self.global_pooling = ceil, global_pooling

    def extra_repr(self) -> str:
        if self.global_pooling:
            return f"{self.method}, global_pooling=True"
        return (f"{self.method}, kernel={self.kernel}, stride={self.stride}, pad={self.pad}"
                + ("" if self.ceil else ", ceil=False"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = (x.shape[-2], x.shape[-1])
        kernel = size if self.global_pooling else self.kernel
        axes = list(zip(size, kernel, self.stride, self.pad, strict=True))
        pooled = [caffe_pooled_size(n, k, s, p, self.ceil) for n, k, s, p in axes]
        # Cells past the image up to the end of the last window (none when it ends inside).
        after = [max(0, (o - 1) * s + k - n - p)
                 for o, (n, k, s, p) in zip(pooled, axes, strict=True)]
        sides = (self.pad[1], after[1], self.pad[0], after[0])
        if self.method == "MAX":
            return F.max_pool2d(F.pad(x, sides, value=-FLT_MAX), kernel, self.stride)
        sums = F.avg_pool2d(F.pad(x, sides), kernel, self.stride, divisor_override=1)
        rows, cols = (self.count(o, *axis, x.device) for o, axis in zip(pooled, axes, strict=True))
        return sums / (rows[:, None] * cols[None, :]).to(x.dtype)

    @staticmethod
    def count(pooled: int, size: int, kernel: int, stride: int, pad: int,
              device: torch.device) -> torch.Tensor:
        """Caffe's AVE divisor along one axis: each window clipped to size + pad."""
        start = torch.arange(pooled, device=device) * stride - pad
        return torch.clamp(start + kernel, max=size + pad) - start
''',
    "WithinChannelLRN": '''
class WithinChannelLRN(nn.Module):
    """Caffe's LRN with norm_region WITHIN_CHANNEL: x * (1 + alpha * m)^-beta, m the mean of
    x^2 over the size x size box around each cell, always over size^2 cells (zeros outside)."""

    def __init__(self, size: int, alpha: float, beta: float) -> None:
        super().__init__()
        self.size, self.alpha, self.beta = size, alpha, beta

    def extra_repr(self) -> str:
        return f"size={self.size}, alpha={self.alpha}, beta={self.beta}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = F.avg_pool2d(x * x, self.size, stride=1, padding=(self.size - 1) // 2)
        return x * (1 + self.alpha * mean) ** -self.beta
''',
    "Concat": '''
class Concat(nn.Module):
    """Caffe's Concat: the inputs joined along one axis."""

    def __init__(self, axis: int = 1) -> None:
        super().__init__()
        self.axis = axis

    def extra_repr(self) -> str:
        return f"axis={self.axis}"

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.cat(xs, self.axis)
''',
    "Eltwise": '''
class Eltwise(nn.Module):
    """Caffe's Eltwise: the inputs' weighted sum (SUM), product (PROD) or maximum (MAX)."""

    def __init__(self, operation: str, coeffs: tuple[float, ...] = ()) -> None:
        super().__init__()
        self.operation, self.coeffs = operation, coeffs

    def extra_repr(self) -> str:
        return self.operation + (f", coeffs={self.coeffs}" if self.operation == "SUM" else "")

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if self.operation == "SUM":  # Caffe: 0 + c0 x0 + c1 x1 + ...
            return sum(c * x for c, x in zip(self.coeffs, xs, strict=True))
        y = xs[0]
        for x in xs[1:]:
            y = y * x if self.operation == "PROD" else torch.maximum(y, x)
        return y
''',
    "line_up": '''
def line_up(t: torch.Tensor, trailing: int) -> torch.Tensor:
    """``t`` with ``trailing`` axes of size 1 appended, so that it broadcasts over the axes of
    the input from Caffe's ``axis`` on."""
    return t.reshape(*t.shape, *(1,) * trailing)
''',
    "Scale": '''

class Scale(nn.Module):
    """Caffe's Scale: x times a factor (learned, or the second input) lined up with x's axes
    from Caffe's axis, plus an optional learned bias of the factor's shape."""

    def __init__(self, shape: tuple[int, ...] | None, bias: tuple[int, ...] | None,
                 trailing: int) -> None:
        super().__init__()
        self.weight = None if shape is None else nn.Parameter(torch.ones(shape))
        self.bias = None if bias is None else nn.Parameter(torch.zeros(bias))
        self.trailing = trailing

    def forward(self, x: torch.Tensor, factor: torch.Tensor | None = None) -> torch.Tensor:
        y = x * line_up(self.weight if factor is None else factor, self.trailing)
        return y if self.bias is None else y + line_up(self.bias, self.trailing)
''',
    "Bias": '''
class Bias(nn.Module):
    """Caffe's Bias: x plus a bias (learned, or the second input) lined up with x's axes from
    Caffe's axis."""

    def __init__(self, shape: tuple[int, ...] | None, trailing: int) -> None:
        super().__init__()
        self.bias = None if shape is None else nn.Parameter(torch.zeros(shape))
        self.trailing = trailing

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x + line_up(self.bias if bias is None else bias, self.trailing)
''',
    "Reshape": '''
class Reshape(nn.Module):
    """Caffe's Reshape: axes start..end-1 of x become ``shape``, where 0 copies x's axis at
    that place and -1 is inferred."""

    def __init__(self, shape: tuple[int, ...], start: int, end: int) -> None:
        super().__init__()
        self.shape, self.start, self.end = shape, start, end

    def extra_repr(self) -> str:
        return f"shape={self.shape}, start={self.start}, end={self.end}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        middle = [x.shape[self.start + i] if d == 0 else d for i, d in enumerate(self.shape)]
        return x.reshape(*x.shape[:self.start], *middle, *x.shape[self.end:])
''',
    "Permute": '''
class Permute(nn.Module):
    """The SSD fork's Permute: x's axes in ``order``."""

    def __init__(self, order: tuple[int, ...]) -> None:
        super().__init__()
        self.order = order

    def extra_repr(self) -> str:
        return f"order={self.order}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(*self.order)
''',
    "ShuffleChannel": '''
class ShuffleChannel(nn.Module):
    """ShuffleNet's channel shuffle: the channels read as a (group, C / group) grid and
    transposed."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group

    def extra_repr(self) -> str:
        return f"group={self.group}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[:2]
        grid = x.reshape(n, self.group, c // self.group, -1).transpose(1, 2)
        return grid.reshape(x.shape)
''',
    "Axpy": '''
class Axpy(nn.Module):
    """SENet's Axpy: a per-channel scale (N, C) or (N, C, 1, 1) times x, plus y."""

    def forward(self, a: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return a.reshape(*a.shape[:2], *(1,) * (x.dim() - 2)) * x + y
''',
    "Interp": '''
class Interp(nn.Module):
    """DeepLab's Interp: the crop (top, left, height, width) of x resized to ``size``,
    bilinear with the corners aligned."""

    def __init__(self, size: tuple[int, int], crop: tuple[int, int, int, int] | None = None
                 ) -> None:
        super().__init__()
        self.size, self.crop = size, crop

    def extra_repr(self) -> str:
        return f"size={self.size}" + ("" if self.crop is None else f", crop={self.crop}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.crop is not None:
            top, left, h, w = self.crop
            x = x[:, :, top:top + h, left:left + w]
        return F.interpolate(x, size=self.size, mode="bilinear", align_corners=True)
''',
    "UpsampleNearest": '''
class UpsampleNearest(nn.Module):
    """The YOLOv3 ports' Upsample: each value repeated into a scale x scale block."""

    def __init__(self, scale: int) -> None:
        super().__init__()
        self.scale = scale

    def extra_repr(self) -> str:
        return f"scale={self.scale}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        s = self.scale
        return x[:, :, :, None, :, None].expand(n, c, h, s, w, s).reshape(n, c, h * s, w * s)
''',
    "Normalize": '''
class Normalize(nn.Module):
    """SSD's Normalize: x / sqrt(sum of x^2 + eps) times a learned scale (one value, or one
    per channel); the sum over a whole sample, or over the channels at each position."""

    def __init__(self, shape: tuple[int, ...], across_spatial: bool = True,
                 eps: float = 1e-10) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.across_spatial, self.eps = across_spatial, eps

    def extra_repr(self) -> str:
        return f"across_spatial={self.across_spatial}, eps={self.eps}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        axes = tuple(range(1, x.dim())) if self.across_spatial else (1,)
        norm = torch.sqrt((x * x).sum(axes, keepdim=True) + self.eps)
        return x / norm * self.weight.reshape(*self.weight.shape, *(1,) * (x.dim() - 2))
''',
    "PriorBox": '''
class PriorBox(nn.Module):
    """SSD's PriorBox: its boxes depend on the shapes alone, so they are a stored constant
    (computed at export; another input size needs another export)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("boxes", torch.zeros(shape))

    def forward(self) -> torch.Tensor:
        return self.boxes
''',
}
# Helpers that others call.
_NEEDS = {"Scale": ["line_up"], "Bias": ["line_up"]}
_HELPER_ORDER = ["Pooling", "WithinChannelLRN", "Concat", "Eltwise", "line_up", "Scale",
                 "Bias", "Reshape", "Permute", "ShuffleChannel", "Axpy", "Interp",
                 "UpsampleNearest", "Normalize", "PriorBox"]


# -- names ---------------------------------------------------------------------------------
def identifier(name: str, taken: Iterable[str] = (), reserved: Iterable[str] = (),
               prefix: str = "layer") -> str:
    """``name`` as a Python identifier: other characters become '_', a leading digit or '_'
    gets ``prefix``, a keyword or a ``reserved`` name a trailing '_', a ``taken`` one a
    number ('inception_3a/1x1' -> 'inception_3a_1x1')."""
    base = re.sub(r"[^0-9A-Za-z_]", "_", name) or prefix
    if base[0].isdigit() or base[0] == "_":
        base = f"{prefix}_{base.lstrip('_')}".rstrip("_") or prefix
    if keyword.iskeyword(base) or base in set(reserved):
        base += "_"
    taken = set(taken)
    out, n = base, 1
    while out in taken:
        n += 1
        out = f"{base}_{n}"
    return out


def module_stem(net_name: str) -> str:
    """The file name (no suffix) for a net: its name as an identifier that shadows no module
    the generated source or its user imports."""
    stem = identifier(net_name or "net", prefix="net")
    if stem in sys.stdlib_module_names or stem in ("torch", "safetensors", "numpy"):
        stem += "_net"
    return stem


def _literal(text: str) -> str:
    """``text`` as a Python string literal, in double quotes where it can be."""
    r = repr(text)
    return f'"{r[1:-1]}"' if r[0] == "'" and '"' not in text else r


def _num(v: float) -> str:
    """A float32 field as the shortest literal that reads back as the same float32."""
    return repr(float(str(np.float32(v))))  # numpy's shortest digits, Python's spelling


def _tuple(items: Iterable[str]) -> str:
    """A tuple literal of already-formatted items."""
    items = list(items)
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _ints(values: Sequence[int]) -> str:
    """An int when every axis agrees (PyTorch's shorthand), else a tuple."""
    values = [int(v) for v in values]
    return str(values[0]) if len(set(values)) == 1 else str(tuple(values))


def _wrap(head: str, args: Sequence[str], tail: str, indent: int) -> list[str]:
    """``head + ', '.join(args) + tail`` (``head`` ends with an opening bracket) as lines of
    at most WIDTH columns where the arguments allow: continuation lines aligned after the
    bracket, or, where even that is too wide, indented 4 more on lines of their own."""
    one = " " * indent + head + ", ".join(args) + tail
    if len(one) <= WIDTH or not args:
        return [one]
    pieces = [a + ("," if i < len(args) - 1 else tail) for i, a in enumerate(args)]
    aligned = _fill(" " * indent + head, " " * (indent + len(head)), pieces)
    if all(len(line) <= WIDTH for line in aligned):
        return aligned
    return [" " * indent + head] + _fill("", " " * (indent + 4), pieces)


def _fill(first: str, hang: str, pieces: list[str]) -> list[str]:
    """``pieces`` joined by spaces, greedily, the first line starting with ``first`` (or a
    ``hang`` when empty) and the others with ``hang``."""
    lines, cur = [], first or hang
    for p in pieces:
        if cur.strip() and cur[-1] not in "([{" and len(cur) + 1 + len(p) > WIDTH:
            lines.append(cur)
            cur = hang + p
        else:
            cur += ("" if not cur.strip() or cur[-1] in "([{" else " ") + p
    return lines + [cur]


# -- the export ----------------------------------------------------------------------------
@dataclass
class TorchExport:
    """What ``net_to_pytorch`` makes: the module's source, its state_dict as numpy arrays,
    and how Caffe's names map to the module's."""

    stem: str
    source: str
    tensors: dict[str, np.ndarray]
    attributes: dict[str, str] = field(default_factory=dict)  # Caffe layer -> attribute
    inputs: list[str] = field(default_factory=list)  # Caffe blobs, forward's arguments
    outputs: list[str] = field(default_factory=list)  # Caffe blobs, forward's dict keys


class _Writer:
    """Walks the built net's layers in order: each layer becomes an attribute made in
    ``__init__`` and a line of ``forward``; an in-place layer reassigns its blob's variable."""

    def __init__(self, net: Net, origin: str):
        self.net = net
        self.origin = origin
        self.layers = net.builder.layers
        self.init: list[str] = []
        self.body: list[str] = []
        self.tensors: dict[str, np.ndarray] = {}
        self.helpers: list[str] = []
        self.attributes: dict[str, str] = {}  # Caffe layer name -> attribute
        self.vars: dict[str, str] = {}  # Caffe blob name -> its own local variable
        self.cur: dict[str, str] = {}  # Caffe blob name -> the variable holding it now
        self.args: list[str] = []  # forward's parameters
        self.inputs: list[str] = []
        self.tied: dict[Blob, str] = {}  # a parameter blob -> the first 'attr.key' holding it

    # -- names ------------------------------------------------------------------------
    def attribute(self, L: LayerBuild) -> str:
        attr = identifier(L.param.name, self.attributes.values(), _MODULE_NAMES)
        self.attributes[L.name] = attr
        return attr

    def var(self, blob: str) -> str:
        if blob not in self.vars:
            self.vars[blob] = identifier(blob, self.vars.values(), _LOCAL_NAMES, "blob")
        return self.vars[blob]

    def need(self, helper: str) -> None:
        for h in _NEEDS.get(helper, []) + [helper]:
            if h not in self.helpers:
                self.helpers.append(h)

    # -- emitting ---------------------------------------------------------------------
    def param(self, L: LayerBuild, k: int) -> np.ndarray:
        return np.array(self.net.dispatcher.array(L.params[k]), dtype=np.float32)

    def state(self, attr: str, key: str, value: np.ndarray, L: LayerBuild | None = None,
              k: int | None = None) -> None:
        """``attr.key`` of the state_dict; a Caffe parameter shared with an earlier layer in
        the same form is tied to it in ``__init__``, as in Caffe one tensor."""
        name = f"{attr}.{key}"
        self.tensors[name] = value
        if L is None or k is None:
            return
        blob = L.params[k]
        first = self.tied.get(blob)
        if first is None:
            self.tied[blob] = name
        elif self.tensors[first].shape == value.shape and np.array_equal(self.tensors[first],
                                                                         value):
            self.init.append(f"        self.{name} = self.{first}  # one Caffe parameter")

    def module(self, L: LayerBuild, cls: str, *args: str,
               call: Sequence[str] | None = None) -> str:
        """The layer's attribute, ``self.attr = cls(args)`` in ``__init__``, and its line of
        forward, ``top = self.attr(call)`` (default: the bottoms' variables); returns attr."""
        attr = self.attribute(L)
        if attr != L.param.name:
            self.init.append(f"        # Caffe layer {_literal(L.param.name)}")
        self.init.extend(_wrap(f"self.{attr} = {cls}(", args, ")", 8))
        call = [self.cur[b] for b in L.param.bottom] if call is None else call
        top = L.param.top[0]
        self.cur[top] = self.var(top)
        self.body.extend(_wrap(f"{self.cur[top]} = self.{attr}(", call, ")", 8))
        return attr

    # -- the walk ---------------------------------------------------------------------
    def run(self) -> tuple[str, list[str]]:
        with Progress(len(self.layers), "caffe_to_pytorch", unit="layer") as progress:
            for i, L in enumerate(self.layers):
                handler = _FORMS.get(facts(L.type).export)
                if handler is None:
                    raise _unsupported(L)
                handler(self, L)
                progress.update(i + 1)
        outputs = list(self.net.outputs)
        return self.source(outputs), outputs

    def source(self, outputs: list[str]) -> str:
        net_name, stem = _doc(self.net.model.name or "net"), module_stem(self.net.model.name)
        ins = ", ".join(self.args)
        data = self.net.builder.data
        shapes = {t: f"\n    {_doc(t)}: {tuple(data[t].shape)}" for t in self.inputs + outputs}
        intro = (f'"""Caffe net {net_name} ({_doc(self.origin)}) as a PyTorch module, written '
                 "by purine-caffe caffe_to_pytorch. Load it with its weights:")
        doc = [*_fill("", "", intro.split(" ")), "",
               "    from safetensors.torch import load_file", f"    from {stem} import Net", "",
               "    net = Net()", f'    net.load_state_dict(load_file("{stem}.safetensors"))',
               f"    outputs = net({ins})  # a dict: Caffe blob name -> tensor", "",
               "Inputs (shapes as the prototxt gives them; the batch size is free):"
               + "".join(shapes[t] for t in self.inputs),
               "Outputs (Caffe's: the blobs no layer reads, by name):"
               + "".join(shapes[t] for t in outputs), "",
               "The module starts in eval mode, Caffe's TEST phase: Dropout passes through, "
               "BatchNorm",
               "uses its stored statistics. Attributes are the Caffe layer names made "
               "identifiers; where",
               'they differ, a comment above the attribute gives the Caffe name."""', "",
               "import torch"]
        if {"Pooling", "WithinChannelLRN", "Interp"} & set(self.helpers):
            doc.append("import torch.nn.functional as F")
        doc.append("from torch import nn")
        helpers = [_HELPERS[h] for h in _HELPER_ORDER if h in self.helpers]
        keys = [_literal(o) for o in outputs]
        lines = doc + ["".join(helpers).rstrip("\n"), "", "",
                       "class Net(nn.Module):",
                       *_fill("    ", "    ", f'"""Caffe net {net_name}: forward({ins}) '
                              f'returns the dict of outputs {", ".join(_doc(o) for o in outputs)}'
                              '."""'.split(" ")), "",
                       "    def __init__(self) -> None:", "        super().__init__()",
                       *self.init, "        self.train(False)  # Caffe's TEST phase", ""]
        lines += _wrap("def forward(", ["self"] + [f"{a}: torch.Tensor" for a in self.args],
                       ") -> dict[str, torch.Tensor]:", 4)
        lines += self.body
        lines += _wrap("return {", [f"{k}: {self.cur[o]}" for k, o in zip(keys, outputs)],
                       "}", 8)
        return "\n".join(lines) + "\n"


def _doc(text: str) -> str:
    """``text`` as it may stand in a generated docstring or comment: one line, escaped."""
    return repr(text)[1:-1].replace('"', '\\"')


def _unsupported(L: LayerBuild, why: str = "") -> ConvertError:
    return unsupported(L, "PyTorch", supported(), why or _REFUSED.get(L.type, ""))


def supported() -> list[str]:
    """The layer types whose declared export form this exporter writes."""
    return types_with(lambda f: f.export in _FORMS)


def _axis(L: LayerBuild, axis: int, ndim: int) -> int:
    return axis_index(L, axis, ndim, "PyTorch")


# -- layer handlers ------------------------------------------------------------------------
def _input(w: _Writer, L: LayerBuild) -> None:
    for t in L.param.top:
        w.cur[t] = w.var(t)
        w.args.append(w.vars[t])
        w.inputs.append(t)


def _alias(w: _Writer, L: LayerBuild) -> None:
    # Split: every top is the bottom's tensor (an in-place layer on one top then writes a
    # variable of that top's own, leaving the others alone).
    for t in L.param.top:
        w.cur[t] = w.cur[L.param.bottom[0]]


def _silence(w: _Writer, L: LayerBuild) -> None:
    pass


def _convolution(w: _Writer, L: LayerBuild) -> None:
    p = L.param.convolution_param
    ndim = len(L.bottoms[0].shape)
    if _axis(L, p.axis, ndim) != 1:
        raise _unsupported(L, f"convolution_param.axis {p.axis}: PyTorch convolves with the "
                              "channels on axis 1 only")
    weight = w.param(L, 0)
    spatial = weight.ndim - 2
    if not 1 <= spatial <= 3:
        raise _unsupported(L, f"{spatial} spatial axes; PyTorch convolves over 1 to 3")
    deconv = L.type == "Deconvolution"
    # Caffe's (num_output, channels / group, k...) is Conv's layout; Deconvolution's
    # (channels, num_output / group, k...) is ConvTranspose's.
    channels, outputs = L.bottoms[0].shape[1], p.num_output
    # The depthwise types convolve each channel alone, group given or not (as they build).
    group = channels if L.type in _DEPTHWISE else p.group
    args = [str(channels), str(outputs), f"kernel_size={_ints(weight.shape[2:])}"]
    for name, default in (("stride", 1), ("pad", 0), ("dilation", 1)):
        values = spatial_values(L, p, name, spatial, default)
        if any(v != default for v in values):
            args.append(f"{'padding' if name == 'pad' else name}={_ints(values)}")
    if group != 1:
        args.append(f"groups={group}")
    if not p.bias_term:
        args.append("bias=False")
    kind = f"ConvTranspose{spatial}d" if deconv else f"Conv{spatial}d"
    attr = w.module(L, f"nn.{kind}", *args)
    w.state(attr, "weight", weight, L, 0)
    if p.bias_term:
        w.state(attr, "bias", w.param(L, 1), L, 1)


def _pooling(w: _Writer, L: LayerBuild) -> None:
    p = L.param.pooling_param
    if p.pool not in (_POOL.MAX, _POOL.AVE):
        raise _unsupported(L, f"pool {_POOL.PoolMethod.Name(p.pool)}")
    if len(L.param.top) > 1:
        raise _unsupported(L, "the argmax (second) top of MAX pooling; remove that top")
    args = [_literal(_POOL.PoolMethod.Name(p.pool))]
    if p.global_pooling:
        args.append("global_pooling=True")
    else:
        args += [f"kernel={pool_values(L, p, 'kernel', None)}",
                 f"stride={pool_values(L, p, 'stride', p.stride)}",
                 f"pad={pool_values(L, p, 'pad', p.pad)}"]
        if p.round_mode == _POOL.FLOOR:
            args.append("ceil=False")
    w.need("Pooling")
    w.module(L, "Pooling", *args)


def _lrn(w: _Writer, L: LayerBuild) -> None:
    p = L.param.lrn_param
    if len(L.bottoms[0].shape) != 4:
        raise _unsupported(L, f"bottom {L.bottoms[0].shape}: LRN here needs (N, C, H, W)")
    args = [str(p.local_size), f"alpha={_num(p.alpha)}", f"beta={_num(p.beta)}"]
    if p.norm_region == _LRN.ACROSS_CHANNELS:
        # Caffe's x / (k + alpha / size * sum of x^2 over size channels)^beta is PyTorch's
        # local_response_norm, for the odd sizes Caffe allows. PyTorch pads the channels by
        # half the window: one wider than the channels (2^31 cells) is cut to what reaches
        # them all, alpha scaled to keep Caffe's divisor.
        channels = L.bottoms[0].shape[1]
        if p.local_size > 2 * channels - 1:
            size = max(1, 2 * channels - 1)
            args[:2] = [str(size), f"alpha={p.alpha * size / p.local_size!r}"]
        w.module(L, "nn.LocalResponseNorm", *args, f"k={_num(p.k)}")
    else:
        w.need("WithinChannelLRN")
        w.module(L, "WithinChannelLRN", *args)


def _inner_product(w: _Writer, L: LayerBuild) -> None:
    p = L.param.inner_product_param
    shape = L.bottoms[0].shape
    axis = _axis(L, p.axis, len(shape))
    weight = w.param(L, 0)
    if p.transpose:  # Caffe keeps (K, num_output) then; nn.Linear (num_output, K)
        weight = np.ascontiguousarray(weight.T)
    x = w.cur[L.param.bottom[0]]
    # Caffe flattens the axes from ``axis`` into K and keeps those before it.
    arg = x if axis == len(shape) - 1 else f"{x}.flatten({axis})"
    args = [str(weight.shape[1]), str(weight.shape[0])] + ([] if p.bias_term else ["bias=False"])
    attr = w.module(L, "nn.Linear", *args, call=[arg])
    w.state(attr, "weight", weight, L, 0)
    if p.bias_term:
        w.state(attr, "bias", w.param(L, 1), L, 1)


def _relu(w: _Writer, L: LayerBuild) -> None:
    slope = L.param.relu_param.negative_slope
    if slope:
        w.module(L, "nn.LeakyReLU", _num(slope))
    else:
        w.module(L, "nn.ReLU")


def _prelu(w: _Writer, L: LayerBuild) -> None:
    slope = w.param(L, 0).reshape(-1)  # Caffe's shared slope is a 0-axis blob
    attr = w.module(L, "nn.PReLU", *([str(slope.size)] if slope.size != 1 else []))
    w.state(attr, "weight", slope, L, 0)


def _elu(w: _Writer, L: LayerBuild) -> None:
    w.module(L, "nn.ELU", _num(L.param.elu_param.alpha))


def _fixed(cls: str) -> Callable[[_Writer, LayerBuild], None]:
    def handler(w: _Writer, L: LayerBuild) -> None:
        w.module(L, cls)
    return handler


def _dropout(w: _Writer, L: LayerBuild) -> None:
    # Caffe's Dropout is the identity outside TRAIN; so is nn.Dropout in eval mode, and in
    # train mode both keep a unit's value at 1 / (1 - ratio).
    w.module(L, "nn.Dropout", _num(L.param.dropout_param.dropout_ratio))


def _softmax(w: _Writer, L: LayerBuild) -> None:
    axis = _axis(L, L.param.softmax_param.axis, len(L.bottoms[0].shape))
    w.module(L, "nn.Softmax", str(axis))


def _concat(w: _Writer, L: LayerBuild) -> None:
    p = L.param.concat_param
    ndim = len(L.bottoms[0].shape)
    axis = p.concat_dim if p.HasField("concat_dim") else _axis(L, p.axis, ndim)
    w.need("Concat")
    w.module(L, "Concat", *([] if axis == 1 else [str(axis)]))


def _eltwise(w: _Writer, L: LayerBuild) -> None:
    p = L.param.eltwise_param
    args = [_literal(_ELTWISE.EltwiseOp.Name(p.operation))]
    if p.operation == _ELTWISE.SUM:
        coeffs = [float(c) for c in p.coeff] or [1.0] * len(L.bottoms)
        args.append(_tuple(_num(c) for c in coeffs))
    w.need("Eltwise")
    w.module(L, "Eltwise", *args)


def _trailing(L: LayerBuild, axis: int, operand: tuple[int, ...]) -> int:
    """Axes of bottom 0 after an operand of shape ``operand`` applied from ``axis`` (a
    scalar operand from axis 0, as in Caffe)."""
    ndim = len(L.bottoms[0].shape)
    start = _axis(L, axis, ndim) if operand else 0
    return ndim - start - len(operand)


def _scale(w: _Writer, L: LayerBuild) -> None:
    p = L.param.scale_param
    two = len(L.bottoms) == 2
    shape = tuple(L.bottoms[1].shape) if two else tuple(L.params[0].shape)
    bias_k = 0 if two else 1
    bias = tuple(L.params[bias_k].shape) if p.bias_term else None
    w.need("Scale")
    attr = w.module(L, "Scale", str(None if two else shape), f"bias={bias}",
                    f"trailing={_trailing(L, p.axis, shape)}")
    if not two:
        w.state(attr, "weight", w.param(L, 0), L, 0)
    if p.bias_term:
        w.state(attr, "bias", w.param(L, bias_k), L, bias_k)


def _bias(w: _Writer, L: LayerBuild) -> None:
    p = L.param.bias_param
    two = len(L.bottoms) == 2
    shape = tuple(L.bottoms[1].shape) if two else tuple(L.params[0].shape)
    w.need("Bias")
    attr = w.module(L, "Bias", str(None if two else shape),
                    f"trailing={_trailing(L, p.axis, shape)}")
    if not two:
        w.state(attr, "bias", w.param(L, 0), L, 0)


def _batch_norm(w: _Writer, L: LayerBuild) -> None:
    p = L.param.batch_norm_param
    shape = L.bottoms[0].shape
    if not 2 <= len(shape) <= 5:
        raise _unsupported(L, f"bottom {shape}: PyTorch's BatchNorm takes 2 to 5 axes")
    kind = f"nn.BatchNorm{max(1, len(shape) - 2)}d"
    c = shape[1]
    if p.HasField("use_global_stats") and not p.use_global_stats:
        # Each batch's own statistics, in eval mode too: PyTorch's without running stats.
        w.module(L, kind, str(c), f"eps={_num(p.eps)}", "affine=False",
                 "track_running_stats=False")
        return
    mean_sum, var_sum, factor = (w.param(L, k) for k in range(3))
    # Caffe keeps sums and their moving-average weight; a weight of 0 means statistics of 0.
    f = np.float32(0.0 if factor.ravel()[0] == 0 else 1.0 / factor.ravel()[0])
    # PyTorch's momentum is the weight of a new batch: 1 - Caffe's moving_average_fraction.
    momentum = repr(float(1 - Decimal(_num(p.moving_average_fraction))))
    attr = w.module(L, kind, str(c), f"eps={_num(p.eps)}", f"momentum={momentum}",
                    "affine=False")
    w.state(attr, "running_mean", mean_sum.reshape(c) * f)
    w.state(attr, "running_var", var_sum.reshape(c) * f)
    w.state(attr, "num_batches_tracked", np.array(0, dtype=np.int64))


def _flatten(w: _Writer, L: LayerBuild) -> None:
    p = L.param.flatten_param
    ndim = len(L.bottoms[0].shape)
    start, end = _axis(L, p.axis, ndim), _axis(L, p.end_axis, ndim)
    default = (start, end) == (1, ndim - 1)  # nn.Flatten's own
    w.module(L, "nn.Flatten", *([] if default else [str(start), str(end)]))


def _reshape(w: _Writer, L: LayerBuild) -> None:
    p = L.param.reshape_param
    ndim = len(L.bottoms[0].shape)
    start = p.axis if p.axis >= 0 else ndim + p.axis + 1
    end = ndim if p.num_axes == -1 else start + p.num_axes
    w.need("Reshape")
    w.module(L, "Reshape", str(tuple(p.shape.dim)), f"start={start}", f"end={end}")


# -- the forks' layers ---------------------------------------------------------------------
_DEPTHWISE = ("ConvolutionDepthwise", "DepthwiseConvolution")


def _order(L: LayerBuild) -> list[int]:
    """Permute's whole axis order: the axes it names, then the others in their order."""
    named = list(L.param.permute_param.order)
    return named + [i for i in range(len(L.bottoms[0].shape)) if i not in named]


def _permute(w: _Writer, L: LayerBuild) -> None:
    order = _order(L)
    if order == sorted(order):  # the builder names the bottom's blob: so does the module
        _alias(w, L)
        return
    w.need("Permute")
    w.module(L, "Permute", str(tuple(order)))


def _shuffle_channel(w: _Writer, L: LayerBuild) -> None:
    w.need("ShuffleChannel")
    w.module(L, "ShuffleChannel", str(L.param.shuffle_channel_param.group))


def _axpy(w: _Writer, L: LayerBuild) -> None:
    w.need("Axpy")
    w.module(L, "Axpy")


def _interp(w: _Writer, L: LayerBuild) -> None:
    p = L.param.interp_param
    h, wd = L.bottoms[0].shape[2:]
    args = [str(tuple(w.net.builder.data[L.param.top[0]].shape[2:]))]
    if p.pad_beg or p.pad_end:  # both <= 0: the part of the input that is resized
        crop = (-p.pad_beg, -p.pad_beg, h + p.pad_beg + p.pad_end, wd + p.pad_beg + p.pad_end)
        args.append(f"crop={crop}")
    w.need("Interp")
    # A second bottom gives only the size: the call reads the first.
    w.module(L, "Interp", *args, call=[w.cur[L.param.bottom[0]]])


def _upsample(w: _Writer, L: LayerBuild) -> None:
    if len(L.bottoms) == 2:
        raise _unsupported(L, "the SegNet form (a mask bottom) puts each value where a MAX "
                              "Pooling's argmax top says, and that top is not exported; only "
                              "the one-bottom nearest-neighbour Upsample is")
    w.need("UpsampleNearest")
    w.module(L, "UpsampleNearest", str(L.param.upsample_param.scale))


def _normalize(w: _Writer, L: LayerBuild) -> None:
    p = L.param.norm_param
    scale = w.param(L, 0)
    w.need("Normalize")
    attr = w.module(L, "Normalize", str(tuple(scale.shape)),
                    f"across_spatial={p.across_spatial}", f"eps={_num(p.eps)}")
    w.state(attr, "weight", scale, L, 0)


def _prior_box(w: _Writer, L: LayerBuild) -> None:
    # The boxes follow from shapes and parameters: the layer's own kernel computes them here.
    value = computed_top(L)
    w.need("PriorBox")
    attr = w.module(L, "PriorBox", str(value.shape), call=[])
    w.state(attr, "boxes", value)


_REFUSED = {
    "DetectionOutput": "the fork's per-class top_k, NMS (with eta's shrinking threshold) and "
                       "keep_top_k across classes give a data-dependent number of rows; torch "
                       "has no NMS op (torchvision's is another package and keeps no top_k "
                       "or eta); export the net up to the loc, conf and prior blobs",
    "Proposal": "py-faster-rcnn's NMS (+1 pixel widths, rows padded to post_nms_topn) has no "
                "torch op",
    "ROIPooling": "torch has no ROI pooling op (torchvision.ops.roi_pool rounds as Fast "
                  "R-CNN, but the generated module imports torch alone)",
    "PSROIPooling": "torch has no position-sensitive ROI pooling op",
}


# The export forms (a layer type declares its form where it is registered) written here;
# a data layer is an input of the deploy net.
_FORMS: dict[str, Callable[[_Writer, LayerBuild], None]] = {
    "input": _input, "data": _input, "split": _alias, "silence": _silence,
    "convolution": _convolution, "pooling": _pooling, "lrn": _lrn,
    "inner_product": _inner_product, "relu": _relu, "prelu": _prelu, "elu": _elu,
    "sigmoid": _fixed("nn.Sigmoid"), "tanh": _fixed("nn.Tanh"), "dropout": _dropout,
    "softmax": _softmax, "concat": _concat, "eltwise": _eltwise, "scale": _scale,
    "bias": _bias, "batch_norm": _batch_norm, "flatten": _flatten, "reshape": _reshape,
    "relu6": _fixed("nn.ReLU6"), "mish": _fixed("nn.Mish"), "permute": _permute,
    "shuffle_channel": _shuffle_channel, "axpy": _axpy, "interp": _interp,
    "upsample": _upsample, "normalize": _normalize, "prior_box": _prior_box,
}


# -- safetensors, written with numpy --------------------------------------------------------
_DTYPES = {np.dtype("<f4"): "F32", np.dtype("<i8"): "I64"}


def safetensors_chunks(tensors: Mapping[str, np.ndarray],
                       metadata: Mapping[str, str] | None = None) -> list[bytes | memoryview]:
    """The bytes of a .safetensors file: an 8-byte little-endian header length, a JSON
    header (per tensor its dtype, shape and [begin, end) offsets into the data; optional
    ``__metadata__`` of strings), padded with spaces to 8 bytes, then the tensors' data,
    contiguous and little-endian. Wider dtypes come first, so every tensor is aligned."""
    arrays = {}
    for name, a in tensors.items():
        a = np.asarray(a)
        dt = np.dtype(a.dtype).newbyteorder("<")
        if dt not in _DTYPES:
            raise ConvertError(f"safetensors: tensor '{name}' has dtype {a.dtype}; "
                               "F32 and I64 are written")
        arrays[name] = np.asarray(a, dtype=dt, order="C")  # 0-axis arrays stay so
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    order = sorted(arrays, key=lambda n: -arrays[n].dtype.itemsize)  # stable: keeps order
    offset = 0
    for name in order:
        a = arrays[name]
        header[name] = {"dtype": _DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little"), text] + [arrays[n].reshape(-1).data
                                                      for n in order]


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (float32 or int64 arrays by name) as a .safetensors file."""
    atomic_write(path, safetensors_chunks(tensors, metadata))


# -- entry points --------------------------------------------------------------------------
def net_to_pytorch(net: Net, origin: str = "") -> TorchExport:
    """The PyTorch module source and state_dict of a built net with its current parameters
    (build it in phase TEST: Dropout is then the identity, BatchNorm uses stored
    statistics). ``origin`` says where the net came from, for the module's docstring."""
    w = _Writer(net, origin or "a Caffe prototxt")
    source, outputs = w.run()
    return TorchExport(module_stem(net.model.name), source, w.tensors, w.attributes,
                       w.inputs, outputs)


def caffe_to_pytorch(model: str | os.PathLike | pb.NetParameter, weights: str | os.PathLike,
                     out_dir: str | os.PathLike, *, phase: int = pb.TEST, level: int = 0,
                     stages: Sequence[str] = ()) -> TorchExport:
    """Export deploy net ``model`` with the parameters of caffemodel ``weights`` as
    ``out_dir/<net name>.py`` and ``out_dir/<net name>.safetensors``. ``phase``, ``level``
    and ``stages`` pick the layers by their include/exclude rules, as for ``Net``; the
    module computes Caffe's TEST arithmetic whatever the phase."""
    from purine.caffe.net import Net

    origin = "a NetParameter" if isinstance(model, pb.NetParameter) else \
        os.path.basename(os.fspath(model))
    origin += f" + {os.path.basename(os.fspath(weights))}"
    state = _state(phase, level, stages)
    if state:  # the default (TEST, level 0, no stage) is left unsaid
        origin += f", {state}"
    with Net(model, phase=phase, level=level, stages=stages) as net:  # closed after: a
        copy_every_layer(net, weights)                                # data layer's too
        export = net_to_pytorch(net, origin)
    try:
        os.makedirs(out_dir, exist_ok=True)
        base = os.path.join(out_dir, export.stem)
        write_safetensors(base + ".safetensors", export.tensors,
                          {"format": "pt", "source": "purine-caffe caffe_to_pytorch"})
        atomic_write(base + ".py", export.source.encode())
    except OSError as e:
        raise ConvertError(f"{os.fspath(out_dir)}: cannot write: {e.strerror}") from None
    return export


def _state(phase: int, level: int, stages: Sequence[str]) -> str:
    """The NetState that picked the layers, in words; '' for the default."""
    words = [f"phase {pb.Phase.Name(phase)}"] if phase != pb.TEST else []
    words += [f"level {level}"] if level else []
    words += [f"stages {','.join(stages)}"] if stages else []
    return ", ".join(words)


# -- the command ---------------------------------------------------------------------------
# What loads the output: the module imports torch, its weights load with safetensors.
LOAD_WITH = "pip install torch safetensors"


def _phase(text: str) -> int:
    name = text.upper()
    if name not in ("TRAIN", "TEST"):
        raise argparse.ArgumentTypeError(f"expected TRAIN or TEST, got '{text}'")
    return pb.Phase.Value(name)


def _level(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if not -(2 ** 31) <= value < 2 ** 31:  # NetState.level is an int32
        raise argparse.ArgumentTypeError(f"expected a 32-bit integer, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``caffe_to_pytorch --model DEPLOY.prototxt --weights W.caffemodel [--phase P]
    [--level L] [--stage S,...] OUT_DIR``."""
    if parser.description is None:
        parser.description = ("Export a deploy net and its weights as a PyTorch module "
                              "(OUT_DIR/<net name>.py) and .safetensors weights; loading "
                              f"them needs PyTorch and safetensors ({LOAD_WITH}). "
                              "Supported layers: " + ", ".join(supported()) + ".")
    flag(parser, "model", required=True, help="the deploy prototxt (Input layers)")
    flag(parser, "weights", required=True, help="the .caffemodel with the parameters")
    flag(parser, "phase", type=_phase, default=pb.TEST, metavar="TRAIN|TEST",
         help="NetState phase that picks the layers (default TEST)")
    flag(parser, "level", type=_level, default=0, help="NetState level (default 0)")
    flag(parser, "stage", default=None, help="comma-separated NetState stages")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write to")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    stages = [s for s in (args.stage or "").split(",") if s]
    ex = caffe_to_pytorch(args.model, args.weights, args.out_dir, phase=args.phase,
                          level=args.level, stages=stages)
    base = os.path.join(args.out_dir, ex.stem)
    state = _state(args.phase, args.level, stages)
    print(f"{args.model} + {args.weights} -> {base}.py, {base}.safetensors: "
          f"{len(ex.attributes)} layers, {len(ex.tensors)} tensors, inputs "
          f"{', '.join(ex.inputs)}, outputs {', '.join(ex.outputs)}"
          f"{f' ({state})' if state else ''}; load them with PyTorch and safetensors "
          f"({LOAD_WITH})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("caffe_to_pytorch", add_arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
