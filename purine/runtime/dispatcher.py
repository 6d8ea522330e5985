"""The event-driven dispatcher: an op is ready when the ops it depends on have finished;
ready ops go to the worker thread of their location; a finished op releases its dependents.

Storage: a blob's array is a view of its name's buffer in a Store (purine.runtime.memory),
made on first use, which the dispatchers of one net's builds share. Because every
conflicting pair of ops is ordered by a derived edge, the result never depends on how the
workers interleave, and equals a sequential run in program order bit for bit.

A GPU location is one CUDA stream, and its worker only issues kernels: the dispatcher
records an event where a blob's producer and consumer sit on different streams (or a host
op needs a GPU result), and the consumer's stream waits on the device; consecutive runs
are joined the same way. Host Python never waits for the GPU except where a host op reads
what the GPU wrote.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from purine.backend import activate, record, stream, wait
from purine.backend.onednn import pass_scope
from purine.errors import PurineError
from purine.graph import Blob, Graph, Location, Op
from purine.runtime.memory import Buffer, MemoryPlan, Store, blob_nbytes


@dataclass(frozen=True)
class TraceEvent:
    op: Op
    start: float
    end: float
    thread: str


class Transport(Protocol):
    """How a Copy op between hosts (MPI ranks) moves its array: ``tag`` names the op, the
    same on every host (purine.parallel.mpi gives one over MPI point-to-point messages)."""

    def send(self, array: Any, host: int, tag: int) -> None: ...

    def receive(self, array: Any, host: int, tag: int) -> None: ...


# The worker thread of a host's transfers: one per host, so that they leave and arrive in
# program order whatever else runs (a receive waits without holding up computation).
TRANSFER_THREAD = 1 << 16


def crosses_hosts(op: Op) -> bool:
    """A Copy op whose ends are on two hosts: a message from one to the other."""
    return op.type == "Copy" and op.inputs[0].location.host != op.outputs[0].location.host


class _Plan:
    """Dependency counts and dependents of one op sequence, derived once and reused.

    On one host of several (``host``), the sequence is the host's share: the ops that run
    there, and the Copy ops between it and another host, each of which the dispatcher runs
    as a send or a receive at the host's transfer worker, chained in program order. Every
    host issues its transfers in the order of one sequence, the same everywhere, so each
    send meets its receive without a deadlock, as collectives issued in one order do."""

    def __init__(self, graph: Graph, ops: Sequence[Op], storage: dict | None = None,
                 host: int | None = None):
        if host is not None:
            ops = [o for o in ops if any(b.location.host == host
                                         for b in o.inputs + o.outputs)
                   or (not o.inputs and not o.outputs and o.location.host == host)]
        self.ops = tuple(ops)
        # Hazards are those of storage: a planned blob's buffer, else the blob's name (the
        # store's key), so that ops of several builds of one net, run in one sequence (a
        # scheme's ops made on the first build after a later build's pass), are ordered.
        storage = storage or {}
        keys = {b: storage.get(b, b.name) for o in self.ops for b in o.inputs + o.outputs}
        deps = graph.dependencies(self.ops, keys)
        # One process holding every host's share (host None) runs such a Copy as a copy.
        transfers = [o for o in self.ops if host is not None and crosses_hosts(o)]
        for a, b in zip(transfers, transfers[1:]):
            if a not in deps[b]:
                deps[b].append(a)
        self.where = {o: o.location for o in self.ops}
        self.where.update({o: Location("cpu", 0, TRANSFER_THREAD, host) for o in transfers})
        self.count = {o: len(d) for o, d in deps.items()}
        self.dependents: dict[Op, list[Op]] = {o: [] for o in self.ops}
        for o, d in deps.items():
            for p in d:
                self.dependents[p].append(o)
        self.locations = set(self.where.values())
        # GPU work is asynchronous: an op on a GPU stream is "finished" for the dispatcher
        # once its kernels are issued. Where a dependent runs at another location, the
        # producer records an event after its kernels and the dependent's location waits for
        # it: another stream on the device, the host by blocking (only where a host op needs
        # what GPU work wrote or still reads). Edges from host ops need nothing: a host op's
        # work is done when it returns.
        self.waits: dict[Op, list[Op]] = {}
        self.records: set[Op] = set()
        for o, d in deps.items():
            w = [p for p in d if self.where[p].device == "gpu" and self.where[p] != self.where[o]]
            if w:
                self.waits[o] = w
                self.records.update(w)
        self.streams = {loc for loc in self.locations if loc.device == "gpu"}


class _Worker(threading.Thread):
    def __init__(self, location: Location):
        super().__init__(name=f"purine-{location}", daemon=True)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            job = self.inbox.get()
            if job is None:
                return
            execute, op, done = job
            try:
                execute(op)
                done.put((op, None))
            except BaseException as e:  # reported to the dispatching thread
                done.put((op, e))


class Dispatcher:
    """Runs ops of ``graph``; ``run(ops)`` runs a sub-sequence (e.g. forward only), whose
    inputs written by no op in it are taken as ready."""

    def __init__(self, graph: Graph, *, profile: bool = False,
                 memory_plan: MemoryPlan | None = None, host: int | None = None,
                 store: Store | None = None):
        self.graph = graph
        # One host (MPI rank) of a graph placed on several: this dispatcher runs the host's
        # share of every sequence, and ``transport`` moves what crosses to another host.
        self.host = host
        self.transport: Transport | None = None
        self._tags: dict[str, int] = {}
        # The blobs' storage, by name: a net's builds for other shapes share it
        self.store = store if store is not None else Store()
        self._generation = self.store.generation
        self.arrays: dict[Blob, Any] = {}  # views of the store's buffers, made on first use
        self.profile = profile
        self.trace: list[TraceEvent] = []
        self._plans: dict[tuple[Op, ...], _Plan] = {}
        self._workers: dict[Location, _Worker] = {}
        self._bound: dict[Op, tuple[list[Any], list[Any]]] = {}
        self._events: dict[Op, Any] = {}  # the last event each recording op recorded
        self._fence: dict[Location, Any] = {}  # per GPU stream: the end of its last run
        self._seen_streams: set[Location] = set()
        self.memory_plan: MemoryPlan | None = None
        self._storage: dict[Blob, Buffer] = {}  # the plan's blob -> buffer key
        self.external: set[Blob] = set()  # blobs bound to storage from outside
        if memory_plan is not None:
            self.set_memory_plan(memory_plan)

    # -- storage ----------------------------------------------------------------------
    @property
    def _held(self) -> dict[tuple, int]:
        return self.store.held

    def _sync(self) -> None:
        if self._generation != self.store.generation:
            # Another build's blob outgrew a buffer this one had views of: make them anew.
            self.arrays.clear()
            self._bound.clear()
            self._generation = self.store.generation

    def array(self, blob: Blob) -> Any:
        self._sync()
        a = self.arrays.get(blob)
        if a is None:
            key = self._storage.get(blob)
            if key is None:
                a = self.store.view(blob)
            else:  # a view of the buffer the plan shares (in the store, by its number)
                size = self.memory_plan.buffer_bytes[key]
                buf = self.store.flat(("plan", key.index, key.location.memory), key.location,
                                      size, f"{key} (shared by blob '{blob.name}' and others)")
                a = buf[:blob_nbytes(blob)].view(blob.dtype).reshape(blob.shape)
            self.arrays[blob] = a
        # A buffer grown for this blob held no other view of this graph's: ours stay good.
        self._generation = self.store.generation
        return a

    def _forget(self, blob: Blob) -> None:
        """Drop ``blob``'s view and the ops' arguments that hold it."""
        self.arrays.pop(blob, None)
        self._bound = {o: a for o, a in self._bound.items()
                       if blob not in o.inputs and blob not in o.outputs}

    def set_memory_plan(self, plan: MemoryPlan | None) -> None:
        """Let the blobs of ``plan`` (purine.runtime.memory) share buffers; None: every blob
        its own array again. Their arrays are re-made on use, and the dependencies are
        derived again over the storage the blobs share."""
        storage = dict(plan.storage) if plan is not None else {}
        bound = [b.name for b in storage if b in self.external]
        if bound:
            raise PurineError(f"blobs bound to outside storage cannot share buffers: "
                              f"{', '.join(bound)}")
        in_step = self._generation == self.store.generation
        for b in storage:  # their own buffers are no longer needed
            if b not in self._storage:
                self.store.release(b.name)
        touched = set(storage) | set(self._storage)
        for b in touched:
            self.arrays.pop(b, None)
        self._bound = {o: a for o, a in self._bound.items()
                       if touched.isdisjoint(o.inputs) and touched.isdisjoint(o.outputs)}
        if in_step:
            self._generation = self.store.generation
        self.memory_plan, self._storage = plan, storage
        self._plans.clear()

    def bind(self, blob: Blob, array: Any) -> None:
        """Give ``blob`` existing storage (e.g. a parameter another net owns)."""
        if tuple(array.shape) != blob.shape:
            raise PurineError(f"cannot bind blob '{blob.name}' {blob.shape} to an array of "
                              f"shape {tuple(array.shape)}")
        if blob in self._storage:
            raise PurineError(f"cannot bind blob '{blob.name}': the memory plan shares its "
                              "buffer with other blobs")
        in_step = self._generation == self.store.generation
        self.store.bind(blob.name, array)
        self._forget(blob)
        self.arrays[blob] = array
        self.external.add(blob)
        if in_step:  # only this blob's buffer went: the other views stay good
            self._generation = self.store.generation

    def release(self, blob: Blob) -> None:
        """Forget a blob's storage (e.g. after its shape changed); re-allocated on use."""
        in_step = self._generation == self.store.generation
        self.store.release(blob.name)
        self._forget(blob)
        self.external.discard(blob)
        if in_step:
            self._generation = self.store.generation

    def _args(self, op: Op) -> tuple[list[Any], list[Any]]:
        args = self._bound.get(op)
        if args is None:
            args = ([self.array(b) for b in op.inputs], [self.array(b) for b in op.outputs])
            self._bound[op] = args
        return args

    # -- running ----------------------------------------------------------------------
    def _execute(self, op: Op, plan: _Plan) -> None:
        loc = plan.where[op]
        activate(loc)  # a GPU op's kernels go to its location's stream
        for p in plan.waits.get(op, ()):
            wait(loc, self._events[p])
        if loc.thread == TRANSFER_THREAD:
            run, ins, outs = self._transfer, [op], []
        else:
            run, (ins, outs) = op.kernel, self._args(op)
        if self.profile:
            t0 = time.perf_counter()
            run(ins, outs)
            if loc.device == "gpu":  # profiled GPU ops run one at a time: the time is the op's
                stream(loc).synchronize()
            self.trace.append(
                TraceEvent(op, t0, time.perf_counter(), threading.current_thread().name))
        else:
            run(ins, outs)
        if op in plan.records:
            self._events[op] = record(loc)

    def _transfer(self, ops: list[Op], _: list) -> None:
        """A Copy op between hosts, on this host's side: send its input, or receive its
        output, named by the op's place in the graph."""
        op = ops[0]
        if self.transport is None:
            raise PurineError(f"op '{op.name}' copies between hosts (MPI ranks) and this "
                              "dispatcher has no transport")
        if not self._tags:  # by name: a net's builds for other shapes name their ops alike
            self._tags = {o.name: i for i, o in enumerate(self.graph.ops)}
        x, y = op.inputs[0], op.outputs[0]
        if x.location.host == self.host:
            self.transport.send(self.array(x), y.location.host, self._tags[op.name])
        else:
            self.transport.receive(self.array(y), x.location.host, self._tags[op.name])

    def _plan(self, ops: Sequence[Op] | None) -> _Plan:
        key = tuple(self.graph.ops if ops is None else ops)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(self.graph, key, self._storage, self.host)
        return plan

    def run_sequential(self, ops: Sequence[Op] | None = None) -> None:
        """Run in program order in the calling thread: the reference schedule."""
        with pass_scope():
            self._run_sequential(ops)

    def _run_sequential(self, ops: Sequence[Op] | None) -> None:
        self._sync()
        plan = self._plan(ops)
        self._fence_in(plan)
        for op in plan.ops:
            try:
                self._execute(op, plan)
            except PurineError as e:
                _name_op(e, op)
                raise
        self._fence_out(plan)

    def _fence_in(self, plan: _Plan) -> None:
        """Order this run's GPU streams after the previous run's work on the other streams
        (the dependencies of one run do not reach into the last): the streams wait for each
        other on the device, the host does not wait."""
        for s in plan.streams:
            for other, event in self._fence.items():
                if other != s:
                    wait(s, event)

    def _fence_out(self, plan: _Plan) -> None:
        self._seen_streams |= plan.streams
        if len(self._seen_streams) > 1:
            self._fence.update({s: record(s) for s in plan.streams})

    def run(self, ops: Sequence[Op] | None = None) -> None:
        """Run the ops (all by default) at their locations' workers, each when its inputs
        are ready; the first failure is raised once the ops in flight have finished."""
        with pass_scope():
            self._run(ops)

    def _run(self, ops: Sequence[Op] | None) -> None:
        self._sync()
        plan = self._plan(ops)
        if len(plan.locations) <= 1:
            # One worker: program order is already an order in which every op is ready.
            self._run_sequential(plan.ops)
            return
        for o in plan.ops:  # storage is allocated here, never by two workers at once
            if plan.where[o].thread == TRANSFER_THREAD:
                self.array(o.inputs[0] if o.inputs[0].location.host == self.host
                           else o.outputs[0])
            else:
                self._args(o)
        self._fence_in(plan)
        execute = functools.partial(self._execute, plan=plan)
        done: queue.SimpleQueue = queue.SimpleQueue()
        remaining = dict(plan.count)
        in_flight = 0
        failure: tuple[Op, BaseException] | None = None

        def submit(o: Op) -> None:
            nonlocal in_flight
            in_flight += 1
            self._worker(plan.where[o]).inbox.put((execute, o, done))

        for o in plan.ops:
            if remaining[o] == 0:
                submit(o)
        while in_flight:
            op, err = done.get()
            in_flight -= 1
            if err is not None:
                failure = failure or (op, err)
            if failure is not None:
                continue  # let in-flight ops finish, start nothing new
            for d in plan.dependents[op]:
                remaining[d] -= 1
                if remaining[d] == 0:
                    submit(d)
        if failure is not None:
            op, err = failure
            if isinstance(err, PurineError):
                _name_op(err, op)
            raise err
        self._fence_out(plan)

    def _worker(self, location: Location) -> _Worker:
        w = self._workers.get(location)
        if w is None:
            w = self._workers[location] = _Worker(location)
            w.start()
        return w

    def close(self) -> None:
        for w in self._workers.values():
            w.inbox.put(None)
        self._workers.clear()

    def __del__(self) -> None:
        self.close()


def _name_op(err: PurineError, op: Op) -> None:
    """Prefix a kernel's error with the op that raised it."""
    err.args = (f"op '{op.name}': {err}",) + err.args[1:]
