"""Caffe's files and semantics over the bi-graph: prototxt I/O, the layer registry and its
builders, fillers, caffemodel I/O, and the pycaffe-style ``Net``."""

from purine.caffe import layers as _layers  # noqa: F401  (registers every builder)
from purine.caffe.net import TEST, TRAIN, Net

__all__ = ["Net", "TRAIN", "TEST"]
