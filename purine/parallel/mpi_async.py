"""Downpour across MPI processes: rank 0 is the parameter server (a ParameterServer scheme
of a plain Solver: the solver's own update ops, tests, display, snapshots), ranks 1..N-1
are workers, rank k replica k-1 of N-1, each looping pull -> forward/backward -> push with
point-to-point messages and no barrier. A worker that falls silent is dropped and training goes on.

Every message is an array of the net's float type (a float32 net's weights travel as
float32; a message's head, an iteration or a loss, is exact to 2^24). Every MPI call is
non-blocking and made under one lock, beside a heartbeat thread that sends each peer a
small message every tenth of the heartbeat timeout. MPICH tells a survivor nothing about
a killed rank (a send to it completes, a receive from it never does), so silence is the
only sign: no message from a worker for the timeout and the server drops it; none from
the server and a waiting worker stops. A transfer the transport fails (a dead peer's memory
cannot be read) counts as a lost message; an MPI call that fails otherwise is a LinkError,
one line. A process leaves without MPI_Finalize once a rank was lost: it would wait for the
dead rank forever (``leave``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from purine.backend import assign
from purine.caffe.solver import Lap, Scheme, SignalHandler, Solver
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.graph import Blob
from purine.parallel.async_ps import (
    ParameterServer,
    Run,
    SolverWithServer,
    refuse_forward_written,
)
from purine.parallel.mpi import RankLost, mpi_line

# message tags
PULL, WEIGHTS, GRADS, STOP, BYE, FINALIZE, BEAT, FAILED, HELLO, VERDICT = range(11, 21)
SERVER = 0
POLL_S = 0.002  # how long a process with nothing to do sleeps before looking again


class LinkError(RankLost):
    """An MPI call of the Downpour link failed (a peer died and the transport says so)."""


class Link:
    """One process's point-to-point messages: ``send`` never blocks, ``next_message``
    and ``receive`` never wait on a peer past a deadline, and a thread sends each of
    ``peers`` a heartbeat every ``interval`` seconds. ``seen[k]``: when rank k was last
    heard from."""

    def __init__(self, comm: Any, peers: list[int], interval: float,
                 dtype: Any = np.float64):
        from mpi4py import MPI
        from mpi4py.util.dtlib import from_numpy_dtype

        self.MPI, self.comm = MPI, comm
        # Failures come back as MPI.Exception, never as an abort with MPI's own error stack
        # on stderr (mpi4py sets this by default; a user's mpi4py.rc may not have).
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.dtype = np.dtype(dtype)  # of every message, both ways
        self._mpi_type = from_numpy_dtype(self.dtype)
        self.peers = list(peers)
        self.seen = dict.fromkeys(peers, time.monotonic())
        self._lock = threading.Lock()
        self._sending: list[tuple[Any, np.ndarray]] = []  # a buffer lives until sent
        self._abandoned: list[tuple[Any, np.ndarray]] = []  # receives given up on, kept
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, args=(interval,), daemon=True,
                                       name="purine-heartbeat")
        self._beats.start()

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            for k in list(self.peers):
                try:
                    self.send(k, BEAT, np.zeros(0))  # no values: any dtype reads it
                except self.MPI.Exception:  # a lost peer's transport may refuse: its silence
                    self.peers.remove(k)    # decides, and the others still hear from us

    def send(self, dest: int, tag: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, self.dtype)
        with self._lock:
            try:
                self._sending.append((self.comm.Isend(array, dest, tag), array))
            except self.MPI.Exception:
                pass  # the transport refuses a dead peer: its silence decides, as for a send
                # that never completes
            # A send to a lost rank may never complete: it is kept, never waited on.
            self._sending = [(r, a) for r, a in self._sending if not self._done(r)]

    def _done(self, req: Any) -> bool:
        """Whether a send has completed; one the transport failed (its peer died) is done."""
        try:
            return bool(req.Test())
        except self.MPI.Exception:
            return True

    def next_message(self) -> tuple[int, int, Any, int] | None:
        """(source, tag, matched message, value count) of a waiting message, or None."""
        status = self.MPI.Status()
        with self._lock:
            try:
                msg = self.comm.improbe(self.MPI.ANY_SOURCE, self.MPI.ANY_TAG, status)
            except self.MPI.Exception as e:  # the progress engine reports a peer's death
                raise LinkError(f"MPI failed while looking for messages: {mpi_line(e)}") \
                    from None
        if msg is None:
            return None
        self.seen[status.source] = time.monotonic()
        return status.source, status.tag, msg, status.Get_count(self._mpi_type)

    def receive(self, msg: Any, count: int, timeout: float) -> np.ndarray | None:
        """The matched message's values; None if they do not arrive within ``timeout``
        seconds (the sender died while sending)."""
        buf = np.empty(count, self.dtype)
        with self._lock:
            try:
                req = msg.Irecv(buf)
            except self.MPI.Exception:
                return None  # as a transfer failed under way, below
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                try:
                    if req.Test():
                        return buf
                except self.MPI.Exception:
                    # The sender died mid-transfer and the transport says so (MPICH reads a
                    # large message from the sender's memory: a dead process cannot be read).
                    return None
            if time.monotonic() > deadline:
                # MPI may still write into the buffer: it lives as long as the request
                with self._lock:
                    self._abandoned.append((req, buf))
                return None
            time.sleep(POLL_S / 4)

    def stop_beats(self) -> None:
        self._stop.set()
        self._beats.join()

    def close(self, linger: float = 1.0) -> None:
        """Stop the heartbeats; wait up to ``linger`` seconds for the sends under way
        (those to a live peer complete once it reads them; one to a lost rank never)."""
        self.stop_beats()
        deadline = time.monotonic() + linger
        while self._sending and time.monotonic() < deadline:
            with self._lock:
                self._sending = [(r, a) for r, a in self._sending if not self._done(r)]
            time.sleep(POLL_S)


def flat(arrays: list[Any], head: list[float], dtype: Any = np.float64) -> np.ndarray:
    return np.concatenate([np.asarray(head, dtype)]
                          + [np.asarray(a, dtype).ravel() for a in arrays])


def unflatten(values: np.ndarray, blobs: list[Blob], arrays: Callable[[Blob], Any]) -> None:
    """Assign consecutive runs of ``values`` to ``arrays(blob)`` for each blob."""
    at = 0
    for b in blobs:
        assign(arrays(b), values[at: at + b.count].reshape(b.shape))
        at += b.count


class _WorkerScheme(Scheme):
    """A worker's train net: replica ``first`` of ``total``, no tests, no snapshots."""

    root = False

    def __init__(self, first: int, total: int):
        super().__init__(f"worker {first} of {total} asynchronous workers over MPI ranks")
        self.first, self.total = first, total


class Sizes:
    """The message layout every rank derives from its own train net: a weights message is
    [iteration, every learnable parameter]; a gradients message is [loss, the train net's
    outputs, the gradient of every parameter whose lr_mult is not 0]."""

    def __init__(self, solver: Solver):
        b = solver.net.builder
        self.params = list(b.learnable_params)
        self.active = [u for u in solver.updates if u.param.meta["lr_mult"] != 0]
        self.outputs = {n: b.data[n] for n in solver.net.outputs}
        self.dtype = np.dtype(b.dtype)  # the messages' (the same on every rank)
        self.weights = 1 + sum(p.count for p in self.params)
        self.grads = (1 + sum(o.count for o in self.outputs.values())
                      + sum(u.param.count for u in self.active))


class MpiParameterServer(ParameterServer):
    """Rank 0 of a Downpour job over ``comm``, as the scheme of a plain Solver: its
    ``step(iters)`` answers the workers' pulls (while a worker is at most ``staleness``
    pushes ahead of the slowest live one) and runs one solver iteration per push. A worker
    silent for ``heartbeat`` seconds is lost and dropped; losing the last is an error."""

    def __init__(self, comm: Any, staleness: int, heartbeat: float):
        n = comm.size - 1
        super().__init__(f"{n} asynchronous workers over MPI ranks", n, staleness)
        self.comm, self.heartbeat = comm, heartbeat
        self._waiting: set[int] = set()   # replicas that asked for weights
        self._claims: set[int] = set()    # replicas computing on weights pulled in this run
        self._inbox = np.empty(0)         # the gradients message being applied
        self.link: Link | None = None
        self.sizes: Sizes | None = None
        self._targets: list[Blob] = []

    def ready(self, solver: Solver) -> None:
        super().ready(solver)
        self.sizes = Sizes(solver)
        targets = self._server_grads()
        self._targets = [targets[u.grad] for u in self.sizes.active]

    def start(self) -> None:
        """Listen and send heartbeats to the workers (after the start-up handshake)."""
        self.link = Link(self.comm, list(range(1, self.comm.size)), self.heartbeat / 10,
                         self.sizes.dtype)

    def state_objects(self, solver: Solver) -> dict[str, Any]:
        """The test nets' cursors: the workers' data cursors stay in the workers, which
        start their data from the beginning in every run."""
        return {f"test{i}/{k}": s for i, net in enumerate(solver.test_nets)
                for k, s in net.builder.stateful.items()}

    def iteration(self, solver: Solver) -> float:  # noqa: ARG002
        raise PurineError("the server of Downpour over MPI runs no iteration of its own: the "
                          "workers' passes run in their processes")

    def train(self, solver: Solver, iters: int) -> None:
        """``iters`` pushes from the live workers."""
        if iters <= 0:
            return
        assert self.link is not None, "start() the server first"
        run = Run(iters, Lap(solver.iter))
        while not (run.stopped or (run.claimed >= iters and not self._claims)):
            busy = self._read_messages(run)
            self._drop_silent(run)
            busy |= self._answer_pulls(run)
            if not busy:
                time.sleep(POLL_S)
        if run.stopped:
            solver.stopped_early = True
            self._claims.clear()  # pushes still on their way are discarded

    def _read_messages(self, run: Run) -> bool:
        """Handle every waiting message; True if there was one."""
        link, any_ = self.link, False
        while (m := link.next_message()) is not None:
            any_ = True
            source, tag, msg, count = m
            r = source - 1
            values = link.receive(msg, count, self.heartbeat)
            if r not in self.live:
                continue  # a late message of a lost worker
            if values is None:
                self._lose(r, f"its message did not arrive within {self.heartbeat:g}s", run)
            elif tag == PULL:
                self._waiting.add(r)
            elif tag == FAILED:
                self._lose(r, "it stopped on an error; see its log", run)
            elif tag == GRADS and r in self._claims:
                if count != self.sizes.grads:
                    raise PurineError(f"worker rank {source} sent {count} values, this net's "
                                      f"gradients message has {self.sizes.grads}")
                self._claims.discard(r)
                self._inbox = values
                at = 1
                last = {}
                for name, blob in self.sizes.outputs.items():
                    last[name] = values[at: at + blob.count].reshape(blob.shape)
                    at += blob.count
                self._last[r] = last
                self._server_iteration(r, float(values[0]), run)
        return any_

    def _push(self, replica: int) -> None:
        d = self.solver.net.dispatcher
        at = len(self._inbox) - sum(t.count for t in self._targets)
        unflatten(self._inbox[at:], self._targets, d.array)
        d.run(self.solver.update_ops)
        self._updated(replica)

    def _answer_pulls(self, run: Run) -> bool:
        """Send the weights to each waiting worker the staleness bound lets pull, the
        furthest behind first; True if one was sent."""
        sent = False
        for r in sorted(self._waiting, key=lambda k: self.pushes[k]):
            if run.claimed >= run.iters or run.stopped:
                break
            if self._ahead(r) > self.staleness:
                continue
            self._waiting.discard(r)
            self._claims.add(r)
            run.claimed += 1
            self._log_pull(r)
            d = self.solver.net.dispatcher
            self.link.send(r + 1, WEIGHTS, flat([d.array(p) for p in self.sizes.params],
                                                [self.solver.iter], self.sizes.dtype))
            sent = True
        return sent

    def _drop_silent(self, run: Run) -> None:
        now = time.monotonic()
        for r in sorted(self.live):
            if now - self.link.seen[r + 1] > self.heartbeat:
                self._lose(r, f"no message for {self.heartbeat:g}s", run)

    def _lose(self, r: int, why: str, run: Run) -> None:
        self.live.discard(r)
        self.link.peers.remove(r + 1)
        self._waiting.discard(r)
        if r in self._claims:  # its push will not come: another worker may pull instead
            self._claims.discard(r)
            run.claimed -= 1
        n = len(self.live)
        if not n:
            raise PurineError(f"every worker was lost (the last, rank {r + 1}: {why}); "
                              f"training stopped at iteration {self.solver.iter} (the last "
                              "snapshot is intact)")
        self.solver.log.warning("worker rank %d lost (%s); training continues with %d worker%s",
                         r + 1, why, n, "" if n == 1 else "s")

    def stop_workers(self, code: int) -> bool:
        """Tell the live workers to exit with ``code`` and read what they still send until
        each says goodbye (one busy with a push may take its time while it sends heartbeats;
        one silent for the heartbeat timeout is lost), then tell them whether to finalize
        MPI: only when no rank was lost, as MPI_Finalize waits for every rank. Returns that
        decision."""
        link = self.link
        if link is None:
            return True
        for r in sorted(self.live):
            link.send(r + 1, STOP, np.array([float(code)]))
        left, gone = {r + 1 for r in self.live}, set()
        try:
            while left:
                try:
                    m = link.next_message()
                except LinkError:  # the transport reports a dead peer: which, it does not say
                    gone |= left
                    break
                if m is not None:
                    source, tag, msg, count = m
                    link.receive(msg, count, self.heartbeat)  # late gradients are dropped
                    if tag == BYE:
                        left.discard(source)
                    continue
                now = time.monotonic()
                gone |= {k for k in left if now - link.seen[k] > self.heartbeat}
                left -= gone
                time.sleep(POLL_S)
            link.stop_beats()
            finalize = not gone and len(self.live) == len(self.pushes)
            for r in sorted(self.live):
                if r + 1 not in gone:
                    link.send(r + 1, FINALIZE, np.array([float(finalize)]))
        finally:
            link.close()
        return finalize


class MpiServer(SolverWithServer):
    """``MpiServer(source, comm=..., staleness=S, heartbeat=T, **kwargs)``: ``Solver(source,
    scheme=MpiParameterServer(comm, S, T), **kwargs)``, its scheme's state read through."""

    def __init__(self, source: str | os.PathLike | pb.SolverParameter, *, comm: Any,
                 staleness: int, heartbeat: float, **kwargs: Any):
        scheme = MpiParameterServer(comm, staleness, heartbeat)
        super().__init__(Solver(source, scheme=scheme, **kwargs), scheme)


class MpiWorker:
    """Rank k > 0 of a Downpour job: replica k-1 of N-1, built as the solver's train net
    with that replica's data share and seed; ``run`` loops pull -> passes -> push until
    the server says stop or falls silent."""

    def __init__(self, source: str | os.PathLike | pb.SolverParameter, *, comm: Any,
                 heartbeat: float, **kwargs: Any):
        self.comm, self.heartbeat = comm, heartbeat
        self.solver = Solver(source, scheme=_WorkerScheme(comm.rank - 1, comm.size - 1),
                             **kwargs)
        try:
            refuse_forward_written(self.solver.net, self.solver.path)
        except PurineError:
            self.solver.close()
            raise
        self.sizes = Sizes(self.solver)
        s = self.solver
        acc = {o.inputs[0]: o.outputs[0] for o in s.accumulate_ops}
        self._grads = [acc.get(u.grad, u.grad) for u in self.sizes.active]
        self.pushes = 0

    def close(self) -> None:
        self.solver.close()

    def run(self) -> tuple[int, str, bool]:
        """Train until told; returns the exit code, why, and whether to finalize MPI."""
        link = Link(self.comm, [SERVER], self.heartbeat / 10, self.sizes.dtype)
        try:
            link.send(SERVER, PULL, np.zeros(1))
            while True:
                values, tag = self._wait(link, (WEIGHTS, STOP))
                if tag == STOP:
                    code = int(values[0])
                    why = ("the server finished" if code == 0 else
                           "the server stopped on an error")
                    link.stop_beats()
                    link.send(SERVER, BYE, np.zeros(1))
                    link.seen[SERVER] = time.monotonic()  # its beats have stopped
                    finalize = bool(self._wait(link, (FINALIZE,))[0][0])
                    return code, f"{why}, after {self.pushes} pushes of this worker", finalize
                if len(values) != self.sizes.weights:
                    raise PurineError(f"the server sent {len(values)} values, this net's "
                                      f"weights message has {self.sizes.weights}")
                d = self.solver.net.dispatcher
                unflatten(values[1:], self.sizes.params, d.array)
                loss = self._compute()
                outputs = [d.array(b) for b in self.sizes.outputs.values()]
                link.send(SERVER, GRADS, flat(outputs + [d.array(g) for g in self._grads],
                                              [loss], self.sizes.dtype))
                self.pushes += 1
                link.send(SERVER, PULL, np.zeros(1))
        except BaseException:
            link.send(SERVER, FAILED, np.zeros(1))
            raise
        finally:
            link.close()

    def _wait(self, link: Link, tags: tuple[int, ...]) -> tuple[np.ndarray, int]:
        """The server's next message with one of ``tags`` (others, heartbeats, are read
        and dropped)."""
        while True:
            try:
                m = link.next_message()
            except LinkError as e:
                raise PurineError(f"the link to the server (rank 0) failed ({e}); this worker "
                                  "stops") from None
            if m is None:
                silent = time.monotonic() - link.seen[SERVER]
                if silent > self.heartbeat:
                    raise PurineError(f"the server (rank 0) sent nothing for more than "
                                      f"{self.heartbeat:g}s (--heartbeat); this worker stops")
                time.sleep(POLL_S)
                continue
            _, tag, msg, count = m
            values = link.receive(msg, count, self.heartbeat)
            if values is None:
                raise PurineError(f"a message of the server (rank 0) did not arrive within "
                                  f"{self.heartbeat:g}s; this worker stops")
            if tag in tags:
                return values, tag

    def _compute(self) -> float:
        """iter_size forward/backward passes; their mean loss."""
        s = self.solver
        d, n = s.net.dispatcher, s.param.iter_size
        if n > 1:
            d.run(s.zero_ops)
        loss = 0.0
        for _ in range(n):
            d.run(s.pass_ops() + s.accumulate_ops)
            loss += float(s.net.loss_value())
        return loss / n


def _handshake(link: Link, sizes: Sizes | None, heartbeat: float) -> None:
    """Every rank says whether it built its side and the message sizes it expects: the
    workers tell the server, the server tells every worker the whole table. Any failure,
    disagreement or silence (a rank heard from for none of ``heartbeat`` seconds: dead)
    stops every rank alike; a silence is RankLost."""
    comm = link.comm
    mine = [sizes is not None, sizes.weights if sizes else 0, sizes.grads if sizes else 0]
    if comm.rank == SERVER:
        table = np.zeros((comm.size, 3))
        table[SERVER] = mine
        waiting = set(range(1, comm.size))
        while waiting:
            source, values = _startup_message(link, waiting, HELLO, heartbeat)
            if values is None:  # silent: lost
                table[source, 0] = -1
            else:
                table[source] = values[:3]
            waiting.discard(source)
        for k in range(1, comm.size):
            if table[k, 0] >= 0:
                link.send(k, VERDICT, table.ravel())
    else:
        link.send(SERVER, HELLO, np.asarray(mine, np.float64))
        _, values = _startup_message(link, {SERVER}, VERDICT, heartbeat)
        if values is None:
            raise RankLost(f"the server (rank 0) sent nothing for more than {heartbeat:g}s "
                           "while starting (--heartbeat); this worker stops")
        table = values.reshape(comm.size, 3)
    lost = [k for k in range(comm.size) if table[k, 0] < 0]
    if lost:
        raise RankLost(f"rank(s) {', '.join(map(str, lost))} sent nothing for more than "
                       f"{heartbeat:g}s while starting (--heartbeat); every rank stops")
    failed = [k for k in range(comm.size) if not table[k, 0]]
    if failed:
        raise PurineError(f"rank(s) {', '.join(map(str, failed))} failed to build the net; "
                          "see their errors")
    differ = [k for k in range(comm.size) if tuple(table[k, 1:]) != tuple(table[0, 1:])]
    if differ:
        raise PurineError(f"rank(s) {', '.join(map(str, differ))} built another net than rank "
                          f"0 ({int(table[differ[0], 1])} weight values, rank 0 has "
                          f"{int(table[0, 1])}): give every rank the same solver")


def _startup_message(link: Link, sources: set[int], tag: int, heartbeat: float
                     ) -> tuple[int, np.ndarray | None]:
    """(source, values) of the next ``tag`` message from one of ``sources``, or (k, None)
    once rank k of them has been silent for ``heartbeat`` seconds; heartbeats and strays
    are read and dropped."""
    while True:
        try:
            m = link.next_message()
        except LinkError as e:
            raise RankLost(str(e)) from None
        if m is None:
            now = time.monotonic()
            silent = [k for k in sources if now - link.seen[k] > heartbeat]
            if silent:
                return silent[0], None
            time.sleep(POLL_S)
            continue
        source, got, msg, count = m
        values = link.receive(msg, count, heartbeat)
        if got == tag and source in sources:
            return source, values  # None: the sender died while sending


def _say(comm: Any, text: str) -> None:
    print(f"purine-caffe train (rank {comm.rank}): {text}", file=sys.stderr, flush=True)


def train(param: pb.SolverParameter, comm: Any, *, staleness: int, heartbeat: float,
          resume: str | None = None, sigint: str = "stop", sighup: str = "snapshot",
          log: logging.Logger | None = None, **kwargs: Any) -> tuple[int, bool]:
    """This rank's side of ``mpiexec -n N purine-caffe train --async S``: the server on rank
    0, a worker elsewhere. Errors are reported here, on the rank that has them. Returns the
    process's exit code (0: trained, or a worker told so) and whether MPI may be finalized
    (every rank is still there to)."""
    # Heartbeats from the first moment: a rank still building its net (seconds; minutes for
    # a big one) is heard from, and a dead one is known by its silence, not waited for.
    startup = Link(comm, list(range(1, comm.size)) if comm.rank == SERVER else [SERVER],
                   heartbeat / 10)
    try:
        return _start_and_run(comm, startup, param, staleness, heartbeat, resume, sigint,
                              sighup, log, **kwargs)
    finally:
        startup.close(linger=0)  # its beats stop on every path out (closed already if run)


def _start_and_run(comm: Any, startup: Link, param: pb.SolverParameter, staleness: int,
                   heartbeat: float, resume: str | None, sigint: str, sighup: str,
                   log: logging.Logger | None, **kwargs: Any) -> tuple[int, bool]:
    side: Solver | MpiWorker | None = None
    sizes: Sizes | None = None
    try:
        if comm.rank == SERVER:
            server = MpiParameterServer(comm, staleness, heartbeat)
            side = Solver(param, scheme=server, log=log, **kwargs)
            sizes = server.sizes
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when to stop
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            side = MpiWorker(param, comm=comm, heartbeat=heartbeat, log=log, **kwargs)
            sizes = side.sizes
    except KeyboardInterrupt:  # Ctrl-C while building: a failed build, said in one line
        _say(comm, "interrupted while building the net")
    except Exception as e:  # noqa: BLE001 -- the handshake tells the other ranks
        _say(comm, str(e) if isinstance(e, PurineError) else traceback.format_exc())
    try:
        _handshake(startup, sizes, heartbeat)
    except (PurineError, KeyboardInterrupt) as e:
        lost = not isinstance(e, PurineError) or isinstance(e, RankLost)
        if side is not None or lost:  # a failed build said why already
            _say(comm, str(e) if isinstance(e, PurineError) else "interrupted while starting")
        if side is not None:
            side.close()
        return 1, not lost  # an interrupted rank may have left the others mid-handshake
    startup.close()
    if isinstance(side, MpiWorker):
        with side.solver:
            _say(comm, f"worker rank {comm.rank} (pid {os.getpid()}) started: replica "
                       f"{comm.rank - 1} of {comm.size - 1}")
            try:
                code, why, finalize = side.run()
            except BaseException as e:  # noqa: BLE001 -- the process leaves by os._exit
                code, why, finalize = 1, _describe(e), False
        _say(comm, f"worker rank {comm.rank} (pid {os.getpid()}) exits: {why}")
        return code, finalize
    with side:
        side.log.info("Downpour over MPI: the server on rank 0, %d workers, staleness %d, "
                      "heartbeat %gs", comm.size - 1, staleness, heartbeat)
        server.start()
        try:
            with SignalHandler(sigint, sighup) as signals:
                side.requested = signals
                side.solve(resume=resume)
        except BaseException as e:  # noqa: BLE001 -- the process leaves by os._exit
            _say(comm, _describe(e))
            return 1, server.stop_workers(1)
        return 0, server.stop_workers(0)


def _describe(e: BaseException) -> str:
    """A project error's one line, an MPI error's too; anything else with its traceback."""
    if isinstance(e, PurineError):
        return str(e)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(e, mpi.Exception):  # a call outside the link's
        return f"MPI failed: {mpi_line(e)}"
    return "".join(traceback.format_exception(e)).rstrip()


def leave(code: int, finalize: bool) -> int:
    """``code``, for the process to exit with normally (mpi4py finalizes MPI at exit) when
    ``finalize`` says every rank is there to; otherwise leave at once without MPI_Finalize,
    which would wait for the lost rank forever (mpiexec then reports the job failed)."""
    if not finalize:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
