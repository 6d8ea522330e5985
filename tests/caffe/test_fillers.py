"""Fillers against Caffe's definitions: exact values where they are deterministic, moments
where they are random."""

import math

import numpy as np
import pytest

from purine.caffe.fillers import fill
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb


def F(**kw) -> pb.FillerParameter:
    return pb.FillerParameter(**kw)


def rng():
    return np.random.default_rng(0)


def test_constant_is_the_default():
    assert np.array_equal(fill(pb.FillerParameter(), (2, 3), rng()), np.zeros((2, 3)))
    assert np.all(fill(F(type="constant", value=0.25), (4,), rng()) == np.float32(0.25))


def test_uniform_range_and_gaussian_moments():
    u = fill(F(type="uniform", min=-2, max=3), (200, 500), rng())
    assert u.min() >= -2 and u.max() <= 3 and abs(u.mean() - 0.5) < 0.02
    g = fill(F(type="gaussian", mean=1.0, std=0.5), (200, 500), rng())
    assert abs(g.mean() - 1.0) < 0.01 and abs(g.std() - 0.5) < 0.01


def test_sparse_gaussian_keeps_sparse_over_num_outputs():
    g = fill(F(type="gaussian", std=1, sparse=5), (20, 10000), rng())
    assert abs(np.mean(g != 0) - 5 / 20) < 0.01


@pytest.mark.parametrize("norm,n", [
    (pb.FillerParameter.FAN_IN, 3 * 5 * 5),
    (pb.FillerParameter.FAN_OUT, 64 * 5 * 5),
    (pb.FillerParameter.AVERAGE, (3 * 5 * 5 + 64 * 5 * 5) / 2),
])
def test_xavier_and_msra_variance_norms(norm, n):
    shape = (64, 3, 5, 5)
    x = fill(F(type="xavier", variance_norm=norm), shape, rng())
    scale = math.sqrt(3.0 / n)
    assert x.max() <= scale and x.min() >= -scale
    assert abs(x.var() - scale ** 2 / 3) < 0.05 * scale ** 2 / 3
    m = fill(F(type="msra", variance_norm=norm), shape, rng())
    assert abs(m.std() - math.sqrt(2.0 / n)) < 0.05 * math.sqrt(2.0 / n)


def test_positive_unitball_rows_sum_to_one():
    x = fill(F(type="positive_unitball"), (4, 2, 3, 3), rng())
    assert np.all(x >= 0) and np.allclose(x.reshape(4, -1).sum(1), 1)


def test_bilinear_matches_hand_computed_kernel():
    # k = 4: f = 2, c = (2*2 - 1 - 0) / 4 = 0.75; axis weights 1 - |i/2 - 0.75|.
    axis = np.array([0.25, 0.75, 0.75, 0.25])
    x = fill(F(type="bilinear"), (2, 1, 4, 4), rng())
    assert np.allclose(x[1, 0], np.outer(axis, axis))
    # k = 3: f = 2, c = (4 - 1 - 0) / 4 = 0.75 -> weights 0.25, 0.75, 0.75.
    assert np.allclose(fill(F(type="bilinear"), (1, 1, 3, 3), rng())[0, 0],
                       np.outer([0.25, 0.75, 0.75], [0.25, 0.75, 0.75]))


def test_unknown_filler_is_named():
    with pytest.raises(PurineError, match="conv1: unknown filler type 'zeros'"):
        fill(F(type="zeros"), (1,), rng(), "conv1")
