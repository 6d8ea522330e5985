"""Downpour across MPI processes: `mpiexec -n 3 purine-caffe train --async S` trains LeNet
with a server and two workers, goes on when a worker is killed, and exits 0 on the
surviving ranks; the server withholds weights from a worker more than S pushes ahead of the
slowest live one and drops a silent one; a worker whose server dies (killed at several
moments, or its MPI calls failing) leaves in one line; bad combinations are refused in one
line."""

import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from google.protobuf import text_format

from purine.caffe import TEST, Net
from purine.cli import main
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.parallel import mpi, mpi_async
from purine.parallel.mpi_async import BEAT, GRADS, PULL, WEIGHTS, MpiServer, MpiWorker
from tests.parallel.test_async import capture, lenet, mnist_dbs  # noqa: F401 -- a fixture
from tests.parallel.test_mpi import ROOT, launcher  # noqa: F401 -- a fixture

# Rank k runs in tmp/rank<k> in a session of its own (Hydra kills the other ranks' process
# groups when one dies), its stderr and then its exit code there.
PER_RANK = ('cd "$0/rank${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-$PMIX_RANK}}" && '
            '"$@" 2> stderr.txt; echo $? > rc')


def accuracy(model: str, dbs) -> float:
    net = Net(lenet(dbs, batch=64, iters=1).net_param, phase=TEST)
    net.copy_from(model)
    return float(np.mean([float(net.forward()["accuracy"]) for _ in range(10)]))


def test_a_killed_worker_is_dropped_and_the_job_finishes(launcher, tmp_path,  # noqa: F811
                                                         mnist_dbs):  # noqa: F811
    if shutil.which("setsid") is None:
        pytest.skip("no setsid (util-linux): a rank cannot outlive another's death")
    s = lenet(mnist_dbs, batch=64, iters=400)
    s.display, s.snapshot_after_train = 20, True
    s.snapshot_prefix = str(tmp_path / "lenet")
    (tmp_path / "solver.prototxt").write_text(text_format.MessageToString(s))
    for k in range(3):
        (tmp_path / f"rank{k}").mkdir()
    # Three ranks share the cores: with OpenBLAS's default threads per rank they contend
    # (about 6 times slower here).
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OPENBLAS_NUM_THREADS="1")
    cmd = [launcher, "-n", "3", "setsid", "-w", "sh", "-c", PER_RANK, str(tmp_path),
           sys.executable, "-m", "purine.cli", "train", "--solver",
           str(tmp_path / "solver.prototxt"), "--async", "1", "--heartbeat", "3"]
    job = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, env=env, text=True)
    server, victim = tmp_path / "rank0" / "stderr.txt", tmp_path / "rank2" / "stderr.txt"
    try:
        deadline = time.monotonic() + 90
        while not (server.exists() and "] Iteration 60 (" in server.read_text()):
            assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()
            time.sleep(0.1)
        pid = int(re.search(r"worker rank 2 \(pid (\d+)\) started", victim.read_text())[1])
        os.kill(pid, signal.SIGKILL)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    # mpiexec itself reports the killed rank (MPICH: exit code 9); the ranks' own codes:
    codes = [(tmp_path / f"rank{k}" / "rc").read_text().strip() for k in range(3)]
    log = server.read_text()
    assert codes == ["0", "0", str(128 + signal.SIGKILL)], (codes, log)
    lost = [ln for ln in log.splitlines() if " lost " in ln]
    # killed between messages, or in the middle of one (its transfer fails)
    assert len(lost) == 1 and re.search(
        r"\] worker rank 2 lost \((no message for 3s|its message did not arrive within 3s)\); "
        r"training continues with 1 worker$", lost[0]), lost
    assert "Optimization Done." in log
    assert re.search(r"worker rank 1 \(pid \d+\) exits: the server finished, after \d+ pushes",
                     (tmp_path / "rank1" / "stderr.txt").read_text())
    assert not re.search(r"^I\d{4} ", (tmp_path / "rank1" / "stderr.txt").read_text(), re.M)
    assert accuracy(str(tmp_path / "lenet_iter_400.caffemodel"), mnist_dbs) > 0.93


def test_resume_from_the_servers_snapshot(launcher, tmp_path, mnist_dbs):  # noqa: F811
    s = lenet(mnist_dbs, batch=8, iters=20)
    s.snapshot, s.snapshot_prefix = 20, str(tmp_path / "lenet")
    solver = tmp_path / "solver.prototxt"
    solver.write_text(text_format.MessageToString(s))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OPENBLAS_NUM_THREADS="1")
    train = [launcher, "-n", "2", sys.executable, "-m", "purine.cli", "train", "--solver",
             str(solver), "--async", "0"]
    for extra in ([], ["--iterations", "40", "--snapshot", f"{s.snapshot_prefix}_iter_20"
                                                          ".solverstate"]):
        run = subprocess.run(train + extra, capture_output=True, text=True, timeout=120,
                             env=env, stdin=subprocess.DEVNULL)
        # no rank lost: every rank finalizes MPI and mpiexec exits 0 too
        assert run.returncode == 0, run.stderr
    assert "Restoring previous solver status from" in run.stderr
    assert re.search(r"worker rank 1 \(pid \d+\) exits: the server finished, after 20 "
                     "pushes of this worker", run.stderr)
    state = pb.SolverState.FromString((tmp_path / "lenet_iter_40.solverstate").read_bytes())
    assert state.iter == 40


# -- the server's decisions, against scripted workers --------------------------------------
class Comm:
    size = 3


class ScriptedLink:
    """The server's messages, with workers that answer each weights message at once with a
    gradients message and a new pull, except ranks in ``silent``, which fall silent after
    their first pull. The answering ones send heartbeats too."""

    def __init__(self, grads: int, silent: set[int], heartbeat_every: float = 0.02):
        self.grads, self.silent, self.every = grads, silent, heartbeat_every
        self.peers = [1, 2]
        self.seen = dict.fromkeys(self.peers, time.monotonic())
        self.inbox = [(1, PULL), (2, PULL)]
        self.sent: list[tuple[int, int]] = []
        self.last_beat = time.monotonic()

    def send(self, dest, tag, array):
        self.sent.append((dest, tag))
        if tag == WEIGHTS and dest not in self.silent:
            self.inbox += [(dest, GRADS), (dest, PULL)]

    def next_message(self):
        now = time.monotonic()
        if not self.inbox and now - self.last_beat > self.every:
            self.last_beat = now
            self.inbox = [(k, BEAT) for k in self.peers if k not in self.silent]
        if not self.inbox:
            return None
        source, tag = self.inbox.pop(0)
        self.seen[source] = now
        return source, tag, None, self.grads if tag == GRADS else 1

    def receive(self, msg, count, timeout):
        values = np.zeros(count)
        values[0] = 2.3 if count > 1 else 0  # the loss
        return values

    def stop_beats(self):
        pass

    def close(self, linger=1.0):
        pass


def scripted_server(dbs, iters: int, silent: set[int], staleness: int = 1):
    log, lines = capture("mpi_async")
    s = lenet(dbs, batch=8, iters=iters)
    server = MpiServer(s, comm=Comm(), staleness=staleness, heartbeat=0.5, log=log)
    server.link = ScriptedLink(server.sizes.grads, silent)
    return server, lines


def test_the_bound_holds_until_a_silent_worker_is_dropped(mnist_dbs):  # noqa: F811
    server, lines = scripted_server(mnist_dbs, iters=12, silent={2})
    lost_at = []  # how many pulls there were when rank 2 was dropped
    drop = server._lose
    server._lose = lambda r, why, run: (lost_at.append(len(server.pull_log)),
                                        drop(r, why, run))
    t0 = time.monotonic()
    server.step(12)
    assert time.monotonic() - t0 >= 0.5  # rank 1 waited for the heartbeat timeout
    assert server.iter == 12 and server.pushes == [12, 0] and server.live == {0}
    # rank 2 pulled once and never pushed: rank 1 pulled while at most 1 push ahead, then
    # (pushes 2 and 0) waited until rank 2 was dropped
    assert [(p.replica, p.pushes) for p in server.pull_log[:4]] == [
        (0, (0, 0)), (1, (0, 0)), (0, (1, 0)), (0, (2, 0))]
    assert [ln for ln in lines.lines if " lost " in ln] == [
        "worker rank 2 lost (no message for 0.5s); training continues with 1 worker"]
    assert lost_at == [3]
    assert all(p.pushes[p.replica] - min(p.pushes) <= 1 for p in server.pull_log[:3])


def test_two_answering_workers_stay_within_the_bound(mnist_dbs):  # noqa: F811
    server, lines = scripted_server(mnist_dbs, iters=20, silent=set(), staleness=0)
    server.step(20)
    assert server.pushes == [10, 10] and not [ln for ln in lines.lines if " lost " in ln]
    leads = [p.pushes[p.replica] - min(p.pushes) for p in server.pull_log]
    assert max(leads) == 0 and len(server.pull_log) == 20


def test_losing_every_worker_is_an_error(mnist_dbs):  # noqa: F811
    server, _ = scripted_server(mnist_dbs, iters=5, silent={1, 2})
    with pytest.raises(PurineError) as e:
        server.step(5)
    assert str(e.value) == ("every worker was lost (the last, rank 2: no message for 0.5s); "
                            "training stopped at iteration 0 (the last snapshot is intact)")


class SilentServer:
    def __init__(self):
        self.seen = {0: time.monotonic()}

    def next_message(self):
        return None


def test_a_worker_stops_when_the_server_falls_silent():
    worker = MpiWorker.__new__(MpiWorker)  # its wait alone: no net needed
    worker.heartbeat = 0.2
    with pytest.raises(PurineError, match=r"^the server \(rank 0\) sent nothing for more "
                                          r"than 0.2s \(--heartbeat\); this worker stops$"):
        worker._wait(SilentServer(), (WEIGHTS,))


# -- refusals --------------------------------------------------------------------------------
class Rank0Of3:
    rank, size = 0, 3

    def Iallgather(self, mine, table):  # every rank gives what this one gives
        table[...] = mine
        return SimpleNamespace(Test=lambda: True)

    def Abort(self, code):
        raise SystemExit(code)


@pytest.mark.parametrize("extra, message", [
    (["--replicas", "2"], "--async under MPI runs one worker per rank: drop --replicas and "
                          "start more ranks"),
    (["--trace", "t.json"], "--trace with --async under MPI is not supported: the workers' "
                            "passes run in other processes"),
    (["--heartbeat", "0"], None),
])
def test_bad_combinations_are_refused(monkeypatch, capsys, tmp_path, mnist_dbs,  # noqa: F811
                                      extra, message):
    monkeypatch.setattr(mpi, "world", lambda requested=None: Rank0Of3())
    monkeypatch.setattr(mpi, "share_cores", lambda comm: None)  # a pretend job: no machine
    solver = tmp_path / "solver.prototxt"
    solver.write_text(text_format.MessageToString(lenet(mnist_dbs, batch=8, iters=1)))
    with pytest.raises(SystemExit) as e:
        main(["train", "--solver", str(solver), "--async", "1", *extra])
    err = capsys.readouterr().err
    if message is None:  # argparse's own line
        assert e.value.code == 2
        assert "argument -heartbeat/--heartbeat: expected an integer from 1 to 86400 " \
               "(seconds), got 0" in err, err
    else:
        assert e.value.code == 1
        assert err.strip().splitlines()[-1] == f"purine-caffe train (rank 0): {message}"


# -- the server's death ----------------------------------------------------------------------
class FakeMpiError(Exception):
    """Stands for mpi4py's MPI.Exception (importing mpi4py here would initialize MPI)."""


# What MPICH said when a worker read a weights message from a server that had just died
STACK = ("Other MPI error, error stack:\ninternal_Test(81)......: MPI_Test(request=0x7ffd, "
         "flag=0x7ffd, status=0x1) failed\nMPIDI_CMA_copy(42).....: process_vm_readv failed")


class FailingComm:
    """A communicator whose point-to-point calls fail as MPICH's do once the peer died."""

    def Isend(self, array, dest, tag):  # noqa: N802 -- mpi4py's names
        raise FakeMpiError(STACK)

    def improbe(self, source, tag, status):
        raise FakeMpiError(STACK)


class FailingMessage:
    def Irecv(self, buf):  # noqa: N802
        raise FakeMpiError(STACK)


class FailingRequest:
    def Test(self):  # noqa: N802
        raise FakeMpiError(STACK)


def failing_link():
    link = mpi_async.Link.__new__(mpi_async.Link)  # its calls alone: no MPI
    link.MPI = SimpleNamespace(Exception=FakeMpiError, Status=object, ANY_SOURCE=-1,
                               ANY_TAG=-1)
    link.comm, link.dtype = FailingComm(), np.dtype(np.float32)
    link._lock, link._sending, link._abandoned = threading.Lock(), [], []
    link.seen = {0: time.monotonic()}
    return link


def test_mpi_errors_of_a_dead_peer_are_translated_where_the_link_calls_mpi():
    link = failing_link()
    link.send(0, PULL, np.zeros(1))  # refused: the peer's silence decides
    assert link._sending == []
    assert link.receive(FailingMessage(), 4, timeout=1.0) is None  # a lost message
    link._sending = [(FailingRequest(), np.zeros(1))]
    assert link._done(FailingRequest())
    with pytest.raises(mpi_async.LinkError) as e:
        link.next_message()
    assert str(e.value) == ("MPI failed while looking for messages: Other MPI error "
                            "(MPIDI_CMA_copy(42).....: process_vm_readv failed)")


def test_a_worker_whose_link_fails_stops_in_one_line():
    worker = MpiWorker.__new__(MpiWorker)
    worker.heartbeat = 5.0
    with pytest.raises(PurineError) as e:
        worker._wait(failing_link(), (WEIGHTS,))
    assert str(e.value) == (
        "the link to the server (rank 0) failed (MPI failed while looking for messages: "
        "Other MPI error (MPIDI_CMA_copy(42).....: process_vm_readv failed)); this worker "
        "stops")


def test_an_mpi_error_elsewhere_is_described_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", SimpleNamespace(Exception=FakeMpiError))
    assert mpi_async._describe(FakeMpiError(STACK)) == (
        "MPI failed: Other MPI error (MPIDI_CMA_copy(42).....: process_vm_readv failed)")
    assert mpi_async.mpi_line(FakeMpiError("Other MPI error")) == "Other MPI error"


# Each rank in tmp/rank<k>, in a session of its own so that Hydra's kill of the dead rank's
# job does not reach it; its pid, stderr and exit code there.
PER_RANK_PID = ('cd "$0/rank${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-$PMIX_RANK}}" && '
                '{ "$@" 2> stderr.txt & echo $! > pid; wait $!; echo $? > rc; }')
WORKER_LINE = re.compile(r"^purine-caffe train \(rank 1\): worker rank 1 \(pid \d+\) exits: ")


def _wait_for(path, text: str, job, deadline: float) -> None:
    while not (path.exists() and text in path.read_text()):
        assert job.poll() is None and time.monotonic() < deadline, (text, job.stdout.read())
        time.sleep(0.02)


STARTING_LINE = re.compile(r"^purine-caffe train \(rank 1\): the server \(rank 0\) sent "
                           r"nothing for more than 1s while starting \(--heartbeat\); this "
                           r"worker stops$")


@pytest.mark.parametrize("moment", ["Initializing solver", None, "Iteration 5 (",
                                    "Iteration 25 ("])
def test_a_worker_leaves_in_one_line_when_the_server_dies(launcher, tmp_path,  # noqa: F811
                                                          mnist_dbs, moment):  # noqa: F811
    if shutil.which("setsid") is None:
        pytest.skip("no setsid (util-linux): a rank cannot outlive another's death")
    s = lenet(mnist_dbs, batch=64, iters=100000)
    s.display = 5
    (tmp_path / "solver.prototxt").write_text(text_format.MessageToString(s))
    for k in range(2):
        (tmp_path / f"rank{k}").mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OPENBLAS_NUM_THREADS="1")
    cmd = [launcher, "-n", "2", "setsid", "-w", "sh", "-c", PER_RANK_PID, str(tmp_path),
           sys.executable, "-m", "purine.cli", "train", "--solver",
           str(tmp_path / "solver.prototxt"), "--async", "1", "--heartbeat", "1"]
    job = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, env=env, text=True)
    server, worker = tmp_path / "rank0", tmp_path / "rank1"
    try:
        deadline = time.monotonic() + 60
        if moment != "Initializing solver":  # else while the server builds its net
            _wait_for(worker / "stderr.txt", "started", job, deadline)
        if moment is not None:
            _wait_for(server / "stderr.txt", moment, job, deadline)
        os.kill(int((server / "pid").read_text()), signal.SIGKILL)
        _wait_for(worker / "rc", "\n", job, deadline)
    finally:
        for rank in (server, worker):  # outside the launcher's reach
            if not (rank / "rc").exists() and (rank / "pid").exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int((rank / "pid").read_text()), signal.SIGKILL)
        if job.poll() is None:
            job.kill()
    err = (worker / "stderr.txt").read_text()
    lines = err.splitlines()
    assert (worker / "rc").read_text().strip() == "1"
    if moment == "Initializing solver":  # killed while it builds: the worker's one line
        if len(lines) == 2 and "started" in lines[0]:
            pytest.skip("the server had finished starting when the kill landed")
        assert len(lines) == 1 and STARTING_LINE.match(lines[0]), err
        return
    # its start and its exit, nothing of MPI's or Python's between or after
    assert len(lines) == 2 and WORKER_LINE.match(lines[-1]), err
    assert lines[0].startswith("purine-caffe train (rank 1): worker rank 1 (pid "), err


# -- the start-up handshake, in threads with queue-backed links ---------------------------
class QueueLinks:
    """The links of a job of ``size`` ranks in one process: each rank's inbox a queue; the
    ranks in ``alive`` are heard from all the time (their heartbeats), the others never."""

    def __init__(self, size: int, alive: set[int]):
        self.inbox = {k: queue.Queue() for k in range(size)}
        self.alive = alive

    def link(self, rank: int, size: int):
        return QueueLink(self, rank, size)


class QueueLink:
    def __init__(self, links: QueueLinks, rank: int, size: int):
        self.links, self.comm = links, SimpleNamespace(rank=rank, size=size)
        peers = list(range(1, size)) if rank == 0 else [0]
        self.seen = dict.fromkeys(peers, time.monotonic())

    def send(self, dest, tag, array):
        self.links.inbox[dest].put((self.comm.rank, tag, np.asarray(array, np.float64)))

    def next_message(self):
        try:
            source, tag, values = self.links.inbox[self.comm.rank].get_nowait()
        except queue.Empty:
            now = time.monotonic()
            self.seen.update({k: now for k in self.seen if k in self.links.alive})
            return None
        self.seen[source] = time.monotonic()
        return source, tag, values, values.size

    def receive(self, msg, count, timeout):
        return msg


def shake(sizes: list, dead: set[int] = frozenset()) -> dict[int, str]:
    """Each live rank's outcome of the handshake: "ok" or its error's class and line."""
    links, out = QueueLinks(len(sizes), set(range(len(sizes))) - set(dead)), {}

    def run(k: int) -> None:
        try:
            mpi_async._handshake(links.link(k, len(sizes)), sizes[k], 0.3)
            out[k] = "ok"
        except PurineError as e:
            out[k] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(sizes))
               if k not in dead]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_the_handshake_ends_every_live_rank_alike():
    net = SimpleNamespace(weights=5, grads=7)
    assert shake([net] * 3) == {0: "ok", 1: "ok", 2: "ok"}
    lost = ("RankLost: rank(s) 2 sent nothing for more than 0.3s while starting "
            "(--heartbeat); every rank stops")
    assert shake([net] * 3, dead={2}) == {0: lost, 1: lost}
    assert shake([net] * 3, dead={0}) == {k: "RankLost: the server (rank 0) sent nothing for "
                                          "more than 0.3s while starting (--heartbeat); this "
                                          "worker stops" for k in (1, 2)}
    failed = "PurineError: rank(s) 1 failed to build the net; see their errors"
    assert shake([net, None, net]) == dict.fromkeys(range(3), failed)
    other = SimpleNamespace(weights=6, grads=7)
    assert shake([net, other, net]) == dict.fromkeys(range(3), (
        "PurineError: rank(s) 1 built another net than rank 0 (6 weight values, rank 0 has 5):"
        " give every rank the same solver"))


def test_a_rank_lost_at_start_up_leaves_without_abort(monkeypatch, capsys):
    def leave(code):
        raise SystemExit(f"os._exit({code})")

    monkeypatch.setattr(mpi.os, "_exit", leave)
    comm = SimpleNamespace(rank=1, Abort=lambda code: pytest.fail("MPI_Abort was called"))
    with pytest.raises(SystemExit, match=r"os\._exit\(1\)"), mpi.abort_on_error(comm):
        raise mpi.RankLost("not every MPI rank reached x within 60s")
    assert capsys.readouterr().err == ("purine-caffe train (rank 1): not every MPI rank "
                                       "reached x within 60s\n")
