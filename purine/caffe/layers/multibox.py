"""Builders of SSD's training layers (weiliu89/caffe): MultiBoxLoss, whose forward matches
priors to the ground truth and mines negatives before it sums the loss, and AnnotatedData,
which reads AnnotatedDatum LMDBs into images and the [1, 1, num_boxes, 8] box label."""

from __future__ import annotations

import numpy as np

from purine.caffe.facts import DEPLOY
from purine.caffe.layer import LayerBuild, Settler, register
from purine.caffe.layers.ssd import SSD
from purine.data import DataError, db, prefetch
from purine.data.annotated import AnnotatedBatches, AnnotatedTransform, parse_annotated
from purine.data.datum import show_key
from purine.data.prefetch import Prefetcher
from purine.formats import caffe_pb2 as pb
from purine.log import get_logger
from purine.ops import multibox as mb

_MB = pb.MultiBoxLossParameter
_SKIP = 0x5C1B  # the rand_skip draw's stream, as the Data layer's


def _multibox_params(L: LayerBuild) -> dict:
    """MultiBoxLossParameter as kernel keywords, after the fork's set-up checks; options
    not built are refused by name."""
    p = L.param.multibox_loss_param
    if not p.HasField("num_classes"):
        raise L.error("multibox_loss_param.num_classes must be given")
    if p.num_classes < 1:
        raise L.error(f"multibox_loss_param.num_classes is {p.num_classes}; expected >= 1")
    mining = _MB.MiningType.Name(p.mining_type)
    if p.HasField("do_neg_mining") and p.do_neg_mining != (mining != "NONE"):
        raise L.error(f"do_neg_mining: {str(p.do_neg_mining).lower()} disagrees with "
                      f"mining_type {mining}; drop the deprecated do_neg_mining")
    for name, bad, why in (
        ("mining_type HARD_EXAMPLE", mining == "HARD_EXAMPLE",
         "(online hard example mining) is not built; use MAX_NEGATIVE or NONE"),
        ("bp_inside", p.bp_inside, "is not built; leave it false"),
        ("map_object_to_agnostic", p.map_object_to_agnostic, "is not built; leave it false"),
        ("nms_param", p.HasField("nms_param") and p.nms_param.nms_threshold > 0,
         "(NMS among mined negatives) is not built; remove it"),
    ):
        if bad:
            raise L.error(f"multibox_loss_param.{name} {why}")
    if mining != "NONE" and not p.share_location:
        raise L.error("negative mining needs share_location: true (as in the fork)")
    softmax = p.conf_loss_type == _MB.SOFTMAX
    if softmax and not 0 <= p.background_label_id < p.num_classes:
        raise L.error(f"background_label_id {p.background_label_id} must be within [0, "
                      f"{p.num_classes}) for the SOFTMAX confidence loss")
    lp = L.param.loss_param
    if not lp.HasField("normalization") and lp.HasField("normalize"):
        norm = "VALID" if lp.normalize else "BATCH_SIZE"
    else:
        norm = pb.LossParameter.NormalizationMode.Name(lp.normalization)
    return dict(
        num_classes=int(p.num_classes), share_location=p.share_location,
        match_type=_MB.MatchType.Name(p.match_type),
        overlap_threshold=float(np.float32(p.overlap_threshold)),
        use_prior_for_matching=p.use_prior_for_matching,
        background_label_id=int(p.background_label_id), use_difficult_gt=p.use_difficult_gt,
        mining_type=mining, neg_pos_ratio=float(p.neg_pos_ratio),
        neg_overlap=float(np.float32(p.neg_overlap)), code_type=int(p.code_type),
        encode_variance_in_target=p.encode_variance_in_target,
        ignore_cross_boundary_bbox=p.ignore_cross_boundary_bbox,
        conf_loss_type=_MB.ConfLossType.Name(p.conf_loss_type), normalization=norm)


@register("MultiBoxLoss", fork=SSD, train_only="a training layer (prior matching, "
          "hard-negative mining and the loss)" + DEPLOY)
def multibox_loss(L: LayerBuild):
    if not L.param.top:  # Caffe's AutoTopBlobs for a loss layer
        L.param.top.append("(automatic)" if "(automatic)" not in L.net.data
                           else f"(automatic) {L.name}")
    L.expect(4, 1)
    if not L.loss_weights:
        L.loss_weights = [1.0]
    L.no_force_backward.update((2, 3))
    loc, conf, prior, label = L.bottoms
    params = _multibox_params(L)
    c = params["num_classes"]
    lc = 1 if params["share_location"] else c
    if len(prior.shape) != 3 or prior.shape[1] != 2 or prior.shape[2] % 4:
        raise L.error(f"bottom '{prior.name}' {prior.shape} is not a PriorBox output "
                      "(1, 2, num_priors * 4)")
    n_priors = prior.shape[2] // 4
    n = loc.shape[0] if loc.shape else 0
    for b, want, what in ((loc, n_priors * lc * 4, f"num_priors * {lc * 4}"),
                          (conf, n_priors * c, f"num_priors * num_classes ({c})")):
        if len(b.shape) < 2 or b.shape[0] != n or b.count != n * want:
            raise L.error(f"bottom '{b.name}' {b.shape} must be (N, {what}) = ({n}, {want}) for "
                          f"{n_priors} priors (bottoms: {L.shapes()})")
    if len(label.shape) != 4 or label.shape[:2] != (1, 1) or label.shape[3] != 8:
        raise L.error(f"bottom '{label.name}' {label.shape} is not AnnotatedData's box label "
                      "(1, 1, num_boxes, 8)")
    pd = list(L.param.propagate_down)
    # The fork's set-up adds propagate_down [true, true, false, false] when none is given and
    # its forward leaves out the term of a bottom not propagated down.
    use = dict(use_loc=not pd or pd[0], use_conf=len(pd) < 2 or pd[1])
    mp = L.param.multibox_loss_param
    loss_kw = dict(num_classes=c, loc_loss_type=_MB.LocLossType.Name(mp.loc_loss_type),
                   conf_loss_type=params["conf_loss_type"],
                   loc_weight=float(np.float32(mp.loc_weight)))
    loc_w, loc_t = L.scratch("loc_weight", loc.shape), L.scratch("loc_target", loc.shape)
    conf_t, sel = L.scratch("conf_target", conf.shape), L.scratch("conf_select", (n, n_priors))
    stats = L.scratch("stats", (3,))
    loss = L.top(0, ())
    L.forward(mb.multibox_targets, [loc, conf, prior, label], [loc_w, loc_t, conf_t, sel, stats],
              op_type="MultiBoxMatch", **params)
    L.forward(mb.multibox_loss_forward, [loc, conf, loc_w, loc_t, conf_t, sel, stats], [loss],
              **loss_kw, **use)

    def backward():
        if L.needs_diff(0):
            L.backward(mb.multibox_loc_backward, [loc, loc_w, loc_t, stats, L.top_diff(0)],
                       [L.bottom_diff(0)], loc_loss_type=loss_kw["loc_loss_type"],
                       loc_weight=loss_kw["loc_weight"])
        if L.needs_diff(1):
            L.backward(mb.multibox_conf_backward, [conf, conf_t, sel, stats, L.top_diff(0)],
                       [L.bottom_diff(1)], num_classes=c,
                       conf_loss_type=params["conf_loss_type"])
        for i, what in ((2, "prior"), (3, "label")):
            if L.needs_diff(i):
                if pd:  # asked for explicitly: the fork stops there
                    raise L.error(f"cannot backpropagate to the {what} input "
                                  f"'{L.param.bottom[i]}'; set its propagate_down to false")
                # Without propagate_down the fork's default leaves it out: a zero gradient.
                L.zero_diff((i,), "MultiBoxLossBackward")
    return backward


# -- AnnotatedData -------------------------------------------------------------------------
class _BatchShapes(Settler):
    """The next batch's top shapes: the box label's row count changes from batch to batch."""

    reads_bottoms = False

    def __init__(self, source: Prefetcher):
        self.source = source

    def before(self, bottoms: list) -> tuple[tuple[int, ...], ...]:  # noqa: ARG002
        batch = self.source.peek()
        arrays = getattr(batch, "arrays", batch)
        return tuple(tuple(a.shape) for a in arrays)


def _add_forward(L: LayerBuild, shapes: list[tuple[int, ...]], source: Prefetcher) -> None:
    tops = [L.top(i, s) for i, s in enumerate(shapes)]
    L.forward(prefetch.fill_tops, [], tops, op_type=L.type, source=source)
    L.settles(_BatchShapes(source))


@register("AnnotatedData", fork=SSD, train_only="a training layer (reads AnnotatedDatum "
          "LMDBs and samples crops); export a deploy prototxt whose inputs are Input layers")
def annotated_data_layer(L: LayerBuild):
    L.expect(0, (1, 2))
    source = L.kept("cursor")
    if source is not None:  # another build of the net reads on from the first's source
        shapes = L.decided() or [t.shape for t in L.net.base.layers[L.index].tops]
        _add_forward(L, list(shapes), source)
        return None
    p, ap = L.param.data_param, L.param.annotated_data_param
    if not p.source:
        raise L.error("data_param.source is empty; give the LMDB folder of AnnotatedDatum "
                      "records (purine-caffe create_annoset writes one)")
    if p.batch_size <= 0:
        raise L.error(f"data_param.batch_size must be positive, got {p.batch_size}")
    if p.HasField("backend") and p.backend != pb.DataParameter.LMDB:
        raise L.error("AnnotatedData reads LMDB only; set data_param.backend: LMDB")
    try:
        transform = AnnotatedTransform(L.param.transform_param, ap.batch_sampler, L.phase,
                                       L.net.dtype)
        src = db.open_source(p.source, "lmdb")
        key, value = src.first()
        first = parse_annotated(value, f"LMDB '{src.path}': record '{show_key(key)}'")
    except DataError as e:
        raise L.error(str(e)) from None
    labels = len(L.param.top) > 1
    rich = first.HasField("type") or ap.HasField("anno_type")
    if ap.HasField("anno_type") and first.HasField("type"):
        get_logger().warning("layer '%s': the type stored in AnnotatedDatum is shadowed by "
                             "annotated_data_param.anno_type", L.name)
    skip = (int(np.random.default_rng([L.net.seed, L.index, _SKIP]).integers(p.rand_skip))
            if p.rand_skip else 0)
    batches = AnnotatedBatches(src, int(p.batch_size), transform, labels=labels, rich=rich,
                               dtype=L.net.dtype, seed=L.net.seed, index=L.index,
                               replica=L.net.replica, skip=skip)
    try:
        shape = batches.first_shape()
    except DataError as e:
        raise L.error(str(e)) from None
    get_logger().info("Opened lmdb %s", src.path)
    source = prefetch.Prefetcher(batches.reader, p.prefetch, f"layer '{L.name}'")
    L.keep_state("cursor", source)
    shapes = [(int(p.batch_size),) + shape]
    if labels:
        # Until the first pass settles it: the first record's box count (at least 1).
        n_boxes = sum(len(g.annotation) for g in first.annotation_group)
        shapes.append((1, 1, max(n_boxes, 1), 8) if rich else (int(p.batch_size),))
    _add_forward(L, shapes, source)
    get_logger().info("output data size: %s", ",".join(str(d) for d in shapes[0]))
    return None
