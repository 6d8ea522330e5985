"""A layer type declares its facts where it is registered: a type registered here, with
its split rule, export form, drawing and fork, is placed, exported and drawn by tools that
read only the registry (none of them names the type)."""

from __future__ import annotations

import numpy as np
import pytest

from purine.caffe import Net
from purine.caffe.facts import CHANNELS, FACTS, facts
from purine.caffe.layer import BUILDERS, register
from purine.converters import ConvertError
from purine.draw import layers_dot
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net
from purine.graph import Location
from purine.parallel.placement import split_towers

NET = """name: "own"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 4 dim: 1 dim: 3 } } }
layer { name: "t" type: "OwnTanH" bottom: "x" top: "y" }
"""
# x[n, c, 0, w] = (12n + 3c + w - 12) / 8: signs and sizes both ways
X = ((np.arange(24, dtype=np.float32) - 12) / 8).reshape(2, 4, 1, 3)


@pytest.fixture
def own_types():
    """OwnTanH computes as TanH (its builder) but declares facts of its own; OwnPReLU's form
    is one the ONNX exporter lacks."""
    register("OwnTanH", split=CHANNELS, export="tanh", colour="#123456",
             label=lambda lp: [f"own label of {lp.name}"], fork="a test's fork")(BUILDERS["TanH"])
    register("OwnPReLU", export="prelu", fork="a test's fork")(BUILDERS["PReLU"])
    yield
    for t in ("OwnTanH", "OwnPReLU"):
        del BUILDERS[t], FACTS[t]


def _net(text: str = NET) -> Net:
    net = Net(read_net(text), phase=pb.TEST)
    net.blobs["x"].data[...] = X
    return net


def test_registered_facts_are_the_types_facts(own_types):
    f = facts("OwnTanH")
    assert (f.split, f.export, f.colour, f.fork) == (CHANNELS, "tanh", "#123456", "a test's fork")
    assert facts("NoSuchType").export == ""  # an undeclared type: every fact at its default
    with pytest.raises(ValueError, match="OwnTanH registered twice"):
        register("OwnTanH")(BUILDERS["TanH"])


def test_placed_in_towers_by_its_split_rule(own_types):
    c0, c1 = Location("cpu", 0), Location("cpu", 1)
    split = split_towers(read_net(NET), {"t": [c0, c1]}, phase=pb.TEST)
    assert split.towers["t"].names == ["t/tower0", "t/tower1"]
    assert split.towers["t"].axes == []  # no parameters
    types = [lp.type for lp in split.net.layer]
    assert types == ["Input", "Slice", "OwnTanH", "OwnTanH", "Concat"]
    net = Net(split.net, phase=pb.TEST, placement=split.placement)
    net.blobs["x"].data[...] = X
    net.forward()
    np.testing.assert_allclose(split.blob(net, "y"), np.tanh(X), rtol=1e-6)


def test_exported_in_its_declared_form(own_types):
    onnx_export = pytest.importorskip("purine.converters.onnx_export")
    ort = pytest.importorskip("onnxruntime")
    model = onnx_export.net_to_onnx(_net())
    assert [n.op_type for n in model.graph.node] == ["Tanh"]
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": X})
    np.testing.assert_allclose(y, np.tanh(X), rtol=1e-6)
    assert "OwnTanH" in onnx_export.supported()


def test_pytorch_source_in_its_declared_form(own_types):
    from purine.converters.pytorch_export import net_to_pytorch, supported

    out = net_to_pytorch(_net())
    assert "        self.t = nn.Tanh()\n" in out.source
    assert "        y = self.t(x)\n" in out.source
    assert {"OwnTanH", "OwnPReLU"} <= set(supported())


def test_refusal_names_the_declared_fork(own_types):
    from purine.converters.onnx_export import net_to_onnx

    text = NET.replace('type: "OwnTanH"', 'type: "OwnPReLU"')
    with pytest.raises(ConvertError, match=r"layer 't' \(type OwnPReLU, from a test's fork\): "
                                           r"no exact ONNX form \(supported: .*OwnTanH"):
        net_to_onnx(_net(text))


def test_drawn_with_its_declared_colour_and_label(own_types):
    from purine.pycaffe.draw import choose_color_by_layertype

    dot = layers_dot(read_net(NET))
    assert ('"layer:1:t" [label="t\\n(OwnTanH)\\nown label of t", shape="box", '
            'style="filled", fillcolor="#123456", class="layer"]\n') in dot
    assert choose_color_by_layertype("OwnTanH") == "#123456"
    assert choose_color_by_layertype("OwnPReLU") == "#6495ED"  # declared none: Caffe's default
