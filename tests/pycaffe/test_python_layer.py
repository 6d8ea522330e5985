"""Python layers (type "Python"): a user's data layer and Euclidean loss training through
caffe.SGDSolver, the Python loss against the built-in EuclideanLoss, learnable blobs the
solver updates, gradient checks through the net, and the errors a user sees."""

import sys
import types

import numpy as np
import pytest

import purine.caffe.layers.python  # noqa: F401  (registers "Python" until layers/ imports it)
import purine.pycaffe as caffe
from purine.errors import LayerError
from tests.gradcheck import check_gradients
from tests.pycaffe.helpers import input_layer, python_layer, write_layers

SOLVER = """net: "{net}"
base_lr: {lr}
lr_policy: "fixed"
momentum: {momentum}
max_iter: 1000
random_seed: 5
"""


def regression_net(module: str, loss: str, batch: int = 8, pool: int = 64,
                   scale_shift: bool = False) -> str:
    data = python_layer("data", module, "DataLayer", tops=("x", "y"),
                        param_str=f'{{"batch": {batch}, "seed": 3, "pool": {pool}}}')
    x = "x"
    ss = ""
    if scale_shift:
        ss = python_layer("ss", module, "ScaleShift", bottoms=("x",), tops=("xs",))
        x = "xs"
    ip = (f'layer {{ name: "ip" type: "InnerProduct" bottom: "{x}" top: "p" '
          'inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } '
          'bias_filler { type: "gaussian" std: 0.3 } } }')
    if loss == "python":
        lo = python_layer("loss", module, "EuclideanLossLayer", bottoms=("p", "y"),
                          tops=("loss",), extra="loss_weight: 1")
    else:
        lo = 'layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }'
    return f'name: "regression"\n{data}\n{ss}\n{ip}\n{lo}\n'


def make_solver(tmp_path, net_text: str, tag: str, cls=None, lr=0.05, momentum=0.0):
    net = tmp_path / f"{tag}.prototxt"
    net.write_text(net_text)
    path = tmp_path / f"{tag}_solver.prototxt"
    path.write_text(SOLVER.format(net=net, lr=lr, momentum=momentum))
    return (cls or caffe.SGDSolver)(str(path))


def epoch_loss(net, batches: int) -> float:
    return float(np.mean([net.forward()["loss"].sum() for _ in range(batches)]))


def test_python_data_and_loss_layers_train_and_the_loss_falls(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    solver = make_solver(tmp_path, regression_net(mod, "python"), "train", momentum=0.9)
    net = solver.net
    assert isinstance(net, caffe.Net)
    before = epoch_loss(net, 8)
    solver.step(80)
    assert solver.iter == 80
    after = epoch_loss(net, 8)
    assert after < 0.05 * before, (before, after)
    # The data layer's own object is net.layers[0], as in pycaffe; it kept its cursor.
    data = net.layers[0]
    assert type(data).__name__ == "DataLayer" and data.type == "Python"
    assert data.pos == (88 * 8) % 64
    assert net.blob_loss_weights["loss"] == 1.0 and net.blob_loss_weights["p"] == 0.0


def test_python_euclidean_loss_gives_the_builtin_gradient(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    py = make_solver(tmp_path, regression_net(mod, "python"), "py", momentum=0.9)
    builtin = make_solver(tmp_path, regression_net(mod, "builtin"), "builtin", momentum=0.9)
    for s in (py, builtin):  # same seed, same layer indices: the same initial weights
        np.testing.assert_array_equal(s.net.params["ip"][0].data,
                                      py.net.params["ip"][0].data)
    for s in (py, builtin):
        s.net.forward()
        s.net.backward()
    np.testing.assert_allclose(py.net.blobs["loss"].data.sum(),
                               builtin.net.blobs["loss"].data, rtol=1e-6)
    for k in range(2):
        np.testing.assert_allclose(py.net.params["ip"][k].diff, builtin.net.params["ip"][k].diff,
                                   rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(py.net.blobs["p"].diff, builtin.net.blobs["p"].diff,
                               rtol=1e-5, atol=1e-7)
    start = py.net.params["ip"][0].data.copy()
    py.step(6)
    builtin.step(6)
    for k in range(2):
        np.testing.assert_allclose(py.net.params["ip"][k].data,
                                   builtin.net.params["ip"][k].data, rtol=1e-5, atol=1e-6)
    assert np.abs(py.net.params["ip"][0].data - start).max() > 1e-2


def test_learnable_blobs_of_a_python_layer_are_parameters_the_solver_updates(
        tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    # One batch is the whole pool, so every forward sees the same data.
    solver = make_solver(tmp_path, regression_net(mod, "builtin", batch=16, pool=16,
                                                  scale_shift=True), "ss", lr=0.1)
    net = solver.net
    w, b = net.params["ss"]
    np.testing.assert_array_equal(w.data, np.ones(4))  # what setup wrote
    np.testing.assert_array_equal(b.data, np.zeros(4))
    layer = net.layer_dict["ss"]
    assert np.shares_memory(layer.blobs[0].data, w.data)
    net.forward()
    net.backward()
    net.backward()  # the layer's "+=" into its diffs starts from zero at every pass
    grads = [w.diff.copy(), b.diff.copy()]
    assert np.abs(grads[0]).max() > 1e-3
    before = [w.data.copy(), b.data.copy()]
    solver.step(1)
    for v, g, old in zip((w, b), grads, before):
        np.testing.assert_allclose(v.data, old - 0.1 * g, rtol=1e-5, atol=1e-7)
    # Saved with the net and loaded back by layer name.
    path = tmp_path / "ss.caffemodel"
    net.save(str(path))
    again = caffe.Net(str(tmp_path / "ss.prototxt"), str(path), caffe.TRAIN)
    np.testing.assert_array_equal(again.params["ss"][0].data, w.data)


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 2, 2), (4, 2, 5)])
def test_gradient_check_python_layer_with_parameters(tmp_path, monkeypatch, shape):
    mod = write_layers(tmp_path, monkeypatch)
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape)
    net = check_gradients(
        f'name: "ss" type: "Python" bottom: "x" top: "y" python_param {{ module: "{mod}" '
        'layer: "ScaleShift" }', {"x": x})
    # The parameters start at w = 1, b = 0 from setup: y = x.
    np.testing.assert_allclose(net.blobs["y"].data, x)


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 2)])
def test_gradient_check_python_euclidean_loss(tmp_path, monkeypatch, shape):
    mod = write_layers(tmp_path, monkeypatch)
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    net = check_gradients(
        f'name: "loss" type: "Python" bottom: "a" bottom: "b" top: "loss" loss_weight: 1 '
        f'python_param {{ module: "{mod}" layer: "EuclideanLossLayer" }}', {"a": a, "b": b})
    want = ((a - b) ** 2).sum() / shape[0] / 2
    np.testing.assert_allclose(net.blobs["loss"].data, [want], rtol=1e-12)


@pytest.mark.parametrize("top,k", [("y", "2.5"), ("x", "-0.5")])
def test_gradient_check_python_layer_in_place_and_not(tmp_path, monkeypatch, top, k):
    mod = write_layers(tmp_path, monkeypatch)
    x = np.random.default_rng(1).standard_normal((3, 5))
    net = check_gradients(
        f'name: "times" type: "Python" bottom: "x" top: "{top}" python_param {{ '
        f"module: \"{mod}\" layer: \"Times\" param_str: '{k}' }}", {"x": x})
    np.testing.assert_allclose(net.blobs[top].data, float(k) * x)


def test_param_str_phase_and_the_call_order(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    text = input_layer("x", 2, 3) + "\n" + python_layer(
        "rec", mod, "Recorder", bottoms=("x",), tops=("y",), param_str="hello world")
    for phase in (caffe.TRAIN, caffe.TEST):
        net = caffe.Net(text, phase)
        rec = net.layer_dict["rec"]
        assert (rec.seen_param_str, rec.seen_phase) == ("hello world", phase)
        x = np.arange(6.0).reshape(2, 3)
        net.forward(x=x)
        np.testing.assert_array_equal(net.blobs["y"].data, x)
        assert rec.calls == ["setup", "reshape", "reshape", "forward"]


def test_a_python_loss_needs_its_loss_weight_as_in_caffe(tmp_path, monkeypatch):
    """PythonLayer is not a LossLayer: without loss_weight its top weighs nothing."""
    mod = write_layers(tmp_path, monkeypatch)
    body = (input_layer("a", 2, 3) + input_layer("b", 2, 3)
            + 'layer { name: "ip" type: "InnerProduct" bottom: "a" top: "p" '
            "inner_product_param { num_output: 3 } }")
    for extra, weight in (("", 0.0), ("loss_weight: 2", 2.0)):
        net = caffe.Net(body + python_layer("loss", mod, "EuclideanLossLayer", ("p", "b"),
                                            ("loss",), extra=extra), caffe.TRAIN)
        # The InnerProduct's default filler gives p = 0: six residuals of -2 over N = 2.
        net.forward(a=np.ones((2, 3)), b=np.full((2, 3), 2.0))
        assert net.loss == pytest.approx(weight * 24 / 2 / 2)
        net.backward()
        # The layer ignores its top diff (as Caffe's example does), so the weight does not
        # scale the gradient: dp = -2 / 2, dW = dp^T a = -2; no weight, no backward pass.
        np.testing.assert_allclose(net.params["ip"][0].diff, np.full((3, 3), -2.0 if weight
                                                                     else 0.0))


def test_share_with_reaches_python_layer_blobs(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    text = input_layer("x", 2, 3) + python_layer("ss", mod, "ScaleShift", ("x",), ("y",))
    train, test = caffe.Net(text, caffe.TRAIN), caffe.Net(text, caffe.TEST)
    train.params["ss"][0].data[...] = [2, 3, 4]
    test.share_with(train)
    assert np.shares_memory(test.layer_dict["ss"].blobs[0].data, train.params["ss"][0].data)
    out = test.forward(x=np.ones((2, 3)))["y"]
    np.testing.assert_array_equal(out, [[2, 3, 4], [2, 3, 4]])


def test_a_user_module_imports_caffe_and_gets_pycaffe(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    caffe.Net(input_layer("x", 2) + python_layer("t", mod, "Times", ("x",), ("y",), "2"))
    assert sys.modules[mod].caffe is caffe
    assert issubclass(sys.modules[mod].Times, caffe.Layer)


# -- errors ---------------------------------------------------------------------------------
def build(text: str):
    return caffe.Net(text, caffe.TRAIN)


def test_a_module_that_cannot_be_imported_names_layer_module_and_error():
    with pytest.raises(LayerError) as e:
        build(input_layer("x", 2) + python_layer("py", "no_such_module_xq7", "L", ("x",),
                                                 ("y",)))
    msg = str(e.value)
    assert "layer 'py' (type Python)" in msg and "'no_such_module_xq7'" in msg
    assert "ModuleNotFoundError" in msg and "sys.path" in msg


def test_an_import_error_inside_the_module_is_reported(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch, "import not_installed_dependency_q1\n")
    with pytest.raises(LayerError, match=rf"layer 'py'.*'{mod}'.*not_installed_dependency_q1"):
        build(input_layer("x", 2) + python_layer("py", mod, "L", ("x",), ("y",)))


def test_a_module_that_raises_on_import_is_reported(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch, "raise RuntimeError('half written')\n")
    with pytest.raises(LayerError, match=r"layer 'py'.*raised RuntimeError: half written"):
        build(input_layer("x", 2) + python_layer("py", mod, "L", ("x",), ("y",)))


def test_a_missing_class_is_reported(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    with pytest.raises(LayerError, match=rf"layer 'py'.*module '{mod}' .* no class 'Nope'"):
        build(input_layer("x", 2) + python_layer("py", mod, "Nope", ("x",), ("y",)))


def test_missing_python_param_fields_are_reported():
    with pytest.raises(LayerError, match="layer 'py'.*needs both 'module' and 'layer'"):
        build(input_layer("x", 2) + 'layer { name: "py" type: "Python" bottom: "x" top: "y" '
              'python_param { module: "m" } }')


def test_an_exception_in_forward_keeps_its_type_and_names_the_layer(tmp_path, monkeypatch):
    # Caffe's caller sees the layer's own exception; a note says which layer raised it.
    mod = write_layers(tmp_path, monkeypatch)
    net = build(input_layer("x", 2, 2) + python_layer("py", mod, "Broken", ("x",), ("y",),
                                                      "forward"))
    with pytest.raises(ValueError) as e:
        net.forward()
    assert type(e.value) is ValueError and str(e.value) == "bad batch in forward"
    assert e.value.__notes__ == [f"raised in Python layer 'py' ({mod}.Broken.forward)"]


def test_an_exception_in_reshape_at_build_keeps_its_type(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    with pytest.raises(KeyError) as e:
        build(input_layer("x", 2) + python_layer("py", mod, "Broken", ("x",), ("y",),
                                                 "reshape"))
    assert e.value.__notes__ == [f"raised in Python layer 'py' ({mod}.Broken.reshape)"]


def test_the_cli_prints_a_python_layers_exception_as_one_line(tmp_path, monkeypatch, capsys):
    from purine.errors import run_reporting

    mod = write_layers(tmp_path, monkeypatch)
    net = build(input_layer("x", 2, 2) + python_layer("py", mod, "Broken", ("x",), ("y",),
                                                      "forward"))
    capsys.readouterr()  # the net's set-up log, where the log is on
    assert run_reporting("purine-caffe test", lambda: net.forward() and 0) == 1
    assert capsys.readouterr().err == (
        f"purine-caffe test: Python layer 'py' ({mod}.Broken.forward) raised ValueError: "
        "bad batch in forward\n")


def test_a_top_takes_the_shape_reshape_gives_at_each_pass(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    net = build(input_layer("x", 2) + python_layer("py", mod, "Growing", ("x",), ("y",)))
    assert net.blobs["y"].shape == (2,)
    for n in (2, 3, 4):  # the first pass reshapes to (2,) again, then (3,), (4,)
        np.testing.assert_array_equal(net.forward()["y"], np.arange(n))
        assert net.blobs["y"].shape == (n,)


def test_a_top_without_a_shape_is_an_error(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    with pytest.raises(LayerError, match="layer 'py'.*did not give top 'y' a shape"):
        build(input_layer("x", 2) + python_layer("py", mod, "Shapeless", ("x",), ("y",)))


# -- the `import caffe` shim ---------------------------------------------------------------
def _forget_caffe(monkeypatch):
    """As in a fresh process: no ``caffe`` imported and no alias finder (both restored)."""
    for name in [n for n in sys.modules if n == "caffe" or n.startswith("caffe.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if not isinstance(f, caffe.alias.CaffeAlias)])


def test_the_shim_never_replaces_an_installed_caffe(tmp_path, monkeypatch):
    _forget_caffe(monkeypatch)
    pkg = tmp_path / "caffe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert caffe.install_as_caffe() is False
    assert "caffe" not in sys.modules


def test_the_shim_leaves_an_imported_caffe_alone(monkeypatch):
    _forget_caffe(monkeypatch)
    other = types.ModuleType("caffe")
    monkeypatch.setitem(sys.modules, "caffe", other)
    assert caffe.install_as_caffe() is False
    assert sys.modules["caffe"] is other


def test_the_shim_installs_over_a_caffe_source_checkout(tmp_path, monkeypatch):
    _forget_caffe(monkeypatch)
    (tmp_path / "caffe" / "python").mkdir(parents=True)  # no __init__.py: not a package
    monkeypatch.syspath_prepend(str(tmp_path))
    assert caffe.install_as_caffe() is True
    import caffe as imported
    from caffe.proto import caffe_pb2

    assert imported is caffe and caffe_pb2.NetParameter is caffe.proto.caffe_pb2.NetParameter
    assert sys.modules["caffe.io"] is caffe.io
    from caffe.net_spec import assign_proto, to_proto

    assert to_proto is caffe.to_proto and callable(assign_proto)
