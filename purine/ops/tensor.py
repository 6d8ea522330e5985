"""Whole-blob kernels: fill, copy, sum; and the cache of the fused elementwise kernels that
the GPU paths of the other op modules launch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from purine.backend import assign, copy_array, is_device_array

Array = Any


def fill(y: Array, *, value: float) -> None:
    y[...] = value


def fill_random(y: Array, *, draw: Callable[[], Any]) -> None:
    """``draw`` makes the values on the host (one random stream wherever ``y`` lives)."""
    assign(y, draw())


def copy(x: Array, y: Array) -> None:
    """The Copy op: within one memory space or between the host and a device, or two."""
    copy_array(x, y)


def sum(*arrays: Array) -> None:  # noqa: A001 - the op is Caffe's Sum
    """The last array is the output: the sum of all the others."""
    *xs, y = arrays
    y[...] = xs[0]
    for x in xs[1:]:
        y += x


def accumulate(x: Array, acc: Array, acc_out: Array) -> None:  # noqa: ARG001
    """acc += x (``acc_out`` is ``acc``)."""
    acc_out += x


def add_scalar(x: Array, y: Array, *, value: float) -> None:
    y[...] = x + value


# -- fused elementwise kernels on a GPU -----------------------------------------------------
_FUSED: dict[tuple[str, str, str, str], Any] = {}


def elementwise(name: str, in_params: str, out_params: str, operation: str) -> Any:
    """A cupy.ElementwiseKernel for a fused GPU path, built on first use (importing a module
    that declares one needs no GPU) and cached. Compiled with --fmad=false: NVRTC would
    otherwise contract ``a * b + c`` into one fused multiply-add, rounding once where the numpy
    path rounds twice, and the GPU results would no longer match the CPU's bit for bit."""
    key = (name, in_params, out_params, operation)
    k = _FUSED.get(key)
    if k is None:
        import cupy

        k = cupy.ElementwiseKernel(in_params, out_params, operation, f"purine_{name}",
                                   options=("--fmad=false",))
        _FUSED[key] = k
    return k


def scalar_arg(a: Array) -> Any:
    """A 0-d blob as a fused kernel's ``float64`` argument without a host sync: a device array
    stays on the device (cast to float64 there if needed), a host array becomes a float."""
    if is_device_array(a):
        return a if a.dtype == "float64" else a.astype("float64")
    return float(a)
