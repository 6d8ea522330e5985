"""The memory planner: blobs whose lifetimes in an iteration never overlap share one buffer.
A plan maps each shared blob to a buffer key; the dispatcher gives the blob a view of that
buffer and orders the ops of blobs sharing a buffer as if they were one blob."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from purine.backend import allocate
from purine.backend.memory import capacity, show_bytes
from purine.errors import PurineError
from purine.graph import CPU, Blob, Graph, Location, Op

try:
    import resource
except ImportError:  # not on POSIX: no address-space limit to read
    resource = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Buffer:
    """The key of one shared buffer: its memory space (as a location on thread 0) and a
    number unique within the plan."""

    location: Location
    index: int

    def __str__(self) -> str:
        return f"buffer{self.index}@{self.location}"


@dataclass
class MemoryPlan:
    storage: dict[Blob, Buffer] = field(default_factory=dict)  # planned blob -> its buffer
    buffer_bytes: dict[Buffer, int] = field(default_factory=dict)
    blob_bytes: int = 0  # what the planned blobs take with a buffer each

    @property
    def planned_bytes(self) -> int:
        return sum(self.buffer_bytes.values())

    def summary(self) -> str:
        return (f"memory plan: {len(self.storage)} blobs in {len(self.buffer_bytes)} buffers, "
                f"{self.planned_bytes / 1e6:.1f} MB instead of {self.blob_bytes / 1e6:.1f} MB")


def blob_nbytes(blob: Blob) -> int:
    return blob.count * np.dtype(blob.dtype).itemsize


RLIMIT_SLACK = 16 << 20
"""Address space kept free under RLIMIT_AS beyond the bytes counted: a pass maps some tens
of KiB that no op declares (the dispatcher's objects, numpy's iteration buffers), and
OpenBLAS's threaded GEMM mallocs on every call and ends the process when that fails."""


def address_space_left() -> int | None:
    """Bytes this process may still map under its RLIMIT_AS soft limit (``ulimit -v``): the
    limit less the address space mapped now; None without a limit. Past it an allocation
    fails with MemoryError however much RAM is free, so it is a capacity too."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):  # no procfs: the limit alone
        mapped = 0
    return max(soft - mapped, 0)


def check_capacity(location: Location, need: int, held: int, what: str,
                   verb: str = "asks", *, held_allocated: bool = False) -> None:
    """Raise a PurineError when ``need`` more bytes cannot fit in ``location``'s memory
    beside the ``held`` bytes already there; ``what`` names the asker (``verb``'s subject).
    Host memory is also bounded by the process's address-space limit (RLIMIT_AS), less what
    is mapped already: ``held`` counts against it unless ``held_allocated`` (bytes already
    allocated are mapped, so counted once)."""
    total = capacity(location)
    device = "this machine" if location.device == "cpu" else f"gpu {location.index}"
    already = f" beside the {show_bytes(held)} held already" if held else ""
    if total is not None and held + need > total:
        raise PurineError(f"{what} {verb} for {show_bytes(need)}{already}; {device} has "
                          f"{show_bytes(total)} of memory")
    left = address_space_left() if location.device == "cpu" else None
    if left is not None:
        left = max(left - RLIMIT_SLACK, 0)
    pending = need if held_allocated else held + need
    if left is not None and pending > left:
        raise PurineError(f"{what} {verb} for {show_bytes(need)}{already}; this process may "
                          f"map {show_bytes(left)} more (its address-space limit, RLIMIT_AS, "
                          f"less {show_bytes(RLIMIT_SLACK)} kept free)")


def require_bytes(nbytes: int, what: str, location: Location = CPU) -> None:
    """Refuse, before allocating it, a buffer of ``nbytes`` at ``location`` that cannot fit
    in its memory (RAM or the container's limit, a GPU's memory, the process's
    address-space limit): a PurineError whose one line says ``what`` asked for how much and
    what there is."""
    check_capacity(location, int(nbytes), 0, what)


def plan_memory(graph: Graph, ops: Sequence[Op] | None, keep: Iterable[Blob],
                loops: Sequence[tuple[int, int]] = ()) -> MemoryPlan:
    """Share buffers between the blobs of ``ops`` (one iteration in program order; None:
    all of ``graph``'s ops) whose live intervals [first write, last access] do not overlap.
    A blob shares only if it is not in ``keep`` and its first access writes it without
    reading it, so no value flows into it from a previous iteration or from outside.
    ``loops`` are disjoint slices [start, end) of ``ops`` that the caller runs several times
    in a row (the passes of ``iter_size``): a blob written before a loop and read in it is
    read by every repetition, so it lives to the loop's end. (A blob first written in a
    loop is written again by each repetition before any read.)"""
    ops = graph.ops if ops is None else ops
    keep = set(keep)
    first: dict[Blob, int] = {}
    last: dict[Blob, int] = {}
    fresh: set[Blob] = set()  # first access writes without reading
    for i, o in enumerate(ops):
        for b in o.inputs + o.outputs:
            if b not in first:
                first[b] = i
                if b not in o.inputs:
                    fresh.add(b)
            last[b] = i
    intervals: dict[Blob, tuple[int, int]] = {}
    for b in first:  # first-access order: program order, deterministic
        if b in keep or b not in fresh or blob_nbytes(b) == 0:
            continue
        start, end = first[b], last[b]
        for ls, le in loops:
            if start < ls <= end < le:
                end = le - 1
        intervals[b] = (start, end)

    plan = MemoryPlan()
    free: dict[tuple, list[Buffer]] = {}    # memory space -> buffers free now
    live: list[tuple[int, Buffer]] = []     # (end, buffer) of the blobs holding one
    for b in sorted(intervals, key=lambda b: intervals[b][0]):  # stable: ties by first access
        start, end = intervals[b]
        for e, buf in [x for x in live if x[0] < start]:
            live.remove((e, buf))
            free.setdefault(buf.location.memory, []).append(buf)
        need = blob_nbytes(b)
        plan.blob_bytes += need
        pool = free.setdefault(b.location.memory, [])
        fits = [buf for buf in pool if plan.buffer_bytes[buf] >= need]
        if fits:  # the smallest buffer that is big enough
            buf = min(fits, key=lambda x: (plan.buffer_bytes[x], x.index))
        elif pool:  # else the largest, grown
            buf = max(pool, key=lambda x: (plan.buffer_bytes[x], -x.index))
            plan.buffer_bytes[buf] = need
        else:
            host, device, index = b.location.memory
            buf = Buffer(Location(device, index, 0, host), len(plan.buffer_bytes))
            plan.buffer_bytes[buf] = need
        if buf in pool:
            pool.remove(buf)
        plan.storage[b] = buf
        live.append((end, buf))
    return plan


class Store:
    """Blob storage by blob name, shared by the dispatchers of one net's builds (a build per
    set of shapes): the blobs of one name, whatever their shapes, are views of one buffer,
    which grows when a blob outgrows it and never shrinks (Caffe's Blob::Reshape keeps its
    capacity), so a net cycling through a few sizes stops allocating after the first cycle.
    A buffer that grows is a new one: ``generation`` counts the growths, and a dispatcher
    that holds views of an older generation drops them. Arrays bound from outside (a
    parameter another net owns) are kept as given."""

    def __init__(self) -> None:
        self.buffers: dict[Any, tuple[Any, Location]] = {}  # name -> flat uint8 buffer
        self.external: dict[str, Any] = {}  # name -> an array bound from outside
        self.held: dict[tuple, int] = {}  # bytes allocated here, by memory space
        self.generation = 0

    def reserve(self, location: Location, need: int, what: str) -> None:
        """Refuse an allocation that cannot fit beside what this store holds in the same
        memory space, before making it (numpy's zeros would reserve terabytes of virtual
        memory and leave the failure to the first touch); then count it held."""
        space = location.memory
        check_capacity(location, need, self.held.get(space, 0), what, held_allocated=True)
        self.held[space] = self.held.get(space, 0) + need

    def unreserve(self, location: Location, size: int) -> None:
        self.held[location.memory] -= size

    def view(self, blob: Blob) -> Any:
        """``blob``'s array: a view of its name's buffer, grown first where too small."""
        bound = self.external.get(blob.name)
        if bound is not None:
            if tuple(bound.shape) != blob.shape:
                raise PurineError(f"blob '{blob.name}' {blob.shape} is bound to an array of "
                                  f"shape {tuple(bound.shape)}, which cannot change shape")
            return bound
        need = blob_nbytes(blob)
        buf = self.flat(blob.name, blob.location, need,
                        f"blob '{blob.name}' {blob.shape} {blob.dtype}")
        return buf[:need].view(blob.dtype).reshape(blob.shape)

    def flat(self, key: Any, location: Location, need: int, what: str) -> Any:
        """The flat buffer of ``key`` (a blob name, or a memory plan's buffer: the builds of
        a net share the plan's buffers by number too), ``need`` bytes at least."""
        buf, _ = self.buffers.get(key, (None, None))
        if buf is None or buf.nbytes < need:
            self.release(key)
            self.reserve(location, need, what)
            buf = allocate(location, (need,), "uint8")
            self.buffers[key] = (buf, location)
        return buf

    def bind(self, name: str, array: Any) -> None:
        self.release(name)
        self.external[name] = array
        self.generation += 1  # views of what the name was bound to before go

    def release(self, name: Any) -> None:
        """Forget a name's storage (made anew, zero, on the next use)."""
        self.external.pop(name, None)
        buf, location = self.buffers.pop(name, (None, None))
        if buf is not None:
            self.unreserve(location, buf.nbytes)
            self.generation += 1
