"""Our CUDA C sources run on the CPU: each kernel is "one thread per element" over a
grid-stride loop, so with one block of one thread the loop visits every index serially and
computes exactly what the GPU computes. The source (with the loader's own prelude) is
compiled by g++ as C++ behind a header that defines the CUDA keywords away; kernels are
called through ctypes with numpy arrays, and arguments go through the same checks as
purine.backend.cuda's launcher.

``kernel(family, name, dtype)`` has the launcher's interface, so the GPU paths of the ops
can run on numpy arrays with these kernels in place of the GPU's."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from purine.backend import cuda

HEADER = """\
#include <cmath>
#include <algorithm>
using std::min;
using std::max;
using std::sqrt;
using std::pow;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
struct purine_dim3 { unsigned int x, y, z; };
static const purine_dim3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0};
static const purine_dim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
template <typename V> inline V atomicAdd(V* address, V value)
{ V old = *address; *address = old + value; return old; }
"""

_CACHE = Path(os.environ.get("PURINE_TEST_CACHE",
                             Path.home() / ".cache" / "purine-caffe-tests")) / "emulate"
_LIBS: dict[tuple[str, str], ctypes.CDLL] = {}
_LOCK = threading.Lock()


def compiler() -> str:
    """g++'s path, or skip the test that needs it."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed: the CUDA sources cannot be emulated on the CPU")
    return gxx


def library(family: str, dtype: Any) -> ctypes.CDLL:
    """The emulated ``family`` for ``dtype``, compiled once per source text."""
    dt = np.dtype(dtype)
    key = (family, dt.str)
    with _LOCK:
        if key in _LIBS:
            return _LIBS[key]
        text = HEADER + cuda.source(family, dt)
        digest = hashlib.sha256(text.encode()).hexdigest()[:20]
        path = _CACHE / f"{family}-{dt.name}-{digest}.so"
        if not path.exists():
            _CACHE.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=_CACHE) as tmp:
                src = Path(tmp) / "kernels.cpp"
                src.write_text(text)
                out = Path(tmp) / "kernels.so"
                run = subprocess.run(
                    [compiler(), "-O1", "-shared", "-fPIC", "-std=c++17", "-x", "c++",
                     str(src), "-o", str(out)], capture_output=True, text=True)
                if run.returncode:
                    raise RuntimeError(f"g++ failed on {family}.cu ({dt}):\n{run.stderr}")
                os.replace(out, path)  # atomic: parallel test runs never see half a file
        lib = _LIBS[key] = ctypes.CDLL(str(path))
        return lib


_SCALARS = {"int": ctypes.c_int32, "long long": ctypes.c_int64}


def kernel(family: str, name: str, dtype: Any) -> Callable[..., None]:
    """The emulated kernel, called like purine.backend.cuda.kernel's launcher:
    ``launch(n, *args)`` with numpy arrays and scalars."""
    dt = np.dtype(dtype)
    kinds = cuda.signature(family, name)
    fn = getattr(library(family, dt), name)
    scalar_t = ctypes.c_float if dt == np.float32 else ctypes.c_double
    fn.argtypes = [ctypes.c_void_p if k.endswith("*") else
                   scalar_t if k == "T" else _SCALARS[k] for k in kinds]
    fn.restype = None

    def launch(n: int, *args: Any) -> None:
        if n <= 0:
            return
        converted = cuda.arguments(kinds, dt, (n, *args), f"{family}.{name}")
        fn(*[a.ctypes.data if isinstance(a, np.ndarray) else a.item() for a in converted])

    return launch
