"""The exporters and the Caffe forks' layers: caffe_to_onnx writes the ones with an exact ONNX
form (onnxruntime agrees with purine's forward at two batch sizes of a symbolic batch axis)
and refuses the others by name, type, fork and reason; caffe_to_pytorch likewise, its
generated module run in PyTorch (dev only: those tests skip without torch)."""

import importlib.util

import numpy as np
import pytest

from purine.caffe import TEST, Net
from purine.converters import ConvertError
from tests.converters.test_model_converters import (
    assert_agrees,
    onnx_modules,
    randomize,
    run_onnx,
    write,
)
from tests.converters.test_onnx_batch import _dims, _export, _feeds

INPUT = """layer {{ name: "data" type: "Input" top: "data"
  input_param {{ shape {{ dim: 2 dim: {c} dim: {h} dim: {w} }} }} }}
"""

# Depthwise convolutions (group left out; group given, with a channel multiplier of 2), ReLU6
# in place, Mish, ShuffleChannel, Permute (moving axes, and the identity), Axpy with an
# (N, C, 1, 1) and an (N, C) scale.
ACTIVATIONS = INPUT.format(c=4, h=6, w=5) + """
layer { name: "dw" type: "ConvolutionDepthwise" bottom: "data" top: "dw"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "r6" type: "ReLU6" bottom: "dw" top: "dw" }
layer { name: "dw2" type: "DepthwiseConvolution" bottom: "dw" top: "dw2"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1 group: 4 bias_term: false } }
layer { name: "mish" type: "Mish" bottom: "dw2" top: "mish" }
layer { name: "shuffle" type: "ShuffleChannel" bottom: "mish" top: "shuffle"
  shuffle_channel_param { group: 2 } }
layer { name: "nhwc" type: "Permute" bottom: "shuffle" top: "nhwc"
  permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "same" type: "Permute" bottom: "nhwc" top: "same" permute_param { order: 0 } }
layer { name: "gap" type: "Pooling" bottom: "data" top: "gap"
  pooling_param { pool: AVE global_pooling: true } }
layer { name: "axpy" type: "Axpy" bottom: "gap" bottom: "data" bottom: "dw" top: "axpy" }
layer { name: "flat" type: "Flatten" bottom: "gap" top: "flat" }
layer { name: "axpy2" type: "Axpy" bottom: "flat" bottom: "axpy" bottom: "data" top: "axpy2" }
"""

# Interp by zoom, by shrink, by height and width after a crop (pad_beg / pad_end < 0), by a
# second bottom's size; the nearest-neighbour Upsample.
RESIZE = INPUT.format(c=3, h=7, w=6) + """
layer { name: "zoom" type: "Interp" bottom: "data" top: "zoom" interp_param { zoom_factor: 3 } }
layer { name: "shrink" type: "Interp" bottom: "data" top: "shrink"
  interp_param { shrink_factor: 2 } }
layer { name: "crop" type: "Interp" bottom: "data" top: "crop"
  interp_param { height: 9 width: 4 pad_beg: -1 pad_end: -2 } }
layer { name: "like" type: "Interp" bottom: "shrink" bottom: "zoom" top: "like" }
layer { name: "up" type: "Upsample" bottom: "data" top: "up" upsample_param { scale: 3 } }
"""

# Normalize over all of a sample and per position, per-channel and shared scales; PriorBox
# from the image's size and from img_size, with max sizes, flipped ratios, clipping.
SSD = INPUT.format(c=3, h=8, w=8) + """
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "norm" type: "Normalize" bottom: "conv" top: "norm"
  norm_param { across_spatial: false channel_shared: false eps: 0.01 } }
layer { name: "norm_all" type: "Normalize" bottom: "conv" top: "norm_all"
  norm_param { channel_shared: true eps: 0.5 } }
layer { name: "prior" type: "PriorBox" bottom: "norm" bottom: "data" top: "prior"
  prior_box_param { min_size: 4 max_size: 6 aspect_ratio: 2 flip: true clip: true
    variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 } }
layer { name: "prior2" type: "PriorBox" bottom: "conv" top: "prior2"
  prior_box_param { min_size: 3 img_size: 12 step: 2.5 offset: 0.25 } }
"""

ROI = """layer { name: "data" type: "Input" top: "data"
  input_param { shape { dim: 2 dim: 3 dim: 7 dim: 9 } } }
layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 2 dim: 5 } } }
layer { name: "pool" type: "ROIPooling" bottom: "data" bottom: "rois" top: "pool"
  roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 } }
"""


def _symbolic(tmp_path, capfd, text, expect, scale=1.0, feeds=None):
    """Export ``text`` with a symbolic batch; at batch 1 and 3 onnxruntime's tensors equal
    the net's blobs (``expect`` among them); returns the model."""
    model, net, line = _export(tmp_path, text, capfd, seed=3)
    assert "batch axis symbolic ('batch'; built at 2)" in line
    for o in model.graph.output:
        assert _dims(o)[0] in ("batch", 1), o.name  # a PriorBox's (1, 2, ...) stays fixed
    for batch in (1, 3):
        inputs = feeds(net, batch) if feeds else {
            k: v * scale for k, v in _feeds(net, batch, seed=batch).items()}
        assert_agrees(model, net, inputs, expect)
    return model


def _ops(model):
    return [n.op_type for n in model.graph.node]


def test_onnx_activations_depthwise_shuffle_permute_axpy(tmp_path, capfd):
    # x 4: ReLU6 sees values below 0 and above 6, Mish large ones of either sign.
    model = _symbolic(tmp_path, capfd, ACTIVATIONS, ["dw", "dw2", "mish", "shuffle", "nhwc",
                                                     "axpy", "axpy2"], scale=4.0)
    ops = _ops(model)
    assert ops.count("Conv") == 2 and "Clip" in ops and ops.count("Transpose") == 2
    assert ["Softplus", "Tanh", "Mul"] == ops[ops.index("Softplus"):ops.index("Softplus") + 3]
    groups = [a.i for n in model.graph.node if n.op_type == "Conv" for a in n.attribute
              if a.name == "group"]
    assert groups == [4, 4]
    # The identity Permute computes nothing: the output 'same' is the nhwc tensor renamed.
    (same,) = [n for n in model.graph.node if "same" in n.output]
    assert same.op_type == "Identity" and list(same.input) == ["nhwc"]


def test_onnx_relu6_and_mish_values(tmp_path, capfd):
    """Hand values: ReLU6 clips to [0, 6]; Mish(x) = x tanh(ln(1 + e^x)) stays finite far
    out (softplus(40) would overflow as written, e^40 * ...: onnxruntime's does not)."""
    text = """layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 6 } } }
    layer { name: "r6" type: "ReLU6" bottom: "data" top: "r6" }
    layer { name: "mish" type: "Mish" bottom: "data" top: "mish" }"""
    model, _, _ = _export(tmp_path, text, capfd)
    x = np.array([[-40.0, -1.0, 0.0, 1.0, 6.5, 40.0]], np.float32)
    got = run_onnx(model, {"data": x})
    assert got["r6"].tolist() == [[0, 0, 0, 1, 6, 6]]
    mish_1 = np.tanh(np.log1p(np.e))  # 0.86510...
    want = [-40 * np.tanh(np.log1p(np.exp(-40.0))), -np.tanh(np.log1p(np.exp(-1.0))), 0.0,
            mish_1, 6.5 * np.tanh(np.log1p(np.exp(6.5))), 40.0]
    assert np.allclose(got["mish"][0], want, rtol=1e-6, atol=1e-30)


def test_onnx_interp_and_upsample(tmp_path, capfd):
    model = _symbolic(tmp_path, capfd, RESIZE, ["zoom", "shrink", "crop", "like", "up"])
    resize = [n for n in model.graph.node if n.op_type == "Resize"]
    modes = [{a.name: a.s.decode() for a in n.attribute if a.type == 3} for n in resize]
    assert [m["coordinate_transformation_mode"] for m in modes] == ["align_corners"] * 4 + [
        "asymmetric"]
    assert _ops(model).count("Slice") == 1


def test_onnx_interp_hand_values(tmp_path, capfd):
    """A 1 x 3 row zoomed by 2: aligned corners put outputs at 0, 0.5, 1, 1.5, 2."""
    text = """layer { name: "data" type: "Input" top: "data"
      input_param { shape { dim: 1 dim: 1 dim: 1 dim: 3 } } }
    layer { name: "zoom" type: "Interp" bottom: "data" top: "zoom" interp_param { zoom_factor: 2 } }
    layer { name: "up" type: "Upsample" bottom: "data" top: "up" upsample_param { scale: 2 } }"""
    model, _, _ = _export(tmp_path, text, capfd)
    got = run_onnx(model, {"data": np.array([[[[1.0, 3.0, 4.0]]]], np.float32)})
    assert got["zoom"].tolist() == [[[[1.0, 2.0, 3.0, 3.5, 4.0]]]]
    assert got["up"].tolist() == [[[[1, 1, 3, 3, 4, 4]] * 2]]


def test_onnx_normalize_and_prior_box(tmp_path, capfd):
    model = _symbolic(tmp_path, capfd, SSD, ["norm", "norm_all", "prior", "prior2"])
    assert _ops(model).count("Constant") == 2 and _ops(model).count("ReduceSumSquare") == 2
    got = run_onnx(model, {"data": np.zeros((4, 3, 8, 8), np.float32)})
    # conv is 4 x 4 over an 8 x 8 image: step 2, the first cell's centre (1, 1); its first
    # box is min_size 4, (1 - 2, 1 - 2, 1 + 2, 1 + 2) / 8 clipped to [0, 1].
    assert got["prior"].shape == (1, 2, 4 * 4 * 4 * 4)
    assert np.allclose(got["prior"][0, 0, :4], [0, 0, 3 / 8, 3 / 8])
    assert np.allclose(got["prior"][0, 1, :8], [0.1, 0.1, 0.2, 0.2] * 2)
    # prior2: centre (0.25 * 2.5, 0.25 * 2.5), half size 1.5, over 12; variance 0.1.
    c = 0.625
    assert np.allclose(got["prior2"][0, 0, :4], [(c - 1.5) / 12, (c - 1.5) / 12,
                                                  (c + 1.5) / 12, (c + 1.5) / 12])


def _roi_feeds(net, batch):
    """Features of mixed sign (some bins wholly negative) and one ROI per image, corners
    chosen so that scaled halves round away from zero, one ROI past the map's edge."""
    rng = np.random.default_rng(batch)
    feeds = {"data": rng.standard_normal((batch, 3, 7, 9)) - 0.5,
             "rois": np.array([[0, 1, 3, 11, 9], [0, 5, 1, 25, 30], [0, 0, 0, 0, 0]])[:batch]}
    feeds["rois"][:, 0] = np.arange(batch)[::-1]
    for name, v in feeds.items():
        net.blobs[name].reshape(v.shape)
    net.reshape()
    return feeds


def test_onnx_roi_pooling(tmp_path, capfd):
    model = _symbolic(tmp_path, capfd, ROI, ["pool"], feeds=_roi_feeds)
    assert _ops(model) == ["MaxRoiPool"]


def test_onnx_roi_pooling_hand_values(tmp_path, capfd):
    """One 4 x 4 plane of negative values, a ROI over all of it pooled 2 x 2: each bin's max
    (the fork starts at -FLT_MAX; some onnxruntime releases started at FLT_MIN, which would
    read 1.2e-38 here)."""
    text = """layer { name: "data" type: "Input" top: "data"
      input_param { shape { dim: 1 dim: 1 dim: 4 dim: 4 } } }
    layer { name: "rois" type: "Input" top: "rois"
      input_param { shape { dim: 1 dim: 5 dim: 1 dim: 1 } } }
    layer { name: "pool" type: "ROIPooling" bottom: "data" bottom: "rois" top: "pool"
      roi_pooling_param { pooled_h: 2 pooled_w: 2 spatial_scale: 0.5 } }"""
    model, _, _ = _export(tmp_path, text, capfd)
    x = -np.arange(1, 17, dtype=np.float32).reshape(1, 1, 4, 4)
    # corners (x1, y1, x2, y2) = (1, 1, 6.6, 7) scaled by 0.5 and rounded half away from
    # zero: columns 1..3 (round(3.3) = 3), rows 1..4 (round(3.5) = 4, one past the map)
    rois = np.array([0, 1, 1, 6.6, 7], np.float32).reshape(1, 5, 1, 1)
    got = run_onnx(model, {"data": x, "rois": rois})["pool"]
    # rows: 4 cells over 2 bins, [1, 3) and [3, 5) clipped to [3, 4); columns: 3 cells over
    # 2, [1 + floor(0), 1 + ceil(1.5)) = [1, 3) and [1 + floor(1.5), 1 + ceil(3)) = [2, 4);
    # the max of each bin is its first cell, x[r, c] = -(4 r + c + 1)
    assert got.tolist() == [[[[-6, -7], [-14, -15]]]]


# -- refusals ---------------------------------------------------------------------------------
REFUSALS = [
    ("""layer { name: "loc" type: "Input" top: "loc" input_param { shape { dim: 1 dim: 8 } } }
     layer { name: "conf" type: "Input" top: "conf" input_param { shape { dim: 1 dim: 4 } } }
     layer { name: "pri" type: "Input" top: "pri" input_param { shape { dim: 1 dim: 2 dim: 8 } } }
     layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "pri"
       top: "det" detection_output_param { num_classes: 2 nms_param { nms_threshold: 0.45 } } }""",
     "layer 'det' (type DetectionOutput, from SSD, weiliu89/caffe): no exact ONNX form: the "
     "fork's per-class top_k, NMS (with eta's shrinking threshold) and keep_top_k",
     "layer 'det' (type DetectionOutput, from SSD, weiliu89/caffe): no exact PyTorch form: "),
    ("""layer { name: "s" type: "Input" top: "s" input_param { shape { dim: 1 dim: 18 dim: 2 dim: 2 } } }
     layer { name: "d" type: "Input" top: "d" input_param { shape { dim: 1 dim: 36 dim: 2 dim: 2 } } }
     layer { name: "info" type: "Input" top: "info" input_param { shape { dim: 1 dim: 3 } } }
     layer { name: "prop" type: "Proposal" bottom: "s" bottom: "d" bottom: "info" top: "rois"
       proposal_param { feat_stride: 16 } }""",
     "layer 'prop' (type Proposal, from Faster R-CNN's Python layer as OpenCV's Caffe importer "
     "runs it): no exact ONNX form: its NMS measures boxes in pixels with +1 widths",
     "layer 'prop' (type Proposal, from Faster R-CNN's Python layer as OpenCV's Caffe "
     "importer runs it): no exact PyTorch form: "),
    ("""layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 8 dim: 4 dim: 4 } } }
     layer { name: "r" type: "Input" top: "r" input_param { shape { dim: 1 dim: 5 } } }
     layer { name: "ps" type: "PSROIPooling" bottom: "x" bottom: "r" top: "ps"
       psroi_pooling_param { spatial_scale: 1 output_dim: 2 group_size: 2 } }""",
     "layer 'ps' (type PSROIPooling, from R-FCN, daijifeng001/caffe-rfcn): no exact ONNX "
     "form: position-sensitive average pooling",
     "layer 'ps' (type PSROIPooling, from R-FCN, daijifeng001/caffe-rfcn): no exact PyTorch "
     "form: "),
    ("""layer { name: "p" type: "Input" top: "p" input_param { shape { dim: 2 dim: 4 } } }
     layer { name: "t" type: "Input" top: "t" input_param { shape { dim: 2 dim: 4 } } }
     layer { name: "l1" type: "SmoothL1Loss" bottom: "p" bottom: "t" top: "l1" }""",
     "layer 'l1' (type SmoothL1Loss, from Fast R-CNN, rbgirshick/caffe-fast-rcnn): no exact "
     "ONNX form: a training layer (the box regression loss); export a deploy prototxt "
     "without it",
     "layer 'l1' (type SmoothL1Loss, from Fast R-CNN, rbgirshick/caffe-fast-rcnn): no exact "
     "PyTorch form: a training layer (the box regression loss); export a deploy prototxt "
     "without it"),
    ("""layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 dim: 4 dim: 4 } } }
     layer { name: "pool" type: "Pooling" bottom: "x" top: "pooled" top: "mask"
       pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
     layer { name: "unpool" type: "Upsample" bottom: "pooled" bottom: "mask" top: "u"
       upsample_param { scale: 2 } }""",
     "layer 'pool' (type Pooling): no exact ONNX form: the argmax (second) top",
     "layer 'pool' (type Pooling): no exact PyTorch form: the argmax (second) top"),
    ("""layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 dim: 2 dim: 2 } } }
     layer { name: "m" type: "Input" top: "m" input_param { shape { dim: 1 dim: 2 dim: 2 dim: 2 } } }
     layer { name: "unpool" type: "Upsample" bottom: "x" bottom: "m" top: "u"
       upsample_param { scale: 2 } }""",
     "layer 'unpool' (type Upsample, from SegNet / the YOLOv3 ports): no exact ONNX form: the "
     "SegNet form (a mask bottom)",
     "layer 'unpool' (type Upsample, from SegNet / the YOLOv3 ports): no exact PyTorch form: "
     "the SegNet form (a mask bottom)"),
]


@pytest.mark.parametrize("text, onnx_message, torch_message", REFUSALS,
                         ids=["DetectionOutput", "Proposal", "PSROIPooling", "SmoothL1Loss",
                              "pool_mask", "Upsample_mask"])
def test_refusals(tmp_path, text, onnx_message, torch_message):
    from purine.converters.onnx_export import caffe_to_onnx
    from purine.converters.pytorch_export import caffe_to_pytorch

    model = write(tmp_path, "n.prototxt", text)
    Net(model, phase=TEST).save(tmp_path / "w.caffemodel")
    onnx_modules()
    with pytest.raises(ConvertError) as e:
        caffe_to_onnx(model, tmp_path / "w.caffemodel", tmp_path / "n.onnx")
    assert str(e.value).startswith(onnx_message), str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "n.onnx").exists()
    with pytest.raises(ConvertError) as e:
        caffe_to_pytorch(model, tmp_path / "w.caffemodel", tmp_path / "out")
    assert str(e.value).startswith(torch_message), str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_training_layers_refused_without_a_build():
    """MultiBoxLoss and AnnotatedData need labels and LMDBs to build; the message for their
    type is the same whatever the net around them."""
    from purine.converters.deploy import unsupported

    class Layer:
        def __init__(self, name, type_):
            self.type = type_
            self.param = type("P", (), {"name": name})()

    e = unsupported(Layer("mbox_loss", "MultiBoxLoss"), "ONNX", ["Input"])
    assert str(e) == ("layer 'mbox_loss' (type MultiBoxLoss, from SSD, weiliu89/caffe): no "
                      "exact ONNX form: a training layer (prior matching, hard-negative mining "
                      "and the loss); export a deploy prototxt without it")
    e = unsupported(Layer("data", "AnnotatedData"), "PyTorch", ["Input"])
    assert str(e) == ("layer 'data' (type AnnotatedData, from SSD, weiliu89/caffe): no exact "
                      "PyTorch form: a training layer (reads AnnotatedDatum LMDBs and samples "
                      "crops); export a deploy prototxt whose inputs are Input layers")


# -- PyTorch ----------------------------------------------------------------------------------
def _torch_run(tmp_path, text, batch_feeds, seed=3):
    """Export ``text`` with random weights; load the module with its tensors (no safetensors
    needed) and check every blob it returns or a hook sees against purine's forward at
    each feed; returns the export."""
    torch = pytest.importorskip("torch", reason="checking the generated module needs PyTorch")
    from purine.converters.pytorch_export import net_to_pytorch

    net = Net(write(tmp_path, "deploy.prototxt", text), phase=TEST)
    randomize(net, seed)
    ex = net_to_pytorch(net)
    path = tmp_path / f"{ex.stem}.py"
    path.write_text(ex.source)
    spec = importlib.util.spec_from_file_location(ex.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Net()
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in ex.tensors.items()})
    last = {t: L.name for L in net.builder.layers for t in L.param.top}
    top = {L.name: L.param.top[0] for L in net.builder.layers if L.param.top}
    got = {}
    for layer, attr in ex.attributes.items():
        getattr(model, attr).register_forward_hook(
            lambda m, i, o, layer=layer: got.__setitem__(layer, o.detach().numpy()))
    for feeds in batch_feeds(net):
        got.clear()
        net.forward(**feeds)
        with torch.no_grad():
            out = model(**{k: torch.from_numpy(np.asarray(v, np.float32))
                           for k, v in feeds.items()})
        compared = {top[k]: v for k, v in got.items() if last[top[k]] == k}
        compared.update({k: v.numpy() for k, v in out.items()})
        for blob, value in compared.items():
            want = net.blobs[blob].data
            assert value.shape == want.shape, (blob, value.shape, want.shape)
            scale = max(float(np.abs(want).max()), 1e-12)
            err = float(np.abs(value - want).max())
            assert err <= 1e-5 * scale, f"{blob}: max error {err} of magnitude {scale}"
        assert len(compared) > len(out)  # the hooks ran
    return ex


def _batches(scale=1.0):
    def feeds(net):
        for batch in (2, 3):
            yield {k: v * scale for k, v in _feeds(net, batch, seed=batch).items()}
    return feeds


def test_pytorch_activations_depthwise_shuffle_permute_axpy(tmp_path):
    ex = _torch_run(tmp_path, ACTIVATIONS, _batches(4.0))
    for line in ("self.dw = nn.Conv2d(4, 4, kernel_size=3, padding=1, groups=4)",
                 "self.r6 = nn.ReLU6()", "self.mish = nn.Mish()",
                 "self.dw2 = nn.Conv2d(4, 8, kernel_size=3, stride=2, padding=1, groups=4, "
                 "bias=False)",
                 "self.shuffle = ShuffleChannel(2)", "self.nhwc = Permute((0, 2, 3, 1))",
                 "axpy = self.axpy(gap, data, dw)"):
        assert line in ex.source, line
    assert "self.same" not in ex.source  # the identity Permute: its top is nhwc's variable


def test_pytorch_interp_and_upsample(tmp_path):
    ex = _torch_run(tmp_path, RESIZE, _batches())
    assert "self.crop = Interp((9, 4), crop=(1, 1, 4, 3))" in ex.source
    assert "self.up = UpsampleNearest(3)" in ex.source


def test_pytorch_normalize_and_prior_box(tmp_path):
    ex = _torch_run(tmp_path, SSD, _batches())
    assert "self.norm = Normalize((4,), across_spatial=False, eps=0.01)" in ex.source
    assert "prior = self.prior()" in ex.source
    assert ex.tensors["prior.boxes"].shape == (1, 2, 256)
    assert np.allclose(ex.tensors["prior.boxes"][0, 0, :4], [0, 0, 3 / 8, 3 / 8])


def test_pytorch_refuses_roi_pooling(tmp_path):
    from purine.converters.pytorch_export import net_to_pytorch

    net = Net(write(tmp_path, "roi.prototxt", ROI), phase=TEST)
    with pytest.raises(ConvertError, match=r"^layer 'pool' \(type ROIPooling, from Fast R-CNN, "
                       r"rbgirshick/caffe-fast-rcnn\): no exact PyTorch form: torch has no ROI "
                       r"pooling op \(torchvision.ops.roi_pool"):
        net_to_pytorch(net)
