"""Hostile and edge-case inputs that must give Caffe's numbers or one line of our own error:
lr policies past float64's range, test_iter 0, a negative solver-state iteration, and CLI
integers outside their proto field's range."""

import logging
import math

import numpy as np
import pytest

from purine.caffe.solver import Solver
from purine.cli import MAX_REPLICAS, main
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.ops.solver import rate

NET = """
name: "regression"
layer { name: "data" type: "DummyData" top: "x" top: "y" dummy_data_param {
  shape { dim: 6 dim: 4 } shape { dim: 6 dim: 3 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "p"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }
"""


def solver_text(**fields) -> str:
    base = dict(base_lr=0.05, lr_policy='"fixed"', max_iter=100, random_seed=7,
                weight_decay=0.01, momentum=0.9)
    base.update(fields)
    body = "\n".join(f"{k}: {v}" for k, v in base.items())
    return f"net_param {{ {NET} }}\n{body}\n"


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def logger() -> tuple[logging.Logger, Lines]:
    log = logging.getLogger("purine.test_hostile")
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO)
    h = Lines()
    log.addHandler(h)
    return log, h


# -- lr policies: C's IEEE results, never an exception ----------------------------------
@pytest.mark.parametrize("policy, it, params, want", [
    # exp(-0.1 * (0 - 10000)) = exp(1000) is inf in C, so 1 / (1 + inf) = 0
    ("sigmoid", 0, dict(gamma=0.1, stepsize=10000), 0.0),
    # past the midpoint the exponent is very negative: exp gives 0 and the rate is base_lr
    ("sigmoid", 20000, dict(gamma=0.1, stepsize=10000), 0.05),
    ("exp", 400, dict(gamma=10.0), math.inf),  # 10^400 is past 1e308
    ("exp", 2000, dict(gamma=0.5), 0.0),  # 0.5^2000 underflows to 0
    ("step", 40, dict(gamma=1e10, stepsize=1), math.inf),  # (1e10)^40
    ("multistep", 5, dict(gamma=1e200, stepvalues=(1, 2)), math.inf),  # (1e200)^2
    ("poly", 100, dict(power=-1.0, max_iter=100), math.inf),  # 0^-1
])
def test_lr_policies_overflow_as_c_does(policy, it, params, want):
    assert rate(policy, it, base_lr=0.05, **params) == want


def test_inv_with_a_negative_base_is_nan_not_complex():
    # (1 + 1 * -5)^-0.5: C's pow of a negative base and a fractional power is NaN
    r = rate("inv", -5, base_lr=0.05, gamma=1.0, power=0.5)
    assert isinstance(r, float) and math.isnan(r)
    assert rate("inv", -5, base_lr=0.05, gamma=1.0, power=2.0) == pytest.approx(0.05 / 16)


def test_lr_policy_parameter_errors_are_unchanged():
    with pytest.raises(PurineError, match="lr_policy 'poly' needs max_iter > 0, got 0"):
        rate("poly", 0, base_lr=0.1, power=1.0)
    with pytest.raises(PurineError, match="unknown lr_policy 'nope'"):
        rate("nope", 0, base_lr=0.1)


def test_sigmoid_whose_rate_is_zero_trains_without_moving_the_weights():
    s = Solver(solver_text(lr_policy='"sigmoid"', gamma=0.1, stepsize=10000))
    assert s.lr == 0.0
    w0 = s.net.params["ip"][0].data.copy()
    s.step(2)
    assert s.iter == 2
    assert np.array_equal(s.net.params["ip"][0].data, w0)


# -- test_iter: 0 ------------------------------------------------------------------------
def test_zero_test_iter_runs_no_batch_and_logs_a_nan_loss():
    log, lines = logger()
    s = Solver(solver_text(test_iter=0, test_interval=100, test_compute_loss="true")
               + f"test_net_param {{ {NET} }}\n", log=log)
    assert s.test(0) == {}
    # Caffe divides the summed loss, 0, by test_iter, 0: NaN; no output has a line
    assert lines.lines[-2:] == ["Iteration 0, Testing net (#0)", "Test loss: nan"]
    assert not any("net output" in line for line in lines.lines)


# -- solver state ------------------------------------------------------------------------
def test_a_negative_solverstate_iter_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "bad.solverstate"
    path.write_bytes(pb.SolverState(iter=-3).SerializeToString())
    s = Solver(solver_text(lr_policy='"inv"', gamma=1.0, power=0.5))
    with pytest.raises(PurineError, match=rf"^{path}: iter is -3; a solver state's "
                                          r"iteration must be 0 or more$"):
        s.restore(path)
    assert s.iter == 0


# -- CLI integers ------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["train", "--solver", "s.prototxt", "--iterations", "3000000000"],
     "argument -iterations/--iterations: expected an integer from 0 to 2147483647 "
     "(a 32-bit count, as Caffe's), got 3000000000"),
    (["train", "--solver", "s.prototxt", "--iterations", "-1"],
     "expected an integer from 0 to 2147483647 (a 32-bit count, as Caffe's), got -1"),
    (["test", "--model", "m.prototxt", "--level", "-2147483649"],
     "argument -level/--level: expected an integer from -2147483648 to 2147483647 "
     "(NetState.level is a 32-bit integer), got -2147483649"),
    (["time", "--model", "m.prototxt", "--threads", "-5"],
     "argument -threads/--threads: expected an integer from 1 to 1024"),
    (["train", "--solver", "s.prototxt", "--replicas", "100000"],
     f"argument -replicas/--replicas: expected an integer from 1 to {MAX_REPLICAS} "
     "(each replica is a whole copy of the net in this process"),
    (["train", "--solver", "s.prototxt", "--async", "-1"],
     "argument -async/--async: expected an integer from 0 to 2147483647"),
    (["demo", "--iterations", "ten"], "argument -iterations/--iterations: expected an "
                                      "integer, got 'ten'"),
])
def test_cli_integers_out_of_range_are_one_argparse_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert message in line


def test_cli_integers_at_the_edge_of_their_range_parse():
    from purine.cli import build_parser

    args = build_parser().parse_args(["train", "--solver", "s", "--iterations", "2147483647",
                                      "--level", "-2147483648", "--threads", "1024",
                                      "--replicas", str(MAX_REPLICAS)])
    assert (args.iterations, args.level, args.threads, args.replicas) == (
        2 ** 31 - 1, -(2 ** 31), 1024, MAX_REPLICAS)
