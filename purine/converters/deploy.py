"""What the exporters of a deploy net share: its parameters copied from a caffemodel that
must hold every layer's, and the one-line refusal of a layer the target cannot express."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from purine.caffe.facts import facts
from purine.converters import ConvertError


def copy_every_layer(net: Any, weights: str | os.PathLike) -> None:
    """``net.copy_from(weights)``, refused when the file lacks a layer's parameters: Caffe's
    copy keeps the fillers' values for such a layer, an export must not."""
    copied = net.copy_from(weights)
    missing = [name for name in net.params if name not in copied]
    if missing:
        raise ConvertError(f"{os.fspath(weights)}: no parameters for layer(s) "
                           f"{', '.join(missing)} of the net")


# Layer types that feed a train net: a deploy net has Input layers in their place.
DATA_TYPES = frozenset({"Data", "ImageData", "HDF5Data", "MemoryData", "DummyData",
                        "WindowData"})


def unsupported(L: Any, target: str, supported: Iterable[str], why: str = "") -> ConvertError:
    """The error for layer ``L`` that has no exact ``target`` (ONNX, PyTorch) form: ``why``,
    or the types the exporter supports and, for a train net's layers, what to export. A
    fork's layer type names its fork (both as the layer's facts declare)."""
    declared = facts(L.type)
    fork = f", from {declared.fork}" if declared.fork else ""
    head = f"layer '{L.param.name}' (type {L.type}{fork}): no exact {target} form"
    why = why or declared.train_only
    if why:
        return ConvertError(f"{head}: {why}")
    hint = ""
    if L.type in DATA_TYPES:
        hint = "; export a deploy prototxt whose inputs are Input layers"
    elif "Loss" in L.type or L.type == "Accuracy":
        hint = "; export a deploy prototxt, without loss and accuracy layers"
    return ConvertError(f"{head} (supported: {', '.join(sorted(supported))}){hint}")


def computed_top(L: Any) -> np.ndarray:
    """Top 0 of a layer whose output depends on shapes and parameters alone (PriorBox), as
    float32: its own forward kernel run on the host over zero-filled bottoms it ignores."""
    top = L.tops[0]
    value = np.zeros(top.shape, np.float32)
    (op,) = [o for o in L.forward_ops if top in o.outputs]
    op.kernel([np.zeros(b.shape, np.float32) for b in op.inputs], [value])
    return value


def axis_index(L: Any, axis: int, ndim: int, target: str) -> int:
    """Caffe's axis (negative counts from the end) as an index, or the exporter's error."""
    if not -ndim <= axis < ndim:
        raise unsupported(L, target, (), f"axis {axis} is out of range for {ndim} axes")
    return axis % ndim
