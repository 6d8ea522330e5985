"""GPUs across MPI ranks on real GPUs: `mpiexec -n 2 purine-caffe train --gpu local` (one GPU
per rank) and 2 ranks x 2 GPUs give the weights of the CPU run with as many replicas in all
(to 1e-4: float32 on another device); two ranks on one GPU are refused before iteration 0.
The bootstrap and the graph are checked without a GPU in tests/parallel/test_mpi_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from purine.backend import gpu_count
from purine.parallel import build_solver
from tests.gpu.common import requires_gpu
from tests.parallel import test_mpi
from tests.parallel.test_data_parallel import lenet_solver
from tests.parallel.test_mpi import BATCH, load, write_solver
from tests.parallel.test_mpi_gpu import launch

launcher, mnist_db = test_mpi.launcher, test_mpi.mnist_db  # the fixtures, shared


@pytest.fixture
def nccl_loads():
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.skip("CuPy cannot load NCCL: pip install nvidia-nccl-cu13 (or cu12)")


def needs_gpus(n: int) -> None:
    have = gpu_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs, this machine has {have}: NCCL puts each rank of a "
                    "communicator on its own GPU")


def assert_close_weights(model: str, db: str, replicas: int) -> None:
    reference = build_solver(lenet_solver(db, BATCH, 10), replicas=replicas)
    reference.step(10)
    got = load(model, db)
    for layer, views in reference.net.params.items():
        for k, v in enumerate(views):
            np.testing.assert_allclose(got.params[layer][k].data, v.data, rtol=1e-4,
                                       atol=1e-4 * np.abs(v.data).max(),
                                       err_msg=f"{layer}[{k}]")


@requires_gpu
def test_two_ranks_of_one_gpu_each_train_as_two_cpu_replicas(launcher, nccl_loads, tmp_path,
                                                              mnist_db):
    needs_gpus(2)
    prefix = str(tmp_path / "lenet")
    rc, logs = launch(launcher, tmp_path, 2, 0, "--solver",
                      write_solver(tmp_path, mnist_db, 10, prefix), "--gpu", "local")
    assert rc == 0, logs
    assert "MPI: 2 ranks x 1 replicas (2 replicas in all)" in logs[0]
    assert_close_weights(f"{prefix}_iter_10.caffemodel", mnist_db, 2)


@requires_gpu
def test_two_ranks_of_two_gpus_train_as_four_cpu_replicas(launcher, nccl_loads, tmp_path,
                                                           mnist_db):
    needs_gpus(4)
    prefix = str(tmp_path / "lenet")
    rc, logs = launch(launcher, tmp_path, 2, 2, "--solver",
                      write_solver(tmp_path, mnist_db, 10, prefix), "--gpu", "0,1")
    assert rc == 0, logs
    assert "MPI: 2 ranks x 2 replicas (4 replicas in all)" in logs[0]
    assert_close_weights(f"{prefix}_iter_10.caffemodel", mnist_db, 4)


@requires_gpu
def test_two_ranks_on_one_gpu_are_refused_before_training(launcher, nccl_loads, tmp_path,
                                                          mnist_db):
    prefix = str(tmp_path / "lenet")
    rc, logs = launch(launcher, tmp_path, 2, 0, "--solver",
                      write_solver(tmp_path, mnist_db, 10, prefix), "--gpu", "0")
    assert rc != 0
    said = [line for log in logs for line in log.splitlines() if "cannot share a GPU" in line]
    assert said and all(line.endswith("is local GPU 0 of rank 0 and GPU 0 of rank 1; give "
                                      "each rank its own (--gpu local)") for line in said), logs
    assert not any("Iteration 0" in log for log in logs)
