"""caffe_to_pytorch's --phase, --level and --stage pick the layers by their include/exclude
rules, as `purine-caffe test` and `time` do; its summary line says what loads the output."""

import os

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.cli import main as cli_main
from purine.converters.pytorch_export import caffe_to_pytorch, main
from tests.converters.test_pytorch_export import assert_agrees, randomize

# relu: TEST only; wide: with stage "wide"; deep: at level 2 or more.
RULES = """name: "rules"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 4 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param { num_output: 3 } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" include { phase: TEST } }
layer { name: "wide" type: "InnerProduct" bottom: "ip1" top: "wide"
  include { stage: "wide" } inner_product_param { num_output: 5 } }
layer { name: "deep" type: "InnerProduct" bottom: "ip1" top: "deep"
  include { min_level: 2 } inner_product_param { num_output: 2 } }
"""


@pytest.fixture
def files(tmp_path):
    """The prototxt and a caffemodel holding every layer's parameters (level 2, stage wide)."""
    model = tmp_path / "rules.prototxt"
    model.write_text(RULES)
    with Net(str(model), phase=TEST, level=2, stages=["wide"]) as net:
        randomize(net)
        net.save(tmp_path / "w.caffemodel")
    return str(model), str(tmp_path / "w.caffemodel")


@pytest.mark.parametrize("flags, layers, state", [
    ([], ["data", "ip1", "relu"], ""),
    (["--phase", "TRAIN"], ["data", "ip1"], " (phase TRAIN)"),
    (["-phase=train", "--stage", "wide"], ["data", "ip1", "wide"], " (phase TRAIN, stages wide)"),
    (["--stage", "x,wide", "--level", "2"], ["data", "ip1", "relu", "wide", "deep"],
     " (level 2, stages x,wide)"),
])
def test_phase_level_and_stage_pick_the_layers(tmp_path, files, capsys, flags, layers, state):
    model, weights = files
    out = tmp_path / "out"
    assert main(["--model", model, "--weights", weights, *flags, str(out)]) == 0
    line = capsys.readouterr().err.splitlines()[-1]  # after the net's set-up log
    base = os.path.join(out, "rules")
    assert line.startswith(f"{model} + {weights} -> {base}.py, {base}.safetensors: ")
    outputs = sorted(n for n in layers[2:] if n != "relu") or ["ip1"]
    assert line.endswith(f"inputs data, outputs {', '.join(outputs)}{state}; load them with "
                         "PyTorch and safetensors (pip install torch safetensors)")
    source = (out / "rules.py").read_text()
    for name in ("ip1", "relu", "wide", "deep"):
        assert (f"self.{name} = " in source) is (name in layers), name
    # the same through purine-caffe
    assert cli_main(["caffe_to_pytorch", "--model", model, "--weights", weights, *flags,
                     str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "rules.py").read_bytes() == source.encode()


def test_train_phase_module_agrees_with_the_train_net(tmp_path, files):
    model, weights = files
    ex = caffe_to_pytorch(model, weights, tmp_path / "out", phase=TRAIN, stages=["wide"])
    assert list(ex.attributes) == ["ip1", "wide"] and ex.outputs == ["wide"]
    assert "rules.prototxt + w.caffemodel, phase TRAIN, stages wide" in ex.source
    with Net(model, phase=TRAIN, stages=["wide"], weights=weights) as net:
        x = np.random.default_rng(0).standard_normal((2, 4))
        # no ReLU between ip1 and wide: negative values pass (TEST would clip them)
        assert (net.forward(data=x)["wide"] != 0).all()
        assert (net.blobs["ip1"].data < 0).any()
        assert assert_agrees(ex, net, tmp_path / "out", {"data": x}) == [
            "ip1", "wide", "output wide"]


@pytest.mark.parametrize("flags, message", [
    (["--phase", "deploy"], "expected TRAIN or TEST, got 'deploy'"),
    (["--level", "2x"], "expected an integer, got '2x'"),
    (["--level", str(2 ** 31)], "expected a 32-bit integer, got 2147483648"),
])
def test_bad_flags_are_one_line(tmp_path, files, capsys, flags, message):
    model, weights = files
    assert main(["--model", model, "--weights", weights, *flags, str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
