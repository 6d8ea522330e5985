"""``purine-caffe time`` runs and prints what Caffe's ``time`` does: one initial
forward+backward, then ``--iterations`` timed passes, and lines in Caffe's format whose
figures relate as Caffe's do (the total covers the timed passes only)."""

import re

import pytest

from purine.caffe.net import Net
from purine.cli import main
from tests.test_cli import NET

# A pass long enough (tens of ms) that one pass more or less in the total is plain to see
HEAVY = NET.replace("dim: 8 dim: 1 dim: 6 dim: 6 } shape { dim: 8 }",
                    "dim: 64 dim: 3 dim: 32 dim: 32 } shape { dim: 64 }").replace(
    "num_output: 4 kernel_size: 3", "num_output: 32 kernel_size: 5")

GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ \S+:\d+\] (.*)$")
NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan)"


def parse_caffe_time(stderr: str) -> dict:
    """Read ``caffe time``'s lines in their order; fail on any line out of place."""
    lines = [m.group(1) for m in map(GLOG.match, stderr.splitlines()) if m]
    start = lines.index("Performing Forward")
    it = iter(lines[start:])
    out: dict = {"iterations": [], "layers": []}

    def expect(pattern: str) -> tuple[str, ...]:
        line = next(it)
        m = re.fullmatch(pattern, line)
        assert m, f"{line!r} does not match {pattern!r}"
        return m.groups()

    expect(r"Performing Forward")
    out["initial_loss"] = float(expect(rf"Initial loss: {NUM}")[0])
    expect(r"Performing Backward")
    expect(r"\*\*\* Benchmark begins \*\*\*")
    n = int(expect(r"Testing for (\d+) iterations\.")[0])
    for k in range(1, n + 1):
        i, ms = expect(rf"Iteration: (\d+) forward-backward time: {NUM} ms\.")
        assert int(i) == k
        out["iterations"].append(float(ms))
    expect(r"Average time per layer: ")
    line = next(it)
    while not line.startswith("Average Forward pass"):
        m = re.fullmatch(rf"( *)(\S+)\tforward: {NUM} ms\.", line)
        assert m and len(m.group(1) + m.group(2)) >= 10, line  # setw(10), right-aligned
        b = re.fullmatch(rf"( *)(\S+)\tbackward: {NUM} ms\.", next(it))
        assert b and b.group(1, 2) == m.group(1, 2)
        out["layers"].append((m.group(2), float(m.group(3)), float(b.group(3))))
        line = next(it)
    out["forward"] = float(re.fullmatch(rf"Average Forward pass: {NUM} ms\.", line).group(1))
    out["backward"] = float(expect(rf"Average Backward pass: {NUM} ms\.")[0])
    out["forward_backward"] = float(expect(rf"Average Forward-Backward: {NUM} ms\.")[0])
    out["total"] = float(expect(rf"Total Time: {NUM} ms\.")[0])
    expect(r"\*\*\* Benchmark ends \*\*\*")
    return out


@pytest.fixture
def passes(monkeypatch):
    """Every forward and backward pass of a Net, with whether the profiler timed it."""
    log: list[tuple[str, bool]] = []
    forward, backward = Net.forward, Net.backward

    def counted_forward(self, *a, **k):
        log.append(("F", self.dispatcher.profile))
        return forward(self, *a, **k)

    def counted_backward(self, *a, **k):
        log.append(("B", self.dispatcher.profile))
        return backward(self, *a, **k)

    monkeypatch.setattr(Net, "forward", counted_forward)
    monkeypatch.setattr(Net, "backward", counted_backward)
    return log


@pytest.mark.parametrize("iterations", [1, 3])
def test_one_initial_pass_then_the_timed_ones(tmp_path, passes, capsys, iterations):
    (tmp_path / "net.prototxt").write_text(NET)
    assert main(["time", "--model", str(tmp_path / "net.prototxt"),
                 "--iterations", str(iterations)]) == 0
    # the initial pass untimed, as Caffe's, then each timed pass under the profiler
    assert passes == [("F", False), ("B", False)] + [("F", True), ("B", True)] * iterations
    t = parse_caffe_time(capsys.readouterr().err)
    assert len(t["iterations"]) == iterations


def test_lines_and_figures_relate_as_caffes(tmp_path, capsys):
    assert HEAVY != NET
    (tmp_path / "net.prototxt").write_text(HEAVY)
    assert main(["time", "-model", str(tmp_path / "net.prototxt"), "-iterations", "3"]) == 0
    t = parse_caffe_time(capsys.readouterr().err)
    # the TRAIN net's layers in net order (Accuracy is TEST only)
    assert [name for name, _, _ in t["layers"]] == ["data", "conv", "relu", "pool", "ip",
                                                     "loss"]
    assert t["initial_loss"] > 0
    iters, total = t["iterations"], t["total"]
    assert len(iters) == 3 and all(ms > 0 for ms in iters)
    # Total Time spans the three timed passes and only them: their sum plus the clock
    # reads and log lines between them (well under a millisecond), and no fourth pass
    assert min(iters) > 5.0
    assert sum(iters) <= total * (1 + 1e-5)
    assert total - sum(iters) < 0.25 * min(iters)
    assert t["forward_backward"] == pytest.approx(total / 3, rel=1e-5)
    assert t["forward"] + t["backward"] == pytest.approx(sum(iters) / 3, rel=1e-4)
    # one worker runs the ops one after another: the layers fit inside their pass
    assert sum(f for _, f, _ in t["layers"]) <= t["forward"] * (1 + 1e-4)
    assert sum(b for _, _, b in t["layers"]) <= t["backward"] * (1 + 1e-4)
    conv = dict((name, (f, b)) for name, f, b in t["layers"])["conv"]
    assert conv[0] > 0 and conv[1] > 0


def test_time_with_a_placement_splits_dropout_into_towers(tmp_path, capsys):
    """The towers' Dropout streams are keyed as in ``train`` (the placed net's own draws)."""
    net = NET.replace('layer { name: "ip"', 'layer { name: "drop" type: "Dropout" bottom: "pool" '
                      'top: "pool" dropout_param { dropout_ratio: 0.5 } }\nlayer { name: "ip"')
    (tmp_path / "net.prototxt").write_text(net)
    (tmp_path / "two.placement").write_text(
        'layer { name: "conv" location: "cpu:0" location: "cpu:1" }\n'
        'layer { name: "relu" location: "cpu:0" location: "cpu:1" }\n'
        'layer { name: "pool" location: "cpu:0" location: "cpu:1" }\n'
        'layer { name: "drop" location: "cpu:0" location: "cpu:1" }\n')
    assert main(["time", "--model", str(tmp_path / "net.prototxt"), "--placement",
                 str(tmp_path / "two.placement"), "--iterations", "2"]) == 0
    t = parse_caffe_time(capsys.readouterr().err)
    assert len(t["iterations"]) == 2
    assert {"drop/tower0", "drop/tower1"} <= {name for name, *_ in t["layers"]}
