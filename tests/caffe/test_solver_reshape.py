"""A solver's train net reshaped between steps, as in Caffe: the graph and the update ops are
rebuilt, and training goes on bit for bit as a solver built at the new shape and restored
from a snapshot of the first (weights, history, iteration, random streams, data cursor)."""

import h5py
import numpy as np
import pytest

from purine.caffe.solver import Solver
from purine.errors import PurineError
from purine.ops import solver as so
from purine.parallel import build_solver


def net_text(batch: int, h5_list: str) -> str:
    """Inputs x, y of ``batch`` rows through Dropout (a random stream) and an InnerProduct;
    a second branch reads an HDF5 file (a data cursor) plus DummyData noise (a stream)."""
    return f'''name: "reshaped"
    layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: {batch} dim: 3 }} }} }}
    layer {{ name: "y" type: "Input" top: "y" input_param {{ shape {{ dim: {batch} dim: 2 }} }} }}
    layer {{ name: "drop" type: "Dropout" bottom: "x" top: "xd" dropout_param {{
      dropout_ratio: 0.3 }} }}
    layer {{ name: "ip" type: "InnerProduct" bottom: "xd" top: "p"
      param {{ lr_mult: 1 decay_mult: 1 }} param {{ lr_mult: 2 decay_mult: 0 }}
      inner_product_param {{ num_output: 2 weight_filler {{ type: "gaussian" std: 0.5 }}
      bias_filler {{ type: "gaussian" std: 0.5 }} }} }}
    layer {{ name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }}
    layer {{ name: "h5" type: "HDF5Data" top: "h" top: "t"
      hdf5_data_param {{ source: "{h5_list}" batch_size: 2 }} }}
    layer {{ name: "noise" type: "DummyData" top: "n" dummy_data_param {{
      shape {{ dim: 2 dim: 3 }} data_filler {{ type: "gaussian" std: 0.1 }} }} }}
    layer {{ name: "sum" type: "Eltwise" bottom: "h" bottom: "n" top: "hn" }}
    layer {{ name: "ip2" type: "InnerProduct" bottom: "hn" top: "q"
      inner_product_param {{ num_output: 2 weight_filler {{ type: "gaussian" std: 0.5 }} }} }}
    layer {{ name: "loss2" type: "EuclideanLoss" bottom: "q" bottom: "t" top: "loss2" }}'''


def solver_text(batch: int, tmp_path, kind: str = "SGD") -> str:
    h5_list = tmp_path / "list.txt"
    if not h5_list.exists():
        rng = np.random.default_rng(5)
        with h5py.File(tmp_path / "d.h5", "w") as f:
            f["h"] = rng.standard_normal((7, 3)).astype(np.float32)  # odd: the cursor wraps
            f["t"] = rng.standard_normal((7, 2)).astype(np.float32)
        h5_list.write_text(f"{tmp_path}/d.h5\n")
    net = net_text(batch, str(h5_list)).replace("\n", " ")
    extra = "momentum2: 0.999 delta: 1e-8" if kind == "Adam" else "momentum: 0.9"
    return (f"net_param {{ {net} }}\ntype: \"{kind}\"\nbase_lr: 0.1\nlr_policy: \"step\"\n"
            f"gamma: 0.5\nstepsize: 2\nweight_decay: 0.01\n{extra}\nmax_iter: 100\n"
            f"random_seed: 11\ntest_iter: 1\ntest_interval: 1000\n"
            f"test_initialization: false\nsnapshot_prefix: \"{tmp_path}/s\"\n")


def batch_of(it: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + it)
    return (rng.standard_normal((rows, 3)).astype(np.float32),
            rng.standard_normal((rows, 2)).astype(np.float32))


def train(s: Solver, iters: range, rows: int) -> None:
    for it in iters:
        x, y = batch_of(it, rows)
        s.net.blobs["x"].data[...] = x
        s.net.blobs["y"].data[...] = y
        s.step(1)


def history(s: Solver) -> list[np.ndarray]:
    return [s.net.dispatcher.array(h).copy() for h in s._history()]


def params(s: Solver) -> dict[str, np.ndarray]:
    return {f"{n}[{k}]": v.data.copy() for n, vs in s.net.params.items()
            for k, v in enumerate(vs)}


@pytest.mark.parametrize("kind,share", [("SGD", False), ("SGD", True), ("Adam", True)])
def test_reshaped_train_net_continues_as_a_solver_restored_at_the_new_batch(tmp_path, kind,
                                                                           share):
    with Solver(solver_text(4, tmp_path, kind), share_memory=share) as s:
        train(s, range(3), 4)
        _, state = s.snapshot()
        built = s.net.builder
        s.net.blobs["x"].reshape(8, 3)
        s.net.blobs["y"].reshape(8, 2)
        assert s.net.blobs["x"].data.shape == (8, 3)
        train(s, range(3, 6), 8)  # the first of these steps rebuilds
        assert s.net.builder is not built and s.net.blobs["p"].shape == (8, 2)
        assert s.iter == 6
        if share:  # a plan over the rebuilt graph's blobs
            plan = s.net.dispatcher.memory_plan
            assert plan is not None and s.net.builder.data["xd"] in plan.storage
        got_params, got_history = params(s), history(s)
        # The learning rate blob: iteration 5's rate, two steps of gamma down.
        np.testing.assert_allclose(s.net.dispatcher.array(s._lr), 0.1 * 0.5 ** 2)
        assert so.rate(it=5, **s.lr_params()) == pytest.approx(0.025)
    with Solver(solver_text(8, tmp_path, kind), share_memory=share) as ref:
        ref.restore(state)  # weights, history, iteration 3, random streams, HDF5 cursor
        assert ref.iter == 3
        train(ref, range(3, 6), 8)
        want_params, want_history = params(ref), history(ref)
    assert len(got_history) == (4 if kind == "SGD" else 8)
    for k in want_params:
        np.testing.assert_array_equal(got_params[k], want_params[k], err_msg=k)
    for got, want in zip(got_history, want_history, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_data_cursor_goes_on_through_the_rebuild(tmp_path):
    with Solver(solver_text(4, tmp_path)) as s:
        train(s, range(3), 4)  # rows 0-1, 2-3, 4-5 of the 7
        s.net.blobs["x"].reshape(8, 3)
        s.net.blobs["y"].reshape(8, 2)
        train(s, range(3, 5), 8)
        with h5py.File(tmp_path / "d.h5", "r") as f:
            rows = f["h"][...]
        np.testing.assert_array_equal(s.net.blobs["h"].data, rows[[1, 2]])  # 6, 0, then 1, 2


def test_test_nets_see_the_weights_trained_after_the_rebuild(tmp_path):
    with Solver(solver_text(4, tmp_path)) as s:
        train(s, range(2), 4)
        s.net.blobs["x"].reshape(8, 3)
        s.net.blobs["y"].reshape(8, 2)
        train(s, range(2, 4), 8)
        test = s.test_nets[0]
        w, b = s.net.params["ip"][0].data, s.net.params["ip"][1].data
        assert np.shares_memory(test.params["ip"][0].data, w)
        x, _ = batch_of(50, 4)
        p = test.forward(blobs=["p"], x=x)["p"]  # TEST phase: Dropout passes x through
        np.testing.assert_allclose(p, x @ w.T + b, rtol=1e-5, atol=1e-6)


def test_no_rebuild_while_the_shapes_are_unchanged(tmp_path):
    with Solver(solver_text(4, tmp_path)) as s:
        built, dispatcher = s.net.builder, s.net.dispatcher
        train(s, range(2), 4)
        s.net.blobs["x"].reshape(4, 3)  # its own shape
        s.net.blobs["y"].reshape(6, 2)
        s.net.blobs["y"].reshape(4, 2)  # and back before a step
        train(s, range(2, 4), 4)
        s.net.forward()
        assert s.net.builder is built and s.net.dispatcher is dispatcher and s.iter == 4


def test_a_forward_of_the_solvers_net_rebuilds_the_update_ops_too(tmp_path):
    with Solver(solver_text(4, tmp_path)) as s:
        train(s, range(1), 4)
        s.net.blobs["x"].reshape(6, 3)
        s.net.blobs["y"].reshape(6, 2)
        s.net.forward()  # rebuilt here, by the solver
        graph = s.net.graph
        assert all(graph.has_op(op.name) for op in s.update_ops)
        assert s.update_ops[0].inputs[0] is s._it and s.iter == 1
        train(s, range(1, 2), 6)
        assert s.net.graph is graph and s.iter == 2


def test_a_shape_the_layers_cannot_take_leaves_the_solver_as_it_was(tmp_path):
    with Solver(solver_text(4, tmp_path)) as s:
        train(s, range(2), 4)
        s.net.blobs["x"].reshape(8, 3)  # y stays at 4 rows: EuclideanLoss refuses
        with pytest.raises(PurineError, match="layer 'loss'"):
            s.step(1)
        assert s.net.blobs["x"].shape == (4, 3) and s.iter == 2
        train(s, range(2, 3), 4)
        assert s.iter == 3


def test_replicas_refuse_naming_the_blob(tmp_path):
    with build_solver(solver_text(4, tmp_path), replicas=2) as s:
        s.net.blobs["x"].reshape(8, 3)
        with pytest.raises(PurineError, match=r"training 2 data-parallel replicas cannot be built "
                                              r"again for other shapes; input blob 'x' \(4, 3\) was "
                                              r"reshaped to \(8, 3\)"):
            s.step(1)
        s.net.blobs["x"].reshape(4, 3)  # back: it trains
        s.step(1)
        assert s.iter == 1


FEED = '''
import numpy as np
from purine.pycaffe import Layer


class Feed(Layer):
    """A Python data layer whose reshape() takes its batch size from ``rows``."""

    def setup(self, bottom, top):
        self.rows, self.calls = 4, 0

    def reshape(self, bottom, top):
        top[0].reshape(self.rows, 3)
        top[1].reshape(self.rows, 2)

    def forward(self, bottom, top):
        rng = np.random.default_rng(self.calls)
        self.calls += 1
        top[0].data[...] = rng.standard_normal((self.rows, 3))
        top[1].data[...] = rng.standard_normal((self.rows, 2))
'''


def test_a_python_data_layer_takes_a_new_batch_size_at_the_solvers_rebuild(tmp_path,
                                                                          monkeypatch):
    import purine.pycaffe as caffe

    (tmp_path / "feed_layers.py").write_text(FEED)
    monkeypatch.syspath_prepend(str(tmp_path))
    net = ('layer { name: "feed" type: "Python" top: "x" top: "y" python_param { '
           'module: "feed_layers" layer: "Feed" } } '
           'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "p" inner_product_param '
           '{ num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } } '
           'layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }')
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net_param {{ {net} }} base_lr: 0.1 momentum: 0.9 lr_policy: "fixed" '
                    "random_seed: 3")
    s = caffe.SGDSolver(str(path))
    try:
        s.step(2)
        feed = s.net.layer_dict["feed"]
        weights, hist = params(s), history(s)
        feed.rows = 8
        s.net.reshape()  # the layer's reshape() runs again: its tops take 8 rows
        assert s.net.layer_dict["feed"] is feed and s.net.blobs["p"].shape == (8, 2)
        for k, w in weights.items():
            np.testing.assert_array_equal(params(s)[k], w)
        for got, want in zip(history(s), hist, strict=True):
            np.testing.assert_array_equal(got, want)
        s.step(2)
        assert s.iter == 4 and feed.calls == 4 and s.net.blobs["x"].shape == (8, 3)
        assert not np.array_equal(params(s)["ip[0]"], weights["ip[0]"])
    finally:
        s.close()
