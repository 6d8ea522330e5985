"""Model parallelism on GPUs: two-tower AlexNet with its towers on GPU 0 and GPU 1, and
the hybrid with one replica per GPU (convolutions data-parallel, fc6 split over the GPUs;
a replica on GPU 1 reads the convolution weights through a Copy op), each against the
unsplit net trained on the CPU from the same weights (to 1e-4: float32 on other devices).
The same graphs are checked on two CPU memory spaces in tests/parallel."""

from __future__ import annotations

import numpy as np
import pytest

from purine.backend import gpu_count
from purine.caffe.solver import Solver
from purine.graph import Location
from purine.parallel import build_solver
from tests.gpu.common import requires_gpu
from tests.parallel.test_placement_training import (  # noqa: F401 -- image_db: a fixture
    PLACEMENT,
    alexnet_solver,
    image_db,
    per_replica_and_whole,
)

G0, G1 = Location("gpu", 0), Location("gpu", 1)


def needs_two_gpus() -> None:
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {gpu_count()}: each tower or replica "
                    "is on a GPU of its own")


def trained_like(plain: Solver, placed: Solver, iters: int = 4) -> None:
    split = placed.scheme.split_of(placed.net)
    split.load(placed.net, {n: [v.data for v in views] for n, views in plain.net.params.items()})
    plain.step(iters)
    placed.step(iters)
    got = split.params(placed.net)
    for layer, views in plain.net.params.items():
        for k, v in enumerate(views):
            np.testing.assert_allclose(np.asarray(got[layer][k]), v.data, rtol=1e-4,
                                       atol=1e-4 * np.abs(v.data).max(),
                                       err_msg=f"{layer}[{k}]")


@requires_gpu
def test_two_towers_on_two_gpus_train_as_the_unsplit_net(image_db, tmp_path):  # noqa: F811
    needs_two_gpus()
    param = alexnet_solver(image_db)
    gpus = tmp_path / "gpus.placement"
    gpus.write_text(PLACEMENT.read_text().replace('"cpu:0"', '"gpu:0"')
                    .replace('"cpu:1"', '"gpu:1"'))
    trained_like(Solver(param), build_solver(param, placement=gpus, location=G0))


@requires_gpu
def test_the_hybrid_with_a_replica_per_gpu_equals_the_whole_batch(image_db, tmp_path):  # noqa: F811
    needs_two_gpus()
    param, whole = per_replica_and_whole(image_db, 2)
    hybrid = tmp_path / "hybrid.placement"
    hybrid.write_text('layer { name: "fc6" location: "replicas" }\n'
                      'layer { name: "relu6" location: "replicas" }\n')
    trained_like(Solver(whole), build_solver(param, replicas=2, placement=hybrid,
                                             location=G0, replica_locations=[G1]))
