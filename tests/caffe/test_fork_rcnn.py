"""The R-CNN forks' layers: ROIPooling, PSROIPooling and Proposal against OpenCV's Caffe
importer on seeded inputs (several spatial scales, ROIs over the borders and off the map) and
against hand-computed values; SmoothL1Loss against hand-computed values and a numpy
transcription of py-faster-rcnn's rule; float64 gradient checks; Dropout's scale_train."""

from __future__ import annotations

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.errors import LayerError, PurineError
from tests.gradcheck import check_gradients, forward_layer, layer_net, layer_spec

SCALES = [1.0, 0.5, 0.3, 0.0625]


def random_rois(rng: np.random.Generator, count: int, batch: int, height: int, width: int,
                scale: float) -> np.ndarray:
    """ROIs in image coordinates over a (height, width) map at ``scale``: random boxes
    reaching past every border, plus a reversed box (forced to 1x1), a point, one box off
    the map and one covering it exactly."""
    h, w = height / scale, width / scale
    rows = []
    for _ in range(count):
        x1, x2 = np.sort(rng.uniform(-0.3 * w, 1.3 * w, 2))
        y1, y2 = np.sort(rng.uniform(-0.3 * h, 1.3 * h, 2))
        rows.append([rng.integers(batch), x1, y1, x2, y2])
    rows += [[batch - 1, 0.6 * w, 0.7 * h, 0.2 * w, 0.1 * h], [0, 0, 0, 0, 0],
             [batch - 1, 2 * w, 2 * h, 3 * w, 3 * h], [0, 0, 0, w - 1, h - 1]]
    return np.array(rows, dtype=np.float32)


def opencv_forward(tmp_path, inputs: dict[str, np.ndarray], layers: str,
                   outputs: list[str]) -> list[np.ndarray]:
    """OpenCV's outputs for Input layers of ``inputs`` followed by ``layers`` (no weights)."""
    cv2 = pytest.importorskip("cv2")
    if not hasattr(cv2, "dnn") or not hasattr(cv2.dnn, "readNetFromCaffe"):
        pytest.skip("this OpenCV has no Caffe importer")
    path = tmp_path / "cv.prototxt"
    path.write_text(layer_net(layers, {n: v.shape for n, v in inputs.items()}, False))
    net = cv2.dnn.readNetFromCaffe(str(path))
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    for name, value in inputs.items():
        net.setInput(value, name)
    return list(net.forward(outputs))


def ours_forward(inputs: dict[str, np.ndarray], layers: str, outputs: list[str],
                 phase: int = TEST) -> list[np.ndarray]:
    net = Net(layer_net(layers, {n: v.shape for n, v in inputs.items()}, False), phase=phase)
    got = net.forward(blobs=outputs, **inputs)
    return [np.array(got[n]) for n in outputs]


def assert_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    scale = max(float(np.abs(theirs).max()), 1e-30)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * scale)


def roi_layer(scale: float, pooled_h: int = 3, pooled_w: int = 4, rois: str = "rois") -> str:
    return layer_spec("pool", "ROIPooling", ["data", rois], ["pool"],
                      f"roi_pooling_param {{ pooled_h: {pooled_h} pooled_w: {pooled_w} "
                      f"spatial_scale: {scale} }}")


def psroi_layer(scale: float, dim: int = 2, group: int = 3) -> str:
    return layer_spec("pool", "PSROIPooling", ["data", "rois"], ["pool"],
                      f"psroi_pooling_param {{ spatial_scale: {scale} output_dim: {dim} "
                      f"group_size: {group} }}")


# -- ROIPooling ----------------------------------------------------------------------------
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("pooled", [(3, 4), (7, 7), (1, 1)])
def test_roi_pooling_matches_opencv(tmp_path, scale, pooled):
    rng = np.random.default_rng(int(scale * 1000) + pooled[0])
    x = rng.standard_normal((2, 5, 9, 11)).astype(np.float32)
    rois = random_rois(rng, 14, 2, 9, 11, scale)
    inputs = {"data": x, "rois": rois}
    layer = roi_layer(scale, *pooled)
    (ours,) = ours_forward(inputs, layer, ["pool"])
    (theirs,) = opencv_forward(tmp_path, inputs, layer, ["pool"])
    assert_close(ours, theirs)


X16 = np.arange(16, dtype=np.float64).reshape(1, 1, 4, 4)  # value 4 * row + column


def test_roi_pooling_hand_values():
    rois = np.array([[0, 0, 0, 3, 3],      # the whole map in 2 x 2 bins: quadrant maxima
                     [0, 1, 1, 5, 3],      # * 0.5 -> (0.5, 0.5, 2.5, 1.5) -> cells (1, 1)-(3, 2)
                     [0, 20, 20, 30, 30],  # off the map: empty bins are 0
                     [0, 6, 6, 2, 2]])     # reversed: one cell, at (3, 3)
    layer = roi_layer(1.0, 2, 2)
    net = forward_layer(layer, data=X16, rois=rois[:1])
    np.testing.assert_array_equal(net.blobs["pool"].data[0, 0], [[5, 7], [13, 15]])
    # scale 0.5 and 1 x 2 bins: ROI rows 1-2, columns 1-3; bin width 1.5 -> columns
    # [floor(0), ceil(1.5)) = 1-2 and [floor(1.5), ceil(3)) = 2-3 of it
    net = forward_layer(roi_layer(0.5, 1, 2), data=X16, rois=rois[1:])
    got = net.blobs["pool"].data[:, 0]
    np.testing.assert_array_equal(got[0], [[10, 11]])
    np.testing.assert_array_equal(got[1], [[0, 0]])
    np.testing.assert_array_equal(got[2], [[15, 15]])  # 1 x 1 ROI: both bins read (3, 3)


def test_roi_pooling_backward_routes_to_argmax_and_sums_rois():
    rois = np.array([[0, 0, 0, 3, 3], [0, 2, 2, 3, 3]], dtype=np.float64)
    net = Net(layer_net(roi_layer(1.0, 2, 2), {"data": X16.shape, "rois": rois.shape}),
              phase=TRAIN, dtype="float64")
    net.forward(data=X16, rois=rois)
    dy = np.array([[[[1, 2], [3, 4]]], [[[10, 20], [30, 40]]]], dtype=np.float64)
    dx = net.backward(pool=dy)["data"][0, 0]
    want = np.zeros((4, 4))
    want[1, 1], want[1, 3], want[3, 1] = 1, 2, 3
    want[2, 2], want[2, 3], want[3, 2] = 10, 20, 30
    want[3, 3] = 4 + 40  # the max of the first ROI's last bin and of the second ROI's
    np.testing.assert_array_equal(dx, want)


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.3])
def test_roi_pooling_gradient(scale):
    rng = np.random.default_rng(7)
    x = rng.permutation(2 * 3 * 6 * 7).reshape(2, 3, 6, 7) * 0.01  # distinct: no ties
    rois = random_rois(rng, 5, 2, 6, 7, scale).astype(np.float64)
    check_gradients(roi_layer(scale, 2, 3), {"data": x, "rois": rois}, check=["data"])


def test_roi_pooling_errors():
    x = np.zeros((1, 2, 4, 4))
    with pytest.raises(LayerError, match="pooled_h and pooled_w must be positive"):
        forward_layer(layer_spec("p", "ROIPooling", ["data", "rois"], ["p"],
                                 "roi_pooling_param { pooled_w: 2 }"), data=x,
                      rois=np.zeros((1, 5)))
    with pytest.raises(LayerError, match=r"one row of 5 values per ROI"):
        forward_layer(roi_layer(1.0), data=x, rois=np.zeros((3, 4)))
    with pytest.raises(PurineError, match=r"ROI 1 has batch index 2, outside \[0, 1\)"):
        forward_layer(roi_layer(1.0), data=x, rois=np.array([[0, 0, 0, 1, 1], [2, 0, 0, 1, 1]]))


# -- PSROIPooling --------------------------------------------------------------------------
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dim_group", [(2, 3), (3, 2), (1, 7)])
def test_psroi_pooling_matches_opencv(tmp_path, scale, dim_group):
    dim, group = dim_group
    rng = np.random.default_rng(int(scale * 1000) + group)
    x = rng.standard_normal((2, dim * group * group, 9, 11)).astype(np.float32)
    rois = random_rois(rng, 14, 2, 9, 11, scale)
    inputs = {"data": x, "rois": rois}
    layer = psroi_layer(scale, dim, group)
    (ours,) = ours_forward(inputs, layer, ["pool"])
    (theirs,) = opencv_forward(tmp_path, inputs, layer, ["pool"])
    assert_close(ours, theirs)


def test_psroi_pooling_hand_values():
    # 1 output channel, 2 x 2 groups: bin (ph, pw) reads channel 2 * ph + pw.
    x = np.stack([X16[0, 0] + 100 * k for k in range(4)])[None]
    # ROI (0, 0)-(3, 3): rounded, the far corner + 1 -> extent 4, bins of 2 cells.
    # ROI (0.4, 0.6)-(1.4, 2.2) -> corners 0, 1, 1, 2 -> start (0, 1), extent (2, 2) cells
    # -> bins of 1 x 1 at rows 1, 2 and columns 0, 1.
    rois = np.array([[0, 0, 0, 3, 3], [0, 0.4, 0.6, 1.4, 2.2], [0, 9, 9, 12, 12]])
    net = forward_layer(psroi_layer(1.0, 1, 2), data=x, rois=rois)
    got = net.blobs["pool"].data[:, 0]
    np.testing.assert_allclose(got[0], [[(0 + 1 + 4 + 5) / 4, 100 + (2 + 3 + 6 + 7) / 4],
                                        [200 + (8 + 9 + 12 + 13) / 4,
                                         300 + (10 + 11 + 14 + 15) / 4]])
    np.testing.assert_allclose(got[1], [[4, 105], [208, 309]])
    np.testing.assert_array_equal(got[2], 0)  # off the map: empty bins


def test_psroi_pooling_backward_spreads_over_bins():
    x = np.zeros((1, 4, 4, 4))
    rois = np.array([[0, 0, 0, 3, 3], [0, 0, 0, 1, 1]], dtype=np.float64)
    net = Net(layer_net(psroi_layer(1.0, 1, 2), {"data": x.shape, "rois": rois.shape}),
              phase=TRAIN, dtype="float64")
    net.forward(data=x, rois=rois)
    dy = np.array([[[[4, 8], [12, 16]]], [[[1, 2], [3, 5]]]], dtype=np.float64)
    dx = net.backward(pool=dy)["data"][0]
    want = np.zeros((4, 4, 4))
    want[0, :2, :2], want[1, :2, 2:], want[2, 2:, :2], want[3, 2:, 2:] = 1, 2, 3, 4
    # the second ROI's 2 x 2 cells: one cell per bin, each in its own channel
    want[0, 0, 0] += 1
    want[1, 0, 1] += 2
    want[2, 1, 0] += 3
    want[3, 1, 1] += 5
    np.testing.assert_allclose(dx, want)


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.3])
def test_psroi_pooling_gradient(scale):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 8, 6, 7))
    rois = random_rois(rng, 5, 2, 6, 7, scale).astype(np.float64)
    check_gradients(psroi_layer(scale, 2, 2), {"data": x, "rois": rois}, check=["data"])


def test_psroi_pooling_errors():
    rois = np.zeros((1, 5))
    with pytest.raises(LayerError, match=r"psroi_pooling_param.group_size is required"):
        forward_layer(layer_spec("p", "PSROIPooling", ["data", "rois"], ["p"],
                                 "psroi_pooling_param { spatial_scale: 1 output_dim: 2 }"),
                      data=np.zeros((1, 8, 3, 3)), rois=rois)
    with pytest.raises(LayerError, match=r"needs output_dim \* group_size\^2 = 2 \* 2\^2 = 8"):
        forward_layer(psroi_layer(1.0, 2, 2), data=np.zeros((1, 6, 3, 3)), rois=rois)


# -- SmoothL1Loss --------------------------------------------------------------------------
def smooth_l1_layer(bottoms: int = 2, sigma: float | None = None) -> str:
    names = ["pred", "target", "inside", "outside"][:bottoms]
    params = "" if sigma is None else f"smooth_l1_loss_param {{ sigma: {sigma} }}"
    return layer_spec("loss", "SmoothL1Loss", names, ["loss"], params)


def smooth_l1_reference(pred, target, sigma=1.0, inside=None, outside=None) -> float:
    """py-faster-rcnn's SmoothL1Loss forward, transcribed: d = w_in * (pred - target),
    f(d) = 0.5 sigma^2 d^2 if |d| < 1 / sigma^2 else |d| - 0.5 / sigma^2, times w_out,
    summed and divided by the batch size."""
    s2 = sigma * sigma
    d = pred - target
    if inside is not None:
        d = d * inside
    f = np.where(np.abs(d) < 1 / s2, 0.5 * s2 * d * d, np.abs(d) - 0.5 / s2)
    if outside is not None:
        f = f * outside
    return float(f.sum() / pred.shape[0])


def test_smooth_l1_hand_values():
    pred = np.array([[0.5, -2.0, 0.1, 3.0], [1.5, 0.0, -0.5, 0.25]])
    target = np.array([[0.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 1.0]])
    # sigma 1: 0.125 + 1.5 + 0.005 + 2.5 and 0.5 + 0 + 0.125 + 0.28125, over 2 images
    net = forward_layer(smooth_l1_layer(), pred=pred, target=target)
    assert float(net.blobs["loss"].data) == pytest.approx((4.13 + 0.90625) / 2, abs=1e-12)
    # sigma 3 (threshold 1/9): 0.5 - 1/18, 2 - 1/18, 4.5 * 0.01, 3 - 1/18 | 1 - 1/18, 0,
    # 0.5 - 1/18, 0.75 - 1/18
    net = forward_layer(smooth_l1_layer(sigma=3), pred=pred, target=target)
    want = (5.5 + 0.045 - 3 / 18 + 2.25 - 3 / 18) / 2
    assert float(net.blobs["loss"].data) == pytest.approx(want, abs=1e-12)
    # weights: inside 2 on (0, 0) makes d = 1 (|d| >= 1: 0.5), outside 0 drops (0, 1)
    inside, outside = np.ones_like(pred), np.ones_like(pred)
    inside[0, 0], outside[0, 1] = 2, 0
    net = forward_layer(smooth_l1_layer(4), pred=pred, target=target, inside=inside,
                        outside=outside)
    want = (0.5 + 0.005 + 2.5 + 0.90625) / 2
    assert float(net.blobs["loss"].data) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("sigma", [1.0, 3.0, 0.5])
def test_smooth_l1_matches_transcription(sigma):
    rng = np.random.default_rng(int(sigma * 10))
    shape = (3, 8, 2, 5)
    pred, target = rng.standard_normal(shape) * 2, rng.standard_normal(shape)
    inside, outside = rng.uniform(0, 2, shape), rng.uniform(0, 1, shape)
    net = forward_layer(smooth_l1_layer(4, sigma), pred=pred, target=target, inside=inside,
                        outside=outside)
    want = smooth_l1_reference(pred, target, sigma, inside, outside)
    assert float(net.blobs["loss"].data) == pytest.approx(want, rel=1e-12)


def away_from_kink(rng: np.random.Generator, shape, sigma: float, inside=None) -> tuple:
    """pred and target whose w_in * (pred - target) stays 0.05 or more from +-1 / sigma^2,
    where f' jumps (central differences straddling it would not match)."""
    pred, target = rng.standard_normal(shape), rng.standard_normal(shape)
    w = np.ones(shape) if inside is None else inside
    d = (pred - target) * w
    near = np.abs(np.abs(d) - 1 / sigma ** 2) < 0.05
    pred[near] = target[near] + np.sign(d[near]) * (1 / sigma ** 2 + 0.3) / w[near]
    return pred, target


@pytest.mark.parametrize("sigma", [1.0, 3.0])
@pytest.mark.parametrize("bottoms", [2, 4])
def test_smooth_l1_gradient(sigma, bottoms):
    rng = np.random.default_rng(bottoms)
    shape = (2, 4, 3, 2)
    inside = rng.uniform(0.5, 2, shape)
    pred, target = away_from_kink(rng, shape, sigma, inside if bottoms == 4 else None)
    blobs = {"pred": pred, "target": target}
    if bottoms == 4:
        blobs |= {"inside": inside, "outside": rng.uniform(0, 2, shape)}
    check_gradients(smooth_l1_layer(bottoms, sigma), blobs, check=["pred", "target"])


def test_smooth_l1_loss_weight_scales_gradient():
    pred, target = np.array([[0.5, -3.0]]), np.array([[0.0, 0.0]])
    spec = smooth_l1_layer() + " loss_weight: 2"
    net = Net(layer_net(spec, {"pred": pred.shape, "target": target.shape}), phase=TRAIN,
              dtype="float64")
    net.forward(pred=pred, target=target)
    got = net.backward()
    np.testing.assert_allclose(got["pred"], [[1.0, -2.0]])  # 2 * (0.5, sign(-3))
    np.testing.assert_allclose(got["target"], [[-1.0, 2.0]])


def test_smooth_l1_errors():
    a = np.zeros((2, 3))
    with pytest.raises(LayerError, match="give both inside and outside weights"):
        forward_layer(smooth_l1_layer(3), pred=a, target=a, inside=a)
    with pytest.raises(LayerError, match=r"must have the prediction's shape"):
        forward_layer(smooth_l1_layer(), pred=a, target=np.zeros((2, 4)))


# -- Proposal ------------------------------------------------------------------------------
def proposal_layer(stride=16, base=16, ratios=(0.5, 1, 2), scales=(8, 16, 32), pre=6000,
                   post=300, thresh=0.7) -> str:
    anchors = " ".join([f"ratio: {r}" for r in ratios] + [f"scale: {s}" for s in scales])
    return layer_spec("prop", "Proposal", ["scores", "deltas", "im_info"], ["rois", "sc"],
                      f"proposal_param {{ feat_stride: {stride} base_size: {base} "
                      f"min_size: 16 {anchors} pre_nms_topn: {pre} post_nms_topn: {post} "
                      f"nms_thresh: {thresh} }}")


PROPOSAL_CASES = {
    "faster_rcnn_defaults": (0, (5, 7), (80, 112), {}),
    "few_kept": (1, (6, 8), (90, 120), dict(ratios=(0.5, 1, 2), scales=(1, 2), pre=50,
                                            post=20, thresh=0.5)),
    "stride_8": (2, (4, 6), (30, 45), dict(stride=8, base=8, ratios=(1,), scales=(2, 4),
                                           pre=100, thresh=0.3)),
    "odd_sizes": (4, (5, 5), (47.9, 51.2), dict(stride=10, base=12, ratios=(0.7, 1.3),
                                                scales=(3, 5.5), pre=1000, post=40,
                                                thresh=0.45)),
    "non_positive_scores": (3, (7, 5), (100, 70), dict(ratios=(0.5, 2), scales=(4,), pre=60,
                                                       post=100, thresh=0.6)),
}


@pytest.mark.parametrize("case", sorted(PROPOSAL_CASES))
def test_proposal_matches_opencv(tmp_path, case):
    seed, (h, w), (im_h, im_w), k = PROPOSAL_CASES[case]
    rng = np.random.default_rng(seed)
    a = len(k.get("ratios", (0, 0, 0))) * len(k.get("scales", (0, 0, 0)))
    scores = rng.uniform(0, 1, (1, 2 * a, h, w)).astype(np.float32)
    if case == "non_positive_scores":  # OpenCV drops object scores <= 0 before sorting
        scores[0, a:][rng.random((a, h, w)) < 0.3] = 0
        scores[0, a:][rng.random((a, h, w)) < 0.2] = -0.5
    deltas = (rng.standard_normal((1, 4 * a, h, w)) * 0.3).astype(np.float32)
    inputs = {"scores": scores, "deltas": deltas,
              "im_info": np.array([[im_h, im_w, 1.0]], dtype=np.float32)}
    layer = proposal_layer(**k)
    rois, sc = ours_forward(inputs, layer, ["rois", "sc"])
    # OpenCV answers for a layer's first top only; its second goes through a Power layer
    # (layer_net closes the last layer's brace).
    identity = ' }\nlayer { name: "sc_out" type: "Power" bottom: "sc" top: "sc_out"'
    cv_rois, cv_sc = opencv_forward(tmp_path, inputs, layer + identity, ["prop", "sc_out"])
    kept = int((np.abs(cv_rois).sum(axis=1) > 0).sum())
    assert 0 < kept and int((np.abs(rois).sum(axis=1) > 0).sum()) == kept
    assert_close(rois, cv_rois)
    assert_close(sc, cv_sc)
    assert np.all(np.diff(sc[:kept, 0]) <= 0)  # by falling score


def test_proposal_hand_values():
    # One anchor (16 x 16) on a 1 x 2 map: anchors (0, 0)-(15, 15) and (16, 0)-(31, 15).
    # Decoding puts x2 at centre + width / 2 (one past the anchor's, as py-faster-rcnn):
    # (0, 0)-(16, 16) and (16, 0)-(32, 16), clipped to the 20 x 28 image: (16, 0)-(27, 16).
    scores = np.array([0.7, 0.1, 0.3, 0.9], dtype=np.float32).reshape(1, 2, 1, 2)
    deltas = np.zeros((1, 4, 1, 2), dtype=np.float32)
    info = np.array([[20, 28, 1]], dtype=np.float32)
    layer = proposal_layer(ratios=(1,), scales=(1,), post=3, thresh=0.7)
    inputs = {"scores": scores, "deltas": deltas, "im_info": info}
    rois, sc = ours_forward(inputs, layer, ["rois", "sc"])
    np.testing.assert_array_equal(rois, [[0, 16, 0, 27, 16], [0, 0, 0, 16, 16], [0] * 5])
    np.testing.assert_allclose(sc[:, 0], [0.9, 0.3, 0])
    # dx 0.5 moves the first by 8 to (8, 0)-(24, 16); it meets the other in 9 x 17 cells:
    # IoU 153 / (289 + 204 - 153) = 0.45, kept under threshold 0.7, suppressed under 0.3
    deltas[0, 0, 0, 0] = 0.5
    rois, _ = ours_forward(inputs, layer, ["rois", "sc"])
    np.testing.assert_array_equal(rois[:2], [[0, 16, 0, 27, 16], [0, 8, 0, 24, 16]])
    rois, _ = ours_forward(inputs, proposal_layer(ratios=(1,), scales=(1,), post=3,
                                                  thresh=0.3), ["rois", "sc"])
    np.testing.assert_array_equal(rois[:2], [[0, 16, 0, 27, 16], [0] * 5])


def test_proposal_errors():
    info = np.array([[20, 28, 1]])
    with pytest.raises(LayerError, match=r"must be \(1, 2 \* 9, H, W\)"):
        forward_layer(proposal_layer(), TEST, scores=np.zeros((1, 4, 2, 2)),
                      deltas=np.zeros((1, 8, 2, 2)), im_info=info)
    with pytest.raises(LayerError, match=r"must be \(1, 36, 2, 2\)"):
        forward_layer(proposal_layer(), TEST, scores=np.zeros((1, 18, 2, 2)),
                      deltas=np.zeros((1, 36, 2, 3)), im_info=info)


# -- Dropout with scale_train: false -------------------------------------------------------
def dropout_layer(ratio: float, scale_train: bool | None, in_place: bool = False) -> str:
    flag = "" if scale_train is None else f" scale_train: {str(scale_train).lower()}"
    top = "x" if in_place else "y"
    return layer_spec("drop", "Dropout", ["x"], [top],
                      f"dropout_param {{ dropout_ratio: {ratio}{flag} }}")


@pytest.mark.parametrize("in_place", [False, True])
def test_dropout_scale_train_false_test_phase(in_place):
    x = np.array([[1.0, 2.0, -4.0, 0.5]])
    spec = dropout_layer(0.25, False, in_place)
    net = Net(layer_net(spec, {"x": x.shape}), phase=TEST, dtype="float64")
    top = "x" if in_place else "y"
    net.forward(x=x)
    np.testing.assert_array_equal(net.blobs[top].data, [[0.75, 1.5, -3.0, 0.375]])
    got = net.backward(**{top: np.array([[4.0, -8.0, 1.0, 2.0]])})
    np.testing.assert_array_equal(got["x"], [[3.0, -6.0, 0.75, 1.5]])
    # scale_train true (the default) stays the identity at test time
    net = forward_layer(dropout_layer(0.25, None), TEST, x=x)
    np.testing.assert_array_equal(net.blobs["y"].data, x)


def test_dropout_scale_train_false_train_phase():
    x = np.arange(1, 2001, dtype=np.float64).reshape(4, 500)
    net = Net(layer_net(dropout_layer(0.3, False), {"x": x.shape}), phase=TRAIN,
              dtype="float64", seed=3)
    net.forward(x=x)
    y = net.blobs["y"].data.copy()
    kept = y != 0
    np.testing.assert_array_equal(y[kept], x[kept])  # unscaled
    assert abs(kept.mean() - 0.7) < 0.03
    dy = np.full(x.shape, 5.0)
    np.testing.assert_array_equal(net.backward(y=dy)["x"], np.where(kept, 5.0, 0.0))
    # scale_train true with the same seed draws the same mask and scales by 1 / 0.7
    net = Net(layer_net(dropout_layer(0.3, True), {"x": x.shape}), phase=TRAIN,
              dtype="float64", seed=3)
    net.forward(x=x)
    keep = 1 - float(np.float32(0.3))  # the prototxt's ratio is a float32
    np.testing.assert_allclose(net.blobs["y"].data, np.where(kept, x / keep, 0), rtol=1e-15)


def test_dropout_scale_train_false_matches_opencv(tmp_path):
    x = np.random.default_rng(5).standard_normal((2, 3, 4)).astype(np.float32)
    layer = dropout_layer(0.4, False)
    (ours,) = ours_forward({"x": x}, layer, ["y"])
    (theirs,) = opencv_forward(tmp_path, {"x": x}, layer, ["drop"])  # OpenCV: layer names
    assert_close(ours, theirs)
    np.testing.assert_allclose(ours, x * np.float32(0.6), rtol=1e-6)


def test_rois_from_a_learning_branch_get_a_zero_gradient():
    """ROIs computed by a layer with a learned parameter need a gradient: ROIPooling gives
    them zeros (the fork never differentiates its ROIs), so the scale's gradient is 0."""
    proto = layer_net(layer_spec("scale", "Scale", ["rois"], ["scaled"],
                                 'scale_param { axis: 0 num_axes: 0 '
                                 'filler { type: "constant" value: 1 } }'),
                      {"data": X16.shape, "rois": (1, 5)})
    proto += f"layer {{ {roi_layer(1.0, 2, 2, rois='scaled')} }}\n"
    net = Net(proto, phase=TRAIN, dtype="float64")
    net.forward(data=X16, rois=np.array([[0.0, 0, 0, 3, 3]]))
    np.testing.assert_array_equal(net.blobs["pool"].data[0, 0], [[5, 7], [13, 15]])
    net.backward(pool=np.ones((1, 1, 2, 2)))
    np.testing.assert_array_equal(net.blobs["scaled"].diff, 0)
    np.testing.assert_array_equal(net.params["scale"][0].diff, 0)
