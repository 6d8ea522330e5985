"""Test databases written with the lmdb package and caffe_pb2.Datum directly, a plain
per-element transcription of Caffe's DataTransformer::Transform loops as the reference, and
data-layer nets with the batches they give."""

from __future__ import annotations

import os

import cv2
import lmdb
import numpy as np

from purine.caffe import TRAIN, Net
from purine.caffe.net import NetBuilder
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net
from purine.runtime import Dispatcher


def raw_datum(img: np.ndarray, label: int = 0) -> pb.Datum:
    """(C, H, W) uint8 -> a raw Datum; float arrays go to float_data."""
    c, h, w = img.shape
    if img.dtype == np.uint8:
        return pb.Datum(channels=c, height=h, width=w, data=img.tobytes(), label=label)
    d = pb.Datum(channels=c, height=h, width=w, label=label)
    d.float_data.extend(img.astype(np.float32).ravel().tolist())
    return d


def encoded_datum(img_hwc: np.ndarray, label: int = 0, ext: str = ".png") -> pb.Datum:
    ok, buf = cv2.imencode(ext, img_hwc)
    assert ok
    h, w = img_hwc.shape[:2]
    c = 1 if img_hwc.ndim == 2 else img_hwc.shape[2]
    return pb.Datum(channels=c, height=h, width=w, data=buf.tobytes(), label=label,
                    encoded=True)


def write_lmdb(path: str | os.PathLike, records: list) -> str:
    """records: Datum messages (keyed 00000000, 00000001, ...) or (key, bytes) pairs."""
    path = os.fspath(path)
    env = lmdb.open(path, map_size=1 << 28)
    with env.begin(write=True) as txn:
        for i, r in enumerate(records):
            key, value = (r if isinstance(r, tuple)
                          else (f"{i:08d}".encode(), r.SerializeToString()))
            txn.put(key, value)
    env.close()
    return path


def write_mean(path: str | os.PathLike, mean: np.ndarray, legacy: bool = True) -> str:
    """A .binaryproto mean: legacy num/channels/height/width (as compute_image_mean writes)
    or a BlobShape."""
    blob = pb.BlobProto()
    if legacy:
        c, h, w = mean.shape
        blob.num, blob.channels, blob.height, blob.width = 1, c, h, w
    else:
        blob.shape.dim.extend(mean.shape)
    blob.data.extend(mean.astype(np.float32).ravel().tolist())
    with open(path, "wb") as f:
        f.write(blob.SerializeToString())
    return os.fspath(path)


def data_layer(db, batch: int = 4, transform: str = "", tops=("data", "label"), extra: str = "",
               backend: str | None = "LMDB") -> str:
    """A Data layer over ``db``; backend None leaves data_param.backend unset."""
    tops = " ".join(f'top: "{t}"' for t in tops)
    b = f"backend: {backend}" if backend else ""
    return (f'layer {{ name: "data" type: "Data" {tops} data_param {{ source: "{db}" {b} '
            f"batch_size: {batch} {extra} }} transform_param {{ {transform} }} }}")


def data_net(db, phase: int = TRAIN, seed: int = 0, dtype: str = "float32", **kw) -> Net:
    return Net(data_layer(db, **kw), phase=phase, seed=seed, dtype=dtype)


def batches(net: Net, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (data, label) tops of ``n`` forward passes."""
    out = []
    for _ in range(n):
        net.forward()
        out.append((net.blobs["data"].data.copy(), net.blobs["label"].data.copy()))
    return out


def train_step(solver) -> tuple[np.ndarray, np.ndarray]:
    """One solver iteration; the data and label it trained on."""
    solver.step(1)
    return solver.net.blobs["data"].data.copy(), solver.net.blobs["label"].data.copy()


def replica_labels(text: str, r: int, n_replicas: int, n: int) -> list[list[int]]:
    """The labels of ``n`` batches that replica ``r`` of ``n_replicas`` reads through the
    data layer ``text``."""
    b = NetBuilder(read_net(text), TRAIN, replica=(r, n_replicas))
    d = Dispatcher(b.graph)
    ops = [op for L in b.layers for op in L.forward_ops]
    out = []
    for _ in range(n):
        d.run(ops)
        out.append(d.array(b.data["label"]).astype(int).tolist())
    return out


def images(n: int, shape=(3, 8, 9), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n,) + tuple(shape), dtype=np.uint8)


def caffe_transform(datum: np.ndarray, *, crop: int = 0, h_off: int = 0, w_off: int = 0,
                    mirror: bool = False, mean: np.ndarray | None = None,
                    mean_values=None, scale: float = 1.0, dtype=np.float32) -> np.ndarray:
    """DataTransformer<Dtype>::Transform(const Datum&, Dtype*) element by element."""
    t = np.dtype(dtype).type
    channels, dh, dw = datum.shape
    data = datum.ravel()
    height, width = (crop, crop) if crop else (dh, dw)
    out = np.zeros(channels * height * width, dtype)
    flat_mean = None if mean is None else mean.astype(dtype).ravel()
    mv = None
    if mean_values is not None:
        mv = [t(np.float32(v)) for v in mean_values]
        if len(mv) == 1:
            mv = mv * channels
    s = t(np.float32(scale))
    for c in range(channels):
        for h in range(height):
            for w in range(width):
                data_index = (c * dh + h_off + h) * dw + w_off + w
                top_index = (c * height + h) * width + ((width - 1 - w) if mirror else w)
                element = t(data[data_index])
                if flat_mean is not None:
                    out[top_index] = (element - flat_mean[data_index]) * s
                elif mv is not None:
                    out[top_index] = (element - mv[c]) * s
                else:
                    out[top_index] = element * s
    return out.reshape(channels, height, width)


def match_transform(sample: np.ndarray, datum: np.ndarray, phase_train: bool, **kw
                    ) -> tuple[int, int, bool]:
    """The (h_off, w_off, mirror) for which Caffe's loops give ``sample`` exactly, trying
    every offset the phase allows (random in TRAIN, the centre in TEST); fails if none."""
    crop = kw.get("crop", 0)
    _, dh, dw = datum.shape
    if crop and phase_train:
        offsets = [(h, w) for h in range(dh - crop + 1) for w in range(dw - crop + 1)]
    elif crop:
        offsets = [((dh - crop) // 2, (dw - crop) // 2)]
    else:
        offsets = [(0, 0)]
    mirrors = [False, True] if kw.pop("mirror", False) else [False]
    for h, w in offsets:
        for m in mirrors:
            ref = caffe_transform(datum, h_off=h, w_off=w, mirror=m, **kw)
            if ref.dtype == sample.dtype and np.array_equal(ref, sample):
                return h, w, m
    raise AssertionError(f"no crop offset / mirror of Caffe's Transform gives this sample "
                         f"(tried {len(offsets)} offsets x {mirrors})")
