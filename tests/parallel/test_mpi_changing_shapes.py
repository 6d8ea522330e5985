"""Data parallelism over MPI ranks with shapes that change at every pass: each rank's Python
data layer serves images of its own sizes, each rank's net goes on in its build for them,
and the all-reduce over the parameters (whose shapes never change) averages the gradients.
Two ranks equal one process whose iter_size 2 passes take rank 0's item, then rank 1's."""

import os

import numpy as np
import pytest

from purine.caffe import TRAIN, Net
from purine.caffe.solver import Solver
from tests.parallel.test_mpi import launch, launcher  # noqa: F401  (a fixture)

LAYER = '''
import json
import os

import numpy as np

import caffe

SIZES = [[(9, 12), (12, 10), (11, 11)], [(10, 8), (9, 12), (13, 9)]]


class RankImages(caffe.Layer):
    """Item k of rank r: an image of SIZES[r][k % 3] and a per-pixel label. param_str
    "rank": this MPI rank's items; "alternate": rank 0's item k, then rank 1's, ..."""

    def setup(self, bottom, top):
        self.mode = json.loads(self.param_str)["mode"]
        self.k = 0

    def item(self):
        if self.mode == "rank":
            r, k = int(os.environ.get("PMI_RANK", "0")), self.k
        else:
            r, k = self.k % 2, self.k // 2
        h, w = SIZES[r][k % 3]
        rng = np.random.default_rng([r, k])
        return rng.standard_normal((1, 2, h, w)), rng.integers(0, 3, (1, 1, h, w))

    def reshape(self, bottom, top):
        self.image, self.label = self.item()
        top[0].reshape(*self.image.shape)
        top[1].reshape(*self.label.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.image
        top[1].data[...] = self.label
        self.k += 1

    def backward(self, top, propagate_down, bottom):
        pass
'''

NET = '''name: "fcn"
layer { name: "data" type: "Python" top: "data" top: "label"
  python_param { module: "rank_images" layer: "RankImages" param_str: '{"mode": "MODE"}' } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "score" type: "Convolution" bottom: "conv" top: "score"
  convolution_param { num_output: 3 kernel_size: 1
    weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss" }
'''


def solver_text(mode: str, iter_size: int, prefix: str) -> str:
    net = NET.replace("MODE", mode).replace("\n", " ")
    return (f"net_param {{ {net} }}\nbase_lr: 0.1\nmomentum: 0.9\nweight_decay: 0.001\n"
            f'lr_policy: "fixed"\nmax_iter: 6\nrandom_seed: 7\niter_size: {iter_size}\n'
            f'display: 1\nsnapshot_prefix: "{prefix}"\n')


def test_two_ranks_each_at_its_own_sizes_equal_one_process_averaging_both(launcher,  # noqa: F811
                                                                           tmp_path,
                                                                           monkeypatch):
    (tmp_path / "rank_images.py").write_text(LAYER)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(solver_text("rank", 1, str(tmp_path / "mpi")))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))  # where the ranks find the layer
    run, logs = launch(launcher, tmp_path, 2, "--solver", str(solver))
    assert run.returncode == 0, (run.stdout, run.stderr, logs)
    assert "Optimization Done." in logs[0]

    monkeypatch.syspath_prepend(str(tmp_path))
    with Solver(solver_text("alternate", 2, str(tmp_path / "ref"))) as reference:
        reference.step(6)
        assert len(reference.net.builds()) >= 4  # the sizes of both ranks went through
        net = Net(NET.replace("MODE", "rank"), phase=TRAIN)
        net.copy_from(str(tmp_path / "mpi_iter_6.caffemodel"))
        for layer, views in reference.net.params.items():
            for k, v in enumerate(views):
                np.testing.assert_allclose(net.params[layer][k].data, v.data, rtol=1e-4,
                                           atol=1e-5, err_msg=f"{layer}[{k}]")
        # and training moved them: the first snapshot's weights are not the initial ones
        start = Solver(solver_text("alternate", 2, str(tmp_path / "start")))
        assert not np.allclose(start.net.params["conv"][0].data,
                               reference.net.params["conv"][0].data)
        start.close()


@pytest.fixture(autouse=True)
def _no_caffe_module(monkeypatch):
    """The layer module imports ``caffe``: purine's face, for this process's solvers."""
    import purine.pycaffe  # noqa: F401  (installs itself as `caffe` for Python layers)
