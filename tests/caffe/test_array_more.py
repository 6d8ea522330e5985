"""Parameter, Filter and BatchReindex: forward values against numpy and numbers by hand,
float64 gradient checks, a Parameter trained by the solver and saved in a caffemodel, the
Filter kernels' gather and scatter, and the build-time and run-time errors."""

from __future__ import annotations

import numpy as np
import pytest

from purine.caffe import TRAIN, Net
from purine.caffe.solver import Solver
from purine.errors import LayerError, PurineError
from purine.formats.caffemodel import load_weights
from purine.ops import array as arr
from tests.gradcheck import check_gradients, gaussian, layer_net, layer_spec


def _net(layer: str, force_backward: bool = True, **shapes) -> Net:
    return Net(layer_net(layer, shapes, force_backward), phase=TRAIN, dtype="float64")


# -- Parameter ------------------------------------------------------------------------------
PARAM = 'name: "w" type: "Parameter" top: "w" parameter_param { shape { dim: 2 dim: 3 } }'


def test_parameter_top_is_the_parameter_data():
    net = _net(PARAM)
    assert net.params["w"][0].shape == (2, 3)
    np.testing.assert_array_equal(net.params["w"][0].data, np.zeros((2, 3)))  # no filler
    assert not net.builder.layers[-1].forward_ops  # the top is the blob itself, no copy
    net.params["w"][0].data[...] = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(net.forward()["w"], np.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("dims", [[2, 3], [4], [1, 2, 1, 2], []])
def test_parameter_gradient(dims):
    shape = " ".join(f"dim: {d}" for d in dims)
    net = check_gradients(f'name: "w" type: "Parameter" top: "w" parameter_param {{ '
                          f"shape {{ {shape} }} }}", {})
    assert net.params["w"][0].shape == tuple(dims)


def test_parameter_read_by_two_layers_sums_both_gradients():
    text = ("force_backward: true\n" + f"layer {{ {PARAM} }}\n"
            'layer { name: "a" type: "Power" bottom: "w" top: "a" power_param { scale: 2 } }\n'
            'layer { name: "b" type: "Power" bottom: "w" top: "b" power_param { power: 2 } }\n')
    net = Net(text, phase=TRAIN, dtype="float64")
    w = gaussian(2, 3)
    net.params["w"][0].data[...] = w
    net.forward()
    net.backward(a=np.ones((2, 3)), b=np.full((2, 3), 0.5))
    np.testing.assert_allclose(net.params["w"][0].diff, 2 + w, rtol=1e-14)  # 2 + 0.5 * 2w


SOLVER = """
net_param {{ name: "fit"
  layer {{ name: "w" type: "Parameter" top: "w" param {{ lr_mult: {lr_mult} }}
    parameter_param {{ shape {{ dim: 2 dim: 3 }} }} }}
  layer {{ name: "t" type: "DummyData" top: "t" dummy_data_param {{ shape {{ dim: 2 dim: 3 }}
    data_filler {{ type: "constant" value: 2 }} }} }}
  layer {{ name: "loss" type: "EuclideanLoss" bottom: "w" bottom: "t" top: "loss" }} }}
base_lr: 0.5 lr_policy: "fixed" max_iter: 10 momentum: 0.5 weight_decay: 0
snapshot_prefix: "{prefix}"
"""


def test_parameter_trains_with_the_solver_and_round_trips_a_caffemodel(tmp_path):
    s = Solver(SOLVER.format(lr_mult=1, prefix=tmp_path / "fit"))
    # SGD with momentum on EuclideanLoss(w, 2) = |w - 2|^2 / (2 N), N = 2, from w = 0.
    w, v = np.zeros((2, 3)), np.zeros((2, 3))
    for _ in range(3):
        s.step(1)
        v = 0.5 * v + 0.5 * (w - 2) / 2
        w = w - v
        np.testing.assert_allclose(s.net.params["w"][0].data, w, rtol=1e-6)
        np.testing.assert_allclose(s.net.blobs["w"].data, w, rtol=1e-6)
    np.testing.assert_allclose(w, np.full((2, 3), 1.65625))  # 0.5, 1.125, 1.65625 by hand
    model, _ = s.snapshot()
    saved = load_weights(model)
    np.testing.assert_allclose(saved["w"][0], w, rtol=1e-6)
    fresh = Net(Solver(SOLVER.format(lr_mult=1, prefix=tmp_path / "x")).param.net_param,
                model, phase=TRAIN)
    fresh.forward()
    np.testing.assert_allclose(fresh.params["w"][0].data, w, rtol=1e-6)
    np.testing.assert_allclose(fresh.blobs["w"].data, w, rtol=1e-6)
    np.testing.assert_allclose(fresh.blobs["loss"].data, 3 * 0.34375 ** 2 / 2, rtol=1e-6)


def test_parameter_with_lr_mult_0_stays_put():
    s = Solver(SOLVER.format(lr_mult=0, prefix="unused"))
    s.step(2)
    np.testing.assert_array_equal(s.net.params["w"][0].data, np.zeros((2, 3)))
    assert not s.net.builder.layers[0].backward_ops


@pytest.mark.parametrize("layer, shapes, match", [
    ('name: "w" type: "Parameter" bottom: "x" top: "w"', {"x": (2,)},
     r"needs 0 bottom blob\(s\), got 1"),
    ('name: "w" type: "Parameter" top: "w" parameter_param { shape { dim: 2 dim: -1 } }', {},
     r"parameter_param.shape \[2, -1\] has a negative dimension"),
])
def test_parameter_errors(layer, shapes, match):
    with pytest.raises(LayerError, match=r"layer 'w' \(type Parameter\): " + match):
        _net(layer, **shapes)


# -- Filter ---------------------------------------------------------------------------------
def test_filter_kernels_gather_and_scatter_the_selected_items():
    """The kernels work for any count of selected items (a NaN selects, as any non-zero)."""
    x = np.arange(12.0).reshape(6, 2)
    z = np.arange(6.0)
    sel = np.array([0.0, 1.0, -2.0, 0.0, np.nan, 0.0])
    y, yz = np.empty((3, 2)), np.empty(3)
    arr.filter_forward(x, z, sel, y, yz, bottoms=2)
    np.testing.assert_array_equal(y, [[2, 3], [4, 5], [8, 9]])
    np.testing.assert_array_equal(yz, [1, 2, 4])
    dx = np.full((6, 2), 7.0)  # overwritten, not accumulated into
    arr.filter_backward(sel, np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), dx)
    np.testing.assert_array_equal(dx, [[0, 0], [1, 2], [3, 4], [0, 0], [5, 6], [0, 0]])


@pytest.mark.parametrize("n_keep", [0, 2, 5])
def test_filter_forward_kernel_against_numpy(n_keep):
    rng = np.random.default_rng(n_keep)
    x = rng.standard_normal((5, 2, 3))
    sel = np.zeros(5)
    sel[rng.permutation(5)[:n_keep]] = rng.uniform(0.5, 2, n_keep)
    y = np.empty((n_keep, 2, 3))
    arr.filter_forward(x, sel.reshape(5, 1, 1, 1), y, bottoms=1)
    np.testing.assert_array_equal(y, x[sel != 0])
    dy = rng.standard_normal(y.shape)
    dx = np.empty_like(x)
    arr.filter_backward(sel, dy, dx)
    want = np.zeros_like(x)
    want[sel != 0] = dy
    np.testing.assert_array_equal(dx, want)


@pytest.mark.parametrize("shapes, sel_shape", [
    ([(4, 3)], (4,)),
    ([(3, 2, 2), (3,)], (3, 1)),
    ([(2, 3, 2, 2), (2, 5), (2, 1, 1)], (2, 1, 1, 1)),
])
def test_filter_gradient_selecting_everything(shapes, sel_shape):
    names = "abc"[:len(shapes)]
    bottoms = {n: gaussian(*s, seed=i) for i, (n, s) in enumerate(zip(names, shapes, strict=True))}
    bottoms["sel"] = np.arange(1.0, sel_shape[0] + 1).reshape(sel_shape)
    tops = [f"y{n}" for n in names]
    net = check_gradients(layer_spec("f", "Filter", [*names, "sel"], tops), bottoms,
                          check=list(names))
    for n in names:
        np.testing.assert_array_equal(net.blobs[f"y{n}"].data, bottoms[n])


def test_filter_selecting_fewer_items_gives_tops_of_that_count():
    net = _net(layer_spec("f", "Filter", ["x", "sel"], ["y"]), x=(4, 2), sel=(4, 1))
    x, sel = gaussian(4, 2), np.array([[1.0], [0.0], [1.0], [1.0]])
    np.testing.assert_array_equal(net.forward(x=x, sel=sel)["y"], x[[0, 2, 3]])
    assert net.blobs["y"].shape == (3, 2)


def test_filter_kernel_refuses_tops_of_another_count():
    # Where the net does not settle the count first (a data-parallel replica's op), the op
    # finds the mismatch itself.
    x, sel, y = gaussian(4, 2), np.array([[1.0], [0.0], [1.0], [1.0]]), np.empty((4, 2))
    with pytest.raises(PurineError, match=r"Filter selector \(4, 1\) selects 3 of 4 items, but "
                                          r"the tops were built with 4"):
        arr.filter_forward(x, sel, y, bottoms=1)


def test_filter_never_asks_the_selector_for_a_gradient():
    net = _net(layer_spec("f", "Filter", ["x", "sel"], ["y"]), x=(3, 2), sel=(3,))
    net.forward(x=gaussian(3, 2), sel=np.ones(3))
    dy = gaussian(3, 2, seed=1)
    np.testing.assert_array_equal(net.backward(y=dy)["x"], dy)
    ops = net.builder.layers[-1].backward_ops
    assert [op.outputs[0].name for op in ops] == ["x@diff"]


@pytest.mark.parametrize("bottoms, tops, params, shapes, match", [
    (["x", "sel"], ["y"], "", {"x": (4, 2), "sel": (3,)},
     r"bottom 'x' \(4, 2\) must have as many items \(axis 0\) as the selector 'sel' \(3,\) "
     r"has values \(3\)"),
    (["x", "z", "sel"], ["y", "w"], "", {"x": (3, 2), "z": (2,), "sel": (3,)},
     r"bottom 'z' \(2,\) must have as many items"),
    (["x", "sel"], ["y"], "", {"x": (3, 2), "sel": (3, 2)},
     r"the selector \(last bottom\) 'sel' \(3, 2\) must be \(N,\) or \(N, 1, ...\)"),
    (["x", "sel"], ["y", "w"], "", {"x": (3, 2), "sel": (3,)},
     r"1 bottom\(s\) to filter and a selector need 1 top\(s\), got 2"),
    (["x"], ["y"], "", {"x": (3, 2)}, r"needs 2 or more bottom blob\(s\), got 1"),
    (["x", "sel"], ["x"], "", {"x": (3, 2), "sel": (3,)}, r"cannot run in place"),
    (["x", "sel"], ["y"], "loss_weight: 1 propagate_down: true propagate_down: true",
     {"x": (3, 2), "sel": (3,)},
     r"cannot propagate a gradient to its selector bottom 'sel'"),
])
def test_filter_errors(bottoms, tops, params, shapes, match):
    with pytest.raises(LayerError, match=r"layer 'f' \(type Filter\): " + match):
        _net(layer_spec("f", "Filter", bottoms, tops, params), **shapes)


# -- BatchReindex ---------------------------------------------------------------------------
def test_batch_reindex_by_hand():
    x = np.array([10.0, 20.0, 30.0])
    net = _net(layer_spec("r", "BatchReindex", ["x", "p"], ["y"]), x=(3,), p=(4,))
    # 2.9 truncates to 2, as Caffe's int cast does; it is inside [0, 3), so allowed.
    y = net.forward(x=x, p=np.array([2.0, 0.0, 2.9, 2.0]))["y"]
    np.testing.assert_array_equal(y, [30, 10, 30, 30])
    dx = net.backward(y=np.array([1.0, 2.0, 3.0, 4.0]))["x"]
    np.testing.assert_array_equal(dx, [2, 0, 8])  # item 1 never picked; item 2 thrice


@pytest.mark.parametrize("x_shape, permut", [
    ((4,), [3, 1, 0, 2]),
    ((4, 3), [0, 0, 3]),
    ((3, 2, 2), [2, 2, 1, 0, 1, 2]),
    ((2, 3, 1, 2), [1]),
    ((3, 2), []),
])
def test_batch_reindex_gradient(x_shape, permut):
    x = gaussian(*x_shape)
    p = np.array(permut, dtype=np.float64)
    net = check_gradients(layer_spec("r", "BatchReindex", ["x", "p"], ["y"]), {"x": x, "p": p},
                          check=["x"])
    assert net.blobs["y"].shape == (len(permut),) + x_shape[1:]
    np.testing.assert_array_equal(net.blobs["y"].data, x[p.astype(int)])


def test_batch_reindex_backward_against_add_at():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3))
    p = rng.integers(0, 5, 12).astype(np.float64)
    net = _net(layer_spec("r", "BatchReindex", ["x", "p"], ["y"]), x=x.shape, p=p.shape)
    net.forward(x=x, p=p)
    dy = rng.standard_normal((12, 3))
    want = np.zeros_like(x)
    np.add.at(want, p.astype(int), dy)
    np.testing.assert_allclose(net.backward(y=dy)["x"], want, rtol=1e-14)


@pytest.mark.parametrize("bad, where", [(-1.0, 1), (3.0, 2), (-0.5, 0), (np.nan, 1)])
def test_batch_reindex_index_out_of_range_is_a_run_time_error(bad, where):
    net = _net(layer_spec("r", "BatchReindex", ["x", "p"], ["y"]), x=(3, 2), p=(3,))
    p = np.array([0.0, 1.0, 2.0])
    p[where] = bad
    with pytest.raises(PurineError, match=rf"op 'r/BatchReindexForward': BatchReindex index "
                                          rf"{bad!r} at position {where} of the index bottom "
                                          r"\(3,\) is outside \[0, 3\)"):
        net.forward(x=gaussian(3, 2), p=p)


@pytest.mark.parametrize("bottoms, tops, params, shapes, match", [
    (["x", "p"], ["y"], "", {"x": (3, 2), "p": (3, 1)},
     r"the index bottom 'p' \(3, 1\) must have exactly one axis: \(M,\) indices into the "
     r"first axis of bottom 'x' \(3, 2\)"),
    (["x", "p"], ["y"], "", {"x": (), "p": (2,)}, r"bottom 'x' has no axes"),
    (["x"], ["y"], "", {"x": (3,)}, r"needs 2 bottom blob\(s\), got 1"),
    (["x", "p"], ["x"], "", {"x": (3,), "p": (3,)}, r"cannot run in place"),
    (["x", "p"], ["y"], "loss_weight: 1 propagate_down: true propagate_down: true",
     {"x": (3,), "p": (2,)},
     r"cannot propagate a gradient to its index bottom 'p'"),
])
def test_batch_reindex_errors(bottoms, tops, params, shapes, match):
    with pytest.raises(LayerError, match=r"layer 'r' \(type BatchReindex\): " + match):
        _net(layer_spec("r", "BatchReindex", bottoms, tops, params), **shapes)


def test_force_backward_leaves_the_index_and_selector_bottoms_alone():
    net = _net(layer_spec("r", "BatchReindex", ["x", "p"], ["y"]), x=(3,), p=(2,))
    assert net.builder.layers[-1].bottom_need == [True, False]
    net = _net(layer_spec("f", "Filter", ["x", "z", "sel"], ["y", "w"]), x=(3,), z=(3, 2), sel=(3,))
    assert net.builder.layers[-1].bottom_need == [True, True, False]
