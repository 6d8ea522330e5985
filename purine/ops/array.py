"""Array kernels (Caffe's Concat, Slice, Eltwise, Flatten/Reshape, Crop, ArgMax, Reduction,
Tile, Embed, Filter, BatchReindex): copies between blobs along an axis, elementwise
combinations of several blobs, reductions and index lookups, forward and backward side by
side."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from purine.backend import device_variant, get_array_module, scatter_add, stable_argsort
from purine.errors import PurineError

Array = Any


def _along(axis: int, start: int, size: int) -> tuple[slice, ...]:
    """The index of ``size`` entries from ``start`` along ``axis``, all of every other axis."""
    return (slice(None),) * axis + (slice(start, start + size),)


# -- Concat / Slice -------------------------------------------------------------------------
def concat_forward(*arrays: Array, axis: int) -> None:
    """The last array is the output: the others laid side by side along ``axis``."""
    *xs, y = arrays
    start = 0
    for x in xs:
        y[_along(axis, start, x.shape[axis])] = x
        start += x.shape[axis]


def take_slice(x: Array, y: Array, *, axis: int, start: int) -> None:
    """``y`` = the part of ``x`` from ``start`` along ``axis`` (Concat's backward)."""
    y[...] = x[_along(axis, start, y.shape[axis])]


def slice_forward(x: Array, *ys: Array, axis: int) -> None:
    start = 0
    for y in ys:
        y[...] = x[_along(axis, start, y.shape[axis])]
        start += y.shape[axis]


def slice_backward(*arrays: Array, axis: int) -> None:
    """The last array is the bottom's gradient: the tops' gradients side by side."""
    concat_forward(*arrays, axis=axis)


# -- Eltwise --------------------------------------------------------------------------------
def eltwise_sum(*arrays: Array, coeffs: Sequence[float]) -> None:
    *xs, y = arrays
    xp = get_array_module(y)
    xp.multiply(xs[0], coeffs[0], out=y)
    for x, c in zip(xs[1:], coeffs[1:], strict=True):
        if c == 1:
            y += x
        else:
            y += c * x


def eltwise_prod(*arrays: Array) -> None:
    *xs, y = arrays
    xp = get_array_module(y)
    xp.multiply(xs[0], xs[1], out=y)
    for x in xs[2:]:
        y *= x


def eltwise_max(*arrays: Array) -> None:
    """The last two arrays are the output and the index of the bottom that won each
    element. As Caffe's CPU code: bottom 1 wins a tie with bottom 0, and a later bottom
    must exceed the running maximum to win."""
    *xs, y, winner = arrays
    xp = get_array_module(y)
    first = xs[0] > xs[1]
    xp.copyto(y, xp.where(first, xs[0], xs[1]))
    xp.copyto(winner, xp.where(first, 0, 1).astype(winner.dtype))
    for i, x in enumerate(xs[2:], 2):
        better = x > y
        xp.copyto(y, x, where=better)
        xp.copyto(winner, i, where=better)


def eltwise_sum_backward(dy: Array, dx: Array, *, coeff: float) -> None:
    if coeff == 1:
        dx[...] = dy
    else:
        get_array_module(dy).multiply(dy, coeff, out=dx)


def eltwise_prod_backward(*arrays: Array) -> None:
    """``others..., dy, dx``: the gradient of one factor is the product of the other
    factors times the top's gradient (Caffe's stable_prod_grad)."""
    *others, dy, dx = arrays
    dx[...] = others[0]
    for x in others[1:]:
        dx *= x
    dx *= dy


def eltwise_prod_backward_quotient(y: Array, x: Array, dy: Array, dx: Array) -> None:
    """stable_prod_grad: false: top / bottom times the top's gradient (inf or nan where
    the bottom is zero, as in Caffe)."""
    xp = get_array_module(y)
    xp.divide(y, x, out=dx)
    dx *= dy


def eltwise_max_backward(winner: Array, dy: Array, dx: Array, *, index: int) -> None:
    xp = get_array_module(dy)
    xp.copyto(dx, xp.where(winner == index, dy, 0))


# -- Flatten / Reshape / Crop / Tile --------------------------------------------------------
def reshape_copy(x: Array, y: Array) -> None:
    """``y`` = ``x`` in ``y``'s shape (same count, row-major order)."""
    y[...] = x.reshape(y.shape)


def _crop_index(offsets: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))


def crop_forward(x: Array, y: Array, *, offsets: Sequence[int]) -> None:
    y[...] = x[_crop_index(offsets, y.shape)]


def crop_backward(dy: Array, dx: Array, *, offsets: Sequence[int]) -> None:
    dx[...] = 0
    dx[_crop_index(offsets, dy.shape)] = dy


def _tile_dims(shape: Sequence[int], axis: int) -> tuple[int, int]:
    return math.prod(shape[:axis]), math.prod(shape[axis:])


def tile_forward(x: Array, y: Array, *, axis: int, tiles: int) -> None:
    """Each block of ``x`` from ``axis`` on is repeated ``tiles`` times in a row."""
    if y.size == 0:  # an empty top's (outer, tiles, 0) view may pass 2^63 bytes
        return
    outer, inner = _tile_dims(x.shape, axis)
    y.reshape(outer, tiles, inner)[...] = x.reshape(outer, 1, inner)


def tile_backward(dy: Array, dx: Array, *, axis: int, tiles: int) -> None:
    if dx.size == 0:
        return
    outer, inner = _tile_dims(dx.shape, axis)
    dy.reshape(outer, tiles, inner).sum(axis=1, out=dx.reshape(outer, inner))


# -- ArgMax ---------------------------------------------------------------------------------
def _top_k(x: Array, k: int) -> Array:
    """Indices of the ``k`` largest entries along the last axis, largest first; among equal
    values the larger index comes first (Caffe sorts (value, index) pairs descending)."""
    xp = get_array_module(x)
    d = x.shape[-1]
    if k == 1:
        return (d - 1) - xp.argmax(x[..., ::-1], axis=-1)[..., None]
    # A stable ascending sort keeps equal values in index order; reversed, it is
    # descending with the larger index first.
    return stable_argsort(x, axis=-1)[..., ::-1][..., :k]


def argmax_forward(x: Array, y: Array, *, axis: int | None, top_k: int,
                   out_max_val: bool) -> None:
    """With ``axis``: the top_k indices (or values, with out_max_val) along it. Without:
    per sample (axis 0) over the flattened rest, the indices, then with out_max_val the
    values, as Caffe lays them out in its (N, 1 or 2, top_k) top."""
    xp = get_array_module(x)
    if axis is None:
        x2 = x.reshape(x.shape[0], -1)
        idx = _top_k(x2, top_k)
        y2 = y.reshape(x.shape[0], -1)
        y2[:, :top_k] = idx
        if out_max_val:
            y2[:, top_k:] = xp.take_along_axis(x2, idx, axis=-1)
        return
    xs = xp.moveaxis(x, axis, -1)
    idx = _top_k(xs, top_k)
    xp.moveaxis(y, axis, -1)[...] = xp.take_along_axis(xs, idx, axis=-1) if out_max_val else idx


# -- Reduction ------------------------------------------------------------------------------
def reduction_forward(x: Array, y: Array, *, op: str, coeff: float) -> None:
    """``y`` (the leading axes of ``x``) = coeff x the SUM / ASUM / SUMSQ / MEAN of each
    trailing block; for MEAN ``coeff`` already includes 1 / block size."""
    xp = get_array_module(x)
    x2 = x.reshape(y.size, -1)
    y1 = y.reshape(-1)
    if op in ("SUM", "MEAN"):
        x2.sum(axis=1, out=y1)
    elif op == "ASUM":
        xp.abs(x2).sum(axis=1, out=y1)
    elif op == "SUMSQ":
        (x2 * x2).sum(axis=1, out=y1)
    else:
        raise PurineError(f"unknown reduction operation {op}")
    if coeff != 1:
        y1 *= coeff


def reduction_backward(*arrays: Array, op: str, coeff: float) -> None:
    """``dy, dx`` for SUM and MEAN; ``x, dy, dx`` for ASUM and SUMSQ, which need the
    bottom."""
    xp = get_array_module(arrays[-1])
    dy, dx = arrays[-2:]
    dx2 = dx.reshape(dy.size, -1)
    g = dy.reshape(-1, 1) * coeff
    if op in ("SUM", "MEAN"):
        dx2[...] = g
        return
    x2 = arrays[0].reshape(dy.size, -1)
    if op == "ASUM":
        xp.sign(x2, out=dx2)
        dx2 *= g
    elif op == "SUMSQ":
        xp.multiply(x2, 2 * g, out=dx2)
    else:
        raise PurineError(f"unknown reduction operation {op}")


# -- Embed ----------------------------------------------------------------------------------
def _indices_gpu(x: Array, input_dim: int,
                 check: bool) -> tuple[Array, Array | None]:  # noqa: ARG001
    """Reading the verdict back would stall the stream: the bad positions come back as a
    mask (their index clamped into range), checked or not, and the caller writes NaN there."""
    xp = get_array_module(x)
    flat = x.reshape(-1)
    idx = flat.astype(xp.int64)
    bad = (idx != flat) | (idx < 0) | (idx >= input_dim)
    return xp.clip(idx, 0, input_dim - 1), bad


@device_variant(_indices_gpu)
def _indices(x: Array, input_dim: int, check: bool) -> tuple[Array, Array | None]:
    """The indices ``x`` holds as floats, truncated toward zero as Caffe's int cast does;
    with ``check``, a non-integer or an index outside [0, input_dim) is an error (a GPU
    gives a mask of them instead, see ``_indices_gpu``)."""
    flat = x.reshape(-1)
    idx = flat.astype(np.int64)
    if check:
        bad = (idx != flat) | (idx < 0) | (idx >= input_dim)
        if bool(bad.any()):
            pos = int(np.argmax(bad))
            raise PurineError(
                f"Embed bottom holds {float(flat[pos])!r} at flat position {pos} (of shape "
                f"{tuple(x.shape)}); it must hold integer indices in [0, {input_dim}), "
                f"input_dim = {input_dim}")
    return idx, None


def embed_forward(x: Array, w: Array, *rest: Array, input_dim: int) -> None:
    """``y[..., :] = w[x[...]] (+ b)``: one row of the (input_dim, num_output) weight per
    index; ``rest`` is ``[b], y`` or ``y``."""
    *b, y = rest
    xp = get_array_module(w)
    y2 = y.reshape(-1, w.shape[1])
    idx, bad = _indices(x, input_dim, check=True)
    xp.take(w, idx, axis=0, out=y2)
    if b:
        y2 += b[0]
    if bad is not None:
        y2[...] = xp.where(bad[:, None], xp.nan, y2)


def embed_backward_weight(x: Array, dy: Array, dw: Array, *, input_dim: int) -> None:
    """Each weight row collects the gradients of every position that looked it up."""
    idx, _ = _indices(x, input_dim, check=False)
    dw[...] = 0
    scatter_add(dw, idx, dy.reshape(-1, dw.shape[1]))


def embed_backward_bias(dy: Array, db: Array) -> None:
    dy.reshape(-1, db.shape[0]).sum(axis=0, out=db)


# -- Filter ---------------------------------------------------------------------------------
def _selected_first(selector: Array) -> tuple[Array, Array]:
    """The item indices with the selected ones (selector != 0, NaN included) first, in
    order, and how many are selected (a 0-d array: no host sync on a GPU)."""
    xp = get_array_module(selector)
    dropped = (selector.reshape(-1) == 0).astype(xp.int8)
    # A stable sort keeps the order among the selected items.
    return stable_argsort(dropped), dropped.size - dropped.sum()


def filter_count(selector: Array) -> int:
    """How many items ``selector`` selects (its nonzero values, NaN included): Filter's
    top count, which the net settles before the forward op (a host sync on a GPU)."""
    return int(get_array_module(selector).count_nonzero(selector))


def filter_forward(*arrays: Array, bottoms: int) -> None:
    """``x_1..x_K, selector, y_1..y_K``: each y holds its x's selected items, in order. The
    net settles the tops' first axis to the selected count before the op runs; where it
    does not (a data-parallel replica) a selector that selects another number of items
    than the tops hold is an error (on a GPU too: the count is read back once per forward,
    since wrong tops would poison the loss silently)."""
    xs, selector, ys = arrays[:bottoms], arrays[bottoms], arrays[bottoms + 1:]
    xp = get_array_module(selector)
    order, count = _selected_first(selector)
    rows = ys[0].shape[0]
    if int(count) != rows:
        raise PurineError(
            f"Filter selector {tuple(selector.shape)} selects {int(count)} of "
            f"{selector.shape[0]} items, but the tops were built with {rows}, and where this "
            "layer runs (a data-parallel replica, an asynchronous worker) the net's shapes stay "
            "those it was built with")
    keep = order[:rows]
    for x, y in zip(xs, ys, strict=True):
        xp.take(x, keep, axis=0, out=y)


def filter_backward(selector: Array, dy: Array, dx: Array) -> None:
    """Each selected item's gradient goes back to its row; the other rows get zero."""
    order, _ = _selected_first(selector)
    dx[...] = 0
    dx[order[:dy.shape[0]]] = dy


# -- BatchReindex ---------------------------------------------------------------------------
def _clamped_reindex(permut: Array, num: int) -> tuple[Array, Array]:
    """The indices ``permut`` holds as floats, truncated toward zero as Caffe's int cast
    does, 0 where the value is outside [0, num); and the mask of those bad positions."""
    xp = get_array_module(permut)
    bad = ~((permut >= 0) & (permut < num))  # NaN fails both comparisons: bad
    return xp.trunc(xp.where(bad, 0, permut)).astype(xp.int64), bad


def _reindex_gpu(permut: Array, num: int,
                 check: bool) -> tuple[Array, Array | None]:  # noqa: ARG001
    """Reading the verdict back would stall the stream: the bad positions come back as a
    mask, checked or not, and the caller writes NaN there."""
    return _clamped_reindex(permut, num)


@device_variant(_reindex_gpu)
def _reindex(permut: Array, num: int, check: bool) -> tuple[Array, Array | None]:
    """``_clamped_reindex``'s indices; with ``check``, a value outside [0, num) is an error
    (a fraction inside passes, as in Caffe; a GPU gives the mask instead, see
    ``_reindex_gpu``)."""
    idx, bad = _clamped_reindex(permut, num)
    if check and bool(bad.any()):
        pos = int(np.argmax(bad))
        raise PurineError(
            f"BatchReindex index {float(permut[pos])!r} at position {pos} of the index bottom "
            f"{tuple(permut.shape)} is outside [0, {num}), the first axis of the data bottom "
            f"({int(bad.sum())} bad index(es) in all)")
    return idx, None


def batch_reindex_forward(x: Array, permut: Array, y: Array) -> None:
    """y[i] = x[permut[i]]: the items of ``x`` in the order (and multiplicity) ``permut``
    gives."""
    xp = get_array_module(x)
    idx, bad = _reindex(permut, x.shape[0], check=True)
    xp.take(x, idx, axis=0, out=y)
    if bad is not None:
        xp.copyto(y, xp.nan, where=bad.reshape((-1,) + (1,) * (y.ndim - 1)))


def batch_reindex_backward(permut: Array, dy: Array, dx: Array) -> None:
    """dx[j] = the sum of dy[i] over every i with permut[i] == j; zero for an item never
    picked."""
    idx, _ = _reindex(permut, dx.shape[0], check=False)
    dx[...] = 0
    scatter_add(dx, idx, dy)
