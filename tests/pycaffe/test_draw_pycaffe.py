"""caffe.draw: Caffe's node labels, edge labels and colours written out by hand, the nodes and
edges of a small net's pydot graph (in-place layers, phases, V1 nets), rendering by Graphviz
(a PNG signature) and the one-line errors without Graphviz or without pydot."""

import importlib.util
import shutil
import subprocess
import sys

import pytest
from google.protobuf import text_format

from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.pycaffe import draw
from purine.pycaffe.draw import (
    GraphvizMissingError,
    NetDrawError,
    PydotMissingError,
    choose_color_by_layertype,
    draw_net,
    draw_net_to_file,
    get_edge_label,
    get_layer_label,
    get_layer_lr_mult,
    get_pooling_types_dict,
    get_pydot_graph,
)

needs_pydot = pytest.mark.skipif(importlib.util.find_spec("pydot") is None,
                                 reason="pydot is not installed")
needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="Graphviz's dot is not installed")
PNG = b"\x89PNG\r\n\x1a\n"

TINY = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
        include { phase: TRAIN } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" exclude { phase: TRAIN } }
"""
CONV = r'"conv\n(Convolution)\nkernel size: 3\nstride: 2\npad: 1"'
POOL = r'"pool\n(Pooling AVE)\nkernel size: 2\nstride: 2\npad: 0"'
IP = r'"ip\n(InnerProduct)"'
RELU = r'"relu\n(ReLU)"'
DATA = r'"data\n(Input)"'
LOSS = r'"loss\n(SoftmaxWithLoss)"'
PROB = r'"prob\n(Softmax)"'


def net(text=TINY):
    return text_format.Parse(text, pb.NetParameter())


def layer(text):
    return text_format.Parse(text, pb.LayerParameter())


def edges(graph):
    return [(e.get_source(), e.get_destination(), e.get_label()) for e in graph.get_edges()]


def nodes(graph):
    return {n.get_name(): n.get_attributes() for n in graph.get_nodes()}


# -- labels, colours -----------------------------------------------------------------------
def test_layer_labels():
    conv = net().layer[1]
    assert get_layer_label(conv, "LR") == CONV
    assert get_layer_label(conv, "TB") == '"conv (Convolution) kernel size: 3 stride: 2 pad: 1"'
    assert get_layer_label(conv, "BT", display_lrm=True) == \
        '"conv (Convolution) kernel size: 3 stride: 2 pad: 1 lr mult: 1.0, 2.0"'
    assert get_layer_label(net().layer[3], "LR") == POOL
    assert get_layer_label(net().layer[2], "RL", display_lrm=True) == RELU
    assert get_layer_label(net().layer[4], "LR", display_lrm=True) == \
        r'"ip\n(InnerProduct)\nlr mult: 1.0, 1.0"'
    frozen = layer('name: "f" type: "InnerProduct" param { lr_mult: 0 } param { lr_mult: 0 }')
    assert get_layer_label(frozen, "LR", display_lrm=True) == r'"f\n(InnerProduct)"'
    deconv = layer('name: "up" type: "Deconvolution" '
                   'convolution_param { num_output: 21 kernel_size: 64 stride: 32 }')
    assert get_layer_label(deconv, "TB") == '"up (Deconvolution) kernel size: 64 stride: 32 pad: 0"'
    # No kernel_size: Caffe's label says 1 (its default reading of the empty list).
    assert get_layer_label(layer('name: "c" type: "Convolution"'), "TB") == \
        '"c (Convolution) kernel size: 1 stride: 1 pad: 0"'


def test_labels_of_per_axis_legacy_and_global_windows():
    rect = layer('name: "r" type: "Convolution" convolution_param { kernel_h: 3 kernel_w: 5 '
                 'stride_h: 1 stride_w: 2 pad_h: 0 pad_w: 2 }')
    assert get_layer_label(rect, "TB") == '"r (Convolution) kernel size: 3x5 stride: 1x2 pad: 0x2"'
    cube = layer('name: "k" type: "Convolution" convolution_param { kernel_size: 3 '
                 'kernel_size: 3 kernel_size: 3 pad: 1 }')
    assert get_layer_label(cube, "TB") == '"k (Convolution) kernel size: 3 stride: 1 pad: 1"'
    pool = layer('name: "p" type: "Pooling" pooling_param { pool: MAX kernel_h: 2 kernel_w: 4 '
                 'stride_h: 2 stride_w: 4 }')
    assert get_layer_label(pool, "TB") == '"p (Pooling MAX) kernel size: 2x4 stride: 2x4 pad: 0"'
    gap = layer('name: "g" type: "Pooling" pooling_param { pool: AVE global_pooling: true }')
    assert get_layer_label(gap, "TB") == '"g (Pooling AVE) kernel size: global stride: 1 pad: 0"'


def test_names_with_quotes_stay_one_dot_string():
    odd = layer(r'name: "say \"hi\"" type: "ReLU"')
    assert get_layer_label(odd, "TB") == r'"say \"hi\" (ReLU)"'


def test_edge_labels_lr_mults_colours_pooling_names():
    assert get_edge_label(layer('type: "Data" data_param { batch_size: 64 }')) == "Batch 64"
    assert get_edge_label(net().layer[1]) == "4"
    assert get_edge_label(net().layer[4]) == "10"
    assert get_edge_label(layer('type: "Deconvolution" convolution_param { num_output: 21 }')) \
        == "21"
    assert get_edge_label(net().layer[2]) == '""'
    assert get_layer_lr_mult(net().layer[1]) == (1.0, 2.0)
    assert get_layer_lr_mult(layer('type: "Convolution" param { lr_mult: 10 }')) == (10.0, 1.0)
    assert get_layer_lr_mult(layer('type: "InnerProduct"')) == (1.0, 1.0)
    with pytest.raises(NetDrawError, match="ReLU layers have no learning rate"):
        get_layer_lr_mult(net().layer[2])
    with pytest.raises(ValueError, match="3 param entries"):
        get_layer_lr_mult(layer('name: "x" type: "Convolution" param {} param {} param {}'))
    assert [choose_color_by_layertype(t) for t in
            ("Convolution", "Deconvolution", "Pooling", "InnerProduct", "ReLU")] == \
        ["#FF5050", "#FF5050", "#FF9900", "#CC33FF", "#6495ED"]
    assert get_pooling_types_dict() == {0: "MAX", 1: "AVE", 2: "STOCHASTIC"}


# -- the graph -----------------------------------------------------------------------------
@needs_pydot
def test_graph_of_a_small_net():
    g = get_pydot_graph(net(), "LR")
    assert g.get_name() == "tiny" and g.get_rankdir() == "LR"
    assert edges(g) == [
        (DATA, '"data"', '""'),
        ('"data"', CONV, '""'), (CONV, '"conv"', "4"),
        ('"conv"', RELU, '""'), (RELU, '"conv"', '""'),
        ('"conv"', POOL, '""'), (POOL, '"pool"', '""'),
        ('"pool"', IP, '""'), (IP, '"ip"', "10"),
        ('"ip"', LOSS, '""'), ('"label"', LOSS, '""'), (LOSS, '"loss"', '""'),
        ('"ip"', PROB, '""'), (PROB, '"prob"', '""'),
    ]
    got = nodes(g)
    assert list(got) == [DATA, '"data"', CONV, '"conv"', RELU, POOL, '"pool"', IP, '"ip"',
                         LOSS, '"label"', '"loss"', PROB, '"prob"']
    assert got[CONV] == {"shape": "record", "fillcolor": "#FF5050", "style": "filled"}
    assert got[POOL]["fillcolor"] == "#FF9900" and got[IP]["fillcolor"] == "#CC33FF"
    assert got[DATA]["fillcolor"] == "#6495ED"
    assert got[RELU] == {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}  # in place
    # A blob a layer reads is a grey octagon; one nothing reads is a plain node.
    assert got['"pool"'] == {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}
    assert got['"prob"'] == {} and got['"loss"'] == {}
    plain = get_pydot_graph(net(), "TB", label_edges=False)
    assert {label for *_, label in edges(plain)} == {'""'}
    assert '"data (Input)"' in nodes(plain)


@needs_pydot
def test_phase_filtering():
    train = [n for n in nodes(get_pydot_graph(net(), "LR", phase=pb.TRAIN)) if "(" in n]
    test = [n for n in nodes(get_pydot_graph(net(), "LR", phase=pb.TEST)) if "(" in n]
    assert train == [DATA, CONV, RELU, POOL, IP, LOSS]
    assert test == [DATA, CONV, RELU, POOL, IP, PROB]
    # A rule without a phase (stages only) holds in both phases.
    staged = net('layer { name: "a" type: "ReLU" bottom: "x" top: "y" include { stage: "s" } }')
    assert len(get_pydot_graph(staged, "LR", phase=pb.TEST).get_nodes()) == 3
    both = net('layer { name: "bad" type: "ReLU" include { phase: TRAIN } '
               'exclude { phase: TEST } }')
    with pytest.raises(NetDrawError, match="layer 'bad' has both include and exclude"):
        get_pydot_graph(both, "LR", phase=pb.TRAIN)
    assert len(get_pydot_graph(both, "LR").get_nodes()) == 1  # no phase: not checked


@needs_pydot
def test_v1_nets_and_odd_names():
    v1 = net('name: "old" layers { name: "c" type: CONVOLUTION bottom: "x" top: "y" '
             'convolution_param { num_output: 2 kernel_size: 1 } }')
    g = get_pydot_graph(v1, "LR")
    assert edges(g) == [('"x"', r'"c\n(Convolution)\nkernel size: 1\nstride: 1\npad: 0"', '""'),
                        (r'"c\n(Convolution)\nkernel size: 1\nstride: 1\npad: 0"', '"y"', "2")]
    # pydot would read an unquoted "a:b" as node a, port b
    colon = net('layer { name: "s" type: "Split" bottom: "in:0" top: "out:1" }')
    assert list(nodes(get_pydot_graph(colon, "LR"))) == [r'"s\n(Split)"', '"in:0"', '"out:1"']
    unnamed = get_pydot_graph(net('layer { name: "r" type: "ReLU" bottom: "x" top: "y" }'), "LR")
    assert unnamed.get_name() == "Net"
    with pytest.raises(NetDrawError, match="rankdir 'UP'"):
        get_pydot_graph(net(), "UP")
    with pytest.raises(NetDrawError, match="expected a caffe_pb2.NetParameter, got str"):
        draw_net("lenet.prototxt", "LR")


# -- rendering -----------------------------------------------------------------------------
@needs_pydot
def test_raw_is_the_dot_text_without_graphviz(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    text = draw_net(net(), "LR", ext="raw").decode()
    assert text == get_pydot_graph(net(), "LR").to_string()
    assert text.startswith("digraph tiny {") and "rankdir=LR;" in text
    assert f'"conv" -> {POOL} [label=""];' in text
    assert f'{IP} -> "ip" [label=10];' in text


@needs_pydot
@needs_dot
def test_png_and_svg(tmp_path):
    assert draw_net(net(), "LR").startswith(PNG)
    draw_net_to_file(net(), tmp_path / "net.png", "TB", pb.TEST, True)
    assert (tmp_path / "net.png").read_bytes().startswith(PNG)
    draw_net_to_file(net(), str(tmp_path / "net.svg"))
    svg = (tmp_path / "net.svg").read_text()
    assert "<svg" in svg and "kernel size: 3" in svg and "SoftmaxWithLoss" in svg
    draw_net_to_file(net(), tmp_path / "net.raw")
    assert (tmp_path / "net.raw").read_text().startswith("digraph tiny {")
    with pytest.raises(PurineError, match=r"dot -Tnosuchformat failed \(exit 1\)"):
        draw_net(net(), "LR", ext="nosuchformat")


@needs_pydot
def test_without_graphviz_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(GraphvizMissingError, match="install Graphviz") as e:
        draw_net_to_file(net(), tmp_path / "net.png")
    assert isinstance(e.value, PurineError) and "\n" not in str(e.value)
    assert "needs Graphviz's 'dot' program" in str(e.value)
    assert not (tmp_path / "net.png").exists()
    with pytest.raises(NetDrawError, match="needs an extension"):
        draw_net_to_file(net(), tmp_path / "net")


def test_without_pydot_import_works_and_drawing_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pydot", None)  # import pydot now raises ImportError
    with pytest.raises(PydotMissingError, match="pip install pydot") as e:
        draw_net(net(), "LR")
    assert isinstance(e.value, PurineError) and isinstance(e.value, ImportError)
    # The module itself imports without pydot, and does not import it on its own.
    code = ("import sys; sys.modules['pydot'] = None; import purine.pycaffe.draw as d; "
            "print(d.get_edge_label.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0 and done.stdout.strip() == "get_edge_label", done.stderr
    code = "import sys, purine.pycaffe.draw; print('pydot' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.stdout.strip() == "False", done.stderr


def test_module_names():
    assert draw.LAYER_STYLE_DEFAULT["fillcolor"] == "#6495ED"
    assert draw.BLOB_STYLE == {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}
