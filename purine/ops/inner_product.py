"""InnerProduct: y = x W^T + b over the axes from ``axis`` on (W is (N, K), or (K, N) when
``transpose``)."""

from __future__ import annotations

from typing import Any

Array = Any


def _2d(x: Array, m: int, k: int) -> Array:
    """The (m, k) view of a blob whose axes from ``axis`` on hold k values (an explicit k:
    numpy's -1 cannot size an empty batch)."""
    return x.reshape(m, k)


def _sizes(w: Array, transpose: bool) -> tuple[int, int]:
    """(K inputs, N outputs) of the weight: (N, K), or (K, N) when ``transpose``."""
    return (w.shape[0], w.shape[1]) if transpose else (w.shape[1], w.shape[0])


def inner_product_forward(x: Array, w: Array, *rest: Array, m: int, transpose: bool) -> None:
    *b, y = rest
    k, n = _sizes(w, transpose)
    y2 = _2d(y, m, n)
    _2d(x, m, k).dot(w if transpose else w.T, out=y2)
    if b:
        y2 += b[0]


def inner_product_backward_data(dy: Array, w: Array, dx: Array, *, m: int, transpose: bool) -> None:
    k, n = _sizes(w, transpose)
    _2d(dy, m, n).dot(w.T if transpose else w, out=_2d(dx, m, k))


def inner_product_backward_weight(x: Array, dy: Array, dw: Array, *, m: int,
                                  transpose: bool) -> None:
    k, n = _sizes(dw, transpose)
    x2, dy2 = _2d(x, m, k), _2d(dy, m, n)
    if transpose:
        x2.T.dot(dy2, out=dw)
    else:
        dy2.T.dot(x2, out=dw)


def inner_product_backward_bias(dy: Array, db: Array, *, m: int) -> None:
    _2d(dy, m, db.shape[0]).sum(axis=0, out=db)
