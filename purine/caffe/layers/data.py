"""Builders of the data layers (Data, ImageData, MemoryData, HDF5Data), and pycaffe's
``set_input_arrays`` for MemoryData. A builder opens its source to learn the top shapes
(Caffe infers them from the first record) and adds one forward op, with no inputs, that
writes the next prepared batch into the tops; the batch cursor is run-time state that
snapshots keep."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from purine.caffe import caffe_pb2 as pb
from purine.caffe.layer import LayerBuild, register
from purine.data import DataError
from purine.errors import PurineError
from purine.log import get_logger

if TYPE_CHECKING:
    from purine.caffe.net import Net
    from purine.data.memory import MemoryFeed
    from purine.data.prefetch import Prefetcher
    from purine.data.transformer import Transformer

# purine.data's modules import purine.caffe (for caffe_pb2), so this module, which
# purine.caffe imports, takes them when a builder runs rather than at import.

_SKIP = 0x5C1B  # the rand_skip draw's stream, apart from the batches' transform streams
_LEGACY_TRANSFORM = ("scale", "mean_file", "crop_size", "mirror")


def _transformer(L: LayerBuild, legacy: pb.DataParameter | pb.ImageDataParameter | None = None,
                 force_color: bool = False) -> Transformer:
    from purine.data.transformer import Transformer

    param = pb.TransformationParameter()
    param.CopyFrom(L.param.transform_param)
    if force_color and not param.force_gray:  # DataParameter's older force_encoded_color
        param.force_color = True
    if legacy is not None:
        old = [f for f in _LEGACY_TRANSFORM if legacy.HasField(f)]
        if old:
            # Caffe upgrades these only in V1 nets and ignores them in a 'layer' entry.
            get_logger().warning("layer '%s': %s in %s are ignored, as Caffe ignores them; "
                                 "put them in transform_param", L.name, ", ".join(old),
                                 legacy.DESCRIPTOR.name)
    try:
        return Transformer(param, L.phase, L.net.dtype)
    except DataError as e:
        raise L.error(str(e)) from None


def _batch_size(L: LayerBuild, n: int, where: str) -> int:
    if n <= 0:
        raise L.error(f"{where}.batch_size must be positive, got {n}")
    return int(n)


def _skip(L: LayerBuild, rand_skip: int) -> int:
    """Caffe skips a random number in [0, rand_skip) of records once, at set-up."""
    if not rand_skip:
        return 0
    return int(np.random.default_rng([L.net.seed, L.index, _SKIP]).integers(rand_skip))


def _add_forward(L: LayerBuild, shapes: list[tuple[int, ...]],
                 source: Prefetcher | MemoryFeed) -> None:
    from purine.data import prefetch

    tops = [L.top(i, s) for i, s in enumerate(shapes)]
    L.forward(prefetch.fill_tops, [], tops, op_type=L.type, source=source)
    log = get_logger()
    log.info("output data size: %s", ",".join(str(d) for d in shapes[0]))


@register("Data")
def data_layer(L: LayerBuild):
    from purine.data import datum, lmdb_source, prefetch

    L.expect(0, (1, 2))
    p = L.param.data_param
    if p.backend != pb.DataParameter.LMDB:
        hint = ("convert the database to LMDB (convert_imageset --backend lmdb) and set "
                "'backend: LMDB'")
        if not p.HasField("backend") and os.path.exists(os.path.join(p.source, "data.mdb")):
            hint = (f"data_param.backend defaults to LEVELDB, but '{p.source}' is an LMDB: "
                    "add 'backend: LMDB' to data_param")
        raise L.error(f"backend LEVELDB is not supported; {hint}")
    if not p.source:
        raise L.error("data_param.source is empty; give the LMDB directory")
    batch = _batch_size(L, p.batch_size, "data_param")
    tf = _transformer(L, p, force_color=p.force_encoded_color)
    try:
        src = lmdb_source.LMDBSource(p.source)
        key, value = src.first()
        where = f"LMDB '{src.path}': record '{datum.show_key(key)}'"
        flag = datum.decode_flag(tf.force_color, tf.force_gray)
        image = datum.datum_image(datum.parse_datum(value, where), flag, where)
        shape = tf.output_shape(image.shape, where)
    except DataError as e:
        raise L.error(str(e)) from None
    get_logger().info("Opened lmdb %s", src.path)
    labels = len(L.param.top) > 1
    batches = lmdb_source.DatumBatches(
        src, batch, tf, shape, labels=labels, dtype=L.net.dtype, seed=L.net.seed,
        index=L.index, replica=L.net.replica, skip=_skip(L, p.rand_skip))
    source = prefetch.Prefetcher(batches.reader, p.prefetch, f"layer '{L.name}'")
    L.keep_state("cursor", source)
    _add_forward(L, [(batch,) + shape] + ([(batch,)] if labels else []), source)
    return None


@register("ImageData")
def image_data_layer(L: LayerBuild):
    from purine.data import image_list, prefetch

    L.expect(0, 2)
    p = L.param.image_data_param
    if (p.new_height > 0) != (p.new_width > 0):
        raise L.error(f"new_height ({p.new_height}) and new_width ({p.new_width}) must be set "
                      "together")
    if not p.source:
        raise L.error("image_data_param.source is empty; give the list file")
    batch = _batch_size(L, p.batch_size, "image_data_param")
    tf = _transformer(L, p)
    try:
        images = image_list.ImageList(
            p.source, root_folder=p.root_folder, is_color=p.is_color, new_height=p.new_height,
            new_width=p.new_width, shuffle=p.shuffle, seed=L.net.seed, index=L.index)
        skip = _skip(L, p.rand_skip)
        if skip >= len(images):
            raise L.error(f"rand_skip drew {skip} but '{p.source}' lists {len(images)} images: "
                          "not enough images to skip")
        entry = images.line(skip)
        shape = tf.output_shape(images.image(entry).shape, images.where(entry))
    except DataError as e:
        raise L.error(str(e)) from None
    batches = image_list.ImageBatches(images, batch, tf, shape, dtype=L.net.dtype,
                                      seed=L.net.seed, index=L.index, replica=L.net.replica,
                                      skip=skip)
    source = prefetch.Prefetcher(batches.reader, 4, f"layer '{L.name}'")
    L.keep_state("cursor", source)
    _add_forward(L, [(batch,) + shape, (batch,)], source)
    return None


@register("MemoryData")
def memory_data_layer(L: LayerBuild):
    from purine.data import memory

    L.expect(0, 2)
    p = L.param.memory_data_param
    dims = (p.batch_size, p.channels, p.height, p.width)
    if min(dims) <= 0:
        raise L.error(f"batch_size, channels, height and width must be specified and positive "
                      f"in memory_data_param, got {dims}")
    feed = memory.MemoryFeed(L.name, p.batch_size, dims[1:], L.net.dtype, _transformer(L),
                             seed=L.net.seed, index=L.index)
    L.keep_state("cursor", feed)
    _add_forward(L, [dims, (p.batch_size,)], feed)
    return None


@register("HDF5Data")
def hdf5_data_layer(L: LayerBuild):
    from purine.data import hdf5, prefetch

    L.expect(0, (1, None))
    p = L.param.hdf5_data_param
    if L.param.HasField("transform_param"):
        raise L.error("HDF5Data does not transform data; remove transform_param")
    if not p.source:
        raise L.error("hdf5_data_param.source is empty; give the list of .h5 files")
    batch = _batch_size(L, p.batch_size, "hdf5_data_param")
    try:
        src = hdf5.HDF5Source(p.source, list(L.param.top), shuffle=p.shuffle,
                              dtype=L.net.dtype, seed=L.net.seed, index=L.index)
    except DataError as e:
        raise L.error(str(e)) from None
    get_logger().info("Number of HDF5 files: %d", len(src.files))
    batches = hdf5.HDF5Batches(src, batch, replica=L.net.replica)
    source = prefetch.Prefetcher(batches.reader, 2, f"layer '{L.name}'")
    L.keep_state("cursor", source)
    _add_forward(L, [(batch,) + s for s in src.row_shapes], source)
    return None


# -- pycaffe's MemoryData feeding ---------------------------------------------------------
def _memory_feed(net: Net) -> tuple[LayerBuild, MemoryFeed]:
    for L in net.builder.layers:
        if L.type == "MemoryData":
            return L, net.builder.stateful[f"{L.name}/cursor"]
    raise PurineError(f"net '{net.model.name}' has no MemoryData layer to feed")


def set_input_arrays(net: Net, data: np.ndarray, labels: np.ndarray) -> None:
    """pycaffe's ``net.set_input_arrays(data, labels)``: feed the net's first MemoryData
    layer (N, C, H, W) data and N labels, N a multiple of its batch size; forward passes
    take consecutive batches, wrapping. As in Caffe, the arrays are not transformed."""
    L, feed = _memory_feed(net)
    if L.param.HasField("transform_param"):
        get_logger().warning("MemoryData layer '%s' does not transform array data on "
                             "set_input_arrays", L.name)
    feed.set_arrays(data, labels)


def add_images(net: Net, images: Sequence[np.ndarray], labels: Sequence[int]) -> None:
    """Caffe's MemoryDataLayer::AddMatVector: feed OpenCV images ((H, W) or (H, W, C)
    uint8, BGR), transformed by the layer's transform_param, and their labels."""
    _, feed = _memory_feed(net)
    feed.add_images(images, labels)
