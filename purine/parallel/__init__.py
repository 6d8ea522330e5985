"""Data parallelism by graph composition: the replicas of a train net are copies of its
graph composed into one graph, each at its own location and reading its own batches. A
replica in the first replica's memory space uses its parameter blobs directly; one in
another memory space (another device) keeps its own copy, refreshed by Copy ops before its
forward pass, and sends its gradients back by Copy ops. Per parameter, an all-reduce op
averages the replicas' gradients as soon as they all exist, and the solver's update ops
follow it. ``DataParallel`` is that rewrite as a scheme of the solver, over MPI ranks too,
and ``build_solver`` the solver constructor that applies it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from purine.caffe.net import TRAIN, Net, NetBuilder
from purine.caffe.solver import Scheme, Solver
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.graph import Blob, Graph, Location, Op, Stateful, kernel
from purine.ops import tensor
from purine.parallel.mpi import Ranks
from purine.parallel.nccl import NcclGroup, nccl_all_reduce_mean, nccl_reduce_mean
from purine.runtime import Dispatcher


def all_reduce_mean(*arrays: Any) -> None:
    """The last array is the first input, updated in place: the mean of all inputs, summed
    in replica order (so the result does not depend on which replica finished first)."""
    *grads, out = arrays
    for g in grads[1:]:
        out += g
    out *= 1.0 / len(grads)


@dataclass
class Replicas:
    """Replicas 1..N-1 of a train net, composed into replica 0's graph."""

    count: int
    pass_ops: list[Op] = field(default_factory=list)     # their forward and backward ops
    reduce_ops: list[Op] = field(default_factory=list)   # one all-reduce per parameter
    loss_tops: list[tuple[Blob, float]] = field(default_factory=list)
    stateful: dict[str, Stateful] = field(default_factory=dict)
    server: Location = field(default_factory=Location)  # where reduce and update ops run


def replicate(net: Net, param: pb.NetParameter, count: int, *, level: int = 0,
              stages: tuple[str, ...] = (), seed: int = 0, first: int = 0,
              total: int | None = None, locations: list[Location] | None = None,
              nccl: NcclGroup | None = None) -> Replicas:
    """Compose ``count - 1`` more replicas of ``net`` (replica 0, built with
    ``replica=(first, total)`` and seed ``seed + first``) into its graph. Replica r runs at
    worker thread r; the all-reduce and (by the solver) the update ops run at thread
    ``count``. Across MPI ranks, local replica r is replica ``first + r`` of ``total``
    (default ``count``): its data, seed and state keys are those of that global replica, so
    R ranks of N replicas read, draw and snapshot as R*N replicas in one process do.
    ``locations[r - 1]`` places replica r elsewhere (e.g. Location("gpu", r)). ``nccl``, a
    group spanning MPI ranks, reduces the gradients across them too: over its GPUs when the
    replicas have one GPU each, after the local all-reduce when they share this rank's GPU."""
    graph, builder = net.graph, net.builder
    total = count if total is None else total
    out = Replicas(count, server=Location(builder.location.device, builder.location.index,
                                          count, builder.location.host))
    devices = [builder.location.index] + [loc.index for loc in locations or []]
    use_nccl = (builder.location.device == "gpu" and (bool(locations) or nccl is not None)
                and all(loc.device == "gpu" for loc in locations or [])
                and len(set(devices)) == count)
    if nccl is not None and nccl.devices != (devices if use_nccl else devices[:1]):
        raise PurineError(f"the NCCL group's GPUs {nccl.devices} are not the replicas' "
                          f"{devices}")
    masters = {p.name: p for p in builder.learnable_params}
    grads: dict[str, list[Blob]] = {name: [builder.param_grad(p)] for name, p in masters.items()}
    for r in range(1, count):
        loc = Location(builder.location.device, builder.location.index, r,
                       builder.location.host)
        if locations:
            loc = locations[r - 1]
        shared = loc.memory == builder.location.memory
        g = first + r
        b = NetBuilder(param, TRAIN, level=level, stages=stages, seed=seed + g, location=loc,
                       replica=(g, total), dtype=builder.dtype)
        own_grads = {p.name: b.param_grad(p) for p in b.learnable_params}
        # Parameters the forward pass writes (BatchNorm's statistics) stay each replica's
        # own, as on Caffe's GPUs: the first replica's are the ones kept.
        bound = {p.name for p in b.learnable_params if shared and not b.graph.writers(p)}
        start = len(graph.ops)
        mapped = graph.compose(b.graph, f"replica{r}/",
                               bind={name: masters[name] for name in bound})
        replica_ops = graph.ops[start:]
        if builder.storage is not None:  # the replica's kept state lives in the merged graph
            b.storage = lambda blob, m=mapped, arrays=builder.storage: arrays(m[blob.name])
        # Weights not bound are broadcast in; gradients from another memory come home.
        out.pass_ops += [graph.op(f"replica{r}/pull/{name}", "Copy", [masters[name]],
                                  [mapped[name]], kernel(tensor.copy), loc)
                         for name in own_grads if name not in bound]
        out.pass_ops += replica_ops
        for name, grad in own_grads.items():
            grad = mapped[grad.name]
            if use_nccl:  # reduced where it is, by NCCL (below)
                grads[name].append(grad)
                continue
            if not shared:
                home = graph.blob(f"replica{r}/{name}@diff@home", grad.shape, grad.dtype,
                                  out.server)
                out.pass_ops.append(graph.op(f"replica{r}/push/{name}", "Copy", [grad],
                                             [home], kernel(tensor.copy), out.server))
                grad = home
            grads[name].append(grad)
        out.loss_tops += [(mapped[t.name], w) for t, w in b.loss_tops]
        out.stateful.update({f"replica{g}/{k}": s for k, s in b.stateful.items()})
    if use_nccl:
        out.reduce_ops = nccl_reduce_ops(graph, grads, nccl or NcclGroup(devices), out.server)
        return out
    order = backward_order(graph, grads)  # before the all-reduce ops write the gradients too
    for name, gs in grads.items():
        out.reduce_ops.append(graph.op(f"all_reduce/{name}", "AllReduceMean", gs, [gs[0]],
                                       kernel(all_reduce_mean), out.server))
    if nccl is not None:  # the replicas share this rank's GPU: their mean goes across ranks
        out.reduce_ops += nccl_reduce_ops(graph, {n: gs[:1] for n, gs in grads.items()}, nccl,
                                          out.server, order)
    return out


def backward_order(graph: Graph, grads: dict[str, list[Blob]]) -> list[str]:
    """The parameters in the order the backward pass writes replica 0's gradients (the last
    writer's position in the graph; never written first)."""
    position = {b: i for i, o in enumerate(graph.ops) for b in o.outputs}
    return sorted(grads, key=lambda name: position.get(grads[name][0], -1))


def nccl_reduce_ops(graph: Graph, grads: dict[str, list[Blob]], group: NcclGroup,
                    server: Location, order: list[str] | None = None) -> list[Op]:
    """Per local GPU j of ``group`` (gradients ``grads[name][j]``), one NCCL op per gradient
    at a communication stream of that GPU, chained in ``order`` (default: the backward
    pass's), so every GPU issues the same collectives in the same order. In one process
    the op reduces to GPU 0 (NcclReduceMean); across ranks it all-reduces over every rank's
    GPUs (NcclAllReduceMean). GPU 0's ops run at ``server``, where the update ops follow."""
    order = backward_order(graph, grads) if order is None else order
    if group.across_ranks:
        kind, verb, fn = "NcclAllReduceMean", "all_reduce", nccl_all_reduce_mean
    else:
        kind, verb, fn = "NcclReduceMean", "reduce", nccl_reduce_mean
    ops: list[Op] = []
    for j, device in enumerate(group.devices):
        loc = server if j == 0 else Location("gpu", device, server.thread, server.host)
        token = graph.blob(f"nccl/token{j}", (1,), "float32", loc)
        run = kernel(fn, group=group, local=j)
        for name in order:
            g = grads[name][j]
            ops.append(graph.op(f"nccl/{verb}{j}/{name}", kind, [g, token], [g, token], run,
                                loc))
    return ops


class DataParallel(Scheme):
    """``replicas`` data-parallel replicas in this process (``locations[r - 1]`` places
    replica r); with ``comm``, an mpi4py communicator of R ranks (every rank building its
    solver alike), this rank's replicas are k*N .. k*N+N-1 of R*N. Then rank 0 alone tests
    and writes snapshots (snapshot() is collective: every rank's data cursors go into rank
    0's .solverstate, keyed by global replica), and every rank restores from the same files."""

    def __init__(self, replicas: int = 1, comm: Any = None,
                 locations: list[Location] | None = None):
        super().__init__()
        self.count, self.locations = replicas, locations
        self.mpi = Ranks(comm, replicas) if comm is not None and comm.size > 1 else None
        self.replicas: Replicas | None = None
        if self.mpi:
            self.first, self.total, self.root = self.mpi.first, self.mpi.total, self.mpi.is_root
            self.description = f"{self.mpi.total} replicas over MPI ranks"
        else:
            self.total = replicas
            if replicas > 1:
                self.description = f"{replicas} data-parallel replicas"
        self.concurrent = replicas > 1

    def rewrite(self, solver: Solver, param: pb.NetParameter, level: int,
                stages: tuple[str, ...]) -> None:
        """The other replicas join the net's graph with the gradient all-reduce; over MPI,
        the exchange ops follow (on GPUs, NCCL ops over every rank's GPUs instead), and
        every rank starts from rank 0's weights."""
        net, b = solver.net, solver.net.builder
        here = b.location
        group = self._nccl_group(here) if self.mpi and here.device != "cpu" else None
        if self.count > 1:
            r = self.replicas = replicate(net, param, self.count, level=level, stages=stages,
                                          seed=solver.seed, first=self.first, total=self.total,
                                          locations=self.locations, nccl=group)
            self.server = r.server
            self.pass_ops += r.pass_ops + r.reduce_ops
            self.keep |= {t for t, _ in r.loss_tops}
            self.stateful.update(r.stateful)
        if self.mpi:  # the exchange runs where the update ops will, off the net's threads
            self.server = self.server or Location(here.device, here.index, b.threads, here.host)
            if group is None:
                self.mpi.build(net.graph, [b.param_grad(w) for w in b.learnable_params
                                           if w.meta["lr_mult"] != 0], self.server)
                self.pass_ops += self.mpi.ops
            elif self.count == 1:  # one GPU, one replica: its gradients go straight across
                grads = {w.name: [b.param_grad(w)] for w in b.learnable_params}
                self.pass_ops += nccl_reduce_ops(net.graph, grads, group, self.server)
            self.mpi.broadcast([net.dispatcher.array(w) for w in b.learnable_params])
            # One replica per rank on the CPU: the exchange reads the gradients by name, so
            # the net may be built again for other shapes, each rank's own at each pass.
            self.shapes_may_change = self.count == 1 and group is None

    def _nccl_group(self, here: Location) -> NcclGroup:
        """This rank's GPUs in one NCCL communicator with every other rank's (collective):
        the replicas' GPUs when each has its own, else this rank's one GPU, where the
        replicas' mean is taken before it goes across."""
        assert self.mpi is not None
        others = self.locations or []
        devices = [here.index] + [loc.index for loc in others]
        if any(loc.device != "gpu" for loc in others) or (
                len(set(devices)) not in (1, len(devices))):
            where = ", ".join(str(loc) for loc in [here, *others])
            raise PurineError(f"GPUs across MPI ranks need each replica on its own GPU or all "
                              f"on one; got {where}")
        return NcclGroup(devices if len(set(devices)) > 1 else devices[:1], self.mpi.comm)

    def loss(self, loss: Any, dispatcher: Dispatcher) -> Any:
        if self.replicas:
            other = sum(w * float(dispatcher.array(t).sum()) for t, w in self.replicas.loss_tops)
            loss = (float(loss) + other) / self.replicas.count
        return self.mpi.mean(float(loss)) if self.mpi else loss

    def agree(self, action: str) -> str:
        return self.mpi.agree(action) if self.mpi else action

    def gather_state(self, private: dict) -> dict | None:
        return self.mpi.gather_state(private) if self.mpi else private

    def gather_trace(self, events: list[dict]) -> list[dict] | None:
        return self.mpi.gather_trace(events) if self.mpi else super().gather_trace(events)


def scheme_for(*, replicas: int = 1, comm: Any = None,
               replica_locations: list[Location] | None = None, placement: Any = None,
               staleness: int | None = None) -> Scheme:
    """The scheme ``build_solver``'s keywords name: ``ModelParallel(placement, ...)`` with a
    placement (a placement file or locations by layer name; with replicas, the hybrid),
    ``Downpour(replicas, staleness)`` with a staleness (asynchronous replicas in this
    process), else ``DataParallel(replicas, comm, replica_locations)``."""
    if placement is not None:
        from purine.parallel.model_parallel import ModelParallel

        return ModelParallel(placement, replicas, replica_locations, comm)
    if staleness is not None:
        from purine.parallel.async_ps import Downpour

        return Downpour(replicas, staleness)
    return DataParallel(replicas, comm, replica_locations)


def build_solver(source: str | os.PathLike | pb.SolverParameter, *, replicas: int = 1,
                 comm: Any = None, replica_locations: list[Location] | None = None,
                 placement: Any = None, staleness: int | None = None,
                 **kwargs: Any) -> Solver:
    """``Solver(source, **kwargs)`` training with the scheme ``scheme_for`` gives for the
    other keywords: data parallelism, model parallelism (``placement``) or asynchronous
    replicas (``staleness``)."""
    return Solver(source, scheme=scheme_for(replicas=replicas, comm=comm,
                                            replica_locations=replica_locations,
                                            placement=placement, staleness=staleness),
                  **kwargs)
