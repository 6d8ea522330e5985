"""Weights by layer name (purine.formats.weights): the legacy 4-d shape rule and the count and
shape checks that Net.copy_from, Net.share_with, SplitNet.load and caffemodel_npz share."""

import numpy as np
import pytest

from purine.errors import PurineError
from purine.formats.weights import fit_shape, layer_arrays, legacy_shape_match


@pytest.mark.parametrize("have, want, ok", [
    ((1, 1, 3, 4), (3, 4), True),      # an old InnerProduct weight
    ((1, 1, 1, 5), (5,), True),        # an old bias
    ((3, 4), (3, 4), True),
    ((1, 1, 4, 3), (3, 4), False),     # same count, axes swapped
    ((1, 1, 3, 4), (3, 2, 2), False),  # same count, other axes
])
def test_legacy_shape_match(have, want, ok):
    assert legacy_shape_match(have, want) is ok
    a = np.arange(float(np.prod(have))).reshape(have)
    fit = fit_shape(a, want)
    if ok:
        assert fit.shape == want and np.array_equal(fit.ravel(), a.ravel())
    else:
        assert fit is None


def test_an_equal_shape_is_the_same_array():
    a = np.zeros((2, 3), np.float32)
    assert fit_shape(a, (2, 3)) is a
    assert layer_arrays("ip", [a], [(2, 3)], source="in the file", legacy=False)[0] is a


def test_a_count_mismatch_names_the_layer_and_both_counts():
    with pytest.raises(PurineError, match=r"^m\.caffemodel: layer 'ip' has 1 parameter blobs "
                                          r"in the file, the net expects 2$"):
        layer_arrays("ip", [np.zeros(3)], [(3,), (1,)], source="in the file",
                     where="m.caffemodel: ")


def test_a_shape_mismatch_names_the_parameter_and_both_shapes():
    w = np.zeros((1, 1, 3, 4))
    assert layer_arrays("ip", [w], [(3, 4)], source="in the weights")[0].shape == (3, 4)
    with pytest.raises(PurineError, match=r"^layer 'ip' parameter 0 has shape \(1, 1, 3, 4\) "
                                          r"in net 'a', the net expects \(3, 4\)$"):
        layer_arrays("ip", [w], [(3, 4)], source="in net 'a'", legacy=False)
    with pytest.raises(PurineError, match=r"parameter 1 has shape \(4,\) in the weights, the "
                                          r"net expects \(3,\)"):
        layer_arrays("ip", [w, np.zeros(4)], [(3, 4), (3,)], source="in the weights")
