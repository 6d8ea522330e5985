"""Caffe's convert_imageset: the images of a list file become an LMDB or a LevelDB (or any
registered backend's database) of Datum records, keyed, laid out and encoded as Caffe's tool
writes them. ``open_writer`` opens every database the tools write (images here, in-memory
images, features for extract_features, the dataset tools' records)."""

from __future__ import annotations

import argparse
import functools
import operator
import os
import re
import sys
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np
from google.protobuf.message import Message

from purine.converters import ConvertError, bool_flag, flag, run_main
from purine.converters.progress import Progress
from purine.data import DataError
from purine.data import db as backends
from purine.data.datum import decode_image, encode_datum, opencv_quiet
from purine.data.db import DatumWriter
from purine.data.image_list import read_list
from purine.formats.files import BINARY_LIMIT, read_bounded
from purine.log import get_logger

# Caffe shuffles with an unseeded RNG; ours is seeded so the same list gives the same order.
SHUFFLE_SEED = 0
# The most pixel bytes one resized image may have: a Datum is one protobuf message, which
# protobuf caps at 2 GiB; the rest of the Datum needs a few bytes.
MAX_DATUM_PIXELS = 2**31 - 1 - 64


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


def image_datum(image: np.ndarray | Encoded, label: int, encoding: str = "") -> bytes:
    """The serialized Datum Caffe stores for an image: raw uint8 C x H x W with
    ``encoded: false`` set explicitly, or encoded (bytes kept when already Encoded, else
    encoded as ``encoding``), which has no channels/height/width."""
    label = int(label)
    if isinstance(image, Encoded):
        return encode_datum(image.data, label)
    if encoding:
        return encode_datum(encode_image(image, encoding), label)
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise ConvertError(f"image data type must be uint8 (as Caffe's), got {image.dtype}")
    c, h, w = image_shape(image)
    return encode_datum(image.reshape(h, w, c).transpose(2, 0, 1), label, encoded=False)


# -- the database writer ------------------------------------------------------------------
def _commit(writer: DatumWriter, batch: list[tuple[bytes, bytes]]) -> None:
    """One transaction: every record the tools write passes here."""
    writer.write(batch)


def open_writer(path: str | os.PathLike, backend: str, log=None) -> DatumWriter:
    """A new database of the registered ``backend`` (Caffe's ``db::NEW``): put, commit
    every db.COMMIT_EVERY records, close; its errors are ConvertErrors. The folder must not
    exist; ``abort`` removes what was written."""
    found = backends.get(backend)
    if found is None:
        raise ConvertError(f"unknown backend '{backend}'; use {backends.names_text()}")
    writer = found.writer(path, ConvertError, transact=_commit)
    (log or get_logger()).info("Opened %s %s", backend, writer.path)
    return writer


def _fill(writer: DatumWriter, items: Iterable[tuple[str | bytes, Message | bytes]],
          total: int | None, label: str, log) -> int:
    count = 0
    with Progress(total, label, unit="record", log=log) as progress:
        for key, value in items:
            committed = writer.put(key, value if isinstance(value, bytes)
                                   else value.SerializeToString())
            count += 1
            progress.update(count)
            if committed:
                log.info("Processed %d files.", count)
        if writer.pending:
            writer.commit()
            log.info("Processed %d files.", count)
    return count


def write_datums(db: str | os.PathLike, items: Iterable[tuple[str | bytes, Message | bytes]],
                 *, total: int | None = None, log=None, backend: str = "lmdb") -> int:
    """Write (key, Datum or its bytes) pairs to a new ``backend`` database ``db`` in
    transactions of 1000, as Caffe's tools do; returns the record count. The folder must
    not exist (Caffe's ``db::NEW``); on an error the half-written database is removed."""
    log = log or get_logger()
    writer = open_writer(db, backend, log)
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
    ``db`` (lmdb, leveldb or another registered backend): raw uint8 C x H x W, or encoded as
    ``encoding`` ("png", "jpg"; ``Encoded`` images are kept as they are). ``check_size``:
    every image must have the first one's (C, H, W)."""
    if encoding:
        _check_encoding(encoding, None)  # the images may be gray or color

    def datums() -> Iterator[tuple[str, bytes]]:
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


# Names OpenCV may write, offered in messages when it can write them in this build.
_CANDIDATES = ("jpg", "jpeg", "jpe", "png", "bmp", "dib", "tiff", "tif", "webp", "jp2",
               "avif", "pbm", "pgm", "ppm", "pnm", "sr", "ras", "gif", "exr", "hdr", "pic",
               "pfm")


@functools.cache
def encoding_works(encoding: str, gray: bool = False) -> bool:
    """Whether OpenCV writes a small ``gray`` or color uint8 image as ``encoding`` and
    reads it back as uint8 with its channels (Caffe's data layers take 8-bit images only,
    so HDR, PFM or a disabled OpenEXR would make records nothing can read)."""
    import cv2

    if not re.fullmatch(r"[a-z0-9]+", encoding, re.ASCII):
        return False
    probe = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    probe = probe[:, :, 0].copy() if gray else probe
    with opencv_quiet():
        try:
            ok, buf = cv2.imencode("." + encoding, probe)
            back = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED) if ok else None
        except cv2.error:
            return False
    return back is not None and back.dtype == np.uint8 and back.shape == probe.shape


def _check_encoding(encoding: str, gray: bool | None = False,
                    where: str = "encode_type") -> None:
    """Refuse an encoding OpenCV cannot write for ``gray`` (or, for None, either) images,
    naming the ones it can."""
    modes = (False, True) if gray is None else (gray,)
    if not any(encoding_works(encoding, g) for g in modes):
        kinds = [c for c in _CANDIDATES if any(encoding_works(c, g) for g in modes)]
        what = "" if gray is None else ("gray " if gray else "color ")
        raise ConvertError(f"{where} '{encoding}': OpenCV cannot write that format as 8-bit "
                           f"{what}images that read back; use one of {', '.join(kinds)}")


def _check_resize(height: int, width: int, gray: bool) -> tuple[int, int]:
    """Caffe's resize flags: int32 values, negative ones taken as 0, and a resized image
    (both sizes > 0) must fit one Datum, which protobuf caps below 2 GiB."""
    for name, v in (("resize_height", height), ("resize_width", width)):
        if not -2**31 <= v < 2**31:
            raise ConvertError(f"--{name} {v}: expected an int32, as Caffe's flag is")
    height, width = max(0, height), max(0, width)
    size = height * width * (1 if gray else 3)
    if height and width and size > MAX_DATUM_PIXELS:
        raise ConvertError(f"--resize_height {height} --resize_width {width}: a resized image "
                           f"holds {size} bytes, more than the {MAX_DATUM_PIXELS} a Datum can "
                           "(protobuf's 2 GiB limit)")
    return height, width


def shuffle_order(n: int, seed: int, log=None) -> np.ndarray:
    """The order --shuffle writes ``n`` lines in. A seed of 0 or more gives the same order
    every time; a negative one, as Caffe's random_seed -1, draws the seed from the system's
    entropy (Caffe's own tool always shuffles unseeded), logged so the run can be repeated."""
    if seed < 0:
        drawn = int.from_bytes(os.urandom(8), "little")
        (log or get_logger()).info("Shuffling data (seed %d: unseeded, as in Caffe; drew "
                                   "seed %d)", seed, drawn)
        seed = drawn
    else:
        (log or get_logger()).info("Shuffling data (seed %d)", seed)
    return np.random.default_rng(seed).permutation(n)


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
    data = read_bounded(path, BINARY_LIMIT, error=ConvertError)
    try:  # decode_image keeps the codecs' own lines off stderr
        image = decode_image(data, cv2.IMREAD_GRAYSCALE if gray else cv2.IMREAD_COLOR, where)
    except DataError:
        raise ConvertError(f"{where}: cannot read {path}: OpenCV cannot decode it as an "
                           "image") from None
    image = image[0] if gray else image.transpose(1, 2, 0)  # back to OpenCV's H x W (x C)
    height, width = resize
    resized = height > 0 and width > 0
    if resized:
        image = cv2.resize(image, (width, height))
    if not encoding:
        return image
    shape = image_shape(image)
    # Caffe keeps the file only when neither resize size is set (even if just one is).
    if not height and not width and _same_format(_ext(path), encoding):
        # Keep the file only if a reader decoding it natively gets what we would store.
        with opencv_quiet():
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
    # Every flag is checked before the list is read and the database is created.
    if backends.get(backend) is None:
        raise ConvertError(f"unknown backend '{backend}'; use {backends.names_text()}")
    # A Path cannot end in '/', so it names a folder; a string is prefixed as given.
    root = os.path.join(root, "") if isinstance(root, os.PathLike) else root
    listfile = os.fspath(listfile)
    encode_type = encode_type.lower()
    if encode_type:
        _check_encoding(encode_type, gray)
    height, width = _check_resize(int(resize[0]), int(resize[1]), gray)
    seed = operator.index(seed)
    lines = read_list(listfile)
    if encoded and not encode_type:  # each file's own extension: all checked up front
        for name, _, lineno in lines:
            enc = _ext(name)
            if not enc:
                raise ConvertError(f"{listfile}:{lineno}: cannot guess the encoding of "
                                   f"'{name}' from its name; give --encode_type")
            _check_encoding(enc, gray, f"{listfile}:{lineno}: the encoding of '{name}',")
    if shuffle:
        order = shuffle_order(len(lines), seed, log)
        lines = [lines[i] for i in order]
    log.info("A total of %d images.", len(lines))
    if encode_type and not encoded:
        log.info("encode_type specified, assuming encoded=true.")
    hint = ""
    if root and not root.endswith(("/", os.sep)):
        hint = (f" (ROOTFOLDER '{root}' is prefixed to the list's paths as given, as in "
                f"Caffe: did you mean '{root}/'?)")

    def records() -> Iterator[Record]:
        for line_id, (name, label, lineno) in enumerate(lines):
            where = f"{listfile}:{lineno}"
            enc = encode_type or (_ext(name) if encoded else "")
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
