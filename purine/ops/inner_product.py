"""InnerProduct: y = x W^T + b over the axes from ``axis`` on (W is (N, K), or (K, N) when
``transpose``).

Float32 host calls go to oneDNN's matmul where it is installed (``purine.backend.onednn``):
beside it numpy's OpenBLAS runs one thread, which would leave these GEMMs on one core. A
transposed operand is the same memory read with other strides, so nothing is copied. Small
products (``onednn.MATMUL_MIN_MACS``), float64, GPU arrays, or no oneDNN: the numpy (or cupy)
products below."""

from __future__ import annotations

from typing import Any

import numpy as np

from purine.backend import onednn

Array = Any


def _2d(x: Array, m: int, k: int) -> Array:
    """The (m, k) view of a blob whose axes from ``axis`` on hold k values (an explicit k:
    numpy's -1 cannot size an empty batch)."""
    return x.reshape(m, k)


def _sizes(w: Array, transpose: bool) -> tuple[int, int]:
    """(K inputs, N outputs) of the weight: (N, K), or (K, N) when ``transpose``."""
    return (w.shape[0], w.shape[1]) if transpose else (w.shape[1], w.shape[0])


def _dnnl(x: Array) -> onednn.Dnnl | None:
    """oneDNN for a float32 host call, else None (a GPU or float64 call does not load it)."""
    if type(x) is not np.ndarray or x.dtype != np.float32:
        return None
    return onednn.get()


def inner_product_forward(x: Array, w: Array, *rest: Array, m: int, transpose: bool) -> None:
    """y = x W^T (+ b): ``rest`` is (b, y) or (y,)."""
    *b, y = rest
    k, n = _sizes(w, transpose)
    dnnl = _dnnl(x)
    # x (m, k) times W^T (k, n): W^T is (n, k) memory read transposed, unless W is stored
    # (k, n) already.
    if dnnl is not None and dnnl.matmul(x, w, b[0] if b else None, y, m, k, n,
                                        trans_b=not transpose):
        return
    y2 = _2d(y, m, n)
    _2d(x, m, k).dot(w if transpose else w.T, out=y2)
    if b:
        y2 += b[0]


def inner_product_backward_data(dy: Array, w: Array, dx: Array, *, m: int, transpose: bool) -> None:
    """dx = dy W."""
    k, n = _sizes(w, transpose)
    dnnl = _dnnl(dy)
    if dnnl is not None and dnnl.matmul(dy, w, None, dx, m, n, k, trans_b=transpose):
        return
    _2d(dy, m, n).dot(w.T if transpose else w, out=_2d(dx, m, k))


def inner_product_backward_weight(x: Array, dy: Array, dw: Array, *, m: int,
                                  transpose: bool) -> None:
    """dW = dy^T x, or x^T dy when ``transpose``; written, not added to."""
    k, n = _sizes(dw, transpose)
    dnnl = _dnnl(x)
    if dnnl is not None:
        # The left factor is an (m, rows) blob read transposed.
        done = (dnnl.matmul(x, dy, None, dw, k, m, n, trans_a=True) if transpose
                else dnnl.matmul(dy, x, None, dw, n, m, k, trans_a=True))
        if done:
            return
    x2, dy2 = _2d(x, m, k), _2d(dy, m, n)
    if transpose:
        x2.T.dot(dy2, out=dw)
    else:
        dy2.T.dot(x2, out=dw)


def inner_product_backward_bias(dy: Array, db: Array, *, m: int) -> None:
    _2d(dy, m, db.shape[0]).sum(axis=0, out=db)
