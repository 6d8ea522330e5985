"""Caffe's weight fillers: constant, uniform, gaussian (with sparse), xavier, msra,
positive_unitball, bilinear; fan-in = count / shape[0], fan-out = count / shape[1]. They
draw in float64 chunks straight into the parameter's own array, whatever its dtype."""

from __future__ import annotations

import functools
import math

import numpy as np

from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb

_NORM = pb.FillerParameter


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    count = math.prod(shape)
    fan_in = count // shape[0] if shape else 1
    fan_out = count // shape[1] if len(shape) > 1 else count
    return fan_in, fan_out


def _n(p: pb.FillerParameter, shape: tuple[int, ...]) -> float:
    fan_in, fan_out = _fans(shape)
    if p.variance_norm == _NORM.FAN_OUT:
        return fan_out
    if p.variance_norm == _NORM.AVERAGE:
        return (fan_in + fan_out) / 2.0
    return fan_in


FILLERS = ("constant", "uniform", "gaussian", "xavier", "msra", "positive_unitball",
           "bilinear")


def check_filler(p: pb.FillerParameter, shape: tuple[int, ...], owner: str = "") -> None:
    """Refuse a filler ``fill`` could not draw for ``shape`` (Caffe's GetFiller and the
    fillers' own checks), so a layer that draws at every forward is refused when built."""
    kind = p.type
    if kind not in FILLERS:
        raise PurineError(f"{owner}: unknown filler type '{kind}'; expected constant, uniform, "
                          "gaussian, xavier, msra, positive_unitball or bilinear")
    bad = ((kind == "uniform" and not (math.isfinite(p.min) and math.isfinite(p.max)
                                       and p.min <= p.max))
           or (kind == "gaussian" and not (math.isfinite(p.std) and p.std >= 0)))
    if bad:
        raise PurineError(f"{owner}: {kind} filler with min {p.min:g}, max {p.max:g}, "
                          f"std {p.std:g}: expected finite values, min <= max, std >= 0")
    if kind == "gaussian" and p.sparse >= 0 and len(shape) < 2:
        raise PurineError(f"{owner}: sparse gaussian filler needs a blob of 2+ axes")
    if kind == "bilinear" and (len(shape) != 4 or shape[2] != shape[3]):
        raise PurineError(f"{owner}: bilinear filler needs a 4-d blob with square "
                          f"kernels, got shape {shape}")


FILL_CHUNK = 1 << 20
"""Values drawn at a time: a filler's float64 temporaries stay a few MiB however large the
parameter (NumPy's generators give the same stream drawn in pieces as drawn at once)."""


def _chunk(p: pb.FillerParameter, shape: tuple[int, ...]) -> int:
    """Values per draw: positive_unitball normalizes whole rows (shape[0] of them)."""
    count = math.prod(shape)
    n = min(count, FILL_CHUNK)
    if p.type == "positive_unitball" and count:
        row = count // shape[0]
        n = max(row, n // row * row)
    return n


def fill_scratch_bytes(p: pb.FillerParameter, shape: tuple[int, ...]) -> int:
    """The most bytes ``fill_into`` holds besides the array it fills: a chunk drawn in
    float64, its float32 rounding and, for a sparse gaussian, the mask's draws."""
    return 24 * _chunk(p, shape)


FILL_SLACK = fill_scratch_bytes(pb.FillerParameter(), (FILL_CHUNK,))
"""The scratch of one full chunk (24 MiB): the most any filler holds, but for
positive_unitball's rows longer than a chunk. Like the interpreter's own memory it is left
out of the memory check; only what goes past it is counted."""


def fill_into(p: pb.FillerParameter, out: np.ndarray, rng: np.random.Generator,
              owner: str = "") -> None:
    """Fill the contiguous host array ``out`` as Caffe's filler ``p`` fills a blob of its
    shape: values drawn in float64 and rounded to float32 (Caffe's default Dtype), then
    stored in ``out``'s dtype, chunk by chunk (see FILL_CHUNK)."""
    shape = tuple(out.shape)
    check_filler(p, shape, owner)
    flat = out.reshape(-1)  # a view: ``out`` is contiguous
    kind, count = p.type, flat.size
    if count == 0:  # nothing to draw (the fan-scaled fillers would divide by 0)
        return
    if kind == "constant":
        flat[...] = np.float32(p.value)
        return
    if kind == "bilinear":
        k = shape[3]
        f = math.ceil(k / 2.0)
        c = (2 * f - 1 - f % 2) / (2.0 * f)
        axis = 1 - np.abs(np.arange(k) / f - c)
        flat.reshape(-1, k * k)[...] = np.outer(axis, axis).reshape(-1).astype(np.float32)
        return
    if kind == "uniform":
        draw = functools.partial(rng.uniform, p.min, p.max)
    elif kind == "gaussian":
        draw = functools.partial(rng.normal, p.mean, p.std or 0.0)  # -0.0: numpy refuses
    elif kind == "xavier":
        scale = math.sqrt(3.0 / _n(p, shape))
        draw = functools.partial(rng.uniform, -scale, scale)
    elif kind == "msra":
        draw = functools.partial(rng.normal, 0.0, math.sqrt(2.0 / _n(p, shape)))
    elif kind == "positive_unitball":
        draw = functools.partial(rng.uniform, 0.0, 1.0)
    else:
        raise AssertionError(kind)  # check_filler knows every type
    step = _chunk(p, shape)
    for start in range(0, count, step):
        values = draw(min(step, count - start))
        if kind == "positive_unitball":  # each row sums to one
            rows = values.reshape(-1, count // shape[0])
            rows /= rows.sum(axis=1, keepdims=True)
        flat[start:start + values.size] = values.astype(np.float32)
    if kind == "gaussian" and p.sparse >= 0:
        # The mask's draws follow all the values', as in one array-wide draw of each.
        keep = p.sparse / shape[0]
        for start in range(0, count, step):
            n = min(step, count - start)
            flat[start:start + n] *= rng.random(n) < keep


def fill(p: pb.FillerParameter, shape: tuple[int, ...], rng: np.random.Generator,
         owner: str = "") -> np.ndarray:
    """A float32 array of ``shape`` filled as Caffe's filler ``p`` fills it."""
    out = np.zeros(shape, dtype=np.float32)
    fill_into(p, out, rng, owner)
    return out
