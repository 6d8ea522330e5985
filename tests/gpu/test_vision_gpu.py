"""Convolution, pooling (SPP's pyramid levels included) and LRN on a real GPU (cupy arrays,
our CUDA kernels, cuBLAS) against the same ops on numpy: float32 within the tolerances stated
per op, float64 to 1e-10. Every test needs a CUDA GPU and skips with the reason otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from purine.ops import conv, lrn, pooling
from tests.gpu.common import requires_gpu
from tests.gpu.test_cuda_sources import CONV_CASES, LRN_CASES, POOL_CASES, pool_geometry

pytestmark = requires_gpu


def spp_level(n: int, c: int, h: int, w: int, level: int) -> tuple:
    """The pooling case of SPP pyramid level ``level``: 2^level bins a side, the kernel (and
    stride) the bin size rounded up, the padding half the bins' overhang."""
    bins = 2 ** level
    kernel = (-(-h // bins), -(-w // bins))
    pad = ((kernel[0] * bins - h + 1) // 2, (kernel[1] * bins - w + 1) // 2)
    g = pool_geometry(n, c, h, w, kernel, kernel, pad)
    assert (g.pooled_h, g.pooled_w) == (bins, bins)
    return (n, c, h, w, kernel, kernel, pad)


# padded levels whose last bin overhangs the image, rectangular, and the global level 0
SPP_CASES = [spp_level(2, 3, 7, 7, 1), spp_level(2, 3, 7, 7, 2), spp_level(1, 4, 6, 7, 2),
             spp_level(1, 2, 15, 14, 3), spp_level(2, 3, 6, 5, 0)]

# float32 tolerances, relative to the scale of the result (its largest magnitude): cuBLAS
# and our kernels sum in other orders than numpy/OpenBLAS.
CONV_F32 = 1e-4
POOL_F32 = 1e-5
LRN_F32 = 1e-5
F64 = 1e-10


@pytest.fixture
def cp():
    import cupy

    with cupy.cuda.Device(0):
        yield cupy


def close(got, want, dtype, f32):
    """``got`` (a device array) against ``want`` (numpy) within ``f32`` of the scale of
    ``want`` in float32, 1e-10 in float64; NaNs where ``want`` has them."""
    got = got.get()
    assert got.dtype == want.dtype
    tol = f32 if dtype == np.float32 else F64
    finite = want[np.isfinite(want)]
    scale = float(np.abs(finite).max()) if finite.size else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(scale, 1.0))


def run_both(cp, fn, inputs, outputs, **params):
    """``fn`` on numpy and on the GPU: (numpy outputs, device outputs)."""
    host_out = [np.empty(shape, dt) for shape, dt in outputs]
    fn(*inputs, *host_out, **params)
    dev_out = [cp.full(shape, np.nan if np.dtype(dt).kind == "f" else 7, dt)
               for shape, dt in outputs]
    fn(*[cp.asarray(a) for a in inputs], *dev_out, **params)
    cp.cuda.get_current_stream().synchronize()
    return host_out, dev_out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chunk", [1, None])
@pytest.mark.parametrize("args", CONV_CASES)
def test_conv_matches_cpu(cp, monkeypatch, args, chunk, dtype):
    g = conv.ConvGeometry(*args)
    if chunk is not None:
        monkeypatch.setattr(conv, "GPU_COL_BUDGET",
                            g.channels * g.kernel_h * g.kernel_w * g.out_h * g.out_w)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((g.num, g.channels, g.height, g.width)).astype(dtype)
    w = rng.standard_normal((g.num_output, g.channels // g.group, g.kernel_h,
                             g.kernel_w)).astype(dtype)
    b = rng.standard_normal(g.num_output).astype(dtype)
    dy = rng.standard_normal((g.num, g.num_output, g.out_h, g.out_w)).astype(dtype)
    (y,), (dy_,) = run_both(cp, conv.conv_forward, [x, w, b], [(dy.shape, dtype)], geom=g)
    close(dy_, y, dtype, CONV_F32)
    (y,), (dy_,) = run_both(cp, conv.conv_forward, [x, w], [(dy.shape, dtype)], geom=g)
    close(dy_, y, dtype, CONV_F32)
    (dx,), (dx_,) = run_both(cp, conv.conv_backward_data, [dy, w], [(x.shape, dtype)],
                             geom=g)
    close(dx_, dx, dtype, CONV_F32)
    (dw,), (dw_,) = run_both(cp, conv.conv_backward_weight, [x, dy, x, dy],
                             [(w.shape, dtype)], geom=g)
    close(dw_, dw, dtype, CONV_F32)
    (db,), (db_,) = run_both(cp, conv.conv_backward_bias, [dy, dy], [(b.shape, dtype)],
                             num=g.num)
    close(db_, db, dtype, CONV_F32)
    bias = rng.standard_normal(g.channels).astype(dtype)
    (y,), (y_,) = run_both(cp, conv.deconv_forward, [dy, w, bias], [(x.shape, dtype)], geom=g)
    close(y_, y, dtype, CONV_F32)


def test_conv_runs_on_the_current_stream(cp):
    """Kernels launch on the caller's stream and wait for nothing: the results are there
    once that stream is synchronized."""
    g = conv.ConvGeometry(8, 16, 20, 20, 32, 3, 3, pad_h=1, pad_w=1)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((8, 16, 20, 20)).astype(np.float32)
    w = rng.standard_normal((32, 16, 3, 3)).astype(np.float32)
    want = np.empty((8, 32, 20, 20), np.float32)
    conv.conv_forward(x, w, want, geom=g)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        xd, wd = cp.asarray(x), cp.asarray(w)
        y = cp.empty(want.shape, np.float32)
        conv.conv_forward(xd, wd, y, geom=g)
    stream.synchronize()
    close(y, want, np.float32, CONV_F32)


@pytest.mark.parametrize("mask_type", ["int32", "data"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", POOL_CASES + SPP_CASES)
def test_max_pool_matches_cpu(cp, case, dtype, mask_type):
    g = pool_geometry(*case)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((g.num, g.channels, g.height, g.width)).astype(dtype)
    shape = (g.num, g.channels, g.pooled_h, g.pooled_w)
    mdt = np.int32 if mask_type == "int32" else dtype
    (y, m), (y_, m_) = run_both(cp, pooling.max_pool_forward, [x], [(shape, dtype),
                                                                     (shape, mdt)], geom=g)
    np.testing.assert_array_equal(y_.get(), y)  # maxima are copies: exact
    np.testing.assert_array_equal(m_.get(), m)
    dy = rng.standard_normal(shape).astype(dtype)
    (dx,), (dx_,) = run_both(cp, pooling.max_pool_backward, [dy, m], [(x.shape, dtype)],
                             geom=g)
    close(dx_, dx, dtype, POOL_F32)
    # The CPU reads a GPU mask and the GPU a CPU one: the format is the same.
    dx2 = np.empty_like(x)
    pooling.max_pool_backward(dy, m_.get(), dx2, geom=g)
    np.testing.assert_array_equal(dx2, dx)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", POOL_CASES + SPP_CASES)
def test_ave_pool_matches_cpu(cp, case, dtype):
    g = pool_geometry(*case)
    rng = np.random.default_rng(14)
    x = rng.standard_normal((g.num, g.channels, g.height, g.width)).astype(dtype)
    shape = (g.num, g.channels, g.pooled_h, g.pooled_w)
    (y,), (y_,) = run_both(cp, pooling.ave_pool_forward, [x], [(shape, dtype)], geom=g)
    close(y_, y, dtype, POOL_F32)
    dy = np.where(np.isnan(y), 0, rng.standard_normal(shape)).astype(dtype)
    (dx,), (dx_,) = run_both(cp, pooling.ave_pool_backward, [dy], [(x.shape, dtype)], geom=g)
    close(dx_, dx, dtype, POOL_F32)


@pytest.mark.parametrize("within", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", LRN_CASES)
def test_lrn_matches_cpu(cp, case, dtype, within):
    shape, size, alpha, beta, k = case
    rng = np.random.default_rng(15)
    x = rng.standard_normal(shape).astype(dtype)
    params = dict(size=size, alpha=alpha, beta=beta, within=within)
    (y, s), (y_, s_) = run_both(cp, lrn.lrn_forward, [x], [(shape, dtype)] * 2,
                                shift=1.0 if within else k, **params)
    close(s_, s, dtype, LRN_F32)
    close(y_, y, dtype, LRN_F32)
    dy = rng.standard_normal(shape).astype(dtype)
    (dx,), (dx_,) = run_both(cp, lrn.lrn_backward, [x, y, s, dy], [(shape, dtype)], **params)
    close(dx_, dx, dtype, LRN_F32)
