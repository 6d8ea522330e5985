"""Data parallelism by graph composition: the replicas of a train net are copies of its
graph composed into one graph, each at its own location and reading its own batches. A
replica in the first replica's memory space uses its parameter blobs directly; one in
another memory space (another device) keeps its own copy, refreshed by Copy ops before its
forward pass, and sends its gradients back by Copy ops. Per parameter, an all-reduce op
averages the replicas' gradients as soon as they all exist, and the solver's update ops
follow it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from purine.caffe.net import TRAIN, Net, NetBuilder
from purine.formats import caffe_pb2 as pb
from purine.graph import Blob, Location, Op, Stateful, kernel
from purine.ops import tensor


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
              total: int | None = None,
              locations: list[Location] | None = None) -> Replicas:
    """Compose ``count - 1`` more replicas of ``net`` (replica 0, built with
    ``replica=(first, total)`` and seed ``seed + first``) into its graph. Replica r runs at
    worker thread r; the all-reduce and (by the solver) the update ops run at thread
    ``count``. Across MPI ranks, local replica r is replica ``first + r`` of ``total``
    (default ``count``): its data, seed and state keys are those of that global replica, so
    R ranks of N replicas read, draw and snapshot as R*N replicas in one process do.
    ``locations[r - 1]`` places replica r elsewhere (e.g. Location("gpu", r))."""
    graph, builder = net.graph, net.builder
    total = count if total is None else total
    out = Replicas(count, server=Location(builder.location.device, builder.location.index,
                                          count, builder.location.host))
    devices = [builder.location.index] + [loc.index for loc in locations or []]
    use_nccl = (builder.location.device == "gpu" and bool(locations)
                and all(loc.device == "gpu" for loc in locations)
                and len(set(devices)) == count)
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
        out.reduce_ops = _nccl_reduce_ops(graph, grads, devices, out.server)
        return out
    for name, gs in grads.items():
        out.reduce_ops.append(graph.op(f"all_reduce/{name}", "AllReduceMean", gs, [gs[0]],
                                       kernel(all_reduce_mean), out.server))
    return out


def _nccl_reduce_ops(graph, grads: dict[str, list[Blob]], devices: list[int],
                     server: Location) -> list[Op]:
    """Per replica, one NCCL reduce op per gradient at a communication stream of its GPU,
    chained in the order the backward pass writes the gradients (the last writer's position
    in the graph), so every GPU issues the same collectives in the same order."""
    from purine.parallel.nccl import NcclGroup, nccl_reduce_mean

    position = {b: i for i, o in enumerate(graph.ops) for b in o.outputs}
    order = sorted(grads, key=lambda name: position.get(grads[name][0], -1))
    group = NcclGroup(devices)
    ops: list[Op] = []
    for r, device in enumerate(devices):
        loc = server if r == 0 else Location("gpu", device, server.thread, server.host)
        token = graph.blob(f"nccl/token{r}", (1,), "float32", loc)
        for name in order:
            g = grads[name][r]
            ops.append(graph.op(f"nccl/reduce{r}/{name}", "NcclReduceMean", [g, token],
                                [g, token], kernel(nccl_reduce_mean, group=group, rank=r),
                                loc))
    return ops
