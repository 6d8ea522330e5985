"""The forks' layers in the rest of the project: placed at another location they give the
unplaced numbers forward and backward, and both drawings (purine's layer view and pycaffe's
caffe.draw) show them with their types and settings."""

import numpy as np
import pytest

from purine.caffe import TRAIN, Net
from purine.draw import layers_dot
from purine.formats.prototxt import read_net
from purine.graph import Location
from tests.fuzz.test_prototxt import FORK_NET

# The trainable part of the forks' net: what a placement may split across locations.
TRAINABLE = """
force_backward: true
layer { name: "data" type: "Input" top: "data" top: "rois"
  input_param { shape { dim: 2 dim: 4 dim: 8 dim: 8 } shape { dim: 3 dim: 5 } } }
layer { name: "dw" type: "ConvolutionDepthwise" bottom: "data" top: "dw"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1
                      weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "relu6" type: "ReLU6" bottom: "dw" top: "dw" }
layer { name: "shuffle" type: "ShuffleChannel" bottom: "dw" top: "shuffle"
  shuffle_channel_param { group: 2 } }
layer { name: "mish" type: "Mish" bottom: "shuffle" top: "mish" }
layer { name: "gap" type: "Pooling" bottom: "mish" top: "gap"
  pooling_param { pool: AVE global_pooling: true } }
layer { name: "axpy" type: "Axpy" bottom: "gap" bottom: "mish" bottom: "data" top: "axpy" }
layer { name: "norm" type: "Normalize" bottom: "axpy" top: "norm"
  norm_param { across_spatial: false scale_filler { type: "constant" value: 2 } } }
layer { name: "interp" type: "Interp" bottom: "norm" top: "interp"
  interp_param { zoom_factor: 2 } }
layer { name: "perm" type: "Permute" bottom: "interp" top: "perm"
  permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "roi" type: "ROIPooling" bottom: "norm" bottom: "rois" top: "roi"
  roi_pooling_param { pooled_h: 2 pooled_w: 2 spatial_scale: 1 } }
"""


def test_placed_fork_layers_give_the_unplaced_numbers():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 4, 8, 8))
    # [batch index, x1, y1, x2, y2], away from ties at bin edges
    rois = np.array([[0, 0, 0, 5, 6], [1, 2, 1, 7, 7], [0, 3, 2, 6, 5]], dtype=np.float64)
    other = Location("cpu", 1)
    nets = [Net(TRAINABLE, phase=TRAIN, dtype="float64", seed=2),
            Net(TRAINABLE, phase=TRAIN, dtype="float64", seed=2,
                placement={"shuffle": other, "mish": other, "axpy": other, "norm": other,
                           "perm": other})]
    for net in nets:
        net.forward(data=x, rois=rois)
        net.backward(perm=np.linspace(-1, 1, 2 * 15 * 15 * 4).reshape(2, 15, 15, 4),
                     roi=np.ones((3, 4, 2, 2)))
    plain, placed = nets
    assert any(op.type == "Copy" for op in placed.graph.ops)
    assert placed.params["norm"][0]._data.location == other
    for name in plain.blobs:
        np.testing.assert_allclose(placed.blobs[name].data, plain.blobs[name].data,
                                   rtol=1e-12, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(placed.blobs["data"].diff, plain.blobs["data"].diff,
                               rtol=1e-12, atol=1e-12)
    assert np.abs(plain.blobs["data"].diff).sum() > 0
    for layer, views in plain.params.items():
        for a, b in zip(views, placed.params[layer]):
            np.testing.assert_allclose(b.diff, a.diff, rtol=1e-12, atol=1e-12, err_msg=layer)


def test_purines_layer_view_draws_every_fork_layer():
    net = read_net(FORK_NET)
    dot = layers_dot(net, rankdir="TB")
    for layer in net.layer:
        assert f"{layer.name}" in dot and layer.type in dot, layer.type
    assert 'rankdir="TB"' in dot


def test_caffe_draw_labels_the_fork_layers():
    pytest.importorskip("pydot", reason="caffe.draw builds pydot graphs (the draw extra)")
    from purine.pycaffe import draw

    net = read_net(FORK_NET)
    labels = draw.get_pydot_graph(net, "LR").to_string()
    for kind in ("ROIPooling", "PriorBox", "DetectionOutput", "ShuffleChannel", "Interp",
                 "ConvolutionDepthwise", "Normalize", "Permute", "Axpy", "Upsample"):
        assert f"({kind})" in labels, kind
    # A depthwise convolution is labelled like a convolution: its kernel, stride and pad.
    dw = next(layer for layer in net.layer if layer.type == "ConvolutionDepthwise")
    label = draw.get_layer_label(dw, "TB")
    assert label.startswith('"dw (ConvolutionDepthwise)') and "kernel size: 3" in label, label
