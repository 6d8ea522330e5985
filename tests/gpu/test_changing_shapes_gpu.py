"""Shapes that change at every pass on a GPU: a Python data layer cycling image sizes, a
convolution, a Filter whose count follows the data (a ReLU's zeros) and a Python layer in the middle, trained
by a solver on the GPU, equal the same training on the CPU step by step (float64). The
Python layers compute on the host (their bottoms are copied there to settle their shapes),
Filter's count is read back from the device. With PURINE_GPU_STAND_IN=cpu the 'GPU' side is
the CPU: the test's own logic is checked, not a GPU."""

import numpy as np

from purine.backend import to_host
from purine.caffe.solver import Solver
from purine.graph import CPU
from tests.gpu.common import TABLE_LOCATION, requires_gpu_or_stand_in

LAYERS = '''
import numpy as np

import caffe

SIZES = [(6, 8), (8, 5), (7, 7)]


class Images(caffe.Layer):
    """Item k: a (1, 2, H, W) image of SIZES[k % 3], loaded in reshape as FCN's layers do."""

    def setup(self, bottom, top):
        self.k = 0

    def reshape(self, bottom, top):
        h, w = SIZES[self.k % 3]
        rng = np.random.default_rng(self.k)
        self.image = rng.standard_normal((1, 2, h, w))
        self.target = rng.standard_normal((1, 3))
        top[0].reshape(*self.image.shape)
        top[1].reshape(*self.target.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.image
        top[1].data[...] = self.target
        self.k += 1

    def backward(self, top, propagate_down, bottom):
        pass


class Rows(caffe.Layer):
    """(1, C, H, W) -> (H*W, C): one row per pixel; the row count follows the image."""

    def reshape(self, bottom, top):
        n, c, h, w = bottom[0].data.shape
        top[0].reshape(h * w, c)

    def forward(self, bottom, top):
        x = bottom[0].data
        top[0].data[...] = x[0].reshape(x.shape[1], -1).T

    def backward(self, top, propagate_down, bottom):
        n, c, h, w = bottom[0].data.shape
        bottom[0].diff[...] = top[0].diff.T.reshape(1, c, h, w)
'''

NET = '''name: "shapes"
layer { name: "data" type: "Python" top: "data" top: "target"
  python_param { module: "gpu_shape_layers" layer: "Images" } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 3 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.4 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "rows" type: "Python" bottom: "conv" top: "rows"
  python_param { module: "gpu_shape_layers" layer: "Rows" } }
layer { name: "slice" type: "Slice" bottom: "rows" top: "first" top: "rest"
  slice_param { axis: 1 slice_point: 1 } }
layer { name: "gate" type: "ReLU" bottom: "first" top: "gate" }
layer { name: "keep" type: "Filter" bottom: "rest" bottom: "gate" top: "kept"
  propagate_down: true propagate_down: false }
layer { name: "ip" type: "InnerProduct" bottom: "kept" top: "p" inner_product_param {
  num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "Reduction" bottom: "p" top: "loss" loss_weight: 1
  reduction_param { operation: SUMSQ coeff: 0.1 } }
layer { name: "silence" type: "Silence" bottom: "target" }
'''


def solver_text() -> str:
    net = NET.replace("\n", " ")
    return (f"net_param {{ {net} }}\nbase_lr: 0.05\nmomentum: 0.9\nlr_policy: \"fixed\"\n"
            "max_iter: 100\nrandom_seed: 3\n")


def steps(location, n: int) -> list[tuple[float, np.ndarray]]:
    out = []
    with Solver(solver_text(), dtype="float64", location=location) as s:
        for _ in range(n):
            s.step(1)
            out.append((float(s.net.blobs["loss"].data.sum()),
                        to_host(s.net.params["conv"][0].data).copy()))
        builds = len(s.net.builds())
    return out, builds


@requires_gpu_or_stand_in
def test_a_net_changing_shapes_trains_on_the_gpu_as_on_the_cpu(tmp_path, monkeypatch):
    import purine.pycaffe  # noqa: F401  (the layers' `import caffe`)

    (tmp_path / "gpu_shape_layers.py").write_text(LAYERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    cpu, cpu_builds = steps(CPU, 6)
    gpu, gpu_builds = steps(TABLE_LOCATION, 6)
    assert cpu_builds == gpu_builds > 3  # the image sizes and Filter's counts changed
    for k, ((pc, wc), (pg, wg)) in enumerate(zip(cpu, gpu, strict=True)):
        assert abs(pg - pc) <= 1e-9 * max(1.0, abs(pc)), (k, pg, pc)
        np.testing.assert_allclose(wg, wc, rtol=1e-9, atol=1e-12, err_msg=f"step {k}")
    assert len({p for p, _ in cpu}) == len(cpu)  # every step its own loss
