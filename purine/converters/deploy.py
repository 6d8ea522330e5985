"""What the exporters of a deploy net share: its parameters copied from a caffemodel that
must hold every layer's, and the convolution and pooling fields as Caffe reads them."""

from __future__ import annotations

import os
from typing import Any

from purine.converters import ConvertError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import read_caffemodel


def copy_every_layer(net: Any, weights: str | os.PathLike) -> None:
    """``net.copy_from(weights)``, refused when the file lacks a layer's parameters: Caffe's
    copy keeps the fillers' values for such a layer, an export must not."""
    stored = read_caffemodel(weights)
    in_file = {lp.name for lp in list(stored.layer) + list(stored.layers) if lp.blobs}
    missing = [name for name in net.params if name not in in_file]
    if missing:
        raise ConvertError(f"{os.fspath(weights)}: no parameters for layer(s) "
                           f"{', '.join(missing)} of the net")
    net.copy_from(weights)


def conv_values(p: pb.ConvolutionParameter, name: str, spatial: int, default: int
                 ) -> list[int]:
    """stride / pad / dilation as Caffe reads them: the _h/_w pair, else the repeated
    field once or per axis, else ``default`` (the builder has checked them)."""
    if name != "dilation" and (p.HasField(f"{name}_h") or p.HasField(f"{name}_w")):
        return [getattr(p, f"{name}_h"), getattr(p, f"{name}_w")]
    values = list(getattr(p, name))
    if not values:
        return [default] * spatial
    return [values[0 if len(values) == 1 else i] for i in range(spatial)]


def pool_values(p: pb.PoolingParameter, name: str, default: int) -> tuple[int, int]:
    field = "kernel_size" if name == "kernel" else name
    if p.HasField(f"{name}_h"):
        return getattr(p, f"{name}_h"), getattr(p, f"{name}_w")
    value = getattr(p, field) if p.HasField(field) else default
    return value, value
