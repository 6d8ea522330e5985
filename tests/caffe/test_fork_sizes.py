"""The forks' layers and Tile at empty and huge sizes (issue 28): an empty axis runs as the
fork runs it (empty tops, zero gradients, all-empty bins give 0), and a kernel workspace that
cannot fit (Interp's matrices, ROIPooling's bins) is refused in one line naming the layer."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator

import numpy as np
import pytest

from purine.caffe import TRAIN, Net
from purine.errors import LayerError
from tests.gradcheck import layer_net

BIG = 2 ** 31 - 1


pytestmark = pytest.mark.usefixtures("quiet_log")


def run(layer: str, bottoms: dict, dtype: str = "float64", **values: np.ndarray) -> Net:
    """The net of ``layer``, forward (bottoms ``values`` where given) and backward with the
    top's gradient 1 and every parameter's gradient set to 3 first."""
    net = Net(layer_net(layer, bottoms), phase=TRAIN, dtype=dtype)
    for name, v in values.items():
        net.blobs[name].data[...] = v
    net.forward()
    for params in net.params.values():
        for p in params:
            p.diff[...] = 3.0
    net.blobs["y"].diff[...] = 1.0
    net.backward()
    return net


@contextlib.contextmanager
def headroom(nbytes: int) -> Iterator[None]:
    """The process may map ``nbytes`` more (RLIMIT_AS): a refusal that holds on any host."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        cap = int(f.read().split()[0]) * resource.getpagesize() + nbytes
    resource.setrlimit(resource.RLIMIT_AS, (cap if soft == resource.RLIM_INFINITY
                                            else min(cap, soft), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def refused(layer: str, bottoms: dict) -> str:
    with headroom(1 << 30), pytest.raises(LayerError) as e:
        Net(layer_net(layer, bottoms), phase=TRAIN, dtype="float64")
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# -- Normalize ------------------------------------------------------------------------------
NORM = 'name: "n" type: "Normalize" bottom: "x" top: "y" norm_param { across_spatial: false '


def test_normalize_over_no_sample_and_no_channel():
    net = run(NORM + "channel_shared: false }", {"x": (0, 0, 1, 1)})
    assert net.blobs["y"].data.shape == (0, 0, 1, 1)
    assert net.params["n"][0].diff.shape == (0,)
    net = run(NORM + "channel_shared: false }", {"x": (0, 3, 2, 2)})
    np.testing.assert_array_equal(net.params["n"][0].diff, [0.0, 0.0, 0.0])  # no sample


def test_normalize_shared_scale_over_2_31_channels_of_no_sample():
    net = run(NORM + "}", {"x": (0, BIG, 0, 0)})  # channel_shared by default: one scale
    assert net.blobs["y"].data.shape == (0, BIG, 0, 0)
    np.testing.assert_array_equal(net.params["n"][0].diff, 0.0)


def test_normalize_values_unchanged():
    # (3, 4) / 5 per position, scale 1; the shared scale's gradient is sum(xhat) = 1.4
    x = np.array([3.0, 4.0]).reshape(1, 2, 1, 1)
    net = run(NORM + "channel_shared: true }", {"x": (1, 2, 1, 1)}, x=x)
    np.testing.assert_allclose(net.blobs["y"].data.ravel(), [0.6, 0.8], rtol=1e-9)
    np.testing.assert_allclose(net.params["n"][0].diff, 1.4, rtol=1e-9)


# -- ShuffleChannel, Upsample, Interp, Tile -------------------------------------------------
def test_shuffle_channel_of_no_channel():
    layer = 'name: "s" type: "ShuffleChannel" bottom: "x" top: "y" shuffle_channel_param ' \
            '{ group: 1 }'
    net = run(layer, {"x": (2, 0, 3, 3)})
    assert net.blobs["y"].data.shape == net.blobs["x"].diff.shape == (2, 0, 3, 3)
    # still the shuffle for a real case: channels 0 1 2 3 in 2 groups read 0 2 1 3
    x = np.arange(4.0).reshape(1, 4, 1, 1)
    net = run(layer.replace("group: 1", "group: 2"), {"x": (1, 4, 1, 1)}, x=x)
    np.testing.assert_array_equal(net.blobs["y"].data.ravel(), [0, 2, 1, 3])


def test_nearest_upsample_of_an_empty_blob_by_2_30():
    net = run('name: "u" type: "Upsample" bottom: "x" top: "y" upsample_param '
              '{ scale: 1073741824 }', {"x": (0, 0, 0, 2 ** 30)}, "float32")
    assert net.blobs["y"].data.shape == (0, 0, 0, 2 ** 60)


def test_masked_upsample_of_an_empty_map_gives_zeros():
    layer = ('name: "u" type: "Upsample" bottom: "x" bottom: "m" top: "y" upsample_param '
             '{ upsample_h: 2 upsample_w: 3 }')
    net = run(layer, {"x": (1, 2, 0, 0), "m": (1, 2, 0, 0)})
    np.testing.assert_array_equal(net.blobs["y"].data, np.zeros((1, 2, 2, 3)))
    net = run(layer, {"x": (0, 2, 1, 1), "m": (0, 2, 1, 1)})
    assert net.blobs["y"].data.shape == (0, 2, 2, 3)


def test_interp_of_an_empty_batch_builds_no_matrix_and_a_real_one_is_checked():
    layer = 'name: "i" type: "Interp" bottom: "x" top: "y" interp_param { zoom_factor: 4097 }'
    net = run(layer, {"x": (0, 0, 4097, 1)})
    assert net.blobs["y"].data.shape == (0, 0, 4097 + 4096 * 4096, 1)
    # one plane: a 128 MiB top, but a 16781313 x 4097 matrix of 512 GiB in float64
    msg = refused(layer, {"x": (1, 1, 4097, 1)})
    assert msg.startswith("layer 'i' (type Interp): Interp's 4097x1 -> 16781313x1 matrices "
                          "and products asks for "), msg


def test_tile_of_empty_blobs_past_2_63_bytes():
    net = run('name: "t" type: "Tile" bottom: "x" top: "y" tile_param { axis: 1 '
              f'tiles: {BIG} }}', {"x": (BIG, 0, 0)})
    assert net.blobs["y"].data.shape == (BIG, 0, 0)
    net = run('name: "t" type: "Tile" bottom: "x" top: "y" tile_param { axis: -1 tiles: 2 }',
              {"x": (BIG, 2 ** 30, 0)}, "float32")
    assert net.blobs["x"].diff.shape == (BIG, 2 ** 30, 0)


# -- ROIPooling, PSROIPooling, PriorBox -----------------------------------------------------
ROI = ('name: "r" type: "ROIPooling" bottom: "x" bottom: "rois" top: "y" roi_pooling_param '
       '{ pooled_h: 1 pooled_w: %d spatial_scale: 0.5 }')


def test_roi_pooling_of_an_empty_map_gives_empty_bins():
    rois = np.array([[0.0, 0, 0, 4, 4]])
    net = run(ROI % 2, {"x": (1, 2, 0, 0), "rois": (1, 5)}, rois=rois)
    np.testing.assert_array_equal(net.blobs["y"].data, np.zeros((1, 2, 1, 2)))
    assert net.blobs["x"].diff.shape == (1, 2, 0, 0)


def test_roi_pooling_of_no_roi_sizes_no_bin_and_real_bins_are_checked():
    net = run(ROI % BIG, {"x": (0, 0, 0, 0), "rois": (0, 5)})
    assert net.blobs["y"].data.shape == (0, 0, 1, BIG)
    # one ROI of 2^24 bins: a 128 MiB top, but 48 (1 + 2^24 + 2) bytes of bin bounds and
    # 2^24 (32 + 7 * 8 + 8) of maxima, argmax and compared values: 2.25 GiB
    msg = refused(ROI % 2 ** 24, {"x": (1, 1, 2, 2), "rois": (1, 5)})
    assert msg.startswith("layer 'r' (type ROIPooling): ROIPooling's bins (1 ROIs of "
                          "1x16777216, 1 channels) asks for 2.3 GiB; "), msg


def test_psroi_pooling_of_empty_maps():
    layer = ('name: "p" type: "PSROIPooling" bottom: "x" bottom: "rois" top: "y" '
             'psroi_pooling_param { spatial_scale: 0.5 output_dim: %d group_size: %d }')
    net = run(layer % (2 ** 31 - 2, 1), {"x": (1, 2 ** 31 - 2, 0, 0), "rois": (0, 5)})
    assert net.blobs["y"].data.shape == (0, 2 ** 31 - 2, 1, 1)
    rois = np.array([[0.0, 0, 0, 4, 4]])
    net = run(layer % (1, 2), {"x": (1, 4, 0, 0), "rois": (1, 5)}, rois=rois)
    np.testing.assert_array_equal(net.blobs["y"].data, np.zeros((1, 1, 2, 2)))


PRIOR = ('name: "pb" type: "PriorBox" bottom: "x" bottom: "img" top: "y" prior_box_param '
         '{ min_size: 1 aspect_ratio: 2 flip: true }')


def test_prior_box_of_a_map_of_no_cell_and_of_an_image_of_no_pixel():
    net = Net(layer_net(PRIOR, {"x": (0, 0, 0, 0), "img": (0, 0, 0, 0)}), phase=TRAIN)
    net.forward()
    assert net.blobs["y"].data.shape == (1, 2, 0)
    msg = refused(PRIOR, {"x": (1, 1, 2, 2), "img": (1, 3, 0, 4)})
    assert msg == ("layer 'pb' (type PriorBox): image bottom 'img' (1, 3, 0, 4) has no "
                   "pixels; the priors of the 2 x 2 map are divided by its height and width")
