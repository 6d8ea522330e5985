"""The Caffe forks' schema additions (proto/caffe.proto): each fork's typical prototxt parses,
field numbers are the documented ones, binaries round-trip, a fork's clashing field numbers are
re-read by layer type, and OpenCV's importer reads the text and caffemodel we write."""

import struct

import numpy as np
import pytest
from google.protobuf import text_format

from purine.errors import ProtoError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import encode_net, read_caffemodel
from purine.formats.prototxt import parse_text, read_binary


def number(msg_cls, name: str) -> int:
    return msg_cls.DESCRIPTOR.fields_by_name[name].number


# --------------------------------------------------------------------------- field numbers


def test_layer_parameter_fork_field_numbers():
    expected = {
        # OpenCV's merged schema, free in BVLC
        "norm_param": 149, "prior_box_param": 150, "proposal_param": 201,
        "roi_pooling_param": 8266711, "psroi_pooling_param": 10002,
        # weiliu89/caffe (OpenCV's 147/148 are BVLC's swish_param/clip_param)
        "annotated_data_param": 200, "permute_param": 202, "detection_output_param": 204,
        "detection_evaluate_param": 205,
        # 2000 + the fork's clashing number
        "multibox_loss_param": 2201, "interp_param": 2143, "upsample_param": 2137,
        # the forks' own
        "smooth_l1_loss_param": 8266712, "shuffle_channel_param": 164,
    }
    assert {n: number(pb.LayerParameter, n) for n in expected} == expected
    # BVLC's numbers the forks collide with are untouched
    bvlc = {"input_param": 143, "swish_param": 147, "clip_param": 148, "embed_param": 137}
    assert {n: number(pb.LayerParameter, n) for n in bvlc} == bvlc


def test_fork_fields_in_bvlc_messages():
    assert number(pb.DropoutParameter, "scale_train") == 2
    assert pb.DropoutParameter().scale_train is True
    t = {"resize_param": 8, "noise_param": 9, "emit_constraint": 10, "crop_h": 11,
         "crop_w": 12, "distort_param": 13, "expand_param": 14}
    assert {n: number(pb.TransformationParameter, n) for n in t} == t
    s = {"eval_type": 2041, "ap_version": 2042, "plateau_winsize": 43,
         "show_per_class_result": 44, "layer_wise_reduce": 41, "weights": 42}
    assert {n: number(pb.SolverParameter, n) for n in s} == s
    assert (pb.SolverParameter().eval_type, pb.SolverParameter().ap_version) == \
        ("classification", "Integral")


def test_fork_message_numbers_and_defaults():
    d = pb.DetectionOutputParameter()
    assert (number(pb.DetectionOutputParameter, "keep_top_k"),
            number(pb.DetectionOutputParameter, "variance_encoded_in_target"),
            number(pb.DetectionOutputParameter, "confidence_threshold"),
            number(pb.DetectionOutputParameter, "visualize"),
            number(pb.DetectionOutputParameter, "normalized_bbox")) == (7, 8, 9, 10, 2010)
    assert (d.keep_top_k, d.share_location, d.code_type, d.normalized_bbox) == \
        (-1, True, pb.PriorBoxParameter.CORNER, True)
    p = pb.PriorBoxParameter()
    assert (p.flip, p.clip, p.offset) == (True, False, 0.5)
    assert [number(pb.PriorBoxParameter, n) for n in
            ("min_size", "max_size", "aspect_ratio", "variance", "offset", "offset_h",
             "width", "height")] == [1, 2, 3, 6, 13, 14, 16, 17]
    assert (pb.PriorBoxParameter.CORNER, pb.PriorBoxParameter.CENTER_SIZE,
            pb.PriorBoxParameter.CORNER_SIZE) == (1, 2, 3)
    m = pb.MultiBoxLossParameter()
    assert (m.loc_loss_type, m.conf_loss_type, m.match_type, m.mining_type) == (
        pb.MultiBoxLossParameter.SMOOTH_L1, pb.MultiBoxLossParameter.SOFTMAX,
        pb.MultiBoxLossParameter.PER_PREDICTION, pb.MultiBoxLossParameter.MAX_NEGATIVE)
    assert (m.overlap_threshold, m.neg_pos_ratio, m.neg_overlap, m.sample_size) == \
        (0.5, 3.0, 0.5, 64)
    assert [number(pb.MultiBoxLossParameter, n) for n in
            ("code_type", "encode_variance_in_target", "mining_type", "nms_param",
             "use_prior_for_nms")] == [14, 16, 20, 21, 23]
    n = pb.NonMaximumSuppressionParameter()
    assert (round(n.nms_threshold, 6), n.top_k, n.eta) == (0.3, 0, 1.0)
    assert pb.NormalizeBBoxParameter().eps == pytest.approx(1e-10)
    assert (pb.NormalizeBBoxParameter().across_spatial,
            pb.NormalizeBBoxParameter().channel_shared) == (True, True)
    r = pb.ProposalParameter()
    assert (r.feat_stride, r.base_size, r.min_size, r.pre_nms_topn, r.post_nms_topn) == \
        (16, 16, 16, 6000, 300)
    assert r.nms_thresh == pytest.approx(0.7)
    assert pb.ROIPoolingParameter().spatial_scale == 1.0
    assert pb.SmoothL1LossParameter().sigma == 1.0
    i = pb.InterpParameter()
    assert (i.zoom_factor, i.shrink_factor, i.pad_beg, i.pad_end) == (1, 1, 0, 0)
    assert pb.ShuffleChannelParameter().group == 1
    assert pb.UpsampleParameter().scale == 2
    assert [number(pb.UpsampleParameter, n) for n in
            ("scale", "scale_h", "scale_w", "pad_out_h", "pad_out_w", "upsample_h",
             "upsample_w")] == [1, 2, 3, 4, 5, 6, 7]
    assert [number(pb.PSROIPoolingParameter, n) for n in
            ("spatial_scale", "output_dim", "group_size")] == [1, 2, 3]
    b = pb.BatchSampler()
    assert (b.use_original_image, b.max_trials) == (True, 100)
    assert pb.ExpansionParameter().prob == 1.0
    assert pb.NoiseParameter().jpeg == -1.0
    assert pb.ResizeParameter().resize_mode == pb.ResizeParameter.WARP == 1
    assert pb.EmitConstraint().emit_type == pb.EmitConstraint.CENTER == 0


# --------------------------------------------------------------------------- text snippets

SSD_DEPLOY = """
name: "ssd"
input: "data"
input_shape { dim: 1 dim: 3 dim: 300 dim: 300 }
layer { name: "conv4_3_norm" type: "Normalize" bottom: "conv4_3" top: "conv4_3_norm"
  norm_param { across_spatial: false channel_shared: false eps: 1e-08
    scale_filler { type: "constant" value: 20 } } }
layer { name: "conv4_3_norm_mbox_loc_perm" type: "Permute" bottom: "conv4_3_norm_mbox_loc"
  top: "conv4_3_norm_mbox_loc_perm" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "conv4_3_norm_mbox_priorbox" type: "PriorBox" bottom: "conv4_3_norm"
  bottom: "data" top: "conv4_3_norm_mbox_priorbox"
  prior_box_param { min_size: 30.0 max_size: 60.0 aspect_ratio: 2 aspect_ratio: 3
    flip: true clip: false variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2
    img_h: 300 img_w: 300 step_h: 8 step_w: 8 offset: 0.5
    offset_h: 0.25 offset_w: 0.75 width: 12 height: 16 } }
layer { name: "detection_out" type: "DetectionOutput" bottom: "mbox_loc"
  bottom: "mbox_conf_flatten" bottom: "mbox_priorbox" top: "detection_out"
  include { phase: TEST }
  detection_output_param { num_classes: 21 share_location: true background_label_id: 0
    nms_param { nms_threshold: 0.45 top_k: 400 eta: 1.0 }
    save_output_param { output_directory: "out" output_name_prefix: "comp4_det_test_"
      output_format: "VOC" label_map_file: "labelmap_voc.prototxt"
      name_size_file: "test_name_size.txt" num_test_image: 4952
      resize_param { prob: 1 resize_mode: WARP height: 300 width: 300
        interp_mode: LINEAR } }
    code_type: CENTER_SIZE variance_encoded_in_target: false keep_top_k: 200
    confidence_threshold: 0.01 visualize: false visualize_threshold: 0.6
    normalized_bbox: true clip: false } }
"""


def test_ssd_deploy_layers_parse():
    net = parse_text(SSD_DEPLOY, pb.NetParameter(), "ssd_deploy.prototxt")
    norm, perm, prior, det = net.layer
    assert (norm.norm_param.across_spatial, norm.norm_param.channel_shared) == (False, False)
    assert norm.norm_param.eps == pytest.approx(1e-8)
    assert norm.norm_param.scale_filler.value == 20
    assert list(perm.permute_param.order) == [0, 2, 3, 1]
    p = prior.prior_box_param
    assert (list(p.min_size), list(p.max_size), list(p.aspect_ratio)) == ([30], [60], [2, 3])
    assert list(p.variance) == pytest.approx([0.1, 0.1, 0.2, 0.2])
    assert (p.img_h, p.img_w, p.step_h, p.step_w, p.flip, p.clip) == (300, 300, 8, 8, True,
                                                                      False)
    assert (list(p.offset_h), list(p.offset_w), list(p.width), list(p.height)) == \
        ([0.25], [0.75], [12], [16])
    d = det.detection_output_param
    assert (d.num_classes, d.keep_top_k, d.code_type) == (21, 200,
                                                          pb.PriorBoxParameter.CENTER_SIZE)
    assert (d.nms_param.nms_threshold, d.nms_param.top_k) == (pytest.approx(0.45), 400)
    assert d.save_output_param.num_test_image == 4952
    assert d.save_output_param.resize_param.interp_mode == [pb.ResizeParameter.LINEAR]
    assert d.confidence_threshold == pytest.approx(0.01)
    assert d.HasField("normalized_bbox") and d.HasField("clip")


def test_faster_rcnn_rfcn_test_layers_parse():
    net = parse_text("""
layer { name: "input-data" type: "Python" top: "data" top: "im_info"
  python_param { module: "roi_data_layer.layer" layer: "RoIDataLayer"
    param_str: "'num_classes': 21" } }
layer { name: "proposal" type: "Python" bottom: "rpn_cls_prob_reshape"
  bottom: "rpn_bbox_pred" bottom: "im_info" top: "rois"
  python_param { module: "rpn.proposal_layer" layer: "ProposalLayer"
    param_str: "'feat_stride': 16" } }
layer { name: "proposal2" type: "Proposal" bottom: "a" bottom: "b" bottom: "im_info"
  top: "rois2" proposal_param { feat_stride: 16 base_size: 16 min_size: 16
    ratio: 0.5 ratio: 1 ratio: 2 scale: 8 scale: 16 scale: 32 pre_nms_topn: 6000
    post_nms_topn: 300 nms_thresh: 0.7 } }
layer { name: "roi_pool5" type: "ROIPooling" bottom: "conv5_3" bottom: "rois"
  top: "pool5" roi_pooling_param { pooled_w: 7 pooled_h: 7 spatial_scale: 0.0625 } }
layer { name: "drop6" type: "Dropout" bottom: "fc6" top: "fc6"
  dropout_param { dropout_ratio: 0.5 scale_train: false } }
layer { name: "loss_bbox" type: "SmoothL1Loss" bottom: "bbox_pred" bottom: "bbox_targets"
  bottom: "bbox_inside_weights" bottom: "bbox_outside_weights" top: "loss_bbox"
  loss_weight: 1 smooth_l1_loss_param { sigma: 3.0 } }
layer { name: "psroipooled_cls_rois" type: "PSROIPooling" bottom: "rfcn_cls" bottom: "rois"
  top: "psroipooled_cls_rois"
  psroi_pooling_param { spatial_scale: 0.0625 output_dim: 21 group_size: 7 } }
""", pb.NetParameter(), "faster_rcnn_test.pt")
    data, py, prop, roi, drop, sl1, psroi = net.layer
    assert py.python_param.param_str == "'feat_stride': 16"
    assert (list(prop.proposal_param.ratio), list(prop.proposal_param.scale)) == \
        ([0.5, 1, 2], [8, 16, 32])
    r = roi.roi_pooling_param
    assert (r.pooled_h, r.pooled_w, r.spatial_scale) == (7, 7, 0.0625)
    assert drop.dropout_param.scale_train is False
    assert drop.dropout_param.HasField("scale_train")
    assert sl1.smooth_l1_loss_param.sigma == 3.0
    ps = psroi.psroi_pooling_param
    assert (ps.spatial_scale, ps.output_dim, ps.group_size) == (0.0625, 21, 7)


def test_segmentation_and_mobile_layers_parse():
    net = parse_text("""
layer { name: "interp" type: "Interp" bottom: "fc8" top: "fc8_interp"
  interp_param { zoom_factor: 8 pad_beg: 0 pad_end: 0 } }
layer { name: "interp2" type: "Interp" bottom: "a" top: "b"
  interp_param { height: 65 width: 33 shrink_factor: 2 } }
layer { name: "shuffle" type: "ShuffleChannel" bottom: "c" top: "shuffle"
  shuffle_channel_param { group: 3 } }
layer { name: "upsample4" type: "Upsample" bottom: "conv5_1_D" bottom: "pool4_mask"
  top: "pool4_D" upsample_param { scale: 2 upsample_w: 60 upsample_h: 45 } }
layer { name: "up_old" type: "Upsample" bottom: "x" bottom: "m" top: "y"
  upsample_param { scale_h: 2 scale_w: 3 pad_out_h: true pad_out_w: false } }
layer { name: "dw" type: "ConvolutionDepthwise" bottom: "c" top: "dw"
  convolution_param { num_output: 12 kernel_size: 3 pad: 1 group: 12 } }
layer { name: "relu6" type: "ReLU6" bottom: "dw" top: "dw" }
layer { name: "mish" type: "Mish" bottom: "dw" top: "dw" }
layer { name: "axpy" type: "Axpy" bottom: "s" bottom: "x" bottom: "y" top: "z" }
""", pb.NetParameter(), "seg.prototxt")
    i1, i2, sh, up, up_old = net.layer[:5]
    assert (i1.interp_param.zoom_factor, i1.interp_param.HasField("height")) == (8, False)
    assert (i2.interp_param.height, i2.interp_param.width, i2.interp_param.shrink_factor) == \
        (65, 33, 2)
    assert sh.shuffle_channel_param.group == 3
    u = up.upsample_param
    assert (u.scale, u.upsample_h, u.upsample_w) == (2, 45, 60)
    o = up_old.upsample_param
    assert (o.scale_h, o.scale_w, o.pad_out_h, o.pad_out_w, o.HasField("scale")) == \
        (2, 3, True, False, False)


SSD_TRAIN = """
layer { name: "data" type: "AnnotatedData" top: "data" top: "label"
  include { phase: TRAIN }
  transform_param { mirror: true mean_value: 104 mean_value: 117 mean_value: 123
    resize_param { prob: 1 resize_mode: WARP height: 300 width: 300
      interp_mode: LINEAR interp_mode: AREA interp_mode: NEAREST interp_mode: CUBIC
      interp_mode: LANCZOS4 }
    emit_constraint { emit_type: CENTER }
    distort_param { brightness_prob: 0.5 brightness_delta: 32 contrast_prob: 0.5
      contrast_lower: 0.5 contrast_upper: 1.5 hue_prob: 0.5 hue_delta: 18
      saturation_prob: 0.5 saturation_lower: 0.5 saturation_upper: 1.5
      random_order_prob: 0.0 }
    expand_param { prob: 0.5 max_expand_ratio: 4.0 }
    noise_param { prob: 0.1 hist_eq: true jpeg: 50 saltpepper_param { fraction: 0.01 value: 0 } }
    crop_h: 280 crop_w: 290 }
  data_param { source: "trainval_lmdb" batch_size: 32 backend: LMDB }
  annotated_data_param {
    batch_sampler { max_sample: 1 max_trials: 1 }
    batch_sampler { sampler { min_scale: 0.3 max_scale: 1.0 min_aspect_ratio: 0.5
        max_aspect_ratio: 2.0 }
      sample_constraint { min_jaccard_overlap: 0.1 } max_sample: 1 max_trials: 50 }
    batch_sampler { sampler { min_scale: 0.3 max_scale: 1.0 }
      sample_constraint { max_jaccard_overlap: 1.0 min_object_coverage: 0.5 }
      max_sample: 1 max_trials: 50 }
    label_map_file: "labelmap_voc.prototxt" anno_type: BBOX } }
layer { name: "mbox_loss" type: "MultiBoxLoss" bottom: "mbox_loc" bottom: "mbox_conf"
  bottom: "mbox_priorbox" bottom: "label" top: "mbox_loss" include { phase: TRAIN }
  propagate_down: true propagate_down: true propagate_down: false propagate_down: false
  loss_param { normalization: VALID }
  multibox_loss_param { loc_loss_type: SMOOTH_L1 conf_loss_type: SOFTMAX loc_weight: 1.0
    num_classes: 21 share_location: true match_type: PER_PREDICTION overlap_threshold: 0.5
    use_prior_for_matching: true background_label_id: 0 use_difficult_gt: true
    neg_pos_ratio: 3.0 neg_overlap: 0.5 code_type: CENTER_SIZE
    ignore_cross_boundary_bbox: false mining_type: MAX_NEGATIVE
    nms_param { nms_threshold: 0.5 top_k: 10 } sample_size: 64 use_prior_for_nms: false
    encode_variance_in_target: false map_object_to_agnostic: false bp_inside: false
    do_neg_mining: true } }
layer { name: "detection_eval" type: "DetectionEvaluate" bottom: "detection_out"
  bottom: "label" top: "detection_eval" include { phase: TEST }
  detection_evaluate_param { num_classes: 21 background_label_id: 0 overlap_threshold: 0.5
    evaluate_difficult_gt: false name_size_file: "test_name_size.txt" } }
"""


def test_ssd_train_layers_and_solver_parse():
    net = parse_text(SSD_TRAIN, pb.NetParameter(), "ssd_train.prototxt")
    data, loss, ev = net.layer
    t = data.transform_param
    assert len(t.resize_param.interp_mode) == 5
    assert t.resize_param.interp_mode[-1] == pb.ResizeParameter.LANCZOS4 == 5
    assert (t.distort_param.hue_delta, t.expand_param.max_expand_ratio) == (18, 4.0)
    assert (t.crop_h, t.crop_w, t.noise_param.jpeg) == (280, 290, 50)
    assert t.noise_param.saltpepper_param.fraction == pytest.approx(0.01)
    a = data.annotated_data_param
    assert len(a.batch_sampler) == 3
    assert a.batch_sampler[0].HasField("sampler") is False
    assert a.batch_sampler[1].sample_constraint.min_jaccard_overlap == pytest.approx(0.1)
    assert a.batch_sampler[2].sample_constraint.min_object_coverage == 0.5
    assert a.anno_type == pb.AnnotatedDatum.BBOX
    m = loss.multibox_loss_param
    assert (m.num_classes, m.code_type, m.nms_param.top_k, m.do_neg_mining) == \
        (21, pb.PriorBoxParameter.CENTER_SIZE, 10, True)
    assert list(loss.propagate_down) == [True, True, False, False]
    assert ev.detection_evaluate_param.evaluate_difficult_gt is False

    solver = parse_text("""
train_net: "train.prototxt" test_net: "test.prototxt" test_iter: 619 test_interval: 10000
base_lr: 0.001 lr_policy: "multistep" stepvalue: 80000 stepvalue: 100000 gamma: 0.1
eval_type: "detection" ap_version: "11point" show_per_class_result: true
plateau_winsize: 5000 plateau_winsize: 10000
""", pb.SolverParameter(), "solver.prototxt")
    assert (solver.eval_type, solver.ap_version, solver.show_per_class_result) == \
        ("detection", "11point", True)
    assert list(solver.plateau_winsize) == [5000, 10000]


def test_annotated_datum_and_label_map():
    d = pb.AnnotatedDatum(datum=pb.Datum(channels=3, height=2, width=2, data=b"\0" * 12),
                          type=pb.AnnotatedDatum.BBOX)
    g = d.annotation_group.add(group_label=7)
    g.annotation.add(instance_id=1, bbox=pb.NormalizedBBox(xmin=0.25, ymin=0.5, xmax=0.75,
                                                           ymax=1.0, difficult=True))
    # hand-built: datum(1){...} type(2)=0 annotation_group(3){group_label(1)=7
    #   annotation(2){instance_id(1)=1 bbox(2){xmin ymin xmax ymax (fixed32) difficult(6)=1}}}
    bbox = (b"\x0d" + struct.pack("<f", 0.25) + b"\x15" + struct.pack("<f", 0.5)
            + b"\x1d" + struct.pack("<f", 0.75) + b"\x25" + struct.pack("<f", 1.0) + b"\x30\x01")
    ann = b"\x08\x01" + b"\x12" + bytes([len(bbox)]) + bbox
    group = b"\x08\x07" + b"\x12" + bytes([len(ann)]) + ann
    datum = b"\x08\x03\x10\x02\x18\x02\x22\x0c" + b"\0" * 12
    want = b"\x0a" + bytes([len(datum)]) + datum + b"\x10\x00" + \
        b"\x1a" + bytes([len(group)]) + group
    assert d.SerializeToString() == want
    assert pb.AnnotatedDatum.FromString(want) == d
    lm = parse_text('item { name: "none_of_the_above" label: 0 display_name: "background" }\n'
                    'item { name: "aeroplane" label: 1 display_name: "aeroplane" }',
                    pb.LabelMap(), "labelmap_voc.prototxt")
    assert [(i.name, i.label, i.display_name) for i in lm.item] == \
        [("none_of_the_above", 0, "background"), ("aeroplane", 1, "aeroplane")]


# --------------------------------------------------------------------------- binary


def test_binary_round_trip_of_fork_layers(tmp_path):
    text = SSD_DEPLOY + SSD_TRAIN
    net = parse_text(text, pb.NetParameter(), "x")
    seg = parse_text("""
layer { name: "i" type: "Interp" interp_param { height: 3 } }
layer { name: "u" type: "Upsample" upsample_param { upsample_h: 4 } }
layer { name: "s" type: "ShuffleChannel" shuffle_channel_param { group: 2 } }
layer { name: "p" type: "PSROIPooling" psroi_pooling_param { output_dim: 2 } }
layer { name: "r" type: "ROIPooling" roi_pooling_param { pooled_h: 2 } }
layer { name: "pr" type: "Proposal" proposal_param { ratio: 2 } }""", pb.NetParameter(), "y")
    net.layer.extend(seg.layer)
    blob = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = tmp_path / "fork.caffemodel"
    path.write_bytes(encode_net(net.name, net.layer, {"conv4_3_norm": [blob]}))
    back = read_caffemodel(path)
    assert len(back.layer) == len(net.layer)
    for got, want in zip(back.layer, net.layer):
        got_params = pb.LayerParameter()
        got_params.CopyFrom(got)
        del got_params.blobs[:]
        assert got_params == want
    assert list(back.layer[0].blobs[0].data) == [0, 1, 2, 3, 4, 5]
    assert list(back.layer[0].blobs[0].shape.dim) == [2, 3]
    assert text_format.MessageToString(back.layer[-1]) == \
        text_format.MessageToString(net.layer[-1])


def _key(number: int, wire: int = 2) -> bytes:
    """Protobuf tag varint, written out independently of the code under test."""
    n, out = number << 3 | wire, bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _layer(ltype: str, number: int, payload: bytes, name: str = "l") -> bytes:
    body = (b"\x0a" + bytes([len(name)]) + name.encode() + b"\x12" + bytes([len(ltype)])
            + ltype.encode() + _key(number) + bytes([len(payload)]) + payload)
    return b"\xa2\x06" + bytes([len(body)]) + body  # NetParameter.layer = 100


def _read(tmp_path, data: bytes) -> pb.NetParameter:
    path = tmp_path / "fork.caffemodel"
    path.write_bytes(data)
    return read_caffemodel(path)


def test_key_helper_matches_known_tags():
    assert _key(100) == b"\xa2\x06"
    assert _key(143) == b"\xfa\x08"
    assert _key(8266711) == b"\xba\xbd\xc4\x1f"


@pytest.mark.parametrize("ltype, fork_number, payload, field, want", [
    # DeepLab v2: Interp's interp_param at 143 (height 5, width 7)
    ("Interp", 143, b"\x08\x05\x10\x07", "interp_param", "height: 5\nwidth: 7\n"),
    # OpenCV's numbers: DetectionOutput 147 (num_classes 21), Permute 148 (order 0 2 3 1)
    ("DetectionOutput", 147, b"\x08\x15\x38\xc8\x01", "detection_output_param",
     "num_classes: 21\nkeep_top_k: 200\n"),
    ("Permute", 148, b"\x08\x00\x08\x02\x08\x03\x08\x01", "permute_param",
     "order: 0\norder: 2\norder: 3\norder: 1\n"),
    # weiliu89/caffe: MultiBoxLoss 201 (num_classes 21), PriorBox 203, Normalize 206
    ("MultiBoxLoss", 201, b"\x20\x15", "multibox_loss_param", "num_classes: 21\n"),
    ("PriorBox", 203, b"\x0d" + struct.pack("<f", 30.0) + b"\x20\x00", "prior_box_param",
     "min_size: 30\nflip: false\n"),
    ("Normalize", 206, b"\x08\x00\x18\x00", "norm_param",
     "across_spatial: false\nchannel_shared: false\n"),
    # SegNet Upsample at 137, YOLOv3 ports at 149; ShuffleChannel at 159; caffe-rfcn 10001
    ("Upsample", 137, b"\x30\x2d\x38\x3c", "upsample_param", "upsample_h: 45\nupsample_w: 60\n"),
    ("Upsample", 149, b"\x08\x02", "upsample_param", "scale: 2\n"),
    ("ShuffleChannel", 159, b"\x08\x03", "shuffle_channel_param", "group: 3\n"),
    ("PSROIPooling", 10001, b"\x10\x15\x18\x07", "psroi_pooling_param",
     "output_dim: 21\ngroup_size: 7\n"),
])
def test_fork_numbers_reread_by_layer_type(tmp_path, ltype, fork_number, payload, field, want):
    net = _read(tmp_path, _layer(ltype, fork_number, payload))
    (layer,) = net.layer
    assert layer.type == ltype
    assert layer.HasField(field)
    got = getattr(layer, field)
    assert got == text_format.Parse(want, type(got)())
    # nothing is left at the clashing field
    others = [f.name for f, _ in layer.ListFields() if f.name not in ("name", "type", field)]
    assert others == []


@pytest.mark.parametrize("ltype, num, payload, field", [
    ("Input", 143, b"\x0a\x04\x0a\x02\x01\x03", "input_param"),  # shape { dim: 1 dim: 3 }
    ("Swish", 147, b"\x0d" + struct.pack("<f", 2.0), "swish_param"),
    ("Clip", 148, b"\x0d" + struct.pack("<f", 0.0) + b"\x15" + struct.pack("<f", 6.0),
     "clip_param"),
    ("Embed", 137, b"\x08\x04", "embed_param"),
    ("Proposal", 201, b"\x08\x10", "proposal_param"),
    # our own numbers are never moved
    ("DetectionOutput", 204, b"\x08\x15", "detection_output_param"),
    ("Permute", 202, b"\x08\x01", "permute_param"),
    ("Normalize", 149, b"\x08\x00", "norm_param"),
    ("PriorBox", 150, b"\x20\x00", "prior_box_param"),
    ("Interp", 2143, b"\x08\x05", "interp_param"),
])
def test_bvlc_and_own_numbers_keep_their_meaning(tmp_path, ltype, num, payload, field):
    net = _read(tmp_path, _layer(ltype, num, payload))
    assert net.layer[0].HasField(field)
    assert net.layer[0].ListFields()[-1][0].number == num


def test_rule_applies_per_layer_and_keeps_blobs(tmp_path):
    blob = b"\x3a\x0a" + b"\x2a\x08" + struct.pack("<2f", 1.5, -2.0)  # blobs { data: [..] }
    first = _layer("Interp", 143, b"\x08\x05", name="interp")
    second = _layer("Input", 143, b"\x0a\x02\x0a\x00", name="input")
    # splice a blob into the Interp layer and a net name in front
    body = first[3:] + blob
    data = b"\x0a\x01n" + b"\xa2\x06" + bytes([len(body)]) + body + second
    net = _read(tmp_path, data)
    assert net.name == "n"
    interp, inp = net.layer
    assert interp.interp_param.height == 5 and not interp.HasField("input_param")
    assert list(interp.blobs[0].data) == [1.5, -2.0]
    assert inp.HasField("input_param") and not inp.HasField("interp_param")


def test_damaged_binary_still_reports_one_line(tmp_path):
    data = _layer("Interp", 143, b"\x08\x05")[:-3]
    path = tmp_path / "bad.caffemodel"
    path.write_bytes(data)
    with pytest.raises(ProtoError, match="bad.caffemodel"):
        read_binary(path, pb.NetParameter())


# --------------------------------------------------------------------------- OpenCV

cv2 = pytest.importorskip("cv2")


def test_opencv_reads_our_text_and_caffemodel(tmp_path):
    if not hasattr(cv2, "dnn") or not hasattr(cv2.dnn, "readNetFromCaffe"):
        pytest.skip("this OpenCV has no Caffe importer")
    net = parse_text("""
name: "forks"
layer { name: "data" type: "Input" top: "data" top: "img"
  input_param { shape { dim: 1 dim: 4 dim: 2 dim: 2 } shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "norm" type: "Normalize" bottom: "data" top: "norm"
  norm_param { across_spatial: false channel_shared: false eps: 1e-10 } }
layer { name: "perm" type: "Permute" bottom: "norm" top: "perm"
  permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "shuffle" type: "ShuffleChannel" bottom: "data" top: "shuffle"
  shuffle_channel_param { group: 2 } }
layer { name: "drop" type: "Dropout" bottom: "shuffle" top: "drop"
  dropout_param { dropout_ratio: 0.5 scale_train: false } }
layer { name: "prior" type: "PriorBox" bottom: "data" bottom: "img" top: "prior"
  prior_box_param { min_size: 4 clip: false flip: true
    variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 offset: 0.5 } }
""", pb.NetParameter(), "forks.prototxt")
    scale = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    proto = tmp_path / "forks.prototxt"
    model = tmp_path / "forks.caffemodel"
    proto.write_text(text_format.MessageToString(net))
    model.write_bytes(encode_net(net.name, net.layer, {"norm": [scale]}))
    cvnet = cv2.dnn.readNetFromCaffe(str(proto), str(model))
    x = np.arange(1, 17, dtype=np.float32).reshape(1, 4, 2, 2)
    cvnet.setInput(x, "data")
    cvnet.setInput(np.zeros((1, 3, 8, 8), np.float32), "img")
    perm, drop, prior = cvnet.forward(["perm", "drop", "prior"])
    # L2 over channels at each pixel, times the per-channel scale, then NCHW -> NHWC
    norm = x / np.sqrt((x ** 2).sum(axis=1, keepdims=True) + 1e-10) * scale[:, None, None]
    np.testing.assert_allclose(perm, norm.transpose(0, 2, 3, 1), rtol=1e-5)
    # groups of 2 channels interleaved: [0, 1, 2, 3] -> [0, 2, 1, 3]; OpenCV honours
    # scale_train: false (Faster R-CNN's dropout scales by 1 - ratio at test time)
    np.testing.assert_array_equal(drop, 0.5 * x[:, [0, 2, 1, 3]])
    # a 2x2 map on an 8x8 image: step 4, one 4x4 box per cell centred at (4j+2, 4i+2)
    boxes = [[0, 0, .5, .5], [.5, 0, 1, .5], [0, .5, .5, 1], [.5, .5, 1, 1]]
    np.testing.assert_allclose(prior[0, 0], np.ravel(boxes), atol=1e-6)
    np.testing.assert_allclose(prior[0, 1], [0.1, 0.1, 0.2, 0.2] * 4, rtol=1e-6)
