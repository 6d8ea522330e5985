"""The Caffe forks' published nets (SSD300, MobileNet-SSD, Faster R-CNN ZF, R-FCN ResNet-50,
DeepLab v2), stored byte for byte under tests/fixtures/forks/, and a ShuffleNet stage written
from its paper, run in purine and in OpenCV's Caffe importer with the same seeded random
weights: outputs and a few inner tops agree."""

import re
from pathlib import Path

import numpy as np
import pytest

from purine.caffe import TEST, Net
from purine.errors import PurineError
from purine.ops import detection as det

cv2 = pytest.importorskip("cv2", reason="opencv-python-headless<5 is in the test extra")
if not hasattr(cv2, "dnn") or not hasattr(cv2.dnn, "readNetFromCaffe"):
    pytest.skip("this OpenCV has no Caffe importer (OpenCV 5 removed it; the test extra "
                "pins opencv-python-headless<5)", allow_module_level=True)

FORKS = Path(__file__).resolve().parents[1] / "fixtures" / "forks"
WEIGHTED = ("Convolution", "Deconvolution", "InnerProduct", "ConvolutionDepthwise")


def fixture(name: str) -> str:
    return (FORKS / name).read_text()


# -- weights -----------------------------------------------------------------------------

def he_weights(net: Net, seed: int) -> None:
    """Random weights that keep activations O(1) through a deep net: He-scaled filters,
    small biases, BatchNorm statistics near the identity, Scale gains around 1 (a residual
    branch's last gain 0.3, so sums over 16 blocks do not blow up), Normalize near SSD's 20.
    The detection heads ('bbox' or 'cls_score' in the name) get a twentieth of that, as
    trained ones predict small deltas and unsaturated scores: a delta of 5 passes through
    exp() and turns float32's last bit into tenths of a pixel of a proposal, and scores
    that saturate to exactly 1 tie, so the proposals' order would be the sort's choice."""
    rng = np.random.default_rng(seed)
    for name, views in net.params.items():
        kind = net.layer_types[net.layer_names.index(name)]
        shapes = [v.data.shape for v in views]
        if kind in WEIGHTED:
            gain = 0.05 if "bbox" in name or "cls_score" in name else 1.0
            views[0].data[...] = rng.standard_normal(shapes[0]) * gain * np.sqrt(
                2.0 / np.prod(shapes[0][1:]))
            if len(views) > 1:
                views[1].data[...] = rng.standard_normal(shapes[1]) * 0.1 * gain
        elif kind == "BatchNorm":
            views[0].data[...] = rng.standard_normal(shapes[0]) * 0.1
            views[1].data[...] = rng.uniform(0.5, 2.0, shapes[1])
            views[2].data[...] = 1.0
        elif kind == "Scale":
            gain = 0.3 if name.endswith("branch2c") else 1.0
            views[0].data[...] = rng.uniform(0.5, 1.5, shapes[0]) * gain
            if len(views) > 1:
                views[1].data[...] = rng.standard_normal(shapes[1]) * 0.1
        elif kind == "Normalize":
            views[0].data[...] = rng.uniform(10.0, 30.0, shapes[0])
        else:
            raise AssertionError(f"no random weights for {name} ({kind})")


# -- the two runs and their comparison ---------------------------------------------------

def run_both(tmp_path, text: str, feeds: dict[str, np.ndarray],
             pairs: list[tuple[str, str]]) -> tuple[dict, dict]:
    """Our net and OpenCV's on ``text`` with one caffemodel. ``pairs`` name a blob of ours
    and the OpenCV layer whose output is that blob: OpenCV gives each in-place layer its
    own output, so a top that a ReLU or Dropout rewrites in place is its last writer's."""
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    net = Net(str(path), phase=TEST, seed=5)
    he_weights(net, seed=7)
    weights = tmp_path / "net.caffemodel"
    net.save(weights)
    net.forward(**feeds)
    ours = {blob: net.blobs[blob].data.copy() for blob, _ in pairs}
    cv = cv2.dnn.readNetFromCaffe(str(path), str(weights))
    cv.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    for name, value in feeds.items():
        cv.setInput(value, name)
    outs = cv.forward([layer for _, layer in pairs])
    theirs = {blob: out for (blob, _), out in zip(pairs, outs, strict=True)}
    return ours, theirs


def assert_close(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """1e-4 relative to the blob's largest magnitude."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    scale = max(float(np.abs(want).max()), 1e-30) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale, err_msg=name)


def assert_detections(got: np.ndarray, want: np.ndarray) -> None:
    """DetectionOutput rows as a set; OpenCV pads its top with zero rows to keep_top_k."""
    want = want.reshape(-1, 7)
    want = want[np.abs(want).sum(axis=1) > 0]
    got = got.reshape(-1, 7)
    assert len(got) > 0 and got.shape == want.shape, (got.shape, want.shape)
    got, want = (r[np.lexsort(r.T[::-1])] for r in (got, want))
    assert_close(got, want, "detection_out")


def check(ours: dict, theirs: dict) -> None:
    for blob, value in ours.items():
        if blob == "detection_out":
            assert_detections(value, theirs[blob])
        else:
            assert_close(value, theirs[blob], blob)
            assert np.abs(value).max() > 1e-3, f"{blob} is all but zero: weights too small"


# -- the forms OpenCV runs ---------------------------------------------------------------

def layer_blocks(text: str) -> list[tuple[int, int, str]]:
    """(start, end, text) of each top-level ``layer { ... }`` block, braces counted outside
    comments (py-faster-rcnn's files keep commented-out layers)."""
    blocks, depth, start, pos = [], 0, None, 0
    for line in text.splitlines(keepends=True):
        code = line.split("#", 1)[0]
        if depth == 0 and re.match(r"\s*layer\s*\{", code):
            start = pos
        depth += code.count("{") - code.count("}")
        pos += len(line)
        if start is not None and depth == 0:
            blocks.append((start, pos, text[start:pos]))
            start = None
    return blocks


def replace_layers(text: str, kind: str, new: str) -> str:
    """``text`` with each layer of type ``kind`` replaced by ``new`` ('' drops it)."""
    hits = [b for b in layer_blocks(text)
            if re.search(r"\btype:\s*['\"]" + re.escape(kind) + r"['\"]", b[2])]
    assert hits, f"no {kind} layer"
    for start, end, _ in reversed(hits):
        text = text[:start] + new + text[end:]
    return text


# py-faster-rcnn's proposal layer is Python (rpn.proposal_layer); OpenCV's converted nets
# (opencv_extra's faster_rcnn_zf.prototxt, rfcn_pascal_voc_resnet50.prototxt) run it as the
# Proposal type with the anchors' ratios and scales and the layer's test defaults
# (feat_stride 16, pre 6000, post 300, NMS 0.7, min_size 16: py-faster-rcnn's TEST config).
PROPOSAL = """layer {
  name: "proposal"
  type: "Proposal"
  bottom: "rpn_cls_prob_reshape"
  bottom: "rpn_bbox_pred"
  bottom: "im_info"
  top: "rois"
  proposal_param { ratio: 0.5 ratio: 1.0 ratio: 2.0 scale: 8 scale: 16 scale: 32 }
}
"""


def postprocessing(scores: str, deltas: str, share_location: bool) -> str:
    """OpenCV's post-processing for these nets: per-roi class scores and box deltas as one
    row each, the rois without their batch column, and a DetectionOutput decoding deltas
    against unnormalized rois (variance in the target: plain Faster R-CNN decoding)."""
    return f"""
layer {{ name: "post_scores" type: "Reshape" bottom: "{scores}" top: "post_scores"
  reshape_param {{ shape {{ dim: 1 dim: -1 }} }} }}
layer {{ name: "post_deltas" type: "Reshape" bottom: "{deltas}" top: "post_deltas"
  reshape_param {{ shape {{ dim: 1 dim: -1 }} }} }}
layer {{ name: "post_crop" type: "Slice" bottom: "rois" top: "post_batch" top: "post_boxes"
  slice_param {{ axis: 1 slice_point: 1 }} }}
layer {{ name: "post_priors" type: "Reshape" bottom: "post_boxes" top: "post_priors"
  reshape_param {{ shape {{ dim: 1 dim: 1 dim: -1 }} }} }}
layer {{ name: "detection_out" type: "DetectionOutput"
  bottom: "post_deltas" bottom: "post_scores" bottom: "post_priors" top: "detection_out"
  detection_output_param {{ num_classes: 21 share_location: {str(share_location).lower()}
    background_label_id: 0 nms_param {{ nms_threshold: 0.3 }} code_type: CENTER_SIZE
    keep_top_k: 100 variance_encoded_in_target: true normalized_bbox: false }} }}
"""


def image(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# -- the nets ----------------------------------------------------------------------------

def test_ssd300_vgg16(tmp_path):
    """weiliu89/caffe's SSD300 (VOC0712), whole: 300x300 and batch 1, as published (its
    PriorBox steps 8..300 are fixed to the 300 input)."""
    pairs = [("conv4_3_norm", "conv4_3_norm"), ("fc7", "relu7"), ("conv9_2", "conv9_2_relu"),
             ("mbox_loc", "mbox_loc"), ("mbox_conf_flatten", "mbox_conf_flatten"),
             ("mbox_priorbox", "mbox_priorbox"), ("detection_out", "detection_out")]
    ours, theirs = run_both(tmp_path, fixture("ssd300_vgg16_voc0712_deploy.prototxt"),
                            {"data": image((1, 3, 300, 300))}, pairs)
    check(ours, theirs)


def test_mobilenet_ssd(tmp_path):
    """chuanqi305's MobileNet-SSD (depthwise as grouped Convolution), whole, 300x300."""
    pairs = [("conv1/dw", "conv1/dw/relu"), ("conv13", "conv13/relu"),
             ("conv17_2", "conv17_2/relu"), ("mbox_loc", "mbox_loc"),
             ("mbox_conf_flatten", "mbox_conf_flatten"), ("mbox_priorbox", "mbox_priorbox"),
             ("detection_out", "detection_out")]
    ours, theirs = run_both(tmp_path, fixture("mobilenet_ssd_deploy.prototxt"),
                            {"data": image((1, 3, 300, 300))}, pairs)
    check(ours, theirs)


def test_faster_rcnn_zf(tmp_path):
    """py-faster-rcnn's ZF end2end test net at its 224x224 input, the Python proposal layer
    as OpenCV's Proposal, then OpenCV's post-processing (one DetectionOutput per class box)."""
    text = replace_layers(fixture("faster_rcnn_zf_end2end_test.prototxt"), "Python", PROPOSAL)
    text += postprocessing("cls_prob", "bbox_pred", share_location=False)
    pairs = [("conv5", "relu5"), ("rpn_cls_prob_reshape", "rpn_cls_prob_reshape"),
             ("rpn_bbox_pred", "rpn_bbox_pred"), ("rois", "proposal"),
             ("roi_pool_conv5", "roi_pool_conv5"), ("fc7", "drop7"),
             ("cls_prob", "cls_prob"), ("bbox_pred", "bbox_pred"),
             ("detection_out", "detection_out")]
    feeds = {"data": image((1, 3, 224, 224)),
             "im_info": np.array([[224, 224, 1]], np.float32)}
    ours, theirs = run_both(tmp_path, text, feeds, pairs)
    assert ours["rois"].shape[0] > 50  # enough proposals that the order is a real check
    check(ours, theirs)


def test_rfcn_resnet50(tmp_path):
    """py-R-FCN's ResNet-50 class-agnostic test net at its 224x224 input: the Python
    proposal layer as OpenCV's Proposal, PSROIPooling, then OpenCV's post-processing."""
    text = replace_layers(fixture("rfcn_resnet50_test_agnostic.prototxt"), "Python", PROPOSAL)
    text += """
layer { name: "post_fg" type: "Slice" bottom: "bbox_pred" top: "post_bg" top: "post_fg"
  slice_param { axis: 1 slice_point: 4 } }
""" + postprocessing("cls_prob", "post_fg", share_location=True)
    pairs = [("res2c", "res2c_relu"), ("res4f", "res4f_relu"), ("res5c", "res5c_relu"),
             ("rois", "proposal"), ("psroipooled_cls_rois", "psroipooled_cls_rois"),
             ("psroipooled_loc_rois", "psroipooled_loc_rois"), ("cls_prob", "cls_prob_reshape"),
             ("bbox_pred", "bbox_pred_reshape"), ("detection_out", "detection_out")]
    feeds = {"data": image((1, 3, 224, 224)),
             "im_info": np.array([[224, 224, 1]], np.float32)}
    ours, theirs = run_both(tmp_path, text, feeds, pairs)
    assert ours["rois"].shape[0] > 50
    check(ours, theirs)


def test_deeplab_v2_vgg16_aspp(tmp_path):
    """DeepLab v2's VGG16 ASPP test net (four dilated branches summed, Interp x8). Its
    ImageSegData input becomes an Input of 1x3x129x129 (fully convolutional: the published
    crop is 513) and the MatWrite/Silence sinks that save results to disk are dropped."""
    text = fixture("deeplab_v2_vgg16_aspp_test_val.prototxt")
    text = replace_layers(text, "ImageSegData", 'layer { name: "data" type: "Input" '
                          'top: "data" input_param { shape { dim: 1 dim: 3 dim: 129 '
                          'dim: 129 } } }\n')
    text = replace_layers(replace_layers(text, "MatWrite", ""), "Silence", "")
    pairs = [("pool5", "pool5"), ("fc7_2", "drop7_2"), ("fc8_voc12_4", "fc8_voc12_4"),
             ("fc8_voc12", "fc8_voc12"), ("fc8_interp", "fc8_interp")]
    ours, theirs = run_both(tmp_path, text, {"data": image((1, 3, 129, 129))}, pairs)
    assert ours["fc8_interp"].shape == (1, 21, 129, 129)
    check(ours, theirs)


# -- OpenCV's normalized_bbox: false, which the Faster R-CNN and R-FCN forms use ---------------

def test_pixel_boxes_by_hand():
    """Pixel boxes count both end pixels: a 0..9 box is 10 wide; boxes that share a column
    overlap by one pixel; a CENTER_SIZE prior is one pixel wider and its centre half a pixel
    further than a normalized one."""
    a = np.array([[0, 0, 9, 9]], np.float32)
    b = np.array([[5, 0, 14, 9], [9, 0, 18, 9]], np.float32)
    np.testing.assert_allclose(det.jaccard(a, b, normalized=False), [[50 / 150, 10 / 190]],
                               rtol=1e-6)
    np.testing.assert_allclose(det.jaccard(a, b), [[36 / 126, 0]], rtol=1e-6)
    prior = np.array([[0, 0, 9, 19]], np.float32)  # 10 x 20 pixels, centre (5, 10)
    loc = np.array([[0.1, -0.2, np.log(2), 0]], np.float32)
    got = det.decode_boxes(loc, prior, None, code_type=det.CENTER_SIZE,
                           variance_encoded_in_target=True, normalized=False)
    np.testing.assert_allclose(got, [[-4, -4, 16, 16]], rtol=1e-6, atol=1e-5)


def test_pixel_boxes_refuse_corner_size(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text("""
input: "loc" input_shape { dim: 1 dim: 8 } input: "conf" input_shape { dim: 1 dim: 4 }
input: "prior" input_shape { dim: 1 dim: 1 dim: 8 }
layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior"
  top: "det" detection_output_param { num_classes: 2 code_type: CORNER_SIZE
  variance_encoded_in_target: true normalized_bbox: false } }""")
    with pytest.raises(PurineError, match="normalized_bbox: false takes code_type"):
        Net(str(path), phase=TEST)


# -- ShuffleNet: its published deploy files carry no licence, so the net is written here -----

def shufflenet_stage(groups: int = 3, width: int = 240, units: int = 3) -> str:
    """ShuffleNet 1x (g = 3) up to its first stage, built from the paper's description (Zhang
    et al. 2017, table 1 and figure 2): conv1 3x3/2 (24), max pool 3x3/2, then one stride-2
    unit (group 1x1 conv at a quarter width, channel shuffle, depthwise 3x3/2, group 1x1
    conv; a 3x3/2 average-pooled shortcut concatenated) and stride-1 units (the same with
    a stride-1 depthwise conv and an element-wise sum), as the ports write them: Convolution
    with group, ShuffleChannel, ConvolutionDepthwise, BatchNorm + Scale."""
    out = ['name: "shufflenet_stage2"',
           'layer { name: "data" type: "Input" top: "data" '
           'input_param { shape { dim: 1 dim: 3 dim: 64 dim: 64 } } }']

    def conv(name, bottom, n, k, s=1, group=1, kind="Convolution"):
        g = f" group: {group}" if group > 1 and kind == "Convolution" else ""
        out.append(f'layer {{ name: "{name}" type: "{kind}" bottom: "{bottom}" top: "{name}" '
                   f'convolution_param {{ num_output: {n} kernel_size: {k} stride: {s} '
                   f'pad: {k // 2} bias_term: false{g} }} }}')
        out.append(f'layer {{ name: "{name}_bn" type: "BatchNorm" bottom: "{name}" '
                   f'top: "{name}_bn" }}')
        out.append(f'layer {{ name: "{name}_scale" type: "Scale" bottom: "{name}_bn" '
                   f'top: "{name}_scale" scale_param {{ bias_term: true }} }}')
        return f"{name}_scale"

    def relu(name, bottom):
        out.append(f'layer {{ name: "{name}" type: "ReLU" bottom: "{bottom}" top: "{name}" }}')
        return name

    x = relu("conv1_relu", conv("conv1", "data", 24, 3, 2))
    out.append(f'layer {{ name: "pool1" type: "Pooling" bottom: "{x}" top: "pool1" '
               'pooling_param { pool: MAX kernel_size: 3 stride: 2 } }')
    x, channels = "pool1", 24
    for u in range(units):
        first = u == 0
        p = f"stage2_{u + 1}"
        mid = width // 4
        a = relu(f"{p}_relu1", conv(f"{p}_gconv1", x, mid, 1, group=1 if first else groups))
        out.append(f'layer {{ name: "{p}_shuffle" type: "ShuffleChannel" bottom: "{a}" '
                   f'top: "{p}_shuffle" shuffle_channel_param {{ group: {groups} }} }}')
        d = conv(f"{p}_dwconv", f"{p}_shuffle", mid, 3, 2 if first else 1,
                 kind="ConvolutionDepthwise")
        b = conv(f"{p}_gconv2", d, width - channels if first else width, 1, group=groups)
        if first:
            out.append(f'layer {{ name: "{p}_avg" type: "Pooling" bottom: "{x}" '
                       f'top: "{p}_avg" pooling_param {{ pool: AVE kernel_size: 3 stride: 2 }} '
                       '}')
            out.append(f'layer {{ name: "{p}_concat" type: "Concat" bottom: "{p}_avg" '
                       f'bottom: "{b}" top: "{p}_concat" }}')
            joined = f"{p}_concat"
        else:
            out.append(f'layer {{ name: "{p}_sum" type: "Eltwise" bottom: "{x}" '
                       f'bottom: "{b}" top: "{p}_sum" }}')
            joined = f"{p}_sum"
        x, channels = relu(f"{p}_relu", joined), width
    out.append(f'layer {{ name: "pool_ave" type: "Pooling" bottom: "{x}" top: "pool_ave" '
               'pooling_param { pool: AVE global_pooling: true } }')
    out.append('layer { name: "fc" type: "InnerProduct" bottom: "pool_ave" top: "fc" '
               'inner_product_param { num_output: 10 } }')
    out.append('layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }')
    return "\n".join(out) + "\n"


def test_shufflenet_stage(tmp_path):
    pairs = [("stage2_1_shuffle", "stage2_1_shuffle"), ("stage2_1_dwconv", "stage2_1_dwconv"),
             ("stage2_1_relu", "stage2_1_relu"), ("stage2_3_relu", "stage2_3_relu"),
             ("fc", "fc")]
    ours, theirs = run_both(tmp_path, shufflenet_stage(), {"data": image((1, 3, 64, 64))},
                            pairs)
    check(ours, theirs)
