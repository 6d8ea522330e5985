"""Recurrent kernels (Caffe's RNN, LSTM and LSTMUnit): each recurrence runs as one op, a loop
over time steps whose every step is vectorized over the batch, and its backward op runs the
same loop in reverse (backpropagation through time).

T = 0 runs no step: the outputs are empty, the final state is the initial one and the
gradients are zero. (Caffe's own unrolled net cannot be set up for T = 0: its Slice of the
input has no tops.)

Shapes: ``pre`` (T, N, G) holds the input projections of all steps (W x_t + b, plus the static
input's projection), ``cont`` (T, N) the sequence continuation flags, ``h0``/``c0`` (1, N, H)
the state before the first step. The gate order of an LSTM's 4H axis is i, f, o, g.
"""

from __future__ import annotations

from typing import Any

from purine.backend import get_array_module

Array = Any


def _sigmoid(xp: Any, x: Array, out: Array) -> None:
    """1 / (1 + e^-x) through tanh: no overflow for large |x|."""
    xp.multiply(x, 0.5, out=out)
    xp.tanh(out, out=out)
    out *= 0.5
    out += 0.5


def _steps(hs: Array) -> int:
    """The time steps to run: none when a step has nothing to compute (N = 0 or H = 0),
    whatever T (2^31-1 empty steps would take hours and change nothing)."""
    return hs.shape[0] if hs.size else 0


def _conted(cont_t: Array, h: Array) -> Array:
    """cont_t * h_{t-1}: the state a step sees, zero where a new sequence begins."""
    return cont_t[:, None] * h


# -- the static input --------------------------------------------------------------------
def add_static(pre: Array, static: Array, pre_out: Array) -> None:  # noqa: ARG001
    """pre_t += static for every step t (``pre_out`` is ``pre``)."""
    pre_out += static[None]


def sum_over_time(dpre: Array, dstatic: Array) -> None:
    dpre.sum(axis=0, out=dstatic)


# -- RNN -----------------------------------------------------------------------------------
def rnn_forward(pre: Array, cont: Array, w_hh: Array, h0: Array,
                hs: Array, h0_used: Array, h_last: Array) -> None:
    """h_t = tanh(pre_t + W_hh (cont_t h_{t-1})) into ``hs``; ``h_last`` gets h_T. ``h0``
    and ``h_last`` may be one array (the state a layer carries from one pass to the next),
    so h_0 is copied to ``h0_used``, which the backward pass reads, before anything else."""
    xp = get_array_module(pre)
    h0_used[...] = h0
    h = h0_used[0]
    for t in range(_steps(hs)):
        a = xp.matmul(_conted(cont[t], h), w_hh.T)
        a += pre[t]
        xp.tanh(a, out=hs[t])
        h = hs[t]
    h_last[0] = h  # h_0 itself after no step (T = 0)


def rnn_backward(hs: Array, h0: Array, cont: Array, w_hh: Array, dhs: Array,
                 dpre: Array, dw_hh: Array) -> None:
    """Through time, last step first: dpre (T, N, H) and dw_hh (H, H) from the gradient
    ``dhs`` at every h_t. No gradient enters at h_T nor leaves at h_0 (Caffe's)."""
    xp = get_array_module(hs)
    dh = xp.zeros(hs.shape[1:], dtype=hs.dtype)  # hs[0] is no step when T = 0
    for t in reversed(range(_steps(hs))):
        dh += dhs[t]
        da = dpre[t]
        xp.multiply(dh, 1 - hs[t] * hs[t], out=da)
        dh = _conted(cont[t], xp.matmul(da, w_hh))
    _weight_gradient(xp, dpre, _seen_states(xp, cont, h0, hs), dw_hh)


def _seen_states(xp: Any, cont: Array, h0: Array, hs: Array) -> Array:
    """(T, N, H): cont_t h_{t-1}, the state each step reads."""
    prev = xp.concatenate([h0, hs[:-1]]) if hs.shape[0] else hs
    return cont[:, :, None] * prev


def _weight_gradient(xp: Any, dpre: Array, seen: Array, dw: Array) -> None:
    """dw = sum_t dpre_t^T seen_t as one GEMM over all steps (a (G, H) product per step
    would allocate a weight-sized temporary each time)."""
    g, h = dw.shape
    xp.matmul(dpre.reshape(-1, g).T, seen.reshape(-1, h), out=dw)


# -- one LSTM step (shared by the LSTM recurrence and the LSTMUnit layer) -----------------
def _cell_forward(xp: Any, a: Array, cont_t: Array, c_prev: Array, c: Array, h: Array) -> None:
    """Activate the gate inputs ``a`` (N, 4H) in place to i, f, o, g, where f is already
    multiplied by cont_t (zero at a sequence start, as Caffe's LSTMUnit has it); then
    c = f c_prev + i g and h = o tanh(c)."""
    n = a.shape[1] // 4
    _sigmoid(xp, a[:, :3 * n], a[:, :3 * n])
    xp.tanh(a[:, 3 * n:], out=a[:, 3 * n:])
    a[:, n:2 * n] *= cont_t[:, None]
    i, f, o, g = a[:, :n], a[:, n:2 * n], a[:, 2 * n:3 * n], a[:, 3 * n:]
    xp.multiply(f, c_prev, out=c)
    c += i * g
    xp.tanh(c, out=h)
    h *= o


def _cell_backward(xp: Any, gates: Array, c_prev: Array, c: Array, dh: Array, dc: Array,
                   da: Array) -> Array:
    """Gradients of one step: ``da`` (N, 4H) gets d/d(gate inputs); returns d/d(c_prev).
    The forget gate's derivative is f (1 - f) of the cont-multiplied f, as in Caffe's
    LSTMUnit (exact whenever cont is 0 or 1)."""
    n = gates.shape[1] // 4
    i, f, o, g = gates[:, :n], gates[:, n:2 * n], gates[:, 2 * n:3 * n], gates[:, 3 * n:]
    tanh_c = xp.tanh(c)
    dc_total = dc + dh * o * (1 - tanh_c * tanh_c)
    xp.multiply(dc_total * g, i * (1 - i), out=da[:, :n])
    xp.multiply(dc_total * c_prev, f * (1 - f), out=da[:, n:2 * n])
    xp.multiply(dh * tanh_c, o * (1 - o), out=da[:, 2 * n:3 * n])
    xp.multiply(dc_total * i, 1 - g * g, out=da[:, 3 * n:])
    return dc_total * f


# -- LSTM ----------------------------------------------------------------------------------
def lstm_forward(pre: Array, cont: Array, w_hc: Array, h0: Array, c0: Array,
                 hs: Array, cs: Array, gates: Array, h0_used: Array, c0_used: Array,
                 h_last: Array, c_last: Array) -> None:
    """The LSTM over all steps: ``hs`` and ``cs`` (T, N, H) get h_t and c_t, ``gates``
    (T, N, 4H) the activated gates the backward pass reads; ``h_last``/``c_last`` get the final
    state and may be the arrays ``h0``/``c0`` themselves (copied first to ``*_used``)."""
    xp = get_array_module(pre)
    h0_used[...] = h0
    c0_used[...] = c0
    h, c = h0_used[0], c0_used[0]
    for t in range(_steps(hs)):
        a = gates[t]
        xp.matmul(_conted(cont[t], h), w_hc.T, out=a)
        a += pre[t]
        _cell_forward(xp, a, cont[t], c, cs[t], hs[t])
        h, c = hs[t], cs[t]
    h_last[0] = h  # the initial state itself after no step (T = 0)
    c_last[0] = c


def lstm_backward(cont: Array, w_hc: Array, h0: Array, c0: Array, hs: Array, cs: Array,
                  gates: Array, dhs: Array, dpre: Array, dw_hc: Array) -> None:
    """Through time, last step first: dpre (T, N, 4H) and dw_hc (4H, H) from the gradient
    ``dhs`` at every h_t. No gradient enters at h_T/c_T nor leaves at h_0/c_0 (Caffe's)."""
    xp = get_array_module(hs)
    dh, dc = xp.zeros(hs.shape[1:], hs.dtype), xp.zeros(cs.shape[1:], cs.dtype)
    for t in reversed(range(_steps(hs))):
        dh += dhs[t]
        c_prev = cs[t - 1] if t else c0[0]
        dc = _cell_backward(xp, gates[t], c_prev, cs[t], dh, dc, dpre[t])
        dh = _conted(cont[t], xp.matmul(dpre[t], w_hc))
    _weight_gradient(xp, dpre, _seen_states(xp, cont, h0, hs), dw_hc)


# -- LSTMUnit ------------------------------------------------------------------------------
def lstm_unit_forward(c_prev: Array, x: Array, cont: Array, c: Array, h: Array) -> None:
    """One step for shapes c_prev (1, N, H), x (1, N, 4H), cont (1, N)."""
    xp = get_array_module(x)
    _cell_forward(xp, x[0].copy(), cont[0], c_prev[0], c[0], h[0])


def lstm_unit_backward(c_prev: Array, x: Array, cont: Array, c: Array, dc: Array, dh: Array,
                       *outs: Array, want_dc_prev: bool, want_dx: bool) -> None:
    """``outs``: dc_prev when ``want_dc_prev``, then dx when ``want_dx``."""
    xp = get_array_module(x)
    gates = x[0].copy()
    _cell_forward(xp, gates, cont[0], c_prev[0], xp.empty_like(c[0]), xp.empty_like(c[0]))
    da = xp.empty_like(gates)
    dc_prev = _cell_backward(xp, gates, c_prev[0], c[0], dh[0], dc[0], da)
    outs = list(outs)
    if want_dc_prev:
        outs.pop(0)[0] = dc_prev
    if want_dx:
        outs.pop(0)[0] = da
