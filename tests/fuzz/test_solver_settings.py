"""Fuzzing solver prototxt: a small solver whose settings are given extreme, wrong-typed or
unknown values (and whose text is mutated line by line), built and stepped once."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from purine.caffe.solver import Solver, read_solver
from purine.formats import caffe_pb2 as pb
from tests.fuzz.harness import (
    TEXT_NUMBERS,
    Draw,
    check,
    counted,
    field_names,
    mutated_text,
    share,
    skip_if_too_big,
)

NET = """name: "small"
layer { name: "data" type: "DummyData" top: "x" top: "y" dummy_data_param {
  shape { dim: 6 dim: 4 } shape { dim: 6 dim: 3 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "p"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }
"""
BASE = {"base_lr": "0.05", "lr_policy": '"fixed"', "max_iter": "100", "random_seed": "7",
        "weight_decay": "0.01", "momentum": "0.9"}

NUMBERS = st.sampled_from(TEXT_NUMBERS) | st.integers(-2, 20).map(str)
FLAGS = st.sampled_from(("true", "false", "1", "0", "yes", '"true"'))
STRINGS = st.sampled_from(('""', '"missing.prototxt"', '"/nonexistent/x"', '"a\\nb"', "7"))
SETTINGS: dict[str, st.SearchStrategy[str]] = {
    "base_lr": NUMBERS, "gamma": NUMBERS, "power": NUMBERS, "stepsize": NUMBERS,
    "stepvalue": NUMBERS, "max_iter": NUMBERS, "momentum": NUMBERS, "momentum2": NUMBERS,
    "delta": NUMBERS, "rms_decay": NUMBERS, "weight_decay": NUMBERS,
    "clip_gradients": NUMBERS, "iter_size": NUMBERS, "average_loss": NUMBERS,
    "display": NUMBERS, "test_iter": NUMBERS, "test_interval": NUMBERS, "snapshot": NUMBERS,
    "random_seed": NUMBERS, "device_id": NUMBERS,
    "lr_policy": st.sampled_from(('"fixed"', '"step"', '"exp"', '"inv"', '"multistep"',
                                  '"poly"', '"sigmoid"', '"bogus"', '""', "FIXED")),
    "type": st.sampled_from(('"SGD"', '"Nesterov"', '"AdaGrad"', '"RMSProp"', '"AdaDelta"',
                             '"Adam"', '"sgd"', '"Bogus"', '""')),
    "solver_type": st.sampled_from(("SGD", "NESTEROV", "ADAGRAD", "RMSPROP", "ADADELTA",
                                    "ADAM", "7", "BOGUS")),
    "regularization_type": st.sampled_from(('"L1"', '"L2"', '"L3"', '""', "L1")),
    "solver_mode": st.sampled_from(("CPU", "GPU", "2")),
    "snapshot_format": st.sampled_from(("BINARYPROTO", "HDF5", "3")),
    "test_initialization": FLAGS, "snapshot_after_train": FLAGS, "debug_info": FLAGS,
    "snapshot_diff": FLAGS, "layer_wise_reduce": FLAGS, "test_compute_loss": FLAGS,
    "net": STRINGS, "train_net": STRINGS, "weights": STRINGS, "snapshot_prefix": STRINGS,
    "nonexistent_field": NUMBERS,
}


@st.composite
def solver_settings(draw: Draw) -> dict[str, list[str]]:
    """1..5 settings over the base ones; a repeated field may get several values."""
    names = draw(st.lists(st.sampled_from(sorted(SETTINGS)), min_size=1, max_size=5,
                          unique=True))
    return {n: draw(st.lists(SETTINGS[n], min_size=1, max_size=2)) for n in names}


def solver_text(fields: dict[str, list[str]], prefix: Path) -> str:
    values = {k: [v] for k, v in BASE.items()} | fields
    body = "\n".join(f"{k}: {v}" for k, vs in values.items() for v in vs)
    # The case's folder as the prefix; a drawn snapshot_prefix comes later and wins.
    return f'net_param {{ {NET} }}\nsnapshot_prefix: "{prefix}/s"\n{body}\n'


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("solver")


def build_and_step(path: Path) -> None:
    with Solver(str(path)) as s:
        s.step(1)


def run_case(path: Path) -> None:
    """Parse (an error names the file), then build and step once: an error names the file,
    a layer, or a file the solver names (net, weights, snapshot_prefix)."""
    parsed: list[pb.SolverParameter] = []
    if check(lambda: parsed.append(read_solver(str(path))), path) != "success":
        return
    param = parsed[0]
    if skip_if_too_big(param):
        return
    named = tuple(p for p in [param.net, param.train_net, param.snapshot_prefix,
                              *param.weights, *param.test_net] if isinstance(p, str) and p)
    # In the case's folder, a snapshot with a relative or mutated prefix lands there too.
    with contextlib.chdir(path.parent):
        check(lambda: build_and_step(path), path, also=("layer '",) + named)


@share(0.6)
@given(fields=solver_settings())
@counted
def test_mutated_solver_settings(case_dir: Path, fields: dict[str, list[str]]) -> None:
    path = case_dir / "solver.prototxt"
    path.write_text(solver_text(fields, case_dir))
    run_case(path)


SEED_TEXT = solver_text({}, Path("/nonexistent"))
KEYS = field_names(pb.SolverParameter)


@share(0.4)
@given(data=mutated_text([SEED_TEXT.replace("{ ", "{\n").replace(" }", "\n}")], KEYS))
@counted
def test_mutated_solver_text(case_dir: Path, data: bytes) -> None:
    path = case_dir / "solver.prototxt"
    path.write_bytes(data.replace(b"/nonexistent", str(case_dir).encode()))
    run_case(path)
