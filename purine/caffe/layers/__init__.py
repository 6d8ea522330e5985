"""Layer builders, one per Caffe type string, grouped by family; importing this package
registers them all."""

from purine.caffe.layers import array, common, loss, neuron, normalization, vision  # noqa: F401
