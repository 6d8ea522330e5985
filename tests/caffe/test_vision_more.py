"""STOCHASTIC pooling, SPP and Im2col: forward values against hand-computed numbers and
plain loop transcriptions of Caffe's kernels, sampling statistics and seeding, the routing
of STOCHASTIC's gradient, float64 gradient checks, and the errors for bad parameters."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from purine.backend import RandomStream
from purine.caffe import TEST, TRAIN, Net
from purine.errors import LayerError
from purine.ops import pooling
from tests.gradcheck import check_gradients, layer_net

FLT_MIN = float(np.finfo(np.float32).tiny)
X33 = np.arange(1.0, 10.0).reshape(1, 1, 3, 3)  # [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


def spec(type_: str, params: str, tops=("y",), name="l") -> str:
    return (f'name: "{name}" type: "{type_}" bottom: "x" '
            + " ".join(f'top: "{t}"' for t in tops) + f" {params}")


def net_of(layer: str, shape, phase=TRAIN, seed=0, force_backward=False,
           dtype="float64") -> Net:
    return Net(layer_net(layer, {"x": shape}, force_backward), phase=phase, dtype=dtype,
               seed=seed)


def stochastic(kernel, stride=(1, 1)) -> str:
    return spec("Pooling", f"pooling_param {{ pool: STOCHASTIC kernel_h: {kernel[0]} "
                           f"kernel_w: {kernel[1]} stride_h: {stride[0]} "
                           f"stride_w: {stride[1]} }}")


def positive(shape, seed=0, low=0.5):
    return np.random.default_rng(seed).uniform(low, 2.0, shape)


def pooled_size(size, k, s, p=0):
    out = math.ceil((size + 2 * p - k) / s) + 1
    return out - 1 if p and (out - 1) * s >= size + p else out


def windows(h, w, kernel, stride):
    """Caffe's STOCHASTIC windows: (ph, pw, rows, cols), no padding, clipped to the image."""
    oh, ow = pooled_size(h, kernel[0], stride[0]), pooled_size(w, kernel[1], stride[1])
    for a, b in itertools.product(range(oh), range(ow)):
        hs, ws = a * stride[0], b * stride[1]
        yield a, b, range(hs, min(hs + kernel[0], h)), range(ws, min(ws + kernel[1], w))


# -- STOCHASTIC: references --------------------------------------------------------------------
def stochastic_test_ref(x, kernel, stride):
    n, c, h, w = x.shape
    oh, ow = pooled_size(h, kernel[0], stride[0]), pooled_size(w, kernel[1], stride[1])
    y = np.zeros((n, c, oh, ow), x.dtype)
    for i_n, i_c in itertools.product(range(n), range(c)):
        for a, b, rows, cols in windows(h, w, kernel, stride):
            total, squares = x.dtype.type(FLT_MIN), x.dtype.type(0)
            for r, q in itertools.product(rows, cols):
                total += x[i_n, i_c, r, q]
                squares += x[i_n, i_c, r, q] * x[i_n, i_c, r, q]
            y[i_n, i_c, a, b] = squares / total
    return y


def stochastic_train_ref(x, kernel, stride, u):
    """Caffe's StoPoolForwardTrain given its uniform draws ``u`` in (0, 1]: returns (top,
    plane index of the pick, -1 where the loop picks nothing)."""
    n, c, h, w = x.shape
    y, idx = np.zeros(u.shape, x.dtype), np.full(u.shape, -1)
    for i_n, i_c in itertools.product(range(n), range(c)):
        for a, b, rows, cols in windows(h, w, kernel, stride):
            cells = list(itertools.product(rows, cols))
            total = x.dtype.type(0)
            for r, q in cells:
                total += x[i_n, i_c, r, q]
            threshold = np.float32(u[i_n, i_c, a, b] * total)
            running = x.dtype.type(0)
            for r, q in cells:
                running += x[i_n, i_c, r, q]
                if running >= threshold:
                    y[i_n, i_c, a, b], idx[i_n, i_c, a, b] = x[i_n, i_c, r, q], r * w + q
                    break
    return y, idx


def rand_idx(net: Net, blob="l@rand_idx") -> np.ndarray:
    """The layer's record of each window's pick (Caffe's rand_idx_, as plane indices)."""
    return net.dispatcher.array(net.graph.blobs[blob])


# -- STOCHASTIC: TEST phase ------------------------------------------------------------------
def test_stochastic_test_phase_by_hand():
    net = net_of(stochastic((2, 2)), X33.shape, phase=TEST)
    # Windows {1, 2, 4, 5}, {2, 3, 5, 6}, {4, 5, 7, 8}, {5, 6, 8, 9}: sum(x^2) / sum(x).
    np.testing.assert_allclose(net.forward(x=X33)["y"],
                               [[[[46 / 12, 74 / 16], [154 / 24, 206 / 28]]]], rtol=1e-14)
    # Stride 2 rounds up: the last windows are clipped to {3, 6}, {7, 8} and {9}.
    net = net_of(stochastic((2, 2), (2, 2)), X33.shape, phase=TEST)
    np.testing.assert_allclose(net.forward(x=X33)["y"],
                               [[[[46 / 12, 45 / 9], [113 / 15, 9]]]], rtol=1e-14)
    # An all-zero window gives 0 (Caffe's FLT_MIN in the denominator), not NaN.
    zeros = X33.copy()
    zeros[0, 0, :2, :2] = 0
    got = net.forward(x=zeros)["y"]
    assert got[0, 0, 0, 0] == 0
    np.testing.assert_allclose(got[0, 0, 1, 1], 9, rtol=1e-14)


STOCHASTIC_CASES = [
    ((2, 3, 6, 6), (2, 2), (2, 2)),
    ((1, 2, 7, 5), (3, 2), (2, 3)),
    ((2, 1, 5, 7), (3, 3), (1, 1)),
    ((1, 2, 6, 5), (2, 2), (3, 3)),  # a stride past the kernel: windows wholly outside
]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("shape,kernel,stride", STOCHASTIC_CASES)
def test_stochastic_test_phase_matches_reference(shape, kernel, stride, dtype):
    x = positive(shape, seed=2, low=0.0).astype(dtype)
    net = net_of(stochastic(kernel, stride), shape, phase=TEST, dtype=dtype)
    got = net.forward(x=x)["y"]
    # Both accumulate in Caffe's scan order in the blob's type: equal to the last bit.
    np.testing.assert_array_equal(got, stochastic_test_ref(x, kernel, stride))


@pytest.mark.parametrize("shape,kernel,stride", STOCHASTIC_CASES)
def test_stochastic_test_phase_gradients(shape, kernel, stride):
    # TEST's output sum(x^2) / sum(x) is smooth for positive inputs, so its gradient is
    # checked numerically. TRAIN's output is a fresh random sample at every forward pass
    # (finite differences would compare different samples); its routing is checked below.
    check_gradients(stochastic(kernel, stride), {"x": positive(shape, seed=5)}, phase=TEST)


# -- STOCHASTIC: TRAIN phase -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape,kernel,stride", STOCHASTIC_CASES)
def test_stochastic_train_picks_as_caffe_does(shape, kernel, stride, dtype):
    # The kernel against Caffe's loop fed the same uniform draws: same picks, same values.
    x = positive(shape, seed=3, low=0.0).astype(dtype)
    x[0, 0, :2, :2] = 0  # an all-zero window picks its first position
    n, c, h, w = shape
    oh, ow = pooled_size(h, kernel[0], stride[0]), pooled_size(w, kernel[1], stride[1])
    geom = pooling.PoolGeometry(n, c, h, w, *kernel, *stride, 0, 0, oh, ow)
    y, idx = np.empty((n, c, oh, ow), dtype), np.empty((n, c, oh, ow), np.int32)
    pooling.stochastic_pool_forward_train(x, y, idx, geom=geom, rng=RandomStream(11, 5))
    u = (1.0 - RandomStream(11, 5).next().random(y.shape)).astype(dtype)
    want_y, want_idx = stochastic_train_ref(x, kernel, stride, u)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(y, want_y)
    if kernel[0] <= stride[0]:  # the first window is {0, 0, 0, 0} in sample 0, channel 0
        assert idx[0, 0, 0, 0] == 0 and y[0, 0, 0, 0] == 0


def test_stochastic_train_outputs_members_of_their_windows():
    shape, kernel, stride = (2, 3, 7, 6), (3, 2), (2, 2)
    x = positive(shape, seed=4)
    net = net_of(stochastic(kernel, stride), shape)
    for _ in range(5):
        y = net.forward(x=x)["y"]
        idx = rand_idx(net)
        for i_n, i_c in itertools.product(range(2), range(3)):
            for a, b, rows, cols in windows(7, 6, kernel, stride):
                r, q = divmod(int(idx[i_n, i_c, a, b]), 6)
                assert r in rows and q in cols
                assert y[i_n, i_c, a, b] == x[i_n, i_c, r, q]


def test_stochastic_sampling_frequencies_match_the_values():
    # Channel 0's windows hold 1, 2, 3, 4 (p = 0.1 .. 0.4); channel 1's 0, 1, 3, 6 (the
    # zero is never drawn). 1000 windows a pass, 20 passes: 20000 draws per channel.
    patterns = np.array([[[1.0, 2.0], [3.0, 4.0]], [[0.0, 1.0], [3.0, 6.0]]])
    x = np.tile(patterns[None], (1, 1, 1, 1000))  # (1, 2, 2, 2000): 1000 2x2 windows
    net = net_of(stochastic((2, 2), (2, 2)), x.shape)
    counts = np.zeros((2, 4))
    for _ in range(20):
        net.forward(x=x)
        idx = rand_idx(net)[0, :, 0, :]  # (2, 1000): plane index h * 2000 + w
        offset = (idx // 2000) * 2 + (idx % 2000) % 2  # kernel offset 0..3 in scan order
        for ch in range(2):
            counts[ch] += np.bincount(offset[ch], minlength=4)
    for ch in range(2):
        p = patterns[ch].ravel() / patterns[ch].sum()
        expected = p * counts[ch].sum()
        seen = p > 0
        chi2 = (((counts[ch] - expected)[seen]) ** 2 / expected[seen]).sum()
        # 3 degrees of freedom: P(chi2 > 16.27) = 0.001; the seed makes it deterministic.
        assert chi2 < 16.27, (ch, counts[ch], expected)
        assert counts[ch][~seen].sum() == 0


def test_stochastic_is_seeded_and_resumes_from_its_stream_state():
    shape = (2, 2, 6, 6)
    x = positive(shape, seed=6)
    a, b = net_of(stochastic((2, 2), (2, 2)), shape, seed=3), net_of(
        stochastic((2, 2), (2, 2)), shape, seed=3)
    first = a.forward(x=x)["y"].copy()
    second = a.forward(x=x)["y"].copy()
    assert not np.array_equal(first, second)  # a fresh draw each pass
    np.testing.assert_array_equal(b.forward(x=x)["y"], first)  # same seed, same samples
    c = net_of(stochastic((2, 2), (2, 2)), shape, seed=4)
    assert not np.array_equal(c.forward(x=x)["y"], first)
    # The stream's state is what a snapshot saves: restoring it replays the draws.
    (stream,) = [s for k, s in a.builder.stateful.items() if k.startswith("l/random")]
    saved = stream.state()
    third = a.forward(x=x)["y"].copy()
    stream.restore(saved)
    np.testing.assert_array_equal(a.forward(x=x)["y"], third)


@pytest.mark.parametrize("kernel,stride", [((3, 3), (2, 2)), ((2, 3), (1, 2)),
                                           ((2, 2), (2, 2))])
def test_stochastic_backward_routes_to_the_sample(kernel, stride):
    shape = (2, 2, 7, 6)
    x = positive(shape, seed=7)
    net = net_of(stochastic(kernel, stride), shape, force_backward=True)
    net.forward(x=x)
    idx = rand_idx(net).copy()
    dy = np.random.default_rng(8).standard_normal(idx.shape)
    dx = net.backward(y=dy)["x"]
    want = np.zeros(shape)
    for i_n, i_c, a, b in itertools.product(*(range(d) for d in idx.shape)):
        r, q = divmod(int(idx[i_n, i_c, a, b]), 6)
        want[i_n, i_c, r, q] += dy[i_n, i_c, a, b]  # overlapping windows add up
    np.testing.assert_allclose(dx, want, rtol=1e-14, atol=0)


@pytest.mark.parametrize("shape,kernel,stride", STOCHASTIC_CASES)
def test_stochastic_backward_gpu_path_with_the_emulated_kernel(shape, kernel, stride):
    # On a GPU the routing is MAX's gather kernel fed the picks; here that CUDA source runs
    # on the CPU (tests/gpu/emulate.py) and must agree with the host path, -1 included.
    from tests.gpu import emulate

    n, c, h, w = shape
    oh, ow = pooled_size(h, kernel[0], stride[0]), pooled_size(w, kernel[1], stride[1])
    geom = pooling.PoolGeometry(n, c, h, w, *kernel, *stride, 0, 0, oh, ow)
    x = positive(shape, seed=17)
    y, idx = np.empty((n, c, oh, ow)), np.empty((n, c, oh, ow), np.int32)
    pooling.stochastic_pool_forward_train(x, y, idx, geom=geom, rng=RandomStream(1, 2))
    assert (idx == -1).any() == (stride[0] > kernel[0])  # windows outside pick nothing
    dy = np.random.default_rng(18).standard_normal(idx.shape)
    want, got = np.empty(shape), np.full(shape, np.nan)
    pooling.stochastic_pool_backward(dy, idx, want, geom=geom)
    pooling._gpu_max_pool_backward(emulate.kernel, dy, idx, got, geom)
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)


# -- SPP -------------------------------------------------------------------------------------
def spp(height: int, pool: str = "MAX") -> str:
    return spec("SPP", f"spp_param {{ pyramid_height: {height} pool: {pool} }}")


def spp_ref(x, height, pool):
    """Each level by Caffe's GetPoolingParam and Pooling CPU loops, flattened and joined."""
    n, c, h, w = x.shape
    parts = []
    for level in range(height):
        bins = 2 ** level
        kh, kw = math.ceil(h / bins), math.ceil(w / bins)
        ph, pw = (kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2
        oh, ow = pooled_size(h, kh, kh, ph), pooled_size(w, kw, kw, pw)
        y = np.zeros((n, c, oh, ow))
        for a, b in itertools.product(range(oh), range(ow)):
            hs, ws = a * kh - ph, b * kw - pw
            box = x[:, :, max(hs, 0):min(hs + kh, h), max(ws, 0):min(ws + kw, w)]
            if pool == "MAX":
                y[:, :, a, b] = box.max(axis=(2, 3))
            else:
                size = (min(hs + kh, h + ph) - hs) * (min(ws + kw, w + pw) - ws)
                y[:, :, a, b] = box.sum(axis=(2, 3)) / size
        parts.append(y.reshape(n, -1))
    return parts[0].reshape(n, c, 1, 1) if height == 1 else np.concatenate(parts, axis=1)


SPP_SHAPES = [(2, 3, 8, 8), (1, 2, 7, 7), (2, 2, 6, 9), (1, 1, 13, 11), (1, 3, 4, 16)]


@pytest.mark.parametrize("height", [1, 2, 3])
@pytest.mark.parametrize("shape", SPP_SHAPES)
def test_spp_shapes(shape, height):
    n, c = shape[:2]
    net = net_of(spp(height), shape)
    # Level l has 2^l x 2^l bins; pyramid_height 1 is one global pooling, kept 4-d.
    want = (n, c, 1, 1) if height == 1 else (n, c * sum(4 ** lv for lv in range(height)))
    assert net.blobs["y"].shape == want


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("height", [1, 2, 3])
@pytest.mark.parametrize("shape", SPP_SHAPES)
def test_spp_matches_reference(shape, height, pool):
    x = np.random.default_rng(9).standard_normal(shape)
    got = net_of(spp(height, pool), shape).forward(x=x)["y"]
    np.testing.assert_allclose(got, spp_ref(x, height, pool), rtol=1e-13, atol=1e-15)


def test_spp_by_hand():
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    got = net_of(spp(2), x.shape).forward(x=x)["y"]
    # Level 0: the maximum 15; level 1: the maxima of the four 2x2 quadrants.
    np.testing.assert_array_equal(got, [[15, 5, 7, 13, 15]])
    got = net_of(spp(2, "AVE"), x.shape).forward(x=x)["y"]
    np.testing.assert_allclose(got, [[7.5, 2.5, 4.5, 10.5, 12.5]], rtol=1e-15)
    # 3x3, two levels: kernel 2, pad 1 for level 1; AVE counts the padding as Caffe does.
    got = net_of(spp(2, "AVE"), X33.shape).forward(x=X33)["y"]
    np.testing.assert_allclose(got, [[5, 1 / 4, (2 + 3) / 4, (4 + 7) / 4, (5 + 6 + 8 + 9) / 4]],
                               rtol=1e-15)


def test_spp_stochastic():
    x = positive((2, 2, 8, 4), seed=10)
    # TEST: level by level, the probability-weighted averages of the bins.
    got = net_of(spp(3, "STOCHASTIC"), x.shape, phase=TEST).forward(x=x)["y"]
    parts = [stochastic_test_ref(x, (8 // 2 ** lv, 4 // 2 ** lv), (8 // 2 ** lv, 4 // 2 ** lv))
             .reshape(2, -1) for lv in range(3)]
    np.testing.assert_allclose(got, np.concatenate(parts, axis=1), rtol=1e-14)
    # TRAIN: every level draws its own samples from its bins.
    net = net_of(spp(3, "STOCHASTIC"), x.shape, force_backward=True)
    y = net.forward(x=x)["y"]
    picks = [rand_idx(net, f"l@rand_idx{lv}").reshape(2, 2, -1).copy() for lv in range(3)]
    bounds = np.cumsum([0] + [2 * 4 ** lv for lv in range(3)])  # channels * bins^2
    for lv, idx in enumerate(picks):
        picked = np.take_along_axis(x.reshape(2, 2, -1), idx, axis=2)
        np.testing.assert_array_equal(y[:, bounds[lv]:bounds[lv + 1]], picked.reshape(2, -1))
    # The levels' gradients add up in the bottom, each routed to its own samples.
    dy = np.random.default_rng(1).standard_normal(y.shape)
    dx = net.backward(y=dy)["x"]
    want = np.zeros(x.size)
    plane = np.arange(4).reshape(2, 2, 1) * 32
    for lv, idx in enumerate(picks):
        np.add.at(want, (idx + plane).ravel(), dy[:, bounds[lv]:bounds[lv + 1]].ravel())
    np.testing.assert_allclose(dx.ravel(), want, rtol=1e-14)


GRAD_SPP = [((2, 2, 6, 6), 3), ((1, 2, 7, 5), 2), ((1, 1, 9, 10), 3), ((2, 1, 5, 4), 1)]


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("shape,height", GRAD_SPP)
def test_spp_gradients(shape, height, pool):
    n = int(np.prod(shape))
    rng = np.random.default_rng(12)
    # Distinct values (no MAX ties under the finite-difference step).
    x = (rng.permutation(n) - n / 2).reshape(shape) * 0.05
    check_gradients(spp(height, pool), {"x": x})


# -- Im2col ----------------------------------------------------------------------------------
def im2col_params(kernel, stride=None, pad=None, dilation=None, extra="") -> str:
    parts = [f"kernel_size: {k}" for k in kernel]
    for name, values in (("stride", stride), ("pad", pad), ("dilation", dilation)):
        parts += [f"{name}: {v}" for v in values or ()]
    return f"convolution_param {{ {' '.join(parts)} {extra} }}"


def im2col_ref(x, kernel, stride, pad, dilation, axis=1):
    """Caffe's im2col_nd loop: output channel c * prod(kernel) + (row-major offset)."""
    lead = x.shape[:axis]
    x = x.reshape((math.prod(lead),) + x.shape[axis:])
    n, c, size = x.shape[0], x.shape[1], x.shape[2:]
    out = tuple((s + 2 * p - (d * (k - 1) + 1)) // st + 1
                for s, k, st, p, d in zip(size, kernel, stride, pad, dilation))
    kk = math.prod(kernel)
    y = np.zeros((n, c * kk) + out)
    for i_n, i_c in itertools.product(range(n), range(c)):
        for o, offset in enumerate(itertools.product(*(range(k) for k in kernel))):
            for pos in itertools.product(*(range(m) for m in out)):
                src = tuple(q * st - p + k * d for q, st, p, k, d
                            in zip(pos, stride, pad, offset, dilation))
                if all(0 <= s < m for s, m in zip(src, size)):
                    y[(i_n, i_c * kk + o) + pos] = x[(i_n, i_c) + src]
    return y.reshape(lead + y.shape[1:])


def test_im2col_by_hand():
    net = net_of(spec("Im2col", im2col_params([2])), X33.shape)
    y = net.forward(x=X33)["y"]
    assert y.shape == (1, 4, 2, 2)
    # Channel (i, j) holds every window's value at kernel offset (i, j).
    np.testing.assert_array_equal(y[0], [[[1, 2], [4, 5]], [[2, 3], [5, 6]],
                                         [[4, 5], [7, 8]], [[5, 6], [8, 9]]])
    # Pad 1, stride 2: the windows at padded (0, 0), (0, 2), (2, 0), (2, 2).
    net = net_of(spec("Im2col", im2col_params([2], [2], [1])), X33.shape)
    np.testing.assert_array_equal(net.forward(x=X33)["y"][0],
                                  [[[0, 0], [0, 5]], [[0, 0], [4, 6]],
                                   [[0, 2], [0, 8]], [[1, 3], [7, 9]]])


IM2COL_CASES = [
    # shape, kernel, stride, pad, dilation, axis
    ((2, 3, 5, 5), [3], [1], [0], [1], 1),
    ((1, 2, 6, 7), [3, 2], [2, 1], [1, 0], [1], 1),
    ((2, 2, 7, 6), [2], [1, 2], [2], [2, 1], 1),
    ((1, 1, 8, 5), [3, 1], [3], [1, 2], [2], 1),
    ((2, 3, 9), [3], [2], [1], [2], 1),  # 1-d
    ((1, 2, 4, 5, 3), [2, 3, 2], [1, 2, 1], [1, 0, 1], [1], 1),  # 3-d (Caffe's im2col_nd)
    ((2, 2, 2, 5, 4), [2], [1], [1], [1], 2),  # axis 2: the first two axes are the batch
]


@pytest.mark.parametrize("shape,kernel,stride,pad,dilation,axis", IM2COL_CASES)
def test_im2col_matches_reference(shape, kernel, stride, pad, dilation, axis):
    spatial = len(shape) - axis - 1

    def full(v):
        return v * spatial if len(v) == 1 else v

    x = np.random.default_rng(13).standard_normal(shape)
    layer = spec("Im2col", im2col_params(kernel, stride, pad, dilation, f"axis: {axis}"))
    got = net_of(layer, shape).forward(x=x)["y"]
    want = im2col_ref(x, full(kernel), full(stride), full(pad), full(dilation), axis)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_im2col_force_nd_and_kernel_h_w_give_the_same_columns():
    x = np.random.default_rng(14).standard_normal((2, 3, 6, 5))
    base = net_of(spec("Im2col", "convolution_param { kernel_h: 3 kernel_w: 2 pad_h: 1 "
                                 "stride_w: 2 stride_h: 1 }"), x.shape).forward(x=x)["y"]
    nd = net_of(spec("Im2col", im2col_params([3, 2], [1, 2], [1, 0],
                                             extra="force_nd_im2col: true")), x.shape)
    np.testing.assert_array_equal(nd.forward(x=x)["y"], base)
    np.testing.assert_array_equal(base, im2col_ref(x, [3, 2], [1, 2], [1, 0], [1, 1]))


def test_im2col_times_weights_is_the_convolution():
    # A Convolution is a GEMM of its weights with Im2col's columns (Caffe's own identity).
    x = np.random.default_rng(15).standard_normal((2, 3, 7, 6))
    params = "kernel_size: 3 stride: 2 pad: 1 dilation: 1"
    cols = net_of(spec("Im2col", f"convolution_param {{ {params} }}"), x.shape).forward(
        x=x)["y"]
    conv = net_of(spec("Convolution", f"convolution_param {{ num_output: 4 {params} "
                                      "bias_term: false weight_filler { type: 'gaussian' } }"),
                  x.shape)
    w = conv.params["l"][0].data.reshape(4, -1)
    np.testing.assert_allclose(np.einsum("mk,nkhw->nmhw", w, cols), conv.forward(x=x)["y"],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,kernel,stride,pad,dilation,axis", IM2COL_CASES)
def test_im2col_gradients(shape, kernel, stride, pad, dilation, axis):
    x = np.random.default_rng(16).standard_normal(shape)
    check_gradients(spec("Im2col", im2col_params(kernel, stride, pad, dilation,
                                                 f"axis: {axis}")), {"x": x})


# -- errors ----------------------------------------------------------------------------------
ERRORS = [
    ("Pooling", "pooling_param { pool: STOCHASTIC kernel_size: 2 pad: 1 }", (1, 1, 4, 4),
     r"padding is implemented for MAX and AVE pooling only; STOCHASTIC pooling got pad "
     r"\(1, 1\)"),
    ("SPP", "spp_param { pool: MAX }", (1, 1, 4, 4),
     "pyramid_height must be at least 1, got 0"),
    ("SPP", "spp_param { pyramid_height: 3 }", (1, 1, 5, 8),
     r"pyramid level 2 \(4x4 bins\) of bottom 'x' \(1, 1, 5, 8\) needs kernel \(2, 2\) and "
     r"pad \(2, 0\)"),
    ("SPP", "spp_param { pyramid_height: 2 }", (1, 1, 1, 4), r"pad \(1, 0\)"),
    ("SPP", "spp_param { pyramid_height: 3 pool: STOCHASTIC }", (1, 1, 8, 6),
     r"level 2 .* needs pad \(0, 1\), but STOCHASTIC pooling has no padding"),
    ("SPP", "spp_param { pyramid_height: 1 }", (1, 4, 4), "4 axes"),
    ("Im2col", "convolution_param { num_output: 4 }", (1, 1, 4, 4),
     r"kernel_size \(or kernel_h and kernel_w\) is required"),
    ("Im2col", "convolution_param { kernel_size: 5 }", (1, 1, 4, 4),
     r"kernel extent \[5, 5\] exceeds the padded input"),
    ("Im2col", "convolution_param { kernel_size: 3 dilation: 2 pad: 0 }", (1, 1, 4, 6),
     r"kernel extent \[5, 5\]"),
    ("Im2col", "convolution_param { kernel_size: 2 stride: 0 }", (1, 1, 4, 4),
     r"stride must be positive, got \[0, 0\]"),
    ("Im2col", "convolution_param { kernel_h: 2 kernel_w: 2 }", (1, 1, 4, 4, 4),
     "for 2-d convolution only"),
    ("Im2col", "convolution_param { kernel_size: 2 kernel_size: 2 }", (1, 1, 4, 4, 4),
     "once per spatial axis"),
    ("Im2col", "convolution_param { kernel_size: 1 axis: 1 }", (3, 4),
     r"no spatial axis after its channel axis 1"),
]


@pytest.mark.parametrize("type_,params,shape,message", ERRORS)
def test_errors(type_, params, shape, message):
    with pytest.raises(LayerError, match=message):
        net_of(spec(type_, params), shape, force_backward=True)


def test_stochastic_pooling_has_no_mask_top():
    with pytest.raises(LayerError, match=r"needs 1 top blob\(s\), got 2"):
        net_of(spec("Pooling", "pooling_param { pool: STOCHASTIC kernel_size: 2 }",
                    tops=("y", "m")), (1, 1, 4, 4))


@pytest.mark.parametrize("type_,params", [
    ("SPP", "spp_param { pyramid_height: 2 }"),
    ("Im2col", "convolution_param { kernel_size: 1 }"),
])
def test_in_place_is_refused(type_, params):
    with pytest.raises(LayerError, match="cannot run in place"):
        net_of(spec(type_, params, tops=("x",)), (1, 2, 4, 4))
