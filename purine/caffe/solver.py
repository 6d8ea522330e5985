"""Caffe's solvers as graph ops, and the training loop around them.

The update is a subgraph appended to the train net's graph: an op turns the iteration blob
into the learning-rate blob; per learnable parameter, ops clip, normalise, regularise and
apply Caffe's update rule in place; a last op advances the iteration. One dispatcher run of
forward + backward + update ops is one iteration, so a parameter's update can start as soon
as its gradient exists.
"""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from purine.backend import assign, is_device_array, one_blas_thread, to_host
from purine.backend.onednn import pass_scope
from purine.caffe.net import TEST, TRAIN, Net, NetBuilder, close_all
from purine.caffe.setup_log import debug_string
from purine.caffe.update import TrainOps, build_update, lr_params
from purine.errors import ProtoError, PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import Chunks, atomic_write, stale_temporaries
from purine.formats.hdf5_snapshot import (
    INSTALL_HINT,
    SolverStateH5,
    have_h5py,
    read_state,
    write_state,
)
from purine.formats.prototxt import parse_text, read_message, read_net
from purine.formats.solverstate import PRIVATE_STATE_FIELD as PRIVATE_STATE_FIELD  # re-exported
from purine.formats.solverstate import (
    encode_solverstate,
    field_where,
    h5_where,
    history_array,
    parse_private,
    read_solverstate,
    state_problem,
)
from purine.formats.solverstate import snapshot_seed as snapshot_seed  # re-exported
from purine.formats.upgrade import upgrade_solver
from purine.graph import CPU, Blob, Location, Op, Stateful
from purine.log import get_logger
from purine.ops import solver as so
from purine.runtime import Dispatcher


class DivergenceError(PurineError):
    """The loss became NaN or infinite."""


def read_solver(source: str | os.PathLike | pb.SolverParameter) -> pb.SolverParameter:
    """A SolverParameter from a path, a prototxt string or a message; the legacy
    ``solver_type`` enum becomes the ``type`` string, as Caffe's upgrade does."""
    if isinstance(source, pb.SolverParameter):
        param = pb.SolverParameter()
        param.CopyFrom(source)
    elif isinstance(source, str) and not os.path.exists(source) and "\n" in source:
        param = parse_text(source, pb.SolverParameter())
    else:
        param = read_message(source, pb.SolverParameter())
    where = "solver " + (os.fspath(source) if isinstance(source, str | os.PathLike)
                         and "\n" not in os.fspath(source) else "(prototxt text)")
    param = upgrade_solver(param, where)
    kind = so.SOLVER_TYPES.get(param.type)
    if kind is None:
        raise ProtoError(f"{where}: unknown type '{param.type}'; expected one of "
                         + ", ".join(so.SOLVER_TYPES))
    if param.iter_size < 1:
        raise ProtoError(f"{where}: iter_size must be at least 1, got {param.iter_size}")
    reads = {f for _, f in kind.reads}
    if "momentum" not in reads and param.momentum != 0:
        raise ProtoError(f"{where}: momentum cannot be used with {param.type} (Caffe refuses "
                         f"it too); remove momentum: {param.momentum:g}")
    if "rms_decay" in reads and not 0 <= param.rms_decay < 1:
        raise ProtoError(f"{where}: rms_decay must be in [0, 1), got {param.rms_decay:g}")
    return param


def _resolve(path: str, base: str) -> str:
    """Net paths in a solver are relative to the working directory, as in Caffe; fall back
    to the solver file's directory when that is where the file is."""
    if os.path.isabs(path) or os.path.exists(path) or not base:
        return path
    alt = os.path.join(base, path)
    return alt if os.path.exists(alt) else path


class Scheme:
    """The points where a parallel scheme (purine.parallel) rewrites the solver's training
    graph and joins its loop; the solver knows these points, not the schemes. This base is
    the plain case: one replica in one process. A scheme serves one solver."""

    first = 0            # this process's first replica of ``total``: its seed, data, state keys
    total = 1
    root = True          # this process tests and writes snapshots and traces
    concurrent = False   # replicas run on concurrent workers (then one BLAS thread each)
    # The train net may be built again for other shapes: what the scheme adds reads the
    # parameters' gradients by name only (an all-reduce over ranks), no copy of the net
    # is woven into its graph
    shapes_may_change = False
    server: Location | None = None  # where the update ops run; None: the train net's location

    def __init__(self, description: str | None = None):
        # The replicas woven into the net's graph, in words ("2 data-parallel replicas");
        # given, the train net cannot be rebuilt for new input shapes.
        self.description = description
        self.pass_ops: list[Op] = []    # run after each forward/backward pass of the net
        self.keep: set[Blob] = set()    # blobs read between iterations (no memory sharing)
        self.stateful: dict[str, Stateful] = {}  # other replicas' cursors, by state key

    def rewrite(self, solver: Solver, param: pb.NetParameter, level: int,
                stages: tuple[str, ...]) -> None:
        """Compose the scheme's ops into ``solver.net``'s graph, built from ``param`` at
        ``level`` and ``stages``; runs before the update ops exist."""

    def ready(self, solver: Solver) -> None:
        """The solver is built (nets, update ops, weights): add what needs its update ops,
        or refuse the net; an error here closes the solver."""

    def train(self, solver: Solver, iters: int) -> None:
        """Run ``iters`` iterations of ``solver`` (its ``step``): by default its own loop;
        a parameter server counts pushes instead."""
        solver.loop(iters)

    def iteration(self, solver: Solver) -> Any:
        """One iteration of ``solver`` (what ``loop`` and ``trace_iteration`` run); returns
        its loss."""
        return solver.local_iteration()

    def state_objects(self, solver: Solver) -> dict[str, Stateful]:
        """The objects whose run-time state a snapshot keeps, by state key: replica 0's
        keys bare, replica g's ``replica{g}/...``, test net i's ``test{i}/...``."""
        prefix = f"replica{self.first}/" if self.first else ""
        objects = {prefix + k: s for k, s in solver.net.builder.stateful.items()}
        objects.update(self.stateful)
        for i, net in enumerate(solver.test_nets):  # a test net's data cursor goes on too
            objects.update({f"test{i}/{k}": s for k, s in net.builder.stateful.items()})
        return objects

    def loss(self, loss: Any, dispatcher: Dispatcher) -> Any:  # noqa: ARG002
        """The loss of a pass from the train net's own: averaged over the replicas."""
        return loss

    def agree(self, action: str) -> str:
        """The action (none, snapshot, stop) every process takes after an iteration."""
        return action

    def gather_state(self, private: dict) -> dict | None:
        """The private snapshot state to write; None where this process writes nothing."""
        return private

    def gather_weights(self, solver: Solver) -> None:
        """Bring the parameters and their history to the process that tests and writes
        snapshots, where other processes hold some (a placement over MPI ranks); called on
        every process before tests and snapshots."""

    def gather_trace(self, events: list[dict]) -> list[dict] | None:
        """The trace rows (purine.runtime.trace) to write, from this process's; None where
        this process writes none."""
        return events if self.root else None

    # Model parallelism builds the nets from a rewritten net (layers split into towers) and
    # keeps the files in the user's net's layout: these four points are where it does so.
    def make_net(self, param: pb.NetParameter, **kwargs: Any) -> Net:
        """One of the solver's nets (the train net, each test net)."""
        return Net(param, **kwargs)

    def save_weights(self, net: Net, path: str, hdf5: bool) -> None:
        """Write ``net``'s parameters as a caffemodel (``.h5`` when ``hdf5``)."""
        if hdf5:
            net.save_hdf5(path)
        else:
            net.save(path)

    def load_weights(self, net: Net, path: str) -> None:
        """Copy a caffemodel's parameters into ``net`` by layer name."""
        net.copy_from(path)

    def history_layout(self, params: list[Blob]) -> HistoryLayout:
        """How one history group (an array per parameter in ``params``, the train net's
        learnable parameters) is laid out in a solver state file."""
        return HistoryLayout(params)


@dataclass
class Lap:
    """Where the display's rate counts from: the iteration and time of the last display
    line (or of the step's start), so that rate x time = iterations."""

    it_start: int
    # looked up at each Lap, not bound once: the clock is the module's ``time`` of the moment
    t_start: float = field(default_factory=lambda: time.perf_counter())


class HistoryLayout:
    """A solver state's history group as the train net holds it: ``params`` names and
    shapes the file's entries; ``to_file`` / ``from_file`` convert the arrays."""

    def __init__(self, params: Sequence[Blob]):
        self.params = list(params)

    def to_file(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return arrays

    def from_file(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return arrays


class Solver:
    """``Solver(solver_prototxt)``: the train net, its test nets sharing its weights, the
    update subgraph, and ``step`` / ``solve`` / ``snapshot`` / ``restore``.

    ``scheme`` spreads the training over replicas, processes and locations (purine.parallel's
    ``build_solver(..., replicas=N, comm=..., placement=...)`` makes one): it builds the nets
    and rewrites the train net's graph before the update ops are added, and the loop runs the
    graph it is given. ``dtype``: the nets' float type (float64 for exact comparisons).
    ``update_worker``: the update ops run on a dispatcher worker of their own (the one after
    the net's ``threads``), so a parameter's update overlaps the rest of the backward pass;
    the numbers are the same either way."""

    def __init__(self, source: str | os.PathLike | pb.SolverParameter, *,
                 level: int | None = None, stages: Sequence[str] | None = None,
                 threads: int = 1, log=None, path: str | None = None,
                 scheme: Scheme | None = None, location: Location = CPU,
                 share_memory: bool = False, dtype: str = "float32",
                 update_worker: bool = False):
        self.scheme = scheme = scheme or Scheme()
        self.update_worker = update_worker
        if path is None:
            path = os.fspath(source) if isinstance(source, str | os.PathLike) else ""
            if isinstance(source, str) and not os.path.exists(source) and "\n" in source:
                path = ""  # prototxt text, not a file name
        self.path = path
        self.param = p = read_solver(source)
        self.log = log or get_logger()
        base = os.path.dirname(self.path)
        seed = p.random_seed if p.random_seed >= 0 else int.from_bytes(os.urandom(4), "little")
        self.seed = seed
        if scheme.root:  # Caffe's root solver logs its set-up
            self.log.info("Initializing solver from parameters: \n%s",
                          debug_string(p).removesuffix("\n"))
        train_param, test_params = self._net_params(base)
        # Caffe sets the train net's debug_info to the solver's at every step (on display
        # iterations only), whatever the net's own field says.
        train_param, generic = pb.NetParameter(), train_param  # test nets may share it
        train_param.CopyFrom(generic)
        train_param.debug_info = p.debug_info
        self._check_settings(writes=scheme.root)

        def state(s: pb.NetState) -> tuple[int, list[str]]:
            return (s.level if level is None else level,
                    list(s.stage) if stages is None else list(stages))

        lv, st = state(p.train_state)
        if not scheme.root:
            test_params = []  # Caffe: the root process alone tests
        self.closed = False
        self.test_nets: list[Net] = []
        try:
            if scheme.root:
                self.log.info("%s", self._train_source)
            self.net = scheme.make_net(train_param, phase=TRAIN, level=lv, stages=st,
                                       seed=seed + scheme.first, threads=threads,
                                       replica=(scheme.first, scheme.total),
                                       location=location, dtype=dtype)
            self._check_regularization()
            self.trace_path: str | None = None  # write a Chrome trace of the next iteration
            scheme.rewrite(self, train_param, lv, tuple(st))
            if scheme.description and not scheme.shapes_may_change:
                # replicas' ops are woven into the net's first build
                self.net.frozen = (f"solver {self._where()}: the train net of a solver "
                                   f"training {scheme.description} cannot be built again "
                                   "for other shapes")
            for i, tp in enumerate(test_params):
                s = p.test_state[i] if i < len(p.test_state) else pb.NetState()
                lv, st = state(s)
                self.log.info("Creating test net (#%d) specified by %s", i,
                              self._test_sources[i])
                self.test_nets.append(scheme.make_net(tp, phase=TEST, level=lv, stages=st,
                                                      seed=seed, threads=threads,
                                                      location=location, dtype=dtype))
            self.share_memory = share_memory
            self._iter_host = 0  # the counter blob's value, known without reading a GPU
            self._build_train()
            if scheme.root:
                self.log.info("Solver scaffolding done.")
            self.smoothed: deque[float] = deque(maxlen=max(1, p.average_loss))
            self.requested: Callable[[], str] = lambda: "none"
            self.last_test: list[dict[str, np.ndarray]] = []
            self._load_weights(base)
            scheme.ready(self)
        except BaseException:  # the databases the nets opened so far are free again
            self.close()
            raise

    # -- releasing -----------------------------------------------------------------------
    def close(self) -> None:
        """Close the train net, its replicas' data layers and the test nets: their prefetch
        threads are joined and their databases released when this returns. Closing twice
        does nothing; stepping after it is an error. ``with Solver(...) as solver:`` closes
        on leaving the block."""
        if self.closed:
            return
        self.closed = True
        objects: list[Any] = [n for n in (getattr(self, "net", None), *self.test_nets)
                              if n is not None]
        if objects:
            try:
                objects += self.state_objects().values()  # replicas' cursors too
            except AttributeError:  # a scheme failed to build before it made its replicas
                pass
        close_all(objects)

    def __enter__(self) -> Solver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- settings refused or checked before iteration 0 ----------------------------------
    def _where(self) -> str:
        return self.path or "(prototxt text)"

    def _refuse(self, key: str, why: str) -> ProtoError:
        return ProtoError(f"solver {self._where()}: {key}: {why}")

    def _check_settings(self, writes: bool) -> None:
        """Refuse what this solver would not honour, and what would otherwise fail only
        once used mid-run (Caffe finds some of these at the first update or snapshot).
        ``writes``: this process writes the snapshots (MPI: rank 0 alone)."""
        p = self.param
        if p.snapshot_diff:
            raise self._refuse("snapshot_diff", "true is not supported: snapshots hold the "
                               "parameters' data, not their diffs; remove it or set false")
        if p.average_loss < 1:
            raise self._refuse("average_loss", f"must be at least 1, got {p.average_loss}")
        if p.stepvalue and p.lr_policy != "multistep":  # Caffe ignores them: so do we
            self.log.warning("solver %s: stepvalue is read only by lr_policy \"multistep\"; "
                             "this solver's is \"%s\", so it is ignored", self._where(),
                             p.lr_policy)
        steps = list(p.stepvalue)
        if p.lr_policy == "multistep" and any(b <= a for a, b in zip(steps, steps[1:])):
            # Caffe passes at most one step value per iteration, so out of order or repeated
            # values would change the rate at other iterations than they name.
            raise self._refuse("stepvalue", "values must increase strictly, got "
                               + ", ".join(map(str, steps)))
        try:
            so.rate(it=0, **self.lr_params())  # unknown policy, missing stepsize, ...
        except PurineError as e:
            raise self._refuse("lr_policy", str(e)) from None
        if p.snapshot_format == pb.SolverParameter.HDF5 and not have_h5py():
            raise self._refuse("snapshot_format", f"HDF5 needs the h5py package: {INSTALL_HINT}"
                               " (or use BINARYPROTO, the default)")
        if writes and (p.snapshot or p.snapshot_after_train):
            self._check_snapshot_prefix()

    def _check_snapshot_prefix(self) -> None:
        """Caffe's CheckSnapshotWritePermissions: create and remove a file where the
        snapshots go, so an unwritable prefix fails now, not at the first snapshot."""
        prefix, given = self._prefix(), self.param.snapshot_prefix
        folder = os.path.dirname(prefix) or "."
        if not os.path.isdir(folder):
            raise self._refuse(f"snapshot_prefix '{given}'", f"points into '{folder}', "
                               "which does not exist")
        try:
            fd, probe = tempfile.mkstemp(prefix=os.path.basename(prefix) + ".", dir=folder,
                                         suffix=".tempfile")
        except OSError as e:
            raise self._refuse(f"snapshot_prefix '{given}'", f"cannot write snapshots into "
                               f"'{folder}' ({e.strerror}); give a writable directory") from None
        os.close(fd)
        os.unlink(probe)
        for stale in stale_temporaries(prefix):
            try:
                os.unlink(stale)
            except OSError:
                continue  # another process's, or gone already: nothing of ours is lost
            self.log.info("Removed %s, left by a snapshot that was interrupted", stale)

    def _check_regularization(self) -> None:
        """Caffe's Regularize fails at the first update when a decay applies and the type is
        unknown; refuse that now."""
        p = self.param
        if p.weight_decay and p.regularization_type not in so.REGULARIZATION_TYPES and any(
                w.meta["decay_mult"] for w in self.net.builder.learnable_params):
            raise self._refuse("regularization_type", f"'{p.regularization_type}' is unknown; "
                               f"expected one of {', '.join(so.REGULARIZATION_TYPES)}")

    def _load_weights(self, base: str) -> None:
        """The ``weights`` field: caffemodels (comma-separated, as many fields as given)
        copied by layer name into the train and test nets, in order, as Caffe does."""
        for entry in self.param.weights:
            for path in (w.strip() for w in entry.split(",")):
                if not path:
                    continue
                path = _resolve(path, base)
                self.log.info("Finetuning from %s", path)
                try:
                    for net in [self.net] + self.test_nets:
                        self.scheme.load_weights(net, path)
                except PurineError as e:
                    raise self._refuse("weights", str(e)) from None

    # -- nets ----------------------------------------------------------------------------
    def _net_params(self, base: str) -> tuple[pb.NetParameter, list[pb.NetParameter]]:
        p = self.param
        given = [f for f in ("net", "net_param", "train_net", "train_net_param") if p.HasField(f)]
        if len(given) != 1:
            raise ProtoError(f"solver {self.path or ''}: give exactly one of net, net_param, "
                             f"train_net, train_net_param (found: {', '.join(given) or 'none'})")
        which = given[0]
        if which in ("net", "train_net"):
            train = read_net(_resolve(getattr(p, which), base))
        else:
            train = read_net(getattr(p, which))
        # Where each net comes from, in the words of Caffe's set-up log.
        self._train_source = {
            "net": f"Creating training net from net file: {p.net}",
            "net_param": "Creating training net specified in net_param.",
            "train_net": f"Creating training net from train_net file: {p.train_net}",
            "train_net_param": "Creating training net specified in train_net_param.",
        }[which]
        tests = [read_net(tp) for tp in p.test_net_param]
        tests += [read_net(_resolve(t, base)) for t in p.test_net]
        self._test_sources = (["test_net_param"] * len(p.test_net_param)
                              + [f"test_net file: {t}" for t in p.test_net])
        generic = p.HasField("net") or p.HasField("net_param")
        n_test = len(tests) + (max(0, len(p.test_iter) - len(tests)) if generic else 0)
        self._test_sources += [f"net file: {p.net}" if p.HasField("net") else "net_param"
                               ] * (n_test - len(tests))
        if len(p.test_iter) != n_test:
            raise ProtoError(f"solver {self.path}: {len(p.test_iter)} test_iter values for "
                             f"{n_test} test nets; give one test_iter per test net")
        while len(tests) < n_test:
            tests.append(train)
        if len(p.test_state) not in (0, n_test):
            raise ProtoError(f"solver {self.path}: {len(p.test_state)} test_state values for "
                             f"{n_test} test nets")
        return train, tests

    # -- the train side: update subgraph, test nets' weights, memory plan -----------------
    def _build_train(self) -> None:
        """What the solver adds to the train net's first build: the test nets' weights bound
        to its parameters, the update ops, and the memory plan (``share_memory``); the net
        calls ``_extend`` for each build it makes later, for other shapes."""
        for tn in self.test_nets:
            tn.share_with(self.net)
        self._extend(self.net.builder)
        self.net.extend = self._extend

    def _extend(self, b: NetBuilder) -> None:
        """Add the update ops (and the memory plan) to build ``b`` of the train net."""
        b.train = self._build_update(b)
        if self.share_memory:
            self._share_memory(b)

    # The update of the train net's current build (the latest whole one, where the current
    # stops short of a layer still to settle its shapes).
    def _train(self) -> TrainOps:
        b = self.net.builder
        return b.train if b.full else self.net.whole.train

    _it = property(lambda self: self._train().it)
    _lr = property(lambda self: self._train().lr)
    updates = property(lambda self: self._train().updates)
    zero_ops = property(lambda self: self._train().zero_ops)
    accumulate_ops = property(lambda self: self._train().accumulate_ops)
    update_ops = property(lambda self: self._train().update_ops)

    def _build_update(self, b: NetBuilder) -> TrainOps:
        """The update subgraph of build ``b`` (purine.caffe.update), at the scheme's server,
        else at the net's location (on a worker of its own with ``update_worker``)."""
        loc = self.scheme.server or b.location
        if self.update_worker and not self.scheme.server:
            loc = Location(loc.device, loc.index, b.threads, loc.host)
        return build_update(b.graph, b.learnable_params, b.param_grad, self.param, loc)

    def lr_params(self) -> dict:
        """The solver's learning-rate policy settings, as ``purine.ops.solver.rate`` reads
        them."""
        return lr_params(self.param)


    # -- state ---------------------------------------------------------------------------
    @property
    def iter(self) -> int:
        return self._iter_host

    @iter.setter
    def iter(self, value: int) -> None:
        assign(self.net.dispatcher.array(self._it), value)
        self._iter_host = int(value)

    @property
    def lr(self) -> float:
        return so.rate(it=self.iter, **self.lr_params())

    def _share_memory(self, b: NetBuilder) -> None:
        """Let the blobs of build ``b`` of the train net whose lifetimes in an iteration
        never overlap share buffers (purine.runtime.memory). What outlives an iteration
        keeps its own array: parameters (every replica's), solver history, the iteration and
        rate blobs, the loss tops and outputs read between iterations, and blobs bound to
        outside storage; so do the blobs of the layers before the last that settles its
        shapes in a pass, which another build may go on from. The plan covers every run
        ``local_iteration`` makes: with iter_size > 1 the passes are a loop between the zeroing
        and the update."""
        from purine.runtime.memory import plan_memory

        net, d, t = self.net, b.dispatcher, b.train
        passes = b.forward_all + b.backward_all + self.scheme.pass_ops + t.accumulate_ops
        ops = t.zero_ops + passes + t.update_ops
        loops = [(len(t.zero_ops), len(t.zero_ops) + len(passes))]
        if self.param.iter_size == 1:
            loops = []
        keep = {x for x in b.graph.blobs.values() if "lr_mult" in x.meta}
        keep |= {h for u in t.updates for h in u.history} | {t.it, t.lr}
        keep |= {x for x, _ in b.loss_tops} | self.scheme.keep
        if self.scheme.pass_ops:  # the scheme's ops, on the first build, read them by name
            keep |= {b.param_grad(w) for w in b.learnable_params}
        keep |= {b.data[n] for n in net.outputs if n in b.data}
        keep |= {x for x in b.graph.blobs.values() if x.name in d.store.external}  # bound
        # iter_size's accumulators: the passes of one iteration may run in several builds
        keep |= {x for op in t.zero_ops for x in op.outputs}
        # The layers up to the last one settling its shapes in the middle of a pass (a data
        # layer's settle before any op runs)
        mid = [c for c in net._cuts if net._settlers[c].reads_bottoms]
        keep |= {x for L in b.layers[:max(mid, default=-1) + 1] for op in L.forward_ops
                 for x in op.inputs + op.outputs}
        plan = plan_memory(b.graph, ops, keep, loops)
        d.set_memory_plan(plan)
        if b is net.builder:  # the first build's (the solver is being built), not others'
            self.log.info(plan.summary())

    # -- running -------------------------------------------------------------------------
    def pass_ops(self) -> list[Op]:
        """One forward/backward pass of the net, then the scheme's ops (the other replicas'
        passes, the gradient all-reduce)."""
        return self.net._forward_ops + self.net._backward_ops + self.scheme.pass_ops

    def _pass_loss(self) -> Any:
        """The pass's loss; on a GPU a 0-d device array, so the host need not wait for the
        pass to finish (it is read when the display needs it)."""
        return self.scheme.loss(self.net.loss_value(), self.net.dispatcher)


    def iteration(self) -> Any:
        """One iteration as the scheme runs it (by default ``local_iteration``); returns
        its loss."""
        return self.scheme.iteration(self)


    def local_iteration(self) -> Any:
        """One iteration: iter_size forward/backward passes, then the update. Returns the
        loss averaged over the passes (and replicas). A pass settles its shapes as it goes
        (Net._pass); its backward pass and what follows run in the build it ends in."""
        net, n = self.net, self.param.iter_size
        last = len(net.layer_names) - 1
        loss = 0.0
        if n == 1:
            net._pass(0, last, lambda: (net._backward_ops + self.scheme.pass_ops
                                        + self.update_ops))
            self._iter_host += 1
            return self._pass_loss()
        net.dispatcher.run(self.zero_ops)
        for _ in range(n):
            net._pass(0, last, lambda: (net._backward_ops + self.scheme.pass_ops
                                        + self.accumulate_ops))
            loss = loss + self._pass_loss()
        net.dispatcher.run(self.update_ops)
        self._iter_host += 1
        return loss / n

    def count_update(self) -> None:
        """Count an iteration whose update ops a scheme ran itself (a parameter server's
        push): the counter blob advanced, and the host's copy of it follows."""
        self._iter_host += 1

    def apply_update(self) -> None:
        """Caffe's Solver::ApplyUpdate: update the weights from the gradients the train net
        holds now (its parameters' diffs, as a backward pass leaves them), at the current
        iteration's rate, with weight decay, clipping and the solver's history; the
        iteration does not advance (``step`` does)."""
        t = self._train()
        ops = [o for o in t.update_ops if o.name != "solver/next_iter"]
        if self.param.iter_size > 1:  # the accumulators take the one set of gradients
            ops = t.zero_ops + t.accumulate_ops + ops
        self.net.dispatcher.run(ops)

    def trace_iteration(self, path: str | os.PathLike) -> float:
        """Run one iteration with the dispatcher's profiler on and write its Chrome trace;
        returns the iteration's loss."""
        from purine.data import prefetch
        from purine.runtime.trace import SPANS, trace_rows, write_chrome_trace

        net = self.net
        net.profile(True)
        SPANS.start()
        try:
            with prefetch.recording(SPANS):  # the data threads' spans join the ops' events
                loss = self.iteration()
        finally:
            events = net.profile(False)
            spans = SPANS.stop()
        # The parameter server: where update ops ran and the train net's own pass did not
        # (a replicas' all-reduce thread, the async server).
        forward = {op for b in net.builds() for op in b.forward_all}
        passed = {e.op.location for e in events if e.op in forward}
        servers = {o.location for o in self.update_ops} - passed
        rows = self.scheme.gather_trace(trace_rows(events, spans, servers))  # collective
        if rows is not None:
            write_chrome_trace(rows, path)
            self.log.info("Wrote the trace of iteration %d to %s", self.iter - 1, path)
        return loss

    def step(self, iters: int) -> None:
        """Train ``iters`` iterations (the scheme's: pushes, for a parameter server)."""
        if self.closed:
            raise PurineError(f"solver {self._where()} is closed: its nets' data sources are "
                              "released; build a new solver to train again")
        self.net.reshape_if_needed()  # an input blob reshaped: the train side is rebuilt
        # One scope for all the iterations: each pass's own would switch OpenBLAS's thread
        # count twice per pass (waiting for its threads, 0.2 ms on LeNet's 30 ms).
        with one_blas_thread() if self.scheme.concurrent else nullcontext(), pass_scope():
            self.scheme.train(self, iters)

    def loop(self, iters: int) -> None:
        """``iters`` iterations in this thread, each with what surrounds it (``iterate``);
        the first of them is traced when ``trace_path`` is set."""
        stop, lap = self.iter + iters, Lap(self.iter)
        while self.iter < stop:
            action = self.iterate(self._traced_or_plain_iteration, lap)
            if action == "stop":
                self.stopped_early = True
                break

    def _traced_or_plain_iteration(self) -> Any:
        """``iteration()``, traced to ``trace_path`` once when one is set (``--trace``)."""
        if not self.trace_path:
            return self.iteration()
        path, self.trace_path = self.trace_path, None
        return self.trace_iteration(path)

    def iterate(self, iteration: Callable[[], Any], lap: Lap,
                outputs: dict[str, np.ndarray] | None = None, who: str = "") -> str:
        """``iteration()`` (it returns the loss) with what Caffe does around one: the tests
        due first; then the loss check, the display line (``outputs``: the train outputs
        shown, by default the net's; ``who`` joins the iteration in an error), the
        scheduled snapshot and the requested action, which is returned once a requested
        snapshot is written."""
        p, log = self.param, self.log
        if p.test_interval and self.iter % p.test_interval == 0 and (
                self.iter > 0 or p.test_initialization):
            self.test_all()
        display = p.display and self.iter % p.display == 0
        if self.net.builder.debug:
            self.net.builder.debug.on = bool(display)
        loss = iteration()
        it = self.iter - 1  # the update op advanced the counter
        if not is_device_array(loss):  # a GPU's loss is checked when it is displayed
            _check_finite(float(loss), it, who)
        self.smoothed.append(loss)
        if display:
            _check_finite(float(loss), it, who)
            # The iterations run since the last line (or since this step began: the
            # first line, the first after a resume), so that rate x time = iterations.
            lapse, done = time.perf_counter() - lap.t_start, it + 1 - lap.it_start
            per_s = done / lapse if lapse > 0 else 0.0
            log.info("Iteration %d (%g iter/s, %.3fs/%d iters), loss = %g", it, per_s,
                     lapse, done, sum(float(v) for v in self.smoothed) / len(self.smoothed))
            lap.t_start, lap.it_start = time.perf_counter(), it + 1
            self._log_outputs(self.net, "Train", outputs)
            log.info("Iteration %d, lr = %g", it, so.rate(it=it, **self.lr_params()))
        if p.snapshot and self.iter % p.snapshot == 0:
            self.snapshot()
        action = self.scheme.agree(self.requested())
        if action == "snapshot":
            self.snapshot()
        return action

    def solve(self, resume: str | None = None) -> None:
        p, log = self.param, self.log
        self.stopped_early = False
        log.info("Solving %s", self.net.model.name)
        log.info("Learning Rate Policy: %s", p.lr_policy)
        if resume:
            log.info("Restoring previous solver status from %s", resume)
            self.restore(resume)
        self.step(p.max_iter - self.iter)
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
            self.snapshot()
        if self.stopped_early:
            log.info("Optimization stopped early.")
            return
        if p.display and self.iter % p.display == 0:
            self.net.forward()
            log.info("Iteration %d, loss = %g", self.iter, self.net.loss)
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        log.info("Optimization Done.")

    def _log_outputs(self, net: Net, kind: str, values: dict[str, np.ndarray] | None) -> None:
        weights = {b.name: w for b, w in net.builder.loss_tops}  # by name: any build
        k = 0
        for name in net.outputs:
            data = values[name] if values is not None else net.blobs[name].data
            w = weights.get(net.builder.data[name].name, 0.0)
            for v in np.ravel(to_host(data)):
                extra = f" (* {w:g} = {w * float(v):g} loss)" if w else ""
                self.log.info("    %s net output #%d: %s = %g%s", kind, k, name, float(v), extra)
                k += 1

    def test_all(self) -> list[dict[str, np.ndarray]]:
        self.scheme.gather_weights(self)
        self.last_test = [self.test(i) for i in range(len(self.test_nets))]
        return self.last_test

    def test(self, i: int) -> dict[str, np.ndarray]:
        p, net = self.param, self.test_nets[i]
        self.log.info("Iteration %d, Testing net (#%d)", self.iter, i)
        sums: dict[str, np.ndarray] = {}
        loss = 0.0
        for _ in range(p.test_iter[i]):
            out = net.forward()
            if p.test_compute_loss:
                loss += net.loss
            for name, v in out.items():
                sums[name] = sums.get(name, 0) + to_host(v).astype(np.float64)
        n = p.test_iter[i]
        means = {k: v / n for k, v in sums.items()}
        if p.test_compute_loss:  # 0 / 0 over zero batches is NaN, as Caffe logs it
            self.log.info("Test loss: %g", loss / n if n else math.nan)
        if n > 0:  # no batches (test_iter 0 or less): no output line, as in Caffe
            self._log_outputs(net, "Test", means)
        return means

    # -- snapshots -----------------------------------------------------------------------
    def _prefix(self) -> str:
        prefix = self.param.snapshot_prefix
        if not prefix:
            prefix = os.path.splitext(self.path)[0] if self.path else "purine"
        return prefix

    def snapshot(self) -> tuple[str, str]:
        hdf5 = self.param.snapshot_format == pb.SolverParameter.HDF5
        base = f"{self._prefix()}_iter_{self.iter}"
        ext = ".h5" if hdf5 else ""
        model, state = base + ".caffemodel" + ext, base + ".solverstate" + ext
        self.scheme.gather_weights(self)  # MPI: collective
        private = self.scheme.gather_state(self._private_state())  # MPI: collective
        if private is None:  # another process writes
            return model, state
        if hdf5:
            self._snapshot_hdf5(model, state, private)
            return model, state
        self.log.info("Snapshotting to binary proto file %s", model)
        self.scheme.save_weights(self.net, model, hdf5=False)
        self.log.info("Snapshotting solver state to binary proto file %s", state)
        atomic_write(state, self.encode_state(model, private))
        return model, state

    def _snapshot_hdf5(self, model: str, state: str, private: dict) -> None:

        self.log.info("Snapshotting to HDF5 file %s", model)
        self.scheme.save_weights(self.net, model, hdf5=True)
        self.log.info("Snapshotting solver state to HDF5 file %s", state)
        write_state(state, SolverStateH5(
            iter=self.iter, learned_net=model, current_step=self._current_step(),
            history=self._history_arrays(),
            private=json.dumps(private)))

    def _history(self) -> list[Blob]:
        """Caffe's history order: every learnable parameter's first history blob, then
        every one's second (AdaDelta, Adam)."""
        n = len(self.updates[0].history) if self.updates else 0
        return [u.history[k] for k in range(n) for u in self.updates]

    def _history_arrays(self) -> list[np.ndarray]:
        """The history as a solver state file holds it (the scheme's layout), in Caffe's
        order."""
        d, layout = self.net.dispatcher, self._history_layout()
        n = len(self.updates[0].history) if self.updates else 0
        return [a for k in range(n) for a in layout.to_file(
            [to_host(d.array(u.history[k])) for u in self.updates])]

    def _history_layout(self) -> HistoryLayout:
        return self.scheme.history_layout([u.param for u in self.updates])

    def encode_state(self, model_path: str, private: dict | None = None) -> Chunks:
        """This solver's binary .solverstate naming ``model_path`` as its learned net."""
        private = self._private_state() if private is None else private
        return encode_solverstate(self.iter, model_path, self._current_step(),
                                  self._history_arrays(), private)

    def _private_state(self) -> dict:
        """What Caffe's SolverState has no field for: the train net's run-time state (how
        far each random stream and data cursor has gone), by layer."""
        return {"seed": self.seed,
                "stateful": {k: s.state() for k, s in self.state_objects().items()}}

    def state_objects(self) -> dict[str, Stateful]:
        """The objects whose run-time state a snapshot keeps, by key (the scheme's)."""
        return self.scheme.state_objects(self)


    def _private_plan(self, payload: str | bytes, where: str) -> list[tuple[str, Any, dict]]:
        """(key, object, state) for each entry of a private state that an object of this
        solver receives, all checked against the schema before any is restored; ``where``
        names the file and field in an error. Keys no object here has are left out (another
        run's replicas or test nets), as Caffe leaves out unknown fields."""
        objects = self.state_objects()
        plan = []
        for key, value in parse_private(payload, where)["stateful"].items():
            obj = objects.get(key)
            if obj is None:
                continue
            want = obj.state()
            # {}: what an object writes when it keeps nothing (a recurrent layer's state in
            # a net no dispatcher runs); its restore decides what to do with it.
            problem = state_problem(want, value) if want and value else None
            if problem:
                raise PurineError(f"{where}: '{key}': {problem}")
            plan.append((key, obj, value))
        return plan

    @staticmethod
    def _restore_plan(plan: list[tuple[str, Any, dict]], where: str) -> None:
        """Hand each checked state to its object; a value its restore refuses (a cursor
        below 0, bytes that are not an array) is an error naming the file and key."""
        for key, obj, value in plan:
            try:
                obj.restore(value)
            except KeyError as e:
                raise PurineError(f"{where}: '{key}': the state lacks {e}") from None
            except (PurineError, ValueError, TypeError, OverflowError, IndexError) as e:
                raise PurineError(f"{where}: '{key}': refused: {e}") from None

    def _restore_history(self, where: str, it: int, learned_net: str, history: Sequence,
                         noun: str, fit: Callable[[int, Any, Blob], np.ndarray]) -> None:
        """What either snapshot format restores after the private state: the learned net,
        the solver's history (``fit(k, value, blob)`` checks the k-th stored value against
        its blob and gives the array to assign) and the iteration."""
        if it < 0:  # Caffe never writes one; the lr policies have no value there
            raise PurineError(f"{where}: iter is {it}; a solver state's iteration must be 0 "
                              "or more")
        if learned_net:
            self.scheme.load_weights(self.net, learned_net)
        layout, hist = self._history_layout(), self._history()
        m = len(layout.params)
        need = len(hist) // len(self.updates) * m if self.updates else 0
        if len(history) != need:
            raise PurineError(f"{where}: {len(history)} history {noun}, the "
                              f"'{self.param.type}' solver of this net needs {need}")
        arrays = [fit(k, value, layout.params[k % m]) for k, value in enumerate(history)]
        d, n = self.net.dispatcher, len(self.updates)
        for g in range(need // m if m else 0):  # each history group: one per parameter
            group = layout.from_file(arrays[g * m:(g + 1) * m])
            for h, a in zip(hist[g * n:(g + 1) * n], group, strict=True):
                if self.net.host is None or h.location.host == self.net.host:
                    assign(d.array(h), a)  # (another rank's history is that rank's to keep)
        self.iter = it

    def _current_step(self) -> int:
        p = self.param
        if p.lr_policy == "step" and p.stepsize:
            return self.iter // p.stepsize
        if p.lr_policy == "multistep":
            return sum(1 for s in p.stepvalue if self.iter >= s)
        return 0

    def restore(self, path: str | os.PathLike) -> None:
        """Resume from a .solverstate or, when the name ends in .h5 (Caffe's test), a
        .solverstate.h5 (ours or Caffe's: Caffe's has no private state, and then the random
        streams start over, as Caffe's do)."""
        if os.fspath(path).endswith(".h5"):
            self._restore_hdf5(path)
            return
        path = os.fspath(path)
        state, payloads = read_solverstate(path)
        where = field_where(path)
        plans = [self._private_plan(payload, where) for payload in payloads]
        for plan in plans:
            self._restore_plan(plan, where)

        def fit(k: int, blob: pb.BlobProto, h: Blob) -> np.ndarray:
            return history_array(path, k, blob, h.name, h.count).reshape(h.shape)

        self._restore_history(path, state.iter, state.learned_net, state.history, "blobs", fit)

    def _restore_hdf5(self, path: str | os.PathLike) -> None:

        path = os.fspath(path)
        # Counted and shaped as _restore_history fits them, checked before a value is read.
        layout = self._history_layout()
        m = len(layout.params)
        need = len(self._history()) // len(self.updates) * m if self.updates else 0
        state = read_state(path, [(layout.params[k % m].name, layout.params[k % m].shape)
                                  for k in range(need)],
                           f"the '{self.param.type}' solver of this net")
        if state.private is not None:
            where = h5_where(path)
            self._restore_plan(self._private_plan(state.private, where), where)

        def fit(k: int, a: np.ndarray, h: Blob) -> np.ndarray:
            if a.shape != h.shape:
                raise PurineError(f"{path}: history/{k} has shape {a.shape}, parameter "
                                  f"'{h.name}' needs {h.shape}")
            return a

        self._restore_history(path, state.iter, state.learned_net, state.history, "datasets",
                              fit)


def _check_finite(loss: float, it: int, who: str = "") -> None:
    if not math.isfinite(loss):
        raise DivergenceError(f"iteration {it}{who}: the loss is {loss}; training stopped "
                              "(snapshots already written are intact)")


# -- signals -----------------------------------------------------------------------------
class SignalHandler:
    """Caffe's SIGINT / SIGHUP effects (stop, snapshot, none), checked between iterations."""

    def __init__(self, sigint: str = "stop", sighup: str = "snapshot"):
        for v in (sigint, sighup):
            if v not in ("stop", "snapshot", "none"):
                raise PurineError(f"signal effect '{v}': expected stop, snapshot or none")
        self.effects = {signal.SIGINT: sigint, signal.SIGHUP: sighup}
        self.pending: str = "none"
        self._old: dict[int, object] = {}

    def __enter__(self) -> SignalHandler:
        for sig in self.effects:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.pending = self.effects.get(signum, "none")

    def __call__(self) -> str:
        action, self.pending = self.pending, "none"
        return action
