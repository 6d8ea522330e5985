"""Model parallelism by towers: the placement file, the rewrite that splits layers into
towers, and Caffe's AlexNet on two CPU memory spaces giving the unsplit net's numbers."""

import re
from pathlib import Path

import numpy as np
import pytest

from purine.caffe import TRAIN, Net
from purine.errors import LayerError, ProtoError, PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net, replace_data_layers
from purine.graph import Location
from purine.parallel.placement import parse_location, place, read_placement, split_towers

ROOT = Path(__file__).resolve().parents[2]
ALEXNET = ROOT / "models" / "bvlc_alexnet"
C0, C1 = Location("cpu", 0), Location("cpu", 1)


def cross_copies(net: Net) -> set[str]:
    """Copy ops between memory spaces (not the in-place layers' saved copies)."""
    return {op.name for op in net.graph.ops if op.type == "Copy"
            and op.inputs[0].location.memory != op.outputs[0].location.memory}


def close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Equal to 1e-5 relative to the larger array's scale."""
    scale = max(float(np.abs(a).max()), float(np.abs(b).max()), 1e-30)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


def assert_same_numbers(plain: Net, placed: Net, split, inputs: list[str]) -> None:
    """Every original blob, the inputs' gradients and every original parameter's gradient
    of ``placed`` (the split net, towers joined) equal ``plain``'s."""
    assert placed.loss == pytest.approx(plain.loss, rel=1e-12)
    # The original net's blobs; plain.blobs has its implicit splits' tops too.
    assert set(split.blobs) == {t for lp in split.original.layer for t in lp.top}
    for name in split.blobs:
        close(plain.blobs[name].data, split.blob(placed, name), f"blob {name}")
    for name in inputs:
        close(plain.blobs[name].diff, split.blob(placed, name, diff=True), f"diff of {name}")
    grads = split.params(placed, diff=True)
    assert set(grads) == set(plain.params)
    for layer, views in plain.params.items():
        assert len(grads[layer]) == len(views)
        for k, v in enumerate(views):
            close(v.diff, grads[layer][k], f"gradient of {layer}[{k}]")


# -- AlexNet in two towers ------------------------------------------------------------------
def alexnet() -> pb.NetParameter:
    """Caffe's AlexNet with its data layers as inputs (batch 2). The Dropout layers are
    removed: their masks are drawn per layer index, which the split net changes. fc6 and
    fc7 are narrowed to 256 outputs to keep the test fast; the towers are the conv stack."""
    p = replace_data_layers(read_net(ALEXNET / "train_val.prototxt"),
                            {"data": (2, 3, 227, 227), "label": (2,)})
    layers = [lp for lp in p.layer if lp.type != "Dropout"]
    del p.layer[:]
    p.layer.extend(layers)
    for lp in p.layer:
        if lp.name in ("fc6", "fc7"):
            lp.inner_product_param.num_output = 256
    p.force_backward = True
    return p


def test_alexnet_in_two_towers_gives_the_unsplit_numbers():
    param = alexnet()
    split = place(param, ALEXNET / "two_tower.placement")
    plain = Net(param, phase=TRAIN, dtype="float64")
    placed = Net(split.net, phase=TRAIN, dtype="float64", placement=split.placement)
    split.load(placed, {name: [v.data for v in views] for name, views in plain.params.items()})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 227, 227))
    for net in (plain, placed):
        net.forward(data=x, label=np.array([3.0, 997.0]))
        net.backward()
    assert_same_numbers(plain, placed, split, ["data"])

    # The towers: the grouped convolutions and the per-channel layers between them.
    assert set(split.towers) == {"conv2", "relu2", "conv3", "relu3", "conv4", "relu4",
                                 "conv5", "relu5", "pool5"}
    conv2 = [lp for lp in split.net.layer if lp.name.startswith("conv2/tower")]
    assert [(lp.name, lp.convolution_param.num_output, lp.convolution_param.group)
            for lp in conv2] == [("conv2/tower0", 128, 1), ("conv2/tower1", 128, 1)]
    assert placed.params["conv2/tower1"][0].shape == (128, 48, 5, 5)
    assert placed.params["conv3/tower1"][0].shape == (192, 256, 3, 3)
    assert placed.params["conv4/tower1"][0]._data.location == C1
    assert placed.params["fc6"][0]._data.location == C0
    # Copy ops exactly where Caffe's AlexNet joins its towers, forward and backward:
    # pool1 -> conv2 (each tower its half), conv2 -> norm2 (LRN across all channels),
    # pool2 -> conv3 (every channel to each tower), pool5 -> fc6.
    assert cross_copies(placed) == {
        "conv2/tower1/CopyIn#0", "conv2/tower1/CopyOut#0",
        "conv2/concat/CopyIn#1", "conv2/concat/CopyOut#1",
        "conv3/tower1/CopyIn#0", "conv3/tower1/CopyOut#0",
        "pool5/concat/CopyIn#1", "pool5/concat/CopyOut#1"}
    assert {op.location for op in placed.graph.ops} == {C0, C1}
    assert {str(op.location) for op in placed.graph.ops} == {"cpu:0/t0", "cpu:1/t0"}


def test_the_alexnet_placement_fits_every_phase_and_the_deploy_net():
    for model, phase in (("train_val", pb.TRAIN), ("train_val", pb.TEST), ("deploy", pb.TEST)):
        split = place(read_net(ALEXNET / f"{model}.prototxt"), ALEXNET / "two_tower.placement",
                      phase=phase)
        names = [lp.name for lp in split.net.layer]
        assert "conv5/tower1" in names and "pool5/concat" in names
        assert split.blobs["conv4"] == ("conv4/tower0", "conv4/tower1")


# -- the rewrite on a small net -------------------------------------------------------------
SMALL = """
force_backward: true
layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 4 dim: 7 dim: 7 } } }
layer { name: "conv1" type: "Convolution" bottom: "x" top: "c1"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 group: 2
    weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "c1" top: "c1" relu_param { negative_slope: 0.1 } }
layer { name: "pool1" type: "Pooling" bottom: "c1" top: "p1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "p1" top: "c2"
  convolution_param { num_output: 6 kernel_size: 2
    weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "tanh2" type: "TanH" bottom: "c2" top: "c2" }
layer { name: "conv3" type: "Convolution" bottom: "c2" top: "c3"
  convolution_param { num_output: 4 kernel_size: 1 group: 2 bias_term: false
    weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "c3" top: "y"
  inner_product_param { num_output: 6
    weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ipt" type: "InnerProduct" bottom: "c2" top: "z"
  inner_product_param { num_output: 4 transpose: true weight_filler { type: "gaussian" std: 0.3 } } }
"""

T0, T1 = Location("cpu", 0, 0), Location("cpu", 0, 1)
CASES = {
    # Towers on two memory spaces, some swapped, so parts travel both ways; ipt stays whole
    # at cpu:1 and joins c2's parts there.
    "two memory spaces": (
        {"conv1": [C0, C1], "relu1": [C0, C1], "pool1": [C0, C1], "conv2": [C1, C0],
         "tanh2": [C1, C0], "conv3": [C0, C1], "ip": [C0, C1], "ipt": C1},
        {"conv1/tower1/CopyIn#0", "conv1/tower1/CopyOut#0"}),
    # Two worker threads of one memory space: towers without a single Copy op.
    "two threads": (
        {"conv1": [T0, T1], "relu1": [T0, T1], "pool1": [T0, T1], "conv2": [T0, T1],
         "tanh2": [T0, T1], "conv3": [T0, T1], "ip": [T0, T1], "ipt": [T1, T0]}, set()),
    # relu1 left whole between split layers: c1 is joined, rectified in place, cut again.
    "whole layer between towers": (
        {"conv1": [C0, C1], "pool1": [C1, C0], "ipt": [C0, C1]},
        {"conv1/tower1/CopyIn#0", "conv1/tower1/CopyOut#0"}),
    # relu1 split in place on c1, which is whole at cpu:0: tower 1 at cpu:1 gets a copy of
    # its part and writes a top of its own.
    "in place away from the part": (
        {"relu1": [C0, C1], "pool1": C1},
        {"relu1/tower1/CopyIn#0", "relu1/tower1/CopyOut#0"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_nets_give_the_unsplit_numbers(case):
    placement, some_copies = CASES[case]
    split = split_towers(read_net(SMALL), placement)
    plain = Net(SMALL, phase=TRAIN, dtype="float64")
    placed = Net(split.net, phase=TRAIN, dtype="float64", placement=split.placement)
    split.load(placed, {name: [v.data for v in views] for name, views in plain.params.items()})
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 7, 7))
    dy, dz = rng.standard_normal((2, 6)), rng.standard_normal((2, 4))
    for net in (plain, placed):
        assert net.outputs == ["y", "z"]  # split outputs are joined back under their names
        net.forward(x=x)
        net.backward(y=dy, z=dz)
    assert_same_numbers(plain, placed, split, ["x"])
    copies = cross_copies(placed)
    assert some_copies <= copies and (copies == set()) == (some_copies == set())
    if case == "whole layer between towers":
        assert split.blobs["c1"] == ("c1",)
        assert [(lp.name, lp.type, list(lp.top)) for lp in split.net.layer
                if lp.name.startswith("c1/")] == [
            ("c1/concat", "Concat", ["c1"]),
            ("c1/slice", "Slice", ["c1/tower0#2", "c1/tower1#2"])]
    if case == "in place away from the part":
        assert [(lp.name, list(lp.bottom), list(lp.top)) for lp in split.net.layer
                if lp.name.startswith("relu1/")] == [
            ("relu1/tower0", ["c1/tower0"], ["c1/tower0"]),
            ("relu1/tower1", ["c1/tower1"], ["c1/tower1#2"])]
        assert split.blobs["c1"] == ("c1@pool1",)  # joined at cpu:1 for pool1


def test_split_params_cut_each_blob_along_its_axis_and_join_back():
    split = split_towers(read_net(SMALL), {"conv1": [C0, C1], "ipt": [C0, C1]})
    w, b = np.arange(4 * 2 * 9.0).reshape(4, 2, 3, 3), np.arange(4.0)
    wt = np.arange(24 * 4.0).reshape(24, 4)  # transposed (K, N): cut along N
    parts = split.split_params({"conv1": [w, b], "ipt": [wt, b], "conv2": [np.ones(3)]})
    assert set(parts) == {"conv1/tower0", "conv1/tower1", "ipt/tower0", "ipt/tower1", "conv2"}
    for k in range(2):
        np.testing.assert_array_equal(parts[f"conv1/tower{k}"][0], w[2 * k:2 * (k + 1)])
        np.testing.assert_array_equal(parts[f"conv1/tower{k}"][1], b[2 * k:2 * (k + 1)])
        np.testing.assert_array_equal(parts[f"ipt/tower{k}"][0], wt[:, 2 * k:2 * (k + 1)])
        np.testing.assert_array_equal(parts[f"ipt/tower{k}"][1], b[2 * k:2 * (k + 1)])
    joined = split.join_params(parts)
    np.testing.assert_array_equal(joined["conv1"][0], w)
    np.testing.assert_array_equal(joined["ipt"][0], wt)
    np.testing.assert_array_equal(joined["ipt"][1], b)
    assert set(joined) == {"conv1", "ipt", "conv2"}


def test_a_split_net_saves_and_loads_caffemodels_of_the_original(tmp_path):
    split = split_towers(read_net(SMALL), {"conv1": [C0, C1], "conv3": [C1, C0]})
    placed = Net(split.net, phase=TRAIN, dtype="float64", placement=split.placement, seed=3)
    split.save(placed, tmp_path / "w.caffemodel")
    plain = Net(SMALL, phase=TRAIN, weights=str(tmp_path / "w.caffemodel"))
    again = Net(split.net, phase=TRAIN, dtype="float64", placement=split.placement, seed=4)
    split.load(again, tmp_path / "w.caffemodel")
    for layer, views in plain.params.items():
        for k, v in enumerate(views):
            mine = split.params(placed)[layer][k]
            np.testing.assert_allclose(v.data, mine, rtol=1e-6)  # a caffemodel holds floats
            np.testing.assert_allclose(split.params(again)[layer][k], v.data)


@pytest.mark.parametrize("layer, placement, message", [
    ("layer { name: \"n\" type: \"LRN\" bottom: \"c1\" top: \"n\" }", {"n": [C0, C1]},
     "LRN across channels mixes"),
    ("layer { name: \"n\" type: \"Convolution\" bottom: \"c1\" top: \"n\" "
     "convolution_param { num_output: 6 kernel_size: 1 group: 3 } }", {"n": [C0, C1]},
     "group 3 is neither a multiple of 2"),
    ("layer { name: \"n\" type: \"InnerProduct\" bottom: \"c1\" top: \"n\" "
     "inner_product_param { num_output: 5 } }", {"n": [C0, C1]},
     "num_output 5 is not a multiple of 2"),
    ("layer { name: \"n\" type: \"Softmax\" bottom: \"c1\" top: \"n\" }", {"n": [C0, C1]},
     "towers can split Convolution, InnerProduct"),
    ("layer { name: \"n\" type: \"Convolution\" bottom: \"c1\" top: \"n\" param { name: \"w\" } "
     "convolution_param { num_output: 2 kernel_size: 1 } }", {"n": [C0, C1]},
     "shares parameters by name"),
])
def test_layers_that_cannot_be_split_are_errors(layer, placement, message):
    net = SMALL.split('layer { name: "pool1"')[0] + layer
    with pytest.raises(LayerError, match=re.escape(message)):
        split_towers(read_net(net), placement)


# -- the placement file ---------------------------------------------------------------------
def test_placement_files_in_line_and_block_form(tmp_path):
    f = tmp_path / "p.placement"
    f.write_text('# towers\nlayer: "conv1" location: "cpu:1"   # a comment\n'
                 'layer {\n  name: "conv2"\n  location: "cpu:0/t1"\n  location: "rank2/gpu:3/t4"\n}\n'
                 'layer: "ip" location: "cpu:0" location: "cpu:1"\n')
    assert read_placement(f, read_net(SMALL)) == {
        "conv1": (C1,), "conv2": (Location("cpu", 0, 1), Location("gpu", 3, 4, 2)),
        "ip": (C0, C1)}


@pytest.mark.parametrize("loc", [Location(), Location("cpu", 1), Location("gpu", 2, 3),
                                 Location("cpu", 0, 0, 1), Location("gpu", 1, 7, 12)])
def test_locations_read_as_they_print(loc):
    assert parse_location(str(loc)) == loc


@pytest.mark.parametrize("text, message", [
    ('layer: "conv1" location: "cpu:1"\nlayer: "conv9" location: "cpu:0"\n',
     ":2: net 'small' has no layer 'conv9' (did you mean 'conv3', 'conv2', 'conv1'?)"),
    ('\n\nlayer: "conv1" location: "cpu1"\n', ":3: bad location 'cpu1'"),
    ('layer: "conv1" location: "tpu:0"\n', ":1: bad location 'tpu:0'"),
    ('layer: "conv1" location: "cpu:0/t"\n', ":1: bad location 'cpu:0/t'"),
    ('layer: "conv1"\nlayer: "conv2" location: "cpu:0"\n', ":1: layer 'conv1' has no location"),
    ('layer: "conv1" location: "cpu:0"\n\nlayer { name: "conv1" location: "cpu:1" }\n',
     ":3: layer 'conv1' is placed twice (first on line 1)"),
    ('layer {\n  name: "conv1"\n  where: "cpu:1"\n}\n', ":3: unknown field 'where'"),
    ('layer { location: "cpu:1" }\n', ":1: a layer block needs a name"),
    ('layer { name: "conv1" location: "cpu:1"\n', ":1: expected '}', found the end"),
    ('layer: "conv1" location: "cpu:1\n', ":1: unterminated string"),
    ('layer: "conv1" location = "cpu:1"\n', ":1: unexpected '='"),
    ('layer: conv1 location: "cpu:1"\n', ':1: expected a quoted string, found \'conv1\''),
    ('place: "conv1"\n', ":1: expected 'layer', found 'place'"),
    ('layer: "conv1" location "cpu:1"\n', ":1: expected ':', found \"cpu:1\""),
])
def test_bad_placement_files_name_the_file_and_line(tmp_path, text, message):
    f = tmp_path / "bad.placement"
    f.write_text(text)
    net = read_net(SMALL)
    net.name = "small"
    with pytest.raises(ProtoError, match=re.escape(f"{f}{message}")):
        read_placement(f, net)


def test_a_missing_placement_file_is_an_error(tmp_path):
    with pytest.raises(ProtoError, match="cannot read"):
        read_placement(tmp_path / "none.placement", read_net(SMALL))
    with pytest.raises(PurineError, match="no location"):
        split_towers(read_net(SMALL), {"conv1": []})
