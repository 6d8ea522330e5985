"""Training with a placement (model parallelism): Krizhevsky's two-tower AlexNet on two
CPU memory spaces trains to the weights of the unsplit net, each parameter updated where
it lives; its snapshots are the unsplit net's files, and resuming continues the run."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from purine.caffe.net import TEST, Net
from purine.caffe.solver import Solver
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net
from purine.graph import Location
from purine.parallel import build_solver
from purine.parallel.placement import read_placement, split_towers
from purine.zoo import model_file

ALEXNET = Path(model_file("bvlc_alexnet/train_val.prototxt")).parent
PLACEMENT = ALEXNET / "two_tower.placement"
C0, C1 = Location("cpu", 0), Location("cpu", 1)

cv2 = pytest.importorskip("cv2", reason="opencv-python-headless<5 is in the test extra")


@pytest.fixture(scope="module")
def image_db(tmp_path_factory):
    from purine.converters.convert_imageset import write_images

    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("alexnet") / "train_lmdb"
    records = ((f"{i:08d}", rng.integers(0, 256, (67, 67, 3), dtype=np.uint8), i % 7)
               for i in range(24))
    write_images(path, records, total=24)
    return str(path)


def alexnet_solver(db: str, **fields) -> pb.SolverParameter:
    """Caffe's AlexNet solver on 67x67 images (pool5 is 1x1), fc6 and fc7 narrowed to 256
    outputs, without Dropout (test_dropout_invariance.py trains the net with it) and
    without the TEST net."""
    net = read_net(ALEXNET / "train_val.prototxt")
    layers = [lp for lp in net.layer if lp.type != "Dropout" and "TEST" not in str(lp.include)]
    del net.layer[:]
    net.layer.extend(layers)
    for lp in net.layer:
        if lp.type == "Data":
            lp.data_param.source, lp.data_param.batch_size = db, 4
            lp.transform_param.ClearField("mean_file")
            lp.transform_param.crop_size = 0
            lp.transform_param.scale = 1 / 64
        if lp.name in ("fc6", "fc7"):
            lp.inner_product_param.num_output = 256
    s = pb.SolverParameter(net_param=net, base_lr=0.01, lr_policy="step", gamma=0.1,
                           stepsize=5, momentum=0.9, weight_decay=0.0005, max_iter=10,
                           random_seed=7, snapshot_prefix="")
    for key, value in fields.items():
        setattr(s, key, value)
    return s


def assert_same_weights(got: dict, want: Net, what: str = "") -> None:
    for layer, views in want.params.items():
        for k, v in enumerate(views):
            np.testing.assert_allclose(got[layer][k], v.data, rtol=1e-5,
                                       atol=1e-5 * np.abs(v.data).max(),
                                       err_msg=f"{what}{layer}[{k}]")


def plain_and_placed(param: pb.SolverParameter, iters: int = 10) -> tuple[Solver, Solver]:
    """The unsplit net and the two-tower net trained ``iters`` iterations from the same
    weights: the unsplit net's fillers, cut into towers (a tower's filler draws its own)."""
    plain = Solver(param, dtype="float64")
    placed = build_solver(param, placement=PLACEMENT, dtype="float64")
    split = placed.scheme.split_of(placed.net)
    split.load(placed.net, {n: [v.data for v in views] for n, views in plain.net.params.items()})
    assert_same_weights(split.params(placed.net), plain.net)
    plain.step(iters)
    placed.step(iters)
    return plain, placed


@pytest.mark.parametrize("fields", [
    {},
    # Adam reads the iteration in both memory spaces; clipping sums squares per space;
    # iter_size accumulates where each parameter lives.
    {"type": "Adam", "base_lr": 0.001, "momentum2": 0.999, "clip_gradients": 0.5,
     "iter_size": 2},
], ids=["sgd", "adam-clip-itersize"])
def test_two_tower_alexnet_trains_to_the_unsplit_weights(image_db, fields):
    param = alexnet_solver(image_db, **fields)
    plain, placed = plain_and_placed(param)
    split = placed.scheme.split_of(placed.net)
    assert_same_weights(split.params(placed.net), plain.net)
    # Each parameter's update ops run where the parameter lives.
    where = {op.name: op.location.memory for op in placed.update_ops}
    assert where["solver/conv4/tower1[0]/update"] == C1.memory
    assert where["solver/conv4/tower0[0]/update"] == C0.memory
    assert where["solver/fc8[0]/update"] == C0.memory
    copies = sorted(n for n, op in ((o.name, o) for o in placed.update_ops) if op.type == "Copy")
    expected = ["solver/lr@cpu:1"]
    if "clip_gradients" in fields:
        expected += ["solver/clip_scale@cpu:1", "solver/clip_sumsq@cpu:1@home"]
    if fields.get("type") == "Adam":
        expected += ["solver/iter@cpu:1"]
    assert copies == sorted(expected)
    assert {h.location.memory for u in placed.updates for h in u.history
            if u.param.location == C1} == {C1.memory}


def test_a_placed_run_snapshots_the_unsplit_net_and_resumes(image_db, tmp_path):
    param = alexnet_solver(image_db, snapshot=5, snapshot_prefix=str(tmp_path / "placed"))
    _, placed = plain_and_placed(param)
    model, state = tmp_path / "placed_iter_5.caffemodel", tmp_path / "placed_iter_5.solverstate"
    assert model.exists() and state.exists()

    # The caffemodel and solverstate are the unsplit net's: an unsplit solver resumes from
    # them and ends where the placed run ended, and the placed solver resumes from them too.
    param.snapshot = 0
    plain = Solver(param, dtype="float64")
    plain.restore(str(state))
    assert plain.iter == 5
    plain.step(5)
    split = placed.scheme.split_of(placed.net)
    assert_same_weights(split.params(placed.net), plain.net, "unsplit resume: ")
    again = build_solver(param, placement=PLACEMENT, dtype="float64")
    again.restore(str(state))
    again.step(5)
    assert_same_weights(split.params(again.net), plain.net, "placed resume: ")
    history = {u.param.name: again.net.dispatcher.array(u.history[0]) for u in again.updates}
    mine = {u.param.name: placed.net.dispatcher.array(u.history[0]) for u in placed.updates}
    for name, h in mine.items():
        np.testing.assert_allclose(history[name], h, rtol=1e-5, atol=1e-7, err_msg=name)

    # OpenCV's Caffe importer reads the placed run's caffemodel as the unsplit net's.
    deploy = pb.NetParameter(name="AlexNet")
    deploy.layer.add(name="data", type="Input", top=["data"]).input_param.shape.add(
        dim=[2, 3, 67, 67])
    deploy.layer.extend(lp for lp in param.net_param.layer
                        if lp.type not in ("Data", "SoftmaxWithLoss", "Accuracy"))
    (tmp_path / "deploy.prototxt").write_text(text_format.MessageToString(deploy))
    x = np.random.default_rng(1).standard_normal((2, 3, 67, 67)).astype(np.float32)
    ours = Net(str(tmp_path / "deploy.prototxt"), str(model), phase=TEST)
    want = ours.forward(data=x)["fc8"]
    cv = cv2.dnn.readNetFromCaffe(str(tmp_path / "deploy.prototxt"), str(model))
    cv.setInput(x)
    np.testing.assert_allclose(cv.forward("fc8"), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())

    # Fine-tuning a placed net from an unsplit caffemodel loads every tower's part.
    param.weights.append(str(model))
    tuned = build_solver(param, placement=PLACEMENT, dtype="float64")
    start = Solver(param, dtype="float64")
    assert_same_weights(tuned.scheme.split_of(tuned.net).params(tuned.net), start.net)


def test_a_placement_naming_an_unknown_layer_is_refused(image_db, tmp_path):
    bad = tmp_path / "bad.placement"
    bad.write_text('layer: "conv9" location: "cpu:1"\n')
    with pytest.raises(PurineError, match=r"bad.placement:1: net 'AlexNet' has no layer "
                                          r"'conv9'"):
        build_solver(alexnet_solver(image_db), placement=bad)


def test_train_with_a_placement_file_from_the_command_line(image_db, tmp_path):
    param = alexnet_solver(image_db, max_iter=4, snapshot=2, display=1,
                           snapshot_prefix=str(tmp_path / "cli"))
    solver = tmp_path / "solver.prototxt"
    solver.write_text(text_format.MessageToString(param))
    run = [sys.executable, "-m", "purine.cli", "train", "--solver", str(solver),
           "--placement", str(PLACEMENT)]
    r = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"Placement {PLACEMENT}: each layer it names runs where it says" in r.stderr
    assert re.search(r"Iteration 3 \(.*\), loss = [0-9.]+\n", r.stderr)
    # Resume from the placed run's snapshot, and the unsplit net loads its caffemodel.
    r = subprocess.run(run + ["--snapshot", str(tmp_path / "cli_iter_2.solverstate")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Restoring previous solver status from" in r.stderr
    plain = Solver(param)
    plain.net.copy_from(str(tmp_path / "cli_iter_4.caffemodel"))
    assert plain.net.params["conv2"][0].shape == (256, 48, 5, 5)

    hybrid = tmp_path / "hybrid.placement"
    hybrid.write_text('layer { name: "fc6" location: "replicas" }\n')
    r = subprocess.run(run[:-1] + [str(hybrid), "--replicas", "2", "--iterations", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"Iteration 2, loss = [0-9.]+\n", r.stderr)

    r = subprocess.run(run + ["--async", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "--placement with --async is not supported" in r.stderr


HYBRID = ALEXNET / "one_weird_trick.placement"


def per_replica_and_whole(db: str, replicas: int, batch: int = 2
                          ) -> tuple[pb.SolverParameter, pb.SolverParameter]:
    """The test solver with ``batch`` images per replica, and the same with the replicas'
    batches together (what the hybrid must equal)."""
    param, whole = alexnet_solver(db), alexnet_solver(db)
    for p, n in ((param, batch), (whole, batch * replicas)):
        for lp in p.net_param.layer:
            if lp.type == "Data":
                lp.data_param.batch_size = n
    return param, whole


@pytest.mark.parametrize("replicas,spaces", [(2, False), (4, False), (2, True)],
                         ids=["2-workers", "4-workers", "2-memory-spaces"])
def test_hybrid_alexnet_equals_one_net_with_the_whole_batch(image_db, tmp_path, replicas,
                                                            spaces):
    """Krizhevsky's one weird trick: the convolutions data-parallel (each replica its own
    images, one set of weights), fc6 and fc7 split into a tower per replica over every
    replica's images; equal to one net trained with the replicas' batches together. With
    ``spaces`` replica 1 is in another memory space (the layout of one GPU per replica)."""
    param, whole = per_replica_and_whole(image_db, replicas)
    # The shipped file, less the Dropout layers this test's net leaves out.
    placement = tmp_path / "hybrid.placement"
    placement.write_text("".join(line for line in HYBRID.read_text().splitlines(True)
                                 if "drop" not in line))
    plain = Solver(whole, dtype="float64")
    others = [C1] if spaces else None
    hybrid = build_solver(param, replicas=replicas, placement=placement, dtype="float64",
                          replica_locations=others)
    split = hybrid.scheme.split_of(hybrid.net)
    split.load(hybrid.net, {n: [v.data for v in views] for n, views in plain.net.params.items()})
    plain.step(10)
    hybrid.step(10)
    assert_same_weights(split.params(hybrid.net), plain.net)

    net = hybrid.net
    t = [C0, C1] if spaces else [Location("cpu", 0, r) for r in range(replicas)]
    assert net.builder.data["data"].shape == (2 * replicas, 3, 67, 67)
    assert [net.builder.data[f"pool5/replica{r}"].shape[0] for r in range(replicas)] == \
        [2] * replicas
    where = {L.name: L.location for L in net.builder.layers}
    assert [where["conv3" if r == 0 else f"conv3/replica{r}"] for r in range(replicas)] == t
    assert [where[f"fc7/tower{r}"] for r in range(replicas)] == t
    assert where["fc8"] == t[0]
    # One set of convolution weights: the copies use conv1's blob, and its gradient is
    # summed over them; fc6's weight is cut into the towers.
    if spaces:  # replica 1 reads a copy of conv1's weights, and sends its gradient home
        copies = {op.name for op in net.graph.ops if op.type == "Copy"}
        assert {"conv1/replica1/ParamIn#0", "conv1/replica1/ParamOut#0"} <= copies
        copy = next(L for L in net.builder.layers if L.name == "conv1/replica1")
        assert copy.params[0].location == C1  # the mirror it reads
        # pycaffe's view is the weight itself, as for a weight shared in one memory space
        assert net.params["conv1/replica1"][0]._data is net.params["conv1"][0]._data
    else:
        assert net.params["conv1/replica1"][0]._data is net.params["conv1"][0]._data
    learnable = {p.name for p in net.builder.learnable_params}
    assert "conv1[0]" in learnable and "conv1/replica1[0]" not in learnable
    assert net.params["fc6/tower0"][0].shape == (256 // replicas, 256)
    # The snapshot is the unsplit net's.
    hybrid.param.snapshot_prefix = str(tmp_path / "hybrid")
    model, _ = hybrid.snapshot()
    again = Solver(whole, dtype="float64")
    again.net.copy_from(model)
    assert_same_weights({n: [v.data for v in vs] for n, vs in again.net.params.items()},
                        plain.net)


def test_a_replicated_layer_must_not_compute_a_loss(image_db, tmp_path):
    only = tmp_path / "none.placement"  # names no layer: every layer would be replicated
    only.write_text("# nothing placed\n")
    with pytest.raises(PurineError, match=r"layer 'loss' \(type SoftmaxWithLoss\): cannot run "
                                          r"once per replica: it computes a loss"):
        build_solver(alexnet_solver(image_db), replicas=2, placement=only)


def test_the_shipped_hybrid_placement_fits_alexnet_in_both_phases():
    param = read_net(ALEXNET / "train_val.prototxt")
    where = read_placement(HYBRID, param)
    replicas = [Location("cpu", 0, r) for r in range(2)]
    train = split_towers(param, where, phase=pb.TRAIN, replicas=replicas, data_parallel=True)
    names = [lp.name for lp in train.net.layer]
    cut = next(lp for lp in train.net.layer if lp.name == "data/slice")
    assert (list(cut.top), cut.slice_param.axis) == (["data/replica0", "data/replica1"], 0)
    assert {"conv1", "conv1/replica1", "pool5/replica1", "fc6/tower1", "drop7/tower1",
            "fc8", "loss"} <= set(names)
    assert "fc8/replica1" not in names and train.replica_of["conv5/replica1"] == "conv5"
    data = next(lp for lp in train.net.layer if lp.name == "data")
    assert data.data_param.batch_size == 2 * 256
    test = split_towers(param, where, phase=pb.TEST, replicas=replicas)
    assert {lp.name for lp in test.net.layer} >= {"conv1", "fc6/tower0", "fc6/tower1"}
    assert not test.replica_of and "conv1/replica1" not in {lp.name for lp in test.net.layer}


SHARED = """
name: "shared"
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 3 dim: 4 } } }
layer { name: "a" type: "InnerProduct" bottom: "x" top: "a" param { name: "w" } param { name: "b" }
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 }
  bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "t" type: "TanH" bottom: "a" top: "t" }
layer { name: "c" type: "InnerProduct" bottom: "t" top: "c" param { name: "w" } param { name: "b" }
  inner_product_param { num_output: 4 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "c" bottom: "x" top: "loss" }
"""


def test_a_weight_shared_across_memory_spaces_is_mirrored_and_its_gradient_summed_home():
    param = pb.NetParameter()
    text_format.Parse(SHARED, param)
    x = np.random.default_rng(2).standard_normal((3, 4))
    nets = [Net(param, phase=pb.TRAIN, dtype="float64"),
            Net(param, phase=pb.TRAIN, dtype="float64", placement={"c": C1, "t": C1})]
    for net in nets:
        net.params["a"][0].data[...] = nets[0].params["a"][0].data
        net.params["a"][1].data[...] = nets[0].params["a"][1].data
        net.forward(x=x)
        net.backward()
    plain, placed = nets
    mirror = next(L for L in placed.builder.layers if L.name == "c").params[0]
    assert mirror.location == C1  # c reads a mirror of a's weight
    assert placed.params["c"][0]._data is placed.params["a"][0]._data  # views show the weight
    assert placed.builder.learnable_params == [placed.params["a"][0]._data,
                                               placed.params["a"][1]._data]
    assert placed.loss == pytest.approx(plain.loss, rel=1e-12)
    for k in range(2):
        np.testing.assert_allclose(placed.params["a"][k].diff, plain.params["a"][k].diff,
                                   rtol=1e-12, atol=1e-14)


def test_a_snapshot_holds_the_current_shared_weight_where_a_mirror_reads_it(tmp_path):
    """The snapshot writes the shared weight under each layer using it (as Caffe does):
    the weight itself, not a mirror a step behind."""
    net = pb.NetParameter()
    text_format.Parse(SHARED, net)
    param = pb.SolverParameter(net_param=net, base_lr=0.1, lr_policy="fixed", max_iter=2,
                               random_seed=3, snapshot_prefix=str(tmp_path / "s"))
    placed = build_solver(param, placement={"c": C1, "t": C1}, dtype="float64")
    placed.net.blobs["x"].data[...] = np.random.default_rng(2).standard_normal((3, 4))
    placed.step(2)
    model, _ = placed.snapshot()
    saved = Net(net, phase=pb.TRAIN, dtype="float64")
    saved.copy_from(model)
    for k in range(2):  # (a caffemodel holds float32)
        for layer in ("a", "c"):
            np.testing.assert_allclose(saved.params[layer][k].data,
                                       placed.net.params["a"][k].data, rtol=1e-6)


INPLACE = """
name: "inplace"
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 3 dim: 4 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "h"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "relu" type: "ReLU" bottom: "h" top: "h" }
layer { name: "ip2" type: "InnerProduct" bottom: "h" top: "y"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "x" top: "loss" }
"""


def test_an_in_place_layer_left_behind_its_placed_bottom_writes_a_top_of_its_own():
    from purine.parallel.placement import split_towers

    param = pb.NetParameter()
    text_format.Parse(INPLACE, param)
    split = split_towers(param, {"ip1": C1})
    relu = next(lp for lp in split.net.layer if lp.name == "relu")
    assert list(relu.bottom) == ["h"] and list(relu.top) == ["h@relu"]
    plain = Net(param, phase=pb.TRAIN, dtype="float64")
    placed = Net(split.net, phase=pb.TRAIN, dtype="float64", placement=split.placement)
    split.load(placed, {n: [v.data for v in views] for n, views in plain.params.items()})
    x = np.random.default_rng(4).standard_normal((3, 4))
    for net in (plain, placed):
        net.forward(x=x)
        net.backward()
    assert placed.loss == pytest.approx(plain.loss, rel=1e-12)
    for layer in ("ip1", "ip2"):
        np.testing.assert_allclose(placed.params[layer][0].diff, plain.params[layer][0].diff,
                                   rtol=1e-12, atol=1e-14)


def test_pycaffe_solvers_take_a_placement(image_db, tmp_path):
    import purine.pycaffe as caffe

    param = alexnet_solver(image_db, max_iter=2)
    path = tmp_path / "solver.prototxt"
    path.write_text(text_format.MessageToString(param))
    placed = caffe.SGDSolver(str(path), placement=str(PLACEMENT))
    plain = build_solver(param, placement=PLACEMENT)
    assert [L.name for L in placed.net.builder.layers] == \
        [L.name for L in plain.net.builder.layers]
    assert placed.net.params["conv2/tower1"][0].data.shape == (128, 48, 5, 5)
    placed.step(2)
    assert placed.iter == 2 and np.isfinite(placed.net.blobs["loss"].data).all()
