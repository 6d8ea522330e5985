"""Every kernel of the generic op modules (activation, softmax, loss, normalization, array,
tensor, inner_product, recurrent, im2col) and pooling's STOCHASTIC kernels (array code) on a
GPU against the same kernel on numpy, from one table of cases. Without a GPU, the fused
kernels' CUDA C compiles for sm_90 and, run serially on the CPU, gives the numpy path's numbers
bit for bit, and the device-only branches of the Filter, BatchReindex and STOCHASTIC backward
kernels run on numpy as device arrays (``backend.is_device_array`` patched) through a
stand-in array module (the last with our CUDA C emulated)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from purine import backend
from purine.backend import RandomStream, cuda
from purine.errors import LabelError, PurineError
from purine.ops import activation as act
from purine.ops import array as arr
from purine.ops import im2col as i2c
from purine.ops import inner_product as ip
from purine.ops import loss, tensor
from purine.ops import normalization as nm
from purine.ops import pooling as pl
from purine.ops import recurrent as rec
from purine.ops import softmax as sm
from tests.gpu import emulate as cuda_emulate
from tests.gpu.common import STAND_IN, requires_gpu, requires_gpu_or_stand_in
from tests.gpu.test_cuda_sources import pool_geometry
from tests.gpu.test_solver_gpu import emulate, nvcc_compiles

SHAPE = (4, 3, 5, 6)


@dataclass
class Case:
    """``make(rng, dtype)`` gives the arguments; the last ``n_out`` are the outputs (an array
    may appear twice: an in-place call). ``kw`` is called for fresh keyword arguments."""
    id: str
    fn: Callable
    make: Callable
    n_out: int = 1
    kw: Callable = field(default=dict)
    rtol32: float = 1e-5


def _r(rng, dtype, shape=SHAPE, lo=-2.0, hi=2.0):
    return rng.uniform(lo, hi, shape).astype(dtype)


def _z(dtype, shape=SHAPE):
    return np.zeros(shape, dtype)


def _labels(rng, dtype, shape, classes, ignore=None):
    lab = rng.integers(0, classes, shape).astype(dtype)
    if ignore is not None:
        lab.reshape(-1)[::5] = ignore
    return lab


def _probs(rng, dtype, axis=1):
    p = np.zeros(SHAPE, dtype)
    sm.softmax_forward(_r(rng, dtype, lo=-3, hi=3), p, axis=axis)
    return p


def _ties(rng, dtype, shape=SHAPE):
    """Scores with many equal values, for top_k tie-breaking."""
    return rng.integers(0, 3, shape).astype(dtype)


def _inplace(make1):
    """The output is the (first) input: an in-place forward."""
    def make(rng, dtype):
        a = make1(rng, dtype)
        return a[:-1] + [a[0]]
    return make


def _x_y(rng, dtype):
    return [_r(rng, dtype), _z(dtype)]


def _x_dy_dx(rng, dtype):
    return [_r(rng, dtype), _r(rng, dtype), _z(dtype)]


def _y_dy_dx(lo=0.05, hi=0.95):
    return lambda rng, dtype: [_r(rng, dtype, lo=lo, hi=hi), _r(rng, dtype), _z(dtype)]


def _slope(shared):
    return lambda rng, dtype: _r(rng, dtype, (), 0.1, 0.3) if shared else _r(rng, dtype, (3,),
                                                                             0.1, 0.3)


def _softmax_loss(fwd, ignore, norm):
    kw = dict(axis=1, ignore_label=ignore, normalization=norm)
    if fwd:
        def make(rng, dtype):
            return [_probs(rng, dtype), _labels(rng, dtype, (4, 5, 6), 3, ignore),
                    _z(dtype, ())]
        return Case(f"softmax_loss_fwd-{ignore}-{norm}", loss.softmax_loss_forward, make,
                    kw=lambda: kw)

    def make_b(rng, dtype):
        return [_probs(rng, dtype), _labels(rng, dtype, (4, 5, 6), 3, ignore),
                np.array(0.7, dtype), _z(dtype)]
    return Case(f"softmax_loss_bwd-{ignore}-{norm}", loss.softmax_loss_backward, make_b,
                kw=lambda: kw)


def _sce(fwd, ignore, norm):
    kw = dict(ignore_label=ignore, normalization=norm)

    def target(rng, dtype):
        t = rng.uniform(0, 1, SHAPE).astype(dtype)
        if ignore is not None:
            t.reshape(-1)[::7] = ignore
        return t
    if fwd:
        return Case(f"sigmoid_ce_fwd-{ignore}-{norm}", loss.sigmoid_cross_entropy_loss_forward,
                    lambda rng, dt: [_r(rng, dt, lo=-5, hi=5), target(rng, dt), _z(dt, ())],
                    kw=lambda: kw)
    return Case(f"sigmoid_ce_bwd-{ignore}-{norm}", loss.sigmoid_cross_entropy_loss_backward,
                lambda rng, dt: [_r(rng, dt, lo=-5, hi=5), target(rng, dt),
                                 np.array(1.3, dt), _z(dt)], kw=lambda: kw)


def _accuracy(top_k, ignore, per_class, axis=1):
    kw = dict(axis=axis, top_k=top_k, ignore_label=ignore)

    def make(rng, dtype):
        lab_shape = SHAPE[:axis] + SHAPE[axis + 1:]
        outs = [_z(dtype, ())] + ([_z(dtype, (SHAPE[axis],))] if per_class else [])
        return [_ties(rng, dtype), _labels(rng, dtype, lab_shape, SHAPE[axis], ignore)] + outs
    return Case(f"accuracy-top{top_k}-{ignore}-{per_class}-axis{axis}", loss.accuracy_forward,
                make, n_out=1 + per_class, kw=lambda: kw)


def _bn_train(rng, dtype):
    x = _r(rng, dtype)
    mean, var, factor = _r(rng, dtype, (3,)), _r(rng, dtype, (3,), 0.5, 1.5), np.ones(1, dtype)
    return [x, mean, var, factor, _z(dtype), mean, var, factor, _z(dtype), _z(dtype, (3,))]


def _bn_global(factor):
    def make(rng, dtype):
        return [_r(rng, dtype), _r(rng, dtype, (3,)), _r(rng, dtype, (3,), 0.5, 1.5),
                np.full(1, factor, dtype), _z(dtype), _z(dtype, (3,))]
    return make


ODI = dict(outer=4, dim=3, inner=30)


def _mll(fwd):
    def make(rng, dt):
        prob = _r(rng, dt, (8, 3, 2, 2), 0.05, 1.0)  # classes: the 12 values after axis 0
        label = _labels(rng, dt, (8, 1, 1, 1), 12)
        return [prob, label] + ([_z(dt, ())] if fwd else [np.array(0.8, dt), _z(dt, prob.shape)])
    fn = loss.multinomial_logistic_loss_forward if fwd else loss.multinomial_logistic_loss_backward
    return Case(f"mll_{'fwd' if fwd else 'bwd'}", fn, make)


def _infogain(fwd, ignore, norm, axis=1):
    kw = dict(axis=axis, ignore_label=ignore, normalization=norm)

    def make(rng, dt):
        c = SHAPE[axis]
        lab = _labels(rng, dt, SHAPE[:axis] + SHAPE[axis + 1:], c, ignore)
        h = _r(rng, dt, (c, c), 0.0, 2.0)
        head = [_probs(rng, dt, axis), lab, h]
        return head + ([_z(dt, ())] if fwd else [np.array(0.6, dt), _z(dt)])
    fn = loss.infogain_loss_forward if fwd else loss.infogain_loss_backward
    return Case(f"infogain_{'fwd' if fwd else 'bwd'}-{ignore}-{norm}-axis{axis}", fn, make,
                kw=lambda: kw)


def _contrastive_pairs(rng, dt):
    """Features (12, 5) and partners at distances 0.2..3.5 (some dissimilar pairs inside the
    margin 1.5, some outside, by distance and by its square), a third of them similar."""
    a = _r(rng, dt, (12, 5))
    u = rng.standard_normal((12, 5))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    b = (a + u * np.linspace(0.2, 3.5, 12)[:, None]).astype(dt).reshape(12, 5, 1, 1)
    return [a, b, np.tile(np.array([1, 0, 0], dt), 4)]


def _contrastive(fwd, legacy, sign=1.0):
    kw = dict(margin=1.5, legacy_version=legacy) | ({} if fwd else dict(sign=sign))
    if fwd:
        return Case(f"contrastive_fwd-legacy{legacy}", loss.contrastive_loss_forward,
                    lambda rng, dt: _contrastive_pairs(rng, dt) + [_z(dt, ())], kw=lambda: kw)
    return Case(f"contrastive_bwd-legacy{legacy}{sign:+}", loss.contrastive_loss_backward,
                lambda rng, dt: _contrastive_pairs(rng, dt) + [np.array(0.9, dt),
                                                               _z(dt, (12, 5))],
                kw=lambda: kw)


def _mvn_fwd(across, variance):
    groups = 4 if across else 12
    return Case(f"mvn_fwd-across{across}-variance{variance}", nm.mvn_forward,
                lambda rng, dt: [_r(rng, dt, lo=-1, hi=3), _z(dt)]
                + ([_z(dt, (groups,))] if variance else []), n_out=1 + variance,
                kw=lambda: dict(groups=groups, eps=1e-3))


def _selector(rng, dt):
    """Six items, four selected (NaN counts as selected, as any nonzero value)."""
    return np.array([1, 0, 2.5, 0, np.nan, -1], dt)


def _reindex_permut(dt):
    return np.array([3, 0, 3.7, 5, 1, 3, 0.2], dt)  # repeats, and fractions truncated


def _embed(rng, dtype, with_bias=True):
    x = rng.integers(0, 7, (4, 5)).astype(dtype)
    w = _r(rng, dtype, (7, 6))
    return [x, w] + ([_r(rng, dtype, (6,))] if with_bias else []) + [_z(dtype, (4, 5, 6))]


def _reduction(op, fwd):
    coeff = 0.5 if op != "MEAN" else 0.5 / 30
    kw = dict(op=op, coeff=coeff)
    if fwd:
        return Case(f"reduction_fwd-{op}", arr.reduction_forward,
                    lambda rng, dt: [_r(rng, dt), _z(dt, (4, 3))], kw=lambda: kw)
    needs_x = op in ("ASUM", "SUMSQ")
    return Case(f"reduction_bwd-{op}", arr.reduction_backward,
                lambda rng, dt: ([_r(rng, dt)] if needs_x else []) + [_r(rng, dt, (4, 3)),
                                                                      _z(dt)], kw=lambda: kw)


def _argmax(axis, top_k, out_max_val):
    kw = dict(axis=axis, top_k=top_k, out_max_val=out_max_val)

    def make(rng, dtype):
        x = _ties(rng, dtype)
        if axis is None:
            y = _z(dtype, (4, 1 + out_max_val, top_k))
        else:
            shape = list(SHAPE)
            shape[axis] = top_k
            y = _z(dtype, tuple(shape))
        return [x, y]
    return Case(f"argmax-{axis}-{top_k}-{out_max_val}", arr.argmax_forward, make, kw=lambda: kw)


# -- STOCHASTIC pooling (no padding) and Im2col: array code on every device -------------
# overlapping 3x3 windows, the last column's clipped; windows (third row) past the image
STOCHASTIC_GEOMS = {"overlap": pool_geometry(4, 3, 5, 6, (3, 3), (2, 2), (0, 0)),
                    "gaps": pool_geometry(4, 3, 5, 6, (1, 2), (3, 4), (0, 0))}


def _nonneg(rng, dtype):
    """Values to sample from: non-negative, the first 2x2 of every plane zero (all-zero
    windows: TEST's FLT_MIN denominator, TRAIN's first-position pick)."""
    x = _r(rng, dtype, lo=0.0, hi=1.0)
    x[:, :, :2, :2] = 0
    return x


def _pooled(g: pl.PoolGeometry) -> tuple[int, ...]:
    return (g.num, g.channels, g.pooled_h, g.pooled_w)


def _stochastic(kind: str, geom: str) -> Case:
    g = STOCHASTIC_GEOMS[geom]
    kw = dict(geom=g)
    if kind == "fwd_train":
        return Case(f"stochastic_fwd_train-{geom}", pl.stochastic_pool_forward_train,
                    lambda rng, dt: [_nonneg(rng, dt), _z(dt, _pooled(g)),
                                     np.full(_pooled(g), 7, np.int32)], n_out=2,
                    kw=lambda: kw | dict(rng=RandomStream(9, 2)))
    if kind == "bwd_train":
        def make(rng, dt):
            """The routing given the picks a forward recorded (-1 where none)."""
            index = np.zeros(_pooled(g), np.int32)
            pl.stochastic_pool_forward_train(_nonneg(rng, dt), _z(dt, _pooled(g)), index,
                                             geom=g, rng=RandomStream(9, 3))
            return [_r(rng, dt, _pooled(g)), index, _r(rng, dt)]
        return Case(f"stochastic_bwd_train-{geom}", pl.stochastic_pool_backward, make,
                    kw=lambda: kw)
    if kind == "fwd_test":
        return Case(f"stochastic_fwd_test-{geom}", pl.stochastic_pool_forward_test,
                    lambda rng, dt: [_nonneg(rng, dt), _z(dt, _pooled(g))], kw=lambda: kw)
    return Case(f"stochastic_bwd_test-{geom}", pl.stochastic_pool_backward_test,
                lambda rng, dt: [_nonneg(rng, dt), _r(rng, dt, _pooled(g)), _r(rng, dt)],
                kw=lambda: kw, rtol32=1e-4)


IM2COL_GEOMS = {  # (num, channels, size, kernel, stride, pad, dilation)
    "2d": i2c.Im2colGeometry(4, 3, (5, 6), (3, 2), (2, 1), (1, 0), (2, 1)),
    "3d": i2c.Im2colGeometry(2, 3, (4, 5, 6), (2, 3, 2), (1, 2, 2), (1, 0, 1), (1, 1, 2)),
    "1d": i2c.Im2colGeometry(4, 3, (9,), (3,), (2,), (1,), (3,)),
}


def _im2col(fwd: bool, geom: str) -> Case:
    g = IM2COL_GEOMS[geom]
    x_shape = (g.num, g.channels) + g.size
    y_shape = (g.num, g.channels * int(np.prod(g.kernel))) + g.out
    if fwd:
        return Case(f"im2col_fwd-{geom}", i2c.im2col_forward,
                    lambda rng, dt: [_r(rng, dt, x_shape), _z(dt, y_shape)],
                    kw=lambda: dict(geom=g))
    return Case(f"im2col_bwd-{geom}", i2c.im2col_backward,
                lambda rng, dt: [_r(rng, dt, y_shape), _r(rng, dt, x_shape)],
                kw=lambda: dict(geom=g))


# -- recurrent: T = 4 steps, N = 3 sequences, H = 5 ------------------------------------------
T, N, H = 4, 3, 5


def _cont(dt):
    """A reset at t = 0 and two inside the sequences."""
    c = np.ones((T, N), dt)
    c[0] = 0
    c[2, 1] = c[3, 2] = 0
    return c


def _rnn_fwd(state_in_place: bool):
    def make(rng, dt):
        h0 = _r(rng, dt, (1, N, H))
        head = [_r(rng, dt, (T, N, H)), _cont(dt), _r(rng, dt, (H, H), -0.6, 0.6), h0]
        # the kept state: h_T written over h_0, after h_0 has been read
        return head + [_z(dt, (T, N, H)), _z(dt, (1, N, H)),
                       h0 if state_in_place else _z(dt, (1, N, H))]
    return Case(f"rnn_fwd-inplace{state_in_place}", rec.rnn_forward, make, n_out=3)


def _lstm_fwd(state_in_place: bool):
    def make(rng, dt):
        h0, c0 = _r(rng, dt, (1, N, H)), _r(rng, dt, (1, N, H))
        head = [_r(rng, dt, (T, N, 4 * H)), _cont(dt), _r(rng, dt, (4 * H, H), -0.6, 0.6),
                h0, c0]
        outs = [_z(dt, (T, N, H)), _z(dt, (T, N, H)), _z(dt, (T, N, 4 * H)),
                _z(dt, (1, N, H)), _z(dt, (1, N, H))]
        last = [h0, c0] if state_in_place else [_z(dt, (1, N, H)), _z(dt, (1, N, H))]
        return head + outs + last
    return Case(f"lstm_fwd-inplace{state_in_place}", rec.lstm_forward, make, n_out=7)


def _lstm_bwd(rng, dt):
    """Activated gates as a forward leaves them: i, f, o in (0, 1), g in (-1, 1)."""
    gates = np.concatenate([_r(rng, dt, (T, N, 3 * H), 0.05, 0.95),
                            _r(rng, dt, (T, N, H), -0.95, 0.95)], axis=2)
    return [_cont(dt), _r(rng, dt, (4 * H, H), -0.6, 0.6), _r(rng, dt, (1, N, H)),
            _r(rng, dt, (1, N, H)), _r(rng, dt, (T, N, H), -0.9, 0.9), _r(rng, dt, (T, N, H)),
            gates, _r(rng, dt, (T, N, H)), _z(dt, (T, N, 4 * H)), _z(dt, (4 * H, H))]


def _unit_in(rng, dt):
    """c_prev, gate inputs, cont (a reset, a fraction, a continuation), c."""
    return [_r(rng, dt, (1, N, H)), _r(rng, dt, (1, N, 4 * H)),
            np.array([[0.0, 0.5, 1.0]], dt), _r(rng, dt, (1, N, H))]


def _unit_bwd(dc_prev: bool, dx: bool):
    def make(rng, dt):
        return (_unit_in(rng, dt) + [_r(rng, dt, (1, N, H)), _r(rng, dt, (1, N, H))]
                + ([_z(dt, (1, N, H))] if dc_prev else []) + ([_z(dt, (1, N, 4 * H))]
                                                              if dx else []))
    return Case(f"lstm_unit_bwd-{dc_prev}-{dx}", rec.lstm_unit_backward, make,
                n_out=dc_prev + dx, kw=lambda: dict(want_dc_prev=dc_prev, want_dx=dx))


CASES = [
    # activation
    Case("relu_fwd", act.relu_forward, _x_y),
    Case("relu_fwd_inplace", act.relu_forward, _inplace(_x_y)),
    Case("relu_fwd_leaky", act.relu_forward, _x_y, kw=lambda: dict(negative_slope=0.1)),
    Case("relu_fwd_leaky_inplace", act.relu_forward, _inplace(_x_y),
         kw=lambda: dict(negative_slope=0.1)),
    Case("relu_bwd", act.relu_backward, _x_dy_dx),
    Case("relu_bwd_leaky", act.relu_backward, _x_dy_dx, kw=lambda: dict(negative_slope=0.1)),
    Case("relu_bwd_dx_is_dy", act.relu_backward,
         lambda rng, dt: (lambda x, dy: [x, dy, dy])(_r(rng, dt), _r(rng, dt))),
    Case("prelu_fwd", act.prelu_forward,
         lambda rng, dt: [_r(rng, dt), _slope(False)(rng, dt), _z(dt)]),
    Case("prelu_fwd_shared", act.prelu_forward,
         lambda rng, dt: [_r(rng, dt), _slope(True)(rng, dt), _z(dt)]),
    Case("prelu_bwd_data", act.prelu_backward_data,
         lambda rng, dt: [_r(rng, dt), _slope(False)(rng, dt), _r(rng, dt), _z(dt)]),
    Case("prelu_bwd_slope", act.prelu_backward_slope,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt), _z(dt, (3,))]),
    Case("prelu_bwd_slope_shared", act.prelu_backward_slope,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt), _z(dt, ())]),
    Case("sigmoid_fwd", act.sigmoid_forward, _x_y),
    Case("sigmoid_bwd", act.sigmoid_backward, _y_dy_dx()),
    Case("tanh_fwd", act.tanh_forward, _x_y),
    Case("tanh_bwd", act.tanh_backward, _y_dy_dx(-0.9, 0.9)),
    Case("elu_fwd", act.elu_forward, _x_y, kw=lambda: dict(alpha=0.7)),
    Case("elu_bwd", act.elu_backward,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt), _r(rng, dt), _z(dt)],
         kw=lambda: dict(alpha=0.7)),
    Case("absval_fwd", act.absval_forward, _x_y),
    Case("absval_bwd", act.absval_backward, _x_dy_dx),
    Case("bnll_fwd", act.bnll_forward, lambda rng, dt: [_r(rng, dt, lo=-60, hi=60), _z(dt)]),
    Case("bnll_bwd", act.bnll_backward,
         lambda rng, dt: [_r(rng, dt, lo=-60, hi=60), _r(rng, dt), _z(dt)]),
    Case("threshold", act.threshold_forward, _x_y, kw=lambda: dict(threshold=0.3)),
    Case("power_fwd", act.power_forward, lambda rng, dt: [_r(rng, dt, lo=0.1), _z(dt)],
         kw=lambda: dict(power=1.7, scale=0.8, shift=0.3)),
    Case("power_fwd_const", act.power_forward, _x_y,
         kw=lambda: dict(power=2.0, scale=0.0, shift=1.5)),
    Case("power_bwd", act.power_backward, lambda rng, dt: [_r(rng, dt, lo=0.1), _r(rng, dt),
                                                           _z(dt)],
         kw=lambda: dict(power=1.7, scale=0.8, shift=0.3)),
    Case("power_bwd_square", act.power_backward, _x_dy_dx,
         kw=lambda: dict(power=2.0, scale=-1.5, shift=0.0)),
    Case("power_bwd_linear", act.power_backward_linear, lambda rng, dt: [_r(rng, dt), _z(dt)],
         kw=lambda: dict(diff_scale=0.4)),
    Case("power_bwd_linear_zero", act.power_backward_linear,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt)], kw=lambda: dict(diff_scale=0.0)),
    Case("exp_fwd", act.exp_forward, _x_y, kw=lambda: dict(inner_scale=0.7, outer_scale=1.3)),
    Case("exp_fwd_plain", act.exp_forward, _x_y, kw=lambda: dict(inner_scale=1, outer_scale=1)),
    Case("exp_bwd", act.exp_backward, _y_dy_dx(), kw=lambda: dict(inner_scale=0.7)),
    Case("log_fwd", act.log_forward, lambda rng, dt: [_r(rng, dt, lo=0.1), _z(dt)],
         kw=lambda: dict(scale=1.5, shift=0.2, base_scale=0.4)),
    Case("log_bwd", act.log_backward,
         lambda rng, dt: [_r(rng, dt, lo=0.1), _r(rng, dt), _z(dt)],
         kw=lambda: dict(scale=1.5, shift=0.2, base_scale=0.4)),
    Case("dropout_fwd", act.dropout_forward,
         lambda rng, dt: [_r(rng, dt), _z(dt), _z("uint8")], n_out=2,
         kw=lambda: dict(ratio=0.3, rng=RandomStream(7, 3))),
    Case("dropout_fwd_inplace", act.dropout_forward,
         lambda rng, dt: (lambda x: [x, x, _z("uint8")])(_r(rng, dt)), n_out=2,
         kw=lambda: dict(ratio=0.5, rng=RandomStream(7, 4))),
    Case("dropout_bwd", act.dropout_backward,
         lambda rng, dt: [rng.integers(0, 2, SHAPE).astype("uint8"), _r(rng, dt), _z(dt)],
         kw=lambda: dict(ratio=0.3)),
    Case("swish_fwd", act.swish_forward, lambda rng, dt: [_r(rng, dt, lo=-6, hi=6), _z(dt),
                                                         _z(dt)], n_out=2,
         kw=lambda: dict(beta=0.7)),
    Case("swish_fwd_inplace", act.swish_forward,
         lambda rng, dt: (lambda x: [x, x, _z(dt)])(_r(rng, dt, lo=-6, hi=6)), n_out=2,
         kw=lambda: dict(beta=1.0)),
    Case("swish_bwd", act.swish_backward,
         lambda rng, dt: [_r(rng, dt), _y_dy_dx()(rng, dt)[0], _r(rng, dt), _z(dt)],
         kw=lambda: dict(beta=0.7)),
    Case("clip_fwd", act.clip_forward, _x_y, kw=lambda: dict(lo=-0.5, hi=1.2)),
    Case("clip_fwd_inplace", act.clip_forward, _inplace(_x_y), kw=lambda: dict(lo=-0.5, hi=1.2)),
    Case("clip_fwd_lo_above_hi", act.clip_forward, _x_y, kw=lambda: dict(lo=0.4, hi=-0.4)),
    Case("clip_bwd", act.clip_backward, _x_dy_dx, kw=lambda: dict(lo=-0.5, hi=1.2)),
    # softmax
    Case("softmax_fwd_axis1", sm.softmax_forward, _x_y, kw=lambda: dict(axis=1)),
    Case("softmax_fwd_axis3_inplace", sm.softmax_forward, _inplace(_x_y),
         kw=lambda: dict(axis=3)),
    Case("softmax_bwd", sm.softmax_backward,
         lambda rng, dt: [_probs(rng, dt), _r(rng, dt), _z(dt)], kw=lambda: dict(axis=1)),
    # losses
    *[_softmax_loss(f, ig, n) for f in (True, False) for ig in (None, 2)
      for n in loss.NORMALIZATIONS],
    Case("euclidean_fwd", loss.euclidean_loss_forward,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt, (4, 90)), _z(dt, ())]),
    *[Case(f"euclidean_bwd{s:+}", loss.euclidean_loss_backward,
           lambda rng, dt: [_r(rng, dt), _r(rng, dt), np.array(0.6, dt), _z(dt)],
           kw=lambda s=s: dict(sign=s)) for s in (1.0, -1.0)],
    *[_sce(f, ig, n) for f in (True, False) for ig in (None, -1)
      for n in ("BATCH_SIZE", "VALID", "FULL")],
    *[Case(f"hinge_fwd-{n}", loss.hinge_loss_forward,
           lambda rng, dt: [_r(rng, dt, (8, 10)), _labels(rng, dt, (8,), 10), _z(dt, ())],
           kw=lambda n=n: dict(norm=n)) for n in ("L1", "L2")],
    *[Case(f"hinge_bwd-{n}", loss.hinge_loss_backward,
           lambda rng, dt: [_r(rng, dt, (8, 10)), _labels(rng, dt, (8,), 10),
                            np.array(0.9, dt), _z(dt, (8, 10))],
           kw=lambda n=n: dict(norm=n)) for n in ("L1", "L2")],
    _accuracy(1, None, False), _accuracy(2, None, True), _accuracy(1, 1, True),
    _accuracy(2, 0, False, axis=3),
    _mll(True), _mll(False),
    *[_infogain(f, ig, n) for f in (True, False) for ig, n in ((None, "VALID"), (2, "VALID"),
                                                              (2, "FULL"), (None, "NONE"))],
    _infogain(True, 1, "BATCH_SIZE", axis=3), _infogain(False, 1, "BATCH_SIZE", axis=3),
    Case("infogain_matrix", loss.infogain_matrix, lambda rng, dt: [_z(dt, (5, 5))],
         kw=lambda: dict(value=np.arange(25.0).reshape(5, 5))),
    *[_contrastive(True, legacy) for legacy in (False, True)],
    *[_contrastive(False, legacy, s) for legacy in (False, True) for s in (1.0, -1.0)],
    # normalization
    Case("bn_fwd_train", nm.batch_norm_forward_train, _bn_train, n_out=6,
         kw=lambda: dict(channels=3, moving_average_fraction=0.999, eps=1e-5)),
    Case("bn_fwd_global", nm.batch_norm_forward_global, _bn_global(3.5), n_out=2,
         kw=lambda: dict(channels=3, eps=1e-5)),
    Case("bn_fwd_global_untrained", nm.batch_norm_forward_global, _bn_global(0.0), n_out=2,
         kw=lambda: dict(channels=3, eps=1e-5)),
    Case("bn_bwd_train", nm.batch_norm_backward_train,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt), _r(rng, dt, (3,), 0.5, 2), _z(dt)],
         kw=lambda: dict(channels=3), rtol32=1e-4),
    Case("bn_bwd_global", nm.batch_norm_backward_global,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt, (3,), 0.5, 2), _z(dt)],
         kw=lambda: dict(channels=3)),
    Case("scale_fwd", nm.scale_forward, lambda rng, dt: [_r(rng, dt), _r(rng, dt, (3,)),
                                                         _z(dt)], kw=lambda: ODI),
    Case("scale_fwd_bias_inplace", nm.scale_forward,
         lambda rng, dt: (lambda x: [x, _r(rng, dt, (3,)), _r(rng, dt, (3,)), x])(_r(rng, dt)),
         kw=lambda: ODI),
    Case("scale_bwd_data", nm.scale_backward_data,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt, (3,)), _z(dt)], kw=lambda: ODI),
    Case("scale_bwd_scale", nm.scale_backward_scale,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt), _z(dt, (3,))], kw=lambda: ODI),
    Case("bias_fwd", nm.bias_forward, lambda rng, dt: [_r(rng, dt), _r(rng, dt, (3,)),
                                                       _z(dt)], kw=lambda: ODI),
    Case("bias_bwd", nm.bias_backward_bias, lambda rng, dt: [_r(rng, dt), _z(dt, (3,))],
         kw=lambda: ODI),
    *[_mvn_fwd(a, v) for a in (False, True) for v in (False, True)],
    Case("mvn_fwd_inplace", nm.mvn_forward,
         lambda rng, dt: (lambda x: [x, x, _z(dt, (12,))])(_r(rng, dt)), n_out=2,
         kw=lambda: dict(groups=12, eps=1e-9)),
    Case("mvn_bwd", nm.mvn_backward,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt, (12,), 0.5, 2.0), _r(rng, dt), _z(dt)],
         kw=lambda: dict(groups=12), rtol32=1e-4),
    Case("mvn_bwd_dx_is_dy", nm.mvn_backward,
         lambda rng, dt: (lambda dy: [_r(rng, dt), _r(rng, dt, (4,), 0.5, 2.0), dy, dy])(
             _r(rng, dt)), kw=lambda: dict(groups=4), rtol32=1e-4),
    Case("mvn_bwd_mean", nm.mvn_backward_mean, lambda rng, dt: [_r(rng, dt), _z(dt)],
         kw=lambda: dict(groups=12)),
    # array
    Case("concat", arr.concat_forward,
         lambda rng, dt: [_r(rng, dt, (4, 2, 5)), _r(rng, dt, (4, 3, 5)), _z(dt, (4, 5, 5))],
         kw=lambda: dict(axis=1)),
    Case("take_slice", arr.take_slice, lambda rng, dt: [_r(rng, dt), _z(dt, (4, 3, 2, 6))],
         kw=lambda: dict(axis=2, start=1)),
    Case("slice_fwd", arr.slice_forward,
         lambda rng, dt: [_r(rng, dt), _z(dt, (4, 3, 5, 2)), _z(dt, (4, 3, 5, 4))], n_out=2,
         kw=lambda: dict(axis=3)),
    Case("slice_bwd", arr.slice_backward,
         lambda rng, dt: [_r(rng, dt, (1, 3, 5, 6)), _r(rng, dt, (3, 3, 5, 6)), _z(dt)],
         kw=lambda: dict(axis=0)),
    Case("eltwise_sum", arr.eltwise_sum,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt), _r(rng, dt), _z(dt)],
         kw=lambda: dict(coeffs=(1.0, -0.5, 2.0))),
    Case("eltwise_prod", arr.eltwise_prod,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt), _r(rng, dt), _z(dt)]),
    Case("eltwise_max", arr.eltwise_max,
         lambda rng, dt: [_ties(rng, dt), _ties(rng, dt), _ties(rng, dt), _z(dt),
                          _z("int32")], n_out=2),
    Case("eltwise_sum_bwd", arr.eltwise_sum_backward, lambda rng, dt: [_r(rng, dt), _z(dt)],
         kw=lambda: dict(coeff=-0.5)),
    Case("eltwise_sum_bwd_one", arr.eltwise_sum_backward,
         lambda rng, dt: [_r(rng, dt), _z(dt)], kw=lambda: dict(coeff=1.0)),
    Case("eltwise_prod_bwd", arr.eltwise_prod_backward,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt), _r(rng, dt), _z(dt)]),
    Case("eltwise_prod_bwd_quotient", arr.eltwise_prod_backward_quotient,
         lambda rng, dt: [_r(rng, dt), _r(rng, dt, lo=0.5), _r(rng, dt), _z(dt)]),
    Case("eltwise_max_bwd", arr.eltwise_max_backward,
         lambda rng, dt: [rng.integers(0, 3, SHAPE).astype("int32"), _r(rng, dt), _z(dt)],
         kw=lambda: dict(index=1)),
    Case("reshape_copy", arr.reshape_copy, lambda rng, dt: [_r(rng, dt), _z(dt, (12, 30))]),
    Case("crop_fwd", arr.crop_forward, lambda rng, dt: [_r(rng, dt), _z(dt, (4, 3, 3, 2))],
         kw=lambda: dict(offsets=(0, 0, 1, 3))),
    Case("crop_bwd", arr.crop_backward, lambda rng, dt: [_r(rng, dt, (4, 3, 3, 2)), _r(rng, dt)],
         kw=lambda: dict(offsets=(0, 0, 1, 3))),
    Case("tile_fwd", arr.tile_forward, lambda rng, dt: [_r(rng, dt), _z(dt, (4, 9, 5, 6))],
         kw=lambda: dict(axis=1, tiles=3)),
    Case("tile_bwd", arr.tile_backward, lambda rng, dt: [_r(rng, dt, (4, 9, 5, 6)), _z(dt)],
         kw=lambda: dict(axis=1, tiles=3)),
    _argmax(None, 1, False), _argmax(None, 3, True), _argmax(1, 1, False), _argmax(1, 2, True),
    _argmax(3, 3, False),
    *[_reduction(op, f) for op in ("SUM", "ASUM", "SUMSQ", "MEAN") for f in (True, False)],
    Case("embed_fwd", arr.embed_forward, _embed, kw=lambda: dict(input_dim=7)),
    Case("embed_fwd_nobias", arr.embed_forward, lambda rng, dt: _embed(rng, dt, False),
         kw=lambda: dict(input_dim=7)),
    Case("embed_bwd_weight", arr.embed_backward_weight,
         lambda rng, dt: [rng.integers(0, 7, (4, 5)).astype(dt), _r(rng, dt, (4, 5, 6)),
                          _z(dt, (7, 6))], kw=lambda: dict(input_dim=7)),
    Case("embed_bwd_bias", arr.embed_backward_bias,
         lambda rng, dt: [_r(rng, dt, (4, 5, 6)), _z(dt, (6,))]),
    Case("filter_fwd", arr.filter_forward,
         lambda rng, dt: [_r(rng, dt, (6, 3, 2)), _r(rng, dt, (6,)), _selector(rng, dt),
                          _z(dt, (4, 3, 2)), _z(dt, (4,))], n_out=2,
         kw=lambda: dict(bottoms=2)),
    Case("filter_fwd_all", arr.filter_forward,
         lambda rng, dt: [_r(rng, dt), np.ones((4, 1), dt), _z(dt)],
         kw=lambda: dict(bottoms=1)),
    Case("filter_bwd", arr.filter_backward,
         lambda rng, dt: [_selector(rng, dt), _r(rng, dt, (4, 3, 2)), _r(rng, dt, (6, 3, 2))]),
    Case("batch_reindex_fwd", arr.batch_reindex_forward,
         lambda rng, dt: [_r(rng, dt, (6, 5, 2)), _reindex_permut(dt), _z(dt, (7, 5, 2))]),
    Case("batch_reindex_bwd", arr.batch_reindex_backward,
         lambda rng, dt: [_reindex_permut(dt), _r(rng, dt, (7, 5, 2)), _r(rng, dt, (6, 5, 2))]),
    # tensor
    Case("fill", tensor.fill, lambda rng, dt: [_r(rng, dt)], kw=lambda: dict(value=0.25)),
    Case("copy", tensor.copy, _x_y),
    Case("sum", tensor.sum, lambda rng, dt: [_r(rng, dt), _r(rng, dt), _r(rng, dt), _z(dt)]),
    Case("accumulate", tensor.accumulate,
         lambda rng, dt: (lambda acc: [_r(rng, dt), acc, acc])(_r(rng, dt))),
    Case("add_scalar_inplace", tensor.add_scalar,
         lambda rng, dt: (lambda it: [it, it])(np.array(41.0, dt)), kw=lambda: dict(value=1.0)),
    # inner product
    *[Case(f"ip_fwd-{t}-{b}", ip.inner_product_forward,
           lambda rng, dt, t=t, b=b: [_r(rng, dt), _r(rng, dt, (90, 7) if t else (7, 90))]
           + ([_r(rng, dt, (7,))] if b else []) + [_z(dt, (4, 7))],
           kw=lambda t=t: dict(m=4, transpose=t)) for t in (False, True) for b in (False, True)],
    *[Case(f"ip_bwd_data-{t}", ip.inner_product_backward_data,
           lambda rng, dt, t=t: [_r(rng, dt, (4, 7)), _r(rng, dt, (90, 7) if t else (7, 90)),
                                 _z(dt)], kw=lambda t=t: dict(m=4, transpose=t))
      for t in (False, True)],
    *[Case(f"ip_bwd_weight-{t}", ip.inner_product_backward_weight,
           lambda rng, dt, t=t: [_r(rng, dt), _r(rng, dt, (4, 7)),
                                 _z(dt, (90, 7) if t else (7, 90))],
           kw=lambda t=t: dict(m=4, transpose=t)) for t in (False, True)],
    Case("ip_bwd_bias", ip.inner_product_backward_bias,
         lambda rng, dt: [_r(rng, dt, (4, 7)), _z(dt, (7,))], kw=lambda: dict(m=4)),
    # pooling: STOCHASTIC, Im2col
    *[_stochastic(k, g) for k in ("fwd_train", "bwd_train", "fwd_test", "bwd_test")
      for g in STOCHASTIC_GEOMS],
    *[_im2col(f, g) for f in (True, False) for g in IM2COL_GEOMS],
    # recurrent
    Case("add_static_inplace", rec.add_static,
         lambda rng, dt: (lambda pre: [pre, _r(rng, dt, (N, H)), pre])(_r(rng, dt, (T, N, H)))),
    Case("sum_over_time", rec.sum_over_time,
         lambda rng, dt: [_r(rng, dt, (T, N, H)), _z(dt, (N, H))]),
    _rnn_fwd(False), _rnn_fwd(True),
    Case("rnn_bwd", rec.rnn_backward,
         lambda rng, dt: [_r(rng, dt, (T, N, H), -0.9, 0.9), _r(rng, dt, (1, N, H)), _cont(dt),
                          _r(rng, dt, (H, H), -0.6, 0.6), _r(rng, dt, (T, N, H)),
                          _z(dt, (T, N, H)), _z(dt, (H, H))], n_out=2, rtol32=1e-4),
    _lstm_fwd(False), _lstm_fwd(True),
    Case("lstm_bwd", rec.lstm_backward, _lstm_bwd, n_out=2, rtol32=1e-4),
    Case("lstm_unit_fwd", rec.lstm_unit_forward,
         lambda rng, dt: _unit_in(rng, dt)[:3] + [_z(dt, (1, N, H)), _z(dt, (1, N, H))],
         n_out=2),
    _unit_bwd(True, True), _unit_bwd(True, False), _unit_bwd(False, True),
]


def _run(case: Case, dtype: str, device: bool) -> list[np.ndarray]:
    """The case's outputs after one call, on numpy or on the GPU (same inputs, same seed);
    under the CPU stand-in the 'GPU' arrays are numpy copies, moved as cupy's would be."""
    args = case.make(np.random.default_rng(12345), dtype)
    if device:
        if STAND_IN:
            to_device, to_host = np.array, np.asarray
        else:
            import cupy

            to_device, to_host = cupy.asarray, cupy.asnumpy
        moved: dict[int, object] = {}  # an array given twice (in place) moves once
        args = [moved.setdefault(id(a), to_device(a)) if isinstance(a, np.ndarray) else a
                for a in args]
    case.fn(*args, **case.kw())
    outs = args[-case.n_out:]
    return [to_host(o) for o in outs] if device else outs


# -- without a GPU -----------------------------------------------------------------------------
def test_case_table_runs_on_numpy():
    """Every case is well formed (the GPU tests below are the same calls on cupy)."""
    for case in CASES:
        for dtype in ("float64", "float32"):
            outs = _run(case, dtype, device=False)
            assert all(np.isfinite(o).all() for o in outs), case.id


FUSED = {**{f"act_{k}": v for k, v in act.FUSED.items()},
         "softmax_loss_grad": loss.SOFTMAX_LOSS_GRAD}


def test_fused_kernels_compile_for_sm90(tmp_path):
    kernels = {}
    for dtype in ("float64", "float32"):
        a = np.zeros(4, dtype)
        for name, spec in FUSED.items():
            args = []
            for t, _ in (p.split() for p in (spec[0] + ", " + spec[1]).split(",")):
                args.append(a if t == "T" else np.zeros(4, "uint8") if t == "M"
                            else np.zeros(4, "int64") if t == "int64" else 0.5)
            kernels[f"{name}_{dtype}"] = (spec, args)
    nvcc_compiles(kernels, tmp_path)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_fused_relu_bit_for_bit_emulated(slope, dtype):
    rng = np.random.default_rng(0)
    x, dy = _r(rng, dtype), _r(rng, dtype)
    x.reshape(-1)[::11] = 0
    dy.reshape(-1)[::13] = -np.inf
    want, got = _z(dtype), _z(dtype)
    with np.errstate(invalid="ignore"):  # -inf * 0 is NaN on both paths
        act.relu_backward(x, dy, want, negative_slope=slope)
    emulate(act.FUSED["relu_backward"], x, dy, slope, got)
    np.testing.assert_array_equal(got, want)
    if slope:
        act.relu_forward(x, want, negative_slope=slope)
        emulate(act.FUSED["relu_leaky"], x, slope, got)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_dropout_bit_for_bit_emulated(dtype):
    rng = np.random.default_rng(0)
    x, want, mask = _r(rng, dtype), _z(dtype), _z("uint8")
    act.dropout_forward(x, want, mask, ratio=0.3, rng=RandomStream(1, 2))
    got = _z(dtype)
    emulate(act.FUSED["dropout"], x, mask, 1.0 / (1.0 - 0.3), got)
    np.testing.assert_array_equal(got, want)
    act.dropout_backward(mask, x, want, ratio=0.3)
    emulate(act.FUSED["dropout"], x, mask, 1.0 / (1.0 - 0.3), got)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("ignore", [None, 2])
def test_fused_softmax_loss_grad_bit_for_bit_emulated(ignore, dtype):
    """The kernel's arithmetic, with the per-position factor the GPU branch computes."""
    rng = np.random.default_rng(0)
    p, lab = _probs(rng, dtype), _labels(rng, dtype, (4, 5, 6), 3, ignore)
    dloss = np.array(0.7, dtype)
    want = _z(dtype)
    loss.softmax_loss_backward(p, lab, dloss, want, axis=1, ignore_label=ignore)
    index, valid, _ = loss._class_labels(np, lab, 4, 3, 30, ignore)
    scale = dloss / loss._normalizer(np, "VALID", valid, 120, 4, p.dtype)
    factor = np.where(valid, scale, 0).astype(dtype)
    got = np.zeros((4, 3, 30), dtype)
    c = np.arange(3, dtype=np.int64)
    # broadcast by hand: the emulation takes full-size arrays
    emulate(loss.SOFTMAX_LOSS_GRAD, np.ascontiguousarray(p.reshape(4, 3, 30)),
            np.ascontiguousarray(np.broadcast_to(index[:, None, :], got.shape)),
            np.ascontiguousarray(np.broadcast_to(factor[:, None, :], got.shape)),
            np.ascontiguousarray(np.broadcast_to(c[None, :, None], got.shape)), got)
    np.testing.assert_array_equal(got.reshape(SHAPE), want)


class DeviceLike:
    """numpy under another name: the array module of the device bodies the ops run while
    every array counts as a device array."""

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.fixture
def device_branch(monkeypatch):
    monkeypatch.setattr(backend, "is_device_array", lambda a: True)
    monkeypatch.setattr(arr, "get_array_module", lambda *a: DeviceLike())
    # CuPy's scatter-add, which sums repeated indices as np.add.at does
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(scatter_add=np.add.at))


def test_filter_device_branch_gathers_and_refuses_a_wrong_count(device_branch):
    rng = np.random.default_rng(4)
    x, x2, sel = rng.standard_normal((6, 3, 2)), rng.standard_normal(6), _selector(rng, "f8")
    keep = [0, 2, 4, 5]  # the nonzero selector values, NaN included, in order
    y, y2 = np.zeros((4, 3, 2)), np.zeros(4)
    arr.filter_forward(x, x2, sel, y, y2, bottoms=2)
    np.testing.assert_array_equal(y, x[keep])
    np.testing.assert_array_equal(y2, x2[keep])
    dy, dx = rng.standard_normal((4, 3, 2)), np.full((6, 3, 2), 7.0)
    arr.filter_backward(sel, dy, dx)
    want = np.zeros((6, 3, 2))
    want[keep] = dy
    np.testing.assert_array_equal(dx, want)
    # the tops were built for 4 items: another count is an error on the device too
    for rows in (3, 5):
        with pytest.raises(PurineError, match=f"selects 4 of 6 items, but the tops were built "
                                              f"with {rows}"):
            arr.filter_forward(x, sel, np.zeros((rows, 3, 2)), bottoms=1)


def test_filter_wrong_count_is_an_error_on_the_host():
    with pytest.raises(PurineError, match=r"selects 4 of 6 items, but the tops were built "
                                          r"with 5"):
        arr.filter_forward(np.zeros((6, 2)), _selector(None, "f8"), np.zeros((5, 2)),
                           bottoms=1)


def test_batch_reindex_device_branch_sums_repeats_and_turns_bad_indices_into_nan(device_branch):
    rng = np.random.default_rng(5)
    x, permut = rng.standard_normal((6, 5, 2)), _reindex_permut("f8")
    idx = [3, 0, 3, 5, 1, 3, 0]  # truncated toward zero
    y = np.zeros((7, 5, 2))
    arr.batch_reindex_forward(x, permut, y)
    np.testing.assert_array_equal(y, x[idx])
    dy, dx = rng.standard_normal((7, 5, 2)), np.full((6, 5, 2), 7.0)
    arr.batch_reindex_backward(permut, dy, dx)
    want = np.zeros((6, 5, 2))
    for i, j in enumerate(idx):
        want[j] += dy[i]
    np.testing.assert_allclose(dx, want, rtol=1e-15)
    assert not dx[[2, 4]].any()  # never picked
    bad = np.array([1.0, 6.0, -1.0, np.nan, 5.9])
    y = np.zeros((5, 5, 2))
    arr.batch_reindex_forward(x, bad, y)  # no error on a GPU: NaN rows instead
    np.testing.assert_array_equal(np.isnan(y).all(axis=(1, 2)), [False, True, True, True, False])
    np.testing.assert_array_equal(y[[0, 4]], x[[1, 5]])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("geom", sorted(STOCHASTIC_GEOMS))
def test_stochastic_backward_device_branch_routes_as_the_host(monkeypatch, geom, dtype):
    """On a GPU the routing is MAX's gather kernel reading the recorded picks (-1: none);
    here that kernel's CUDA C runs emulated and must give the host's scatter-add exactly
    (both add a pixel's windows in window order)."""
    g = STOCHASTIC_GEOMS[geom]
    dy, index, _ = _stochastic("bwd_train", geom).make(np.random.default_rng(3), dtype)
    want = np.full((g.num, g.channels, g.height, g.width), 7.0, dtype)
    pl.stochastic_pool_backward(dy, index, want, geom=g)
    launched = []

    def kernel(family, name, dt):
        launched.append(name)
        return cuda_emulate.kernel(family, name, dt)

    monkeypatch.setattr(backend, "is_device_array", lambda a: True)
    monkeypatch.setattr(pl, "get_array_module", lambda *a: DeviceLike())
    monkeypatch.setattr(cuda, "kernel", kernel)
    got = np.full_like(want, np.nan)
    pl.stochastic_pool_backward(dy, index, got, geom=g)
    assert launched == ["max_pool_backward"]
    np.testing.assert_array_equal(got, want)
    # what the comparison covers: pixels picked by two windows, or windows without a pick
    picks = np.bincount((index + np.arange(g.num * g.channels).reshape(g.num, g.channels, 1, 1)
                         * g.height * g.width)[index >= 0])
    assert (picks.max() > 1) if geom == "overlap" else (index == -1).any()


# -- on a GPU ----------------------------------------------------------------------------------
@requires_gpu_or_stand_in
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_op_on_gpu_matches_numpy(case, dtype):
    """float64 to 1e-12 (reductions and transcendental functions may differ in the last
    places); float32 to the case's rtol (1e-5 unless stated), atol 1e-6."""
    want = _run(case, dtype, device=False)
    got = _run(case, dtype, device=True)
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == "float64" else dict(rtol=case.rtol32,
                                                                          atol=1e-6)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, err_msg=case.id, **tol)


@requires_gpu
def test_bad_label_is_nan_on_gpu_and_an_error_on_the_host():
    import cupy

    rng = np.random.default_rng(0)
    p, lab = _probs(rng, "float64"), _labels(rng, "float64", (4, 5, 6), 3)
    lab[1, 2, 3] = 3
    with pytest.raises(LabelError):
        loss.softmax_loss_forward(p, lab, np.zeros(()), axis=1)
    out = cupy.zeros(())
    loss.softmax_loss_forward(cupy.asarray(p), cupy.asarray(lab), out, axis=1)
    assert np.isnan(out.get())
    dx = cupy.zeros(SHAPE)
    loss.softmax_loss_backward(cupy.asarray(p), cupy.asarray(lab), cupy.ones(()), dx, axis=1)
    bad = np.isnan(dx.get())
    assert bad[1, :, 2, 3].all() and bad.sum() == 3
    acc = cupy.zeros(())
    loss.accuracy_forward(cupy.asarray(p), cupy.asarray(lab), acc, axis=1)
    assert np.isnan(acc.get())
