"""pycaffe's GPU mode: set_mode_gpu and set_device place the nets and solvers made afterwards
on that GPU; without a usable GPU set_mode_gpu warns why and they run on the CPU."""

import warnings

import numpy as np
import pytest

import purine.pycaffe as caffe
from purine.backend import gpu_unavailable
from purine.caffe import net as caffe_net
from purine.caffe import solver as caffe_solver
from purine.graph import CPU, Location
from purine.pycaffe import mode

NET = ('layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } } '
       'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { '
       'num_output: 2 weight_filler { type: "gaussian" std: 1 } } }')
REASON = "CuPy is not installed (pip install 'purine-caffe[gpu]')"


@pytest.fixture
def clean_settings(monkeypatch):
    for k in ("mode", "device", "seed"):
        monkeypatch.setattr(mode.settings, k, getattr(mode.settings, k))


@pytest.fixture
def no_gpu(monkeypatch, clean_settings):
    monkeypatch.setattr(mode, "gpu_unavailable", lambda: REASON)


@pytest.fixture
def four_gpus(monkeypatch, clean_settings):
    monkeypatch.setattr(mode, "gpu_unavailable", lambda: None)
    monkeypatch.setattr(mode, "gpu_count", lambda: 4)


def test_without_a_gpu_gpu_mode_warns_why_and_runs_on_the_cpu(no_gpu):
    with pytest.warns(RuntimeWarning) as record:
        caffe.set_mode_gpu()
    assert [str(w.message) for w in record] == [
        "purine.pycaffe.set_mode_gpu: no GPU backend available: " + REASON
        + "; nets and solvers run on the CPU"]
    caffe.set_device(3)  # recorded: no GPU to check it against
    net = caffe.Net(NET, caffe.TEST)
    assert net.location == CPU
    assert {op.location.device for op in net.graph.ops} == {"cpu"}
    x = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]], np.float32)
    np.testing.assert_allclose(net.forward(x=x)["y"], x @ net.params["ip"][0].data.T
                               + net.params["ip"][1].data, rtol=1e-6)


@pytest.mark.skipif(gpu_unavailable() is None, reason="this machine has a GPU: the warning "
                    "test needs one without (the placement tests run on both)")
def test_the_warning_gives_the_backends_own_reason(clean_settings):
    with pytest.warns(RuntimeWarning, match="no GPU backend available: "
                      + gpu_unavailable().split("(")[0].rstrip()):
        caffe.set_mode_gpu()
    assert mode.location() == CPU


def capture_net_location(monkeypatch) -> list:
    seen = []
    # Record where the net would be built instead of building it (no CuPy needed).
    monkeypatch.setattr(caffe_net.Net, "_build", lambda self, previous=None: seen.append(
        self.location))
    return seen


def test_with_a_gpu_nets_are_built_on_the_chosen_device(four_gpus, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a usable GPU: no warning
        caffe.set_mode_gpu()
    caffe.set_device(2)
    seen = capture_net_location(monkeypatch)
    net = caffe.Net(NET, caffe.TEST)
    assert seen == [Location("gpu", 2)] and net.location == Location("gpu", 2)
    caffe.Net(NET, caffe.TEST, location=CPU)  # an explicit location still wins
    assert seen[-1] == CPU
    caffe.set_mode_cpu()
    caffe.Net(NET, caffe.TEST)
    assert seen[-1] == CPU


def test_with_a_gpu_solvers_are_built_on_the_chosen_device(four_gpus, monkeypatch, tmp_path):
    class Stop(Exception):
        pass

    seen = []

    def fake_init(self, param, **kwargs):
        seen.append(kwargs["location"])
        raise Stop

    monkeypatch.setattr(caffe_solver.Solver, "__init__", fake_init)
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net_param {{ {NET} }} base_lr: 0.1 lr_policy: "fixed"')
    caffe.set_mode_gpu()
    caffe.set_device(1)
    with pytest.raises(Stop):
        caffe.SGDSolver(str(path))
    assert seen == [Location("gpu", 1)]


def test_set_device_checks_the_index_against_the_gpus_present(four_gpus):
    caffe.set_device(3)
    with pytest.raises(ValueError, match=r"set_device: no GPU 4; this machine has 4 "
                                         r"\(indices 0 to 3\)"):
        caffe.set_device(4)
    assert mode.settings.device == 3


@pytest.mark.skipif(gpu_unavailable() is not None, reason=f"needs a GPU: {gpu_unavailable()}")
def test_gpu_mode_gives_the_cpus_answers(clean_settings):
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    want = caffe.Net(NET, caffe.TEST, seed=4).forward(x=x)["y"]
    caffe.set_mode_gpu()
    caffe.set_device(0)
    net = caffe.Net(NET, caffe.TEST, seed=4)
    assert net.location == Location("gpu", 0)
    from purine.backend import to_host

    np.testing.assert_allclose(to_host(net.forward(x=x)["y"]), want, rtol=1e-5)
