"""The layer registry is Caffe's whole registry: every type string BVLC Caffe registers has a
builder, every V1 enum upgrades to one, the forks' types are the ones named, and the layer
list of docs/layers.md names exactly what is registered."""

import os
import re

from purine.caffe import net as _net  # noqa: F401  (importing the net registers the layers)
from purine.caffe.layer import BUILDERS
from purine.formats.upgrade import V1_TYPE_NAMES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# REGISTER_LAYER_CLASS / REGISTER_LAYER_CREATOR in BVLC Caffe's src/caffe/layers and
# layer_factory.cpp (Python when built WITH_PYTHON_LAYER; Clip and Swish came with master).
CAFFE_TYPES = {
    "AbsVal", "Accuracy", "ArgMax", "BatchNorm", "BatchReindex", "Bias", "BNLL", "Clip",
    "Concat", "ContrastiveLoss", "Convolution", "Crop", "Data", "Deconvolution", "Dropout",
    "DummyData", "Eltwise", "ELU", "Embed", "EuclideanLoss", "Exp", "Filter", "Flatten",
    "HDF5Data", "HDF5Output", "HingeLoss", "Im2col", "ImageData", "InfogainLoss",
    "InnerProduct", "Input", "Log", "LRN", "LSTM", "LSTMUnit", "MemoryData",
    "MultinomialLogisticLoss", "MVN", "Parameter", "Pooling", "Power", "PReLU", "Python",
    "Reduction", "ReLU", "Reshape", "RNN", "Scale", "Sigmoid", "SigmoidCrossEntropyLoss",
    "Silence", "Slice", "Softmax", "SoftmaxWithLoss", "Split", "SPP", "Swish", "TanH",
    "Threshold", "Tile", "WindowData",
}


# The Caffe forks' layers that real models use (issue 26), each named in docs/layers.md with
# the fork it came from.
FORK_TYPES = {
    "AnnotatedData", "Axpy", "ConvolutionDepthwise", "DepthwiseConvolution", "DetectionOutput",
    "Interp", "Mish", "MultiBoxLoss", "Normalize", "Permute", "PriorBox", "Proposal",
    "PSROIPooling", "ReLU6", "ROIPooling", "ShuffleChannel", "SmoothL1Loss", "Upsample",
}


def test_every_caffe_type_has_a_builder():
    assert sorted(CAFFE_TYPES - set(BUILDERS)) == []
    assert sorted(set(BUILDERS) - CAFFE_TYPES) == sorted(FORK_TYPES)


def test_every_v1_enum_upgrades_to_a_registered_type():
    names = {name for name in V1_TYPE_NAMES.values() if name}
    assert len(names) == len(V1_TYPE_NAMES) - 1
    assert sorted(names - set(BUILDERS)) == []


def readme_layers() -> set[str]:
    """The type names of docs/layers.md's list (the README's front page links to it)."""
    with open(os.path.join(ROOT, "docs", "layers.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## The layer types\n", 1)[1].split("\nFillers:", 1)[0]
    section = re.sub(r"\([^)]*\)", "", section)  # the notes in brackets name no layers
    items = re.sub(r"^- [a-z]+:", "", section.strip().split("\n", 1)[1], flags=re.M)
    return set(re.findall(r"\b[A-Z][A-Za-z0-9]+\b", items))


def test_readme_lists_the_registry():
    assert readme_layers() == set(BUILDERS)
