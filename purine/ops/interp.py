"""Resizing feature maps, forward and backward side by side: DeepLab's Interp (bilinear,
corners aligned, over a crop of the input), SegNet's Upsample (each input value put back
where a max-pool mask says it came from) and the YOLOv3 ports' nearest-neighbour Upsample."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from purine.backend import get_array_module
from purine.errors import PurineError

Array = Any


# -- Interp ---------------------------------------------------------------------------------
CACHED_MATRIX = 1 << 22
"""Matrices of up to this many values are kept for the next net of the same sizes; larger
ones (checked as the layer's scratch) are made at each run, so none outlives its net."""


def interp_matrix(size_in: int, size_out: int, dtype: Any = np.float64) -> np.ndarray:
    """(size_out, size_in): row o holds the two bilinear weights of output o along one axis
    (see ``_interp_matrix``); read-only, cached when small."""
    if size_in * size_out <= CACHED_MATRIX:
        return _cached_matrix(size_in, size_out, np.dtype(dtype))
    return _interp_matrix(size_in, size_out, dtype)


@functools.lru_cache(maxsize=64)
def _cached_matrix(size_in: int, size_out: int, dtype: Any) -> np.ndarray:
    return _interp_matrix(size_in, size_out, dtype)


def _interp_matrix(size_in: int, size_out: int, dtype: Any) -> np.ndarray:
    """(size_out, size_in): row o holds the two bilinear weights of output o along one axis.

    The corners align (output 0 is input 0, output size_out - 1 is input size_in - 1). The
    positions and weights are float32 computations whatever the net's dtype, as DeepLab's
    caffe_cpu_interp2 makes them, so that both agree to the last bit of the weights."""
    step = (np.float32(size_in - 1) / np.float32(size_out - 1) if size_out > 1
            else np.float32(0))
    pos = step * np.arange(size_out, dtype=np.float32)
    low = np.minimum(pos.astype(np.int64), size_in - 1)  # truncation, as the fork's int()
    up = (low < size_in - 1).astype(np.int64)  # the last input has no right neighbour
    lam1 = (pos - low.astype(np.float32)).astype(dtype)
    m = np.zeros((size_out, size_in), dtype=dtype)
    rows = np.arange(size_out)
    np.add.at(m, (rows, low), np.asarray(1, dtype=dtype) - lam1)
    np.add.at(m, (rows, low + up), lam1)
    m.flags.writeable = False  # cached: every net with these sizes shares it (when small)
    return m


def _interp_matrices(xp: Any, x_plane: tuple[int, int], y_plane: tuple[int, int],
                     dtype: Any) -> tuple[Array, Array]:
    dtype = np.dtype(dtype)
    return (xp.asarray(interp_matrix(x_plane[0], y_plane[0], dtype)),
            xp.asarray(interp_matrix(x_plane[1], y_plane[1], dtype)))


def interp_forward(x: Array, y: Array, *, crop: tuple[int, int, int, int]) -> None:
    """y = Ah · x[crop] · Awᵀ per (num, channel) plane, ``crop`` = (top, left, height,
    width) of the part of x that is resized (pad_beg / pad_end <= 0 cut the rest off)."""
    if y.size == 0:  # an empty batch: no matrix is built (their sizes may be huge)
        return
    xp = get_array_module(x)
    t, left, h, w = crop
    ah, aw = _interp_matrices(xp, (h, w), y.shape[2:], y.dtype)
    part = x[:, :, t:t + h, left:left + w]
    y[...] = xp.matmul(xp.matmul(ah, part), aw.T)


def interp_backward(dy: Array, dx: Array, *, crop: tuple[int, int, int, int]) -> None:
    """dx[crop] = Ahᵀ · dy · Aw (the adjoint of the forward), zero outside the crop."""
    xp = get_array_module(dy)
    t, left, h, w = crop
    dx.fill(0)
    if dy.size == 0:
        return
    ah, aw = _interp_matrices(xp, (h, w), dy.shape[2:], dy.dtype)
    dx[:, :, t:t + h, left:left + w] = xp.matmul(xp.matmul(ah.T, dy), aw)


# -- Upsample (SegNet) ----------------------------------------------------------------------
def _mask_index(x: Array, mask: Array, plane: int) -> Array:
    """Flat indices into the top of each bottom value: its plane's offset plus the mask."""
    xp = get_array_module(x)
    n, c = x.shape[:2]
    idx = mask.reshape(n * c, math.prod(mask.shape[2:])).astype(xp.int64)
    if idx.size == 0:  # an empty batch or map: no index to check
        return idx
    lo, hi = int(idx.min()), int(idx.max())  # one read back: a bad mask stops here
    if lo < 0 or hi >= plane:
        bad = lo if lo < 0 else hi
        raise PurineError(f"Upsample mask holds index {bad}, outside the top's plane of "
                          f"{plane} values; the mask must come from a MAX Pooling whose "
                          "bottom had the Upsample top's height and width")
    return idx + xp.arange(n * c, dtype=xp.int64)[:, None] * plane


def upsample_forward(x: Array, mask: Array, y: Array) -> None:
    """y = zeros with y[n, c].flat[mask[n, c, i, j]] = x[n, c, i, j]; where two values
    name one place, the later one in scan order stays (as the fork's loop writes)."""
    xp = get_array_module(x)
    plane = y.shape[2] * y.shape[3]
    idx = _mask_index(x, mask, plane).reshape(-1)
    values = x.reshape(-1)
    flat = y.reshape(-1)
    flat.fill(0)
    flat[idx] = values
    # An overlapping pooling's mask can name one place twice, and an array assignment
    # leaves which write wins unspecified. Read back: where every place holds what was
    # written there, no two different values collided; else keep each place's last source
    # (a sort, paid only then).
    if bool((flat[idx] != values).any()):
        _, first_from_end = xp.unique(idx[::-1], return_index=True)
        last = idx.size - 1 - first_from_end
        flat[idx[last]] = values[last]


def upsample_backward(dy: Array, mask: Array, dx: Array) -> None:
    """dx[n, c, i, j] = dy[n, c].flat[mask[n, c, i, j]]: the gradient read back from where
    each value went (a value another one overwrote reads it too, as in the fork)."""
    plane = dy.shape[2] * dy.shape[3]
    idx = _mask_index(dx, mask, plane).reshape(-1)
    dx.reshape(-1)[...] = dy.reshape(-1)[idx]


def upsample_nearest_forward(x: Array, y: Array, *, scale: int) -> None:
    """The YOLOv3 ports' one-bottom Upsample: each value repeated into a scale × scale
    block, y[n, c, h, w] = x[n, c, h // scale, w // scale]."""
    if y.size == 0:  # an empty top's (n, c, h, scale, w, scale) view may pass 2^63 bytes
        return
    n, c, h, w = x.shape
    y.reshape(n, c, h, scale, w, scale)[...] = x[:, :, :, None, :, None]


def upsample_nearest_backward(dy: Array, dx: Array, *, scale: int) -> None:
    """dx = the sum of dy over each value's block."""
    if dx.size == 0:
        return
    n, c, h, w = dx.shape
    dx[...] = dy.reshape(n, c, h, scale, w, scale).sum(axis=(3, 5))
