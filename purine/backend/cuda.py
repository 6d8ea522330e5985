"""Our CUDA C kernels (purine/ops/cuda/<family>.cu): compiled with NVRTC through CuPy once
per family, element type and device, and launched one thread per element on the current
device and stream.

A source defines ``extern "C" __global__ void name(const long long n, ...)`` kernels over
an element type ``T`` and loops with ``PURINE_LOOP(i, n)``; both come from the prelude
``source`` puts in front. The parameter types of each kernel are read from its source, so
a launch converts Python scalars to exactly those C types and refuses arrays of the wrong
element type or layout.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from purine.errors import PurineError

THREADS = 256
MAX_BLOCKS = 1 << 16  # the grid-stride loop covers the rest
OPTIONS = ("-std=c++17",)
SOURCE_DIR = Path(__file__).resolve().parent.parent / "ops" / "cuda"

_PRELUDE = """\
typedef {ctype} T;
#define PURINE_LOOP(i, n) \\
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \\
         i += (long long)blockDim.x * gridDim.x)
#define PURINE_FLT_MAX 3.402823466e+38f
"""
_CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}

# Parameter kinds: "T*" an array of the element type, "int*" an int32 array, "T" a scalar
# of the element type, "int" and "long long" integer scalars.
_KINDS = {"T*", "int*", "T", "int", "long long"}
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)')
_QUALIFIERS = re.compile(r"\b(const|__restrict__)\b")


def _ctype(dtype: Any) -> str:
    dt = np.dtype(dtype)
    if dt not in _CTYPES:
        raise PurineError(f"CUDA kernels take float32 or float64 arrays, not {dt}")
    return _CTYPES[dt]


@cache
def _text(family: str) -> str:
    path = SOURCE_DIR / f"{family}.cu"
    try:
        return path.read_text()
    except OSError as e:
        raise PurineError(f"no CUDA source for kernel family '{family}' ({path})") from e


def source(family: str, dtype: Any) -> str:
    """The CUDA C text compiled for ``family`` and element type ``dtype``: prelude + file."""
    return _PRELUDE.format(ctype=_ctype(dtype)) + _text(family)


@cache
def signatures(family: str) -> dict[str, tuple[str, ...]]:
    """Every kernel of ``family``: name -> the kinds of its parameters, in order."""
    found: dict[str, tuple[str, ...]] = {}
    for name, params in _KERNEL.findall(_text(family)):
        kinds = []
        for param in params.split(","):
            words = _QUALIFIERS.sub(" ", param).replace("*", " * ").split()
            kind = " ".join(words[:-1]).replace(" *", "*")  # drop the parameter's name
            if kind not in _KINDS:
                raise PurineError(f"{family}.cu: kernel {name} has a parameter '{param.strip()}'"
                                  f" of a type the launcher cannot pass")
            kinds.append(kind)
        if not kinds or kinds[0] != "long long":
            raise PurineError(f"{family}.cu: kernel {name} must take the element count "
                              "'long long n' first")
        found[name] = tuple(kinds)
    return found


def signature(family: str, name: str) -> tuple[str, ...]:
    """The parameter kinds of kernel ``name`` in ``family`` ("T*", "int*", "T", "int",
    "long long"); the first is always the element count n."""
    kernels = signatures(family)
    if name not in kernels:
        raise PurineError(f"{family}.cu has no kernel '{name}' (it has {sorted(kernels)})")
    return kernels[name]


_INT32 = (-(1 << 31), (1 << 31) - 1)


def arguments(kinds: Sequence[str], dtype: Any, args: Sequence[Any], where: str
              ) -> list[Any]:
    """``args`` checked against the parameter ``kinds``: arrays as they are (C-contiguous,
    of the element type ``dtype`` for "T*", int32 for "int*"), scalars as numpy scalars of
    the parameter's C type (a Python int would otherwise travel as 8 bytes)."""
    dt = np.dtype(dtype)
    if len(args) != len(kinds):
        raise PurineError(f"{where} takes {len(kinds)} arguments, got {len(args)}")
    out: list[Any] = []
    for k, (kind, a) in enumerate(zip(kinds, args)):
        if kind.endswith("*"):
            want = dt if kind == "T*" else np.dtype(np.int32)
            if getattr(a, "dtype", None) != want or not hasattr(a, "flags"):
                raise PurineError(f"{where}: argument {k} must be an array of {want}, got "
                                  f"{type(a).__name__} of {getattr(a, 'dtype', None)}")
            if not a.flags.c_contiguous:
                raise PurineError(f"{where}: argument {k} must be C-contiguous (a kernel "
                                  "sees only the memory, not a view's strides)")
            out.append(a)
        elif kind == "T":
            out.append(dt.type(a))
        else:
            value = int(a)
            if kind == "int" and not _INT32[0] <= value <= _INT32[1]:
                raise PurineError(f"{where}: argument {k} = {value} does not fit an int")
            out.append(np.int32(value) if kind == "int" else np.int64(value))
    return out


def blocks(n: int) -> int:
    return max(1, min(-(-n // THREADS), MAX_BLOCKS))


_MODULES: dict[tuple[str, str, int], Any] = {}
_FUNCTIONS: dict[tuple[str, str, str, int], Any] = {}
_LOCK = threading.Lock()


def _function(family: str, name: str, dtype: np.dtype) -> Any:
    import cupy

    key = (family, name, dtype.str, cupy.cuda.runtime.getDevice())
    fn = _FUNCTIONS.get(key)
    if fn is None:
        with _LOCK:  # one module per (family, type, device), whichever thread comes first
            mkey = (family, dtype.str, key[3])
            module = _MODULES.get(mkey)
            if module is None:
                module = _MODULES[mkey] = cupy.RawModule(
                    code=source(family, dtype), options=OPTIONS, backend="nvrtc")
            fn = _FUNCTIONS[key] = module.get_function(name)
    return fn


def kernel(family: str, name: str, dtype: Any) -> Callable[..., None]:
    """A launcher ``launch(n, *args)`` of kernel ``name`` from ``family`` for element type
    ``dtype``: ``n`` threads' worth of grid-stride loop (``n`` is also the kernel's first
    argument), on the current device and stream. Nothing is waited for."""
    dt = np.dtype(dtype)
    _ctype(dt)
    kinds = signature(family, name)
    where = f"{family}.{name}"

    def launch(n: int, *args: Any) -> None:
        if n <= 0:
            return
        converted = arguments(kinds, dt, (n, *args), where)
        _function(family, name, dt)((blocks(n),), (THREADS,), tuple(converted))

    return launch
