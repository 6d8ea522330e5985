"""Training while the image size changes at every iteration, as Caffe's fully convolutional
and detection nets do: a Python data layer loads the next image in ``reshape()`` (Caffe's
FCN layers), cycling through several sizes, and the solver trains through the net's builds.

Each iteration's loss and update are checked against a net fixed at that iteration's size
(Input layers, the same weights) and a numpy SGD step (momentum, weight decay, lr and decay
multipliers, the step policy); iter_size 2 with its two passes at two sizes; the command
line's per-iteration losses against the in-process solver and its final snapshot; a resume
from a snapshot taken between sizes, bit for bit; ``forward(start=, end=)`` after a size
change; and the Faster R-CNN pattern, a later Python layer whose top (the loss's label) takes
the new shape in ``reshape()`` or only in ``forward()``."""

import importlib
import re

import numpy as np
import pytest

import purine.cli
import purine.pycaffe as caffe
from purine.caffe.net import TRAIN, Net
from purine.caffe.solver import Solver
from tests.pycaffe.helpers import write_layers

SIZES = [(12, 16), (16, 12), (14, 14), (10, 12)]  # (H, W), item i has SIZES[i % 4]
CLASSES = 3

LAYERS = '''
import json

import numpy as np

import caffe

SIZES = [(12, 16), (16, 12), (14, 14), (10, 12)]


def item(pos, seed=0, classes=3):
    """Item ``pos``: an image (1, 3, H, W) of size SIZES[pos % 4] and a label per pixel."""
    h, w = SIZES[pos % len(SIZES)]
    rng = np.random.default_rng([seed, pos])
    image = rng.standard_normal((1, 3, h, w))
    label = rng.integers(0, classes, (1, 1, h, w)).astype(np.float64)
    return image, label


def targets(image, h, w):
    """A class per cell of an (h, w) map over the image (every second pixel): 0, 1 or 2 by
    the signs of channels 0 and 1; -1 (ignored) where channel 2 is weak."""
    x = image[0, :, ::2, ::2][:, :h, :w]
    labels = (x[0] > 0).astype(np.float64) + (x[1] > 0)
    labels[np.abs(x[2]) < 0.3] = -1
    return labels.reshape(1, 1, h, w)


class SizedImages(caffe.Layer):
    """Caffe's FCN data layer pattern: reshape() loads item ``pos`` and gives the tops its
    shape, forward() copies it and moves on. param_str: {"start": first item, "seed": s}."""

    def setup(self, bottom, top):
        params = json.loads(self.param_str or "{}")
        self.pos = params.get("start", 0)
        self.seed = params.get("seed", 0)

    def reshape(self, bottom, top):
        self.image, self.label = item(self.pos, self.seed)
        top[0].reshape(*self.image.shape)
        if len(top) > 1:
            top[1].reshape(*self.label.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.image
        if len(top) > 1:
            top[1].data[...] = self.label
        self.pos += 1

    def backward(self, top, propagate_down, bottom):
        pass


class Targets(caffe.Layer):
    """Faster R-CNN's anchor target pattern: labels for each cell of bottom[0] (a score map)
    from bottom[1] (the image). param_str "forward": the top takes its shape in forward(),
    as py-faster-rcnn's AnchorTargetLayer does (its reshape() does nothing); otherwise in
    reshape()."""

    def setup(self, bottom, top):
        self.in_forward = self.param_str == "forward"
        top[0].reshape(1, 1, *bottom[0].shape[2:])

    def reshape(self, bottom, top):
        if not self.in_forward:
            top[0].reshape(1, 1, *bottom[0].shape[2:])

    def forward(self, bottom, top):
        labels = targets(bottom[1].data, *bottom[0].shape[2:])
        top[0].reshape(*labels.shape)
        top[0].data[...] = labels

    def backward(self, top, propagate_down, bottom):
        pass
'''

FILL = 'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.1 }'
PARAMS = "param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }"
# Caffe's multipliers of each learnable parameter: (lr_mult, decay_mult)
MULTS = {"conv1[0]": (1, 1), "conv1[1]": (2, 0), "score[0]": (1, 1), "score[1]": (2, 0),
         "up[0]": (1, 1)}
BASE_LR, GAMMA, STEPSIZE, MOMENTUM, DECAY = 0.05, 0.5, 3, 0.9, 0.01


def layers(tmp_path, monkeypatch):
    """The layer module written where the nets import it from, and the module itself."""
    name = write_layers(tmp_path, monkeypatch, LAYERS)
    caffe.install_as_caffe()  # `import caffe` in the module, as the net's builder does
    return name, importlib.import_module(name)


def python_data(module: str, start: int = 0, tops=("data", "label")) -> str:
    t = " ".join(f'top: "{x}"' for x in tops)
    return (f'layer {{ name: "images" type: "Python" {t} python_param {{ module: "{module}" '
            f"layer: \"SizedImages\" param_str: '{{\"start\": {start}}}' }} }}\n")


def inputs(h: int, w: int, label: tuple[int, int] | None = None) -> str:
    """Input layers standing for the data layer at one size."""
    lh, lw = label or (h, w)
    return (f'layer {{ name: "images" type: "Input" top: "data" top: "label" input_param {{ '
            f"shape {{ dim: 1 dim: 3 dim: {h} dim: {w} }} "
            f"shape {{ dim: 1 dim: 1 dim: {lh} dim: {lw} }} }} }}\n")


# The score map both nets below start with: a stride-2 convolution and a 1x1 score.
TRUNK = f'''
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1" {PARAMS}
  convolution_param {{ num_output: 4 kernel_size: 3 stride: 2 pad: 1 {FILL} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "score" type: "Convolution" bottom: "conv1" top: "score" {PARAMS}
  convolution_param {{ num_output: {CLASSES} kernel_size: 1 {FILL} }} }}
'''

# A small FCN: a stride-2 convolution, a 1x1 score, a stride-2 Deconvolution back up, a Crop
# against the image, and a per-pixel SoftmaxWithLoss; no weight depends on the image size.
FCN = TRUNK + f'''
layer {{ name: "up" type: "Deconvolution" bottom: "score" top: "up"
  param {{ lr_mult: 1 decay_mult: 1 }}
  convolution_param {{ num_output: {CLASSES} kernel_size: 4 stride: 2 bias_term: false
    weight_filler {{ type: "gaussian" std: 0.3 }} }} }}
layer {{ name: "crop" type: "Crop" bottom: "up" bottom: "data" top: "cropped"
  crop_param {{ axis: 2 offset: 1 }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "cropped" bottom: "label" top: "loss" }}
'''

# Faster R-CNN's pattern: the labels come from a Python layer after the score map, which
# settles their shape; the loss propagates to the scores only, ignores label -1 and
# normalizes by the valid cells.
DETECT = TRUNK + '''
{targets}
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss"
  propagate_down: 1 propagate_down: 0 loss_param { ignore_label: -1 normalize: true } }
'''


def targets_layer(module: str, where: str) -> str:
    return (f'layer {{ name: "targets" type: "Python" bottom: "score" bottom: "data" '
            f'top: "label" python_param {{ module: "{module}" layer: "Targets" '
            f"param_str: '{where}' }} }}")


def solver_text(net: str, **extra) -> str:
    fields = dict(base_lr=BASE_LR, lr_policy='"step"', gamma=GAMMA, stepsize=STEPSIZE,
                  momentum=MOMENTUM, weight_decay=DECAY, max_iter=100, random_seed=7)
    fields.update(extra)
    net = net.replace("\n", " ")
    return f"net_param {{ {net} }}\n" + "".join(f"{k}: {v}\n" for k, v in fields.items())


def state(s: Solver) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each learnable parameter's (weights, momentum history), by "layer[k]"."""
    d = s.net.dispatcher
    return {u.param.name: (d.array(u.param).copy(), d.array(u.history[0]).copy())
            for u in s.updates}


def reference(net_text: str, weights: dict, image: np.ndarray, label: np.ndarray):
    """Loss and parameter gradients of a fresh float64 net built at the image's size (Input
    layers), with ``weights`` copied in."""
    ref = Net(net_text, phase=TRAIN, dtype="float64")
    try:
        assert ref.blobs["data"].shape == image.shape
        for name, views in ref.params.items():
            for k, v in enumerate(views):
                v.data[...] = weights[f"{name}[{k}]"][0]
        ref.blobs["data"].data[...] = image
        ref.blobs["label"].data[...] = label
        ref.forward()
        ref.backward()
        grads = {f"{name}[{k}]": v.diff.copy() for name, views in ref.params.items()
                 for k, v in enumerate(views)}
        return ref.loss, grads
    finally:
        ref.close()


def sgd(before: dict, grads: dict, it: int, iter_size: int = 1) -> dict:
    """Caffe's SGD step by hand: normalize, regularize (L2), momentum update. The settings
    are SolverParameter's float fields: 0.01 is read as float32's nearest value."""
    base_lr, gamma, momentum, decay = (float(np.float32(v))
                                       for v in (BASE_LR, GAMMA, MOMENTUM, DECAY))
    rate = base_lr * gamma ** (it // STEPSIZE)
    out = {}
    for name, (w, h) in before.items():
        lr_mult, decay_mult = MULTS[name]
        g = grads[name] / iter_size + decay * decay_mult * w
        h = momentum * h + rate * lr_mult * g
        out[name] = (w - h, h)
    return out


def read_back(net, it: int, want: dict) -> list[str]:
    """The blobs of ``want`` that ``net.blobs[name].data`` shows otherwise, in words."""
    wrong = []
    for name, value in want.items():
        got = np.asarray(net.blobs[name].data)
        if got.shape != np.shape(value) and got.size == np.size(value) == 1:
            got = got.reshape(np.shape(value))
        if got.shape != np.shape(value) or not np.allclose(got, value, rtol=1e-6, atol=0):
            wrong.append(f"iteration {it}: blob '{name}' {got.shape}, first values "
                         f"{got.ravel()[:3]}; the pass's: {np.ravel(value)[:3]}")
    return wrong


def assert_state(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        for part, g, w in zip(("weights", "history"), got[name], want[name]):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-12,
                                       err_msg=f"{what}: {name} {part}")


# -- 1: an FCN whose data layer cycles through image sizes ------------------------------------
def test_each_iteration_equals_a_net_fixed_at_its_size_and_a_numpy_sgd_step(tmp_path,
                                                                           monkeypatch):
    name, mod = layers(tmp_path, monkeypatch)
    with Solver(solver_text(python_data(name) + FCN), dtype="float64") as s:
        losses, stale = [], []
        for it in range(8):
            before = state(s)
            s.step(1)
            image, label = mod.item(it)
            assert s.net.blobs["cropped"].shape == (1, CLASSES) + SIZES[it % 4]
            loss, grads = reference(inputs(*image.shape[2:]) + FCN, before, image, label)
            assert float(s.smoothed[-1]) == pytest.approx(loss, rel=1e-6), f"iteration {it}"
            assert_state(state(s), sgd(before, grads, it), f"iteration {it}")
            losses.append(loss)
            # After the step the net's blobs hold its pass, as Caffe's do: item ``it``, and
            # the loss of the pass.
            stale += read_back(s.net, it, {"data": image, "label": label, "loss": loss})
        assert s.iter == 8
        # One build per image size, made in the first cycle and reused in the second.
        assert len(s.net.builds()) == 4
    assert len(set(np.round(losses, 6))) == 8  # eight distinct passes, not one repeated
    assert not stale, "blobs read after the step do not hold its pass:\n" + "\n".join(stale)


# -- 2: the same, trained by `purine-caffe train` ---------------------------------------------
LOSS_LINE = re.compile(r"Iteration (\d+) \([^)]*\), loss = (\S+)")
FINAL_LINE = re.compile(r"Iteration (\d+), loss = (\S+)")


def test_the_command_line_trains_through_the_sizes_as_the_solver_does(tmp_path, monkeypatch,
                                                                      capsys):
    name, _ = layers(tmp_path, monkeypatch)
    net = tmp_path / "fcn.prototxt"
    net.write_text('name: "fcn"\n' + python_data(name) + FCN)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{net}"\nbase_lr: {BASE_LR}\nlr_policy: "step"\ngamma: {GAMMA}\n'
                      f"stepsize: {STEPSIZE}\nmomentum: {MOMENTUM}\nweight_decay: {DECAY}\n"
                      f'display: 1\nmax_iter: 6\nrandom_seed: 7\nsnapshot_prefix: '
                      f'"{tmp_path}/fcn"\n')
    with Solver(str(solver)) as s:  # float32, as the command trains
        want = []
        for _ in range(6):
            s.step(1)
            want.append(float(s.smoothed[-1]))
        weights = {n: [v.data.copy() for v in vs] for n, vs in s.net.params.items()}
        final = float(s.net.forward()["loss"])  # item 6 with the trained weights
    capsys.readouterr()
    assert purine.cli.main(["train", "--solver", str(solver)]) == 0
    log = capsys.readouterr().err
    rows = [(int(m.group(1)), float(m.group(2))) for m in LOSS_LINE.finditer(log)]
    assert [it for it, _ in rows] == list(range(6)), log
    np.testing.assert_allclose([v for _, v in rows], want, rtol=1e-5)
    last = list(FINAL_LINE.finditer(log))
    assert int(last[-1].group(1)) == 6
    assert float(last[-1].group(2)) == pytest.approx(final, rel=1e-5)
    # The snapshot written at the end loads, with the weights the solver reached.
    model = tmp_path / "fcn_iter_6.caffemodel"
    assert model.exists() and (tmp_path / "fcn_iter_6.solverstate").exists()
    with Net(str(net), phase=TRAIN, weights=str(model)) as loaded:
        assert loaded.params.keys() == weights.keys()
        for n, arrays in weights.items():
            for k, a in enumerate(arrays):
                np.testing.assert_allclose(loaded.params[n][k].data, a, rtol=1e-5, atol=1e-7,
                                           err_msg=f"{n}[{k}]")


# -- 3: iter_size 2, the two passes of an iteration at two sizes ------------------------------
def test_iter_size_two_sums_the_gradients_of_passes_at_two_sizes(tmp_path, monkeypatch):
    name, mod = layers(tmp_path, monkeypatch)
    stale = []
    with Solver(solver_text(python_data(name) + FCN, iter_size=2), dtype="float64") as s:
        for it in range(4):
            before = state(s)
            s.step(1)
            losses, grads = [], []
            for pos in (2 * it, 2 * it + 1):  # two items, two sizes
                image, label = mod.item(pos)
                loss, g = reference(inputs(*image.shape[2:]) + FCN, before, image, label)
                losses.append(loss)
                grads.append(g)
            assert mod.item(2 * it)[0].shape != mod.item(2 * it + 1)[0].shape
            assert float(s.smoothed[-1]) == pytest.approx(np.mean(losses), rel=1e-6)
            summed = {n: grads[0][n] + grads[1][n] for n in grads[0]}
            assert_state(state(s), sgd(before, summed, it, iter_size=2), f"iteration {it}")
            # the net's blobs hold the iteration's second pass
            stale += read_back(s.net, it, {"data": image, "loss": losses[1]})
    assert not stale, "blobs read after the step do not hold its pass:\n" + "\n".join(stale)


# -- 4: resume from a snapshot taken between two sizes ----------------------------------------
def test_resuming_from_a_snapshot_between_sizes_is_bit_identical(tmp_path, monkeypatch):
    name, _ = layers(tmp_path, monkeypatch)
    text = solver_text(python_data(name) + FCN, snapshot=3,
                       snapshot_prefix=f'"{tmp_path}/run"')
    with Solver(text) as straight:  # float32: snapshots hold float32 weights
        straight.step(6)  # snapshots at 3 (after a 14x14 image, before a 10x12 one) and 6
        want = state(straight)
    resumed_text = solver_text(python_data(name, start=3) + FCN, snapshot=0)
    with Solver(resumed_text) as resumed:  # its data layer goes on from item 3
        resumed.restore(tmp_path / "run_iter_3.solverstate")
        assert resumed.iter == 3
        resumed.step(3)
        assert resumed.iter == 6
        got = state(resumed)
    assert got.keys() == want.keys()
    for n in want:
        np.testing.assert_array_equal(got[n][0], want[n][0], err_msg=f"{n} weights")
        np.testing.assert_array_equal(got[n][1], want[n][1], err_msg=f"{n} history")


# -- 5: forward(start=, end=) after a size change ---------------------------------------------
def conv2d(x, w, b, stride=1, pad=0):
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    k = w.shape[2]
    oh = (xp.shape[2] - k) // stride + 1
    ow = (xp.shape[3] - k) // stride + 1
    out = np.empty((x.shape[0], w.shape[0], oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * stride:i * stride + k, j * stride:j * stride + k]
            out[:, :, i, j] = np.einsum("nckl,ockl->no", patch, w)
    return out + b[None, :, None, None]


PARTIAL = f'''
layer {{ name: "input" type: "Input" top: "data" input_param {{
  shape {{ dim: 1 dim: 3 dim: 8 dim: 8 }} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 {FILL} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param {{ num_output: 5 kernel_size: 3 stride: 2 {FILL} }} }}
layer {{ name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }}
layer {{ name: "pool" type: "Pooling" bottom: "conv2" top: "pool"
  pooling_param {{ pool: AVE global_pooling: true }} }}
'''


def test_forward_from_start_to_end_after_a_size_change_runs_those_layers_at_the_new_size():
    net = caffe.Net(PARTIAL, caffe.TEST, seed=3, dtype="float64")
    w1, b1 = (p.data.copy() for p in net.params["conv1"])
    w2, b2 = (p.data.copy() for p in net.params["conv2"])
    net.forward()  # at 8x8
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 11, 9))
    net.blobs["data"].reshape(*x.shape)
    net.blobs["data"].data[...] = x
    net.forward()
    c1 = np.maximum(conv2d(x, w1, b1, pad=1), 0)
    np.testing.assert_allclose(net.blobs["conv1"].data, c1, rtol=1e-10, atol=1e-12)
    pooled = net.blobs["pool"].data.copy()

    # conv2..relu2 alone, on conv1 values of our own: the layers around them do not run.
    mine = rng.standard_normal(c1.shape)
    net.blobs["conv1"].data[...] = mine
    out = net.forward(start="conv2", end="relu2")
    want = np.maximum(conv2d(mine, w2, b2, stride=2), 0)
    assert list(out) == ["conv2"] and out["conv2"].shape == (2, 5, 5, 4)
    np.testing.assert_allclose(out["conv2"], want, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(net.blobs["conv1"].data, mine)
    np.testing.assert_array_equal(net.blobs["pool"].data, pooled)

    # Another size, then the two halves of the net one after the other.
    x = rng.standard_normal((1, 3, 7, 10))
    net.blobs["data"].reshape(*x.shape)
    net.blobs["data"].data[...] = x
    out = net.forward(end="relu1")
    c1 = np.maximum(conv2d(x, w1, b1, pad=1), 0)
    np.testing.assert_allclose(out["conv1"], c1, rtol=1e-10, atol=1e-12)
    out = net.forward(start="conv2", end="relu2")
    np.testing.assert_allclose(out["conv2"], np.maximum(conv2d(c1, w2, b2, stride=2), 0),
                               rtol=1e-10, atol=1e-12)
    assert out["conv2"].shape == (1, 5, 3, 4)


# -- 6: Faster R-CNN's pattern: a later Python layer settles the label's shape ----------------
@pytest.mark.parametrize("where", ["reshape", "forward"])
def test_labels_from_a_later_python_layer_follow_the_image_size(tmp_path, monkeypatch, where):
    name, mod = layers(tmp_path, monkeypatch)
    net = python_data(name, tops=("data",)) + DETECT.replace("{targets}",
                                                              targets_layer(name, where))
    with Solver(solver_text(net), dtype="float64") as s:
        for it in range(6):  # a cycle of sizes, then two of them again
            before = state(s)
            s.step(1)
            image, _ = mod.item(it)
            h, w = ((d + 1) // 2 for d in image.shape[2:])  # the stride-2 score map
            label = mod.targets(image, h, w)
            ref_net = inputs(*image.shape[2:], label=(h, w)) + DETECT.replace("{targets}", "")
            loss, grads = reference(ref_net, before, image, label)
            assert np.isfinite(float(s.smoothed[-1]))
            assert float(s.smoothed[-1]) == pytest.approx(loss, rel=1e-6), f"iteration {it}"
            assert_state(state(s), sgd(before, grads, it), f"iteration {it}")
            assert s.net.blobs["label"].shape == (1, 1, h, w)
            assert not read_back(s.net, it, {"data": image, "label": label, "loss": loss})


# -- share_memory (the command line's default) across builds ---------------------------------
@pytest.mark.parametrize("iter_size", [1, 2])
def test_shared_memory_trains_through_the_sizes_as_without_it(tmp_path, monkeypatch,
                                                               iter_size):
    name, _ = layers(tmp_path, monkeypatch)
    text = solver_text(python_data(name) + FCN, iter_size=iter_size)
    runs = []
    for share in (False, True):
        with Solver(text, dtype="float64", share_memory=share) as s:
            s.step(6)  # the accumulators of one iteration's passes span two builds
            runs.append((state(s), len(s.net.builds()), dict(s.net._store.held)))
    (plain, builds, held), (shared, shared_builds, shared_held) = runs
    assert builds == shared_builds == 4
    for n in plain:
        for got, want in zip(shared[n], plain[n]):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15, err_msg=n)
    # The plan's buffers are the builds' together (by number), not one set per build.
    assert sum(shared_held.values()) < sum(held.values())


def test_a_python_layers_writes_to_its_tops_in_reshape_reach_the_forward(tmp_path,
                                                                         monkeypatch):
    module = write_layers(tmp_path, monkeypatch, """
import caffe

class Writes(caffe.Layer):
    def setup(self, bottom, top):
        self.k = 2

    def reshape(self, bottom, top):
        top[0].reshape(1, 2 if self.k < 4 else 3)
        top[0].data[...] = self.k  # Caffe keeps what reshape writes

    def forward(self, bottom, top):
        self.k += 1
""")
    caffe.install_as_caffe()
    net = caffe.Net(f'layer {{ name: "w" type: "Python" top: "o" python_param {{ module: '
                    f'"{module}" layer: "Writes" }} }} layer {{ name: "p" type: "Power" '
                    'bottom: "o" top: "q" power_param { scale: 10 } }', caffe.TEST)
    outs = [net.forward()["q"].copy() for _ in range(4)]
    for got, k in zip(outs, (2, 3, 4, 5)):
        np.testing.assert_array_equal(got, np.full((1, 2 if k < 4 else 3), 10.0 * k))


def test_share_with_a_second_net_reaches_every_build(tmp_path, monkeypatch):
    name, mod = layers(tmp_path, monkeypatch)
    text = python_data(name) + FCN
    a, b = (caffe.Net(text, caffe.TRAIN, seed=s) for s in (1, 2))
    t = caffe.Net(text, caffe.TRAIN, seed=3)
    for _ in range(3):  # three builds, each viewing its weights
        t.forward()
    t.share_with(a)
    t.share_with(b)
    for _ in range(3):
        t.forward()
        for layer, views in b.params.items():
            for k, v in enumerate(views):
                assert t.params[layer][k].data is v.data or np.array_equal(
                    t.params[layer][k].data, v.data), (layer, k)
    np.testing.assert_array_equal(t.params["conv1"][0].data, b.params["conv1"][0].data)
    assert not np.array_equal(t.params["conv1"][0].data, a.params["conv1"][0].data)
