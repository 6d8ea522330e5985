"""Whole-blob kernels: fill, copy, sum."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Array = Any


def fill(y: Array, *, value: float) -> None:
    y[...] = value


def fill_random(y: Array, *, draw: Callable[[], Any]) -> None:
    y[...] = draw()


def copy(x: Array, y: Array) -> None:
    y[...] = x


def sum(*arrays: Array) -> None:  # noqa: A001 - the op is Caffe's Sum
    """The last array is the output: the sum of all the others."""
    *xs, y = arrays
    y[...] = xs[0]
    for x in xs[1:]:
        y += x


def accumulate(x: Array, acc: Array, acc_out: Array) -> None:
    """acc += x (``acc_out`` is ``acc``)."""
    acc_out += x


def add_scalar(x: Array, y: Array, *, value: float) -> None:
    y[...] = x + value
