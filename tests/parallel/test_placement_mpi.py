"""A placement over MPI ranks: every rank builds the whole graph and runs its share, and a
Copy op between ranks is a message. Two-tower AlexNet with its second tower on rank 1, and
the hybrid (convolutions one replica per rank, fc6 a tower per rank) across 2 ranks, train
to the weights of the unsplit net trained in one process."""

import json
import re

import numpy as np
import pytest
from google.protobuf import text_format

from purine.caffe.net import TRAIN, Net
from purine.caffe.solver import Solver
from tests.parallel.test_mpi import launcher, mpirun  # noqa: F401 -- a fixture
from tests.parallel.test_placement_training import PLACEMENT, alexnet_solver, image_db  # noqa: F401


def unsplit_run(param, tmp_path, init: str):
    """The unsplit net trained in this process from ``init``; its final weights."""
    s = Solver(param)
    s.net.copy_from(init)
    s.step(param.max_iter)
    return s.net


def start_weights(param, path) -> str:
    net = Net(param.net_param, phase=TRAIN, seed=11)
    net.save(path)
    return str(path)


def assert_close(model: str, want: Net) -> None:
    got = Net(want.model, phase=TRAIN)
    got.copy_from(model)
    for layer, views in want.params.items():
        for k, v in enumerate(views):
            np.testing.assert_allclose(got.params[layer][k].data, v.data, rtol=1e-4,
                                       atol=1e-5 * np.abs(v.data).max(),
                                       err_msg=f"{layer}[{k}]")


def write(tmp_path, param, placement_text: str) -> tuple[str, str]:
    solver = tmp_path / "solver.prototxt"
    solver.write_text(text_format.MessageToString(param))
    placement = tmp_path / "ranks.placement"
    placement.write_text(placement_text)
    return str(solver), str(placement)


def test_two_towers_on_two_ranks_train_as_the_unsplit_net(launcher, image_db, tmp_path):  # noqa: F811
    param = alexnet_solver(image_db, max_iter=4, snapshot_after_train=True, display=1,
                           snapshot_prefix=str(tmp_path / "ranks"))
    # The shipped two-tower file with its second tower on rank 1 instead of cpu:1.
    text = PLACEMENT.read_text().replace('"cpu:1"', '"rank1/cpu:0"')
    solver, placement = write(tmp_path, param, text)
    init = start_weights(param, tmp_path / "init.caffemodel")
    mpirun(launcher, tmp_path, 2, "--solver", solver, "--placement", placement,
           "--weights", init, "--trace", str(tmp_path / "trace.json"))
    assert_close(str(tmp_path / "ranks_iter_4.caffemodel"), unsplit_run(param, tmp_path, init))
    # Rank 0's trace holds both ranks: rank 1 ran its tower's ops and its transfers.
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    ops = {(e["pid"], e["name"]) for e in trace if e["ph"] == "X"}
    assert (1, "conv2/tower1/ConvForward") in ops and (0, "conv1/ConvForward") in ops
    assert (0, "conv2/tower1/ConvForward") not in ops
    assert {(0, "conv2/tower1/CopyIn#0"), (1, "conv2/tower1/CopyIn#0")} <= ops
    log = (tmp_path / "rank0" / "stderr.txt").read_text()
    assert "Iteration 4, loss = " in log and "Optimization Done." in log


def test_the_hybrid_across_two_ranks_equals_the_whole_batch(launcher, image_db, tmp_path):  # noqa: F811
    param = alexnet_solver(image_db, max_iter=4, snapshot_after_train=True,
                           snapshot_prefix=str(tmp_path / "hybrid"))
    for lp in param.net_param.layer:
        if lp.type == "Data":
            lp.data_param.batch_size = 2  # per rank
    solver, placement = write(tmp_path, param, 'layer { name: "fc6" location: "replicas" }\n'
                                               'layer { name: "relu6" location: "replicas" }\n')
    init = start_weights(param, tmp_path / "init.caffemodel")
    mpirun(launcher, tmp_path, 2, "--solver", solver, "--placement", placement,
           "--weights", init)
    whole = param.__class__()
    whole.CopyFrom(param)
    for lp in whole.net_param.layer:
        if lp.type == "Data":
            lp.data_param.batch_size = 4
    assert_close(str(tmp_path / "hybrid_iter_4.caffemodel"), unsplit_run(whole, tmp_path, init))


@pytest.mark.parametrize("text, message", [
    ('layer { name: "fc8" location: "rank1/cpu:0" }\n'
     'layer { name: "loss" location: "rank1/cpu:0" }\n',
     "must leave the loss and the outputs on rank 0, where the solver logs them; loss "
     "would be elsewhere"),
])
def test_a_loss_away_from_rank_0_is_refused(launcher, image_db, tmp_path, text, message):  # noqa: F811
    solver, placement = write(tmp_path, alexnet_solver(image_db, max_iter=1), text)
    with pytest.raises(AssertionError):  # the job fails: every rank stops
        mpirun(launcher, tmp_path, 2, "--solver", solver, "--placement", placement)
    # Every rank finds it before iteration 0; the first to say so ends the job.
    logs = "".join((tmp_path / f"rank{k}" / "stderr.txt").read_text() for k in range(2))
    assert re.search(r"purine-caffe train \(rank \d\): net 'AlexNet': a placement over MPI "
                     r"ranks " + re.escape(message), logs), logs


def test_a_net_placed_over_ranks_runs_whole_in_one_process(tmp_path):
    """Without MPI, one process holds every rank's share: a Copy op between ranks is a
    copy, and the numbers are the unsplit net's (a dry run of a placement over ranks)."""
    from purine.parallel.placement import place
    from tests.parallel.test_two_tower import alexnet, assert_same_numbers

    param = alexnet()
    ranks = tmp_path / "ranks.placement"
    ranks.write_text(PLACEMENT.read_text().replace('"cpu:1"', '"rank1/cpu:0"'))
    split = place(param, ranks)
    plain = Net(param, phase=TRAIN, dtype="float64")
    placed = Net(split.net, phase=TRAIN, dtype="float64", placement=split.placement)
    assert {op.location.host for op in placed.graph.ops} == {0, 1}
    split.load(placed, {name: [v.data for v in views] for name, views in plain.params.items()})
    x = np.random.default_rng(0).standard_normal((2, 3, 227, 227))
    for net in (plain, placed):
        net.forward(data=x, label=np.array([3.0, 997.0]))
        net.backward()
    assert_same_numbers(plain, placed, split, ["data"])


DROPOUT_NET = """
name: "n"
layer { name: "d" type: "DummyData" top: "x" top: "y" dummy_data_param {
  shape { dim: 4 dim: 6 } shape { dim: 4 dim: 4 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "h1" inner_product_param {
  num_output: 16 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "drop" type: "Dropout" bottom: "h1" top: "h1" dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip2" type: "InnerProduct" bottom: "h1" top: "h2" inner_product_param {
  num_output: 4 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "h2" bottom: "y" top: "loss" }
"""


def test_a_placement_over_ranks_resumes_every_ranks_random_streams(launcher, tmp_path):  # noqa: F811
    """Rank 1's Dropout draws from its own stream: the snapshot keeps where it got to, so
    a resumed run ends with the uninterrupted run's weights."""
    from purine.formats import caffe_pb2 as pb

    net = pb.NetParameter()
    text_format.Parse(DROPOUT_NET, net)
    param = pb.SolverParameter(net_param=net, base_lr=0.1, lr_policy="fixed", max_iter=4,
                               random_seed=3, momentum=0.9, snapshot=2,
                               snapshot_prefix=str(tmp_path / "snap"))
    solver, placement = write(tmp_path, param, 'layer: "ip1" location: "rank1/cpu:0"\n'
                                               'layer: "drop" location: "rank1/cpu:0"\n')
    mpirun(launcher, tmp_path, 2, "--solver", solver, "--placement", placement)
    (tmp_path / "straight.caffemodel").write_bytes((tmp_path / "snap_iter_4.caffemodel")
                                                   .read_bytes())
    mpirun(launcher, tmp_path, 2, "--solver", solver, "--placement", placement,
           "--snapshot", str(tmp_path / "snap_iter_2.solverstate"))
    straight, resumed = (Net(net, phase=TRAIN) for _ in range(2))
    straight.copy_from(str(tmp_path / "straight.caffemodel"))
    resumed.copy_from(str(tmp_path / "snap_iter_4.caffemodel"))
    for layer, views in straight.params.items():
        for k, v in enumerate(views):
            np.testing.assert_array_equal(resumed.params[layer][k].data, v.data, layer)
