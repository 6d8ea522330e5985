"""MultinomialLogisticLoss, InfogainLoss and ContrastiveLoss: forward values against numbers
worked by hand and against plain loop transcriptions of Caffe's CPU code, float64 gradient
checks over parameter tables, H read from a .binaryproto or a bottom, and the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from purine import backend
from purine.caffe import TEST, TRAIN, Net
from purine.errors import LabelError, LayerError
from purine.formats import caffe_pb2 as pb
from purine.ops import loss as ls
from tests.gradcheck import check_gradients, forward_layer, layer_net, random_labels

RNG = np.random.default_rng(4321)
# Caffe's kLOG_THRESHOLD is the float 1e-20; a double net widens that float.
LOG_THRESHOLD = float(np.float32(1e-20))


def ref_softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def write_blob(path, h, legacy=False, double=False):
    """H as a BlobProto file, built field by field (not with the project's writer)."""
    blob = pb.BlobProto()
    if legacy:
        blob.num, blob.channels, blob.height, blob.width = 1, 1, *h.shape
    else:
        blob.shape.dim.extend(h.shape)
    (blob.double_data if double else blob.data).extend(h.reshape(-1).tolist())
    path.write_bytes(blob.SerializeToString())
    return str(path)


# -- MultinomialLogisticLoss -------------------------------------------------------------------
def mll(extra: str = "") -> str:
    return ('name: "mll" type: "MultinomialLogisticLoss" bottom: "prob" bottom: "label" '
            f'top: "loss" {extra}')


def test_multinomial_logistic_loss_by_hand():
    prob = np.array([[0.2, 0.5, 0.3], [0.25, 0.25, 0.5]])
    net = forward_layer(mll(), prob=prob, label=np.array([1.0, 2.0]))
    assert net.blobs["loss"].data.shape == ()
    assert float(net.blobs["loss"].data) == pytest.approx(math.log(2), rel=1e-15)
    assert net.loss == pytest.approx(math.log(2), rel=1e-15)
    net.backward()  # -1 / num / p at the label, 0 elsewhere
    np.testing.assert_allclose(net.blobs["prob"].diff, [[0, -1.0, 0], [0, 0, -1.0]], rtol=1e-15)


def test_multinomial_logistic_loss_flattens_all_axes_after_the_first():
    # dim = count / num = 6: a label indexes the flattened (3, 2) sample.
    prob = RNG.random((2, 3, 2)) + 0.1
    net = forward_layer(mll("loss_param { normalization: FULL ignore_label: 5 }"), prob=prob,
                        label=np.array([5.0, 2.0]))
    # loss_param plays no part: no ignored label and always divided by num.
    want = -(math.log(prob[0].reshape(-1)[5]) + math.log(prob[1].reshape(-1)[2])) / 2
    assert float(net.blobs["loss"].data) == pytest.approx(want, rel=1e-14)


def test_multinomial_logistic_loss_clamps_at_the_float_log_threshold():
    prob = np.array([[1.0, 0.0], [0.5, 0.5]])
    net = forward_layer(mll(), prob=prob, label=np.array([1.0, 0.0]))
    want = (-math.log(LOG_THRESHOLD) + math.log(2)) / 2
    assert float(net.blobs["loss"].data) == pytest.approx(want, rel=1e-15)
    net.backward()
    np.testing.assert_allclose(net.blobs["prob"].diff,
                               [[0, -0.5 / LOG_THRESHOLD], [-1.0, 0]], rtol=1e-15)


@pytest.mark.parametrize("shape,label_shape,extra", [
    ((3, 4), (3,), ""), ((3, 4), (3, 1, 1, 1), "loss_weight: 2"),
    ((2, 3, 2, 2), (2,), ""), ((4, 5, 1, 1), (4, 1), "loss_weight: 0.5")])
def test_multinomial_logistic_loss_gradient(shape, label_shape, extra):
    prob = RNG.random(shape) + 0.2  # away from the clamp
    lab = random_labels(RNG, label_shape, math.prod(shape[1:]))
    net = check_gradients(mll(extra), {"prob": prob, "label": lab}, check=["prob"])
    net.forward(prob=prob, label=lab)
    p2, idx = prob.reshape(shape[0], -1), lab.reshape(-1).astype(int)
    want = -np.log(p2[np.arange(shape[0]), idx]).sum() / shape[0]
    assert float(net.blobs["loss"].data) == pytest.approx(want, rel=1e-13)


def test_multinomial_logistic_loss_errors():
    with pytest.raises(LayerError, match=r"'label' \(2, 3\) must hold one label per sample"):
        forward_layer(mll(), prob=np.full((2, 3), 0.3), label=np.zeros((2, 3)))
    with pytest.raises(LayerError, match="same first dimension"):
        forward_layer(mll(), prob=np.full((2, 3), 0.3), label=np.zeros(3))
    with pytest.raises(LayerError, match=r"\(1, 1, 1, 1, 2\) has 5 axes; "
                                         "MultinomialLogisticLoss takes blobs of at most 4"):
        forward_layer(mll(), prob=np.full((1, 1, 1, 1, 2), 0.5), label=np.zeros(1))
    with pytest.raises(LabelError, match=r"label value 3 at index \(1,\).*outside \[0, 3\)"):
        forward_layer(mll(), prob=np.full((2, 3), 0.3), label=np.array([0.0, 3.0]))


# -- InfogainLoss ------------------------------------------------------------------------------
def ref_infogain(x, label, h, axis=1, ignore=None, mode="VALID"):
    """Caffe's loops: the loss and the diff (for a loss weight of 1)."""
    prob = ref_softmax(x, axis)
    outer, classes = math.prod(x.shape[:axis]), x.shape[axis]
    inner = math.prod(x.shape[axis + 1:])
    p = prob.reshape(outer, classes, inner)
    hm = h.reshape(classes, classes)
    lab = label.reshape(-1)
    loss, count = 0.0, 0
    diff = np.zeros_like(p)
    for i in range(outer):
        for j in range(inner):
            v = int(lab[i * inner + j])
            if ignore is not None and v == ignore:
                continue
            for k in range(classes):
                loss -= hm[v, k] * math.log(max(p[i, k, j], LOG_THRESHOLD))
                diff[i, k, j] = p[i, k, j] * sum(hm[v, :]) - hm[v, k]
            count += 1
    n = {"FULL": outer * inner, "VALID": count, "BATCH_SIZE": outer, "NONE": 1}[mode]
    n = max(1.0, n)
    return loss / n, diff.reshape(x.shape) / n


def infogain(loss_param: str = "", extra: str = "", source: str | None = None,
             axis: int | None = None, h_bottom: bool = False) -> str:
    ip = []
    if source is not None:
        ip.append(f'source: "{source}"')
    if axis is not None:
        ip.append(f"axis: {axis}")
    ipp = f"infogain_loss_param {{ {' '.join(ip)} }} " if ip else ""
    lp = f"loss_param {{ {loss_param} }} " if loss_param else ""
    hb = 'bottom: "H" ' if h_bottom else ""
    return ('name: "info" type: "InfogainLoss" bottom: "scores" bottom: "label" '
            f'{hb}top: "loss" {extra} {ipp}{lp}')


def test_infogain_loss_by_hand(tmp_path):
    # Equal scores: p = 1/2 each. Label 1 takes H's row (3, 4): 7 log 2; label 0 (1, 2): 3 log 2.
    h = np.array([[1.0, 2.0], [3.0, 4.0]])
    src = write_blob(tmp_path / "H.binaryproto", h)
    net = forward_layer(infogain(source=src), scores=np.zeros((2, 2)), label=np.array([1.0, 0.0]))
    assert float(net.blobs["loss"].data) == pytest.approx(10 * math.log(2) / 2, rel=1e-15)
    net.backward()  # p * rowsum - H[label] over the 2 valid labels
    np.testing.assert_allclose(net.blobs["scores"].diff,
                               [[0.5 * 7 - 3, 0.5 * 7 - 4], [0.5 * 3 - 1, 0.5 * 3 - 2]]
                               / np.array(2.0), rtol=1e-15)


def test_infogain_loss_with_identity_h_is_softmax_with_loss(tmp_path):
    x = RNG.standard_normal((3, 4, 2))
    lab = random_labels(RNG, (3, 2), 4, ignore=-1)
    src = write_blob(tmp_path / "I.binaryproto", np.eye(4))
    lp = "ignore_label: -1 normalization: FULL"
    info = forward_layer(infogain(lp, source=src), scores=x, label=lab)
    swl = forward_layer('name: "swl" type: "SoftmaxWithLoss" bottom: "scores" bottom: "label" '
                        f'top: "loss" loss_param {{ {lp} }}', scores=x, label=lab)
    assert float(info.blobs["loss"].data) == pytest.approx(float(swl.blobs["loss"].data),
                                                           rel=1e-13)
    info.backward()
    swl.backward()
    np.testing.assert_allclose(info.blobs["scores"].diff, swl.blobs["scores"].diff,
                               rtol=1e-12, atol=1e-16)


INFOGAIN_CASES = [
    # loss_param, mode, ignore, axis, shape
    ("", "VALID", None, None, (3, 4)),
    ("normalization: FULL", "FULL", None, None, (3, 4, 2)),
    ("normalization: VALID ignore_label: -1", "VALID", -1, None, (3, 4, 2)),
    ("normalization: BATCH_SIZE ignore_label: 1", "BATCH_SIZE", 1, None, (2, 3, 2, 2)),
    ("normalization: NONE", "NONE", None, None, (3, 3)),
    ("normalization: FULL ignore_label: 0", "FULL", 0, -1, (2, 3, 4)),
    ("ignore_label: 2", "VALID", 2, 2, (2, 2, 3, 2)),
    ("normalization: BATCH_SIZE", "BATCH_SIZE", None, -2, (4, 3, 2)),
]


@pytest.mark.parametrize("loss_param,mode,ignore,axis,shape", INFOGAIN_CASES)
@pytest.mark.parametrize("h_from", ["file", "bottom"])
def test_infogain_loss_gradient_and_value(tmp_path, loss_param, mode, ignore, axis, shape,
                                          h_from):
    ax = 1 if axis is None else axis % len(shape)
    classes = shape[ax]
    x = RNG.standard_normal(shape)
    lab_shape = shape[:ax] + shape[ax + 1:]
    lab = random_labels(RNG, lab_shape, classes, ignore=ignore if ignore == -1 else None)
    h = RNG.random((classes, classes)).astype(np.float32).astype(np.float64)  # exact in a file
    if h_from == "file":
        layer = infogain(loss_param, axis=axis,
                         source=write_blob(tmp_path / "H.binaryproto", h, legacy=True))
        bottoms = {"scores": x, "label": lab}
    else:
        layer = infogain(loss_param, axis=axis, h_bottom=True)
        bottoms = {"scores": x, "label": lab, "H": h}
    net = check_gradients(layer, bottoms, check=["scores"])
    net.forward(**bottoms)
    want, want_diff = ref_infogain(x, lab, h, ax, ignore, mode)
    assert float(net.blobs["loss"].data) == pytest.approx(want, rel=1e-12)
    net.backward()
    np.testing.assert_allclose(net.blobs["scores"].diff, want_diff, rtol=1e-12, atol=1e-15)
    if h_from == "bottom":  # force_backward leaves H out: no gradient is written for it
        assert np.all(net.blobs["H"].diff == 0)


def test_infogain_loss_h_in_double_and_any_shape_of_its_count(tmp_path):
    # A double_data file keeps 0.1 exactly in a double net; the shape (16,) is accepted by count.
    h = np.full((4, 4), 0.1) + np.eye(4)
    x, lab = RNG.standard_normal((2, 4)), np.array([3.0, 1.0])
    src = write_blob(tmp_path / "H.binaryproto", h.reshape(16), double=True)
    net = forward_layer(infogain(source=src), scores=x, label=lab)
    assert float(net.blobs["loss"].data) == pytest.approx(ref_infogain(x, lab, h)[0], rel=1e-14)


def test_infogain_loss_second_top_and_loss_weight(tmp_path):
    x = RNG.standard_normal((3, 4))
    lab = random_labels(RNG, (3,), 4)
    h = RNG.random((4, 4)).astype(np.float32).astype(np.float64)
    src = write_blob(tmp_path / "H.binaryproto", h)
    layer = infogain(extra='top: "prob" loss_weight: 2', source=src)
    net = check_gradients(layer, {"scores": x, "label": lab}, check=["scores"],
                          tops=["loss"])
    net.forward(scores=x, label=lab)
    np.testing.assert_allclose(net.blobs["prob"].data, ref_softmax(x, 1), rtol=1e-13)
    assert [w for _, w in net.builder.loss_tops] == [2.0]  # the prob top is not a loss
    want, want_diff = ref_infogain(x, lab, h)
    assert net.loss == pytest.approx(2 * want, rel=1e-13)
    net.backward()
    np.testing.assert_allclose(net.blobs["scores"].diff, 2 * want_diff, rtol=1e-12)


def test_infogain_loss_clamps_the_probability_and_runs_in_float32(tmp_path):
    h = np.array([[0.0, 1.0], [1.0, 0.0]])
    src = write_blob(tmp_path / "H.binaryproto", h)
    net = forward_layer(infogain(source=src), scores=np.array([[0.0, -800.0]]),
                        label=np.array([0.0]))
    assert float(net.blobs["loss"].data) == pytest.approx(-math.log(LOG_THRESHOLD), rel=1e-15)
    text = layer_net(infogain(source=src), {"scores": (1, 2), "label": (1,)})
    net32 = Net(text, phase=TEST)
    out = net32.forward(scores=np.array([[0.0, 1.0]], np.float32), label=np.array([1.0]))
    want = -math.log(1 / (1 + math.e))  # -H[1, 0] log p_0
    assert out["loss"].dtype == np.float32
    assert float(out["loss"]) == pytest.approx(want, rel=1e-6)


def test_infogain_loss_h_wrong_size(tmp_path):
    src = write_blob(tmp_path / "H3.binaryproto", np.eye(3), legacy=True)
    with pytest.raises(LayerError, match=r"layer 'info' \(type InfogainLoss\): infogain matrix "
                                         r"'.*H3\.binaryproto' has shape \(1, 1, 3, 3\) \(9 "
                                         r"values\); bottom 'scores' \(2, 4\) has 4 classes "
                                         r"along axis 1, so H must be 4 x 4"):
        forward_layer(infogain(source=src), scores=np.zeros((2, 4)), label=np.zeros(2))
    with pytest.raises(LayerError, match=r"bottom 'H' \(3, 3\) holds 9 values; bottom 'scores' "
                                         r"\(2, 3, 4\) has 4 classes along axis 2, so H must "
                                         "be 4 x 4"):
        forward_layer(infogain(axis=-1, h_bottom=True), scores=np.zeros((2, 3, 4)),
                      label=np.zeros((2, 3)), H=np.eye(3))


def test_infogain_loss_source_errors(tmp_path):
    with pytest.raises(LayerError, match="needs the infogain matrix H: set infogain_loss_param"):
        forward_layer(infogain(), scores=np.zeros((2, 3)), label=np.zeros(2))
    missing = tmp_path / "none.binaryproto"
    with pytest.raises(LayerError, match=r"infogain matrix: .*none\.binaryproto: cannot read"):
        forward_layer(infogain(source=str(missing)), scores=np.zeros((2, 3)), label=np.zeros(2))
    junk = tmp_path / "junk.binaryproto"
    junk.write_bytes(b"\xff\xff\xff")
    with pytest.raises(LayerError, match=r"junk\.binaryproto: not a binary \.binaryproto"):
        forward_layer(infogain(source=str(junk)), scores=np.zeros((2, 3)), label=np.zeros(2))


def test_infogain_loss_parameter_and_label_errors(tmp_path):
    src = write_blob(tmp_path / "H.binaryproto", np.eye(3))
    with pytest.raises(LayerError, match="normalize is deprecated and refused by InfogainLoss"):
        forward_layer(infogain("normalize: true", source=src), scores=np.zeros((2, 3)),
                      label=np.zeros(2))
    with pytest.raises(LayerError, match=r"'label' \(2, 2\) holds 4 labels.*needs 2 x 1 = 2"):
        forward_layer(infogain(source=src), scores=np.zeros((2, 3)), label=np.zeros((2, 2)))
    with pytest.raises(LabelError, match=r"label value 3 .*outside \[0, 3\)"):
        forward_layer(infogain(source=src), scores=np.zeros((2, 3)), label=np.array([3.0, 0.0]))
    with pytest.raises(LabelError, match="not the ignore_label 255"):
        forward_layer(infogain("ignore_label: 255", source=src), scores=np.zeros((2, 3)),
                      label=np.array([255.0, -2.0]))
    with pytest.raises(LayerError, match="needs 2-3 bottom blob"):
        forward_layer('name: "info" type: "InfogainLoss" bottom: "scores" top: "loss"',
                      scores=np.zeros((2, 3)))


def test_infogain_loss_refuses_a_gradient_for_h():
    # H computed by a learnable layer would need its gradient: refused, as Caffe does.
    text = layer_net('name: "ip" type: "InnerProduct" bottom: "z" top: "H" '
                     'inner_product_param { num_output: 9 }',
                     {"scores": (2, 3), "label": (2,), "z": (1, 2)}, force_backward=False)
    text += f"layer {{ {infogain(h_bottom=True)} }}\n"
    with pytest.raises(LayerError, match="cannot backpropagate to the infogain matrix 'H'"):
        Net(text, phase=TRAIN)


# -- the device branch of the label kernels -----------------------------------------------------
def _label_kernels(prob, scores, h, lab, dloss):
    out = {}
    loss = np.zeros(())
    ls.multinomial_logistic_loss_forward(prob, lab, loss)
    out["mll"] = loss.copy()
    dx = np.zeros_like(prob)
    ls.multinomial_logistic_loss_backward(prob, lab, dloss, dx)
    out["mll_diff"] = dx
    kw = dict(axis=1, ignore_label=-1, normalization="VALID")
    p = ref_softmax(scores, 1)
    ls.infogain_loss_forward(p, lab, h, loss, **kw)
    out["info"] = loss.copy()
    dx = np.zeros_like(p)
    ls.infogain_loss_backward(p, lab, h, dloss, dx, **kw)
    out["info_diff"] = dx
    return out


def test_device_branch_matches_the_host_and_turns_bad_labels_into_nan(monkeypatch):
    # On a GPU a bad label is not read back (that would stall the stream): the kernels give
    # NaN instead of raising. Numpy arrays taken for device arrays run those bodies here.
    prob = RNG.random((4, 3)) + 0.1
    scores, h = RNG.standard_normal((4, 3)), RNG.random((3, 3))
    dloss = np.array(1.5)
    good = np.array([0.0, 2.0, 1.0, 2.0])
    host = _label_kernels(prob, scores, h, good, dloss)
    monkeypatch.setattr(backend, "is_device_array", lambda a: True)
    monkeypatch.setattr(ls, "get_array_module", lambda *a: np)
    device = _label_kernels(prob, scores, h, good, dloss)
    for k, v in host.items():
        np.testing.assert_allclose(device[k], v, rtol=1e-15, err_msg=k)
    bad = _label_kernels(prob, scores, h, np.array([0.0, 3.0, 1.0, 2.0]), dloss)
    assert np.isnan(bad["mll"]) and np.isnan(bad["info"])
    for k in ("mll_diff", "info_diff"):  # the bad sample's row, and only it
        assert np.isnan(bad[k][1]).all() and not np.isnan(bad[k][[0, 2, 3]]).any(), k


# -- ContrastiveLoss ---------------------------------------------------------------------------
def contrastive(param: str = "", extra: str = "") -> str:
    cp = f"contrastive_loss_param {{ {param} }}" if param else ""
    return ('name: "con" type: "ContrastiveLoss" bottom: "a" bottom: "b" bottom: "y" '
            f'top: "loss" {extra} {cp}')


def ref_contrastive(a, b, y, margin=1.0, legacy=False):
    """Caffe's loops: the loss and the diff of a (that of b is its negative)."""
    num = a.shape[0]
    d = (a - b).reshape(num, -1)
    loss = 0.0
    diff = np.zeros_like(d)
    for i in range(num):
        dist_sq = float(d[i] @ d[i])
        if int(y.reshape(-1)[i]):
            loss += dist_sq
            diff[i] = d[i] / num
        elif legacy:
            loss += max(margin - dist_sq, 0.0)
            if margin - dist_sq > 0:
                diff[i] = -d[i] / num
        else:
            dist = math.sqrt(dist_sq)
            loss += max(margin - dist, 0.0) ** 2
            if margin - dist > 0:
                diff[i] = -(margin - dist) / (dist + 1e-4) * d[i] / num
    return loss / num / 2, diff.reshape(a.shape)


def test_contrastive_loss_by_hand():
    # Distances 5 (similar), 0.5 and 1 (dissimilar), margin 1.
    a = np.zeros((3, 2))
    b = np.array([[3.0, 4.0], [0.3, 0.4], [0.6, 0.8]])
    y = np.array([1.0, 0.0, 0.0])
    net = forward_layer(contrastive(), a=a, b=b, y=y)
    assert float(net.blobs["loss"].data) == pytest.approx((25 + 0.25 + 0) / 3 / 2, rel=1e-15)
    net.backward()
    # Pair 1: -(1 - 0.5) / (0.5 + 1e-4) * (a - b) / 3; pair 2 sits on the margin: 0.
    want = np.array([[-3.0, -4.0], [0.3, 0.4], [0.0, 0.0]]) / 3
    want[1] *= 0.5 / 0.5001
    np.testing.assert_allclose(net.blobs["a"].diff, want, rtol=1e-14)
    np.testing.assert_allclose(net.blobs["b"].diff, -want, rtol=1e-14)
    # Legacy: the dissimilar term is max(margin - d^2, 0), not squared.
    net = forward_layer(contrastive("legacy_version: true"), a=a, b=b, y=y)
    assert float(net.blobs["loss"].data) == pytest.approx((25 + 0.75 + 0) / 3 / 2, rel=1e-15)


def pairs(num, channels, margin, legacy, y):
    """Feature pairs whose distances keep clear of the margin's kink: dissimilar pairs at
    0.3-0.8 or 1.3-2 of the margin (in d^2 for the legacy form)."""
    a = RNG.standard_normal((num, channels))
    u = RNG.standard_normal((num, channels))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    frac = np.where(RNG.random(num) < 0.6, RNG.uniform(0.3, 0.8, num), RNG.uniform(1.3, 2, num))
    dist = np.sqrt(frac * margin) if legacy else frac * margin
    dist = np.where(np.trunc(y) != 0, RNG.uniform(0.2, 2, num), dist)
    return a, a + dist[:, None] * u


CONTRASTIVE_CASES = [
    ("", 1.0, False), ("legacy_version: true", 1.0, True), ("margin: 0.5", 0.5, False),
    ("margin: 3 legacy_version: true", 3.0, True), ("margin: 2.5 legacy_version: false", 2.5,
                                                     False), ("margin: 0.7", 0.7, False)]


@pytest.mark.parametrize("param,margin,legacy", CONTRASTIVE_CASES)
@pytest.mark.parametrize("shape,extra", [((6, 3), ""), ((5, 4, 1, 1), "loss_weight: 2")])
def test_contrastive_loss_gradient_and_value(param, margin, legacy, shape, extra):
    num = shape[0]
    # 2, -1 count as similar and 0.7 as dissimilar: Caffe casts y to int.
    y = np.array([1.0, 0.0, 2.0, 0.7, 0.0, -1.0][:num])
    a, b = pairs(num, math.prod(shape[1:]), np.float32(margin), legacy, y)
    a, b = a.reshape(shape), b.reshape(shape)
    y = y.reshape((num, 1, 1, 1) if len(shape) == 4 else (num,))
    # Caffe's 1e-4 in the dissimilar gradient's denominator departs from the true gradient
    # by a relative 1e-4 / d (d >= 0.15 here); the legacy form has no such term.
    rtol = 1e-5 if legacy else 1e-3
    net = check_gradients(contrastive(param, extra), {"a": a, "b": b, "y": y},
                          check=["a", "b"], rtol=rtol)
    net.forward(a=a, b=b, y=y)
    want, want_diff = ref_contrastive(a, b, y, float(np.float32(margin)), legacy)
    assert float(net.blobs["loss"].data) == pytest.approx(want, rel=1e-13)
    w = 2.0 if extra else 1.0
    assert net.loss == pytest.approx(w * want, rel=1e-13)
    net.backward()
    np.testing.assert_allclose(net.blobs["a"].diff, w * want_diff, rtol=1e-12, atol=1e-16)
    np.testing.assert_allclose(net.blobs["b"].diff, -w * want_diff, rtol=1e-12, atol=1e-16)
    assert np.all(net.blobs["y"].diff == 0)  # force_backward leaves the similarity out


def test_contrastive_loss_margin_is_a_float():
    # margin 0.3 is the float 0.30000001192...: Caffe's Dtype(margin) in a double net.
    a, b = np.zeros((1, 1)), np.full((1, 1), 0.1)
    net = forward_layer(contrastive("margin: 0.3"), a=a, b=b, y=np.zeros(1))
    m = float(np.float32(0.3))
    assert float(net.blobs["loss"].data) == (m - 0.1) ** 2 / 2


def test_contrastive_loss_coincident_dissimilar_pair_stays_finite():
    a = np.array([[1.0, 2.0], [0.0, 0.0]])
    b = np.array([[1.0, 2.0], [1e-7, 0.0]])
    net = forward_layer(contrastive(), a=a, b=b, y=np.zeros(2))
    assert float(net.blobs["loss"].data) == pytest.approx((1 + (1 - 1e-7) ** 2) / 4, rel=1e-14)
    net.backward()
    want = np.array([[0.0, 0.0], [-(1 - 1e-7) / (1e-7 + 1e-4) * -1e-7 / 2, 0.0]])
    np.testing.assert_allclose(net.blobs["a"].diff, want, rtol=1e-13)
    assert np.all(np.isfinite(net.blobs["b"].diff))


def test_contrastive_loss_shape_errors():
    with pytest.raises(LayerError, match=r"bottoms 'a' \(2, 3, 2, 1\) and 'b' \(2, 3, 2, 1\) "
                                         "must be feature pairs"):
        forward_layer(contrastive(), a=np.zeros((2, 3, 2, 1)), b=np.zeros((2, 3, 2, 1)),
                      y=np.zeros(2))
    with pytest.raises(LayerError, match=r"'a' \(2, 3\) and 'b' \(2, 4\) must be feature pairs"):
        forward_layer(contrastive(), a=np.zeros((2, 3)), b=np.zeros((2, 4)), y=np.zeros(2))
    with pytest.raises(LayerError, match="same first dimension"):
        forward_layer(contrastive(), a=np.zeros((2, 3)), b=np.zeros((3, 3)), y=np.zeros(2))
    with pytest.raises(LayerError, match=r"'y' \(3,\) must hold one similarity per pair, "
                                         r"shaped \(2,\) or \(2, 1, 1, 1\)"):
        forward_layer(contrastive(), a=np.zeros((2, 3)), b=np.zeros((2, 3)), y=np.zeros(3))
    with pytest.raises(LayerError, match=r"'y' \(2, 2\) must hold one similarity"):
        forward_layer(contrastive(), a=np.zeros((2, 3)), b=np.zeros((2, 3)), y=np.zeros((2, 2)))
    with pytest.raises(LayerError, match="needs 3 bottom blob"):
        forward_layer('name: "con" type: "ContrastiveLoss" bottom: "a" bottom: "b" top: "loss"',
                      a=np.zeros((2, 3)), b=np.zeros((2, 3)))


def test_contrastive_loss_in_a_siamese_net():
    # Two InnerProduct branches sharing one weight; the gradient reaches the shared weight
    # through both bottoms (a's diff minus b's diff through the same map).
    text = ('layer { name: "in" type: "Input" top: "x1" top: "x2" top: "y" input_param { '
            'shape { dim: 4 dim: 3 } shape { dim: 4 dim: 3 } shape { dim: 4 } } }\n'
            'layer { name: "f1" type: "InnerProduct" bottom: "x1" top: "a" param { name: "w" } '
            'inner_product_param { num_output: 2 bias_term: false '
            'weight_filler { type: "gaussian" std: 1 } } }\n'
            'layer { name: "f2" type: "InnerProduct" bottom: "x2" top: "b" param { name: "w" } '
            'inner_product_param { num_output: 2 bias_term: false } }\n'
            f'layer {{ {contrastive("legacy_version: true margin: 20")} }}\n')
    net = Net(text, phase=TRAIN, dtype="float64")
    x1, x2 = RNG.standard_normal((4, 3)), RNG.standard_normal((4, 3))
    y = np.array([1.0, 0.0, 1.0, 0.0])
    net.forward(x1=x1, x2=x2, y=y)
    w = net.params["f1"][0].data
    loss, da = ref_contrastive(x1 @ w.T, x2 @ w.T, y, 20.0, legacy=True)
    assert net.loss == pytest.approx(loss, rel=1e-13)
    net.backward()
    np.testing.assert_allclose(net.params["f1"][0].diff, da.T @ x1 - da.T @ x2, rtol=1e-12)
