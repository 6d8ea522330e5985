"""Sizes checked before allocation and empty axes (issue 28): fillers draw in chunks straight
into the net's dtype; every parameter, blob and op workspace of a net is checked against
memory (RAM and RLIMIT_AS) before any is allocated or filled; RNN/LSTM over T = 0,
ContrastiveLoss over N = 0 and Convolution/Pooling/InnerProduct over N = 0 run."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net, fillers
from purine.errors import LayerError, PurineError
from purine.formats import caffe_pb2 as pb
from purine.log import get_logger
from purine.runtime.memory import require_bytes
from tests.gradcheck import layer_net

ROOT = Path(__file__).resolve().parents[2]
F32 = np.float32
FILLERS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "constant" value: 0.25 }'


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    """Build logs off for these tests, and the level given back after each (setLevel, so
    the logger's cached decisions are dropped too)."""
    log = get_logger()
    level = log.level
    log.setLevel(logging.WARNING)
    yield
    log.setLevel(level)


def net_of(layer: str, bottoms: dict, phase: int = TRAIN, dtype: str = "float64") -> Net:
    return Net(layer_net(layer, bottoms), phase=phase, dtype=dtype)


# -- fillers: chunked, in the parameter's own dtype ------------------------------------
def f32(v: float) -> float:
    """A FillerParameter float field as the filler reads it."""
    return float(F32(v))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fill_into_draws_numpys_stream_in_chunks(monkeypatch, dtype):
    monkeypatch.setattr(fillers, "FILL_CHUNK", 7)  # 60 values: nine draws
    shape = (4, 15)
    cases = {
        "uniform": (pb.FillerParameter(type="uniform", min=-2, max=3),
                    lambda r: r.uniform(-2.0, 3.0, shape)),
        "gaussian": (pb.FillerParameter(type="gaussian", mean=1, std=0.5),
                     lambda r: r.normal(1.0, 0.5, shape)),
        # fan_in = 60 / 4 = 15: scale sqrt(3 / 15)
        "xavier": (pb.FillerParameter(type="xavier"),
                   lambda r: r.uniform(-np.sqrt(0.2), np.sqrt(0.2), shape)),
        "msra": (pb.FillerParameter(type="msra"), lambda r: r.normal(0.0, np.sqrt(2 / 15), shape)),
        # every normal first, then the mask's uniforms: keep where u < sparse / shape[0]
        "sparse": (pb.FillerParameter(type="gaussian", std=f32(0.5), sparse=2),
                   lambda r: r.normal(0.0, f32(0.5), shape) * (r.random(shape) < 0.5)),
    }
    for name, (p, reference) in cases.items():
        out = np.full(shape, 99.0, dtype=dtype)
        fillers.fill_into(p, out, np.random.default_rng(11), name)
        want = reference(np.random.default_rng(11)).astype(F32).astype(dtype)
        np.testing.assert_array_equal(out, want, err_msg=name)


def test_positive_unitball_chunks_whole_rows(monkeypatch):
    monkeypatch.setattr(fillers, "FILL_CHUNK", 5)  # rows of 3: draws of 3 values
    out = np.zeros((4, 3))
    fillers.fill_into(pb.FillerParameter(type="positive_unitball"), out,
                      np.random.default_rng(2), "u")
    u = np.random.default_rng(2).uniform(0.0, 1.0, (4, 3))
    np.testing.assert_array_equal(out, (u / u.sum(axis=1, keepdims=True)).astype(F32))


def test_constant_and_bilinear_into_float64():
    out = np.zeros((2, 3))
    fillers.fill_into(pb.FillerParameter(type="constant", value=0.1), out, None, "c")
    assert (out == float(F32(0.1))).all()  # float32's 0.1, as Caffe's float fillers give
    out = np.zeros((1, 2, 4, 4))
    fillers.fill_into(pb.FillerParameter(type="bilinear"), out, None, "b")
    row = [0.25, 0.75, 0.75, 0.25]  # f = 2, c = 0.75: 1 - |i / 2 - 0.75|
    np.testing.assert_array_equal(out[0, 1], np.outer(row, row))


def test_fill_scratch_is_a_few_chunks_not_the_parameter():
    p = pb.FillerParameter(type="gaussian", std=1)
    assert fillers.fill_scratch_bytes(p, (1 << 16, 1 << 16)) == 24 << 20
    assert fillers.fill_scratch_bytes(p, (3, 5)) == 24 * 15
    # positive_unitball draws whole rows: one row of 2^21 values at least
    ball = pb.FillerParameter(type="positive_unitball")
    assert fillers.fill_scratch_bytes(ball, (4, 1 << 21)) == 24 << 21


def test_float64_net_gets_float32_rounded_draws():
    net = net_of('name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param '
                 '{ num_output: 3 weight_filler { type: "uniform" min: -1 max: 1 } }',
                 {"x": (2, 4)})
    w = net.params["ip"][0].data
    assert w.dtype == np.float64
    # Net seed 0, layer index 1 (after the Input), parameter 0
    want = np.random.default_rng([0, 1, 0]).uniform(-1.0, 1.0, (3, 4)).astype(F32)
    np.testing.assert_array_equal(w, want)


# -- the memory check before anything is allocated -------------------------------------
def test_require_bytes_names_the_asker():
    with pytest.raises(PurineError, match=r"^blob 'x' asks for 8192\.0 PiB; this machine has "
                       r".* of memory$"):
        require_bytes(1 << 63, "blob 'x'")
    require_bytes(1 << 10, "a small buffer")  # fits: no error


def test_num_output_int32_max_is_refused_in_one_line():
    layer = ('name: "fc" type: "InnerProduct" bottom: "x" top: "y" inner_product_param '
             '{ num_output: 2147483647 weight_filler { type: "xavier" } }')
    with pytest.raises(LayerError) as e:
        net_of(layer, {"x": (2, 4096)}, dtype="float32")
    # 2147483647 * 4096 * 4 bytes = 32 TiB (less a row)
    assert str(e.value).startswith("layer 'fc' (type InnerProduct): parameter 0 "
                                   "(2147483647, 4096) float32 asks for 32.0 TiB")
    assert "of memory" in str(e.value) and "\n" not in str(e.value)


def _run_limited(script: str, headroom_mib: int, *args: object) -> list[str]:
    """Run ``script`` in a fresh interpreter whose address space may grow ``headroom_mib``
    past what it maps once purine is imported; returns its stdout lines."""
    prelude = textwrap.dedent(f"""
        import logging, resource, sys
        import numpy as np
        from purine.caffe import Net, TEST, TRAIN
        from purine.errors import PurineError
        from purine.log import get_logger
        get_logger().setLevel(logging.WARNING)
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + ({headroom_mib} << 20),
                                                resource.RLIM_INFINITY))
        def peak_mib():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1",
               MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script),
                           *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


RNN = """
H = int(sys.argv[1])
text = f'''layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: 1 dim: 1 dim: 4 }} }} }}
layer {{ name: "c" type: "Input" top: "cont" input_param {{ shape {{ dim: 1 dim: 1 }} }} }}
layer {{ name: "rnn" type: "RNN" bottom: "x" bottom: "cont" top: "y"
  recurrent_param {{ num_output: {H} weight_filler {{ type: "uniform" min: -0.1 max: 0.1 }} }} }}'''
before = peak_mib()
try:
    net = Net(text, phase=TEST)
    net.forward()
    lo, hi = float(np.float32(-0.1)), float(np.float32(0.1))
    want = np.random.default_rng([0, 2, 3]).uniform(lo, hi, 5).astype(np.float32)
    print("ok", np.array_equal(net.params["rnn"][3].data[0, :5], want),
          net.blobs["y"].data.shape)
except PurineError as e:
    print("refused", e)
print("grown", peak_mib() - before)
"""


def test_rnn_that_passes_the_check_is_filled_without_a_float64_copy():
    # W_hh and W_ho are 7000 x 7000 float32 (187 MiB each). Filled through float64 copies
    # they took ~750 MiB at the peak (MemoryError under 700 MiB); drawn in chunks into
    # their own storage the net fits.
    out = _run_limited(RNN, 700, 7000)
    assert out[0] == "ok True (1, 1, 7000)", out


def test_rnn_num_output_int32_max_is_refused_under_rlimit_as():
    out = _run_limited(RNN, 700, 2 ** 31 - 1)
    assert out[0].startswith("refused layer 'rnn' (type RNN): parameter 0 (2147483647, 4) "
                             "float32 asks for 32.0 GiB"), out
    assert int(out[1].split()[1]) < 100  # refused before anything was allocated


def test_a_workspace_is_checked_beside_the_gradients_built_after_it():
    # RNN over T = N = 4097 steps and streams, 3 inputs, 1 unit: 960 MiB of blobs, 192 of
    # them the input's gradient, which the backward pass adds after the forward pass's
    # check of the recurrent weight's 128 MiB workspace. Checked beside only the forward
    # blobs, the net was built and ran out of address space inside its backward op (a long
    # fuzz run's find); now it is refused when built, by the layer's name.
    script = """
    shape = lambda *d: " ".join(f"dim: {x}" for x in d)
    text = (f'force_backward: true '
            f'layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ '
            f'{shape(4097, 4097, 3)} }} }} }} '
            f'layer {{ name: "c" type: "Input" top: "cont" input_param {{ shape {{ '
            f'{shape(4097, 4097)} }} }} }} '
            f'layer {{ name: "rnn" type: "RNN" bottom: "x" bottom: "cont" top: "y" '
            f'recurrent_param {{ num_output: 1 weight_filler {{ type: "gaussian" std: 0.1 }} '
            f'}} }}')
    try:
        with Net(text, phase=TRAIN) as net:
            net.forward()
            net.backward()
        print("ran")
    except PurineError as e:
        print("refused", e)
    """
    out = _run_limited(script, 1024)
    assert out[0].startswith("refused layer 'rnn' (type RNN): scratch for 4097 time steps of "
                             "4097 x 1 gate values asks for 128.3 MiB beside the "), out
    assert "(its address-space limit, RLIMIT_AS, less 16.0 MiB kept free)" in out[0], out


def test_a_later_parameter_past_the_address_space_refuses_before_any_fill():
    # Each weight is 8000 x 8000 float32 (244 MiB): the third passes the 650 MiB left.
    script = """
    ip = lambda i, b: (f'layer {{ name: "ip{i}" type: "InnerProduct" bottom: "{b}" '
                       f'top: "ip{i}" inner_product_param {{ num_output: 8000 '
                       f'weight_filler {{ type: "gaussian" std: 1 }} }} }}')
    text = ('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 '
            'dim: 8000 } } }\\n' + "\\n".join(ip(i, b) for i, b in
                                              ((1, "x"), (2, "ip1"), (3, "ip2"))))
    before = peak_mib()
    try:
        Net(text, phase=TEST)
        print("built")
    except PurineError as e:
        print("refused", e)
    print("grown", peak_mib() - before)
    """
    out = _run_limited(script, 650)
    assert out[0].startswith("refused layer 'ip3' (type InnerProduct): parameter 0 "
                             "(8000, 8000) float32 asks for 244.1 MiB beside the 488.3 MiB held "
                             "already; this process may map"), out
    assert "RLIMIT_AS" in out[0]
    assert int(out[1].split()[1]) < 100  # no 244 MiB weight was filled: checked first


def test_blobs_are_checked_together_with_the_layer_named():
    # Each top is 1 x 2^28 float64 (2 GiB): 512 GiB in all, past any test machine; the
    # message names the layer whose blob goes past, before anything is allocated.
    layers = ['layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 '
              'dim: 268435456 } } }']
    for i in range(256):
        layers.append(f'layer {{ name: "p{i}" type: "Power" bottom: "{"x" if i == 0 else f"p{i - 1}"}" '
                      f'top: "p{i}" }}')
    with pytest.raises(LayerError, match=r"^layer 'p\d+' \(type Power\): blob 'p\d+' "
                       r"\(1, 268435456\) float64 asks for 2\.0 GiB beside the .* held "
                       r"already; this (machine has|process may map)"):
        Net("\n".join(layers), phase=TEST, dtype="float64")


# -- op workspaces ----------------------------------------------------------------------
def test_pooling_stride_int32_max_is_refused_at_build_with_the_layer_named():
    layer = ('name: "pool" type: "Pooling" bottom: "x" top: "y" pooling_param '
             '{ pool: MAX kernel_size: 3 stride: 2147483647 }')
    with pytest.raises(LayerError) as e:
        net_of(layer, {"x": (1, 3, 5, 5)}, dtype="float32")
    # The padded copy holds both windows' rows: (2147483647 + 3)^2 per plane, 3 planes.
    msg = str(e.value)
    assert msg.startswith("layer 'pool' (type Pooling): scratch for pooling (1, 3, 5, 5) "
                          "(window 3x3, stride 2147483647x2147483647) asks for "), msg
    assert "\n" not in msg


def test_a_stride_past_the_image_that_fits_runs_as_caffe():
    # pooled = ceil((5 - 3) / 1000) + 1 = 2 per axis; windows starting at 1000 lie outside
    # the image and keep Caffe's initial -FLT_MAX (mask -1).
    net = net_of('name: "pool" type: "Pooling" bottom: "x" top: "y" top: "m" pooling_param '
                 '{ pool: MAX kernel_size: 3 stride: 1000 }', {"x": (1, 1, 5, 5)},
                 phase=TEST, dtype="float32")
    net.forward(x=np.arange(25, dtype=F32).reshape(1, 1, 5, 5))
    lowest = -np.finfo(F32).max
    np.testing.assert_array_equal(net.blobs["y"].data[0, 0], [[12, lowest], [lowest, lowest]])
    np.testing.assert_array_equal(net.blobs["m"].data[0, 0], [[12, -1], [-1, -1]])


# A stride as large as the padded image: tops of 2 x 2, but a padded copy of 400005^2 pixels
# per plane (3 TiB in float64), never allocated.
@pytest.mark.parametrize("layer, what", [
    ('name: "conv" type: "Convolution" bottom: "x" top: "y" convolution_param { '
     'num_output: 2 kernel_size: 1 pad: 200000 stride: 400000 }', "layer 'conv' (type "
     "Convolution): im2col scratch for (1, 3, 5, 5) (kernel 1x1, pad 200000x200000) asks for"),
    ('name: "cols" type: "Im2col" bottom: "x" top: "y" convolution_param { kernel_size: 1 '
     'pad: 200000 stride: 400000 }', "layer 'cols' (type Im2col): scratch for a padded copy "
     "of (1, 3, 5, 5) (pad (200000, 200000)) asks for 3.5 TiB; this "),
])
def test_conv_and_im2col_scratch_is_refused_at_build(layer, what):
    with pytest.raises(LayerError) as e:
        net_of(layer, {"x": (1, 3, 5, 5)}, dtype="float64")
    assert str(e.value).startswith(what), str(e.value)


# -- empty axes -------------------------------------------------------------------------
def recurrent(type_: str, exposed: bool) -> tuple[str, dict]:
    state = ["h0"] + (["c0"] if type_ == "LSTM" else [])
    bottoms = ["x", "cont"] + (state if exposed else [])
    tops = ["y"] + ([s.replace("0", "T") for s in state] if exposed else [])
    wiring = " ".join([f'bottom: "{b}"' for b in bottoms] + [f'top: "{t}"' for t in tops])
    ex = "expose_hidden: true" if exposed else ""
    shapes = {"x": (0, 2, 3), "cont": (0, 2)} | ({s: (1, 2, 4) for s in state} if exposed
                                                 else {})
    return (f'name: "r" type: "{type_}" {wiring} recurrent_param {{ num_output: 4 '
            f'{FILLERS} {ex} }}'), shapes


@pytest.mark.parametrize("type_", ["RNN", "LSTM"])
def test_recurrent_over_no_time_step(type_):
    # T = 0 runs no step: y is (0, N, H), the final state is the initial one, and every
    # gradient is zero. (Caffe's unrolled net cannot be set up for T = 0: its Slice of x
    # would have no tops.)
    layer, shapes = recurrent(type_, exposed=True)
    net = net_of(layer, shapes)
    h0 = np.arange(8.0).reshape(1, 2, 4) / 10
    feed = {"x": np.zeros((0, 2, 3)), "cont": np.zeros((0, 2)), "h0": h0}
    if type_ == "LSTM":
        feed["c0"] = -h0
    net.forward(**feed)
    assert net.blobs["y"].data.shape == (0, 2, 4)
    np.testing.assert_array_equal(net.blobs["hT"].data, h0)
    if type_ == "LSTM":
        np.testing.assert_array_equal(net.blobs["cT"].data, -h0)
    for p in net.params["r"]:
        p.diff[...] = 7.0  # stale values the backward pass must overwrite
    net.backward()
    assert net.blobs["x"].diff.shape == (0, 2, 3)
    np.testing.assert_array_equal(net.blobs["h0"].diff, 0.0)
    for p in net.params["r"]:
        np.testing.assert_array_equal(p.diff, 0.0)


@pytest.mark.parametrize("type_", ["RNN", "LSTM"])
def test_recurrent_carried_state_survives_no_time_step(type_):
    layer, _ = recurrent(type_, exposed=False)
    T1 = {"x": (1, 2, 3), "cont": (1, 2)}
    net = net_of(layer, T1, phase=TEST)
    net.forward(x=np.ones((1, 2, 3)), cont=np.zeros((1, 2)))
    after_one = net.blobs["y"].data.copy()
    net.blobs["x"].reshape(0, 2, 3)
    net.blobs["cont"].reshape(0, 2)
    net.forward()
    assert net.blobs["y"].data.shape == (0, 2, 4)
    net.blobs["x"].reshape(1, 2, 3)
    net.blobs["cont"].reshape(1, 2)
    # cont = 1 continues from the kept state: the same as continuing right after step 1
    net.forward(x=np.ones((1, 2, 3)), cont=np.ones((1, 2)))
    second = net.blobs["y"].data.copy()
    other = net_of(layer, T1, phase=TEST)
    other.forward(x=np.ones((1, 2, 3)), cont=np.zeros((1, 2)))
    np.testing.assert_array_equal(other.blobs["y"].data, after_one)
    other.forward(x=np.ones((1, 2, 3)), cont=np.ones((1, 2)))
    np.testing.assert_array_equal(second, other.blobs["y"].data)


def test_contrastive_loss_over_no_pair_is_nan_as_in_caffe():
    # Caffe: loss = sum / num / 2 in float: 0 / 0 = NaN; Backward loops over no pair.
    net = net_of('name: "l" type: "ContrastiveLoss" bottom: "a" bottom: "b" bottom: "y" '
                 'top: "loss"', {"a": (0, 3), "b": (0, 3), "y": (0,)})
    net.forward()
    assert np.isnan(net.blobs["loss"].data)
    net.backward()
    assert net.blobs["a"].diff.shape == (0, 3) and net.blobs["b"].diff.shape == (0, 3)


def test_contrastive_loss_one_pair_still_hand_computed():
    # similar pair at distance^2 = 1 + 4 = 5: loss 5 / 1 / 2
    net = net_of('name: "l" type: "ContrastiveLoss" bottom: "a" bottom: "b" bottom: "y" '
                 'top: "loss"', {"a": (1, 2), "b": (1, 2), "y": (1,)})
    net.forward(a=np.array([[1.0, 2.0]]), b=np.array([[0.0, 0.0]]), y=np.array([1.0]))
    assert float(net.blobs["loss"].data) == 2.5


def test_conv_pool_ip_over_an_empty_batch():
    text = f"""force_backward: true
    layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: 0 dim: 2 dim: 6 dim: 6 }} }} }}
    layer {{ name: "conv" type: "Convolution" bottom: "x" top: "c"
      convolution_param {{ num_output: 3 kernel_size: 3 pad: 1 {FILLERS} }} }}
    layer {{ name: "pool" type: "Pooling" bottom: "c" top: "p" pooling_param {{ pool: AVE kernel_size: 2 stride: 2 }} }}
    layer {{ name: "mpool" type: "Pooling" bottom: "p" top: "q" pooling_param {{ pool: MAX kernel_size: 2 stride: 2 pad: 1 }} }}
    layer {{ name: "ip" type: "InnerProduct" bottom: "q" top: "y" inner_product_param {{ num_output: 5 {FILLERS} }} }}
    """
    net = Net(text, phase=TRAIN, dtype="float64")
    net.forward()
    assert net.blobs["c"].data.shape == (0, 3, 6, 6)
    assert net.blobs["p"].data.shape == (0, 3, 3, 3)
    assert net.blobs["q"].data.shape == (0, 3, 2, 2)
    assert net.blobs["y"].data.shape == (0, 5)
    for name in ("conv", "ip"):
        for p in net.params[name]:
            p.diff[...] = 3.0
    net.backward()
    assert net.blobs["x"].diff.shape == (0, 2, 6, 6)
    for name in ("conv", "ip"):  # a sum over no sample
        for p in net.params[name]:
            np.testing.assert_array_equal(p.diff, 0.0)


def test_the_core_nets_input_reshape_is_sized_against_memory_first():
    """purine.caffe.Net (not only pycaffe's) refuses an input shape that cannot fit, and an
    axis past Caffe's int, before making the blob's zero array."""
    net = ('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 } } }'
           'layer { name: "r" type: "ReLU" bottom: "x" top: "y" }')
    with Net(net, phase=TEST) as n:
        with pytest.raises(PurineError, match=r"^blob 'x' reshape\(2147483647, 3, 227, 227\) "
                                              r"\(float32\) asks for [\d.]+ PiB; "):
            n.blobs["x"].reshape(2 ** 31 - 1, 3, 227, 227)
        with pytest.raises(PurineError, match=r"axis past 2\^31-1"):
            n.blobs["x"].reshape(0, 2 ** 31)
        n.blobs["x"].reshape(2, 3)  # still usable afterwards
        n.blobs["x"].data[...] = [[-1, 2, -3], [4, -5, 6]]
        assert n.forward()["y"].tolist() == [[0, 2, 0], [4, 0, 6]]
