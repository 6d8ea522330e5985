"""GPUs across MPI ranks, checked without a GPU: MPI ranks are threads of this process joined
by an in-process communicator, a stand-in ``cupy.cuda.nccl`` records each call and sums the
buffers it is given by address, and host arrays stand in for the GPUs' (running it on GPUs:
tests/gpu/test_mpi_nccl.py)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

import purine.parallel.nccl as nccl_module
import purine.runtime.memory as memory_module
from purine.backend import gpu_unavailable
from purine.caffe.solver import Solver
from purine.cli import main
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import parse_text
from purine.graph import Location
from purine.parallel import build_solver, mpi
from purine.parallel.nccl import NcclGroup
from tests.parallel import test_mpi
from tests.test_cli import NET

launcher = test_mpi.launcher  # the fixture, shared
GPU0, GPU1 = Location("gpu", 0), Location("gpu", 1)
PARAMS = ["conv[0]", "conv[1]", "ip[0]", "ip[1]"]
BACKWARD = ["ip[0]", "ip[1]", "conv[0]", "conv[1]"]  # the order backward writes gradients
ME = threading.local()  # the simulated MPI rank of the running thread
TIMEOUT = 30  # seconds a simulated collective waits for the others before failing


# Rank k works in tmp/rank<k>, its stderr there; $GPUS_PER_RANK > 0 shows rank k only its
# GPUs k*G .. k*G+G-1 (so every rank's --gpu 0,1 names other GPUs).
PER_RANK = ('r="${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-$PMIX_RANK}}"; g="$GPUS_PER_RANK"; '
            'if [ "$g" -gt 0 ]; then CUDA_VISIBLE_DEVICES=$(seq -s, $((r*g)) $((r*g+g-1))); '
            'export CUDA_VISIBLE_DEVICES; fi; cd "$0/rank$r" && exec "$@" 2> stderr.txt')


def launch(launcher: str, tmp, ranks: int, gpus_per_rank: int, *args: str):
    """``purine-caffe train ARGS`` on ``ranks`` ranks, each shown its ``gpus_per_rank``
    GPUs: (return code, each rank's stderr)."""
    run, logs = test_mpi.launch(launcher, tmp, ranks, *args, per_rank=PER_RANK,
                                env={"GPUS_PER_RANK": str(gpus_per_rank)}, timeout=300)
    return run.returncode, logs


def run_at_once(ranks: list[int], fns: list[Callable[[], object]]) -> list:
    """Each ``fns[i]()`` on its own thread, as simulated rank ``ranks[i]``, all at once as
    MPI ranks (or one rank's GPUs) run; returns the results, or the exceptions raised."""
    out: list = [None] * len(fns)

    def run(i: int) -> None:
        ME.rank = ranks[i]
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 -- handed to the test to assert on
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    return out


def run_ranks(size: int, fn: Callable[[int], object]) -> list:
    """``fn(k)`` for ranks k = 0..size-1 at once."""
    return run_at_once(list(range(size)), [lambda k=k: fn(k) for k in range(size)])


class Rendezvous:
    """Where ``size`` parties meet for each collective: every party deposits its part, all
    wait, each reads all parts, all wait again."""

    def __init__(self, size: int):
        self.parts: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT)

    def exchange(self, k: int, part: object) -> list:
        self.parts[k] = part
        self.barrier.wait()
        everything = list(self.parts)
        self.barrier.wait()
        return everything


class World:
    """An MPI job of ``size`` ranks in one process (mpi4py's calls that purine makes)."""

    def __init__(self, size: int):
        self.size, self.meeting = size, Rendezvous(size)
        self.calls: list[tuple[int, str]] = []

    def comm(self, rank: int) -> Comm:
        return Comm(self, rank)


class Comm:
    def __init__(self, world: World, rank: int):
        self.world, self.rank, self.size = world, rank, world.size

    def _meet(self, name: str, part: object) -> list:
        self.world.calls.append((self.rank, name))
        return self.world.meeting.exchange(self.rank, part)

    def allgather(self, value):
        return self._meet("allgather", value)

    def Iallgather(self, mine, table):
        table[...] = np.stack(self._meet("Iallgather", np.array(mine)))
        return SimpleNamespace(Test=lambda: True)

    def bcast(self, value, root):
        return self._meet("bcast", value)[root]

    def Bcast(self, array, root):
        array[...] = self._meet("Bcast", array.copy())[root]


class FakeNccl:
    """The part of ``cupy.cuda.nccl`` purine calls: each call recorded with the simulated
    rank that made it; collectives sum the buffers of every NCCL rank, found by address."""

    available = True
    NCCL_FLOAT32, NCCL_FLOAT64, NCCL_SUM = 7, 8, 0
    DTYPES = {7: np.float32, 8: np.float64}

    def __init__(self):
        self.calls: list[tuple] = []
        self.cliques: dict[tuple, Rendezvous] = {}
        self.lock = threading.Lock()
        self.ids = 0
        nccl = self

        class NcclCommunicator:
            def __init__(self, nranks, uid, rank):
                nccl.record("NcclCommunicator", nranks, uid, rank)
                with nccl.lock:
                    self.clique = nccl.cliques.setdefault(uid, Rendezvous(nranks))
                self.rank = rank

            def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
                nccl.record("allReduce", self.rank, count, datatype, op, stream)
                assert sendbuf == recvbuf  # in place
                buf = nccl.view(recvbuf, count, datatype)
                parts = self.clique.exchange(self.rank, (count, datatype, op, buf.copy()))
                assert {p[:3] for p in parts} == {(count, datatype, op)}, parts
                total = parts[0][3].copy()
                for p in parts[1:]:  # summed in NCCL rank order
                    total += p[3]
                buf[...] = total

        self.NcclCommunicator = NcclCommunicator

    def record(self, *call) -> None:
        with self.lock:
            self.calls.append((getattr(ME, "rank", None), *call))

    @staticmethod
    def view(address: int, count: int, datatype: int) -> np.ndarray:
        dtype = np.dtype(FakeNccl.DTYPES[datatype])
        raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
        return np.frombuffer(raw, dtype)

    def get_unique_id(self):
        self.record("get_unique_id")
        self.ids += 1
        return (self.ids, 42, 7)  # a tuple of ints, as CuPy's

    def groupStart(self):
        self.record("groupStart")

    def groupEnd(self):
        self.record("groupEnd")


class FakeCuda:
    """CuPy's calls for NCCL: the GPUs of simulated rank k are on machine ``node<k>``
    unless ``one_machine``; the stream handle is 1000 + the current device."""

    def __init__(self, nccl: FakeNccl, one_machine: bool = False):
        self._nccl, self.one_machine = nccl, one_machine
        self.current = threading.local()

    def nccl(self):
        return self._nccl

    @contextmanager
    def device(self, index):
        self._nccl.record("device", index)
        before = getattr(self.current, "device", 0)
        self.current.device = index
        try:
            yield
        finally:
            self.current.device = before

    def stream(self) -> int:
        return 1000 + getattr(self.current, "device", 0)

    def gpu_id(self, index: int) -> str:
        return f"node{0 if self.one_machine else ME.rank}/0000:{index + 1:02x}:00.0"


@pytest.fixture
def nccl(monkeypatch) -> FakeNccl:
    fake = FakeNccl()
    monkeypatch.setattr(nccl_module, "CUDA", FakeCuda(fake))
    return fake


@pytest.fixture
def host_memory(monkeypatch):
    monkeypatch.setattr(memory_module, "allocate",
                        lambda loc, shape, dtype: np.zeros(shape, dtype))


def solver_param() -> pb.SolverParameter:
    return parse_text(f'net_param {{ {NET} }} base_lr: 0.1 momentum: 0.9 lr_policy: "fixed" '
                      "max_iter: 2 random_seed: 1", pb.SolverParameter())


def by_rank(calls: list[tuple], rank: int, *names: str) -> list[tuple]:
    return [c[1:] for c in calls if c[0] == rank and c[1] in names]


# -- the bootstrap ------------------------------------------------------------------------------
def test_rank0_makes_the_id_and_every_rank_joins_its_gpus_as_k_times_g_plus_j(nccl):
    world = World(2)
    groups = run_ranks(2, lambda k: NcclGroup([0, 1], world.comm(k)))
    assert all(isinstance(g, NcclGroup) for g in groups), groups
    uid = (1, 42, 7)
    assert by_rank(nccl.calls, 0, "get_unique_id") == [("get_unique_id",)]
    assert by_rank(nccl.calls, 1, "get_unique_id") == []
    assert [g.uid for g in groups] == [uid, uid]
    assert [(g.first, g.size, g.across_ranks) for g in groups] == [(0, 4, True), (2, 4, True)]
    # the MPI part: one allgather (the GPUs), one bcast (the id), on each rank
    assert sorted(world.calls) == [(0, "allgather"), (0, "bcast"), (1, "allgather"),
                                   (1, "bcast")]

    for k, g in enumerate(groups):  # made on first use, by whichever GPU's op comes first
        ME.rank = k
        assert g.comm(1) is not g.comm(0)
    del ME.rank
    init = ("groupStart", "device", "NcclCommunicator", "groupEnd")
    for k in (0, 1):
        assert by_rank(nccl.calls, k, *init) == [
            ("groupStart",),
            ("device", 0), ("NcclCommunicator", 4, uid, 2 * k),
            ("device", 1), ("NcclCommunicator", 4, uid, 2 * k + 1),
            ("groupEnd",)]


def test_ranks_with_unequal_gpu_counts_are_refused_on_every_rank(nccl):
    world = World(3)
    errors = run_ranks(3, lambda k: NcclGroup([0, 1] if k != 1 else [0], world.comm(k)))
    message = ("NCCL across MPI ranks needs the same number of GPUs on every rank: rank 0 has "
               "2, rank 1 has 1")
    assert [str(e) for e in errors] == [message] * 3
    assert all(isinstance(e, PurineError) for e in errors)
    assert not by_rank(nccl.calls, 0, "get_unique_id")  # refused before the id


def test_two_ranks_on_one_gpu_are_refused(monkeypatch, nccl):
    monkeypatch.setattr(nccl_module, "CUDA", FakeCuda(nccl, one_machine=True))
    world = World(2)
    errors = run_ranks(2, lambda k: NcclGroup([0], world.comm(k)))
    assert [str(e) for e in errors] == [
        "NCCL cannot share a GPU between ranks: node0/0000:01:00.0 is local GPU 0 of rank 0 "
        "and GPU 0 of rank 1; give each rank its own (--gpu local)"] * 2


def test_one_process_keeps_ncclcommunicator_initall(nccl):
    calls = []
    nccl.NcclCommunicator.initAll = staticmethod(lambda devices: calls.append(devices)
                                                 or ["c0", "c1"])
    g = NcclGroup([0, 1])
    assert (g.uid, g.first, g.size, g.across_ranks) == (None, 0, 2, False)
    assert (g.comm(0), g.comm(1)) == ("c0", "c1")
    assert calls == [[0, 1]] and nccl.calls == []  # no id, no group: NCCL's own clique


# -- the graph as built -------------------------------------------------------------------------
def build_ranks(world: World, **kw) -> list[Solver]:
    solvers = run_ranks(world.size, lambda k: build_solver(solver_param(), comm=world.comm(k),
                                                           **kw))
    assert all(isinstance(s, Solver) for s in solvers), solvers
    return solvers


def nccl_ops(s: Solver, j: int) -> list:
    return [o for o in s.scheme.pass_ops if o.name.startswith(f"nccl/all_reduce{j}/")]


def test_two_ranks_of_two_gpus_all_reduce_every_gradient_in_backward_order(nccl, host_memory):
    world = World(2)
    solvers = build_ranks(world, location=GPU0, replicas=2, replica_locations=[GPU1])
    for s in solvers:
        ops = s.scheme.replicas.reduce_ops
        assert {o.type for o in ops} == {"NcclAllReduceMean"}
        assert s.scheme.mpi.ops == []  # no MPI exchange: NCCL spans the ranks
        for j, gpu in enumerate((0, 1)):
            chain = nccl_ops(s, j)
            assert [o.name for o in chain] == [f"nccl/all_reduce{j}/{p}" for p in BACKWARD]
            # GPU 0's ops at the solver's stream of GPU 0, GPU 1's on that stream of GPU 1
            assert {o.location for o in chain} == {Location("gpu", gpu, 2)}
            deps = s.net.graph.dependencies(chain)
            for prev, op in zip(chain, chain[1:]):
                assert prev in deps[op]  # one chain per GPU, through its token
            grads = [o.inputs[0].name for o in chain]
            want = [f"{'replica1/' if j else ''}{p}@diff" for p in BACKWARD]
            assert grads == want
        update = [o for o in s.update_ops if o.name.endswith("/update")]
        assert {o.location for o in update} == {Location("gpu", 0, 2)}
        deps = s.net.graph.dependencies(s.pass_ops() + s.update_ops)
        for name in PARAMS:  # an update waits for its gradient's all-reduce on GPU 0
            reduce = next(o for o in ops if o.name == f"nccl/all_reduce0/{name}")
            prepare = next(o for o in s.update_ops if o.name == f"solver/{name}/prepare")
            assert reduce in deps[prepare]
    # every rank starts from rank 0's weights (its own fillers drew its replica's)
    for w0, w1 in zip(solvers[0].net.builder.learnable_params,
                      solvers[1].net.builder.learnable_params, strict=True):
        np.testing.assert_array_equal(solvers[1].net.dispatcher.array(w1),
                                      solvers[0].net.dispatcher.array(w0))
    assert [s.scheme.first for s in solvers] == [0, 2]


def test_two_ranks_of_one_gpu_all_reduce_at_the_update_stream(nccl, host_memory):
    world = World(2)
    solvers = build_ranks(world, location=GPU0)
    for s in solvers:
        chain = nccl_ops(s, 0)
        assert [o.name for o in chain] == [f"nccl/all_reduce0/{p}" for p in BACKWARD]
        assert {o.location for o in chain} == {Location("gpu", 0, 1)} == {s.scheme.server}
        assert s.scheme.replicas is None and s.scheme.mpi.ops == []


def test_replicas_sharing_a_gpu_take_their_mean_then_go_across(nccl, host_memory):
    world = World(2)
    solvers = build_ranks(world, location=GPU0, replicas=2)
    for s in solvers:
        ops = s.scheme.replicas.reduce_ops
        local = [o for o in ops if o.type == "AllReduceMean"]
        across = [o for o in ops if o.type == "NcclAllReduceMean"]
        assert [o.name for o in across] == [f"nccl/all_reduce0/{p}" for p in BACKWARD]
        deps = s.net.graph.dependencies(ops)
        for op in across:  # each after its parameter's local mean
            name = op.name.rsplit("/", 1)[1]
            assert next(o for o in local if o.name == f"all_reduce/{name}") in deps[op]


def test_replicas_spread_unevenly_over_gpus_are_refused_across_ranks(nccl, host_memory):
    world = World(2)
    errors = run_ranks(2, lambda k: build_solver(
        solver_param(), comm=world.comm(k), location=GPU0, replicas=3,
        replica_locations=[Location("gpu", 0, 1), GPU1]))
    assert [str(e) for e in errors] == [
        "GPUs across MPI ranks need each replica on its own GPU or all on one; got "
        "gpu:0/t0, gpu:0/t1, gpu:1/t0"] * 2


# -- the collectives as they run ----------------------------------------------------------------
def test_two_ranks_of_two_gpus_give_every_rank_the_mean_in_the_same_order(nccl, host_memory):
    """Each (rank, GPU) runs its chain of ops on its own thread, with the gradients of four
    replicas; the stand-in sums by address as NCCL does."""
    world = World(2)
    solvers = build_ranks(world, location=GPU0, replicas=2, replica_locations=[GPU1])
    rng = np.random.default_rng(3)
    grads = {}  # (global replica, param) -> its gradient
    for k, s in enumerate(solvers):
        for j in (0, 1):
            for op in nccl_ops(s, j):
                g = rng.standard_normal(op.inputs[0].shape).astype("float32")
                s.net.dispatcher.array(op.inputs[0])[...] = g
                grads[2 * k + j, op.name.rsplit("/", 1)[1]] = g

    def run_chain(s: Solver, j: int) -> None:
        array = s.net.dispatcher.array
        for op in nccl_ops(s, j):  # the dispatcher makes the op's GPU current
            with nccl_module.CUDA.device(op.location.index):
                op.kernel([array(b) for b in op.inputs], [array(b) for b in op.outputs])

    pairs = [(k, j) for k in (0, 1) for j in (0, 1)]
    assert run_at_once([k for k, _ in pairs], [lambda k=k, j=j: run_chain(solvers[k], j)
                                               for k, j in pairs]) == [None] * 4

    for k, s in enumerate(solvers):
        for op in nccl_ops(s, 0):
            name = op.name.rsplit("/", 1)[1]
            total = grads[0, name] + grads[1, name] + grads[2, name] + grads[3, name]
            np.testing.assert_allclose(s.net.dispatcher.array(op.inputs[0]), total / 4,
                                       rtol=1e-6, err_msg=f"rank {k} {name}")
            np.testing.assert_allclose(total / 4, np.mean([grads[r, name] for r in range(4)],
                                                          axis=0), rtol=1e-6)
        for op in nccl_ops(s, 1):  # the second GPU holds the sum, which nothing reads
            name = op.name.rsplit("/", 1)[1]
            np.testing.assert_allclose(s.net.dispatcher.array(op.inputs[0]),
                                       sum(grads[r, name] for r in range(4)), rtol=1e-6)
    # every GPU issued the same collectives in the same order, on its own stream
    sizes = {"conv[0]": 4 * 9, "conv[1]": 4, "ip[0]": 3 * 16, "ip[1]": 3}
    for k in (0, 1):
        for j in (0, 1):
            issued = [c[1:] for c in by_rank(nccl.calls, k, "allReduce") if c[1] == 2 * k + j]
            assert issued == [(2 * k + j, sizes[p], 7, 0, 1000 + j) for p in BACKWARD]


# -- the command line ---------------------------------------------------------------------------
def test_gpu_local_without_mpi_is_refused(tmp_path, capsys, monkeypatch):
    for name in mpi.LAUNCHER_SIZE_ENV:
        monkeypatch.delenv(name, raising=False)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net_param {{ {NET} }} base_lr: 0.1 lr_policy: "fixed" max_iter: 1')
    assert main(["train", "--solver", str(solver), "--gpu", "local"]) == 1
    assert ("--gpu local gives each MPI rank one GPU by its rank on its machine; launch with "
            "mpirun, or give GPU ids") in capsys.readouterr().err


def test_ranks_must_agree_on_their_gpu_count():
    world = World(3)
    errors = run_ranks(3, lambda k: mpi.same_on_every_rank(world.comm(k), [1, 1, 0][k],
                                                           "the number of GPUs (--gpu)"))
    assert [str(e) for e in errors] == [
        "the number of GPUs (--gpu) must be the same on every MPI rank: rank 0 has 1, "
        "rank 2 has 0"] * 3
    world = World(2)
    assert run_ranks(2, lambda k: mpi.same_on_every_rank(world.comm(k), 2, "x")) == [None] * 2


def test_local_rank_is_the_rank_among_those_on_its_machine(monkeypatch):
    machines = ["a", "b", "a", "b", "a"]  # ranks 0..4 dealt round robin to two machines
    monkeypatch.setattr(mpi, "_mpi", lambda: SimpleNamespace(
        Get_processor_name=lambda: machines[ME.rank]))
    world = World(5)
    assert run_ranks(5, lambda k: mpi.local_rank(world.comm(k))) == [0, 0, 1, 1, 2]


def test_gpu_local_under_mpirun_asks_every_rank_then_says_why_not(launcher, tmp_path):
    if gpu_unavailable() is None:
        pytest.skip("this machine has a GPU: tests/gpu/test_mpi_nccl.py trains with --gpu local")
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net_param {{ {NET} }} base_lr: 0.1 lr_policy: "fixed" max_iter: 1')
    rc, logs = launch(launcher, tmp_path, 2, 0, "--solver", str(solver), "--gpu", "local")
    assert rc != 0
    said = [line for log in logs for line in log.splitlines() if "--gpu local: " in line]
    assert said and all(line.endswith(f"--gpu local: {gpu_unavailable()}; run without --gpu "
                                      "to use the CPU") for line in said), logs
