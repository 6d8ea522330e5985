"""Fine-tuning from a trained model: copy_from logs Caffe's ``Ignoring source layer <name>``
for each layer of the file the net lacks (binary, V1 and HDF5 caffemodels), and copies the
layers both have."""

import numpy as np
import pytest

from purine.caffe import TEST, Net
from purine.formats import caffe_pb2 as pb
from purine.log import get_logger

GAUSS = 'weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 }'


def ip(name, bottom, top, n):
    return (f'layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{top}" '
            f"inner_product_param {{ num_output: {n} {GAUSS} }} }}")


DATA = 'layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 4 } } } '
# The pretrained net: a feature layer, a ReLU and a 5-way classifier with its softmax.
SOURCE = (DATA + ip("fc6", "x", "h", 3)
          + 'layer { name: "relu6" type: "ReLU" bottom: "h" top: "h" } '
          + ip("fc8", "h", "score", 5)
          + 'layer { name: "prob" type: "Softmax" bottom: "score" top: "prob" }')
# The fine-tuned net keeps fc6 and relu6 and puts a new 2-way classifier in fc8's place.
TARGET = (DATA + ip("fc6", "x", "h", 3)
          + 'layer { name: "relu6" type: "ReLU" bottom: "h" top: "h" } '
          + ip("fc8_new", "h", "score", 2))


@pytest.fixture(autouse=True)
def info_level():
    get_logger()  # the project's logger at INFO, as a run has it, before log_lines listens


def ignored(lines):
    return [line for line in lines if line.startswith("Ignoring source layer")]


@pytest.mark.parametrize("suffix", [".caffemodel", ".caffemodel.h5"])
def test_fine_tuning_logs_each_source_layer_the_net_lacks(tmp_path, log_lines, suffix):
    source = Net(SOURCE, TEST, seed=1)
    path = tmp_path / f"pretrained{suffix}"
    (source.save_hdf5 if suffix.endswith("h5") else source.save)(path)
    target = Net(TARGET, TEST, seed=2)
    fresh = target.params["fc8_new"][0].data.copy()
    log_lines.clear()
    target.copy_from(path)
    # fc8 and prob are gone from the fine-tuned net; data, fc6 and relu6 are matched.
    want = ["Ignoring source layer fc8", "Ignoring source layer prob"]
    assert ignored(log_lines) == want
    for k in range(2):
        np.testing.assert_array_equal(target.params["fc6"][k].data,
                                      source.params["fc6"][k].data)
    np.testing.assert_array_equal(target.params["fc8_new"][0].data, fresh)


def test_a_net_with_every_source_layer_logs_nothing(tmp_path, log_lines):
    source = Net(SOURCE, TEST, seed=1)
    source.save(tmp_path / "m.caffemodel")
    log_lines.clear()
    Net(SOURCE, TEST, weights=str(tmp_path / "m.caffemodel"))
    assert ignored(log_lines) == []


def test_v1_layers_of_an_old_caffemodel_are_named_too(tmp_path, log_lines):
    old = pb.NetParameter(name="old")
    conv = old.layers.add()  # the V1 "layers" field, as 2014 caffemodels have it
    conv.name = "conv_old"
    fc6 = old.layers.add()
    fc6.name = "fc6"
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    blob = fc6.blobs.add()
    blob.num, blob.channels, blob.height, blob.width = 1, 1, 3, 4  # V1's 4-d blobs
    blob.data.extend(w.ravel().tolist())
    b = fc6.blobs.add()
    b.num, b.channels, b.height, b.width = 1, 1, 1, 3
    b.data.extend([1.0, 2.0, 3.0])
    path = tmp_path / "v1.caffemodel"
    path.write_bytes(old.SerializeToString())
    target = Net(TARGET, TEST)
    log_lines.clear()
    target.copy_from(path)
    assert ignored(log_lines) == ["Ignoring source layer conv_old"]
    np.testing.assert_array_equal(target.params["fc6"][0].data, w)
    np.testing.assert_array_equal(target.params["fc6"][1].data, [1.0, 2.0, 3.0])
