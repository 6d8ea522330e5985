"""The model zoo nets build, run forward and backward, have Caffe's parameter counts, and
the dispatcher's threaded run equals the sequential run bit for bit."""

import os

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import filter_net, read_net, replace_data_layers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = {
    # net: (train prototxt, deploy prototxt, data shape for the test, parameter count)
    "lenet": ("models/lenet/lenet_train_test.prototxt", "models/lenet/lenet.prototxt",
              (4, 1, 28, 28), 431_080),
    "cifar10_quick": ("models/cifar10_quick/cifar10_quick_train_test.prototxt",
                      "models/cifar10_quick/cifar10_quick.prototxt", (4, 3, 32, 32), 145_578),
    "alexnet": ("models/bvlc_alexnet/train_val.prototxt", "models/bvlc_alexnet/deploy.prototxt",
                (2, 3, 227, 227), 60_965_224),
}


def train_net(name: str, threads: int) -> Net:
    path, _, shape, _ = MODELS[name]
    param = filter_net(read_net(os.path.join(ROOT, path)), pb.NetState(phase=TRAIN))
    param = replace_data_layers(param, {"data": shape, "label": shape[:1]})
    return Net(param, phase=TRAIN, seed=1, threads=threads)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_threaded_run_equals_sequential_run_bit_for_bit(name):
    shape = MODELS[name][2]
    rng = np.random.default_rng(0)
    data = rng.standard_normal(shape).astype(np.float32)
    label = rng.integers(0, 10, shape[0]).astype(np.float32)
    results = []
    for threads in (1, 3):
        net = train_net(name, threads)
        assert len({op.location for op in net.graph.ops}) == threads
        net.forward(data=data, label=label)
        net.backward()
        assert np.isfinite(net.loss) and net.loss > 0
        results.append(net)
    a, b = results
    for blob in a.blobs:
        assert np.array_equal(a.blobs[blob].data, b.blobs[blob].data), blob
    for layer, views in a.params.items():
        for k, v in enumerate(views):
            assert np.array_equal(v.diff, b.params[layer][k].diff), (layer, k)
            assert np.abs(v.diff).sum() > 0, (layer, k)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_deploy_nets_have_caffes_parameter_counts(name):
    _, deploy, shape, count = MODELS[name]
    net = Net(os.path.join(ROOT, deploy), phase=TEST)
    assert sum(v.count for views in net.params.values() for v in views) == count
    net.blobs["data"].reshape(*((1,) + shape[1:]))
    net.reshape()
    out = net.forward(data=np.zeros((1,) + shape[1:], np.float32))
    (prob,) = out.values()
    assert prob.shape[0] == 1 and np.allclose(prob.sum(axis=1), 1, atol=1e-5)
