"""AlexNet trained by `purine-caffe train --gpu 0` with models/bvlc_alexnet's own prototxts
(only paths, batch sizes and iteration counts moved) on generated images, against the same
command on the CPU: the losses of the first iterations agree within float32 rounding."""

import re
import subprocess
import sys

import numpy as np

from purine.datasets.mnist import load_mnist_5k, write_mnist_list
from tests.gpu.common import requires_gpu
from tests.test_alexnet_pipeline import alexnet_files

ITERS = 6


def cli(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "purine.cli", *args], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stderr


def losses(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"Iteration \d+ \(.*\), loss = ([\d.e+-]+)", log)]


@requires_gpu
def test_alexnet_trains_on_the_gpu_as_on_the_cpu(tmp_path):
    images, labels = load_mnist_5k()
    pick = np.random.default_rng(0).choice(len(labels), 128, replace=False)
    listfile = write_mnist_list(tmp_path / "images", images[pick], labels[pick])
    db, mean = tmp_path / "train_lmdb", tmp_path / "mean.binaryproto"
    cli("convert_imageset", "--resize_height=256", "--resize_width=256", "--shuffle",
        f"{tmp_path / 'images'}/", str(listfile), str(db))
    cli("compute_image_mean", str(db), str(mean))
    alexnet_files(tmp_path, db, mean, batch=32, iters=ITERS, test_iter=1, test_interval=1000)

    cpu = losses(cli("train", "--solver", str(tmp_path / "solver.prototxt")))
    gpu_log = cli("train", "--solver", str(tmp_path / "solver.prototxt"), "--gpu", "0")
    gpu = losses(gpu_log)
    print("AlexNet b32 losses, cpu:", cpu, "gpu:", gpu)
    assert len(cpu) == len(gpu) == ITERS
    assert abs(cpu[0] - np.log(1000)) < 0.5  # chance level over 1000 classes
    # the same weights, data, crops, mirrors and Dropout masks: float32 rounding apart
    np.testing.assert_allclose(gpu[0], cpu[0], rtol=1e-5)
    np.testing.assert_allclose(gpu, cpu, rtol=1e-3)
