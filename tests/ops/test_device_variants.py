"""The one form GPU code takes in the ops: a host body and a device body joined by
``backend.device_variant``, chosen by where the first argument lives; and no op module left
that compares an array module with numpy to pick its code."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import numpy as np

from purine import backend
from purine.backend import device_variant, scatter_add, stable_argsort
from purine.ops import activation, conv, solver

OPS_DIR = Path(__file__).resolve().parents[2] / "purine" / "ops"


class FakeDeviceArray:
    """Counts as a GPU array: ``is_device_array`` looks at the module of the type."""

    def __init__(self) -> None:
        self.sorted_along: list[int] = []

    def argsort(self, axis: int = -1) -> str:
        self.sorted_along.append(axis)
        return "device order"


FakeDeviceArray.__module__ = "cupy_stand_in"


def recorder(tag: str, calls: list) -> object:
    def body(*args, **kwargs):
        calls.append((tag, args, kwargs))
        return tag

    return body


def test_the_first_argument_picks_the_body_and_the_arguments_pass_intact():
    calls: list = []
    op = device_variant(recorder("device", calls))(recorder("host", calls))
    dev, host = FakeDeviceArray(), np.zeros(3)
    assert backend.is_device_array(dev) and not backend.is_device_array(host)
    assert op(dev, host, 7, k=2) == "device"
    assert op(host, dev, 8, k=3) == "host"  # all of an op's arrays live where it runs
    (tag1, args1, kw1), (tag2, args2, kw2) = calls
    assert (tag1, len(args1), kw1) == ("device", 3, {"k": 2})
    assert args1[0] is dev and args1[1] is host and args1[2] == 7
    assert (tag2, len(args2), kw2) == ("host", 3, {"k": 3})
    assert args2[0] is host and args2[1] is dev and args2[2] == 8


def test_a_decorated_op_keeps_the_host_bodys_name_and_docstring():
    # graph.kernel names an op after its function
    assert activation.relu_backward.__name__ == "relu_backward"
    assert conv.conv_forward.__name__ == "conv_forward"
    assert solver.sgd_update.__doc__.startswith("h = momentum * h + local_rate * g")


def test_a_numpy_call_runs_the_host_body():
    x = np.array([-2.0, -0.5, 0.0, 3.0])
    y = np.empty_like(x)
    activation.relu_forward(x, y, negative_slope=0.25)
    np.testing.assert_array_equal(y, [-0.5, -0.125, 0.0, 3.0])


def test_scatter_add_sums_repeated_indices_on_the_host():
    target = np.zeros(4)
    scatter_add(target, np.array([0, 2, 0, 0]), np.array([1.0, 2.0, 3.0, 4.0]))
    np.testing.assert_array_equal(target, [8.0, 0.0, 2.0, 0.0])


def test_scatter_add_on_a_device_is_cupyx_scatter_add(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(
        scatter_add=lambda *a: calls.append(a)))
    target, index, values = FakeDeviceArray(), np.array([1, 1]), np.array([0.5, 0.25])
    scatter_add(target, index, values)
    assert len(calls) == 1
    assert calls[0][0] is target and calls[0][1] is index and calls[0][2] is values


def test_stable_argsort_keeps_ties_in_index_order_on_the_host():
    # long enough that numpy's default (introsort) would not keep the order of ties
    a = np.tile(np.array([1, 0, 1, 0], dtype=np.int8), 16)
    order = stable_argsort(a)
    np.testing.assert_array_equal(order, np.r_[np.arange(1, 64, 2), np.arange(0, 64, 2)])
    rows = stable_argsort(np.array([[3.0, 1.0, 3.0], [2.0, 2.0, 0.0]]), axis=-1)
    np.testing.assert_array_equal(rows, [[1, 0, 2], [2, 0, 1]])


def test_stable_argsort_on_a_device_is_the_arrays_own_argsort():
    # CuPy's argsort is always stable and takes no kind
    a = FakeDeviceArray()
    assert stable_argsort(a, axis=0) == "device order"
    assert a.sorted_along == [0]


def module_comparisons(source: str) -> list[int]:
    """Lines of ``source`` that compare something with numpy by identity (``xp is np``,
    ``get_array_module(a) is not np``): the branch that device_variant replaces."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        if not any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            continue
        if any(isinstance(o, ast.Name) and o.id in ("np", "numpy")
               for o in (node.left, *node.comparators)):
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_an_array_module_branch():
    source = ("def f(x):\n    xp = get_array_module(x)\n    if xp is not np:\n        pass\n"
              "    return 1 if get_array_module(x) is np else 2\n")
    assert module_comparisons(source) == [3, 5]
    assert module_comparisons("def f(x):\n    return x is None\n") == []


def test_no_op_module_branches_on_its_array_module():
    files = sorted(OPS_DIR.glob("*.py"))
    assert {"activation.py", "array.py", "conv.py", "loss.py", "lrn.py", "pooling.py",
            "solver.py"} <= {f.name for f in files}
    found = {f.name: module_comparisons(f.read_text()) for f in files}
    assert {name: lines for name, lines in found.items() if lines} == {}
