"""Asynchronous parameter-server training: LeNet learns the embedded MNIST digits with two
stale replicas, the staleness bound holds (also against a slow replica), S=0 runs in rounds,
snapshots follow the solver, and an error in a replica thread is raised, not hung on."""

import json
import logging
import os
import threading
import time

import numpy as np
import pytest

from purine.backend import _openblas_threads, one_blas_thread
from purine.caffe.solver import DivergenceError, Solver, read_solver
from purine.datasets.mnist import split_mnist_5k, write_mnist_lmdb
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net
from purine.parallel.async_ps import AsyncSolver
from purine.zoo import model_file


@pytest.fixture(scope="module")
def mnist_dbs(tmp_path_factory):
    """4000 training digits and the 1000 held-out ones, as the demo splits them."""
    train_x, train_y, test_x, test_y = split_mnist_5k(n_test=1000)
    root = tmp_path_factory.mktemp("mnist")
    write_mnist_lmdb(root / "train_lmdb", train_x, train_y)
    write_mnist_lmdb(root / "test_lmdb", test_x, test_y)
    return str(root / "train_lmdb"), str(root / "test_lmdb"), str(root)


def lenet(dbs, batch: int, iters: int) -> pb.SolverParameter:
    """models/lenet's net and solver on the embedded digits; no display, tests or
    snapshots unless a test turns them on."""
    train_db, test_db, root = dbs
    net = read_net(model_file("lenet/lenet_train_test.prototxt"))
    for layer in net.layer:
        if layer.type == "Data":
            train = any(r.phase == pb.TRAIN for r in layer.include)
            layer.data_param.source = train_db if train else test_db
            if train:
                layer.data_param.batch_size = batch
    s = read_solver(model_file("lenet/lenet_solver.prototxt"))
    s.ClearField("net")
    s.net_param.CopyFrom(net)
    del s.test_iter[:]
    s.test_iter.append(10)  # 10 batches of 100: the 1000 held-out digits
    s.test_interval = 0
    s.max_iter = iters
    s.display = 0
    s.snapshot = 0
    s.snapshot_after_train = False
    s.snapshot_prefix = os.path.join(root, "lenet")
    s.random_seed = 7
    return s


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def capture(name: str) -> tuple[logging.Logger, Lines]:
    log = logging.getLogger(f"test_async.{name}")
    log.setLevel(logging.INFO)
    log.propagate = False
    lines = Lines()
    log.handlers = [lines]
    return log, lines


def assert_bounded(solver: AsyncSolver, staleness: int) -> int:
    """Every pull came from a replica at most ``staleness`` pushes ahead of the slowest;
    returns the largest lead seen."""
    assert solver.pull_log
    leads = [p.pushes[p.replica] - min(p.pushes) for p in solver.pull_log]
    assert max(leads) <= staleness
    # a replica pulls once per push, and the pushes only happen after pulls
    counts = np.bincount([p.replica for p in solver.pull_log], minlength=len(solver.pushes))
    assert list(counts) == solver.pushes
    return max(leads)


def slow_down(solver: AsyncSolver, replica: int, seconds: float) -> None:
    """Make one of a replica's forward ops sleep first."""
    op = solver.workers[replica].pass_ops[0]
    inner = op.kernel

    def slow(ins, outs):
        time.sleep(seconds)
        inner(ins, outs)

    op.kernel = slow


def test_two_stale_replicas_train_lenet(mnist_dbs):
    s = lenet(mnist_dbs, batch=64, iters=600)
    s.display, s.test_interval = 100, 300
    log, lines = capture("lenet")
    solver = AsyncSolver(s, replicas=2, staleness=1, log=log)
    solver.solve()
    assert solver.iter == 600  # one solver iteration per push
    assert sum(solver.pushes) == 600 and abs(solver.pushes[0] - solver.pushes[1]) <= 2
    assert_bounded(solver, 1)
    accuracy = solver.last_test[0]["accuracy"]
    assert accuracy > 0.9, f"test accuracy {accuracy}"
    # Caffe's log lines, from the pushes, at the solver's display and test intervals
    shown = [ln for ln in lines.lines if " iter/s, " in ln]
    assert [ln.split(" (")[0] for ln in shown] == [f"Iteration {i}" for i in range(0, 600, 100)]
    assert all(", loss = " in ln for ln in shown)
    first, last = (float(ln.rsplit("= ", 1)[1]) for ln in (shown[0], shown[-1]))
    assert last < 0.5 * first
    assert "Iteration 500, lr = 0.00964069" in lines.lines  # inv policy at iteration 500
    assert [ln for ln in lines.lines if "Testing net" in ln] == [
        f"Iteration {i}, Testing net (#0)" for i in (0, 300, 600)]


@pytest.mark.parametrize("replicas", [2, 3])
def test_staleness_zero_runs_in_rounds(mnist_dbs, replicas):
    solver = AsyncSolver(lenet(mnist_dbs, batch=8, iters=10 * replicas), replicas=replicas,
                         staleness=0, log=capture("rounds")[0])
    # each replica's pull and pass at its own location, its push and the update at the server
    server = {o.location for o in solver.update_ops}
    assert len(server) == 1
    for w in solver.workers:
        assert {o.location for o in w.pull_ops + w.pass_ops} == {w.location}
        assert {o.location for o in w.push_ops} == server
    assert len({w.location for w in solver.workers} | server) == replicas + 1
    solver.solve()
    assert solver.iter == 10 * replicas
    assert solver.pushes == [10] * replicas
    assert_bounded(solver, 0)
    # a round: every replica pulls before any pulls again
    rounds = [sorted(p.replica for p in solver.pull_log[k: k + replicas])
              for k in range(0, len(solver.pull_log), replicas)]
    assert rounds == [list(range(replicas))] * 10


def test_bound_holds_against_a_slow_replica(mnist_dbs):
    solver = AsyncSolver(lenet(mnist_dbs, batch=8, iters=20), replicas=2, staleness=2,
                         log=capture("slow")[0])
    slow_down(solver, 1, 0.3)
    solver.solve()
    assert solver.iter == 20
    assert assert_bounded(solver, 2) == 2  # the fast replica reached the bound and waited
    assert 2 <= solver.pushes[0] - solver.pushes[1] <= 3
    # the fast replica's gradients are fresh, the slow one's are stale by up to S + 1 pushes
    assert solver.pushes[0] > solver.pushes[1]


@pytest.mark.parametrize("iter_size", [1, 2])
def test_one_replica_is_the_synchronous_solver(mnist_dbs, iter_size):
    """Pull, pass, push with one replica: the same ops on the same data as Solver.step."""
    s = lenet(mnist_dbs, batch=8, iters=6)
    s.iter_size = iter_size
    sync = Solver(s, log=capture("sync")[0])
    sync.step(6)
    solo = AsyncSolver(s, replicas=1, staleness=0, log=capture("solo")[0])
    solo.step(6)
    assert solo.iter == 6 and solo.pushes == [6]
    for layer, views in sync.net.params.items():
        for k, v in enumerate(views):
            np.testing.assert_array_equal(solo.net.params[layer][k].data, v.data,
                                          err_msg=f"{layer}[{k}]")
    assert list(solo.smoothed) == list(sync.smoothed)


def test_snapshots_and_resume(mnist_dbs, tmp_path):
    s = lenet(mnist_dbs, batch=8, iters=20)
    s.snapshot, s.snapshot_prefix = 10, str(tmp_path / "async")
    solver = AsyncSolver(s, replicas=2, staleness=1, log=capture("snap")[0])
    solver.solve()
    for it in (10, 20):
        assert (tmp_path / f"async_iter_{it}.caffemodel").exists()
        assert (tmp_path / f"async_iter_{it}.solverstate").exists()
    resumed = AsyncSolver(s, replicas=2, staleness=1, log=capture("resume")[0])
    resumed.restore(str(tmp_path / "async_iter_20.solverstate"))
    assert resumed.iter == 20
    for layer, views in solver.net.params.items():
        for k, v in enumerate(views):
            np.testing.assert_array_equal(resumed.net.params[layer][k].data, v.data)
    for a, b in zip(solver._history(), resumed._history(), strict=True):
        np.testing.assert_array_equal(resumed.net.dispatcher.array(b),
                                      solver.net.dispatcher.array(a))
    # the data cursors of both replicas were saved and restored
    saved = {k: o.state() for k, o in solver.state_objects().items()}
    assert {k: o.state() for k, o in resumed.state_objects().items()} == saved
    assert any(k.startswith("replica1/") for k in saved)
    resumed.step(4)
    assert resumed.iter == 24


def test_stop_request_ends_training(mnist_dbs):
    solver = AsyncSolver(lenet(mnist_dbs, batch=8, iters=50), replicas=2, staleness=1,
                         log=capture("stop")[0])
    calls = iter(range(1000))
    solver.requested = lambda: "stop" if next(calls) == 5 else "none"
    solver.solve()
    assert solver.stopped_early
    assert solver.iter == 6


@pytest.mark.parametrize("staleness", [0, 1])
def test_error_in_a_replica_is_raised(mnist_dbs, staleness):
    """With S=0 the healthy replica is soon waiting for the failed one: it must wake."""
    solver = AsyncSolver(lenet(mnist_dbs, batch=8, iters=100), replicas=2,
                         staleness=staleness, log=capture("error")[0])
    op = solver.workers[1].pass_ops[-1]
    calls = []
    inner = op.kernel

    def fail(ins, outs):
        calls.append(1)
        if len(calls) == 3:
            raise PurineError("injected failure")
        inner(ins, outs)

    op.kernel = fail
    outcome: list[BaseException] = []

    def train():
        try:
            solver.step(100)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    t = threading.Thread(target=train, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "step() hung after a replica failed"
    assert len(outcome) == 1 and isinstance(outcome[0], PurineError)
    assert f"op '{op.name}': injected failure" in str(outcome[0])
    assert solver.iter < 100  # the other replica stopped too
    assert not [t for t in threading.enumerate() if t.name.startswith("purine-async")]


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid:RuntimeWarning")
def test_divergence_is_raised(mnist_dbs):
    s = lenet(mnist_dbs, batch=8, iters=50)
    s.base_lr = 1e8
    solver = AsyncSolver(s, replicas=2, staleness=1, log=capture("diverge")[0])
    with pytest.raises(DivergenceError, match="the loss is"):
        solver.solve()
    assert solver.iter < 50


def test_trace_iteration_is_one_push(mnist_dbs, tmp_path):
    solver = AsyncSolver(lenet(mnist_dbs, batch=8, iters=10), replicas=2, staleness=0,
                         log=capture("trace")[0])
    solver.trace_iteration(tmp_path / "trace.json")
    assert solver.iter == 1 and solver.pushes == [1, 0]
    names = {e["name"] for e in json.loads((tmp_path / "trace.json").read_text())
             ["traceEvents"] if "name" in e}
    assert {"replica0/pull/conv1[0]", "replica0/push/ip2[1]", "solver/next_iter"} <= names
    solver.step(3)  # replica 1 catches up first under S=0
    assert solver.iter == 4 and solver.pull_log[1].replica == 1


def test_blas_runs_one_thread_per_replica():
    threads = _openblas_threads()  # numpy's wheels bundle OpenBLAS
    assert threads is not None
    get, set_ = threads
    before = get()
    try:
        set_(2)
        with one_blas_thread():
            assert get() == 1
        assert get() == 2
    finally:
        set_(before)


def test_bad_arguments():
    with pytest.raises(PurineError, match="staleness"):
        AsyncSolver(pb.SolverParameter(), staleness=-1)
    with pytest.raises(PurineError, match="replica"):
        AsyncSolver(pb.SolverParameter(), replicas=0)


BATCHNORM_NET = """
name: "bn"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { data_filler { type: "gaussian" std: 1 mean: 3 }
    data_filler { type: "constant" value: 0 } shape { dim: 8 dim: 4 } shape { dim: 8 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "bn" type: "BatchNorm" bottom: "ip" top: "bn" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "bn" bottom: "label" top: "loss" }
"""


def test_a_layer_whose_forward_pass_writes_its_parameters_is_refused():
    """BatchNorm's statistics would never reach the server (and each pull would reset
    them): refused before iteration 0, as over MPI."""
    from google.protobuf import text_format as tf

    s = pb.SolverParameter(base_lr=0.01, lr_policy="fixed", max_iter=10, random_seed=1)
    tf.Parse(BATCHNORM_NET, s.net_param)
    with pytest.raises(PurineError, match=r"--async cannot train layer 'bn': its forward pass "
                                          r"writes parameter 0 \(statistics\)"):
        AsyncSolver(s, replicas=2)
