"""`purine-caffe plot` of a short run stays readable: a marker on every point, whole
iterations on the x axis, a range around a single point (or a constant value) instead of
matplotlib's +-5% sliver, and no warnings."""

import importlib.util
import warnings

import pytest

from purine.cli import main as cli_main
from purine.converters.plot import plot

pytestmark = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                reason="matplotlib is in the test extra")

HEAD = "I0101 00:00:00.000000  1 solver.cpp:279] Solving net\n"
POINT = ("I0101 00:00:{s:02d}.000000  1 solver.cpp:228] Iteration {it}, loss = {loss}\n"
         "I0101 00:00:{s:02d}.000000  1 solver.cpp:244]     Train net output #0: loss = {loss}\n"
         "I0101 00:00:{s:02d}.000000  1 solver.cpp:106] Iteration {it}, lr = 0.5\n")


def _log(tmp_path, points):
    """A Caffe log of (iteration, loss) display lines, one second apart, lr 0.5 throughout."""
    path = tmp_path / f"run{len(points)}.log"
    path.write_text(HEAD + "".join(POINT.format(s=i + 1, it=it, loss=loss)
                                   for i, (it, loss) in enumerate(points)))
    return path


def _draw(log, out, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        return plot([log], out, **kw)


def _ticks(ax):
    low, high = ax.get_xlim()
    return [t for t in ax.get_xticks() if low <= t <= high]


def test_one_point(tmp_path, capsys):
    log = _log(tmp_path, [(0, 3.0)])
    fig = _draw(log, tmp_path / "one.png")
    # Caffe's parse_log gives a row the lr logged after it, so one row has no lr: one panel
    [loss] = fig.axes
    # x: an iteration either side of 0, ticks only at whole iterations
    assert loss.get_xlim() == (-1.0, 1.0)
    assert _ticks(loss) == [-1.0, 0.0, 1.0]
    # y: 10% either side of the single value (matplotlib alone gives 2.835..3.165)
    assert loss.get_ylim() == pytest.approx((2.7, 3.3))
    [line] = loss.get_lines()
    assert line.get_marker() == "o" and line.get_markersize() == 6
    # against seconds the one point, at 1 s, gets a second either side
    fig = _draw(log, tmp_path / "one_s.svg", x="seconds")
    assert fig.axes[0].get_xlim() == (0.0, 2.0)
    assert cli_main(["plot", str(log), "--out", str(tmp_path / "cli.png")]) == 0
    assert capsys.readouterr().err == f"plotted {log} -> {tmp_path / 'cli.png'}\n"


def test_two_points(tmp_path):
    fig = _draw(_log(tmp_path, [(0, 3.0), (1, 2.5)]), tmp_path / "two.png")
    loss, lr = fig.axes
    low, high = loss.get_xlim()
    assert low < 0 and high > 1  # both points inside, none on the frame
    assert _ticks(loss) == _ticks(lr) == [0.0, 1.0]  # no tick at 0.2 of an iteration
    assert loss.get_ylim()[0] < 2.5 and loss.get_ylim()[1] > 3.0
    assert lr.get_ylim() == pytest.approx((0.45, 0.55))  # a constant: the same range
    for ax in (loss, lr):
        [line] = ax.get_lines()
        assert line.get_marker() == "o"


def test_a_zero_value_and_a_longer_run(tmp_path):
    points = [(it, 0.0) for it in range(0, 40, 1)]
    fig = _draw(_log(tmp_path, points), tmp_path / "flat.png", chart="train_loss")
    [ax] = fig.axes
    assert ax.get_ylim() == (-1.0, 1.0)  # +-1 around 0, where 10% of it is nothing
    [line] = ax.get_lines()
    assert line.get_marker() in ("None", None, "")  # 40 points: a plain line
