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
