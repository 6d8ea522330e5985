"""Net translation: implicit splits, parameter sharing, need-backward analysis, NetState
rules, the pycaffe-style API, and the errors a user sees."""

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.errors import LayerError, ProtoError
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import filter_net, insert_splits, parse_text, replace_data_layers

IP = 'inner_product_param {{ num_output: {n} weight_filler {{ type: "gaussian" std: 1 }} ' \
     'bias_filler {{ type: "gaussian" std: 1 }} }}'


def net_text(body: str, force_backward: bool = False) -> str:
    head = "force_backward: true\n" if force_backward else ""
    return head + 'layer { name: "data" type: "Input" top: "x" ' \
        'input_param { shape { dim: 3 dim: 4 } } }\n' + body


def two_heads() -> str:
    """x -> ip1 -> relu (in place) -> {ip2, ip3}, both heads weighted into the loss."""
    return net_text(f"""
layer {{ name: "ip1" type: "InnerProduct" bottom: "x" top: "h" {IP.format(n=5)} }}
layer {{ name: "relu" type: "ReLU" bottom: "h" top: "h" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "h" top: "a" loss_weight: 1 {IP.format(n=2)} }}
layer {{ name: "ip3" type: "InnerProduct" bottom: "h" top: "b" loss_weight: 0.5 {IP.format(n=2)} }}
""")


def test_splits_are_named_as_caffe_names_them():
    net = parse_text(two_heads(), pb.NetParameter())
    split = insert_splits(net)
    names = [(l.name, l.type, list(l.bottom), list(l.top)) for l in split.layer]
    assert names[3] == ("h_relu_0_split", "Split", ["h"], ["h_relu_0_split_0", "h_relu_0_split_1"])
    assert names[4][2] == ["h_relu_0_split_0"] and names[5][2] == ["h_relu_0_split_1"]


def test_a_weighted_loss_top_that_is_also_consumed_gets_a_split_carrying_the_loss():
    net = parse_text(net_text(f"""
layer {{ name: "ip" type: "InnerProduct" bottom: "x" top: "y" loss_weight: 2 {IP.format(n=2)} }}
layer {{ name: "relu" type: "ReLU" bottom: "y" top: "z" }}
"""), pb.NetParameter())
    split = insert_splits(net)
    s = split.layer[2]
    assert (s.type, list(s.top), list(s.loss_weight)) == ("Split", ["y_ip_0_split_0", "y_ip_0_split_1"], [2.0, 0.0])
    assert list(split.layer[1].loss_weight) == []
    assert list(split.layer[3].bottom) == ["y_ip_0_split_1"]


def test_gradient_through_a_split_is_the_sum_of_both_heads():
    net = Net(two_heads(), phase=TRAIN, dtype="float64", seed=3)
    x = np.random.default_rng(0).standard_normal((3, 4))
    net.forward(x=x)
    w1, b1 = (p.data for p in net.params["ip1"])
    w2, w3 = net.params["ip2"][0].data, net.params["ip3"][0].data
    pre = x @ w1.T + b1
    h = np.maximum(pre, 0)
    assert np.allclose(net.blobs["h"].data, h)
    want_loss = (h @ w2.T + net.params["ip2"][1].data).sum() \
        + 0.5 * (h @ w3.T + net.params["ip3"][1].data).sum()
    assert net.loss == pytest.approx(want_loss)
    net.backward()
    dh = np.ones((3, 2)) @ w2 + 0.5 * np.ones((3, 2)) @ w3
    dpre = dh * (pre > 0)
    assert np.allclose(net.params["ip1"][0].diff, dpre.T @ x)
    assert np.allclose(net.params["ip1"][1].diff, dpre.sum(0))
    # The data layer needs no gradient unless force_backward.
    assert not net.graph.writers(net.builder.diff("x"))


def test_shared_parameters_get_the_sum_of_their_gradients():
    shared = 'param { name: "w" } param { name: "b" }'
    net = Net(net_text(f"""
layer {{ name: "ip1" type: "InnerProduct" bottom: "x" top: "a" loss_weight: 1 {shared} {IP.format(n=4)} }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "a" top: "b" loss_weight: 1 {shared} {IP.format(n=4)} }}
"""), phase=TRAIN, dtype="float64")
    assert net.params["ip1"][0].data is net.params["ip2"][0].data or np.shares_memory(
        net.params["ip1"][0].data, net.params["ip2"][0].data)
    x = np.random.default_rng(1).standard_normal((3, 4))
    net.forward(x=x)
    net.backward()
    w = net.params["ip1"][0].data
    a = net.blobs["a"].data
    # loss = sum(a) + sum(a W^T + b); gradient of W from both uses of it.
    da = np.ones((3, 4)) + np.ones((3, 4)) @ w
    want = da.T @ x + np.ones((3, 4)).T @ a
    assert np.allclose(net.params["ip1"][0].diff, want)


def test_shared_parameter_with_another_shape_is_an_error_naming_both():
    with pytest.raises(LayerError, match=r"layer 'ip2' .*shares parameter 'w' of layer 'ip1'"
                       r" but needs shape \(3, 4\), the owner has \(4, 4\)"):
        Net(net_text(f"""
layer {{ name: "ip1" type: "InnerProduct" bottom: "x" top: "a" param {{ name: "w" }} {IP.format(n=4)} }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "a" top: "b" param {{ name: "w" }} {IP.format(n=3)} }}
"""))


def test_lr_mult_zero_and_propagate_down_prune_backward_ops():
    net = Net(net_text(f"""
layer {{ name: "ip1" type: "InnerProduct" bottom: "x" top: "a" param {{ lr_mult: 0 }} param {{ lr_mult: 0 }} {IP.format(n=4)} }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "a" top: "b" param {{ lr_mult: 2 decay_mult: 0 }} propagate_down: false loss_weight: 1 {IP.format(n=2)} }}
"""), phase=TRAIN)
    types = {op.name for op in net.graph.ops}
    assert "ip2/InnerProductBackwardWeight" in types
    assert "ip2/InnerProductBackwardData" not in types
    assert not any(n.startswith("ip1/") and "Backward" in n for n in types)
    w2 = net.builder.layers[2].params[0]
    assert (w2.meta["lr_mult"], w2.meta["decay_mult"]) == (2.0, 0.0)


def test_layers_not_under_a_loss_get_no_backward():
    net = Net(net_text(f"""
layer {{ name: "ip1" type: "InnerProduct" bottom: "x" top: "a" {IP.format(n=4)} }}
"""), phase=TRAIN)
    assert not any("Backward" in op.type for op in net.graph.ops)


def test_force_backward_computes_input_gradients():
    net = Net(net_text(f"""
layer {{ name: "ip1" type: "InnerProduct" bottom: "x" top: "a" {IP.format(n=2)} }}
""", force_backward=True), phase=TEST, dtype="float64")
    net.forward(x=np.ones((3, 4)))
    grads = net.backward(a=np.ones((3, 2)))
    assert np.allclose(grads["x"], np.ones((3, 2)) @ net.params["ip1"][0].data)


RULES = """
layer { name: "always" type: "Input" top: "a" input_param { shape { dim: 1 } } }
layer { name: "train" type: "Input" top: "b" include { phase: TRAIN } input_param { shape { dim: 1 } } }
layer { name: "test_deep" type: "Input" top: "c" include { phase: TEST min_level: 2 } input_param { shape { dim: 1 } } }
layer { name: "staged" type: "Input" top: "d" include { stage: "s1" stage: "s2" } input_param { shape { dim: 1 } } }
layer { name: "not_s1" type: "Input" top: "e" exclude { stage: "s1" } input_param { shape { dim: 1 } } }
layer { name: "max1" type: "Input" top: "f" include { max_level: 1 not_stage: "x" } input_param { shape { dim: 1 } } }
"""


@pytest.mark.parametrize("phase,level,stages,want", [
    (TRAIN, 0, [], ["always", "train", "not_s1", "max1"]),
    (TEST, 0, [], ["always", "not_s1", "max1"]),
    (TEST, 2, [], ["always", "test_deep", "not_s1"]),
    (TEST, 0, ["s1"], ["always", "max1"]),
    (TEST, 0, ["s1", "s2"], ["always", "staged", "max1"]),
    (TRAIN, 1, ["x"], ["always", "train", "not_s1"]),
])
def test_include_exclude_rules(phase, level, stages, want):
    net = parse_text(RULES, pb.NetParameter())
    state = pb.NetState(phase=phase, level=level, stage=stages)
    assert [l.name for l in filter_net(net, state).layer] == want
    assert Net(RULES, phase=phase, level=level, stages=stages).layer_names == want


def test_pycaffe_style_api():
    net = Net(two_heads(), TRAIN)
    assert list(net.blobs) == ["x", "h", "h_relu_0_split_0", "h_relu_0_split_1", "a", "b"]
    assert net.inputs == ["x"] and net.outputs == ["a", "b"]
    assert [(k, [p.shape for p in v]) for k, v in net.params.items()] == [
        ("ip1", [(5, 4), (5,)]), ("ip2", [(2, 5), (2,)]), ("ip3", [(2, 5), (2,)])]
    b = net.blobs["x"]
    assert (b.num, b.channels, b.height, b.width, b.count) == (3, 4, 1, 1, 12)
    assert net.blobs["x"].data.dtype == np.float32
    net.blobs["x"].reshape(7, 4)
    net.reshape()
    assert net.blobs["h"].data.shape == (7, 5)
    out = net.forward(x=np.ones((7, 4), np.float32))
    assert out["a"].shape == (7, 2)
    with pytest.raises(Exception, match=r"blob 'x' has shape \(7, 4\), the input has \(2, 4\)"):
        net.forward(x=np.ones((2, 4)))


def test_phase_arguments_in_pycaffe_order(tmp_path):
    path = tmp_path / "n.prototxt"
    path.write_text(two_heads())
    net = Net(str(path), TRAIN)
    net.save(tmp_path / "w.caffemodel")
    again = Net(str(path), str(tmp_path / "w.caffemodel"), TEST)
    assert again.phase == TEST
    for name, views in net.params.items():
        for a, b in zip(views, again.params[name]):
            assert np.array_equal(a.data, b.data)


def test_syntax_error_names_file_line_and_column(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_text('name: "x"\nlayer {\n  name: "a"\n  type "Input"\n}\n')
    with pytest.raises(ProtoError, match=r"bad.prototxt:4:8: .*"):
        Net(str(path))


def test_unknown_type_and_missing_bottom_are_named():
    with pytest.raises(LayerError, match="layer 'q' \\(type Quux\\): unknown layer type"):
        Net(net_text('layer { name: "q" type: "Quux" bottom: "x" top: "y" }'))
    with pytest.raises(ProtoError, match="layer 'r' \\(type ReLU\\): unknown bottom blob 'nope'"):
        Net(net_text('layer { name: "r" type: "ReLU" bottom: "nope" top: "y" }'))


def test_each_parameter_gets_its_own_random_stream():
    net = Net(net_text(f'layer {{ name: "ip" type: "InnerProduct" bottom: "x" top: "y" {IP.format(n=4)} }}'))
    w, b = (v.data for v in net.params["ip"])
    assert not np.allclose(w[0], b)  # same filler, same layer: different numbers
    again = Net(net_text(f'layer {{ name: "ip" type: "InnerProduct" bottom: "x" top: "y" {IP.format(n=4)} }}'))
    assert np.array_equal(again.params["ip"][0].data, w)


def test_propagate_down_true_forces_a_gradient():
    net = Net(net_text(f'layer {{ name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
                       f'propagate_down: true loss_weight: 1 {IP.format(n=2)} }}'),
              phase=TRAIN, dtype="float64")
    net.forward(x=np.ones((3, 4)))
    grads = net.backward()
    assert np.allclose(grads["x"], np.ones((3, 2)) @ net.params["ip"][0].data)


def test_backward_over_a_layer_range_seeds_the_loss_weights():
    net = Net(two_heads(), phase=TRAIN, dtype="float64")
    net.forward(x=np.ones((3, 4)))
    net.backward(start="ip3", end="ip3")
    assert np.allclose(net.params["ip3"][1].diff, 0.5 * 3)  # loss weight 0.5, 3 samples


def test_shared_multipliers_follow_caffe():
    adopt = Net(net_text(f"""
layer {{ name: "ip1" type: "InnerProduct" bottom: "x" top: "a" param {{ name: "w" }} {IP.format(n=4)} }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "a" top: "b" param {{ name: "w" lr_mult: 3 }} {IP.format(n=4)} }}
"""))
    assert adopt.builder.layers[1].params[0].meta["lr_mult"] == 3
    with pytest.raises(LayerError, match="has decay_mult 2 here and 1 in layer 'ip1'"):
        Net(net_text(f"""
layer {{ name: "ip1" type: "InnerProduct" bottom: "x" top: "a" param {{ name: "w" decay_mult: 1 }} {IP.format(n=4)} }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "a" top: "b" param {{ name: "w" decay_mult: 2 }} {IP.format(n=4)} }}
"""))


def test_a_layer_name_used_twice():
    """Caffe allows it (BVLC's mnist_autoencoder has two layers named "loss"): both run, and
    pycaffe's names repeat; a repeat with parameters is refused, since parameters (and
    .caffemodel records) are named after their layer."""
    net = Net(net_text('layer { name: "r" type: "ReLU" bottom: "x" top: "y" }\n'
                       'layer { name: "r" type: "Power" bottom: "y" top: "z" '
                       'power_param { scale: 2 } }'))
    x = np.array([[-1.0, 2.0, -3.0, 4.0]] * 3, dtype=np.float32)
    out = net.forward(x=x)
    np.testing.assert_array_equal(out["z"], 2 * np.maximum(x, 0))
    assert net.layer_names[-2:] == ["r", "r"]
    with pytest.raises(LayerError, match="layer 'r' .*a layer name used twice, here by a "
                                         "layer with parameters"):
        Net(net_text(f'layer {{ name: "r" type: "ReLU" bottom: "x" top: "y" }}\n'
                     f'layer {{ name: "r" type: "InnerProduct" bottom: "y" top: "z" '
                     f'{IP.format(n=4)} }}'))


def test_replace_data_layers_keeps_python_layers_that_compute():
    net = parse_text('''
layer { name: "d" type: "Python" top: "x" top: "y" python_param { module: "m" layer: "Src" } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "p" inner_product_param { num_output: 1 } }
layer { name: "loss" type: "Python" bottom: "p" bottom: "y" top: "loss"
        python_param { module: "m" layer: "Loss" } }''', pb.NetParameter())
    out = replace_data_layers(net, {"x": (2, 3), "y": (2, 1)})
    assert [lp.type for lp in out.layer] == ["Input", "InnerProduct", "Python"]
    assert [tuple(s.dim) for s in out.layer[0].input_param.shape] == [(2, 3), (2, 1)]
    with pytest.raises(ProtoError, match=r"layer 'd' \(Python\): no stand-in shape for "
                                         r"top\(s\) y"):
        replace_data_layers(net, {"x": (2, 3)})
