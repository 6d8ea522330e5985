"""caffe_to_onnx's batch axis: symbolic by default (onnxruntime runs the model at batch sizes
other than the prototxt's and agrees with purine's forward at each), fixed by --batch N, and
kept fixed, saying why, where the net cannot follow another batch size."""

import numpy as np
import pytest

from purine.caffe import TEST, Net
from purine.formats.prototxt import read_net
from tests.converters.test_model_converters import (
    LENET,
    MIX_A,
    MIX_B,
    assert_agrees,
    onnx_modules,
    randomize,
    write,
)


def _export(tmp_path, text, capfd, *flags, seed=0, scale=0.5):
    """Save random weights for ``text``, run the command; (model, net, its stderr line)."""
    from purine.converters.onnx_export import main

    onnx, _ = onnx_modules()
    model = write(tmp_path, "deploy.prototxt", text)
    net = Net(model, phase=TEST)
    randomize(net, seed, scale)
    net.save(tmp_path / "w.caffemodel")
    capfd.readouterr()
    assert main(["--model", model, "--weights", str(tmp_path / "w.caffemodel"), *flags,
                 str(tmp_path / "net.onnx")]) == 0
    line = capfd.readouterr().err
    return onnx.load(str(tmp_path / "net.onnx")), net, line


def _dims(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _feeds(net, batch, seed):
    rng = np.random.default_rng(seed)
    feeds = {}
    for name in net.inputs:
        shape = (batch,) + net.blobs[name].shape[1:]
        net.blobs[name].reshape(shape)
        feeds[name] = rng.standard_normal(shape)
    net.reshape()
    return feeds


def _lenet():
    param = read_net(LENET)
    param.layer[0].input_param.shape[0].dim[0] = 3
    return str(param)


@pytest.mark.parametrize("text, built, expect", [
    (_lenet(), 3, ["conv1", "pool2", "ip1", "prob"]),
    (MIX_A, 2, ["conv1", "cat", "pave2", "ip", "prob"]),
    # Scale by a second bottom on axis 0, Flatten, InnerProduct on axis 2, Reshape {0, -1}:
    # the Reshapes whose shapes hold the batch.
    (MIX_B, 2, ["gated", "flat", "ip_axis", "shape", "soft"]),
], ids=["lenet", "mix_a", "mix_b"])
def test_symbolic_batch_runs_at_other_sizes(tmp_path, capfd, text, built, expect):
    model, net, line = _export(tmp_path, text, capfd, seed=4)
    assert f"batch axis symbolic ('batch'; built at {built})" in line
    for i in model.graph.input:
        assert _dims(i)[0] == "batch" and all(isinstance(d, int) for d in _dims(i)[1:])
    for o in model.graph.output:
        assert _dims(o)[0] == "batch", o.name
    for batch in (1, 5):
        feeds = _feeds(net, batch, seed=batch)
        assert net.blobs[net.inputs[0]].shape[0] == batch
        assert_agrees(model, net, feeds, expect)
    # onnxruntime found nothing to warn about (a declared shape it did not get, say)
    assert "does not match" not in capfd.readouterr().err


def test_fixed_batch(tmp_path, capfd):
    _, ort = onnx_modules()
    model, net, line = _export(tmp_path, MIX_B, capfd, "--batch", "4", seed=4)
    assert "batch 4 (fixed by --batch)" in line
    for v in list(model.graph.input) + list(model.graph.output):
        assert _dims(v)[0] == 4 and all(isinstance(d, int) for d in _dims(v))
    assert_agrees(model, net, _feeds(net, 4, seed=1), ["gated", "ip_axis", "shape"])
    # fixed means fixed: onnxruntime refuses another batch size
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="invalid dimensions for input"):
        sess.run(None, {"data": np.zeros((1, 4, 5, 5), np.float32),
                        "gate": np.zeros((1, 4), np.float32)})


def test_batch_must_be_positive(tmp_path, capsys):
    from purine.converters.onnx_export import main

    assert main(["--model", "m", "--weights", "w", "--batch", "0", "o.onnx"]) == 2
    assert "expected a batch size of at least 1, got 0" in capsys.readouterr().err


INPUTS_DIFFER = """name: "two"
layer { name: "in" type: "Input" top: "a" top: "b"
  input_param { shape { dim: 2 dim: 4 } shape { dim: 1 dim: 4 } } }
layer { name: "ipa" type: "InnerProduct" bottom: "a" top: "ya" inner_product_param { num_output: 3 } }
layer { name: "ipb" type: "InnerProduct" bottom: "b" top: "yb" inner_product_param { num_output: 3 } }
"""

# The whole shape in the prototxt: the net builds at batch 2 only.
WHOLE_SHAPE = """name: "whole"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 } } }
layer { name: "r" type: "Reshape" bottom: "data" top: "r" reshape_param { shape { dim: 4 dim: 6 } } }
"""


@pytest.mark.parametrize("text, note", [
    (INPUTS_DIFFER, "batch 2 (fixed: its inputs differ in their first axis (a 2, b 1))"),
    (WHOLE_SHAPE, "batch 2 (fixed: the net does not build at batch size 1: "),
])
def test_a_net_that_cannot_follow_the_batch_stays_fixed_and_says_why(tmp_path, capfd, text,
                                                                      note):
    model, net, line = _export(tmp_path, text, capfd)
    assert note in line
    for v in list(model.graph.input) + list(model.graph.output):
        assert all(isinstance(d, int) and d > 0 for d in _dims(v)), v.name
    rng = np.random.default_rng(0)
    assert_agrees(model, net, {n: rng.standard_normal(net.blobs[n].shape) for n in net.inputs})
