"""What the exporters of a deploy net share: its parameters copied from a caffemodel that
must hold every layer's."""

from __future__ import annotations

import os
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
