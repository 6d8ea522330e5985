"""Where the dispatcher puts CUDA events: derived from the graph (checked exactly), and
issued around the right kernels (checked with the backend's stream calls replaced by
recorders, on numpy arrays, so the protocol is tested on a machine without a GPU)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import purine.runtime.dispatcher as dispatcher_module
import purine.runtime.memory as memory_module
from purine.graph import Graph, Location
from purine.runtime.dispatcher import Dispatcher, _Plan

CPU = Location("cpu", 0, 0)
S0 = Location("gpu", 0, 0)
S1 = Location("gpu", 0, 1)
G1 = Location("gpu", 1, 0)


def add_one(ins, outs):
    outs[0][...] = ins[0] + 1


def diamond() -> Graph:
    """host -> s0 -> (s0, s1) -> s0 -> host, with a copy between the devices."""
    g = Graph()
    h = g.blob("h", (4,), location=CPU)
    a = g.blob("a", (4,), location=S0)
    b = g.blob("b", (4,), location=S0)
    c = g.blob("c", (4,), location=S1)
    d = g.blob("d", (4,), location=S0)
    e = g.blob("e", (4,), location=G1)
    out = g.blob("out", (4,), location=CPU)
    g.op("up", "Copy", [h], [a], add_one, S0)
    g.op("left", "T", [a], [b], add_one, S0)
    g.op("right", "T", [a], [c], add_one, S1)
    g.op("join", "T", [c], [d], add_one, S0)
    g.op("peer", "Copy", [d], [e], add_one, G1)
    g.op("down", "Copy", [e], [out], add_one, CPU)
    g.op("refill", "T", [out], [h], add_one, CPU)  # writes what "up" read: waits for it
    return g


def names(ops) -> list[str]:
    return sorted(o.name for o in ops)


def test_events_only_where_gpu_work_crosses_a_stream_or_reaches_the_host():
    g = diamond()
    plan = _Plan(g, g.ops)
    waits = {o.name: names(p) for o, p in plan.waits.items()}
    assert waits == {
        "right": ["up"],            # s0 -> s1
        "join": ["right"],          # s1 -> s0
        "peer": ["join"],           # gpu0 -> gpu1
        "down": ["peer"],           # gpu1 -> host: the host blocks
        "refill": ["up"],  # host overwrites h, which the upload on s0 read ("down" is a
                           # host op: done when it returned)
    }
    assert names(plan.records) == ["join", "peer", "right", "up"]
    assert "left" not in waits  # same stream: ordered by the stream itself
    assert plan.streams == {S0, S1, G1}


def test_a_graph_on_one_stream_needs_no_event():
    g = Graph()
    x = g.blob("x", (2,), location=S0)
    y = g.blob("y", (2,), location=S0)
    z = g.blob("z", (2,), location=S0)
    g.op("f", "T", [x], [y], add_one, S0)
    g.op("g", "T", [y], [z], add_one, S0)
    plan = _Plan(g, g.ops)
    assert plan.waits == {} and plan.records == set()


class FakeStreams:
    """Stands in for the backend's stream calls; events are (location, serial)."""

    def __init__(self):
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.serial = 0

    def activate(self, loc):
        pass

    def record(self, loc):
        with self.lock:
            self.serial += 1
            ev = (loc, self.serial)
            self.log.append(("record", threading.current_thread().name, ev))
        return ev

    def wait(self, loc, ev):
        with self.lock:
            self.log.append(("wait", loc, ev))

    def stream(self, loc):
        raise AssertionError("profiling is off")


@pytest.fixture
def fake(monkeypatch):
    f = FakeStreams()
    for name in ("activate", "record", "wait", "stream"):
        monkeypatch.setattr(dispatcher_module, name, getattr(f, name))
    monkeypatch.setattr(memory_module, "allocate",
                        lambda loc, shape, dtype: np.zeros(shape, dtype))
    return f


@pytest.mark.parametrize("threaded", [False, True])
def test_every_cross_stream_consumer_waits_for_its_producers_event(fake, threaded):
    g = diamond()
    d = Dispatcher(g)
    d.array(g.blobs["h"])[...] = 1
    ran: list[str] = []

    def noting(fn, name):  # note the order kernels ran in
        def run(ins, outs):
            ran.append(name)
            fn(ins, outs)
        return run

    for o in g.ops:
        o.kernel = noting(o.kernel, o.name)
    (d.run if threaded else d.run_sequential)()
    np.testing.assert_array_equal(d.array(g.blobs["out"]), 6)
    np.testing.assert_array_equal(d.array(g.blobs["h"]), 7)
    recorded = {ev: ev for kind, _, ev in fake.log if kind == "record"}
    waits = [(loc, ev) for kind, loc, ev in fake.log if kind == "wait"]
    plan = _Plan(g, g.ops)
    expected = sorted((o.location, d._events[p]) for o, ps in plan.waits.items() for p in ps)
    assert sorted(waits) == expected
    assert all(ev in recorded for _, ev in waits)
    assert ran.index("right") > ran.index("up") and ran.index("refill") > ran.index("down")


def test_consecutive_runs_join_their_streams_on_the_device(fake):
    """Run 2's ops on s1 must follow run 1's work on s0 (and the reverse), though no edge
    of one run's plan reaches into the other's."""
    g = Graph()
    a = g.blob("a", (2,), location=S0)
    b = g.blob("b", (2,), location=S1)
    g.op("w0", "T", [a], [a], add_one, S0)
    g.op("w1", "T", [b], [b], add_one, S1)
    d = Dispatcher(g)
    d.run_sequential([g.ops[0]])
    assert [k for k, *_ in fake.log] == []  # one stream seen so far: nothing to join
    d.run_sequential([g.ops[1]])
    first = [e for k, _, e in fake.log if k == "record"]
    assert {e[0] for e in first} == {S1}
    fake.log.clear()
    d.run_sequential([g.ops[0]])
    waits = [(loc, ev) for k, loc, ev in fake.log if k == "wait"]
    assert waits == [(S0, first[0])]  # s0 waits for the end of s1's last run
