"""Caffe's net set-up log (Net::Init's INFO lines): LeNet's train net line for line against
what Caffe writes for it, written out here by hand; a net with a split, an in-place ReLU and
a weighted loss; the backward verdicts; the rule lines; the net text; who logs and when."""

import logging

import numpy as np
import pytest
from google.protobuf import text_format

from purine.caffe import TEST, TRAIN, Net
from purine.caffe.setup_log import debug_string
from purine.caffe.solver import Solver
from purine.cli import main
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net
from purine.log import get_logger
from tests.data.helpers import raw_datum, write_lmdb


@pytest.fixture(autouse=True)
def info_level():
    log = get_logger()
    level = log.level
    log.setLevel(logging.INFO)  # as a run has it
    yield
    log.setLevel(level)


@pytest.fixture
def lenet(tmp_path):
    """models/lenet's net with both Data layers reading a small stand-in LMDB."""
    src = write_lmdb(tmp_path / "mnist_lmdb",
                     [raw_datum(np.full((1, 28, 28), i, np.uint8), i) for i in range(10)])
    model = read_net("models/lenet/lenet_train_test.prototxt")
    for layer in model.layer:
        if layer.type == "Data":
            layer.data_param.source = src
    return model, src


def layer(name, type_, bottoms=(), tops=()):
    return [f"Creating layer {name}", f"Creating Layer {name}"] + [
        f"{name} <- {b}" for b in bottoms] + [f"{name} -> {t}" for t in tops] + [
        f"Setting up {name}"]


# Caffe at batch 64, float: each top adds count x 4 bytes to the running total.
#   mnist  data 64*1*28*28 = 50176, label 64      (50176 + 64) * 4 =  200960
#   conv1  64*20*24*24 = 737280                   + 2949120        = 3150080
#   pool1  64*20*12*12 = 184320                   +  737280        = 3887360
#   conv2  64*50*8*8   = 204800                   +  819200        = 4706560
#   pool2  64*50*4*4   = 51200                    +  204800        = 4911360
#   ip1    64*500      = 32000                    +  128000        = 5039360
#   relu1  in place: ip1 again, 32000             +  128000        = 5167360
#   ip2    64*10       = 640                      +    2560        = 5169920
#   loss   a scalar, count 1                      +       4        = 5169924
def lenet_train_lines(src):
    return [
        "The NetState phase (0) differed from the phase (1) specified by a rule in layer mnist",
        "The NetState phase (0) differed from the phase (1) specified by a rule in layer "
        "accuracy",
        "HEADER",
        "Creating layer mnist", "Creating Layer mnist", "mnist -> data", "mnist -> label",
        f"Opened lmdb {src}", "output data size: 64,1,28,28",  # the Data layer's own lines
        "Setting up mnist", "Top shape: 64 1 28 28 (50176)", "Top shape: 64 (64)",
        "Memory required for data: 200960",
        *layer("conv1", "Convolution", ["data"], ["conv1"]),
        "Top shape: 64 20 24 24 (737280)", "Memory required for data: 3150080",
        *layer("pool1", "Pooling", ["conv1"], ["pool1"]),
        "Top shape: 64 20 12 12 (184320)", "Memory required for data: 3887360",
        *layer("conv2", "Convolution", ["pool1"], ["conv2"]),
        "Top shape: 64 50 8 8 (204800)", "Memory required for data: 4706560",
        *layer("pool2", "Pooling", ["conv2"], ["pool2"]),
        "Top shape: 64 50 4 4 (51200)", "Memory required for data: 4911360",
        *layer("ip1", "InnerProduct", ["pool2"], ["ip1"]),
        "Top shape: 64 500 (32000)", "Memory required for data: 5039360",
        "Creating layer relu1", "Creating Layer relu1", "relu1 <- ip1",
        "relu1 -> ip1 (in-place)", "Setting up relu1",
        "Top shape: 64 500 (32000)", "Memory required for data: 5167360",
        *layer("ip2", "InnerProduct", ["ip1"], ["ip2"]),
        "Top shape: 64 10 (640)", "Memory required for data: 5169920",
        *layer("loss", "SoftmaxWithLoss", ["ip2", "label"], ["loss"]),
        "Top shape: (1)", "    with loss weight 1", "Memory required for data: 5169924",
        "loss needs backward computation.", "ip2 needs backward computation.",
        "relu1 needs backward computation.", "ip1 needs backward computation.",
        "pool2 needs backward computation.", "conv2 needs backward computation.",
        "pool1 needs backward computation.", "conv1 needs backward computation.",
        "mnist does not need backward computation.",
        "This network produces output loss",
        "Network initialization done.",
    ]


def test_lenet_train_net_logs_caffes_lines(lenet, log_lines):
    model, src = lenet
    with Net(model, phase=TRAIN):
        pass
    want = lenet_train_lines(src)
    head = log_lines[2]
    assert log_lines[:2] + ["HEADER"] + log_lines[3:] == want
    # The net text: the TRAIN layers as written (C++ digits: 1, not 1.0), the state it is for.
    first, text = head.split("\n", 1)
    assert first == "Initializing net from parameters: "
    assert text.startswith('name: "LeNet"\nstate {\n  phase: TRAIN\n}\nlayer {\n  name: "mnist"\n'
                           '  type: "Data"\n  top: "data"\n  top: "label"\n  include {\n'
                           "    phase: TRAIN\n  }\n  transform_param {\n"
                           "    scale: 0.00390625\n  }\n")
    assert "    lr_mult: 2\n" in text and "lr_mult: 2.0" not in text
    assert not text.endswith("\n")  # the handler ends the line, as glog does
    parsed = text_format.Parse(text, pb.NetParameter())
    assert [x.name for x in parsed.layer] == ["mnist", "conv1", "pool1", "conv2", "pool2",
                                              "ip1", "relu1", "ip2", "loss"]
    assert parsed.layer[0].data_param.source == src and parsed.state.phase == TRAIN


def test_lenet_test_net_has_caffes_splits_and_memory(lenet, log_lines):
    model, src = lenet
    with Net(model, phase=TEST):
        pass
    # Batch 100; ip2 and label feed both accuracy and loss, so Caffe splits them.
    assert layer("label_mnist_1_split", "Split", ["label"],
                 ["label_mnist_1_split_0", "label_mnist_1_split_1"]) + [
        "Top shape: 100 (100)", "Top shape: 100 (100)",
        "Memory required for data: 314800"] == log_lines[12:21]  # (78400 + 100 * 3) * 4
    assert "ip2_ip2_0_split <- ip2" in log_lines
    # every top counted, splits and in-place tops too: Caffe's figure for this net
    assert [x for x in log_lines if x.startswith("Memory")][-1] == (
        "Memory required for data: 8086808")
    assert log_lines[-15:] == [
        "loss needs backward computation.", "accuracy does not need backward computation.",
        "ip2_ip2_0_split needs backward computation.", "ip2 needs backward computation.",
        "relu1 needs backward computation.", "ip1 needs backward computation.",
        "pool2 needs backward computation.", "conv2 needs backward computation.",
        "pool1 needs backward computation.", "conv1 needs backward computation.",
        "label_mnist_1_split does not need backward computation.",
        "mnist does not need backward computation.",
        "This network produces output accuracy", "This network produces output loss",
        "Network initialization done."]


# h, made by fc and rewritten in place by relu, feeds the loss and a sigmoid: Caffe puts a
# Split after relu (the blob's last writer). The sigmoid's output reaches no loss.
SPLIT_NET = """name: "split"
layer { name: "in" type: "Input" top: "x" top: "y"
        input_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 4 } } }
layer { name: "fc" type: "InnerProduct" bottom: "x" top: "h"
        inner_product_param { num_output: 4 } }
layer { name: "relu" type: "ReLU" bottom: "h" top: "h" }
layer { name: "l2" type: "EuclideanLoss" bottom: "h" bottom: "y" top: "l2" loss_weight: 0.5 }
layer { name: "sig" type: "Sigmoid" bottom: "h" top: "s" }
"""


def test_split_in_place_and_weighted_loss(log_lines):
    with Net(SPLIT_NET, TRAIN):
        pass
    # float32 tops: x 6 + y 8 -> 56; h 8 -> 88; h again (in place) -> 120;
    # two split tops of 8 -> 184; the loss (1) -> 188; s 8 -> 220
    assert log_lines[1:] == [
        *layer("in", "Input", [], ["x", "y"]), "Top shape: 2 3 (6)", "Top shape: 2 4 (8)",
        "Memory required for data: 56",
        *layer("fc", "InnerProduct", ["x"], ["h"]), "Top shape: 2 4 (8)",
        "Memory required for data: 88",
        "Creating layer relu", "Creating Layer relu", "relu <- h", "relu -> h (in-place)",
        "Setting up relu", "Top shape: 2 4 (8)", "Memory required for data: 120",
        *layer("h_relu_0_split", "Split", ["h"], ["h_relu_0_split_0", "h_relu_0_split_1"]),
        "Top shape: 2 4 (8)", "Top shape: 2 4 (8)", "Memory required for data: 184",
        *layer("l2", "EuclideanLoss", ["h_relu_0_split_0", "y"], ["l2"]),
        "Top shape: (1)", "    with loss weight 0.5", "Memory required for data: 188",
        *layer("sig", "Sigmoid", ["h_relu_0_split_1"], ["s"]), "Top shape: 2 4 (8)",
        "Memory required for data: 220",
        "sig does not need backward computation.",
        "l2 needs backward computation.",
        "h_relu_0_split needs backward computation.",
        "relu needs backward computation.",
        "fc needs backward computation.",
        "in does not need backward computation.",
        "This network produces output l2",  # name order, as Caffe's std::set
        "This network produces output s",
        "Network initialization done.",
    ]


def test_backward_verdicts_are_caffes_before_force_backward(log_lines):
    # lr_mult 0 everywhere: nothing learns, so nothing needs a gradient; force_backward
    # then turns the gradients on, after Caffe has printed its verdicts.
    frozen = SPLIT_NET.replace("num_output: 4 }", "num_output: 4 } param { lr_mult: 0 } "
                               "param { lr_mult: 0 }")
    for force in ("", "force_backward: true\n"):
        log_lines.clear()
        with Net(force + frozen, TRAIN):
            pass
        verdicts = [x for x in log_lines if "backward computation" in x]
        assert verdicts == [f"{n} does not need backward computation."
                            for n in ("sig", "l2", "h_relu_0_split", "relu", "fc", "in")]


def test_shared_parameters_and_rule_lines(log_lines):
    net = """name: "rules"
    layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 } } }
    layer { name: "a" type: "InnerProduct" bottom: "x" top: "a"
            param { name: "w" } inner_product_param { num_output: 2 bias_term: false } }
    layer { name: "b" type: "InnerProduct" bottom: "a" top: "b" exclude { stage: "deploy" }
            param { name: "w" } inner_product_param { num_output: 2 bias_term: false } }
    layer { name: "c" type: "ReLU" bottom: "b" top: "c" include { min_level: 2 } }
    layer { name: "d" type: "ReLU" bottom: "b" top: "d" include { max_level: -1 }
            include { not_stage: "s1" } }
    layer { name: "e" type: "ReLU" bottom: "b" top: "e" include { phase: TEST stage: "s2" } }
    """
    with Net(net, TEST, stages=["s1"]):
        pass
    assert log_lines[:5] == [
        "The NetState did not contain stage 'deploy' specified by a rule in layer b",
        "The NetState level (0) is above the min_level (2) specified by a rule in layer c",
        "The NetState level (0) is above the max_level (-1) specified by a rule in layer d",
        "The NetState contained a not_stage 's1' specified by a rule in layer d",
        "The NetState did not contain stage 's2' specified by a rule in layer e",
    ]
    assert log_lines[5].startswith('Initializing net from parameters: \nname: "rules"\n'
                                   'state {\n  phase: TEST\n  stage: "s1"\n}\n')
    i = log_lines.index("Memory required for data: 24")  # x 2, a 2, b 2 floats
    assert log_lines[i + 1] == "Sharing parameters 'w' owned by layer 'a', param index 0"
    assert log_lines[-2:] == ["This network produces output b", "Network initialization done."]


def test_only_the_first_build_logs(log_lines):
    net = Net(SPLIT_NET, TRAIN)
    assert log_lines.count("Network initialization done.") == 1
    log_lines.clear()
    net.blobs["x"].reshape(5, 3)
    net.blobs["y"].reshape(5, 4)
    net.forward()  # a second build, for the new shapes: Caffe's Reshape logs nothing
    assert net.blobs["s"].data.shape == (5, 4)
    assert log_lines == []


def test_a_layers_own_lines_go_among_its_set_up_lines_and_quiet_keeps_warnings(lenet,
                                                                              log_lines):
    model, _ = lenet
    model.layer[0].data_param.scale = 0.5  # a field Caffe ignores there: the layer warns
    warning = ("layer 'mnist': scale in DataParameter are ignored, as Caffe ignores them; "
               "put them in transform_param")
    with Net(model, phase=TRAIN):
        pass
    i = log_lines.index(warning)
    assert log_lines.index("mnist -> label") < i < log_lines.index("Setting up mnist")
    log_lines.clear()
    get_logger().setLevel(logging.WARNING)  # caffe.init_log(1), or an MPI rank but the first
    with Net(model, phase=TRAIN):
        pass
    assert log_lines == [warning]


def test_a_failing_layer_ends_the_lines(log_lines):
    bad = SPLIT_NET.replace('top: "s" }', 'top: "s" }\nlayer { name: "p" type: "Pooling" '
                            'bottom: "s" top: "p" pooling_param { kernel_size: 9 } }')
    with pytest.raises(PurineError, match="layer 'p'"):
        Net(bad, TRAIN)
    assert log_lines[-5:] == ["Memory required for data: 220", "Creating layer p",
                              "Creating Layer p", "p <- s", "p -> p"]


def test_solver_logs_its_train_and_test_nets(tmp_path, log_lines):
    (tmp_path / "net.prototxt").write_text(SPLIT_NET.replace(
        'name: "sig"', 'name: "sig" include { phase: TEST }'))
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "{tmp_path}/net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\n'
                    "max_iter: 1\ntest_iter: 1\ntest_interval: 10\nsolver_mode: CPU\n")
    Solver(str(path)).close()
    heads = [x.split("\n")[2:4] for x in log_lines if x.startswith("Initializing net")]
    assert heads == [["state {", "  phase: TRAIN"], ["state {", "  phase: TEST"]]
    # The solver's own lines, as Caffe's Solver::Init, InitTrainNet and InitTestNets say them.
    # (the solver's fields in number order, as C++'s DebugString: test_iter is 3, net 24)
    text = log_lines[0].split("\n")
    assert text[:3] == ["Initializing solver from parameters: ", "test_iter: 1",
                        "test_interval: 10"]
    assert text[-1] == f'net: "{tmp_path}/net.prototxt"'
    assert log_lines[1] == f"Creating training net from net file: {tmp_path}/net.prototxt"
    assert log_lines[2] == ("The NetState phase (0) differed from the phase (1) specified by "
                            "a rule in layer sig")
    done = [i for i, x in enumerate(log_lines) if x == "Network initialization done."]
    assert len(done) == 2
    assert log_lines[done[0] + 1] == (f"Creating test net (#0) specified by net file: "
                                      f"{tmp_path}/net.prototxt")
    assert log_lines[done[1] + 1:] == ["Solver scaffolding done."]


def test_cli_writes_the_lines_with_glog_prefixes(tmp_path, capsys):
    (tmp_path / "net.prototxt").write_text(SPLIT_NET)
    assert main(["test", "--model", str(tmp_path / "net.prototxt"), "--iterations", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    done = [x for x in err if x.endswith("] Network initialization done.")]
    assert len(done) == 1 and done[0][0] == "I"
    assert any(x.endswith("] Top shape: 2 3 (6)") for x in err)
    assert "state {" in err  # the net text's lines, unprefixed as glog leaves them


def test_pycaffe_net_logs_as_caffes(tmp_path, log_lines):
    from purine.pycaffe.net import Net as PyNet

    (tmp_path / "net.prototxt").write_text(SPLIT_NET)
    PyNet(str(tmp_path / "net.prototxt"), TEST).close()
    assert log_lines[0].split("\n")[2:4] == ["state {", "  phase: TEST"]
    assert log_lines[-3:] == ["This network produces output l2",
                              "This network produces output s", "Network initialization done."]


def test_debug_string_is_cpp_protobufs_text():
    # Without float fields C++'s DebugString and Python's text format agree.
    net = read_net(SPLIT_NET)
    net.layer[0].name = 'in "quoted"\t'
    net.force_backward = True
    assert debug_string(net) == text_format.MessageToString(net)
    # C++'s DebugString (unlike Utf8DebugString) writes non-ASCII bytes as octal escapes
    assert debug_string(pb.LayerParameter(name="caf\u00e9")) == 'name: "caf\\303\\251"\n'
    # Floats take C++'s shortest %g form: 6 digits unless the value needs 9 to read back.
    f = pb.FillerParameter(std=1.0, mean=0.1, min=1e-5, max=100000.0, value=1e6)
    f.sparse = 3
    assert debug_string(f) == ('value: 1e+06\nmin: 1e-05\nmax: 100000\nmean: 0.1\n'
                               'std: 1\nsparse: 3\n')
    assert debug_string(pb.FillerParameter(std=0.123456789)) == "std: 0.123456791\n"
