"""What the exporters of a deploy net share: its parameters copied from a caffemodel that
must hold every layer's, and the one-line refusal of a layer the target cannot express."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

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
    or the types the exporter supports and, for a train net's layers, what to export."""
    head = f"layer '{L.param.name}' (type {L.type}): no exact {target} form"
    if why:
        return ConvertError(f"{head}: {why}")
    hint = ""
    if L.type in DATA_TYPES:
        hint = "; export a deploy prototxt whose inputs are Input layers"
    elif "Loss" in L.type or L.type == "Accuracy":
        hint = "; export a deploy prototxt, without loss and accuracy layers"
    return ConvertError(f"{head} (supported: {', '.join(sorted(supported))}){hint}")


def axis_index(L: Any, axis: int, ndim: int, target: str) -> int:
    """Caffe's axis (negative counts from the end) as an index, or the exporter's error."""
    if not -ndim <= axis < ndim:
        raise unsupported(L, target, (), f"axis {axis} is out of range for {ndim} axes")
    return axis % ndim
