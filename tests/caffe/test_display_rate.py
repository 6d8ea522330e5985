"""The display line's rate agrees with its time: "Iteration I (R iter/s, Ts/N iters)" counts
the N iterations run since the previous line, or since the run (or a resume) began, so that
R = N / T; the first line after ``--snapshot`` measures from the resume point."""

import re
import types

import pytest

from purine.caffe import solver as solver_module
from purine.cli import main as cli_main
from tests.converters.helpers import TINY_NET as NET

LINE = re.compile(r"Iteration (\d+) \(([\d.e+-]+) iter/s, ([\d.]+)s/(\d+) iters\), loss = ")


@pytest.fixture
def solver(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "{tmp_path}/net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\n'
                    f'display: 5\nmax_iter: 7\nsnapshot: 7\n'
                    f'snapshot_prefix: "{tmp_path}/tiny"\nsolver_mode: CPU\n')
    return str(path)


def _rates(text):
    """(iteration, rate, seconds, iterations) of each display line in ``text``."""
    return [(int(m[1]), float(m[2]), float(m[3]), int(m[4])) for m in LINE.finditer(text)]


def _train(capsys, *args):
    capsys.readouterr()
    assert cli_main(["train", *args]) == 0
    return _rates(capsys.readouterr().err)


@pytest.fixture
def clock(monkeypatch):
    """The solver's clock, a quarter second further at every reading."""
    now = [100.0]

    def perf_counter():
        now[0] += 0.25
        return now[0]
    monkeypatch.setattr(solver_module, "time", types.SimpleNamespace(perf_counter=perf_counter))


def test_first_line_after_resume_counts_from_the_resume_point(solver, tmp_path, capsys, clock):
    # From iteration 0: the first line covers iteration 0 alone, the next 1..5.
    assert _train(capsys, "--solver", solver) == [(0, 4.0, 0.25, 1), (5, 20.0, 0.25, 5)]
    # Resumed at 7: the first line, at 10, covers iterations 7, 8, 9 and 10.
    resumed = _train(capsys, "--solver", solver, "--snapshot", str(tmp_path / "tiny_iter_7"
                                                                   ".solverstate"),
                     "--iterations", "16")
    assert resumed == [(10, 16.0, 0.25, 4), (15, 20.0, 0.25, 5)]


def test_the_measured_rate_agrees_with_the_printed_time(solver, tmp_path, capsys):
    _train(capsys, "--solver", solver)
    lines = _train(capsys, "--solver", solver, "--snapshot",
                   str(tmp_path / "tiny_iter_7.solverstate"), "--iterations", "16")
    assert [(it, n) for it, _, _, n in lines] == [(10, 4), (15, 5)]
    for _, rate, seconds, n in lines:
        # the time is printed to the millisecond: rate x time is n within that rounding
        assert abs(rate * seconds - n) <= rate * 0.0005 + 1e-3 * n, (rate, seconds, n)
