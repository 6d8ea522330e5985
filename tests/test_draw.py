"""purine.draw: the bi-graph of LeNet's train net as dot text (every op and blob, forward /
backward / solver ops told apart, edges as the graph has them), Caffe's layer view, and
rendering through Graphviz's ``dot`` (a stand-in program, and the real one where installed)."""

import os
import re
import shutil
import stat

import pytest

from purine.caffe import TRAIN
from purine.draw import DrawError, build_net, build_solver, draw, layers_dot, main, net_dot, quote
from purine.formats.prototxt import read_net, replace_data_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENET = os.path.join(ROOT, "models", "lenet", "lenet_train_test.prototxt")
STAND_IN = {"data": (2, 1, 28, 28), "label": (2,)}


def node_class(text, node_id):
    """The ``class`` attribute of the node statement for ``node_id`` (None if absent)."""
    m = re.search(r"^\s*" + re.escape(quote(node_id)) + r" \[.*class=\"(\w+)\"", text, re.M)
    return m.group(1) if m else None


def edges(text):
    return set(re.findall(r'^\s*"([^"]+)" -> "([^"]+)"', text, re.M))


@pytest.fixture
def lenet_files(tmp_path):
    """LeNet's train/test prototxt with Input stand-ins for its LMDBs, and a solver for it."""
    net = replace_data_layers(read_net(LENET), STAND_IN)
    (tmp_path / "lenet.prototxt").write_text(str(net))
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "lenet.prototxt"}"\nbase_lr: 0.01\nmomentum: 0.9\n'
        'weight_decay: 0.0005\nlr_policy: "inv"\ngamma: 0.0001\npower: 0.75\n')
    return tmp_path / "lenet.prototxt", tmp_path / "solver.prototxt"


def test_bi_graph_of_the_train_net(lenet_files, tmp_path):
    model, _ = lenet_files
    assert main(["--model", str(model), str(tmp_path / "net.dot")]) == 0
    text = (tmp_path / "net.dot").read_text()
    b = build_net(model, TRAIN)
    forward = [op for L in b.layers for op in L.forward_ops]
    backward = b.seed_ops + [op for L in b.layers for op in L.backward_ops]
    assert len(text.split('class="forward"')) - 1 == len(forward) > 0
    assert len(text.split('class="backward"')) - 1 == len(backward) > 0
    assert {op.name for op in forward + backward} == {op.name for op in b.graph.ops}
    for op in forward:
        assert node_class(text, "op:" + op.name) == "forward", op.name
    for op in backward:
        assert node_class(text, "op:" + op.name) == "backward", op.name
    for name in b.graph.blobs:
        assert node_class(text, "blob:" + name) is not None, name
    assert node_class(text, "blob:conv1[0]") == "param"
    assert node_class(text, "blob:conv1@diff") == "diff"
    assert node_class(text, "blob:pool1@mask") == "scratch"
    assert node_class(text, "blob:data") == "data"
    assert "cluster" not in text and "solver" not in text
    # Every op's edges, from its inputs and to its outputs.
    e = edges(text)
    for op in b.graph.ops:
        for x in op.inputs:
            if x not in op.outputs:
                assert ("blob:" + x.name, "op:" + op.name) in e
        for y in op.outputs:
            assert ("op:" + op.name, "blob:" + y.name) in e
    assert ("blob:data", "op:conv1/ConvForward") in e
    assert ("op:conv1/ConvBackwardWeight", "blob:conv1[0]@diff") in e
    assert '"op:relu1/ReluForward" -> "blob:ip1" [dir=both];' in text  # in place
    assert 'label="data\\n2x1x28x28"' in text


def test_solver_update_ops_are_drawn_apart(lenet_files, tmp_path):
    _, solver_file = lenet_files
    out = tmp_path / "solver.dot"
    assert main(["--solver", str(solver_file), "--clusters", str(out)]) == 0
    text = out.read_text()
    solver = build_solver(solver_file)
    ops = solver.net.graph.ops
    update = {op.name for op in solver.update_ops}
    # lr, clip, next_iter and per parameter (8 of them) a prepare and an update op.
    assert len(update) == 3 + 2 * 8
    for op in ops:
        want = "solver" if op.name in update else ("backward" if "Backward" in op.name
                                                   or "LossWeight" in op.name else "forward")
        assert node_class(text, "op:" + op.name) == want, op.name
    assert node_class(text, "blob:solver/lr") == "solver"
    assert node_class(text, "blob:solver/ip1[0]@history0") == "solver"
    # The clusters hold exactly their ops.
    clusters = dict(re.findall(r'subgraph "cluster_(\w+)" \{(.*?)\n  \}', text, re.S))
    assert sorted(clusters) == ["backward", "forward", "solver"]
    in_solver = set(re.findall(r'"op:([^"]+)" \[', clusters["solver"]))
    assert in_solver == update
    assert ("op:solver/conv1[0]/update", "blob:conv1[0]") in edges(text)
    assert ("blob:conv1[0]@diff", "op:solver/conv1[0]/update") in edges(text)
    assert '"op:solver/conv1[0]/prepare" -> "blob:conv1[0]@diff" [dir=both];' in text


def test_layer_view(tmp_path):
    # The real LeNet file: no net is built, so its LMDBs need not exist.
    assert main(["--model", LENET, "--layers", "--phase", "TEST", str(tmp_path / "l.dot")]) == 0
    text = (tmp_path / "l.dot").read_text()
    layers = ["mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2",
              "accuracy", "loss"]
    ids = re.findall(r'^\s*"(layer:\d+:[^"]+)" \[', text, re.M)
    assert [i.split(":")[2] for i in ids] == layers
    labelled = set(re.findall(r'"layer:\d+:(\w+)" -> "layer:\d+:(\w+)" \[label="(\w+)"\]',
                              text))
    assert ("relu1", "ip2", "ip1") in labelled  # after the in-place ReLU
    assert ("ip1", "relu1", "ip1") in labelled
    assert ("mnist", "loss", "label") in labelled and ("mnist", "conv1", "data") in labelled
    assert 'label="conv1\\n(Convolution)\\nkernel 5, stride 1, pad 0\\nnum_output 20"' in text
    assert re.search(r'"output:accuracy" \[label="accuracy"', text)
    assert '"layer:9:loss" -> "output:loss";' in text
    train = layers_dot(read_net(LENET), phase=TRAIN)
    assert "accuracy" not in train and '"output:loss"' in train
    # No phase: every layer, as Caffe's draw_net; both data layers feed conv1, each in
    # its phase.
    assert main(["--model", LENET, "--layers", str(tmp_path / "all.dot")]) == 0
    every = (tmp_path / "all.dot").read_text()
    assert '"layer:0:mnist"' in every and '"layer:1:mnist"' in every
    assert '"layer:0:mnist" -> "layer:2:conv1" [label="data"];' in every
    assert '"layer:1:mnist" -> "layer:2:conv1" [label="data"];' in every
    assert '"layer:1:mnist" -> "layer:9:accuracy" [label="label"];' in every
    assert '"layer:0:mnist" -> "layer:9:accuracy"' not in every  # accuracy is TEST only


def test_rendering_runs_dot(tmp_path, monkeypatch, lenet_files):
    model, _ = lenet_files
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "dot"
    # A stand-in for Graphviz: records its arguments and writes what it read.
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\ncat\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + os.environ.get("PATH", ""))
    text = draw(tmp_path / "net.svg", model=model, layers=True)
    assert (tmp_path / "net.svg").read_text() == text
    args = (bin_dir / "args").read_text().split()
    assert args == ["-Tsvg"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp") or ".svg." in p]


def test_rendering_without_graphviz_says_what_to_do(tmp_path, monkeypatch, lenet_files,
                                                    capsys):
    model, _ = lenet_files
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["--model", str(model), str(tmp_path / "net.png")]) == 1
    err = capsys.readouterr().err
    assert "needs Graphviz's 'dot' program" in err and "write a .dot file" in err
    assert not (tmp_path / "net.png").exists()
    with pytest.raises(DrawError, match=r"must end in \.dot, \.gv, \.svg, \.png or \.pdf"):
        draw(tmp_path / "net.jpg", model=model)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_real_graphviz_renders_svg(tmp_path, lenet_files):
    model, solver_file = lenet_files
    draw(tmp_path / "net.svg", solver=solver_file)
    svg = (tmp_path / "net.svg").read_text()
    assert "<svg" in svg and 'class="node solver"' in svg and "ConvBackwardWeight" in svg


def test_user_errors(tmp_path, capsys, monkeypatch):
    # LeNet's LMDBs are not here (a user may have built them in the checkout; the relative
    # sources are then looked up from an empty folder): the message says how to draw it.
    monkeypatch.chdir(tmp_path)
    assert main(["--model", LENET, str(tmp_path / "x.dot")]) == 1
    err = capsys.readouterr().err
    assert "--stand_in data=N,... --stand_in label=N,..." in err and "--layers" in err
    assert main(["--model", LENET, "--stand_in", "data=2,1,28,28", "--stand_in", "label=2",
                 str(tmp_path / "x.dot")]) == 0
    assert main(["--model", LENET, "--solver", "s", str(tmp_path / "x.dot")]) == 2
    assert main(["--model", LENET, "--stand_in", "data", str(tmp_path / "x.dot")]) == 2
    assert "is not NAME=D1,D2" in capsys.readouterr().err


def test_quoting():
    assert quote('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'
    builder = build_net(replace_data_layers(read_net(LENET), STAND_IN), TRAIN)
    assert net_dot(builder).startswith('digraph "LeNet" {')
