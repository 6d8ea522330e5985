"""Array kernels of the Caffe forks, forward and backward side by side: ShuffleNet's channel
shuffle (a transpose of the channel axis seen as groups × members) and SENet's Axpy
(a per-channel scale of one blob added to another)."""

from __future__ import annotations

import math
from typing import Any

from purine.backend import get_array_module

Array = Any


# -- ShuffleChannel -------------------------------------------------------------------------
def shuffle_channel(x: Array, y: Array, *, group: int) -> None:
    """y[:, j·group + i] = x[:, i·(C/group) + j]: the channels, read as a (group, C/group)
    grid, transposed. Its inverse is the same shuffle with C/group groups, which is the
    backward pass."""
    if x.size == 0:  # an empty axis (C = 0 too, whose backward has 0 groups): nothing moves
        return
    n, c = x.shape[:2]
    size = math.prod(x.shape[2:])  # explicit: an empty batch has no -1 to infer
    grid = x.reshape(n, group, c // group, size)
    y.reshape(n, c // group, group, size)[...] = grid.transpose(0, 2, 1, 3)


# -- Axpy -----------------------------------------------------------------------------------
def _per_channel(a: Array, ndim: int) -> Array:
    """The (N, C) scale (given as (N, C) or (N, C, 1, 1)) broadcast over (N, C, ...)."""
    return a.reshape(a.shape[:2] + (1,) * (ndim - 2))


def axpy_forward(a: Array, x: Array, y_in: Array, top: Array) -> None:
    """top = a[n, c] · x + y_in; ``top`` may be ``y_in`` (in place)."""
    xp = get_array_module(x)
    scaled = _per_channel(a, x.ndim) * x
    xp.add(scaled, y_in, out=top)


def axpy_backward_scale(x: Array, dtop: Array, da: Array) -> None:
    """da[n, c] = Σ over the spatial positions of dtop · x."""
    n, c = x.shape[:2]
    da.reshape(n, c)[...] = (dtop * x).reshape(n, c, math.prod(x.shape[2:])).sum(axis=2)


def axpy_backward_x(a: Array, dtop: Array, dx: Array) -> None:
    """dx = a[n, c] · dtop."""
    get_array_module(dtop).multiply(dtop, _per_channel(a, dtop.ndim), out=dx)
