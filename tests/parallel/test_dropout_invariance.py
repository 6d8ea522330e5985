"""Dropout is placement-invariant: a layer's random stream is keyed by the layer of the
user's net it is (or is a part of), and a tower or replica draws exactly its part of the
mask the unsplit layer draws, so two towers and the hybrid train to the unsplit net's
numbers with the shipped AlexNet's Dropout layers."""

from pathlib import Path

import numpy as np
import pytest

from purine.backend import RandomStream, StreamPart
from purine.caffe.net import Net
from purine.caffe.solver import Solver
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net
from purine.graph import Location
from purine.parallel import build_solver
from purine.parallel.placement import read_placement, split_towers
from purine.zoo import model_file

ALEXNET = Path(model_file("bvlc_alexnet/train_val.prototxt")).parent
TWO_TOWER, HYBRID = ALEXNET / "two_tower.placement", ALEXNET / "one_weird_trick.placement"


def numpy_draw(seed: int, key: int, count: int, shape: tuple[int, ...]) -> np.ndarray:
    """The reference: numpy's own generator for (seed, key, count), the whole shape."""
    return np.random.default_rng([seed, key, count]).random(shape)


# -- the stream: a part draws its part of the whole layer's numbers ------------------------
@pytest.mark.parametrize("whole,part,box", [
    ((6, 5), StreamPart(0, 1, 3), np.s_[2:4]),                 # replica 1 of 3: rows 2..3
    ((4, 6), StreamPart(1, 2, 3), np.s_[:, 4:6]),              # tower 2 of 3, short gaps
    ((3, 4096), StreamPart(1, 1, 2), np.s_[:, 2048:]),         # fc6's tower 1, long gaps
    ((2, 4, 3, 3), StreamPart(1, 0, 2), np.s_[:, 0:2]),        # a conv tower's channels
    ((4, 3000), StreamPart(0, 3, 4), np.s_[3:4]),              # the last replica
], ids=["rows", "channels-short", "channels-long", "channels-4d", "last-rows"])
def test_a_part_draws_its_part_of_the_whole_layers_numbers(whole, part, box):
    want = numpy_draw(7, 3, 0, whole)[box]
    s = RandomStream(7, 3, part)
    got = s.uniform(want.shape)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(s.uniform(want.shape), numpy_draw(7, 3, 1, whole)[box])
    assert s.state() == {"count": 2}


def test_the_parts_together_are_the_whole_draw():
    whole = numpy_draw(5, 11, 0, (4, 6, 2))
    towers = [RandomStream(5, 11, StreamPart(1, k, 3)).uniform((4, 2, 2)) for k in range(3)]
    np.testing.assert_array_equal(np.concatenate(towers, 1), whole)
    rows = [RandomStream(5, 11, StreamPart(0, r, 2)).uniform((2, 6, 2)) for r in range(2)]
    np.testing.assert_array_equal(np.concatenate(rows, 0), whole)


def test_an_unsplit_stream_draws_as_before():
    """The unsplit net's numbers do not move: ``uniform`` is numpy's draw for (seed, key,
    count), and ``next`` its generator, as before parts existed."""
    s = RandomStream(7, 3)
    np.testing.assert_array_equal(s.uniform((3, 4)), numpy_draw(7, 3, 0, (3, 4)))
    np.testing.assert_array_equal(s.next().random(5), numpy_draw(7, 3, 1, (5,)))
    # A part's ``next`` (ops that draw otherwise) is its own, not a copy of its siblings'.
    a, b = (RandomStream(7, 3, StreamPart(1, k, 2)).next().random(4) for k in range(2))
    assert not np.array_equal(a, b)


NET = """
name: "drops"
layer { name: "tin" type: "Input" top: "t" input_param { shape { dim: 4 dim: 3 } } }
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 4 dim: 6 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "h"
  inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "drop" type: "Dropout" bottom: "h" top: "h" dropout_param { dropout_ratio: 0.5 } }
layer { name: "out" type: "InnerProduct" bottom: "h" top: "y"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss" }
"""


def small_net() -> pb.NetParameter:
    from google.protobuf import text_format

    return text_format.Parse(NET, pb.NetParameter())


def test_the_unsplit_dropout_mask_is_the_layers_index_stream():
    """The mask of the layer at index 3 (after the two Inputs and the InnerProduct) with
    seed 9 is numpy's draw for (9, 1_000_003 * 4 + 0): unchanged by this work."""
    net = Net(small_net(), phase=pb.TRAIN, dtype="float64", seed=9)
    net.forward(x=np.ones((4, 6)), t=np.zeros((4, 3)))
    mask = net.builder.dispatcher.array(net.builder.graph.blobs["drop@mask"])
    np.testing.assert_array_equal(mask, numpy_draw(9, 1_000_003 * 4, 0, (4, 6)) < 0.5)


@pytest.mark.parametrize("where", [
    {"ip": [Location("cpu", 0), Location("cpu", 1)],
     "drop": [Location("cpu", 0), Location("cpu", 1)]},
    {"drop": [Location("cpu", 0), Location("cpu", 0, 1), Location("cpu", 1)]},
    # ip's towers join before drop (a Concat): drop, whole, is at another index
    {"ip": [Location("cpu", 0), Location("cpu", 1)], "drop": Location("cpu", 1)},
], ids=["two-towers", "three-towers", "whole-after-towers"])
def test_a_split_dropout_drops_what_the_unsplit_one_drops(where):
    param = small_net()
    split = split_towers(param, where, phase=pb.TRAIN)
    plain = Net(param, phase=pb.TRAIN, dtype="float64", seed=9)
    placed = Net(split.net, phase=pb.TRAIN, dtype="float64", seed=9, placement=split.placement)
    split.key_streams(placed.builder.stateful)
    split.load(placed, {n: [v.data for v in views] for n, views in plain.params.items()})
    x = np.random.default_rng(1).standard_normal((4, 6))
    t = np.random.default_rng(2).standard_normal((4, 3))
    for _ in range(3):  # three passes: the streams advance alike
        for net in (plain, placed):
            net.forward(x=x, t=t)
            net.backward()
        assert placed.loss == pytest.approx(plain.loss, rel=1e-12)
        np.testing.assert_array_equal(split.blob(placed, "h"), plain.blobs["h"].data)
        np.testing.assert_allclose(split.params(placed, diff=True)["ip"][0],
                                   plain.params["ip"][0].diff, rtol=1e-12, atol=1e-14)


POOL_NET = """
name: "stochastic"
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 4 dim: 6 dim: 6 } } }
layer { name: "pool" type: "Pooling" bottom: "x" top: "y"
  pooling_param { pool: STOCHASTIC kernel_size: 3 stride: 2 } }
"""


def test_split_stochastic_pooling_picks_what_the_unsplit_one_picks():
    """Pooling's STOCHASTIC method draws one uniform per output through the same parts:
    two towers over the channels pick the unsplit layer's positions."""
    from google.protobuf import text_format

    param = text_format.Parse(POOL_NET, pb.NetParameter())
    split = split_towers(param, {"pool": [Location("cpu", 0), Location("cpu", 1)]},
                         phase=pb.TRAIN)
    plain = Net(param, phase=pb.TRAIN, dtype="float64", seed=4)
    placed = Net(split.net, phase=pb.TRAIN, dtype="float64", seed=4, placement=split.placement)
    split.key_streams(placed.builder.stateful)
    x = np.random.default_rng(3).uniform(0.1, 1.0, (2, 4, 6, 6))  # positive: every window
    for _ in range(2):
        plain.forward(x=x)
        placed.forward(x=x)
        np.testing.assert_array_equal(split.blob(placed, "y"), plain.blobs["y"].data)


# -- the shipped AlexNet, Dropout included --------------------------------------------------
@pytest.fixture(scope="module")
def image_db(tmp_path_factory):
    from purine.converters.convert_imageset import write_images

    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("alexnet_dropout") / "train_lmdb"
    records = ((f"{i:08d}", rng.integers(0, 256, (67, 67, 3), dtype=np.uint8), i % 7)
               for i in range(24))
    write_images(path, records, total=24)
    return str(path)


def alexnet(db: str, batch: int, **fields) -> pb.SolverParameter:
    """The shipped train_val.prototxt (Dropout, mirror included) on 67x67 images, fc6 and
    fc7 narrowed to 256 outputs, without the TEST net."""
    net = read_net(ALEXNET / "train_val.prototxt")
    layers = [lp for lp in net.layer if "TEST" not in str(lp.include)]
    del net.layer[:]
    net.layer.extend(layers)
    for lp in net.layer:
        if lp.type == "Data":
            lp.data_param.source, lp.data_param.batch_size = db, batch
            lp.transform_param.ClearField("mean_file")
            lp.transform_param.crop_size = 0
            lp.transform_param.scale = 1 / 64
        if lp.name in ("fc6", "fc7"):
            lp.inner_product_param.num_output = 256
    assert sum(lp.type == "Dropout" for lp in net.layer) == 2
    s = pb.SolverParameter(net_param=net, base_lr=0.01, lr_policy="fixed", momentum=0.9,
                           weight_decay=0.0005, max_iter=10, random_seed=7,
                           snapshot_prefix="")
    for key, value in fields.items():
        setattr(s, key, value)
    return s


def train_both(plain: Solver, other: Solver, iters: int = 3) -> None:
    """Both from the unsplit net's weights; the losses agree at every iteration, the
    weights at the end (1e-5, float64)."""
    split = other.scheme.split_of(other.net)
    split.load(other.net, {n: [v.data for v in views] for n, views in plain.net.params.items()})
    for _ in range(iters):
        plain.step(1)
        other.step(1)
        assert float(other.net.blobs["loss"].data) == pytest.approx(
            float(plain.net.blobs["loss"].data), rel=1e-5)
    assert_same_weights(split.params(other.net), plain)


def assert_same_weights(got: dict, plain: Solver, what: str = "") -> None:
    for layer, views in plain.net.params.items():
        for k, v in enumerate(views):
            np.testing.assert_allclose(got[layer][k], v.data, rtol=1e-5,
                                       atol=1e-5 * np.abs(v.data).max(),
                                       err_msg=f"{what}{layer}[{k}]")


def test_two_tower_alexnet_with_dropout_trains_to_the_unsplit_weights(image_db):
    plain = Solver(alexnet(image_db, 4), dtype="float64")
    placed = build_solver(alexnet(image_db, 4), placement=TWO_TOWER, dtype="float64")
    train_both(plain, placed)


@pytest.mark.parametrize("placement", [HYBRID, "fc8"], ids=["shipped", "dropout-replicated"])
def test_hybrid_alexnet_with_dropout_equals_one_net_with_the_whole_batch(image_db, tmp_path,
                                                                        placement):
    """The shipped one_weird_trick.placement (drop6, drop7 split into a tower per replica:
    each draws its channels), and a placement naming fc8 alone (drop6, drop7 run once per
    replica: each draws its rows)."""
    if placement == "fc8":
        placement = tmp_path / "fc8.placement"
        placement.write_text('layer { name: "fc8" location: "replicas" }\n')
    plain = Solver(alexnet(image_db, 4), dtype="float64")
    hybrid = build_solver(alexnet(image_db, 2), replicas=2, placement=placement,
                          dtype="float64")
    names = {L.name for L in hybrid.net.builder.layers}
    assert ({"drop6/tower1", "drop7/tower1"} if placement == HYBRID
            else {"drop6/replica1", "drop7/replica1"}) <= names
    train_both(plain, hybrid)


def test_the_streams_of_the_split_net_are_the_user_layers(image_db):
    """drop6's towers and the unsplit drop6 share one key, the unsplit net's; each tower
    holds its channels."""
    param = alexnet(image_db, 2).net_param
    plain = Net(param, phase=pb.TRAIN, seed=7)
    key = plain.builder.stateful["drop6/random#0"].key
    index = [L.name for L in plain.builder.layers].index("drop6")
    assert key == 1_000_003 * (index + 1)
    where = read_placement(HYBRID, param)
    split = split_towers(param, where, phase=pb.TRAIN, data_parallel=True,
                         replicas=[Location("cpu", 0, r) for r in range(2)])
    net = Net(split.net, phase=pb.TRAIN, seed=7, placement=split.placement,
              replica_of=split.replica_of)
    before = net.builder.stateful["drop6/tower1/random#0"].key
    assert before != key  # its place in the rewritten net differs from the user's net's
    split.key_streams(net.builder.stateful)
    for k in range(2):
        s = net.builder.stateful[f"drop6/tower{k}/random#0"]
        assert (s.key, s.part) == (key, StreamPart(1, k, 2))


def test_a_placed_runs_snapshot_resumes_the_unsplit_dropout_streams(image_db, tmp_path):
    """The .solverstate of a two-tower run holds drop6's stream under drop6's key (the
    towers' as one entry): an unsplit run resumed from it goes on as the placed run does."""
    param = alexnet(image_db, 4, snapshot=2, snapshot_prefix=str(tmp_path / "placed"))
    hybrid = build_solver(alexnet(image_db, 2, snapshot=2,
                                  snapshot_prefix=str(tmp_path / "placed")),
                          replicas=2, placement=HYBRID, dtype="float64")
    keys = set(hybrid.state_objects())
    assert {"drop6/random#0", "drop7/random#0"} <= keys
    assert not any("tower" in k for k in keys)
    hybrid.step(2)
    param.snapshot = 0
    plain = Solver(param, dtype="float64")
    plain.restore(str(tmp_path / "placed_iter_2.solverstate"))
    assert plain.state_objects()["drop6/random#0"].count == 2
    again = build_solver(alexnet(image_db, 2), replicas=2, placement=HYBRID, dtype="float64")
    again.restore(str(tmp_path / "placed_iter_2.solverstate"))  # and a placed run resumes
    assert [again.net.builder.stateful[f"drop7/tower{k}/random#0"].count
            for k in range(2)] == [2, 2]
    hybrid.step(2)
    plain.step(2)
    assert_same_weights(hybrid.scheme.split_of(hybrid.net).params(hybrid.net), plain,
                        "unsplit resume: ")
