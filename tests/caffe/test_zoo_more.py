"""CaffeNet and GoogLeNet from the model zoo: the TRAIN nets (data layers swapped for Input
stand-ins) run forward and backward with every loss counted at its loss_weight and every
parameter reached by the gradient; the TEST nets' accuracy layers run; the deploy nets have
Caffe's parameter counts, take the train nets' parameter shapes layer by layer, and output
one probability row per image; GoogLeNet's deploy forward agrees with OpenCV's Caffe
importer run on the same prototxt and the weights purine writes."""

import os

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import filter_net, read_message, read_net, replace_data_layers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = {
    # net: (train/val prototxt, deploy prototxt, stand-in data shape, deploy parameter count)
    "caffenet": ("models/bvlc_reference_caffenet/train_val.prototxt",
                 "models/bvlc_reference_caffenet/deploy.prototxt", (2, 3, 227, 227),
                 60_965_224),
    "googlenet": ("models/bvlc_googlenet/train_val.prototxt",
                  "models/bvlc_googlenet/deploy.prototxt", (2, 3, 224, 224), 6_998_552),
}
# Loss tops of the TRAIN nets and their loss_weight (Caffe's published values).
LOSSES = {
    "caffenet": {"loss": 1.0},
    "googlenet": {"loss1/loss1": 0.3, "loss2/loss2": 0.3, "loss3/loss3": 1.0},
}
SOLVERS = {
    "caffenet": ["models/bvlc_reference_caffenet/solver.prototxt"],
    "googlenet": ["models/bvlc_googlenet/solver.prototxt",
                  "models/bvlc_googlenet/quick_solver.prototxt"],
}


def stand_in_net(name: str, phase: int) -> Net:
    path, _, shape, _ = MODELS[name]
    param = filter_net(read_net(os.path.join(ROOT, path)), pb.NetState(phase=phase))
    param = replace_data_layers(param, {"data": shape, "label": shape[:1]})
    return Net(param, phase=phase, seed=1)


def batch(name: str) -> tuple[np.ndarray, np.ndarray]:
    shape = MODELS[name][2]
    rng = np.random.default_rng(0)
    data = (rng.standard_normal(shape) * 50).astype(np.float32)  # mean-subtracted pixels
    label = rng.integers(0, 1000, shape[0]).astype(np.float32)
    return data, label


@pytest.fixture(scope="module", params=sorted(MODELS))
def trained_step(request):
    """A TRAIN net after one forward and backward pass on a random batch."""
    name = request.param
    net = stand_in_net(name, TRAIN)
    data, label = batch(name)
    net.forward(data=data, label=label)
    net.backward()
    return name, net


def test_train_net_loss_is_the_weighted_sum_of_its_loss_tops(trained_step):
    name, net = trained_step
    assert np.isfinite(net.loss) and net.loss > 0
    weighted = 0.0
    for top, weight in LOSSES[name].items():
        value = float(net.blobs[top].data.sum())
        assert np.isfinite(value) and value > 0, top
        weighted += weight * value
    assert net.loss == pytest.approx(weighted, rel=1e-6)


def test_train_net_gradient_reaches_every_parameter(trained_step):
    name, net = trained_step
    assert net.params
    for layer, views in net.params.items():
        assert len(views) == 2, layer  # weights and bias everywhere in these nets
        for k, v in enumerate(views):
            assert np.isfinite(v.diff).all(), (layer, k)
            assert np.abs(v.diff).sum() > 0, (layer, k)


def test_train_net_parameters_match_the_deploy_net_layer_by_layer(trained_step):
    name, train = trained_step
    deploy = Net(os.path.join(ROOT, MODELS[name][1]), phase=TEST)
    for layer, views in deploy.params.items():
        assert layer in train.params, layer
        assert [v.shape for v in views] == [v.shape for v in train.params[layer]], layer
    extra = set(train.params) - set(deploy.params)
    if name == "googlenet":  # the auxiliary classifiers exist only for training
        assert extra and all(layer.startswith(("loss1/", "loss2/")) for layer in extra)
    else:
        assert not extra


@pytest.mark.parametrize("name", sorted(MODELS))
def test_test_phase_accuracy_layers_run(name):
    net = stand_in_net(name, TEST)
    data, label = batch(name)
    out = net.forward(data=data, label=label)
    accuracies = [k for k in out if "accuracy" in k or "top-" in k]
    assert accuracies
    for k in accuracies:
        assert 0.0 <= float(out[k]) <= 1.0, k


@pytest.mark.parametrize("name", sorted(MODELS))
def test_deploy_net_has_caffes_parameter_count_and_outputs_probabilities(name):
    _, deploy, shape, count = MODELS[name]
    net = Net(os.path.join(ROOT, deploy), phase=TEST)
    assert net.blobs["data"].shape == (10,) + shape[1:]
    assert sum(v.count for views in net.params.values() for v in views) == count
    net.blobs["data"].reshape(1, *shape[1:])
    net.reshape()
    rng = np.random.default_rng(1)
    out = net.forward(data=(rng.standard_normal((1,) + shape[1:]) * 50).astype(np.float32))
    assert list(out) == ["prob"]
    prob = out["prob"]
    assert prob.shape == (1, 1000)
    assert (prob >= 0).all() and np.allclose(prob.sum(axis=1), 1, atol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_solvers_point_at_the_zoo_train_net(name):
    for path in SOLVERS[name]:
        solver = read_message(os.path.join(ROOT, path), pb.SolverParameter())
        assert solver.net == MODELS[name][0]
        assert os.path.exists(os.path.join(ROOT, solver.net))
        assert solver.snapshot_prefix.startswith(os.path.dirname(MODELS[name][0]) + "/")


def test_googlenet_deploy_forward_matches_opencv(tmp_path):
    cv2 = pytest.importorskip("cv2", reason="opencv-python-headless<5 is in the test extra")
    if not hasattr(cv2, "dnn") or not hasattr(cv2.dnn, "readNetFromCaffe"):
        pytest.skip("this OpenCV has no Caffe importer")
    _, deploy, shape, _ = MODELS["googlenet"]
    path = os.path.join(ROOT, deploy)
    net = Net(path, phase=TEST, seed=5)  # xavier weights, biases 0.2 and 0
    net.blobs["data"].reshape(1, *shape[1:])
    net.reshape()
    x = (np.random.default_rng(2).standard_normal((1,) + shape[1:]) * 50).astype(np.float32)
    net.forward(data=x)
    weights = tmp_path / "googlenet.caffemodel"
    net.save(weights)
    cv = cv2.dnn.readNetFromCaffe(path, str(weights))
    cv.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    cv.setInput(x)
    names = ["inception_4a/output", "inception_5b/output", "loss3/classifier", "prob"]
    for blob, theirs in zip(names, cv.forward(names)):
        ours = net.blobs[blob].data
        assert ours.shape == theirs.shape, blob
        scale = np.abs(theirs).max()
        assert scale > 0, blob
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5 * scale, err_msg=blob)
