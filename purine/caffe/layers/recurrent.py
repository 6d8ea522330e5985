"""Builders of Caffe's recurrent layers (RNN, LSTM, LSTMUnit): the time steps unrolled into
the net's bi-graph as one input-projection op for all steps and one op for the recurrence,
each with its backward op (backpropagation through time)."""

from __future__ import annotations

import base64
import math
from typing import TYPE_CHECKING

import numpy as np

from purine.backend import assign, to_host
from purine.caffe.layer import LayerBuild, register
from purine.graph import Blob
from purine.ops import activation as act
from purine.ops import inner_product as ip
from purine.ops import recurrent as rec
from purine.ops import tensor

if TYPE_CHECKING:
    from purine.caffe.net import NetBuilder

# The recurrent state blobs of each architecture, as Caffe names them (bottoms and tops
# that expose_hidden adds, in this order).
_STATE = {"RNN": ("h_0", "h_T"), "LSTM": ("h_0", "c_0", "h_T", "c_T")}


class CarriedState:
    """The state a recurrent layer carries from one forward pass to the next, as snapshots
    keep it: the raw bytes of the array (base64, with dtype and shape), so that a resumed run
    continues bit for bit. It reads and writes the blob through the storage of the
    dispatcher that runs the net."""

    def __init__(self, net: NetBuilder, blob: Blob):
        self.net, self.blob = net, blob

    def state(self) -> dict:
        if self.net.storage is None:  # a graph no dispatcher runs as its own: nothing kept
            return {}
        a = np.ascontiguousarray(to_host(self.net.storage(self.blob)))
        return {"dtype": a.dtype.str, "shape": list(a.shape),
                "data": base64.b64encode(a.tobytes()).decode("ascii")}

    def restore(self, state: dict) -> None:
        if self.net.storage is None or "data" not in state:
            return
        shape = tuple(int(d) for d in state["shape"])
        if shape != self.blob.shape:
            return  # the net was reshaped (another batch size): it starts from zeros anew
        dtype = np.dtype(state["dtype"])
        if dtype.kind != "f":  # what state() writes; another kind cannot be a net's blob
            raise ValueError(f"dtype '{state['dtype']}' is not a floating-point type")
        a = np.frombuffer(base64.b64decode(state["data"], validate=True), dtype=dtype)
        assign(self.net.storage(self.blob), a.reshape(shape))


class _Setup:
    """What RNN and LSTM share: the checked bottoms, and the input projection of all steps
    (W x_t + b [+ W_static x_static]) as ops, with their backward."""

    def __init__(self, L: LayerBuild, gates: int):
        p = L.param.recurrent_param
        n_state = len(_STATE[L.type]) // 2
        self.exposed = p.expose_hidden
        extra = n_state if self.exposed else 0
        inputs = ["x", "cont", "[x_static]"] + list(_STATE[L.type][:extra])
        outputs = ["o" if L.type == "RNN" else "h"] + list(_STATE[L.type][n_state:][:extra])
        mode = f"with expose_hidden: {str(self.exposed).lower()}"
        if not 2 + extra <= len(L.bottoms) <= 3 + extra:
            raise L.error(f"{mode} takes bottoms {', '.join(inputs)} ({2 + extra} or "
                          f"{3 + extra} blobs), got {len(L.bottoms)}")
        if len(L.param.top) != 1 + extra:
            raise L.error(f"{mode} makes tops {', '.join(outputs)} ({1 + extra} blobs), "
                          f"got {len(L.param.top)}")
        if p.num_output <= 0:
            raise L.error("recurrent_param.num_output must be positive, got 0")
        self.H = H = p.num_output
        x, cont = L.bottom(0), L.bottom(1)
        if len(x.shape) < 2:
            raise L.error(f"bottom x must have at least 2 axes (T, N, ...), got shape {x.shape}")
        self.T, self.N = T, N = x.shape[:2]
        if cont.shape != (T, N):
            raise L.error(f"bottom cont must have shape (T, N) = {(T, N)} to match x "
                          f"{x.shape}, got {cont.shape}")
        self.static = len(L.bottoms) == 3 + extra
        xs = L.bottom(2) if self.static else None
        if xs is not None and (len(xs.shape) < 1 or xs.shape[0] != N):
            raise L.error(f"bottom x_static must have N = {N} as its first axis to match x "
                          f"{x.shape}, got shape {xs.shape}")
        first = 2 + self.static
        self.h0 = L.bottoms[first:first + extra]
        for name, b in zip(_STATE[L.type], self.h0):
            if b.shape != (1, N, H):
                raise L.error(f"bottom {name} must have shape (1, N, num_output) = "
                              f"{(1, N, H)}, got {b.shape}")
        # Caffe cannot propagate to the continuation flags, so force_backward spares them.
        L.no_force_backward.add(1)

        self.L, self.x, self.cont, self.xs, self.G = L, x, cont, xs, gates * H
        self.w_x = L.add_param((self.G, math.prod(x.shape[2:])), p.weight_filler)
        self.b = L.add_param((self.G,), p.bias_filler)
        self.w_s = (L.add_param((self.G, math.prod(xs.shape[1:])), p.weight_filler)
                    if xs is not None else None)
        self.pre = L.scratch("pre", (T, N, self.G))
        # A step's temporaries (its gate inputs and gradients (N, G), a few (N, H) arrays)
        # and the states all steps read, (T, N, H), for the recurrent weight's gradient:
        # twice, the shifted states and their product with cont (a long fuzz run's find)
        L.net.require_scratch(L.location, (16 * N * self.G + 2 * T * N * H)
                              * np.dtype(x.dtype).itemsize,
                              f"scratch for {T} time steps of {N} x {self.G} gate values")
        L.forward(ip.inner_product_forward, [x, self.w_x, self.b], [self.pre], m=T * N,
                  transpose=False)
        if xs is not None:
            self.s = L.scratch("static", (N, self.G))
            L.forward(ip.inner_product_forward, [xs, self.w_s], [self.s], m=N, transpose=False)
            L.forward(rec.add_static, [self.pre, self.s], [self.pre])

    def state(self, n: int) -> list[Blob]:
        """The initial states: the exposed bottoms, or blobs the layer keeps from one forward
        pass to the next (Caffe copies h_T into h_0 before each pass; zero at first)."""
        if self.exposed:
            return list(self.h0)
        blobs = [self.L.scratch(f"state#{i}", (1, self.N, self.H)) for i in range(n)]
        for i, b in enumerate(blobs):
            self.L.keep_state(f"state#{i}", CarriedState(self.L.net, b))
        return blobs

    def last(self, state: list[Blob]) -> list[Blob]:
        """Where the final states go: the exposed tops, or the kept state itself."""
        if self.exposed:
            return [self.L.top(1 + i, (1, self.N, self.H)) for i in range(len(state))]
        return state

    def check_cont(self) -> None:
        if self.L.needs_diff(1):
            raise self.L.error("cannot backpropagate to the sequence indicators cont "
                               "(bottom 1); set its propagate_down to false")

    def diff(self, k: int) -> Blob:
        L = self.L
        return L.param_diff(k) if L.needs_param_diff(k) else L.scratch(f"unused_diff#{k}",
                                                                       L.params[k].shape)

    def zero_state_diffs(self) -> None:
        """Zeros as the exposed h_0/c_0 bottoms' gradients, where an upstream layer (or
        force_backward) asks for them: this layer never writes them in Caffe."""
        first = 2 + self.static
        for i in range(first, first + len(self.h0)):
            if self.L.needs_diff(i):
                self.L.backward(tensor.fill, [], [self.L.bottom_diff(i)],
                                op_type="RecurrentStateZeroDiff", value=0.0)

    def backward_projection(self, dpre: Blob) -> None:
        """Gradients of W_x, b, W_static, x and x_static from d(pre)."""
        L, m = self.L, self.T * self.N
        if L.needs_param_diff(0):
            L.backward(ip.inner_product_backward_weight, [self.x, dpre], [L.param_diff(0)],
                       m=m, transpose=False)
        if L.needs_param_diff(1):
            L.backward(ip.inner_product_backward_bias, [dpre], [L.param_diff(1)], m=m)
        if L.needs_diff(0):
            L.backward(ip.inner_product_backward_data, [dpre, self.w_x], [L.bottom_diff(0)],
                       m=m, transpose=False)
        if self.xs is not None and (L.needs_param_diff(2) or L.needs_diff(2)):
            ds = L.scratch("static@diff", (self.N, self.G))
            L.backward(rec.sum_over_time, [dpre], [ds])
            if L.needs_param_diff(2):
                L.backward(ip.inner_product_backward_weight, [self.xs, ds], [L.param_diff(2)],
                           m=self.N, transpose=False)
            if L.needs_diff(2):
                L.backward(ip.inner_product_backward_data, [ds, self.w_s], [L.bottom_diff(2)],
                           m=self.N, transpose=False)


@register("RNN")
def rnn(L: LayerBuild):
    """h_t = tanh(W_hh (cont_t h_{t-1}) + W_xh x_t + b_h [+ W_xh_static x_static]),
    o_t = tanh(W_ho h_t + b_o); parameters W_xh, b_h, [W_xh_static], W_hh, W_ho, b_o.
    With expose_hidden, Caffe shares only the data (not the diff) of h_0 and h_T with its
    unrolled net: a gradient at the top h_T is ignored and h_0's gradient is zero."""
    S = _Setup(L, gates=1)
    T, N, H = S.T, S.N, S.H
    p = L.param.recurrent_param
    k_hh = len(L.params)
    w_hh = L.add_param((H, H), p.weight_filler)
    w_ho = L.add_param((H, H), p.weight_filler)
    b_o = L.add_param((H,), p.bias_filler)
    h0 = S.state(1)
    hs, h0_used = L.scratch("h", (T, N, H)), L.scratch("h0", (1, N, H))
    h_last = S.last(h0)
    L.forward(rec.rnn_forward, [S.pre, S.cont, w_hh, h0[0]], [hs, h0_used, h_last[0]])
    ow = L.scratch("o_input", (T, N, H))
    L.forward(ip.inner_product_forward, [hs, w_ho, b_o], [ow], m=T * N, transpose=False)
    o = L.top(0, (T, N, H))
    L.forward(act.tanh_forward, [ow], [o])

    def backward():
        S.check_cont()
        dow = L.scratch("o_input@diff", (T, N, H))
        L.backward(act.tanh_backward, [o, L.top_diff(0)], [dow])
        if L.needs_param_diff(k_hh + 1):
            L.backward(ip.inner_product_backward_weight, [hs, dow], [L.param_diff(k_hh + 1)],
                       m=T * N, transpose=False)
        if L.needs_param_diff(k_hh + 2):
            L.backward(ip.inner_product_backward_bias, [dow], [L.param_diff(k_hh + 2)],
                       m=T * N)
        dhs = L.scratch("h@diff", (T, N, H))
        L.backward(ip.inner_product_backward_data, [dow, w_ho], [dhs], m=T * N,
                   transpose=False)
        dpre = L.scratch("pre@diff", (T, N, H))
        L.backward(rec.rnn_backward, [hs, h0_used, S.cont, w_hh, dhs], [dpre, S.diff(k_hh)])
        S.backward_projection(dpre)
        S.zero_state_diffs()
    return backward


@register("LSTM")
def lstm(L: LayerBuild):
    """Gates i, f, o, g from W_xc x_t + b_c [+ W_xc_static x_static] + W_hc (cont_t h_{t-1});
    c_t = cont_t f c_{t-1} + i g, h_t = o tanh(c_t); parameters W_xc, b_c, [W_xc_static],
    W_hc. With expose_hidden, Caffe shares only the data (not the diff) of h_0, c_0, h_T and
    c_T with its unrolled net: gradients at the tops h_T/c_T are ignored, h_0/c_0 get zero."""
    S = _Setup(L, gates=4)
    T, N, H = S.T, S.N, S.H
    k_hc = len(L.params)
    w_hc = L.add_param((4 * H, H), L.param.recurrent_param.weight_filler)
    h0, c0 = S.state(2)
    h = L.top(0, (T, N, H))
    cs, gates = L.scratch("c", (T, N, H)), L.scratch("gates", (T, N, 4 * H))
    h0_used, c0_used = L.scratch("h0", (1, N, H)), L.scratch("c0", (1, N, H))
    h_last, c_last = S.last([h0, c0])
    L.forward(rec.lstm_forward, [S.pre, S.cont, w_hc, h0, c0],
              [h, cs, gates, h0_used, c0_used, h_last, c_last])

    def backward():
        S.check_cont()
        dpre = L.scratch("pre@diff", (T, N, 4 * H))
        L.backward(rec.lstm_backward,
                   [S.cont, w_hc, h0_used, c0_used, h, cs, gates, L.top_diff(0)],
                   [dpre, S.diff(k_hc)])
        S.backward_projection(dpre)
        S.zero_state_diffs()
    return backward


@register("LSTMUnit")
def lstm_unit(L: LayerBuild):
    """One LSTM step: bottoms c_prev (1, N, H), gate inputs x (1, N, 4H) in the order
    i, f, o, g, cont (1, N); tops c (1, N, H) and h (1, N, H)."""
    L.expect(3, 2)
    c_prev, x, cont = L.bottoms
    for name, b, axes in (("c_prev", c_prev, 3), ("x", x, 3), ("cont", cont, 2)):
        if len(b.shape) != axes or b.shape[0] != 1 or b.shape[1] != c_prev.shape[1]:
            want = "(1, N)" if axes == 2 else "(1, N, " + ("H)" if name == "c_prev" else "4H)")
            raise L.error(f"bottom {name} must have shape {want} with N = c_prev's axis 1; "
                          f"got {L.shapes()}")
    if x.shape[2] != 4 * c_prev.shape[2]:
        raise L.error(f"bottom x must have 4H = {4 * c_prev.shape[2]} gate inputs "
                      f"(H = {c_prev.shape[2]} from c_prev), got {x.shape[2]}")
    c, h = L.top(0, c_prev.shape), L.top(1, c_prev.shape)
    # The ops' temporaries: the gates and their gradient (N, 4H) and a few (N, H) arrays
    L.net.require_scratch(L.location, 16 * x.count * np.dtype(x.dtype).itemsize,
                          f"scratch for the gates of {x.shape}")
    L.forward(rec.lstm_unit_forward, [c_prev, x, cont], [c, h])
    L.no_force_backward.add(2)

    def backward():
        if L.needs_diff(2):
            raise L.error("cannot backpropagate to the sequence indicators cont "
                          "(bottom 2); set its propagate_down to false")
        outs = [L.bottom_diff(i) for i in (0, 1) if L.needs_diff(i)]
        if outs:
            L.backward(rec.lstm_unit_backward, [c_prev, x, cont, c, L.top_diff(0),
                                                L.top_diff(1)], outs,
                       want_dc_prev=L.needs_diff(0), want_dx=L.needs_diff(1))
    return backward
