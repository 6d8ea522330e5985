"""The purine-caffe command end to end: train from a solver.prototxt, snapshots, resume,
Caffe-format logs that parse_log.py's expressions read, test/time, and user errors."""

import datetime
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from purine.backend import gpu_unavailable
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb

NET = """name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label" dummy_data_param {
  shape { dim: 8 dim: 1 dim: 6 dim: 6 } shape { dim: 8 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy"
  include { phase: TEST } }
"""

DEPLOY = """name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 1 dim: 6 dim: 6 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""


def write_solver(tmp, **extra) -> str:
    (tmp / "net.prototxt").write_text(NET)
    fields = dict(net=f'"{tmp}/net.prototxt"', base_lr=0.1, momentum=0.9, lr_policy='"inv"',
                  gamma=0.01, power=0.75, display=2, max_iter=6, snapshot=3,
                  snapshot_prefix=f'"{tmp}/tiny"', test_iter=2, test_interval=3,
                  random_seed=5, solver_mode="CPU")
    fields.update(extra)
    path = tmp / "solver.prototxt"
    path.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()))
    return str(path)


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "purine.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


# The expressions of Caffe's tools/extra/parse_log.py, and its timestamp rule.
ITERATION = re.compile(r"Iteration (\d+)")
TRAIN_OUTPUT = re.compile(r"Train net output #(\d+): (\S+) = ([\.\deE+-]+)")
TEST_OUTPUT = re.compile(r"Test net output #(\d+): (\S+) = ([\.\deE+-]+)")
LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")


def log_time(line: str, year: int) -> datetime.datetime:
    head, stamp = line.split()[:2]
    whole, micro = stamp.rsplit(".", 1)
    h, m, s = (int(x) for x in whole.split(":"))
    return datetime.datetime(year, int(head[1:3]), int(head[3:5]), h, m, s, int(micro))


def parse_log(text: str):
    iteration, lr = -1, float("nan")
    train, test = [], []
    start = None
    for line in text.splitlines():
        if start is None and "Solving" in line:
            start = log_time(line, 2026)
        m = ITERATION.search(line)
        if m:
            iteration = int(m.group(1))
        if iteration == -1:
            continue
        log_time(line, 2026)  # every line after the start carries a parseable time
        m = LEARNING_RATE.search(line)
        if m:
            lr = float(m.group(1))
        for regex, rows in ((TRAIN_OUTPUT, train), (TEST_OUTPUT, test)):
            m = regex.search(line)
            if m:
                rows.append((iteration, lr, m.group(2), float(m.group(3))))
    return start, train, test


def test_train_writes_snapshots_and_a_log_that_parse_log_reads(tmp_path):
    solver = write_solver(tmp_path)
    r = cli("train", "--solver", solver)
    assert r.returncode == 0, r.stderr
    log = r.stderr
    start, train, test = parse_log(log)
    assert start is not None
    assert [row[0] for row in train] == [0, 2, 4]
    assert all(name == "loss" for _, _, name, _ in train)
    lr0 = 0.1 * (1 + 0.01 * 2) ** -0.75
    # As with Caffe's logs, a row carries the lr printed after the previous display.
    assert train[1][1] == pytest.approx(0.1) and train[2][1] == pytest.approx(lr0, rel=1e-5)
    assert [(it, name) for it, _, name, _ in test] == [
        (0, "accuracy"), (0, "loss"), (3, "accuracy"), (3, "loss"), (6, "accuracy"),
        (6, "loss")]
    assert "Optimization Done." in log
    assert "(* 1 = " in log
    for it in (3, 6):
        for ext in ("caffemodel", "solverstate"):
            assert (tmp_path / f"tiny_iter_{it}.{ext}").exists()
    st = pb.SolverState()
    st.ParseFromString((tmp_path / "tiny_iter_6.solverstate").read_bytes())
    assert st.iter == 6 and len(st.history) == 4

    # Resume from iteration 3: the weights at 6 are the same bits as the straight run.
    straight = (tmp_path / "tiny_iter_6.caffemodel").read_bytes()
    r = cli("train", "-solver", solver, "-snapshot", str(tmp_path / "tiny_iter_3.solverstate"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tiny_iter_6.caffemodel").read_bytes() == straight

    # The snapshot scores with `test` and loads in OpenCV with a deploy prototxt.
    r = cli("test", "--model", str(tmp_path / "net.prototxt"), "--weights",
            str(tmp_path / "tiny_iter_6.caffemodel"), "--iterations", "2")
    assert r.returncode == 0, r.stderr
    assert re.search(r"\] accuracy = [\d.]+", r.stderr) and "Loss: " in r.stderr
    cv2 = pytest.importorskip("cv2", reason="the OpenCV cross-check needs opencv-python-headless<5")
    from purine.caffe import TEST, Net

    (tmp_path / "deploy.prototxt").write_text(DEPLOY)
    ours = Net(str(tmp_path / "deploy.prototxt"), str(tmp_path / "tiny_iter_6.caffemodel"), TEST)
    x = np.random.default_rng(0).standard_normal((2, 1, 6, 6)).astype(np.float32)
    want = ours.forward(data=x)["prob"]
    cv = cv2.dnn.readNetFromCaffe(str(tmp_path / "deploy.prototxt"),
                                  str(tmp_path / "tiny_iter_6.caffemodel"))
    cv.setInput(x)
    np.testing.assert_allclose(cv.forward("prob"), want, rtol=1e-5, atol=1e-6)


def test_user_errors_are_one_line_with_an_exit_code(tmp_path):
    solver = write_solver(tmp_path)
    r = cli("train", "--solver", solver, "--weights", "a.caffemodel", "--snapshot", "b")
    assert r.returncode == 1 and "not both" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.prototxt"
    bad.write_text('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 } } }\n'
                   'layer { name: "fc" type: "InnerProduct" bottom: "y" top: "z" }\n')
    r = cli("time", "--model", str(bad))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "layer 'fc' (type InnerProduct): unknown bottom blob 'y'" in r.stderr
    r = cli("train", "--solver", str(tmp_path / "missing.prototxt"))
    assert r.returncode == 1 and "missing.prototxt: cannot read" in r.stderr
    why = gpu_unavailable()
    r = cli("train", "--solver", solver, "--gpu", "0" if why else "99")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert (f"--gpu 0: {why}" if why else "--gpu 99: this machine has") in r.stderr


def test_time_prints_caffe_style_per_layer_lines(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    r = cli("time", "-model", str(tmp_path / "net.prototxt"), "-iterations", "2")
    assert r.returncode == 0, r.stderr
    for layer in ("conv", "pool", "ip", "loss"):
        assert re.search(rf"\s{layer}\tforward: [\d.e+-]+ ms\.", r.stderr)
        assert re.search(rf"\s{layer}\tbackward: [\d.e+-]+ ms\.", r.stderr)
    assert re.search(r"Average Forward-Backward: [\d.e+-]+ ms\.", r.stderr)


def test_divergence_stops_with_the_iteration_and_keeps_the_last_snapshot(tmp_path):
    solver = write_solver(tmp_path, base_lr=1e30, max_iter=50, snapshot=1, test_interval=0,
                          lr_policy='"fixed"')
    r = cli("train", "--solver", solver)
    assert r.returncode == 1
    assert re.search(r"iteration \d+: the loss is (nan|inf)", r.stderr)
    models = sorted(tmp_path.glob("tiny_iter_*.caffemodel"))
    assert models
    pb.NetParameter().ParseFromString(models[-1].read_bytes())


@pytest.mark.parametrize("sig,effect,stops", [(signal.SIGINT, "stop", True),
                                              (signal.SIGHUP, "snapshot", False)])
def test_signals_follow_their_effects(tmp_path, sig, effect, stops):
    solver = write_solver(tmp_path, max_iter=100000, snapshot=0, test_interval=0, display=0,
                          snapshot_after_train="true")
    p = subprocess.Popen([sys.executable, "-m", "purine.cli", "train", "--solver", solver],
                         stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        p.send_signal(sig)
        time.sleep(1)
        if not stops:
            p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert "Optimization stopped early." in err
    snaps = list(tmp_path.glob("tiny_iter_*.caffemodel"))
    assert len(snaps) == (1 if stops else 2), err  # SIGHUP: one more snapshot before the stop


def test_killing_during_snapshots_leaves_only_complete_files(tmp_path):
    solver = write_solver(tmp_path, max_iter=100000, snapshot=1, test_interval=0, display=0)
    rng = np.random.default_rng(0)
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-m", "purine.cli", "train", "--solver", solver],
                             stderr=subprocess.DEVNULL)
        time.sleep(2.0 + rng.uniform(0, 0.5))
        p.kill()
        p.wait()
    models = list(tmp_path.glob("*.caffemodel"))
    states = list(tmp_path.glob("*.solverstate"))
    assert models and states
    for f in models:
        net = pb.NetParameter()
        net.ParseFromString(f.read_bytes())
        assert [len(l.blobs) for l in net.layer if l.name in ("conv", "ip")] == [2, 2]
    for f in states:
        st = pb.SolverState()
        st.ParseFromString(f.read_bytes())
        assert len(st.history) == 4 and os.path.exists(st.learned_net)


def test_resume_is_bit_identical_without_a_random_seed(tmp_path):
    solver = write_solver(tmp_path, random_seed=-1, test_interval=0)
    assert cli("train", "--solver", solver).returncode == 0
    straight = (tmp_path / "tiny_iter_6.caffemodel").read_bytes()
    r = cli("train", "--solver", solver, "--snapshot", str(tmp_path / "tiny_iter_3.solverstate"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tiny_iter_6.caffemodel").read_bytes() == straight


def test_trace_keeps_the_first_iterations_test_and_display(tmp_path):
    solver = write_solver(tmp_path)
    r = cli("train", "--solver", solver, "--trace", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stderr
    assert "Iteration 0, Testing net (#0)" in r.stderr
    assert re.search(r"Iteration 0 \(.*\), loss = ", r.stderr)
    assert (tmp_path / "t.json").exists()


@pytest.mark.parametrize("spec, ids", [("0", [0]), ("1,0", [1, 0]), ("all", [0, 1]),
                                       (" 0 , 1 ", [0, 1])])
def test_gpu_ids_as_caffe_takes_them(monkeypatch, spec, ids):
    import purine.backend as backend
    from purine.cli import _gpus, build_parser

    monkeypatch.setattr(backend, "gpu_unavailable", lambda: None)
    monkeypatch.setattr(backend, "gpu_count", lambda: 2)
    monkeypatch.setattr(backend, "set_tf32", lambda on: None)
    args = build_parser().parse_args(["train", "--solver", "s.prototxt", "--gpu", spec])
    assert _gpus(args) == ids


@pytest.mark.parametrize("spec, message", [
    ("2", "this machine has 2 GPU(s), ids 0..1"), ("0,0", "each at most once"),
    ("zero", "expected GPU ids such as 0 or 0,1, or 'all'")])
def test_bad_gpu_ids_are_named(monkeypatch, spec, message):
    import purine.backend as backend
    from purine.cli import _gpus, build_parser

    monkeypatch.setattr(backend, "gpu_unavailable", lambda: None)
    monkeypatch.setattr(backend, "gpu_count", lambda: 2)
    args = build_parser().parse_args(["train", "--solver", "s.prototxt", "--gpu", spec])
    with pytest.raises(PurineError, match=re.escape(f"--gpu {spec}: ") + ".*" + re.escape(message)):
        _gpus(args)


def test_solver_mode_gpu_without_a_gpu_trains_on_the_cpu(tmp_path):
    """The zoo's solvers say solver_mode: GPU; on a machine without one, Caffe users get a
    warning and a CPU run rather than a refusal."""
    if gpu_unavailable() is None:
        pytest.skip("this machine has a GPU: solver_mode GPU would use it")
    solver = write_solver(tmp_path, solver_mode="GPU", max_iter=2, snapshot=0,
                          test_interval=0)
    r = cli("train", "--solver", solver)
    assert r.returncode == 0, r.stderr
    assert "solver_mode is GPU but" in r.stderr and "training on the CPU" in r.stderr


def test_update_worker_puts_the_update_ops_on_a_track_of_their_own(tmp_path):
    import json

    solver = write_solver(tmp_path)
    r = cli("train", "--solver", solver, "--update-worker", "--trace", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stderr
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    tracks = {names[e["tid"]] for e in trace["traceEvents"]
              if e["ph"] == "X" and e["name"].endswith("/update")}
    assert tracks == {"parameter server"}, tracks  # the worker that runs only updates
