"""The dispatcher: threaded runs equal the sequential run bit for bit, independent ops run
concurrently, kernel errors name the op."""

import threading

import numpy as np
import pytest

from purine.errors import PurineError
from purine.graph import Graph, Location
from purine.runtime import Dispatcher


def matmul(a, b, out):
    np.matmul(a, b, out=out)


def add_inplace(a, out):
    out += a


def random_graph(threads: int) -> tuple[Graph, list]:
    """A diamond-heavy graph with in-place updates, ops spread over ``threads`` workers."""
    g = Graph()
    rng = np.random.default_rng(0)
    blobs = [g.blob(f"b{i}", (32, 32)) for i in range(4)]
    values = [rng.standard_normal((32, 32)).astype(np.float32) for _ in blobs]
    k = 0
    for step in range(24):
        i, j = rng.choice(len(blobs), 2, replace=False)
        loc = Location(thread=k % threads)
        k += 1
        if step % 3 == 2:
            g.op(f"acc{step}", "Acc", [blobs[i], blobs[j]], [blobs[j]],
                 lambda ins, outs: add_inplace(ins[0], outs[0]), loc)
        else:
            out = g.blob(f"m{step}", (32, 32))
            g.op(f"mm{step}", "MatMul", [blobs[i], blobs[j]], [out],
                 lambda ins, outs: matmul(ins[0], ins[1], outs[0]), loc)
            blobs.append(out)
    return g, values


@pytest.mark.parametrize("threads", [2, 4])
def test_threaded_run_equals_sequential_run_bit_for_bit(threads):
    results = []
    for mode in ("sequential", "threaded", "threaded"):
        g, values = random_graph(threads)
        d = Dispatcher(g)
        for b, v in zip(list(g.blobs.values())[:4], values):
            d.array(b)[...] = v
        (d.run_sequential if mode == "sequential" else d.run)()
        results.append({n: d.array(b).copy() for n, b in g.blobs.items()})
        d.close()
    for other in results[1:]:
        for name, value in results[0].items():
            assert np.array_equal(value, other[name]), name
    assert len(results[0]) > 10


def test_independent_ops_on_two_locations_run_concurrently():
    g = Graph()
    x = g.blob("x", (1,))
    ya, yb = g.blob("ya", (1,)), g.blob("yb", (1,))
    a_started, b_started = threading.Event(), threading.Event()

    def a(ins, outs):  # waits for b: a sequential schedule would time out here
        a_started.set()
        assert b_started.wait(5), "op b never ran while op a was running"
        outs[0][...] = 1

    def b(ins, outs):
        b_started.set()
        assert a_started.wait(5)
        outs[0][...] = 2

    g.op("a", "A", [x], [ya], a, Location(thread=0))
    g.op("b", "B", [x], [yb], b, Location(thread=1))
    d = Dispatcher(g)
    d.run()
    assert d.array(ya)[0] == 1 and d.array(yb)[0] == 2


def test_a_failing_kernel_names_its_op_and_later_ops_do_not_run():
    g = Graph()
    x, y, z = g.blob("x", (1,)), g.blob("y", (1,)), g.blob("z", (1,))
    ran = []

    def bad(ins, outs):
        raise PurineError("label 7 is out of range")

    g.op("loss", "Bad", [x], [y], bad, Location(thread=0))
    g.op("after", "After", [y], [z], lambda i, o: ran.append(1), Location(thread=1))
    d = Dispatcher(g)
    with pytest.raises(PurineError, match="op 'loss': label 7 is out of range"):
        d.run()
    assert ran == []


def test_run_of_a_subsequence_takes_unwritten_inputs_as_ready():
    g = Graph()
    x, y, z = g.blob("x", (2,)), g.blob("y", (2,)), g.blob("z", (2,))
    first = g.op("double", "F", [x], [y], lambda i, o: np.multiply(i[0], 2, out=o[0]))
    second = g.op("plus1", "F", [y], [z], lambda i, o: np.add(i[0], 1, out=o[0]))
    d = Dispatcher(g, profile=True)
    d.array(x)[...] = [1, 2]
    d.run([first])
    assert d.array(y).tolist() == [2, 4] and d.array(z).tolist() == [0, 0]
    d.array(y)[...] = [10, 20]
    d.run([second])
    assert d.array(z).tolist() == [11, 21]
    assert [e.op.name for e in d.trace] == ["double", "plus1"]
    assert all(e.end >= e.start for e in d.trace)
