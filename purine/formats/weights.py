"""Parameter arrays matched to a net's blobs by layer name, as Caffe's CopyTrainedLayersFrom
matches them: one layer's blob count and each blob's shape must agree, and the 4-d shape
(num, channels, height, width) an old caffemodel stores stands for its shape without 1s."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from purine.errors import PurineError


def legacy_shape_match(have: Sequence[int], want: Sequence[int]) -> bool:
    """Whether ``have`` and ``want`` agree once every axis of size 1 is dropped: old
    caffemodels pad every blob to 4-d, an InnerProduct weight (N, K) to (1, 1, N, K)."""
    return [d for d in have if d != 1] == [d for d in want if d != 1]


def fit_shape(a: np.ndarray, want: Sequence[int]) -> np.ndarray | None:
    """``a`` in shape ``want``: itself when the shapes are equal, reshaped when its shape is
    the legacy 4-d form of ``want``; None when it does not fit."""
    want = tuple(want)
    if a.shape == want:
        return a
    return a.reshape(want) if legacy_shape_match(a.shape, want) else None


def layer_arrays(name: str, arrays: Sequence[np.ndarray], want: Sequence[Sequence[int]], *,
                 source: str, where: str = "", legacy: bool = True) -> list[np.ndarray]:
    """The parameter arrays of layer ``name`` that ``source`` (words such as "in the file")
    holds, checked against the shapes the net expects; with ``legacy`` an old 4-d shape is
    reshaped. A count or shape that differs raises PurineError prefixed with ``where``."""
    if len(arrays) != len(want):
        raise PurineError(f"{where}layer '{name}' has {len(arrays)} parameter blobs {source}, "
                          f"the net expects {len(want)}")
    out = []
    for k, (a, shape) in enumerate(zip(arrays, want)):
        fit = fit_shape(a, shape) if legacy else (a if a.shape == tuple(shape) else None)
        if fit is None:
            raise PurineError(f"{where}layer '{name}' parameter {k} has shape {a.shape} "
                              f"{source}, the net expects {tuple(shape)}")
        out.append(fit)
    return out
