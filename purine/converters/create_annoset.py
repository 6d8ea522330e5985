"""SSD's create_annoset / convert_annoset (weiliu89/caffe): images with their box files (the
fork's txt rows or VOC XML, names mapped by a LabelMap prototxt) become an LMDB or LevelDB of
AnnotatedDatum records, keyed ``%08d_image`` as the fork's tool writes them."""

from __future__ import annotations

import argparse
import os
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import numpy as np

from purine.converters import ConvertError, bool_flag, flag
from purine.converters.convert_imageset import (
    SHUFFLE_SEED,
    Encoded,
    _check_encoding,
    _ext,
    encode_image,
    image_datum,
    image_shape,
    load_image,
    write_datums,
)
from purine.errors import ProtoError
from purine.formats import caffe_pb2 as pb
from purine.formats.files import TEXT_LIMIT, read_bounded, read_bounded_text
from purine.formats.prototxt import read_text
from purine.log import get_logger

# A box as the fork stores it: (label, xmin, ymin, xmax, ymax normalized, difficult).
Box = tuple[int, float, float, float, float, bool]


def read_label_map(path: str | os.PathLike, check_label: bool = False) -> dict[str, int]:
    """A LabelMap prototxt as name -> label; ``check_label`` refuses a repeated name (the
    fork's --check_label), else the last entry of a name wins."""
    try:
        lm = read_text(path, pb.LabelMap())
    except ProtoError as e:
        raise ConvertError(f"label map {e}") from None
    names: dict[str, int] = {}
    for item in lm.item:
        if check_label and item.name in names:
            raise ConvertError(f"{os.fspath(path)}: the name '{item.name}' appears more than "
                               "once (--check_label)")
        names[item.name] = int(item.label)
    return names


def read_list_pairs(path: str) -> list[tuple[str, str, int]]:
    """(image, second field, line number) per non-blank line of ``image field`` pairs."""
    text = read_bounded_text(path, what="the list file", error=ConvertError)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise ConvertError(f"{path}:{n}: expected 'image annotation' (two fields), got "
                               f"{len(parts)}")
        out.append((parts[0], parts[1], n))
    return out


def read_txt_boxes(path: str, height: int, width: int) -> list[Box]:
    """The fork's txt box file: rows ``label xmin ymin xmax ymax`` in pixels."""
    try:
        lines = read_bounded(path, TEXT_LIMIT, what="the box file",
                             error=ConvertError).decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ConvertError(f"{path}: cannot read the box file: {e}") from None
    boxes = []
    for n, line in enumerate(lines, 1):
        parts = line.split()
        if not parts:
            continue
        try:
            label, x0, y0, x1, y1 = int(parts[0]), *(float(v) for v in parts[1:])
        except ValueError:
            label = None
        if label is None or len(parts) != 5:
            raise ConvertError(f"{path}:{n}: expected 'label xmin ymin xmax ymax' (an integer "
                               "and four numbers in pixels)")
        boxes.append((label, x0 / width, y0 / height, x1 / width, y1 / height, False))
    return boxes


def _xml_int(node: ET.Element, tag: str, path: str) -> int:
    text = node.findtext(tag)
    if text is None:
        return 0  # the fork reads a missing corner as 0
    try:
        return int(text.strip())
    except ValueError:
        raise ConvertError(f"{path}: <{tag}> is '{text.strip()}'; expected an integer pixel "
                           "coordinate") from None


def read_xml_boxes(path: str, height: int, width: int, names: dict[str, int]) -> list[Box]:
    """A VOC XML file's objects (name, difficult, bndbox); the boxes are normalized by the
    file's <size> (the image's size when it has none)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        raise ConvertError(f"{path}: cannot read the XML annotation: {e}") from None
    size = root.find("size")
    if size is not None and size.findtext("height") and size.findtext("width"):
        height, width = _xml_int(size, "height", path), _xml_int(size, "width", path)
    if height == 0 or width == 0:
        raise ConvertError(f"{path}: no valid image width/height")
    boxes = []
    for obj in root.findall("object"):
        name = (obj.findtext("name") or "").strip()
        if name not in names:
            raise ConvertError(f"{path}: unknown name '{name}'; the label map has "
                               f"{', '.join(sorted(names)) or 'no names'}")
        bb = obj.find("bndbox")
        if bb is None:
            raise ConvertError(f"{path}: object '{name}' has no <bndbox>")
        x0, y0, x1, y1 = (_xml_int(bb, t, path) for t in ("xmin", "ymin", "xmax", "ymax"))
        difficult = (obj.findtext("difficult") or "").strip() == "1"
        boxes.append((names[name], x0 / width, y0 / height, x1 / width, y1 / height,
                      difficult))
    return boxes


def annotated_datum(datum: pb.Datum, boxes: list[Box] | None) -> pb.AnnotatedDatum:
    """An AnnotatedDatum of type BBOX (plain, for None): one group per label in order of first
    appearance, instance ids counting up within each group."""
    a = pb.AnnotatedDatum(datum=datum)
    if boxes is None:
        return a
    a.type = pb.AnnotatedDatum.BBOX
    groups: dict[int, pb.AnnotationGroup] = {}
    for label, x0, y0, x1, y1, difficult in boxes:
        g = groups.get(label)
        if g is None:
            g = groups[label] = a.annotation_group.add(group_label=label)
        an = g.annotation.add(instance_id=len(g.annotation))
        an.bbox.xmin, an.bbox.ymin, an.bbox.xmax, an.bbox.ymax = x0, y0, x1, y1
        an.bbox.difficult = difficult
    return a


def _image(path: str, where: str, *, gray: bool, resize: tuple[int, int], min_dim: int,
           max_dim: int, encoding: str) -> np.ndarray | Encoded:
    """The fork's ReadImageToCVMat: min_dim / max_dim rescale keeping the aspect ratio (and
    win over resize), then the image is encoded as convert_imageset does."""
    if not (min_dim or max_dim):
        return load_image(path, where, gray=gray, resize=resize, encoding=encoding)
    import cv2

    img = load_image(path, where, gray=gray)
    short, long = min(img.shape[:2]), max(img.shape[:2])
    s = np.float32(1.0)
    if min_dim > 0 and short < min_dim:
        s = np.float32(min_dim) / np.float32(short)
    if max_dim > 0 and int(s * long) > max_dim:
        s = np.float32(max_dim) / np.float32(long)
    if s != 1:
        img = cv2.resize(img, (0, 0), fx=float(s), fy=float(s))
    return Encoded(encode_image(img, encoding), image_shape(img)) if encoding else img


def create_annoset(root: str | os.PathLike, listfile: str | os.PathLike,
                   db: str | os.PathLike, *, anno_type: str = "classification",
                   label_type: str = "xml", label_map_file: str = "",
                   check_label: bool = False, min_dim: int = 0, max_dim: int = 0,
                   resize: tuple[int, int] = (0, 0), check_size: bool = False,
                   encoded: bool = False, encode_type: str = "", shuffle: bool = False,
                   seed: int = SHUFFLE_SEED, gray: bool = False, backend: str = "lmdb",
                   log=None) -> int:
    """The fork's convert_annoset: each ``image annotation`` line of ``listfile`` (``image
    label`` for anno_type classification) becomes an AnnotatedDatum under ``%08d_image`` in
    a new database ``db``. ``root`` is prefixed to both paths as given (a string: give its
    trailing '/'); a missing box file gives an image with no boxes, as in the fork.
    ``resize`` is (height, width). Returns the number of records written."""
    log = log or get_logger()
    if anno_type not in ("classification", "detection"):
        raise ConvertError(f"anno_type '{anno_type}': expected classification or detection")
    if anno_type == "detection" and label_type not in ("xml", "txt"):
        raise ConvertError(f"label_type '{label_type}' is not built; use xml or txt")
    root = os.path.join(root, "") if isinstance(root, os.PathLike) else root
    listfile = os.fspath(listfile)
    names: dict[str, int] = {}
    if anno_type == "detection":
        if not label_map_file:
            raise ConvertError("anno_type detection needs --label_map_file (a LabelMap "
                               "prototxt)")
        names = read_label_map(label_map_file, check_label)
    encode_type = encode_type.lower()
    if encode_type:
        _check_encoding(encode_type)
    lines = read_list_pairs(listfile)
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(lines))
        lines = [lines[i] for i in order]
    log.info("A total of %d images.", len(lines))
    size = (max(0, int(resize[0])), max(0, int(resize[1])))

    def records() -> Iterator[tuple[str, pb.AnnotatedDatum]]:
        first = None
        for line_id, (name, second, lineno) in enumerate(lines):
            where = f"{listfile}:{lineno}"
            enc = encode_type or (_ext(name) if encoded else "")
            if encoded and not enc:
                raise ConvertError(f"{where}: cannot guess the encoding of '{name}'; give "
                                   "--encode_type")
            image = _image(root + name, where, gray=gray, resize=size, min_dim=max(0, min_dim),
                           max_dim=max(0, max_dim), encoding=enc)
            shape = image_shape(image)
            if check_size and first is not None and shape != first:
                raise ConvertError(f"{where}: image is {shape} (C, H, W) but the first was "
                                   f"{first} (--check_size)")
            first = first or shape
            if anno_type == "classification":
                try:
                    label = int(second)
                except ValueError:
                    raise ConvertError(f"{where}: label '{second}' is not an integer") from None
                yield f"{line_id:08d}_{name}", annotated_datum(
                    pb.Datum.FromString(image_datum(image, label, enc)), None)
                continue
            boxes: list[Box] = []
            anno = root + second
            if os.path.exists(anno):
                h, w = load_image(root + name, where).shape[:2]  # the original's size
                boxes = (read_xml_boxes(anno, h, w, names) if label_type == "xml"
                         else read_txt_boxes(anno, h, w))
            else:
                log.warning("%s: no annotation file %s; the image gets no boxes", where, anno)
            yield f"{line_id:08d}_{name}", annotated_datum(
                pb.Datum.FromString(image_datum(image, -1, enc)), boxes)

    return write_datums(db, records(), total=len(lines), log=log, backend=backend)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """convert_annoset's flags (one dash or two, ``--flag=value``) and arguments."""
    if parser.description is None:
        parser.description = ("Convert images and their box annotations to an lmdb/leveldb "
                              "of AnnotatedDatum, as SSD's create_annoset. LISTFILE lines are "
                              "'image annotation' ('image label' for classification).")
    flag(parser, "anno_type", default="classification",
         help="classification or detection (default classification, as the fork's)")
    flag(parser, "label_type", default="xml", help="box files: xml (VOC) or txt")
    flag(parser, "label_map_file", default="", help="a LabelMap prototxt: names -> labels")
    bool_flag(parser, "check_label", "refuse a label map that repeats a name")
    flag(parser, "min_dim", type=int, default=0, help="resize so the short side is at least this")
    flag(parser, "max_dim", type=int, default=0, help="resize so the long side is at most this")
    flag(parser, "resize_width", type=int, default=0, help="width images are resized to")
    flag(parser, "resize_height", type=int, default=0, help="height images are resized to")
    bool_flag(parser, "check_size", "check that all the datum have the same size")
    bool_flag(parser, "encoded", "store the encoded image in the datum")
    flag(parser, "encode_type", default="", help="what to encode the image as ('png', 'jpg')")
    bool_flag(parser, "shuffle", "shuffle the list (seeded: --seed)")
    flag(parser, "seed", type=int, default=SHUFFLE_SEED, help="the --shuffle seed")
    bool_flag(parser, "gray", "treat images as grayscale ones")
    flag(parser, "backend", default="lmdb", help="lmdb or leveldb")
    parser.add_argument("root", metavar="ROOTFOLDER/", help="folder the list's paths are in")
    parser.add_argument("listfile", metavar="LISTFILE", help="lines of 'image annotation'")
    parser.add_argument("db", metavar="DB_NAME", help="the database folder to create")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    n = create_annoset(args.root, args.listfile, args.db, anno_type=args.anno_type,
                       label_type=args.label_type, label_map_file=args.label_map_file,
                       check_label=args.check_label, min_dim=args.min_dim,
                       max_dim=args.max_dim, resize=(args.resize_height, args.resize_width),
                       check_size=args.check_size, encoded=args.encoded,
                       encode_type=args.encode_type, shuffle=args.shuffle, seed=args.seed,
                       gray=args.gray, backend=args.backend)
    get_logger().info("Wrote %d records.", n)
    return 0
