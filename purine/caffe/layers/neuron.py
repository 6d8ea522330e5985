"""Builders of Caffe's neuron layers: elementwise, shape-preserving, usable in place."""

from __future__ import annotations

from purine.caffe.layer import LayerBuild, register
from purine.ops import activation as act


@register("ReLU")
def relu(L: LayerBuild):
    L.expect(1, 1)
    slope = L.param.relu_param.negative_slope
    x = L.bottom(0)
    y = L.top(0, x.shape)
    L.forward(act.relu_forward, [x], [y], negative_slope=slope)

    def backward():
        # The top's sign is the bottom's sign, so in-place use needs no saved copy.
        L.backward(act.relu_backward, [y, L.top_diff(0)], [L.bottom_diff(0)],
                   negative_slope=slope)
    return backward
