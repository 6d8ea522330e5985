"""Caffe's convert_imageset: the images of a list file become an LMDB or a LevelDB of Datum
records, keyed, laid out and encoded as Caffe's tool writes them. ``DBWriter`` writes every
database of Datums (images here and for in-memory images, features for extract_features)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

from purine.converters import ConvertError, bool_flag, flag, run_main
from purine.converters.progress import Progress
from purine.data.image_list import read_list
from purine.data.leveldb_source import message as leveldb_message
from purine.data.leveldb_source import plyvel_module
from purine.formats import caffe_pb2 as pb
from purine.log import get_logger

COMMIT_EVERY = 1000  # records per transaction, as Caffe's tools commit
# Caffe shuffles with an unseeded RNG; ours is seeded so the same list gives the same order.
SHUFFLE_SEED = 0
# Caffe asks LMDB for a 1 TB map: address space only on 64-bit, the file grows as written.
# A full map is still handled, by doubling it and retrying the transaction.
MAP_SIZE = 1 << 40 if sys.maxsize > 2**32 else 1 << 30
LMDB_MAX_KEY = 511  # bytes, LMDB's compiled-in limit
# What Caffe asks of a new LevelDB: a 256 MB write buffer and 64 KiB blocks.
LEVELDB_WRITE_BUFFER = 256 << 20
LEVELDB_BLOCK = 64 << 10


class Encoded(NamedTuple):
    """An already encoded image (PNG, JPEG bytes) stored as is; ``shape`` is its decoded
    (C, H, W), which --check_size compares."""

    data: bytes
    shape: tuple[int, int, int]


class Record(NamedTuple):
    """One record for ``write_images``: the LMDB key, a uint8 image (H x W or H x W x C in
    OpenCV's BGR order) or an ``Encoded`` one, the label, and where it came from (for
    messages; plain ``(key, image, label)`` tuples work too)."""

    key: str
    image: np.ndarray | Encoded
    label: int
    where: str = ""


# -- one image -> one Datum (Caffe's CVMatToDatum / EncodeCVMatToDatum) ------------------
def image_shape(image: np.ndarray | Encoded) -> tuple[int, int, int]:
    """(C, H, W) of an H x W or H x W x C image, or an Encoded image's decoded shape."""
    if isinstance(image, Encoded):
        return image.shape
    if image.ndim == 2:
        return (1, *image.shape)
    if image.ndim == 3:
        h, w, c = image.shape
        return (c, h, w)
    raise ConvertError(f"an image is H x W or H x W x C, got shape {image.shape}")


def mat_to_datum(image: np.ndarray, label: int) -> pb.Datum:
    """A raw Datum: channels, height, width, the pixels as uint8 C x H x W, the label, and
    ``encoded: false`` set explicitly, so the bytes equal Caffe's."""
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise ConvertError(f"image data type must be uint8 (as Caffe's), got {image.dtype}")
    c, h, w = image_shape(image)
    chw = image.reshape(h, w, c).transpose(2, 0, 1)
    return pb.Datum(channels=c, height=h, width=w, data=np.ascontiguousarray(chw).tobytes(),
                    label=int(label), encoded=False)


def encode_image(image: np.ndarray, encoding: str) -> bytes:
    """The image encoded by OpenCV as ``encoding`` ("png", "jpg", ...)."""
    import cv2

    try:
        ok, buf = cv2.imencode("." + encoding, image)
    except cv2.error:
        ok = False
    if not ok:
        raise ConvertError(f"OpenCV cannot encode an image of shape {image.shape} as "
                           f"'{encoding}'")
    return buf.tobytes()


def image_datum(image: np.ndarray | Encoded, label: int, encoding: str = "") -> pb.Datum:
    """The Datum Caffe stores for an image: raw, or encoded (bytes kept when already
    Encoded, else encoded as ``encoding``); an encoded Datum has no channels/height/width."""
    if isinstance(image, Encoded):
        return pb.Datum(data=image.data, label=int(label), encoded=True)
    if encoding:
        return pb.Datum(data=encode_image(image, encoding), label=int(label), encoded=True)
    return mat_to_datum(image, label)


# -- the database writer ------------------------------------------------------------------
def _commit(env, batch: list[tuple[bytes, bytes]]) -> None:
    import lmdb

    while True:
        try:
            with env.begin(write=True) as txn:
                txn.cursor().putmulti(batch)
            return
        except lmdb.MapFullError:
            # The transaction was aborted: grow the map (as newer Caffe does) and redo it.
            env.set_mapsize(env.info()["map_size"] * 2)


class DBWriter:
    """A new LMDB or LevelDB (Caffe's ``db::NEW``) written in transactions: ``put`` buffers
    a record, ``commit`` writes the buffered ones together. The folder must not exist;
    ``abort`` removes what was written."""

    def __init__(self, path: str | os.PathLike, backend: str = "lmdb", log=None):
        self.path, self.backend = os.fspath(path), backend
        if backend not in ("lmdb", "leveldb"):
            raise ConvertError(f"unknown backend '{backend}'; use lmdb or leveldb")
        plyvel = plyvel_module() if backend == "leveldb" else None  # before any folder is made
        try:
            os.mkdir(self.path)
        except FileExistsError:
            raise ConvertError(f"{self.path}: already exists; remove it or choose another name "
                               "(Caffe's tools never write into an existing database)") from None
        except OSError as e:
            raise ConvertError(f"{self.path}: cannot create the database folder: "
                               f"{e.strerror}") from None
        self.pending: list[tuple[bytes, bytes]] = []
        self._env = self._db = None
        try:
            if plyvel is None:
                import lmdb

                try:
                    self._env = lmdb.open(self.path, map_size=MAP_SIZE, subdir=True)
                except lmdb.Error as e:
                    raise ConvertError(f"{self.path}: cannot open the lmdb: {e}") from None
            else:
                try:
                    self._db = plyvel.DB(self.path, create_if_missing=True,
                                         error_if_exists=True,
                                         write_buffer_size=LEVELDB_WRITE_BUFFER,
                                         block_size=LEVELDB_BLOCK)
                except plyvel.Error as e:
                    raise ConvertError(f"{self.path}: cannot open the leveldb: "
                                       f"{leveldb_message(e)}") from None
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        (log or get_logger()).info("Opened %s %s", backend, self.path)

    def put(self, key: str | bytes, value: pb.Datum | bytes) -> None:
        k = key if isinstance(key, bytes) else key.encode("utf-8", "surrogateescape")
        if self._env is not None and not 0 < len(k) <= LMDB_MAX_KEY:
            raise ConvertError(f"key {key!r} is {len(k)} bytes; LMDB keys are 1 to "
                               f"{LMDB_MAX_KEY} bytes")
        self.pending.append((k, value if isinstance(value, bytes) else value.SerializeToString()))

    def commit(self) -> None:
        if not self.pending:
            return
        if self._env is not None:
            self._commit_lmdb()
        else:
            import plyvel

            try:
                with self._db.write_batch(transaction=True) as batch:
                    for k, v in self.pending:
                        batch.put(k, v)
            except plyvel.Error as e:
                raise ConvertError(f"{self.path}: writing the leveldb failed: "
                                   f"{leveldb_message(e)}") from None
        self.pending.clear()

    def _commit_lmdb(self) -> None:
        import lmdb

        try:
            _commit(self._env, self.pending)
        except lmdb.Error as e:
            raise ConvertError(f"{self.path}: writing the lmdb failed: {e}") from None

    def close(self) -> None:
        """Commit what is pending and close the database."""
        try:
            self.commit()
        finally:
            self._close()

    def _close(self) -> None:
        if self._env is not None:
            self._env.close()
        if self._db is not None:
            self._db.close()
        self._env = self._db = None

    def abort(self) -> None:
        """Close without committing and remove the half-written database."""
        self._close()
        shutil.rmtree(self.path, ignore_errors=True)


def _fill(db: DBWriter, items: Iterable[tuple[str | bytes, pb.Datum | bytes]],
          total: int | None, label: str, log) -> int:
    count = 0
    with Progress(total, label, unit="record", log=log) as progress:
        for key, value in items:
            db.put(key, value)
            count += 1
            progress.update(count)
            if count % COMMIT_EVERY == 0:
                db.commit()
                log.info("Processed %d files.", count)
        if count % COMMIT_EVERY != 0:
            db.commit()
            log.info("Processed %d files.", count)
    return count


def write_datums(db: str | os.PathLike, items: Iterable[tuple[str | bytes, pb.Datum | bytes]],
                 *, total: int | None = None, log=None, backend: str = "lmdb") -> int:
    """Write (key, Datum) pairs to a new LMDB or LevelDB ``db`` in transactions of 1000, as
    Caffe's tools do; returns the record count. The folder must not exist (Caffe's
    ``db::NEW``); on an error the half-written database is removed."""
    log = log or get_logger()
    writer = DBWriter(db, backend, log)
    try:
        count = _fill(writer, items, total, os.path.basename(os.path.normpath(writer.path)),
                      log)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return count


def write_images(db: str | os.PathLike, records: Iterable[Record | tuple], *,
                 encoding: str = "", check_size: bool = False, total: int | None = None,
                 log=None, backend: str = "lmdb") -> int:
    """Write (key, image, label[, where]) records as Datums to a new ``backend`` database
    ``db`` (lmdb or leveldb): raw uint8 C x H x W, or encoded as ``encoding`` ("png", "jpg";
    ``Encoded`` images are kept as they are). ``check_size``: every image must have the
    first one's (C, H, W)."""
    if encoding:
        _check_encoding(encoding)

    def datums() -> Iterator[tuple[str, pb.Datum]]:
        first = None
        for rec in records:
            key, image, label, *rest = rec
            if not isinstance(image, Encoded):
                image = np.asarray(image)
            shape = image_shape(image)
            if check_size:
                if first is None:
                    first = shape
                elif shape != first:
                    where = rest[0] if rest and rest[0] else f"record '{key}'"
                    raise ConvertError(
                        f"{where}: image is {'x'.join(map(str, shape))} (CxHxW) but the "
                        f"first was {'x'.join(map(str, first))} (--check_size)")
            yield key, image_datum(image, label, encoding)

    return write_datums(db, datums(), total=total, log=log, backend=backend)


def _check_encoding(encoding: str) -> None:
    import cv2

    if not cv2.haveImageWriter("." + encoding):
        raise ConvertError(f"encode_type '{encoding}': OpenCV cannot write that format "
                           "(try png or jpg)")


# -- the list file and the images it names -----------------------------------------------


def _ext(name: str) -> str:
    dot = name.rfind(".")
    return name[dot + 1:].lower() if dot >= 0 else ""


def _same_format(ext: str, encoding: str) -> bool:
    return ext == encoding or {ext, encoding} == {"jpg", "jpeg"}


def load_image(path: str, where: str, *, gray: bool = False, resize: tuple[int, int] = (0, 0),
               encoding: str = "", hint: str = "") -> np.ndarray | Encoded:
    """Caffe's ReadImageToDatum before the Datum: OpenCV reads ``path`` as BGR (or gray),
    resizes (bilinear) when both of ``resize`` = (height, width) are > 0; with an
    ``encoding`` the file's own bytes are kept when it is already in that format, has the
    channels asked for and was not resized, else the image is re-encoded."""
    import cv2

    if not os.path.isfile(path):
        raise ConvertError(f"{where}: image not found: {path}{hint}")
    image = cv2.imread(path, cv2.IMREAD_GRAYSCALE if gray else cv2.IMREAD_COLOR)
    if image is None:
        raise ConvertError(f"{where}: cannot read {path}: OpenCV cannot decode it as an image")
    height, width = resize
    resized = height > 0 and width > 0
    if resized:
        image = cv2.resize(image, (width, height))
    if not encoding:
        return image
    shape = image_shape(image)
    # Caffe keeps the file only when neither resize size is set (even if just one is).
    if not height and not width and _same_format(_ext(path), encoding):
        with open(path, "rb") as f:
            data = f.read()
        # Keep the file only if a reader decoding it natively gets what we would store.
        native = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
        if native is not None and native.dtype == np.uint8 and native.shape == image.shape:
            return Encoded(data, shape)
    return Encoded(encode_image(image, encoding), shape)


def convert_imageset(root: str | os.PathLike, listfile: str | os.PathLike,
                     db: str | os.PathLike, *, gray: bool = False, shuffle: bool = False,
                     resize: tuple[int, int] = (0, 0), check_size: bool = False,
                     encoded: bool = False, encode_type: str = "", seed: int = SHUFFLE_SEED,
                     backend: str = "lmdb", log=None) -> int:
    """Caffe's convert_imageset: each ``path label`` line of ``listfile`` becomes a Datum
    under the key ``%08d_path`` in a new ``backend`` database ``db`` (lmdb or leveldb). A
    string ``root`` is prefixed to the paths as given, as Caffe does (so give it a trailing
    '/'); a Path is a folder.
    ``resize`` is (height, width). ``encode_type`` implies ``encoded``; ``encoded`` alone
    takes each file's extension. Returns the number of records written."""
    log = log or get_logger()
    if backend not in ("lmdb", "leveldb"):
        raise ConvertError(f"unknown backend '{backend}'; use lmdb or leveldb")
    # A Path cannot end in '/', so it names a folder; a string is prefixed as given.
    root = os.path.join(root, "") if isinstance(root, os.PathLike) else root
    listfile = os.fspath(listfile)
    encode_type = encode_type.lower()
    if encode_type:
        _check_encoding(encode_type)
    lines = read_list(listfile)
    if shuffle:
        log.info("Shuffling data (seed %d)", seed)
        order = np.random.default_rng(seed).permutation(len(lines))
        lines = [lines[i] for i in order]
    log.info("A total of %d images.", len(lines))
    if encode_type and not encoded:
        log.info("encode_type specified, assuming encoded=true.")
    height, width = (max(0, int(x)) for x in resize)
    hint = ""
    if root and not root.endswith(("/", os.sep)):
        hint = (f" (ROOTFOLDER '{root}' is prefixed to the list's paths as given, as in "
                f"Caffe: did you mean '{root}/'?)")

    def records() -> Iterator[Record]:
        for line_id, (name, label, lineno) in enumerate(lines):
            where = f"{listfile}:{lineno}"
            enc = encode_type
            if encoded and not enc:
                enc = _ext(name)
                if not enc:
                    raise ConvertError(f"{where}: cannot guess the encoding of '{name}' from "
                                       "its name; give --encode_type")
            image = load_image(root + name, where, gray=gray, resize=(height, width),
                               encoding=enc, hint=hint)
            yield Record(f"{line_id:08d}_{name}", image, label, f"{where}: '{name}'")

    return write_images(db, records(), check_size=check_size, total=len(lines), log=log,
                        backend=backend)


# -- the command --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Caffe's convert_imageset flags (one dash or two, ``--flag=value``) and arguments."""
    if parser.description is None:
        parser.description = ("Convert a set of images to the lmdb/leveldb format used as "
                              "input for Caffe. LISTFILE lines are 'relative/path label'.")
    bool_flag(parser, "gray", "treat images as grayscale ones")
    bool_flag(parser, "shuffle", "randomly shuffle the order of images and their labels "
                                 f"(seeded: --seed, default {SHUFFLE_SEED})")
    flag(parser, "seed", type=int, default=SHUFFLE_SEED, help="the --shuffle seed")
    flag(parser, "backend", default="lmdb",
         help="the db backend: lmdb or leveldb (leveldb needs the plyvel package)")
    flag(parser, "resize_width", type=int, default=0, help="width images are resized to")
    flag(parser, "resize_height", type=int, default=0, help="height images are resized to")
    bool_flag(parser, "check_size", "check that all the datum have the same size")
    bool_flag(parser, "encoded", "store the encoded image in the datum")
    flag(parser, "encode_type", default="",
         help="what to encode the image as ('png', 'jpg', ...); implies --encoded")
    parser.add_argument("root", metavar="ROOTFOLDER/", help="folder the list's paths are in")
    parser.add_argument("listfile", metavar="LISTFILE", help="lines of 'relative/path label'")
    parser.add_argument("db", metavar="DB_NAME", help="the database folder to create")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    convert_imageset(args.root, args.listfile, args.db, gray=args.gray, shuffle=args.shuffle,
                     resize=(args.resize_height, args.resize_width),
                     check_size=args.check_size, encoded=args.encoded,
                     encode_type=args.encode_type, seed=args.seed, backend=args.backend)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("convert_imageset", add_arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
