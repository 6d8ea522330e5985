"""Local response normalization kernels (Caffe's LRN layer). Both regions share one form:

    scale = shift + alpha / norm * window_sum(x^2),   y = x * scale^-beta

ACROSS_CHANNELS sums ``size`` neighbouring channels (shift k, norm size); WITHIN_CHANNEL is
Caffe's composition x * (1 + alpha * avepool(x^2))^-beta whose pool is size x size with pad
(size-1)/2 and stride 1, so every window divides by size^2 (shift 1, norm size^2).
On a GPU, ACROSS_CHANNELS runs our lrn kernels (one thread per element, the same
arithmetic in the same order); WITHIN_CHANNEL runs the array code below on cupy.

On the host the array code runs on blocks of whole images, spread over the cores: a window
never leaves its image, so each element gets the same operations in the same order as on
the whole batch (the same bits), while a block's arrays and temporaries stay in cache
across the formula's dozen passes instead of streaming the whole batch through memory
for each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from purine.backend import cuda, device_variant, get_array_module, host_parallel

Array = Any

# Elements per host block (whole images, at least one): a float32 block of 512 KiB and the
# few temporaries the formula makes fit in a core's share of the cache.
BLOCK_ELEMENTS = 1 << 17


def _power(xp: Any, a: Array, exponent: float, out: Array) -> Array:
    """``a ** exponent`` into ``out``, with square roots for Caffe's usual beta = 0.75
    (pow is several times dearer than sqrt)."""
    if exponent == -0.75:
        xp.sqrt(a, out=out)
        out *= xp.sqrt(out)
        xp.reciprocal(out, out=out)
    elif exponent == -0.5:
        xp.sqrt(a, out=out)
        xp.reciprocal(out, out=out)
    elif exponent == -1.0:
        xp.reciprocal(a, out=out)
    else:
        xp.power(a, exponent, out=out)
    return out


def _channel_window_sum(a: Array, size: int, out: Array) -> None:
    """out[:, c] = sum of a[:, c'] over |c' - c| <= (size-1)/2 (a is (num, channels, P))."""
    half = (size - 1) // 2
    channels = a.shape[1]
    out[...] = a
    for o in range(1, half + 1):
        if o >= channels:
            break
        out[:, o:] += a[:, :channels - o]
        out[:, :channels - o] += a[:, o:]


def _box_sum(a: Array, size: int, out: Array) -> None:
    """out = the size x size box sums of a (num, channels, H, W), zero outside the image:
    separable, so 2 (size-1) shifted adds instead of size^2."""
    half = (size - 1) // 2
    h, w = a.shape[2:]
    rows = a.copy()
    for o in range(1, min(half, w - 1) + 1):
        rows[..., o:] += a[..., :w - o]
        rows[..., :w - o] += a[..., o:]
    out[...] = rows
    for o in range(1, min(half, h - 1) + 1):
        out[:, :, o:] += rows[:, :, :h - o]
        out[:, :, :h - o] += rows[:, :, o:]


def _window_sum(a: Array, out: Array, *, size: int, within: bool) -> None:
    if within:
        _box_sum(a, size, out)
    else:
        planes = a.shape[:2] + (math.prod(a.shape[2:]),)  # -1 cannot size an empty batch
        _channel_window_sum(a.reshape(planes), size, out.reshape(planes))


def _in_blocks(fn: Callable[[slice], None], x: Array) -> None:
    """Run ``fn`` over slices of x's batch axis: the cores take parts of the batch, and each
    part goes in blocks of about BLOCK_ELEMENTS elements."""
    num = x.shape[0]
    per_image = math.prod(x.shape[1:])
    step = max(1, BLOCK_ELEMENTS // max(per_image, 1))

    def part(s: slice) -> None:
        for i in range(s.start, s.stop, step):
            fn(slice(i, min(i + step, s.stop)))

    host_parallel(part, num, work=x.size)


def _norm(size: int, within: bool) -> int:
    return size * size if within else size


def _forward_arrays(x: Array, y: Array, scale: Array, *, size: int, alpha: float,
                    beta: float, shift: float, within: bool) -> None:
    """The forward pass as array operations (the host's, and a GPU's WITHIN_CHANNEL)."""
    xp = get_array_module(x)
    sq = xp.square(x)
    _window_sum(sq, scale, size=size, within=within)
    scale *= alpha / _norm(size, within)
    scale += shift
    xp.multiply(x, _power(xp, scale, -beta, sq), out=y)


def _lrn_forward_gpu(x: Array, y: Array, scale: Array, *, size: int, alpha: float,
                     beta: float, shift: float, within: bool) -> None:
    if within:
        _forward_arrays(x, y, scale, size=size, alpha=alpha, beta=beta, shift=shift,
                        within=within)
    else:
        _gpu_forward(cuda.kernel, x, y, scale, size=size, alpha=alpha, beta=beta,
                     shift=shift)


@device_variant(_lrn_forward_gpu)
def lrn_forward(x: Array, y: Array, scale: Array, *, size: int, alpha: float, beta: float,
                shift: float, within: bool) -> None:
    """y = x * scale^-beta, keeping ``scale`` (Caffe's scale_) for the backward pass."""
    _in_blocks(lambda s: _forward_arrays(x[s], y[s], scale[s], size=size, alpha=alpha,
                                         beta=beta, shift=shift, within=within), x)


def _backward_arrays(x: Array, y: Array, scale: Array, dy: Array, dx: Array, *, size: int,
                     alpha: float, beta: float, within: bool) -> None:
    """The backward pass as array operations (the host's, and a GPU's WITHIN_CHANNEL)."""
    xp = get_array_module(x)
    ratio = xp.multiply(dy, y)
    ratio /= scale
    acc = xp.empty_like(ratio)
    _window_sum(ratio, acc, size=size, within=within)
    acc *= x
    acc *= 2.0 * alpha * beta / _norm(size, within)
    xp.multiply(dy, _power(xp, scale, -beta, ratio), out=dx)
    dx -= acc


def _lrn_backward_gpu(x: Array, y: Array, scale: Array, dy: Array, dx: Array, *, size: int,
                      alpha: float, beta: float, within: bool) -> None:
    if within:
        _backward_arrays(x, y, scale, dy, dx, size=size, alpha=alpha, beta=beta,
                         within=within)
    else:
        _gpu_backward(cuda.kernel, x, y, scale, dy, dx, size=size, alpha=alpha, beta=beta)


@device_variant(_lrn_backward_gpu)
def lrn_backward(x: Array, y: Array, scale: Array, dy: Array, dx: Array, *, size: int,
                 alpha: float, beta: float, within: bool) -> None:
    """Caffe's formula: dx = dy * scale^-beta
    - 2 alpha beta / norm * x * window_sum(dy * y / scale)."""
    _in_blocks(lambda s: _backward_arrays(x[s], y[s], scale[s], dy[s], dx[s], size=size,
                                          alpha=alpha, beta=beta, within=within), x)


# -- GPU (ACROSS_CHANNELS); ``kernels(family, name, dtype) -> launch`` is passed in so that
# the tests run these wrappers with the CUDA sources emulated on the CPU.

def _channels_plane(x: Array) -> tuple[int, int]:
    plane = 1
    for d in x.shape[2:]:
        plane *= d
    return x.shape[1], plane


def _gpu_forward(kernels: Any, x: Array, y: Array, scale: Array, *, size: int, alpha: float,
                 beta: float, shift: float) -> None:
    channels, plane = _channels_plane(x)
    kernels("lrn", "lrn_across_forward", x.dtype)(
        x.size, x, y, scale, channels, plane, size, alpha / _norm(size, False), shift, -beta)


def _gpu_backward(kernels: Any, x: Array, y: Array, scale: Array, dy: Array, dx: Array, *,
                  size: int, alpha: float, beta: float) -> None:
    channels, plane = _channels_plane(x)
    kernels("lrn", "lrn_across_backward", x.dtype)(
        x.size, x, y, scale, dy, dx, channels, plane, size, -beta,
        2.0 * alpha * beta / _norm(size, False))
