"""Activations of the Caffe forks (MobileNet's ReLU6, YOLOv4's Mish), forward and backward
side by side. As in purine.ops.activation, each kernel fills its output in place and
tolerates ``y is x`` and ``dx is dy``."""

from __future__ import annotations

from typing import Any

from purine.backend import get_array_module

Array = Any

RELU6_CAP = 6.0


def relu6_forward(x: Array, y: Array) -> None:
    """y = min(max(x, 0), 6)."""
    get_array_module(x).clip(x, 0, RELU6_CAP, out=y)


def relu6_backward(y: Array, dy: Array, dx: Array) -> None:
    """dx = dy where 0 < x < 6, else 0. ``y`` may be the top (in-place use): clipping keeps
    a value strictly inside (0, 6) exactly when the bottom was."""
    xp = get_array_module(y)
    inside = (y > 0) & (y < RELU6_CAP)
    xp.multiply(dy, inside, out=dx)


def _softplus_tanh(xp: Any, x: Array) -> Array:
    """tanh(ln(1 + e^x)), with the softplus as logaddexp(0, x) so large x cannot overflow."""
    return xp.tanh(xp.logaddexp(0, x))


def mish_forward(x: Array, y: Array) -> None:
    """y = x · tanh(softplus(x))."""
    xp = get_array_module(x)
    t = _softplus_tanh(xp, x)
    xp.multiply(x, t, out=y)


def mish_backward(x: Array, dy: Array, dx: Array) -> None:
    """dx = dy · (t + x · (1 - t²) · σ(x)), t = tanh(softplus(x)); ``x`` is the bottom
    (saved before an in-place forward)."""
    xp = get_array_module(x)
    t = _softplus_tanh(xp, x)
    sigmoid = 0.5 * (1 + xp.tanh(0.5 * x))  # no exp(-x) overflow for very negative x
    grad = t + x * (1 - t * t) * sigmoid
    xp.multiply(dy, grad, out=dx)
