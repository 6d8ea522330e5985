"""oneDNN's CPU convolutions, MAX and AVE pooling, ReLU and matrix products through its C API
(ctypes), used by the float32 host bodies of ``purine.ops.conv``, ``purine.ops.pooling``,
``purine.ops.activation`` and ``purine.ops.inner_product`` when the ``onednn-cpu-gomp`` wheel
is installed (a dependency on Linux x86-64); without it, or with ``PURINE_ONEDNN=0`` (read once
into ``SETTINGS``; ``use`` changes it), they run on numpy. While a pass runs with it in use
(``pass_scope``, which the dispatcher holds), OpenBLAS runs one thread; between passes the
user's own numpy has its threads.

Each convolution geometry gets its primitives once (descriptor creation costs milliseconds)
on oneDNN's own blocked layouts, or with NHWC activations where the blocks would pad the
channels by much (``PADDING_FOR_NHWC``); a call reorders its NCHW/OIHW operands into them
and the result back. The blocked copies live in one scratch buffer shared by all primitives,
each call's copies side by side in it, so the extra memory is the largest one call needs (the
blocked operands of one convolution), not a sum over layers or over operand positions.
MAX pooling runs on plain NCHW; its workspace, each maximum's kernel offset, is the argmax
that ``purine.ops.pooling`` keeps on the host and the backward reads. AVE pooling runs
there too, where one of oneDNN's two averages has Caffe's divisor (``ave_algorithm``).
ReLU runs on the flat arrays. A matrix product runs oneDNN's matmul on the arrays themselves:
a transposed operand is the same memory read with other strides, the bias a (1, N) row
broadcast over the batch.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from purine.backend import set_blas_threads
from purine.errors import PurineError

# The wheels that install libdnnl.so.3 for the CPU; they differ only in the threading runtime.
DISTRIBUTIONS = ("onednn-cpu-gomp", "onednn-cpu-iomp", "onednn-cpu-tbb")
LIBRARY = "libdnnl.so.3"

# Enum values and argument indices of oneDNN 3.x's dnnl_types.h.
_CPU, _F32 = 1, 3
_TAG_ANY, _TAG_A, _TAG_ABCD, _TAG_ABCDE, _TAG_NHWC = 1, 2, 5, 6, 22  # NHWC: dnnl_acdb
_FORWARD_TRAINING, _CONV_DIRECT, _ELTWISE_RELU = 64, 1, 0x20
_POOLING_MAX, _POOLING_AVG_INCLUDE, _POOLING_AVG_EXCLUDE = 0x1ff, 0x2ff, 0x3ff
_Q_SRC, _Q_DIFF_SRC, _Q_WEIGHTS, _Q_DIFF_WEIGHTS, _Q_DST, _Q_DIFF_DST, _Q_WORKSPACE = range(
    129, 136)
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS, _ARG_BIAS, _ARG_WORKSPACE = 1, 17, 33, 41, 64
_ARG_DIFF_SRC, _ARG_DIFF_DST, _ARG_DIFF_WEIGHTS = 129, 145, 161
_Q_IMPL_INFO_STR = 8  # the implementation's name, "brg:avx512_core", "gemm:jit", "ref:any"
_RUNTIMES = {1: "sequential", 2: "OpenMP", 4: "TBB", 8: "threadpool", 256: "OpenCL",
             512: "SYCL"}
_ALIGN = 64  # bytes; what oneDNN's own allocations use
# Products of fewer multiply-adds stay on numpy: below about this many, waking oneDNN's OpenMP
# team costs more than a second core saves (LeNet's ip2, 64x500x10: 0.007 ms on one OpenBLAS
# thread, 0.03 ms through oneDNN; its ip1, 64x800x500: 0.65 against 0.32 ms).
MATMUL_MIN_MACS = 1 << 22
# A convolution whose blocked activations (input times output) would be this much larger
# than the plain ones runs on NHWC instead: on 2 AVX-512 cores LeNet's conv2 (20 -> 50
# channels) took 0.72x the blocked time forward and backward, 24 -> 40 channels 0.82x and
# 48 -> 100 0.97x, where channel counts of multiples of 16 took 1.07-1.18x on NHWC.
PADDING_FOR_NHWC = 1.1
# ReLUs of fewer values stay on numpy (one pass over a few hundred KB is cheaper there than
# waking the team); above it oneDNN's is 3-6x numpy's speed forward and 1.5-2.5x backward
# on 2 cores (0.8M-4.6M values), with the same bits.
ELTWISE_MIN = 1 << 16

_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_DIMS = ctypes.c_int64 * 12
_SIGNATURES: dict[str, list[Any]] = {
    "dnnl_engine_get_count": [ctypes.c_int],
    "dnnl_engine_create": [_PP, ctypes.c_int, ctypes.c_size_t],
    "dnnl_stream_create": [_PP, _P, ctypes.c_uint],
    "dnnl_stream_wait": [_P],
    "dnnl_memory_desc_create_with_tag": [_PP, ctypes.c_int, _DIMS, ctypes.c_int, ctypes.c_int],
    "dnnl_memory_desc_create_with_strides": [_PP, ctypes.c_int, _DIMS, ctypes.c_int, _DIMS],
    "dnnl_memory_desc_equal": [_P, _P],
    "dnnl_memory_desc_get_size": [_P],
    "dnnl_memory_create": [_PP, _P, _P, _P],
    "dnnl_memory_set_data_handle": [_P, _P],
    "dnnl_primitive_desc_query_md": [_P, ctypes.c_int, ctypes.c_int],
    "dnnl_primitive_create": [_PP, _P],
    "dnnl_primitive_execute": [_P, _P, ctypes.c_int, _P],
    "dnnl_reorder_primitive_desc_create": [_PP, _P, _P, _P, _P, _P],
    "dnnl_convolution_forward_primitive_desc_create": [
        _PP, _P, ctypes.c_int, ctypes.c_int, _P, _P, _P, _P, _DIMS, _DIMS, _DIMS, _DIMS, _P],
    "dnnl_convolution_backward_data_primitive_desc_create": [
        _PP, _P, ctypes.c_int, _P, _P, _P, _DIMS, _DIMS, _DIMS, _DIMS, _P, _P],
    "dnnl_convolution_backward_weights_primitive_desc_create": [
        _PP, _P, ctypes.c_int, _P, _P, _P, _P, _DIMS, _DIMS, _DIMS, _DIMS, _P, _P],
    "dnnl_pooling_forward_primitive_desc_create": [
        _PP, _P, ctypes.c_int, ctypes.c_int, _P, _P, _DIMS, _DIMS, _DIMS, _DIMS, _DIMS, _P],
    "dnnl_pooling_backward_primitive_desc_create": [
        _PP, _P, ctypes.c_int, _P, _P, _DIMS, _DIMS, _DIMS, _DIMS, _DIMS, _P, _P],
    "dnnl_matmul_primitive_desc_create": [_PP, _P, _P, _P, _P, _P, _P],
    "dnnl_eltwise_forward_primitive_desc_create": [
        _PP, _P, ctypes.c_int, ctypes.c_int, _P, _P, ctypes.c_float, ctypes.c_float, _P],
    "dnnl_eltwise_backward_primitive_desc_create": [
        _PP, _P, ctypes.c_int, _P, _P, _P, ctypes.c_float, ctypes.c_float, _P, _P],
    "dnnl_primitive_desc_query": [_P, ctypes.c_int, ctypes.c_int, _P],
}
_RESTYPES = {"dnnl_engine_get_count": ctypes.c_size_t, "dnnl_memory_desc_get_size":
             ctypes.c_size_t, "dnnl_primitive_desc_query_md": ctypes.c_void_p}


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


def find_library() -> str | None:
    """The path of libdnnl.so.3 in the first installed oneDNN CPU wheel, or None."""
    for dist in DISTRIBUTIONS:
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in files:
            if f.name == LIBRARY:
                return str(f.locate())
    return None


def _load(path: str) -> ctypes.CDLL:
    """dlopen ``path``. Intel's wheels install the libraries it needs beside it without a
    RUNPATH, so a dependency the loader cannot find is loaded from that folder first."""
    folder = os.path.dirname(path)
    for _ in range(16):
        try:
            return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            m = re.search(r"(\S+\.so[.\d]*): cannot open shared object", str(e))
            dep = os.path.join(folder, m.group(1)) if m else None
            if dep is None or dep == path or not os.path.exists(dep):
                raise
            _load(dep)
    raise OSError(f"{path}: too many missing dependencies")


def _dims(*values: int) -> Any:
    return _DIMS(*values)


@dataclass
class _Operand:
    """One NCHW/OIHW array of a primitive: its plain memory (pointed at the array at each
    call) and, when the primitive wants another layout, the blocked memory and the reorder
    between the two."""

    plain: ctypes.c_void_p
    mem: ctypes.c_void_p
    blocked_bytes: int  # 0 when the primitive reads or writes the array itself
    reorder: tuple[ctypes.c_void_p, Any] | None
    offset: int = 0  # where the blocked copy lies in the primitive's part of the scratch


class _Primitive:
    """One convolution primitive and its operands, run on arrays in a fixed order."""

    def __init__(self, dnnl: Dnnl, pd: ctypes.c_void_p,
                 operands: list[tuple[int, int | None, ctypes.c_void_p, bool]]):
        """``operands``: (exec argument, query of the layout the primitive wants or None for
        the plain one, plain layout, is an input), in the order ``run`` takes the arrays."""
        self.dnnl = dnnl
        self.ops: list[_Operand] = []
        self.inputs: list[_Operand] = []
        self.outputs: list[_Operand] = []
        args = []
        self.scratch_bytes = 0  # the blocked copies side by side, each aligned
        for arg, query, plain_md, is_input in operands:
            plain = dnnl.memory(plain_md)
            want = (plain_md if query is None
                    else ctypes.c_void_p(dnnl.lib.dnnl_primitive_desc_query_md(pd, query, 0)))
            if query is None or dnnl.lib.dnnl_memory_desc_equal(plain_md, want):
                op = _Operand(plain, plain, 0, None)
            else:
                mem = dnnl.memory(want)
                pair = (plain_md, plain, want, mem) if is_input else (want, mem, plain_md, plain)
                size = dnnl.lib.dnnl_memory_desc_get_size(want)
                op = _Operand(plain, mem, size, dnnl.reorder(*pair), self.scratch_bytes)
                self.scratch_bytes += -(-size // _ALIGN) * _ALIGN
            self.ops.append(op)
            (self.inputs if is_input else self.outputs).append(op)
            args.append(_ExecArg(arg, op.mem.value))
        self.prim = dnnl.primitive(pd)
        self.args = (_ExecArg * len(args))(*args)
        # what a call executes: the inputs' reorders, the primitive, the outputs' reorders
        self.steps = ([op.reorder for op in self.inputs if op.reorder] + [(self.prim, self.args)]
                      + [op.reorder for op in self.outputs if op.reorder])

    def run(self, *arrays: np.ndarray) -> None:
        d = self.dnnl
        lib = d.lib
        with d.lock:
            base = d.scratch(self.scratch_bytes) if self.scratch_bytes else 0
            for op, a in zip(self.ops, arrays, strict=True):
                lib.dnnl_memory_set_data_handle(op.plain, a.ctypes.data)
                if op.blocked_bytes:
                    lib.dnnl_memory_set_data_handle(op.mem, base + op.offset)
            for prim, args in self.steps:
                status = lib.dnnl_primitive_execute(prim, d.stream, len(args), args)
                if status:
                    raise PurineError(f"oneDNN: a primitive failed with status {status}")
            if lib.dnnl_stream_wait(d.stream):
                raise PurineError("oneDNN: waiting for the CPU stream failed")
            d.calls += 1


class Dnnl:
    """One loaded libdnnl, its CPU engine and stream, and the convolution and matmul
    primitives made so far, keyed by (op, geometry) and by the product's shape. Calls are
    serialized: the stream and the scratch buffers are shared, and each primitive uses every
    core anyway."""

    def __init__(self, path: str):
        lib = self.lib = _load(path)
        lib.dnnl_version.restype = ctypes.POINTER(_Version)
        v = lib.dnnl_version().contents
        self.version = f"{v.major}.{v.minor}.{v.patch}"
        self.runtime = _RUNTIMES.get(v.cpu_runtime, str(v.cpu_runtime))
        if v.major != 3:
            raise OSError(f"version {self.version} found, 3.x expected")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = _RESTYPES.get(name, ctypes.c_int)
        if lib.dnnl_engine_get_count(_CPU) == 0:
            raise OSError(f"oneDNN {self.version} ({self.runtime} CPU runtime) has no CPU "
                          f"engine")
        self.engine, self.stream = ctypes.c_void_p(), ctypes.c_void_p()
        self.call("dnnl_engine_create", ctypes.byref(self.engine), _CPU, 0)
        self.call("dnnl_stream_create", ctypes.byref(self.stream), self.engine, 1)
        self.lock = threading.Lock()
        self.calls = 0  # primitive runs so far (tests and benches see which path ran)
        self._scratch = np.empty(0, np.uint8)
        self._prims: dict[tuple[Any, ...], _Primitive | None] = {}
        self._hints: dict[Any, ctypes.c_void_p] = {}
        self._tags: dict[Any, int] = {}  # the activations' layout per geometry
        self._pools: dict[Any, _MaxPool | None] = {}

    def __str__(self) -> str:
        return f"oneDNN {self.version} ({self.runtime})"

    # -- C API helpers ---------------------------------------------------------------------
    def call(self, name: str, *args: Any) -> None:
        status = getattr(self.lib, name)(*args)
        if status:
            raise PurineError(f"oneDNN: {name} failed with status {status}")

    def md(self, dims: tuple[int, ...], tag: int) -> ctypes.c_void_p:
        md = ctypes.c_void_p()
        self.call("dnnl_memory_desc_create_with_tag", ctypes.byref(md), len(dims),
                  _dims(*dims), _F32, tag)
        return md

    def memory(self, md: ctypes.c_void_p) -> ctypes.c_void_p:
        """A memory of layout ``md`` with no buffer yet (``run`` points it at one)."""
        mem = ctypes.c_void_p()
        self.call("dnnl_memory_create", ctypes.byref(mem), md, self.engine, None)
        return mem

    def primitive(self, pd: ctypes.c_void_p) -> ctypes.c_void_p:
        p = ctypes.c_void_p()
        self.call("dnnl_primitive_create", ctypes.byref(p), pd)
        return p

    def reorder(self, src_md: ctypes.c_void_p, src: ctypes.c_void_p, dst_md: ctypes.c_void_p,
                dst: ctypes.c_void_p) -> tuple[ctypes.c_void_p, Any]:
        pd = ctypes.c_void_p()
        self.call("dnnl_reorder_primitive_desc_create", ctypes.byref(pd), src_md, self.engine,
                  dst_md, self.engine, None)
        return self.primitive(pd), (_ExecArg * 2)(_ExecArg(_ARG_SRC, src.value),
                                                   _ExecArg(_ARG_DST, dst.value))

    def scratch(self, nbytes: int) -> int:
        """The aligned address of the scratch buffer, grown to at least ``nbytes`` (the
        caller holds ``lock``; the address holds until the next call)."""
        if self._scratch.size < nbytes + _ALIGN:
            self._scratch = np.empty(0, np.uint8)  # the old buffer goes before the new comes
            self._scratch = np.empty(nbytes + _ALIGN, np.uint8)
        return self._scratch.ctypes.data + (-self._scratch.ctypes.data) % _ALIGN

    # -- convolutions ----------------------------------------------------------------------
    @staticmethod
    def _shapes(g: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(x, w, y) dims; a grouped weight is (group, outputs, channels, kh, kw) per group,
        which is Caffe's (num_output, channels/group, kh, kw) memory."""
        x = (g.num, g.channels, g.height, g.width)
        y = (g.num, g.num_output, g.out_h, g.out_w)
        if g.group == 1:
            w: tuple[int, ...] = (g.num_output, g.channels, g.kernel_h, g.kernel_w)
        else:
            w = (g.group, g.num_output // g.group, g.channels // g.group, g.kernel_h,
                 g.kernel_w)
        return x, w, y

    def _geometry_args(self, g: Any) -> tuple[Any, ...]:
        # oneDNN's dilation counts the gaps (Caffe's minus one); the right/bottom padding is
        # what Caffe's floored output size leaves over, negative when it drops a border.
        right = ((g.out_h - 1) * g.stride_h + g.dilation_h * (g.kernel_h - 1) + 1 - g.height
                 - g.pad_h,
                 (g.out_w - 1) * g.stride_w + g.dilation_w * (g.kernel_w - 1) + 1 - g.width
                 - g.pad_w)
        return (_dims(g.stride_h, g.stride_w), _dims(g.dilation_h - 1, g.dilation_w - 1),
                _dims(g.pad_h, g.pad_w), _dims(*right))

    def _plain(self, g: Any) -> tuple[ctypes.c_void_p, ...]:
        x, w, y = self._shapes(g)
        w_tag = _TAG_ABCD if g.group == 1 else _TAG_ABCDE
        return self.md(x, _TAG_ABCD), self.md(w, w_tag), self.md(y, _TAG_ABCD)

    def _activation_tag(self, g: Any) -> int:
        """NHWC for the activations of ``g`` when the blocked layouts oneDNN picks would pad
        them by more than ``PADDING_FOR_NHWC`` (channel counts that are not a multiple of its
        16-float block on AVX-512: LeNet's 20 and 50 become 32 and 64) and its NHWC
        kernels are not reference loops; else oneDNN's own choice. Once per geometry."""
        if g not in self._tags:
            x, _, y = self._plain(g)
            blocked = self._pd("fwd", g, _TAG_ANY)
            padded = 1.0
            for query, plain in ((_Q_SRC, x), (_Q_DST, y)):
                want = self.lib.dnnl_primitive_desc_query_md(blocked, query, 0)
                padded *= (self.lib.dnnl_memory_desc_get_size(want)
                           / self.lib.dnnl_memory_desc_get_size(plain))
            tag = _TAG_ANY
            if padded > PADDING_FOR_NHWC:
                try:
                    if not any(self._impl(self._pd(op, g, _TAG_NHWC)).startswith("ref")
                               for op in ("fwd", "bwd_data", "bwd_w")):
                        tag = _TAG_NHWC
                except PurineError:
                    pass
            self._tags[g] = tag
        return self._tags[g]

    def _impl(self, pd: ctypes.c_void_p) -> str:
        """The implementation's name: "brgconv:avx512_core", "jit:avx2", "ref:any"."""
        impl = ctypes.c_char_p()
        self.call("dnnl_primitive_desc_query", pd, _Q_IMPL_INFO_STR, 0, ctypes.byref(impl))
        return (impl.value or b"").decode()

    def _pd(self, op: str, g: Any, tag: int) -> ctypes.c_void_p:
        """The descriptor of ``op`` ("fwd", "fwd_bias", "bwd_data", "bwd_w") for ``g`` with
        activations of layout ``tag`` and the weight's left to oneDNN. The bias gradient is
        not in "bwd_w": it stays purine's own op (a layer may not want it)."""
        x, w, y = (self.md(s, t) for s, t in zip(self._shapes(g), (tag, _TAG_ANY, tag)))
        pd = ctypes.c_void_p()
        if op in ("fwd", "fwd_bias"):
            b = self.md((g.num_output,), _TAG_A) if op == "fwd_bias" else None
            self.call("dnnl_convolution_forward_primitive_desc_create", ctypes.byref(pd),
                      self.engine, _FORWARD_TRAINING, _CONV_DIRECT, x, w, b, y,
                      *self._geometry_args(g), None)
            return pd
        # The backward descriptors need the forward one (without bias) as a hint.
        if (g, tag) not in self._hints:
            self._hints[g, tag] = self._pd("fwd", g, tag)
        hint = self._hints[g, tag]
        if op == "bwd_data":
            self.call("dnnl_convolution_backward_data_primitive_desc_create", ctypes.byref(pd),
                      self.engine, _CONV_DIRECT, x, w, y, *self._geometry_args(g), hint, None)
        else:
            self.call("dnnl_convolution_backward_weights_primitive_desc_create",
                      ctypes.byref(pd), self.engine, _CONV_DIRECT, x, w, None, y,
                      *self._geometry_args(g), hint, None)
        return pd

    def _make(self, op: str, g: Any) -> _Primitive:
        x, w, y = self._plain(g)
        pd = self._pd(op, g, self._activation_tag(g))
        if op in ("fwd", "fwd_bias"):
            operands = [(_ARG_SRC, _Q_SRC, x, True), (_ARG_WEIGHTS, _Q_WEIGHTS, w, True),
                        (_ARG_DST, _Q_DST, y, False)]
            if op == "fwd_bias":  # always plain (x): no reorder
                operands.insert(2, (_ARG_BIAS, None, self.md((g.num_output,), _TAG_A), True))
            return _Primitive(self, pd, operands)
        if op == "bwd_data":
            return _Primitive(self, pd, [(_ARG_DIFF_DST, _Q_DIFF_DST, y, True),
                                         (_ARG_WEIGHTS, _Q_WEIGHTS, w, True),
                                         (_ARG_DIFF_SRC, _Q_DIFF_SRC, x, False)])
        return _Primitive(self, pd, [(_ARG_SRC, _Q_SRC, x, True),
                                     (_ARG_DIFF_DST, _Q_DIFF_DST, y, True),
                                     (_ARG_DIFF_WEIGHTS, _Q_DIFF_WEIGHTS, w, False)])

    def _get(self, op: str, g: Any) -> _Primitive | None:
        return self._cached((op, g), lambda: self._make(op, g))

    def _cached(self, key: tuple[Any, ...], make: Callable[[], _Primitive]
                ) -> _Primitive | None:
        """The primitive of ``key``, made by ``make()`` on first use; None (numpy runs it)
        when oneDNN has no implementation for it."""
        if key not in self._prims:
            with self.lock:
                if key not in self._prims:
                    try:
                        self._prims[key] = make()
                    except PurineError:
                        self._prims[key] = None
        return self._prims[key]

    @staticmethod
    def _fits(g: Any, *arrays: np.ndarray) -> bool:
        """Whether oneDNN can take these arrays: float32, contiguous, non-empty NCHW."""
        if min(g.num, g.channels, g.height, g.width, g.num_output, g.out_h, g.out_w) <= 0:
            return False
        return all(type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous
                   for a in arrays)

    def conv_forward(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, y: np.ndarray,
                     g: Any) -> bool:
        """y = w * x (+ b) for geometry ``g``; False (nothing written) when oneDNN does not
        take this call and numpy must."""
        arrays = (x, w, y) if b is None else (x, w, b, y)
        if not self._fits(g, *arrays):
            return False
        prim = self._get("fwd" if b is None else "fwd_bias", g)
        if prim is None:
            return False
        prim.run(*arrays)
        return True

    def conv_backward_data(self, dy: np.ndarray, w: np.ndarray, dx: np.ndarray, g: Any) -> bool:
        """dx = w^T * dy; False when numpy must do it."""
        if not self._fits(g, dy, w, dx):
            return False
        prim = self._get("bwd_data", g)
        if prim is None:
            return False
        prim.run(dy, w, dx)
        return True

    def conv_backward_weight(self, arrays: tuple[np.ndarray, ...], g: Any) -> bool:
        """dw = the sum over the (x, dy) pairs of ``arrays`` = (x0, dy0, x1, dy1, ..., dw);
        False when numpy must do it."""
        *pairs, dw = arrays
        if not pairs or not self._fits(g, *arrays):
            return False
        prim = self._get("bwd_w", g)
        if prim is None:
            return False
        prim.run(pairs[0], pairs[1], dw)
        if len(pairs) > 2:
            part = np.empty_like(dw)
            for i in range(2, len(pairs), 2):
                prim.run(pairs[i], pairs[i + 1], part)
                dw += part
        return True

    # -- matrix products (InnerProduct) ---------------------------------------------------
    def _matrix_md(self, rows: int, cols: int, stored_transposed: bool) -> ctypes.c_void_p:
        """A plain (rows, cols) matrix; ``stored_transposed``: its memory is the row-major
        (cols, rows) array, so only the strides differ."""
        md = ctypes.c_void_p()
        strides = (1, rows) if stored_transposed else (cols, 1)
        self.call("dnnl_memory_desc_create_with_strides", ctypes.byref(md), 2,
                  _dims(rows, cols), _F32, _dims(*strides))
        return md

    def _make_matmul(self, m: int, k: int, n: int, trans_a: bool, trans_b: bool,
                     bias: bool) -> _Primitive:
        a, b = self._matrix_md(m, k, trans_a), self._matrix_md(k, n, trans_b)
        c = self._matrix_md(m, n, False)
        bias_md = self._matrix_md(1, n, False) if bias else None
        pd = ctypes.c_void_p()
        self.call("dnnl_matmul_primitive_desc_create", ctypes.byref(pd), self.engine, a, b,
                  bias_md, c, None)
        # oneDNN's reference loops are far slower than numpy's BLAS (a transposed destination
        # took 4 s for AlexNet's fc6 weight gradient); numpy keeps such a product.
        if self._impl(pd).startswith("ref"):
            raise PurineError(f"oneDNN: only a reference matmul for {m}x{k}x{n}")
        operands = [(_ARG_SRC, None, a, True), (_ARG_WEIGHTS, None, b, True),
                    (_ARG_DST, None, c, False)]
        if bias_md is not None:
            operands.insert(2, (_ARG_BIAS, None, bias_md, True))
        return _Primitive(self, pd, operands)

    def matmul(self, a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, c: np.ndarray,
               m: int, k: int, n: int, trans_a: bool = False, trans_b: bool = False) -> bool:
        """c (m, n) = A B (+ bias on every row), where A (m, k) is ``a``'s memory read
        row-major, or as the row-major (k, m) array when ``trans_a``, and B (k, n) likewise
        ``b``'s (as (n, k) when ``trans_b``); the arrays may have any shape of that size.
        False (nothing written) when numpy must do it: another dtype, an empty or small
        product (``MATMUL_MIN_MACS``), an array that is not contiguous, or no oneDNN
        implementation."""
        arrays = (a, b, c) if bias is None else (a, b, bias, c)
        if (min(m, k, n) <= 0 or m * k * n < MATMUL_MIN_MACS
                or a.size != m * k or b.size != k * n or c.size != m * n
                or (bias is not None and bias.size != n)
                or not all(type(x) is np.ndarray and x.dtype == np.float32
                           and x.flags.c_contiguous for x in arrays)):
            return False
        key = ("matmul", m, k, n, trans_a, trans_b, bias is not None)
        prim = self._cached(key, lambda: self._make_matmul(m, k, n, trans_a, trans_b,
                                                           bias is not None))
        if prim is None:
            return False
        prim.run(*arrays)
        return True

    # -- ReLU ------------------------------------------------------------------------------
    def _make_relu(self, n: int, backward: bool) -> _Primitive:
        md = self.md((n,), _TAG_A)
        fwd = ctypes.c_void_p()
        self.call("dnnl_eltwise_forward_primitive_desc_create", ctypes.byref(fwd), self.engine,
                  _FORWARD_TRAINING, _ELTWISE_RELU, md, md, 0.0, 0.0, None)
        if not backward:
            return _Primitive(self, fwd, [(_ARG_SRC, None, md, True),
                                          (_ARG_DST, None, md, False)])
        pd = ctypes.c_void_p()
        self.call("dnnl_eltwise_backward_primitive_desc_create", ctypes.byref(pd), self.engine,
                  _ELTWISE_RELU, md, md, md, 0.0, 0.0, fwd, None)
        return _Primitive(self, pd, [(_ARG_SRC, None, md, True), (_ARG_DIFF_DST, None, md, True),
                                     (_ARG_DIFF_SRC, None, md, False)])

    def _relu(self, backward: bool, *arrays: np.ndarray) -> bool:
        n = arrays[0].size
        if n < ELTWISE_MIN or not all(type(a) is np.ndarray and a.dtype == np.float32
                                      and a.flags.c_contiguous and a.size == n for a in arrays):
            return False
        prim = self._cached(("relu", n, backward), lambda: self._make_relu(n, backward))
        if prim is None:
            return False
        prim.run(*arrays)
        return True

    def relu_forward(self, x: np.ndarray, y: np.ndarray) -> bool:
        """y = max(x, 0) (``y`` may be ``x``), the bits of numpy's; False (nothing written)
        when numpy must do it: another dtype, fewer than ``ELTWISE_MIN`` values."""
        return self._relu(False, x, y)

    def relu_backward(self, x: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> bool:
        """dx = dy where x > 0, else dy * 0 (``x`` may be the top: the same signs); False
        when numpy must do it."""
        return self._relu(True, x, dy, dx)

    # -- MAX pooling -----------------------------------------------------------------------
    def _max_pool(self, g: Any) -> _MaxPool | None:
        """The forward primitive of geometry ``g`` on plain NCHW, or None when oneDNN has
        none or its workspace is not one kernel offset per output (u8 or s32)."""
        x, y = self._pool_mds(g)
        # Caffe clips a window to the image; oneDNN pads with the lowest float, which never
        # wins over an image value, so the ceil-rounded overhang is right padding.
        window = _pool_window(g)
        pd = ctypes.c_void_p()
        self.call("dnnl_pooling_forward_primitive_desc_create", ctypes.byref(pd), self.engine,
                  _FORWARD_TRAINING, _POOLING_MAX, x, y, *window, None)
        ws = ctypes.c_void_p(self.lib.dnnl_primitive_desc_query_md(pd, _Q_WORKSPACE, 0))
        outputs = g.num * g.channels * g.pooled_h * g.pooled_w
        code = {outputs: np.uint8, 4 * outputs: np.int32}.get(
            self.lib.dnnl_memory_desc_get_size(ws) if ws.value else 0)
        if code is None:
            return None
        # The workspace holds the offset i*kernel_w + j of each maximum in its (padded)
        # window.
        prim = _Primitive(self, pd, [(_ARG_SRC, None, x, True), (_ARG_DST, None, y, False),
                                     (_ARG_WORKSPACE, None, ws, False)])
        return _MaxPool(prim, pd, window, ws, code)

    def _pool(self, g: Any) -> _MaxPool | None:
        """The MAX pooling forward of geometry ``g``, made on first use; None when oneDNN
        has none for it."""
        if g not in self._pools:
            with self.lock:
                if g not in self._pools:
                    try:
                        self._pools[g] = self._max_pool(g)
                    except PurineError:  # no implementation for this geometry
                        self._pools[g] = None
        return self._pools[g]

    def _pool_fits(self, g: Any, x: np.ndarray, y: np.ndarray, offsets: np.ndarray
                   ) -> _MaxPool | None:
        """The forward of ``g`` when oneDNN takes these arrays (float32 x and y, contiguous,
        no window wholly outside the image, ``offsets`` of its workspace's type), else
        None."""
        if (not _pool_takes(g, x, y) or type(offsets) is not np.ndarray
                or not offsets.flags.c_contiguous or offsets.size != y.size):
            return None
        pool = self._pool(g)
        return pool if pool is not None and offsets.dtype == pool.code else None

    def max_pool_forward_offsets(self, x: np.ndarray, y: np.ndarray, offsets: np.ndarray,
                                 g: Any) -> bool:
        """y = the window maxima, ``offsets`` = oneDNN's workspace: each maximum's kernel
        offset i * kernel_w + j (the first in scan order on ties), which ``max_pool_backward``
        reads; False (nothing written) when numpy must do it."""
        pool = self._pool_fits(g, x, y, offsets)
        if pool is None:
            return False
        pool.prim.run(x, y, offsets)
        return True

    def max_pool_backward(self, dy: np.ndarray, offsets: np.ndarray, dx: np.ndarray, g: Any
                          ) -> bool:
        """dx = dy scattered to the maxima ``max_pool_forward_offsets`` found (overlapping
        windows add up); False (nothing written) when numpy must do it."""
        pool = self._pool_fits(g, dx, dy, offsets)
        if pool is None:
            return False
        prim = self._cached(("max_pool_backward", g), lambda: self._max_pool_backward(g, pool))
        if prim is None:
            return False
        prim.run(dy, offsets, dx)
        return True

    def _max_pool_backward(self, g: Any, pool: _MaxPool) -> _Primitive:
        x, y = self._pool_mds(g)
        pd = ctypes.c_void_p()
        self.call("dnnl_pooling_backward_primitive_desc_create", ctypes.byref(pd), self.engine,
                  _POOLING_MAX, x, y, *pool.window, pool.pd, None)
        return _Primitive(self, pd, [(_ARG_DIFF_DST, None, y, True),
                                     (_ARG_WORKSPACE, None, pool.workspace, True),
                                     (_ARG_DIFF_SRC, None, x, False)])

    def _pool_mds(self, g: Any) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        return (self.md((g.num, g.channels, g.height, g.width), _TAG_ABCD),
                self.md((g.num, g.channels, g.pooled_h, g.pooled_w), _TAG_ABCD))

    # -- AVE pooling -----------------------------------------------------------------------
    def _make_ave_pool(self, g: Any, backward: bool) -> _Primitive:
        alg = ave_algorithm(g)
        if alg is None:
            raise PurineError("oneDNN: no average that divides as Caffe does")
        x, y = self._pool_mds(g)
        window = _pool_window(g)
        fwd = ctypes.c_void_p()
        self.call("dnnl_pooling_forward_primitive_desc_create", ctypes.byref(fwd), self.engine,
                  _FORWARD_TRAINING, alg, x, y, *window, None)
        if not backward:
            pd, operands = fwd, [(_ARG_SRC, None, x, True), (_ARG_DST, None, y, False)]
        else:
            pd = ctypes.c_void_p()
            self.call("dnnl_pooling_backward_primitive_desc_create", ctypes.byref(pd),
                      self.engine, alg, x, y, *window, fwd, None)
            operands = [(_ARG_DIFF_DST, None, y, True), (_ARG_DIFF_SRC, None, x, False)]
        # Only vectorized kernels: the scalar ones ("simple_nchw", "ref"), which oneDNN picks
        # for few planes, took up to 2.7x numpy's separable products (4x3 planes of 64x64,
        # a 5x5 window: 0.67 against 0.25 ms).
        if not self._impl(pd).startswith("jit"):
            raise PurineError("oneDNN: no vectorized average pooling for this geometry")
        return _Primitive(self, pd, operands)

    def _ave_pool(self, backward: bool, src: np.ndarray, dst: np.ndarray, g: Any) -> bool:
        if not _pool_takes(g, *((dst, src) if backward else (src, dst))):
            return False
        prim = self._cached(("ave_pool", g, backward), lambda: self._make_ave_pool(g, backward))
        if prim is None:
            return False
        prim.run(src, dst)
        return True

    def ave_pool_forward(self, x: np.ndarray, y: np.ndarray, g: Any) -> bool:
        """y = each window's mean as Caffe divides it (``ave_algorithm``); False (nothing
        written) when numpy must do it: another dtype, a window wholly outside the image, a
        geometry whose divisor no oneDNN average gives."""
        return self._ave_pool(False, x, y, g)

    def ave_pool_backward(self, dy: np.ndarray, dx: np.ndarray, g: Any) -> bool:
        """dx = each window's dy over its divisor, spread over the window; False when numpy
        must do it."""
        return self._ave_pool(True, dy, dx, g)


def _pool_takes(g: Any, x: np.ndarray, y: np.ndarray) -> bool:
    """Whether oneDNN's pooling takes input ``x`` and output ``y`` of geometry ``g``: float32,
    contiguous, of ``g``'s sizes, not empty, no window wholly outside the image."""
    return (min(g.num, g.channels, g.height, g.width, g.pooled_h, g.pooled_w) > 0
            and not (g.empty_rows or g.empty_cols)
            and x.size == g.num * g.channels * g.height * g.width
            and y.size == g.num * g.channels * g.pooled_h * g.pooled_w
            and all(type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous
                    for a in (x, y)))


def _right_padding(g: Any) -> tuple[int, int]:
    """How far the last (ceil-rounded) window of pooling geometry ``g`` reaches past the
    image, rows and columns: oneDNN's right padding."""
    return ((g.pooled_h - 1) * g.stride_h + g.kernel_h - g.height - g.pad_h,
            (g.pooled_w - 1) * g.stride_w + g.kernel_w - g.width - g.pad_w)


def _pool_window(g: Any) -> tuple[Any, ...]:
    """oneDNN's strides, kernel, dilation, left and right padding of pooling geometry ``g``."""
    return (_dims(g.stride_h, g.stride_w), _dims(g.kernel_h, g.kernel_w), _dims(0, 0),
            _dims(g.pad_h, g.pad_w), _dims(*_right_padding(g)))


def ave_algorithm(g: Any) -> int | None:
    """The oneDNN average whose divisor is Caffe's for geometry ``g``, or None. Caffe divides
    a window's sum by its extent clipped to the padded image (the padding counts, the
    overhang of a ceil-rounded last window does not). Without padding that is the number of
    image values in the window, oneDNN's exclude-padding average; where no window overhangs
    the padded image it is the kernel's area, oneDNN's include-padding average."""
    if g.pad_h == g.pad_w == 0:
        return _POOLING_AVG_EXCLUDE
    right_h, right_w = _right_padding(g)
    return _POOLING_AVG_INCLUDE if right_h <= g.pad_h and right_w <= g.pad_w else None


@dataclass
class _MaxPool:
    """A MAX pooling forward primitive (x, y, workspace) and what its backward needs."""

    prim: _Primitive
    pd: ctypes.c_void_p  # the forward descriptor (the backward's hint)
    window: tuple[Any, ...]  # strides, kernel, dilation, left and right padding (dims)
    workspace: ctypes.c_void_p  # the workspace's memory descriptor
    code: Any  # the workspace's numpy dtype


@dataclass
class Settings:
    """Whether the float32 CPU bodies may call oneDNN: ``PURINE_ONEDNN=0`` says no. Read once,
    when this module loads, not on every convolution; ``use`` changes it afterwards."""

    enabled: bool = True

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        return cls(enabled=environ.get("PURINE_ONEDNN") != "0")


SETTINGS = Settings.from_environ()
# "dnnl": the loaded library (or None: not installed, failed); "blas_threads": present while
# this module holds OpenBLAS at one thread, the count it had before (None: no OpenBLAS);
# "passes": how many passes are running now (pass_scope), in any thread.
_STATE: dict[str, Any] = {"passes": 0}
_LOAD_LOCK = threading.Lock()


@contextmanager
def pass_scope() -> Iterator[None]:
    """Hold OpenBLAS at one thread while a pass runs with oneDNN loaded and in use, and give
    its count back when the last pass in flight (passes nest and run in several threads)
    ends: the setting is the kernels', not the process's."""
    with _LOAD_LOCK:
        _STATE["passes"] += 1
        if SETTINGS.enabled and _STATE.get("dnnl") is not None:
            _take_blas_threads()
    try:
        yield
    finally:
        with _LOAD_LOCK:
            _STATE["passes"] -= 1
            if _STATE["passes"] == 0:
                _give_back_blas_threads()


def use(enabled: bool) -> bool:
    """Turn oneDNN on or off from now on (tests and benches that compare it with numpy);
    returns the setting before. Off, OpenBLAS gets back the thread count oneDNN's load took."""
    with _LOAD_LOCK:
        before, SETTINGS.enabled = SETTINGS.enabled, bool(enabled)
        if not enabled:
            _give_back_blas_threads()
        elif _STATE.get("dnnl") is not None and _STATE["passes"]:
            _take_blas_threads()
    return before


def get() -> Dnnl | None:
    """The loaded oneDNN, or None: when it is turned off (``PURINE_ONEDNN=0``, ``use``), when
    no oneDNN CPU wheel is installed, or when the installed one fails to load (said once in a
    warning)."""
    if not SETTINGS.enabled:
        return None
    try:
        return _STATE["dnnl"]
    except KeyError:
        pass
    with _LOAD_LOCK:
        if "dnnl" not in _STATE:
            _STATE["dnnl"] = _start()
    return _STATE["dnnl"]


def _start() -> Dnnl | None:
    path = find_library()
    if path is None:
        from purine.log import get_logger

        if platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64"):
            why = ("oneDNN is not installed (pip install onednn-cpu-gomp==2023.2.0, a "
                   "dependency of purine-caffe here)")
        else:
            why = (f"no oneDNN CPU wheel exists for {platform.system()} "
                   f"{platform.machine()} (Linux x86-64 only)")
        get_logger().warning("%s: convolutions run on numpy, about 1.3-2x slower", why)
        return None
    # No OMP_WAIT_POLICY of ours: libgomp's default, a bounded spin after each parallel
    # region, keeps its team awake across the gaps between one op's primitives and the
    # next op's. PASSIVE (sleep at once) paid a wake-up per primitive: LeNet's training loop
    # ran 3,000-4,000 img/s with it against 4,500-5,000 without on 2 cores. It once kept the
    # team off the cores of OpenBLAS's threads; OpenBLAS now runs one thread while passes run.
    try:
        dnnl = Dnnl(path)
    except (OSError, AttributeError, PurineError) as e:
        from purine.log import get_logger

        if isinstance(e, OSError) and "libgomp" in str(e):  # the one system library it needs
            get_logger().warning("oneDNN needs the GNU OpenMP runtime libgomp.so.1, which this "
                                 "system lacks (apt-get install libgomp1; dnf install libgomp); "
                                 "convolutions run on numpy")
        else:
            get_logger().warning("oneDNN at %s is not used, convolutions run on numpy: %s",
                                 path, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
    # OpenBLAS's idle threads spin too, against oneDNN's OpenMP team: with one BLAS thread
    # bench/cpu_nets.py on 2 cores went from 1.23x to 0.72x PyTorch's time on CIFAR-10
    # quick, 1.26x to 0.85x on LeNet and 1.07x to 0.85x on AlexNet. InnerProduct's larger
    # products go to oneDNN for that reason; raising the BLAS threads around them instead
    # made the next convolutions slower than the products got faster (AlexNet 470-480 ms
    # against 380-390 ms through oneDNN, CIFAR-10 quick 1.75x its time). Held while passes
    # run (pass_scope; this one, when the library loads in the middle of it).
    if _STATE["passes"]:
        _take_blas_threads()
    return dnnl


def _take_blas_threads() -> None:
    if "blas_threads" not in _STATE:
        _STATE["blas_threads"] = set_blas_threads(1)


def _give_back_blas_threads() -> None:
    before = _STATE.pop("blas_threads", None)
    if before is not None:
        set_blas_threads(before)


def available() -> bool:
    return get() is not None


def describe() -> str:
    """What runs the float32 CPU convolutions: "oneDNN 3.2.0 (OpenMP)" or "numpy"."""
    d = get()
    return "numpy" if d is None else str(d)


def reset() -> None:
    """Forget the loaded library's state so that the next ``get`` looks again (tests), and
    give OpenBLAS back its thread count. A library once loaded stays in the process."""
    with _LOAD_LOCK:
        _give_back_blas_threads()
        passes = _STATE["passes"]
        _STATE.clear()
        _STATE["passes"] = passes
