"""Synchronous data parallelism: N replicas with batch b each give, after 10 iterations,
the weights of one replica with batch N*b fed the same samples."""

import numpy as np
import pytest

from purine.caffe.solver import Solver, read_solver
from purine.datasets.mnist import load_mnist_5k, write_mnist_lmdb
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net
from purine.parallel import build_solver
from purine.zoo import model_file


@pytest.fixture(scope="module")
def mnist_db(tmp_path_factory):
    images, labels = load_mnist_5k()
    pick = np.random.default_rng(0).permutation(len(labels))[:640]
    path = tmp_path_factory.mktemp("mnist") / "train_lmdb"
    write_mnist_lmdb(path, images[pick], labels[pick])
    return str(path)


def lenet_solver(db: str, batch: int, iters: int = 10) -> pb.SolverParameter:
    net = read_net(model_file("lenet/lenet_train_test.prototxt"))
    for layer in net.layer:
        if layer.type == "Data":
            layer.data_param.source = db
            layer.data_param.batch_size = batch
    s = read_solver(model_file("lenet/lenet_solver.prototxt"))
    s.ClearField("net")
    s.net_param.CopyFrom(net)
    del s.test_iter[:]
    s.test_interval = 0
    s.max_iter = iters
    s.display = 0
    s.snapshot = 0
    s.random_seed = 3
    return s


@pytest.mark.parametrize("replicas", [2, 4])
def test_replicas_equal_one_net_with_the_whole_batch(mnist_db, replicas):
    b = 8
    single = Solver(lenet_solver(mnist_db, b * replicas))
    single.step(10)
    parallel = build_solver(lenet_solver(mnist_db, b), replicas=replicas)
    locations = {op.location for op in parallel.pass_ops()}
    assert len(locations) == replicas + 1  # one worker per replica, one for the all-reduce
    parallel.step(10)
    for layer, views in single.net.params.items():
        for k, v in enumerate(views):
            got = parallel.net.params[layer][k].data
            np.testing.assert_allclose(got, v.data, rtol=1e-5, atol=1e-6 * np.abs(v.data).max(),
                                       err_msg=f"{layer}[{k}]")
    assert np.isfinite(parallel._pass_loss())


def test_replicas_in_other_memory_spaces_copy_weights_in_and_gradients_home(mnist_db):
    """The layout a GPU per replica needs: each replica keeps its own weights, refreshed by
    Copy ops, and sends its gradients home by Copy ops; the numbers do not change."""
    from purine.graph import Location

    shared = build_solver(lenet_solver(mnist_db, 8), replicas=2)
    shared.step(10)
    apart = build_solver(lenet_solver(mnist_db, 8), replicas=2,
                         replica_locations=[Location("cpu", 1)])
    copies = [op for op in apart.pass_ops() if op.type == "Copy"]
    assert {op.name.split("/")[1] for op in copies} == {"pull", "push"}
    assert len(copies) == 2 * len(apart.net.builder.learnable_params)
    apart.step(10)
    for layer, views in shared.net.params.items():
        for a, b in zip(views, apart.net.params[layer]):
            assert np.array_equal(a.data, b.data), layer


@pytest.fixture(scope="module")
def cifar_db(tmp_path_factory):
    from purine.converters.convert_imageset import write_images

    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("cifar") / "train_lmdb"
    records = ((f"{i:08d}", rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), i % 10)
               for i in range(320))
    write_images(path, records, total=320)
    return str(path)


@pytest.mark.parametrize("replicas", [2, 4])
def test_cifar10_quick_replicas_equal_one_net_with_the_whole_batch(cifar_db, replicas):
    def cifar_solver(batch: int) -> pb.SolverParameter:
        net = read_net(model_file("cifar10_quick/cifar10_quick_train_test.prototxt"))
        for layer in net.layer:
            if layer.type == "Data":
                layer.data_param.source = cifar_db
                layer.data_param.batch_size = batch
                layer.transform_param.ClearField("mean_file")
                layer.transform_param.scale = 1 / 256
        s = read_solver(model_file("cifar10_quick/cifar10_quick_solver.prototxt"))
        s.ClearField("net")
        s.net_param.CopyFrom(net)
        del s.test_iter[:]
        s.test_interval = s.display = s.snapshot = 0
        s.max_iter, s.random_seed = 10, 3
        return s

    b = 4
    single = Solver(cifar_solver(b * replicas))
    single.step(10)
    parallel = build_solver(cifar_solver(b), replicas=replicas)
    parallel.step(10)
    for layer, views in single.net.params.items():
        for k, v in enumerate(views):
            np.testing.assert_allclose(parallel.net.params[layer][k].data, v.data, rtol=1e-5,
                                       atol=1e-6 * np.abs(v.data).max(),
                                       err_msg=f"{layer}[{k}]")


def test_batchnorm_statistics_advance_once_per_iteration_with_replicas():
    """Each replica's forward pass updates its own BatchNorm statistics (as on Caffe's
    GPUs); the kept statistics are the first replica's, the same with shared weights as
    with weights in another memory space."""
    from purine.graph import Location

    net = """name: "bn"
    layer { name: "d" type: "DummyData" top: "x" top: "y" dummy_data_param {
      shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 }
      data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
    layer { name: "bn" type: "BatchNorm" bottom: "x" top: "b" }
    layer { name: "ip" type: "InnerProduct" bottom: "b" top: "p"
      inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
    layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }"""

    def run(**kw) -> float:
        s = build_solver(pb.SolverParameter(net_param=read_net(net), base_lr=0.1, max_iter=3,
                                            lr_policy="fixed", random_seed=1), **kw)
        s.step(3)
        return [v.data.copy() for v in s.net.params["bn"]]

    one = run()
    shared = run(replicas=2)
    apart = run(replicas=2, replica_locations=[Location("cpu", 1)])
    assert one[2][0] == shared[2][0] == apart[2][0]  # moving-average factor: 3 updates
    for a, b in zip(shared, apart):
        assert np.array_equal(a, b)
