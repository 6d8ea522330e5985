"""Elementwise activations (Caffe's neuron layers), forward and backward side by side."""

from __future__ import annotations

from typing import Any

from purine.backend import get_array_module

Array = Any


def relu_forward(x: Array, y: Array, *, negative_slope: float = 0.0) -> None:
    xp = get_array_module(x)
    if negative_slope == 0:
        xp.maximum(x, 0, out=y)
    else:
        xp.multiply(x, xp.where(x > 0, 1, negative_slope).astype(x.dtype), out=y)


def relu_backward(x: Array, dy: Array, dx: Array, *, negative_slope: float = 0.0) -> None:
    """``x`` may be the top (in-place use): its sign is the bottom's sign."""
    xp = get_array_module(x)
    if negative_slope == 0:
        xp.multiply(dy, x > 0, out=dx)
    else:
        xp.multiply(dy, xp.where(x > 0, 1, negative_slope).astype(dy.dtype), out=dx)
