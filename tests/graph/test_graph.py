"""Graph contracts: derived dependencies, validation, pruning, composition."""

import pytest

from purine.errors import GraphError
from purine.graph import Graph, Location, kernel


def nop(ins, outs):
    pass


def chain():
    g = Graph()
    x, y, z = (g.blob(n, (2,)) for n in "xyz")
    a = g.op("a", "A", [x], [y], nop)          # y = f(x)
    r = g.op("r", "R", [y], [z], nop)          # reads y
    inplace = g.op("i", "I", [y], [y], nop)    # in place: y = g(y)
    after = g.op("b", "B", [y], [x], nop)      # x = h(y), overwrites a source
    return g, (a, r, inplace, after)


def test_dependencies_are_derived_from_program_order():
    g, (a, r, inplace, after) = chain()
    deps = g.dependencies()
    assert deps[a] == []
    assert deps[r] == [a]                    # read after write
    assert set(deps[inplace]) == {a, r}      # after the writer and every reader of y
    assert set(deps[after]) == {inplace, a}  # reads new y; writes x that a read


def test_validate_accepts_in_place_and_rejects_a_second_writer():
    g, _ = chain()
    g.validate()
    g2 = Graph()
    x, y = g2.blob("x", (1,)), g2.blob("y", (1,))
    g2.op("w1", "W", [x], [y], nop)
    g2.op("w2", "W", [x], [y], nop)
    with pytest.raises(GraphError, match="'y' is written by op 'w1' and again by op 'w2'"):
        g2.validate()


def test_cross_location_edge_needs_a_copy_of_equal_shape():
    g = Graph()
    gpu = Location("gpu", 0)
    x = g.blob("x", (3,))
    y = g.blob("y", (3,), location=gpu)
    with pytest.raises(GraphError, match="needs a Copy op"):
        g.op("f", "F", [x], [y], nop, gpu)
    g.op("copy", "Copy", [x], [y], nop, gpu)
    g.validate()
    z = g.blob("z", (4,), location=gpu)
    g.op("bad", "Copy", [x], [z], nop, gpu)
    with pytest.raises(GraphError, match="Copy op 'bad' joins blobs of shapes"):
        g.validate()


def test_blob_and_op_names_are_unique_and_blobs_must_belong():
    g = Graph()
    x = g.blob("x", (1,))
    with pytest.raises(GraphError, match="blob 'x' already exists"):
        g.blob("x", (1,))
    other = Graph().blob("y", (1,))
    with pytest.raises(GraphError, match="uses blob 'y', which is not in this graph"):
        g.op("f", "F", [x], [other], nop)


def test_compose_prefixes_names_and_binds_shared_blobs():
    inner = Graph()
    a, b = inner.blob("a", (2,)), inner.blob("b", (2,))
    inner.op("f", "F", [a], [b], nop)
    outer = Graph()
    shared = outer.blob("shared", (2,))
    m0 = outer.compose(inner, "r0/", bind={"a": shared})
    m1 = outer.compose(inner, "r1/", bind={"a": shared})
    assert m0["a"] is shared and m1["a"] is shared
    assert sorted(outer.blobs) == ["r0/b", "r1/b", "shared"]
    assert [o.name for o in outer.ops] == ["r0/f", "r1/f"]
    assert outer.ops[1].inputs == (shared,) and outer.ops[1].outputs == (m1["b"],)
    with pytest.raises(GraphError, match="bound to 'wrong'"):
        outer.compose(inner, "r2/", bind={"a": outer.blob("wrong", (3,))})


def test_kernel_adapts_a_function_to_the_op_interface():
    def scale(x, y, *, by):
        y[:] = [by * v for v in x]

    run = kernel(scale, by=3)
    out = [0, 0]
    run([[1, 2]], [out])
    assert out == [3, 6]
    assert run.__name__ == run.__qualname__ == "scale"   # ops and traces are named after it
