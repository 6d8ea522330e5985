"""Layers that settle their top shapes at every pass, as Caffe's Reshape-before-Forward allows:
Filter selecting any number of items (all, some, one, none), Python layers whose ``reshape``
(or ``forward``, as Faster R-CNN's ProposalLayer) gives a different number of rows each pass,
checked against numpy forward, backward, gradient checks and solver steps; the grow-only
storage that stops allocating after a first cycle of sizes; and the errors where a shape
cannot follow (a parameter, data-parallel replicas), plus test nets sharing the train net's
weights across their own builds."""

from __future__ import annotations

import numpy as np
import pytest

import purine.pycaffe as caffe
from purine.caffe import TEST, TRAIN, Net
from purine.caffe.layers.python import Layer
from purine.caffe.solver import Solver
from purine.errors import LayerError, PurineError
from purine.parallel import build_solver
from tests.gradcheck import check_gradients, gaussian, layer_spec, numeric_gradient

MODULE = __name__  # the Python layers below are looked up in this module
GAUSS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'


# -- the Python layers ------------------------------------------------------------------------
def batch(calls: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """What ``CycleFeed`` emits at its ``calls``-th forward: x (rows, 3), y (rows, 2)."""
    rng = np.random.default_rng(1000 + calls)
    return rng.standard_normal((rows, 3)), rng.standard_normal((rows, 2))


class KeepPositive(Layer):
    """Bottoms x (N, d), t (N, e); tops the rows of both whose x[:, 0] is above zero:
    ``reshape`` decides the count from the bottom's values, ``backward`` scatters."""

    def reshape(self, bottom, top):
        self.keep = np.flatnonzero(bottom[0].data[:, 0] > 0)
        for b, t in zip(bottom, top, strict=True):
            t.reshape(len(self.keep), *b.shape[1:])

    def forward(self, bottom, top):
        for b, t in zip(bottom, top, strict=True):
            t.data[...] = b.data[self.keep]

    def backward(self, top, propagate_down, bottom):
        for i, (b, t) in enumerate(zip(bottom, top, strict=True)):
            if propagate_down[i]:
                b.diff[...] = 0
                b.diff[self.keep] = t.diff


class CycleFeed(Layer):
    """A data layer: tops x (n, 3), y (n, 2) with n cycling through param_str's sizes (one
    per forward; ``reshape`` takes the current one, or ``every``, a class attribute, when a
    test sets it), the values ``batch(calls, n)``."""

    every: int | None = None

    def setup(self, bottom, top):
        self.sizes = [int(s) for s in self.param_str.split(",")]
        self.calls = 0

    def reshape(self, bottom, top):
        n = self.every or self.sizes[self.calls % len(self.sizes)]
        top[0].reshape(n, 3)
        top[1].reshape(n, 2)

    def forward(self, bottom, top):
        x, y = batch(self.calls, top[0].shape[0])
        top[0].data[...] = x
        top[1].data[...] = y
        self.calls += 1

    def backward(self, top, propagate_down, bottom):
        pass


def proposals(calls: int, x: np.ndarray) -> np.ndarray:
    """What ``Proposals`` emits at its ``calls``-th forward: a count cycling 3, 1, 4, 2 of
    rows (index, x[index % N] * (calls + 1))."""
    count = (3, 1, 4, 2)[calls % 4]
    rows = np.arange(count)
    return np.column_stack([rows, x[rows % len(x)] * (calls + 1)])


class Proposals(Layer):
    """Faster R-CNN's ProposalLayer pattern: ``reshape`` gives the top (1, 5) only, and
    ``forward`` reshapes it to the rows it computed and writes them."""

    def setup(self, bottom, top):
        self.calls = 0

    def reshape(self, bottom, top):
        top[0].reshape(1, 5)

    def forward(self, bottom, top):
        blob = proposals(self.calls, bottom[0].data)
        self.calls += 1
        top[0].reshape(*blob.shape)
        top[0].data[...] = blob

    def backward(self, top, propagate_down, bottom):
        pass


class Widen(Layer):
    """Top (N, d + extra): the bottom's columns, then ``extra`` zero columns (``extra`` an
    attribute a test sets between passes)."""

    def setup(self, bottom, top):
        self.extra = 0

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape[0], bottom[0].shape[1] + self.extra)

    def forward(self, bottom, top):
        top[0].data[...] = 0
        top[0].data[:, :bottom[0].shape[1]] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        pass


def python(name: str, cls: str, bottoms=(), tops=(), param_str: str = "", extra: str = "") -> str:
    b = " ".join(f'bottom: "{x}"' for x in bottoms)
    t = " ".join(f'top: "{x}"' for x in tops)
    return (f'layer {{ name: "{name}" type: "Python" {b} {t} {extra} python_param {{ '
            f"module: \"{MODULE}\" layer: \"{cls}\" param_str: '{param_str}' }} }}\n")


def input_(top: str, *dims: int) -> str:
    shape = " ".join(f"dim: {d}" for d in dims)
    return (f'layer {{ name: "{top}" type: "Input" top: "{top}" '
            f"input_param {{ shape {{ {shape} }} }} }}\n")


def ip(bottom: str, top: str, n: int, name: str = "ip", extra: str = "") -> str:
    return (f'layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{top}" '
            f"{extra} inner_product_param {{ num_output: {n} {GAUSS} }} }}\n")


def euclidean(a: str, b: str, top: str = "loss") -> str:
    return (f'layer {{ name: "{top}" type: "EuclideanLoss" bottom: "{a}" bottom: "{b}" '
            f'top: "{top}" }}\n')


def weights(net: Net, layer: str = "ip") -> tuple[np.ndarray, np.ndarray]:
    return net.params[layer][0].data.copy(), net.params[layer][1].data.copy()


# -- 1. Filter with any count -----------------------------------------------------------------
def filter_net(sel_dims: tuple[int, ...], loss: str) -> str:
    """x (5, 3) and t (5, 2) filtered by s, an InnerProduct on the kept x, and a loss: the
    Euclidean distance to the kept t, or half the sum of squares of the output."""
    text = ("force_backward: true\n" + input_("x", 5, 3) + input_("t", 5, 2)
            + input_("s", *sel_dims)
            + 'layer { name: "f" type: "Filter" bottom: "x" bottom: "t" bottom: "s" top: "y" '
              'top: "u" }\n' + ip("y", "p", 2))
    if loss == "euclidean":
        return text + euclidean("p", "u")
    return text + ('layer { name: "loss" type: "Reduction" bottom: "p" top: "loss" '
                   "loss_weight: 0.5 reduction_param { operation: SUMSQ } }\n")


SELECTORS = [
    [1.0, 2.0, -1.0, 0.5, 3.0],    # all 5
    [0.0, 2.0, 0.0, -1.0, 1.0],    # 3
    [0.0, 0.0, 0.0, 4.0, 0.0],     # 1
    [0.0, 0.0, 0.0, 0.0, 0.0],     # none
    [1.0, 0.0, 1.0, 0.0, 0.0],     # 2
    [0.0, 2.0, 0.0, -1.0, 1.0],    # 3 again: its build is reused
]


@pytest.mark.parametrize("sel_dims", [(5,), (5, 1)])
@pytest.mark.parametrize("loss", ["sumsq", "euclidean"])
def test_filter_follows_the_selected_count_forward_and_backward(sel_dims, loss):
    net = Net(filter_net(sel_dims, loss), TRAIN, dtype="float64")
    assert net.blobs["y"].shape == (5, 3)  # set-up: the full batch, as in Caffe
    w, b = weights(net)
    selectors = [s for s in SELECTORS if loss == "sumsq" or any(s)]  # 0/0 otherwise
    for i, sel in enumerate(selectors):
        sel = np.array(sel)
        x, t = gaussian(5, 3, seed=i), gaussian(5, 2, seed=10 + i)
        net.blobs["x"].data[...] = x
        net.blobs["t"].data[...] = t
        net.blobs["s"].data[...] = sel.reshape(sel_dims)
        net.forward()
        kept = sel != 0
        k = int(kept.sum())
        assert net.blobs["y"].shape == (k, 3) and net.blobs["u"].shape == (k, 2)
        assert net.blobs["p"].shape == (k, 2)
        np.testing.assert_array_equal(net.blobs["y"].data, x[kept])
        np.testing.assert_array_equal(net.blobs["u"].data, t[kept])
        p = x[kept] @ w.T + b
        np.testing.assert_allclose(net.blobs["p"].data, p, rtol=1e-12, atol=1e-12)
        if loss == "euclidean":
            want_loss, dp = ((p - t[kept]) ** 2).sum() / k / 2, (p - t[kept]) / k
        else:
            want_loss, dp = 0.5 * (p ** 2).sum(), p
        assert net.loss == pytest.approx(want_loss, rel=1e-12, abs=1e-15)
        net.blobs["x"].diff[...] = 7.0  # a stale gradient must be overwritten
        net.backward()
        dx = np.zeros((5, 3))
        dx[kept] = dp @ w
        np.testing.assert_allclose(net.blobs["x"].diff, dx, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(net.params["ip"][0].diff, dp.T @ x[kept], rtol=1e-12,
                                   atol=1e-12)
        np.testing.assert_allclose(net.params["ip"][1].diff, dp.sum(axis=0), rtol=1e-12,
                                   atol=1e-12)
        if loss == "euclidean":  # the kept targets get the opposite gradient; the others 0
            du = np.zeros((5, 2))
            du[kept] = -dp
            np.testing.assert_allclose(net.blobs["t"].diff, du, rtol=1e-12, atol=1e-12)
    distinct = {int((np.array(s) != 0).sum()) for s in selectors}
    assert len(net.builds()) == len(distinct)


def test_gradient_check_through_filter_selecting_fewer_items():
    x = gaussian(5, 3, seed=4)
    sel = np.array([0.0, 1.5, 0.0, -2.0, 0.0])
    net = check_gradients(layer_spec("f", "Filter", ["x", "sel"], ["y"]),
                          {"x": x, "sel": sel}, check=["x"])
    assert net.blobs["y"].shape == (2, 3)
    np.testing.assert_array_equal(net.blobs["y"].data, x[[1, 3]])


def test_gradient_check_of_a_net_through_filter_at_two_counts():
    net = Net(filter_net((5,), "euclidean"), TRAIN, dtype="float64")
    for sel in ([0.0, 1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0, 1.0]):
        x, t = gaussian(5, 3, seed=len(sel)), gaussian(5, 2, seed=9)
        net.blobs["s"].data[...] = sel
        net.blobs["t"].data[...] = t

        def loss(x: np.ndarray = x) -> float:
            net.blobs["x"].data[...] = x
            net.forward()
            return net.loss

        loss()
        net.backward()
        got_x = net.blobs["x"].diff.copy()
        got_w = [v.diff.copy() for v in net.params["ip"]]
        np.testing.assert_allclose(got_x, numeric_gradient(loss, x), rtol=1e-6, atol=1e-8)
        assert np.all(got_x[np.array(sel) == 0] == 0) and np.abs(got_x).max() > 1e-3
        for k, v in enumerate(net.params["ip"]):
            np.testing.assert_allclose(got_w[k], numeric_gradient(loss, v.data), rtol=1e-6,
                                       atol=1e-8)
        assert net.blobs["y"].shape == (int(sum(sel)), 3)


# -- 2. a Python layer emitting a different number of rows each pass -----------------------
KEEP_NET = (input_("x", 6, 4) + input_("t", 6, 2)
            + python("keep", "KeepPositive", ("x", "t"), ("xk", "tk"))
            + ip("xk", "p", 2) + euclidean("p", "tk"))


def inputs_keeping(k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """x (6, 4) whose first feature is positive (at least 0.2) in ``k`` rows, negative (at
    most -0.2) in the others, and t (6, 2)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 4))
    sign = -np.ones(6)
    sign[rng.permutation(6)[:k]] = 1
    x[:, 0] = sign * (0.2 + np.abs(x[:, 0]))
    return x, rng.standard_normal((6, 2))


def step_keeping(s: Solver, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One solver step on inputs keeping ``k`` rows; returns the inputs."""
    x, t = inputs_keeping(k, seed)
    s.net.blobs["x"].data[...] = x
    s.net.blobs["t"].data[...] = t
    s.step(1)
    return x, t


def keep_reference(x, t, w, b):
    """The net's loss and its gradients w.r.t. x, W and b, in numpy."""
    kept = x[:, 0] > 0
    k = int(kept.sum())
    p = x[kept] @ w.T + b
    r = (p - t[kept]) / k
    dx = np.zeros_like(x)
    dx[kept] = r @ w
    return ((p - t[kept]) ** 2).sum() / k / 2, dx, r.T @ x[kept], r.sum(axis=0)


def test_python_layer_rows_follow_the_bottoms_values_at_each_pass():
    net = Net(KEEP_NET, TRAIN, dtype="float64")
    w, b = weights(net)
    for i, k in enumerate((3, 5, 1, 6, 3, 2)):
        x, t = inputs_keeping(k, seed=i)
        out = net.forward(x=x, t=t)
        assert net.blobs["xk"].shape == (k, 4) and net.blobs["tk"].shape == (k, 2)
        assert net.blobs["p"].shape == (k, 2)
        kept = x[:, 0] > 0
        np.testing.assert_array_equal(net.blobs["xk"].data, x[kept])
        np.testing.assert_array_equal(net.blobs["tk"].data, t[kept])
        np.testing.assert_allclose(net.blobs["p"].data, x[kept] @ w.T + b, rtol=1e-12)
        want = keep_reference(x, t, w, b)
        assert float(out["loss"]) == pytest.approx(want[0], rel=1e-12)
        net.backward()
        np.testing.assert_allclose(net.params["ip"][0].diff, want[2], rtol=1e-10, atol=1e-14)
    assert len(net.builds()) == 6  # set-up (0 rows: the inputs are zero), 3, 5, 1, 6, 2


def test_gradient_check_of_a_net_through_a_python_layer_at_two_counts():
    net = Net("force_backward: true\n" + KEEP_NET, TRAIN, dtype="float64")
    w, b = weights(net)
    for k in (2, 4):
        x, t = inputs_keeping(k, seed=20 + k)
        net.blobs["t"].data[...] = t

        def loss(x: np.ndarray = x) -> float:
            net.blobs["x"].data[...] = x
            net.forward()
            return net.loss

        assert loss() == pytest.approx(keep_reference(x, t, w, b)[0], rel=1e-12)
        assert net.blobs["xk"].shape == (k, 4)
        net.backward()
        got_x = net.blobs["x"].diff.copy()
        got_w = [v.diff.copy() for v in net.params["ip"]]
        np.testing.assert_allclose(got_x, keep_reference(x, t, w, b)[1], rtol=1e-10,
                                   atol=1e-14)
        np.testing.assert_allclose(got_x, numeric_gradient(loss, x), rtol=1e-6, atol=1e-8)
        for k_, v in enumerate(net.params["ip"]):
            np.testing.assert_allclose(got_w[k_], numeric_gradient(loss, v.data), rtol=1e-6,
                                       atol=1e-8)


def test_a_solver_trains_through_a_python_layer_whose_count_changes():
    text = (f"net_param {{ {KEEP_NET} }}\nbase_lr: 0.1\nlr_policy: \"fixed\"\nmomentum: 0.9\n"
            "weight_decay: 0.01\nrandom_seed: 7\n")
    # SolverParameter's fields are proto floats: Caffe's double solver uses their float32
    # values (0.1f, not 0.1), and so must the reference.
    lr, mom, decay = (float(np.float32(v)) for v in (0.1, 0.9, 0.01))
    with Solver(text, dtype="float64") as s:
        w, b = weights(s.net)
        hw, hb = np.zeros_like(w), np.zeros_like(b)
        rows = []
        for it, k in enumerate((2, 5, 3, 6, 1)):
            x, t = step_keeping(s, k, seed=40 + it)
            want, _, gw, gb = keep_reference(x, t, w, b)
            assert s.net.loss == pytest.approx(want, rel=1e-12), it
            rows.append(s.net.blobs["xk"].shape[0])
            # Caffe's SGD: weight decay into the gradient, then momentum.
            hw = mom * hw + lr * (gw + decay * w)
            hb = mom * hb + lr * (gb + decay * b)
            w, b = w - hw, b - hb
            np.testing.assert_allclose(s.net.params["ip"][0].data, w, rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(s.net.params["ip"][1].data, b, rtol=1e-12, atol=1e-14)
        assert rows == [2, 5, 3, 6, 1] and s.iter == 5


def test_a_solver_trains_on_a_count_it_had_before_its_buffers_grew():
    """The counts come back (2, 6, 2, 6, 2): each return runs a build made before another
    build grew the shared buffers, and must compute on the grown ones."""
    text = (f"net_param {{ {KEEP_NET} }}\nbase_lr: 0.5\nlr_policy: \"fixed\"\n"
            "random_seed: 7\n")
    with Solver(text, dtype="float64") as s:
        w, b = weights(s.net)
        for it, k in enumerate((2, 6, 2, 6, 2)):
            x, t = step_keeping(s, k, seed=60 + it)
            want, _, gw, gb = keep_reference(x, t, w, b)
            assert s.net.loss == pytest.approx(want, rel=1e-12), it
            kept = x[:, 0] > 0
            np.testing.assert_array_equal(s.net.blobs["xk"].data, x[kept], err_msg=f"step {it}")
            np.testing.assert_allclose(s.net.blobs["p"].data, x[kept] @ w.T + b, rtol=1e-12,
                                       err_msg=f"step {it}")
            w, b = w - 0.5 * gw, b - 0.5 * gb
            np.testing.assert_allclose(s.net.params["ip"][0].data, w, rtol=1e-12,
                                       atol=1e-14, err_msg=f"step {it}")


# -- 3. a top reshaped inside forward() ---------------------------------------------------------
def test_a_top_reshaped_in_forward_reaches_the_next_layers():
    text = (input_("x", 4, 4) + python("prop", "Proposals", ("x",), ("rois",))
            + 'layer { name: "pow" type: "Power" bottom: "rois" top: "q" '
              "power_param { scale: 2 shift: 1 } }\n" + ip("rois", "r", 3))
    net = Net(text, TEST, dtype="float64")
    assert net.blobs["rois"].shape == (1, 5)  # what reshape() gives
    w, b = weights(net)
    for calls in range(6):  # 3, 1, 4, 2, 3, 1 rows
        x = gaussian(4, 4, seed=calls)
        net.forward(x=x)
        want = proposals(calls, x)
        assert net.blobs["rois"].shape == want.shape == ((3, 1, 4, 2)[calls % 4], 5)
        np.testing.assert_array_equal(net.blobs["rois"].data, want)
        np.testing.assert_allclose(net.blobs["q"].data, 2 * want + 1, rtol=1e-15)
        np.testing.assert_allclose(net.blobs["r"].data, want @ w.T + b, rtol=1e-12,
                                   atol=1e-12)
    # A build per count: the set-up one (1 row) and those the passes moved to.
    assert sorted(bl.data["rois"].shape[0] for bl in net.builds()) == [1, 2, 3, 4]


# -- 4. grow-only storage ------------------------------------------------------------------------
CYCLE_NET = (python("feed", "CycleFeed", (), ("x", "y"), "4,7,2") + ip("x", "p", 2)
             + euclidean("p", "y"))
# Bytes per row of a batch: x (3 values), y (2), p (2) and p's gradient (2), in float64; and
# the bytes whatever the batch: the parameters and their gradients (2 x (2x3 + 2)) and the
# loss with its gradient (2 x 1).
ROW, FIXED = 8 * (3 + 2 + 2 + 2), 8 * (2 * (2 * 3 + 2) + 2)


def test_cycling_sizes_stop_allocating_after_the_first_cycle_and_hold_the_largest():
    net = Net(CYCLE_NET, TRAIN, dtype="float64")
    (space,) = net._store.held
    held_after = []
    for n in (4, 7, 2):
        net.forward()
        net.backward()
        assert net.blobs["x"].shape == (n, 3) and net.blobs["p"].diff.shape == (n, 2)
        held_after.append(net._store.held[space])
    # 4 rows: what they need; 7: the four per-row buffers grew, once each; 2: they fit.
    assert held_after == [4 * ROW + FIXED, 7 * ROW + FIXED, 7 * ROW + FIXED]
    assert net._store.generation == 4
    assert held_after[-1] < (4 + 7 + 2) * ROW + FIXED  # the largest, not the sum
    generation, held, builds = net._store.generation, dict(net._store.held), net.builds()
    assert len(builds) == 3
    for _ in range(2):  # a second and a third cycle
        for n in (4, 7, 2):
            net.forward()
            net.backward()
            assert net.blobs["x"].shape == (n, 3)
            assert net._store.generation == generation and net._store.held == held
        assert net.builds() == builds  # the same build objects, none made again


def test_cycling_sizes_compute_on_the_grown_buffers():
    """Back at 4 rows after the 7-row pass grew the buffers, the first build (whose ops
    ran on the 4-row buffers before) must read and write the grown ones."""
    net = Net(CYCLE_NET, TRAIN, dtype="float64")
    w, b = weights(net)
    for calls in range(9):
        n = (4, 7, 2)[calls % 3]
        net.forward()
        net.backward()
        x, y = batch(calls, n)
        p = x @ w.T + b
        np.testing.assert_array_equal(net.blobs["x"].data, x, err_msg=f"pass {calls}")
        assert net.loss == pytest.approx(((p - y) ** 2).sum() / n / 2, rel=1e-12), calls
        np.testing.assert_allclose(net.params["ip"][0].diff, (p - y).T @ x / n, rtol=1e-10,
                                   err_msg=f"pass {calls}")


# -- 5. a parameter shape cannot follow ----------------------------------------------------------
def test_a_parameter_that_would_change_shape_names_the_layer_and_the_net_goes_on():
    text = (input_("x", 3, 4) + python("widen", "Widen", ("x",), ("xw",))
            + ip("xw", "p", 2))
    net = caffe.Net(text, caffe.TEST, dtype="float64")
    w, b = weights(net)
    x = gaussian(3, 4, seed=1)
    np.testing.assert_allclose(net.forward(x=x)["p"], x @ w.T + b, rtol=1e-12)
    builds = net.builds()
    net.layer_dict["widen"].extra = 2
    with pytest.raises(LayerError) as e:
        net.forward(x=x)
    msg = str(e.value)
    assert e.value.layer_name == "ip"
    assert msg.startswith("layer 'ip' (type InnerProduct): ")
    assert "parameter 0 would change shape from (2, 4) to (2, 6)" in msg
    assert "parameters keep their shapes" in msg
    # No whole build was kept for the refused shapes (as in Caffe, the layer's forward ran
    # before InnerProduct's reshape refused: the part up to it may stay, built).
    assert {b for b in net.builds() if b.full} == set(builds)
    # Back at the old width the net runs as before, with its weights.
    net.layer_dict["widen"].extra = 0
    x2 = gaussian(3, 4, seed=2)
    np.testing.assert_allclose(net.forward(x=x2)["p"], x2 @ w.T + b, rtol=1e-12)
    assert net.blobs["xw"].shape == (3, 4)
    np.testing.assert_array_equal(net.params["ip"][0].data, w)


# -- 6. data-parallel replicas refuse a change --------------------------------------------------
def test_replicas_refuse_a_python_data_layer_changing_size_naming_the_layer(monkeypatch):
    net = python("feed", "CycleFeed", (), ("x", "y"), "4,8") + ip("x", "p", 2) + euclidean(
        "p", "y")
    text = f'net_param {{ {net} }}\nbase_lr: 0.1\nlr_policy: "fixed"\nrandom_seed: 3\n'
    with build_solver(text, replicas=2, dtype="float64") as s:
        s.step(1)  # 4 rows, as built
        assert s.iter == 1
        with pytest.raises(PurineError) as e:
            s.step(1)  # the layer asks for 8
        assert str(e.value) == (
            "solver (prototxt text): the train net of a solver training 2 data-parallel "
            "replicas cannot be built again for other shapes; layer 'feed' gives its tops "
            "the shapes (8, 3), (8, 2): give the shapes in the net's prototxt")
        assert s.iter == 1 and s.net.blobs["x"].shape == (4, 3)
        # Every replica's layer object (each replica has its own, as in Caffe) back at the
        # built size: training goes on.
        monkeypatch.setattr(CycleFeed, "every", 4)
        s.step(1)
        assert s.iter == 2 and caffe.Net.adopt(s.net).layer_dict["feed"].calls == 2


# -- 7. test nets ---------------------------------------------------------------------------------
def test_a_test_net_changing_size_uses_the_train_nets_current_weights():
    train = 'include { phase: TRAIN }'
    test = 'include { phase: TEST }'
    net = (python("feed", "CycleFeed", (), ("x", "y"), "4", train)
           + python("tfeed", "CycleFeed", (), ("x", "y"), "3,5", test)
           + ip("x", "p", 2) + euclidean("p", "y"))
    text = (f'net_param {{ {net} }}\nbase_lr: 0.2\nlr_policy: "fixed"\nrandom_seed: 3\n'
            "test_iter: 1\ntest_interval: 1000\ntest_initialization: false\n")
    with Solver(text, dtype="float64") as s:
        tn = s.test_nets[0]
        seen = []
        calls = 0
        for _ in range(3):
            s.step(2)
            w, b = weights(s.net)
            for _ in range(2):
                n = (3, 5)[calls % 2]
                out = tn.forward()
                x, y = batch(calls, n)
                p = x @ w.T + b
                assert tn.blobs["p"].shape == (n, 2)
                assert np.shares_memory(tn.params["ip"][0].data, s.net.params["ip"][0].data)
                np.testing.assert_array_equal(tn.blobs["x"].data, x, err_msg=f"test {calls}")
                np.testing.assert_allclose(tn.blobs["p"].data, p, rtol=1e-12,
                                           err_msg=f"test {calls}")
                assert float(out["loss"]) == pytest.approx(((p - y) ** 2).sum() / n / 2,
                                                           rel=1e-12), calls
                calls += 1
            seen.append(w)
        assert len(tn.builds()) == 2
        # The weights moved between the checks: the test net saw each one.
        assert np.abs(seen[1] - seen[0]).max() > 1e-3 and np.abs(seen[2] - seen[1]).max() > 1e-3


# -- 8. the trace of an iteration that changed build in its pass --------------------------------
def test_the_trace_of_an_iteration_shows_both_parts_of_its_pass(tmp_path):
    from tests.parallel.test_trace import load_trace

    text = (f"net_param {{ {KEEP_NET} }}\nbase_lr: 0.1\nlr_policy: \"fixed\"\n"
            "random_seed: 7\n")
    with Solver(text, dtype="float64") as s:
        for it, k in enumerate((2, 5)):  # the second pass moves to the build for 5 rows
            x, t = inputs_keeping(k, seed=60 + it)
            s.net.blobs["x"].data[...] = x
            s.net.blobs["t"].data[...] = t
            if it == 1:
                s.trace_iteration(tmp_path / "trace.json")
            else:
                s.step(1)
        _, ops, _ = load_trace(tmp_path / "trace.json")
        names = [e["name"] for e in ops]
        b = s.net.builder  # the build for 5 rows, where the pass ended
        assert b.data["xk"].shape == (5, 4)
        # Every op of the iteration once: the Python layer's forward (run in the build for
        # the shapes its reshape gave), the rest of the forward pass, the backward pass and
        # the update, in the order they ran.
        want = b.forward_all + b.backward_all + s.update_ops
        assert sorted(names) == sorted(op.name for op in want)
        assert names.index("keep/Python") < names.index("ip/InnerProductForward") \
            < names.index("ip/InnerProductBackwardWeight") < names.index("solver/ip[0]/update")
        starts = [e["ts"] for e in ops]
        assert starts == sorted(starts)
