"""The README's AlexNet path, end to end on real images: JPEG/PNG folder + list file ->
convert_imageset (256x256, shuffled) -> compute_image_mean -> purine-caffe train with
models/bvlc_alexnet's own prototxts (only paths, batch sizes and iteration counts moved),
for a few iterations on 227x227 crops, with a falling loss."""

import re
import subprocess
import sys

import numpy as np

from purine.datasets.mnist import load_mnist_5k, write_mnist_list
from purine.zoo import model_file


def cli(*args):
    r = subprocess.run([sys.executable, "-m", "purine.cli", *args], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stderr


def alexnet_files(tmp_path, db, mean, *, batch: int, iters: int, test_iter: int,
                  test_interval: int) -> None:
    """tmp_path/train_val.prototxt and tmp_path/solver.prototxt: models/bvlc_alexnet's own,
    with only the paths (``db`` for both phases), batch sizes and iteration counts moved;
    a display line every iteration, seeded, no snapshot at the end."""
    net = open(model_file("bvlc_alexnet/train_val.prototxt")).read()
    net = net.replace("examples/imagenet/ilsvrc12_train_lmdb", str(db))
    net = net.replace("examples/imagenet/ilsvrc12_val_lmdb", str(db))
    net = net.replace("data/ilsvrc12/imagenet_mean.binaryproto", str(mean))
    net = net.replace("batch_size: 256", f"batch_size: {batch}").replace(
        "batch_size: 50", f"batch_size: {batch}")
    (tmp_path / "train_val.prototxt").write_text(net)
    solver = open(model_file("bvlc_alexnet/solver.prototxt")).read()
    solver = re.sub(r'net: ".*"', f'net: "{tmp_path}/train_val.prototxt"', solver)
    solver = re.sub(r"max_iter: \d+", f"max_iter: {iters}", solver)
    solver = re.sub(r"display: \d+", "display: 1", solver)
    solver = re.sub(r"test_iter: \d+", f"test_iter: {test_iter}", solver)
    solver = re.sub(r"test_interval: \d+", f"test_interval: {test_interval}", solver)
    solver = re.sub(r'snapshot_prefix: ".*"', f'snapshot_prefix: "{tmp_path}/alexnet"', solver)
    solver += "snapshot_after_train: false\nrandom_seed: 1\n"
    (tmp_path / "solver.prototxt").write_text(solver)


def test_alexnet_pipeline_trains_with_a_falling_loss(tmp_path):
    images, labels = load_mnist_5k()
    pick = np.random.default_rng(0).choice(len(labels), 240, replace=False)
    folder = tmp_path / "images"
    listfile = write_mnist_list(folder, images[pick], labels[pick])
    db = tmp_path / "ilsvrc12_train_lmdb"
    mean = tmp_path / "imagenet_mean.binaryproto"
    cli("convert_imageset", "--resize_height=256", "--resize_width=256", "--shuffle",
        f"{folder}/", str(listfile), str(db))
    log = cli("compute_image_mean", str(db), str(mean))
    assert mean.exists() and "channel" in log.lower()

    alexnet_files(tmp_path, db, mean, batch=12, iters=12, test_iter=2, test_interval=12)

    log = cli("train", "--solver", str(tmp_path / "solver.prototxt"))
    assert "output data size: 12,3,227,227" in log
    losses = [float(x) for x in re.findall(r"Iteration \d+ \(.*\), loss = ([\d.e+-]+)", log)]
    assert len(losses) == 12
    assert abs(losses[0] - np.log(1000)) < 0.5  # chance level over 1000 classes
    assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
    assert re.search(r"Test net output #0: accuracy = [\d.]+", log)
