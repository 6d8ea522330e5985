"""Caffe's debug_info: after each layer's forward pass the mean absolute value of its tops and
parameters, after its backward pass that of the gradients it wrote, then the parameters' L1
and L2 norms; a solver's debug_info prints them on display iterations only."""

import re

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.caffe.solver import Solver

NET = """{debug}
layer {{ name: "x" type: "Input" top: "x" top: "y"
        input_param {{ shape {{ dim: 2 dim: 3 }} shape {{ dim: 2 }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "x" top: "p" param {{ name: "w" }}
        inner_product_param {{ num_output: 4 weight_filler {{ type: "gaussian" std: 1 }}
                              bias_filler {{ type: "constant" value: -0.5 }} }} }}
layer {{ name: "r" type: "ReLU" bottom: "p" top: "p" }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "p" bottom: "y" top: "loss" }}
"""


def values(lines: list[str], prefix: str) -> dict[str, float]:
    """'<what> data: v' / '<what> diff: v' lines starting with ``prefix`` -> {what: v}."""
    out = {}
    for line in lines:
        m = re.fullmatch(rf"    \[{prefix}\] Layer (.+) (?:data|diff): (\S+)", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def mean_abs(a) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64)).mean())


def test_a_nets_debug_info_logs_every_layer(log_lines):
    net = Net(NET.format(debug="debug_info: true"), phase=TRAIN, seed=3)
    x = np.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]], dtype=np.float32)
    y = np.array([2, 0], dtype=np.float32)
    w = net.params["ip"][0].data.copy()
    log_lines.clear()
    net.forward(x=x, y=y)
    pre = x @ w.T - 0.5  # the ip top before ReLU overwrote it in place
    fwd = values(log_lines, "Forward")
    assert list(fwd) == ["x, top blob x", "x, top blob y", "ip, top blob p", "ip, param blob w",
                         "ip, param blob 1", "r, top blob p", "loss, top blob loss"]
    expect = {"x, top blob x": mean_abs(x), "x, top blob y": 1.0, "ip, top blob p": mean_abs(pre),
              "ip, param blob w": mean_abs(w), "ip, param blob 1": 0.5,
              "r, top blob p": mean_abs(np.maximum(pre, 0)),
              "loss, top blob loss": float(net.blobs["loss"].data)}
    for k, v in expect.items():
        assert fwd[k] == pytest.approx(v, rel=1e-5), k
    log_lines.clear()
    net.backward()
    bwd = values(log_lines, "Backward")
    assert list(bwd) == ["loss, bottom blob p", "r, bottom blob p", "ip, param blob 0",
                         "ip, param blob 1"]
    assert bwd["ip, param blob 0"] == pytest.approx(mean_abs(net.params["ip"][0].diff), rel=1e-5)
    assert bwd["ip, param blob 1"] == pytest.approx(mean_abs(net.params["ip"][1].diff), rel=1e-5)
    assert bwd["r, bottom blob p"] == pytest.approx(mean_abs(net.blobs["p"].diff), rel=1e-5)
    norms = [line for line in log_lines if "All net params" in line]
    w, b = net.params["ip"][0], net.params["ip"][1]
    l1 = (mean_abs(w.data) * w.data.size + 0.5 * 4,
          mean_abs(w.diff) * w.diff.size + mean_abs(b.diff) * 4)
    l2 = (np.sqrt((w.data.astype(np.float64) ** 2).sum() + 4 * 0.25),
          np.sqrt((w.diff.astype(np.float64) ** 2).sum() + (b.diff.astype(np.float64) ** 2).sum()))
    m = re.fullmatch(r"    \[Backward\] All net params \(data, diff\): L1 norm = \((\S+), (\S+)\); "
                     r"L2 norm = \((\S+), (\S+)\)", norms[0])
    assert len(norms) == 1 and m
    np.testing.assert_allclose([float(v) for v in m.groups()], l1 + l2, rtol=1e-5)


def test_without_debug_info_nothing_is_logged(log_lines):
    net = Net(NET.format(debug=""), phase=TEST)
    net.forward(x=np.ones((2, 3), np.float32), y=np.zeros(2, np.float32))
    assert not [line for line in log_lines if "[Forward]" in line]
    assert not [op for op in net.graph.ops if op.type == "DebugInfo"]


def test_a_solvers_debug_info_logs_on_display_iterations_only(tmp_path, log_lines):
    (tmp_path / "net.prototxt").write_text(NET.format(debug="").replace(
        'type: "Input" top: "x" top: "y"\n        input_param { shape { dim: 2 dim: 3 } '
        'shape { dim: 2 } }',
        'type: "DummyData" top: "x" top: "y" dummy_data_param { shape { dim: 2 dim: 3 } '
        'shape { dim: 2 } data_filler { type: "constant" value: 1 } }'))
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{tmp_path}/net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\n'
                      "max_iter: 4\ndisplay: 2\ndebug_info: true\nrandom_seed: 1\n"
                      f'snapshot_prefix: "{tmp_path}/s"\nsnapshot_after_train: false\n')
    s = Solver(str(solver))
    log_lines.clear()
    s.step(4)
    marks = [re.match(r"Iteration \d+|    \[Forward\] Layer x", line).group(0).strip()
             for line in log_lines
             if line.startswith("Iteration") or "[Forward] Layer x" in line]
    # iterations 0 and 2 are displayed: their passes print, 1 and 3 print nothing
    assert marks == ["[Forward] Layer x", "[Forward] Layer x", "Iteration 0",
                     "Iteration 0", "[Forward] Layer x", "[Forward] Layer x", "Iteration 2",
                     "Iteration 2"]
    assert sum("All net params" in line for line in log_lines) == 2
