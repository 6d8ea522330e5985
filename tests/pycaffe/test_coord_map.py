"""caffe.coord_map: maps of single layers worked out by hand from where a top pixel's window
sits in its bottom, their composition through conv/pool/deconv stacks, and the crops of
FCN-32s/16s/8s on VGG-16 (offsets 19; 5, 27; 5, 9, 31, as in FCN's published prototxts)."""

import numpy as np
import pytest

from purine.errors import PurineError
from purine.pycaffe import NetSpec
from purine.pycaffe import layers as L
from purine.pycaffe import params as P
from purine.pycaffe.coord_map import (
    AxisMismatchException,
    CoordMapError,
    CropError,
    UnconnectedTopsError,
    UndefinedMapException,
    compose,
    conv_params,
    coord_map,
    coord_map_from_to,
    crop,
    crop_params,
    inverse,
)


def data(dims=(1, 3, 64, 64)):
    return L.Input(shape=dict(dim=list(dims)))


def same(m, axis, a, b):
    ax, ma, mb = m
    assert ax == axis
    np.testing.assert_array_equal(np.broadcast_to(ma, np.shape(a)), a)
    np.testing.assert_array_equal(np.broadcast_to(mb, np.shape(b)), b)


# -- one layer ------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, a, b", [
    # top pixel y is centred on bottom pixel y*s - p + (k-1)/2, so y = (x + p - (k-1)/2) / s
    (dict(kernel_size=3), 1.0, -1.0),
    (dict(kernel_size=3, pad=1), 1.0, 0.0),
    (dict(kernel_size=5, stride=2, pad=2), 0.5, 0.0),
    (dict(kernel_size=4, stride=2), 0.5, -0.75),
    (dict(kernel_size=7, stride=2, pad=3), 0.5, 0.0),
    (dict(kernel_size=3, dilation=2), 1.0, -2.0),  # spans 5 pixels
    (dict(kernel_size=3, dilation=4, pad=4), 1.0, 0.0),  # DeepLab's atrous 3x3
    (dict(kernel_size=11, stride=4), 0.25, -1.25),  # AlexNet's conv1
])
def test_convolution_map(kw, a, b):
    top = L.Convolution(data(), num_output=8, **kw)
    same(coord_map(top.fn), 1, [a], [b])


def test_pooling_map_and_its_dict_form():
    # ResNet's 3x3/2 pad 1 pool: y = (x + 1 - 1) / 2
    top = L.Pooling(data(), pool=P.Pooling.MAX, kernel_size=3, stride=2, pad=1)
    same(coord_map(top.fn), 1, [0.5], [0.0])
    top = L.Pooling(data(), pooling_param=dict(pool=P.Pooling.AVE, kernel_size=2, stride=2))
    same(coord_map(top.fn), 1, [0.5], [-0.25])
    assert coord_map(L.Pooling(data(), kernel_size=2).fn)[1:] == (1.0, -0.5)  # stride 1


def test_deconvolution_map_is_the_inverse_of_the_convolution():
    # deconv: y = s*x - p + (k-1)/2
    up = L.Deconvolution(data(), convolution_param=dict(num_output=2, kernel_size=64,
                                                        stride=32, bias_term=False))
    same(coord_map(up.fn), 1, [32], [31.5])
    up = L.Deconvolution(data(), convolution_param=dict(num_output=2, kernel_size=4, stride=2,
                                                        pad=1))
    same(coord_map(up.fn), 1, [2], [0.5])
    conv = L.Convolution(data(), num_output=2, kernel_size=4, stride=2, pad=1)
    same(compose(coord_map(conv.fn), coord_map(up.fn)), 1, [1.0], [0.0])


def test_per_axis_and_legacy_fields():
    top = L.Convolution(data(), num_output=2, kernel_size=[3, 5], stride=[1, 2], pad=[0, 2])
    same(coord_map(top.fn), 1, [1.0, 0.5], [-1.0, 0.0])
    legacy = L.Convolution(data(), num_output=2, kernel_h=3, kernel_w=5, stride_h=1,
                           stride_w=2, pad_w=2)
    same(coord_map(legacy.fn), 1, [1.0, 0.5], [-1.0, 0.0])
    axis, stride, extent, pad = conv_params(legacy.fn)
    assert axis == 1 and list(stride) == [1, 2] and list(extent) == [3, 5] and list(pad) == [0, 2]
    deep = L.Convolution(data((1, 3, 8, 8, 8)), num_output=2, kernel_size=3, pad=[0, 1, 2])
    same(coord_map(deep.fn), 1, [1.0, 1.0, 1.0], [-1.0, 0.0, 1.0])


def test_axis_and_im2col():
    top = L.Convolution(data(), convolution_param=dict(num_output=2, kernel_size=3, axis=2))
    assert coord_map(top.fn)[0] == 2
    cols = L.Im2col(data(), convolution_param=dict(kernel_size=2, stride=2))
    same(coord_map(cols.fn), 1, [0.5], [-0.25])


def test_crop_and_pass_through_maps():
    a, b = data(), data((1, 3, 32, 32))
    cut = L.Crop(a, b, crop_param=dict(axis=2, offset=[3, 4]))
    assert crop_params(cut.fn)[0] == 2
    same(coord_map(cut.fn), 1, [1], [-3, -4])
    assert crop_params(L.Crop(a, b).fn)[0] == 2  # Caffe's default axis
    for kind in ("ReLU", "Dropout", "BatchNorm", "Scale", "Eltwise", "LRN", "Sigmoid"):
        assert coord_map(getattr(L, kind)(a).fn) == (None, 1, 0)


def test_layers_without_a_map():
    for top in (L.InnerProduct(data(), num_output=3), L.Softmax(data()),
                L.Pooling(data(), pool=P.Pooling.AVE, global_pooling=True)):
        with pytest.raises(UndefinedMapException):
            coord_map(top.fn)
    with pytest.raises(CoordMapError, match="Convolution layer 'c': no kernel_size"):
        coord_map(L.Convolution(data(), num_output=2, name="c").fn)


def test_compose_and_inverse():
    # (2x + 3) after (0.5x + 4): 2(0.5x + 4) + 3 = x + 11
    assert compose((1, 2, 3), (1, 0.5, 4)) == (1, 1.0, 11)
    assert compose((None, 1, 0), (2, 3, 1)) == (2, 3, 1)
    assert compose((2, 3, 1), (None, 1, 0)) == (2, 3, 1)
    assert inverse((1, 4, 2)) == (1, 0.25, -0.5)  # y = 4x + 2 -> x = y/4 - 1/2
    with pytest.raises(AxisMismatchException):
        compose((1, 1, 0), (2, 1, 0))
    assert issubclass(AxisMismatchException, PurineError)


# -- through a net -------------------------------------------------------------------------
def test_conv_pool_deconv_stack():
    n = NetSpec()
    n.data = data((1, 1, 100, 100))
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=3)  # c = x - 1
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=2, stride=2)  # p = c/2 - 1/4
    n.up = L.Deconvolution(n.pool, convolution_param=dict(num_output=4, kernel_size=4,
                                                          stride=2))  # u = 2p + 3/2
    # u = c + 1 = x
    same(coord_map_from_to(n.up, n.data), 1, [1.0], [0.0])
    # pool = (x - 1)/2 - 1/4 = x/2 - 3/4, so x = 2*pool + 3/2
    same(coord_map_from_to(n.pool, n.data), 1, [2.0], [1.5])
    same(coord_map_from_to(n.data, n.pool), 1, [0.5], [-0.75])
    n.relu = L.ReLU(n.up)
    same(coord_map_from_to(n.relu, n.up), None, [1], [0])


def test_siblings_meet_at_their_common_input():
    n = NetSpec()
    n.data = data()
    n.a = L.Convolution(n.data, num_output=2, kernel_size=5, stride=2, pad=2)  # a = x/2
    n.b = L.Convolution(n.data, num_output=2, kernel_size=3)  # b = x - 1
    same(coord_map_from_to(n.a, n.b), 1, [2.0], [-1.0])  # b = 2a - 1


def test_two_bottom_convolution_maps_each_top():
    n = NetSpec()
    n.x, n.y = data(), data((1, 3, 20, 20))
    n.cx, n.cy = L.Convolution(n.x, n.y, ntop=2, num_output=2, kernel_size=5, stride=2)
    same(coord_map_from_to(n.cy, n.y), 1, [2.0], [2.0])  # cy = (y - 2)/2


def test_unconnected_tops():
    n = NetSpec()
    n.data = data()
    n.conv = L.Convolution(n.data, num_output=2, kernel_size=3)
    n.ip = L.InnerProduct(n.conv, num_output=2)
    with pytest.raises(UnconnectedTopsError, match="share no input") as e:
        coord_map_from_to(n.ip, n.data)
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, PurineError)


# -- FCN on VGG-16 -------------------------------------------------------------------------
def conv_relu(bottom, nout, pad=1, ks=3):
    conv = L.Convolution(bottom, kernel_size=ks, stride=1, num_output=nout, pad=pad)
    return conv, L.ReLU(conv, in_place=True)


def vgg16_fcn(n):
    """VGG-16 as FCN's net.py writes it: conv1_1 pads by 100, fc6 is a 7x7 convolution."""
    n.data = data((1, 3, 500, 500))
    widths = [(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)]
    bottom = n.data
    for block, (width, depth) in enumerate(widths, start=1):
        for i in range(1, depth + 1):
            pad = 100 if (block, i) == (1, 1) else 1
            n[f"conv{block}_{i}"], n[f"relu{block}_{i}"] = conv_relu(bottom, width, pad=pad)
            bottom = n[f"relu{block}_{i}"]
        n[f"pool{block}"] = L.Pooling(bottom, pool=P.Pooling.MAX, kernel_size=2, stride=2)
        bottom = n[f"pool{block}"]
    n.fc6, n.relu6 = conv_relu(n.pool5, 4096, ks=7, pad=0)
    n.drop6 = L.Dropout(n.relu6, dropout_ratio=0.5, in_place=True)
    n.fc7, n.relu7 = conv_relu(n.drop6, 4096, ks=1, pad=0)
    n.drop7 = L.Dropout(n.relu7, dropout_ratio=0.5, in_place=True)
    n.score_fr = L.Convolution(n.drop7, num_output=21, kernel_size=1, pad=0)


def upsample(bottom, factor):
    return L.Deconvolution(bottom, convolution_param=dict(
        num_output=21, kernel_size=2 * factor, stride=factor, bias_term=False),
        param=[dict(lr_mult=0)])


def offset_of(top):
    return list(top.fn.params["crop_param"]["offset"]), top.fn.params["crop_param"]["axis"]


def test_fcn32s_crop_offset_19():
    # pool5 = (x + 99)/32 - 31/64 (five 2x2/2 pools after the pad-100 conv), fc6 = pool5 - 3,
    # upscore = 32 fc6 + 31.5 = x + 19: the score is upscore cut from pixel 19 on.
    n = NetSpec()
    vgg16_fcn(n)
    n.upscore = upsample(n.score_fr, 32)
    n.score = crop(n.upscore, n.data)
    assert offset_of(n.score) == ([19], 2)
    same(coord_map_from_to(n.upscore, n.data), 1, [1.0], [-19.0])
    text = str(n.to_proto())
    assert "crop_param {\n    axis: 2\n    offset: 19\n  }" in text
    assert 'bottom: "upscore"\n  bottom: "data"\n  top: "score"' in text


def test_fcn16s_and_fcn8s_crop_offsets():
    n = NetSpec()
    vgg16_fcn(n)
    n.upscore2 = upsample(n.score_fr, 2)  # u = 2 fc6 + 1.5 = pool4 - 5
    n.score_pool4 = L.Convolution(n.pool4, num_output=21, kernel_size=1, pad=0)
    n.score_pool4c = crop(n.score_pool4, n.upscore2)
    assert offset_of(n.score_pool4c) == ([5], 2)
    n.fuse_pool4 = L.Eltwise(n.upscore2, n.score_pool4c, operation=P.Eltwise.SUM)
    # FCN-16s: 16 u + 15.5 = x + 27
    n.upscore16 = upsample(n.fuse_pool4, 16)
    assert offset_of(crop(n.upscore16, n.data)) == ([27], 2)
    # FCN-8s: v = 2u + 1.5 = pool3 - 9, then 8 v + 7.5 = x + 31
    n.upscore_pool4 = upsample(n.fuse_pool4, 2)
    n.score_pool3 = L.Convolution(n.pool3, num_output=21, kernel_size=1, pad=0)
    n.score_pool3c = crop(n.score_pool3, n.upscore_pool4)
    assert offset_of(n.score_pool3c) == ([9], 2)
    n.fuse_pool3 = L.Eltwise(n.upscore_pool4, n.score_pool3c, operation=P.Eltwise.SUM)
    n.upscore8 = upsample(n.fuse_pool3, 8)
    n.score = crop(n.upscore8, n.data)
    assert offset_of(n.score) == ([31], 2)
    # The walk through a Crop layer follows its first bottom only: pool3c = pool3 - 9.
    same(coord_map_from_to(n.score_pool3c, n.pool3), 1, [1.0], [9.0])


def test_crop_of_a_crop_adds_the_offsets():
    n = NetSpec()
    n.data = data()
    n.big = L.Deconvolution(n.data, convolution_param=dict(num_output=3, kernel_size=7))
    n.cut = L.Crop(n.big, n.data, crop_param=dict(axis=2, offset=2))  # big = x + 3, cut = x + 1
    same(coord_map_from_to(n.cut, n.data), 1, [1], [-1])
    assert offset_of(crop(n.cut, n.data)) == ([1], 2)


def test_crop_refusals():
    n = NetSpec()
    n.data = data()
    n.pool = L.Pooling(n.data, kernel_size=3, stride=3)
    n.up = upsample(n.pool, 2)
    with pytest.raises(CropError, match="differ in scale"):  # 2/3 of data's scale
        crop(n.up, n.data)
    n.small = L.Convolution(n.data, num_output=2, kernel_size=5)  # small = x - 2: too small
    with pytest.raises(CropError, match="b <= 0") as e:
        crop(n.small, n.data)
    assert isinstance(e.value, AssertionError) and isinstance(e.value, PurineError)
    n.half = L.Convolution(n.data, num_output=2, kernel_size=2, pad=1)  # half = x + 0.5
    with pytest.raises(CropError, match="whole number"):
        crop(n.half, n.data)


def test_crop_through_pass_through_layers_only():
    n = NetSpec()
    n.data = data()
    n.relu = L.ReLU(n.data)
    assert offset_of(crop(n.relu, n.data)) == ([0], 2)


def test_stride_three_maps_back_to_whole_pixels():
    # Floating thirds: 3 * (1/3) and the shifts must still count as scale 1, offset 1.
    n = NetSpec()
    n.data = data()
    n.pool = L.Pooling(n.data, kernel_size=3, stride=3)  # p = (x - 1)/3
    n.up = upsample(n.pool, 3)  # u = 3p + 2.5 = x + 1.5
    n.up2 = L.Deconvolution(n.pool, convolution_param=dict(num_output=2, kernel_size=5,
                                                           stride=3))  # 3p + 2 = x + 1
    assert offset_of(crop(n.up2, n.data)) == ([1], 2)
    with pytest.raises(CropError, match="whole number"):
        crop(n.up, n.data)
