"""SSD training (weiliu89/caffe): MultiBoxLoss on hand-worked cases (matches, mined negatives,
loss, gradients), the AnnotatedData layer over LMDBs written by create_annoset, and a tiny SSD
trained on drawn rectangles whose deploy net's DetectionOutput finds them again."""

from __future__ import annotations

import math
import os

import cv2
import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.caffe.solver import Solver
from purine.converters.create_annoset import annotated_datum, create_annoset
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.ops import multibox as mb
from tests.gradcheck import check_gradients, numeric_gradient

# -- MultiBoxLoss: one image, four priors (the quadrants of the image) -----------------------
QUADRANTS = np.array([[0.0, 0.0, 0.5, 0.5], [0.5, 0.0, 1.0, 0.5],
                      [0.0, 0.5, 0.5, 1.0], [0.5, 0.5, 1.0, 1.0]])
VAR = np.array([0.1, 0.1, 0.2, 0.2])


def prior_blob(boxes: np.ndarray, var: np.ndarray = VAR) -> np.ndarray:
    """PriorBox's (1, 2, P * 4): the boxes, then one variance row per box."""
    return np.stack([boxes.reshape(-1), np.tile(var, len(boxes))])[None]


def label_blob(*rows: tuple) -> np.ndarray:
    """AnnotatedData's (1, 1, G, 8) rows [item, label, instance, x0, y0, x1, y1, difficult]."""
    return np.array(rows, np.float64).reshape(1, 1, len(rows), 8)


# Two ground truths, each covering 0.8 (IoU) of one quadrant prior and nothing of the others:
# class 1 in the top-left quadrant (prior 0), class 2 in the bottom-right one (prior 3).
GT2 = label_blob((0, 1, 0, 0.0, 0.0, 0.4, 0.5, 0), (0, 2, 0, 0.5, 0.5, 1.0, 0.9, 0))
# Scores for background, class 1, class 2 per prior: prior 2's background score is the
# lowest of the two unmatched priors, so its loss is the highest: it is the mined negative.
CONF = np.array([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
LOC = np.array([[0.5, -0.5, 0.0, 2.0], [3.0, 3.0, 3.0, 3.0], [-3.0, 1.0, 0.0, 0.0],
                [0.1, 0.2, 0.3, 0.4]])


def mbox_layer(params: str = "", extra: str = "") -> str:
    return ('name: "mbox_loss" type: "MultiBoxLoss" bottom: "loc" bottom: "conf" '
            'bottom: "prior" bottom: "label" top: "loss" '
            f"multibox_loss_param {{ num_classes: 3 {params} }} {extra}")


def targets(loc, conf, prior, label, **kw):
    n, p = loc.shape[0], prior.shape[2] // 4
    out = [np.zeros(loc.shape), np.zeros(loc.shape), np.zeros(conf.shape), np.zeros((n, p)),
           np.zeros(3)]
    mb.multibox_targets(loc, conf, prior, label, *out, num_classes=3, **kw)
    return out


def test_hand_case_matches_mining_and_loss():
    loc, conf = LOC.reshape(1, 16), CONF.reshape(1, 12)
    # Bipartite matching pairs prior 0 with box 0 and prior 3 with box 1; one negative is
    # mined (int(2 positives * 0.5)) among priors 1 and 2: prior 2, whose loss is higher.
    loc_w, loc_t, conf_t, sel, stats = targets(loc, conf, prior_blob(QUADRANTS), GT2,
                                               neg_pos_ratio=0.5)
    np.testing.assert_array_equal(sel, [[1, 0, 1, 1]])
    np.testing.assert_array_equal(stats, [2, 1, 2])  # matches, negatives, normalizer (VALID)
    np.testing.assert_array_equal(conf_t.reshape(4, 3)[[0, 2, 3]], np.eye(3)[[1, 0, 2]])
    # CORNER targets (gt - prior) / variance: box 0's xmax is 0.1 left of the prior's,
    # box 1's ymax 0.1 above: -0.1 / 0.2 = -0.5 each.
    np.testing.assert_allclose(loc_t.reshape(4, 4), [[0, 0, -0.5, 0], [0] * 4, [0] * 4,
                                                     [0, 0, 0, -0.5]], atol=1e-12)
    np.testing.assert_array_equal(loc_w.reshape(4, 4).any(axis=1), [True, False, False, True])

    net = Net(f'layer {{ name: "in" type: "Input" top: "loc" top: "conf" top: "prior" '
              f'top: "label" input_param {{ shape {{ dim: 1 dim: 16 }} shape {{ dim: 1 dim: 12 }}'
              f' shape {{ dim: 1 dim: 2 dim: 16 }} shape {{ dim: 1 dim: 1 dim: 2 dim: 8 }} }} }}'
              f'layer {{ {mbox_layer("neg_pos_ratio: 0.5")} }}', phase=TRAIN,
              dtype="float64")
    out = net.forward(loc=loc, conf=conf, prior=prior_blob(QUADRANTS), label=GT2)
    # SmoothL1 of prediction - target: prior 0 (0.5, -0.5, 0.5, 2.0) -> 3 * 0.125 + 1.5;
    # prior 3 (0.1, 0.2, 0.3, 0.9) -> 0.5 * (0.01 + 0.04 + 0.09 + 0.81).
    loc_loss = 3 * 0.125 + 1.5 + 0.5 * 0.95
    e = math.e
    conf_loss = (-math.log(e / (e + 2))        # prior 0, class 1
                 - math.log(1 / 3)             # prior 3, class 2, all scores equal
                 - math.log(1 / (e + 2)))      # prior 2, mined, background
    assert float(out["loss"]) == pytest.approx((loc_loss + conf_loss) / 2, rel=1e-12)


def test_per_prediction_matching_and_neg_overlap():
    gt = np.array([[0.0, 0.0, 0.5, 0.5]])
    priors = np.array([[0.0, 0.0, 0.5, 0.5],     # IoU 1: the bipartite match
                       [0.0, 0.0, 0.5, 0.4],     # IoU 0.8: matched per prediction
                       [0.25, 0.0, 0.75, 0.5],   # IoU 1/3: neither match nor negative
                       [0.5, 0.5, 1.0, 1.0]])    # IoU 0: the only negative
    idx, ovl = mb.match_boxes(gt, priors)
    np.testing.assert_array_equal(idx, [0, 0, -1, -1])
    np.testing.assert_allclose(ovl, [1, 0.8, 1 / 3, 0])
    idx, _ = mb.match_boxes(gt, priors, match_type="BIPARTITE")
    np.testing.assert_array_equal(idx, [0, -1, -1, -1])
    label = label_blob((0, 1, 0, 0.0, 0.0, 0.5, 0.5, 0))
    *_, sel, stats = targets(np.zeros((1, 16)), np.zeros((1, 12)), prior_blob(priors), label,
                             neg_overlap=0.3)
    np.testing.assert_array_equal(sel, [[1, 1, 0, 1]])  # 2 positives, min(6, 1) negatives
    np.testing.assert_array_equal(stats, [2, 1, 2])


def test_matching_decoded_predictions_and_per_class_locations():
    # Zero offsets decode to the priors themselves: the same matches as matching the priors.
    prior = prior_blob(QUADRANTS)
    a = targets(np.zeros((1, 16)), CONF.reshape(1, 12), prior, GT2, neg_pos_ratio=0.5)
    b = targets(np.zeros((1, 16)), CONF.reshape(1, 12), prior, GT2, neg_pos_ratio=0.5,
                use_prior_for_matching=False)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    # One location per class: box 0 (class 1) goes to prior 0's class-1 slot, box 1 (class 2)
    # to prior 3's class-2 slot; without mining every prior takes the confidence loss.
    loc_w, loc_t, _, sel, stats = targets(np.zeros((1, 48)), np.zeros((1, 12)), prior, GT2,
                                          share_location=False, mining_type="NONE")
    slots = np.argwhere(loc_w.reshape(4, 3, 4).any(axis=2))
    np.testing.assert_array_equal(slots, [[0, 1], [3, 2]])
    np.testing.assert_allclose(loc_t.reshape(4, 3, 4)[3, 2], [0, 0, 0, -0.5], atol=1e-12)
    np.testing.assert_array_equal(sel, np.ones((1, 4)))
    np.testing.assert_array_equal(stats, [2, 0, 2])


def test_bipartite_ties_take_the_lowest_prior():
    # Both priors overlap the box equally; the fork's scan keeps the first maximum.
    idx, _ = mb.match_boxes(np.array([[0.25, 0.0, 0.75, 1.0]]),
                            np.array([[0.0, 0.0, 0.5, 1.0], [0.5, 0.0, 1.0, 1.0]]),
                            match_type="BIPARTITE")
    np.testing.assert_array_equal(idx, [0, -1])


def test_difficult_padding_and_background_rows():
    rows = label_blob((-1, -1, -1, -1, -1, -1, -1, -1), (1, 2, 0, 0.1, 0.1, 0.2, 0.2, 1),
                      (1, 1, 0, 0.3, 0.3, 0.4, 0.4, 0))
    gts = mb.ground_truth(rows, 0, use_difficult_gt=False)
    assert list(gts) == [1] and gts[1][1].tolist() == [1]
    assert mb.ground_truth(rows, 0, use_difficult_gt=True)[1][1].tolist() == [2, 1]
    with pytest.raises(PurineError, match="background label 0"):
        mb.ground_truth(label_blob((0, 0, 0, 0.1, 0.1, 0.2, 0.2, 0)), 0, True)


@pytest.mark.parametrize("kw", [
    dict(neg_pos_ratio=0.5),
    dict(mining_type="NONE", normalization="FULL"),
    dict(code_type=2, conf_loss_type="LOGISTIC", normalization="BATCH_SIZE"),
])
@pytest.mark.parametrize("loc_loss_type", ["SMOOTH_L1", "L2"])
def test_gradient_with_matching_held_fixed(kw, loc_loss_type):
    rng = np.random.default_rng(3)
    loc, conf = rng.normal(0, 0.6, (1, 16)), rng.normal(0, 1, (1, 12))
    fixed = targets(loc, conf, prior_blob(QUADRANTS), GT2, **kw)
    conf_type = kw.get("conf_loss_type", "SOFTMAX")
    loss_kw = dict(num_classes=3, loc_loss_type=loc_loss_type, conf_loss_type=conf_type,
                   loc_weight=0.7)

    def loss() -> float:
        out = np.zeros(())
        mb.multibox_loss_forward(loc, conf, *fixed, out, **loss_kw)
        return float(out)

    dloc, dconf = np.zeros_like(loc), np.zeros_like(conf)
    top = np.array(1.5)
    mb.multibox_loc_backward(loc, fixed[0], fixed[1], fixed[4], top, dloc,
                             loc_loss_type=loc_loss_type, loc_weight=0.7)
    mb.multibox_conf_backward(conf, fixed[2], fixed[3], fixed[4], top, dconf, num_classes=3,
                              conf_loss_type=conf_type)
    np.testing.assert_allclose(dloc, 1.5 * numeric_gradient(loss, loc), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(dconf, 1.5 * numeric_gradient(loss, conf), rtol=1e-6, atol=1e-9)


def test_net_gradient_check():
    rng = np.random.default_rng(5)
    check_gradients(mbox_layer("neg_pos_ratio: 1"),
                    dict(loc=rng.normal(0, 0.5, (1, 16)), conf=rng.normal(0, 1, (1, 12)),
                         prior=prior_blob(QUADRANTS), label=GT2),
                    check=["loc", "conf"], rtol=1e-5, atol=1e-8)


def test_variance_in_target_gradient_is_the_forks():
    # The fork divides prediction and target by the variance but copies the gradient back
    # without that factor: the derivative of SmoothL1 at (loc - t * var) / var.
    loc = np.zeros((1, 16))
    fixed = targets(loc, np.zeros((1, 12)), prior_blob(QUADRANTS), GT2, neg_pos_ratio=0.5,
                    encode_variance_in_target=True)
    dloc = np.zeros_like(loc)
    mb.multibox_loc_backward(loc, fixed[0], fixed[1], fixed[4], np.array(1.0), dloc)
    # d = 0 / var - (-0.5) = 0.5 at prior 0's xmax and prior 3's ymax; over 2 matches.
    want = np.zeros((4, 4))
    want[0, 2] = want[3, 3] = 0.5 / 2
    np.testing.assert_allclose(dloc.reshape(4, 4), want, atol=1e-12)


@pytest.mark.parametrize("params, message", [
    ("mining_type: HARD_EXAMPLE", "HARD_EXAMPLE"),
    ("share_location: false", "share_location"),
    ("bp_inside: true", "bp_inside"),
])
def test_refused_options(params, message):
    shapes = dict(loc=(1, 16), conf=(1, 12), prior=(1, 2, 16), label=(1, 1, 2, 8))
    from tests.gradcheck import layer_net
    with pytest.raises(PurineError, match=message):
        Net(layer_net(mbox_layer(params), shapes), phase=TRAIN)


# -- the synthetic box dataset, written by create_annoset -----------------------------------
SIZE = 32
COLORS = {1: (40, 40, 230), 2: (40, 230, 40)}  # BGR: class 1 red, class 2 green
LABEL_MAP = ('item { name: "none_of_the_above" label: 0 } item { name: "red" label: 1 } '
             'item { name: "green" label: 2 }')


def draw_scene(rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[int, int, ...]]]:
    """A dark noisy image with one or two bright rectangles that do not overlap; boxes as
    (label, xmin, ymin, xmax, ymax) in pixels (xmax, ymax exclusive)."""
    img = rng.integers(0, 40, (SIZE, SIZE, 3)).astype(np.uint8)
    boxes: list[tuple] = []
    while len(boxes) < rng.integers(1, 3):
        w, h = rng.integers(9, 17, 2)
        x, y = rng.integers(0, SIZE - w + 1), rng.integers(0, SIZE - h + 1)
        if any(x < b[3] and b[1] < x + w and y < b[4] and b[2] < y + h for b in boxes):
            continue
        label = int(rng.integers(1, 3))
        cv2.rectangle(img, (int(x), int(y)), (int(x + w - 1), int(y + h - 1)), COLORS[label],
                      thickness=-1)
        boxes.append((label, int(x), int(y), int(x + w), int(y + h)))
    return img, boxes


def write_dataset(folder, n: int, seed: int) -> tuple[str, list]:
    """``n`` scenes as PNGs and txt box files under ``folder``, converted by create_annoset;
    returns the LMDB path and the scenes' boxes."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder / "img")
    lines, scenes = [], []
    for i in range(n):
        img, boxes = draw_scene(rng)
        cv2.imwrite(str(folder / "img" / f"{i}.png"), img)
        (folder / "img" / f"{i}.txt").write_text(
            "".join(f"{b[0]} {b[1]} {b[2]} {b[3]} {b[4]}\n" for b in boxes))
        lines.append(f"img/{i}.png img/{i}.txt\n")
        scenes.append(boxes)
    (folder / "list.txt").write_text("".join(lines))
    (folder / "labelmap.prototxt").write_text(LABEL_MAP)
    db = str(folder / "lmdb")
    create_annoset(folder, folder / "list.txt", db, anno_type="detection", label_type="txt",
                   label_map_file=str(folder / "labelmap.prototxt"))
    return db, scenes


def test_create_annoset_records(tmp_path):
    db, scenes = write_dataset(tmp_path, 3, seed=1)
    import lmdb
    with lmdb.open(db, readonly=True, lock=False) as env, env.begin() as txn:
        items = list(txn.cursor())
    assert [k.decode() for k, _ in items] == [f"{i:08d}_img/{i}.png" for i in range(3)]
    for (_, value), boxes in zip(items, scenes, strict=True):
        a = pb.AnnotatedDatum.FromString(value)
        assert a.type == pb.AnnotatedDatum.BBOX and a.datum.label == -1
        assert (a.datum.channels, a.datum.height, a.datum.width) == (3, SIZE, SIZE)
        got = [(g.group_label, an.instance_id, an.bbox.xmin, an.bbox.ymin, an.bbox.xmax,
                an.bbox.ymax) for g in a.annotation_group for an in g.annotation]
        # Grouped by label in order of first appearance; pixels over the image size.
        want, seen = [], {}
        for b in boxes:
            seen.setdefault(b[0], []).append(b)
        for label, group in seen.items():
            want += [(label, k, *(np.float32(v / SIZE) for v in b[1:]))
                     for k, b in enumerate(group)]
        assert got == want


def test_create_annoset_voc_xml(tmp_path):
    cv2.imwrite(str(tmp_path / "a.jpg"), np.zeros((20, 40, 3), np.uint8))
    (tmp_path / "a.xml").write_text(
        "<annotation><size><width>40</width><height>20</height></size>"
        "<object><name>cat</name><difficult>1</difficult><bndbox><xmin>4</xmin><ymin>2</ymin>"
        "<xmax>20</xmax><ymax>10</ymax></bndbox></object>"
        "<object><name>dog</name><bndbox><xmin>0</xmin><ymin>0</ymin><xmax>40</xmax>"
        "<ymax>20</ymax></bndbox></object>"
        "<object><name>cat</name><bndbox><xmin>10</xmin><ymin>5</ymin><xmax>30</xmax>"
        "<ymax>15</ymax></bndbox></object></annotation>")
    (tmp_path / "list.txt").write_text("a.jpg a.xml\n")
    (tmp_path / "map.prototxt").write_text('item { name: "cat" label: 3 } '
                                           'item { name: "dog" label: 1 }')
    create_annoset(tmp_path, tmp_path / "list.txt", tmp_path / "db", anno_type="detection",
                   label_map_file=str(tmp_path / "map.prototxt"), encode_type="png")
    import lmdb
    with lmdb.open(str(tmp_path / "db"), readonly=True, lock=False) as env, env.begin() as t:
        a = pb.AnnotatedDatum.FromString(t.get(b"00000000_a.jpg"))
    assert a.datum.encoded
    cats, dogs = a.annotation_group
    assert (cats.group_label, dogs.group_label) == (3, 1)
    assert [an.instance_id for an in cats.annotation] == [0, 1]
    b = cats.annotation[0].bbox
    assert (b.xmin, b.ymin, b.xmax, b.ymax) == tuple(np.float32([0.1, 0.1, 0.5, 0.5]))
    assert b.difficult  # pixels 4, 2, 20, 10 over the <size> 40 x 20
    assert not cats.annotation[1].bbox.difficult

    (tmp_path / "bad.txt").write_text("a.jpg a.xml\n")
    (tmp_path / "map2.prototxt").write_text('item { name: "dog" label: 1 }')
    with pytest.raises(PurineError, match="unknown name 'cat'"):
        create_annoset(tmp_path, tmp_path / "bad.txt", tmp_path / "db2", anno_type="detection",
                       label_map_file=str(tmp_path / "map2.prototxt"))


def test_cli_create_annoset(tmp_path):
    from purine.cli import main
    write_dataset(tmp_path / "x", 1, seed=2)
    rc = main(["create_annoset", "--anno_type=detection", "--label_type=txt",
               f"--label_map_file={tmp_path / 'x' / 'labelmap.prototxt'}", f"{tmp_path / 'x'}/",
               str(tmp_path / "x" / "list.txt"), str(tmp_path / "db")])
    assert rc == 0 and os.path.exists(tmp_path / "db" / "data.mdb")


def data_layer(db: str, batch: int, transform: str = "", samplers: str = "") -> str:
    return (f'layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label" '
            f'transform_param {{ {transform} }} data_param {{ source: "{db}" batch_size: {batch}'
            f' }} annotated_data_param {{ {samplers} }} }}')


def test_annotated_data_labels_and_mirror(tmp_path):
    db, scenes = write_dataset(tmp_path, 4, seed=3)
    net = Net(data_layer(db, 4, "mirror: true scale: 0.5"), phase=TEST)
    out = net.forward()
    rows = out["label"].reshape(-1, 8)
    raw = [cv2.imread(str(tmp_path / "img" / f"{i}.png")) for i in range(4)]
    assert rows.shape[0] == sum(len(s) for s in scenes)
    k = flips = 0
    for i, boxes in enumerate(scenes):
        img = out["data"][i].transpose(1, 2, 0) / 0.5
        flipped = not np.array_equal(img, raw[i])
        if flipped:
            np.testing.assert_array_equal(img, raw[i][:, ::-1])
        flips += flipped
        by_label = sorted(boxes, key=lambda b: [b[0] for b in boxes].index(b[0]))
        for b in by_label:
            x0, x1 = b[1] / SIZE, b[3] / SIZE
            if flipped:
                x0, x1 = 1 - x1, 1 - x0
            np.testing.assert_allclose(rows[k], [i, b[0], rows[k][2], x0, b[2] / SIZE, x1,
                                                 b[4] / SIZE, 0], atol=1e-6)
            k += 1
    assert 0 < flips < 4  # the seeded draws mirror some images and not others


def test_annotated_data_classification_records(tmp_path):
    for i in range(3):
        cv2.imwrite(str(tmp_path / f"{i}.png"), np.full((4, 6, 3), i, np.uint8))
    (tmp_path / "list.txt").write_text("".join(f"{i}.png {7 + i}\n" for i in range(3)))
    create_annoset(tmp_path, tmp_path / "list.txt", tmp_path / "db")
    out = Net(data_layer(str(tmp_path / "db"), 3), phase=TEST).forward()
    np.testing.assert_array_equal(out["label"], [7, 8, 9])  # no annotation type: Datum labels
    np.testing.assert_array_equal(out["data"][:, 0, 0, 0], [0, 1, 2])


def test_annotated_data_samplers_and_resize(tmp_path):
    db, _ = write_dataset(tmp_path, 6, seed=4)
    samplers = "".join(
        f"batch_sampler {{ sampler {{ min_scale: 0.3 max_scale: 1 min_aspect_ratio: 0.5 "
        f"max_aspect_ratio: 2 }} sample_constraint {{ min_jaccard_overlap: {j} }} "
        f"max_sample: 1 max_trials: 50 }}" for j in (0.1, 0.3, 0.5, 0.7, 0.9))
    tf = ("resize_param { resize_mode: WARP height: 24 width: 24 } mirror: true "
          "mean_value: 10 emit_constraint { emit_type: CENTER } "
          "expand_param { prob: 0.5 max_expand_ratio: 2 } "
          "distort_param { brightness_prob: 0.5 brightness_delta: 32 contrast_prob: 0.5 "
          "contrast_lower: 0.5 contrast_upper: 1.5 hue_prob: 0.5 hue_delta: 18 "
          "saturation_prob: 0.5 saturation_lower: 0.5 saturation_upper: 1.5 }")
    net = Net(data_layer(db, 6, tf, samplers), phase=TRAIN)
    for _ in range(3):
        out = net.forward()
        assert out["data"].shape == (6, 3, 24, 24)
        rows = out["label"].reshape(-1, 8)
        if rows[0, 0] == -1:
            assert rows.shape == (1, 8) and (rows == -1).all()
            continue
        assert ((rows[:, 3:7] >= 0) & (rows[:, 3:7] <= 1)).all()
        assert (rows[:, 5] > rows[:, 3]).all() and (rows[:, 6] > rows[:, 4]).all()
        assert set(rows[:, 1].tolist()) <= {1.0, 2.0}


def test_annotated_data_refusals(tmp_path):
    db, _ = write_dataset(tmp_path, 1, seed=5)
    for tf, message in (("noise_param { prob: 1 }", "noise_param"),
                        ("resize_param { resize_mode: FIT_SMALL_SIZE height: 8 width: 8 }",
                         "FIT_SMALL_SIZE")):
        with pytest.raises(PurineError, match=message):
            Net(data_layer(db, 1, tf), phase=TRAIN)


def test_annotated_datum_helper_groups():
    a = annotated_datum(pb.Datum(), [(2, 0.1, 0.1, 0.2, 0.2, False),
                                     (1, 0.3, 0.3, 0.4, 0.4, True),
                                     (2, 0.5, 0.5, 0.6, 0.6, False)])
    assert [(g.group_label, [an.instance_id for an in g.annotation])
            for g in a.annotation_group] == [(2, [0, 1]), (1, [0])]


# -- a tiny SSD, trained -------------------------------------------------------------------
def body(data: str) -> str:
    """Three conv + pool stages down to a 4 x 4 map, and its location and confidence heads
    (4 priors a cell: min size, sqrt(min * max), aspect ratio 2 and 1/2)."""
    def conv(name, bottom, n, relu=True):
        s = (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" '
             f'convolution_param {{ num_output: {n} kernel_size: 3 pad: 1 '
             f'weight_filler {{ type: "xavier" }} bias_filler {{ type: "constant" }} }} }}\n')
        if relu:
            s += f'layer {{ name: "{name}r" type: "ReLU" bottom: "{name}" top: "{name}" }}\n'
        return s

    def pool(name, bottom):
        return (f'layer {{ name: "{name}" type: "Pooling" bottom: "{bottom}" top: "{name}" '
                f'pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}\n')

    def head(name, n):
        return (conv(name, "p3", n, relu=False)
                + f'layer {{ name: "{name}_perm" type: "Permute" bottom: "{name}" '
                  f'top: "{name}_perm" permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}\n'
                + f'layer {{ name: "{name}_flat" type: "Flatten" bottom: "{name}_perm" '
                  f'top: "{name}_flat" }}\n')

    return (conv("c1", data, 16) + pool("p1", "c1") + conv("c2", "p1", 32) + pool("p2", "c2")
            + conv("c3", "p2", 32) + pool("p3", "c3") + head("mbox_loc", 16)
            + head("mbox_conf", 12)
            + 'layer { name: "mbox_priorbox" type: "PriorBox" bottom: "p3" bottom: "data" '
              'top: "mbox_priorbox" prior_box_param { min_size: 10 max_size: 20 '
              'aspect_ratio: 2 flip: true variance: 0.1 variance: 0.1 variance: 0.2 '
              'variance: 0.2 } }\n')


TRAIN_NET = """name: "tiny_ssd"
layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label"
  transform_param {{ mirror: true mean_value: 64 scale: 0.015625 }}
  data_param {{ source: "{db}" batch_size: 8 }} }}
{body}
layer {{ name: "mbox_loss" type: "MultiBoxLoss" bottom: "mbox_loc_flat"
  bottom: "mbox_conf_flat" bottom: "mbox_priorbox" bottom: "label" top: "mbox_loss"
  propagate_down: true propagate_down: true propagate_down: false propagate_down: false
  multibox_loss_param {{ num_classes: 3 match_type: PER_PREDICTION overlap_threshold: 0.5
    neg_pos_ratio: 3 neg_overlap: 0.5 code_type: CENTER_SIZE }} }}
"""

DEPLOY_NET = """name: "tiny_ssd_deploy"
layer {{ name: "data" type: "Input" top: "data"
  input_param {{ shape {{ dim: {n} dim: 3 dim: 32 dim: 32 }} }} }}
{body}
layer {{ name: "conf_r" type: "Reshape" bottom: "mbox_conf_flat" top: "conf_r"
  reshape_param {{ shape {{ dim: 0 dim: -1 dim: 3 }} }} }}
layer {{ name: "conf_s" type: "Softmax" bottom: "conf_r" top: "conf_s"
  softmax_param {{ axis: 2 }} }}
layer {{ name: "conf_f" type: "Flatten" bottom: "conf_s" top: "conf_f" }}
layer {{ name: "detection_out" type: "DetectionOutput" bottom: "mbox_loc_flat"
  bottom: "conf_f" bottom: "mbox_priorbox" top: "detection_out"
  detection_output_param {{ num_classes: 3 share_location: true background_label_id: 0
    nms_param {{ nms_threshold: 0.45 top_k: 50 }} code_type: CENTER_SIZE keep_top_k: 10
    confidence_threshold: 0.3 }} }}
"""


def iou(a, b) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(w, 0) * max(h, 0)
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def test_tiny_ssd_learns_the_boxes(tmp_path):
    db, _ = write_dataset(tmp_path / "train", 200, seed=10)
    rng = np.random.default_rng(99)
    scenes = [draw_scene(rng) for _ in range(20)]  # held out, drawn the same way
    net_text = TRAIN_NET.format(db=db, body=body("data"))
    solver = Solver(f'net_param {{ {net_text} }} type: "Adam" base_lr: 0.003 momentum: 0.9 '
                    'momentum2: 0.999 delta: 1e-8 lr_policy: "fixed" max_iter: 400 '
                    'random_seed: 3 display: 0')
    losses = []
    for _ in range(400):
        solver.step(1)
        losses.append(float(solver.net.blobs["mbox_loss"].data))
    first, last = np.mean(losses[:20]), np.mean(losses[-40:])
    assert last < 0.5 * first, (first, last)
    weights = str(tmp_path / "tiny_ssd.caffemodel")
    solver.net.save(weights)

    deploy = Net(DEPLOY_NET.format(n=len(scenes), body=body("data")), weights=weights,
                 phase=TEST)
    images = np.stack([img for img, _ in scenes]).astype(np.float32)
    dets = deploy.forward(data=(images.transpose(0, 3, 1, 2) - 64) / 64)["detection_out"]
    dets = dets.reshape(-1, 7)
    found = 0
    for i, (_, boxes) in enumerate(scenes):
        mine = dets[dets[:, 0] == i]
        for label, *px in boxes:
            want = [v / SIZE for v in px]
            found += any(d[1] == label and iou(d[3:7], want) > 0.5 for d in mine)
    total = sum(len(b) for _, b in scenes)
    assert found >= 0.8 * total, f"found {found} of {total} boxes"
