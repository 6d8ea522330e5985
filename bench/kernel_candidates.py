"""CIFAR-10 quick's three convolutions and its MAX pooling (batch 100, float32) timed in the
kernel libraries that could replace purine's numpy CPU kernels, all in one process: purine's
own kernels, oneDNN through its C API (ctypes), numba parallel kernels, and PyTorch's CPU
build as the reference. Each library's outputs are checked against purine's.

    python bench/kernel_candidates.py [--reps N] [--dnnl PATH/libdnnl.so.3] [--no-probes]

Times are medians of ``--reps`` calls in ms, with ratios to torch; the calls are taken in
three rounds that visit every column in turn, each visit warmed up first (see
``rounds_ms``). oneDNN columns: "blk" the primitive alone on the blocked layouts it picks
(format_tag_any), "+r" the same with the reorders from/to NCHW/OIHW that a purine op would
pay every call, "nchw" the primitive asked for plain layouts (no reorders). The library is
the first of ``--dnnl``, $PURINE_BENCH_DNNL, or the libdnnl.so.3 of an installed onednn*
distribution whose CPU engine starts; candidates are probed in subprocesses so that a
failing build (the SYCL-only ``onednn`` wheel) leaves nothing loaded here. Without one the
oneDNN columns are skipped with the reason.

Threads: OMP_NUM_THREADS (oneDNN's OpenMP builds, numba's omp layer) defaults to the core
count and OMP_WAIT_POLICY to PASSIVE: OpenMP workers that spin after a parallel region
steal the cores that OpenBLAS's or the next library's threads need (the alternation probe
shows the cost). torch.set_num_threads(cores); OpenBLAS uses its default (all cores). The
probes (skipped by ``--no-probes``) run in subprocesses: numba's compile time cold and
from its on-disk cache, oneDNN's results with one thread against all cores, and a oneDNN
convolution alternating with numpy work under three thread settings. PyTorch, numba and
oneDNN are bench-only peers here, not dependencies of the package.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

CORES = os.cpu_count() or 1
if not os.environ.get("PURINE_BENCH_CHILD"):  # a probe keeps the settings it was given
    os.environ.setdefault("OMP_NUM_THREADS", str(CORES))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("ONEDNN_VERBOSE", "0")
# "ours" is purine's numpy kernels: its ops would otherwise call oneDNN themselves
os.environ.setdefault("PURINE_ONEDNN", "0")
if "NUMBA_CACHE_DIR" not in os.environ:  # keep numba's cache out of the checkout
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="purine-bench-numba-")
    atexit.register(shutil.rmtree, os.environ["NUMBA_CACHE_DIR"], ignore_errors=True)

import numpy as np  # noqa: E402

# The package's own ctypes pieces: the version and argument structs, the loader of a wheel's
# libdnnl.so and the libraries beside it.
from purine.backend.onednn import _ExecArg, _load, _Version  # noqa: E402
from purine.ops.conv import (  # noqa: E402
    ConvGeometry,
    _row_weight,
    _Workspace,
    conv_backward_bias,
    conv_backward_data,
    conv_backward_weight,
    conv_forward,
)
from purine.ops.pooling import PoolGeometry, max_pool_backward, max_pool_forward  # noqa: E402

CONVS = {
    "conv1": ConvGeometry(100, 3, 32, 32, 32, 5, 5, pad_h=2, pad_w=2),
    "conv2": ConvGeometry(100, 32, 16, 16, 32, 5, 5, pad_h=2, pad_w=2),
    "conv3": ConvGeometry(100, 32, 8, 8, 64, 5, 5, pad_h=2, pad_w=2),
}
# pool1: MAX 3x3 stride 2 over conv1's output; Caffe's ceil rounding gives 16x16, the last
# window clipped to the image.
POOL = PoolGeometry(100, 32, 32, 32, 3, 3, 2, 2, 0, 0, 16, 16)


def median_ms(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def rounds_ms(fns: dict[str, Callable[[], Any]], reps: int, rounds: int = 3,
              warm_s: float = 0.15) -> dict[str, float]:
    """The median ms of each of ``fns`` over at least ``reps`` calls, taken in ``rounds``
    rounds that visit every function in turn, so that the load of other processes weighs
    on every column alike. Each visit first calls its function for ``warm_s`` (at least
    twice): the previous library's worker threads may still be spinning."""
    per = -(-reps // rounds)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t_end, calls = time.perf_counter() + warm_s, 0
            while calls < 2 or time.perf_counter() < t_end:
                fn()
                calls += 1
            for _ in range(per):
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def diff(a: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max abs difference, that over max |ref|)."""
    d = float(np.max(np.abs(a.astype(np.float64) - ref)))
    return d, d / max(float(np.max(np.abs(ref))), 1e-30)


def conv_inputs(g: ConvGeometry, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f = np.float32
    return {
        "x": rng.standard_normal((g.num, g.channels, g.height, g.width)).astype(f),
        "w": (rng.standard_normal((g.num_output, g.channels, g.kernel_h, g.kernel_w))
              * 0.05).astype(f),
        "b": rng.standard_normal(g.num_output).astype(f),
        "dy": rng.standard_normal((g.num, g.num_output, g.out_h, g.out_w)).astype(f),
    }


def pool_inputs(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    g = POOL
    return {"x": rng.standard_normal((g.num, g.channels, g.height, g.width)).astype(np.float32),
            "dy": rng.standard_normal((g.num, g.channels, g.pooled_h, g.pooled_w))
            .astype(np.float32)}


# -- purine ---------------------------------------------------------------------------------

def ours_conv(g: ConvGeometry, a: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    """Closures for forward, backward data and backward weight (+ bias) writing into
    ``a``'s "y", "dx", "dw", "db"."""
    a["y"] = np.empty(a["dy"].shape, np.float32)
    a["dx"] = np.empty_like(a["x"])
    a["dw"] = np.empty_like(a["w"])
    a["db"] = np.empty_like(a["b"])

    def bwd_w() -> None:
        conv_backward_weight(a["x"], a["dy"], a["dw"], geom=g)
        conv_backward_bias(a["dy"], a["db"], num=g.num)

    return {"fwd": lambda: conv_forward(a["x"], a["w"], a["b"], a["y"], geom=g),
            "bwd_data": lambda: conv_backward_data(a["dy"], a["w"], a["dx"], geom=g),
            "bwd_w": bwd_w}


def ours_pool(a: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    g = POOL
    a["y"] = np.empty(a["dy"].shape, np.float32)
    a["mask"] = np.empty(a["dy"].shape, np.int32)
    a["dx"] = np.empty_like(a["x"])
    return {"fwd": lambda: max_pool_forward(a["x"], a["y"], a["mask"], geom=g),
            "bwd": lambda: max_pool_backward(a["dy"], a["mask"], a["dx"], geom=g)}


# -- oneDNN through its C API ---------------------------------------------------------------
# Enum values and argument indices of dnnl_types.h; the same in oneDNN 3.2 and 3.13.
DNNL_CPU, DNNL_F32, TAG_ANY, TAG_A, TAG_ABCD = 1, 3, 1, 2, 5
FORWARD_TRAINING, CONV_DIRECT, POOLING_MAX = 64, 1, 511
Q_IMPL_INFO = 8
Q_SRC, Q_DIFF_SRC, Q_WEIGHTS, Q_DIFF_WEIGHTS, Q_DST, Q_DIFF_DST, Q_WORKSPACE = range(129, 136)
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_BIAS, ARG_WORKSPACE = 1, 17, 33, 41, 64
ARG_DIFF_SRC, ARG_DIFF_DST, ARG_DIFF_WEIGHTS, ARG_DIFF_BIAS = 129, 145, 161, 169
RUNTIMES = {1: "sequential", 2: "OpenMP", 4: "TBB", 8: "threadpool", 256: "OpenCL",
            512: "SYCL"}
MEMORY_ALLOCATE = ctypes.c_void_p(2**64 - 1)  # DNNL_MEMORY_ALLOCATE: the library allocates


def _dims(values: tuple[int, ...]) -> Any:
    return (ctypes.c_int64 * 12)(*values)


class Dnnl:
    """The few C API calls the bench needs, on one CPU engine and stream."""

    def __init__(self, path: str):
        t0 = time.perf_counter()
        lib = self.lib = _load(path)
        self.load_s = time.perf_counter() - t0
        lib.dnnl_version.restype = ctypes.POINTER(_Version)
        v = lib.dnnl_version().contents
        self.version = f"{v.major}.{v.minor}.{v.patch}"
        self.runtime = RUNTIMES.get(v.cpu_runtime, str(v.cpu_runtime))
        lib.dnnl_primitive_desc_query_md.restype = ctypes.c_void_p
        lib.dnnl_primitive_desc_query_md.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                                     ctypes.c_int]
        lib.dnnl_memory_desc_equal.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        lib.dnnl_memory_desc_get_size.argtypes = [ctypes.c_void_p]
        lib.dnnl_engine_get_count.restype = ctypes.c_size_t
        lib.dnnl_memory_set_data_handle.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.engine, self.stream = ctypes.c_void_p(), ctypes.c_void_p()
        t0 = time.perf_counter()
        if lib.dnnl_engine_get_count(DNNL_CPU) == 0:
            why = ("its CPU engine runs on SYCL and no SYCL CPU device was found (the "
                   "Unified Runtime has no OpenCL adapter installed)"
                   if v.cpu_runtime == 512 else "no CPU engine")
            raise OSError(f"oneDNN {self.version} ({self.runtime} CPU runtime): {why}")
        self.call("dnnl_engine_create", ctypes.byref(self.engine), DNNL_CPU,
                  ctypes.c_size_t(0))
        self.call("dnnl_stream_create", ctypes.byref(self.stream), self.engine, 1)
        self.engine_s = time.perf_counter() - t0

    def call(self, name: str, *args: Any) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"oneDNN {name} returned status {status}")

    def md(self, dims: tuple[int, ...], tag: int) -> ctypes.c_void_p:
        md = ctypes.c_void_p()
        self.call("dnnl_memory_desc_create_with_tag", ctypes.byref(md), len(dims), _dims(dims),
                  DNNL_F32, tag)
        return md

    def query_md(self, pd: ctypes.c_void_p, what: int) -> ctypes.c_void_p:
        return ctypes.c_void_p(self.lib.dnnl_primitive_desc_query_md(pd, what, 0))

    def impl(self, pd: ctypes.c_void_p) -> str:
        s = ctypes.c_char_p()
        self.call("dnnl_primitive_desc_query", pd, Q_IMPL_INFO, 0, ctypes.byref(s))
        return s.value.decode()

    def memory(self, md: ctypes.c_void_p, array: np.ndarray | None = None) -> ctypes.c_void_p:
        mem = ctypes.c_void_p()
        handle = MEMORY_ALLOCATE if array is None else ctypes.c_void_p(array.ctypes.data)
        self.call("dnnl_memory_create", ctypes.byref(mem), md, self.engine, handle)
        return mem

    def primitive(self, pd: ctypes.c_void_p) -> ctypes.c_void_p:
        p = ctypes.c_void_p()
        self.call("dnnl_primitive_create", ctypes.byref(p), pd)
        return p

    def runner(self, prim: ctypes.c_void_p, args: dict[int, ctypes.c_void_p]
               ) -> Callable[[], None]:
        """A closure executing ``prim`` with ``args`` and waiting for it."""
        packed = (_ExecArg * len(args))(*[_ExecArg(k, v.value) for k, v in args.items()])
        execute, wait, stream, n = (self.lib.dnnl_primitive_execute, self.lib.dnnl_stream_wait,
                                    self.stream, len(args))

        def run() -> None:
            if execute(prim, stream, n, packed) or wait(stream):
                raise RuntimeError("oneDNN execution failed")
        return run

    def reorder(self, src_md: ctypes.c_void_p, src: ctypes.c_void_p, dst_md: ctypes.c_void_p,
                dst: ctypes.c_void_p) -> Callable[[], None]:
        pd = ctypes.c_void_p()
        self.call("dnnl_reorder_primitive_desc_create", ctypes.byref(pd), src_md, self.engine,
                  dst_md, self.engine, None)
        return self.runner(self.primitive(pd), {ARG_SRC: src, ARG_DST: dst})

    def point(self, mem: ctypes.c_void_p, array: np.ndarray) -> None:
        """Make the plain memory ``mem`` use ``array``'s buffer."""
        self.call("dnnl_memory_set_data_handle", mem, array.ctypes.data)

    def same(self, a: ctypes.c_void_p, b: ctypes.c_void_p) -> bool:
        return bool(self.lib.dnnl_memory_desc_equal(a, b))


class _Operand:
    """A plain (NCHW/OIHW/x) numpy array and the memory a primitive wants for it: the array
    itself when the layouts agree, else a library buffer reached through a reorder."""

    def __init__(self, d: Dnnl, array: np.ndarray, plain_md: ctypes.c_void_p,
                 want_md: ctypes.c_void_p, into_primitive: bool):
        self.plain = d.memory(plain_md, array)
        self.blocked = not d.same(plain_md, want_md)
        self.mem = d.memory(want_md) if self.blocked else self.plain
        self.reorder: Callable[[], None] | None = None
        if self.blocked:
            self.reorder = (d.reorder(plain_md, self.plain, want_md, self.mem) if into_primitive
                            else d.reorder(want_md, self.mem, plain_md, self.plain))


def _chain(*steps: Callable[[], None] | None) -> Callable[[], None]:
    live = [s for s in steps if s is not None]

    def run() -> None:
        for s in live:
            s()
    return run


Plain = dict[str, dict[str, ctypes.c_void_p]]  # op -> operand -> its plain memory


def dnnl_conv(d: Dnnl, g: ConvGeometry, a: dict[str, np.ndarray], blocked: bool,
              plain_out: Plain | None = None
              ) -> tuple[dict[str, tuple[Callable[[], None], Callable[[], None]]],
                         dict[str, str], float]:
    """For fwd, bwd_data, bwd_w: (primitive alone, with reorders) closures writing into
    ``a``'s "y", "dx", "dw", "db"; the implementations; the creation time in seconds.
    ``plain_out`` receives each op's plain memories (to point them at other arrays)."""
    t0 = time.perf_counter()
    xs, ws = (g.num, g.channels, g.height, g.width), a["w"].shape
    ys = (g.num, g.num_output, g.out_h, g.out_w)
    plain = {k: d.md(s, TAG_ABCD) for k, s in (("x", xs), ("w", ws), ("y", ys))}
    bias = d.md((g.num_output,), TAG_A)
    tag = TAG_ANY if blocked else TAG_ABCD
    want = {k: d.md(s, tag) for k, s in (("x", xs), ("w", ws), ("y", ys))}
    geo = (_dims((g.stride_h, g.stride_w)), _dims((g.dilation_h - 1, g.dilation_w - 1)),
           _dims((g.pad_h, g.pad_w)),
           _dims(((g.out_h - 1) * g.stride_h + g.dilation_h * (g.kernel_h - 1) + 1
                  - g.height - g.pad_h,
                  (g.out_w - 1) * g.stride_w + g.dilation_w * (g.kernel_w - 1) + 1
                  - g.width - g.pad_w)))
    fwd, bwd_d, bwd_w = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    d.call("dnnl_convolution_forward_primitive_desc_create", ctypes.byref(fwd), d.engine,
           FORWARD_TRAINING, CONV_DIRECT, want["x"], want["w"], bias, want["y"], *geo, None)
    d.call("dnnl_convolution_backward_data_primitive_desc_create", ctypes.byref(bwd_d),
           d.engine, CONV_DIRECT, want["x"], want["w"], want["y"], *geo, fwd, None)
    d.call("dnnl_convolution_backward_weights_primitive_desc_create", ctypes.byref(bwd_w),
           d.engine, CONV_DIRECT, want["x"], want["w"], bias, want["y"], *geo, fwd, None)
    for k, shape in (("y", ys), ("dx", xs), ("dw", ws), ("db", (g.num_output,))):
        a[k] = np.empty(shape, np.float32)
    runs = {}
    # Forward: x, w in; y out.
    x = _Operand(d, a["x"], plain["x"], d.query_md(fwd, Q_SRC), True)
    w = _Operand(d, a["w"], plain["w"], d.query_md(fwd, Q_WEIGHTS), True)
    y = _Operand(d, a["y"], plain["y"], d.query_md(fwd, Q_DST), False)
    b = d.memory(bias, a["b"])
    prim = d.runner(d.primitive(fwd), {ARG_SRC: x.mem, ARG_WEIGHTS: w.mem, ARG_BIAS: b,
                                       ARG_DST: y.mem})
    runs["fwd"] = (prim, _chain(x.reorder, w.reorder, prim, y.reorder))
    plains = {"fwd": {"x": x.plain, "w": w.plain, "b": b, "y": y.plain}}
    # Backward data: dy, w in; dx out.
    dy = _Operand(d, a["dy"], plain["y"], d.query_md(bwd_d, Q_DIFF_DST), True)
    w = _Operand(d, a["w"], plain["w"], d.query_md(bwd_d, Q_WEIGHTS), True)
    dx = _Operand(d, a["dx"], plain["x"], d.query_md(bwd_d, Q_DIFF_SRC), False)
    prim = d.runner(d.primitive(bwd_d), {ARG_DIFF_DST: dy.mem, ARG_WEIGHTS: w.mem,
                                         ARG_DIFF_SRC: dx.mem})
    runs["bwd_data"] = (prim, _chain(dy.reorder, w.reorder, prim, dx.reorder))
    plains["bwd_data"] = {"dy": dy.plain, "w": w.plain, "dx": dx.plain}
    # Backward weights (and bias): x, dy in; dw, db out.
    x = _Operand(d, a["x"], plain["x"], d.query_md(bwd_w, Q_SRC), True)
    dy = _Operand(d, a["dy"], plain["y"], d.query_md(bwd_w, Q_DIFF_DST), True)
    dw = _Operand(d, a["dw"], plain["w"], d.query_md(bwd_w, Q_DIFF_WEIGHTS), False)
    db = d.memory(bias, a["db"])
    prim = d.runner(d.primitive(bwd_w), {ARG_SRC: x.mem, ARG_DIFF_DST: dy.mem,
                                         ARG_DIFF_WEIGHTS: dw.mem, ARG_DIFF_BIAS: db})
    runs["bwd_w"] = (prim, _chain(x.reorder, dy.reorder, prim, dw.reorder))
    plains["bwd_w"] = {"x": x.plain, "dy": dy.plain, "dw": dw.plain}
    if plain_out is not None:
        plain_out.update(plains)
    impls = {"fwd": d.impl(fwd), "bwd_data": d.impl(bwd_d), "bwd_w": d.impl(bwd_w)}
    return runs, impls, time.perf_counter() - t0


def dnnl_pool(d: Dnnl, a: dict[str, np.ndarray], src_md: ctypes.c_void_p | None,
              plain_out: Plain | None = None
              ) -> tuple[dict[str, tuple[Callable[[], None], Callable[[], None]]],
                         dict[str, str], float]:
    """pool1 forward (with its workspace) and backward; the source layout ``src_md`` (e.g.
    conv1's blocked output) or plain NCHW when None. As ``dnnl_conv``."""
    t0 = time.perf_counter()
    g = POOL
    xs, ys = (g.num, g.channels, g.height, g.width), (g.num, g.channels, g.pooled_h, g.pooled_w)
    plain_x, plain_y = d.md(xs, TAG_ABCD), d.md(ys, TAG_ABCD)
    want_x = src_md if src_md is not None else plain_x
    want_y = d.md(ys, TAG_ANY if src_md is not None else TAG_ABCD)
    geo = (_dims((g.stride_h, g.stride_w)), _dims((g.kernel_h, g.kernel_w)), _dims((0, 0)),
           _dims((g.pad_h, g.pad_w)),
           _dims(((g.pooled_h - 1) * g.stride_h + g.kernel_h - g.height - g.pad_h,
                  (g.pooled_w - 1) * g.stride_w + g.kernel_w - g.width - g.pad_w)))
    fwd, bwd = ctypes.c_void_p(), ctypes.c_void_p()
    d.call("dnnl_pooling_forward_primitive_desc_create", ctypes.byref(fwd), d.engine,
           FORWARD_TRAINING, POOLING_MAX, want_x, want_y, *geo, None)
    d.call("dnnl_pooling_backward_primitive_desc_create", ctypes.byref(bwd), d.engine,
           POOLING_MAX, want_x, want_y, *geo, fwd, None)
    a["y"], a["dx"] = np.empty(ys, np.float32), np.empty(xs, np.float32)
    workspace = d.memory(d.query_md(fwd, Q_WORKSPACE))
    x = _Operand(d, a["x"], plain_x, d.query_md(fwd, Q_SRC), True)
    y = _Operand(d, a["y"], plain_y, d.query_md(fwd, Q_DST), False)
    prim = d.runner(d.primitive(fwd), {ARG_SRC: x.mem, ARG_DST: y.mem, ARG_WORKSPACE: workspace})
    runs = {"fwd": (prim, _chain(x.reorder, prim, y.reorder))}
    dy = _Operand(d, a["dy"], plain_y, d.query_md(bwd, Q_DIFF_DST), True)
    dx = _Operand(d, a["dx"], plain_x, d.query_md(bwd, Q_DIFF_SRC), False)
    prim = d.runner(d.primitive(bwd), {ARG_DIFF_DST: dy.mem, ARG_WORKSPACE: workspace,
                                       ARG_DIFF_SRC: dx.mem})
    runs["bwd"] = (prim, _chain(dy.reorder, prim, dx.reorder))
    if plain_out is not None:
        plain_out.update({"fwd": {"x": x.plain, "y": y.plain},
                          "bwd": {"dy": dy.plain, "dx": dx.plain}})
    return runs, {"fwd": d.impl(fwd), "bwd": d.impl(bwd)}, time.perf_counter() - t0


def conv1_blocked_dst(d: Dnnl) -> ctypes.c_void_p:
    """The layout oneDNN picks for conv1's output, which pool1 reads."""
    g = CONVS["conv1"]
    fwd = ctypes.c_void_p()
    geo = (_dims((1, 1)), _dims((0, 0)), _dims((2, 2)), _dims((2, 2)))
    d.call("dnnl_convolution_forward_primitive_desc_create", ctypes.byref(fwd), d.engine,
           FORWARD_TRAINING, CONV_DIRECT, d.md((g.num, g.channels, g.height, g.width), TAG_ANY),
           d.md((g.num_output, g.channels, g.kernel_h, g.kernel_w), TAG_ANY),
           d.md((g.num_output,), TAG_A), d.md((g.num, g.num_output, g.out_h, g.out_w), TAG_ANY),
           *geo, None)
    return d.query_md(fwd, Q_DST)  # owned by fwd, which is never destroyed here


def dnnl_candidates(explicit: str | None) -> list[tuple[str, str]]:
    """(label, path) of the libdnnl.so.3 files to try, in order."""
    found = []
    for label, path in (("--dnnl", explicit), ("PURINE_BENCH_DNNL",
                                               os.environ.get("PURINE_BENCH_DNNL"))):
        if path:
            found.append((label, path))
    for dist in ("onednn-cpu-gomp", "onednn-cpu-iomp", "onednn-cpu-tbb", "onednn"):
        try:
            files = importlib.metadata.distribution(dist).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in files:
            if f.name == "libdnnl.so.3":
                found.append((f"{dist} {importlib.metadata.version(dist)}", str(f.locate())))
    return found


def probe_dnnl(path: str) -> None:
    """Subprocess body: start the engine of ``path`` and print what happened as JSON."""
    try:
        d = Dnnl(path)
        print(json.dumps({"ok": True, "version": d.version, "runtime": d.runtime,
                          "load_s": d.load_s, "engine_s": d.engine_s}))
    except (OSError, RuntimeError, AttributeError) as e:
        print(json.dumps({"ok": False, "why": str(e).splitlines()[0]}))


def pick_dnnl(explicit: str | None) -> tuple[Dnnl | None, list[str]]:
    notes = []
    for label, path in dnnl_candidates(explicit):
        out = subprocess.run([sys.executable, __file__, "--probe-dnnl", path],
                             capture_output=True, text=True)
        lines = out.stdout.strip().splitlines()
        res = json.loads(lines[-1]) if lines else {"ok": False, "why": out.stderr[-300:]}
        if not res["ok"]:
            notes.append(f"oneDNN from {label} ({path}) skipped: {res['why']}")
            continue
        d = Dnnl(path)
        notes.append(f"oneDNN {d.version} from {label} ({path}), {d.runtime} runtime, "
                     f"dlopen "
                     f"{d.load_s * 1e3:.0f} ms, engine+stream {d.engine_s * 1e3:.0f} ms")
        return d, notes
    if not notes:
        notes.append("oneDNN skipped: no --dnnl, no $PURINE_BENCH_DNNL and no onednn* "
                     "distribution installed")
    return None, notes


# -- numba ----------------------------------------------------------------------------------

def numba_kernels(cache: bool) -> dict[str, Any]:
    """The numba kernels: MAX pooling forward (values and Caffe's argmax in one pass, the
    first maximum on ties) and backward over (num*channels) planes in parallel, and the
    "rows" im2col of a stride-1 convolution (purine's im2row order: kh, kw, channel)."""
    from numba import njit, prange

    lowest = np.float32(-np.finfo(np.float32).max)  # Caffe's initial maximum

    @njit(parallel=True, fastmath=False, cache=cache)
    def max_pool_fwd(x, y, mask, height, width, kh, kw, sh, sw, ph, pw):
        planes, pooled_h, pooled_w = y.shape
        for p in prange(planes):
            for oh in range(pooled_h):
                h0 = oh * sh - ph
                h1 = min(h0 + kh, height)
                h0 = max(h0, 0)
                for ow in range(pooled_w):
                    w0 = ow * sw - pw
                    w1 = min(w0 + kw, width)
                    w0 = max(w0, 0)
                    best, arg = lowest, -1
                    for h in range(h0, h1):
                        for w in range(w0, w1):
                            v = x[p, h * width + w]
                            if v > best:
                                best, arg = v, h * width + w
                    y[p, oh, ow] = best
                    mask[p, oh, ow] = arg

    @njit(parallel=True, fastmath=False, cache=cache)
    def max_pool_bwd(dy, mask, dx):
        planes, pooled_h, pooled_w = dy.shape
        for p in prange(planes):
            dx[p, :] = 0
            for oh in range(pooled_h):
                for ow in range(pooled_w):
                    m = mask[p, oh, ow]
                    if m >= 0:
                        dx[p, m] += dy[p, oh, ow]

    @njit(parallel=True, fastmath=False, cache=cache)
    def im2row(x, rows, kh, kw, ph, pw):
        n, c, height, width = x.shape
        out_h, out_w = height + 2 * ph - kh + 1, width + 2 * pw - kw + 1
        for s in prange(n):
            for oh in range(out_h):
                for ow in range(out_w):
                    r = (s * out_h + oh) * out_w + ow
                    for i in range(kh):
                        h = oh + i - ph
                        for j in range(kw):
                            w = ow + j - pw
                            base = (i * kw + j) * c
                            if 0 <= h < height and 0 <= w < width:
                                for k in range(c):
                                    rows[r, base + k] = x[s, k, h, w]
                            else:
                                for k in range(c):
                                    rows[r, base + k] = 0

    return {"max_pool_fwd": max_pool_fwd, "max_pool_bwd": max_pool_bwd, "im2row": im2row}


def numba_pool(k: dict[str, Any], a: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    g = POOL
    planes = g.num * g.channels
    a["y"] = np.empty(a["dy"].shape, np.float32)
    a["mask"] = np.empty(a["dy"].shape, np.int32)
    a["dx"] = np.empty_like(a["x"])
    x2, dx2 = a["x"].reshape(planes, -1), a["dx"].reshape(planes, -1)
    y3, m3 = a["y"].reshape(planes, g.pooled_h, g.pooled_w), a["mask"].reshape(planes, g.pooled_h,
                                                                               g.pooled_w)
    dy3 = a["dy"].reshape(planes, g.pooled_h, g.pooled_w)
    fwd, bwd = k["max_pool_fwd"], k["max_pool_bwd"]
    return {"fwd": lambda: fwd(x2, y3, m3, g.height, g.width, g.kernel_h, g.kernel_w,
                               g.stride_h, g.stride_w, g.pad_h, g.pad_w),
            "bwd": lambda: bwd(dy3, m3, dx2)}


def numba_compile_probe() -> None:
    """Subprocess body: numba's import time and each kernel's first call (compile, or load
    from the cache in $NUMBA_CACHE_DIR) as JSON."""
    t0 = time.perf_counter()
    import numba  # noqa: F401

    res = {"import_s": time.perf_counter() - t0}
    k = numba_kernels(cache=True)
    pa = pool_inputs()
    runs = numba_pool(k, pa)
    for name in ("fwd", "bwd"):
        t0 = time.perf_counter()
        runs[name]()
        res[f"max_pool_{name}_s"] = time.perf_counter() - t0
    g = CONVS["conv2"]
    x = conv_inputs(g)["x"][:10]
    rows = np.empty((10 * g.out_h * g.out_w, g.kernel_dim), np.float32)
    t0 = time.perf_counter()
    k["im2row"](x, rows, g.kernel_h, g.kernel_w, g.pad_h, g.pad_w)
    res["im2row_s"] = time.perf_counter() - t0
    import numba as nb

    res["layer"] = nb.threading_layer()
    print(json.dumps(res))


# -- torch ----------------------------------------------------------------------------------

def torch_conv(g: ConvGeometry, a: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    import torch
    import torch.nn.functional as F

    x, w, b, dy = (torch.from_numpy(a[k]) for k in ("x", "w", "b", "dy"))
    st, pad, dil = [g.stride_h, g.stride_w], [g.pad_h, g.pad_w], [g.dilation_h, g.dilation_w]
    back = torch.ops.aten.convolution_backward

    def fwd() -> None:
        with torch.no_grad():
            a["y"] = F.conv2d(x, w, b, st, pad, dil).numpy()

    def bwd_data() -> None:
        a["dx"] = back(dy, x, w, [g.num_output], st, pad, dil, False, [0, 0], g.group,
                       [True, False, False])[0].numpy()

    def bwd_w() -> None:
        _, dw, db = back(dy, x, w, [g.num_output], st, pad, dil, False, [0, 0], g.group,
                         [False, True, True])
        a["dw"], a["db"] = dw.numpy(), db.numpy()

    return {"fwd": fwd, "bwd_data": bwd_data, "bwd_w": bwd_w}


def torch_pool(a: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    import torch

    g = POOL
    x, dy = torch.from_numpy(a["x"]), torch.from_numpy(a["dy"])
    k, s, p = [g.kernel_h, g.kernel_w], [g.stride_h, g.stride_w], [g.pad_h, g.pad_w]
    state: dict[str, Any] = {}

    def fwd() -> None:
        y, idx = torch.ops.aten.max_pool2d_with_indices(x, k, s, p, [1, 1], True)
        state["idx"] = idx
        a["y"], a["mask"] = y.numpy(), idx.numpy()

    def bwd() -> None:
        a["dx"] = torch.ops.aten.max_pool2d_with_indices_backward(
            dy, x, k, s, p, [1, 1], True, state["idx"]).numpy()

    return {"fwd": fwd, "bwd": bwd}


# -- the whole net --------------------------------------------------------------------------

class DnnlOps:
    """oneDNN kernels behind purine's op signatures, for a bench-only whole-net run:
    convolutions with a bias and group 1 (blocked layouts, reorders from/to NCHW at each
    call) and MAX pooling in NCHW; anything else goes to purine's kernel. The MAX pooling
    keeps oneDNN's workspace instead of filling Caffe's mask (enough for cifar10_quick,
    whose masks are internal)."""

    def __init__(self, d: Dnnl):
        self.d = d
        self.convs: dict[ConvGeometry, tuple[dict, Plain, dict]] = {}
        self.pools: dict[tuple[PoolGeometry, int], tuple[dict, Plain, dict]] = {}
        self.calls = 0

    def _conv(self, g: ConvGeometry) -> tuple[dict, Plain, dict]:
        if g not in self.convs:
            a, plain = conv_inputs(g), {}
            runs = dnnl_conv(self.d, g, a, True, plain)[0]
            self.convs[g] = ({k: v[1] for k, v in runs.items()}, plain, a)
        return self.convs[g]

    def _run(self, entry: tuple[dict, Plain, dict], op: str, **arrays: np.ndarray) -> None:
        runs, plain, _ = entry
        for name, array in arrays.items():
            self.d.point(plain[op][name], array)
        runs[op]()
        self.calls += 1

    @staticmethod
    def _fits(g: ConvGeometry, *arrays: np.ndarray) -> bool:
        return g.group == 1 and all(
            a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)

    def conv_forward(self, x: np.ndarray, w: np.ndarray, *rest: np.ndarray,
                     geom: ConvGeometry) -> None:
        if len(rest) != 2 or not self._fits(geom, x, w, *rest):
            return conv_forward(x, w, *rest, geom=geom)
        self._run(self._conv(geom), "fwd", x=x, w=w, b=rest[0], y=rest[1])

    def conv_backward_data(self, dy: np.ndarray, w: np.ndarray, dx: np.ndarray, *,
                           geom: ConvGeometry) -> None:
        if not self._fits(geom, dy, w, dx):
            return conv_backward_data(dy, w, dx, geom=geom)
        self._run(self._conv(geom), "bwd_data", dy=dy, w=w, dx=dx)

    def conv_backward_weight(self, *arrays: np.ndarray, geom: ConvGeometry) -> None:
        # The primitive also sums the bias gradient into a scratch buffer: purine's
        # ConvBackwardBias op stays as it is.
        if len(arrays) != 3 or not self._fits(geom, *arrays):
            return conv_backward_weight(*arrays, geom=geom)
        x, dy, dw = arrays
        self._run(self._conv(geom), "bwd_w", x=x, dy=dy, dw=dw)

    def _pool(self, g: PoolGeometry, mask: np.ndarray) -> tuple[dict, Plain, dict]:
        key = (g, mask.ctypes.data)
        if key not in self.pools:
            if g != POOL:
                raise SystemExit(f"bench: no oneDNN pooling set up for {g}")
            a, plain = pool_inputs(), {}
            runs = dnnl_pool(self.d, a, None, plain)[0]
            self.pools[key] = ({k: v[1] for k, v in runs.items()}, plain, a)
        return self.pools[key]

    def max_pool_forward(self, x: np.ndarray, y: np.ndarray, mask: np.ndarray, *,
                         geom: PoolGeometry) -> None:
        if geom != POOL:
            return max_pool_forward(x, y, mask, geom=geom)
        self._run(self._pool(geom, mask), "fwd", x=x, y=y)

    def max_pool_backward(self, dy: np.ndarray, mask: np.ndarray, dx: np.ndarray, *,
                          geom: PoolGeometry) -> None:
        if geom != POOL:
            return max_pool_backward(dy, mask, dx, geom=geom)
        self._run(self._pool(geom, mask), "bwd", dy=dy, dx=dx)


def whole_net(d: Dnnl | None, reps: int) -> None:
    """cifar10_quick's TRAIN forward+backward (batch 100) as bench/cpu_nets.py runs it:
    purine as it is, purine with DnnlOps patched into its op modules while the net is
    built, and the PyTorch transcription; losses and parameter gradients compared."""
    import cpu_nets
    import torch

    import purine.ops.conv as conv_module
    import purine.ops.pooling as pool_module
    from purine.caffe import TRAIN, Net

    data, label = cpu_nets.inputs("cifar10_quick")
    param = cpu_nets.train_net_param("cifar10_quick")
    nets = {"purine": Net(param, phase=TRAIN)}
    ops = DnnlOps(d) if d is not None else None
    if ops is not None:
        names = {conv_module: ("conv_forward", "conv_backward_data", "conv_backward_weight"),
                 pool_module: ("max_pool_forward", "max_pool_backward")}
        saved = {(m, n): getattr(m, n) for m, ns in names.items() for n in ns}
        try:
            for m, n in saved:
                setattr(m, n, getattr(ops, n))
            nets["purine+oneDNN"] = Net(param, phase=TRAIN)
        finally:
            for (m, n), fn in saved.items():
                setattr(m, n, fn)
    for net in nets.values():
        net.blobs["data"].data[...] = data
        net.blobs["label"].data[...] = label
        for name, blobs in nets["purine"].params.items():
            for mine, ref in zip(net.params[name], blobs, strict=True):
                mine.data[...] = ref.data

    def step(net: Any) -> Callable[[], None]:
        def run() -> None:
            net.forward()
            net.backward()
        return run

    steps = {name: step(net) for name, net in nets.items()}
    for fn in steps.values():
        fn()
    if ops is not None:
        a, b = nets["purine"], nets["purine+oneDNN"]
        loss = [float(n.blobs["loss"].data.reshape(-1)[0]) for n in (a, b)]
        worst = max(diff(mine.diff, ref.diff)[1] for name in a.params
                    for mine, ref in zip(b.params[name], a.params[name], strict=True))
        print(f"  purine+oneDNN ({ops.calls} oneDNN calls in one step): loss {loss[1]:.6f} "
              f"vs {loss[0]:.6f}, worst parameter gradient diff relative to its max "
              f"{worst:.1e}")
    layers, weights = cpu_nets.torch_model("cifar10_quick")
    x0, y0 = torch.from_numpy(data), torch.from_numpy(label)

    def torch_step() -> None:
        blobs = {"data": x0, "label": y0}
        for top, bottoms, fn in layers:
            blobs[top] = (fn(*(blobs[n] for n in bottoms)) if isinstance(bottoms, tuple)
                          else fn(blobs[bottoms]))
        for w in weights:
            w.grad = None
        blobs[layers[-1][0]].backward()

    steps["torch"] = torch_step
    ms = rounds_ms(steps, reps)
    print("  " + ", ".join(f"{k} {v:.1f} ms ({v / ms['torch']:.2f}x torch)"
                           for k, v in ms.items()))


# -- the study ------------------------------------------------------------------------------

COLUMNS = ("ours", "dnnl blk", "dnnl +r", "dnnl nchw", "numba", "torch")


def determinism_probe(path: str, out_dir: str) -> None:
    """Subprocess body: oneDNN's conv results (with reorders) saved as .npy under
    ``out_dir``, to compare across thread counts."""
    d = Dnnl(path)
    for name, g in CONVS.items():
        a = conv_inputs(g)
        runs, _, _ = dnnl_conv(d, g, a, blocked=True)
        for op in ("fwd", "bwd_data", "bwd_w"):
            runs[op][1]()
        for k in ("y", "dx", "dw", "db"):
            np.save(os.path.join(out_dir, f"{name}_{k}.npy"), a[k], allow_pickle=False)


def alternation_probe(path: str) -> None:
    """Subprocess body: conv2's oneDNN forward (with reorders) alone, numpy work of the size
    of cifar10_quick's other layers alone (ip1's GEMM, a ReLU over conv2's output), and the
    two alternating, as a net would run them; the same for purine's conv2; JSON of ms."""
    d = Dnnl(path)
    g = CONVS["conv2"]
    a = conv_inputs(g)
    dnnl = dnnl_conv(d, g, a, blocked=True)[0]["fwd"][1]
    ours = ours_conv(g, conv_inputs(g))["fwd"]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((g.num, 1024)).astype(np.float32)
    w = rng.standard_normal((1024, 64)).astype(np.float32)
    act = rng.standard_normal(a["y"].size).astype(np.float32)

    def numpy_work() -> None:
        np.matmul(x, w)
        np.maximum(act, 0, out=act)

    res = {"dnnl": median_ms(dnnl, 20), "numpy": median_ms(numpy_work, 20),
           "dnnl+numpy": median_ms(lambda: (dnnl(), numpy_work()), 20),
           "ours": median_ms(ours, 20),
           "ours+numpy": median_ms(lambda: (ours(), numpy_work()), 20)}
    print(json.dumps(res))


def study(reps: int, dnnl_path: str | None, probes: bool) -> None:
    import torch

    torch.set_num_threads(CORES)
    d, notes = pick_dnnl(dnnl_path)
    try:
        t0 = time.perf_counter()
        import numba

        numba_import_s = time.perf_counter() - t0
        nk = numba_kernels(cache=False)
    except ImportError as e:
        nk, numba_import_s = None, 0.0
        notes.append(f"numba skipped: {e}")
    times: dict[str, dict[str, float]] = {}
    checks: list[str] = []
    impls: list[str] = []
    create: list[str] = []

    cells: dict[str, dict[str, Callable[[], Any]]] = {}
    alive: list[dict[str, np.ndarray]] = []  # oneDNN memories point into these arrays

    def record(row: str, col: str, fn: Callable[[], Any]) -> None:
        cells.setdefault(row, {})[col] = fn

    def check(label: str, got: dict[str, np.ndarray], ref: dict[str, np.ndarray],
              keys: tuple[str, ...]) -> None:
        parts = []
        for k in keys:
            ab, rel = diff(np.asarray(got[k]), ref[k])
            parts.append(f"{k} {ab:.1e}/{rel:.1e}")
        checks.append(f"{label}: " + ", ".join(parts))

    for name, g in CONVS.items():
        ref = conv_inputs(g)
        ours = ours_conv(g, ref)
        for op, fn in ours.items():
            fn()
            record(f"{name} {op}", "ours", fn)
        keys = ("y", "dx", "dw", "db")
        if d is not None:
            for blocked in (True, False):
                a = conv_inputs(g)
                runs, imp, create_s = dnnl_conv(d, g, a, blocked)
                alive.append(a)
                first = []
                for op, (_, full) in runs.items():
                    t1 = time.perf_counter()
                    full()
                    first.append(f"{op} {(time.perf_counter() - t1) * 1e3:.1f}")
                label = "blk" if blocked else "nchw"
                create.append(f"{name} {label}: create {create_s * 1e3:.0f} ms, first call ms "
                              + ", ".join(first))
                check(f"{name} dnnl {label}", a, ref, keys)
                impls.append(f"{name} {label}: " + ", ".join(f"{k} {v}"
                                                             for k, v in imp.items()))
                for op, (prim, full) in runs.items():
                    if blocked:
                        record(f"{name} {op}", "dnnl blk", prim)
                        record(f"{name} {op}", "dnnl +r", full)
                    else:
                        record(f"{name} {op}", "dnnl nchw", full)
                if blocked:
                    # Determinism: the weight gradient twice on the same input.
                    runs["bwd_w"][1]()
                    first_dw = a["dw"].copy()
                    runs["bwd_w"][1]()
                    same = np.array_equal(first_dw, a["dw"])
                    checks.append(f"{name} dnnl bwd_w run twice: "
                                  f"{'bit-identical' if same else 'DIFFERS'}")
        a = conv_inputs(g)
        tr = torch_conv(g, a)
        for op, fn in tr.items():
            fn()
            record(f"{name} {op}", "torch", fn)
        check(f"{name} torch", a, ref, keys)
        if name == "conv2":
            conv2_copy_study(g, ref, nk, record)

    # pool1
    ref = pool_inputs()
    for op, fn in ours_pool(ref).items():
        fn()
        record(f"pool1 {op}", "ours", fn)
    if d is not None:
        for label, md in (("blk", conv1_blocked_dst(d)), ("nchw", None)):
            a = pool_inputs()
            runs, imp, create_s = dnnl_pool(d, a, md)
            alive.append(a)
            first = []
            for op, (_, full) in runs.items():
                t1 = time.perf_counter()
                full()
                first.append(f"{op} {(time.perf_counter() - t1) * 1e3:.1f}")
            create.append(f"pool1 {label}: create {create_s * 1e3:.0f} ms, first call ms "
                          + ", ".join(first))
            check(f"pool1 dnnl {label}", a, ref, ("y", "dx"))
            impls.append(f"pool1 {label}: " + ", ".join(f"{k} {v}" for k, v in imp.items()))
            for op, (prim, full) in runs.items():
                if label == "blk":
                    record(f"pool1 {op}", "dnnl blk", prim)
                    record(f"pool1 {op}", "dnnl +r", full)
                else:
                    record(f"pool1 {op}", "dnnl nchw", full)
    if nk is not None:
        a = pool_inputs()
        for op, fn in numba_pool(nk, a).items():
            fn()
            record(f"pool1 {op}", "numba", fn)
        check("pool1 numba", a, ref, ("y", "mask", "dx"))
    a = pool_inputs()
    for op, fn in torch_pool(a).items():
        fn()
        record(f"pool1 {op}", "torch", fn)
    check("pool1 torch", a, ref, ("y", "mask", "dx"))

    for row, fns in cells.items():
        times[row] = rounds_ms(fns, reps)
    print_table(times)
    print(f"\nthreads: {CORES} cores; torch {torch.__version__} {torch.get_num_threads()} "
          f"threads; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}; purine pooling host_parallel, OpenBLAS "
          f"default threads")
    for n in notes:
        print(n)
    if nk is not None:
        print(f"numba {numba.__version__}: import {numba_import_s * 1e3:.0f} ms, threading "
              f"layer {numba.threading_layer()}")
    for title, lines in (("oneDNN implementations", impls), ("oneDNN creation", create),
                         ("max |diff| / relative to max |ours|", checks)):
        if lines:
            print(f"\n{title}:")
            for line in lines:
                print("  " + line)
    print("\ncifar10_quick forward+backward, batch 100:")
    whole_net(d, reps)
    if probes:
        run_probes(d)


def conv2_copy_study(g: ConvGeometry, a: dict[str, np.ndarray], nk: dict[str, Any] | None,
                     record: Callable[[str, str, Callable[[], Any]], None]) -> None:
    """conv2's forward is im2row + one GEMM per chunk: time the copies alone (purine's numpy
    im2row, numba's) and the GEMMs alone, on the same chunks."""
    ws = _Workspace(np, g, np.float32)
    x = a["x"]
    wr = _row_weight(np, a["w"], g)[0]
    n = ws.chunks[0].stop - ws.chunks[0].start
    rows = np.empty((n * g.out_h * g.out_w, g.kernel_dim), np.float32)
    out = np.empty((rows.shape[0], g.num_output), np.float32)

    def numpy_copy() -> None:
        for s in ws.chunks:
            ws.im2row(x[s])

    def gemm() -> None:
        for _ in ws.chunks:
            np.matmul(rows, wr, out=out)

    record("conv2 fwd: im2row only", "ours", numpy_copy)
    record("conv2 fwd: GEMMs only", "ours", gemm)
    if nk is not None:
        im2row = nk["im2row"]

        def numba_copy() -> None:
            for s in ws.chunks:
                im2row(x[s], rows, g.kernel_h, g.kernel_w, g.pad_h, g.pad_w)

        numba_copy()
        ours_rows = ws.im2row(x[ws.chunks[-1]])
        im2row(x[ws.chunks[-1]], rows, g.kernel_h, g.kernel_w, g.pad_h, g.pad_w)
        if not np.array_equal(ours_rows, rows):
            raise SystemExit("numba im2row differs from purine's")
        record("conv2 fwd: im2row only", "numba", numba_copy)


def print_table(times: dict[str, dict[str, float]]) -> None:
    cols = [c for c in COLUMNS if any(c in r for r in times.values())]
    head = f"{'kernel (ms)':26s}" + "".join(f"{c:>10s}" for c in cols)
    ratio_cols = [c for c in cols if c != "torch"]
    head += "   x torch: " + " ".join(f"{c:>9s}" for c in ratio_cols)
    print(head)
    totals: dict[str, float] = {}
    for row, by_col in times.items():
        line = f"{row:26s}" + "".join(
            f"{by_col[c]:10.2f}" if c in by_col else f"{'':10s}" for c in cols)
        t = by_col.get("torch")
        if t:
            line += "              " + " ".join(
                f"{by_col[c] / t:9.2f}" if c in by_col else f"{'':9s}" for c in ratio_cols)
        print(line)
        if ":" not in row and not row.startswith("conv1 bwd_data"):
            for c, v in by_col.items():
                totals[c] = totals.get(c, 0.0) + v
    # conv1's backward data is not part of cifar10_quick's backward (its bottom is data).
    line = f"{'total w/o conv1 bwd_data':26s}" + "".join(
        f"{totals[c]:10.2f}" if c in totals else f"{'':10s}" for c in cols)
    if "torch" in totals:
        line += "              " + " ".join(
            f"{totals[c] / totals['torch']:9.2f}" if c in totals else f"{'':9s}"
            for c in ratio_cols)
    print(line)
    print("(numba and the oneDNN columns cover only the kernels they implement; "
          "total = the kernels each column has)")


def run_probes(d: Dnnl | None) -> None:
    print("\nprobes (subprocesses):")
    with tempfile.TemporaryDirectory(prefix="purine-bench-") as tmp:
        cache = os.path.join(tmp, "numba-cache")
        for label in ("cold (empty cache)", "warm (cache=True, cached)"):
            env = dict(os.environ, NUMBA_CACHE_DIR=cache)
            out = subprocess.run([sys.executable, __file__, "--probe-numba"], env=env,
                                 capture_output=True, text=True)
            if out.returncode:
                print(f"  numba probe failed: {out.stderr.strip().splitlines()[-1:]}")
                break
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  numba {label}: import {r['import_s'] * 1e3:.0f} ms, first call "
                  f"max_pool_fwd {r['max_pool_fwd_s'] * 1e3:.0f} ms, max_pool_bwd "
                  f"{r['max_pool_bwd_s'] * 1e3:.0f} ms, im2row {r['im2row_s'] * 1e3:.0f} ms "
                  f"({r['layer']} layer)")
        if d is None:
            return
        path = d.lib._name
        results = {}
        for threads in ("1", str(CORES)):
            out_dir = os.path.join(tmp, f"dnnl-{threads}")
            os.makedirs(out_dir)
            env = dict(os.environ, OMP_NUM_THREADS=threads)
            out = subprocess.run([sys.executable, __file__, "--probe-determinism", path,
                                  out_dir], env=env, capture_output=True, text=True)
            if out.returncode:
                print(f"  oneDNN determinism probe failed: {out.stderr[-300:]}")
                return
            results[threads] = out_dir
        lines = []
        for name in CONVS:
            for k in ("y", "dx", "dw", "db"):
                a, b = (np.load(os.path.join(results[t], f"{name}_{k}.npy"))
                        for t in ("1", str(CORES)))
                lines.append(f"{name} {k} " + ("same" if np.array_equal(a, b)
                                               else f"differs {diff(a, b)[0]:.1e}"))
        print(f"  oneDNN 1 vs {CORES} threads (bitwise): " + ", ".join(lines))
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT")}
    base["PURINE_BENCH_CHILD"] = "1"
    print("  conv2 fwd alternating with numpy work (ip1 GEMM + a ReLU), medians in ms:")
    for label, extra in (("library defaults", {}),
                         ("OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}),
                         ("PASSIVE + OPENBLAS_THREAD_TIMEOUT=4",
                          {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"})):
        out = subprocess.run([sys.executable, __file__, "--probe-alternation", path],
                             env=dict(base, **extra), capture_output=True, text=True)
        if out.returncode:
            print(f"    {label}: failed: {out.stderr[-300:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"    {label:36s} " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dnnl", help="path of a libdnnl.so.3 to use first")
    ap.add_argument("--no-probes", action="store_true",
                    help="skip the numba compile and oneDNN thread-count subprocesses")
    ap.add_argument("--probe-dnnl", help=argparse.SUPPRESS)
    ap.add_argument("--probe-numba", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe-determinism", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--probe-alternation", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe_dnnl:
        probe_dnnl(args.probe_dnnl)
    elif args.probe_numba:
        numba_compile_probe()
    elif args.probe_determinism:
        determinism_probe(*args.probe_determinism)
    elif args.probe_alternation:
        alternation_probe(args.probe_alternation)
    else:
        study(args.reps, args.dnnl, not args.no_probes)


if __name__ == "__main__":
    main()
