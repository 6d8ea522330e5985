"""The loss family: Softmax, SoftmaxWithLoss, EuclideanLoss, SigmoidCrossEntropyLoss, HingeLoss
and Accuracy. Gradients by central differences in float64; forward values against numbers
worked by hand and against plain numpy transcriptions of Caffe's loops."""

import math

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.errors import LabelError, LayerError, PurineError
from tests.gradcheck import check_gradients, forward_layer, layer_net, random_labels

RNG = np.random.default_rng(1234)
FLT_MIN = np.finfo(np.float32).tiny


# -- plain references (loops, as Caffe writes them) -----------------------------------------
def ref_softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def ref_normalizer(mode, valid, full, batch):
    n = {"FULL": full, "VALID": valid, "BATCH_SIZE": batch, "NONE": 1}[mode]
    return max(1.0, n)


def ref_softmax_loss(x, label, axis=1, ignore=None, mode="VALID"):
    prob = ref_softmax(x, axis)
    outer, classes = math.prod(x.shape[:axis]), x.shape[axis]
    inner = math.prod(x.shape[axis + 1:])
    p = prob.reshape(outer, classes, inner)
    lab = label.reshape(-1)
    loss, count = 0.0, 0
    for i in range(outer):
        for j in range(inner):
            v = int(lab[i * inner + j])
            if ignore is not None and v == ignore:
                continue
            loss -= math.log(max(p[i, v, j], FLT_MIN))
            count += 1
    return loss / ref_normalizer(mode, count, outer * inner, outer)


def ref_accuracy(x, label, axis=1, top_k=1, ignore=None):
    outer, classes = math.prod(x.shape[:axis]), x.shape[axis]
    inner = math.prod(x.shape[axis + 1:])
    s = x.reshape(outer, classes, inner)
    lab = label.reshape(-1)
    right, count = 0, 0
    hits, nums = np.zeros(classes), np.zeros(classes)
    for i in range(outer):
        for j in range(inner):
            v = int(lab[i * inner + j])
            if ignore is not None and v == ignore:
                continue
            nums[v] += 1
            better = sum(1 for k in range(classes) if s[i, k, j] >= s[i, v, j]) - 1
            if better < top_k:
                right += 1
                hits[v] += 1
            count += 1
    per = np.array([h / n if n else 0.0 for h, n in zip(hits, nums, strict=True)])
    return (right / count if count else 0.0), per


# -- Softmax -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,axis", [((3, 4), 1), ((2, 3, 2, 2), 1), ((2, 3, 2, 2), 0),
                                        ((2, 3, 2, 2), -1), ((2, 3, 2, 2), 2)])
def test_softmax_gradient(shape, axis):
    x = RNG.standard_normal(shape)
    net = check_gradients(f'name: "sm" type: "Softmax" bottom: "x" top: "y" '
                          f'softmax_param {{ axis: {axis} }}', {"x": x})
    net.forward(x=x)  # the check leaves the last perturbed input behind
    np.testing.assert_allclose(net.blobs["y"].data, ref_softmax(x, axis), rtol=1e-12)


def test_softmax_in_place_gradient():
    x = RNG.standard_normal((2, 4, 3))
    net = check_gradients('name: "sm" type: "Softmax" bottom: "x" top: "x"', {"x": x},
                          tops=["x"])
    net.forward(x=x)
    np.testing.assert_allclose(net.blobs["x"].data, ref_softmax(x, 1), rtol=1e-12)


def test_softmax_is_stable_for_large_scores():
    x = np.array([[1000.0, 1001.0, 1002.0], [-1000.0, -1000.0, -1000.0]])
    y = forward_layer('name: "sm" type: "Softmax" bottom: "x" top: "y"', x=x).blobs["y"].data
    e = np.exp([-2.0, -1.0, 0.0])
    np.testing.assert_allclose(y, [e / e.sum(), [1 / 3] * 3], rtol=1e-14)


# -- SoftmaxWithLoss -----------------------------------------------------------------------
def swl(loss_param: str = "", extra: str = "", axis: int | None = None) -> str:
    sp = f"softmax_param {{ axis: {axis} }} " if axis is not None else ""
    lp = f"loss_param {{ {loss_param} }} " if loss_param else ""
    return ('name: "loss" type: "SoftmaxWithLoss" bottom: "scores" bottom: "label" '
            f'top: "loss" {extra} {sp}{lp}')


def test_softmax_with_loss_by_hand():
    # Row 0: scores 1, 2, 3, label 2: p = 1 / (1 + e^-1 + e^-2). Row 1: all equal, p = 1/3.
    x = np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    net = forward_layer(swl(), scores=x, label=np.array([2.0, 0.0]))
    want = (math.log(1 + math.exp(-1) + math.exp(-2)) + math.log(3)) / 2
    assert net.blobs["loss"].data.shape == ()
    assert float(net.blobs["loss"].data) == pytest.approx(want, rel=1e-14)
    assert net.loss == pytest.approx(want, rel=1e-14)  # default loss weight 1
    # With label 1 ignored in row 0 as well, VALID divides by the one label left.
    net = forward_layer(swl("ignore_label: 2"), scores=x, label=np.array([2.0, 0.0]))
    assert float(net.blobs["loss"].data) == pytest.approx(math.log(3), rel=1e-14)


MODES = [("", "VALID"), ("normalization: FULL", "FULL"), ("normalization: VALID", "VALID"),
         ("normalization: BATCH_SIZE", "BATCH_SIZE"), ("normalization: NONE", "NONE"),
         ("normalize: false", "BATCH_SIZE"), ("normalize: true", "VALID"),
         ("normalize: false normalization: FULL", "FULL")]


@pytest.mark.parametrize("param,mode", MODES)
@pytest.mark.parametrize("ignore", [None, -1, 0])
def test_softmax_with_loss_forward_matches_reference(param, mode, ignore):
    x = RNG.standard_normal((3, 4, 2, 2))
    lab = random_labels(RNG, (3, 1, 2, 2), 4,
                        ignore=ignore if ignore is not None and ignore < 0 else None)
    lp = f"{param} ignore_label: {ignore}" if ignore is not None else param
    net = forward_layer(swl(lp), scores=x, label=lab)
    want = ref_softmax_loss(x, lab, ignore=ignore, mode=mode)
    assert float(net.blobs["loss"].data) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("param", ["normalization: FULL", "normalization: VALID",
                                   "normalization: BATCH_SIZE", "normalization: NONE",
                                   "normalize: false", ""])
@pytest.mark.parametrize("ignore", [None, -1])
def test_softmax_with_loss_gradient(param, ignore):
    x = RNG.standard_normal((3, 4))
    lab = random_labels(RNG, (3,), 4, ignore=ignore)
    lp = f"{param} ignore_label: {ignore}" if ignore is not None else param
    check_gradients(swl(lp), {"scores": x, "label": lab}, check=["scores"])


def test_softmax_with_loss_spatial_gradient_and_loss_weight_2():
    x = RNG.standard_normal((2, 3, 2, 3))
    lab = random_labels(RNG, (2, 1, 2, 3), 3, ignore=255)
    net = check_gradients(swl("ignore_label: 255", extra="loss_weight: 2", axis=1),
                          {"scores": x, "label": lab}, check=["scores"])
    net.forward(scores=x, label=lab)
    want = ref_softmax_loss(x, lab, ignore=255)
    assert float(net.blobs["loss"].data) == pytest.approx(want, rel=1e-12)
    assert net.loss == pytest.approx(2 * want, rel=1e-12)
    # The diff is (prob - onehot) * 2 / valid count, zero at ignored positions.
    net.backward()
    prob = ref_softmax(x, 1)
    onehot = np.zeros_like(x)
    for n, c, h, w in np.ndindex(lab.shape):
        if lab[n, c, h, w] != 255:
            onehot[n, int(lab[n, c, h, w]), h, w] = 1
    valid = (lab != 255).astype(float)
    want_diff = (prob - onehot) * valid * 2 / valid.sum()
    np.testing.assert_allclose(net.blobs["scores"].diff, want_diff, rtol=1e-12, atol=1e-15)


def test_softmax_with_loss_on_a_later_axis():
    x = RNG.standard_normal((2, 3, 5))  # (N, T, classes): labels (N, T)
    lab = random_labels(RNG, (2, 3), 5, ignore=-1)
    net = check_gradients(swl("ignore_label: -1 normalization: FULL", axis=-1),
                          {"scores": x, "label": lab}, check=["scores"])
    net.forward(scores=x, label=lab)
    want = ref_softmax_loss(x, lab, axis=2, ignore=-1, mode="FULL")
    assert float(net.blobs["loss"].data) == pytest.approx(want, rel=1e-12)


def test_softmax_with_loss_second_top_is_the_probability():
    x = RNG.standard_normal((3, 4, 2))
    lab = random_labels(RNG, (3, 2), 4)
    layer = ('name: "loss" type: "SoftmaxWithLoss" bottom: "scores" bottom: "label" '
             'top: "loss" top: "prob"')
    net = check_gradients(layer, {"scores": x, "label": lab}, check=["scores"], tops=["loss"])
    net.forward(scores=x, label=lab)
    np.testing.assert_allclose(net.blobs["prob"].data, ref_softmax(x, 1), rtol=1e-12)
    assert [w for _, w in net.builder.loss_tops] == [1.0]  # the prob top is not a loss


def test_softmax_with_loss_clamps_the_probability_at_flt_min():
    x = np.array([[0.0, -800.0]])  # p(class 1) underflows to 0 in float64
    net = forward_layer(swl(), scores=x, label=np.array([1.0]))
    assert float(net.blobs["loss"].data) == pytest.approx(-math.log(FLT_MIN), rel=1e-12)


def test_softmax_with_loss_all_ignored_gives_zero_not_nan():
    x = RNG.standard_normal((2, 3))
    net = forward_layer(swl("ignore_label: -1"), scores=x, label=np.array([-1.0, -1.0]))
    assert float(net.blobs["loss"].data) == 0.0
    net.backward()
    assert np.all(net.blobs["scores"].diff == 0)


def test_softmax_with_loss_truncates_labels_like_a_cast_to_int():
    x = RNG.standard_normal((2, 3))
    a = forward_layer(swl(), scores=x, label=np.array([2.7, 0.2])).blobs["loss"].data
    b = forward_layer(swl(), scores=x, label=np.array([2.0, 0.0])).blobs["loss"].data
    assert float(a) == float(b)


@pytest.mark.parametrize("bad,text", [(3.0, "label value 3 "), (-1.0, "label value -1 "),
                                      (np.nan, "label value nan ")])
def test_softmax_with_loss_bad_label_value_is_a_clear_error(bad, text):
    x = RNG.standard_normal((3, 3))
    with pytest.raises(LabelError, match=r"outside \[0, 3\)") as err:
        forward_layer(swl(), scores=x, label=np.array([0.0, bad, 1.0]))
    assert isinstance(err.value, PurineError)
    assert text in str(err.value) and "index (1,)" in str(err.value)
    assert "loss/" in str(err.value)  # the dispatcher names the op, hence the layer


def test_softmax_with_loss_ignore_label_names_itself_in_the_error():
    x = RNG.standard_normal((2, 3))
    with pytest.raises(LabelError, match="not the ignore_label 255"):
        forward_layer(swl("ignore_label: 255"), scores=x, label=np.array([7.0, 255.0]))


def test_softmax_with_loss_label_count_mismatch():
    with pytest.raises(LayerError, match=r"'label' \(2, 3\) holds 6 labels.*'scores' "
                                         r"\(2, 3, 2\) with axis 1 needs 2 x 2 = 4"):
        forward_layer(swl(), scores=np.zeros((2, 3, 2)), label=np.zeros((2, 3)))
    with pytest.raises(LayerError, match=r"'label' \(2, 3\) holds 6 labels.*'scores' \(2, 3\)"):
        forward_layer(swl(), scores=np.zeros((2, 3)), label=np.zeros((2, 3)))
    with pytest.raises(LayerError, match="same first dimension"):
        forward_layer(swl(), scores=np.zeros((2, 3)), label=np.zeros((1, 2)))


def test_softmax_with_loss_without_a_top_gets_an_automatic_one():
    layer = 'name: "loss" type: "SoftmaxWithLoss" bottom: "scores" bottom: "label"'
    net = forward_layer(layer, scores=np.zeros((2, 4)), label=np.array([1.0, 3.0]))
    assert net.loss == pytest.approx(math.log(4), rel=1e-14)


# -- EuclideanLoss ---------------------------------------------------------------------------
def test_euclidean_loss_by_hand():
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    b = np.array([[0.0, 0.0], [1.0, 1.0]])
    net = forward_layer('name: "l2" type: "EuclideanLoss" bottom: "a" bottom: "b" top: "loss"',
                        a=a, b=b)
    assert float(net.blobs["loss"].data) == pytest.approx((1 + 4 + 4 + 9) / 2 / 2, rel=1e-15)


@pytest.mark.parametrize("shape_b,extra", [((3, 4), ""), ((3, 2, 2), "loss_weight: 0.5")])
def test_euclidean_loss_gradient_both_bottoms(shape_b, extra):
    a, b = RNG.standard_normal((3, 4)), RNG.standard_normal(shape_b)
    net = check_gradients(f'name: "l2" type: "EuclideanLoss" bottom: "a" bottom: "b" '
                          f'top: "loss" {extra}', {"a": a, "b": b})
    net.forward(a=a, b=b)
    d = a - b.reshape(a.shape)
    assert float(net.blobs["loss"].data) == pytest.approx((d * d).sum() / 3 / 2, rel=1e-13)


def test_euclidean_loss_count_mismatch():
    with pytest.raises(LayerError, match=r"'a' \(2, 3\) and bottom 'b' \(2, 4\) differ"):
        forward_layer('name: "l2" type: "EuclideanLoss" bottom: "a" bottom: "b" top: "loss"',
                      a=np.zeros((2, 3)), b=np.zeros((2, 4)))


# -- SigmoidCrossEntropyLoss -------------------------------------------------------------------
def sce(loss_param: str = "") -> str:
    lp = f"loss_param {{ {loss_param} }}" if loss_param else ""
    return ('name: "sce" type: "SigmoidCrossEntropyLoss" bottom: "x" bottom: "t" '
            f'top: "loss" {lp}')


def ref_sce(x, t, ignore=None, mode="BATCH_SIZE"):
    loss, count = 0.0, 0
    for xi, ti in zip(x.reshape(-1), t.reshape(-1), strict=True):
        if ignore is not None and int(ti) == ignore:
            continue
        s = 1 / (1 + math.exp(-xi))
        loss -= ti * math.log(s) + (1 - ti) * math.log(1 - s)
        count += 1
    return loss / ref_normalizer(mode, count, x.size, x.shape[0])


def test_sigmoid_cross_entropy_by_hand():
    # x = 0: log 2 whatever the target; x = ln 3, t = 1: -log(3/4). Divided by num = 2.
    x = np.array([[0.0, math.log(3)], [0.0, 0.0]])
    t = np.array([[0.3, 1.0], [1.0, 0.0]])
    net = forward_layer(sce(), x=x, t=t)
    want = (3 * math.log(2) - math.log(0.75)) / 2
    assert float(net.blobs["loss"].data) == pytest.approx(want, rel=1e-14)


@pytest.mark.parametrize("param,mode,ignore", [
    ("", "BATCH_SIZE", None), ("normalization: VALID", "VALID", None),
    ("normalization: FULL", "FULL", None), ("normalization: NONE", "NONE", None),
    ("ignore_label: -1", "BATCH_SIZE", -1), ("ignore_label: -1 normalization: VALID", "VALID", -1),
    ("ignore_label: -1 normalize: true", "VALID", -1), ("normalize: false", "BATCH_SIZE", None)])
def test_sigmoid_cross_entropy_gradient_and_value(param, mode, ignore):
    x = RNG.standard_normal((3, 2, 2)) * 3
    t = RNG.random((3, 2, 2))
    if ignore is not None:
        t[RNG.random(t.shape) < 0.3] = ignore
    net = check_gradients(sce(param), {"x": x, "t": t}, check=["x"])
    net.forward(x=x, t=t)
    assert float(net.blobs["loss"].data) == pytest.approx(ref_sce(x, t, ignore, mode),
                                                          rel=1e-12)


def test_sigmoid_cross_entropy_is_stable_for_large_inputs():
    x = np.array([[800.0, -800.0]])
    net = forward_layer(sce(), x=x, t=np.array([[0.0, 1.0]]))
    assert float(net.blobs["loss"].data) == pytest.approx(1600.0, rel=1e-14)
    net.backward()
    np.testing.assert_allclose(net.blobs["x"].diff, [[1.0, -1.0]], rtol=1e-14)


def test_sigmoid_cross_entropy_count_mismatch():
    with pytest.raises(LayerError, match=r"'x' \(2, 3\) and bottom 't' \(2, 2\) differ in count"):
        forward_layer(sce(), x=np.zeros((2, 3)), t=np.zeros((2, 2)))


# -- HingeLoss ---------------------------------------------------------------------------------
def hinge(norm: str = "") -> str:
    hp = f"hinge_loss_param {{ norm: {norm} }}" if norm else ""
    return f'name: "hinge" type: "HingeLoss" bottom: "x" bottom: "label" top: "loss" {hp}'


def test_hinge_loss_by_hand():
    # Sample 0, label 0: margins max(0, 1 - 1), max(0, 1 - 1), max(0, 1 + 0.5) = 0, 0, 1.5.
    # Sample 1, label 2: max(0, 1 + 0.2), max(0, 1 - 3), max(0, 1 - 0.5) = 1.2, 0, 0.5.
    x = np.array([[1.0, -1.0, 0.5], [0.2, -3.0, 0.5]])
    lab = np.array([0.0, 2.0])
    assert float(forward_layer(hinge(), x=x, label=lab).blobs["loss"].data) == pytest.approx(
        (1.5 + 1.2 + 0.5) / 2, rel=1e-14)
    assert float(forward_layer(hinge("L2"), x=x, label=lab).blobs["loss"].data) == pytest.approx(
        (1.5**2 + 1.2**2 + 0.5**2) / 2, rel=1e-14)


@pytest.mark.parametrize("norm", ["", "L1", "L2"])
@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 2)])
def test_hinge_loss_gradient(norm, shape):
    x = RNG.standard_normal(shape) * 2
    lab = random_labels(RNG, (shape[0],), math.prod(shape[1:]))
    check_gradients(hinge(norm), {"x": x, "label": lab}, check=["x"])


def test_hinge_loss_bad_label():
    with pytest.raises(LabelError, match=r"label value 5 .*outside \[0, 3\)"):
        forward_layer(hinge(), x=np.zeros((2, 3)), label=np.array([0.0, 5.0]))


# -- Accuracy ----------------------------------------------------------------------------------
def acc(param: str = "", tops: str = 'top: "acc"') -> str:
    ap = f"accuracy_param {{ {param} }}" if param else ""
    return f'name: "acc" type: "Accuracy" bottom: "x" bottom: "label" {tops} {ap}'


def test_accuracy_top_1_and_2_by_hand():
    x = np.array([[0.1, 0.5, 0.4],    # label 2: second best
                  [0.7, 0.2, 0.1],    # label 0: best
                  [0.2, 0.3, 0.5],    # label 0: third
                  [0.3, 0.3, 0.4]])   # label 1: tied for second
    lab = np.array([2.0, 0.0, 0.0, 1.0])
    net = forward_layer(acc(), phase=TEST, x=x, label=lab)
    assert net.blobs["acc"].data.shape == ()
    assert float(net.blobs["acc"].data) == 0.25
    # Top 2: row 0 in; row 3's label ties with class 0, and Caffe counts a tie against it:
    # three classes score >= 0.3, which is more than two.
    net = forward_layer(acc("top_k: 2"), phase=TEST, x=x, label=lab)
    assert float(net.blobs["acc"].data) == 0.5
    net = forward_layer(acc("top_k: 3"), phase=TEST, x=x, label=lab)
    assert float(net.blobs["acc"].data) == 1.0


def test_accuracy_ties_count_against_the_label():
    x = np.array([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])
    net = forward_layer(acc(), phase=TEST, x=x, label=np.array([0.0, 2.0]))
    assert float(net.blobs["acc"].data) == 0.0
    net = forward_layer(acc("top_k: 2"), phase=TEST, x=x, label=np.array([0.0, 2.0]))
    assert float(net.blobs["acc"].data) == 0.5


def test_accuracy_ignore_label_and_per_class():
    x = np.array([[0.9, 0.1, 0.0], [0.1, 0.8, 0.1], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6],
                  [0.5, 0.4, 0.1]])
    lab = np.array([0.0, 1.0, 1.0, -1.0, 0.0])
    net = forward_layer(acc("ignore_label: -1", tops='top: "acc" top: "per_class"'), phase=TEST,
                        x=x, label=lab)
    assert float(net.blobs["acc"].data) == 0.75  # 3 right of 4 counted
    np.testing.assert_array_equal(net.blobs["per_class"].data, [1.0, 0.5, 0.0])
    assert net.blobs["per_class"].data.shape == (3,)
    assert net.builder.loss_tops == [] and net.loss == 0.0  # not a loss


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("ignore", [None, 1])
def test_accuracy_spatial_matches_reference(top_k, ignore):
    x = RNG.integers(0, 3, size=(3, 4, 2, 3)).astype(np.float64)  # many ties
    lab = random_labels(RNG, (3, 1, 2, 3), 4)
    p = f"top_k: {top_k}" + (f" ignore_label: {ignore}" if ignore is not None else "")
    net = forward_layer(acc(p, tops='top: "acc" top: "per_class"'), phase=TEST, x=x, label=lab)
    want, per = ref_accuracy(x, lab, top_k=top_k, ignore=ignore)
    assert float(net.blobs["acc"].data) == pytest.approx(want, rel=1e-15)
    np.testing.assert_allclose(net.blobs["per_class"].data, per, rtol=1e-15)


def test_accuracy_on_a_later_axis_and_with_nothing_counted():
    x = RNG.standard_normal((2, 3, 4))
    lab = random_labels(RNG, (2, 3), 4)
    net = forward_layer(acc("axis: 2"), phase=TEST, x=x, label=lab)
    assert float(net.blobs["acc"].data) == pytest.approx(ref_accuracy(x, lab, axis=2)[0])
    net = forward_layer(acc("ignore_label: 0"), phase=TEST, x=np.zeros((2, 3)), label=np.zeros(2))
    assert float(net.blobs["acc"].data) == 0.0


def test_accuracy_errors():
    with pytest.raises(LayerError, match="top_k 4 is more than the 3 classes"):
        forward_layer(acc("top_k: 4"), phase=TEST, x=np.zeros((2, 3)), label=np.zeros(2))
    with pytest.raises(LayerError, match=r"'label' \(3,\) holds 3 labels"):
        forward_layer(acc(), phase=TEST, x=np.zeros((2, 3)), label=np.zeros(3))
    with pytest.raises(LabelError, match="label value 3 "):
        forward_layer(acc(), phase=TEST, x=np.zeros((2, 3)), label=np.array([0.0, 3.0]))


def test_accuracy_has_no_gradient():
    # force_backward alone leaves Accuracy out of the backward pass ...
    net = forward_layer(acc(), phase=TRAIN, x=np.eye(3), label=np.arange(3.0))
    net.backward()
    assert float(net.blobs["acc"].data) == 1.0
    # ... but a net whose loss goes through it is an error.
    text = layer_net('name: "ip" type: "InnerProduct" bottom: "x" top: "s" '
                     'inner_product_param { num_output: 3 }', {"x": (3, 3), "label": (3,)})
    text += 'layer { name: "acc" type: "Accuracy" bottom: "s" bottom: "label" top: "acc" ' \
            'loss_weight: 1 }\n'
    with pytest.raises(LayerError, match="Accuracy cannot be used as a loss"):
        Net(text, phase=TRAIN)


# -- in a net ----------------------------------------------------------------------------------
def test_classifier_head_shares_scores_between_loss_and_accuracy():
    text = ('layer { name: "in" type: "Input" top: "x" top: "label" input_param { '
            'shape { dim: 5 dim: 4 } shape { dim: 5 } } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "s" inner_product_param {'
            ' num_output: 3 weight_filler { type: "gaussian" std: 1 } } }\n'
            'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "label" '
            'top: "loss" }\n'
            'layer { name: "acc" type: "Accuracy" bottom: "s" bottom: "label" top: "acc" }\n')
    net = Net(text, phase=TRAIN, dtype="float64")
    x, lab = RNG.standard_normal((5, 4)), random_labels(RNG, (5,), 3)
    out = net.forward(x=x, label=lab)
    w, b = (p.data for p in net.params["ip"])
    s = x @ w.T + b
    assert float(out["loss"]) == pytest.approx(ref_softmax_loss(s, lab), rel=1e-12)
    assert float(out["acc"]) == pytest.approx(ref_accuracy(s, lab)[0])
    net.backward()
    onehot = np.eye(3)[lab.astype(int)]
    np.testing.assert_allclose(net.params["ip"][0].diff, (ref_softmax(s, 1) - onehot).T @ x / 5,
                               rtol=1e-12)
