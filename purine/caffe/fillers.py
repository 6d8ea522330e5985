"""Caffe's weight fillers: constant, uniform, gaussian (with sparse), xavier, msra,
positive_unitball, bilinear; fan-in = count / shape[0], fan-out = count / shape[1]."""

from __future__ import annotations

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


def fill(p: pb.FillerParameter, shape: tuple[int, ...], rng: np.random.Generator,
         owner: str = "") -> np.ndarray:
    """A float32 array of ``shape`` filled as Caffe's filler ``p`` fills it."""
    check_filler(p, shape, owner)
    kind = p.type
    if math.prod(shape) == 0:  # nothing to draw (the fan-scaled fillers would divide by 0)
        return np.zeros(shape, dtype=np.float32)
    if kind == "constant":
        out = np.full(shape, p.value, dtype=np.float64)
    elif kind == "uniform":
        out = rng.uniform(p.min, p.max, shape)
    elif kind == "gaussian":
        out = rng.normal(p.mean, p.std or 0.0, shape)  # -0.0: numpy refuses its sign
        if p.sparse >= 0:
            keep = rng.random(shape) < p.sparse / shape[0]
            out *= keep
    elif kind == "xavier":
        scale = math.sqrt(3.0 / _n(p, shape))
        out = rng.uniform(-scale, scale, shape)
    elif kind == "msra":
        out = rng.normal(0.0, math.sqrt(2.0 / _n(p, shape)), shape)
    elif kind == "positive_unitball":
        out = rng.uniform(0.0, 1.0, shape)
        flat = out.reshape(shape[0], -1)
        flat /= flat.sum(axis=1, keepdims=True)
    elif kind == "bilinear":
        k = shape[3]
        f = math.ceil(k / 2.0)
        c = (2 * f - 1 - f % 2) / (2.0 * f)
        axis = 1 - np.abs(np.arange(k) / f - c)
        out = np.broadcast_to(np.outer(axis, axis), shape)
    else:
        raise AssertionError(kind)  # check_filler knows every type
    return np.ascontiguousarray(out, dtype=np.float32)
