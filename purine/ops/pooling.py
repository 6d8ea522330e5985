"""Pooling kernels (Caffe's Pooling: MAX with its argmax mask, AVE, STOCHASTIC), vectorized
over everything but the kernel offsets. Windows follow Caffe: MAX ignores padding, AVE divides
by the window clipped to the padded image, STOCHASTIC has none. On a GPU: our CUDA kernels for
MAX and AVE; STOCHASTIC as CuPy array operations. On the host, MAX pooling keeps its argmax as
kernel offsets (``max_pool_forward_offsets``) unless the layer asks for Caffe's mask top; its
float32 passes go to oneDNN where it is installed (``purine.backend.onednn``), the forward
with the same maxima and argmax as numpy's."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from purine.backend import (
    RandomStream,
    cuda,
    device_variant,
    get_array_module,
    host_parallel,
    onednn,
    scatter_add,
)

Array = Any


@dataclass(frozen=True)
class PoolGeometry:
    """Input (num, channels, height, width) pooled to (num, channels, pooled_h, pooled_w);
    window (ph, pw) starts at row ph*stride_h - pad_h, column pw*stride_w - pad_w."""

    num: int
    channels: int
    height: int
    width: int
    kernel_h: int
    kernel_w: int
    stride_h: int
    stride_w: int
    pad_h: int
    pad_w: int
    pooled_h: int
    pooled_w: int

    @property
    def padded_h(self) -> int:
        """Rows of a padded copy that holds every window, the clipped last ones included."""
        return max(self.height + 2 * self.pad_h,
                   (self.pooled_h - 1) * self.stride_h + self.kernel_h)

    @property
    def padded_w(self) -> int:
        return max(self.width + 2 * self.pad_w,
                   (self.pooled_w - 1) * self.stride_w + self.kernel_w)

    @property
    def is_global(self) -> bool:
        """One window covering the whole unpadded image."""
        return (self.kernel_h == self.height and self.kernel_w == self.width
                and self.pad_h == self.pad_w == 0 and self.pooled_h == self.pooled_w == 1)

    @property
    def empty_rows(self) -> int:
        """Trailing output rows whose window lies wholly outside the image (possible only
        without padding and with a stride larger than the kernel): those whose start
        ph * stride - pad reaches the height."""
        return _outside(self.pooled_h, self.height, self.stride_h, self.pad_h)

    @property
    def empty_cols(self) -> int:
        return _outside(self.pooled_w, self.width, self.stride_w, self.pad_w)

    def workspace_bytes(self, itemsize: int, ave: bool = False) -> int:
        """An upper bound on the scratch one of the pooling kernels holds at a time, in bytes
        of ``itemsize``: MAX and STOCHASTIC a padded copy (every window's rows, which a
        stride past the image makes long) and a few temporaries per output; AVE (``ave``)
        its averaging matrices and one product per plane. The layer checks it against
        memory when it is built, before any of it is allocated."""
        planes = self.num * self.channels
        if planes == 0:  # the kernels return at once
            return 0
        if ave:
            matrices = (self.pooled_h * self.height + self.pooled_w * self.width) * (8 + itemsize)
            products = planes * (self.height * self.pooled_w + self.pooled_h * self.width)
            return matrices + products * itemsize
        padded = planes * self.padded_h * self.padded_w * itemsize
        return padded + planes * self.pooled_h * self.pooled_w * (2 * itemsize + 24)

    @property
    def overlapping(self) -> bool:
        return self.kernel_h > self.stride_h or self.kernel_w > self.stride_w


def _outside(pooled: int, size: int, stride: int, pad: int) -> int:
    """How many of ``pooled`` windows along one axis start at or past ``size`` (counted, not
    looped over: ``pooled`` may be large)."""
    first = -(-(size + pad) // stride)  # the first p with p * stride - pad >= size
    return max(0, pooled - first)


def _no_planes(g: PoolGeometry) -> bool:
    """An empty batch (or no channel): nothing to pool, and no loop over the kernel offsets,
    which a kernel of 2^30 rows would make endless."""
    return g.num * g.channels == 0


def _planes(a: Array, g: PoolGeometry, pooled: bool) -> Array:
    if pooled:
        return a.reshape(g.num, g.channels, g.pooled_h, g.pooled_w)
    return a.reshape(g.num, g.channels, g.height, g.width)


def _padded(xp: Any, x: Array, g: PoolGeometry, fill: float) -> Array:
    """``x`` inside a border of ``fill`` wide enough for every window."""
    hp, wp = g.padded_h, g.padded_w
    if hp == g.height and wp == g.width:
        return x
    out = xp.full((g.num, g.channels, hp, wp), fill, dtype=x.dtype)
    out[:, :, g.pad_h:g.pad_h + g.height, g.pad_w:g.pad_w + g.width] = x
    return out


def _window(a: Array, g: PoolGeometry, i: int, j: int) -> Array:
    """The (num, channels, pooled_h, pooled_w) view of padded ``a`` at kernel offset (i, j)."""
    return a[:, :, i:i + g.stride_h * (g.pooled_h - 1) + 1:g.stride_h,
             j:j + g.stride_w * (g.pooled_w - 1) + 1:g.stride_w]


def _window_starts(xp: Any, g: PoolGeometry) -> Array:
    """(pooled_h, pooled_w): the plane index h*W + w of each window's top-left corner."""
    hs = xp.arange(g.pooled_h) * g.stride_h - g.pad_h
    ws = xp.arange(g.pooled_w) * g.stride_w - g.pad_w
    return hs[:, None] * g.width + ws[None, :]


def _max_pool_forward_gpu(x: Array, y: Array, mask: Array, *, geom: PoolGeometry) -> None:
    if _no_planes(geom):
        return
    _gpu_max_pool_forward(cuda.kernel, x, y, mask, geom)


@device_variant(_max_pool_forward_gpu)
def max_pool_forward(x: Array, y: Array, mask: Array, *, geom: PoolGeometry) -> None:
    """y = the window maxima; ``mask`` = the plane index h*W + w of each maximum (the first
    in scan order on ties), as Caffe's max_idx_ or its optional second top (float)."""
    if _no_planes(geom):
        return
    # The kernel offsets (on oneDNN where it takes the call), then their plane indices.
    offsets = np.empty(y.shape, offset_dtype(geom))
    max_pool_forward_offsets(x, y, offsets, geom=geom)
    _planes(mask, geom, True)[...] = _plane_index(_planes(offsets, geom, True), geom)


def _global_max(x4: Array, y4: Array, arg4: Array) -> None:
    """Global MAX pooling: y4 = each plane's maximum, arg4 = its plane index (the window is
    the plane, so it is the kernel offset too)."""
    flat = x4.reshape(x4.shape[0], x4.shape[1], -1)
    arg = flat.argmax(axis=2)
    y4[:, :, 0, 0] = np.take_along_axis(flat, arg[:, :, None], axis=2)[:, :, 0]
    arg4[:, :, 0, 0] = arg


def _empty_windows(g: PoolGeometry) -> tuple[Any, Any]:
    """The trailing rows and columns of windows wholly outside the image."""
    return (np.s_[:, :, g.pooled_h - g.empty_rows:], np.s_[..., g.pooled_w - g.empty_cols:])


def _max_pool_offsets(x4: Array, y4: Array, code: Array, g: PoolGeometry) -> None:
    """y4 = the window maxima, ``code`` (zeros on entry) = each one's kernel offset
    i * kernel_w + j, the first in scan order on ties."""
    # Padding is -inf so that it never wins: Caffe's windows are clipped to the image.
    xpad = _padded(np, x4, g, -np.inf)
    kk = g.kernel_h * g.kernel_w
    code_type = code.dtype.type
    cur = np.empty(y4.shape, dtype=x4.dtype)
    better = np.empty(y4.shape, dtype=bool)
    step = np.empty(y4.shape, dtype=code_type)
    y4[...] = _window(xpad, g, 0, 0)
    for o in range(1, kk):
        # Contiguous copies first: ufuncs on the strided windows pay per short row.
        cur[...] = _window(xpad, g, o // g.kernel_w, o % g.kernel_w)
        np.greater(cur, y4, out=better)
        np.maximum(y4, cur, out=y4)
        # A strictly greater value replaces the argmax; offsets rise, so the last
        # replacement is the largest offset that won: a maximum of better * o.
        np.multiply(better, code_type(o), out=step)
        np.maximum(code, step, out=code)


def _max_pool_backward_gpu(dy: Array, mask: Array, dx: Array, *, geom: PoolGeometry) -> None:
    if _no_planes(geom):
        return
    _gpu_max_pool_backward(cuda.kernel, dy, mask, dx, geom)


@device_variant(_max_pool_backward_gpu)
def max_pool_backward(dy: Array, mask: Array, dx: Array, *, geom: PoolGeometry) -> None:
    """dx = dy scattered to the argmax of each window; overlapping windows add up."""
    if _no_planes(geom):
        return
    g = geom
    dy4, m4, dx4 = _planes(dy, g, True), _planes(mask, g, True), _planes(dx, g, False)
    host_parallel(lambda s: _max_pool_backward(dy4[s], m4[s], dx4[s],
                                               replace(g, num=s.stop - s.start)),
                  g.num, work=dx4.size)


def _max_pool_backward(dy: Array, mask: Array, dx: Array, g: PoolGeometry) -> None:
    plane = g.height * g.width
    base = np.arange(g.num * g.channels, dtype=np.int64).reshape(g.num, g.channels, 1, 1)
    m4 = _planes(mask, g, True)
    # One pass for an integer mask: casting it to int64 first and then adding the broadcast
    # base took 7x as long (3.6 against 0.5 ms on CIFAR-10 quick's pool1).
    index = (np.add(m4, base * plane) if m4.dtype.kind == "i"
             else m4.astype(np.int64) + base * plane)
    values = _planes(dy, g, True)
    if g.empty_rows or g.empty_cols:
        # A window outside the image has no argmax (mask -1) and passes nothing down.
        values = np.where(index >= base * plane, values, 0)
        index = np.maximum(index, base * plane)
    flat = dx.reshape(-1)
    flat.fill(0)
    if g.overlapping or g.empty_rows or g.empty_cols:
        scatter_add(flat, index.reshape(-1), values.reshape(-1))
    else:  # each input is the argmax of at most one window
        flat[index.reshape(-1)] = values.reshape(-1)


# -- MAX pooling on the host, the argmax as kernel offsets ----------------------------------
def offset_dtype(g: PoolGeometry) -> Any:
    """The dtype of ``max_pool_forward_offsets``'s argmax: uint8 while every kernel offset and
    the empty-window mark (kernel_h * kernel_w) fit in it, else int32 (oneDNN's workspace
    types for the same two cases)."""
    return np.uint8 if g.kernel_h * g.kernel_w < 256 else np.int32


def max_pool_forward_offsets(x: Array, y: Array, offsets: Array, *,
                             geom: PoolGeometry) -> None:
    """y = the window maxima; ``offsets`` (``offset_dtype``) = each maximum's kernel offset
    i * kernel_w + j, the first in scan order on ties, and kernel_h * kernel_w for a window
    wholly outside the image (whose maximum is Caffe's -FLT_MAX). MAX pooling on the host
    when no mask top is asked for: the argmax stays in the form oneDNN's forward writes and
    its backward reads, so neither pass converts it to Caffe's plane indices (which
    ``max_pool_forward`` writes, for the mask top and on a GPU)."""
    g, dnnl = geom, onednn.get()
    if _no_planes(g) or (dnnl is not None and dnnl.max_pool_forward_offsets(x, y, offsets, g)):
        return
    x4, y4, o4 = _planes(x, g, False), _planes(y, g, True), _planes(offsets, g, True)
    if g.is_global:
        _global_max(x4, y4, o4)
        return
    o4.fill(0)
    host_parallel(lambda s: _max_pool_offsets(x4[s], y4[s], o4[s],
                                              replace(g, num=s.stop - s.start)),
                  g.num, work=x4.size)
    if g.empty_rows or g.empty_cols:
        for region in _empty_windows(g):
            y4[region] = -np.finfo(np.float32).max
            o4[region] = g.kernel_h * g.kernel_w


def max_pool_backward_offsets(dy: Array, offsets: Array, dx: Array, *,
                              geom: PoolGeometry) -> None:
    """dx = dy scattered to each window's maximum, from ``max_pool_forward_offsets``'s
    offsets; overlapping windows add up (in output order on numpy, as Caffe's backward)."""
    g, dnnl = geom, onednn.get()
    if _no_planes(g) or (dnnl is not None and dnnl.max_pool_backward(dy, offsets, dx, g)):
        return
    dy4, o4, dx4 = _planes(dy, g, True), _planes(offsets, g, True), _planes(dx, g, False)
    host_parallel(lambda s: _max_pool_backward(dy4[s], _plane_index(o4[s], g), dx4[s],
                                               replace(g, num=s.stop - s.start)),
                  g.num, work=dx4.size)


def _plane_index(o4: Array, g: PoolGeometry) -> Array:
    """Caffe's mask (int32 plane indices h * W + w, -1 for an empty window) of kernel
    offsets."""
    if g.is_global:
        return o4.astype(np.int32)
    kk = g.kernel_h * g.kernel_w
    k = np.arange(kk, dtype=np.int32)
    table = (k // g.kernel_w) * g.width + k % g.kernel_w
    empty = g.empty_rows or g.empty_cols
    index = np.minimum(o4, kk - 1) if empty else o4  # the empty-window mark, in range
    mask = np.add(np.take(table, index), _window_starts(np, g).astype(np.int32))
    if empty:
        for region in _empty_windows(g):
            mask[region] = -1
    return mask


def _ave_matrix(xp: Any, pooled: int, size: int, kernel: int, stride: int, pad: int,
                dtype: Any) -> Array:
    """(pooled, size): row p averages window p along one axis, over the image part of the
    window, divided by Caffe's extent clipped to size + pad (padding counts, the overhang
    of a ceil-rounded last window does not). AVE pooling is separable: y = Bh x Bw^T."""
    m = np.zeros((pooled, size))
    for p in range(pooled):
        start = p * stride - pad
        extent = min(start + kernel, size + pad) - start
        if extent:
            m[p, max(start, 0):min(start + kernel, size)] = 1.0 / extent
    return xp.asarray(m.astype(dtype))


def _ave_matrices(xp: Any, g: PoolGeometry, dtype: Any) -> tuple[Array, Array]:
    return (_ave_matrix(xp, g.pooled_h, g.height, g.kernel_h, g.stride_h, g.pad_h, dtype),
            _ave_matrix(xp, g.pooled_w, g.width, g.kernel_w, g.stride_w, g.pad_w, dtype))


def _zero_extent(g: PoolGeometry) -> tuple[list[int], list[int]]:
    """Output rows and columns whose window has extent 0 (it starts at H + pad): Caffe
    divides 0 by 0 there."""
    rows = [p for p in range(g.pooled_h)
            if min(p * g.stride_h - g.pad_h + g.kernel_h, g.height + g.pad_h)
            == p * g.stride_h - g.pad_h]
    cols = [p for p in range(g.pooled_w)
            if min(p * g.stride_w - g.pad_w + g.kernel_w, g.width + g.pad_w)
            == p * g.stride_w - g.pad_w]
    return rows, cols


def _ave_pool_forward_gpu(x: Array, y: Array, *, geom: PoolGeometry) -> None:
    if _no_planes(geom):
        return
    _gpu_ave_pool(cuda.kernel, "ave_pool_forward", x, y, geom)


@device_variant(_ave_pool_forward_gpu)
def ave_pool_forward(x: Array, y: Array, *, geom: PoolGeometry) -> None:
    """y = Bh x Bw^T per plane: two GEMMs, no padded copy (the matrices clip the windows);
    oneDNN's average instead where one has Caffe's divisors (``onednn.ave_algorithm``)."""
    dnnl = onednn.get()
    if _no_planes(geom) or (dnnl is not None and dnnl.ave_pool_forward(x, y, geom)):
        return
    g = geom
    bh, bw = _ave_matrices(np, g, x.dtype)
    planes = g.num * g.channels
    rows = np.dot(x.reshape(planes * g.height, g.width), bw.T)
    np.matmul(bh, rows.reshape(planes, g.height, g.pooled_w),
              out=y.reshape(planes, g.pooled_h, g.pooled_w))
    zero_rows, zero_cols = _zero_extent(g)
    if zero_rows or zero_cols:
        y4 = _planes(y, g, True)
        y4[:, :, zero_rows] = np.nan
        y4[..., zero_cols] = np.nan


def _ave_pool_backward_gpu(dy: Array, dx: Array, *, geom: PoolGeometry) -> None:
    if _no_planes(geom):
        return
    _gpu_ave_pool(cuda.kernel, "ave_pool_backward", dy, dx, geom)


@device_variant(_ave_pool_backward_gpu)
def ave_pool_backward(dy: Array, dx: Array, *, geom: PoolGeometry) -> None:
    """dx = Bh^T dy Bw per plane: each window's dy / pool size over its image part."""
    dnnl = onednn.get()
    if _no_planes(geom) or (dnnl is not None and dnnl.ave_pool_backward(dy, dx, geom)):
        return
    g = geom
    bh, bw = _ave_matrices(np, g, dy.dtype)
    planes = g.num * g.channels
    cols = np.matmul(bh.T, dy.reshape(planes, g.pooled_h, g.pooled_w))
    np.dot(cols.reshape(planes * g.height, g.pooled_w), bw,
           out=dx.reshape(planes * g.height, g.width))


# -- STOCHASTIC: Caffe has it on the GPU only; here it runs on every device with the GPU
# kernels' semantics. Caffe refuses padding for it, so a window is rows ph*stride_h on,
# clipped to the image; the zero border of ``_padded`` (for the overhang of a ceil-rounded
# last window) adds nothing to a window's sums and is never picked (see below).

# Caffe starts TEST's denominator at FLT_MIN, whatever the Dtype, so that an all-zero
# window gives 0 rather than 0 / 0.
FLT_MIN = float(np.finfo(np.float32).tiny)


def _offsets(g: PoolGeometry) -> list[tuple[int, int]]:
    """The kernel offsets (i, j) in Caffe's scan order (row by row)."""
    return [(o // g.kernel_w, o % g.kernel_w) for o in range(g.kernel_h * g.kernel_w)]


def stochastic_pool_forward_train(x: Array, y: Array, index: Array, *, geom: PoolGeometry,
                                  rng: RandomStream) -> None:
    """Training: each window picks one of its positions with probability value / window sum
    and outputs that value; ``index`` = the plane index h*W + w of the pick (-1: none).

    As Caffe: u uniform in (0, 1] per window, threshold = u * sum rounded to float32, and
    the pick is the first position in scan order whose running sum reaches the threshold
    (an all-zero window picks its first position). Inputs are meant to be non-negative;
    a window no position reaches (a negative sum) and a window wholly outside the image
    output 0 and pass no gradient, where Caffe leaves the output as it was."""
    if _no_planes(geom):
        return
    g = geom
    xp = get_array_module(x)
    xpad = _padded(xp, _planes(x, g, False), g, 0.0)
    y4, i4 = _planes(y, g, True), _planes(index, g, True)
    offsets = _offsets(g)
    total = xp.zeros(y4.shape, dtype=x.dtype)
    for i, j in offsets:  # summed in scan order, as Caffe's loop rounds
        total += _window(xpad, g, i, j)
    # The whole batch draws at once from the layer's host stream, so the picks do not
    # depend on the device; a tower or replica draws its part of the whole layer's draw.
    u = xp.asarray((1.0 - rng.uniform(y4.shape)).astype(x.dtype))
    threshold = (u * total).astype(np.float32).astype(x.dtype)
    none = len(offsets)
    code = xp.full(y4.shape, none, dtype=np.int32)  # the kernel offset picked
    running = xp.zeros_like(total)
    hit = xp.empty(y4.shape, dtype=bool)
    y4.fill(0)
    for o, (i, j) in enumerate(offsets):
        cur = _window(xpad, g, i, j)
        running += cur
        # A border zero cannot be the first to reach the threshold: the position before
        # it in scan order (offset (0, 0) is always inside) has the same running sum.
        xp.greater_equal(running, threshold, out=hit)
        hit &= code == none
        xp.copyto(code, np.int32(o), where=hit)
        xp.copyto(y4, cur, where=hit)
    plane_offsets = xp.asarray([i * g.width + j for i, j in offsets] + [0])
    picked = plane_offsets[code] + _window_starts(xp, g)
    i4[...] = xp.where(code == none, -1, picked)
    if g.empty_rows or g.empty_cols:
        for region in (np.s_[:, :, g.pooled_h - g.empty_rows:],
                       np.s_[..., g.pooled_w - g.empty_cols:]):
            y4[region] = 0
            i4[region] = -1


def _stochastic_pool_backward_gpu(dy: Array, index: Array, dx: Array, *, geom: PoolGeometry
                                  ) -> None:
    if _no_planes(geom):
        return
    # MAX's gather kernel: it compares each covering window's index with the pixel's.
    _gpu_max_pool_backward(cuda.kernel, dy, index, dx, geom)


@device_variant(_stochastic_pool_backward_gpu)
def stochastic_pool_backward(dy: Array, index: Array, dx: Array, *, geom: PoolGeometry
                             ) -> None:
    """dx = dy routed to each window's pick (``index``, -1: nowhere); overlapping windows
    add up."""
    if _no_planes(geom):
        return
    g = geom
    i4, dy4 = _planes(index, g, True), _planes(dy, g, True)
    plane = g.height * g.width
    base = np.arange(g.num * g.channels, dtype=np.int64).reshape(g.num, g.channels, 1, 1)
    valid = i4 >= 0
    target = (i4.astype(np.int64) + base * plane)[valid]
    flat = dx.reshape(-1)
    flat.fill(0)
    scatter_add(flat, target, dy4[valid])


def _stochastic_sums(xp: Any, xpad: Array, g: PoolGeometry, dtype: Any) -> tuple[Array, Array]:
    """Per window: FLT_MIN + the sum of its values, and the sum of their squares, each
    accumulated in scan order as Caffe's TEST kernel does."""
    shape = (g.num, g.channels, g.pooled_h, g.pooled_w)
    total = xp.full(shape, FLT_MIN, dtype=dtype)
    squares = xp.zeros(shape, dtype=dtype)
    for i, j in _offsets(g):
        cur = _window(xpad, g, i, j)
        total += cur
        squares += cur * cur
    return total, squares


def stochastic_pool_forward_test(x: Array, y: Array, *, geom: PoolGeometry) -> None:
    """Testing: the probability-weighted average of each window, sum(x^2) / (FLT_MIN +
    sum(x)); 0 for an all-zero window."""
    if _no_planes(geom):
        return
    g = geom
    xp = get_array_module(x)
    total, squares = _stochastic_sums(xp, _padded(xp, _planes(x, g, False), g, 0.0), g,
                                      x.dtype)
    xp.divide(squares, total, out=_planes(y, g, True))


def stochastic_pool_backward_test(x: Array, dy: Array, dx: Array, *, geom: PoolGeometry
                                  ) -> None:
    """The gradient of the TEST output: d(S2 / S1)/dx = (2x - y) / S1 per covering window
    (S1 with its FLT_MIN). Caffe's TEST backward reuses whatever sample indices it last
    drew, which defines nothing; this differentiates the forward it computed."""
    if _no_planes(geom):
        return
    g = geom
    xp = get_array_module(dy)
    xpad = _padded(xp, _planes(x, g, False), g, 0.0)
    total, squares = _stochastic_sums(xp, xpad, g, dy.dtype)
    y = squares / total
    coeff = _planes(dy, g, True) / total
    acc = xp.zeros(xpad.shape, dtype=dy.dtype)
    for i, j in _offsets(g):
        # One offset's windows never share a pixel, so the strided add is a plain one.
        _window(acc, g, i, j)[...] += coeff * (2 * _window(xpad, g, i, j) - y)
    _planes(dx, g, False)[...] = acc[:, :, :g.height, :g.width]


# -- GPU: one thread per output element (forward) or input element (backward, a gather over
# the windows that cover it). ``kernels(family, name, dtype) -> launch`` is passed in so
# that the tests run these wrappers with the CUDA sources emulated on the CPU.

def _gpu_geometry(g: PoolGeometry) -> tuple[int, ...]:
    return (g.height, g.width, g.pooled_h, g.pooled_w, g.kernel_h, g.kernel_w, g.stride_h,
            g.stride_w, g.pad_h, g.pad_w)


def _gpu_mask(mask: Array, dtype: Any) -> tuple[str, Array]:
    """The kernel-name suffix for ``mask``'s type and the array the kernel uses: the mask
    itself when it is int32 or the data type, else an int32 copy."""
    if mask.dtype == np.int32:
        return "", mask
    if mask.dtype == dtype:
        return "_tmask", mask
    return "", mask.astype(np.int32)


def _gpu_max_pool_forward(kernels: Any, x: Array, y: Array, mask: Array, g: PoolGeometry) -> None:
    suffix, m = _gpu_mask(mask, x.dtype)
    kernels("pooling", "max_pool_forward" + suffix, x.dtype)(y.size, x, y, m,
                                                             *_gpu_geometry(g))
    if m is not mask:
        mask[...] = m.reshape(mask.shape)


def _gpu_max_pool_backward(kernels: Any, dy: Array, mask: Array, dx: Array,
                           g: PoolGeometry) -> None:
    suffix, m = _gpu_mask(mask, dy.dtype)
    kernels("pooling", "max_pool_backward" + suffix, dy.dtype)(dx.size, dy, m, dx,
                                                               *_gpu_geometry(g))


def _gpu_ave_pool(kernels: Any, name: str, src: Array, dst: Array, g: PoolGeometry) -> None:
    kernels("pooling", name, src.dtype)(dst.size, src, dst, *_gpu_geometry(g))
