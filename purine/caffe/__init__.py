"""Caffe's semantics over the bi-graph: the layer registry and its builders, fillers, the
pycaffe-style ``Net`` and the ``Solver``. Caffe's files are read and written by
``purine.formats``; its modules' old names here (``purine.caffe.caffe_pb2``...) still resolve,
with a DeprecationWarning."""

import importlib
import warnings
from types import ModuleType

from purine.caffe import layers as _layers  # noqa: F401  (registers every builder)
from purine.caffe.net import TEST, TRAIN, Net

__all__ = ["Net", "TRAIN", "TEST"]

# Modules that lived here before Caffe's files moved to purine.formats; scripts written
# against the old layout (`from purine.caffe import caffe_pb2`) keep running, told where to go.
_MOVED_TO_FORMATS = frozenset(
    {"caffe_pb2", "caffemodel", "hdf5_snapshot", "prototxt", "upgrade", "wire"})


def __getattr__(name: str) -> ModuleType:
    if name not in _MOVED_TO_FORMATS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"purine.caffe.{name} moved: import it as `from purine.formats import {name}`",
                  DeprecationWarning, stacklevel=2)
    return importlib.import_module(f"purine.formats.{name}")
