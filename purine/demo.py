"""``purine-caffe demo``: train Caffe's LeNet on the embedded MNIST digits, offline. The
LMDBs are written by convert_imageset's writer, the nets and solver are models/lenet's
own files with only the data sources, the iteration counts and the snapshot prefix moved."""

from __future__ import annotations

import os

from purine.caffe import caffe_pb2 as pb
from purine.caffe.prototxt import read_net
from purine.caffe.solver import Solver, read_solver
from purine.datasets.mnist import split_mnist_5k, write_mnist_lmdb
from purine.log import get_logger
from purine.zoo import model_file


def run_demo(workdir: str, *, max_iter: int = 1000, test_images: int = 1000,
             threads: int = 1) -> dict[str, float]:
    """Write the LMDBs under ``workdir``, train, and return the last test outputs."""
    log = get_logger()
    os.makedirs(workdir, exist_ok=True)
    train_x, train_y, test_x, test_y = split_mnist_5k(n_test=test_images)
    train_db = os.path.join(workdir, "mnist_train_lmdb")
    test_db = os.path.join(workdir, "mnist_test_lmdb")
    for db, x, y in ((train_db, train_x, train_y), (test_db, test_x, test_y)):
        if not os.path.exists(db):
            log.info("Writing %d digits to %s", len(y), db)
            write_mnist_lmdb(db, x, y)

    net = read_net(model_file("lenet/lenet_train_test.prototxt"))
    for layer in net.layer:
        if layer.type == "Data":
            train = any(r.phase == pb.TRAIN for r in layer.include)
            layer.data_param.source = train_db if train else test_db
    solver = read_solver(model_file("lenet/lenet_solver.prototxt"))
    solver.ClearField("net")
    solver.net_param.CopyFrom(net)
    test_batch = next(l.data_param.batch_size for l in net.layer
                      if l.type == "Data" and any(r.phase == pb.TEST for r in l.include))
    del solver.test_iter[:]
    solver.test_iter.append(max(1, len(test_y) // test_batch))
    solver.max_iter = max_iter
    solver.test_interval = max(1, max_iter // 4)
    solver.snapshot = 0
    solver.snapshot_prefix = os.path.join(workdir, "lenet")
    solver.random_seed = 1  # the same run, and the same accuracy, every time
    with Solver(solver, path=os.path.join(workdir, "lenet_solver.prototxt"),
                threads=threads) as s:
        s.solve()
    return {k: float(v) for k, v in s.last_test[0].items()}
