"""Solver settings this project does not honour, and those that would fail only once used
mid-run, are refused when the Solver is built, before iteration 0, in one line naming the
solver file and the key; the settings it honours instead (weights, layer_wise_reduce)."""

import os
import sys

import numpy as np
import pytest

from purine.caffe import TEST, Net
from purine.caffe.solver import Solver
from purine.cli import main
from purine.errors import PurineError
from purine.parallel import build_solver

# "extra" exists in the TEST net only: the solver's weights reach the test nets too.
NET = """name: "small"
layer { name: "data" type: "DummyData" top: "x" top: "y" dummy_data_param {
  shape { dim: 6 dim: 4 } shape { dim: 6 dim: 3 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "p"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "extra" type: "InnerProduct" bottom: "x" top: "e" include { phase: TEST }
  inner_product_param { num_output: 2 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }
"""


def write_solver(tmp_path, net: str = NET, **fields) -> str:
    (tmp_path / "net.prototxt").write_text(net)
    base = dict(net=f'"{tmp_path}/net.prototxt"', base_lr=0.05, lr_policy='"fixed"',
                momentum=0.9, max_iter=4, display=1, random_seed=2, solver_mode="CPU",
                snapshot_prefix=f'"{tmp_path}/snap"', test_iter=1, test_interval=100)
    base.update(fields)
    path = tmp_path / "solver.prototxt"
    path.write_text("".join(f"{k}: {v}\n" for k, v in base.items()))
    return str(path)


REFUSED = {
    "snapshot_diff": (dict(snapshot_diff="true"),
                      r"snapshot_diff: true is not supported: snapshots hold the parameters' "
                      r"data"),
    "average_loss": (dict(average_loss=0), r"average_loss: must be at least 1, got 0"),
    "stepvalue_not_increasing": (
        dict(lr_policy='"multistep"', gamma=0.1, stepvalue="3\nstepvalue: 3"),
        r"stepvalue: values must increase strictly, got 3, 3"),
    "unknown_lr_policy": (dict(lr_policy='"linear"'),
                          r"lr_policy: unknown lr_policy 'linear': expected one of fixed"),
    "step_without_stepsize": (dict(lr_policy='"step"', gamma=0.1),
                              r"lr_policy: lr_policy 'step' needs stepsize > 0, got 0"),
    "unknown_regularization": (dict(weight_decay=0.01, regularization_type='"L3"'),
                               r"regularization_type: 'L3' is unknown; expected one of L2, L1"),
    "missing_snapshot_folder": (dict(snapshot=2, snapshot_prefix='"{tmp}/nowhere/snap"'),
                                r"snapshot_prefix '.*/nowhere/snap': points into "
                                r"'.*/nowhere', which does not exist"),
    "missing_weights": (dict(weights='"{tmp}/absent.caffemodel"'),
                        r"weights: .*/absent.caffemodel: cannot read: No such file"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_when_the_solver_is_built(tmp_path, case, log_lines, capsys):
    fields, match = REFUSED[case]
    fields = {k: str(v).replace("{tmp}", str(tmp_path)) for k, v in fields.items()}
    path = write_solver(tmp_path, **fields)
    with pytest.raises(PurineError, match=f"^solver {path}: {match}"):
        Solver(path)
    # The command: exit code 1, the one line, and not one iteration run or snapshot written.
    log_lines.clear()
    assert main(["train", "--solver", path]) == 1
    # The log's lines (Finetuning from ..., the net text of Caffe's set-up log) aside: one
    # line from the command.
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if line.startswith("purine-caffe")]
    assert len(err) == 1 and err[0].startswith(f"purine-caffe train: solver {path}: ")
    assert not [line for line in log_lines if line.startswith("Iteration")]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("snap")]


def test_hdf5_snapshots_without_h5py_are_refused(tmp_path, monkeypatch, log_lines):
    monkeypatch.setitem(sys.modules, "h5py", None)  # import h5py now raises ImportError
    path = write_solver(tmp_path, snapshot_format="HDF5", snapshot=2)
    with pytest.raises(PurineError, match=rf"^solver {path}: snapshot_format: HDF5 needs the "
                                          r"h5py package: pip install purine-caffe\[hdf5\]"):
        Solver(path)
    assert main(["train", "--solver", path]) == 1
    assert not [line for line in log_lines if line.startswith("Iteration")]
    Solver(write_solver(tmp_path, snapshot=2))  # BINARYPROTO needs no h5py


def test_an_unwritable_snapshot_folder_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    if os.geteuid() == 0:  # root writes through permission bits; /proc takes no new files
        folder = "/proc"
    path = write_solver(tmp_path, snapshot=2, snapshot_prefix=f'"{folder}/snap"')
    try:
        with pytest.raises(PurineError, match=rf"snapshot_prefix '{folder}/snap': cannot write "
                                              rf"snapshots into '{folder}' \("):
            Solver(path)
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_snapshot_folder_is_probed_and_left_clean(tmp_path):
    Solver(write_solver(tmp_path, snapshot=2))
    assert sorted(os.listdir(tmp_path)) == ["net.prototxt", "solver.prototxt"]


def test_unknown_regularization_without_decay_trains_as_in_caffe(tmp_path):
    s = Solver(write_solver(tmp_path, regularization_type='"L3"', weight_decay=0))
    s.step(2)
    assert s.iter == 2


# -- honoured ----------------------------------------------------------------------------
def saved_weights(path, seed: int) -> dict:
    net = Net(NET, phase=TEST)
    rng = np.random.default_rng(seed)
    for views in net.params.values():
        for v in views:
            v.data[...] = rng.standard_normal(v.shape)
    net.save(path)
    return {name: [v.data.copy() for v in views] for name, views in net.params.items()}


def test_the_weights_field_fills_the_train_and_test_nets(tmp_path):
    a = saved_weights(tmp_path / "a.caffemodel", 1)
    b = saved_weights(tmp_path / "b.caffemodel", 2)
    # Two fields, the first a comma-separated list: files load in order, the last wins;
    # a relative name is found beside the solver file.
    path = write_solver(tmp_path, weights=f'"{tmp_path}/b.caffemodel, a.caffemodel"\n'
                                          f'weights: "{tmp_path}/b.caffemodel"')
    cwd = os.getcwd()
    s = Solver(path)
    assert os.getcwd() == cwd
    assert np.array_equal(s.net.params["ip"][0].data, b["ip"][0])
    assert np.array_equal(s.test_nets[0].params["extra"][0].data, b["extra"][0])
    assert np.array_equal(s.test_nets[0].params["ip"][1].data, b["ip"][1])
    s = Solver(write_solver(tmp_path, weights=f'"{tmp_path}/b.caffemodel,a.caffemodel"'))
    assert np.array_equal(s.net.params["ip"][0].data, a["ip"][0])
    assert np.array_equal(s.test_nets[0].params["extra"][1].data, a["extra"][1])


def test_command_line_weights_replace_and_snapshot_clears_the_field(tmp_path, log_lines):
    a = saved_weights(tmp_path / "a.caffemodel", 1)
    path = write_solver(tmp_path, weights=f'"{tmp_path}/absent.caffemodel"', max_iter=2,
                        base_lr=0, momentum=0)
    assert main(["train", "--solver", path, "--weights", str(tmp_path / "a.caffemodel")]) == 0
    assert f"Finetuning from {tmp_path}/a.caffemodel" in log_lines
    s = Solver(write_solver(tmp_path, max_iter=2, base_lr=0, momentum=0))
    s.restore(tmp_path / "snap_iter_2.solverstate")
    assert np.array_equal(s.net.params["ip"][0].data, a["ip"][0])  # base_lr 0: unchanged
    write_solver(tmp_path, weights=f'"{tmp_path}/absent.caffemodel"', max_iter=4)
    assert main(["train", "--solver", path, "--snapshot",
                 str(tmp_path / "snap_iter_2.solverstate")]) == 0
    assert os.path.exists(tmp_path / "snap_iter_4.solverstate")


def test_layer_wise_reduce_either_way_trains_the_same(tmp_path):
    # Gradients are reduced as soon as each exists whatever the flag says; the result is
    # the same bits (the flag only schedules Caffe's NCCL reductions).
    runs = []
    for flag in ("true", "false"):
        s = build_solver(write_solver(tmp_path, layer_wise_reduce=flag), replicas=2)
        s.step(3)
        runs.append(s.net.params["ip"][0].data.copy())
    assert np.array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], Solver(write_solver(tmp_path)).net.params["ip"][0].data)


def test_stepvalue_without_multistep_is_ignored_with_a_warning(tmp_path, log_lines):
    """As Caffe: only multistep reads stepvalue; the step policy's rates are unchanged."""
    path = write_solver(tmp_path, lr_policy='"step"', stepsize=2, gamma=0.1,
                        stepvalue="1\nstepvalue: 1")
    s = Solver(path)
    assert any('stepvalue is read only by lr_policy "multistep"; this solver\'s is "step", so '
               "it is ignored" in line for line in log_lines)
    s.step(3)
    assert [line for line in log_lines if line.startswith("Iteration 2, lr")] == [
        "Iteration 2, lr = 0.005"]
