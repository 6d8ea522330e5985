"""InnerProduct: y = x W^T + b over the axes from ``axis`` on (W is (N, K), or (K, N) when
``transpose``)."""

from __future__ import annotations

import math
from typing import Any

Array = Any


def _2d(x: Array, m: int) -> Array:
    """The (m, rest) view; an empty batch (m = 0) keeps the rest's size, which -1 cannot
    infer from zero values."""
    return x.reshape(m, math.prod(x.shape) // m if m else math.prod(x.shape[1:]))


def inner_product_forward(x: Array, w: Array, *rest: Array, m: int, transpose: bool) -> None:
    *b, y = rest
    y2 = _2d(y, m)
    x2 = _2d(x, m)
    x2.dot(w if transpose else w.T, out=y2)
    if b:
        y2 += b[0]


def inner_product_backward_data(dy: Array, w: Array, dx: Array, *, m: int, transpose: bool) -> None:
    dy2, dx2 = _2d(dy, m), _2d(dx, m)
    dy2.dot(w.T if transpose else w, out=dx2)


def inner_product_backward_weight(x: Array, dy: Array, dw: Array, *, m: int,
                                  transpose: bool) -> None:
    x2, dy2 = _2d(x, m), _2d(dy, m)
    if transpose:
        x2.T.dot(dy2, out=dw)
    else:
        dy2.T.dot(x2, out=dw)


def inner_product_backward_bias(dy: Array, db: Array, *, m: int) -> None:
    _2d(dy, m).sum(axis=0, out=db)
