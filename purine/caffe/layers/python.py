"""The ``Python`` layer: a user's class (pycaffe's ``caffe.Layer``) named by ``python_param``
run as graph ops, and the blob objects its methods see. Set-up and the first reshape run at
the net's first build and give the top shapes; then, at every pass, the net calls
``reshape`` right before the forward op (the layer settles its shapes, see
purine.caffe.layer.Settler), and goes on in its build for the shapes it gave, as Caffe calls
Reshape before Forward; a top reshaped in ``forward`` moves the pass to the build for that
shape too. The forward op calls ``forward``, the backward op ``backward``, with the blobs'
arrays bound to the net's storage. Every build of the net uses the one user's object."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from purine.backend import to_host
from purine.caffe.layer import LayerBuild, LegacyAxes, Settler, register
from purine.errors import LayerError, from_user_code
from purine.formats import caffe_pb2 as pb
from purine.graph import Blob


class PyBlob(LegacyAxes):
    """A blob as a Python layer sees it (pycaffe's ``Blob``): ``data`` and ``diff`` arrays,
    ``shape``, the legacy ``num``/``channels``/``height``/``width``, ``count``, ``reshape``.

    While bound to the net's storage its shape is the graph's; ``reshape`` to another shape
    gives it an array of its own, which the net moves into its build for that shape. A
    parameter blob keeps its shape (as in Caffe, parameters never change shape)."""

    def __init__(self, shape: Sequence[int] | None = None, dtype: Any = np.float32,
                 name: str = ""):
        self.name = name
        self._shape = None if shape is None else tuple(int(d) for d in shape)
        self._dtype = np.dtype(dtype)
        self._data: Any = None
        self._diff: Any = None
        self._spare_diff: Any = None  # a diff no gradient blob stands behind
        self._graph = False  # the data is the graph's array (bound, not reshaped since)
        self._fixed: str | None = None  # a parameter blob's layer: its shape is fixed

    # -- arrays ------------------------------------------------------------------------
    @property
    def data(self) -> Any:
        if self._data is None:
            self._data = np.zeros(self._shape if self._shape is not None else (0,),
                                  self._dtype)
        return self._data

    @property
    def diff(self) -> Any:
        if self._diff is None:
            self._diff = self._spare(zero=False)
        return self._diff

    def _spare(self, zero: bool) -> Any:
        shape = self._shape if self._shape is not None else (0,)
        s = self._spare_diff
        if s is None or s.shape != shape:
            s = self._spare_diff = np.zeros(shape, self._dtype)
        elif zero:
            s[...] = 0
        return s

    def _bind(self, data: Any, diff: Any = None) -> None:
        self._data, self._diff = data, diff
        self._shape, self._graph = tuple(data.shape), True

    # -- shape -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape if self._shape is not None else ()

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def reshape(self, *shape: int) -> None:
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        new = tuple(int(d) for d in shape)
        if any(d < 0 for d in new):
            raise ValueError(f"blob '{self.name}': negative dimension in reshape{new}")
        if new == self._shape:
            return
        if self._fixed is not None:
            raise LayerError(self._fixed, "Python", f"reshape of parameter blob '{self.name}' "
                             f"from {self.shape} to {new}: parameters keep their shapes")
        self._shape, self._graph = new, False
        self._data = self._diff = self._spare_diff = None

    def __repr__(self) -> str:
        return f"<PyBlob {self.name} {self.shape}>"


class BlobVec(list):
    """pycaffe's ``layer.blobs``: a list of blobs; ``add_blob(*shape)`` appends a zero blob
    that becomes one of the layer's learnable parameters."""

    def add_blob(self, *shape: int) -> None:
        b = PyBlob(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list)
                   else shape, np.float32, name=f"blobs[{len(self)}]")
        b.data  # noqa: B018 - allocated now, so set-up code can fill it
        self.append(b)


class Phase(int):
    """A Python layer's ``self.phase``: equal to ``caffe.TRAIN`` (0) or ``caffe.TEST`` (1),
    and printed as its name, as pycaffe's Phase enum (research code indexes its config by
    ``str(self.phase)``)."""

    def __str__(self) -> str:
        return pb.Phase.Name(int(self))

    def __repr__(self) -> str:
        return f"caffe.{self}"


class Layer:
    """pycaffe's ``caffe.Layer``: subclass it and define ``setup(bottom, top)``,
    ``reshape(bottom, top)``, ``forward(bottom, top)`` and ``backward(top, propagate_down,
    bottom)``. Before ``setup`` the net sets ``self.param_str`` (python_param.param_str, also
    as ``self.param_str_``, the name the Fast/Faster R-CNN fork gives it) and ``self.phase``
    (a ``Phase``: 0 TRAIN, 1 TEST); parameters go in ``self.blobs`` via ``add_blob``."""

    type = "Python"

    def __init__(self, param: pb.LayerParameter | None = None):
        # Caffe constructs the class with the layer's LayerParameter.
        self.blobs = BlobVec()
        self.param_str = param.python_param.param_str if param is not None else ""
        self.param_str_ = self.param_str
        self.phase = Phase(pb.TRAIN)

    def setup(self, bottom: list[PyBlob], top: list[PyBlob]) -> None:
        pass

    def reshape(self, bottom: list[PyBlob], top: list[PyBlob]) -> None:
        pass

    def forward(self, bottom: list[PyBlob], top: list[PyBlob]) -> None:
        raise NotImplementedError(f"{type(self).__name__} defines no forward(bottom, top)")

    def backward(self, top: list[PyBlob], propagate_down: list[bool],
                 bottom: list[PyBlob]) -> None:
        raise NotImplementedError(f"{type(self).__name__} defines no "
                                  "backward(top, propagate_down, bottom)")


class _Instance(Settler):
    """One Python layer in one net, the same in all its builds: the user's object and the
    blob objects it is handed. As a Settler, it settles the layer's top shapes at each pass:
    ``reshape`` before the forward op, and what ``forward`` reshaped after it."""

    reshapes_in_forward = True

    def __init__(self, layer: str, obj: Any, where: str, bottoms: list[PyBlob],
                 tops: list[PyBlob], blobs: list[PyBlob]):
        self.layer, self.obj, self.where = layer, obj, where
        self.bottoms, self.tops, self.blobs = bottoms, tops, blobs
        self.settled = False  # reshape ran for the coming forward op

    def before(self, bottoms: list[Any]) -> tuple[tuple[int, ...], ...]:
        for w, a in zip(self.bottoms, bottoms):
            w._bind(to_host(a))  # a GPU net's blob: the layer computes with numpy
        _call(self.layer, self.where, self.obj, "reshape", self.bottoms, self.tops)
        self.settled = True
        return tuple(w.shape for w in self.tops)

    def after(self) -> tuple[tuple[tuple[int, ...], ...], list[Any]] | None:
        if all(w._graph for w in self.tops):
            return None
        return tuple(w.shape for w in self.tops), [w.data for w in self.tops]


class _Wiring:
    """The graph blobs a Python layer's blob objects stand for in one build of the net."""

    def __init__(self, inst: _Instance):
        self.inst = inst
        self.bottoms: list[Blob] = []
        self.tops: list[Blob] = []
        self.params: list[Blob] = []
        self.param_grads: list[Blob] = []


_WIRING: weakref.WeakKeyDictionary[LayerBuild, _Wiring] = weakref.WeakKeyDictionary()


def layer_object(L: LayerBuild, array: Callable[[Blob], Any]) -> Any | None:
    """The user's object of Python layer ``L`` (None for other layers), its blobs bound to
    the net's arrays (``array(blob)``), so ``net.layers[i].blobs[k].data`` is the parameter."""
    wiring = _WIRING.get(L)
    if wiring is None:
        return None
    inst = wiring.inst
    for w, b in zip(inst.bottoms, wiring.bottoms):
        w._bind(array(b))
    for w, b in zip(inst.tops, wiring.tops):
        w._bind(array(b))
    for w, b, g in zip(inst.blobs, wiring.params, wiring.param_grads):
        w._bind(array(b), array(g))
    return inst.obj


# -- the `caffe` module a user's layer module imports ----------------------------------------
# The pycaffe face (purine.pycaffe) registers its install_as_caffe here when it is imported:
# the builder calls what the layer above provided and never imports it. A net built while
# that face is not loaded (through purine.caffe or the CLI) gets a stand-in `caffe` that
# offers what a layer module takes from it: Layer, TRAIN, TEST and proto.caffe_pb2.
_caffe_installer: Callable[[], bool] | None = None
STANDIN = "__purine_python_layer_standin__"  # marks the stand-in, which pycaffe may replace


def provide_caffe(install: Callable[[], bool]) -> None:
    """Register the function that makes ``import caffe`` work inside a Python layer's
    module; purine.pycaffe registers its ``install_as_caffe`` when it is imported."""
    global _caffe_installer
    _caffe_installer = install


def installed_caffe() -> str | None:
    """The folder of a Caffe importable as ``caffe`` from ``sys.path``, or None. BVLC's
    source tree before ``make pycaffe`` (``python/caffe`` with ``_caffe.cpp`` but no compiled
    ``_caffe``, which cannot be imported) and folders without ``__init__.py`` are none; any
    other ``caffe`` package counts as installed."""
    spec = importlib.machinery.PathFinder.find_spec("caffe")
    if spec is None or spec.origin in (None, "namespace"):
        return None
    for folder in spec.submodule_search_locations or ():
        here = Path(folder)
        unbuilt = (here / "_caffe.cpp").is_file() and not any(
            p.suffix in (".so", ".pyd", ".dylib") for p in here.glob("_caffe*"))
        if not unbuilt:
            return folder
    return None


def caffe_name_free() -> bool:
    """Whether ``import caffe`` may be pointed at purine: no ``caffe`` is imported (but the
    stand-in) and no Caffe is installed (``installed_caffe``)."""
    current = sys.modules.get("caffe")
    if current is not None:
        return bool(getattr(current, STANDIN, False))
    return installed_caffe() is None


def _standin_getattr(name: str) -> Any:
    raise AttributeError(f"caffe.{name}: while purine.pycaffe is not imported, `import caffe` "
                         "in a Python layer's module gives a stand-in with Layer, TRAIN, TEST "
                         "and proto only; import purine.pycaffe before building the net for "
                         "the whole pycaffe API")


def _install_standin() -> None:
    caffe = types.ModuleType("caffe", "purine's stand-in `caffe` for Python layer modules")
    proto = types.ModuleType("caffe.proto")
    proto.caffe_pb2 = pb  # type: ignore[attr-defined]
    caffe.__dict__.update({"Layer": Layer, "TRAIN": pb.TRAIN, "TEST": pb.TEST, "proto": proto,
                           STANDIN: True, "__getattr__": _standin_getattr})
    sys.modules.update({"caffe": caffe, "caffe.proto": proto, "caffe.proto.caffe_pb2": pb})


def _import_caffe() -> None:
    """A user's module says ``import caffe``: let that resolve to purine's pycaffe face (or
    the stand-in) when no real Caffe is installed; an installed Caffe is never replaced."""
    if _caffe_installer is not None:
        _caffe_installer()
    elif caffe_name_free() and "caffe" not in sys.modules:
        _install_standin()


def _load(L: LayerBuild, module: str, name: str) -> type:
    _import_caffe()
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise L.error(f"cannot import python_param.module '{module}': "
                      f"{type(e).__name__}: {e} (the module is looked up on sys.path; add "
                      "its directory to PYTHONPATH)") from e
    except Exception as e:
        raise L.error(f"importing python_param.module '{module}' raised "
                      f"{type(e).__name__}: {e}") from e
    cls = getattr(mod, name, None)
    if cls is None:
        where = getattr(mod, "__file__", None) or module
        raise L.error(f"module '{module}' ({where}) has no class '{name}' "
                      "(python_param.layer)")
    return cls


def _set_up(L: LayerBuild, where: str) -> _Instance:
    """Make the user's object, call its ``setup`` and ``reshape`` (Caffe's SetUp) and give
    the tops their first shapes."""
    p = L.param.python_param
    cls = _load(L, p.module, p.layer)
    try:
        obj = cls(L.param)
    except Exception as e:
        from_user_code(e, f"Python layer '{L.param.name}' ({where}(param))")
        raise
    if not isinstance(getattr(obj, "blobs", None), BlobVec):
        obj.blobs = BlobVec()
    obj.param_str = obj.param_str_ = p.param_str
    obj.phase = Phase(L.phase)
    # share_in_parallel only matters to Caffe's multi-GPU workers, which share one object
    # per layer here anyway.
    dtype = np.dtype(L.net.dtype)
    bottoms = [PyBlob(b.shape, dtype, name) for b, name in zip(L.bottoms, L.param.bottom)]
    tops = []
    for name in L.param.top:
        if name in L.param.bottom:  # in place: the top is the bottom's blob, as in Caffe
            tops.append(bottoms[list(L.param.bottom).index(name)])
        else:
            tops.append(PyBlob(None, dtype, name))
    _call(L.name, where, obj, "setup", bottoms, tops)
    _call(L.name, where, obj, "reshape", bottoms, tops)
    for w in tops:
        if w._shape is None:
            raise L.error(f"{where}.reshape did not give top '{w.name}' a shape; call "
                          f"top[i].reshape(...) in setup or reshape")
    inst = _Instance(L.name, obj, where, bottoms, tops, list(obj.blobs))
    L.share("python", inst)
    return inst


def _call(layer: str, where: str, obj: Any, method: str, *args: Any) -> None:
    fn = getattr(obj, method, None)
    if fn is None:
        raise LayerError(layer, "Python", f"{where} has no {method}() method")
    try:
        fn(*args)
    except LayerError:
        raise
    except Exception as e:  # the layer's own exception type reaches the caller, as in Caffe
        from_user_code(e, f"Python layer '{layer}' ({where}.{method})")
        raise


@register("Python")
def python_layer(L: LayerBuild):
    p = L.param.python_param
    if not p.module or not p.layer:
        raise L.error("python_param needs both 'module' and 'layer' (the class name)")
    where = f"{p.module}.{p.layer}"
    inst: _Instance | None = L.kept("python")
    if inst is None:  # the net's first build: the user's object is made and set up
        inst = _set_up(L, where)
    # Another build, for the shapes a pass settled, uses the same object (set up already).
    shapes = L.decided() or tuple(w.shape for w in inst.tops)
    obj, bottoms, tops = inst.obj, inst.bottoms, inst.tops
    dtype = np.dtype(L.net.dtype)
    wiring = _Wiring(inst)
    for w in inst.blobs:
        b = L.add_param(w.shape, None)
        if b in L.net.initial and b.meta.get("layer") == L.name:
            L.net.initial[b] = np.array(w.data, dtype=dtype)  # what setup put there
        wiring.params.append(b)
        wiring.param_grads.append(L.net.param_grad(b))
        w._fixed = L.name
    wiring.bottoms = list(L.bottoms)
    wiring.tops = [L.top(i, shape) for i, shape in enumerate(shapes)]
    _WIRING[L] = wiring
    L.settles(inst)
    nb, nk = len(bottoms), len(inst.blobs)

    def check_blobs() -> None:
        if len(obj.blobs) != nk:
            raise L.error(f"{where} has {len(obj.blobs)} blobs now and had {nk} after set-up; "
                          "add parameter blobs in setup only")

    def python_forward(*arrays: Any) -> None:
        for w, a in zip(bottoms, arrays[:nb]):
            w._bind(a)
        for w, a in zip(inst.blobs, arrays[nb:nb + nk]):
            w._bind(a)
        for w, a in zip(tops, arrays[nb + nk:]):
            if inst.settled and w._data is not None and w._data is not a \
                    and w._data.shape == a.shape:
                a[...] = w._data  # what reshape() wrote in the top (Caffe keeps it)
            w._bind(a)
        if not inst.settled:
            # Run outside a pass that settles shapes (a data-parallel replica, a worker of
            # an asynchronous solver, the time command): reshape here, as Caffe's net does
            # right before Forward (data layers often load the next item there), in the
            # shapes of this build.
            _call(L.name, where, obj, "reshape", bottoms, tops)
            moved = [w for w in tops if not w._graph]
            if moved:
                w = moved[0]
                raise L.error(f"reshape() gave top '{w.name}' the shape {w.shape}, but where "
                              "this layer runs (a data-parallel replica, an asynchronous "
                              "worker, the time command) the net's shapes stay those it was "
                              f"built with: {tuple(wiring.tops[tops.index(w)].shape)}")
        inst.settled = False
        check_blobs()
        _call(L.name, where, obj, "forward", bottoms, tops)

    L.forward(python_forward, list(L.bottoms) + wiring.params, wiring.tops,
              op_type="Python")

    def backward():
        need = [L.needs_diff(i) for i in range(nb)]
        pneed = [L.needs_param_diff(k) for k in range(nk)]
        top_diffs = [L.top_diff(i) for i in range(len(tops))]
        bottom_diffs = [L.bottom_diff(i) for i in range(nb) if need[i]]
        param_diffs = [L.param_diff(k) for k in range(nk) if pneed[k]]
        nt = len(tops)

        def python_backward(*arrays: Any) -> None:
            ins = arrays[:nb + 2 * nt + nk]
            outs = iter(arrays[nb + 2 * nt + nk:])
            for w, a in zip(bottoms, ins[:nb]):
                w._bind(a)
            for w, a, d in zip(tops, ins[nb:nb + nt], ins[nb + nt:nb + 2 * nt]):
                w._bind(a, d)
            for i, w in enumerate(bottoms):
                if need[i]:
                    d = next(outs)
                    # Gradients overwrite; an in-place layer reads its top diff from it.
                    if not any(d is a for a in ins):
                        d[...] = 0
                    w._diff = d
                elif w not in tops:
                    w._diff = w._spare(zero=True)
            for k, w in enumerate(inst.blobs):
                d = next(outs) if pneed[k] else w._spare(zero=True)
                d[...] = 0  # Caffe clears parameter diffs before each pass
                w._bind(ins[nb + 2 * nt + k], d)
            check_blobs()
            _call(L.name, where, obj, "backward", tops, list(need), bottoms)

        L.backward(python_backward, list(L.bottoms) + wiring.tops + top_diffs
                   + wiring.params, bottom_diffs + param_diffs, op_type="PythonBackward")
    return backward
