"""SSD's inference layers (weiliu89/caffe): Normalize, Permute, PriorBox and DetectionOutput.
Forward outputs against OpenCV's Caffe importer, and against plain transcriptions of the fork's
C++ loops where OpenCV departs from the fork; boxes by hand; Normalize's and Permute's
gradients by central differences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from purine.caffe import TEST, Net
from purine.errors import LayerError
from purine.formats import caffe_pb2 as pb
from purine.ops import detection as det
from tests.gradcheck import check_gradients, layer_spec

cv2 = pytest.importorskip("cv2", reason="opencv-python-headless<5 is in the test extra")
if not hasattr(cv2, "dnn") or not hasattr(cv2.dnn, "readNetFromCaffe"):
    pytest.skip("this OpenCV has no Caffe importer", allow_module_level=True)

CODES = {"CORNER": 1, "CENTER_SIZE": 2, "CORNER_SIZE": 3}


def f32(v: float) -> float:
    """A proto float field's value."""
    return float(np.float32(v))


def inputs_text(shapes: dict[str, tuple[int, ...]]) -> str:
    return "".join(f'layer {{ name: "{n}" type: "Input" top: "{n}" input_param {{ shape {{ '
                   f'{" ".join(f"dim: {d}" for d in s)} }} }} }}\n' for n, s in shapes.items())


def run_both(tmp_path, proto: str, feeds: dict[str, np.ndarray], tops: list[str],
             setup=None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Our float32 net and OpenCV's on ``proto`` with the weights we write: ``tops`` of
    each."""
    path = tmp_path / "net.prototxt"
    path.write_text(proto)
    net = Net(str(path), phase=TEST, seed=5)
    if setup is not None:
        setup(net)
    weights = tmp_path / "net.caffemodel"
    net.save(weights)
    net.forward(**feeds)
    ours = {t: net.blobs[t].data.copy() for t in tops}
    cv = cv2.dnn.readNetFromCaffe(str(path), str(opencv_weights(weights)))
    cv.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    for name, value in feeds.items():
        cv.setInput(value, name)
    theirs = dict(zip(tops, cv.forward(tops), strict=True))
    return ours, theirs


def opencv_weights(path):
    """The caffemodel with each 0-axis blob (the fork's channel-shared Normalize scale)
    written as shape (1,): OpenCV's importer cannot make a 0-axis Mat."""
    model = pb.NetParameter()
    model.ParseFromString(path.read_bytes())
    for layer in model.layer:
        for blob in layer.blobs:
            if blob.HasField("shape") and not blob.shape.dim:
                blob.shape.dim.append(1)
    out = path.with_suffix(".opencv.caffemodel")
    out.write_bytes(model.SerializeToString())
    return out


def assert_close(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """1e-4 relative to the blob's largest magnitude."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    scale = max(float(np.abs(want).max()), 1e-30) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale, err_msg=name)


def row_set(rows: np.ndarray) -> np.ndarray:
    """Detection rows (R, 7) in lexicographic order, to compare as sets."""
    rows = rows.reshape(-1, 7)
    return rows[np.lexsort(rows.T[::-1])]


def opencv_rows(out: np.ndarray) -> np.ndarray:
    """OpenCV pads its DetectionOutput top to keep_top_k rows per image with zero rows."""
    rows = out.reshape(-1, 7)
    return rows[np.abs(rows).sum(axis=1) > 0]


# -- transcriptions of the fork's C++ (loops, float64), the independent references -----------

def fork_prior_box(layer_h, layer_w, img_h, img_w, min_sizes, max_sizes=(), ratios=(),
                   flip=True, clip=False, variance=(0.1,), step_h=0.0, step_w=0.0,
                   offset=0.5):
    """PriorBoxLayer::LayerSetUp and Forward_cpu, one box at a time."""
    ars = [1.0]
    for ar in ratios:
        if all(abs(ar - a) >= 1e-6 for a in ars):
            ars.append(ar)
            if flip:
                ars.append(1.0 / ar)
    if step_h == 0 or step_w == 0:
        step_w, step_h = img_w / layer_w, img_h / layer_h
    out = []
    for h in range(layer_h):
        for w in range(layer_w):
            cx, cy = (w + offset) * step_w, (h + offset) * step_h
            for s, mn in enumerate(min_sizes):
                mn = int(mn)  # `int min_size_ = min_sizes_[s];`
                boxes = [(mn, mn)]
                if max_sizes:
                    side = math.sqrt(mn * int(max_sizes[s]))
                    boxes.append((side, side))
                boxes += [(mn * math.sqrt(ar), mn / math.sqrt(ar)) for ar in ars
                          if abs(ar - 1) >= 1e-6]
                for bw, bh in boxes:
                    out += [(cx - bw / 2) / img_w, (cy - bh / 2) / img_h,
                            (cx + bw / 2) / img_w, (cy + bh / 2) / img_h]
    if clip:
        out = [min(max(v, 0.0), 1.0) for v in out]
    var = [variance[0]] * len(out) if len(variance) == 1 else list(variance) * (len(out) // 4)
    return np.array([[out, var]])


def fork_decode(prior, var, code, vit, b):
    """DecodeBBox for one box."""
    v = [1.0] * 4 if vit else var
    if code == "CORNER":
        return [prior[i] + v[i] * b[i] for i in range(4)]
    pw, ph = prior[2] - prior[0], prior[3] - prior[1]
    if code == "CORNER_SIZE":
        return [prior[i] + v[i] * b[i] * (pw if i % 2 == 0 else ph) for i in range(4)]
    pcx, pcy = (prior[0] + prior[2]) / 2, (prior[1] + prior[3]) / 2
    cx, cy = v[0] * b[0] * pw + pcx, v[1] * b[1] * ph + pcy
    w, h = math.exp(v[2] * b[2]) * pw, math.exp(v[3] * b[3]) * ph
    return [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]


def fork_size(b):
    if b[2] < b[0] or b[3] < b[1]:
        return 0.0
    return (b[2] - b[0]) * (b[3] - b[1])


def fork_jaccard(b1, b2):
    """IntersectBBox and JaccardOverlap (normalized)."""
    if b2[0] > b1[2] or b2[2] < b1[0] or b2[1] > b1[3] or b2[3] < b1[1]:
        inter = [0.0, 0.0, 0.0, 0.0]
    else:
        inter = [max(b1[0], b2[0]), max(b1[1], b2[1]), min(b1[2], b2[2]), min(b1[3], b2[3])]
    iw, ih = inter[2] - inter[0], inter[3] - inter[1]
    if iw > 0 and ih > 0:
        size = iw * ih
        return size / (fork_size(b1) + fork_size(b2) - size)
    return 0.0


def fork_nms(boxes, scores, score_threshold, nms_threshold, eta, top_k):
    """ApplyNMSFast."""
    cand = sorted(((s, i) for i, s in enumerate(scores) if s > score_threshold),
                  key=lambda p: -p[0])  # Python's sort is stable, as std::stable_sort
    if top_k > -1:
        cand = cand[:top_k]
    kept, thr = [], nms_threshold
    for _, idx in cand:
        keep = all(fork_jaccard(boxes[idx], boxes[k]) <= thr for k in kept)
        if keep:
            kept.append(idx)
            if eta < 1 and thr > 0.5:
                thr *= eta
    return kept


def fork_detection_output(loc, conf, prior, num_classes, share_location=True,
                          background_label_id=0, code="CORNER", vit=False, keep_top_k=-1,
                          confidence_threshold=-math.inf, nms_threshold=0.3, eta=1.0,
                          top_k=-1):
    """DetectionOutputLayer::Forward_cpu: rows in the fork's order."""
    n, p = loc.shape[0], prior.shape[-1] // 4
    nl = 1 if share_location else num_classes
    loc = loc.reshape(n, p, nl, 4).tolist()
    conf = conf.reshape(n, p, num_classes).tolist()
    pri = prior.reshape(-1, p, 4).tolist()
    var = pri[1] if len(pri) > 1 else [[1.0] * 4] * p
    rows = []
    for i in range(n):
        boxes = {c: [fork_decode(pri[0][j], var[j], code, vit, loc[i][j][c]) for j in range(p)]
                 for c in range(nl)}
        indices = {}
        for c in range(num_classes):
            if c == background_label_id:
                continue
            scores = [conf[i][j][c] for j in range(p)]
            indices[c] = fork_nms(boxes[0 if share_location else c], scores,
                                  confidence_threshold, nms_threshold, eta, top_k)
        total = sum(len(v) for v in indices.values())
        if -1 < keep_top_k < total:
            pairs = sorted(((conf[i][j][c], c, j) for c, js in indices.items() for j in js),
                           key=lambda t: -t[0])[:keep_top_k]
            indices = {}
            for _, c, j in pairs:
                indices.setdefault(c, []).append(j)
        for c in sorted(indices):
            for j in indices[c]:
                rows.append([i, c, conf[i][j][c], *boxes[0 if share_location else c][j]])
    if not rows:
        rows = [[i] + [-1.0] * 6 for i in range(n)]
    return np.array(rows)


# -- PriorBox ------------------------------------------------------------------------------

def prior_net(params: str, feat=(1, 4, 3, 2), img=(1, 3, 30, 20)) -> str:
    return inputs_text({"data": img, "feat": feat}) + (
        'layer { name: "pb" type: "PriorBox" bottom: "feat" bottom: "data" top: "pb" '
        f"prior_box_param {{ {params} }} }}\n")


def test_prior_box_hand_values():
    # A 2 x 2 map over a 100 x 100 image (img_size), step 50: cell (0, 0) is centred at
    # (25, 25), cell (1, 1) at (75, 75). min 30 / max 60 / ratio 2 (flipped): sides 30,
    # sqrt(1800) = 42.4264, and 42.4264 x 21.2132, 21.2132 x 42.4264.
    proto = inputs_text({"feat": (1, 2, 2, 2)}) + (
        'layer { name: "pb" type: "PriorBox" bottom: "feat" top: "pb" prior_box_param { '
        "min_size: 30 max_size: 60 aspect_ratio: 2 flip: true img_size: 100 step: 50 "
        "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 } }")
    net = Net(proto, phase=TEST)
    net.forward()
    out = net.blobs["pb"].data
    assert out.shape == (1, 2, 2 * 2 * 4 * 4)
    boxes = out[0, 0].reshape(2, 2, 4, 4)
    half = math.sqrt(1800) / 200  # half of sqrt(30 * 60), over 100
    np.testing.assert_allclose(boxes[0, 0], [
        [0.10, 0.10, 0.40, 0.40],
        [0.25 - half, 0.25 - half, 0.25 + half, 0.25 + half],
        [0.25 - half, 0.25 - half / 2, 0.25 + half, 0.25 + half / 2],
        [0.25 - half / 2, 0.25 - half, 0.25 + half / 2, 0.25 + half]], rtol=1e-6)
    np.testing.assert_allclose(boxes[1, 1, 0], [0.60, 0.60, 0.90, 0.90], rtol=1e-6)
    np.testing.assert_allclose(out[0, 1].reshape(-1, 4), [[0.1, 0.1, 0.2, 0.2]] * 16,
                               rtol=1e-6)


def test_prior_box_clip_and_truncated_min_size_by_hand():
    # min_size 7.9 is read into an int by the fork: a 7 x 7 box centred at (5, 5) of a
    # 20 x 10 (w x h) image, i.e. x 1.5..8.5 / 20 and y 1.5..8.5 / 10; with a ratio of 4
    # (no flip) 14 x 3.5: x -2..12 / 20 clipped to 0.
    proto = inputs_text({"data": (1, 1, 10, 20), "feat": (1, 1, 1, 2)}) + (
        'layer { name: "pb" type: "PriorBox" bottom: "feat" bottom: "data" top: "pb" '
        "prior_box_param { min_size: 7.9 aspect_ratio: 4 flip: false clip: true } }")
    net = Net(proto, phase=TEST)
    net.forward()
    boxes = net.blobs["pb"].data[0, 0].reshape(2, 2, 4)  # 2 cells of 2 priors
    np.testing.assert_allclose(boxes[0], [[0.075, 0.15, 0.425, 0.85],
                                          [0.0, 0.325, 0.6, 0.675]], rtol=1e-6)
    np.testing.assert_allclose(boxes[1, 0], [0.575, 0.15, 0.925, 0.85], rtol=1e-6)
    np.testing.assert_allclose(net.blobs["pb"].data[0, 1], 0.1, rtol=1e-6)  # default


PRIOR_CASES = {
    "two_sizes_flip_variance4": "min_size: 10 min_size: 20 max_size: 15 max_size: 30 "
                                "aspect_ratio: 2 flip: true clip: false variance: 0.1 "
                                "variance: 0.1 variance: 0.2 variance: 0.2",
    "clip_step_no_flip": "min_size: 8 aspect_ratio: 2 aspect_ratio: 3 flip: false clip: true "
                         "variance: 0.1 step: 8",
    "step_hw_offset_max": "min_size: 12 max_size: 21 aspect_ratio: 0.5 aspect_ratio: 2 "
                          "clip: false variance: 0.2 step_h: 5 step_w: 7 offset: 0.3",
}


@pytest.mark.parametrize("case", sorted(PRIOR_CASES))
def test_prior_box_matches_opencv(tmp_path, case):
    feeds = {"data": np.zeros((1, 3, 30, 20), np.float32),
             "feat": np.zeros((1, 4, 3, 2), np.float32)}
    ours, theirs = run_both(tmp_path, prior_net(PRIOR_CASES[case]), feeds, ["pb"])
    assert_close(ours["pb"], theirs["pb"], case)


# OpenCV departs from the fork here (it always reads the image's shape, keeps fractional
# sizes, needs a variance and clips by default): checked against the fork's rule instead.
FORK_ONLY = {
    "img_size": ("min_size: 10 max_size: 20 aspect_ratio: 2 img_size: 64 variance: 0.1",
                 dict(img_h=64, img_w=64, min_sizes=[10], max_sizes=[20], ratios=[2])),
    "img_h_img_w": ("min_size: 9 aspect_ratio: 3 flip: false img_h: 50 img_w: 40 clip: true",
                    dict(img_h=50, img_w=40, min_sizes=[9], ratios=[3], flip=False,
                         clip=True)),
    "fractional_sizes": ("min_size: 7.5 max_size: 15.9 aspect_ratio: 2 aspect_ratio: 0.5 "
                         "aspect_ratio: 2",
                         dict(min_sizes=[7.5], max_sizes=[15.9], ratios=[2, 0.5, 2])),
    "defaults": ("min_size: 6 min_size: 11", dict(min_sizes=[6, 11])),
}


@pytest.mark.parametrize("case", sorted(FORK_ONLY))
def test_prior_box_fork_rules(case):
    params, kw = FORK_ONLY[case]
    kw = {"img_h": 30, "img_w": 20, **kw}
    net = Net(prior_net(params), phase=TEST)
    net.forward()
    want = fork_prior_box(3, 2, **{k: ([f32(x) for x in v] if isinstance(v, list) else v)
                                   for k, v in kw.items()})
    assert_close(net.blobs["pb"].data, want, case)


# -- Normalize -----------------------------------------------------------------------------

def normalize_layer(across: bool, shared: bool, extra: str = "") -> str:
    return (f"norm_param {{ across_spatial: {str(across).lower()} channel_shared: "
            f"{str(shared).lower()} {extra} }}")


def set_scale(net: Net, layer: str = "norm") -> None:
    scale = net.params[layer][0].data
    scale[...] = np.random.default_rng(3).uniform(0.5, 3.0, scale.shape)


@pytest.mark.parametrize("across,shared,eps", [(True, True, None), (False, True, None),
                                               (False, False, None), (True, True, 0.5),
                                               (False, False, 0.5)])
def test_normalize_matches_opencv(tmp_path, across, shared, eps):
    extra = "" if eps is None else f"eps: {eps}"
    proto = inputs_text({"data": (2, 4, 3, 5)}) + (
        'layer { name: "norm" type: "Normalize" bottom: "data" top: "norm" '
        f"{normalize_layer(across, shared, extra)} }}\n")
    x = np.random.default_rng(0).standard_normal((2, 4, 3, 5)).astype(np.float32)
    ours, theirs = run_both(tmp_path, proto, {"data": x}, ["norm"], setup=set_scale)
    assert_close(ours["norm"], theirs["norm"], "norm")


def test_normalize_across_spatial_per_channel_scale():
    # OpenCV cannot run this combination (it asks the scale to have C*H*W values); the
    # fork's rule: x / sqrt(sum over the sample of x^2 + eps), times each channel's scale.
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 2))
    layer = layer_spec("norm", "Normalize", ["x"], ["y"], normalize_layer(True, False))
    net = Net(f'layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ '
              f'dim: 2 dim: 3 dim: 4 dim: 2 }} }} }}\nlayer {{ {layer} }}', phase=TEST,
              dtype="float64")
    net.params["norm"][0].data[...] = [0.5, 2.0, -1.5]
    net.forward(x=x)
    for n in range(2):
        norm = math.sqrt(sum(v * v for v in x[n].reshape(-1)) + f32(1e-10))
        for c, s in enumerate([0.5, 2.0, -1.5]):
            np.testing.assert_allclose(net.blobs["y"].data[n, c], x[n, c] / norm * s,
                                       rtol=1e-12)


@pytest.mark.parametrize("across", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_normalize_gradients(across, shared):
    filler = 'scale_filler { type: "uniform" min: 0.5 max: 2.5 }'
    layer = layer_spec("norm", "Normalize", ["x"], ["y"],
                       normalize_layer(across, shared, filler))
    net = check_gradients(layer, {"x": np.random.default_rng(2).standard_normal((2, 3, 2, 3))})
    assert net.params["norm"][0].data.shape == (() if shared else (3,))


# -- Permute -------------------------------------------------------------------------------

@pytest.mark.parametrize("order,shape,full", [
    ([0, 2, 3, 1], (2, 3, 4, 5), (0, 2, 3, 1)),
    ([1], (2, 3, 4, 5), (1, 0, 2, 3)),         # the axes not named follow in order
    ([2, 0], (3, 4, 5), (2, 0, 1)),
])
def test_permute_matches_transpose_and_gradient(order, shape, full):
    x = np.random.default_rng(4).standard_normal(shape)
    params = "permute_param { " + " ".join(f"order: {o}" for o in order) + " }"
    layer = layer_spec("perm", "Permute", ["x"], ["y"], params)
    net = check_gradients(layer, {"x": x})
    np.testing.assert_array_equal(net.blobs["y"].data, np.transpose(x, full))


def test_permute_identity_shares_the_bottom():
    x = np.random.default_rng(5).standard_normal((2, 3, 2))
    layer = layer_spec("perm", "Permute", ["x"], ["y"], "permute_param { order: 0 order: 1 }")
    net = check_gradients(layer, {"x": x})
    np.testing.assert_array_equal(net.blobs["y"].data, x)


# -- DetectionOutput -----------------------------------------------------------------------

def detection_inputs(n=2, p=60, classes=4, share=True, variance=(0.1, 0.1, 0.2, 0.2),
                     vit=False, seed=0):
    """Random priors inside the image, location offsets, and softmax confidences."""
    rng = np.random.default_rng(seed)
    centres, sizes = rng.uniform(0.1, 0.9, (p, 2)), rng.uniform(0.1, 0.4, (p, 2))
    boxes = np.concatenate([centres - sizes / 2, centres + sizes / 2], axis=1)
    rows = [boxes.reshape(-1)] + ([] if vit else [np.tile(variance, p)])
    prior = np.stack(rows)[None].astype(np.float32)
    loc = (rng.standard_normal((n, p * (1 if share else classes) * 4)) * 0.5)
    logits = rng.standard_normal((n, p, classes)) * 2
    conf = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    return loc.astype(np.float32), conf.reshape(n, -1).astype(np.float32), prior


def detection_proto(shapes, num_classes, share=True, bg=0, code="CENTER_SIZE", vit=False,
                    keep=-1, conf_th=None, nms="nms_threshold: 0.45"):
    threshold = "" if conf_th is None else f"confidence_threshold: {conf_th}"
    return inputs_text(shapes) + (
        'layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" '
        f'bottom: "prior" top: "det" detection_output_param {{ num_classes: {num_classes} '
        f"share_location: {str(share).lower()} background_label_id: {bg} nms_param {{ {nms} "
        f"}} code_type: {code} variance_encoded_in_target: {str(vit).lower()} "
        f"keep_top_k: {keep} {threshold} }} }}\n")


# OpenCV 4.14 crashes without a keep_top_k, knows no CORNER_SIZE and ignores eta: those
# are checked against the transcription only (DETECTION_FORK below).
DETECTION_OPENCV = {
    "center_size": dict(keep=100, conf_th=0.3),
    "no_threshold": dict(keep=100),
    "keep_top_k": dict(keep=10, conf_th=0.3),
    "per_class_loc": dict(share=False, keep=100, conf_th=0.3),
    "background_2": dict(bg=2, keep=100, conf_th=0.3),
    "corner": dict(code="CORNER", keep=100, conf_th=0.3),
    "variance_in_target": dict(vit=True, keep=100, conf_th=0.3),
    "nms_top_k": dict(keep=100, conf_th=0.3, nms="nms_threshold: 0.45 top_k: 5"),
    "uniform_variance": dict(keep=50, conf_th=0.2, variance=(0.1,) * 4),
    "no_background_per_class": dict(share=False, bg=-1, code="CORNER", vit=True, keep=30,
                                    conf_th=0.2),
}


def _detection_case(kw):
    kw = dict(kw)
    variance = kw.pop("variance", (0.1, 0.1, 0.2, 0.2))
    loc, conf, prior = detection_inputs(share=kw.get("share", True), variance=variance,
                                        vit=kw.get("vit", False))
    shapes = {"loc": loc.shape, "conf": conf.shape, "prior": prior.shape}
    feeds = {"loc": loc, "conf": conf, "prior": prior}
    return kw, shapes, feeds


def _fork_kwargs(kw, nms_threshold=0.45, eta=1.0, top_k=-1):
    return dict(share_location=kw.get("share", True), background_label_id=kw.get("bg", 0),
                code=kw.get("code", "CENTER_SIZE"), vit=kw.get("vit", False),
                keep_top_k=kw.get("keep", -1),
                confidence_threshold=f32(kw["conf_th"]) if "conf_th" in kw else -math.inf,
                nms_threshold=f32(nms_threshold), eta=f32(eta), top_k=top_k)


@pytest.mark.parametrize("case", sorted(DETECTION_OPENCV))
def test_detection_output_matches_opencv_and_fork(tmp_path, case):
    kw, shapes, feeds = _detection_case(DETECTION_OPENCV[case])
    ours, theirs = run_both(tmp_path, detection_proto(shapes, 4, **kw), feeds, ["det"])
    rows = ours["det"]
    assert rows.shape[:2] == (1, 1) and rows.shape[3] == 7 and rows.shape[2] > 0
    assert_close(row_set(rows), row_set(opencv_rows(theirs["det"])), case)
    top_k = 5 if "top_k" in kw.get("nms", "") else -1
    want = fork_detection_output(*(f.astype(np.float64) for f in feeds.values()), 4,
                                 **_fork_kwargs(kw, top_k=top_k))
    assert_close(rows[0, 0], want, case)  # the fork's row order too


DETECTION_FORK = {
    "corner_size": dict(code="CORNER_SIZE", keep=40, conf_th=0.2),
    "corner_size_in_target": dict(code="CORNER_SIZE", vit=True, keep=40, conf_th=0.2),
    "eta": dict(conf_th=0.1, nms_threshold=0.7, eta=0.8, keep=200),
    "keep_all": dict(conf_th=0.25),
    "top_k_and_keep": dict(conf_th=0.05, top_k=7, keep=12, share=False, bg=3),
}


@pytest.mark.parametrize("case", sorted(DETECTION_FORK))
def test_detection_output_fork_rules(case):
    kw = dict(DETECTION_FORK[case])
    nms_kw = {k: kw.pop(k) for k in ("nms_threshold", "eta", "top_k") if k in kw}
    loc, conf, prior = (a.astype(np.float64) for a in detection_inputs(
        share=kw.get("share", True), vit=kw.get("vit", False), seed=1))
    fkw = _fork_kwargs(kw, **nms_kw)
    got = det.detection_output(loc, conf, prior, num_classes=4,
                               code_type=CODES[fkw.pop("code")],
                               variance_encoded_in_target=fkw.pop("vit"), **fkw)
    want = fork_detection_output(loc, conf, prior, 4, code=kw.get("code", "CENTER_SIZE"),
                                 vit=kw.get("vit", False), **fkw)
    assert got.shape[0] > 1
    assert_close(got, want, case)


def test_detection_output_shared_location_without_background():
    # The fork (and OpenCV) stop on share_location with background_label_id -1: decoding
    # skips the shared label -1 as if it were the background. Here it equals per-class
    # locations that repeat the shared ones, which the fork runs.
    loc, conf, prior = (a.astype(np.float64) for a in detection_inputs(seed=2))
    kw = dict(num_classes=4, background_label_id=-1, code_type=2, keep_top_k=30,
              confidence_threshold=0.2, nms_threshold=0.45)
    got = det.detection_output(loc, conf, prior, share_location=True, **kw)
    per_class = np.repeat(loc.reshape(2, -1, 1, 4), 4, axis=2).reshape(2, -1)
    want = fork_detection_output(per_class, conf, prior, 4, share_location=False,
                                 background_label_id=-1, code="CENTER_SIZE", keep_top_k=30,
                                 confidence_threshold=f32(0.2), nms_threshold=f32(0.45))
    assert {int(c) for c in got[:, 1]} >= {0}
    assert_close(got, want, "no background")


def test_detection_output_rows_follow_each_pass():
    # The row count differs from one input to the next: the net settles the top's shape at
    # each forward; with nothing above the threshold, one (i, -1, ...) row per image.
    loc, conf, prior = detection_inputs(n=2, p=40, classes=3, seed=4)
    shapes = {"loc": loc.shape, "conf": conf.shape, "prior": prior.shape}
    net = Net(detection_proto(shapes, 3, keep=15, conf_th=0.35), phase=TEST)
    for scale in (1.0, 0.8, 0.0):
        c = conf * scale
        net.forward(loc=loc, conf=c, prior=prior)
        want = fork_detection_output(loc.astype(np.float64), c.astype(np.float64),
                                     prior.astype(np.float64), 3, code="CENTER_SIZE",
                                     keep_top_k=15, confidence_threshold=f32(0.35),
                                     nms_threshold=f32(0.45))
        assert_close(net.blobs["det"].data[0, 0], want, f"scale {scale}")
    np.testing.assert_array_equal(net.blobs["det"].data[0, 0],
                                  [[0, -1, -1, -1, -1, -1, -1], [1, -1, -1, -1, -1, -1, -1]])


# -- box kernels by hand -------------------------------------------------------------------

def test_jaccard_by_hand():
    a = np.array([[0.0, 0.0, 1.0, 1.0], [0.2, 0.2, 0.4, 0.3]])
    b = np.array([[0.5, 0.0, 1.5, 1.0], [1.0, 0.0, 2.0, 1.0], [0.6, 0.0, 0.5, 1.0]])
    # half overlap: 0.5 / 1.5; touching: 0; inverted box: 0; disjoint: 0
    np.testing.assert_allclose(det.jaccard(a, b), [[1 / 3, 0, 0], [0, 0, 0]], rtol=1e-12)


@pytest.mark.parametrize("code", sorted(CODES))
@pytest.mark.parametrize("vit", [False, True])
def test_encode_inverts_decode(code, vit):
    rng = np.random.default_rng(6)
    priors = np.concatenate([rng.uniform(0.1, 0.4, (5, 2)), rng.uniform(0.6, 0.9, (5, 2))], 1)
    var = np.tile([0.1, 0.1, 0.2, 0.2], (5, 1))
    loc = rng.standard_normal((3, 5, 4)) * 0.3
    boxes = det.decode_boxes(loc, priors, var, code_type=CODES[code],
                             variance_encoded_in_target=vit)
    want = [[fork_decode(priors[j], var[j], code, vit, loc[i, j]) for j in range(5)]
            for i in range(3)]
    np.testing.assert_allclose(boxes, want, rtol=1e-12)
    back = det.encode_boxes(boxes, priors, var, code_type=CODES[code],
                            variance_encoded_in_target=vit)
    np.testing.assert_allclose(back, loc, rtol=1e-9, atol=1e-12)


def test_nms_by_hand():
    boxes = np.array([[0, 0, 1, 1], [0, 0, 1, 0.9], [0, 0.5, 1, 1.5], [2, 2, 3, 3]], float)
    scores = np.array([0.9, 0.8, 0.7, 0.1])
    # box 1 overlaps box 0 by 0.9 (dropped); box 2 by 1/3 (kept at 0.45); box 3 is below
    # the score threshold.
    np.testing.assert_array_equal(
        det.nms(boxes, scores, nms_threshold=0.45, score_threshold=0.2), [0, 2])
    np.testing.assert_array_equal(det.nms(boxes, scores, nms_threshold=0.3), [0, 3])
    np.testing.assert_array_equal(det.nms(boxes, scores, nms_threshold=0.95, top_k=2), [0, 1])


# -- a small SSD head ----------------------------------------------------------------------

GAUSS = 'weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "gaussian" std: 0.1 }'


def _head(src: str, name: str, priors: int, classes: int) -> str:
    out = []
    # Small confidence weights keep the softmax near uniform, so a threshold just above
    # 1 / classes keeps some boxes and drops most.
    for kind, per, std in (("loc", 4, 0.2), ("conf", classes, 0.01)):
        fill = f'weight_filler {{ type: "gaussian" std: {std} }}'
        out.append(f"""
layer {{ name: "{name}_{kind}" type: "Convolution" bottom: "{src}" top: "{name}_{kind}"
  convolution_param {{ num_output: {priors * per} kernel_size: 3 pad: 1 {fill} }} }}
layer {{ name: "{name}_{kind}_perm" type: "Permute" bottom: "{name}_{kind}"
  top: "{name}_{kind}_perm" permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}
layer {{ name: "{name}_{kind}_flat" type: "Flatten" bottom: "{name}_{kind}_perm"
  top: "{name}_{kind}_flat" flatten_param {{ axis: 1 }} }}""")
    return "".join(out)


def ssd_proto(classes: int = 4) -> str:
    # Map 1 (8 x 8): 6 priors (two min sizes, each with its max size and ratio 2 unflipped),
    # clipped, the step from the image; map 2 (4 x 4): 4 priors (ratio 2 flipped), a step
    # of 7 (the image's would be 8), not clipped.
    return inputs_text({"data": (2, 3, 32, 32)}) + f"""
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 8 kernel_size: 3 pad: 1 stride: 4 {GAUSS} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "conv1_norm" type: "Normalize" bottom: "conv1" top: "conv1_norm"
  norm_param {{ across_spatial: false channel_shared: false
    scale_filler {{ type: "constant" value: 20 }} }} }}
layer {{ name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param {{ num_output: 8 kernel_size: 3 pad: 1 stride: 2 {GAUSS} }} }}
{_head("conv1_norm", "m1", 6, classes)}
{_head("conv2", "m2", 4, classes)}
layer {{ name: "m1_prior" type: "PriorBox" bottom: "conv1_norm" bottom: "data" top: "m1_prior"
  prior_box_param {{ min_size: 6 min_size: 10 max_size: 10 max_size: 16 aspect_ratio: 2
    flip: false clip: true variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 }} }}
layer {{ name: "m2_prior" type: "PriorBox" bottom: "conv2" bottom: "data" top: "m2_prior"
  prior_box_param {{ min_size: 16 max_size: 28 aspect_ratio: 2 flip: true clip: false
    step: 7 offset: 0.5 variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 }} }}
layer {{ name: "mbox_loc" type: "Concat" bottom: "m1_loc_flat" bottom: "m2_loc_flat"
  top: "mbox_loc" concat_param {{ axis: 1 }} }}
layer {{ name: "mbox_conf" type: "Concat" bottom: "m1_conf_flat" bottom: "m2_conf_flat"
  top: "mbox_conf" concat_param {{ axis: 1 }} }}
layer {{ name: "mbox_priorbox" type: "Concat" bottom: "m1_prior" bottom: "m2_prior"
  top: "mbox_priorbox" concat_param {{ axis: 2 }} }}
layer {{ name: "mbox_conf_reshape" type: "Reshape" bottom: "mbox_conf"
  top: "mbox_conf_reshape" reshape_param {{ shape {{ dim: 0 dim: -1 dim: {classes} }} }} }}
layer {{ name: "mbox_conf_softmax" type: "Softmax" bottom: "mbox_conf_reshape"
  top: "mbox_conf_softmax" softmax_param {{ axis: 2 }} }}
layer {{ name: "mbox_conf_flatten" type: "Flatten" bottom: "mbox_conf_softmax"
  top: "mbox_conf_flatten" flatten_param {{ axis: 1 }} }}
layer {{ name: "detection_out" type: "DetectionOutput" bottom: "mbox_loc"
  bottom: "mbox_conf_flatten" bottom: "mbox_priorbox" top: "detection_out"
  detection_output_param {{ num_classes: {classes} share_location: true
    background_label_id: 0 nms_param {{ nms_threshold: 0.45 top_k: 100 }}
    code_type: CENTER_SIZE keep_top_k: 22 confidence_threshold: 0.55 }} }}
"""


def test_ssd_head_matches_opencv(tmp_path):
    x = np.random.default_rng(8).standard_normal((2, 3, 32, 32)).astype(np.float32)
    tops = ["conv1_norm", "m1_loc_perm", "m1_conf_flat", "m1_prior", "m2_prior", "mbox_loc",
            "mbox_conf_flatten", "mbox_priorbox", "detection_out"]
    ours, theirs = run_both(tmp_path, ssd_proto(), {"data": x}, tops)
    assert ours["m1_prior"].shape == (1, 2, 8 * 8 * 6 * 4)
    assert ours["m2_prior"].shape == (1, 2, 4 * 4 * 4 * 4)
    for t in tops[:-1]:
        assert_close(ours[t], theirs[t], t)
    rows = ours["detection_out"][0, 0]
    assert_close(row_set(rows), row_set(opencv_rows(theirs["detection_out"])), "rows")
    want = fork_detection_output(*(ours[t].astype(np.float64) for t in tops[5:8]), 4,
                                 code="CENTER_SIZE", keep_top_k=22,
                                 confidence_threshold=f32(0.55), nms_threshold=f32(0.45),
                                 top_k=100)
    assert_close(rows, want, "rows in the fork's order")
    # The threshold keeps some boxes of each image; keep_top_k caps the second one.
    counts = [int((rows[:, 0] == i).sum()) for i in (0, 1)]
    assert 0 < counts[0] < 22 and counts[1] == 22, counts
    assert (rows[:, 2] > f32(0.55)).all()


# -- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("proto,message", [
    (prior_net("aspect_ratio: 2"), "min_size is required"),
    (prior_net("min_size: 4 variance: 0.1 variance: 0.2"), "1 or 4 values"),
    (prior_net("min_size: 4 max_size: 3"), "greater than its min_size"),
    # a long fuzz run's find: flip divided by it (ZeroDivisionError)
    (prior_net("min_size: 4 aspect_ratio: 0 flip: true"),
     r"aspect_ratio must be positive and finite, got 0\.0"),
    (prior_net("min_size: 4 aspect_ratio: inf"), "aspect_ratio must be positive and finite"),
    # the next long run's find: int(inf) for the fork's integer sizes (OverflowError)
    (prior_net("min_size: 3 max_size: inf"),
     r"max_size must be positive and below 2147483648, got inf"),
    (prior_net("min_size: 3e10"), r"min_size must be positive and below 2147483648"),
    (prior_net("min_size: 4 step: inf"), r"step must be positive and finite, got inf"),
    (prior_net("min_size: 4 step: 2 step_h: 3 step_w: 3"), "either step or step_h"),
    (inputs_text({"feat": (1, 2, 3, 3)}) + 'layer { name: "pb" type: "PriorBox" '
     'bottom: "feat" top: "pb" prior_box_param { min_size: 4 } }', "needs the image"),
    (inputs_text({"x": (2, 3, 4)}) + 'layer { name: "p" type: "Permute" bottom: "x" top: "y" '
     "permute_param { order: 1 order: 1 } }", "names axis 1 twice"),
    (inputs_text({"x": (2, 3, 4)}) + 'layer { name: "p" type: "Permute" bottom: "x" top: "y" '
     "permute_param { order: 3 } }", "out of range"),
    (inputs_text({"x": (2,)}) + 'layer { name: "n" type: "Normalize" bottom: "x" top: "y" }',
     "at least 2 axes"),
    (detection_proto({"loc": (1, 40), "conf": (1, 40), "prior": (1, 2, 36)}, 4),
     "must hold 36 location predictions"),
    (detection_proto({"loc": (1, 40), "conf": (1, 40), "prior": (1, 1, 40)}, 4),
     "boxes and variances"),
    (inputs_text({"loc": (1, 40), "conf": (1, 40), "prior": (1, 2, 40)}) + 'layer { name: "d" '
     'type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "d" }',
     "num_classes is required"),
])
def test_errors(proto, message):
    with pytest.raises(LayerError, match=message):
        Net(proto, phase=TEST)
