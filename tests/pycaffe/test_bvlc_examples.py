"""BVLC Caffe's pycaffe examples (the notebooks' code cells, examples/pycaffe) run unchanged
but for ``import caffe`` resolving to purine.pycaffe, against stand-in files made here; each
test then checks the numbers the example is about. tests/pycaffe/examples/README.md lists them."""

from __future__ import annotations

import math
import random
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np
import pytest

import purine.pycaffe
from purine.caffe import Net
from purine.datasets import split_mnist_5k, write_mnist_lmdb
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net
from purine.pycaffe.mode import settings

HERE = Path(__file__).parent
EXAMPLES = HERE / "examples"
BVLC = HERE.parent / "fixtures" / "bvlc"
CAFFE_NAMES = ("caffe", "caffe.io", "caffe.proto", "caffe.proto.caffe_pb2", "caffe.net_spec")
# The examples' own modules, imported by name from the folders they put on sys.path.
USER_MODULES = ("pyloss", "tools", "pascal_multilabel_datalayers")


@pytest.fixture
def caffe_env(monkeypatch):
    """``import caffe`` gives purine.pycaffe while the test runs; sys.path, the working
    directory, pycaffe's mode and seed and the examples' modules are restored after it."""
    saved = {k: sys.modules[k] for k in CAFFE_NAMES + USER_MODULES if k in sys.modules}
    for k in USER_MODULES:
        sys.modules.pop(k, None)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for field in ("mode", "device"):
        monkeypatch.setattr(settings, field, getattr(settings, field))
    # Solvers whose prototxt sets no random_seed draw one at random, in Caffe too: a fixed one
    # here makes every run of an example train alike.
    monkeypatch.setattr(settings, "seed", 1)
    assert purine.pycaffe.install_as_caffe()
    yield
    for k in CAFFE_NAMES + USER_MODULES:
        sys.modules.pop(k, None)
    sys.modules.update(saved)


def run_example(script: str, cwd: Path, monkeypatch) -> dict:
    """Run examples/<script> as ``__main__`` from ``cwd``; returns its globals."""
    monkeypatch.chdir(cwd)
    return runpy.run_path(str(EXAMPLES / script), run_name="__main__")


def caffe_root(tmp_path: Path) -> Path:
    """An empty stand-in for a Caffe checkout; the notebooks run from its examples/."""
    root = tmp_path / "caffe"
    (root / "examples").mkdir(parents=True)
    return root


def put(root: Path, path: str, source: Path) -> Path:
    """``source`` at ``root/path`` (a link for the large weight files)."""
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.suffix == ".caffemodel":
        target.symlink_to(source)
    else:
        shutil.copy(source, target)
    return target


def write_image(path: Path, seed: int, gray: bool = False) -> Path:
    """Stand-in for a photo of Caffe's examples/images (360 x 480, as cat.jpg): a smooth
    background with random coloured rectangles and discs, as a JPEG."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, 480)[None, :, None] * np.linspace(0, 1, 360)[:, None, None]
    image = (rng.uniform(40, 120, 3) + 100 * ramp).astype(np.uint8)
    for _ in range(12):
        x, y = int(rng.integers(0, 480)), int(rng.integers(0, 360))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            cv2.rectangle(image, (x, y), (x + int(rng.integers(20, 150)),
                                          y + int(rng.integers(20, 150))), colour, -1)
        else:
            cv2.circle(image, (x, y), int(rng.integers(10, 80)), colour, -1)
    if gray:
        image = cv2.cvtColor(image, cv2.COLOR_BGR2GRAY)
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), cv2.GaussianBlur(image, (5, 5), 0))
    return path


def write_random_caffenet(path: Path, side: int) -> Path:
    """Stand-in for bvlc_reference_caffenet.caffemodel: CaffeNet's deploy net for
    ``side`` x ``side`` inputs (227 as Caffe's; a smaller side makes fc6 smaller) with
    random weights, He-scaled so that activations keep their size through the layers, but for
    conv1's (divided by 64: inputs are in pixel units), fc6's (divided by 5, which keeps
    fc7's features as small as trained CaffeNet's, so that fine-tuning at the notebooks' rates
    stays stable) and fc8's (times 10, so that the classes get distinct scores)."""
    param = read_net(BVLC / "models__bvlc_reference_caffenet__deploy.prototxt")
    param.layer[0].input_param.shape[0].dim[:] = [1, 3, side, side]
    rng = np.random.default_rng(side)
    with Net(param, phase=pb.TEST) as net:
        for name, (w, b) in net.params.items():
            std = np.sqrt(2.0 * w.shape[0] / w.count) * SCALE.get(name, 1.0)
            w.data[...] = rng.standard_normal(w.shape, dtype=np.float32) * std
            b.data[...] = 0.0
        net.save(path)
    return path


SCALE = {"conv1": 1 / 64, "fc6": 0.2, "fc8": 10.0}


@pytest.fixture(scope="module")
def caffenet_227(tmp_path_factory) -> Path:
    return write_random_caffenet(tmp_path_factory.mktemp("weights") / "caffenet.caffemodel",
                                 227)


@pytest.fixture(scope="module")
def caffenet_99(tmp_path_factory) -> Path:
    """CaffeNet's weights for 99 x 99 inputs (fc6 4096 x 1024), for the examples that train."""
    return write_random_caffenet(tmp_path_factory.mktemp("weights") / "caffenet99.caffemodel",
                                 99)


def write_imagenet_aux(root: Path) -> None:
    """Stand-ins for python/caffe/imagenet/ilsvrc_2012_mean.npy (a 3 x 256 x 256 BGR mean
    around Caffe's 104, 117, 123) and data/ilsvrc12/synset_words.txt (1000 made-up labels)."""
    mean = root / "python" / "caffe" / "imagenet" / "ilsvrc_2012_mean.npy"
    mean.parent.mkdir(parents=True)
    rng = np.random.default_rng(1)
    np.save(mean, np.array([104.0, 117.0, 123.0])[:, None, None]
            + rng.uniform(-5, 5, (3, 256, 256)))
    words = root / "data" / "ilsvrc12" / "synset_words.txt"
    words.parent.mkdir(parents=True)
    words.write_text("".join(f"n{i:08d} class {i}\n" for i in range(1000)))


# -- 01-learning-lenet.ipynb --------------------------------------------------------------
def test_01_learning_lenet_trains_lenet_and_a_logistic_regression(tmp_path, monkeypatch,
                                                                   caffe_env):
    root = caffe_root(tmp_path)
    mnist = root / "examples" / "mnist"
    mnist.mkdir()
    # Stand-in for get_mnist.sh + create_mnist.sh: the embedded 5000 digits as the two LMDBs.
    train_x, train_y, test_x, test_y = split_mnist_5k(n_test=1000)
    write_mnist_lmdb(mnist / "mnist_train_lmdb", train_x, train_y)
    write_mnist_lmdb(mnist / "mnist_test_lmdb", test_x, test_y)
    shutil.copy(EXAMPLES / "lenet_auto_solver.prototxt", mnist)
    g = run_example("01_learning_lenet.py", root / "examples", monkeypatch)

    # The NetSpec LeNet is BVLC's lenet_auto_train.prototxt shape for shape.
    assert dict(g["blob_shapes"])["pool2"] == (64, 50, 4, 4)
    assert dict(g["param_shapes"])["fc1"] == (500, 800)
    loss, acc = g["lenet_train_loss"], g["lenet_test_acc"]
    assert np.isfinite(loss).all()
    assert loss[-10:].mean() < 0.5 * loss[:10].mean()
    assert acc[0] < acc[-1] and acc[-1] > 0.8  # chance is 0.1
    loss, acc = g["train_loss"], g["test_acc"]  # the custom net: a logistic regression
    assert loss[-10:].mean() < 0.7 * loss[:10].mean()
    assert acc[-1] > 0.7


# -- brewing-logreg.ipynb -----------------------------------------------------------------
def linear_accuracy(X: np.ndarray, y: np.ndarray, Xt: np.ndarray, yt: np.ndarray) -> float:
    """Test accuracy of a logistic regression fitted by full-batch gradient descent: what a
    linear classifier can reach on these data."""
    A, At = np.c_[X, np.ones(len(X))], np.c_[Xt, np.ones(len(Xt))]
    w = np.zeros(A.shape[1])
    for _ in range(500):
        p = 1 / (1 + np.exp(-A @ w))
        w -= 0.5 * A.T @ (p - y) / len(y)
    return float(((At @ w > 0) == yt).mean())


def test_brewing_logreg_trains_on_hdf5_and_beats_chance(tmp_path, monkeypatch, caffe_env):
    root = caffe_root(tmp_path)
    (root / "examples" / "hdf5_classification").mkdir()
    g = run_example("brewing_logreg.py", root / "examples", monkeypatch)

    best = linear_accuracy(g["X"], g["y"], g["Xt"], g["yt"])
    assert best > 0.65  # the stand-in data are learnable, and not trivially
    assert abs(float(g["logreg_accuracy"]) - best) < 0.03
    assert float(g["nonlinear_accuracy"]) > best + 0.02  # the hidden layer of 40 does better
    # Both solvers snapshot at max_iter, as solver() asks.
    assert "train_iter_1000.caffemodel" in g["snapshots"]
    assert not (root / "examples" / "hdf5_classification" / "data").exists()  # cell 21


# -- 00-classification.ipynb --------------------------------------------------------------
def test_00_classification_batch_of_50_matches_batch_of_1(tmp_path, monkeypatch, caffe_env,
                                                           caffenet_227):
    root = caffe_root(tmp_path)
    deploy = put(root, "models/bvlc_reference_caffenet/deploy.prototxt",
                 BVLC / "models__bvlc_reference_caffenet__deploy.prototxt")
    weights = put(root, "models/bvlc_reference_caffenet/bvlc_reference_caffenet.caffemodel",
                  caffenet_227)
    write_imagenet_aux(root)
    write_image(root / "examples" / "images" / "cat.jpg", seed=1)
    write_image(root / "examples" / "image.jpg", seed=2)  # what cell 45 downloads
    g = run_example("00_classification.py", root / "examples", monkeypatch)

    assert g["filter_tiles"].shape == (120, 120, 3)  # 96 conv1 filters on a 10 x 10 grid
    caffe = sys.modules["caffe"]
    single = caffe.Net(str(deploy), str(weights), caffe.TEST)
    single.blobs["data"].reshape(1, 3, 227, 227)
    single.reshape()
    second = g["transformer"].preprocess("data", g["image"])
    for probs, image in ((g["cat_probs"], g["transformed_image"]),
                         (g["net"].blobs["prob"].data, second)):
        assert probs.shape == (50, 1000)
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
        single.blobs["data"].data[...] = image
        one = single.forward()["prob"][0]
        assert one.max() > 10 / 1000  # the stand-in weights pick classes, not a flat guess
        assert (probs.argmax(axis=1) == one.argmax()).all()
        np.testing.assert_allclose(probs, np.broadcast_to(one, probs.shape), rtol=1e-4, atol=1e-8)
    assert not np.allclose(g["cat_probs"][0], g["output_prob"], atol=1e-3)


# -- net_surgery.ipynb --------------------------------------------------------------------
def test_net_surgery_filters_and_fully_convolutional_caffenet(tmp_path, monkeypatch, capsys,
                                                              caffe_env, caffenet_227):
    from scipy.signal import correlate2d

    root = caffe_root(tmp_path)
    put(root, "models/bvlc_reference_caffenet/deploy.prototxt",
        BVLC / "models__bvlc_reference_caffenet__deploy.prototxt")
    put(root, "models/bvlc_reference_caffenet/bvlc_reference_caffenet.caffemodel",
        caffenet_227)
    for name in ("conv.prototxt", "bvlc_caffenet_full_conv.prototxt"):
        put(root, f"examples/net_surgery/{name}", BVLC / f"examples__net_surgery__{name}")
    write_imagenet_aux(root)
    write_image(root / "examples" / "images" / "cat.jpg", seed=1)
    write_image(root / "examples" / "images" / "cat_gray.jpg", seed=3, gray=True)
    g = run_example("net_surgery.py", root / "examples", monkeypatch)

    # Cell 7: conv0 is a view of the conv blob, so after the bias surgery and a forward pass
    # its mean has grown by exactly the new bias, 1.
    out = capsys.readouterr().out
    pre = float(out.split("pre-surgery output mean ")[1].split()[0])
    post = float(out.split("post-surgery output mean ")[1].split()[0])
    assert post - pre == pytest.approx(1.0, abs=0.011)
    # Cell 9: the Gaussian blur (bias 1 from cell 7) and the two Sobel filters are Caffe's
    # convolution, a cross-correlation over the valid window.
    im, filtered = g["im_input"][0, 0], g["filtered"]  # (cell 22 reuses the name `im`)
    assert filtered.shape == (1, 3, 356, 476)
    for k, (kernel, bias) in enumerate(((g["gaussian"], 1.0), (g["sobel"], 0.0),
                                        (g["sobel"].T, 0.0))):
        kernel = np.pad(kernel, (5 - kernel.shape[0]) // 2)  # Sobel: the 5 x 5 centre
        want = correlate2d(im.astype(np.float64), kernel, mode="valid") + bias
        np.testing.assert_allclose(filtered[0, k], want, atol=1e-5)

    # Cells 14-22: at each position of its 8 x 8 map, the fully convolutional net's fc6-conv,
    # fc7-conv and fc8-conv compute what CaffeNet's fc6, fc7 and fc8 compute on the 6 x 6
    # pool5 window there (the 227 x 227 input window at 32 times the position, but for the
    # zero padding of conv2-conv5 at that window's borders).
    prob = g["out"]["prob"]
    assert prob.shape == (1, 1000, 8, 8)
    np.testing.assert_allclose(prob.sum(axis=1), 1.0, rtol=1e-5)
    pool5 = g["net_full_conv"].blobs["pool5"].data[0]
    assert pool5.shape == (256, 13, 13)
    spots = [(0, 0), (0, 7), (7, 0), (7, 7), (3, 4), (5, 2), (1, 6), (6, 1), (2, 2), (4, 5)]
    net = g["net"]  # CaffeNet, deploy batch 10
    net.blobs["pool5"].data[...] = np.stack([pool5[:, i:i + 6, j:j + 6] for i, j in spots])
    fc = net.forward(start="fc6")["prob"]
    for (i, j), row in zip(spots, fc):
        np.testing.assert_allclose(prob[0, :, i, j], row, rtol=1e-4, atol=1e-7)
    assert len({int(prob[0, :, i, j].argmax()) for i, j in spots}) > 1  # windows do differ
    saved = root / "examples" / "net_surgery" / "bvlc_caffenet_full_conv.caffemodel"
    assert saved.stat().st_size > 4 * 60_000_000  # every transplanted weight, in float32


# -- 02-fine-tuning.ipynb -----------------------------------------------------------------
def test_02_fine_tuning_trains_the_style_classifier_and_its_loss_falls(tmp_path, monkeypatch,
                                                                        caffe_env,
                                                                        caffenet_99):
    root = caffe_root(tmp_path)
    put(root, "models/bvlc_reference_caffenet/bvlc_reference_caffenet.caffemodel",
        caffenet_99)
    (root / "models" / "finetune_flickr_style").mkdir()
    write_imagenet_aux(root)
    # Stand-in for data/ilsvrc12/imagenet_mean.binaryproto, at the stand-in images' size.
    mean = np.array([104.0, 117.0, 123.0])[None, :, None, None] * np.ones((1, 3, 112, 112))
    (root / "data" / "ilsvrc12" / "imagenet_mean.binaryproto").write_bytes(
        sys.modules["caffe"].io.array_to_blobproto(mean).SerializeToString())
    # Stand-ins for assemble_data.py's Flickr style images: one image per style among the
    # first 5 (each its own colours and shapes) to train on, and the same styles to test on.
    names = root / "examples" / "finetune_flickr_style" / "style_names.txt"
    names.parent.mkdir()
    names.write_text("".join(f"Style {i}\n" for i in range(20)))
    flickr = root / "data" / "flickr_style"
    for subset, first in (("train", 0), ("test", 100)):
        lines = [f"{write_image(flickr / 'images' / f'{first + i}.jpg', i)} {i}\n"
                 for i in range(5)]
        (flickr / f"{subset}.txt").write_text("".join(lines))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the notebook's temporary files
    g = run_example("02_fine_tuning.py", root / "examples", monkeypatch)

    # Cell 24's own check ran: the style net's frozen layers compute ImageNet's fc7.
    assert g["error"] < 1e-8
    loss = g["train_loss"]
    assert np.isfinite(loss).all() and np.isfinite(g["scratch_train_loss"]).all()
    assert loss[0] == pytest.approx(math.log(5), abs=1e-5)  # fc8_flickr starts at zero
    tuned = g["end_to_end_loss"]["pretrained, end-to-end"]
    assert np.isfinite(tuned).all()
    # The loss on the training images in TEST mode (centre crops, no dropout; a TRAIN net
    # seeded alike would replay the very dropout masks it was trained on): ln 5 with
    # fc8_flickr at zero, lower after fc8_flickr learned, lower again end to end.
    caffe = sys.modules["caffe"]
    losses = []
    for weights in (g["style_weights"], g["style_weights_ft"]):
        with caffe.Net(g["style_net"](train=False, subset="train"), weights, caffe.TEST) as net:
            losses.append(np.mean([float(net.forward()["loss"]) for _ in range(5)]))
    assert losses[0] < math.log(5) - 0.1
    assert losses[1] < losses[0]
    for path in g["finetuned_weights"].values():
        assert Path(path).stat().st_size > 4 * 20_000_000  # CaffeNet at 99 x 99, in float32
    assert 0.0 <= float(g["accuracy"]) <= 1.0 and 0.0 <= float(g["scratch_accuracy"]) <= 1.0


# -- pascal-multilabel-with-datalayer.ipynb -----------------------------------------------
VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair",
               "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant",
               "sheep", "sofa", "train", "tvmonitor")


def write_voc(folder: Path, splits: dict[str, int]) -> None:
    """Stand-in for PASCAL VOC2012: per split, images (JPEGImages/<id>.jpg), their XML
    annotations (Annotations/<id>.xml, one to three objects with boxes) and the id list
    (ImageSets/Main/<split>.txt), as the data layer reads them."""
    for sub in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (folder / sub).mkdir(parents=True)
    rng = np.random.default_rng(7)
    count = 0
    for split, n in splits.items():
        ids = []
        for _ in range(n):
            index = f"2012_{count:06d}"
            count += 1
            ids.append(index)
            write_image(folder / "JPEGImages" / f"{index}.jpg", seed=100 + count)
            objects = "".join(
                f"<object><name>{VOC_CLASSES[c]}</name><difficult>0</difficult><bndbox>"
                f"<xmin>{1 + c}</xmin><ymin>{2 + c}</ymin><xmax>{200 + c}</xmax>"
                f"<ymax>{150 + c}</ymax></bndbox></object>"
                for c in rng.choice(20, size=int(rng.integers(1, 4)), replace=False))
            (folder / "Annotations" / f"{index}.xml").write_text(
                f"<annotation><filename>{index}.jpg</filename>{objects}</annotation>")
        (folder / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")


@pytest.fixture
def seeded_random():
    """The data layer shuffles with Python's random and flips with numpy's global one."""
    saved = random.getstate(), np.random.get_state()
    random.seed(0)
    np.random.seed(0)
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])


def test_pascal_multilabel_python_data_layer_trains_caffenet(tmp_path, monkeypatch, caffe_env,
                                                             seeded_random, caffenet_99):
    root = caffe_root(tmp_path)
    put(root, "models/bvlc_reference_caffenet/bvlc_reference_caffenet.caffemodel",
        caffenet_99)
    shutil.copytree(EXAMPLES / "pycaffe", root / "examples" / "pycaffe")
    write_voc(root / "data" / "pascal" / "VOC2012", {"train": 6, "val": 4})
    g = run_example("pascal_multilabel_with_datalayer.py", root / "examples", monkeypatch)

    # The data layer's tops: 99 x 99 BGR images less 128, and 0/1 labels from the XML files.
    net = g["solver"].net
    assert net.blobs["data"].data.shape == (2, 3, 99, 99)
    labels = net.blobs["label"].data
    assert set(np.unique(labels)) <= {0.0, 1.0} and (labels.sum(axis=1) >= 1).all()
    losses = np.array(g["train_losses"])
    assert np.isfinite(losses).all()
    # score starts at zero: each of the 20 sigmoid outputs costs ln 2, summed over the labels
    # and divided by the batch (SigmoidCrossEntropyLoss's BATCH_SIZE normalization).
    assert losses[0] == pytest.approx(20 * math.log(2), rel=1e-5)
    assert losses[-2:].mean() < losses[0] - 2.0
    # Hamming accuracy over the 20 labels; the notebook's baseline (cell 20) is kept as
    # written, comparing 2 zeros per image against 20 labels.
    assert all(0.5 < a <= 1.0 for a in g["accuracies"])
    assert 0.0 < g["baseline"] <= 0.1


# -- examples/pycaffe: linreg.prototxt with layers/pyloss.py, caffenet.py ----------------
def test_pycaffe_linreg_with_the_python_euclidean_loss_trains(tmp_path, monkeypatch, caffe_env):
    caffe = sys.modules["caffe"]
    monkeypatch.chdir(tmp_path)
    sys.path.insert(0, str(EXAMPLES / "pycaffe" / "layers"))  # pyloss, as $PYTHONPATH has it
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{BVLC / "examples__pycaffe__linreg.prototxt"}"\n'
        'base_lr: 0.1\nlr_policy: "fixed"\nmomentum: 0.9\nmax_iter: 100\nrandom_seed: 2\n')
    solver = caffe.SGDSolver("solver.prototxt")
    assert type(solver.net.layers[-1]).__module__ == "pyloss"  # BVLC's own layer class
    start = np.linalg.norm(solver.net.params["ipx"][0].data)
    losses = []
    for _ in range(60):
        solver.step(1)
        losses.append(solver.net.blobs["loss"].data.item())  # pyloss's top has shape (1,)
    # x and y are fresh Gaussian noise at every pass (DummyData refills), so the loss
    # ||ipx(x) - ipy(y)||^2 / 2N falls as both InnerProducts shrink their weights to zero.
    net = solver.net
    ipx, ipy = net.blobs["ipx"].data, net.blobs["ipy"].data
    assert losses[-1] == pytest.approx(((ipx - ipy) ** 2).sum() / 10 / 2, rel=1e-5)
    assert np.mean(losses[-10:]) < 0.25 * np.mean(losses[:10])
    assert np.linalg.norm(net.params["ipx"][0].data) < 0.5 * start


def settings_of(layer: pb.LayerParameter) -> tuple:
    """What a CaffeNet layer computes, with unset fields read as their defaults (caffenet.py
    spells out pad=0 and group=1; it leaves fillers and the dropout ratio at their defaults,
    so those are not compared)."""
    c, p, n = layer.convolution_param, layer.pooling_param, layer.lrn_param
    return {"Convolution": (c.num_output, tuple(c.kernel_size), tuple(c.stride) or (1,),
                            tuple(c.pad) or (0,), c.group),
            "Pooling": (p.pool, p.kernel_size, p.stride),
            "LRN": (n.local_size, round(n.alpha, 9), n.beta),
            "InnerProduct": (layer.inner_product_param.num_output,)}.get(layer.type, ())


def test_pycaffe_caffenet_py_writes_caffes_caffenet(tmp_path, monkeypatch, caffe_env):
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(EXAMPLES / "pycaffe" / "caffenet.py"), run_name="__main__")

    # The NetSpec CaffeNet is models/bvlc_reference_caffenet/train_val.prototxt's, layer for
    # layer (the generated names aside): types, tops' wiring and every layer parameter.
    reference = read_net(BVLC / "models__bvlc_reference_caffenet__train_val.prototxt")
    ref = [l for l in reference.layer if l.type not in ("Data", "Accuracy")]
    for name, with_acc in (("train.prototxt", False), ("test.prototxt", True)):
        made = read_net(tmp_path / name)
        body = [l for l in made.layer if l.type not in ("Data", "Accuracy")]
        assert [l.type for l in body] == [l.type for l in ref]
        assert [settings_of(a) for a in body] == [settings_of(b) for b in ref]
        assert [list(a.bottom) == [] for a in body[1:]] == [False] * (len(body) - 1)
        assert sum(l.type == "Accuracy" for l in made.layer) == int(with_acc)
        data = made.layer[0]
        assert data.data_param.batch_size == (50 if with_acc else 256)
        assert data.transform_param.crop_size == 227 and data.transform_param.mirror
        assert list(data.transform_param.mean_value) == [104, 117, 123]
