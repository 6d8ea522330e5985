"""Caffe's Im2col layer: every kernel window of an N-d image laid out as channels, in Caffe's
order, and its adjoint col2im; strided views over a padded copy, written once over numpy and
CuPy. (The convolution's own column layouts live in conv.py.)"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from purine.backend import get_array_module

Array = Any

@dataclass(frozen=True)
class Im2colGeometry:
    """Input (num, channels, *size) to output (num, channels * prod(kernel), *out): output
    channel (c, k_1, ..., k_d) in row-major order holds input channel c at kernel offset
    (k_1, ..., k_d) of each window, as Caffe's im2col and im2col_nd order them."""

    num: int
    channels: int
    size: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    pad: tuple[int, ...]
    dilation: tuple[int, ...]

    @property
    def out(self) -> tuple[int, ...]:
        return tuple((n + 2 * p - (d * (k - 1) + 1)) // s + 1 for n, k, s, p, d in zip(
            self.size, self.kernel, self.stride, self.pad, self.dilation, strict=True))

    @property
    def padded(self) -> tuple[int, ...]:
        return tuple(n + 2 * p for n, p in zip(self.size, self.pad, strict=True))

    def workspace_bytes(self, itemsize: int) -> int:
        """The scratch of a forward or backward op, in bytes of ``itemsize``: one padded copy
        of the input (the backward pass's accumulator); checked when the layer is built."""
        return self.num * self.channels * math.prod(self.padded) * itemsize

    @property
    def empty(self) -> bool:
        """No image (an empty batch, no channel): the ops return at once, without a loop
        over the kernel offsets, which a kernel of 2^30 rows would make endless."""
        return self.num * self.channels == 0

    def inner(self) -> tuple[slice, ...]:
        """The image inside a padded copy."""
        return (slice(None), slice(None)) + tuple(
            slice(p, p + n) for n, p in zip(self.size, self.pad, strict=True))

    def windows(self, xp: Any, a: Array) -> Array:
        """The strided (num, channels, *kernel, *out) view of every window of the padded
        array ``a`` (num, channels, *padded); no copy."""
        spatial = a.strides[2:]
        strides = (a.strides[:2] + tuple(d * t for d, t in zip(self.dilation, spatial,
                                                                strict=True))
                   + tuple(s * t for s, t in zip(self.stride, spatial, strict=True)))
        return xp.lib.stride_tricks.as_strided(
            a, shape=(self.num, self.channels) + self.kernel + self.out, strides=strides)


def im2col_forward(x: Array, y: Array, *, geom: Im2colGeometry) -> None:
    """y = the windows of x (zero padded), one output channel per (channel, kernel offset)."""
    g = geom
    if g.empty:
        return
    xp = get_array_module(x)
    x_nd = x.reshape((g.num, g.channels) + g.size)
    if any(g.pad):
        xpad = xp.zeros((g.num, g.channels) + g.padded, dtype=x.dtype)
        xpad[g.inner()] = x_nd
    else:
        xpad = xp.ascontiguousarray(x_nd)
    y.reshape((g.num, g.channels) + g.kernel + g.out)[...] = g.windows(xp, xpad)


def im2col_backward(dy: Array, dx: Array, *, geom: Im2colGeometry) -> None:
    """col2im: dx = the sum of dy over every window position that reads each pixel."""
    g = geom
    if g.empty:
        return
    xp = get_array_module(dy)
    d = len(g.kernel)
    dy_nd = dy.reshape((g.num, g.channels) + g.kernel + g.out)
    acc = xp.zeros((g.num, g.channels) + g.padded, dtype=dy.dtype)
    for offset in np.ndindex(*g.kernel):
        # Within one kernel offset the windows read distinct pixels: a plain strided add.
        index = (slice(None), slice(None)) + tuple(
            slice(k * dl, k * dl + s * (n - 1) + 1, s)
            for k, dl, s, n in zip(offset, g.dilation, g.stride, g.out, strict=True))
        acc[index] += dy_nd[(slice(None), slice(None)) + offset + (slice(None),) * d]
    dx.reshape((g.num, g.channels) + g.size)[...] = acc[g.inner()]
