"""``purine-caffe demo``: Caffe's LeNet on the embedded MNIST digits, offline: LMDBs written by
convert_imageset's writer (``--data-only`` stops there), then models/lenet's own net and solver
with only the data sources, the iteration counts and the snapshot prefix moved."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from purine.caffe.solver import Solver, read_solver
from purine.datasets.mnist import split_mnist_5k, write_mnist_lmdb
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net
from purine.log import get_logger
from purine.zoo import model_file


@dataclass
class DemoRun:
    train_db: str
    test_db: str
    snapshot: str | None = None  # the final .caffemodel; None when only the data was written
    scores: dict[str, float] = field(default_factory=dict)  # the last test outputs


def write_demo_data(workdir: str, test_images: int = 1000) -> tuple[str, str]:
    """The training and test LMDBs under ``workdir`` (kept when already there)."""
    log = get_logger()
    os.makedirs(workdir, exist_ok=True)
    train_x, train_y, test_x, test_y = split_mnist_5k(n_test=test_images)
    train_db = os.path.join(workdir, "mnist_train_lmdb")
    test_db = os.path.join(workdir, "mnist_test_lmdb")
    for db, x, y in ((train_db, train_x, train_y), (test_db, test_x, test_y)):
        if not os.path.exists(db):
            log.info("Writing %d digits to %s", len(y), db)
            write_mnist_lmdb(db, x, y)
    return train_db, test_db


def run_demo(workdir: str, *, max_iter: int = 1000, test_images: int = 1000,
             threads: int = 1, data_only: bool = False) -> DemoRun:
    """Write the LMDBs under ``workdir``, train unless ``data_only``, and log as the last
    line where the files are."""
    log = get_logger()
    train_db, test_db = write_demo_data(workdir, test_images)
    if data_only:
        log.info("Demo data: the LMDBs %s and %s", train_db, test_db)
        return DemoRun(train_db, test_db)

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
    solver.test_iter.append(max(1, test_images // test_batch))
    solver.max_iter = max_iter
    solver.test_interval = max(1, max_iter // 4)
    solver.snapshot = 0
    solver.snapshot_prefix = os.path.join(workdir, "lenet")
    solver.random_seed = 1  # the same run, and the same accuracy, every time
    with Solver(solver, path=os.path.join(workdir, "lenet_solver.prototxt"),
                threads=threads) as s:
        s.solve()
        snapshot = f"{solver.snapshot_prefix}_iter_{s.iter}.caffemodel"  # snapshot_after_train
    run = DemoRun(train_db, test_db, snapshot, {k: float(v) for k, v in s.last_test[0].items()})
    summary = ", ".join(f"{k} = {v:.4f}" for k, v in run.scores.items())
    log.info("Demo finished: LeNet on %s: %s", workdir, summary)
    log.info("Demo files: the LMDBs %s and %s, the final snapshot %s (and .solverstate)",
             train_db, test_db, snapshot)
    return run
