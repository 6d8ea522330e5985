"""Placing layers at other locations: Copy ops where an edge crosses memory spaces, and the
same forward and backward numbers as the unplaced net."""

import numpy as np

from purine.caffe import TRAIN, Net
from purine.graph import Location

NET = """
force_backward: true
layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "c" top: "c" }
layer { name: "ip" type: "InnerProduct" bottom: "c" top: "y"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "c" top: "z"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "cat" type: "Concat" bottom: "y" bottom: "z" top: "out" concat_param { axis: 1 } }
"""


def test_placed_layers_give_the_unplaced_numbers():
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8))
    other = Location("cpu", 1)
    nets = [Net(NET, phase=TRAIN, dtype="float64"),
            Net(NET, phase=TRAIN, dtype="float64",
                placement={"conv": other, "relu": other, "ip2": other})]
    for net in nets:
        net.forward(x=x)
        net.backward(out=np.arange(16.0).reshape(2, 8))
    plain, placed = nets
    copies = [op for op in placed.graph.ops if op.type == "Copy"]
    # conv's input moves to cpu:1; ip (at cpu:0) takes the split of c from cpu:1 and sends its
    # gradient back; the split and ip2 run at cpu:1 with c; the concat pulls z back.
    assert {op.name for op in copies} == {"conv/CopyIn#0", "conv/CopyOut#0", "cat/CopyIn#1",
                                          "cat/CopyOut#1", "ip/CopyIn#0", "ip/CopyOut#0"}
    assert placed.params["conv"][0]._data.location == other
    for name in plain.blobs:
        assert np.allclose(plain.blobs[name].data, placed.blobs[name].data), name
    assert np.allclose(plain.blobs["x"].diff, placed.blobs["x"].diff)
    for layer, views in plain.params.items():
        for a, b in zip(views, placed.params[layer]):
            assert np.allclose(a.diff, b.diff), layer
