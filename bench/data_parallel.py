"""Images/s of synchronous data-parallel training with 1, 2 and 4 CPU replicas, and the
parallel efficiency (images/s with N replicas / (N x images/s with one)).

    python bench/data_parallel.py [--net lenet|cifar10_quick] [--iterations N]

Each replica takes the net's own batch (LeNet 64, CIFAR-10 quick 100) from an LMDB of
embedded MNIST digits (LeNet) or synthetic 32x32 images (CIFAR-10 quick); one iteration is
every replica's forward and backward, the all-reduce and the update. On a machine with C
cores and a multi-threaded BLAS, replicas compete for the same cores, so efficiency
measures what the dispatcher's overlap recovers rather than added hardware.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from purine.caffe.solver import read_solver  # noqa: E402
from purine.datasets.mnist import load_mnist_5k, write_mnist_lmdb  # noqa: E402
from purine.formats.prototxt import read_net  # noqa: E402
from purine.parallel import build_solver  # noqa: E402
from purine.zoo import model_file  # noqa: E402

NETS = {"lenet": ("lenet/lenet_train_test.prototxt", "lenet/lenet_solver.prototxt"),
        "cifar10_quick": ("cifar10_quick/cifar10_quick_train_test.prototxt",
                          "cifar10_quick/cifar10_quick_solver.prototxt")}


def database(name: str, tmp: str) -> str:
    path = os.path.join(tmp, name)
    if name == "lenet":
        images, labels = load_mnist_5k()
        write_mnist_lmdb(path, images, labels)
    else:
        from purine.converters.convert_imageset import write_images

        rng = np.random.default_rng(0)
        records = ((f"{i:08d}", rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), i % 10)
                   for i in range(2000))
        write_images(path, records, total=2000)
    return path


def solver(name: str, db: str):
    net_file, solver_file = NETS[name]
    net = read_net(model_file(net_file))
    for layer in net.layer:
        if layer.type == "Data":
            layer.data_param.source = db
            layer.transform_param.ClearField("mean_file")
    return bench_solver(solver_file, net)


def bench_solver(solver_file: str, net):
    """The zoo's ``solver_file`` training ``net``: no tests, displays or snapshots, seed 1."""
    s = read_solver(model_file(solver_file))
    s.ClearField("net")
    s.net_param.CopyFrom(net)
    del s.test_iter[:]
    s.test_interval = s.display = s.snapshot = 0
    s.random_seed = 1
    return s


def images_per_s(param, replicas: int, iterations: int) -> float:
    s = build_solver(param, replicas=replicas)
    batch = next(l.data_param.batch_size for l in param.net_param.layer if l.type == "Data"
                 and (not l.include or l.include[0].phase == 0))
    s.step(2)
    t0 = time.perf_counter()
    s.step(iterations)
    return iterations * batch * replicas / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="lenet", choices=sorted(NETS))
    ap.add_argument("--iterations", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        param = solver(args.net, database(args.net, tmp))
        base = None
        print(f"{os.cpu_count()} CPUs, {args.net}, {args.iterations} iterations")
        for n in (1, 2, 4):
            rate = images_per_s(param, n, args.iterations)
            base = base or rate
            print(f"{n} replica(s): {rate:8.0f} images/s, efficiency {rate / (n * base):.2f}, "
                  f"speed-up {rate / base:.2f}")


if __name__ == "__main__":
    main()
