"""Convolution kernels (Caffe's Convolution; Deconvolution reuses them transposed): im2col
of the batch in chunks of whole samples and one GEMM per group and chunk; col2im as a
scatter-add over the kernel offsets, or, for stride 1, backward data as the full correlation
of dy with the flipped kernel where that moves less memory.

Blobs are (num, channels, height, width) as the geometry says; a 1-d convolution is the
2-d one with height 1, and axes before the channel axis are folded into ``num``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from purine.backend import get_array_module

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
# - Work buffers keep the batch axis innermost for stride-1 outputs narrower than
#   BATCH_LAST_BELOW: a kernel offset then moves whole (out_w, batch) rows instead of short
#   image rows, which numpy pays for per row.
# - Backward data becomes a full correlation when its im2col of dy (num_output rows per
#   kernel offset) is at most FULL_CORRELATION_RATIO times col2im's scatter into dx
#   (channels rows per offset, each a read-modify-write).
COL_BUDGET = 1 << 21
MIN_COLUMNS = 1024
BATCH_LAST_BELOW = 20
FULL_CORRELATION_RATIO = 2.0


def _size(shape: tuple[int, ...]) -> int:
    size = 1
    for d in shape:
        size *= d
    return size


def _batch_last(g: ConvGeometry) -> bool:
    return g.stride_h == 1 and g.stride_w == 1 and g.out_w < BATCH_LAST_BELOW


class _Workspace:
    """The buffers of one kernel call, sized for a chunk of ``n`` samples. Arrays handed out
    are "canonical" views whose axes put the batch where NCHW does (``(*lead, n, *tail)``);
    in memory the batch is innermost when ``batch_last``. GEMM operands are (rows, n*P)
    matrices whose columns follow that memory order."""

    def __init__(self, xp: Any, g: ConvGeometry, dtype: Any):
        self.xp, self.g, self.dtype = xp, g, dtype
        p = g.out_h * g.out_w
        per_sample = g.channels * g.kernel_h * g.kernel_w * p
        n = max(COL_BUDGET // max(per_sample, 1), -(-MIN_COLUMNS // p))
        n = max(1, min(g.num, n))
        self.chunks = [slice(i, min(i + n, g.num)) for i in range(0, g.num, n)]
        self.batch_last = _batch_last(g)
        self.hp, self.wp = g.height + 2 * g.pad_h, g.width + 2 * g.pad_w
        self._bufs: dict[str, Array] = {}
        self._xpad_n = -1

    def _buf(self, name: str, shape: tuple[int, ...]) -> Array:
        buf = self._bufs.get(name)
        if buf is None or buf.size < _size(shape):
            buf = self._bufs[name] = self.xp.empty(_size(shape), dtype=self.dtype)
        return buf[:_size(shape)]

    def batched(self, name: str, lead: tuple[int, ...], n: int, tail: tuple[int, ...]
                ) -> Array:
        """Buffer ``name`` as a (*lead, n, *tail) view (batch innermost in memory when
        ``batch_last``)."""
        if not self.batch_last:
            return self._buf(name, (*lead, n, *tail)).reshape(*lead, n, *tail)
        a = self._buf(name, (*lead, *tail, n)).reshape(*lead, *tail, n)
        k = len(lead)
        return a.transpose(*range(k), a.ndim - 1, *range(k, a.ndim - 1))

    def matrix(self, name: str, rows: int, n: int) -> Array:
        """Buffer ``name`` as a contiguous (rows, n * out_h * out_w) GEMM operand."""
        return self._buf(name, (rows, n * self.g.out_h * self.g.out_w)).reshape(rows, -1)

    def im2col(self, x: Array) -> Array:
        """The columns of the chunk ``x`` (n, C, H, W) as a (C*kh*kw, n*P) matrix: row
        (c, i, j) is input channel c at kernel offset (i, j) for every output pixel, so
        group k owns the k-th block of rows."""
        g, n = self.g, x.shape[0]
        if g.pad_h or g.pad_w or self.batch_last:
            xpad = self.batched("xpad", (), n, (g.channels, self.hp, self.wp))
            if n != self._xpad_n:  # borders stay zero while the chunk size stays
                xpad.fill(0)
                self._xpad_n = n
            xpad[:, :, g.pad_h:g.pad_h + g.height, g.pad_w:g.pad_w + g.width] = x
            x = xpad
        sn, sc, sh, sw = x.strides
        windows = self.xp.lib.stride_tricks.as_strided(
            x, shape=(g.channels, g.kernel_h, g.kernel_w, n, g.out_h, g.out_w),
            strides=(sc, g.dilation_h * sh, g.dilation_w * sw, sn,
                     g.stride_h * sh, g.stride_w * sw))
        col = self.batched("col", (g.channels, g.kernel_h, g.kernel_w), n, (g.out_h, g.out_w))
        col[...] = windows
        return self.matrix("col", g.channels * g.kernel_h * g.kernel_w, n)

    def col2im(self, dx: Array) -> None:
        """The adjoint of ``im2col``: fill the chunk ``dx`` (n, C, H, W) with the sum of the
        columns in buffer "col" over every window that covers each pixel."""
        g, n = self.g, dx.shape[0]
        cols = self.batched("col", (g.channels, g.kernel_h, g.kernel_w), n, (g.out_h, g.out_w))
        acc = self.batched("acc", (g.channels,), n, (self.hp, self.wp))
        acc.fill(0)
        hspan, wspan = g.stride_h * (g.out_h - 1) + 1, g.stride_w * (g.out_w - 1) + 1
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


def conv_forward(x: Array, w: Array, *rest: Array, geom: ConvGeometry) -> None:
    """y = w * x (+ b): ``rest`` is (b, y) or (y,)."""
    *b, y = rest
    g = geom
    xp = get_array_module(x)
    m, ng = g.num_output, g.group
    mg = m // ng
    w2 = w.reshape(ng, mg, -1)
    if g.is_1x1:
        # The input is its own column matrix: one batched GEMM per group, no copies.
        y3 = y.reshape(g.num, m, -1)
        x3 = x.reshape(g.num, ng, -1, g.height * g.width)
        for k in range(ng):
            xp.matmul(w2[k], x3[:, k], out=y3[:, k * mg:(k + 1) * mg])
        if b:
            y3 += b[0].reshape(1, m, 1)
        return
    x4, y4 = _input(x, g), _output(y, g)
    ws = _Workspace(xp, g, x.dtype)
    for s in ws.chunks:
        col = ws.im2col(x4[s]).reshape(ng, g.kernel_dim, -1)
        out = ws.matrix("out", m, s.stop - s.start).reshape(ng, mg, -1)
        for k in range(ng):
            xp.dot(w2[k], col[k], out=out[k])
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


def conv_backward_data(dy: Array, w: Array, dx: Array, *, geom: ConvGeometry) -> None:
    """dx = w^T * dy: the GEMM gives the columns, col2im sums them back."""
    g = geom
    xp = get_array_module(dy)
    ng = g.group
    mg = g.num_output // ng
    w2 = w.reshape(ng, mg, -1)
    if g.is_1x1:
        dy3 = dy.reshape(g.num, ng, mg, -1)
        dx3 = dx.reshape(g.num, ng, -1, g.height * g.width)
        for k in range(ng):
            xp.matmul(w2[k].T, dy3[:, k], out=dx3[:, k])
        return
    if _full_correlation(g):
        conv_forward(dy, _flipped(xp, w, g), dx, geom=_flipped_geometry(g))
        return
    dy4, dx4 = _output(dy, g), _input(dx, g)
    ws = _Workspace(xp, g, dy.dtype)
    for s in ws.chunks:
        dyt = ws.to_matrix("dy", dy4[s]).reshape(ng, mg, -1)
        col = ws.matrix("col", g.channels * g.kernel_h * g.kernel_w, s.stop - s.start)
        col = col.reshape(ng, g.kernel_dim, -1)
        for k in range(ng):
            xp.dot(w2[k].T, dyt[k], out=col[k])
        ws.col2im(dx4[s])


def conv_backward_weight(*arrays: Array, geom: ConvGeometry) -> None:
    """dw = sum over the (x, dy) pairs of dy * x^T: ``arrays`` is x0, dy0, x1, dy1, ..., dw
    (a layer with several bottoms shares one weight)."""
    *pairs, dw = arrays
    g = geom
    xp = get_array_module(dw)
    ng = g.group
    mg = g.num_output // ng
    dw2 = dw.reshape(ng, mg, -1)
    ws = _Workspace(xp, g, dw.dtype)
    first = True
    for i in range(0, len(pairs), 2):
        x4, dy4 = _input(pairs[i], g), _output(pairs[i + 1], g)
        for s in ws.chunks:
            if g.is_1x1:  # the columns are the input, channels first
                col = ws.to_matrix("col", x4[s])
            else:
                col = ws.im2col(x4[s])
            col = col.reshape(ng, g.kernel_dim, -1)
            dyt = ws.to_matrix("dy", dy4[s]).reshape(ng, mg, -1)
            for k in range(ng):
                if first:
                    xp.dot(dyt[k], col[k].T, out=dw2[k])
                else:
                    dw2[k] += dyt[k].dot(col[k].T)
            first = False


def conv_backward_bias(*arrays: Array, num: int) -> None:
    """db = the sum of each dy over all axes but the channel axis: ``arrays`` is dy0, dy1,
    ..., db; ``num`` is the product of the axes before the channel axis."""
    *dys, db = arrays
    for i, dy in enumerate(dys):
        s = dy.reshape(num, db.shape[0], -1).sum(axis=2).sum(axis=0)
        if i == 0:
            db[...] = s
        else:
            db += s


def deconv_forward(x: Array, w: Array, *rest: Array, geom: ConvGeometry) -> None:
    """Caffe's Deconvolution: y = the convolution's backward-data of x (+ b). ``geom`` is the
    convolution that maps y back to x (its channels are the deconvolution's outputs)."""
    *b, y = rest
    conv_backward_data(x, w, y, geom=geom)
    if b:
        y3 = y.reshape(geom.num, geom.channels, -1)
        y3 += b[0].reshape(1, geom.channels, 1)
