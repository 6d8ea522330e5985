"""pycaffe's ``caffe.Net``: purine's Net with what pycaffe adds on top (``layers``,
``layer_dict``, ``top_names``/``bottom_names``, ``blob_loss_weights``, ``set_input_arrays``,
``forward_all``, ``forward_backward_all``)."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import zip_longest
from typing import Any

import numpy as np

from purine.caffe import net as caffe_net
from purine.caffe.layers import data as data_layers
from purine.caffe.layers import python as python_layers
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.pycaffe import mode
from purine.pycaffe.mode import settings


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

    @classmethod
    def adopt(cls, net: caffe_net.Net) -> Net:
        """Give a net purine made (a solver's train and test nets) this class's methods,
        as pycaffe patches its methods onto every C++ Net; no state is added."""
        if not isinstance(net, cls):
            net.__class__ = cls
        return net

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

    def _batch(self, blobs: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """Batches of the net's batch size; the last one padded with zeros."""
        num = len(next(iter(blobs.values())))
        size = next(iter(self.blobs.values())).num
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
        names = set(self.outputs) | set(blobs or [])
        outs: dict[str, list] = {n: [] for n in names}
        batches = self._batch(kwargs) if kwargs else iter([{}])
        for batch in batches:
            got = self.forward(blobs=list(blobs or []), **batch)
            for n in names:
                outs[n].extend(np.array(got[n] if n in got else self.blobs[n].data))
        result = {n: np.asarray(v) for n, v in outs.items()}
        return _unpad(result, kwargs)

    def forward_backward_all(self, blobs: Sequence[str] | None = None,
                             diffs: Sequence[str] | None = None, **kwargs: np.ndarray
                             ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """forward then backward per batch: inputs for forward and output diffs for
        backward are both taken from ``kwargs``."""
        out_names = set(self.outputs) | set(blobs or [])
        diff_names = set(self.inputs) | set(diffs or [])
        outs: dict[str, list] = {n: [] for n in out_names}
        grads: dict[str, list] = {n: [] for n in diff_names}
        fwd = {n: kwargs[n] for n in self.inputs if n in kwargs}
        bwd = {n: kwargs[n] for n in self.outputs if n in kwargs}
        fb = self._batch(fwd) if fwd else iter([{}])
        bb = self._batch(bwd) if bwd else iter([{}])
        for f, b in zip_longest(fb, bb, fillvalue={}):
            got = self.forward(blobs=list(blobs or []), **f)
            back = self.backward(diffs=list(diffs or []), **b)
            for n in out_names:
                outs[n].extend(np.array(got[n] if n in got else self.blobs[n].data))
            for n in diff_names:
                grads[n].extend(np.array(back[n] if n in back else self.blobs[n].diff))
        return (_unpad({n: np.asarray(v) for n, v in outs.items()}, kwargs),
                _unpad({n: np.asarray(v) for n, v in grads.items()}, kwargs))


def _unpad(result: dict[str, np.ndarray], kwargs: dict[str, np.ndarray]
           ) -> dict[str, np.ndarray]:
    if not kwargs or not result:
        return result
    want = len(next(iter(kwargs.values())))
    have = len(next(iter(result.values())))
    if have < want:
        raise PurineError(f"forward_all: {have} results for {want} inputs")
    return {n: v[:want] for n, v in result.items()}
