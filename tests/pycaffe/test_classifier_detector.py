"""caffe.Classifier and caffe.Detector against hand-computed values: a linear deploy net
(InnerProduct with set weights) makes each prediction W . x + b of the pre-processed crop, whose
pixels are picked here by numpy slicing. Then BVLC's python/classify.py and detect.py run
unchanged on CIFAR-10 quick, checked against OpenCV's Caffe importer fed crops made here."""

from __future__ import annotations

import glob
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

import purine.pycaffe as caffe
from purine.errors import PurineError

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "fixtures" / "bvlc" / "python"
CIFAR = ROOT / "models" / "cifar10_quick" / "cifar10_quick.prototxt"

SWAP = [2, 1, 0]
RAW, INPUT_SCALE = 255.0, 0.5
MEAN = np.array([10.0, 20.0, 30.0])  # per channel, in the net's (BGR) order


def linear_net(tmp_path: Path, batch: int, h: int, w: int, seed: int = 0):
    """A deploy net whose two outputs are W . x + b over the (3, h, w) input; returns the
    prototxt, the caffemodel and (W, b)."""
    proto = tmp_path / f"linear_{h}x{w}.prototxt"
    proto.write_text(
        'name: "linear"\n'
        f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: {batch} '
        f'dim: 3 dim: {h} dim: {w} }} }} }}\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "score" '
        "inner_product_param { num_output: 2 } }\n")
    rng = np.random.default_rng(seed)
    W = rng.integers(-3, 4, (2, 3 * h * w)).astype(np.float32)
    b = np.array([0.5, -1.0], dtype=np.float32)
    net = caffe.Net(str(proto), caffe.TEST)
    net.params["ip"][0].data[...] = W
    net.params["ip"][1].data[...] = b
    weights = tmp_path / f"linear_{h}x{w}.caffemodel"
    net.save(weights)
    return str(proto), str(weights), (W.astype(np.float64), b.astype(np.float64))


def prep(crop: np.ndarray, mean=MEAN, raw=RAW, scale=INPUT_SCALE) -> np.ndarray:
    """Pycaffe's pre-processing of an (h, w, 3) RGB crop, written out: (3, h, w), RGB -> BGR,
    times raw_scale, minus the per-channel mean, times input_scale."""
    x = crop.transpose(2, 0, 1)[SWAP] * raw
    return (x - np.asarray(mean, dtype=np.float64)[:, None, None]) * scale


def score(x: np.ndarray, Wb) -> np.ndarray:
    W, b = Wb
    return W @ x.ravel() + b


def image(seed: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, (h, w, 3))


def classifier(tmp_path, batch=2, h=4, w=4, **kw):
    proto, weights, Wb = linear_net(tmp_path, batch, h, w)
    kw = {"mean": MEAN, "raw_scale": RAW, "input_scale": INPUT_SCALE, "channel_swap": SWAP,
          **kw}
    return caffe.Classifier(proto, weights, **kw), Wb


# -- Classifier ---------------------------------------------------------------------------
def test_centre_crop_truncates_the_corner(tmp_path):
    # A 7 x 9 image, 4 x 4 crops: the centre (3.5, 4.5) less (2, 2) is (1.5, 2.5), truncated
    # to (1, 2), so the crop is rows 1:5, columns 2:6.
    clf, Wb = classifier(tmp_path, image_dims=(7, 9))
    ims = [image(1, 7, 9), image(2, 7, 9)]
    got = clf.predict(ims, oversample=False)
    want = [score(prep(im[1:5, 2:6]), Wb) for im in ims]
    assert got.shape == (2, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)


def test_oversample_averages_corners_centre_and_mirrors(tmp_path):
    clf, Wb = classifier(tmp_path, image_dims=(7, 9))
    im = image(3, 7, 9)
    # Corners at rows 0 and 7-4=3, columns 0 and 9-4=5; the centre crop at (1, 2).
    five = [im[0:4, 0:4], im[0:4, 5:9], im[3:7, 0:4], im[3:7, 5:9], im[1:5, 2:6]]
    ten = five + [c[:, ::-1] for c in five]
    want = np.mean([score(prep(c), Wb) for c in ten], axis=0)
    got = clf.predict([im])  # oversample is the default
    np.testing.assert_allclose(got, [want], rtol=1e-5, atol=1e-3)
    # Mirrored crops count: the average differs from that of the five unmirrored ones.
    assert not np.allclose(want, np.mean([score(prep(c), Wb) for c in five], axis=0))


def test_each_preprocessing_step(tmp_path):
    im = image(4, 4, 4)
    plain, Wb = classifier(tmp_path, mean=None, raw_scale=None, input_scale=None,
                           channel_swap=None)
    np.testing.assert_allclose(plain.predict([im], oversample=False)[0],
                               score(im.transpose(2, 0, 1), Wb), rtol=1e-5, atol=1e-4)
    swapped, _ = classifier(tmp_path, mean=None, raw_scale=None, input_scale=None)
    np.testing.assert_allclose(swapped.predict([im], oversample=False)[0],
                               score(im.transpose(2, 0, 1)[[2, 1, 0]], Wb), rtol=1e-5,
                               atol=1e-4)
    # The mean is subtracted after raw_scale and before input_scale: 0.5 (255 x - mean).
    full, _ = classifier(tmp_path)
    x = 0.5 * (255 * im.transpose(2, 0, 1)[[2, 1, 0]] - np.array([10, 20, 30])[:, None, None])
    np.testing.assert_allclose(full.predict([im], oversample=False)[0], score(x, Wb),
                               rtol=1e-5, atol=1e-2)


def test_images_are_scaled_to_image_dims_first(tmp_path):
    # image_dims defaults to the net input's (4, 4); an 8 x 8 image halves, and OpenCV's
    # bilinear halving is the mean of each 2 x 2 block.
    clf, Wb = classifier(tmp_path)
    np.testing.assert_array_equal(clf.image_dims, [4, 4])
    im = image(5, 8, 8)
    halved = im.reshape(4, 2, 4, 2, 3).mean(axis=(1, 3))
    np.testing.assert_allclose(clf.predict([im], oversample=False)[0], score(prep(halved), Wb),
                               rtol=1e-4, atol=1e-2)


def test_more_images_than_the_batch(tmp_path):
    clf, Wb = classifier(tmp_path, batch=2, image_dims=(5, 6))
    ims = [image(10 + k, 5, 6) for k in range(3)]
    # A 5 x 6 image, 4 x 4 crop: the corner (0.5, 1) truncates to (0, 1).
    want = [score(prep(im[0:4, 1:5]), Wb) for im in ims]
    np.testing.assert_allclose(clf.predict(ims, oversample=False), want, rtol=1e-5,
                               atol=1e-3)
    assert clf.predict(np.stack(ims)).shape == (3, 2)  # an (N, H, W, K) array works too


def test_classifier_errors(tmp_path):
    with pytest.raises(PurineError, match=r"image_dims \(3, 8\).*at least.*\(4, 4\)"):
        classifier(tmp_path, image_dims=(3, 8))
    clf, _ = classifier(tmp_path)
    with pytest.raises(PurineError, match="no input images"):
        clf.predict([])
    with pytest.raises(PurineError, match=r"input 1 has shape \(4, 4\)"):
        clf.predict([image(1, 4, 4), np.zeros((4, 4))])


# -- Detector -----------------------------------------------------------------------------
def write_png(path: Path, seed: int, h: int = 48, w: int = 64) -> np.ndarray:
    """A random PNG; returns its pixels as load_image gives them (RGB in [0, 1])."""
    bgr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    assert cv2.imwrite(str(path), bgr)
    return bgr[:, :, ::-1] / 255.0


def detector(tmp_path, **kw):
    proto, weights, Wb = linear_net(tmp_path, 2, 32, 32)
    kw = {"mean": MEAN, "raw_scale": RAW, "input_scale": INPUT_SCALE, "channel_swap": SWAP,
          **kw}
    return caffe.Detector(proto, weights, **kw), Wb


def test_windows_without_context(tmp_path):
    det, Wb = detector(tmp_path)
    im = write_png(tmp_path / "a.png", 1)
    windows = [np.array([2, 3, 34, 35]), np.array([16, 32, 48, 64])]  # 32 x 32: no warp
    got = det.detect_windows([(str(tmp_path / "a.png"), windows)])
    assert [d["filename"] for d in got] == [str(tmp_path / "a.png")] * 2
    assert [list(d["window"]) for d in got] == [[2, 3, 34, 35], [16, 32, 48, 64]]
    np.testing.assert_allclose(got[0]["prediction"], score(prep(im[2:34, 3:35]), Wb),
                               rtol=1e-5, atol=0.5)
    np.testing.assert_allclose(got[1]["prediction"], score(prep(im[16:48, 32:64]), Wb),
                               rtol=1e-5, atol=0.5)


def context_blobs(im0: np.ndarray, im1: np.ndarray, mean=MEAN, scale=INPUT_SCALE):
    """The net inputs for three windows with context_pad 4 on a 32 x 32 input, worked out
    by hand. The context scale is 32 / (32 - 8) = 4/3 and a 23 x 23 window has half-size 12:
    - (10, 10, 33, 33): centre 22, box 22 -+ 16 = [6, 38] inside the image: the crop is
      im[6:38, 6:38], 32 x 32, no warp.
    - (0, 0, 23, 23): centre 12, box [-4, 28] of 33 pixels: 4 * 32/33 rounds to a border of
      4, the clipped box [0, 28] to round(29 * 32/33) = 28 pixels: im[0:28, 0:28] at [4:, 4:].
    - (25, 41, 48, 64) in the 48 x 64 image: box [21, 37, 53, 69] clipped to [21, 37, 48,
      64], round(28 * 32/33) = 27 pixels each way: im[21:48, 37:64] at [:27, :27].
    Outside them the crop is the mean, which pre-processes to 0."""
    a = prep(im0[6:38, 6:38], mean=mean, scale=scale)
    b = np.zeros((3, 32, 32))
    b[:, 4:, 4:] = prep(im0[0:28, 0:28], mean=mean, scale=scale)
    c = np.zeros((3, 32, 32))
    c[:, :27, :27] = prep(im1[21:48, 37:64], mean=mean, scale=scale)
    return [a, b, c]


WINDOWS = [[10, 10, 33, 33], [0, 0, 23, 23], [25, 41, 48, 64]]


def test_context_pad_crops_and_fills_with_the_mean(tmp_path):
    det, Wb = detector(tmp_path, context_pad=4)
    np.testing.assert_array_equal(det.crop_dims, [32, 32, 3])
    # The mean back in image units: channels unswapped (BGR -> RGB), divided by raw_scale.
    np.testing.assert_allclose(det.crop_mean.ravel(), [30 / 255, 20 / 255, 10 / 255],
                               rtol=1e-6)
    im0 = write_png(tmp_path / "a.png", 2)
    im1 = write_png(tmp_path / "b.png", 3)
    got = det.detect_windows([(str(tmp_path / "a.png"), [np.array(w) for w in WINDOWS[:2]]),
                              (str(tmp_path / "b.png"), [np.array(WINDOWS[2])])])
    want = [score(x, Wb) for x in context_blobs(im0, im1)]
    np.testing.assert_allclose([d["prediction"] for d in got], want, rtol=1e-5, atol=0.5)
    # The crop itself: the border is the raw-unit mean, the rest the image.
    crop = det.crop(im0.astype(np.float32), np.array(WINDOWS[1]))
    assert crop.shape == (32, 32, 3)
    np.testing.assert_allclose(crop[:4, :, 0], 30 / 255, rtol=1e-6)
    np.testing.assert_allclose(crop[4:, 4:], im0[0:28, 0:28], rtol=1e-6)
    # A swap that is not its own inverse: blob channels 0, 1, 2 are image channels 1, 2, 0,
    # so the image's channels 1, 2, 0 take the means 10, 20, 30.
    rolled, _ = detector(tmp_path, context_pad=4, channel_swap=(1, 2, 0))
    np.testing.assert_allclose(rolled.crop_mean.ravel(), [30 / 255, 10 / 255, 20 / 255],
                               rtol=1e-6)


def test_context_crop_without_a_mean_is_zero_outside(tmp_path):
    det, _ = detector(tmp_path, mean=None, context_pad=4)
    im = np.full((48, 64, 3), 0.75, dtype=np.float32)
    crop = det.crop(im, np.array(WINDOWS[2]))
    assert np.all(crop[:27, :27] == 0.75) and np.all(crop[27:] == 0) and np.all(
        crop[:, 27:] == 0)


def test_detector_errors(tmp_path):
    with pytest.raises(PurineError, match="context_pad 16 leaves no room"):
        detector(tmp_path, context_pad=16)
    det, _ = detector(tmp_path, context_pad=4)
    with pytest.raises(PurineError, match="selective_search_ijcv_with_python.*detect_windows"):
        det.detect_selective_search(["a.png"])
    im = np.zeros((48, 64, 3), dtype=np.float32)
    with pytest.raises(PurineError, match=r"window \(60, 70, 80, 90\).*48 x 64 image"):
        det.crop(im, [60, 70, 80, 90])
    with pytest.raises(PurineError, match="no windows"):
        det.detect_windows([])
    with pytest.raises(PurineError, match="cannot read"):
        det.detect_windows([(str(tmp_path / "missing.png"), [[0, 0, 4, 4]])])


def test_lazy_names_on_the_caffe_module():
    from purine.pycaffe.classifier import Classifier
    from purine.pycaffe.detector import Detector

    assert caffe.Classifier is Classifier and caffe.Detector is Detector
    assert issubclass(Classifier, caffe.Net) and issubclass(Detector, caffe.Net)


# -- BVLC's python/classify.py and detect.py, unchanged ------------------------------------
def caffe_names() -> dict:
    return {k: m for k, m in sys.modules.items() if k == "caffe" or k.startswith("caffe.")}


@pytest.fixture
def as_caffe():
    """``import caffe`` (and ``caffe.<name>``) gives purine.pycaffe while the test runs."""
    saved = caffe_names()
    assert caffe.install_as_caffe()
    yield
    for k in caffe_names():
        sys.modules.pop(k)
    sys.modules.update(saved)


def run_script(name: str, args: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(SCRIPTS / name), run_name="__main__")


def run_command(name: str, args: list[str], cwd: Path) -> None:
    """``purine-caffe python <script> args``, as a user runs BVLC's script."""
    r = subprocess.run([sys.executable, "-m", "purine.cli", "python", "-q", str(SCRIPTS / name),
                        *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def cifar_weights(path: Path) -> str:
    """Random He-scaled weights for CIFAR-10 quick (its fillers' are too small to separate
    the classes), with random biases, written by Net.save."""
    rng = np.random.default_rng(7)
    net = caffe.Net(str(CIFAR), caffe.TEST)
    for w, b in net.params.values():
        w.data[...] = rng.standard_normal(w.shape) * np.sqrt(2.0 * w.shape[0] / w.count)
        b.data[...] = rng.standard_normal(b.shape) * 0.1
    net.save(path)
    return str(path)


def opencv_forward(weights: str, blobs: list[np.ndarray]) -> np.ndarray:
    """CIFAR-10 quick's 'prob' by OpenCV's own Caffe importer, for (3, 32, 32) inputs."""
    if not hasattr(cv2, "dnn") or not hasattr(cv2.dnn, "readNetFromCaffe"):
        pytest.skip("this OpenCV has no Caffe importer (opencv-python-headless<5 has)")
    cv = cv2.dnn.readNetFromCaffe(str(CIFAR), weights)
    cv.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    cv.setInput(np.stack(blobs).astype(np.float32))
    return cv.forward("prob").reshape(len(blobs), -1)


def drawn_image(seed: int, h: int, w: int) -> np.ndarray:
    """A uint8 BGR picture: a ramp with random rectangles and discs, drawn with cv2."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, w)[None, :, None] * np.linspace(0, 1, h)[:, None, None]
    bgr = (rng.uniform(40, 120, 3) + 100 * ramp).astype(np.uint8)
    for _ in range(6):
        x, y = int(rng.integers(0, w)), int(rng.integers(0, h))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            cv2.rectangle(bgr, (x, y), (x + int(rng.integers(5, 30)),
                                        y + int(rng.integers(5, 30))), colour, -1)
        else:
            cv2.circle(bgr, (x, y), int(rng.integers(3, 15)), colour, -1)
    return bgr


def test_bvlc_classify_py(tmp_path, as_caffe, monkeypatch):
    weights = cifar_weights(tmp_path / "cifar.caffemodel")
    mean = np.random.default_rng(8).uniform(100, 140, (3, 32, 32))
    np.save(tmp_path / "mean.npy", mean)
    folder = tmp_path / "images"
    folder.mkdir()
    pictures = {}
    for k in range(2):
        bgr = drawn_image(k, 80, 80)
        assert cv2.imwrite(str(folder / f"im{k}.png"), bgr)
        pictures[str(folder / f"im{k}.png")] = bgr[:, :, ::-1] / 255.0
    common = ["--model_def", str(CIFAR), "--pretrained_model", weights, "--mean_file",
              str(tmp_path / "mean.npy"), "--images_dim", "40,40", "--input_scale", "0.02"]
    run_command("classify.py", [str(folder), str(tmp_path / "ten.npy"), "--ext", "png",
                                *common], tmp_path)

    def blob(crop):  # RGB -> BGR, x 255 (the defaults), minus the mean, x 0.02
        return (crop.transpose(2, 0, 1)[[2, 1, 0]] * 255 - mean) * 0.02

    want = []
    for name in glob.glob(str(folder) + "/*.png"):  # the script's own listing, in its order
        # 80 x 80 -> 40 x 40: OpenCV's bilinear halving is the mean of each 2 x 2 block.
        im = pictures[name].reshape(40, 2, 40, 2, 3).mean(axis=(1, 3))
        # 32 x 32 crops of 40 x 40: corners at 0 and 8, the centre at 4.
        five = [im[i:i + 32, j:j + 32] for i, j in ((0, 0), (0, 8), (8, 0), (8, 8), (4, 4))]
        crops = five + [c[:, ::-1] for c in five]
        want.append(opencv_forward(weights, [blob(c) for c in crops]).mean(axis=0))
    got = np.load(tmp_path / "ten.npy")
    assert got.shape == (2, 10)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.ptp(got[0]) > 0.1  # the classes are told apart

    # An .npy of 40 x 40 images and --center_only: rows and columns 4:36 of each.
    ims = np.stack([np.random.default_rng(9 + k).uniform(0, 1, (40, 40, 3)) for k in range(3)])
    np.save(tmp_path / "ims.npy", ims)
    run_script("classify.py", [str(tmp_path / "ims.npy"), str(tmp_path / "centre.npy"),
                               "--center_only", *common], monkeypatch)
    want = opencv_forward(weights, [blob(im[4:36, 4:36]) for im in ims])
    np.testing.assert_allclose(np.load(tmp_path / "centre.npy"), want, atol=2e-5)


@pytest.mark.filterwarnings("ignore:The inplace keyword")  # pandas 3 on detect.py's code
def test_bvlc_detect_py(tmp_path, as_caffe, monkeypatch):
    pd = pytest.importorskip("pandas", reason="detect.py needs pandas")
    weights = cifar_weights(tmp_path / "cifar.caffemodel")
    mean = np.random.default_rng(8).uniform(100, 140, (3, 32, 32))
    np.save(tmp_path / "mean.npy", mean)
    im0 = drawn_image(3, 48, 64)
    im1 = drawn_image(4, 48, 64)
    for name, bgr in (("a.png", im0), ("b.png", im1)):
        assert cv2.imwrite(str(tmp_path / name), bgr)
    a, b = str(tmp_path / "a.png"), str(tmp_path / "b.png")
    # The header order of detect.py's help (x before y); the script picks columns by name.
    rows = [(a, WINDOWS[0]), (a, WINDOWS[1]), (b, WINDOWS[2])]
    (tmp_path / "windows.csv").write_text("filename,xmin,ymin,xmax,ymax\n" + "".join(
        f"{f},{w[1]},{w[0]},{w[3]},{w[2]}\n" for f, w in rows))
    # detect.py's .csv branch cannot run (tests/fixtures/bvlc/python/README.md): its .h5
    # branch hands the finished table to DataFrame.to_hdf, which is caught here instead.
    written = []
    monkeypatch.setattr(pd.DataFrame, "to_hdf",
                        lambda self, *args, **kw: written.append((self.copy(), args)))
    run_script("detect.py", ["--crop_mode", "list", "--model_def", str(CIFAR),
                             "--pretrained_model", weights, "--mean_file",
                             str(tmp_path / "mean.npy"), "--context_pad", "4", "--input_scale",
                             "0.02", str(tmp_path / "windows.csv"), str(tmp_path / "out.h5")],
               monkeypatch)
    (df, args), = written
    assert args[:1] == (str(tmp_path / "out.h5"),)
    assert list(df.index) == [a, a, b]
    assert df[["ymin", "xmin", "ymax", "xmax"]].values.tolist() == WINDOWS
    # detect.py averages the mean file to one value per channel.
    blobs = context_blobs(im0[:, :, ::-1] / 255.0, im1[:, :, ::-1] / 255.0,
                          mean=mean.mean(axis=(1, 2)), scale=0.02)
    want = opencv_forward(weights, blobs)
    got = np.stack(df["prediction"].values)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.ptp(got[0]) > 0.1


def test_bvlc_draw_net_py(tmp_path, as_caffe, monkeypatch):
    pytest.importorskip("pydot", reason="caffe.draw needs pydot")
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed")
    out = tmp_path / "cifar.dot"
    run_script("draw_net.py", [str(CIFAR), str(out)], monkeypatch)
    text = out.read_text()
    assert text.startswith("digraph CIFAR10_quick_test {") and "rankdir=LR" in text
    # One edge per bottom and per top: the Input layer's top, then 12 layers of one bottom
    # and one top each (conv1-3, pool1-3, relu1-3 in place, ip1, ip2, prob).
    assert text.count(" -> ") == 1 + 12 * 2
    conv1 = '"conv1\\n(Convolution)\\nkernel size: 5\\nstride: 1\\npad: 2"'
    assert f"data -> {conv1}" in text
    assert '"pool1\\n(Pooling MAX)\\nkernel size: 3\\nstride: 2\\npad: 0"' in text
    # The edge out of a Convolution or InnerProduct is labelled with its num_output.
    assert re.search(re.escape(f"{conv1} -> conv1") + r"\s*\[label=32\b", text)
