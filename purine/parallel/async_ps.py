"""Asynchronous data parallelism, Downpour style: N replicas, each with its own copy of the
parameters, loop pull -> forward/backward -> push against a parameter server (the solver's
master parameters, histories and update ops), with a bound S on how far one runs ahead.

Everything is graph ops run by the solver's one dispatcher: replica r's net is composed into
the train graph under ``replica{r}/`` (not bound to the master parameters) at worker thread
``r + 1``; pull ops copy master parameters to the replica's, push ops copy its gradients
into the server's gradient blobs, which the solver's update ops (at thread 0) read. Each
replica's ops run in its own Python thread (numpy releases the GIL in its kernels), and a
lock serializes pulls and pushes, so each push is one solver iteration. ``Downpour`` is that
scheme of a plain Solver; ``ParameterServer``, the server side alone, is shared with the
replicas in other processes of purine.parallel.mpi_async.

Async training is not deterministic: which replica pushes when, and so the weights, depend on
how the threads interleave.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from purine.caffe.net import TRAIN, NetBuilder
from purine.caffe.solver import Lap, Scheme, Solver
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.graph import Blob, Location, Op, Stateful, kernel
from purine.ops import tensor


class Pull(NamedTuple):
    """One pull: which replica, the solver iteration of the weights it got, and every
    replica's push count at that moment."""

    replica: int
    iter: int
    pushes: tuple[int, ...]


@dataclass
class Worker:
    """Replica ``index``'s ops: pull, its forward/backward pass (with local accumulation
    when iter_size > 1), push."""

    index: int
    location: Location
    pull_ops: list[Op] = field(default_factory=list)
    pass_ops: list[Op] = field(default_factory=list)
    zero_ops: list[Op] = field(default_factory=list)
    accumulate_ops: list[Op] = field(default_factory=list)
    push_ops: list[Op] = field(default_factory=list)
    loss_tops: list[tuple[Blob, float]] = field(default_factory=list)
    outputs: dict[str, Blob] = field(default_factory=dict)  # train net output name -> blob
    stateful: dict[str, Stateful] = field(default_factory=dict)


@dataclass
class Run:
    """One ``step(iters)``: its push budget and how it ends."""

    iters: int
    lap: Lap
    claimed: int = 0
    failure: BaseException | None = None
    stopped: bool = False

    def over(self) -> bool:
        return self.failure is not None or self.stopped or self.claimed >= self.iters


def refuse_forward_written(net: Any, path: str) -> None:
    """Downpour moves gradients to the server and weights back, so a parameter that the
    forward pass writes (BatchNorm's statistics) would never reach the server, and each
    pull would reset it: refuse such a net before iteration 0."""
    written = {b for o in net._forward_ops for b in o.outputs}
    for p in net.builder.learnable_params:
        if p in written:
            raise PurineError(f"solver {path or '(prototxt text)'}: --async cannot train layer "
                              f"'{p.meta['layer']}': its forward pass writes parameter "
                              f"{p.meta['index']} (statistics), which asynchronous replicas "
                              "would never send to the server; train it synchronously")


class ParameterServer(Scheme):
    """The server side of Downpour, wherever its replicas run, as a scheme of a plain
    Solver: the solver's net holds the master weights, its update ops run once per push,
    and each push is one ``Solver.iterate`` (tests, display, snapshots, requests).
    ``pushes[r]`` counts replica r's pushes; a replica in ``live`` may not pull while it has
    pushed more than ``staleness`` times more than the slowest live one. ``pull_log``
    records every pull. A subclass says how a push reaches the gradient blobs (``_push``)."""

    def __init__(self, description: str, replicas: int, staleness: int):
        if replicas < 1:
            raise PurineError(f"async training needs at least 1 replica, got {replicas}")
        if staleness < 0:
            raise PurineError(f"staleness must be 0 or more, got {staleness}")
        super().__init__(description)
        self.staleness = staleness
        self.pushes = [0] * replicas
        self.live = set(range(replicas))  # replicas that still push (a lost one does not)
        self.pull_log: list[Pull] = []
        self._last: dict[int, dict[str, np.ndarray]] = {}  # a replica's last outputs
        self.solver: Solver | None = None  # the solver served, once built

    def ready(self, solver: Solver) -> None:
        refuse_forward_written(solver.net, solver.path)
        self.solver = solver

    def _server_grads(self) -> dict[Blob, Blob]:
        """For each gradient blob the update ops read through (``u.grad``), the blob a push
        writes: the gradient itself, or its accumulator when iter_size > 1. The master
        net's own backward never runs, so within a run the push is its one writer."""
        s = self.solver
        target = {u.grad: u.grad for u in s.updates}
        target.update({o.inputs[0]: o.outputs[0] for o in s.accumulate_ops})
        return target

    def _ahead(self, replica: int) -> int:
        return self.pushes[replica] - min(self.pushes[r] for r in self.live)

    def _log_pull(self, replica: int) -> None:
        self.pull_log.append(Pull(replica, self.solver.iter, tuple(self.pushes)))

    def _push(self, replica: int) -> None:
        """Replica ``replica``'s gradients into the gradient blobs, then one solver update."""
        raise NotImplementedError

    def _updated(self, replica: int) -> None:
        """Count a push whose update ops have run: the solver's counter blob advanced."""
        self.solver.count_update()
        self.pushes[replica] += 1

    def _server_iteration(self, replica: int, loss: float, run: Run) -> None:
        """A push with what the solver does around an iteration (``Solver.iterate``)."""
        def push() -> float:
            self._push(replica)
            return loss

        action = self.solver.iterate(push, run.lap, self._last[replica], f" (replica {replica})")
        if action == "stop":
            run.stopped = True


class Downpour(ParameterServer):
    """``Solver(..., scheme=Downpour(replicas=N, staleness=S))``: ``step`` trains N
    asynchronous replicas in this process against the solver's net's parameters (the
    server). A replica may not pull while it has pushed more than S times more than the
    slowest replica, so S=0 runs the replicas in rounds of one push each. Learning rate,
    display, test intervals, snapshots and stop/snapshot requests follow the solver
    parameter per push, as ``Solver.step`` does per iteration."""

    def __init__(self, replicas: int = 2, staleness: int = 0):
        super().__init__(f"{replicas} asynchronous replicas", replicas, staleness)
        self.concurrent = replicas > 1  # the replicas' threads: one BLAS thread each
        self.workers: list[Worker] = []
        self._lock = threading.Condition()  # the server: pulls, pushes, tests, snapshots
        self._level, self._stages = 0, ()

    def rewrite(self, solver: Solver, param: pb.NetParameter, level: int,  # noqa: ARG002
                stages: tuple[str, ...]) -> None:
        self._level, self._stages = level, stages  # the replicas are built alike (ready)

    def ready(self, solver: Solver) -> None:
        super().ready(solver)
        n = len(self.pushes)
        self.workers = [self._add_replica(r, n) for r in range(n)]
        solver.log.info("Asynchronous training: %d replicas, staleness %d", n, self.staleness)

    # -- building -------------------------------------------------------------------------
    def _add_replica(self, r: int, count: int) -> Worker:
        s = self.solver
        g, master = s.net.graph, s.net.builder
        m = master.location
        loc = Location(m.device, m.index, r + 1, m.host)
        b = NetBuilder(s.net.model, TRAIN, level=self._level, stages=self._stages,
                       seed=s.seed + r, location=loc, replica=(r, count), dtype=master.dtype)
        w = Worker(r, loc)
        prefix = f"replica{r}/"
        own_grads = {p.name: b.param_grad(p) for p in b.learnable_params}
        start = len(g.ops)
        mapped = g.compose(b.graph, prefix)  # no bind: the replica owns its parameters
        w.pass_ops = g.ops[start:]
        w.loss_tops = [(mapped[t.name], wt) for t, wt in b.loss_tops]
        w.outputs = {n: mapped[b.data[n].name] for n in s.net.outputs}
        w.stateful = dict(b.stateful)
        for p in master.learnable_params:
            w.pull_ops.append(g.op(f"{prefix}pull/{p.name}", "Copy", [p], [mapped[p.name]],
                                   kernel(tensor.copy), loc))
        server_grad = self._server_grads()
        for u in s.updates:
            if u.param.meta["lr_mult"] == 0:
                continue
            grad = mapped[own_grads[u.param.name].name]
            if s.param.iter_size > 1:
                acc = g.blob(f"{prefix}{u.param.name}@accumulated", grad.shape, grad.dtype,
                             loc)
                w.zero_ops.append(g.op(f"{prefix}{u.param.name}/zero", "Fill", [], [acc],
                                       kernel(tensor.fill, value=0.0), loc))
                w.accumulate_ops.append(g.op(f"{prefix}{u.param.name}/accumulate",
                                             "Accumulate", [grad, acc], [acc],
                                             kernel(tensor.accumulate), loc))
                grad = acc
            target = server_grad[u.grad]
            w.push_ops.append(g.op(f"{prefix}push/{u.param.name}", "Copy", [grad], [target],
                                   kernel(tensor.copy), target.location))
        return w

    # -- one replica's steps --------------------------------------------------------------
    def _pull(self, w: Worker) -> None:
        """Copy the master weights into replica ``w`` (the caller holds the server lock)."""
        self._log_pull(w.index)
        self.solver.net.dispatcher.run(w.pull_ops)

    def _compute(self, w: Worker) -> float:
        """iter_size forward/backward passes of replica ``w``; returns their mean loss."""
        d, n = self.solver.net.dispatcher, self.solver.param.iter_size
        loss = 0.0
        if n > 1:
            d.run(w.zero_ops)
        for _ in range(n):
            d.run(w.pass_ops + w.accumulate_ops)
            loss += sum(wt * float(d.array(t).sum()) for t, wt in w.loss_tops)
        self._last[w.index] = {k: np.array(d.array(b)) for k, b in w.outputs.items()}
        return loss / n

    def _push(self, replica: int) -> None:
        """The replica's gradients into the server, then one solver update (the caller
        holds the server lock)."""
        self.solver.net.dispatcher.run(self.workers[replica].push_ops + self.solver.update_ops)
        self._updated(replica)

    def iteration(self, solver: Solver) -> float:  # noqa: ARG002
        """One push by replica 0 in the calling thread (what ``trace_iteration`` records)."""
        w = self.workers[0]
        with self._lock:
            self._pull(w)
        loss = self._compute(w)
        with self._lock:
            self._push(w.index)
            self._lock.notify_all()
        return loss

    # -- training -------------------------------------------------------------------------
    def train(self, solver: Solver, iters: int) -> None:
        """``iters`` pushes in all, by the replicas in their threads; the first error in a
        replica stops the others and is raised here."""
        if iters <= 0:
            return
        run = Run(iters, Lap(solver.iter))
        threads = [threading.Thread(target=self._replica_loop, args=(w, run), daemon=True,
                                    name=f"purine-async-replica{w.index}")
                   for w in self.workers]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException as e:  # e.g. KeyboardInterrupt: stop the replicas first
            with self._lock:
                run.failure = run.failure or e
                self._lock.notify_all()
            for t in threads:
                t.join()
        if run.failure is not None:
            raise run.failure
        if run.stopped:
            solver.stopped_early = True

    def _replica_loop(self, w: Worker, run: Run) -> None:
        try:
            while True:
                with self._lock:
                    self._lock.wait_for(lambda: run.over()
                                        or self._ahead(w.index) <= self.staleness)
                    if run.over():
                        return
                    run.claimed += 1
                    self._pull(w)
                loss = self._compute(w)
                with self._lock:
                    if run.failure is not None or run.stopped:
                        return  # training ended while this replica computed
                    try:
                        self._server_iteration(w.index, loss, run)
                    finally:
                        self._lock.notify_all()
        except BaseException as e:
            with self._lock:
                run.failure = run.failure or e
                self._lock.notify_all()

    # -- state ----------------------------------------------------------------------------
    def state_objects(self, solver: Solver) -> dict[str, Stateful]:  # noqa: ARG002
        """The replicas' data cursors and random streams, keyed as in synchronous mode
        (replica 0 bare, replica r ``replica{r}/...``); the master net never reads data
        while training, so its own are left out."""
        objects: dict[str, Stateful] = {}
        for w in self.workers:
            prefix = f"replica{w.index}/" if w.index else ""
            objects.update({prefix + k: s for k, s in w.stateful.items()})
        return objects


class SolverWithServer:
    """A plain Solver and the parameter-server scheme it trains with, read as one object
    (what ``AsyncSolver`` and mpi_async's ``MpiServer`` give): an attribute is the solver's
    where it has one, else the scheme's (``pushes``, ``pull_log``, ``workers``); setting
    one sets it where it lives."""

    def __init__(self, solver: Solver, scheme: ParameterServer):
        object.__setattr__(self, "solver", solver)
        object.__setattr__(self, "scheme", scheme)

    def __getattr__(self, name: str) -> Any:
        if name in ("solver", "scheme"):  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        try:
            return getattr(self.solver, name)
        except AttributeError:
            return getattr(self.scheme, name)

    def __setattr__(self, name: str, value: Any) -> None:
        owner = self.solver
        if not hasattr(owner, name) and hasattr(self.scheme, name):
            owner = self.scheme
        setattr(owner, name, value)

    def __enter__(self) -> SolverWithServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.solver.close()


class AsyncSolver(SolverWithServer):
    """``AsyncSolver(source, replicas=N, staleness=S, **kwargs)``: ``Solver(source,
    scheme=Downpour(N, S), **kwargs)``, its scheme's counters read through (``pushes``,
    ``pull_log``, ``workers``)."""

    def __init__(self, source: str | os.PathLike | pb.SolverParameter, *, replicas: int = 2,
                 staleness: int = 0, **kwargs: Any):
        scheme = Downpour(replicas, staleness)
        super().__init__(Solver(source, scheme=scheme, **kwargs), scheme)
