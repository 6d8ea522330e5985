"""A reshaped input blob flows through the next forward, as in Caffe (whose layers reshape at
every Forward): the 00-classification batch, net_surgery's reshape-assign-forward, shapes
back, weights kept, no rebuild without a change, solvers' nets, and Python layers."""

import numpy as np
import pytest

import purine.pycaffe as caffe
from purine.caffe import net as caffe_net
from purine.errors import LayerError, PurineError
from tests.pycaffe.helpers import input_layer, python_layer, write_layers

GAUSS = 'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.3 }'


def data(*dims, top="data"):
    return input_layer(top, *dims).replace('name: "in_', 'name: "input_')


def conv(name, bottom, top, n, k):
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{top}" '
            f"convolution_param {{ num_output: {n} kernel_size: {k} {GAUSS} }} }}")


def ip(name, bottom, top, n):
    return (f'layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{top}" '
            f"inner_product_param {{ num_output: {n} {GAUSS} }} }}")


# A CaffeNet in miniature: conv, ReLU, max pooling, a classifier and its softmax "prob".
CLASSIFIER = (data(1, 3, 9, 9) + conv("conv1", "data", "conv1", 4, 3)
              + 'layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" } '
              'layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" '
              "pooling_param { pool: MAX kernel_size: 3 stride: 2 } } "
              + ip("fc", "pool1", "fc", 10)
              + 'layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }')


def params_of(net):
    return {k: [p.data.copy() for p in v] for k, v in net.params.items()}


def assert_same_params(net, before):
    for k, arrays in before.items():
        for got, want in zip(net.params[k], arrays, strict=True):
            np.testing.assert_array_equal(got.data, want)


def images(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 3, 9, 9)).astype(np.float32)


# -- 00-classification: a batch of 50 ---------------------------------------------------------
def test_a_reshaped_batch_runs_through_the_next_forward():
    net = caffe.Net(CLASSIFIER, caffe.TEST, seed=3)
    weights = params_of(net)
    ims = images(50)
    one_by_one = [net.forward(data=im[None])["prob"][0].copy() for im in ims]

    net.blobs["data"].reshape(50, 3, 9, 9)
    # The input has its new shape at once; the layers after it at the forward, as in Caffe.
    assert net.blobs["data"].data.shape == (50, 3, 9, 9) and net.blobs["data"].num == 50
    assert net.blobs["fc"].shape == (1, 10)
    net.blobs["data"].data[...] = ims
    out = net.forward()
    assert out["prob"].shape == (50, 10) and net.blobs["conv1"].shape == (50, 4, 7, 7)
    np.testing.assert_allclose(out["prob"], np.stack(one_by_one), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out["prob"].sum(axis=1), np.ones(50), rtol=1e-5)
    assert_same_params(net, weights)

    # Back to one image: same answers as before the batch.
    net.blobs["data"].reshape(1, 3, 9, 9)
    got = net.forward(data=ims[7:8])["prob"][0]
    np.testing.assert_allclose(got, one_by_one[7], rtol=1e-6)
    assert net.blobs["prob"].shape == (1, 10)
    assert_same_params(net, weights)


def test_forward_with_an_input_checks_it_against_the_blobs_current_shape():
    net = caffe.Net(CLASSIFIER, caffe.TEST, seed=3)
    with pytest.raises(PurineError, match=r"blob 'data' has shape \(1, 3, 9, 9\), the input "
                                          r"has \(4, 3, 9, 9\)"):
        net.forward(data=images(4))
    net.blobs["data"].reshape(4, 3, 9, 9)  # pycaffe: reshape first, then hand the batch
    assert net.forward(data=images(4))["prob"].shape == (4, 10)


def test_forward_all_batches_by_the_reshaped_input():
    net = caffe.Net(CLASSIFIER, caffe.TEST, seed=3)
    ims = images(7, seed=1)
    single = np.stack([net.forward(data=im[None])["prob"][0].copy() for im in ims])
    net.blobs["data"].reshape(3, 3, 9, 9)
    out = net.forward_all(data=ims)
    assert out["prob"].shape == (7, 10) and net.blobs["data"].shape == (3, 3, 9, 9)
    np.testing.assert_allclose(out["prob"], single, rtol=1e-5, atol=1e-7)


def test_backward_after_a_reshaping_forward_gives_the_new_batch_its_gradients():
    text = "force_backward: true " + data(1, 3, 4) + ip("ip", "data", "out", 2)
    net = caffe.Net(text, caffe.TRAIN, seed=5)
    x = np.random.default_rng(2).standard_normal((3, 3, 4)).astype(np.float32)
    dy = np.array([[1.0, -2.0], [0.5, 3.0], [-1.0, 0.25]], np.float32)
    net.blobs["data"].reshape(3, 3, 4)
    net.forward(data=x)
    grad = net.backward(out=dy)["data"]
    w = net.params["ip"][0].data
    assert grad.shape == (3, 3, 4)
    np.testing.assert_allclose(grad, (dy @ w).reshape(3, 3, 4), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.params["ip"][0].diff, dy.T @ x.reshape(3, 12), rtol=1e-5)


# -- net_surgery: reshape to the image, assign, forward ------------------------------------------
def test_net_surgery_reshape_assign_forward_equals_a_net_built_at_that_shape():
    fcn = data(1, 3, 5, 5) + conv("conv1", "data", "conv1", 2, 3) + conv("score", "conv1",
                                                                         "score", 3, 1)
    net = caffe.Net(fcn, caffe.TEST, seed=4)
    im = np.random.default_rng(3).standard_normal((1, 3, 12, 10)).astype(np.float32)
    net.blobs["data"].reshape(*im.shape)
    net.blobs["data"].data[...] = im
    net.forward()
    assert net.blobs["score"].data.shape == (1, 3, 10, 8)

    # The same weights in a net whose prototxt says the image's shape.
    ref = caffe.Net(fcn.replace("dim: 5 dim: 5", "dim: 12 dim: 10"), caffe.TEST)
    for name, views in net.params.items():
        for mine, theirs in zip(views, ref.params[name]):
            theirs.data[...] = mine.data
    want = ref.forward(data=im)["score"]
    np.testing.assert_allclose(net.blobs["score"].data, want, rtol=1e-6)


# -- rebuilding only on a change ----------------------------------------------------------------
def count_builds(monkeypatch):
    builds = []

    class Counting(caffe_net.NetBuilder):
        def __init__(self, *args, **kwargs):
            builds.append(kwargs.get("input_shapes"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(caffe_net, "NetBuilder", Counting)
    return builds


def test_no_rebuild_while_the_shapes_stay(monkeypatch):
    builds = count_builds(monkeypatch)
    net = caffe.Net(CLASSIFIER, caffe.TEST, seed=3)
    graph = net.graph
    net.forward()
    net.blobs["data"].reshape(1, 3, 9, 9)  # the shape it has
    net.forward(data=images(1))
    net.blobs["data"].reshape(6, 3, 9, 9)  # there and back before the forward
    net.blobs["data"].reshape(1, 3, 9, 9)
    net.forward()
    assert net.graph is graph and len(builds) == 1
    net.blobs["data"].reshape(2, 3, 9, 9)
    net.forward()
    net.forward()
    assert net.graph is not graph and len(builds) == 2
    assert builds[-1] == {"data": (2, 3, 9, 9)}


def test_other_inputs_keep_their_values_across_the_rebuild():
    text = (data(2, 4, top="x") + data(3, top="z") + ip("ip", "x", "a", 2)
            + 'layer { name: "sq" type: "Power" bottom: "z" top: "b" power_param { power: 2 } }')
    net = caffe.Net(text, caffe.TEST, seed=1)
    net.blobs["z"].data[...] = [1.0, -2.0, 3.0]
    net.blobs["x"].reshape(5, 4)
    out = net.forward()
    assert out["a"].shape == (5, 2)
    np.testing.assert_array_equal(out["b"], [1.0, 4.0, 9.0])


def test_a_shape_the_layers_cannot_take_fails_and_the_net_stays_as_built():
    net = caffe.Net(CLASSIFIER, caffe.TEST, seed=3)
    x = images(1)
    want = net.forward(data=x)["prob"].copy()
    net.blobs["data"].reshape(1, 3, 2, 2)  # smaller than conv1's 3x3 kernel
    with pytest.raises(LayerError, match="layer 'conv1'"):
        net.forward()
    assert net.blobs["data"].shape == (1, 3, 9, 9)
    np.testing.assert_array_equal(net.forward(data=x)["prob"], want)


def test_only_input_blobs_take_shapes_of_their_own():
    net = caffe.Net(CLASSIFIER, caffe.TEST, seed=3)
    net.blobs["fc"].reshape(1, 10)  # its own shape: nothing to do, as in Caffe
    with pytest.raises(PurineError, match=r"blob 'fc' \(1, 10\) cannot be reshaped to \(2, 10\)"
                                          r": only the net's input blobs \(data\)"):
        net.blobs["fc"].reshape(2, 10)
    with pytest.raises(PurineError, match=r"blob 'data': negative dimension in reshape"):
        net.blobs["data"].reshape(1, -3, 9, 9)


# -- solvers' nets ------------------------------------------------------------------------------
SOLVER_NET = (data(4, 3, top="x") + data(4, 2, top="y") + ip("ip", "x", "p", 2)
              + 'layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" '
              'top: "loss" }')


def solver(tmp_path):
    path = tmp_path / "solver.prototxt"
    path.write_text(f"net_param {{ {SOLVER_NET} }} base_lr: 0.1 lr_policy: \"fixed\" "
                    "test_iter: 1 test_interval: 1000 test_initialization: false "
                    "random_seed: 2")
    return caffe.SGDSolver(str(path))


def test_a_solvers_train_net_reshapes_at_the_next_step(tmp_path):
    s = solver(tmp_path)
    s.net.blobs["x"].reshape(6, 3)
    assert s.net.blobs["x"].data.shape == (6, 3)
    with pytest.raises(LayerError, match="layer 'loss'"):  # y has 4 rows still
        s.step(1)
    assert s.net.blobs["x"].shape == (4, 3) and s.iter == 0  # as built
    s.net.blobs["x"].reshape(6, 3)
    s.net.blobs["y"].reshape(6, 2)
    s.step(1)  # rebuilt with the update ops (tests/caffe/test_solver_reshape.py)
    assert s.iter == 1 and s.net.blobs["p"].shape == (6, 2)


def test_a_solvers_test_net_reshapes_and_still_sees_the_trained_weights(tmp_path):
    s = solver(tmp_path)
    s.net.blobs["x"].data[...] = 1.0
    test = s.test_nets[0]
    test.blobs["x"].reshape(7, 3)
    test.blobs["y"].reshape(7, 2)
    x = np.random.default_rng(0).standard_normal((7, 3)).astype(np.float32)
    test.blobs["x"].data[...] = x
    test.forward()
    s.step(2)  # the update is seen by the rebuilt test net without a copy
    p = test.forward(blobs=["p"])["p"]
    w, b = s.net.params["ip"][0].data, s.net.params["ip"][1].data
    assert p.shape == (7, 2) and s.iter == 2
    np.testing.assert_allclose(p, x @ w.T + b, rtol=1e-5, atol=1e-6)
    # y was reshaped and left at zeros
    np.testing.assert_allclose(test.loss, (p ** 2).sum() / 7 / 2, rtol=1e-5)


# -- Python layers ------------------------------------------------------------------------------
def test_python_layers_keep_their_object_and_follow_the_new_shape(tmp_path, monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    text = (data(2, 3, top="x") + data(4, top="z")
            + python_layer("rec", mod, "Recorder", ("z",), ("r",))
            + python_layer("ss", mod, "ScaleShift", ("x",), ("y",)))
    net = caffe.Net(text, caffe.TRAIN)
    rec, ss = net.layer_dict["rec"], net.layer_dict["ss"]
    ss.blobs[0].data[...] = [2.0, 3.0, 4.0]
    net.forward()
    net.blobs["x"].reshape(5, 3)
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    out = net.forward(x=x)
    # Set up once, as Caffe's layers are: the build's reshape, then each forward's reshape
    # and forward (Caffe's Net::Forward reshapes each layer; nothing more at a new shape).
    assert net.layer_dict["rec"] is rec and net.layer_dict["ss"] is ss
    assert rec.calls == ["setup", "reshape", "reshape", "forward", "reshape", "forward"]
    np.testing.assert_array_equal(out["y"], x * [2.0, 3.0, 4.0])


def test_a_python_layers_new_top_shape_is_taken_at_the_next_pass_or_reshape(tmp_path,
                                                                             monkeypatch):
    mod = write_layers(tmp_path, monkeypatch)
    net = caffe.Net(data(2, top="x") + python_layer("py", mod, "Growing", ("x",), ("y",)),
                    caffe.TRAIN)
    net.forward()  # Growing asks for one more at the next reshape
    np.testing.assert_array_equal(net.forward()["y"], [0, 1, 2])
    net.reshape()  # Caffe's Net::Reshape: its reshape runs and gives the next shape
    assert net.blobs["y"].shape == (4,)
    np.testing.assert_array_equal(net.forward()["y"], [0, 1, 2, 3])  # reshaped again: (4,)
