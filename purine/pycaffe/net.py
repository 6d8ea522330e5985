"""pycaffe's ``caffe.Net``: purine's Net with what pycaffe adds on top (``layers``,
``layer_dict``, ``top_names``/``bottom_names``, ``blob_loss_weights``, ``set_input_arrays``,
``forward_all``, ``forward_backward_all``). Misuse of the calls (an unknown blob or layer, a
value of the wrong shape or kind, a reshape past the host's memory) is refused in one line,
as a PurineError that is also the builtin type pycaffe's own code raises there."""

from __future__ import annotations

import operator
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import zip_longest
from typing import Any

import numpy as np

from purine.backend import is_device_array
from purine.caffe import net as caffe_net
from purine.caffe.layers import data as data_layers
from purine.caffe.layers import python as python_layers
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.pycaffe import mode
from purine.pycaffe.mode import settings


# -- misuse: each a PurineError and the builtin type pycaffe (or numpy under it) raises ---------
class NetArgumentError(PurineError, ValueError):
    """A value of the wrong shape for a blob, inputs of unequal lengths, an unknown layer."""


class NetTypeError(PurineError, TypeError):
    """A value that is no array of numbers (None, a string, a ragged list)."""


class UnknownBlobError(PurineError, KeyError):
    """A blob name the net does not have; a KeyError (as ``net.blobs[name]``), shown plain."""

    __str__ = PurineError.__str__


class BlobSizeError(PurineError, MemoryError):
    """A reshape to more bytes than the host's memory, refused before allocating."""


class PyBlobView(caffe_net.BlobView):
    """``net.blobs[name]`` in pycaffe: its ``reshape`` takes integer sizes only (a string
    or a float is a TypeError naming the blob, as Caffe's Python binding refuses it)."""

    def reshape(self, *shape: int) -> None:
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise NetTypeError(f"blob '{self.name}': reshape{shape!r} needs integer sizes"
                               ) from None
        self._net._reshape_input(self.name, dims)


class LayerView:
    """``net.layers[i]`` for a built-in layer: its ``type`` and parameter ``blobs``. A
    Python layer's entry is the user's own object instead, as in pycaffe."""

    def __init__(self, name: str, type: str, blobs: list[caffe_net.BlobView]):
        self.name, self.type, self.blobs = name, type, blobs

    def __repr__(self) -> str:
        return f"<Layer {self.name} ({self.type})>"


class Net(caffe_net.Net):
    """``caffe.Net(model, phase)``, ``caffe.Net(model, weights, phase)`` or
    ``caffe.Net(model, phase, weights=..., level=..., stages=[...])``. Without a seed a net
    starts from ``set_random_seed``'s, else 0, so its random fillers are reproducible; without
    a location it runs where the mode says (``set_mode_gpu`` and ``set_device``)."""

    def __init__(self, model: str | os.PathLike | pb.NetParameter, *args: Any,
                 weights: str | os.PathLike | None = None, phase: int | str | None = None,
                 level: int = 0, stages: Sequence[str] | None = None, seed: int | None = None,
                 **kwargs: Any):
        if seed is None:
            seed = settings.seed if settings.seed is not None else 0
        kwargs.setdefault("location", mode.location())
        super().__init__(model, *args, weights=None if weights is None else os.fspath(weights),
                         phase=phase, level=level, stages=tuple(stages or ()), seed=seed,
                         **kwargs)
        self._pycaffe_views()

    def _pycaffe_views(self) -> None:
        """``blobs`` as pycaffe's views (a stubbed build may have made none)."""
        if hasattr(self, "blobs"):
            self.blobs = OrderedDict((n, PyBlobView(self, n)) for n in self.blobs)
            self.params = OrderedDict(
                (layer, [PyBlobView(self, v.name, layer, k) for k, v in enumerate(views)])
                for layer, views in self.params.items())

    @classmethod
    def adopt(cls, net: caffe_net.Net) -> Net:
        """Give a net purine made (a solver's train and test nets) this class's methods,
        as pycaffe patches its methods onto every C++ Net; no state is added."""
        if not isinstance(net, cls):
            net.__class__ = cls
            net._pycaffe_views()
        return net

    # -- checked calls -------------------------------------------------------------------
    def _known(self, what: str, names: Any) -> list[str]:
        """``names`` (None, or a list of blob names) as a list, each a blob of the net."""
        if names is None:
            return []
        if isinstance(names, str) or not isinstance(names, Sequence | set):
            raise NetTypeError(f"{what}: expected a list of blob names, got {names!r}")
        for n in names:
            if not isinstance(n, str) or n not in self.blobs:
                raise UnknownBlobError(f"{what}: net '{self.model.name}' has no blob {n!r}")
        return list(names)

    def _value(self, what: str, name: str, value: Any, shape: tuple[int, ...] | None,
               batch: bool = False) -> Any:
        """``value`` for blob ``name`` as an array of numbers of ``shape`` (with ``batch``:
        any length, then ``shape[1:]``), or a one-line error naming the blob."""
        if not isinstance(name, str) or name not in self.blobs:
            raise UnknownBlobError(f"{what}: net '{self.model.name}' has no blob {name!r}")
        if is_device_array(value):
            arr = value
        else:
            if value is None or isinstance(value, str | bytes):
                raise NetTypeError(f"{what}: blob '{name}' needs an array, got {value!r}")
            try:
                arr = np.asarray(value)
            except (TypeError, ValueError) as e:  # a ragged list
                raise NetTypeError(f"{what}: blob '{name}' needs an array, got "
                                   f"{type(value).__name__} ({e})") from None
            if arr.dtype.kind not in "biuf":
                raise NetTypeError(f"{what}: blob '{name}' needs numbers, got an array of "
                                   f"dtype {arr.dtype}")
        got = tuple(arr.shape)
        want = self.blobs[name].shape if shape is None else shape
        kind = "input" if what.startswith("forward") else "diff"
        if batch and (len(got) != len(want) or got[1:] != tuple(want[1:])):
            raise NetArgumentError(f"{what}: blob '{name}' takes items of shape "
                                   f"{tuple(want[1:])}, the {kind} has {got}")
        if not batch and got != tuple(want):
            raise NetArgumentError(f"{what}: blob '{name}' has shape {tuple(want)}, the {kind} "
                                   f"has {got}")
        return arr

    def _layer_index(self, name: str | None, default: int) -> int:
        if name is not None and (not isinstance(name, str) or name not in self.layer_names):
            raise NetArgumentError(f"no layer named {name!r} in net '{self.model.name}'")
        return super()._layer_index(name, default)

    def forward(self, blobs: Sequence[str] | None = None, start: str | None = None,
                end: str | None = None, **kwargs: np.ndarray) -> dict[str, np.ndarray]:
        """pycaffe's forward: ``kwargs`` name blobs (inputs) and give their values."""
        blobs = self._known("forward", blobs)
        values = {n: self._value("forward", n, v, None) for n, v in kwargs.items()}
        return super().forward(blobs, start, end, **values)

    def backward(self, diffs: Sequence[str] | None = None, start: str | None = None,
                 end: str | None = None, **kwargs: np.ndarray) -> dict[str, np.ndarray]:
        """pycaffe's backward: ``kwargs`` name blobs (outputs) and give their diffs, checked
        against the blob's shape as forward checks its inputs."""
        diffs = self._known("backward", diffs)
        values = {n: self._value("backward", n, v, None) for n, v in kwargs.items()}
        return super().backward(diffs, start, end, **values)

    def _check_reshape_bytes(self, name: str, shape: tuple[int, ...]) -> None:
        try:
            super()._check_reshape_bytes(name, shape)
        except PurineError as e:
            raise BlobSizeError(str(e)) from None

    def _reshape_input(self, name: str, shape: tuple[int, ...]) -> None:
        """As the core net's, its errors in the builtin types pycaffe users catch."""
        try:
            super()._reshape_input(name, shape)
        except PurineError as e:
            if isinstance(e, ValueError | MemoryError):
                raise
            raise NetArgumentError(str(e)) from None

    # -- pycaffe's views of the layers --------------------------------------------------
    @property
    def layers(self) -> list[Any]:
        out, b = [], self.whole
        for L in b.layers:
            obj = python_layers.layer_object(L, b.dispatcher.array)
            out.append(obj if obj is not None
                       else LayerView(L.name, L.type, self.params.get(L.name, [])))
        return out

    @property
    def _layer_names(self) -> list[str]:
        return list(self.layer_names)

    @property
    def _blob_names(self) -> list[str]:
        return list(self.blobs)

    @property
    def layer_dict(self) -> OrderedDict[str, Any]:
        return OrderedDict(zip(self.layer_names, self.layers))

    @property
    def top_names(self) -> OrderedDict[str, list[str]]:
        return OrderedDict((L.name, list(L.param.top)) for L in self.whole.layers)

    @property
    def bottom_names(self) -> OrderedDict[str, list[str]]:
        return OrderedDict((L.name, list(L.param.bottom)) for L in self.whole.layers)

    @property
    def blob_loss_weights(self) -> OrderedDict[str, float]:
        weights = {L.param.top[j]: w for L in self.whole.layers
                   for j, w in enumerate(L.loss_weights)}
        return OrderedDict((n, float(weights.get(n, 0.0))) for n in self.blobs)

    # -- feeding and batching ---------------------------------------------------------
    def set_input_arrays(self, data: np.ndarray, labels: np.ndarray) -> None:
        """Feed the MemoryData layer: (N, C, H, W) data and N labels ((N,) or
        (N, 1, 1, 1)), N a multiple of its batch size."""
        data_layers.set_input_arrays(self, data, labels)

    def _batches(self, what: str, blobs: dict[str, Any]) -> dict[str, np.ndarray]:
        """``blobs`` checked for batching: known blobs, arrays of numbers whose axes past the
        first are the blob's, all of one length."""
        out = {n: self._value(what, n, v, None, batch=True) for n, v in blobs.items()}
        lengths = {n: len(v) for n, v in out.items()}
        if len(set(lengths.values())) > 1:
            raise NetArgumentError(f"{what}: the inputs differ in length: " + ", ".join(
                f"'{n}' {k}" for n, k in lengths.items()))
        for n, v in out.items():
            if len(v) and self.blobs[n].shape[0] == 0:
                raise NetArgumentError(f"{what}: blob '{n}' has batch size 0; {len(v)} "
                                       "items cannot be cut into batches of it")
        return out

    def _batch(self, blobs: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """Batches of the blobs' batch size; the last one padded with zeros."""
        first = next(iter(blobs))
        num, size = len(blobs[first]), self.blobs[first].shape[0]
        for i in range(0, num - num % size, size):
            yield {name: v[i:i + size] for name, v in blobs.items()}
        rest = num % size
        if rest:
            yield {name: np.concatenate([np.asarray(v[-rest:]),
                                         np.zeros((size - rest,) + np.shape(v)[1:])])
                   for name, v in blobs.items()}

    def forward_all(self, blobs: Sequence[str] | None = None, **kwargs: np.ndarray
                    ) -> dict[str, np.ndarray]:
        """``forward`` over the inputs in batches; the outputs (and ``blobs``) of all of
        them, without the padding of the last batch."""
        blobs = self._known("forward_all", blobs)
        kwargs = self._batches("forward_all", kwargs)
        names = set(self.outputs) | set(blobs)
        outs: dict[str, list] = {n: [] for n in names}
        batches = self._batch(kwargs) if kwargs else iter([{}])
        for batch in batches:
            got = self.forward(blobs=blobs, **batch)
            for n in names:
                outs[n].extend(np.array(got[n] if n in got else self.blobs[n].data))
        result = {n: _stack(v, self.blobs[n].shape) for n, v in outs.items()}
        return _unpad(result, kwargs)

    def forward_backward_all(self, blobs: Sequence[str] | None = None,
                             diffs: Sequence[str] | None = None, **kwargs: np.ndarray
                             ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """forward then backward per batch: inputs for forward and output diffs for
        backward are both taken from ``kwargs``."""
        blobs = self._known("forward_backward_all", blobs)
        diffs = self._known("forward_backward_all", diffs)
        for n in kwargs:
            if n not in self.inputs and n not in self.outputs:
                raise UnknownBlobError(f"forward_backward_all: {n!r} is neither an input "
                                       f"({', '.join(self.inputs)}) nor an output "
                                       f"({', '.join(self.outputs)}) of net "
                                       f"'{self.model.name}'")
        kwargs = self._batches("forward_backward_all", kwargs)
        out_names = set(self.outputs) | set(blobs)
        diff_names = set(self.inputs) | set(diffs)
        outs: dict[str, list] = {n: [] for n in out_names}
        grads: dict[str, list] = {n: [] for n in diff_names}
        fwd = {n: kwargs[n] for n in self.inputs if n in kwargs}
        bwd = {n: kwargs[n] for n in self.outputs if n in kwargs}
        fb = self._batch(fwd) if fwd else iter([{}])
        bb = self._batch(bwd) if bwd else iter([{}])
        for f, b in zip_longest(fb, bb, fillvalue={}):
            got = self.forward(blobs=blobs, **f)
            back = self.backward(diffs=diffs, **b)
            for n in out_names:
                outs[n].extend(np.array(got[n] if n in got else self.blobs[n].data))
            for n in diff_names:
                grads[n].extend(np.array(back[n] if n in back else self.blobs[n].diff))
        return (_unpad({n: _stack(v, self.blobs[n].shape) for n, v in outs.items()}, kwargs),
                _unpad({n: _stack(v, self.blobs[n].shape) for n, v in grads.items()}, kwargs))


def _stack(items: list, shape: tuple[int, ...]) -> np.ndarray:
    """The rows of a batched result; none (no input rows) as an empty array of the blob's
    row shape."""
    return np.asarray(items) if items else np.zeros((0,) + tuple(shape[1:]), np.float32)


def _unpad(result: dict[str, np.ndarray], kwargs: dict[str, np.ndarray]
           ) -> dict[str, np.ndarray]:
    if not kwargs or not result:
        return result
    want = len(next(iter(kwargs.values())))
    have = len(next(iter(result.values())))
    if have < want:
        raise PurineError(f"forward_all: {have} results for {want} inputs")
    return {n: v[:want] for n, v in result.items()}
