"""Whole nets on a GPU against the same nets on the CPU: every layer's forward values and
gradients (float64, so the GPU's gradients pass the CPU's numerical checks by transitivity,
plus a direct numerical check on the GPU), LeNet trained for 100 iterations, replicas on two
streams of one GPU, the memory planner, and the command line with --gpu."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from purine.backend import assign, synchronize, to_host
from purine.caffe import TRAIN, Net
from purine.graph import Location
from tests.gpu.common import GPU0, requires_gpu
from tests.gradcheck import layer_net

pytestmark = requires_gpu

X = (2, 4, 7, 7)
LAYERS = {
    "conv": ('name: "l" type: "Convolution" bottom: "x" top: "y" convolution_param { '
             'num_output: 6 kernel_size: 3 pad: 1 stride: 2 group: 2 '
             'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" } }'),
    "conv_dilated": ('name: "l" type: "Convolution" bottom: "x" top: "y" convolution_param { '
                     'num_output: 3 kernel_size: 3 dilation: 2 '
                     'weight_filler { type: "gaussian" std: 0.5 } }'),
    "conv_1x1": ('name: "l" type: "Convolution" bottom: "x" top: "y" convolution_param { '
                 'num_output: 5 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } }'),
    "deconv": ('name: "l" type: "Deconvolution" bottom: "x" top: "y" convolution_param { '
               'num_output: 3 kernel_size: 3 stride: 2 weight_filler { type: "gaussian" } }'),
    "max_pool": ('name: "l" type: "Pooling" bottom: "x" top: "y" pooling_param { '
                 'pool: MAX kernel_size: 3 stride: 2 }'),
    "ave_pool": ('name: "l" type: "Pooling" bottom: "x" top: "y" pooling_param { '
                 'pool: AVE kernel_size: 3 stride: 2 pad: 1 }'),
    "global_pool": ('name: "l" type: "Pooling" bottom: "x" top: "y" pooling_param { '
                    'pool: MAX global_pooling: true }'),
    "lrn": ('name: "l" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 3 '
            'alpha: 0.5 beta: 0.75 k: 2 }'),
    "lrn_within": ('name: "l" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 3 '
                   'alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL }'),
    "ip": ('name: "l" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { '
           'num_output: 5 weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }'),
    "relu": 'name: "l" type: "ReLU" bottom: "x" top: "y" relu_param { negative_slope: 0.1 }',
    "sigmoid": 'name: "l" type: "Sigmoid" bottom: "x" top: "y"',
    "tanh": 'name: "l" type: "TanH" bottom: "x" top: "y"',
    "softmax": 'name: "l" type: "Softmax" bottom: "x" top: "y"',
    "batch_norm": 'name: "l" type: "BatchNorm" bottom: "x" top: "y"',
    "scale": ('name: "l" type: "Scale" bottom: "x" top: "y" scale_param { bias_term: true '
              'filler { type: "gaussian" } bias_filler { type: "gaussian" } }'),
    "eltwise": ('name: "l" type: "Eltwise" bottom: "x" bottom: "x2" top: "y" eltwise_param { '
                'operation: PROD }'),
    "concat": 'name: "l" type: "Concat" bottom: "x" bottom: "x2" top: "y"',
}


def build(layer: str, location: Location, two: bool) -> Net:
    bottoms = {"x": X, "x2": X} if two else {"x": X}
    return Net(layer_net(layer, bottoms), phase=TRAIN, dtype="float64", seed=3,
               location=location)


def run(net: Net, inputs: dict, r: np.ndarray) -> dict[str, np.ndarray]:
    net.forward(**inputs)
    net.backward(y=r)
    out = {"y": to_host(net.blobs["y"].data)}
    out.update({f"d{n}": to_host(net.blobs[n].diff) for n in inputs})
    out.update({f"{k}[{i}]": to_host(v.diff) for k, vs in net.params.items()
                for i, v in enumerate(vs)})
    return out


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_forward_and_gradients_equal_the_cpus_in_float64(name):
    two = name in ("eltwise", "concat")
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal(X)}
    if two:
        inputs["x2"] = rng.standard_normal(X)
    cpu, gpu = build(LAYERS[name], Location(), two), build(LAYERS[name], GPU0, two)
    for k, vs in cpu.params.items():  # the same initial weights
        for i, v in enumerate(vs):
            assign(gpu.params[k][i].data, v.data)
    r = rng.standard_normal(cpu.blobs["y"].shape)
    want, got = run(cpu, inputs, r), run(gpu, inputs, r)
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-10, atol=1e-12,
                                   err_msg=f"{name}: {key}")


@pytest.mark.parametrize("name", ["conv", "max_pool", "lrn", "ip"])
def test_numerical_gradients_on_the_gpu(name):
    """Central differences computed on the GPU itself, for the layers with CUDA kernels."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(X)
    net = build(LAYERS[name], GPU0, False)
    r = rng.standard_normal(net.blobs["y"].shape)

    def objective(xv: np.ndarray) -> float:
        net.forward(x=xv)
        return float(np.sum(to_host(net.blobs["y"].data) * r))

    net.forward(x=x)
    net.backward(y=r)
    analytic = to_host(net.blobs["x"].diff)
    eps, numeric = 1e-6, np.zeros_like(x)
    for i in rng.choice(x.size, 40, replace=False):  # 40 positions keep it quick
        xp, xm = x.copy(), x.copy()
        xp.flat[i] += eps
        xm.flat[i] -= eps
        numeric.flat[i] = (objective(xp) - objective(xm)) / (2 * eps)
        np.testing.assert_allclose(analytic.flat[i], numeric.flat[i], rtol=1e-5, atol=1e-7)


def lenet_solver(tmp_path, **extra):
    from purine.caffe import caffe_pb2 as pb
    from purine.caffe.prototxt import read_net
    from purine.caffe.solver import read_solver
    from purine.datasets.mnist import split_mnist_5k, write_mnist_lmdb
    from purine.zoo import model_file

    x, y, _, _ = split_mnist_5k(n_test=100)
    db = str(tmp_path / "train_lmdb")
    write_mnist_lmdb(db, x, y)
    net = read_net(model_file("lenet/lenet_train_test.prototxt"))
    for layer in net.layer:
        if layer.type == "Data":
            layer.data_param.source = db
    s = read_solver(model_file("lenet/lenet_solver.prototxt"))
    s.ClearField("net")
    s.net_param.CopyFrom(net)
    s.test_interval, s.snapshot, s.random_seed, s.display = 0, 0, 1, 0
    del s.test_iter[:]
    s.net_param.ClearField("state")
    for k, v in extra.items():
        setattr(s, k, v)
    for layer in list(s.net_param.layer):  # train only: no test net to build
        if any(r.phase == pb.TEST for r in layer.include):
            s.net_param.layer.remove(layer)
    return s


def losses(solver, n: int) -> list[float]:
    return [float(solver._iteration()) for _ in range(n)]


def test_lenet_on_the_gpu_reproduces_the_cpu_losses_over_100_iterations(tmp_path):
    from purine.caffe.solver import Solver

    param = lenet_solver(tmp_path)
    cpu = losses(Solver(param), 100)
    gpu = losses(Solver(param, location=GPU0), 100)
    np.testing.assert_allclose(gpu, cpu, rtol=1e-4)
    assert cpu[-1] < 0.5 * cpu[0]  # it learned


def test_shared_memory_and_two_streams_train_as_the_plain_gpu_run(tmp_path):
    from purine.caffe.solver import Solver

    param = lenet_solver(tmp_path)
    plain = Solver(param, location=GPU0)
    want = losses(plain, 20)
    shared = Solver(param, location=GPU0, share_memory=True)
    np.testing.assert_allclose(losses(shared, 20), want, rtol=1e-6)
    # two replicas on two streams of the one GPU train as one net with twice the batch
    two = Solver(param, location=GPU0, replicas=2,
                 replica_locations=[Location("gpu", 0, 1)])
    cpu_two = Solver(param, replicas=2)
    np.testing.assert_allclose(losses(two, 20), losses(cpu_two, 20), rtol=1e-4)
    synchronize(GPU0)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "purine.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_the_command_line_trains_times_and_queries_on_the_gpu(tmp_path):
    from tests.test_cli import NET, write_solver

    solver = write_solver(tmp_path)
    r = cli("train", "--solver", solver, "--gpu", "0")
    assert r.returncode == 0, r.stderr
    assert "Optimization Done." in r.stderr and (tmp_path / "tiny_iter_6.caffemodel").exists()
    (tmp_path / "net.prototxt").write_text(NET)
    r = cli("time", "--model", str(tmp_path / "net.prototxt"), "--gpu", "0", "--iterations", "3")
    assert r.returncode == 0, r.stderr
    assert "Average Forward-Backward" in r.stderr and "conv\tforward" in r.stderr
    r = cli("device_query", "--gpu", "0")
    assert r.returncode == 0 and "Number of multiprocessors" in r.stderr
