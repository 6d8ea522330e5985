"""parse_log and plot: the CSVs of Caffe's parse_log.py from a log written by our solver and
from hand-written Caffe logs (both glog prefixes, a run past New Year, 29 February), and the
charts read back from the PNG's header and pixels and from the SVG's text."""

import datetime
import importlib.util
import logging
import os
import re
import struct
import sys
import xml.etree.ElementTree as ET

import cv2
import numpy as np
import pytest

from purine.caffe.solver import Solver
from purine.cli import main as cli_main
from purine.converters import ConvertError
from purine.converters.plot import CAFFE_CHARTS, chart_panel, figure_panels, plot
from purine.converters.training_log import main as parse_log_main
from purine.converters.training_log import parse_log, read_training_log
from purine.errors import PurineError
from purine.log import GlogFormatter

# -- a log from our solver -------------------------------------------------------------------
NET = """
name: "tiny"
layer { name: "data" type: "DummyData" top: "x" top: "label" dummy_data_param {
  shape { dim: 6 dim: 4 } shape { dim: 6 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "p"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "accuracy" type: "Accuracy" bottom: "p" bottom: "label" top: "accuracy"
  include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "p" bottom: "label" top: "loss" }
"""
SOLVER = f"""net_param {{ {NET} }}
base_lr: 0.1 lr_policy: "step" gamma: 0.5 stepsize: 10 momentum: 0.9
max_iter: 20 display: 5 test_interval: 10 test_iter: 2 random_seed: 3 snapshot_after_train: false
"""


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def solver_log(tmp_path_factory):
    """(the log file our solver wrote in glog format, its log records)."""
    path = tmp_path_factory.mktemp("log") / "tiny.log"
    log = logging.getLogger("purine.test_training_log")
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO)
    to_file = logging.FileHandler(path)
    to_file.setFormatter(GlogFormatter())
    records = _Records()
    log.addHandler(to_file)
    log.addHandler(records)
    with Solver(SOLVER, log=log) as s:
        s.solve()
    to_file.close()
    log.handlers.clear()
    return str(path), records.records


def _outputs(records, kind):
    """[(iteration, name, value as the log prints it, seconds since Solving)] of one kind."""
    start = next(r.created for r in records if r.getMessage().startswith("Solving"))
    out, it = [], None
    for r in records:
        m = re.match(r"Iteration (\d+)", r.getMessage())
        if m:
            it = float(m.group(1))
        if r.msg.startswith("    %s net output") and r.args[0] == kind:
            out.append((it, r.args[2], float(f"{r.args[3]:g}"), r.created - start))
    return out


def test_our_log_gives_caffes_rows(solver_log, tmp_path):
    path, records = solver_log
    written = parse_log(path, tmp_path)
    assert written == [str(tmp_path / "tiny.log.train"), str(tmp_path / "tiny.log.test")]
    log = read_training_log(path)

    # display 5: train rows at 0, 5, 10, 15; each row's lr is the last "lr =" line before it
    # (Iteration 0 and 5 say 0.1, 10 says 0.05), the first row takes the second's
    assert [r["NumIters"] for r in log.train] == [0, 5, 10, 15]
    assert [r["LearningRate"] for r in log.train] == [0.1, 0.1, 0.1, 0.05]
    train = _outputs(records, "Train")
    assert [(r["NumIters"], r["loss"]) for r in log.train] == [(t[0], t[2]) for t in train]
    for row, t in zip(log.train, train):
        assert row["Seconds"] == pytest.approx(t[3], abs=2e-6)

    # test_interval 10: tests at 0, 10 and after the last iteration, 20
    assert [r["NumIters"] for r in log.test] == [0, 10, 20]
    assert [r["LearningRate"] for r in log.test] == [0.1, 0.1, 0.05]
    test = _outputs(records, "Test")
    assert [list(r)[3:] for r in log.test] == [["accuracy", "loss"]] * 3
    assert [(r["NumIters"], r["accuracy"], r["loss"]) for r in log.test] == [
        (a[0], a[2], b[2]) for a, b in zip(test[::2], test[1::2])]
    for row, t in zip(log.test, test[::2]):  # a row's time: its first output line's
        assert row["Seconds"] == pytest.approx(t[3], abs=2e-6)

    header = (tmp_path / "tiny.log.test").read_bytes().split(b"\r\n")[0]
    assert header == b"NumIters,Seconds,LearningRate,accuracy,loss"


# -- hand-written Caffe logs -----------------------------------------------------------------
CAFFE_LOG = """\
{a}1231 23:59:50.000000  4242 caffe.cpp:217] Starting Optimization
{a}1231 23:59:58.000000  4242 solver.cpp:279] Solving LeNet
{a}1231 23:59:58.000000  4242 solver.cpp:280] Learning Rate Policy: inv
{a}1231 23:59:58.500000  4242 solver.cpp:337] Iteration 0, Testing net (#0)
{a}1231 23:59:59.250000  4242 solver.cpp:404]     Test net output #0: accuracy = 0.0958
{a}1231 23:59:59.250000  4242 solver.cpp:404]     Test net output #1: loss = 2.30366 (* 1 = \
2.30366 loss)
{a}1231 23:59:59.500000  4242 solver.cpp:228] Iteration 0 (0 iter/s, 1.5s/100 iters), \
loss = 2.30634
{a}1231 23:59:59.500000  4242 solver.cpp:244]     Train net output #0: loss = 2.30634 (* 1 = \
2.30634 loss)
{a}1231 23:59:59.500000  4242 sgd_solver.cpp:106] Iteration 0, lr = 0.01
{b}0101 00:00:01.250000  4242 solver.cpp:228] Iteration 100, loss = 0.215
{b}0101 00:00:01.250000  4242 solver.cpp:244]     Train net output #0: loss = 0.215 (* 1 = \
0.215 loss)
{b}0101 00:00:01.250000  4242 sgd_solver.cpp:106] Iteration 100, lr = 0.00992565
{b}0101 00:00:02.000000  4242 solver.cpp:337] Iteration 200, Testing net (#0)
    a line without a glog prefix: Test net output #0: accuracy = 7
{b}0101 00:00:02.750000  4242 solver.cpp:404]     Test net output #0: accuracy = 0.9716
W0101 00:00:02.750000  4242 solver.cpp:404]     Test net output #1: loss = 8.9e-02 (* 1 = \
0.089 loss)
{b}0101 00:00:03.000000  4242 solver.cpp:228] Iteration 200, loss = 0.1
{b}0101 00:00:03.000000  4242 solver.cpp:244]     Train net output #0: loss = 0.1 (* 1 = \
0.1 loss)
{b}0101 00:00:03.000000  4242 sgd_solver.cpp:106] Iteration 200, lr = 0.00985258
{b}0101 00:00:03.500000  4242 solver.cpp:337] Iteration 300, Testing net (#0)
{b}0101 00:00:03.750000  4242 solver.cpp:404]     Test net output #0: accuracy = 0.98
"""
# Seconds from "Solving" (23:59:58) across New Year; the lr of a row is the last "lr =" seen,
# the first row takes the second's; the last test round never completes and is dropped
CAFFE_TRAIN = ("NumIters,Seconds,LearningRate,loss\r\n"
               "0.0,1.5,0.01,2.30634\r\n"
               "100.0,3.25,0.01,0.215\r\n"
               "200.0,5.0,0.00992565,0.1\r\n")
CAFFE_TEST = ("NumIters,Seconds,LearningRate,accuracy,loss\r\n"
              "0.0,1.25,0.00992565,0.0958,2.30366\r\n"
              "200.0,4.75,0.00992565,0.9716,0.089\r\n")


def _caffe_log(tmp_path, name, year_prefix: bool):
    a, b = ("I2025", "I2026") if year_prefix else ("I", "I")
    text = CAFFE_LOG.format(a=a, b=b)
    if year_prefix:
        text = text.replace("W0101", "W20260101")
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("year_prefix", [False, True], ids=["I1231", "I20251231"])
def test_caffe_log_both_prefixes_give_caffes_csv(tmp_path, year_prefix):
    log = _caffe_log(tmp_path, "caffe.INFO", year_prefix)
    # the year argument only counts for MMDD prefixes; YYYYMMDD ones name theirs
    parse_log(log, tmp_path / "out", year=2025 if not year_prefix else 1999)
    assert (tmp_path / "out" / "caffe.INFO.train").read_bytes().decode() == CAFFE_TRAIN
    assert (tmp_path / "out" / "caffe.INFO.test").read_bytes().decode() == CAFFE_TEST


def test_caffe_log_year_from_the_file_time(tmp_path):
    """Without a year, an MMDD log's last line is in the year the file was last written."""
    log = _caffe_log(tmp_path, "caffe.INFO", year_prefix=False)
    written = datetime.datetime(2026, 1, 1, 12).timestamp()
    os.utime(log, (written, written))
    parse_log(log, tmp_path)
    assert (tmp_path / "caffe.INFO.train").read_bytes().decode() == CAFFE_TRAIN


def test_delimiter_and_cli(tmp_path, capsys):
    log = _caffe_log(tmp_path, "caffe.INFO", year_prefix=True)
    assert parse_log_main([str(log), str(tmp_path / "o"), "--delimiter", "\\t",
                           "--verbose"]) == 0
    assert (tmp_path / "o" / "caffe.INFO.train").read_bytes().decode() == \
        CAFFE_TRAIN.replace(",", "\t")
    assert capsys.readouterr().err == (f"Wrote {tmp_path}/o/caffe.INFO.train\n"
                                       f"Wrote {tmp_path}/o/caffe.INFO.test\n")
    assert cli_main(["parse_log", str(log), str(tmp_path / "c"), "-delimiter", ";"]) == 0
    assert (tmp_path / "c" / "caffe.INFO.test").read_text().splitlines()[1] == \
        "0.0;1.25;0.00992565;0.0958;2.30366"


LEAP_LOG = """\
I{d1} 23:00:00.000000  7 solver.cpp:279] Solving net
I{d1} 23:00:00.000000  7 solver.cpp:337] Iteration 0, Testing net (#0)
I{d2} 01:00:00.000000  7 solver.cpp:404]     Test net output #0: loss = 1.5
"""


@pytest.mark.parametrize("d1, d2, year, seconds", [
    ("0228", "0301", 2024, 26 * 3600.0),  # 29 February between
    ("0228", "0301", 2023, 2 * 3600.0),
    ("20240228", "20240301", None, 26 * 3600.0),
    ("1231", "0229", 2023, (59 * 24 + 2) * 3600.0),  # New Year, then 29 Feb 2024
])
def test_years_leap_days_and_the_only_test_round(tmp_path, d1, d2, year, seconds):
    path = tmp_path / "leap.log"
    path.write_text(LEAP_LOG.format(d1=d1, d2=d2))
    log = read_training_log(path, year)
    # Caffe's parse_log drops a log's only (so never completed) row; it is kept here
    [row] = log.test
    assert list(row) == ["NumIters", "Seconds", "LearningRate", "loss"]
    assert (row["NumIters"], row["Seconds"], row["loss"]) == (0.0, seconds, 1.5)
    assert np.isnan(row["LearningRate"])  # no "lr =" line in the whole log
    assert log.train == []


def test_year_of_an_mmdd_log_past_new_year_counts_back_from_the_file_time(tmp_path):
    path = tmp_path / "leap.log"
    path.write_text(LEAP_LOG.format(d1="1231", d2="0229"))
    written = datetime.datetime(2024, 3, 1, 12).timestamp()
    os.utime(path, (written, written))
    # the last line is in 2024, a leap year: 29 February exists, the start is in 2023
    assert read_training_log(path).test[0]["Seconds"] == (59 * 24 + 2) * 3600.0


def test_a_diverged_run_keeps_its_nan_and_inf(tmp_path):
    path = tmp_path / "diverged.log"
    path.write_text(
        "I0101 00:00:00.000000  1 solver.cpp:279] Solving net\n"
        "I0101 00:00:01.000000  1 solver.cpp:228] Iteration 0, loss = 3\n"
        "I0101 00:00:01.000000  1 solver.cpp:244]     Train net output #0: loss = 3\n"
        "I0101 00:00:01.000000  1 solver.cpp:106] Iteration 0, lr = 0.5\n"
        "I0101 00:00:02.000000  1 solver.cpp:228] Iteration 10, loss = -nan\n"
        "I0101 00:00:02.000000  1 solver.cpp:244]     Train net output #0: loss = -nan\n"
        "I0101 00:00:03.000000  1 solver.cpp:228] Iteration 20, loss = inf\n"
        "I0101 00:00:03.000000  1 solver.cpp:244]     Train net output #0: loss = inf\n")
    parse_log(path, tmp_path, year=2025)
    assert (tmp_path / "diverged.log.train").read_bytes().decode() == (
        "NumIters,Seconds,LearningRate,loss\r\n0.0,1.0,0.5,3.0\r\n"
        "10.0,2.0,0.5,nan\r\n20.0,3.0,0.5,inf\r\n")


def test_log_errors_name_the_file(tmp_path):
    junk = tmp_path / "notes.txt"
    junk.write_text("no glog here\n")
    with pytest.raises(ConvertError, match=re.escape(
            f"{junk}: no line starts with a glog prefix such as 'I1121 12:34:56.789012'; "
            "not a Caffe training log")):
        read_training_log(junk)
    quiet = tmp_path / "quiet.log"
    quiet.write_text("I0101 00:00:00.000000  1 solver.cpp:1] Solving net\n")
    with pytest.raises(ConvertError, match=re.escape(
            f"{quiet}: no 'Train net output' or 'Test net output' line after an 'Iteration' "
            "line; nothing to write")):
        parse_log(quiet, tmp_path)
    with pytest.raises(ConvertError, match="cannot read the log"):
        read_training_log(tmp_path / "missing.log")


# -- charts ------------------------------------------------------------------------------------
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is in the test extra")

def _png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def _svg_texts(path):
    return [t.text for t in ET.parse(path).iter() if t.tag.endswith("text") and t.text]


@needs_matplotlib
def test_default_figure_png(solver_log, tmp_path):
    out = tmp_path / "curves.png"
    plot([solver_log[0]], out)
    assert _png_size(out) == (800, 800)
    image = cv2.imread(str(out))
    # the first line colour (matplotlib's C0, #1f77b4 in BGR) is drawn, on a white page
    blue = np.all(np.abs(image.astype(int) - (180, 119, 31)) < 8, axis=2)
    assert blue.sum() > 200 and (image == 255).all(axis=2).mean() > 0.5


@needs_matplotlib
def test_default_figure_svg_axes_and_legend(solver_log, tmp_path):
    out = tmp_path / "curves.svg"
    plot([solver_log[0]], out, x="seconds")
    texts = _svg_texts(out)
    for want in ("loss", "accuracy", "learning rate", "Seconds", "train loss", "test loss",
                 "test accuracy", "lr"):
        assert want in texts, want
    assert "Iters" not in texts


@needs_matplotlib
def test_several_logs_one_chart(solver_log, tmp_path):
    caffe = _caffe_log(tmp_path, "caffe.log", year_prefix=True)
    out = tmp_path / "acc.svg"
    plot([solver_log[0], caffe], out, chart="test_accuracy")
    texts = _svg_texts(out)
    for want in ("Test accuracy vs. Iters", "Iters", "Test accuracy", "tiny.log", "caffe.log"):
        assert want in texts, want
    panel = chart_panel([read_training_log(caffe)], "test_accuracy")
    assert [(ln.label, ln.x, ln.y) for ln in panel.lines] == [
        ("caffe.log", [0.0, 200.0], [0.0958, 0.9716])]
    panels = figure_panels([read_training_log(solver_log[0]), read_training_log(caffe)])
    assert [p.ylabel for p in panels] == ["loss", "accuracy", "learning rate"]
    assert [ln.label for ln in panels[0].lines] == [
        "tiny.log: train loss", "tiny.log: test loss", "caffe.log: train loss",
        "caffe.log: test loss"]


@needs_matplotlib
def test_caffe_chart_numbers_and_sizes(solver_log, tmp_path, capsys):
    # plot_training_log.py's 0-7: the four charts against Iters, then against Seconds
    assert CAFFE_CHARTS[0] == ("test_accuracy", "iters")
    assert CAFFE_CHARTS[5] == ("train_lr", "seconds")
    assert CAFFE_CHARTS[6] == ("train_loss", "iters")
    out = tmp_path / "lr.svg"
    assert cli_main(["plot", solver_log[0], "--chart", "5", "--out", str(out)]) == 0
    assert f"-> {out}" in capsys.readouterr().err
    texts = _svg_texts(out)
    assert "Train learning rate vs. Seconds" in texts and "Seconds" in texts
    png = tmp_path / "loss.png"
    assert cli_main(["plot", solver_log[0], "-chart", "train_loss", "-out", str(png)]) == 0
    assert _png_size(png) == (800, 500)


@needs_matplotlib
def test_chart_errors(tmp_path, capsys):
    leap = tmp_path / "leap.log"
    leap.write_text(LEAP_LOG.format(d1="20240228", d2="20240301"))
    with pytest.raises(ConvertError, match=re.escape(
            f"{leap}: no test output named like 'acc' for chart test_accuracy (test "
            "outputs: loss)")):
        chart_panel([read_training_log(leap)], "test_accuracy")
    assert cli_main(["plot", str(leap), "--out", str(tmp_path / "x.xyz")]) == 1
    assert f"{tmp_path}/x.xyz: cannot write '.xyz' images" in capsys.readouterr().err
    assert cli_main(["plot", str(leap), "--out", str(tmp_path / "curves")]) == 1
    assert capsys.readouterr().err == (f"purine-caffe plot: {tmp_path}/curves: name the image "
                                       "with a suffix, such as .png or .svg\n")
    with pytest.raises(SystemExit):
        cli_main(["plot", str(leap), "--chart", "8"])
    assert "got '8'" in capsys.readouterr().err


def test_without_matplotlib_a_clear_error(solver_log, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(PurineError, match=re.escape(
            "plot needs matplotlib: pip install 'purine-caffe[plot]'")):
        plot([solver_log[0]], tmp_path / "c.png")
    assert cli_main(["plot", solver_log[0], "--out", str(tmp_path / "c.png")]) == 1
    assert capsys.readouterr().err == (
        "purine-caffe plot: plot needs matplotlib: pip install 'purine-caffe[plot]'\n")
    assert not (tmp_path / "c.png").exists()


# -- issue 28: delimiters a CSV reader cannot read back are refused in one line -------------
@pytest.mark.parametrize("delimiter", ["\n", "\r", '"', "\x00", "\x1b", "\x7f"])
def test_unreadable_delimiter_refused(tmp_path, capsys, delimiter):
    log = _caffe_log(tmp_path, "caffe.INFO", year_prefix=True)
    assert parse_log_main([str(log), str(tmp_path / "o"), "--delimiter", delimiter]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"parse_log: --delimiter {delimiter!r}: a CSV reader cannot read "
                          "that back") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()  # refused before anything is written
    with pytest.raises(ConvertError, match="cannot read that back"):
        parse_log(log, tmp_path / "p", delimiter)


@pytest.mark.parametrize("delimiter", [",", ";", "\t", " ", "|", ".", "e", "'", "\u00e9"])
def test_accepted_delimiters_read_back_with_csv(tmp_path, delimiter):
    """Whatever delimiter is accepted, Python's csv module reads the rows back as written
    (a delimiter found in a value, such as '.' in 0.0958, makes the writer quote it)."""
    import csv

    log = _caffe_log(tmp_path, "caffe.INFO", year_prefix=True)
    parse_log(log, tmp_path / "o", delimiter)
    parse_log(log, tmp_path / "ref", ",")
    for suffix in (".train", ".test"):
        with open(tmp_path / "o" / f"caffe.INFO{suffix}", newline="", encoding="utf-8") as f:
            got = list(csv.reader(f, delimiter=delimiter))
        with open(tmp_path / "ref" / f"caffe.INFO{suffix}", newline="") as f:
            want = list(csv.reader(f))
        assert got == want and len(want) >= 2
    assert want[1] == ["0.0", "1.25", "0.00992565", "0.0958", "2.30366"]


def test_endless_log_is_one_line():
    with pytest.raises(ConvertError, match=r"^/dev/zero: cannot read the log: it is not a "
                                           r"regular file \(a device\)$"):
        read_training_log("/dev/zero")
