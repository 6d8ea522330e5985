"""Caffe's example dataset tools as purine-caffe verbs: convert_mnist_data, convert_cifar_data
and convert_mnist_siamese_data. MNIST IDX files (plain or gzip) and CIFAR-10 binary batches
become LMDBs or LevelDBs whose keys and serialized Datums equal those Caffe's tools write."""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from collections.abc import Callable, Iterator

import numpy as np

from purine.converters import ConvertError, flag, run_main
from purine.converters.convert_imageset import write_datums
from purine.data import db as backends
from purine.data.datum import encode_datums
from purine.formats.files import BINARY_LIMIT, read_bounded
from purine.log import get_logger

IMAGE_MAGIC = 2051  # IDX: unsigned bytes (0x08), 3 dimensions
LABEL_MAGIC = 2049  # IDX: unsigned bytes (0x08), 1 dimension
CIFAR_SIDE = 32
CIFAR_RECORD = 1 + 3 * CIFAR_SIDE * CIFAR_SIDE  # a label byte, then 3 planes (R, G, B)
CIFAR_BATCH = 10000  # records per batch file; train keys step by this per file
CIFAR_TRAIN_FILES = tuple(f"data_batch_{k}.bin" for k in range(1, 6))
CIFAR_TEST_FILE = "test_batch.bin"
# boost::mt19937's default seed: a run without --seed draws what an unseeded generator would.
SIAMESE_SEED = 5489
_GZIP = b"\x1f\x8b"


# -- reading the inputs ---------------------------------------------------------------------
def _read_bytes(path: str) -> tuple[bytes, str]:
    """The file's bytes, gunzipped when it starts with gzip's magic; a missing ``path``
    whose ``path.gz`` exists is read from there (MNIST is downloaded gzipped). Returns
    (bytes, the name used in messages)."""
    if not os.path.exists(path) and os.path.isfile(path + ".gz"):
        path += ".gz"
    try:
        data = read_bounded(path, BINARY_LIMIT, error=ConvertError)
    except ConvertError as e:
        raise ConvertError(f"{path}: cannot open the file: {str(e).rsplit(': ', 1)[-1]}") \
            from None
    if data[:2] == _GZIP:
        # Bounded as the file itself: a small gzip may inflate to any size.
        inflate = zlib.decompressobj(zlib.MAX_WBITS | 16)
        try:
            data = inflate.decompress(data, BINARY_LIMIT + 1)
        except zlib.error as e:
            raise ConvertError(f"{path}: starts as a gzip file but cannot be gunzipped "
                               f"({e}); the download is damaged or truncated") from None
        if len(data) > BINARY_LIMIT:
            raise ConvertError(f"{path}: gunzips to more than {BINARY_LIMIT} bytes; an MNIST "
                               "file is at most 47 MB")
        if not inflate.eof:
            raise ConvertError(f"{path}: starts as a gzip file but cannot be gunzipped "
                               "(it ends before gzip's end-of-stream marker); the download "
                               "is damaged or truncated")
    return data, path


def _header(data: bytes, path: str, words: int) -> list[int]:
    if len(data) < 4 * words:
        raise ConvertError(f"{path}: truncated: {len(data)} bytes, but the IDX header alone "
                           f"is {4 * words} bytes")
    return np.frombuffer(data, ">u4", words).tolist()


def _check_magic(magic: int, expected: int, path: str, what: str) -> None:
    if magic == expected:
        return
    other = {IMAGE_MAGIC: "an image file", LABEL_MAGIC: "a label file"}.get(magic)
    hint = f"; it is {other}: are the image and label arguments swapped?" if other else ""
    raise ConvertError(f"{path}: magic number {magic} (0x{magic:08x}) is not {expected}, "
                       f"that of an MNIST {what} file (IDX unsigned bytes){hint}")


def _check_size(data: bytes, offset: int, expected: int, path: str, what: str) -> None:
    got = len(data) - offset
    if got != expected:
        kind = "truncated" if got < expected else "longer than its header says"
        raise ConvertError(f"{path}: {kind}: the header announces {what} = {expected} bytes "
                           f"after the {offset}-byte header, the file has {got}")


def read_mnist(images: str | os.PathLike, labels: str | os.PathLike
               ) -> tuple[np.ndarray, np.ndarray]:
    """An MNIST image file (IDX magic 2051: count, rows, cols, then the pixels) and its label
    file (magic 2049: count, then one byte per label), plain or gzip; big-endian header words
    as Caffe reads them. Returns uint8 arrays (N, rows, cols) and (N,)."""
    image_bytes, image_path = _read_bytes(os.fspath(images))
    label_bytes, label_path = _read_bytes(os.fspath(labels))
    magic, n, rows, cols = _header(image_bytes, image_path, 4)
    _check_magic(magic, IMAGE_MAGIC, image_path, "image")
    label_magic, n_labels = _header(label_bytes, label_path, 2)
    _check_magic(label_magic, LABEL_MAGIC, label_path, "label")
    if n != n_labels:
        raise ConvertError(f"{image_path} holds {n} images but {label_path} holds {n_labels} "
                           "labels; they must be the same count")
    _check_size(image_bytes, 16, n * rows * cols, image_path,
                f"{n} images x {rows} x {cols}")
    _check_size(label_bytes, 8, n, label_path, f"{n} labels")
    pixels = np.frombuffer(image_bytes, np.uint8, offset=16).reshape(n, rows, cols)
    return pixels, np.frombuffer(label_bytes, np.uint8, offset=8)


def _label(byte: int) -> int:
    """Caffe stores the label byte through a plain ``char``, signed on x86: 128..255 become
    negative labels there, and here too, so the bytes stay equal."""
    return byte - 256 if byte > 127 else byte


def _datums(pixels: np.ndarray, labels: np.ndarray) -> list[bytes]:
    """Raw Datums of uint8 (N, C, H, W) pixels and label bytes, the bytes Caffe's tools
    write: ``encoded`` is never set (they leave it unset, so it is not in their bytes)."""
    return encode_datums(pixels, [_label(b) for b in labels.tolist()])


def _check_new(db: str) -> None:
    """Caffe's db::NEW refuses an existing database; refused here before any input is read."""
    if os.path.lexists(db):
        raise ConvertError(f"{db}: already exists; remove it or choose another name "
                           "(Caffe's tools never write into an existing database)")


# -- convert_mnist_data ---------------------------------------------------------------------
def _read_logged(images: str | os.PathLike, labels: str | os.PathLike, log
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``read_mnist``, logging the counts as Caffe's MNIST tools do."""
    pixels, labels_ = read_mnist(images, labels)
    log.info("A total of %d items.", len(pixels))
    log.info("Rows: %d Cols: %d", pixels.shape[1], pixels.shape[2])
    return pixels, labels_


def convert_mnist_data(images: str | os.PathLike, labels: str | os.PathLike,
                       db: str | os.PathLike, *, backend: str = "lmdb", log=None) -> int:
    """Caffe's convert_mnist_data: each image becomes a Datum (1 x rows x cols uint8, its
    label) under the key ``%08d`` (its index) in a new ``backend`` database ``db``,
    committed every 1000 records. Returns the record count."""
    log = log or get_logger()
    backends.require(backend, ConvertError)
    _check_new(os.fspath(db))
    pixels, labels_ = _read_logged(images, labels, log)
    n, rows, cols = pixels.shape

    def records() -> Iterator[tuple[str, bytes]]:
        for start in range(0, n, 1000):  # encoded a thousand at a time, not all at once
            stop = min(n, start + 1000)
            batch = _datums(pixels[start:stop, None], labels_[start:stop])
            yield from ((f"{start + k:08d}", value) for k, value in enumerate(batch))

    return write_datums(db, records(), total=n, log=log, backend=backend)


# -- convert_mnist_siamese_data -------------------------------------------------------------
def _check_seed(seed: int) -> None:
    if not 0 <= seed < 2**32:
        raise ConvertError(f"--seed {seed}: boost::mt19937 takes a seed in [0, 2^32 - 1]")


def mt19937_draws(seed: int, count: int) -> np.ndarray:
    """The first ``count`` outputs (uint32 as uint64) of boost::mt19937 seeded with ``seed``
    (Caffe's caffe_rng_rand): numpy's MT19937 after RandomState's 32-bit seeding, which is
    the same init_genrand as boost's seed(value)."""
    _check_seed(seed)
    state = np.random.RandomState(seed).get_state(legacy=False)
    generator = np.random.MT19937()
    generator.state = state
    return generator.random_raw(count)


def siamese_pairs(labels: np.ndarray, seed: int = SIAMESE_SEED
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Caffe's draw: for record k, ``i = rand() % N`` then ``j = rand() % N`` from one
    mt19937 stream; the pair's label is 1 when labels[i] == labels[j], else 0. Returns
    (i, j, pair labels)."""
    n = len(labels)
    if n == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    draws = mt19937_draws(seed, 2 * n) % np.uint64(n)
    first, second = draws[0::2].astype(np.int64), draws[1::2].astype(np.int64)
    return first, second, (labels[first] == labels[second]).astype(np.int64)


def convert_mnist_siamese_data(images: str | os.PathLike, labels: str | os.PathLike,
                               db: str | os.PathLike, *, seed: int = SIAMESE_SEED,
                               backend: str = "leveldb", log=None) -> int:
    """Caffe's convert_mnist_siamese_data: N records, record k a Datum of 2 x rows x cols
    (image i, then image j, a random pair drawn as ``siamese_pairs`` does) labelled 1 for
    the same digit, 0 otherwise, under the key ``%08d``; a LevelDB as in Caffe (lmdb on
    request). Returns the record count."""
    log = log or get_logger()
    backends.require(backend, ConvertError)
    _check_seed(seed)
    _check_new(os.fspath(db))
    pixels, labels_ = _read_logged(images, labels, log)
    n, rows, cols = pixels.shape
    first, second, same = siamese_pairs(labels_, seed)

    def records() -> Iterator[tuple[str, bytes]]:
        for start in range(0, n, 1000):  # pairs gathered a thousand at a time, not all at once
            stop = min(n, start + 1000)
            pairs = np.stack((pixels[first[start:stop]], pixels[second[start:stop]]), axis=1)
            batch = _datums(pairs, same[start:stop])
            yield from ((f"{start + k:08d}", value) for k, value in enumerate(batch))

    return write_datums(db, records(), total=n, log=log, backend=backend)


# -- convert_cifar_data ---------------------------------------------------------------------
def _cifar_count(path: str) -> int:
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ConvertError(f"{path}: cannot open the CIFAR-10 batch: {e.strerror}") from None
    if size % CIFAR_RECORD:
        raise ConvertError(f"{path}: {size} bytes is not a whole number of {CIFAR_RECORD}-byte "
                           "CIFAR-10 records (1 label byte + 3x32x32 pixels); the file is "
                           "truncated or not CIFAR-10's binary version (CIFAR-100 has 2 "
                           "label bytes)")
    if size // CIFAR_RECORD > CIFAR_BATCH:
        raise ConvertError(f"{path}: {size // CIFAR_RECORD} records; a CIFAR-10 batch holds "
                           f"at most {CIFAR_BATCH}")
    return size // CIFAR_RECORD


def _cifar_records(path: str, first_key: int) -> Iterator[tuple[str, bytes]]:
    raw = np.frombuffer(read_bounded(path, CIFAR_RECORD * CIFAR_BATCH, what="the CIFAR-10 batch",
                                     error=ConvertError), np.uint8)
    table = raw.reshape(-1, CIFAR_RECORD)
    pixels = table[:, 1:].reshape(-1, 3, CIFAR_SIDE, CIFAR_SIDE)
    for k, value in enumerate(_datums(pixels, table[:, 0])):
        yield f"{first_key + k:05d}", value


def convert_cifar_data(input_folder: str | os.PathLike, output_folder: str | os.PathLike,
                       db_type: str = "lmdb", *, log=None) -> tuple[int, int]:
    """Caffe's convert_cifar_data: data_batch_1.bin .. data_batch_5.bin of ``input_folder``
    become ``output_folder/cifar10_train_<db_type>`` (keys ``%05d`` of
    ``(batch - 1) * 10000 + index``) and test_batch.bin ``cifar10_test_<db_type>`` (keys
    ``%05d`` of the index); each record a Datum 3 x 32 x 32 (the R, G, B planes as stored)
    and its label. Every input is checked before anything is written. Returns the train
    and test record counts."""
    log = log or get_logger()
    backends.require(db_type, ConvertError)
    input_folder, output_folder = os.fspath(input_folder), os.fspath(output_folder)
    train_paths = [os.path.join(input_folder, name) for name in CIFAR_TRAIN_FILES]
    test_path = os.path.join(input_folder, CIFAR_TEST_FILE)
    counts = [_cifar_count(p) for p in train_paths]
    n_test = _cifar_count(test_path)
    if not os.path.isdir(output_folder):
        raise ConvertError(f"{output_folder}: the output folder does not exist")
    train_db = os.path.join(output_folder, f"cifar10_train_{db_type}")
    test_db = os.path.join(output_folder, f"cifar10_test_{db_type}")
    _check_new(train_db)
    _check_new(test_db)

    def train() -> Iterator[tuple[str, bytes]]:
        log.info("Writing Training data")
        for k, path in enumerate(train_paths):
            log.info("Training Batch %d", k + 1)
            yield from _cifar_records(path, k * CIFAR_BATCH)

    n_train = write_datums(train_db, train(), total=sum(counts), log=log, backend=db_type)
    log.info("Writing Testing data")
    n_test = write_datums(test_db, _cifar_records(test_path, 0),
                          total=n_test, log=log, backend=db_type)
    return n_train, n_test


# -- the commands ---------------------------------------------------------------------------
def _backend_flag(parser: argparse.ArgumentParser, default: str) -> None:
    flag(parser, "backend", default=default,
         help=f"the db backend: lmdb or leveldb (default {default}; leveldb needs plyvel)")


def _mnist_inputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("images", metavar="INPUT_IMAGE_FILE",
                        help="MNIST images, IDX (magic 2051), plain or .gz")
    parser.add_argument("labels", metavar="INPUT_LABEL_FILE",
                        help="MNIST labels, IDX (magic 2049), plain or .gz")
    parser.add_argument("db", metavar="OUTPUT_DB", help="the database folder to create")


def add_mnist_arguments(parser: argparse.ArgumentParser) -> None:
    """Caffe's convert_mnist_data: ``[--backend=lmdb|leveldb] images labels db``."""
    parser.description = ("Convert the MNIST dataset (IDX files, plain or gzip) to the "
                          "lmdb/leveldb format Caffe's Data layer reads.")
    _backend_flag(parser, "lmdb")
    _mnist_inputs(parser)
    parser.set_defaults(run=_run_mnist)


def _run_mnist(args: argparse.Namespace) -> int:
    convert_mnist_data(args.images, args.labels, args.db, backend=args.backend)
    return 0


def add_siamese_arguments(parser: argparse.ArgumentParser) -> None:
    """Caffe's convert_mnist_siamese_data: ``images labels db``, plus ``--seed`` and
    ``--backend`` (Caffe's seed is random per run and its backend always leveldb)."""
    parser.description = ("Convert the MNIST dataset to random pairs of digits (2 channels, "
                          "label 1 for the same digit) for Caffe's siamese example.")
    flag(parser, "seed", type=int, default=SIAMESE_SEED,
         help=f"the boost::mt19937 seed of the pair draw (default {SIAMESE_SEED}, an "
              "unseeded mt19937's)")
    _backend_flag(parser, "leveldb")
    _mnist_inputs(parser)
    parser.set_defaults(run=_run_siamese)


def _run_siamese(args: argparse.Namespace) -> int:
    convert_mnist_siamese_data(args.images, args.labels, args.db, seed=args.seed,
                               backend=args.backend)
    return 0


def add_cifar_arguments(parser: argparse.ArgumentParser) -> None:
    """Caffe's convert_cifar_data: ``input_folder output_folder db_type``."""
    parser.description = ("Convert CIFAR-10's binary batches (data_batch_1..5.bin, "
                          "test_batch.bin) to OUTPUT_FOLDER/cifar10_{train,test}_DB_TYPE.")
    parser.add_argument("input_folder", metavar="INPUT_FOLDER",
                        help="the folder of the binary batch files")
    parser.add_argument("output_folder", metavar="OUTPUT_FOLDER",
                        help="where the two databases are created (must exist)")
    parser.add_argument("db_type", metavar="DB_TYPE", help="lmdb or leveldb")
    parser.set_defaults(run=_run_cifar)


def _run_cifar(args: argparse.Namespace) -> int:
    convert_cifar_data(args.input_folder, args.output_folder, args.db_type)
    return 0


TOOLS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], str]] = {
    "convert_mnist_data": (add_mnist_arguments, "MNIST IDX files -> an LMDB or LevelDB of "
                                                "Datums, as Caffe's convert_mnist_data"),
    "convert_cifar_data": (add_cifar_arguments, "CIFAR-10 binary batches -> the train and "
                                                "test databases of Caffe's convert_cifar_data"),
    "convert_mnist_siamese_data": (add_siamese_arguments,
                                   "MNIST IDX files -> random digit pairs, as Caffe's "
                                   "convert_mnist_siamese_data (seeded)"),
}


def main(argv: list[str] | None = None) -> int:
    """``python -m purine.converters.caffe_datasets TOOL ARGS...``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in TOOLS:
        print(f"usage: caffe_datasets {{{','.join(TOOLS)}}} ...", file=sys.stderr)
        return 2
    return run_main(argv[0], TOOLS[argv[0]][0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
