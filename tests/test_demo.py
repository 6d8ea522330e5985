"""The README's first command: LeNet trained on the embedded MNIST digits, offline; and
``demo --data-only``, which writes the LMDBs models/lenet reads and nothing else."""

import re
import subprocess
import sys

import lmdb

from purine.formats import caffe_pb2 as pb


def demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "purine.cli", "demo", *args],
                          capture_output=True, text=True, timeout=300)


def records(path) -> tuple[int, pb.Datum]:
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            datum = pb.Datum.FromString(txn.get(b"00000000"))
            return txn.stat()["entries"], datum
    finally:
        env.close()


def test_demo_trains_lenet_to_a_useful_accuracy(tmp_path):
    r = demo("--dir", str(tmp_path), "--iterations", "200")
    assert r.returncode == 0, r.stderr
    accuracy = [float(a) for a in re.findall(r"Test net output #0: accuracy = ([\d.]+)",
                                             r.stderr)]
    assert len(accuracy) == 5  # at 0, 50, 100, 150, 200
    assert accuracy[0] < 0.3 and accuracy[-1] > 0.85, accuracy
    assert (tmp_path / "mnist_train_lmdb" / "data.mdb").exists()
    assert (tmp_path / "lenet_iter_200.caffemodel").exists()
    # the last line says where the files are
    last = r.stderr.strip().splitlines()[-1]
    assert last.split("] ", 1)[1] == (
        f"Demo files: the LMDBs {tmp_path / 'mnist_train_lmdb'} and "
        f"{tmp_path / 'mnist_test_lmdb'}, the final snapshot "
        f"{tmp_path / 'lenet_iter_200.caffemodel'} (and .solverstate)")
    assert (tmp_path / "lenet_iter_200.solverstate").exists()


def test_data_only_writes_the_two_lmdbs_and_trains_nothing(tmp_path):
    out = tmp_path / "mnist"
    r = demo("--data-only", "--dir", str(out))
    assert r.returncode == 0, r.stderr
    n_train, datum = records(out / "mnist_train_lmdb")
    n_test, _ = records(out / "mnist_test_lmdb")
    assert (n_train, n_test) == (4000, 1000)
    assert (datum.channels, datum.height, datum.width, len(datum.data)) == (1, 28, 28, 784)
    assert sorted(p.name for p in out.iterdir()) == ["mnist_test_lmdb", "mnist_train_lmdb"]
    assert "Iteration" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.endswith(f"Demo data: the LMDBs {out / 'mnist_train_lmdb'} and "
                         f"{out / 'mnist_test_lmdb'}")
    # a second run keeps what is there and still names it
    r = demo("--data-only", "--dir", str(out))
    assert r.returncode == 0 and "Writing" not in r.stderr
    assert records(out / "mnist_train_lmdb")[0] == 4000
