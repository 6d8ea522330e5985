"""The array module of each location: numpy on ``cpu``, cupy on ``gpu``. Kernels are written
once over an array module ``xp`` and get it from their arrays."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from purine.errors import PurineError
from purine.graph import Location


def array_module(location: Location) -> ModuleType:
    if location.device == "cpu":
        return np
    if location.device == "gpu":
        try:
            import cupy
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise PurineError(
                f"location {location} needs CuPy: install purine-caffe[gpu]"
            ) from e
        return cupy
    raise PurineError(f"unknown device kind '{location.device}' in location {location}")


def get_array_module(*arrays: Any) -> ModuleType:
    """numpy, or cupy when any argument is a cupy array."""
    for a in arrays:
        if type(a).__module__.startswith("cupy"):
            import cupy

            return cupy
    return np


def allocate(location: Location, shape: tuple[int, ...], dtype: str) -> Any:
    xp = array_module(location)
    if location.device == "gpu":
        with xp.cuda.Device(location.index):
            return xp.zeros(shape, dtype=dtype)
    return xp.zeros(shape, dtype=dtype)


class RandomStream:
    """The random numbers of one op: its n-th draw comes from a generator seeded with
    (seed, key, n). The draw count is all the state there is, so a resumed run that restores
    it continues the stream exactly, whatever order ops ran in."""

    def __init__(self, seed: int, key: int):
        self.seed, self.key, self.count = seed, key, 0

    def next(self) -> np.random.Generator:
        g = np.random.default_rng([self.seed, self.key, self.count])
        self.count += 1
        return g
