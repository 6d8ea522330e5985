"""The MemoryData layer's source: arrays fed from Python (pycaffe's set_input_arrays, Caffe's
MemoryDataLayer::Reset) or images transformed on the way in (Caffe's AddMatVector); each
forward takes the next batch_size rows, wrapping at the end."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from purine.data import DataError
from purine.data.datum import chw
from purine.data.transformer import Transformer


class MemoryFeed:
    """The rows fed to one MemoryData layer and the position of the next batch."""

    def __init__(self, name: str, batch_size: int, shape: tuple[int, int, int], dtype: str,
                 transformer: Transformer, seed: int = 0, index: int = 0):
        self.name, self.batch_size, self.shape = name, batch_size, tuple(shape)
        self.dtype, self.transformer = np.dtype(dtype), transformer
        self.seed, self.index = seed, index
        self.data: np.ndarray | None = None
        self.labels: np.ndarray | None = None
        self.pos = 0
        self.added = 0  # how many add_images calls, for their random draws

    def _check(self, n: int, labels_n: int) -> None:
        if n != labels_n:
            raise DataError(f"MemoryData layer '{self.name}': data and labels must have the "
                            f"same first dimension, got {n} and {labels_n}")
        if n == 0 or n % self.batch_size:
            raise DataError(f"MemoryData layer '{self.name}': the first dimension of the input "
                            f"arrays ({n}) must be a positive multiple of the batch size "
                            f"{self.batch_size}")

    def set_arrays(self, data: np.ndarray, labels: np.ndarray) -> None:
        """Feed (N, C, H, W) data and N labels as they are (Caffe's Reset does not
        transform); they are read at every forward, so later changes to them show."""
        data, labels = np.asarray(data), np.asarray(labels)
        if data.ndim != 4 or data.shape[1:] != self.shape:
            raise DataError(f"MemoryData layer '{self.name}': data array of shape {data.shape};"
                            f" expected (N,) + {self.shape} (channels, height, width)")
        if labels.ndim not in (1, 4) or labels.shape[1:] not in ((), (1, 1, 1)):
            raise DataError(f"MemoryData layer '{self.name}': labels array of shape "
                            f"{labels.shape}; expected (N,) or (N, 1, 1, 1)")
        self._check(len(data), len(labels))
        self.data = data if data.dtype == self.dtype else data.astype(self.dtype)
        self.labels = labels.reshape(len(labels))
        self.pos = 0

    def add_images(self, images: Sequence[np.ndarray], labels: Sequence[int]) -> None:
        """Caffe's AddMatVector: OpenCV images ((H, W) or (H, W, C) uint8) transformed by the
        layer's transform_param into the layer's (C, H, W)."""
        self._check(len(images), len(labels))
        ims = [chw(np.asarray(im)) for im in images]
        out = np.empty((len(ims),) + self.shape, self.dtype)
        rng = (np.random.default_rng([self.seed, self.index, self.added])
               if self.transformer.random else None)
        self.added += 1
        self.transformer(ims, out, rng, lambda i: f"MemoryData layer '{self.name}': image {i}")
        self.data, self.labels = out, np.asarray(labels, self.dtype)
        self.pos = 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        if self.data is None:
            raise DataError(f"MemoryData layer '{self.name}' has no data: call "
                            "set_input_arrays (or add_images) before the forward pass")
        i, b = self.pos % len(self.data), self.batch_size
        self.pos = (i + b) % len(self.data)
        return self.data[i:i + b], self.labels[i:i + b]

    def state(self) -> dict:
        return {"pos": self.pos, "added": self.added}

    def restore(self, state: dict) -> None:
        pos, added = int(state["pos"]), int(state.get("added", 0))
        if pos < 0 or added < 0:  # a draw count or a row: never negative
            raise DataError(f"MemoryData layer '{self.name}': pos {pos} and added {added}; "
                            "both are 0 or more")
        self.pos, self.added = pos, added
