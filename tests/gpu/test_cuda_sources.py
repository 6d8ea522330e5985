"""Our CUDA C sources, checked without a GPU: they compile for sm_90 in float and double
(nvcc -ptx), and, emulated on the CPU (tests/gpu/emulate.py), every kernel and the GPU
paths of the convolution, pooling and LRN ops around them agree with the CPU ops."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from purine import backend
from purine.backend import cuda
from purine.errors import PurineError
from purine.ops import conv, lrn, pooling
from tests.gpu import emulate

FAMILIES = ["im2col", "pooling", "lrn"]
DTYPES = [np.float32, np.float64]
# float32: the same sums in another order (or fused multiply-adds) differ in the last bits.
TOL = {np.float32: dict(rtol=2e-5, atol=2e-5), np.float64: dict(rtol=1e-12, atol=1e-12)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_source_compiles_for_sm90(tmp_path, family, dtype):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed: the CUDA sources cannot be compiled here")
    src = tmp_path / f"{family}.cu"
    src.write_text(cuda.source(family, dtype))
    ptx = tmp_path / f"{family}.ptx"
    run = subprocess.run([nvcc, "-ptx", "-arch=sm_90", *cuda.OPTIONS, str(src), "-o", str(ptx)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    entries = {line.split()[-1].rstrip("(") for line in ptx.read_text().splitlines()
               if ".entry" in line}
    assert entries == set(cuda.signatures(family))


def nvrtc_library():
    """libnvrtc: $PURINE_NVRTC, the nvidia-cuda-nvrtc wheel's, or the system's; None if
    none is found. Its builtins library is loaded first from the same folder, where NVRTC
    looks for it by name."""
    import ctypes
    import ctypes.util
    import importlib.util
    import os
    from pathlib import Path

    candidates = [os.environ.get("PURINE_NVRTC", "")]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(str(p) for p in Path(root).glob("*/lib/libnvrtc.so*")
                             if "alt" not in p.name)
    candidates.append(ctypes.util.find_library("nvrtc") or "")
    for path in filter(None, candidates):
        try:
            for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so*")):
                if "alt" not in builtins.name:
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_source_compiles_with_nvrtc(family, dtype):
    """The compiler CuPy uses at run time, with the loader's options, no headers."""
    import ctypes

    lib = nvrtc_library()
    if lib is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc, or set PURINE_NVRTC)")
    prog = ctypes.c_void_p()
    text = cuda.source(family, dtype).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), text, f"{family}.cu".encode(), 0,
                                  None, None) == 0
    options = [o.encode() for o in (*cuda.OPTIONS, "--gpu-architecture=compute_90")]
    rc = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, log.value.decode()
    assert "warning" not in log.value.decode()


def test_signatures_and_argument_checks():
    assert cuda.signature("im2col", "im2col") == ("long long", "T*", "T*") + ("int",) * 14
    assert cuda.signature("pooling", "max_pool_forward")[:4] == ("long long", "T*", "T*",
                                                                "int*")
    assert cuda.signature("lrn", "lrn_across_forward")[-5:] == ("long long", "int", "T", "T",
                                                                "T")
    kinds = ("long long", "T*", "int*", "T", "int")
    x, m = np.zeros(4, np.float32), np.zeros(4, np.int32)
    args = cuda.arguments(kinds, np.float32, (4, x, m, 0.1, 3), "k")
    assert [type(a) for a in args] == [np.int64, np.ndarray, np.ndarray, np.float32, np.int32]
    assert args[3] == np.float32(0.1)
    with pytest.raises(PurineError, match="array of float32"):
        cuda.arguments(kinds, np.float32, (4, x.astype(np.float64), m, 0.1, 3), "k")
    with pytest.raises(PurineError, match="array of int32"):
        cuda.arguments(kinds, np.float32, (4, x, x, 0.1, 3), "k")
    with pytest.raises(PurineError, match="C-contiguous"):
        cuda.arguments(kinds, np.float32, (4, np.zeros(8, np.float32)[::2], m, 0.1, 3), "k")
    with pytest.raises(PurineError, match="does not fit an int"):
        cuda.arguments(kinds, np.float32, (4, x, m, 0.1, 1 << 31), "k")
    with pytest.raises(PurineError, match="takes 5 arguments"):
        cuda.arguments(kinds, np.float32, (4, x, m, 0.1), "k")
    with pytest.raises(PurineError, match="no kernel 'nope'"):
        cuda.signature("im2col", "nope")
    with pytest.raises(PurineError, match="float32 or float64"):
        cuda.source("im2col", np.int32)
    assert cuda.blocks(1) == 1 and cuda.blocks(257) == 2
    assert cuda.blocks(1 << 40) == cuda.MAX_BLOCKS


# -- im2col / col2im -------------------------------------------------------------------------
# (num, channels, height, width, num_output, kh, kw, sh, sw, ph, pw, dh, dw, group)
CONV_CASES = [
    (2, 3, 7, 7, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1),
    (3, 4, 9, 9, 4, 3, 3, 1, 1, 2, 2, 2, 2, 2),  # dilated, grouped
    (2, 3, 11, 9, 6, 5, 3, 2, 3, 2, 1, 1, 1, 3),  # rectangular, strided, 3 groups
    (3, 2, 1, 12, 4, 1, 3, 1, 2, 0, 1, 1, 2, 1),  # one row (a 1-d convolution)
    (2, 3, 8, 8, 2, 11, 11, 4, 4, 5, 5, 1, 1, 1),  # kernel larger than the image
    (4, 6, 5, 5, 6, 1, 1, 1, 1, 0, 0, 1, 1, 3),  # 1x1: no columns
    (2, 4, 6, 6, 4, 1, 1, 2, 2, 0, 0, 1, 1, 2),  # 1x1 with stride: columns
    (5, 3, 6, 7, 5, 2, 3, 1, 1, 1, 2, 1, 1, 1),
]


def columns_ref(x, g):
    """The (C*kh*kw, n*P) column matrix built with numpy loops over the kernel taps."""
    n = x.shape[0]
    xp = np.zeros((n, g.channels, g.height + 2 * g.pad_h, g.width + 2 * g.pad_w), x.dtype)
    xp[:, :, g.pad_h:g.pad_h + g.height, g.pad_w:g.pad_w + g.width] = x
    col = np.empty((g.channels, g.kernel_h, g.kernel_w, n, g.out_h, g.out_w), x.dtype)
    for i in range(g.kernel_h):
        for j in range(g.kernel_w):
            h0, w0 = i * g.dilation_h, j * g.dilation_w
            win = xp[:, :, h0:h0 + g.stride_h * (g.out_h - 1) + 1:g.stride_h,
                     w0:w0 + g.stride_w * (g.out_w - 1) + 1:g.stride_w]
            col[:, i, j] = win.transpose(1, 0, 2, 3)
    return col.reshape(g.channels * g.kernel_h * g.kernel_w, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("args", CONV_CASES)
def test_im2col_col2im(args, dtype):
    g = conv.ConvGeometry(*args)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((g.num, g.channels, g.height, g.width)).astype(dtype)
    want = columns_ref(x, g)
    col = np.full(want.shape, np.nan, dtype)
    emulate.kernel("im2col", "im2col", dtype)(col.size, x, col, g.num, *conv._gpu_geometry(g))
    np.testing.assert_array_equal(col, want)  # a pure copy: exact
    # col2im is im2col's adjoint: <col2im(c), x> = <c, im2col(x)> for any c.
    c = rng.standard_normal(want.shape).astype(dtype)
    dx = np.full(x.shape, np.nan, dtype)
    emulate.kernel("im2col", "col2im", dtype)(dx.size, c, dx, g.num, *conv._gpu_geometry(g))
    lhs = np.vdot(dx.astype(float), x.astype(float))
    rhs = np.vdot(c.astype(float), want.astype(float))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-12 if dtype == np.float64 else 1e-5)
    # ... and, pixel by pixel, the CPU op's col2im of the same columns.
    ws = conv._Workspace(np, g, dtype)
    ws.buf("col", c.shape)[...] = c
    ws.batch_last = False
    want_dx = np.empty_like(dx)
    ws.col2im(want_dx)
    np.testing.assert_allclose(dx, want_dx, **TOL[dtype])


# -- the convolution's GPU path on numpy arrays with emulated kernels --------------------------
def conv_case(args, dtype):
    g = conv.ConvGeometry(*args)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((g.num, g.channels, g.height, g.width)).astype(dtype)
    w = rng.standard_normal((g.num_output, g.channels // g.group, g.kernel_h,
                             g.kernel_w)).astype(dtype)
    b = rng.standard_normal(g.num_output).astype(dtype)
    dy = rng.standard_normal((g.num, g.num_output, g.out_h, g.out_w)).astype(dtype)
    return g, x, w, b, dy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [1, 2, None])
@pytest.mark.parametrize("args", CONV_CASES)
def test_conv_gpu_path_matches_cpu(monkeypatch, args, chunk, dtype):
    g, x, w, b, dy = conv_case(args, dtype)
    per_sample = g.channels * g.kernel_h * g.kernel_w * g.out_h * g.out_w
    if chunk is not None:  # 2 leaves a short last chunk for odd batches
        monkeypatch.setattr(conv, "GPU_COL_BUDGET", chunk * per_sample)
    assert len(conv._gpu_chunks(g)) == -(-g.num // (chunk or g.num))
    k = emulate.kernel
    tol = TOL[dtype]
    for bias in (b, None):
        want = np.empty_like(dy)
        conv.conv_forward(x, w, *([bias] if bias is not None else []), want, geom=g)
        y = np.full_like(dy, np.nan)
        conv._gpu_forward(np, k, x, w, bias, y, g)
        np.testing.assert_allclose(y, want, **tol)
    want_dx = np.empty_like(x)
    conv.conv_backward_data(dy, w, want_dx, geom=g)
    dx = np.full_like(x, np.nan)
    conv._gpu_backward_data(np, k, dy, w, dx, g)
    np.testing.assert_allclose(dx, want_dx, **tol)
    want_dw = np.empty_like(w)
    conv.conv_backward_weight(x, dy, x, 2 * dy, want_dw, geom=g)  # two pairs share dw
    dw = np.full_like(w, np.nan)
    conv._gpu_backward_weight(np, k, [x, dy, x, 2 * dy], dw, g)
    np.testing.assert_allclose(dw, want_dw, rtol=tol["rtol"], atol=tol["atol"] * 10)


@pytest.mark.parametrize("chunk", [1, None])
@pytest.mark.parametrize("args", CONV_CASES[:4])
def test_deconv_gpu_path_matches_cpu(monkeypatch, args, chunk):
    # Deconvolution's forward is the convolution's backward data plus the bias.
    g, x, w, b, dy = conv_case(args, np.float64)
    if chunk is not None:
        monkeypatch.setattr(conv, "GPU_COL_BUDGET",
                            g.channels * g.kernel_h * g.kernel_w * g.out_h * g.out_w)
    bias = np.random.default_rng(3).standard_normal(g.channels)
    want = np.empty_like(x)
    conv.deconv_forward(dy, w, bias, want, geom=g)
    got = np.full_like(x, np.nan)
    conv._gpu_backward_data(np, emulate.kernel, dy, w, got, g)
    got += bias.reshape(1, -1, 1, 1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_conv_gpu_empty_batch_weight_gradient():
    g = conv.ConvGeometry(0, 2, 5, 5, 3, 3, 3)
    dw = np.full((3, 2, 3, 3), np.nan)
    conv._gpu_backward_weight(np, emulate.kernel, [], dw, g)
    assert not dw.any()


def test_conv_gpu_float64_gradient_check():
    """The GPU path's backward ops are the forward's derivatives (finite differences)."""
    g, x, w, b, dy = conv_case((2, 4, 6, 5, 4, 3, 2, 2, 1, 1, 1, 1, 2, 2), np.float64)
    k = emulate.kernel

    def loss(xv, wv):
        y = np.empty_like(dy)
        conv._gpu_forward(np, k, xv, wv, b, y, g)
        return np.vdot(y, dy)

    dx, dw = np.empty_like(x), np.empty_like(w)
    conv._gpu_backward_data(np, k, dy, w, dx, g)
    conv._gpu_backward_weight(np, k, [x, dy], dw, g)
    rng = np.random.default_rng(4)
    for _ in range(6):
        for arr, grad, f in ((x, dx, lambda v: loss(v, w)), (w, dw, lambda v: loss(x, v))):
            i = tuple(rng.integers(0, s) for s in arr.shape)
            e = 1e-6
            plus, minus = arr.copy(), arr.copy()
            plus[i] += e
            minus[i] -= e
            np.testing.assert_allclose((f(plus) - f(minus)) / (2 * e), grad[i], rtol=1e-6,
                                       atol=1e-8)


# -- pooling ---------------------------------------------------------------------------------
def pool_geometry(n, c, h, w, kernel, stride, pad, ceil=True):
    def pooled(size, k, s, p):
        span = (size + 2 * p - k) / s
        out = (int(np.ceil(span)) if ceil else int(np.floor(span))) + 1
        if p and (out - 1) * s >= size + p:
            out -= 1
        return out
    return pooling.PoolGeometry(n, c, h, w, *kernel, *stride, *pad,
                                pooled(h, kernel[0], stride[0], pad[0]),
                                pooled(w, kernel[1], stride[1], pad[1]))


POOL_CASES = [
    (2, 3, 7, 7, (3, 3), (2, 2), (0, 0)),  # overlapping, ceil-mode clipped last window
    (2, 3, 8, 8, (2, 2), (2, 2), (0, 0)),  # tiling
    (1, 4, 9, 7, (3, 2), (2, 3), (1, 1)),  # padded, rectangular
    (2, 2, 5, 5, (1, 1), (3, 3), (0, 0)),  # stride > kernel: empty windows past the image
    (2, 2, 6, 6, (2, 2), (4, 4), (0, 0)),  # empty windows again
    (2, 3, 6, 5, (6, 5), (1, 1), (0, 0)),  # global
    (1, 2, 1, 9, (1, 3), (1, 2), (0, 1)),  # one row
    (2, 2, 10, 10, (3, 3), (2, 2), (2, 2)),  # pad 2: a window may start in the padding
    (1, 2, 5, 5, (3, 3), (2, 2), (1, 1)),  # AVE extent clipped at height + pad
]


def pool_inputs(g, dtype, ties=False):
    rng = np.random.default_rng(5)
    if ties:  # few distinct values: the first maximum in scan order must win
        x = rng.integers(0, 3, (g.num, g.channels, g.height, g.width)).astype(dtype)
    else:
        x = rng.standard_normal((g.num, g.channels, g.height, g.width)).astype(dtype)
    dy = rng.standard_normal((g.num, g.channels, g.pooled_h, g.pooled_w)).astype(dtype)
    return x, dy


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("mask_type", ["int32", "data"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", POOL_CASES)
def test_max_pool_matches_cpu(case, dtype, mask_type, ties):
    g = pool_geometry(*case)
    x, dy = pool_inputs(g, dtype, ties)
    mdt = np.int32 if mask_type == "int32" else dtype
    shape = (g.num, g.channels, g.pooled_h, g.pooled_w)
    want_y, want_m = np.empty(shape, dtype), np.empty(shape, mdt)
    pooling.max_pool_forward(x, want_y, want_m, geom=g)
    y, m = np.full(shape, np.nan, dtype), np.full(shape, 7, mdt)
    pooling._gpu_max_pool_forward(emulate.kernel, x, y, m, g)
    np.testing.assert_array_equal(y, want_y)  # maxima are copies: exact
    np.testing.assert_array_equal(m, want_m)
    want_dx = np.empty_like(x)
    pooling.max_pool_backward(dy, want_m, want_dx, geom=g)
    dx = np.full_like(x, np.nan)
    pooling._gpu_max_pool_backward(emulate.kernel, dy, m, dx, g)
    # Both add the windows' gradients in window order: exact as well.
    np.testing.assert_array_equal(dx, want_dx)


def test_max_pool_mask_of_other_float_type_and_nan():
    g = pool_geometry(1, 1, 4, 4, (2, 2), (2, 2), (0, 0))
    x = np.arange(16, dtype=np.float64).reshape(1, 1, 4, 4)
    x[0, 0, 0, 1] = np.nan
    y, m = np.empty((1, 1, 2, 2)), np.empty((1, 1, 2, 2), np.float32)
    pooling._gpu_max_pool_forward(emulate.kernel, x, y, m, g)
    want_y, want_m = np.empty_like(y), np.empty_like(m)
    pooling.max_pool_forward(x, want_y, want_m, geom=g)
    np.testing.assert_array_equal(y, want_y)  # NaN propagates as on the CPU
    np.testing.assert_array_equal(m, want_m)
    assert np.isnan(y[0, 0, 0, 0]) and m[0, 0, 0, 0] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", POOL_CASES)
def test_ave_pool_matches_cpu(case, dtype):
    g = pool_geometry(*case)
    x, dy = pool_inputs(g, dtype)
    shape = (g.num, g.channels, g.pooled_h, g.pooled_w)
    want = np.empty(shape, dtype)
    pooling.ave_pool_forward(x, want, geom=g)
    y = np.full(shape, 7, dtype)
    pooling._gpu_ave_pool(emulate.kernel, "ave_pool_forward", x, y, g)
    np.testing.assert_allclose(y, want, **TOL[dtype])  # NaN where Caffe divides 0 by 0
    dy = np.where(np.isnan(want), 0, dy).astype(dtype)
    want_dx = np.empty_like(x)
    pooling.ave_pool_backward(dy, want_dx, geom=g)
    dx = np.full_like(x, np.nan)
    pooling._gpu_ave_pool(emulate.kernel, "ave_pool_backward", dy, dx, g)
    np.testing.assert_allclose(dx, want_dx, **TOL[dtype])


def test_ave_pool_zero_extent_window_is_nan():
    # Without padding but a stride past the kernel, a ceil-rounded window can start exactly
    # at height + pad: Caffe divides 0 by 0 there.
    g = pooling.PoolGeometry(1, 1, 4, 4, 1, 1, 4, 4, 0, 0, 2, 2)
    x = np.ones((1, 1, 4, 4))
    y = np.zeros((1, 1, 2, 2))
    pooling._gpu_ave_pool(emulate.kernel, "ave_pool_forward", x, y, g)
    assert y[0, 0, 0, 0] == 1 and np.isnan(y[0, 0, 1, 1]) and np.isnan(y[0, 0, 0, 1])
    want = np.empty_like(y)
    pooling.ave_pool_forward(x, want, geom=g)
    np.testing.assert_array_equal(y, want)


# -- LRN -------------------------------------------------------------------------------------
LRN_CASES = [  # (shape, size, alpha, beta, k)
    ((2, 7, 4, 5), 5, 1e-4, 0.75, 1.0),
    ((2, 3, 3, 3), 5, 0.5, 0.75, 2.0),  # window wider than the channels
    ((1, 6, 2, 2), 3, 0.3, 0.5, 1.0),
    ((2, 4, 1, 3), 1, 0.2, 1.0, 0.5),
    ((1, 9, 3, 2), 7, 0.1, 0.6, 1.5),  # pow
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LRN_CASES)
def test_lrn_across_matches_cpu(case, dtype):
    shape, size, alpha, beta, k = case
    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    params = dict(size=size, alpha=alpha, beta=beta)
    want_y, want_s = np.empty_like(x), np.empty_like(x)
    lrn.lrn_forward(x, want_y, want_s, shift=k, within=False, **params)
    y, s = np.full_like(x, np.nan), np.full_like(x, np.nan)
    lrn._gpu_forward(emulate.kernel, x, y, s, shift=k, **params)
    np.testing.assert_allclose(s, want_s, **TOL[dtype])
    np.testing.assert_allclose(y, want_y, **TOL[dtype])
    want_dx = np.empty_like(x)
    lrn.lrn_backward(x, want_y, want_s, dy, want_dx, within=False, **params)
    dx = np.full_like(x, np.nan)
    lrn._gpu_backward(emulate.kernel, x, y, s, dy, dx, **params)
    np.testing.assert_allclose(dx, want_dx, **TOL[dtype])


# -- the public ops take their GPU branch for device arrays ----------------------------------
class FakeDeviceModule:
    """Stands in for cupy as the array module (numpy underneath) of the device bodies that
    the public ops run while every array counts as a device array; those bodies then launch
    the emulated kernels."""

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.fixture
def gpu_branch(monkeypatch):
    launched = []

    def kernel(family, name, dtype):
        launched.append(name)
        return emulate.kernel(family, name, dtype)

    monkeypatch.setattr(cuda, "kernel", kernel)
    monkeypatch.setattr(backend, "is_device_array", lambda a: True)
    for module in (conv, pooling, lrn):
        monkeypatch.setattr(module, "get_array_module", lambda *a: FakeDeviceModule())
    return launched


def test_public_ops_take_the_gpu_branch(gpu_branch):
    g, x, w, b, dy = conv_case(CONV_CASES[2], np.float64)
    y, dx, dw = np.empty_like(dy), np.empty_like(x), np.empty_like(w)
    conv.conv_forward(x, w, b, y, geom=g)
    conv.conv_backward_data(dy, w, dx, geom=g)
    conv.conv_backward_weight(x, dy, dw, geom=g)
    dbias = np.random.default_rng(7).standard_normal(g.channels)
    xd = np.empty_like(x)
    conv.deconv_forward(dy, w, dbias, xd, geom=g)
    assert gpu_branch == ["im2col", "col2im", "im2col", "col2im"]
    want = [np.empty_like(a) for a in (y, dx, dw, xd)]
    backend.is_device_array = lambda a: False  # the host bodies; the fixture restores it
    for module in (conv,):
        module.get_array_module = lambda *a: np  # the fixture restores it
    conv.conv_forward(x, w, b, want[0], geom=g)
    conv.conv_backward_data(dy, w, want[1], geom=g)
    conv.conv_backward_weight(x, dy, want[2], geom=g)
    conv.deconv_forward(dy, w, dbias, want[3], geom=g)
    for got, ref in zip((y, dx, dw, xd), want):
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-10)

    gpu_branch.clear()
    backend.is_device_array = lambda a: True
    pg = pool_geometry(2, 3, 7, 7, (3, 3), (2, 2), (1, 1))
    px, pdy = pool_inputs(pg, np.float64)
    shape = pdy.shape
    py, pm, pdx = np.empty(shape), np.empty(shape, np.int32), np.empty_like(px)
    pooling.max_pool_forward(px, py, pm, geom=pg)
    pooling.max_pool_backward(pdy, pm, pdx, geom=pg)
    ay, adx = np.empty(shape), np.empty_like(px)
    pooling.ave_pool_forward(px, ay, geom=pg)
    pooling.ave_pool_backward(pdy, adx, geom=pg)
    lx = np.random.default_rng(8).standard_normal((2, 5, 3, 3))
    ly, ls, ldx = np.empty_like(lx), np.empty_like(lx), np.empty_like(lx)
    params = dict(size=3, alpha=0.1, beta=0.75)
    lrn.lrn_forward(lx, ly, ls, shift=2.0, within=False, **params)
    lrn.lrn_backward(lx, ly, ls, lx, ldx, within=False, **params)
    wy, ws = np.empty_like(lx), np.empty_like(lx)
    lrn.lrn_forward(lx, wy, ws, shift=1.0, within=True, **params)  # the array code
    assert gpu_branch == ["max_pool_forward", "max_pool_backward", "ave_pool_forward",
                          "ave_pool_backward", "lrn_across_forward", "lrn_across_backward"]
    backend.is_device_array = lambda a: False
    for module in (pooling, lrn):
        module.get_array_module = lambda *a: np
    ry, rm, rdx = np.empty(shape), np.empty(shape, np.int32), np.empty_like(px)
    pooling.max_pool_forward(px, ry, rm, geom=pg)
    pooling.max_pool_backward(pdy, rm, rdx, geom=pg)
    np.testing.assert_array_equal(py, ry)
    np.testing.assert_array_equal(pm, rm)
    np.testing.assert_array_equal(pdx, rdx)
    ray, radx = np.empty(shape), np.empty_like(px)
    pooling.ave_pool_forward(px, ray, geom=pg)
    pooling.ave_pool_backward(pdy, radx, geom=pg)
    np.testing.assert_allclose(ay, ray, rtol=1e-12)
    np.testing.assert_allclose(adx, radx, rtol=1e-12)
    rly, rls, rldx = np.empty_like(lx), np.empty_like(lx), np.empty_like(lx)
    lrn.lrn_forward(lx, rly, rls, shift=2.0, within=False, **params)
    lrn.lrn_backward(lx, rly, rls, lx, rldx, within=False, **params)
    np.testing.assert_allclose(ly, rly, rtol=1e-12)
    np.testing.assert_allclose(ldx, rldx, rtol=1e-12, atol=1e-12)


# -- the launcher's use of CuPy, with CuPy replaced by a recorder -----------------------------
def test_launcher_compiles_once_per_device_and_passes_typed_arguments(monkeypatch):
    import sys
    import types

    calls = {"modules": [], "launches": []}
    device = [0]

    class RawModule:
        def __init__(self, *, code, options, backend):
            calls["modules"].append((code, options, backend, device[0]))

        def get_function(self, name):
            return lambda grid, block, args: calls["launches"].append((name, grid, block,
                                                                       args))

    fake = types.ModuleType("cupy")
    fake.RawModule = RawModule
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(
        getDevice=lambda: device[0]))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuda, "_MODULES", {})
    monkeypatch.setattr(cuda, "_FUNCTIONS", {})
    x, y = np.zeros(10, np.float32), np.zeros(10, np.float32)
    ave = cuda.kernel("pooling", "ave_pool_forward", np.float32)
    ave(1000, x, y, *range(10))
    ave(1000, x, y, *range(10))
    cuda.kernel("pooling", "ave_pool_backward", np.float32)(5, x, y, *range(10))
    assert len(calls["modules"]) == 1  # one module per (family, type, device)
    code, options, backend, _ = calls["modules"][0]
    assert code == cuda.source("pooling", np.float32) and "typedef float T;" in code
    assert options == ("-std=c++17",) and backend == "nvrtc"
    name, grid, block, args = calls["launches"][0]
    assert (name, grid, block) == ("ave_pool_forward", (4,), (256,))
    assert type(args[0]) is np.int64 and args[0] == 1000
    assert args[1] is x and args[2] is y
    assert all(type(a) is np.int32 for a in args[3:]) and list(args[3:]) == list(range(10))
    device[0] = 1
    ave(1000, x, y, *range(10))
    assert len(calls["modules"]) == 2 and calls["modules"][1][3] == 1
    ave(0, x, y, *range(10))  # nothing to do: no launch
    assert len(calls["launches"]) == 4
