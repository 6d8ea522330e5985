"""The host LRN kernels run on blocks of whole images spread over the cores
(``purine.ops.lrn``): every element gets the same bits as the whole-batch array code, in place
too, and the blocks cover the batch once, in runs of the size asked for."""

from __future__ import annotations

import numpy as np
import pytest

import purine.backend
from purine.ops import lrn

PARAMS = dict(size=5, alpha=0.3, beta=0.75)


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of two images (60 elements each), and the batch split over two workers (into
    four parts) even though it is small."""
    monkeypatch.setattr(lrn, "BLOCK_ELEMENTS", 130)
    monkeypatch.setattr(purine.backend, "PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(purine.backend, "HOST_WORKERS", 2)


def whole_batch(x: np.ndarray, dy: np.ndarray, within: bool) -> dict[str, np.ndarray]:
    y, scale, dx = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    lrn._forward_arrays(x, y, scale, shift=2.0, within=within, **PARAMS)
    lrn._backward_arrays(x, y, scale, dy, dx, within=within, **PARAMS)
    return {"y": y, "scale": scale, "dx": dx}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("within", [False, True], ids=["across", "within"])
def test_blocks_give_the_whole_batch_bits(small_blocks, dtype, within):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 5, 3, 4)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    want = whole_batch(x, dy, within)
    y, scale, dx = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    lrn.lrn_forward(x, y, scale, shift=2.0, within=within, **PARAMS)
    lrn.lrn_backward(x, y, scale, dy, dx, within=within, **PARAMS)
    for k, got in {"y": y, "scale": scale, "dx": dx}.items():
        np.testing.assert_array_equal(got, want[k], err_msg=k)
    # In place: the top over the bottom, the bottom's gradient over the top's.
    top, dtop = x.copy(), dy.copy()
    lrn.lrn_forward(top, top, scale, shift=2.0, within=within, **PARAMS)
    np.testing.assert_array_equal(top, want["y"])
    lrn.lrn_backward(x, top, scale, dtop, dtop, within=within, **PARAMS)
    np.testing.assert_array_equal(dtop, want["dx"])


def test_blocks_cover_the_batch_once(small_blocks, monkeypatch):
    seen: list[tuple[int, int]] = []

    def record(x, y, scale, **kwargs):
        seen.append((x.shape[0], int(x[0, 0, 0, 0])))

    monkeypatch.setattr(lrn, "_forward_arrays", record)
    x = np.arange(12, dtype=np.float32)[:, None, None, None] * np.ones((12, 5, 3, 4),
                                                                       np.float32)
    lrn.lrn_forward(x, np.empty_like(x), np.empty_like(x), shift=1.0, within=False, **PARAMS)
    images = sorted(i for n, first in seen for i in range(first, first + n))
    assert images == list(range(12))
    # four parts of three images, each in a block of two (130 elements hold two 60-element
    # images) and a block of one
    assert sorted(n for n, _ in seen) == [1] * 4 + [2] * 4

