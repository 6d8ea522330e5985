"""Layer builders, one per Caffe type string, grouped by family; importing this package
registers them all."""

from purine.caffe.layers import (  # noqa: F401
    array,
    common,
    data,
    forks,
    loss,
    multibox,
    neuron,
    normalization,
    python,
    rcnn,
    recurrent,
    ssd,
    vision,
)
