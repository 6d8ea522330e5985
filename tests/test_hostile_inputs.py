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
@pytest.mark.parametrize("test_iter, loss", [(0, "nan"), (-1, "-0")])
def test_no_test_iter_runs_no_batch_and_logs_caffes_loss(test_iter, loss):
    log, lines = logger()
    s = Solver(solver_text(test_iter=test_iter, test_interval=100, test_compute_loss="true")
               + f"test_net_param {{ {NET} }}\n", log=log)
    assert s.test(0) == {}
    # Caffe divides the summed loss, 0, by test_iter: NaN for 0, -0 for -1; no output line
    assert lines.lines[-2:] == ["Iteration 0, Testing net (#0)", f"Test loss: {loss}"]
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


# -- memory: refused with the layer's name before anything is allocated -------------------
GiB = 2 ** 30


@pytest.fixture
def machine_of_16_gib(monkeypatch):
    """Every memory space holds 16 GiB, whatever this machine has, so the messages are
    known exactly."""
    import purine.runtime.memory as memory

    monkeypatch.setattr(memory, "capacity", lambda location: 16 * GiB)


def net_file(tmp_path, text):
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    return str(path)


INPUT_1x4 = 'layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 4 } } }\n'


@pytest.mark.parametrize("text, message", [
    # pad 2^31-1 around a 4x4 image: a (1, 2, 2^32, 2^32) top of 128 PiB
    ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 1 dim: 4 '
     'dim: 4 } } }\nlayer { name: "conv" type: "Convolution" bottom: "x" top: "y" '
     'convolution_param { num_output: 2 kernel_size: 3 pad: 2147483647 } }',
     "layer 'conv' (type Convolution): its 3 blobs (the largest 'y' (1, 2, 4294967296, "
     "4294967296) float32) ask for 131072.0 PiB; this machine has 16.0 GiB of memory"),
    # the weights are refused before the filler draws them
    (INPUT_1x4 + 'layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "y" '
     'inner_product_param { num_output: 2147483647 } }',
     "layer 'ip1' (type InnerProduct): parameter 0 (2147483647, 4) float32 asks for "
     "32.0 GiB; this machine has 16.0 GiB of memory"),
    ('layer { name: "d" type: "DummyData" top: "x" dummy_data_param { shape { dim: 2147483647 '
     'dim: 4 } } }',
     "layer 'd' (type DummyData): blob 'x' (2147483647, 4) float32 asks for 32.0 GiB; "
     "this machine has 16.0 GiB of memory"),
])
def test_a_net_too_big_for_memory_is_refused_naming_the_layer(tmp_path, machine_of_16_gib,
                                                              text, message):
    from purine.caffe import TEST, Net

    with pytest.raises(PurineError) as e:
        Net(net_file(tmp_path, text), TEST)
    assert str(e.value) == message


def test_an_empty_batch_runs_as_in_caffe(tmp_path):
    from purine.caffe import TEST, Net

    # Caffe's GEMMs take M = 0: the tops are empty and the weight gradient is zero; the
    # softmax loss divides by max(1, count), the accuracy of no samples is 0
    text = ('force_backward: true\nlayer { name: "in" type: "Input" top: "x" top: "label" '
            'input_param { shape { dim: 0 dim: 2 dim: 3 dim: 3 } shape { dim: 0 } } }\n'
            'layer { name: "bn" type: "BatchNorm" bottom: "x" top: "b" }\n'
            'layer { name: "lrn" type: "LRN" bottom: "b" top: "n" }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "n" top: "y" '
            'inner_product_param { num_output: 5 weight_filler { type: "gaussian" } } }\n'
            'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "label" '
            'top: "loss" }\n'
            'layer { name: "acc" type: "Accuracy" bottom: "y" bottom: "label" top: "acc" }')
    with Net(net_file(tmp_path, text), TEST) as net:
        net.params["ip"][0].diff[...] = 7
        out = net.forward()
        net.backward()
        assert net.blobs["y"].data.shape == (0, 5)
        assert (float(out["loss"]), float(out["acc"])) == (0.0, 0.0)
        assert net.params["ip"][0].diff.shape == (5, 18)
        assert not net.params["ip"][0].diff.any()


def test_parameters_are_counted_together_before_each_is_filled(tmp_path, monkeypatch):
    import purine.runtime.memory as memory
    from purine.caffe import TEST, Net

    monkeypatch.setattr(memory, "capacity", lambda location: 2 ** 20)
    # 3 x 384 KiB of weights: the third does not fit beside the first two in 1 MiB
    layers = "".join(f'layer {{ name: "ip{i}" type: "InnerProduct" bottom: "x" top: "y{i}" '
                     f'inner_product_param {{ bias_term: false num_output: 24576 }} }}\n'
                     for i in range(3))
    with pytest.raises(PurineError) as e:
        Net(net_file(tmp_path, INPUT_1x4 + layers), TEST)
    assert str(e.value) == ("layer 'ip2' (type InnerProduct): parameter 0 (24576, 4) "
                            "float32 asks for 384.0 KiB beside the 768.0 KiB held already; "
                            "this machine has 1.0 MiB of memory")


def test_the_dispatcher_refuses_an_allocation_beyond_what_is_left(monkeypatch):
    import purine.runtime.memory as memory
    from purine.graph import Graph
    from purine.runtime import Dispatcher
    from purine.runtime.memory import plan_memory

    monkeypatch.setattr(memory, "capacity", lambda location: 1000)
    g = Graph()
    a, b = g.blob("a", (100,), "float32"), g.blob("b", (100,), "float32")  # 400 B each
    c = g.blob("c", (60,), "float32")
    d = Dispatcher(g)
    d.array(a)
    d.array(b)
    with pytest.raises(PurineError) as e:
        d.array(c)
    assert str(e.value) == ("blob 'c' (60,) float32 asks for 240 B beside the 800 B held "
                            "already; this machine has 1000 B of memory")
    d.release(b)  # what is released is no longer held
    assert d.array(c).shape == (60,)
    d.bind(b, np.zeros(100, np.float32))  # outside storage is not the dispatcher's
    with pytest.raises(PurineError, match="blob 'x'"):
        d.array(g.blob("x", (100,), "float32"))
    # a memory plan's buffers count once for every blob sharing them
    d.set_memory_plan(plan_memory(g, [], keep=()))
    assert d._held == {a.location.memory: 640}


# -- NUL characters, newlines in names, numpy's warnings: one line each -------------------
def test_a_nul_in_a_path_field_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "solver.prototxt"
    path.write_text('net: "a\\000b.prototxt"\nbase_lr: 0.1\n')
    with pytest.raises(PurineError) as e:
        Solver(str(path))
    assert str(e.value) == (f"{path}: field net holds a NUL character ('a\\x00b.prototxt'); "
                            "paths and names cannot contain one")
    path.write_text(NET.replace('name: "ip"', 'name: "ip" include { stage: "x\\000" }'))
    with pytest.raises(PurineError, match=r"field layer\[1\]\.include\[0\]\.stage\[0\] holds a "
                                          r"NUL character \('x\\x00'\)"):
        from purine.caffe import TEST, Net

        Net(str(path), TEST)


def test_a_nul_in_a_file_name_given_to_the_api_is_our_error():
    from purine.caffe import TEST, Net

    with pytest.raises(PurineError) as e:
        Net("net\0.prototxt", TEST)
    assert str(e.value) == ("'net\\x00.prototxt': not a valid file name (it holds a NUL "
                            "character)")


def test_a_nul_in_a_binary_solverstate_is_refused(tmp_path):
    path = tmp_path / "s.solverstate"
    path.write_bytes(pb.SolverState(iter=1, learned_net="w\0.caffemodel").SerializeToString())
    s = Solver(solver_text())
    with pytest.raises(PurineError, match=rf"^{path}: field learned_net holds a NUL "):
        s.restore(path)


def test_a_layer_name_with_a_newline_gives_a_one_line_error(tmp_path, capsys):
    import logging

    from purine.cli import main
    from purine.log import get_logger

    model = tmp_path / "net.prototxt"
    model.write_text('layer { name: "in\\nput" type: "Nope" top: "x" }')
    log = get_logger()
    level = log.level
    log.setLevel(logging.INFO)  # the set-up log's lines too
    try:
        assert main(["test", "--model", str(model), "--iterations", "1"]) == 1
    finally:
        log.setLevel(level)
    lines = capsys.readouterr().err.strip().splitlines()
    err = [line for line in lines if line.startswith("purine-caffe")]
    assert len(err) == 1 and err[0].startswith(
        "purine-caffe test: layer 'in\\nput' (type Nope): unknown layer type; known types: "
        "AbsVal, Accuracy, ")
    # The set-up log's lines (at INFO) name the layer with the escape too.
    assert not [line for line in lines if line.startswith("put")]


def test_a_diverging_run_prints_no_numpy_warnings(tmp_path, capsys, recwarn):
    solver = tmp_path / "solver.prototxt"
    solver.write_text(solver_text(base_lr=1e30, max_iter=20, display=1)
                      + f'snapshot_prefix: "{tmp_path}/s"\n')
    assert main(["train", "--solver", str(solver)]) == 1
    # numpy warns of the overflow (pytest records what would be printed): the CLI silences it
    assert [str(w.message) for w in recwarn if w.category is RuntimeWarning] == []
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("purine-caffe train: iteration 1: the loss is inf; training "
                                    "stopped (snapshots already written are intact)")


def test_a_random_stream_refuses_a_negative_draw_count():
    from purine.backend import RandomStream

    s = RandomStream(7, 3)
    with pytest.raises(ValueError, match="count -1 is below 0"):
        s.restore({"count": -1})
    s.restore({"count": 2})
    assert s.state() == {"count": 2}


# -- a kill during a snapshot: its temporary file goes at the next start -------------------
def test_stale_snapshot_temporaries_of_our_prefix_are_removed_at_start(tmp_path):
    log, lines = logger()
    stale = ["s_iter_10.caffemodel.ab_3x.tmp", "s_iter_10.solverstate.Zq9k1.tmp",
             "s_iter_4.caffemodel.h5.k2j.tmp"]
    kept = ["s_iter_10.caffemodel", "other_iter_10.caffemodel.ab3.tmp", "s_iter_x.caffemodel.a.tmp",
            "notes.tmp", "s_iter_10.caffemodel.a.b.tmp"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"x")
    Solver(solver_text(snapshot=5, snapshot_prefix=f'"{tmp_path}/s"'), log=log)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    assert [x for x in lines.lines if x.startswith("Removed")] == [
        f"Removed {tmp_path / n}, left by a snapshot that was interrupted" for n in sorted(stale)]


def test_an_empty_outer_size_with_an_inner_product_axis_past_1(tmp_path):
    from purine.caffe import TEST, Net

    # axis 2: m = 0 * 3 rows of 4 inputs each; the row length comes from the weight
    text = ('force_backward: true\nlayer { name: "in" type: "Input" top: "x" input_param { '
            'shape { dim: 0 dim: 3 dim: 4 } } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
            'inner_product_param { num_output: 5 axis: 2 } }')
    with Net(net_file(tmp_path, text), TEST) as net:
        net.forward()
        net.backward()
        assert net.blobs["y"].data.shape == (0, 3, 5)
        assert net.params["ip"][0].diff.shape == (5, 4) and not net.params["ip"][0].diff.any()
