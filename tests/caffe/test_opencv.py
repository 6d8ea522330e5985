"""Forward outputs against an independent implementation: OpenCV's Caffe importer
(cv2.dnn.readNetFromCaffe, OpenCV 4.x) runs the same prototxt with the weights we write."""

import numpy as np
import pytest

from purine.caffe import TEST, Net

cv2 = pytest.importorskip("cv2", reason="opencv-python-headless<5 is in the test extra")
if not hasattr(cv2, "dnn") or not hasattr(cv2.dnn, "readNetFromCaffe"):
    pytest.skip("this OpenCV has no Caffe importer (OpenCV 5 removed it; the test extra "
                "pins opencv-python-headless<5)", allow_module_level=True)

HEAD = 'name: "x"\nlayer { name: "data" type: "Input" top: "data" ' \
       'input_param { shape { dim: 2 dim: 3 dim: 13 dim: 11 } } }\n'
GAUSS = 'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.3 }'

# OpenCV's importer ignores LRN's `k` (it always uses 1), so LRN here keeps the default k;
# k != 1 is checked against hand-computed values in test_vision_layers.py.
CASES = {
    "conv_group_dilation": f"""
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 6 kernel_h: 3 kernel_w: 2 pad_h: 1 pad_w: 2 stride_h: 2
    stride_w: 1 dilation: 2 group: 3 {GAUSS} }} }}""",
    "conv_pool_lrn_ip": f"""
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 8 kernel_size: 3 pad: 1 {GAUSS} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param {{ pool: MAX kernel_size: 3 stride: 2 }} }}
layer {{ name: "norm1" type: "LRN" bottom: "pool1" top: "norm1"
  lrn_param {{ local_size: 5 alpha: 0.1 beta: 0.75 }} }}
layer {{ name: "pool2" type: "Pooling" bottom: "norm1" top: "pool2"
  pooling_param {{ pool: AVE kernel_size: 3 stride: 2 pad: 1 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip"
  inner_product_param {{ num_output: 7 {GAUSS} }} }}
layer {{ name: "prob" type: "Softmax" bottom: "ip" top: "prob" }}""",
    "lrn_within_channel": """
layer { name: "norm" type: "LRN" bottom: "data" top: "norm"
  lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL } }""",
    "batchnorm_scale_deconv": f"""
layer {{ name: "bn" type: "BatchNorm" bottom: "data" top: "bn" }}
layer {{ name: "scale" type: "Scale" bottom: "bn" top: "bn" scale_param {{ bias_term: true
  filler {{ type: "gaussian" std: 1 }} bias_filler {{ type: "gaussian" std: 1 }} }} }}
layer {{ name: "up" type: "Deconvolution" bottom: "bn" top: "up"
  convolution_param {{ num_output: 4 kernel_size: 4 stride: 2 pad: 1 {GAUSS} }} }}
layer {{ name: "pool" type: "Pooling" bottom: "up" top: "pool"
  pooling_param {{ pool: MAX global_pooling: true }} }}""",
    "eltwise_concat": f"""
layer {{ name: "a" type: "Convolution" bottom: "data" top: "a"
  convolution_param {{ num_output: 4 kernel_size: 1 {GAUSS} }} }}
layer {{ name: "b" type: "Convolution" bottom: "data" top: "b"
  convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 {GAUSS} }} }}
layer {{ name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "sum"
  eltwise_param {{ operation: SUM coeff: 0.5 coeff: -2 }} }}
layer {{ name: "cat" type: "Concat" bottom: "sum" bottom: "a" top: "cat" }}
layer {{ name: "sig" type: "Sigmoid" bottom: "cat" top: "sig" }}""",
}


def randomize_batchnorm(net: Net) -> None:
    rng = np.random.default_rng(7)
    for name, views in net.params.items():
        if net.layer_types[net.layer_names.index(name)] == "BatchNorm":
            c = views[0].shape[0]
            views[0].data[...] = rng.standard_normal(c) * 2
            views[1].data[...] = rng.uniform(0.5, 3, c) * 2
            views[2].data[...] = 2.0


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_opencv(tmp_path, case):
    proto = HEAD + CASES[case]
    path = tmp_path / "net.prototxt"
    path.write_text(proto)
    net = Net(str(path), phase=TEST, seed=11)
    randomize_batchnorm(net)
    weights = tmp_path / "net.caffemodel"
    net.save(weights)
    x = np.random.default_rng(3).standard_normal((2, 3, 13, 11)).astype(np.float32)
    ours = net.forward(data=x)
    cv = cv2.dnn.readNetFromCaffe(str(path), str(weights))
    cv.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    cv.setInput(x)
    for name, value in ours.items():
        theirs = cv.forward(name)
        assert theirs.shape == value.shape, name
        scale = np.abs(theirs).max()
        np.testing.assert_allclose(value, theirs, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
