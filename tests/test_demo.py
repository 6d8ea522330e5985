"""The README's first command: LeNet trained on the embedded MNIST digits, offline."""

import re
import subprocess
import sys


def test_demo_trains_lenet_to_a_useful_accuracy(tmp_path):
    r = subprocess.run([sys.executable, "-m", "purine.cli", "demo", "--dir", str(tmp_path),
                        "--iterations", "200"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    accuracy = [float(a) for a in re.findall(r"Test net output #0: accuracy = ([\d.]+)",
                                             r.stderr)]
    assert len(accuracy) == 5  # at 0, 50, 100, 150, 200
    assert accuracy[0] < 0.3 and accuracy[-1] > 0.85, accuracy
    assert (tmp_path / "mnist_train_lmdb" / "data.mdb").exists()
    assert (tmp_path / "lenet_iter_200.caffemodel").exists()
