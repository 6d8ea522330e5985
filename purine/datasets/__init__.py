"""Small datasets shipped inside the package, so demos and tests run offline: the MNIST
subset (5000 digits) in ``purine.datasets.mnist``."""

from purine.datasets.mnist import (
    load_mnist_5k,
    split_mnist_5k,
    write_mnist_list,
    write_mnist_lmdb,
)

__all__ = ["load_mnist_5k", "split_mnist_5k", "write_mnist_lmdb", "write_mnist_list"]
