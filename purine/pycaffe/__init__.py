"""pycaffe's API over purine-caffe, for scripts written against BVLC Caffe's Python module::

    import purine.pycaffe as caffe

    net = caffe.Net("deploy.prototxt", "weights.caffemodel", caffe.TEST)
    solver = caffe.SGDSolver("solver.prototxt")
    solver.step(100)

``caffe.Net``, the solvers, ``caffe.Layer`` (Python layers), ``caffe.io``, ``caffe.proto``,
``TRAIN``/``TEST``, the net specification API and the mode functions: after
``set_mode_gpu`` (and ``set_device``) nets and solvers are built on that GPU when CuPy sees
one; without one it warns, saying why, and they run on the CPU.

``install_as_caffe()`` makes ``import caffe`` give this module when no real Caffe is
installed. Importing this module registers it with the Python layer builder, and building
a net with a ``Python`` layer calls it, so a user's layer module that
says ``import caffe`` and subclasses ``caffe.Layer`` works unchanged; an installed Caffe is
never replaced (the user's module then gets that Caffe's classes).
"""

from __future__ import annotations

import sys

from purine.caffe import TEST, TRAIN
from purine.caffe.layer import BUILDERS
from purine.caffe.layers.python import Layer, caffe_name_free, provide_caffe
from purine.pycaffe import io, net_spec, proto
from purine.pycaffe.mode import set_device, set_mode_cpu, set_mode_gpu, set_random_seed
from purine.pycaffe.net import Net
from purine.pycaffe.net_spec import NetSpec, layers, params, to_proto
from purine.pycaffe.solver import (
    AdaDeltaSolver,
    AdaGradSolver,
    AdamSolver,
    NesterovSolver,
    RMSPropSolver,
    SGDSolver,
    Solver,
    get_solver,
)

__all__ = [
    "AdaDeltaSolver", "AdaGradSolver", "AdamSolver", "Layer", "NesterovSolver", "Net",
    "RMSPropSolver", "SGDSolver", "Solver", "TEST", "TRAIN", "get_solver", "install_as_caffe",
    "io", "layer_type_list", "proto", "set_device", "set_mode_cpu", "set_mode_gpu",
    "set_random_seed",
    "NetSpec", "layers", "params", "to_proto",  # the net specification (net_spec.py)
]


def layer_type_list() -> list[str]:
    """The layer types nets can use, sorted (Caffe's LayerRegistry::LayerTypeList)."""
    return sorted(BUILDERS)


def install_as_caffe() -> bool:
    """Make ``import caffe`` (and ``caffe.io``, ``caffe.net_spec``, ``caffe.proto.caffe_pb2``)
    resolve to this module, unless a real ``caffe`` package is importable or already
    imported (the Python layer builder's stand-in ``caffe`` is replaced). Returns whether
    ``caffe`` is now this module. A ``caffe`` directory without ``__init__.py`` (a Caffe
    source checkout seen as a namespace package) does not count as installed."""
    this = sys.modules[__name__]
    if sys.modules.get("caffe") is this:
        return True
    if not caffe_name_free():
        return False
    sys.modules.update({
        "caffe": this,
        "caffe.io": io,
        "caffe.proto": proto,
        "caffe.proto.caffe_pb2": proto.caffe_pb2,
        "caffe.net_spec": net_spec,
    })
    return True


# The Python layer builder (below this face) calls this when it loads a user's layer module.
provide_caffe(install_as_caffe)
