"""Convolution kernels (Caffe's Convolution; Deconvolution reuses them transposed): im2col
of the batch in chunks of whole samples, in a column layout chosen per geometry, and GEMMs
over the columns; col2im as a scatter-add over the kernel offsets, or, for stride 1,
backward data as the full correlation of dy with the flipped kernel where that moves less
memory.

Blobs are (num, channels, height, width) as the geometry says; a 1-d convolution is the
2-d one with height 1, and axes before the channel axis are folded into ``num``.

float32 host calls go to oneDNN instead where it is installed (``purine.backend.onednn``).

On a GPU: our im2col / col2im kernels into one (C*kh*kw, n*P) column matrix per chunk of
samples and one cuBLAS GEMM per group (see the GPU section below).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from purine.backend import cuda, device_variant, get_array_module, onednn

Array = Any


@dataclass(frozen=True)
class ConvGeometry:
    """One convolution: input (num, channels, height, width), weight (num_output,
    channels/group, kernel_h, kernel_w), output (num, num_output, out_h, out_w)."""

    num: int
    channels: int
    height: int
    width: int
    num_output: int
    kernel_h: int
    kernel_w: int
    stride_h: int = 1
    stride_w: int = 1
    pad_h: int = 0
    pad_w: int = 0
    dilation_h: int = 1
    dilation_w: int = 1
    group: int = 1

    @property
    def out_h(self) -> int:
        extent = self.dilation_h * (self.kernel_h - 1) + 1
        return (self.height + 2 * self.pad_h - extent) // self.stride_h + 1

    @property
    def out_w(self) -> int:
        extent = self.dilation_w * (self.kernel_w - 1) + 1
        return (self.width + 2 * self.pad_w - extent) // self.stride_w + 1

    @property
    def kernel_dim(self) -> int:
        """Rows of one group's column matrix: channels/group * kernel_h * kernel_w."""
        return self.channels // self.group * self.kernel_h * self.kernel_w

    @property
    def is_1x1(self) -> bool:
        return (self.kernel_h == self.kernel_w == 1 and self.stride_h == self.stride_w == 1
                and self.pad_h == self.pad_w == 0)


# Tuning, measured on AlexNet, CIFAR-10 quick and LeNet layers (float32, 2 cores):
# - The batch is cut into chunks of whole samples whose columns hold at most COL_BUDGET
#   elements, so a chunk's buffers are recycled by the allocator (no fresh page faults) and
#   stay in the last-level cache between im2col and the GEMM reading them; a chunk still
#   gives the GEMM at least MIN_COLUMNS columns, below which the GEMM itself slows down.
# - Three column layouts (``_layout``):
#   "rows": (n*P, K), one row per output pixel, K ordered (group, kh, kw, channel), copied
#   from a channels-last padded copy of the input, so each kernel row moves kw*channels
#   contiguous values. OpenBLAS also runs (n*P x K) @ (K x few outputs) and the weight
#   gradient (outputs x n*P) @ (n*P x K) faster than the transposed shapes. Used where that
#   run is at least ROW_RUN_MIN values; in the forward pass (and a backward data that is a
#   forward) only up to ROW_OUTPUTS_MAX outputs per group, as numpy's transpose of a wide
#   (n*P, outputs) result back to NCHW costs more than the GEMM gains.
#   "samples": (n, K, P), one GEMM per sample that writes its NCHW output in place, the
#   bias folded into it as a row of ones. For channel-poor inputs (the first layer) with at
#   least SAMPLE_PIXELS_MIN output pixels.
#   "cols": (K, n*P), one GEMM per chunk and group; everything else, and col2im's layout.
# - For a row stride of 1, "samples" im2col and col2im go through the kw column shifts of
#   the image, (n, C, kw, Hp, out_w): each (i, j) window is then out_h consecutive rows of
#   shift j, moved as one run of P values instead of out_h runs of out_w.
# - "cols" buffers keep the batch axis innermost for stride-1 outputs narrower than
#   BATCH_LAST_BELOW: a kernel offset then moves whole (out_w, batch) rows instead of short
#   image rows, which numpy pays for per row.
# - Backward data becomes a full correlation when its im2col of dy (num_output rows per
#   kernel offset) is at most FULL_CORRELATION_RATIO times col2im's scatter into dx
#   (channels rows per offset, each a read-modify-write).
COL_BUDGET = 1 << 21
MIN_COLUMNS = 1024
ROW_RUN_MIN = 64
ROW_OUTPUTS_MAX = 64
SAMPLE_PIXELS_MIN = 256
BATCH_LAST_BELOW = 20
FULL_CORRELATION_RATIO = 2.0


def _size(shape: tuple[int, ...]) -> int:
    size = 1
    for d in shape:
        size *= d
    return size


def workspace_bytes(g: ConvGeometry, itemsize: int) -> int:
    """An upper bound on the scratch one of ``g``'s kernels holds at a time (a chunk's
    columns, padded copy, column shifts, col2im accumulator and output matrices; the GPU's
    buffers are no larger), in bytes of ``itemsize``: the layer checks it against memory
    when it is built, before any of it is allocated."""
    p = g.out_h * g.out_w
    hp, wp = g.height + 2 * g.pad_h, g.width + 2 * g.pad_w
    k = g.channels * g.kernel_h * g.kernel_w
    per_sample = ((k + 1) * p + 2 * g.channels * hp * wp + g.channels * g.kernel_w * hp * g.out_w
                  + 2 * g.num_output * p)
    n = max(COL_BUDGET // max(k * p, 1), -(-MIN_COLUMNS // max(p, 1)))  # as _Workspace
    return min(g.num, max(1, n)) * per_sample * itemsize


def _layout(g: ConvGeometry, forward: bool) -> str:
    """The column layout of ``g``'s im2col for the forward pass or the weight gradient:
    "rows", "samples" or "cols" (see the tuning notes above)."""
    run = g.channels // g.group * (g.kernel_w if g.dilation_w == 1 else 1)
    if run >= ROW_RUN_MIN and (not forward or g.num_output // g.group <= ROW_OUTPUTS_MAX):
        return "rows"
    if g.out_h * g.out_w >= SAMPLE_PIXELS_MIN:
        return "samples"
    return "cols"


def _batch_last(g: ConvGeometry) -> bool:
    return g.stride_h == 1 and g.stride_w == 1 and g.out_w < BATCH_LAST_BELOW


class _Workspace:
    """The buffers of one kernel call, sized for a chunk of ``n`` samples. In the "cols"
    layout, arrays handed out are "canonical" views whose axes put the batch where NCHW
    does (``(*lead, n, *tail)``); in memory the batch is innermost when ``batch_last``.
    "cols" GEMM operands are (rows, n*P) matrices whose columns follow that memory order."""

    def __init__(self, xp: Any, g: ConvGeometry, dtype: Any):
        self.xp, self.g, self.dtype = xp, g, dtype
        p = g.out_h * g.out_w
        per_sample = g.channels * g.kernel_h * g.kernel_w * p
        n = max(COL_BUDGET // max(per_sample, 1), -(-MIN_COLUMNS // max(p, 1)))  # p: 0 pixels
        n = max(1, min(g.num, n))
        self.chunks = [slice(i, min(i + n, g.num)) for i in range(0, g.num, n)]
        self.batch_last = _batch_last(g)
        self.hp, self.wp = g.height + 2 * g.pad_h, g.width + 2 * g.pad_w
        self._bufs: dict[str, list[Any]] = {}

    def _entry(self, name: str, shape: tuple[int, ...]) -> list[Any]:
        entry = self._bufs.get(name)
        if entry is None or entry[0].size < _size(shape):
            entry = self._bufs[name] = [self.xp.empty(_size(shape), dtype=self.dtype), None]
        return entry

    def buf(self, name: str, shape: tuple[int, ...]) -> Array:
        """Buffer ``name`` as a contiguous array of ``shape``, contents undefined."""
        entry = self._entry(name, shape)
        entry[1] = None  # the caller writes it: whatever it held is gone
        return entry[0][:_size(shape)].reshape(shape)

    def constant(self, name: str, shape: tuple[int, ...], value: float, order: str
                 ) -> Array:
        """Buffer ``name`` as ``buf`` gives it, but with every element the caller does not
        write (padding borders, a row of ones) equal to ``value``: filled only when it was
        last handed out for anything but this axis ``order``, shape and value."""
        entry = self._entry(name, shape)
        buf = entry[0][:_size(shape)].reshape(shape)
        if entry[1] != (order, shape, value):
            buf.fill(value)
            entry[1] = (order, shape, value)
        return buf

    def batched(self, name: str, lead: tuple[int, ...], n: int, tail: tuple[int, ...]
                ) -> Array:
        """Buffer ``name`` as a (*lead, n, *tail) view (batch innermost in memory when
        ``batch_last``)."""
        if not self.batch_last:
            return self.buf(name, (*lead, n, *tail))
        a = self.buf(name, (*lead, *tail, n))
        k = len(lead)
        return a.transpose(*range(k), a.ndim - 1, *range(k, a.ndim - 1))

    def matrix(self, name: str, rows: int, n: int) -> Array:
        """Buffer ``name`` as a contiguous (rows, n * out_h * out_w) GEMM operand."""
        return self.buf(name, (rows, n * self.g.out_h * self.g.out_w))

    def padded(self, x: Array, batch_last: bool) -> Array:
        """The chunk ``x`` (n, C, H, W) with zero borders of the padding (as given when there
        are none), the batch innermost in memory when ``batch_last``."""
        g, n = self.g, x.shape[0]
        if not (g.pad_h or g.pad_w or batch_last):
            return x
        if batch_last:
            xpad = self.constant("xpad", (g.channels, self.hp, self.wp, n), 0, "chwn")
            xpad = xpad.transpose(3, 0, 1, 2)
        else:
            xpad = self.constant("xpad", (n, g.channels, self.hp, self.wp), 0, "nchw")
        xpad[:, :, g.pad_h:g.pad_h + g.height, g.pad_w:g.pad_w + g.width] = x
        return xpad

    def _windows(self, x: Array, order: tuple[int, ...]) -> Array:
        """Every kernel window of the padded chunk ``x`` (n, C, Hp, Wp) as a strided view
        with axes (n, C, kh, kw, out_h, out_w) permuted by ``order``; no copy."""
        g = self.g
        sn, sc, sh, sw = x.strides
        shape = (x.shape[0], g.channels, g.kernel_h, g.kernel_w, g.out_h, g.out_w)
        strides = (sn, sc, g.dilation_h * sh, g.dilation_w * sw, g.stride_h * sh,
                   g.stride_w * sw)
        return self.xp.lib.stride_tricks.as_strided(
            x, shape=tuple(shape[a] for a in order), strides=tuple(strides[a] for a in order))

    def im2col(self, x: Array) -> Array:
        """The columns of the chunk ``x`` (n, C, H, W) as a (C*kh*kw, n*P) matrix: row
        (c, i, j) is input channel c at kernel offset (i, j) for every output pixel, so
        group k owns the k-th block of rows."""
        g, n = self.g, x.shape[0]
        col = self.batched("col", (g.channels, g.kernel_h, g.kernel_w), n, (g.out_h, g.out_w))
        col[...] = self._windows(self.padded(x, self.batch_last), (1, 2, 3, 0, 4, 5))
        return self.matrix("col", g.channels * g.kernel_h * g.kernel_w, n)

    def im2col_samples(self, x: Array, ones: bool) -> Array:
        """The columns of the chunk ``x`` (n, C, H, W) per sample, (n, C*kh*kw, P), with a
        last row of ones when ``ones`` (the bias's column in the GEMM)."""
        g, n = self.g, x.shape[0]
        k, p = g.channels * g.kernel_h * g.kernel_w, g.out_h * g.out_w
        if ones:
            col = self.constant("col", (n, k + 1, p), 1, "nkp")
        else:
            col = self.buf("col", (n, k, p))
        view = col[:, :k].reshape(n, g.channels, g.kernel_h, g.kernel_w, g.out_h, g.out_w)
        xpad = self.padded(x, False)
        if g.stride_h != 1:
            view[...] = self._windows(xpad, (0, 1, 2, 3, 4, 5))
            return col
        # In two steps: the kw column shifts of the padded image, (n, C, kw, Hp, out_w),
        # then each (i, j) window is out_h whole consecutive rows of shift j, so the big
        # copy moves P contiguous values at a time instead of out_w.
        sn, sc, sh, sw = xpad.strides
        shifts = self.buf("shifts", (n, g.channels, g.kernel_w, self.hp, g.out_w))
        shifts[...] = self.xp.lib.stride_tricks.as_strided(
            xpad, shape=shifts.shape, strides=(sn, sc, g.dilation_w * sw, sh, g.stride_w * sw))
        tn, tc, tj, th, tw = shifts.strides
        view[...] = self.xp.lib.stride_tricks.as_strided(
            shifts, shape=view.shape, strides=(tn, tc, g.dilation_h * th, tj, th, tw))
        return col

    def im2row(self, x: Array) -> Array:
        """The columns of the chunk ``x`` (n, C, H, W) as a (n*P, C*kh*kw) matrix: row p is
        output pixel p's window ordered (group, i, j, channel of the group), copied from a
        channels-last padded copy of ``x`` so that each (i, group) moves kw*C/group
        contiguous values."""
        g, n = self.g, x.shape[0]
        xt = self.constant("xpad", (n, self.hp, self.wp, g.channels), 0, "nhwc")
        xt[:, g.pad_h:g.pad_h + g.height, g.pad_w:g.pad_w + g.width] = x.transpose(0, 2, 3, 1)
        sn, sh, sw, sc = xt.strides
        cg = g.channels // g.group
        windows = self.xp.lib.stride_tricks.as_strided(
            xt, shape=(n, g.out_h, g.out_w, g.group, g.kernel_h, g.kernel_w, cg),
            strides=(sn, g.stride_h * sh, g.stride_w * sw, cg * sc, g.dilation_h * sh,
                     g.dilation_w * sw, sc))
        rows = self.buf("col", windows.shape)
        rows[...] = windows
        return rows.reshape(n * g.out_h * g.out_w, -1)

    def col2im(self, dx: Array) -> None:
        """The adjoint of ``im2col``: fill the chunk ``dx`` (n, C, H, W) with the sum of the
        columns in buffer "col" over every window that covers each pixel."""
        g, n = self.g, dx.shape[0]
        cols = self.batched("col", (g.channels, g.kernel_h, g.kernel_w), n, (g.out_h, g.out_w))
        acc = self.batched("acc", (g.channels,), n, (self.hp, self.wp))
        acc.fill(0)
        hspan, wspan = g.stride_h * (g.out_h - 1) + 1, g.stride_w * (g.out_w - 1) + 1
        if g.stride_h == 1:
            # The adjoint of im2col_samples' two steps: sum the kh row offsets of each
            # column shift j (whole out_h x out_w blocks, long runs), then scatter the kw
            # shifts (kw adds of short image rows instead of kh*kw).
            shifts = self.batched("shifts", (g.channels, g.kernel_w), n, (self.hp, g.out_w))
            shifts.fill(0)
            for i in range(g.kernel_h):
                h0 = i * g.dilation_h
                shifts[:, :, :, h0:h0 + g.out_h] += cols[:, i]
            for j in range(g.kernel_w):
                w0 = j * g.dilation_w
                acc[:, :, :, w0:w0 + wspan:g.stride_w] += shifts[:, j]
        else:
            for i in range(g.kernel_h):
                h0 = i * g.dilation_h
                for j in range(g.kernel_w):
                    w0 = j * g.dilation_w
                    acc[:, :, h0:h0 + hspan:g.stride_h, w0:w0 + wspan:g.stride_w] += cols[:, i, j]
        inner = acc[:, :, g.pad_h:g.pad_h + g.height, g.pad_w:g.pad_w + g.width]
        dx[...] = inner.transpose(1, 0, 2, 3)

    def to_matrix(self, name: str, a: Array) -> Array:
        """The chunk ``a`` (n, rows, out_h, out_w) as a (rows, n*P) matrix in buffer ``name``."""
        n, rows = a.shape[:2]
        t = self.batched(name, (rows,), n, (self.g.out_h, self.g.out_w))
        t[...] = a.transpose(1, 0, 2, 3)
        return self.matrix(name, rows, n)

    def from_matrix(self, name: str, y: Array, b: Array | None) -> None:
        """Fill the chunk ``y`` (n, rows, out_h, out_w) from the (rows, n*P) matrix in
        buffer ``name``, adding the bias ``b`` (rows,) on the way."""
        n, rows = y.shape[:2]
        t = self.batched(name, (rows,), n, (self.g.out_h, self.g.out_w)).transpose(1, 0, 2, 3)
        if b is None:
            y[...] = t
        else:
            self.xp.add(t, b.reshape(1, rows, 1, 1), out=y)


def _input(a: Array, g: ConvGeometry) -> Array:
    return a.reshape(g.num, g.channels, g.height, g.width)


def _output(a: Array, g: ConvGeometry) -> Array:
    return a.reshape(g.num, g.num_output, g.out_h, g.out_w)


def _row_weight(xp: Any, w: Array, g: ConvGeometry) -> Array:
    """The weight as the "rows" layout's GEMM operand: per group (kh*kw*C/group, M/group),
    its rows ordered like ``im2row``'s columns."""
    ng, cg, mg = g.group, g.channels // g.group, g.num_output // g.group
    w5 = w.reshape(ng, mg, cg, g.kernel_h, g.kernel_w).transpose(0, 3, 4, 2, 1)
    return xp.ascontiguousarray(w5).reshape(ng, -1, mg)


def _group_gemm(xp: Any, a: Array, b: Array, out: Array, ng: int, a_axis: int, b_axis: int,
                out_axis: int) -> None:
    """out = a @ b per group: group k takes the k-th block of ``a``, ``b`` and ``out``
    along the named axes (an axis of -1: the operand is already split, (ng, ...))."""
    def block(t: Array, axis: int, k: int) -> Array:
        if axis < 0:
            return t[k]
        size = t.shape[axis] // ng
        index = [slice(None)] * t.ndim
        index[axis] = slice(k * size, (k + 1) * size)
        return t[tuple(index)]
    for k in range(ng):
        xp.matmul(block(a, a_axis, k), block(b, b_axis, k), out=block(out, out_axis, k))


def _conv_forward_gpu(x: Array, w: Array, *rest: Array, geom: ConvGeometry) -> None:
    *b, y = rest
    if geom.num == 0:  # an empty batch: y is empty
        return
    _gpu_forward(get_array_module(x), cuda.kernel, x, w, b[0] if b else None, y, geom)


@device_variant(_conv_forward_gpu)
def conv_forward(x: Array, w: Array, *rest: Array, geom: ConvGeometry) -> None:
    """y = w * x (+ b): ``rest`` is (b, y) or (y,)."""
    *b, y = rest
    g = geom
    if g.num == 0:  # an empty batch: y is empty
        return
    _dnnl = onednn.get()
    if _dnnl is not None and _dnnl.conv_forward(x, w, b[0] if b else None, y, g):
        return
    m, ng = g.num_output, g.group
    mg = m // ng
    w2 = w.reshape(ng, mg, -1)
    if g.is_1x1:
        # The input is its own column matrix: one batched GEMM per group, no copies.
        y3 = y.reshape(g.num, m, -1)
        x3 = x.reshape(g.num, ng, -1, g.height * g.width)
        for k in range(ng):
            np.matmul(w2[k], x3[:, k], out=y3[:, k * mg:(k + 1) * mg])
        if b:
            y3 += b[0].reshape(1, m, 1)
        return
    x4, y4 = _input(x, g), _output(y, g)
    y3 = y.reshape(g.num, m, g.out_h * g.out_w)
    ws = _Workspace(np, g, x.dtype)
    layout = _layout(g, forward=True)
    if layout == "rows":
        wr = _row_weight(np, w, g)
        for s in ws.chunks:
            rows = ws.im2row(x4[s])
            out = ws.buf("out", (rows.shape[0], m))
            _group_gemm(np, rows, wr, out, ng, 1, -1, 1)
            t = out.reshape(s.stop - s.start, -1, m).transpose(0, 2, 1)
            if b:
                np.add(t, b[0].reshape(1, m, 1), out=y3[s])
            else:
                y3[s] = t
        return
    if layout == "samples":
        fold = bool(b) and ng == 1  # the bias rides in the GEMM as one more column
        wb = np.concatenate([w2[0], b[0].reshape(m, 1)], axis=1)[None] if fold else w2
        for s in ws.chunks:
            col = ws.im2col_samples(x4[s], fold)
            _group_gemm(np, wb, col, y3[s], ng, -1, 1, 1)
            if b and not fold:
                y3[s] += b[0].reshape(1, m, 1)
        return
    for s in ws.chunks:
        col = ws.im2col(x4[s]).reshape(ng, g.kernel_dim, -1)
        out = ws.matrix("out", m, s.stop - s.start).reshape(ng, mg, -1)
        for k in range(ng):
            np.dot(w2[k], col[k], out=out[k])
        ws.from_matrix("out", y4[s], b[0] if b else None)


def _full_correlation(g: ConvGeometry) -> bool:
    """Whether backward data is cheaper as the full correlation of dy with the flipped
    kernel: only for stride 1 (else dy would need dilating) and padding within the kernel
    extent, and only when the correlation's columns cost less than col2im's scatter."""
    if g.stride_h != 1 or g.stride_w != 1:
        return False
    if g.pad_h > g.dilation_h * (g.kernel_h - 1) or g.pad_w > g.dilation_w * (g.kernel_w - 1):
        return False
    correlate = g.num_output * g.height * g.width
    scatter = g.channels * g.out_h * g.out_w
    return correlate <= FULL_CORRELATION_RATIO * scatter


def _flipped_geometry(g: ConvGeometry) -> ConvGeometry:
    """The convolution from dy to dx: channels and outputs swap, the padding complements."""
    return ConvGeometry(
        g.num, g.num_output, g.out_h, g.out_w, g.channels, g.kernel_h, g.kernel_w,
        pad_h=g.dilation_h * (g.kernel_h - 1) - g.pad_h,
        pad_w=g.dilation_w * (g.kernel_w - 1) - g.pad_w,
        dilation_h=g.dilation_h, dilation_w=g.dilation_w, group=g.group)


def _flipped(xp: Any, w: Array, g: ConvGeometry) -> Array:
    """The weight of ``_flipped_geometry``: per group, input and output channels swap and
    the kernel turns by 180 degrees."""
    ng = g.group
    w5 = w.reshape(ng, g.num_output // ng, g.channels // ng, g.kernel_h, g.kernel_w)
    flipped = w5[:, :, :, ::-1, ::-1].transpose(0, 2, 1, 3, 4)
    return xp.ascontiguousarray(flipped).reshape(g.channels, -1, g.kernel_h, g.kernel_w)


def _conv_backward_data_gpu(dy: Array, w: Array, dx: Array, *, geom: ConvGeometry) -> None:
    if geom.num == 0:  # an empty batch: dx is empty
        return
    _gpu_backward_data(get_array_module(dy), cuda.kernel, dy, w, dx, geom)


@device_variant(_conv_backward_data_gpu)
def conv_backward_data(dy: Array, w: Array, dx: Array, *, geom: ConvGeometry) -> None:
    """dx = w^T * dy: the GEMM gives the columns, col2im sums them back."""
    g = geom
    if g.num == 0:  # an empty batch: dx is empty
        return
    _dnnl = onednn.get()
    if _dnnl is not None and _dnnl.conv_backward_data(dy, w, dx, g):
        return
    ng = g.group
    mg = g.num_output // ng
    w2 = w.reshape(ng, mg, -1)
    if g.is_1x1:
        dy3 = dy.reshape(g.num, ng, mg, -1)
        dx3 = dx.reshape(g.num, ng, -1, g.height * g.width)
        for k in range(ng):
            np.matmul(w2[k].T, dy3[:, k], out=dx3[:, k])
        return
    if _full_correlation(g):
        conv_forward(dy, _flipped(np, w, g), dx, geom=_flipped_geometry(g))
        return
    dy4, dx4 = _output(dy, g), _input(dx, g)
    ws = _Workspace(np, g, dy.dtype)
    for s in ws.chunks:
        dyt = ws.to_matrix("dy", dy4[s]).reshape(ng, mg, -1)
        col = ws.matrix("col", g.channels * g.kernel_h * g.kernel_w, s.stop - s.start)
        col = col.reshape(ng, g.kernel_dim, -1)
        for k in range(ng):
            np.dot(w2[k].T, dyt[k], out=col[k])
        ws.col2im(dx4[s])


def _conv_backward_weight_gpu(*arrays: Array, geom: ConvGeometry) -> None:
    *pairs, dw = arrays
    if geom.num == 0:  # a sum over no sample
        dw.fill(0)
        return
    _gpu_backward_weight(get_array_module(dw), cuda.kernel, pairs, dw, geom)


@device_variant(_conv_backward_weight_gpu)
def conv_backward_weight(*arrays: Array, geom: ConvGeometry) -> None:
    """dw = sum over the (x, dy) pairs of dy * x^T: ``arrays`` is x0, dy0, x1, dy1, ..., dw
    (a layer with several bottoms shares one weight)."""
    *pairs, dw = arrays
    if geom.num == 0:  # a sum over no sample
        dw.fill(0)
        return
    g = geom
    _dnnl = onednn.get()
    if _dnnl is not None and _dnnl.conv_backward_weight(arrays, g):
        return
    m, ng = g.num_output, g.group
    mg = m // ng
    ws = _Workspace(np, g, dw.dtype)
    layout = "cols" if g.is_1x1 else _layout(g, forward=False)
    # Each chunk's product lands in `part`; the first one is the sum so far (`acc` is it).
    if layout == "rows":  # per group (mg, kh*kw*cg)
        acc = ws.buf("acc", (ng, mg, g.kernel_dim))
    elif layout == "samples":  # per group (cg*kh*kw, mg)
        acc = ws.buf("acc", (ng, g.kernel_dim, mg))
    else:
        acc = dw.reshape(ng, mg, -1)
    first = True
    for i in range(0, len(pairs), 2):
        x4, dy4 = _input(pairs[i], g), _output(pairs[i + 1], g)
        for s in ws.chunks:
            n = s.stop - s.start
            if layout == "rows":
                rows = ws.im2row(x4[s])
                dyt = ws.buf("dy", (m, n, g.out_h * g.out_w))
                dyt[...] = dy4[s].reshape(n, m, -1).transpose(1, 0, 2)
                part = acc if first else ws.buf("part", acc.shape)
                _group_gemm(np, dyt.reshape(ng, mg, -1), rows, part, ng, -1, 1, -1)
            elif layout == "samples":
                col = ws.im2col_samples(x4[s], False)
                prods = ws.buf("prods", (n, ng, g.kernel_dim, mg))
                dyt = dy4[s].reshape(n, m, -1).transpose(0, 2, 1)
                for k in range(ng):
                    np.matmul(col[:, k * g.kernel_dim:(k + 1) * g.kernel_dim],
                              dyt[:, :, k * mg:(k + 1) * mg], out=prods[:, k])
                part = acc if first else ws.buf("part", acc.shape)
                prods.sum(axis=0, out=part)
            else:
                if g.is_1x1:  # the columns are the input, channels first
                    col = ws.to_matrix("col", x4[s])
                else:
                    col = ws.im2col(x4[s])
                col = col.reshape(ng, g.kernel_dim, -1)
                dyt = ws.to_matrix("dy", dy4[s]).reshape(ng, mg, -1)
                part = acc if first else ws.buf("part", acc.shape)
                for k in range(ng):
                    np.dot(dyt[k], col[k].T, out=part[k])
            if not first:
                acc += part
            first = False
    if first:  # an empty batch
        acc.fill(0)
    dw5 = dw.reshape(ng, mg, g.channels // ng, g.kernel_h, g.kernel_w)
    if layout == "rows":
        dw5[...] = acc.reshape(ng, mg, g.kernel_h, g.kernel_w, -1).transpose(0, 1, 4, 2, 3)
    elif layout == "samples":
        dw5[...] = acc.reshape(ng, -1, g.kernel_h, g.kernel_w, mg).transpose(0, 4, 1, 2, 3)


def conv_backward_bias(*arrays: Array, num: int) -> None:
    """db = the sum of each dy over all axes but the channel axis: ``arrays`` is dy0, dy1,
    ..., db; ``num`` is the product of the axes before the channel axis. Two matrix-vector
    products with vectors of ones, as Caffe's bias multiplier does: BLAS streams dy several
    times faster than numpy's reductions."""
    *dys, db = arrays
    xp = get_array_module(db)
    m = db.shape[0]
    for i, dy in enumerate(dys):
        d2 = dy.reshape(num * m, dy.size // max(num * m, 1))
        per_map = xp.dot(d2, xp.ones(d2.shape[1], dtype=dy.dtype))
        s = xp.dot(xp.ones(num, dtype=dy.dtype), per_map.reshape(num, m))
        if i == 0:
            db[...] = s
        else:
            db += s


def deconv_forward(x: Array, w: Array, *rest: Array, geom: ConvGeometry) -> None:
    """Caffe's Deconvolution: y = the convolution's backward-data of x (+ b). ``geom`` is the
    convolution that maps y back to x (its channels are the deconvolution's outputs)."""
    *b, y = rest
    conv_backward_data(x, w, y, geom=geom)
    if b and y.size:  # an empty top has nothing to add to (and no -1 axis to infer)
        y3 = y.reshape(geom.num, geom.channels, -1)
        y3 += b[0].reshape(1, geom.channels, 1)


# -- GPU ------------------------------------------------------------------------------------
# The batch is cut into chunks of whole samples whose column matrix (C*kh*kw, n*P) holds at
# most GPU_COL_BUDGET elements; our im2col kernel fills it, one cuBLAS GEMM per group reads
# it, and one copy moves the (outputs, n, P) product into NCHW. A chunk of one sample needs
# no copy: its GEMM writes the NCHW output directly. 1x1 stride-1 unpadded convolutions use
# the input as its own columns (a batched GEMM). The array logic below is written over
# ``xp`` with the kernels passed in (``kernels(family, name, dtype) -> launch``), so the
# tests run this very code on numpy arrays with the CUDA sources emulated on the CPU.
GPU_COL_BUDGET = 1 << 26

Kernels = Callable[[str, str, Any], Callable[..., None]]


def _gpu_chunks(g: ConvGeometry) -> list[slice]:
    per_sample = max(g.channels * g.kernel_h * g.kernel_w * g.out_h * g.out_w, 1)
    n = max(1, min(g.num, GPU_COL_BUDGET // per_sample))
    return [slice(i, min(i + n, g.num)) for i in range(0, g.num, n)]


def _gpu_geometry(g: ConvGeometry) -> tuple[int, ...]:
    return (g.channels, g.height, g.width, g.kernel_h, g.kernel_w, g.stride_h, g.stride_w,
            g.pad_h, g.pad_w, g.dilation_h, g.dilation_w, g.out_h, g.out_w)


def _gpu_matrix(a3: Array, buf: Array) -> Array:
    """The chunk ``a3`` (n, rows, P) as a (rows, n*P) matrix: a copy into ``buf``, or ``a3``
    itself for one sample."""
    n, rows, p = a3.shape
    if n == 1:
        return a3[0]
    t = buf[:rows * n * p].reshape(rows, n, p)
    t[...] = a3.transpose(1, 0, 2)
    return t.reshape(rows, n * p)


def _gpu_forward(xp: Any, kernels: Kernels, x: Array, w: Array, b: Array | None, y: Array,
                 g: ConvGeometry) -> None:
    m, ng = g.num_output, g.group
    mg, kg, p = m // ng, g.kernel_dim, g.out_h * g.out_w
    w2 = w.reshape(ng, mg, kg)
    y3 = y.reshape(g.num, m, p)
    if g.is_1x1:
        x3 = x.reshape(g.num, g.channels, p)
        for k in range(ng):
            xp.matmul(w2[k], x3[:, k * kg:(k + 1) * kg], out=y3[:, k * mg:(k + 1) * mg])
        if b is not None:
            y3 += b.reshape(1, m, 1)
        return
    im2col = kernels("im2col", "im2col", x.dtype)
    x4 = _input(x, g)
    chunks = _gpu_chunks(g)
    n_max = chunks[0].stop - chunks[0].start if chunks else 0
    col_buf = xp.empty(ng * kg * n_max * p, dtype=x.dtype)
    out_buf = xp.empty(m * n_max * p, dtype=x.dtype) if n_max > 1 else None
    for s in chunks:
        n = s.stop - s.start
        col = col_buf[:ng * kg * n * p].reshape(ng * kg, n * p)
        im2col(col.size, x4[s], col, n, *_gpu_geometry(g))
        out = y3[s.start] if n == 1 else out_buf[:m * n * p].reshape(m, n * p)
        for k in range(ng):
            xp.matmul(w2[k], col[k * kg:(k + 1) * kg], out=out[k * mg:(k + 1) * mg])
        if n == 1:
            if b is not None:
                out += b.reshape(m, 1)
        elif b is None:
            y3[s] = out.reshape(m, n, p).transpose(1, 0, 2)
        else:
            xp.add(out.reshape(m, n, p).transpose(1, 0, 2), b.reshape(1, m, 1), out=y3[s])


def _gpu_backward_data(xp: Any, kernels: Kernels, dy: Array, w: Array, dx: Array,
                       g: ConvGeometry) -> None:
    m, ng = g.num_output, g.group
    mg, kg, p = m // ng, g.kernel_dim, g.out_h * g.out_w
    w2 = w.reshape(ng, mg, kg)
    dy3 = dy.reshape(g.num, m, p)
    if g.is_1x1:
        dx3 = dx.reshape(g.num, g.channels, p)
        for k in range(ng):
            xp.matmul(w2[k].T, dy3[:, k * mg:(k + 1) * mg], out=dx3[:, k * kg:(k + 1) * kg])
        return
    col2im = kernels("im2col", "col2im", dy.dtype)
    dx4 = _input(dx, g)
    chunks = _gpu_chunks(g)
    n_max = chunks[0].stop - chunks[0].start if chunks else 0
    col_buf = xp.empty(ng * kg * n_max * p, dtype=dy.dtype)
    dy_buf = xp.empty(m * n_max * p, dtype=dy.dtype) if n_max > 1 else None
    for s in chunks:
        n = s.stop - s.start
        dyt = _gpu_matrix(dy3[s], dy_buf)
        col = col_buf[:ng * kg * n * p].reshape(ng * kg, n * p)
        for k in range(ng):
            xp.matmul(w2[k].T, dyt[k * mg:(k + 1) * mg], out=col[k * kg:(k + 1) * kg])
        col2im(dx4[s].size, col, dx4[s], n, *_gpu_geometry(g))


def _gpu_backward_weight(xp: Any, kernels: Kernels, pairs: list[Array], dw: Array,
                         g: ConvGeometry) -> None:
    m, ng = g.num_output, g.group
    mg, kg, p = m // ng, g.kernel_dim, g.out_h * g.out_w
    dw2 = dw.reshape(ng, mg, kg)
    chunks = _gpu_chunks(g)
    n_max = chunks[0].stop - chunks[0].start if chunks else 0
    im2col = None if g.is_1x1 else kernels("im2col", "im2col", dw.dtype)
    col_buf = xp.empty(ng * kg * n_max * p, dtype=dw.dtype)
    dy_buf = xp.empty(m * n_max * p, dtype=dw.dtype) if n_max > 1 else None
    part = None  # each later chunk's product, added to dw (cuBLAS would need beta = 1)
    first = True
    for i in range(0, len(pairs), 2):
        x3 = pairs[i].reshape(g.num, g.channels, g.height * g.width)
        dy3 = pairs[i + 1].reshape(g.num, m, p)
        x4 = _input(pairs[i], g)
        for s in chunks:
            n = s.stop - s.start
            if im2col is None:  # 1x1: the columns are the input, channels first
                col = _gpu_matrix(x3[s], col_buf)
            else:
                col = col_buf[:ng * kg * n * p].reshape(ng * kg, n * p)
                im2col(col.size, x4[s], col, n, *_gpu_geometry(g))
            dyt = _gpu_matrix(dy3[s], dy_buf)
            if not first and part is None:
                part = xp.empty_like(dw2)
            target = dw2 if first else part
            for k in range(ng):
                xp.matmul(dyt[k * mg:(k + 1) * mg], col[k * kg:(k + 1) * kg].T, out=target[k])
            if not first:
                dw2 += part
            first = False
    if first:  # an empty batch
        dw.fill(0)
