"""Caffe's semantics over the bi-graph: the layer registry and its builders, fillers, the
pycaffe-style ``Net`` and the ``Solver``. Caffe's files are read and written by
``purine.formats``, whose modules keep their old names here too (``purine.caffe.caffe_pb2``...)."""

from purine.caffe import layers as _layers  # noqa: F401  (registers every builder)
from purine.caffe.net import TEST, TRAIN, Net

__all__ = ["Net", "TRAIN", "TEST"]
