"""pycaffe's ``caffe.coord_map``: where a pixel of one net_spec top lies in another. Each
spatial layer maps its bottom's coordinates to its top's by ``y = a * x + b`` per spatial axis;
composing these along the net relates any two connected tops, and ``crop`` turns the relation
into the Crop layer that aligns an upsampled top with a reference top (FCN's skip layers)."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from google.protobuf.message import Message

from purine.errors import PurineError
from purine.formats.prototxt import is_repeated
from purine.pycaffe.net_spec import Function, Top, layers

__all__ = ["AxisMismatchException", "CoordMapError", "CropError", "PASS_THROUGH_LAYERS",
           "UnconnectedTopsError", "UndefinedMapException", "compose", "conv_params",
           "coord_map", "coord_map_from_to", "crop", "crop_params", "inverse"]

# (axis, a, b): coordinates along the axes after ``axis`` map as y = a * x + b; ``a`` and ``b``
# are numbers or arrays of one value per axis. axis None: a map that holds on every axis.
Map = tuple[int | None, Any, Any]

IDENTITY: Map = (None, 1, 0)

# Layers whose top pixel i is computed from bottom pixel i alone (Caffe's list).
PASS_THROUGH_LAYERS = ["AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU",
                       "Log", "LRN", "Exp", "MVN", "Power", "ReLU", "PReLU", "Scale",
                       "Sigmoid", "Split", "TanH", "Threshold"]

# Window layers: the top pixel sits at the centre of its kernel window.
WINDOW_LAYERS = ("Convolution", "Pooling", "Im2col")


class CoordMapError(PurineError):
    """A coordinate map that cannot be worked out: names the layer type and why."""


class UndefinedMapException(CoordMapError):
    """A layer type whose top pixels have no position in its bottom (InnerProduct, global
    pooling, ...): the walk between tops does not pass through it."""


class AxisMismatchException(CoordMapError):
    """Two maps that start at different axes cannot be composed."""


class UnconnectedTopsError(CoordMapError, RuntimeError):
    """Two tops with no common ancestor through mappable layers (a RuntimeError, as
    Caffe's coord_map raises)."""


class CropError(CoordMapError, AssertionError):
    """A crop that cannot align the tops: scales differ, or the offset is negative or
    fractional (an AssertionError, as Caffe's ``crop`` asserts)."""


def _settings(fn: Function, message: str) -> dict[str, Any]:
    """The keywords that net_spec routes into ``message`` (``convolution_param`` ...): the
    layer's own keywords, overridden by those of an explicit ``message=dict(...)``."""
    merged = {k: v for k, v in fn.params.items() if not k.endswith("param")}
    given = fn.params.get(message)
    if isinstance(given, Message):
        given = {f.name: (list(v) if is_repeated(f) else v)
                 for f, v in given.ListFields()}
    if isinstance(given, dict):
        merged.update(given)
    return merged


def _per_axis(p: dict[str, Any], name: str, default: int | None) -> np.ndarray | None:
    """``name`` as an array of one value per spatial axis: the field itself (one value for
    every axis, or a list), else the legacy 2-D pair (``kernel_h``/``kernel_w`` for
    ``kernel_size``), else ``default``."""
    if name in p:
        return np.array(p[name], ndmin=1)
    legacy = name.removesuffix("_size")
    h, w = p.get(f"{legacy}_h"), p.get(f"{legacy}_w")
    if h is not None or w is not None:
        fallback = default if default is not None else 0
        return np.array([fallback if h is None else h, fallback if w is None else w])
    return None if default is None else np.array(default, ndmin=1)


def _who(fn: Function) -> str:
    name = fn.params.get("name")
    return f"{fn.type_name} layer '{name}'" if name else f"{fn.type_name} layer"


def conv_params(fn: Function) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """``(axis, stride, extent, pad)`` of a Convolution, Deconvolution, Im2col or Pooling
    layer, one value per spatial axis (or one for all); ``extent`` is the kernel's span in the
    input, ``(kernel_size - 1) * dilation + 1``. Legacy ``_h``/``_w`` fields are read too."""
    pooling = fn.type_name == "Pooling"
    p = _settings(fn, "pooling_param" if pooling else "convolution_param")
    if pooling and p.get("global_pooling"):
        raise UndefinedMapException(f"{_who(fn)}: global pooling keeps no pixel positions")
    kernel = _per_axis(p, "kernel_size", None)
    if kernel is None:
        raise CoordMapError(f"{_who(fn)}: no kernel_size (or kernel_h and kernel_w) to map "
                            "coordinates through")
    dilation = np.array(1 if pooling else p.get("dilation", 1), ndmin=1)
    stride = _per_axis(p, "stride", 1)
    pad = _per_axis(p, "pad", 0)
    # Pooling has no axis field: its spatial axes always follow the channel axis.
    axis = 1 if pooling else int(p.get("axis", 1))
    return axis, stride, (kernel - 1) * dilation + 1, pad


def crop_params(fn: Function) -> tuple[int, np.ndarray]:
    """``(axis, offset)`` of a Crop layer, with Caffe's defaults (axis 2, offset 0)."""
    p = _settings(fn, "crop_param")
    return int(p.get("axis", 2)), np.array(p.get("offset", 0), ndmin=1)


def coord_map(fn: Function) -> Map:
    """The map from a layer's bottom coordinates to its top's, ``(axis, a, b)``: a window
    layer's top pixel y is centred on bottom pixel ``y * stride - pad + (extent - 1) / 2``,
    so ``a = 1 / stride``, ``b = (pad - (extent - 1) / 2) / stride``; Deconvolution is the
    inverse of that; Crop shifts by ``-offset``; pass-through layers are the identity."""
    kind = fn.type_name
    if kind in WINDOW_LAYERS:
        axis, stride, extent, pad = conv_params(fn)
        return axis, 1 / stride, (pad - (extent - 1) / 2) / stride
    if kind == "Deconvolution":
        axis, stride, extent, pad = conv_params(fn)
        return axis, stride, (extent - 1) / 2 - pad
    if kind == "Crop":
        axis, offset = crop_params(fn)
        # Maps name the axis before the first mapped one, as Convolution's axis does.
        return axis - 1, 1, -offset
    if kind in PASS_THROUGH_LAYERS:
        return IDENTITY
    raise UndefinedMapException(f"{kind} layers have no coordinate map")


def compose(base_map: Map, next_map: Map) -> Map:
    """``base_map`` after ``next_map``: ``x -> a1 * (a2 * x + b2) + b1``."""
    ax1, a1, b1 = base_map
    ax2, a2, b2 = next_map
    if ax1 is not None and ax2 is not None and ax1 != ax2:
        raise AxisMismatchException(f"cannot compose a map from axis {ax2} with one from "
                                    f"axis {ax1}")
    return (ax2 if ax1 is None else ax1), a1 * a2, a1 * b2 + b1


def inverse(coord_map: Map) -> Map:
    """The map back: ``y -> (y - b) / a``."""
    ax, a, b = coord_map
    return ax, 1 / a, -b / a


def _mappable_bottoms(top: Top) -> tuple[Top, ...]:
    # A Crop's second bottom only lends its shape: its pixels do not move into the top.
    inputs = top.fn.inputs
    return inputs[:1] if top.fn.type_name == "Crop" else inputs


def _ancestors(top: Top) -> dict[Top, Map]:
    """``top`` and every top it is computed from through mappable layers, nearest first, each
    with the map from its coordinates to ``top``'s."""
    maps = {top: IDENTITY}
    queue = deque([top])
    while queue:
        t = queue.popleft()
        try:
            step = coord_map(t.fn)
        except UndefinedMapException:
            continue  # the walk stops at layers that scramble positions
        for bottom in _mappable_bottoms(t):
            if bottom not in maps:
                maps[bottom] = compose(maps[t], step)
                queue.append(bottom)
    return maps


def coord_map_from_to(top_from: Top, top_to: Top) -> Map:
    """The map ``(axis, a, b)`` taking a coordinate of ``top_from`` to that of ``top_to``
    (``to = a * from + b``), through the nearest top both are computed from. Raises
    UnconnectedTopsError (a RuntimeError) when they share none."""
    from_maps = _ancestors(top_from)
    for top, to_map in _ancestors(top_to).items():
        if top in from_maps:
            return compose(to_map, inverse(from_maps[top]))
    raise UnconnectedTopsError("coord_map: the two tops share no input through spatial "
                               "or pass-through layers; are they connected?")


def crop(top_from: Top, top_to: Top) -> Top:
    """A Crop layer (net_spec) that cuts ``top_from`` to ``top_to``'s size, aligned pixel for
    pixel; raises CropError (an AssertionError) when their scales differ or the offset would
    be negative or fractional."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    # Maps are built in floating point (a stride of 3 gives thirds): compare with a tolerance.
    if not np.allclose(a, 1, rtol=0, atol=1e-9):
        raise CropError(f"crop: the tops differ in scale (a = {a}); crop needs a = 1")
    if np.any(b > 1e-9):
        raise CropError(f"crop: the reference top reaches outside the cropped one (b = {b}); "
                        "crop needs b <= 0")
    offset = np.round(-b)
    if not np.allclose(offset, -b, rtol=0, atol=1e-9):
        raise CropError(f"crop: the offset is not a whole number of pixels (b = {b})")
    # With no spatial layer between them (axis None) the tops are aligned from axis 2 on.
    axis = 2 if ax is None else ax + 1
    return layers.Crop(top_from, top_to,
                       crop_param=dict(axis=axis, offset=[int(v) for v in offset.ravel()]))
