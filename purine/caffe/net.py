"""A Caffe net as a bi-graph: NetBuilder translates a NetParameter into forward ops, backward
ops and parameter blobs; Net is the pycaffe-style face over it (blobs, params, forward,
backward) run by the dispatcher."""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from purine.backend import assign, is_device_array, to_host
from purine.caffe.fillers import (
    FILL_SLACK,
    check_filler,
    fill,
    fill_into,
    fill_scratch_bytes,
)
from purine.caffe.layer import BUILDERS, LayerBuild, LegacyAxes
from purine.caffe.setup_log import setup_log
from purine.errors import LayerError, PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import atomic_write, blob_arrays, net_chunks, read_caffemodel
from purine.formats.hdf5_snapshot import is_hdf5, read_weights, write_weights
from purine.formats.prototxt import filter_net, insert_splits, read_net
from purine.formats.weights import layer_arrays
from purine.graph import CPU, Blob, Graph, Location, Op, Stateful, kernel
from purine.log import get_logger
from purine.ops import tensor
from purine.runtime import Dispatcher
from purine.runtime.memory import Store, blob_nbytes, check_capacity, require_bytes

TRAIN, TEST = pb.TRAIN, pb.TEST
_PHASES = {"TRAIN": TRAIN, "TEST": TEST, TRAIN: TRAIN, TEST: TEST}


class DebugInfo:
    """Caffe's debug_info: after each layer's forward pass the mean absolute value of its tops
    and parameters, after its backward pass that of its bottoms' and parameters' gradients,
    then the L1 and L2 norms of all parameters. The lines come from ops of their own in the
    graph; ``on`` switches them (a solver turns them on for its display iterations only, as
    Caffe's does)."""

    def __init__(self, on: bool):
        self.on = on


def _log_mean_abs(*arrays: Any, lines: Sequence[str], switch: DebugInfo) -> None:
    if switch.on:
        log = get_logger()
        for line, a in zip(lines, arrays, strict=True):
            log.info("    %s %g", line, float(abs(a).sum()) / a.size)


def _log_norms(*arrays: Any, switch: DebugInfo) -> None:
    """Arrays: every parameter's data, then every parameter's gradient."""
    if switch.on:
        half = len(arrays) // 2
        l1 = [sum(float(abs(a).sum()) for a in part) for part in (arrays[:half], arrays[half:])]
        l2 = [sum(float((a * a).sum()) for a in part) ** 0.5
              for part in (arrays[:half], arrays[half:])]
        get_logger().error("    [Backward] All net params (data, diff): L1 norm = (%g, %g); "
                           "L2 norm = (%g, %g)", *l1, *l2)


class Filling:
    """A parameter's filler, drawn when the net's storage exists: straight into the
    parameter's array in its dtype (no float64 copy of the whole parameter), after every
    blob of the net passed the memory check."""

    def __init__(self, filler: pb.FillerParameter, rng: np.random.Generator, layer: str):
        self.filler, self.rng, self.layer = filler, rng, layer

    def into(self, target: Any) -> None:
        if isinstance(target, np.ndarray) and target.flags.c_contiguous:
            fill_into(self.filler, target, self.rng, self.layer)
        else:  # a device array: drawn on the host (float32), then copied over
            assign(target, fill(self.filler, tuple(target.shape), self.rng, self.layer))


class NetBuilder:
    """Builds the graph of one net for one NetState (phase, level, stages)."""

    def __init__(self, param: pb.NetParameter, phase: int, *, level: int = 0,
                 stages: Sequence[str] = (), seed: int = 0, location: Location = CPU,
                 threads: int = 1, input_shapes: dict[str, tuple[int, ...]] | None = None,
                 dtype: str = "float32", replica: tuple[int, int] = (0, 1),
                 placement: dict[str, Location] | None = None,
                 replica_of: dict[str, str] | None = None,
                 base: NetBuilder | None = None,
                 decided: dict[int, tuple[tuple[int, ...], ...]] | None = None,
                 upto: int | None = None, log_setup: bool = False):
        self.phase = phase
        # Another build of the net whose first build is ``base``, for other shapes: layers
        # take over base's run-time objects (data cursors, random streams, the objects of
        # Python layers), as Caffe's Net::Reshape keeps its layers, and its parameters (of
        # the same shapes; nothing is filled again). ``decided``: the top shapes a pass
        # settled for the layers that settle theirs (layer index -> shapes). ``upto``: build
        # the layers before that index only (the part of a pass up to a layer whose shapes
        # the pass has still to settle), with no backward pass.
        self.base = base
        self.decided = dict(decided or {})
        self.upto = upto
        self.full = upto is None
        self.placement = dict(placement or {})  # layer name -> where its ops and blobs go
        # layer name -> the layer it is a data-parallel copy of (a layer maps to itself
        # when it has copies): all of them use the one layer's parameter blobs
        self.replica_of = dict(replica_of or {})
        self.dtype = dtype
        # (index, count) of this net among data-parallel replicas: data layers read
        # distinct batches per replica.
        self.replica = replica
        self.seed = seed
        self.location = location
        self.threads = max(1, threads)
        self.input_shapes = dict(input_shapes or {})
        self.graph = Graph()
        self.data: dict[str, Blob] = {}  # Caffe blob name -> its data blob
        self.blob_names: list[str] = []  # in Caffe's order (net.blobs)
        self.layers: list[LayerBuild] = []
        # A parameter's first value: an array, or the filler that draws it into the
        # parameter's own storage once the whole net is known to fit (see Filling)
        self.initial: dict[Blob, np.ndarray | Filling] = {}
        self._param_bytes: dict[tuple, int] = {}  # the parameters' bytes by memory space
        self._blob_bytes: dict[tuple, int] = {}  # every blob's bytes so far, by memory space
        self._counted = 0  # graph blobs counted in _blob_bytes
        self._scratch: list[tuple[Location, int, str]] = []  # a layer's op workspaces
        self._all_scratch: list[tuple[LayerBuild, Location, int, str]] = []  # the net's
        self.loss_tops: list[tuple[Blob, float]] = []
        self.seed_ops: list[Op] = []
        self._diffs: dict[str, Blob] = {}
        self._shared: dict[str, tuple[str, Blob]] = {}  # share name -> (owner layer, blob)
        # parameter blob -> (layer name, index) of each use, its owner first
        self._param_uses: dict[Blob, list[tuple[str, int]]] = {}
        self._use_diffs: dict[tuple[str, int], Blob] = {}
        self._n_ops = 0
        # run-time state snapshots must keep, and other run-time objects: one set per net
        self.stateful: dict[str, Stateful] = base.stateful if base else {}
        self.shared: dict[str, Any] = base.shared if base else {}
        # A blob's array, once a dispatcher runs this graph (the Net sets it): stateful
        # objects whose state lives in blobs (a recurrent layer's carried state) read it here.
        self.storage: Callable[[Blob], Any] | None = None
        # Set by the Net that runs this build: its dispatcher, the shapes it was built for
        # (the input shapes asked, then each settling layer's tops), its op lists
        self.dispatcher: Dispatcher | None = None
        self.prefix: tuple = ()
        self.forward_all: list[Op] = []
        self.backward_all: list[Op] = []
        self.segments: dict[tuple[int, int], list[Op]] = {}
        self.by_name: dict[str, LayerBuild] | None = None

        # Replicas of a data-parallel net print nothing, as Caffe's non-root solvers.
        self.debug = DebugInfo(True) if param.debug_info and replica[0] == 0 else None
        if base is not None:
            self.debug = base.debug  # one switch for all builds
        state = pb.NetState()
        state.CopyFrom(param.state)
        state.phase, state.level = phase, level
        state.stage.extend(s for s in stages if s not in state.stage)
        self.param = insert_splits(filter_net(param, state))
        self.force_backward = param.force_backward
        try:
            with setup_log(self, param, state, log_setup):  # Caffe's Init lines, if asked
                self._build()
        except BaseException:
            if base is None:
                close_all(self.stateful.values())  # the data layers built so far
            raise

    # -- services for LayerBuild (plain values in, never the LayerBuild) ----------------
    def add_op(self, layer: str, op_type: str, inputs: Iterable[Blob],
               outputs: Iterable[Blob], k, location: Location) -> Op:
        loc = location
        if self.threads > 1 and not self.placement:
            loc = Location(loc.device, loc.index, self._n_ops % self.threads, loc.host)
        self._n_ops += 1
        name, n = f"{layer}/{op_type}", 1
        while self.graph.has_op(name):
            n += 1
            name = f"{layer}/{op_type}#{n}"
        return self.graph.op(name, op_type, inputs, outputs, k, loc)

    def diff(self, name: str) -> Blob:
        d = self._diffs.get(name)
        if d is None:
            b = self.data[name]
            d = self._diffs[name] = self.graph.blob(f"{name}@diff", b.shape, b.dtype, b.location)
        return d

    def add_param(self, layer: str, k: int, shape: tuple[int, ...], spec: pb.ParamSpec,
                  filler: pb.FillerParameter | None, lr_mult: float | None,
                  rng: np.random.Generator, location: Location) -> Blob:
        """Parameter ``k`` of ``layer``: a new blob filled from ``rng``, or the blob shared
        under ``spec.name``. Raises a PurineError the layer names."""
        if lr_mult is not None and spec.HasField("lr_mult") and spec.lr_mult != lr_mult:
            raise PurineError(f"parameter {k} must have lr_mult {lr_mult}, got {spec.lr_mult}")
        mult = spec.lr_mult if spec.HasField("lr_mult") else (1.0 if lr_mult is None else lr_mult)
        if spec.name and spec.name in self._shared:
            owner, b = self._shared[spec.name]
            if b.shape != shape:
                permissive = spec.share_mode == pb.ParamSpec.PERMISSIVE
                raise PurineError(
                    f"shares parameter '{spec.name}' of layer '{owner}' but needs shape "
                    f"{shape}, the owner has {b.shape}" + (
                        " (PERMISSIVE sharing of equal counts in other shapes is not "
                        "supported)" if permissive and b.count == int(np.prod(shape)) else ""))
            # As Caffe: a multiplier set on either side is the parameter's; both must agree.
            for field_ in ("lr_mult", "decay_mult"):
                if spec.HasField(field_):
                    mine = getattr(spec, field_)
                    if b.meta[field_ + "_set"] and b.meta[field_] != mine:
                        raise PurineError(f"shared parameter '{spec.name}' has {field_} "
                                          f"{mine:g} here and {b.meta[field_]:g} in layer "
                                          f"'{owner}'")
                    b.meta[field_], b.meta[field_ + "_set"] = mine, True
            self._param_uses[b].append((layer, k))
            return b
        if self.base is not None:  # another build: the first build's parameter
            first = self.base.graph.blobs.get(f"{layer}[{k}]")
            if first is not None and first.shape != shape:
                raise PurineError(f"parameter {k} would change shape from {first.shape} to "
                                  f"{shape} with these bottom shapes; parameters keep their "
                                  "shapes when a net is reshaped (as in Caffe)")
        b = self.graph.blob(f"{layer}[{k}]", shape, self.dtype, location,
                            lr_mult=mult, decay_mult=spec.decay_mult, layer=layer,
                            index=k, share_name=spec.name,
                            lr_mult_set=spec.HasField("lr_mult") or lr_mult is not None,
                            decay_mult_set=spec.HasField("decay_mult"))
        if spec.name:
            self._shared[spec.name] = (layer, b)
        self._param_uses[b] = [(layer, k)]
        if self.base is not None:
            return b
        # Checked with the filler's temporaries; nothing is allocated or drawn until every
        # layer is built and the whole net is known to fit.
        space, need = location.memory, blob_nbytes(b)
        filler = filler or pb.FillerParameter()
        held, what = self._param_bytes.get(space, 0), f"parameter {k} {shape} {b.dtype}"
        check_capacity(location, need, held, what)
        scratch = fill_scratch_bytes(filler, shape)
        if scratch > FILL_SLACK:  # positive_unitball's long rows
            check_capacity(location, need + scratch, held, f"{what} and its filler's scratch",
                           verb="ask")
        self._param_bytes[space] = self._param_bytes.get(space, 0) + need
        check_filler(filler, shape, layer)  # refused now, under the layer's name
        self.initial[b] = Filling(filler, rng, layer)
        return b

    def require_scratch(self, location: Location, nbytes: int, what: str) -> None:
        """An op's workspace of ``nbytes`` (im2col columns, a padded copy) must fit beside
        every blob of the net up to the layer asking (checked once its blobs are counted):
        refused at build time, not at the op's run."""
        self._scratch.append((location, nbytes, what))

    def _check_scratch(self, layer: LayerBuild) -> None:
        """Now, beside the blobs counted so far (to refuse early); kept to be checked again
        beside every blob once the net is built (``_check_all_scratch``): an op's
        workspace exists while any blob may, the gradients counted later included."""
        for location, nbytes, what in self._scratch:
            check_capacity(location, nbytes, 0, what)  # alone, then beside the blobs
            check_capacity(location, nbytes, self._blob_bytes.get(location.memory, 0), what)
            self._all_scratch.append((layer, location, nbytes, what))
        self._scratch.clear()

    def _check_all_scratch(self) -> None:
        for layer, location, nbytes, what in self._all_scratch:
            try:
                check_capacity(location, nbytes, self._blob_bytes.get(location.memory, 0),
                               what)
            except PurineError as e:
                raise layer.error(str(e)) from None

    def param_diff(self, layer: str, k: int, param: Blob) -> Blob:
        """The gradient ``layer``'s use ``k`` of ``param`` writes (its own blob where the
        parameter is shared, summed into param_grad afterwards)."""
        b = param
        if len(self._param_uses[b]) == 1:
            return self.param_grad(b)
        key = (layer, k)
        if key not in self._use_diffs:
            self._use_diffs[key] = self.graph.blob(f"{layer}[{k}]@diff", b.shape,
                                                   b.dtype, b.location)
        return self._use_diffs[key]

    @property
    def learnable_params(self) -> list[Blob]:
        """Parameter blobs that own their storage, in Caffe's learnable_params order."""
        return list(self._param_uses)

    def param_grad(self, b: Blob) -> Blob:
        """The gradient of parameter ``b``, summed over every layer that uses it."""
        name = f"{b.name}@diff"
        if name in self.graph.blobs:
            return self.graph.blobs[name]
        return self.graph.blob(name, b.shape, b.dtype, b.location)

    # -- building ----------------------------------------------------------------------
    def _check_sizes(self) -> None:
        """The blobs added since the last check must fit in memory beside every blob before
        them (all are allocated when the net first runs; refused here, before any is, with
        the name of the layer that adds them)."""
        blobs = list(self.graph.blobs.values())
        new, self._counted = blobs[self._counted:], len(blobs)
        by_space: dict[tuple, list[Blob]] = {}
        for b in new:
            by_space.setdefault(b.location.memory, []).append(b)
            # An empty blob takes no memory, but an array's axes must still describe fewer
            # than 2^63 bytes (NumPy multiplies the other axes): (0, 2^31-1, 2^31-1) cannot.
            span = math.prod(d for d in b.shape if d) * np.dtype(b.dtype).itemsize
            if b.count == 0 and span >= 2 ** 63:
                raise PurineError(f"blob '{b.name}' {b.shape} {b.dtype} is empty, but its other "
                                  "axes are too long for an array (2^63 bytes or more)")
        for space, group in by_space.items():
            big = max(group, key=blob_nbytes)
            need, held = sum(map(blob_nbytes, group)), self._blob_bytes.get(space, 0)
            if len(group) == 1:
                what, verb = f"blob '{big.name}' {big.shape} {big.dtype}", "asks"
            else:
                what, verb = (f"its {len(group)} blobs (the largest '{big.name}' {big.shape} "
                              f"{big.dtype})"), "ask"
            check_capacity(big.location, need, 0, what, verb=verb)  # alone, then with the rest
            check_capacity(big.location, need, held, what, verb=verb)
            self._blob_bytes[space] = held + need

    def _build(self) -> None:
        backwards = []
        names: set[str] = set()
        for i, lp in enumerate(self.param.layer):
            if self.upto is not None and i >= self.upto:
                break
            builder = BUILDERS.get(lp.type)
            if builder is None:
                raise LayerError(lp.name, lp.type, "unknown layer type; known types: "
                                 + ", ".join(sorted(BUILDERS)))
            # Caffe lets two layers share a name (BVLC's mnist_autoencoder has two "loss"
            # layers); ops and blobs are named after their layer, so a repeat builds under
            # a name of its own, and only a layer without parameters may repeat a name.
            repeat = lp.name in names
            names.add(lp.name)
            L = LayerBuild(self, lp, i, f"{lp.name}#{i}" if repeat else None)
            try:
                backwards.append(builder(L))
                self._check_sizes()
                self._check_scratch(L)
            except LayerError:
                raise
            except PurineError as e:
                raise L.error(str(e)) from None
            if repeat and L.params:
                raise LayerError(lp.name, lp.type, "a layer name used twice, here by a layer "
                                 "with parameters; parameters are named after their layer "
                                 "(in .caffemodel files too): give this layer its own name")
            if self.debug:
                self._debug_forward(L)
            if len(L.tops) != len(lp.top):
                raise L.error(f"declares {len(lp.top)} tops, the layer makes {len(L.tops)}")
            if len(L.loss_weights) > len(L.tops):
                raise L.error(f"{len(L.loss_weights)} loss_weight values for "
                              f"{len(L.tops)} tops")
            for t in lp.top:
                if t not in self.blob_names:
                    self.blob_names.append(t)
            self.layers.append(L)
        if not self.full:
            self.graph.validate()
            return
        self._need_backward()
        for L in self.layers:
            for j, w in enumerate(L.loss_weights):
                if w:
                    self.loss_tops.append((L.tops[j], w))
                    diff = self.diff(L.param.top[j])
                    self.seed_ops.append(self.graph.op(
                        f"{L.name}/LossWeight#{j}", "Fill", [], [diff],
                        kernel(tensor.fill, value=w), diff.location))
        for L, backward in zip(reversed(self.layers), reversed(backwards)):
            if backward is not None and any(L.bottom_need + L.param_need):
                try:
                    backward()
                    self._check_sizes()  # the gradients it adds
                    self._check_scratch(L)
                except LayerError:
                    raise
                except PurineError as e:
                    raise L.error(str(e)) from None
                for i in L.mirrors:  # gradients back to their bottoms' memory
                    grad = L.bottom_diff(i)
                    if self.graph.writers(grad):
                        target = self.diff(L.param.bottom[i])
                        L.backward_ops.append(self.graph.op(
                            f"{L.name}/CopyOut#{i}", "Copy", [grad], [target],
                            kernel(tensor.copy), target.location))
                for k, (grad, target) in L.param_outs.items():  # and to their parameters'
                    if self.graph.writers(grad):
                        L.backward_ops.append(self.graph.op(
                            f"{L.name}/ParamOut#{k}", "Copy", [grad], [target],
                            kernel(tensor.copy), target.location))
                if self.debug:
                    self._debug_backward(L)
            elif L.save_ops:  # nothing will read the copies taken for backward
                self.graph.remove_ops(L.save_ops)
                L.forward_ops = [op for op in L.forward_ops if op not in L.save_ops]
        self._sum_shared_diffs()
        self._check_sizes()
        self._check_all_scratch()
        if self.debug and self.layers and any(L.backward_ops for L in self.layers):
            params = self.learnable_params
            grads = [self.param_grad(w) for w in params]
            if all(self.graph.writers(g) for g in grads):
                first = self.layers[0]  # its backward ops run last
                first.backward_ops.append(self.graph.op(
                    f"{first.name}/DebugInfoNorms", "DebugInfo", params + grads, [],
                    kernel(_log_norms, switch=self.debug), first.location))
        self.graph.validate()

    def _debug_forward(self, L: LayerBuild) -> None:
        specs = L.param.param
        names = [specs[k].name if k < len(specs) and specs[k].name else str(k)
                 for k in range(len(L.params))]
        lines = ([f"[Forward] Layer {L.param.name}, top blob {t} data:" for t in L.param.top]
                 + [f"[Forward] Layer {L.param.name}, param blob {n} data:" for n in names])
        L.forward(_log_mean_abs, L.tops + L.params, [], op_type="DebugInfo", lines=lines,
                  switch=self.debug)

    def _debug_backward(self, L: LayerBuild) -> None:
        blobs, lines = [], []
        for j, b in enumerate(L.param.bottom):
            if L.bottom_need[j] and self.graph.writers(self.diff(b)):
                blobs.append(self.diff(b))
                lines.append(f"[Backward] Layer {L.param.name}, bottom blob {b} diff:")
        for k in range(len(L.params)):
            if L.param_need[k] and self.graph.writers(L.param_diff(k)):
                blobs.append(L.param_diff(k))
                lines.append(f"[Backward] Layer {L.param.name}, param blob {k} diff:")
        if blobs:
            L.backward(_log_mean_abs, blobs, [], op_type="DebugInfo", lines=lines,
                       switch=self.debug)

    def _need_backward(self) -> None:
        """Caffe's analysis of which layers and bottoms need a gradient."""
        blob_need: dict[str, bool] = {}
        layer_need: list[bool] = []
        for L in self.layers:
            lp = L.param
            if lp.propagate_down and len(lp.propagate_down) != len(lp.bottom):
                raise L.error(f"propagate_down has {len(lp.propagate_down)} values for "
                              f"{len(lp.bottom)} bottoms")
            # An explicit propagate_down decides, forcing a gradient when true (Caffe).
            L.bottom_need = [lp.propagate_down[j] if lp.propagate_down
                             else blob_need.get(b, False) for j, b in enumerate(lp.bottom)]
            L.param_need = [b.meta["lr_mult"] != 0 for b in L.params]
            need = any(L.bottom_need) or any(L.param_need)
            for t in lp.top:
                if need:
                    blob_need[t] = True
                else:
                    blob_need.setdefault(t, False)
            layer_need.append(need)
        under_loss: set[str] = set()
        skip: set[str] = set()
        for i in reversed(range(len(self.layers))):
            L = self.layers[i]
            contributes = any((j < len(L.loss_weights) and L.loss_weights[j] != 0)
                              or t in under_loss for j, t in enumerate(L.param.top))
            skip_down = all(t in skip for t in L.param.top)
            if (layer_need[i] and skip_down) or not contributes:
                layer_need[i] = False
                L.bottom_need = [False] * len(L.bottom_need)
            for j, b in enumerate(L.param.bottom):
                if contributes:
                    under_loss.add(b)
                if not L.bottom_need[j]:
                    skip.add(b)
            if not layer_need[i]:
                L.param_need = [False] * len(L.params)
        self.layer_need = layer_need  # the verdicts Caffe logs (before force_backward)
        if self.force_backward:
            for L in self.layers:
                L.bottom_need = [n or j not in L.no_force_backward
                                 for j, n in enumerate(L.bottom_need)]
                L.param_need = [True] * len(L.params)

    def _sum_shared_diffs(self) -> None:
        layers = {L.name: L for L in self.layers}
        for b, uses in self._param_uses.items():
            if len(uses) < 2:
                continue
            parts = [self._use_diffs[use] for use in uses
                     if use in self._use_diffs and self.graph.writers(self._use_diffs[use])]
            if parts:
                owner = layers[uses[0][0]]
                op = self.graph.op(f"{b.name}/SumSharedDiff", "Sum", parts,
                                   [self.param_grad(b)], kernel(tensor.sum),
                                   owner.location)
                owner.backward_ops.append(op)


class BlobView(LegacyAxes):
    """``net.blobs[name]``, or parameter ``k`` of ``layer`` in ``net.params``: a Caffe blob's
    data and diff as arrays, in the net's build for the shapes of its last pass."""

    def __init__(self, net: Net, name: str, layer: str | None = None, k: int = 0):
        self._net, self.name, self._layer, self._k = net, name, layer, k

    def _where(self) -> tuple[NetBuilder, Blob]:
        """The build and graph blob behind this view: the net's current build's, or for a
        blob past where the last pass stopped, the latest build's that has it."""
        if self._layer is None:
            b = self._net._build_of(self.name)
            return b, b.data[self.name]
        return self._net._param(self._layer, self._k)

    @property
    def _data(self) -> Blob:
        return self._where()[1]

    def _staged(self, diff: bool = False) -> np.ndarray | None:
        """The array standing for this input blob between a reshape and the next pass."""
        if self._layer is not None:
            return None
        return (self._net._staged_diffs if diff else self._net._staged).get(self.name)

    @property
    def data(self) -> np.ndarray:
        staged = self._staged()
        if staged is not None:
            return staged
        b, blob = self._where()
        return b.dispatcher.array(blob)

    @property
    def diff(self) -> np.ndarray:
        if self._staged() is not None:
            if self._staged(diff=True) is None:
                self._net._staged_diffs[self.name] = np.zeros_like(self._staged())
            return self._staged(diff=True)
        b, blob = self._where()
        d = b.diff(self.name) if self._layer is None else b.param_grad(blob)
        return b.dispatcher.array(d)

    @property
    def shape(self) -> tuple[int, ...]:
        staged = self._staged()
        return self._data.shape if staged is None else staged.shape

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def reshape(self, *shape: int) -> None:
        """Caffe's Blob::Reshape of an input blob: the blob has the new shape at once (its
        ``data`` a zero array of it, to be filled), the layers after it from the next
        ``forward`` (or ``net.reshape()``), which runs the net's build for the new shapes."""
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        self._net._reshape_input(self.name, tuple(int(d) for d in shape))

    def __repr__(self) -> str:
        return f"<Blob {self.name} {self.shape}>"


MAX_BUILDS = 16
"""How many builds (one per set of shapes) a net keeps besides its first; the least recently
used goes when a new one is made (their storage is shared, so a build costs graph objects)."""


class Net:
    """pycaffe's Net over a bi-graph: ``Net(model, weights=None, phase=TEST)``;
    ``Net(model, phase)`` and ``Net(model, weights, phase)`` as in pycaffe.

    Caffe settles every layer's shapes right before its forward, at every pass. Here a graph
    is built for one set of shapes (a *build*), and a pass settles shapes where they can
    change: the input blobs' shapes before it, and the layers that settle theirs (a Python
    layer's ``reshape``, Filter's selector) right before their forward ops. Where shapes
    differ from the current build's, the pass goes on in the build for them (made on first
    need, kept after). Builds share their parameters, run-time objects and storage (by
    blob name, grow-only), so switching costs no copy and a net cycling through a few sizes
    stops allocating after the first cycle."""

    def __init__(self, model: str | os.PathLike | pb.NetParameter, *args: Any,
                 weights: str | None = None, phase: int | str | None = None,
                 level: int = 0, stages: Sequence[str] = (), seed: int = 0,
                 threads: int = 1, dtype: str = "float32",
                 replica: tuple[int, int] = (0, 1),
                 placement: dict[str, Location] | None = None,
                 replica_of: dict[str, str] | None = None,
                 location: Location = CPU, host: int | None = None):
        for a in args:
            if isinstance(a, int | str) and a in _PHASES and phase is None:
                phase = a
            elif isinstance(a, str | os.PathLike) and weights is None:
                weights = os.fspath(a)
            else:
                raise TypeError(f"Net: unexpected argument {a!r}")
        self.phase = _PHASES[TEST if phase is None else phase]
        self.model = read_net(model)
        self._level, self._stages, self._seed, self._threads = level, tuple(stages), seed, threads
        self._dtype, self._replica, self._placement = dtype, replica, placement
        self._replica_of = replica_of
        # The MPI rank of this process where the placement spans several: it runs (and
        # allocates) its share of the graph; None: all of it
        self.host = host
        self.location = location  # where the layers run (Python layers stay on the host)
        self._input_shapes: dict[str, tuple[int, ...]] = {}  # requested by blob reshapes
        # Input blobs reshaped since the last pass: host arrays of their new shapes, which
        # ``blobs[name].data`` gives until the next pass copies them into the graph's blobs.
        self._staged: dict[str, np.ndarray] = {}
        self._staged_diffs: dict[str, np.ndarray] = {}
        self._store = Store()  # every build's blobs, by name
        self._builds: OrderedDict[tuple, NetBuilder] = OrderedDict()  # by shapes, LRU last
        # A solver's train net: the solver adds its ops (the update) to each new build.
        self.extend: Callable[[NetBuilder], None] | None = None
        # Why this net's graph cannot be built again for other shapes (a solver's scheme
        # wove replicas into it), or None
        self.frozen: str | None = None
        self._profiling = False  # the dispatchers' profiler, for builds made while it is on
        self._first_inputs: dict[str, tuple[int, ...]] = {}  # the first build's input shapes
        self.closed = False
        self._build()
        if weights is not None:
            self.copy_from(weights)

    def _make(self, decided: dict[int, tuple], upto: int | None) -> NetBuilder:
        """A build of the net at the requested input shapes and the ``decided`` top shapes
        (the first build when there is none yet), with its dispatcher over the net's store."""
        first = self._first if self._builds else None
        b = NetBuilder(self.model, self.phase, level=self._level, stages=self._stages,
                       seed=self._seed, threads=self._threads,
                       input_shapes=self._input_shapes, dtype=self._dtype,
                       replica=self._replica, placement=self._placement,
                       replica_of=self._replica_of, location=self.location,
                       base=first, decided=decided, upto=upto, log_setup=first is None)
        b.dispatcher = Dispatcher(b.graph, host=self.host, store=self._store,
                                  profile=self._profiling)
        b.dispatcher.transport = self.dispatcher.transport if first is not None else None
        b.storage = b.dispatcher.array
        b.prefix = (self._inputs_key(),) + tuple(
            tuple(tuple(t.shape) for t in L.tops) for L in b.layers if L.settler is not None)
        b.forward_all = [op for L in b.layers for op in L.forward_ops]
        b.backward_all = b.seed_ops + [op for L in reversed(b.layers)
                                       for op in L.backward_ops]
        b.segments = {}
        if first is not None and b.full and self.extend is not None:
            self.extend(b)
        return b

    def _build(self) -> None:
        b = self._make({}, None)
        self._first = b
        self._first_inputs = {t: b.data[t].shape for L in b.layers if L.type == "Input"
                              for t in L.param.top}
        self._settlers = {L.index: L.settler for L in b.layers if L.settler is not None}
        self._cuts = sorted(self._settlers)
        for blob in list(b.initial):  # the filled values go in, and need not stay twice
            value = b.initial.pop(blob)
            if self.host is None or blob.location.host == self.host:
                target = b.dispatcher.array(blob)
                if isinstance(value, Filling):
                    value.into(target)
                else:
                    assign(target, value)
        self._builds[(b.prefix, b.upto)] = b
        self._use(b)
        self.layer_names = [L.param.name for L in b.layers]
        self.layer_types = [L.type for L in b.layers]
        self.blobs: OrderedDict[str, BlobView] = OrderedDict(
            (n, BlobView(self, n)) for n in b.blob_names)
        self.params: OrderedDict[str, list[BlobView]] = OrderedDict()
        for L in b.layers:
            if L.params:
                # A parameter shared from another memory space shows its home blob, which
                # the solver updates and snapshots write (the layer reads a mirror of it).
                homes = [L.param_homes.get(k, p) for k, p in enumerate(L.params)]
                self.params[L.name] = [BlobView(self, h.name, L.name, k)
                                       for k, h in enumerate(homes)]
        self.inputs = list(self._first_inputs)
        available: set[str] = set()  # Caffe's rule: what no later layer consumed,
        for L in b.layers:             # in name order (Caffe keeps them in a std::set)
            available.difference_update(L.param.bottom)
            available.update(L.param.top)
        self.outputs = sorted(available)

    # -- builds ------------------------------------------------------------------------
    def _inputs_key(self) -> tuple:
        return tuple(sorted((n, s) for n, s in self._input_shapes.items()
                            if s != self._first_inputs.get(n)))

    def _use(self, b: NetBuilder) -> None:
        self._builds.move_to_end((b.prefix, b.upto))
        self.builder, self.graph, self.dispatcher = b, b.graph, b.dispatcher
        self._forward_ops, self._backward_ops = b.forward_all, b.backward_all

    def profile(self, on: bool) -> list:
        """Switch the dispatchers' profiler on or off (every build's, and those made while
        it is on); off returns the events they recorded, in time order."""
        self._profiling = on
        events = []
        for b in self._builds.values():
            b.dispatcher.profile = on
            events += b.dispatcher.trace
            b.dispatcher.trace = []
        return sorted(events, key=lambda e: e.start)

    def builds(self) -> list[NetBuilder]:
        """The builds this net holds, the least recently used first."""
        return list(self._builds.values())

    def _blob(self, name: str) -> Blob:
        """Caffe blob ``name`` in the current build, or in the latest that has it (a pass
        that stopped short of the layer making it)."""
        return self._build_of(name).data[name]

    def _build_of(self, name: str) -> NetBuilder:
        if name in self.builder.data:
            return self.builder
        for b in reversed(self._builds.values()):
            if name in b.data:
                return b
        raise PurineError(f"net '{self.model.name}' has no blob '{name}'")

    def _param(self, layer: str, k: int) -> tuple[NetBuilder, Blob]:
        """Parameter ``k`` of ``layer`` in the current build (or the first, where the
        current stops short of the layer): its home blob, where the layer reads a mirror."""
        b = self.builder if self.builder.full else self._first
        if b.by_name is None:
            b.by_name = {L.name: L for L in b.layers}
        L = b.by_name[layer]
        return b, L.param_homes.get(k, L.params[k])

    def _settle(self, k: int, shapes: tuple, what: str = "", need: int | None = None) -> None:
        """Settle the shapes of cut ``k`` (the k-th layer that settles its tops; -1: the
        input blobs) for this pass: go on in a build for them holding the layers before
        ``need`` (by default up to the next cut), made if there is none."""
        n = len(self.layer_names)
        reach = self._cuts[k + 1] if k + 1 < len(self._cuts) else n  # up to the next cut
        need = reach if need is None else need

        def fits(b: NetBuilder) -> bool:
            return b.prefix[:k + 2] == prefix and (b.full or b.upto >= need)

        prefix = self.builder.prefix[:k + 1] + (shapes,)
        if fits(self.builder):
            return
        found = next((b for b in reversed(self._builds.values()) if fits(b)), None)
        if self.frozen is not None and found is not self._first:
            raise PurineError(f"{self.frozen}; {what}: give the shapes in the net's prototxt")
        if found is None:
            decided = {self._cuts[j]: prefix[j + 1] for j in range(k + 1)}
            try:  # as far as the next cut, if the layers there can take the shapes now
                found = self._make(decided, reach if reach < n else None)
            except PurineError:
                if need >= reach:
                    raise
                # A layer past cut k cannot take the shapes its forward may still change
                # (a loss reading a label that a Python layer reshapes in forward).
                found = self._make(decided, need)
            self._builds[(found.prefix, found.upto)] = found
            while len(self._builds) > MAX_BUILDS + 1:
                key, old = next((key, b) for key, b in self._builds.items()
                                if b is not self._first)
                del self._builds[key]
                old.dispatcher.close()
        self._use(found)

    def _ops(self, a: int, z: int) -> list[Op]:
        """The forward ops of layers [a, z) of the current build."""
        b = self.builder
        if a == 0 and z >= len(b.layers):
            return b.forward_all
        ops = b.segments.get((a, z))
        if ops is None:
            ops = b.segments[(a, z)] = [op for L in b.layers[a:z] for op in L.forward_ops]
        return ops

    def _pass(self, lo: int, hi: int, tail: Callable[[], list[Op]] | None = None) -> None:
        """Caffe's forward over layers ``lo``..``hi``, then ``tail()``'s ops (a backward
        pass, an update) in the same dispatcher run. A layer that settles its shapes is
        settled right before its forward op, on what the pass computed so far; the ops
        between two such layers run together, in the build for the shapes settled."""
        if lo > 0:  # from a layer on: the build must hold it (not stop short before it)
            self._full()
        start = lo
        for k, c in enumerate(self._cuts):
            if not lo <= c <= hi:
                continue
            settler = self._settlers[c]
            # A settler that reads no bottom (a data layer's) is settled without running the
            # layers before it first: they have the same shapes in either build.
            if settler.reads_bottoms and start < c:
                self.dispatcher.run(self._ops(start, c))
                start = c
            shapes = self._shapes_of(c)
            layer = self.layer_names[c]
            what = f"layer '{layer}' gives its tops the shapes {_show(shapes)}"
            if not settler.reshapes_in_forward:
                self._settle(k, shapes, what)
                continue
            # The layer's forward may give its tops other shapes (a Python layer's forward
            # may reshape them, as Faster R-CNN's proposal layer does): the layers after it
            # are built once that is known, so a build for the shapes reshape() gave reaches
            # only as far as the layer itself.
            self._settle(k, shapes, what, need=c + 1)
            self.dispatcher.run(self._ops(start, c + 1))
            start = c + 1
            moved = settler.after()
            if moved is not None and moved[0] != shapes:
                self._settle(k, moved[0], f"layer '{layer}' gives its tops the shapes "
                             f"{_show(moved[0])} in forward")
                for t, a in zip(self.builder.layers[c].tops, moved[1]):
                    assign(self.dispatcher.array(t), a)
            else:
                self._settle(k, shapes, what)
        ops = self._ops(start, hi + 1)
        if tail is not None:
            ops = ops + tail()
        if ops:
            self.dispatcher.run(ops)

    def _shapes_of(self, c: int) -> tuple:
        """Cut layer ``c``'s top shapes for this pass, from its settler (given the bottoms
        the pass computed, where it reads them); its errors named as the op's are."""
        settler = self._settlers[c]
        bottoms = [self.dispatcher.array(self.builder.data[n])
                   for n in self.model_layer(c).bottom] if settler.reads_bottoms else []
        try:
            return settler.before(bottoms)
        except PurineError as e:
            ops = self._first.layers[c].forward_ops
            if ops and not isinstance(e, LayerError):
                e.args = (f"op '{ops[-1].name}': {e}",) + e.args[1:]
            raise

    @property
    def whole(self) -> NetBuilder:
        """A build with every layer: the current one, or where a forward pass stopped short of
        a layer still to settle its shapes, the latest that has them all."""
        if self.builder.full:
            return self.builder
        return next(b for b in reversed(self._builds.values()) if b.full)

    def _full(self) -> NetBuilder:
        """The current build, which a backward pass needs whole: a forward that stopped
        short of a layer still to settle its shapes leaves a build of the part before it."""
        if not self.builder.full:
            prefix = self.builder.prefix
            found = next((b for b in reversed(self._builds.values())
                          if b.full and b.prefix[:len(prefix)] == prefix), None)
            if found is None:
                layer = self.layer_names[self.builder.upto]
                raise PurineError(f"net '{self.model.name}': the last forward pass stopped "
                                  f"before layer '{layer}', which settles its top shapes "
                                  "when it runs; run forward through it first")
            self._use(found)
        return self.builder

    # -- releasing ---------------------------------------------------------------------
    def close(self) -> None:
        """Stop the data layers' prefetch threads, wait for them, and release their sources
        (an LMDB environment, a LevelDB handle): the databases are free for other openers
        when this returns. Closing twice does nothing; running the net after it is an
        error. ``with Net(...) as net:`` closes on leaving the block."""
        if not self.closed:
            self.closed = True
            for b in self._builds.values():
                b.dispatcher.close()  # their worker threads, when they run ops on several
            close_all(self.builder.stateful.values())

    def __enter__(self) -> Net:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise PurineError(f"net '{self.model.name}' is closed: its data sources are "
                              "released; build a new net to run it again")

    # -- running -----------------------------------------------------------------------
    def _layer_index(self, name: str | None, default: int) -> int:
        if name is None:
            return default
        if name not in self.layer_names:
            raise PurineError(f"no layer named '{name}' in net '{self.model.name}'")
        return self.layer_names.index(name)

    def forward(self, blobs: Sequence[str] | None = None, start: str | None = None,
                end: str | None = None, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """Run the forward ops (of layers ``start``..``end``) after copying ``inputs`` into
        their blobs; returns the output blobs (and ``blobs``) by name."""
        self._check_open()
        for name, value in inputs.items():
            if name not in self.blobs:
                raise PurineError(f"forward: net has no blob '{name}'")
            view = self.blobs[name]  # its shape: the built one, or one asked by reshape
            if not is_device_array(value):
                value = np.asarray(value)
            if tuple(value.shape) != view.shape:
                raise PurineError(f"forward: blob '{name}' has shape {view.shape}, "
                                  f"the input has {tuple(value.shape)}")
            assign(view.data, value)
        self.reshape_if_needed()
        lo = self._layer_index(start, 0)
        hi = self._layer_index(end, len(self.layer_names) - 1)
        self._pass(lo, hi)
        names = list(self.outputs) + [b for b in (blobs or []) if b not in self.outputs]
        if end is not None:
            names = list(self.model_layer(hi).top) + list(blobs or [])
        return {n: self.blobs[n].data for n in names}

    def model_layer(self, i: int) -> pb.LayerParameter:
        """Layer ``i``'s parameter message, as the net was built (phase rules applied)."""
        return self._first.layers[i].param

    def backward(self, diffs: Sequence[str] | None = None, start: str | None = None,
                 end: str | None = None, **top_diffs: np.ndarray) -> dict[str, np.ndarray]:
        """Run the backward ops; returns the input blobs' diffs (and ``diffs``) by name."""
        self._check_open()
        b = self._full()
        given = set()
        for name, value in top_diffs.items():
            assign(self.blobs[name].diff, value)
            given.add(b.diff(name))
        # The loss tops' diffs start as their loss weights, unless the caller gave them.
        ops = [op for op in b.seed_ops if op.outputs[0] not in given]
        layers = b.layers
        if start is not None or end is not None:
            i = self._layer_index(end, 0)
            j = self._layer_index(start, len(layers) - 1)
            layers = layers[i: j + 1]
        ops += [op for L in reversed(layers) for op in L.backward_ops]
        self.dispatcher.run(ops)
        names = list(self.inputs) + list(diffs or [])
        if end is not None:  # pycaffe: the bottoms of the last layer run
            names = list(self.model_layer(self._layer_index(end, 0)).bottom) + list(diffs or [])
        return {n: self.blobs[n].diff for n in names}

    def clear_param_diffs(self) -> None:
        """Set every parameter's diff to zero (Caffe's Net::ClearParamDiffs)."""
        for views in self.params.values():
            for v in views:
                v.diff[...] = 0

    def loss_value(self) -> Any:
        """``loss`` as an array scalar where the net runs (on a GPU, reading it later
        does not make the host wait now)."""
        total: Any = 0.0
        for b, w in self.builder.loss_tops:
            total = total + w * self.dispatcher.array(b).sum()
        return total

    @property
    def loss(self) -> float:
        """Sum over loss tops of loss_weight x sum(top), as Caffe's Net::Forward returns."""
        return float(sum(w * float(self.dispatcher.array(b).sum())
                         for b, w in self.builder.loss_tops))

    def _reshape_input(self, name: str, shape: tuple[int, ...]) -> None:
        """``blobs[name].reshape(*shape)``: only an input blob may take a shape of its own;
        the others follow from the layers that write them."""
        if any(d < 0 for d in shape):
            raise PurineError(f"blob '{name}': negative dimension in reshape{shape}")
        self._check_reshape_bytes(name, shape)
        if max(shape, default=0) > 2 ** 31 - 1:  # an empty blob may still name one
            raise PurineError(f"blob '{name}': reshape{shape} has an axis past 2^31-1, "
                              "Caffe's largest")
        now = self._blob(name).shape
        if name not in self.inputs:
            if shape == now:
                return
            raise PurineError(
                f"net '{self.model.name}': blob '{name}' {now} cannot be reshaped to {shape}: "
                "only the net's input blobs (" + ", ".join(self.inputs) + ") take shapes of "
                "their own; the other blobs' follow from the layers that write them")
        self._input_shapes[name] = shape
        self._staged_diffs.pop(name, None)
        if shape == now:  # the current build's shape: nothing to stage
            self._staged.pop(name, None)
        elif name not in self._staged or self._staged[name].shape != shape:
            self._staged[name] = np.zeros(shape, self._blob(name).dtype)

    def _check_reshape_bytes(self, name: str, shape: tuple[int, ...]) -> None:
        """The new shape's bytes must fit before its zero array is made (numpy's zeros
        would reserve the address space and fail at the first touch)."""
        dtype = np.dtype(self._blob(name).dtype)
        require_bytes(math.prod(shape) * dtype.itemsize,
                      f"blob '{name}' reshape{shape} ({dtype.name})")

    def reshape_if_needed(self) -> bool:
        """Settle the input blobs' shapes given since the last pass (Caffe reshapes every
        layer at each forward; the net goes on in its build for the new input shapes, made
        if there is none) and copy their staged values in. Returns whether it changed
        build."""
        if not self._staged:
            return False
        staged = dict(self._staged)
        now = self.builder
        try:
            self._settle(-1, self._inputs_key(), ", ".join(
                f"input blob '{n}' {self._blob(n).shape} was reshaped to {a.shape}"
                for n, a in staged.items()))
        except BaseException:
            # The net stays as it was: forget the shapes that could not be built.
            for n in staged:
                self._input_shapes[n] = self._blob(n).shape
            self._staged.clear()
            self._staged_diffs.clear()
            raise
        self._staged.clear()
        self._staged_diffs.clear()
        for n, a in staged.items():
            assign(self.dispatcher.array(self.builder.data[n]), a)
        return self.builder is not now

    def reshape(self) -> None:
        """Caffe's Net::Reshape: settle every shape now, the input blobs' and, in order, each
        layer's that settles its own (a Python layer's ``reshape`` runs, as in Caffe), and
        go on in the build for them."""
        self._check_open()
        self.reshape_if_needed()
        for k, c in enumerate(self._cuts):
            shapes = self._shapes_of(c)
            self._settle(k, shapes, f"layer '{self.layer_names[c]}' gives its tops the "
                         f"shapes {_show(shapes)}")

    def share_with(self, other: Net) -> None:
        """Use ``other``'s parameter arrays for the layers both nets have, by name (Caffe's
        ShareTrainedLayersWith: a test net sees the train net's weights without a copy).
        Every build of this net uses them."""
        for name, views in self.params.items():
            theirs = other.params.get(name)
            if theirs is None:
                continue
            arrays = layer_arrays(name, [src.data for src in theirs], [v.shape for v in views],
                                  source=f"in net '{other.model.name}'", legacy=False)
            for mine, a in zip(views, arrays):
                self.dispatcher.bind(mine._data, a)

    # -- weights -----------------------------------------------------------------------
    def copy_from(self, path: str | os.PathLike) -> set[str]:
        """Copy parameters from a .caffemodel or, when the file is HDF5 (told by its
        signature, as Caffe's CopyTrainedLayersFrom does), a .caffemodel.h5, by layer name:
        layers it lacks keep theirs; a shape mismatch is an error naming both shapes.
        Returns the names of the layers whose parameters it copied."""
        if is_hdf5(path):
            return self.load_hdf5(path)
        known, log, source = set(self.layer_names), get_logger(), read_caffemodel(path)
        copied: set[str] = set()
        # The file's layers in order (a name given twice: the last copy stays, as in Caffe).
        for layer in list(source.layer) + list(source.layers):
            name = layer.name
            if name not in known:
                log.info("Ignoring source layer %s", name)  # Caffe's line: fine-tuners read it
                continue
            views = self.params.get(name)
            if not layer.blobs or views is None:
                continue
            arrays = blob_arrays(layer.blobs, f"{os.fspath(path)}: layer '{name}'")
            arrays = layer_arrays(name, arrays, [v.shape for v in views], source="in the file",
                                  where=f"{os.fspath(path)}: ")
            for v, a in zip(views, arrays):
                assign(v.data, a)
            copied.add(name)
        return copied

    def load_hdf5(self, path: str | os.PathLike) -> set[str]:
        """Copy parameters from a .caffemodel.h5 (``data/<layer>/<i>``), as Caffe's
        CopyTrainedLayersFromHDF5: shapes must match exactly, and a blob may be missing
        only where the layer shares it from another layer. Returns the names of the layers
        whose parameters it copied."""
        path = os.fspath(path)
        known = set(self.layer_names)
        copied: set[str] = set()
        # The net's shapes go to the reader, which checks every dataset against its
        # parameter before reading a value (a file may declare gigabytes).
        expect = {name: [v.shape for v in views] for name, views in self.params.items()}
        for name, datasets in read_weights(path, expect).items():
            if name not in known:
                get_logger().info("Ignoring source layer %s", name)
                continue
            views = self.params.get(name)
            if views is None:
                continue
            if len(datasets) > len(views):
                raise PurineError(f"{path}: layer '{name}' has {len(datasets)} datasets, the "
                                  f"net expects at most {len(views)} parameter blobs")
            for k, v in enumerate(views):
                a = datasets.get(str(k))
                if a is None:
                    if self._owns(name, k):
                        raise PurineError(f"{path}: layer '{name}' has no dataset data/{name}/"
                                          f"{k}; the net expects {len(views)} parameter blobs")
                    continue  # shared from its owner's layer
                if a.shape != v.shape:
                    raise PurineError(f"{path}: layer '{name}' parameter {k} has shape "
                                      f"{a.shape} in the file, the net expects {v.shape}")
                assign(v.data, a)
                copied.add(name)
        return copied

    def _owns(self, layer: str, k: int) -> bool:
        """Whether ``layer``'s parameter ``k`` is its own (not shared from another layer)."""
        b, blob = self._param(layer, k)
        return b._param_uses[blob][0][0] == layer

    def save(self, path: str | os.PathLike) -> None:
        """Write the parameters as a .caffemodel (temporary file, then rename): every layer
        with its own blobs, as Caffe's ToProto; a layer repeating a name has none."""
        # Layer by layer: a map by Caffe name would hand a repeat its namesake's blobs.
        chunks = net_chunks(self.model.name, [], {})
        for L in self.whole.layers:
            if L.type != "Split":  # the net's own layers only
                arrays = [to_host(v.data) for v in self.params.get(L.name, [])]
                chunks += net_chunks("", [L.param], {L.param.name: arrays})
        atomic_write(path, chunks)

    def save_hdf5(self, path: str | os.PathLike) -> None:
        """Write the parameters as a .caffemodel.h5 in Caffe's layout (a group per layer
        name under ``data``; a shared blob is written by its owner only). Needs h5py."""
        layers = []
        for L in self.whole.layers:
            # As in save(): the net's own layers only. A layer repeating a name (built as
            # "name#i") has no parameters, and its namesake's group stands for the name.
            if L.type == "Split" or L.name != L.param.name:
                continue
            views = self.params.get(L.name, [])
            layers.append((L.param.name, [to_host(v.data) if self._owns(L.name, k) else None
                                          for k, v in enumerate(views)]))
        write_weights(path, layers)


def _show(shapes: Sequence[Sequence[int]]) -> str:
    return ", ".join(str(tuple(s)) for s in shapes)


def close_all(objects: Iterable[Any]) -> None:
    """``close()`` each object that has one (data cursors: prefetchers and their sources),
    all of them even when one fails; then raise the first failure."""
    first: BaseException | None = None
    for obj in list(objects):
        close = getattr(obj, "close", None)
        if close is None:
            continue
        try:
            close()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first
