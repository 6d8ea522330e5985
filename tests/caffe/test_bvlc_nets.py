"""Every net BVLC Caffe 1.0 ships under models/ and examples/ (stored byte for byte in
tests/fixtures/bvlc/) builds in each NetState it has data for, data layers swapped for Input
stand-ins; forward gives Caffe's output shapes, parameter counts and finite losses, and a
TRAIN backward gives every learnable parameter a finite, nonzero gradient."""

from __future__ import annotations

import os

import numpy as np
import pytest
from google.protobuf import text_format

from purine.caffe import TEST, TRAIN, Net
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import filter_net, read_message, read_net, replace_data_layers

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "fixtures", "bvlc")

# The net prototxts of BVLC/caffe at tag 1.0 (commit eeebdab16155d34ff8f5f42137da7df4d1c7eab0):
# `git ls-tree -r --name-only 1.0 -- models examples`, every *.prototxt but the 25 solvers.
# (An index listing of the repository's files spans all its history, forks' files included;
# the tag's tree is the 1.0 set.)
BVLC_NETS = [
    "examples/cifar10/cifar10_full.prototxt",
    "examples/cifar10/cifar10_full_sigmoid_train_test.prototxt",
    "examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt",
    "examples/cifar10/cifar10_full_train_test.prototxt",
    "examples/cifar10/cifar10_quick.prototxt",
    "examples/cifar10/cifar10_quick_train_test.prototxt",
    "examples/feature_extraction/imagenet_val.prototxt",
    "examples/finetune_pascal_detection/pascal_finetune_trainval_test.prototxt",
    "examples/hdf5_classification/nonlinear_auto_test.prototxt",
    "examples/hdf5_classification/nonlinear_auto_train.prototxt",
    "examples/hdf5_classification/nonlinear_train_val.prototxt",
    "examples/hdf5_classification/train_val.prototxt",
    "examples/mnist/lenet.prototxt",
    "examples/mnist/lenet_train_test.prototxt",
    "examples/mnist/mnist_autoencoder.prototxt",
    "examples/net_surgery/bvlc_caffenet_full_conv.prototxt",
    "examples/net_surgery/conv.prototxt",
    "examples/pycaffe/linreg.prototxt",
    "examples/siamese/mnist_siamese.prototxt",
    "examples/siamese/mnist_siamese_train_test.prototxt",
    "models/bvlc_alexnet/deploy.prototxt",
    "models/bvlc_alexnet/train_val.prototxt",
    "models/bvlc_googlenet/deploy.prototxt",
    "models/bvlc_googlenet/train_val.prototxt",
    "models/bvlc_reference_caffenet/deploy.prototxt",
    "models/bvlc_reference_caffenet/train_val.prototxt",
    "models/bvlc_reference_rcnn_ilsvrc13/deploy.prototxt",
    "models/finetune_flickr_style/deploy.prototxt",
    "models/finetune_flickr_style/train_val.prototxt",
]
# Solvers that carry their net inline (net_param): the net is tested, the solver is not.
SOLVER_NETS = ["examples/mnist/lenet_consolidated_solver.prototxt"]

SOURCE_TYPES = ("Data", "ImageData", "HDF5Data", "MemoryData", "WindowData", "Python")
LOSS_TYPES = ("SoftmaxWithLoss", "Accuracy")  # the layers that take class labels
LABEL_TOPS = ("label", "sim")  # one value per sample: shape (N,)
# One record of each net's dataset before the transformer crops it (crop_size, when set,
# replaces the spatial size): MNIST digits, siamese MNIST pairs stacked on channels, CIFAR-10
# images, the 4 features of the HDF5 classification example, 256x256 colour images for the
# ImageNet, Flickr Style and PASCAL window nets.
MNIST, PAIRS, CIFAR, FEATURES, IMAGES = (1, 28, 28), (2, 28, 28), (3, 32, 32), (4,), (3, 256, 256)
DATASETS = {
    "examples/cifar10/cifar10_full_sigmoid_train_test.prototxt": CIFAR,
    "examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt": CIFAR,
    "examples/cifar10/cifar10_full_train_test.prototxt": CIFAR,
    "examples/cifar10/cifar10_quick_train_test.prototxt": CIFAR,
    "examples/feature_extraction/imagenet_val.prototxt": IMAGES,
    "examples/finetune_pascal_detection/pascal_finetune_trainval_test.prototxt": IMAGES,
    "examples/hdf5_classification/nonlinear_auto_test.prototxt": FEATURES,
    "examples/hdf5_classification/nonlinear_auto_train.prototxt": FEATURES,
    "examples/hdf5_classification/nonlinear_train_val.prototxt": FEATURES,
    "examples/hdf5_classification/train_val.prototxt": FEATURES,
    "examples/mnist/lenet_consolidated_solver.prototxt": MNIST,
    "examples/mnist/lenet_train_test.prototxt": MNIST,
    "examples/mnist/mnist_autoencoder.prototxt": MNIST,
    "examples/siamese/mnist_siamese_train_test.prototxt": PAIRS,
    "models/bvlc_alexnet/train_val.prototxt": IMAGES,
    "models/bvlc_googlenet/train_val.prototxt": IMAGES,
    "models/bvlc_reference_caffenet/train_val.prototxt": IMAGES,
    "models/finetune_flickr_style/train_val.prototxt": IMAGES,
}
# Stand-in batch: the net's own batch_size (or Input batch) capped at 2, and at 1 where one
# sample holds more than BIG values (224x224 and 227x227 colour images), to keep the file fast.
BATCH, BIG = 2, 100_000

# Caffe's learnable parameter counts (shared blobs once). CaffeNet = AlexNet = 60,965,224;
# the fine-tuned nets swap fc8 (4096*1000+1000) for their own classifier.
CAFFENET = 60_965_224
FC8 = 4096 * 1000 + 1000
LENET = (20 * 25 + 20) + (50 * 20 * 25 + 50) + (500 * 800 + 500) + (10 * 500 + 10)  # 431,080
CIFAR_FULL = (32 * 75 + 32) + (32 * 800 + 32) + (64 * 800 + 64) + (10 * 1024 + 10)  # 89,578
CIFAR_BN = CIFAR_FULL - (32 + 32 + 64) + 3 * 1 + 2 * (32 + 32 + 64)  # no conv bias; BN 2C+1
CIFAR_QUICK = (32 * 75 + 32) + (32 * 800 + 32) + (64 * 800 + 64) + (64 * 1024 + 64) + (10 * 64
                                                                                       + 10)
GOOGLENET = 6_998_552
# Each auxiliary classifier: 1x1 conv to 128, fc 2048->1024, classifier 1024->1000.
AUX1 = (128 * 512 + 128) + (1024 * 2048 + 1024) + (1000 * 1024 + 1000)
AUX2 = (128 * 528 + 128) + (1024 * 2048 + 1024) + (1000 * 1024 + 1000)
AUTOENCODER = sum(a * b + b for a, b in [(784, 1000), (1000, 500), (500, 250), (250, 30),
                                          (30, 250), (250, 500), (500, 1000), (1000, 784)])
PARAMS = {
    "examples/cifar10/cifar10_full.prototxt": CIFAR_FULL,
    "examples/cifar10/cifar10_full_sigmoid_train_test.prototxt": CIFAR_FULL,
    "examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt": CIFAR_BN,
    "examples/cifar10/cifar10_full_train_test.prototxt": CIFAR_FULL,
    "examples/cifar10/cifar10_quick.prototxt": CIFAR_QUICK,
    "examples/cifar10/cifar10_quick_train_test.prototxt": CIFAR_QUICK,
    "examples/feature_extraction/imagenet_val.prototxt": CAFFENET,
    "examples/finetune_pascal_detection/pascal_finetune_trainval_test.prototxt":
        CAFFENET - FC8 + 4096 * 21 + 21,
    "examples/hdf5_classification/nonlinear_auto_test.prototxt": 4 * 40 + 40 + 40 * 2 + 2,
    "examples/hdf5_classification/nonlinear_auto_train.prototxt": 4 * 40 + 40 + 40 * 2 + 2,
    "examples/hdf5_classification/nonlinear_train_val.prototxt": 4 * 40 + 40 + 40 * 2 + 2,
    "examples/hdf5_classification/train_val.prototxt": 4 * 2 + 2,
    "examples/mnist/lenet.prototxt": LENET,
    "examples/mnist/lenet_consolidated_solver.prototxt": LENET,
    "examples/mnist/lenet_train_test.prototxt": LENET,
    "examples/mnist/mnist_autoencoder.prototxt": AUTOENCODER,
    "examples/net_surgery/bvlc_caffenet_full_conv.prototxt": CAFFENET,  # fc6-8 as convolutions
    "examples/net_surgery/conv.prototxt": 3 * 25 + 3,
    "examples/pycaffe/linreg.prototxt": 2 * (10 * 6 + 10),
    "examples/siamese/mnist_siamese.prototxt": LENET + 2 * 10 + 2,
    "examples/siamese/mnist_siamese_train_test.prototxt": LENET + 2 * 10 + 2,
    "models/bvlc_alexnet/deploy.prototxt": CAFFENET,
    "models/bvlc_alexnet/train_val.prototxt": CAFFENET,
    "models/bvlc_googlenet/deploy.prototxt": GOOGLENET,
    "models/bvlc_googlenet/train_val.prototxt": GOOGLENET + AUX1 + AUX2,
    "models/bvlc_reference_caffenet/deploy.prototxt": CAFFENET,
    "models/bvlc_reference_caffenet/train_val.prototxt": CAFFENET,
    "models/bvlc_reference_rcnn_ilsvrc13/deploy.prototxt": CAFFENET - FC8 + 4096 * 200 + 200,
    "models/finetune_flickr_style/deploy.prototxt": CAFFENET - FC8 + 4096 * 20 + 20,
    "models/finetune_flickr_style/train_val.prototxt": CAFFENET - FC8 + 4096 * 20 + 20,
}
# Class counts of the label-taking layers: MNIST, CIFAR-10 10, ImageNet 1000, Flickr Style
# 20, PASCAL VOC 20 + background, the HDF5 example 2.
CLASSES = {
    "examples/cifar10/cifar10_full_sigmoid_train_test.prototxt": 10,
    "examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt": 10,
    "examples/cifar10/cifar10_full_train_test.prototxt": 10,
    "examples/cifar10/cifar10_quick_train_test.prototxt": 10,
    "examples/feature_extraction/imagenet_val.prototxt": 1000,
    "examples/finetune_pascal_detection/pascal_finetune_trainval_test.prototxt": 21,
    "examples/hdf5_classification/nonlinear_auto_test.prototxt": 2,
    "examples/hdf5_classification/nonlinear_auto_train.prototxt": 2,
    "examples/hdf5_classification/nonlinear_train_val.prototxt": 2,
    "examples/hdf5_classification/train_val.prototxt": 2,
    "examples/mnist/lenet_consolidated_solver.prototxt": 10,
    "examples/mnist/lenet_train_test.prototxt": 10,
    "models/bvlc_alexnet/train_val.prototxt": 1000,
    "models/bvlc_googlenet/train_val.prototxt": 1000,
    "models/bvlc_reference_caffenet/train_val.prototxt": 1000,
    "models/finetune_flickr_style/train_val.prototxt": 20,
}

# Output blobs (tops no layer consumes, sorted) and their shapes by Caffe's rules, per
# NetState ("TRAIN", "TEST", "TEST/<stage>"); "N" is the stand-in batch. Losses and
# accuracies are 0-axis blobs; a loss layer without a top gets Caffe's "(automatic)" one.
SCORES = {"accuracy": (), "loss": ()}
TRAIN_TEST = {"TRAIN": {"loss": ()}, "TEST": SCORES}
GOOGLENET_TEST = {f"loss{i}/{k}": () for i in (1, 2, 3) for k in (f"loss{i}", "top-1", "top-5")}
AUTOENCODER_OUT = {"cross_entropy_loss": (), "l2_error": ()}
OUTPUTS = {
    "examples/cifar10/cifar10_full.prototxt": {"TEST": {"prob": ("N", 10)}},
    "examples/cifar10/cifar10_full_sigmoid_train_test.prototxt": TRAIN_TEST,
    "examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt": TRAIN_TEST,
    "examples/cifar10/cifar10_full_train_test.prototxt": TRAIN_TEST,
    "examples/cifar10/cifar10_quick.prototxt": {"TEST": {"prob": ("N", 10)}},
    "examples/cifar10/cifar10_quick_train_test.prototxt": TRAIN_TEST,
    "examples/feature_extraction/imagenet_val.prototxt": {"TRAIN": SCORES, "TEST": SCORES},
    "examples/finetune_pascal_detection/pascal_finetune_trainval_test.prototxt": {
        "TRAIN": {"(automatic)": ()}, "TEST": {"(automatic)": (), "accuracy": ()}},
    "examples/hdf5_classification/nonlinear_auto_test.prototxt": {"TRAIN": SCORES,
                                                                   "TEST": SCORES},
    "examples/hdf5_classification/nonlinear_auto_train.prototxt": {"TRAIN": SCORES,
                                                                    "TEST": SCORES},
    "examples/hdf5_classification/nonlinear_train_val.prototxt": TRAIN_TEST,
    "examples/hdf5_classification/train_val.prototxt": TRAIN_TEST,
    "examples/mnist/lenet.prototxt": {"TEST": {"prob": ("N", 10)}},
    "examples/mnist/lenet_consolidated_solver.prototxt": {
        "TRAIN": SCORES, "TEST/test-on-test-set": SCORES,  # its accuracy has no phase rule
        "TEST/test-on-train-set": SCORES},
    "examples/mnist/lenet_train_test.prototxt": TRAIN_TEST,
    "examples/mnist/mnist_autoencoder.prototxt": {
        "TRAIN": AUTOENCODER_OUT, "TEST/test-on-test": AUTOENCODER_OUT,
        "TEST/test-on-train": AUTOENCODER_OUT},
    # 451x451 gives an 8x8 map of class scores (the net surgery example's figure).
    "examples/net_surgery/bvlc_caffenet_full_conv.prototxt": {"TEST": {"prob": (1, 1000, 8, 8)}},
    "examples/net_surgery/conv.prototxt": {"TEST": {"conv": (1, 3, 96, 96)}},
    "examples/pycaffe/linreg.prototxt": {"TRAIN": {"loss": (1,)}, "TEST": {"loss": (1,)}},
    "examples/siamese/mnist_siamese.prototxt": {"TEST": {"feat": ("N", 2)}},
    "examples/siamese/mnist_siamese_train_test.prototxt": {"TRAIN": {"loss": ()},
                                                           "TEST": {"loss": ()}},
    "models/bvlc_alexnet/deploy.prototxt": {"TEST": {"prob": ("N", 1000)}},
    "models/bvlc_alexnet/train_val.prototxt": TRAIN_TEST,
    "models/bvlc_googlenet/deploy.prototxt": {"TEST": {"prob": ("N", 1000)}},
    "models/bvlc_googlenet/train_val.prototxt": {
        "TRAIN": {"loss1/loss1": (), "loss2/loss2": (), "loss3/loss3": ()},
        "TEST": GOOGLENET_TEST},
    "models/bvlc_reference_caffenet/deploy.prototxt": {"TEST": {"prob": ("N", 1000)}},
    "models/bvlc_reference_caffenet/train_val.prototxt": TRAIN_TEST,
    "models/bvlc_reference_rcnn_ilsvrc13/deploy.prototxt": {"TEST": {"fc-rcnn": ("N", 200)}},
    "models/finetune_flickr_style/deploy.prototxt": {"TEST": {"prob": ("N", 20)}},
    "models/finetune_flickr_style/train_val.prototxt": TRAIN_TEST,
}

# Loss tops and their loss_weight where not {"loss": 1} (a loss layer's default weight 1 on
# its first top; nets without a "loss" output have none): GoogLeNet's auxiliary classifiers
# count 0.3, the autoencoder reports its L2 error at weight 0, the PASCAL net's loss layer
# declares no top.
LOSS_WEIGHTS = {
    "models/bvlc_googlenet/train_val.prototxt": {"loss1/loss1": 0.3, "loss2/loss2": 0.3,
                                                 "loss3/loss3": 1.0},
    "examples/mnist/mnist_autoencoder.prototxt": {"cross_entropy_loss": 1.0, "l2_error": 0.0},
    "examples/finetune_pascal_detection/pascal_finetune_trainval_test.prototxt": {
        "(automatic)": 1.0},
}


def fixture_path(origin: str) -> str:
    return os.path.join(FIXTURES, origin.replace("/", "__"))


def load(origin: str) -> pb.NetParameter:
    """The net of a fixture (upgraded from V0/V1 by read_net); a solver's inline net_param."""
    if origin in SOLVER_NETS:
        solver = read_message(fixture_path(origin), pb.SolverParameter())
        return read_net(solver.net_param)
    return read_net(fixture_path(origin))


def sources(param: pb.NetParameter) -> list[pb.LayerParameter]:
    """Layers that read a dataset: the source types with no bottoms (a Python layer with
    bottoms, like linreg's loss, computes rather than reads)."""
    return [lp for lp in param.layer if lp.type in SOURCE_TYPES and not lp.bottom]


def states(param: pb.NetParameter) -> list[tuple[int, tuple[str, ...]]]:
    """TRAIN, TEST and TEST with each stage the include rules name, kept where the filtered
    net reads data (DummyData counts); a net fed only by Input (a deploy net) runs in TEST."""
    stages = sorted({s for lp in param.layer for r in lp.include for s in r.stage})
    candidates = [(TRAIN, ()), (TEST, ())] + [(TEST, (s,)) for s in stages]
    with_data = [(phase, st) for phase, st in candidates if any(
        lp.type == "DummyData" or lp in sources(param) for lp in
        filter_net(param, pb.NetState(phase=phase, stage=st)).layer)]
    return with_data or [(TEST, ())]


def state_name(phase: int, stages: tuple[str, ...]) -> str:
    return "/".join(["TRAIN" if phase == TRAIN else "TEST", *stages])


def batch_size(lp: pb.LayerParameter) -> int:
    for field in ("data_param", "image_data_param", "hdf5_data_param", "window_data_param",
                  "memory_data_param"):
        if lp.HasField(field):
            return getattr(lp, field).batch_size
    raise AssertionError(f"no batch_size in data layer '{lp.name}' ({lp.type})")


def stand_in_batch(declared: int, sample: tuple[int, ...]) -> int:
    return min(declared, 1 if int(np.prod(sample)) > BIG else BATCH)


def stand_in(origin: str, param: pb.NetParameter) -> tuple[pb.NetParameter, int]:
    """The filtered net with its data layers replaced by Input layers (and Input batches cut
    down), and the stand-in batch N."""
    out = pb.NetParameter()
    out.CopyFrom(param)
    layers = sources(out)
    if not layers:  # Input layers (a deploy net), the batch capped; DummyData kept as is
        batches = []
        for lp in out.layer:
            for shape in (lp.input_param.shape if lp.type == "Input" else []):
                shape.dim[0] = stand_in_batch(shape.dim[0], tuple(shape.dim[1:]))
                batches.append(shape.dim[0])
            batches += [shape.dim[0] for shape in lp.dummy_data_param.shape]
        assert len(set(batches)) == 1, batches
        return out, batches[0]
    assert len(layers) == 1, [lp.name for lp in layers]
    lp = layers[0]
    sample = DATASETS[origin]
    crop = lp.transform_param.crop_size
    if crop:
        sample = (sample[0], crop, crop)
    n = stand_in_batch(batch_size(lp), sample)
    shapes = {top: (n,) if top in LABEL_TOPS else (n, *sample) for top in lp.top}
    return replace_data_layers(out, shapes), n


def derived_classes(param: pb.NetParameter) -> int:
    """num_output of the layer that makes the scores each label-taking layer reads (walking
    up through layers without num_output, such as Softmax); the least over those layers."""
    producer = {}
    for lp in param.layer:
        for top in lp.top:
            producer.setdefault(top, lp)  # in-place layers keep the first writer
    counts = []
    for lp in param.layer:
        if lp.type in LOSS_TYPES and len(lp.bottom) > 1:
            layer = producer[lp.bottom[0]]
            while not layer.inner_product_param.num_output:
                layer = producer[layer.bottom[0]]
            counts.append(layer.inner_product_param.num_output)
    return min(counts)


def feed(net: Net, param: pb.NetParameter, origin: str) -> dict[str, np.ndarray]:
    """Seeded inputs for the net built from ``param`` (before its data layers were replaced):
    labels valid class indices (siamese similarity 0/1); pixels in [0, 1) where the data
    layer scales them so (MNIST's 1/256), else mean-subtracted-like normals."""
    rng = np.random.default_rng(0)
    scaled = any(lp.transform_param.scale != 1 for lp in param.layer)
    out = {}
    for name in net.inputs:
        shape = net.blobs[name].shape
        if name == "sim":
            out[name] = rng.integers(0, 2, shape).astype(np.float32)
        elif name == "label":
            classes = derived_classes(param)
            assert classes == CLASSES[origin]
            out[name] = rng.integers(0, classes, shape).astype(np.float32)
        elif scaled:
            out[name] = rng.random(shape, dtype=np.float32)
        else:
            out[name] = rng.standard_normal(shape).astype(np.float32)
    return out


def stand_in_weights(net: Net, param: pb.NetParameter) -> None:
    """A net that names no weight filler leaves every weight at Caffe's default constant 0:
    it is meant to run with a .caffemodel. Give it seeded random weights in the stead of one
    (normal with variance 1/fan_in, biases 0.1 * normal), so that signals and gradients are
    not all zero."""
    if "weight_filler" in text_format.MessageToString(param):
        return
    # One block of normals tiled over each blob: drawing 60 million values would cost more
    # than the whole forward pass.
    block = np.random.default_rng(1).standard_normal(1 << 16, dtype=np.float32)
    for views in net.params.values():
        for view in views:
            shape = view.shape
            std = 0.1 if len(shape) == 1 else float(np.prod(shape[1:])) ** -0.5
            view.data[...] = np.resize(block, shape) * np.float32(std)


# Parameters whose gradient is exactly zero by Caffe's math: in the siamese net the
# contrastive loss depends on feat - feat_p only, and ip2 -> feat is affine (no nonlinearity),
# so the shared biases of ip2 and feat get opposite gradients from the two twins.
ZERO_GRADIENT = {
    "examples/siamese/mnist_siamese_train_test.prototxt": {
        ("ip2", 1), ("ip2_p", 1), ("feat", 1), ("feat_p", 1)},
}


def lr_mult(param: pb.NetParameter, layer: str, k: int) -> float:
    lp = next(lp for lp in param.layer if lp.name == layer)
    spec = lp.param[k] if k < len(lp.param) else pb.ParamSpec()
    return spec.lr_mult if spec.HasField("lr_mult") else 1.0


CASES = [(origin, phase, st) for origin in BVLC_NETS + SOLVER_NETS
         for phase, st in states(load(origin))]


@pytest.mark.parametrize("origin,phase,stages", CASES,
                         ids=[f"{o}-{state_name(p, s)}" for o, p, s in CASES])
def test_net_runs_with_caffes_shapes_and_finite_losses(origin, phase, stages, monkeypatch):
    """Build one NetState of a Caffe 1.0 net on stand-in data: Caffe's parameter count and
    output shapes, the loss as the loss_weight sum of its tops, and in TRAIN a gradient that
    reaches every parameter with a nonzero lr_mult."""
    monkeypatch.syspath_prepend(FIXTURES)  # linreg's python_param module 'pyloss'
    filtered = filter_net(load(origin), pb.NetState(phase=phase, stage=stages))
    param, n = stand_in(origin, filtered)
    net = Net(param, phase=phase, stages=stages, seed=0)
    assert sum(b.count for b in net.builder.learnable_params) == PARAMS[origin]
    stand_in_weights(net, param)

    out = net.forward(**feed(net, filtered, origin))
    expected = OUTPUTS[origin][state_name(phase, stages)]
    assert sorted(out) == sorted(expected)
    for name, shape in expected.items():
        assert out[name].shape == tuple(n if d == "N" else d for d in shape), name
        assert np.isfinite(out[name]).all(), name
        if name == "accuracy" or "top-" in name:
            assert 0.0 <= float(out[name]) <= 1.0, name
        if name == "prob":  # Softmax over the channel axis
            np.testing.assert_allclose(out[name].sum(axis=1), 1.0, rtol=1e-5)
    weights = LOSS_WEIGHTS.get(origin, {"loss": 1.0} if "loss" in expected else {})
    total = sum(w * float(out[top].sum()) for top, w in weights.items())
    assert np.isfinite(net.loss) and net.loss == pytest.approx(total, rel=1e-6)
    assert (net.loss > 0) == any(weights.values())
    if phase != TRAIN:
        return

    net.backward()
    assert net.params
    zero = ZERO_GRADIENT.get(origin, set())
    for layer, views in net.params.items():
        weight_scale = float(np.abs(views[0].diff).max())
        for k, view in enumerate(views):
            diff = view.diff
            assert np.isfinite(diff).all(), (layer, k)
            if (layer, k) in zero:
                assert np.abs(diff).max() <= 1e-6 * weight_scale, (layer, k)
            elif lr_mult(param, layer, k) != 0:
                assert np.abs(diff).max() > 0, (layer, k)


def test_siamese_twins_share_their_parameters():
    """The _p twin layers name the same parameters (conv1_w ...): one array for both."""
    origin = "examples/siamese/mnist_siamese_train_test.prototxt"
    param, _ = stand_in(origin, filter_net(load(origin), pb.NetState(phase=TRAIN)))
    net = Net(param, phase=TRAIN, seed=0)
    twins = [layer for layer in net.params if layer.endswith("_p")]
    assert twins == ["conv1_p", "conv2_p", "ip1_p", "ip2_p", "feat_p"]
    for twin in twins:
        for mine, theirs in zip(net.params[twin], net.params[twin[:-2]]):
            assert np.shares_memory(mine.data, theirs.data), twin


def test_states_are_the_ones_caffes_solvers_run():
    """Each net runs in exactly the NetStates its expected outputs name; the autoencoder's
    and the consolidated LeNet's TEST stages are those of their solvers' test_state."""
    for origin in BVLC_NETS + SOLVER_NETS:
        got = sorted(state_name(p, s) for p, s in states(load(origin)))
        assert got == sorted(OUTPUTS[origin]), origin
    solver = read_message(fixture_path(SOLVER_NETS[0]), pb.SolverParameter())
    tests = [state_name(TEST, tuple(st.stage)) for st in solver.test_state]
    assert sorted(tests) == sorted(OUTPUTS[SOLVER_NETS[0]])[:-1]  # all but TRAIN


def test_fixtures_are_every_net_caffe_ships():
    names = sorted(f for f in os.listdir(FIXTURES) if f.endswith(".prototxt"))
    assert names == sorted(fixture_path(o).rsplit(os.sep, 1)[1]
                           for o in BVLC_NETS + SOLVER_NETS)
    assert sorted(OUTPUTS) == sorted(PARAMS) == sorted(BVLC_NETS + SOLVER_NETS)
    unlabelled = ["examples/mnist/mnist_autoencoder.prototxt",  # data sets without classes
                  "examples/siamese/mnist_siamese_train_test.prototxt"]
    assert sorted(DATASETS) == sorted([*CLASSES, *unlabelled])
    with open(os.path.join(FIXTURES, "README.md")) as f:
        readme = f.read()
    for origin in BVLC_NETS + SOLVER_NETS:
        assert f"- {origin}\n" in readme, origin


def test_the_consolidated_solver_net_is_v1_and_upgrades_to_lenet_train_test():
    """Caffe 1.0's only V1-format net: after the upgrade it has the layers, types, blobs and
    parameters of the current-format lenet_train_test.prototxt (apart from its data rules)."""
    solver = read_message(fixture_path(SOLVER_NETS[0]), pb.SolverParameter())
    assert solver.net_param.layers and not solver.net_param.layer
    upgraded = load(SOLVER_NETS[0])
    current = load("examples/mnist/lenet_train_test.prototxt")
    skip = lambda net: [lp for lp in net.layer if lp.type != "Data"]  # noqa: E731
    for a, b in zip(skip(upgraded), skip(current), strict=True):
        assert (a.name, a.type, list(a.bottom), list(a.top)) == (
            b.name, b.type, list(b.bottom), list(b.top))
        assert a.convolution_param == b.convolution_param, a.name
        assert a.inner_product_param == b.inner_product_param, a.name
        assert a.pooling_param == b.pooling_param, a.name
