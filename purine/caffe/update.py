"""The solver's update subgraph, built from the net's learnable parameters and the solver's
settings: the learning rate from the iteration, per parameter clipping, Normalize,
Regularize and the update rule of purine.ops.solver.SOLVER_TYPES, and the iteration's step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from purine.formats import caffe_pb2 as pb
from purine.graph import Blob, Graph, Location, Op, kernel
from purine.ops import solver as so
from purine.ops import tensor


@dataclass
class ParamUpdate:
    param: Blob
    grad: Blob
    history: list[Blob] = field(default_factory=list)


@dataclass
class TrainOps:
    """What the solver adds to one build of the train net (a build per set of shapes): the
    iteration and rate blobs, the parameters' updates, and the ops. The blobs of all builds
    share their storage by name, so history, accumulated gradients and the iteration carry
    over whichever build runs."""

    it: Blob
    lr: Blob
    updates: list[ParamUpdate]
    zero_ops: list[Op]
    accumulate_ops: list[Op]
    update_ops: list[Op]


def lr_params(p: pb.SolverParameter) -> dict[str, Any]:
    """The keywords of purine.ops.solver.rate / learning_rate from a SolverParameter."""
    return dict(policy=p.lr_policy, base_lr=p.base_lr, gamma=p.gamma, power=p.power,
                stepsize=p.stepsize, stepvalues=tuple(p.stepvalue), max_iter=p.max_iter)


def build_update(g: Graph, params: Sequence[Blob], grad: Callable[[Blob], Blob],
                 p: pb.SolverParameter, loc: Location) -> TrainOps:
    """The update subgraph of ``params`` (whose gradients ``grad`` gives) in ``g``, by the
    settings ``p``. Each parameter's update ops run where the parameter lives: at ``loc``
    (the scheme's server or the net's location) in its memory space, else at the
    parameter's own location (model parallelism). The iteration and rate blobs live once,
    at ``loc``; a Copy op per other memory space feeds them there each iteration (two
    scalars: one counter to snapshot and restore, and no second rate computation to keep in
    step). Gradient clipping sums squares per memory space and sends the sums home."""
    it_blob = g.blob("solver/iter", (), "float64", loc)
    lr_blob = g.blob("solver/lr", (), "float64", loc)
    ops: list[Op] = []

    def op(name: str, fn, ins, outs, at: Location = loc, **params) -> Op:
        kind = "Copy" if fn is tensor.copy else fn.__name__  # the engine's Copy op
        o = g.op(f"solver/{name}", kind, ins, outs, kernel(fn, **params), at)
        ops.append(o)
        return o

    def where(w: Blob) -> Location:
        return loc if w.location.memory == loc.memory else w.location

    def space(at: Location) -> str:
        return "" if at.memory == loc.memory else "@" + str(at).rsplit("/t", 1)[0]

    op("lr", so.learning_rate, [it_blob], [lr_blob], **lr_params(p))
    rule = so.SOLVER_TYPES[p.type]
    n_hist = rule.histories
    updates: list[ParamUpdate] = []
    for w in params:
        u = ParamUpdate(w, grad(w))
        u.history = [g.blob(f"solver/{w.name}@history{k}", w.shape, w.dtype, where(w))
                     for k in range(n_hist)]
        updates.append(u)
    active = [u for u in updates if u.param.meta["lr_mult"] != 0]
    remote: dict[tuple, Location] = {}  # other memory spaces with active parameters
    for u in active:
        if space(where(u.param)):
            remote.setdefault(where(u.param).memory, where(u.param))

    def feed(blob: Blob) -> dict[tuple, Blob]:
        """``blob`` (at the server) and a copy of it in each other memory space."""
        out = {loc.memory: blob}
        for key, at in remote.items():
            out[key] = g.blob(f"{blob.name}{space(at)}", blob.shape, blob.dtype, at)
            op(f"{blob.name.removeprefix('solver/')}{space(at)}", tensor.copy, [blob],
               [out[key]], at=at)
        return out

    lr = feed(lr_blob)
    it = feed(it_blob) if rule.reads_iter else {}

    # iter_size > 1: gradients are summed into accumulators over the passes.
    zero_ops: list[Op] = []
    accumulate_ops: list[Op] = []
    grads = {u.param: u.grad for u in active}
    if p.iter_size > 1:
        for u in active:
            at = where(u.param)
            acc = g.blob(f"solver/{u.param.name}@accumulated", u.param.shape,
                         u.param.dtype, at)
            zero_ops.append(g.op(f"solver/{u.param.name}/zero", "Fill", [], [acc],
                                 kernel(tensor.fill, value=0.0), at))
            accumulate_ops.append(g.op(
                f"solver/{u.param.name}/accumulate", "Accumulate", [u.grad, acc], [acc],
                kernel(tensor.accumulate), at))
            grads[u.param] = acc
    scale = g.blob("solver/clip_scale", (), "float64", loc)
    if p.clip_gradients >= 0:
        sums = []  # each other memory space's sum of squares, sent to the server
        for key, at in remote.items():
            here = [grads[u.param] for u in active if where(u.param).memory == key]
            part = g.blob(f"solver/clip_sumsq{space(at)}", (), here[0].dtype, at)
            home = g.blob(f"solver/clip_sumsq{space(at)}@home", (), here[0].dtype, loc)
            op(f"clip_sumsq{space(at)}", so.sum_of_squares, here, [part], at=at)
            op(f"clip_sumsq{space(at)}@home", tensor.copy, [part], [home])
            sums.append(home)
        op("clip", so.gradient_scale, [grads[u.param] for u in active
                                       if not space(where(u.param))] + sums, [scale],
           clip=p.clip_gradients, partials=len(sums))
    else:
        op("clip", tensor.fill, [], [scale], value=1.0)
    scales = {loc.memory: scale}
    for key, at in remote.items():  # the factor, or 1 where nothing clips
        scales[key] = g.blob(f"solver/clip_scale{space(at)}", (), "float64", at)
        if p.clip_gradients >= 0:
            op(f"clip_scale{space(at)}", tensor.copy, [scale], [scales[key]], at=at)
        else:
            op(f"clip{space(at)}", tensor.fill, [], [scales[key]], at=at, value=1.0)
    reg = p.regularization_type
    for u in active:
        w, gr, at = u.param, grads[u.param], where(u.param)
        m = at.memory
        op(f"{w.name}/prepare", so.prepare_gradient, [w, gr, scales[m]], [gr], at=at,
           iter_size=p.iter_size, decay=p.weight_decay * w.meta["decay_mult"],
           regularization=reg)
        ins = [gr, lr[m]] + ([it[m]] if rule.reads_iter else []) + [w] + u.history
        op(f"{w.name}/update", rule.update, ins, [w] + u.history, at=at,
           lr_mult=w.meta["lr_mult"], **rule.keywords(p))
    op("next_iter", tensor.add_scalar, [it_blob], [it_blob], value=1.0)
    return TrainOps(it_blob, lr_blob, updates, zero_ops, accumulate_ops, ops)

