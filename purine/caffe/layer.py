"""The layer registry (Caffe type string -> graph builder) and what a builder is handed.

A builder adds its layer's forward ops and parameter blobs, and returns a function that adds
its backward ops; that function is called later, in reverse layer order, once the net knows
which gradients are needed (Caffe's need_backward / loss analysis)::

    @register("AbsVal")
    def absval(L: LayerBuild):
        x = L.bottom(0)
        y = L.top(0, x.shape)
        L.forward(act.absval_forward, [x], [y])

        def backward():
            L.backward(act.absval_backward, [L.saved(0), L.top_diff(0)], [L.bottom_diff(0)])
        return backward
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from purine.backend import RandomStream, stream_key
from purine.caffe.facts import declare
from purine.errors import LayerError, PurineError
from purine.formats import caffe_pb2 as pb

# kernel and Stateful live in purine.graph; imported here for this module's use and re-exported
# for the builders and users that import them from the layer registry.
from purine.graph import Blob, Graph, Location, Op, Stateful, kernel
from purine.ops import tensor

Backward = Callable[[], None]


Builder = Callable[["LayerBuild"], "Backward | None"]


class LegacyAxes:
    """pycaffe's num / channels / height / width over a blob's ``shape`` (1 past its axes)."""

    shape: tuple[int, ...]

    def _axis(self, i: int) -> int:
        return self.shape[i] if i < len(self.shape) else 1

    num = property(lambda self: self._axis(0))
    channels = property(lambda self: self._axis(1))
    height = property(lambda self: self._axis(2))
    width = property(lambda self: self._axis(3))


class NetServices(Protocol):
    """What a layer under construction asks of the net it joins (purine.caffe.net's
    NetBuilder provides it): calls go from the net down into builders and from a builder
    into this interface, so this module knows nothing of the net module. The services take
    plain values (names, shapes, specs, locations), never the LayerBuild, and raise a
    PurineError the LayerBuild turns into its own LayerError."""

    phase: int
    dtype: str
    seed: int
    location: Location  # where a layer goes when ``placement`` names it not
    placement: dict[str, Location]  # layer name -> where its ops and blobs go
    replica_of: dict[str, str]  # layer name -> the layer whose parameters it uses
    replica: tuple[int, int]  # (index, count) among data-parallel replicas
    input_shapes: dict[str, tuple[int, ...]]
    force_backward: bool
    graph: Graph
    data: dict[str, Blob]  # Caffe blob name -> its data blob
    initial: dict[Blob, np.ndarray]  # parameter blob -> its filled value
    stateful: dict[str, Stateful]  # run-time state snapshots must keep
    shared: dict[str, Any]  # other run-time objects every build of the net uses
    layers: list[LayerBuild]
    # The net's first build, when this one is another build of the same net for other
    # shapes: layers take over its run-time objects (data cursors, random streams, Python
    # layers' objects) and parameters, whose shapes must not change.
    base: NetServices | None
    decided: dict[int, tuple[tuple[int, ...], ...]]  # layer index -> tops a pass settled

    def add_param(self, layer: str, k: int, shape: tuple[int, ...], spec: pb.ParamSpec,
                  filler: pb.FillerParameter | None, lr_mult: float | None,
                  rng: np.random.Generator, location: Location) -> Blob: ...

    def add_op(self, layer: str, op_type: str, inputs: Sequence[Blob],
               outputs: Sequence[Blob], k: Any, location: Location) -> Op: ...

    def diff(self, name: str) -> Blob: ...

    def param_diff(self, layer: str, k: int, param: Blob) -> Blob: ...

    def param_grad(self, b: Blob) -> Blob: ...

    def require_scratch(self, location: Location, nbytes: int, what: str) -> None: ...


BUILDERS: dict[str, Builder] = {}


def register(*types: str, **facts: Any) -> Callable[[Builder], Builder]:
    """Register a builder under one or more Caffe type strings, with the types' facts
    (``purine.caffe.facts.LayerFacts``' fields: split, export, fork, colour, label ...)."""

    def deco(fn: Builder) -> Builder:
        for t in types:
            if t in BUILDERS:
                raise ValueError(f"layer type {t} registered twice")
            BUILDERS[t] = fn
        if facts:
            declare(*types, **facts)
        return fn

    return deco


class Settler:
    """How a layer whose top shapes each pass settles finds them, right before its forward
    op runs (Caffe calls every layer's Reshape there; for most layers the shapes follow
    from the bottoms' and the net's graph for them is made once, but a Python layer's
    ``reshape``, Filter's selector or a data layer's next batch decide them).

    ``before(bottoms)`` gets the bottoms' arrays (computed by the pass so far; none where
    ``reads_bottoms`` is false, and then the layers before it need not run first) and
    returns the top shapes. Where ``reshapes_in_forward``, the layer's forward op runs on
    its own and ``after()`` then returns the top shapes and arrays if the op gave its tops
    other shapes (a Python layer may reshape a top in ``forward``), else None."""

    reads_bottoms = True
    reshapes_in_forward = False

    def before(self, bottoms: list[Any]) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def after(self) -> tuple[tuple[tuple[int, ...], ...], list[Any]] | None:
        return None


class LayerBuild:
    """One layer under construction: its parameter message, bottoms, tops, parameter blobs,
    and the net-level services (blob naming, gradients, fillers, op placement)."""

    def __init__(self, net: NetServices, param: pb.LayerParameter, index: int,
                 name: str | None = None):
        self.net = net
        self.param = param
        self.name = name or param.name  # what its ops and blobs are named after
        self.type = param.type
        self.index = index
        self.phase = net.phase
        self.location = net.placement.get(self.name, net.location)
        if self.type == "Python" and self.location.device != "cpu":
            # pycaffe layers compute with numpy: on the host, their blobs copied over
            self.location = Location("cpu", 0, 0, self.location.host)
        source = net.data.get(param.bottom[0]) if param.bottom else None
        if self.type == "Split" and self.name not in net.placement and source is not None:
            self.location = source.location  # an implicit split stays put (the builder
            # refuses a Split without its bottom)
        # A bottom from another memory space arrives through a Copy op into a mirror here;
        # its gradient goes back through a Copy op after this layer's backward.
        self.mirrors: dict[int, Blob] = {}
        # Likewise a parameter this layer shares from a layer in another memory space: it
        # reads a mirror refreshed by a Copy op in its forward pass, and its gradient goes
        # home by a Copy op, to be summed with the other uses' there.
        self.param_homes: dict[int, Blob] = {}
        self.param_outs: dict[int, tuple[Blob, Blob]] = {}  # k -> (gradient here, at home)
        self.tops: list[Blob] = []
        self.params: list[Blob] = []
        self.forward_ops: list[Op] = []
        self.backward_ops: list[Op] = []
        self.bottoms: list[Blob] = [self._local(i, net.data[b])
                                    for i, b in enumerate(param.bottom)]
        self.loss_weights: list[float] = list(param.loss_weight)
        self.no_force_backward: set[int] = set()
        # Set by the net before backward() is called.
        self.bottom_need: list[bool] = []
        self.param_need: list[bool] = []
        self._saved: dict[int, Blob] = {}
        self.save_ops: list[Op] = []  # dropped again when no backward pass needs them
        self.settler: Settler | None = None  # set by layers whose top shapes a pass settles
        self._streams = 0

    def _local(self, i: int, b: Blob) -> Blob:
        if b.location.memory == self.location.memory:
            return b
        if self.param.bottom[i] in self.param.top:
            raise self.error(f"an in-place layer cannot run at {self.location}, away from its "
                             f"bottom '{b.name}' at {b.location}")
        m = self.net.graph.blob(f"{b.name}@{self.name}/{i}", b.shape, b.dtype, self.location)
        self.forward_ops.append(self.net.graph.op(
            f"{self.name}/CopyIn#{i}", "Copy", [b], [m], kernel(tensor.copy), self.location))
        self.mirrors[i] = m
        return m

    # -- checks and errors ------------------------------------------------------------
    def error(self, message: str) -> LayerError:
        return LayerError(self.name, self.type, message)

    def shapes(self) -> str:
        return ", ".join(f"{b.name} {tuple(b.shape)}" for b in self.bottoms)

    def expect(self, bottoms: int | tuple[int, int | None], tops: int | tuple[int, int | None]
               ) -> None:
        for what, have, want in (("bottom", len(self.bottoms), bottoms),
                                 ("top", len(self.param.top), tops)):
            lo, hi = (want, want) if isinstance(want, int) else want
            if have < lo or (hi is not None and have > hi):
                exp = str(lo) if lo == hi else (f"{lo} or more" if hi is None else f"{lo}-{hi}")
                raise self.error(f"needs {exp} {what} blob(s), got {have}")

    def bottom(self, i: int) -> Blob:
        return self.bottoms[i]

    # -- blobs ------------------------------------------------------------------------
    def top(self, i: int, shape: Sequence[int], dtype: str | None = None) -> Blob:
        """Create top ``i`` with ``shape``; an in-place top (same name as a bottom) reuses
        the bottom's blob, whose shape must then be ``shape``."""
        name = self.param.top[i]
        shape = tuple(int(d) for d in shape)
        if name in self.param.bottom:
            b = self.net.data[name]
            if b.shape != shape:
                raise self.error(f"in-place top '{name}' would change shape {b.shape} -> {shape}")
        else:
            if name in self.net.data:
                raise self.error(f"top '{name}' is produced by an earlier layer too; "
                                 "only in-place tops may reuse a name")
            b = self.net.graph.blob(name, shape, dtype or self.net.dtype, self.location)
        self.net.data[name] = b
        while len(self.tops) <= i:
            self.tops.append(b)
        self.tops[i] = b
        return b

    def alias_top(self, i: int, blob: Blob) -> None:
        """Top ``i`` names ``blob``'s data without a copy (Split, Reshape-like layers);
        its gradient is still a blob of its own."""
        self.net.data[self.param.top[i]] = blob
        while len(self.tops) <= i:
            self.tops.append(blob)
        self.tops[i] = blob

    def add_param(self, shape: Sequence[int], filler: pb.FillerParameter | None,
                  *, lr_mult: float | None = None) -> Blob:
        """The layer's next parameter blob, initialised with ``filler`` (or shared by
        ``ParamSpec.name``); ``lr_mult`` overrides the default of 1 where Caffe does."""
        k = len(self.params)
        specs = self.param.param
        spec = specs[k] if k < len(specs) else pb.ParamSpec()
        origin = self.net.replica_of.get(self.name)
        if origin is not None and not spec.name:  # copies share the original's blobs
            spec = pb.ParamSpec(name=f"{origin}[{k}]")
            spec.MergeFrom(specs[k] if k < len(specs) else pb.ParamSpec())
        try:
            b = self.net.add_param(self.name, k, tuple(int(d) for d in shape), spec, filler,
                                   lr_mult, self.rng(k), self.location)
        except LayerError:
            raise
        except PurineError as e:
            raise self.error(str(e)) from None
        if b.location.memory != self.location.memory:
            home = b
            b = self.net.graph.blob(f"{home.name}@{self.name}", home.shape, home.dtype,
                                    self.location, **home.meta)
            self.forward_ops.append(self.net.graph.op(
                f"{self.name}/ParamIn#{k}", "Copy", [home], [b], kernel(tensor.copy),
                self.location))
            self.param_homes[k] = home
        self.params.append(b)
        return b

    def saved(self, i: int) -> Blob:
        """Bottom ``i`` as the backward pass must see it: for an in-place layer a copy
        taken before the forward op overwrites it (call before adding the forward op)."""
        b = self.bottoms[i]
        if self.param.bottom[i] not in self.param.top:
            return b
        if i not in self._saved:
            s = self.net.graph.blob(f"{self.name}@saved{i}", b.shape, b.dtype, b.location)
            self.save_ops.append(self.forward(tensor.copy, [b], [s], op_type="Copy"))
            self._saved[i] = s
        return self._saved[i]

    def top_diff(self, i: int) -> Blob:
        return self.net.diff(self.param.top[i])

    def bottom_diff(self, i: int) -> Blob:
        m = self.mirrors.get(i)
        if m is None:
            return self.net.diff(self.param.bottom[i])
        name = f"{m.name}@diff"
        g = self.net.graph
        return g.blobs[name] if name in g.blobs else g.blob(name, m.shape, m.dtype, m.location)

    def param_diff(self, k: int) -> Blob:
        home = self.param_homes.get(k)
        if home is None:
            return self.net.param_diff(self.name, k, self.params[k])
        here = self.net.param_grad(self.params[k])  # the mirror's gradient blob
        self.param_outs[k] = (here, self.net.param_diff(self.name, k, home))
        return here

    def scratch(self, suffix: str, shape: Sequence[int], dtype: str | None = None) -> Blob:
        """A blob private to this layer (a mask, an argmax index, a saved statistic)."""
        return self.net.graph.blob(f"{self.name}@{suffix}", shape, dtype or self.net.dtype,
                                   self.location)

    def settles(self, settler: Settler) -> None:
        """Declare that a pass settles this layer's top shapes right before its forward op
        (see Settler); the net then builds its graph for the shapes the pass found."""
        self.settler = settler

    def decided(self) -> tuple[tuple[int, ...], ...] | None:
        """The top shapes a pass settled for this layer, when the net builds its graph for
        them (None at the net's first build, where the layer's set-up decides them)."""
        return self.net.decided.get(self.index)

    def kept(self, key: str) -> Any | None:
        """The run-time object this layer registered under ``key`` in the net's first build,
        when this is another build of the same net (None otherwise): a data cursor or a
        user's object goes on across builds instead of being made again."""
        if self.net.base is None:
            return None
        key = f"{self.name}/{key}"
        return self.net.stateful.get(key, self.net.shared.get(key))

    def share(self, key: str, obj: Any) -> None:
        """Register a run-time object that is no snapshot state (a user's Python layer, an
        output file) for the net's other builds to take over (``kept``)."""
        self.net.shared.setdefault(f"{self.name}/{key}", obj)

    def rng(self, key: int = 0) -> np.random.Generator:
        """A generator for one of this layer's one-off draws (the filler of parameter
        ``key``), seeded from the net seed, the layer index and ``key``."""
        return np.random.default_rng([self.net.seed, self.index, key])

    def random_stream(self) -> RandomStream:
        """A stream for an op that draws at every run (Dropout, DummyData); the net keeps
        it so that a snapshot can save how far it has gone. Its key is ``stream_key`` of
        the layer's index in the net; a net rewritten for parallelism (towers, replicas)
        re-keys its layers' streams by the layer of the user's net each one is, or is a
        part of (purine.parallel.placement.SplitNet.key_streams)."""
        n, self._streams = self._streams, self._streams + 1
        kept = self.kept(f"random#{n}")
        if kept is not None:
            return kept
        s = RandomStream(self.net.seed, stream_key(self.index, n))
        self.keep_state(f"random#{n}", s)
        return s

    def keep_state(self, key: str, obj: Stateful) -> None:
        """Register run-time state a resumed run must continue from (a random stream, a
        data cursor): the solver saves ``obj.state()`` in its snapshots and hands it back
        to ``obj.restore``. In another build of the net the first build's object stays."""
        self.net.stateful.setdefault(f"{self.name}/{key}", obj)

    # -- ops --------------------------------------------------------------------------
    def forward(self, fn: Callable[..., None], inputs: Sequence[Blob], outputs: Sequence[Blob],
                op_type: str | None = None, **params: Any) -> Op:
        op = self.net.add_op(self.name, op_type or _op_type(fn), inputs, outputs,
                             kernel(fn, **params), self.location)
        self.forward_ops.append(op)
        return op

    def backward(self, fn: Callable[..., None], inputs: Sequence[Blob],
                 outputs: Sequence[Blob], op_type: str | None = None, **params: Any) -> Op:
        op = self.net.add_op(self.name, op_type or _op_type(fn), inputs, outputs,
                             kernel(fn, **params), self.location)
        self.backward_ops.append(op)
        return op

    def needs_diff(self, i: int) -> bool:
        return self.bottom_need[i]

    def zero_diff(self, bottoms: Iterable[int], op_type: str) -> None:
        """Bottoms the layer reads but passes nothing down to (a shape, labels, ROIs): where
        the net still wants their gradient, that gradient is zero."""
        for i in bottoms:
            if self.needs_diff(i):
                self.backward(tensor.fill, [], [self.bottom_diff(i)], op_type=op_type,
                              value=0.0)

    def needs_param_diff(self, k: int) -> bool:
        return self.param_need[k]


def _op_type(fn: Callable[..., None]) -> str:
    return "".join(part.capitalize() for part in fn.__name__.split("_"))
