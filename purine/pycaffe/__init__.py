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
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

from purine.caffe import TEST, TRAIN
from purine.caffe.layer import BUILDERS
from purine.caffe.layers.python import Layer, caffe_name_free, provide_caffe
from purine.pycaffe import alias, io, net_spec, proto
from purine.pycaffe.mode import set_device, set_mode_cpu, set_mode_gpu, set_random_seed
from purine.pycaffe.net import Net
from purine.pycaffe.net_spec import NetSpec, layers, params, to_proto
from purine.pycaffe.process import (
    NCCL,
    Timer,
    has_nccl,
    init_log,
    log,
    set_multiprocess,
    set_solver_count,
    set_solver_rank,
    solver_count,
    solver_rank,
)
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

try:
    _purine_version = _dist_version("purine-caffe")
except PackageNotFoundError:  # run from a source tree that was never installed
    _purine_version = "0+unknown"

__all__ = [
    "AdaDeltaSolver", "AdaGradSolver", "AdamSolver", "Classifier", "Detector", "Layer", "NCCL",
    "NesterovSolver", "Net", "RMSPropSolver", "SGDSolver", "Solver", "TEST", "TRAIN", "Timer",
    "get_solver", "has_nccl", "init_log", "install_as_caffe", "io", "layer_type_list", "log",
    "proto", "set_device", "set_mode_cpu", "set_mode_gpu", "set_multiprocess",
    "set_random_seed", "set_solver_count", "set_solver_rank", "solver_count", "solver_rank",
    "NetSpec", "layers", "net_spec", "params", "to_proto",  # net specification (net_spec.py)
]

# BVLC Caffe's pycaffe version, with purine's as a PEP 440 local label: a script that reads
# caffe.__version__ sees 1.0.0, and which Caffe it is.
__version__ = f"1.0.0+purine.{_purine_version}"


_LAZY = {"Classifier": "purine.pycaffe.classifier", "Detector": "purine.pycaffe.detector"}


def __getattr__(name: str):
    """``caffe.Classifier`` and ``caffe.Detector`` load their modules on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'caffe' (purine.pycaffe) has no attribute {name!r}")


def layer_type_list() -> list[str]:
    """The layer types nets can use, sorted (Caffe's LayerRegistry::LayerTypeList)."""
    return sorted(BUILDERS)


def install_as_caffe(force: bool = False) -> bool:
    """Make ``import caffe`` and ``import caffe.<name>`` give this module and its submodules
    (``caffe.io``, ``caffe.proto.caffe_pb2``, ``caffe.net_spec``, ``caffe.coord_map``,
    ``caffe.draw`` ...) from now on, ahead of any ``caffe`` folder on ``sys.path``; returns
    whether they do. An installed Caffe, or another ``caffe`` already imported, is left
    alone unless ``force``. BVLC's source tree before ``make pycaffe`` is no installed Caffe
    (notebooks put its ``python/`` folder on ``sys.path``)."""
    this = sys.modules[__name__]
    current = sys.modules.get("caffe")
    ours = current is this or (current is None and alias.installed())
    if not (force or ours or caffe_name_free()):
        return False
    alias.install()
    return True


# The Python layer builder (below this face) calls this when it loads a user's layer module.
provide_caffe(install_as_caffe)
