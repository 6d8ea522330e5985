"""What the converter tests share: a hand-written PNG encoder (an oracle independent of
OpenCV for channel order), an image-folder fixture builder, LMDB reading, a log catcher."""

import logging
import struct
import zlib

import cv2
import lmdb
import numpy as np

from purine.formats import caffe_pb2 as pb


def write_png_rgb(path, rgb):
    """An 8-bit RGB PNG written from the PNG spec alone (rows with filter byte 0)."""
    h, w, _ = rgb.shape

    def chunk(kind, body):
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))

    raw = b"".join(b"\x00" + bytes(rgb[y].astype(np.uint8).ravel()) for y in range(h))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


def make_imageset(root, n=5, shape=(6, 5), seed=0):
    """``n`` BGR images under ``root`` (PNG, one JPEG, one name with a space) and the list
    file; returns (list path, [(relative name, label, BGR array as written)])."""
    rng = np.random.default_rng(seed)
    names = ["a/img0.png", "a/img1.png", "b/img 2.png", "b/img3.jpg", "c/img4.PNG",
             "c/img5.png", "c/img6.png"][:n]
    entries = []
    for i, name in enumerate(names):
        image = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        assert cv2.imwrite(str(path), image)
        entries.append((name, 10 + i, image))
    listfile = root / "list.txt"
    listfile.write_text("".join(f"{name} {label}\n" for name, label, _ in entries))
    return listfile, entries


def read_lmdb(path):
    """[(key bytes, value bytes)] in key order, read with the lmdb package alone."""
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        items = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    env.close()
    return items


def datums(path):
    out = []
    for key, value in read_lmdb(path):
        d = pb.Datum()
        d.ParseFromString(value)
        out.append((key.decode(), d))
    return out


def chw_bytes(image):
    """Caffe's CVMatToDatum layout written out as loops: data[(c*H + h)*W + w]."""
    if image.ndim == 2:
        image = image[:, :, None]
    h, w, c = image.shape
    out = bytearray(c * h * w)
    for y in range(h):
        for x in range(w):
            for ch in range(c):
                out[(ch * h + y) * w + x] = int(image[y, x, ch])
    return bytes(out)


class Lines(logging.Handler):
    """A logger whose messages land in ``.lines``."""

    def __init__(self, name="converter-test"):
        super().__init__()
        self.lines = []
        self.log = logging.getLogger(name)
        self.log.handlers[:] = [self]
        self.log.setLevel(logging.INFO)
        self.log.propagate = False

    def emit(self, record):
        self.lines.append(record.getMessage())


# A DummyData net small enough for the command tests (train, test, the display line).
TINY_NET = """name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label" dummy_data_param {
  shape { dim: 4 dim: 1 dim: 4 dim: 4 } shape { dim: 4 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
