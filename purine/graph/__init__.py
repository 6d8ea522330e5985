"""The bi-graph: blobs (data) and ops (computation) placed at locations.

A graph is built in program order; the dependencies between ops (read-after-write,
write-after-write, write-after-read for in-place ops) are derived from that order, never
written by hand. The graph knows nothing of Caffe or of numpy vs cupy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from purine.errors import GraphError

Kernel = Callable[[list[Any], list[Any]], None]
"""An op's kernel: ``kernel(inputs, outputs)`` reads the input arrays and fills the output
arrays in place (an in-place op gets the same array in both lists)."""


def kernel(fn: Callable[..., None], **params: Any) -> Kernel:
    """Adapt ``fn(*inputs, *outputs, **params)`` to the op kernel interface."""

    def run(ins: list, outs: list) -> None:
        fn(*ins, *outs, **params)

    run.__name__ = run.__qualname__ = fn.__name__
    return run


class Stateful(Protocol):
    """Run-time state an op keeps outside its blobs (a random stream, a data cursor), which
    snapshots save and restore beside the blobs."""

    def state(self) -> dict: ...

    def restore(self, state: dict) -> None: ...


@dataclass(frozen=True, order=True)
class Location:
    """Where a blob lives and an op runs: MPI rank, device kind and index, worker thread
    (a CPU worker thread or a CUDA stream)."""

    device: str = "cpu"
    index: int = 0
    thread: int = 0
    host: int = 0

    @property
    def memory(self) -> tuple[int, str, int]:
        """The memory space: blobs in one space need no Copy op between them."""
        return (self.host, self.device, self.index)

    def __str__(self) -> str:
        host = f"rank{self.host}/" if self.host else ""
        return f"{host}{self.device}:{self.index}/t{self.thread}"


CPU = Location()


@dataclass(eq=False)
class Blob:
    """A named array of fixed shape and dtype at a location. Its storage belongs to the
    runtime; ``meta`` carries what the builders attach (e.g. ``lr_mult`` of a parameter)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    location: Location = CPU
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def count(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __repr__(self) -> str:
        return f"Blob({self.name!r}, {self.shape}, {self.dtype}, {self.location})"


@dataclass(eq=False)
class Op:
    """``inputs >> kernel >> outputs`` at a location. An op writes only its outputs; an
    in-place op names a blob as both input and output."""

    name: str
    type: str
    inputs: tuple[Blob, ...]
    outputs: tuple[Blob, ...]
    kernel: Kernel
    location: Location = CPU

    def __repr__(self) -> str:
        ins = ", ".join(b.name for b in self.inputs)
        outs = ", ".join(b.name for b in self.outputs)
        return f"Op({self.name!r}: {{{ins}}} >> {self.type} >> {{{outs}}} @ {self.location})"


class Graph:
    """Blobs and ops in program order."""

    def __init__(self) -> None:
        self.blobs: dict[str, Blob] = {}
        self.ops: list[Op] = []
        self._op_names: set[str] = set()

    # -- building ---------------------------------------------------------------------
    def blob(
        self,
        name: str,
        shape: Sequence[int],
        dtype: str = "float32",
        location: Location = CPU,
        **meta: Any,
    ) -> Blob:
        if name in self.blobs:
            raise GraphError(f"blob '{name}' already exists in the graph")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise GraphError(f"blob '{name}' has a negative dimension: {shape}")
        b = Blob(name, shape, dtype, location, dict(meta))
        self.blobs[name] = b
        return b

    def op(
        self,
        name: str,
        type: str,
        inputs: Iterable[Blob],
        outputs: Iterable[Blob],
        kernel: Kernel,
        location: Location | None = None,
    ) -> Op:
        inputs, outputs = tuple(inputs), tuple(outputs)
        if name in self._op_names:
            raise GraphError(f"op '{name}' already exists in the graph")
        for b in inputs + outputs:
            if self.blobs.get(b.name) is not b:
                raise GraphError(f"op '{name}' uses blob '{b.name}', which is not in this graph")
        if location is None:
            location = (outputs or inputs)[0].location if (outputs or inputs) else CPU
        for b in inputs + outputs:
            if b.location.memory != location.memory and type != "Copy":
                raise GraphError(
                    f"op '{name}' at {location} touches blob '{b.name}' at {b.location}: "
                    "an edge between memory spaces needs a Copy op"
                )
        o = Op(name, type, inputs, outputs, kernel, location)
        self.ops.append(o)
        self._op_names.add(name)
        return o

    def compose(
        self, other: Graph, prefix: str = "", bind: Mapping[str, Blob] | None = None
    ) -> dict[str, Blob]:
        """Copy ``other`` into this graph, naming its blobs and ops ``prefix + name``; the
        blobs named in ``bind`` are not copied but replaced by the given blobs of this
        graph. Returns the map from ``other``'s blob names to this graph's blobs."""
        bind = dict(bind or {})
        mapped: dict[str, Blob] = {}
        for name, b in other.blobs.items():
            if name in bind:
                target = bind[name]
                if target.shape != b.shape or target.dtype != b.dtype:
                    raise GraphError(
                        f"compose: blob '{name}' {b.shape} {b.dtype} is bound to "
                        f"'{target.name}' {target.shape} {target.dtype}"
                    )
                mapped[name] = target
            else:
                mapped[name] = self.blob(prefix + name, b.shape, b.dtype, b.location, **b.meta)
        for o in other.ops:
            self.op(
                prefix + o.name,
                o.type,
                [mapped[b.name] for b in o.inputs],
                [mapped[b.name] for b in o.outputs],
                o.kernel,
                o.location,
            )
        return mapped

    def remove_ops(self, ops: Iterable[Op]) -> None:
        """Drop ops (e.g. copies a pass turned out not to need); their blobs stay."""
        gone = set(ops)
        self.ops = [o for o in self.ops if o not in gone]
        self._op_names -= {o.name for o in gone}

    # -- queries ----------------------------------------------------------------------
    def has_op(self, name: str) -> bool:
        return name in self._op_names

    def writers(self, blob: Blob) -> list[Op]:
        return [o for o in self.ops if blob in o.outputs]

    def dependencies(self, ops: Sequence[Op] | None = None,
                     storage: Mapping[Blob, Any] | None = None) -> dict[Op, list[Op]]:
        """For each op, the earlier ops it must wait for: the last writer of each input
        (read after write), the last writer of each output (write after write), and every
        reader of an output's current value (write after read). ``storage`` maps a blob to
        the key of the memory it lives in (a blob absent from it is its own key): the
        hazards are those of the keys, so blobs sharing memory are ordered like one blob."""
        ops = self.ops if ops is None else ops
        storage = storage or {}
        last_writer: dict[Any, Op] = {}
        readers: dict[Any, list[Op]] = defaultdict(list)
        deps: dict[Op, list[Op]] = {}
        for o in ops:
            ins = [storage.get(b, b) for b in o.inputs]
            outs = [storage.get(b, b) for b in o.outputs]
            d: dict[Op, None] = {}
            for k in ins:
                if k in last_writer:
                    d[last_writer[k]] = None
            for k in outs:
                if k in last_writer:
                    d[last_writer[k]] = None
                for r in readers[k]:
                    d[r] = None
            d.pop(o, None)
            deps[o] = list(d)
            for k in ins:
                readers[k].append(o)
            for k in outs:
                last_writer[k] = o
                readers[k] = []
        return deps

    def validate(self) -> None:
        """Check the contracts: a blob has one writer, except in-place ops that also read
        it; a Copy op joins blobs of equal shape."""
        first_writer: dict[Blob, Op] = {}
        for o in self.ops:
            for b in o.outputs:
                if b in first_writer and b not in o.inputs:
                    raise GraphError(
                        f"blob '{b.name}' is written by op '{first_writer[b].name}' and again "
                        f"by op '{o.name}', which does not read it (only in-place ops may)"
                    )
                first_writer.setdefault(b, o)
            if o.type == "Copy":
                shapes = {b.shape for b in o.inputs + o.outputs}
                if len(shapes) != 1:
                    raise GraphError(f"Copy op '{o.name}' joins blobs of shapes {sorted(shapes)}")

    def __repr__(self) -> str:
        return f"Graph({len(self.blobs)} blobs, {len(self.ops)} ops)"
