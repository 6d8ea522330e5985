"""Normalization kernels: BatchNorm (batch or running statistics), MVN (per-group mean and
variance), Scale and Bias (a per-slice factor or offset broadcast over a blob viewed as (outer,
dim, inner)). Forward and backward side by side; outputs may alias inputs (in-place layers)."""

from __future__ import annotations

import math
from typing import Any

from purine.backend import get_array_module

Array = Any


# -- BatchNorm ------------------------------------------------------------------------------
# A bottom of shape (N, C, ...) is viewed as (N, C, S); statistics run over axes 0 and 2.

def _ncs(a: Array, channels: int) -> Array:
    return a.reshape(a.shape[0], channels, math.prod(a.shape[2:]))


def _per_channel(v: Array) -> Array:
    return v.reshape(1, -1, 1)


def batch_norm_forward_train(x: Array, mean: Array, var: Array, factor: Array,  # noqa: ARG001
                             y: Array, mean_out: Array, var_out: Array, factor_out: Array,
                             x_norm: Array, inv_std: Array, *, channels: int,
                             moving_average_fraction: float, eps: float) -> None:
    """Normalise with the batch statistics and fold them into the running sums in place
    (``mean_out`` is ``mean``, etc.); ``x_norm`` and ``inv_std`` are kept for backward
    because a later in-place layer may overwrite ``y``."""
    xp = get_array_module(x)
    x3, y3 = _ncs(x, channels), _ncs(y, channels)
    m = x3.shape[0] * x3.shape[2]
    mu = x3.mean(axis=(0, 2))
    xp.subtract(x3, _per_channel(mu), out=y3)  # y may be x: x is not read after this
    batch_var = (y3 * y3).mean(axis=(0, 2))
    maf = moving_average_fraction
    factor_out *= maf
    factor_out += 1
    mean_out *= maf
    mean_out += mu
    # The running variance is the unbiased estimate; normalisation uses the biased one.
    var_out *= maf
    var_out += batch_var * (m / (m - 1) if m > 1 else 1.0)
    xp.sqrt(batch_var + eps, out=inv_std)
    xp.reciprocal(inv_std, out=inv_std)
    y3 *= _per_channel(inv_std)
    x_norm[...] = y


def batch_norm_forward_global(x: Array, mean: Array, var: Array, factor: Array, y: Array,
                              inv_std: Array, *, channels: int, eps: float) -> None:
    """Normalise with the stored statistics divided by the moving-average factor (a zero
    factor, i.e. never trained, gives zero mean and variance, as in Caffe)."""
    xp = get_array_module(x)
    zero = factor == 0
    scale = xp.where(zero, 0, 1 / xp.where(zero, 1, factor)).astype(x.dtype)
    xp.sqrt(var * scale + eps, out=inv_std)
    xp.reciprocal(inv_std, out=inv_std)
    y3 = _ncs(y, channels)
    xp.subtract(_ncs(x, channels), _per_channel(mean * scale), out=y3)
    y3 *= _per_channel(inv_std)


def batch_norm_backward_train(dy: Array, x_norm: Array, inv_std: Array, dx: Array, *,
                              channels: int) -> None:
    """dx = (dy - mean(dy) - x_norm * mean(dy * x_norm)) * inv_std, means over (N, S);
    ``dx`` may be ``dy`` (in-place layer)."""
    dy3, xn3 = _ncs(dy, channels), _ncs(x_norm, channels)
    mean_dy = dy3.mean(axis=(0, 2), keepdims=True)
    mean_dy_xn = (dy3 * xn3).mean(axis=(0, 2), keepdims=True)
    _ncs(dx, channels)[...] = (dy3 - mean_dy - xn3 * mean_dy_xn) * _per_channel(inv_std)


def batch_norm_backward_global(dy: Array, inv_std: Array, dx: Array, *, channels: int) -> None:
    """With fixed statistics the layer is affine per channel."""
    xp = get_array_module(dy)
    xp.multiply(_ncs(dy, channels), _per_channel(inv_std), out=_ncs(dx, channels))


# -- MVN ------------------------------------------------------------------------------------
# A blob is viewed as (groups, dim): one group per (n, c) plane, or per n across channels.

def mvn_forward(x: Array, y: Array, *std: Array, groups: int, eps: float) -> None:
    """y = x - mean(x) per group; with a ``std`` output (normalize_variance) also divided by
    sqrt(var) + eps, eps added after the root, var the biased variance. ``std`` keeps that
    divisor for the backward pass; ``y`` may be ``x``."""
    xp = get_array_module(x)
    x2, y2 = x.reshape(groups, -1), y.reshape(groups, -1)
    mean = x2.mean(axis=1, keepdims=True)
    xp.subtract(x2, mean, out=y2)
    if std:
        s = std[0]
        xp.sqrt((y2 * y2).mean(axis=1), out=s)
        s += eps
        y2 /= s[:, None]


def mvn_backward(y: Array, std: Array, dy: Array, dx: Array, *, groups: int) -> None:
    """normalize_variance: dx = (dy - (y * sum(y * dy) + sum(dy)) / dim) / std, sums per
    group. This is Caffe's gradient, which treats the divisor as sqrt(var) and so is exact
    only as eps goes to 0 (off by a factor of about 1 + eps / sqrt(var) in one term).
    ``dx`` may be ``dy``."""
    xp = get_array_module(dy)
    y2, dy2 = y.reshape(groups, -1), dy.reshape(groups, -1)
    dim = y2.shape[1]
    sum_ydy = xp.einsum("gd,gd->g", y2, dy2)[:, None]
    sum_dy = dy2.sum(axis=1, keepdims=True)
    t = y2 * sum_ydy
    t += sum_dy
    t *= -1.0 / dim
    t += dy2
    t /= std[:, None]
    dx.reshape(groups, -1)[...] = t


def mvn_backward_mean(dy: Array, dx: Array, *, groups: int) -> None:
    """Without normalize_variance: dx = dy - mean(dy) per group."""
    xp = get_array_module(dy)
    dy2 = dy.reshape(groups, -1)
    xp.subtract(dy2, dy2.mean(axis=1, keepdims=True), out=dx.reshape(groups, -1))


# -- Scale and Bias -------------------------------------------------------------------------
# The bottom is viewed as (outer, dim, inner); the scale / bias has ``dim`` elements.

def _odi(a: Array, outer: int, dim: int, inner: int) -> Array:
    return a.reshape(outer, dim, inner)


def scale_forward(x: Array, scale: Array, *rest: Array, outer: int, dim: int,
                  inner: int) -> None:
    """y = x * scale (+ bias, when Scale has bias_term); ``rest`` is ([bias,] y)."""
    xp = get_array_module(x)
    *bias, y = rest
    y3 = _odi(y, outer, dim, inner)
    xp.multiply(_odi(x, outer, dim, inner), scale.reshape(1, dim, 1), out=y3)
    if bias:
        y3 += bias[0].reshape(1, dim, 1)


def scale_backward_data(dy: Array, scale: Array, dx: Array, *, outer: int, dim: int,
                        inner: int) -> None:
    xp = get_array_module(dy)
    xp.multiply(_odi(dy, outer, dim, inner), scale.reshape(1, dim, 1),
                out=_odi(dx, outer, dim, inner))


def scale_backward_scale(x: Array, dy: Array, dscale: Array, *, outer: int, dim: int,
                         inner: int) -> None:
    """dscale[d] = sum over outer and inner of x * dy (``x`` is the bottom before an
    in-place forward overwrote it)."""
    xp = get_array_module(x)
    total = xp.einsum("odi,odi->d", _odi(x, outer, dim, inner), _odi(dy, outer, dim, inner))
    dscale[...] = total.reshape(dscale.shape)


def bias_forward(x: Array, bias: Array, y: Array, *, outer: int, dim: int, inner: int) -> None:
    xp = get_array_module(x)
    xp.add(_odi(x, outer, dim, inner), bias.reshape(1, dim, 1), out=_odi(y, outer, dim, inner))


def bias_backward_bias(dy: Array, dbias: Array, *, outer: int, dim: int, inner: int) -> None:
    dbias[...] = _odi(dy, outer, dim, inner).sum(axis=(0, 2)).reshape(dbias.shape)
