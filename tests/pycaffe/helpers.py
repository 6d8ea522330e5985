"""Shared by the pycaffe tests: user layer modules written to a temporary directory the way
a Caffe user keeps them (``import caffe``, ``class X(caffe.Layer)``), and small nets."""

from __future__ import annotations

import itertools
import sys
import textwrap

_count = itertools.count()

# The classic pycaffe layers (Caffe's examples/pycaffe/layers pattern), in our own words.
LAYERS = '''
import json

import numpy as np

import caffe


class DataLayer(caffe.Layer):
    """Regression batches from a fixed pool: x (batch, 4), y = x W^T (batch, 3)."""

    def setup(self, bottom, top):
        if len(top) != 2:
            raise Exception("DataLayer makes two tops: data and target")
        params = json.loads(self.param_str)
        self.batch = params["batch"]
        rng = np.random.default_rng(params["seed"])
        self.x = rng.standard_normal((params.get("pool", 64), 4))
        self.y = self.x @ rng.standard_normal((3, 4)).T
        self.pos = 0

    def reshape(self, bottom, top):
        top[0].reshape(self.batch, 4)
        top[1].reshape(self.batch, 3)

    def forward(self, bottom, top):
        rows = (np.arange(self.batch) + self.pos) % len(self.x)
        top[0].data[...] = self.x[rows]
        top[1].data[...] = self.y[rows]
        self.pos = (self.pos + self.batch) % len(self.x)

    def backward(self, top, propagate_down, bottom):
        pass


class EuclideanLossLayer(caffe.Layer):
    """Half the mean (over the batch) squared distance between two bottoms."""

    def setup(self, bottom, top):
        if len(bottom) != 2:
            raise Exception("EuclideanLossLayer compares two bottoms")

    def reshape(self, bottom, top):
        if bottom[0].count != bottom[1].count:
            raise Exception("the two bottoms must hold as many values")
        self.residual = np.zeros_like(bottom[0].data)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.residual[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = np.sum(self.residual ** 2) / bottom[0].num / 2.0

    def backward(self, top, propagate_down, bottom):
        for i, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[i]:
                bottom[i].diff[...] = sign * self.residual / bottom[i].num


class ScaleShift(caffe.Layer):
    """y = x * w + b along axis 1, w and b learnable (set to 1 and 0 in setup)."""

    def setup(self, bottom, top):
        c = bottom[0].channels
        self.blobs.add_blob(c)
        self.blobs.add_blob(c)
        self.blobs[0].data[...] = 1.0
        self.blobs[1].data[...] = 0.0

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].shape)

    def _expand(self, v, x):
        return v.reshape((1, -1) + (1,) * (x.ndim - 2))

    def forward(self, bottom, top):
        x = bottom[0].data
        w, b = self.blobs[0].data, self.blobs[1].data
        top[0].data[...] = x * self._expand(w, x) + self._expand(b, x)

    def backward(self, top, propagate_down, bottom):
        x, dy = bottom[0].data, top[0].diff
        axes = tuple(i for i in range(x.ndim) if i != 1)
        self.blobs[0].diff[...] += (dy * x).sum(axis=axes)
        self.blobs[1].diff[...] += dy.sum(axis=axes)
        if propagate_down[0]:
            bottom[0].diff[...] = dy * self._expand(self.blobs[0].data, x)


class Times(caffe.Layer):
    """y = k x with k from param_str; may run in place."""

    def setup(self, bottom, top):
        self.k = float(self.param_str)

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.k * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = self.k * top[0].diff


class Recorder(caffe.Layer):
    """Keeps what the net handed it, for the tests to read through net.layers."""

    def setup(self, bottom, top):
        self.seen_param_str = self.param_str
        self.seen_phase = self.phase
        self.calls = ["setup"]
        top[0].reshape(*bottom[0].shape)

    def reshape(self, bottom, top):
        self.calls.append("reshape")

    def forward(self, bottom, top):
        self.calls.append("forward")
        top[0].data[...] = bottom[0].data


class Broken(caffe.Layer):
    def setup(self, bottom, top):
        self.where = self.param_str

    def reshape(self, bottom, top):
        if self.where == "reshape":
            raise KeyError("no such key")
        top[0].reshape(*bottom[0].shape)

    def forward(self, bottom, top):
        if self.where == "forward":
            raise ValueError("bad batch in forward")
        top[0].data[...] = bottom[0].data


class Growing(caffe.Layer):
    """Asks for a bigger top at each pass, and fills it with 0, 1, ..."""

    def setup(self, bottom, top):
        self.n = 2

    def reshape(self, bottom, top):
        top[0].reshape(self.n)

    def forward(self, bottom, top):
        top[0].data[...] = np.arange(self.n)
        self.n += 1


class Shapeless(caffe.Layer):
    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        pass
'''


def write_layers(tmp_path, monkeypatch, source: str = LAYERS) -> str:
    """Write ``source`` as a fresh module on sys.path; returns its name."""
    name = f"user_layers_{next(_count)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def python_layer(name: str, module: str, cls: str, bottoms=(), tops=(), param_str="",
                 extra="") -> str:
    b = " ".join(f'bottom: "{x}"' for x in bottoms)
    t = " ".join(f'top: "{x}"' for x in tops)
    return (f'layer {{ name: "{name}" type: "Python" {b} {t} {extra} python_param {{ '
            f"module: \"{module}\" layer: \"{cls}\" param_str: '{param_str}' }} }}")


def input_layer(top: str, *dims: int) -> str:
    shape = " ".join(f"dim: {d}" for d in dims)
    return f'layer {{ name: "in_{top}" type: "Input" top: "{top}" input_param {{ shape {{ {shape} }} }} }}'
