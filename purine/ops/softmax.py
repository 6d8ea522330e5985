"""Softmax over one axis (Caffe's Softmax layer), forward and backward side by side; the
loss family reuses the forward for SoftmaxWithLoss's probabilities."""

from __future__ import annotations

from typing import Any

from purine.backend import get_array_module

Array = Any


def softmax_forward(x: Array, y: Array, *, axis: int) -> None:
    """``y = exp(x - max) / sum(exp(x - max))`` along ``axis``; ``y`` may be ``x``."""
    xp = get_array_module(x)
    # Shifting by the maximum keeps exp() from overflowing; the result is unchanged.
    shift = x.max(axis=axis, keepdims=True)
    xp.subtract(x, shift, out=y)
    xp.exp(y, out=y)
    y /= y.sum(axis=axis, keepdims=True)


def softmax_backward(y: Array, dy: Array, dx: Array, *, axis: int) -> None:
    """``dx = (dy - sum(dy * y)) * y`` along ``axis``; needs only the top, so in-place use
    works, and ``dx`` may be ``dy``."""
    xp = get_array_module(y)
    dot = (dy * y).sum(axis=axis, keepdims=True)
    xp.subtract(dy, dot, out=dx)
    dx *= y
