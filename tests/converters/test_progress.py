"""The progress bar of the long commands: drawn through tqdm when stderr is a terminal (a fake
one here, rendered as a terminal shows it), absent in pipes, forced by PURINE_PROGRESS; log
lines and error messages always keep lines of their own; `train` never draws one."""

import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from purine import cli
from purine.caffe import TEST, Net
from purine.converters import compute_image_mean, convert_imageset, extract_features
from purine.converters.progress import Progress, wanted
from tests.converters.helpers import TINY_NET, make_imageset

GLOG = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] ")

NET = TINY_NET + 'layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" }\n'

DEPLOY = """name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 4 dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def screen(text):
    """The lines a terminal shows for ``text``: '\\r' returns to column 0, later characters
    overwrite earlier ones, '\\n' starts a new line (tqdm at position 0 moves no further)."""
    lines, line, col = [], [], 0
    for ch in text:
        if ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            line[col:col + 1] = [ch]
            col += 1
    if line:
        lines.append("".join(line).rstrip())
    return lines


# A line of the net (or solver) text that Caffe's set-up log prints, unprefixed as glog
# continues a message, after "Initializing net from parameters:".
NET_TEXT = re.compile(r" *(\w+ \{|\w+: \S.*|\})")


def messages(lines):
    """The messages of glog lines; any other line fails the test (a bar mixed into one), but
    the net text's lines under the set-up log's "Initializing net from parameters:"."""
    out: list[str] = []
    in_net_text = False
    for line in lines:
        m = GLOG.match(line)
        if m is None and in_net_text and NET_TEXT.fullmatch(line):
            continue
        assert m, f"not a whole log line: {line!r}"
        out.append(line[m.end():])
        in_net_text = out[-1].rstrip() in ("Initializing net from parameters:",
                                           "Initializing solver from parameters:")
    return out


@pytest.fixture
def stderr(monkeypatch):
    """Swap sys.stderr for a terminal (``stderr(True)``) or a pipe; returns the stream."""
    monkeypatch.delenv("PURINE_PROGRESS", raising=False)

    def swap(tty):
        stream = FakeTTY() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", stream)
        return stream
    return swap


def convert(tmp_path, n=5, missing=None):
    listfile, _ = make_imageset(tmp_path / "images", n=n)
    if missing is not None:  # list line ``missing`` names an image that is not there
        lines = listfile.read_text().splitlines()
        lines[missing - 1] = "gone.png 0"
        listfile.write_text("\n".join(lines) + "\n")
    return convert_imageset.main([str(tmp_path / "images") + "/", str(listfile),
                                  str(tmp_path / "db")])


def test_convert_imageset_draws_the_bar_below_its_log_lines(tmp_path, stderr):
    out = stderr(True)
    assert convert(tmp_path / "tty") == 0
    shown = screen(out.getvalue())
    assert re.fullmatch(r"db \[#{30}\] 5/5 100% \d\d:\d\d<\d\d:\d\d [\d.]+record/s", shown[-1])
    assert "\rdb [" + "." * 30 + "] 0/5   0%" in out.getvalue()  # drawn from the start
    tty_messages = messages(shown[:-1])

    pipe = stderr(False)
    assert convert(tmp_path / "pipe") == 0
    assert "\r" not in pipe.getvalue()
    # The same log lines, whole, in the same order: the bar only adds its own last line.
    assert tty_messages == [m.replace(str(tmp_path / "pipe"), str(tmp_path / "tty"))
                            for m in messages(screen(pipe.getvalue()))]
    assert "A total of 5 images." in tty_messages and tty_messages[-1] == "Processed 5 files."


def test_an_error_mid_run_erases_the_bar_and_starts_its_own_line(tmp_path, stderr):
    out = stderr(True)
    assert convert(tmp_path, missing=4) == 1
    assert "] 0/5   0%" in out.getvalue()  # a bar was drawn before the error
    shown = screen(out.getvalue())
    list_path = tmp_path / "images" / "list.txt"
    assert shown[-1] == (f"convert_imageset: {list_path}:4: image not found: "
                         f"{tmp_path / 'images'}/gone.png")
    messages(shown[:-1])  # nothing of the bar is left on any line
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("tty, env, drawn", [
    (True, None, True), (False, None, False), (True, "0", False), (False, "1", True),
    (True, "off", False), (False, "yes", True), (True, "maybe", True)])
def test_terminal_or_purine_progress_decides(monkeypatch, tty, env, drawn):
    if env is None:
        monkeypatch.delenv("PURINE_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("PURINE_PROGRESS", env)
    stream = FakeTTY() if tty else io.StringIO()
    assert wanted(stream) is drawn
    with Progress(10, "items", stream=stream) as bar:
        for i in range(10):
            bar.update(i + 1)
    text = stream.getvalue()
    if drawn:
        assert screen(text) == [screen(text)[-1]]
        assert screen(text)[-1].startswith("items [" + "#" * 30 + "] 10/10 100% ")
    else:
        assert text == ""


def test_a_closed_or_plain_stream_is_no_terminal(monkeypatch):
    monkeypatch.delenv("PURINE_PROGRESS", raising=False)
    closed = open(os.devnull, "w")
    closed.close()  # its isatty() raises ValueError
    assert wanted(closed) is False and wanted(object()) is False


def test_compute_image_mean_counts_the_records(tmp_path, stderr):
    assert convert(tmp_path) == 0
    out = stderr(True)
    assert compute_image_mean.main([str(tmp_path / "db"), str(tmp_path / "mean.binaryproto")]) \
        == 0
    shown = screen(out.getvalue())
    bar = [i for i, line in enumerate(shown) if line.startswith("db [")]
    assert len(bar) == 1 and "] 5/5 100% " in shown[bar[0]]
    msgs = messages(shown[:bar[0]] + shown[bar[0] + 1:])
    assert "Starting Iteration" in msgs and "Processed 5 files." in msgs


@pytest.fixture
def weights(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    with Net(str(tmp_path / "net.prototxt"), phase=TEST) as net:
        net.save(tmp_path / "w.caffemodel")
    return str(tmp_path / "net.prototxt"), str(tmp_path / "w.caffemodel")


def test_extract_features_counts_batches(tmp_path, weights, stderr):
    out = stderr(True)
    model, caffemodel = weights
    assert extract_features.main([caffemodel, model, "ip", str(tmp_path / "feat"), "3",
                                  "lmdb"]) == 0
    shown = screen(out.getvalue())
    bar = [i for i, line in enumerate(shown) if line.startswith("extract_features [")]
    assert len(bar) == 1 and "] 3/3 100% " in shown[bar[0]] and "batch/s" in shown[bar[0]]
    msgs = messages(shown[:bar[0]] + shown[bar[0] + 1:])
    assert msgs[-2:] == ["Extracted features of 12 query images for feature blob ip",
                         "Successfully extracted the features!"]


def test_cli_test_counts_batches_and_keeps_each_batch_line_whole(weights, stderr):
    model, caffemodel = weights
    out = stderr(True)
    assert cli.main(["test", "--model", model, "--weights", caffemodel, "--iterations", "3"]) \
        == 0
    shown = screen(out.getvalue())
    bar = [i for i, line in enumerate(shown) if line.startswith("test [")]
    assert len(bar) == 1 and "] 3/3 100% " in shown[bar[0]]
    msgs = messages(shown[:bar[0]] + shown[bar[0] + 1:])
    batches = [m for m in msgs if m.startswith("Batch ")]
    assert [m.split(",")[0] for m in batches] == ["Batch 0"] * 2 + ["Batch 1"] * 2 + \
        ["Batch 2"] * 2
    before = len(messages(shown[:bar[0]]))
    assert msgs[before].startswith("Loss: ")  # the summary comes after the bar

    pipe = stderr(False)
    assert cli.main(["test", "--model", model, "--weights", caffemodel, "--iterations", "3"]) \
        == 0
    assert "\r" not in pipe.getvalue()
    assert [m for m in messages(screen(pipe.getvalue())) if m.startswith("Batch ")] == batches


def test_train_keeps_caffes_log_lines_on_a_terminal(tmp_path, weights, stderr):
    model, _ = weights
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{model}"\nbase_lr: 0.1\nlr_policy: "fixed"\ndisplay: 1\n'
                      f'max_iter: 2\nsnapshot_prefix: "{tmp_path}/tiny"\nsolver_mode: CPU\n')
    out = stderr(True)
    assert cli.main(["train", "--solver", str(solver)]) == 0
    assert "\r" not in out.getvalue()
    msgs = messages(screen(out.getvalue()))
    assert any(m.startswith("Iteration 2, loss = ") for m in msgs)


@pytest.mark.parametrize("tool", ["onnx", "pytorch"])
def test_exporters_count_layers(tmp_path, stderr, tool):
    if tool == "onnx":
        pytest.importorskip("onnx", reason="ONNX export needs the onnx package")
        from purine.converters.onnx_export import main
        out_path = tmp_path / "net.onnx"
    else:
        from purine.converters.pytorch_export import main
        out_path = tmp_path / "out"
    (tmp_path / "deploy.prototxt").write_text(DEPLOY)
    with Net(str(tmp_path / "deploy.prototxt"), phase=TEST) as net:
        net.params["ip"][0].data[...] = np.arange(48, dtype=np.float32).reshape(3, 16) / 48
        net.save(tmp_path / "w.caffemodel")
    out = stderr(True)
    assert main(["--model", str(tmp_path / "deploy.prototxt"), "--weights",
                 str(tmp_path / "w.caffemodel"), str(out_path)]) == 0
    shown = screen(out.getvalue())
    # Input, InnerProduct, ReLU, Softmax: the bar, then the command's summary line. The bar
    # gives up cells to keep the line within 80 columns (tests/converters/test_progress_width.py).
    assert re.match(rf"caffe_to_{tool} \[#{{10,30}}\] 4/4 100% ", shown[-2])
    assert len(shown[-2]) <= 80
    assert "layer/s" in shown[-2] and shown[-1].startswith(str(tmp_path / "deploy.prototxt"))


def test_importing_the_tools_does_not_import_tqdm():
    code = ("import sys, purine, purine.cli, purine.converters.convert_imageset, "
            "purine.converters.progress; print('tqdm' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
