"""pycaffe's Net and solvers through ``import purine.pycaffe as caffe``: the constructors,
net surgery (weights copied by layer name, the fully-connected -> convolution recast, save
and load), feature extraction with caffe.io.Transformer, pycaffe's layer and name views,
set_input_arrays, forward_all, the mode functions and the solver classes."""

import cv2
import numpy as np
import pytest

import purine.pycaffe as caffe
from purine.pycaffe.mode import settings

GAUSS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'


def ip(name, bottom, top, n, extra=""):
    return (f'layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{top}" '
            f"{extra} inner_product_param {{ num_output: {n} {GAUSS} }} }}")


def conv(name, bottom, top, n, k):
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{top}" '
            f"convolution_param {{ num_output: {n} kernel_size: {k} {GAUSS} }} }}")


def data(*dims, top="data"):
    shape = " ".join(f"dim: {d}" for d in dims)
    return f'layer {{ name: "{top}" type: "Input" top: "{top}" input_param {{ shape {{ {shape} }} }} }}'


RELU = 'layer {{ name: "{0}" type: "ReLU" bottom: "{1}" top: "{1}" }}'


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# -- constructors -----------------------------------------------------------------------------
def test_the_three_constructor_forms(tmp_path):
    proto = write(tmp_path, "net.prototxt", data(2, 3) + ip("ip", "data", "out", 2))
    a = caffe.Net(proto, caffe.TEST)
    assert a.phase == caffe.TEST
    a.params["ip"][0].data[...] = np.arange(6).reshape(2, 3)
    weights = str(tmp_path / "w.caffemodel")
    a.save(weights)
    b = caffe.Net(proto, weights, caffe.TEST)
    c = caffe.Net(proto, caffe.TRAIN, weights=weights)
    d = caffe.Net(proto, phase=caffe.TEST, weights=weights, stages=None)
    assert (b.phase, c.phase, d.phase) == (caffe.TEST, caffe.TRAIN, caffe.TEST)
    for n in (b, c, d):
        np.testing.assert_array_equal(n.params["ip"][0].data, np.arange(6).reshape(2, 3))
        np.testing.assert_array_equal(n.params["ip"][1].data, a.params["ip"][1].data)


# -- net surgery --------------------------------------------------------------------------------
def test_net_surgery_copies_weights_by_layer_name_and_round_trips(tmp_path):
    src = caffe.Net(data(2, 6) + ip("ip1", "data", "h", 5) + RELU.format("relu", "h")
                    + ip("ip2", "h", "out", 3), caffe.TEST, seed=1)
    # The destination renames the first layer; its weights are transplanted by hand.
    dst_text = (data(2, 6) + ip("fc1", "data", "h", 5) + RELU.format("relu", "h")
                + ip("ip2", "h", "out", 3))
    dst_proto = write(tmp_path, "dst.prototxt", dst_text)
    dst = caffe.Net(dst_proto, caffe.TEST, seed=2)
    for k in range(2):
        dst.params["fc1"][k].data[...] = src.params["ip1"][k].data
        dst.params["ip2"][k].data[...] = src.params["ip2"][k].data
    x = np.random.default_rng(0).standard_normal((2, 6))
    want = src.forward(data=x)["out"].copy()
    np.testing.assert_allclose(dst.forward(data=x)["out"], want, rtol=1e-6)
    saved = str(tmp_path / "dst.caffemodel")
    dst.save(saved)
    again = caffe.Net(dst_proto, saved, caffe.TEST)
    np.testing.assert_allclose(again.forward(data=x)["out"], want, rtol=1e-6)
    # copy_from takes the layers a file has by name and leaves the others.
    src_saved = str(tmp_path / "src.caffemodel")
    src.save(src_saved)
    fresh = caffe.Net(dst_proto, caffe.TEST, seed=3)
    fc1 = fresh.params["fc1"][0].data.copy()
    fresh.copy_from(src_saved)
    np.testing.assert_array_equal(fresh.params["fc1"][0].data, fc1)
    np.testing.assert_array_equal(fresh.params["ip2"][0].data, src.params["ip2"][0].data)


def test_net_surgery_recasts_inner_products_as_convolutions(tmp_path):
    """pycaffe's classic: the fully connected net becomes fully convolutional by copying
    each InnerProduct's weights into a Convolution through ``.flat``."""
    x = np.random.default_rng(4).standard_normal((2, 2, 3, 3))
    full = caffe.Net(data(2, 2, 3, 3) + ip("fc6", "data", "h", 4) + RELU.format("r", "h")
                     + ip("fc7", "h", "out", 3), caffe.TEST, seed=5)
    conv_text = (data(2, 2, 3, 3) + conv("fc6-conv", "data", "h", 4, 3) + RELU.format("r", "h")
                 + conv("fc7-conv", "h", "out", 3, 1))
    fully_conv = caffe.Net(conv_text, caffe.TEST, seed=6)
    for fc, cv in (("fc6", "fc6-conv"), ("fc7", "fc7-conv")):
        fully_conv.params[cv][0].data.flat = full.params[fc][0].data.flat
        fully_conv.params[cv][1].data[...] = full.params[fc][1].data
    want = full.forward(data=x)["out"]
    got = fully_conv.forward(data=x)["out"]
    assert got.shape == (2, 3, 1, 1)
    np.testing.assert_allclose(got[:, :, 0, 0], want, rtol=1e-5, atol=1e-6)


# -- feature extraction ---------------------------------------------------------------------------
def test_feature_extraction_with_the_transformer(tmp_path):
    net = caffe.Net(data(1, 3, 6, 5) + ip("ip1", "data", "ip1", 4) + RELU.format("relu1", "ip1")
                    + ip("ip2", "ip1", "prob", 2), caffe.TEST, seed=8)
    rng = np.random.default_rng(9)
    bgr = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
    path = str(tmp_path / "cat.png")
    cv2.imwrite(path, bgr)

    t = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([104.0, 117.0, 123.0]))
    t.set_input_scale("data", 0.5)
    image = caffe.io.load_image(path)
    x = t.preprocess("data", image)
    # A plain transcription: RGB in [0, 1] -> CHW -> BGR -> [0, 255] -> minus mean -> x 0.5.
    ref = (bgr.astype(np.float64).transpose(2, 0, 1)
           - np.array([104.0, 117.0, 123.0])[:, None, None]) * 0.5
    assert x.dtype == np.float32 and x.shape == (3, 6, 5)
    np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(t.deprocess("data", x), image, atol=1e-6)

    # Two images in one batch: reshape the input blob, then the net.
    net.blobs["data"].reshape(2, 3, 6, 5)
    net.reshape()
    net.blobs["data"].data[...] = [x, x[:, :, ::-1]]
    net.forward()
    w, b = (p.data.astype(np.float64) for p in net.params["ip1"])
    want = np.maximum(np.stack([ref.ravel(), ref[:, :, ::-1].ravel()]) @ w.T + b, 0)
    np.testing.assert_allclose(net.blobs["ip1"].data, want, rtol=1e-4, atol=1e-3)


# -- pycaffe's views ----------------------------------------------------------------------------
def two_heads():
    return (data(3, 4, top="x") + ip("ip1", "x", "h", 5) + RELU.format("relu", "h")
            + ip("ip2", "h", "a", 2, "loss_weight: 1") + ip("ip3", "h", "b", 2, "loss_weight: 0.5"))


def test_layer_and_blob_name_views_as_pycaffe_has_them():
    net = caffe.Net(two_heads(), caffe.TRAIN)
    split = "h_relu_0_split"
    assert net._layer_names == ["x", "ip1", "relu", split, "ip2", "ip3"]
    assert [lr.type for lr in net.layers] == ["Input", "InnerProduct", "ReLU", "Split",
                                              "InnerProduct", "InnerProduct"]
    assert list(net.layer_dict) == net._layer_names
    assert net.top_names == {"x": ["x"], "ip1": ["h"], "relu": ["h"],
                             split: [f"{split}_0", f"{split}_1"], "ip2": ["a"], "ip3": ["b"]}
    assert net.bottom_names == {"x": [], "ip1": ["x"], "relu": ["h"], split: ["h"],
                                "ip2": [f"{split}_0"], "ip3": [f"{split}_1"]}
    assert net._blob_names == ["x", "h", f"{split}_0", f"{split}_1", "a", "b"]
    assert net.blob_loss_weights == {"x": 0, "h": 0, f"{split}_0": 0, f"{split}_1": 0,
                                     "a": 1.0, "b": 0.5}
    layer = net.layer_dict["ip1"]
    assert len(layer.blobs) == 2 and net.layers[2].blobs == []
    assert np.shares_memory(layer.blobs[0].data, net.params["ip1"][0].data)
    assert net.inputs == ["x"] and net.outputs == ["a", "b"]


def test_set_input_arrays_feeds_the_memory_data_layer():
    net = caffe.Net('layer { name: "mem" type: "MemoryData" top: "data" top: "label" '
                    "memory_data_param { batch_size: 2 channels: 1 height: 2 width: 2 } }",
                    caffe.TEST)
    x = np.arange(16, dtype=np.float32).reshape(4, 1, 2, 2)
    labels = np.array([3, 1, 4, 1], dtype=np.float32)
    net.set_input_arrays(x, labels)
    for i in (0, 2, 0):
        out = net.forward()
        np.testing.assert_array_equal(out["data"], x[i:i + 2])
        np.testing.assert_array_equal(out["label"], labels[i:i + 2])


def test_forward_all_batches_and_drops_the_padding():
    net = caffe.Net(data(2, 3) + ip("ip", "data", "out", 2), caffe.TEST)
    x = np.random.default_rng(1).standard_normal((5, 3))
    out = net.forward_all(data=x)
    w, b = (p.data for p in net.params["ip"])
    assert out["out"].shape == (5, 2)
    np.testing.assert_allclose(out["out"], x @ w.T + b, rtol=1e-5, atol=1e-6)


def test_forward_backward_all_gives_input_gradients():
    net = caffe.Net("force_backward: true\n" + data(2, 3) + ip("ip", "data", "out", 2),
                    caffe.TEST)
    x = np.random.default_rng(2).standard_normal((3, 3))
    g = np.random.default_rng(3).standard_normal((3, 2))
    outs, diffs = net.forward_backward_all(data=x, out=g)
    w = net.params["ip"][0].data
    assert outs["out"].shape == (3, 2) and diffs["data"].shape == (3, 3)
    np.testing.assert_allclose(diffs["data"], g @ w, rtol=1e-5, atol=1e-6)


# -- modes and seeds -------------------------------------------------------------------------
@pytest.fixture
def clean_settings(monkeypatch):
    for k in ("mode", "device", "seed"):
        monkeypatch.setattr(settings, k, getattr(settings, k))


def test_mode_functions(clean_settings):
    with pytest.warns(RuntimeWarning, match="no GPU backend"):
        caffe.set_mode_gpu()
    assert settings.mode == "gpu"
    caffe.set_device(1)
    assert settings.device == 1
    caffe.set_mode_cpu()
    assert settings.mode == "cpu"
    with pytest.raises(ValueError, match="device index"):
        caffe.set_device(-1)
    assert {"Python", "InnerProduct", "Convolution"} <= set(caffe.layer_type_list())


def test_set_random_seed_seeds_later_nets_and_solvers(tmp_path, clean_settings):
    text = data(2, 3) + ip("ip", "data", "out", 4)
    caffe.set_random_seed(11)
    a, b = caffe.Net(text, caffe.TEST), caffe.Net(text, caffe.TEST)
    np.testing.assert_array_equal(a.params["ip"][0].data, b.params["ip"][0].data)
    np.testing.assert_array_equal(a.params["ip"][0].data,
                                  caffe.Net(text, caffe.TEST, seed=11).params["ip"][0].data)
    caffe.set_random_seed(12)
    assert not np.allclose(caffe.Net(text, caffe.TEST).params["ip"][0].data,
                           a.params["ip"][0].data)
    solver = caffe.SGDSolver(solver_file(tmp_path, seed=None))
    assert solver.param.random_seed == 12


# -- solvers --------------------------------------------------------------------------------
NET = (
    'name: "regression" '
    'layer { name: "data" type: "DummyData" top: "x" top: "y" dummy_data_param { '
    "shape { dim: 6 dim: 4 } shape { dim: 6 dim: 3 } "
    'data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } } '
    + ip("ip", "x", "p", 3)
    + ' layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }')


def solver_file(tmp_path, kind=None, seed=7, extra="", momentum=0.9):
    lines = [f"net_param {{ {NET} }}", "base_lr: 0.01", 'lr_policy: "fixed"', "max_iter: 10",
             f"momentum: {momentum}", "test_iter: 1", "test_interval: 1000",
             f'snapshot_prefix: "{tmp_path}/snap"', extra]
    if kind:
        lines.append(f'type: "{kind}"')
    if seed is not None:
        lines.append(f"random_seed: {seed}")
    return write(tmp_path, "solver.prototxt", "\n".join(lines))


@pytest.mark.parametrize("cls,kind", [
    (caffe.SGDSolver, "SGD"), (caffe.NesterovSolver, "Nesterov"),
    (caffe.AdaGradSolver, "AdaGrad"), (caffe.RMSPropSolver, "RMSProp"),
    (caffe.AdaDeltaSolver, "AdaDelta"), (caffe.AdamSolver, "Adam")])
def test_each_solver_class_uses_its_own_rule(tmp_path, cls, kind):
    # As with Caffe's C++ classes, the class decides, not the file's type. (Caffe refuses
    # momentum with AdaGrad and RMSProp.)
    momentum = 0 if kind in ("AdaGrad", "RMSProp") else 0.9
    s = cls(solver_file(tmp_path, kind="Adam" if kind != "Adam" else "SGD", momentum=momentum))
    assert s.param.type == kind
    s.step(2)
    assert s.iter == 2


def test_get_solver_follows_the_file_and_nets_are_pycaffe_nets(tmp_path):
    s = caffe.get_solver(solver_file(tmp_path, kind="Adam", extra="delta: 1e-8"))
    assert isinstance(s, caffe.AdamSolver) and s.param.type == "Adam"
    assert isinstance(s.net, caffe.Net) and isinstance(s.test_nets[0], caffe.Net)
    assert s.test_nets[0].phase == caffe.TEST
    assert s.net.layer_dict["ip"].blobs[0].shape == (3, 4)
    plain = caffe.get_solver(solver_file(tmp_path))
    assert isinstance(plain, caffe.SGDSolver)


def test_solve_snapshot_and_restore(tmp_path):
    path = solver_file(tmp_path)
    s = caffe.SGDSolver(path)
    s.step(3)
    model, state = s.snapshot()
    assert model.endswith("snap_iter_3.caffemodel")
    s.step(2)
    after5 = s.net.params["ip"][0].data.copy()
    r = caffe.SGDSolver(path)
    r.restore(state)
    assert r.iter == 3
    r.step(2)
    np.testing.assert_array_equal(r.net.params["ip"][0].data, after5)
    r.solve()
    assert r.iter == 10
