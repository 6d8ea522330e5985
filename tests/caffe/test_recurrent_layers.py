"""Caffe's recurrent layers (RNN, LSTM, LSTMUnit): forward values against hand-computed
numbers and a plain numpy step loop, the hidden state kept from one pass to the next, float64
gradient checks through time, caffemodel round trips, training through the Solver, and the
errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.caffe.solver import Solver
from purine.errors import LayerError
from purine.formats import caffe_pb2 as pb
from purine.parallel import build_solver
from tests.gradcheck import check_gradients, layer_net

FILLERS = ('weight_filler { type: "gaussian" std: 0.5 } '
           'bias_filler { type: "gaussian" std: 0.5 }')


def spec(type_: str, num_output: int = 2, static: bool = False, exposed: bool = False,
         extra: str = "", tops: list[str] | None = None) -> str:
    bottoms = ["x", "cont"] + (["xs"] if static else [])
    state = ["h0"] + (["c0"] if type_ == "LSTM" else [])
    if exposed:
        bottoms += state
    tops = tops if tops is not None else ["y"] + (
        [s.replace("0", "T") for s in state] if exposed else [])
    wiring = " ".join([f'bottom: "{b}"' for b in bottoms] + [f'top: "{t}"' for t in tops])
    ex = "expose_hidden: true" if exposed else ""
    return (f'name: "r" type: "{type_}" {wiring} {extra} '
            f"recurrent_param {{ num_output: {num_output} {FILLERS} {ex} }}")


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


# -- plain numpy references: one time step after another ----------------------------------
def rnn_reference(params, x, cont, xs=None, h0=None):
    w_xh, b_h, *rest = params
    w_s = rest.pop(0) if xs is not None else None
    w_hh, w_ho, b_o = rest
    T, N = cont.shape
    h = np.zeros((N, w_hh.shape[0])) if h0 is None else h0[0]
    out = []
    for t in range(T):
        a = x[t].reshape(N, -1) @ w_xh.T + b_h + (cont[t][:, None] * h) @ w_hh.T
        if xs is not None:
            a = a + xs.reshape(N, -1) @ w_s.T
        h = np.tanh(a)
        out.append(np.tanh(h @ w_ho.T + b_o))
    return np.stack(out), h[None]


def lstm_reference(params, x, cont, xs=None, h0=None, c0=None):
    w_xc, b_c, *rest = params
    w_s = rest.pop(0) if xs is not None else None
    (w_hc,) = rest
    T, N = cont.shape
    H = w_hc.shape[1]
    h = np.zeros((N, H)) if h0 is None else h0[0]
    c = np.zeros((N, H)) if c0 is None else c0[0]
    out = []
    for t in range(T):
        a = x[t].reshape(N, -1) @ w_xc.T + b_c + (cont[t][:, None] * h) @ w_hc.T
        if xs is not None:
            a = a + xs.reshape(N, -1) @ w_s.T
        i, f, o = sigmoid(a[:, :H]), sigmoid(a[:, H:2 * H]), sigmoid(a[:, 2 * H:3 * H])
        g = np.tanh(a[:, 3 * H:])
        c = cont[t][:, None] * f * c + i * g
        h = o * np.tanh(c)
        out.append(h)
    return np.stack(out), h[None], c[None]


def make_inputs(type_: str, T: int, static: bool, exposed: bool, x_shape=(3,), seed=0,
                H: int = 2):
    """x (T, 2, *x_shape), cont with a reset in the middle (and at t = 0 unless the state is
    exposed: a kept state would change between the gradient check's passes), x_static, and
    the initial states."""
    rng = np.random.default_rng(seed)
    N = 2
    cont = np.ones((T, N))
    if T > 1:
        cont[1, 0] = 0
    if not exposed:
        cont[0] = 0
    else:
        cont[0, 1] = 0
    inputs = {"x": rng.standard_normal((T, N) + x_shape), "cont": cont}
    if static:
        inputs["xs"] = rng.standard_normal((N, 2, 2))
    if exposed:
        inputs["h0"] = rng.standard_normal((1, N, H))
        if type_ == "LSTM":
            inputs["c0"] = rng.standard_normal((1, N, H))
    return inputs


def build(layer: str, inputs: dict, phase: int = TEST, seed: int = 0) -> Net:
    shapes = {n: np.shape(v) for n, v in inputs.items()}
    return Net(layer_net(layer, shapes, force_backward=False), phase=phase, dtype="float64",
               seed=seed)


# -- forward values -----------------------------------------------------------------------
def test_rnn_hand_computed():
    inputs = {"x": np.array([[[1.0]], [[2.0]]]), "cont": np.array([[0.0], [1.0]])}
    # debug_info is accepted (Caffe logs the unrolled net's blobs with it; nothing here)
    net = build(spec("RNN", num_output=1).replace("num_output: 1", "num_output: 1 debug_info: true"),
                inputs)
    for k, v in enumerate([[[1.0]], [0.0], [[0.5]], [[2.0]], [-1.0]]):
        net.params["r"][k].data[...] = v
    net.forward(**inputs)
    # h1 = tanh(1), o1 = tanh(2 h1 - 1); h2 = tanh(2 + 0.5 h1), o2 = tanh(2 h2 - 1)
    np.testing.assert_allclose(net.blobs["y"].data.ravel(),
                               [0.48015700943368606, 0.7469775865356177], rtol=1e-12)


@pytest.mark.parametrize("cont,want_c,want_h", [
    # i = s(1.2), f = s(2), o = s(-1), g = tanh(0.5); c = 0.5 f + i g; h = o tanh(c)
    (1.0, 0.7955470272233716, 0.1779154934713459),
    # cont 0: h_0 and c_0 are ignored, i = s(1)
    (0.0, 0.33783471214704114, 0.08755198285395513),
])
def test_lstm_hand_computed(cont, want_c, want_h):
    inputs = {"x": np.ones((1, 1, 1)), "cont": np.full((1, 1), cont),
              "h0": np.full((1, 1, 1), 0.2), "c0": np.full((1, 1, 1), 0.5)}
    net = build(spec("LSTM", num_output=1, exposed=True), inputs)
    net.params["r"][0].data[...] = [[1.0], [2.0], [-1.0], [0.5]]
    net.params["r"][1].data[...] = 0
    net.params["r"][2].data[...] = [[1.0], [0.0], [0.0], [0.0]]
    net.forward(**inputs)
    assert net.blobs["y"].data.item() == pytest.approx(want_h, rel=1e-12)
    assert net.blobs["hT"].data.item() == pytest.approx(want_h, rel=1e-12)
    assert net.blobs["cT"].data.item() == pytest.approx(want_c, rel=1e-12)


@pytest.mark.parametrize("type_", ["RNN", "LSTM"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("exposed", [False, True])
@pytest.mark.parametrize("T", [1, 4])
def test_forward_matches_step_loop(type_, static, exposed, T):
    inputs = make_inputs(type_, T, static, exposed, x_shape=(2, 3), H=3)
    net = build(spec(type_, num_output=3, static=static, exposed=exposed), inputs)
    net.forward(**inputs)
    params = [p.data for p in net.params["r"]]
    h0 = inputs.get("h0")
    if type_ == "RNN":
        y, hT = rnn_reference(params, inputs["x"], inputs["cont"], inputs.get("xs"), h0)
        states = {"hT": hT}
    else:
        y, hT, cT = lstm_reference(params, inputs["x"], inputs["cont"], inputs.get("xs"), h0,
                                   inputs.get("c0"))
        states = {"hT": hT, "cT": cT}
    np.testing.assert_allclose(net.blobs["y"].data, y, rtol=1e-12, atol=1e-14)
    assert net.blobs["y"].data.shape == (T, 2, 3)
    if exposed:
        for name, want in states.items():
            np.testing.assert_allclose(net.blobs[name].data, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("type_", ["RNN", "LSTM"])
def test_state_carries_over_between_passes(type_):
    """Without expose_hidden the state after the last step starts the next pass, so three
    one-step passes equal one three-step pass; cont 0 discards it."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 2, 4))
    cont = np.array([[0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    whole = build(spec(type_, num_output=3), {"x": x, "cont": cont}, seed=5)
    whole.forward(x=x, cont=cont)
    step = build(spec(type_, num_output=3), {"x": x[:1], "cont": cont[:1]}, seed=5)
    for t in range(3):
        step.forward(x=x[t:t + 1], cont=cont[t:t + 1])
        np.testing.assert_allclose(step.blobs["y"].data[0], whole.blobs["y"].data[t],
                                   rtol=1e-12, atol=1e-14)
    # A fourth pass with cont 1 goes on from the state; with cont 0 it starts afresh.
    first = whole.blobs["y"].data[0].copy()
    step.forward(x=x[:1], cont=np.ones((1, 2)))
    assert np.abs(step.blobs["y"].data[0] - first).max() > 1e-3
    step.forward(x=x[:1], cont=np.zeros((1, 2)))
    np.testing.assert_allclose(step.blobs["y"].data[0], first, rtol=1e-12, atol=1e-14)


# -- gradients ----------------------------------------------------------------------------
@pytest.mark.parametrize("type_", ["RNN", "LSTM"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("exposed", [False, True])
@pytest.mark.parametrize("T", [1, 3])
def test_gradients(type_, static, exposed, T):
    """The objective weighs the main top only: Caffe ignores gradients at an exposed h_T/c_T
    and leaves h_0/c_0 without one (test_exposed_state_gets_and_gives_no_gradient)."""
    inputs = make_inputs(type_, T, static, exposed, x_shape=(3,) if static else (1, 3))
    check = [n for n in inputs if n not in ("cont", "h0", "c0")]
    net = check_gradients(spec(type_, static=static, exposed=exposed), inputs, check=check,
                          tops=["y"])
    assert not net.blobs["cont"].diff.any()  # force_backward spares the sequence flags


@pytest.mark.parametrize("type_", ["RNN", "LSTM"])
def test_exposed_state_gets_and_gives_no_gradient(type_):
    """Caffe shares only the data of h_0/c_0 and h_T/c_T with its unrolled net: h_0/c_0's
    diffs stay zero under force_backward, and gradients put at h_T/c_T change nothing."""
    inputs = make_inputs(type_, 3, True, True)
    net = Net(layer_net(spec(type_, static=True, exposed=True),
                        {n: v.shape for n, v in inputs.items()}), phase=TRAIN, dtype="float64")
    states = ["h0"] + (["c0"] if type_ == "LSTM" else [])
    finals = [s.replace("0", "T") for s in states]
    rng = np.random.default_rng(7)
    dy = rng.standard_normal(net.blobs["y"].shape)
    dfinal = {t: rng.standard_normal(net.blobs[t].shape) for t in finals}
    zero_final = {t: np.zeros(net.blobs[t].shape) for t in finals}
    watched = ["x", "xs"]
    net.forward(**inputs)

    def grads(**top_diffs):
        for s in states:
            net.blobs[s].diff[...] = 1.0  # a stale value the backward pass must overwrite
        net.backward(**top_diffs)
        for s in states:
            np.testing.assert_array_equal(net.blobs[s].diff, 0.0)
        return [net.blobs[n].diff.copy() for n in watched] + [p.diff.copy()
                                                               for p in net.params["r"]]

    from_y = grads(y=dy, **zero_final)
    assert all(np.abs(g).max() > 1e-3 for g in from_y)
    # Adding gradients at the final state changes no gradient...
    for got, want in zip(grads(y=dy, **dfinal), from_y):
        np.testing.assert_array_equal(got, want)
    # ...and with the objective on the final state alone every gradient is zero.
    for g in grads(y=np.zeros_like(dy), **dfinal):
        np.testing.assert_array_equal(g, 0.0)


def test_propagate_down_false_still_trains_the_weights():
    inputs = make_inputs("LSTM", 3, True, False)
    grads = {}
    for down in ("true", "false"):
        layer = spec("LSTM", static=True, extra="loss_weight: 1 " + " ".join(
            [f"propagate_down: {down}", "propagate_down: false", f"propagate_down: {down}"]))
        net = build(layer, inputs, phase=TRAIN)
        net.forward(**inputs)
        net.backward()
        grads[down] = [p.diff.copy() for p in net.params["r"]]
        assert net.blobs["x"].diff.any() == (down == "true")
        assert net.blobs["xs"].diff.any() == (down == "true")
    for with_x, without in zip(grads["true"], grads["false"]):
        assert np.abs(with_x).max() > 0
        np.testing.assert_array_equal(with_x, without)


# -- LSTMUnit ------------------------------------------------------------------------------
UNIT = 'name: "u" type: "LSTMUnit" bottom: "c_prev" bottom: "x" bottom: "cont" top: "c" top: "h"'


def unit_inputs(cont, seed=0, H=3):
    rng = np.random.default_rng(seed)
    N = len(cont)
    return {"c_prev": rng.standard_normal((1, N, H)), "x": rng.standard_normal((1, N, 4 * H)),
            "cont": np.array([cont], dtype=np.float64)}


def test_lstm_unit_forward():
    inputs = unit_inputs([1.0, 0.0, 0.5])
    net = build(UNIT, inputs)
    net.forward(**inputs)
    H = 3
    a, c_prev, cont = inputs["x"][0], inputs["c_prev"][0], inputs["cont"][0][:, None]
    i, f, o = sigmoid(a[:, :H]), sigmoid(a[:, H:2 * H]), sigmoid(a[:, 2 * H:3 * H])
    g = np.tanh(a[:, 3 * H:])
    c = cont * f * c_prev + i * g
    np.testing.assert_allclose(net.blobs["c"].data[0], c, rtol=1e-12)
    np.testing.assert_allclose(net.blobs["h"].data[0], o * np.tanh(c), rtol=1e-12)
    assert net.blobs["c"].data.shape == net.blobs["h"].data.shape == (1, 3, 3)


@pytest.mark.parametrize("cont", [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
def test_lstm_unit_gradients(cont):
    check_gradients(UNIT, unit_inputs(cont), check=["c_prev", "x"])


def test_lstm_unit_forget_gradient_uses_the_cont_scaled_gate():
    """With cont = 0.5 Caffe's forget-gate gradient is dc c_prev f (1 - f) of f = cont s(x_f),
    not the derivative of cont s(x_f); a gradient on c alone shows it."""
    inputs = unit_inputs([0.5], H=1)
    net = Net(layer_net(UNIT, {n: v.shape for n, v in inputs.items()}), phase=TRAIN,
              dtype="float64")
    net.forward(**inputs)
    net.backward(c=np.ones((1, 1, 1)), h=np.zeros((1, 1, 1)))
    f = 0.5 * sigmoid(inputs["x"][0, 0, 1])
    c_prev = inputs["c_prev"][0, 0, 0]
    assert net.blobs["x"].diff[0, 0, 1] == pytest.approx(c_prev * f * (1 - f), rel=1e-12)
    assert net.blobs["c_prev"].diff[0, 0, 0] == pytest.approx(f, rel=1e-12)


# -- parameters in caffemodels --------------------------------------------------------------
@pytest.mark.parametrize("type_,static,shapes", [
    ("RNN", False, [(2, 6), (2,), (2, 2), (2, 2), (2,)]),
    ("RNN", True, [(2, 6), (2,), (2, 4), (2, 2), (2, 2), (2,)]),
    ("LSTM", False, [(8, 6), (8,), (8, 2)]),
    ("LSTM", True, [(8, 6), (8,), (8, 4), (8, 2)]),
])
def test_parameters_round_trip_through_caffemodel(tmp_path, type_, static, shapes):
    inputs = make_inputs(type_, 3, static, False, x_shape=(2, 3))
    net = build(spec(type_, static=static), inputs, seed=1)
    assert [p.data.shape for p in net.params["r"]] == shapes
    path = tmp_path / "r.caffemodel"
    net.save(path)
    saved = pb.NetParameter()
    saved.ParseFromString(path.read_bytes())
    (layer,) = [lp for lp in saved.layer if lp.name == "r"]
    assert [tuple(b.shape.dim) for b in layer.blobs] == shapes
    other = build(spec(type_, static=static), inputs, seed=2)
    assert not np.allclose(other.params["r"][0].data, net.params["r"][0].data)
    other.copy_from(path)
    for mine, theirs in zip(other.params["r"], net.params["r"]):
        np.testing.assert_array_equal(mine.data, theirs.data)
    net.forward(**inputs)
    other.forward(**inputs)
    np.testing.assert_array_equal(other.blobs["y"].data, net.blobs["y"].data)


# -- training -----------------------------------------------------------------------------
def test_lstm_learns_to_echo_the_previous_input(tmp_path):
    """A toy sequence task: y_t = x_{t-1} within sequences of 5 steps (y_1 = 0), read from
    HDF5 time-major as a Caffe LSTM net reads it; the loss falls from that of a constant guess to near zero."""
    import h5py

    T, N, K = 5, 8, 16
    rng = np.random.default_rng(0)
    x = rng.choice([-1.0, 1.0], size=(K, T, N, 1))
    y = np.concatenate([np.zeros((K, 1, N, 1)), x[:, :-1]], axis=1)
    cont = np.ones((K, T, N))
    cont[:, 0] = 0
    with h5py.File(tmp_path / "seq.h5", "w") as f:
        f["x"] = x.reshape(K * T, N, 1).astype(np.float32)
        f["y"] = y.reshape(K * T, N, 1).astype(np.float32)
        f["cont"] = cont.reshape(K * T, N).astype(np.float32)
    (tmp_path / "list.txt").write_text(str(tmp_path / "seq.h5") + "\n")
    net = f"""
    layer {{ name: "data" type: "HDF5Data" top: "x" top: "cont" top: "y"
      hdf5_data_param {{ source: "{tmp_path / 'list.txt'}" batch_size: {T} }} }}
    layer {{ name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h"
      recurrent_param {{ num_output: 8 weight_filler {{ type: "uniform" min: -0.3 max: 0.3 }}
      bias_filler {{ type: "constant" value: 0 }} }} }}
    layer {{ name: "out" type: "InnerProduct" bottom: "h" top: "p"
      inner_product_param {{ num_output: 1 axis: 2 weight_filler {{ type: "xavier" }} }} }}
    layer {{ name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }}
    """
    solver = Solver(f"net_param {{ {net} }}\nbase_lr: 0.05\nmomentum: 0.9\nlr_policy: \"fixed\"\n"
                    "max_iter: 200\nrandom_seed: 1\nclip_gradients: 5\n")
    losses = []
    for _ in range(120):
        solver.step(1)
        losses.append(solver.net.loss)
    assert all(np.isfinite(losses))
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert last < 0.05 * first, (first, last)  # a constant guess stays near first



# The sequence goes on from batch to batch (cont 1 throughout), so each forward pass starts
# from the state the last one carried.
CARRY_NET = """
layer { name: "data" type: "DummyData" top: "x" top: "cont" top: "y" dummy_data_param {
  shape { dim: 3 dim: 2 dim: 4 } shape { dim: 3 dim: 2 } shape { dim: 3 dim: 2 dim: 3 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 }
  data_filler { type: "gaussian" std: 1 } } }
layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h"
  recurrent_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 }
  bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "h" bottom: "y" top: "loss" }
"""


@pytest.mark.parametrize("fmt, replicas", [("BINARYPROTO", 1), ("HDF5", 1), ("BINARYPROTO", 2)])
def test_resume_carries_the_hidden_state_bit_for_bit(tmp_path, fmt, replicas):
    """4 iterations straight equal 2, a snapshot, a fresh solver restored from it and 2 more,
    in loss and weights: the snapshot keeps h_T and c_T exactly (every replica's)."""
    text = (f"net_param {{ {CARRY_NET} }}\nbase_lr: 0.1\nmomentum: 0.9\n"
            f'lr_policy: "fixed"\nmax_iter: 4\nrandom_seed: 7\n'
            f'snapshot_prefix: "{tmp_path}/s"\nsnapshot_format: {fmt}\n')

    def run(solver, n):
        losses = []
        for _ in range(n):
            solver.step(1)
            losses.append(solver.net.loss)
        return losses

    straight = build_solver(text, replicas=replicas)
    want = run(straight, 4)
    half = build_solver(text, replicas=replicas)
    assert run(half, 2) == want[:2]
    names = [f"{r}lstm@state#{i}" for r in ["", *(f"replica{k}/" for k in range(1, replicas))]
             for i in range(2)]
    carried = [half.net.dispatcher.array(half.net.graph.blobs[n]).copy() for n in names]
    assert min(np.abs(c).max() for c in carried) > 1e-3  # h_T and c_T are not zeros
    _, state = half.snapshot()
    resumed = build_solver(text, replicas=replicas)
    resumed.restore(state)
    for n, c in zip(names, carried, strict=True):
        assert np.array_equal(resumed.net.dispatcher.array(resumed.net.graph.blobs[n]), c), n
    assert run(resumed, 2) == want[2:]
    for a, b in zip(straight.net.params["lstm"], resumed.net.params["lstm"], strict=True):
        assert np.array_equal(a.data, b.data)


# -- errors -------------------------------------------------------------------------------
ERRORS = [
    ("cont of the wrong shape", spec("RNN"), {"x": (3, 2, 4), "cont": (3, 1)},
     r"bottom cont must have shape \(T, N\) = \(3, 2\) to match x \(3, 2, 4\), got \(3, 1\)"),
    ("cont with 3 axes", spec("LSTM"), {"x": (3, 2, 4), "cont": (3, 2, 1)},
     r"bottom cont must have shape \(T, N\)"),
    ("x with one axis", spec("RNN"), {"x": (3,), "cont": (3, 2)},
     r"bottom x must have at least 2 axes \(T, N, \.\.\.\), got shape \(3,\)"),
    ("x_static with another N", spec("LSTM", static=True),
     {"x": (3, 2, 4), "cont": (3, 2), "xs": (5, 4)},
     r"bottom x_static must have N = 2 as its first axis to match x \(3, 2, 4\), "
     r"got shape \(5, 4\)"),
    ("num_output 0", spec("RNN", num_output=0), {"x": (3, 2, 4), "cont": (3, 2)},
     "recurrent_param.num_output must be positive"),
    ("exposed without h_0", spec("LSTM", tops=["y", "hT", "cT"]).replace(
        "num_output: 2", "num_output: 2 expose_hidden: true"), {"x": (3, 2, 4), "cont": (3, 2)},
     r"with expose_hidden: true takes bottoms x, cont, \[x_static\], h_0, c_0 "
     r"\(4 or 5 blobs\), got 2"),
    ("exposed without the state tops", spec("RNN", exposed=True, tops=["y"]),
     {"x": (3, 2, 4), "cont": (3, 2), "h0": (1, 2, 2)},
     r"with expose_hidden: true makes tops o, h_T \(2 blobs\), got 1"),
    ("state tops without expose_hidden", spec("LSTM", tops=["y", "hT", "cT"]),
     {"x": (3, 2, 4), "cont": (3, 2)},
     r"with expose_hidden: false makes tops h \(1 blobs\), got 3"),
    ("h_0 of the wrong shape", spec("RNN", exposed=True),
     {"x": (3, 2, 4), "cont": (3, 2), "h0": (1, 2, 5)},
     r"bottom h_0 must have shape \(1, N, num_output\) = \(1, 2, 2\), got \(1, 2, 5\)"),
    ("c_0 of the wrong shape", spec("LSTM", exposed=True),
     {"x": (3, 2, 4), "cont": (3, 2), "h0": (1, 2, 2), "c0": (2, 2)},
     r"bottom c_0 must have shape \(1, N, num_output\) = \(1, 2, 2\), got \(2, 2\)"),
    ("backward to cont", spec("RNN", extra="loss_weight: 1 propagate_down: true propagate_down: true"),
     {"x": (3, 2, 4), "cont": (3, 2)}, "cannot backpropagate to the sequence indicators cont"),
    ("LSTMUnit backward to cont", UNIT + " loss_weight: 1 propagate_down: true propagate_down: true "
     "propagate_down: true", {"c_prev": (1, 2, 3), "x": (1, 2, 12), "cont": (1, 2)},
     r"cannot backpropagate to the sequence indicators cont \(bottom 2\)"),
    ("LSTMUnit x of the wrong width", UNIT, {"c_prev": (1, 2, 3), "x": (1, 2, 9),
                                             "cont": (1, 2)},
     r"bottom x must have 4H = 12 gate inputs \(H = 3 from c_prev\), got 9"),
    ("LSTMUnit cont of another N", UNIT, {"c_prev": (1, 2, 3), "x": (1, 2, 12),
                                          "cont": (1, 3)},
     r"bottom cont must have shape \(1, N\) with N = c_prev's axis 1"),
    ("LSTMUnit with two time steps", UNIT, {"c_prev": (2, 2, 3), "x": (2, 2, 12),
                                            "cont": (2, 2)},
     r"bottom c_prev must have shape \(1, N, H\)"),
    ("LSTMUnit with two bottoms", UNIT.replace(' bottom: "cont"', ""),
     {"c_prev": (1, 2, 3), "x": (1, 2, 12)}, r"needs 3 bottom blob\(s\), got 2"),
]


@pytest.mark.parametrize("what,layer,shapes,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(what, layer, shapes, message):
    with pytest.raises(LayerError, match=message):
        Net(layer_net(layer, shapes, force_backward=False), phase=TRAIN, dtype="float64")
