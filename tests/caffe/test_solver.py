"""The solver as graph ops: updates against a numpy transcription of Caffe's formulas,
iter_size, resume that is bit-identical, snapshots, and the errors a user sees."""

import numpy as np
import pytest

from purine.caffe.solver import DivergenceError, Solver, read_solver
from purine.errors import ProtoError, PurineError
from purine.formats import caffe_pb2 as pb

NET = """
name: "regression"
layer { name: "data" type: "DummyData" top: "x" top: "y" dummy_data_param {
  shape { dim: 6 dim: 4 } shape { dim: 6 dim: 3 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "p"
  param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 }
  bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }
"""


def solver_text(**fields) -> str:
    base = dict(base_lr=0.05, lr_policy='"step"', gamma=0.5, stepsize=3, max_iter=100,
                random_seed=7, weight_decay=0.01, momentum=0.9)
    base.update(fields)
    body = "\n".join(f"{k}: {v}" for k, v in base.items())
    net = NET.replace("\n", " ")
    return f"net_param {{ {net} }}\n{body}\n"


def grads(w, b, x, y):
    """EuclideanLoss(x W^T + b, y) = sum((p - y)^2) / N / 2."""
    dp = (x @ w.T + b - y) / x.shape[0]
    return dp.T @ x, dp.sum(0)


def reference_step(kind, state, gw, gb, it, p):
    """One iteration of Caffe's ApplyUpdate in plain numpy (float64)."""
    rate = p["base_lr"] * p["gamma"] ** (it // p["stepsize"])
    out = []
    norm = np.sqrt((gw ** 2).sum() + (gb ** 2).sum())
    scale = p["clip"] / norm if 0 <= p["clip"] < norm else 1.0
    for name, g, lr_mult, decay_mult in (("w", gw, 1, 1), ("b", gb, 2, 0)):
        w = state[name]
        g = g * scale + p["weight_decay"] * decay_mult * w
        lr = rate * lr_mult
        h = state.setdefault(name + "h", np.zeros_like(w))
        if kind == "SGD":
            h[...] = p["momentum"] * h + lr * g
            w -= h
        elif kind == "Nesterov":
            prev = h.copy()
            h[...] = p["momentum"] * h + lr * g
            w -= (1 + p["momentum"]) * h - p["momentum"] * prev
        elif kind == "Adam":
            v = state.setdefault(name + "v", np.zeros_like(w))
            h[...] = p["momentum"] * h + (1 - p["momentum"]) * g
            v[...] = p["momentum2"] * v + (1 - p["momentum2"]) * g * g
            t = it + 1
            corr = np.sqrt(1 - p["momentum2"] ** t) / (1 - p["momentum"] ** t)
            w -= lr * corr * h / (np.sqrt(v) + p["delta"])
        out.append(w)
    return out


@pytest.mark.parametrize("kind,clip", [("SGD", -1), ("SGD", 0.5), ("Nesterov", 0.8),
                                       ("Adam", -1)])
def test_updates_match_caffe_formulas(kind, clip):
    extra = {"type": f'"{kind}"', "clip_gradients": clip}
    if kind == "Adam":
        extra.update(base_lr=0.01, momentum2=0.999, delta=1e-8)
    s = Solver(solver_text(**extra))
    p = dict(base_lr=float(s.param.base_lr), gamma=0.5, stepsize=3, weight_decay=0.01,
             momentum=0.9, clip=clip, momentum2=0.999, delta=1e-8)
    net = s.net
    state = {"w": net.params["ip"][0].data.astype(np.float64),
             "b": net.params["ip"][1].data.astype(np.float64)}
    clipped = 0
    for it in range(8):
        s.step(1)
        x, y = net.blobs["x"].data.astype(np.float64), net.blobs["y"].data.astype(np.float64)
        gw, gb = grads(state["w"], state["b"], x, y)
        clipped += 0 <= clip < np.sqrt((gw ** 2).sum() + (gb ** 2).sum())
        reference_step(kind, state, gw, gb, it, p)
        np.testing.assert_allclose(net.params["ip"][0].data, state["w"], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(net.params["ip"][1].data, state["b"], rtol=1e-4, atol=1e-6)
    assert s.iter == 8
    if clip >= 0:
        assert clipped > 0, "the test should exercise clipping"


def test_iter_size_averages_the_passes():
    a = Solver(solver_text(iter_size=2, weight_decay=0, momentum=0))
    w0 = a.net.params["ip"][0].data.copy()
    b0 = a.net.params["ip"][1].data.copy()
    seen = []
    orig = a.net.dispatcher.run

    def spy(ops):
        orig(ops)
        if ops and ops[0] in a.net._forward_ops:
            seen.append((a.net.blobs["x"].data.copy(), a.net.blobs["y"].data.copy()))

    a.net.dispatcher.run = spy
    a.step(1)
    assert len(seen) == 2
    g = [grads(w0.astype(np.float64), b0.astype(np.float64), x, y) for x, y in seen]
    gw = (g[0][0] + g[1][0]) / 2
    np.testing.assert_allclose(a.net.params["ip"][0].data, w0 - 0.05 * gw, rtol=1e-5, atol=1e-7)


DROPOUT_NET = NET.replace('layer { name: "loss"', """
layer { name: "drop" type: "Dropout" bottom: "p" top: "p" dropout_param { dropout_ratio: 0.3 } }
layer { name: "loss\"""")


def test_resume_from_snapshot_is_bit_identical(tmp_path):
    text = solver_text(snapshot_prefix=f'"{tmp_path}/r"', type='"Adam"', base_lr=0.01,
                       max_iter=10).replace(NET.replace("\n", " "),
                                            DROPOUT_NET.replace("\n", " "))
    straight = Solver(text)
    straight.step(10)
    half = Solver(text)
    half.step(5)
    model, state = half.snapshot()
    assert model.endswith("r_iter_5.caffemodel") and state.endswith("r_iter_5.solverstate")
    resumed = Solver(text)
    resumed.restore(state)
    assert resumed.iter == 5
    resumed.step(5)
    for a, b in zip(straight.net.params["ip"], resumed.net.params["ip"]):
        assert np.array_equal(a.data, b.data)
    # Caffe's reader sees an ordinary SolverState: iter, learned_net, one m and v per param.
    st = pb.SolverState()
    st.ParseFromString(open(state, "rb").read())
    assert (st.iter, st.learned_net, len(st.history)) == (5, model, 4)


def test_legacy_solver_type_and_unknown_type():
    assert read_solver(solver_text().replace("momentum: 0.9", "solver_type: NESTEROV")).type \
        == "Nesterov"
    with pytest.raises(ProtoError, match="unknown type 'Sgd'"):
        read_solver(solver_text(type='"Sgd"'))


def test_solver_needs_exactly_one_train_net():
    with pytest.raises(ProtoError, match="give exactly one of net, net_param"):
        Solver("base_lr: 0.1\nmax_iter: 1\n")


def test_test_iter_must_match_test_nets():
    with pytest.raises(ProtoError, match="1 test_iter values for 2 test nets"):
        Solver(solver_text(test_iter=1) + f"test_net_param {{ {NET} }}\n" * 2)


def test_divergence_names_the_iteration():
    s = Solver(solver_text(base_lr=1e30, momentum=0, gamma=1))
    with pytest.raises(DivergenceError, match=r"iteration \d+: the loss is (nan|inf)"):
        s.step(20)


def test_solver_settings_caffe_refuses_are_refused():
    with pytest.raises(ProtoError, match="momentum cannot be used with AdaGrad"):
        read_solver(solver_text(type='"AdaGrad"'))
    with pytest.raises(ProtoError, match="rms_decay must be in"):
        read_solver(solver_text(type='"RMSProp"', momentum=0, rms_decay=1.5))


def test_a_solvers_net_reshapes_only_inputs_and_bad_settings_are_named(tmp_path):
    s = Solver(solver_text())  # x is DummyData's: its shape follows from the layer
    with pytest.raises(PurineError, match=r"blob 'x' \(6, 4\) cannot be reshaped to "
                                          r"\(2, 4\): only the net's input blobs"):
        s.net.blobs["x"].reshape(2, 4)
    with pytest.raises(ProtoError, match="iter_size must be at least 1"):
        read_solver(solver_text(iter_size=0))
    with pytest.raises(ProtoError, match="snapshot_prefix .* does not exist"):
        Solver(solver_text(snapshot=5, snapshot_prefix=f'"{tmp_path}/missing/x"'))


def test_snapshots_keep_the_seed_and_the_test_nets_state(tmp_path):
    from purine.caffe.solver import snapshot_seed

    text = solver_text(snapshot_prefix=f'"{tmp_path}/r"', random_seed=-1, test_iter=1,
                       test_interval=100) + f"test_net_param {{ {NET} }}\n"
    s = Solver(text)
    s.step(2)
    _, state = s.snapshot()
    assert snapshot_seed(state) == s.seed
    assert any(k.startswith("test0/") for k in s._private_state()["stateful"])


@pytest.mark.parametrize("kind", ['"SGD"', '"Adam"'])
def test_update_ops_on_a_worker_of_their_own_give_the_same_bits(kind):
    text = solver_text(type=kind, base_lr=0.01, clip_gradients=0.5, iter_size=2)
    plain, own = Solver(text), Solver(text, update_worker=True)
    assert {op.location.thread for op in plain.update_ops} == {0}
    assert {op.location.thread for op in own.update_ops} == {1}
    assert {op.location.thread for op in own.net.graph.ops} == {0, 1}
    plain.step(6)
    own.step(6)
    for a, b in zip(plain.net.params["ip"], own.net.params["ip"], strict=True):
        assert np.array_equal(a.data, b.data)
