"""Builders of the data layers (Data, ImageData, MemoryData, HDF5Data, WindowData), of
HDF5Output, and pycaffe's ``set_input_arrays`` for MemoryData. A builder opens its source
to learn the top shapes (Caffe infers them from the first record) and adds one forward op,
with no inputs, that writes the next prepared batch into the tops; the batch cursor is
run-time state that snapshots keep."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from purine.caffe.layer import LayerBuild, Settler, register
from purine.data import (
    DataError,
    datum,
    db,
    hdf5,
    image_list,
    lmdb_source,
    memory,
    prefetch,
    window,
)
from purine.data.memory import MemoryFeed
from purine.data.prefetch import Prefetcher
from purine.data.transformer import Transformer
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.log import get_logger

if TYPE_CHECKING:
    from purine.caffe.net import Net

_SKIP = 0x5C1B  # the rand_skip draw's stream, apart from the batches' transform streams
_LEGACY_TRANSFORM = ("scale", "mean_file", "crop_size", "mirror")


def _transformer(L: LayerBuild, legacy: pb.DataParameter | pb.ImageDataParameter | None = None,
                 force_color: bool = False) -> Transformer:
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


def _add_forward(L: LayerBuild, shapes: Sequence[tuple[int, ...]],
                 source: Prefetcher | MemoryFeed, log: bool = True) -> None:
    """The forward op writing ``source``'s batches into tops of ``shapes``. Data and
    ImageData shape each batch by its first record, as Caffe does: the pass settles their
    tops from the next batch."""
    tops = [L.top(i, s) for i, s in enumerate(shapes)]
    L.forward(prefetch.fill_tops, [], tops, op_type=L.type, source=source)
    if L.type in ("Data", "ImageData"):
        L.settles(_BatchShapes(source))
    if log:
        get_logger().info("output data size: %s", ",".join(str(d) for d in shapes[0]))


def _reuse(L: LayerBuild) -> bool:
    """In another build of the net (for other shapes) a data layer goes on reading from the
    first build's source: its forward op is made again over that source, for the batch
    shapes the pass settled or the first build's; nothing is opened or logged again."""
    source = L.kept("cursor")
    if source is None:
        return False
    shapes = L.decided() or [t.shape for t in L.net.base.layers[L.index].tops]
    _add_forward(L, shapes, source, log=False)
    return True


class _BatchShapes(Settler):
    """The top shapes of a Data or ImageData layer at each pass: its next batch's, which
    Caffe shapes by the batch's first record. It reads no bottom, so the net settles it
    without running the layers before it first."""

    reads_bottoms = False

    def __init__(self, source: Prefetcher):
        self.source = source

    def before(self, bottoms: list) -> tuple[tuple[int, ...], ...]:  # noqa: ARG002
        batch = self.source.peek()
        arrays = getattr(batch, "arrays", batch)  # a batch made for a GPU, or host arrays
        return tuple(tuple(a.shape) for a in arrays)


def _data_backend(L: LayerBuild, p: pb.DataParameter) -> str:
    """The backend data_param asks for (LEVELDB when unset, Caffe's default), unless the
    source holds another kind: Caffe would fail to open it, we read it as what it is and
    warn, so that a net written for an LMDB without 'backend: LMDB' runs."""
    asked = db.by_enum(p.backend)
    found = db.detect(p.source)
    setting = (pb.DataParameter.DB.Name(p.backend)
               + ("" if p.HasField("backend") else " (the default)"))
    if found is None:
        if not os.path.exists(p.source):
            return asked.name  # the source says it does not exist
        raise L.error(f"'{p.source}' is {db.neither()}; data_param.backend is {setting}")
    if found != asked.name:
        b = db.get(found)
        fix = ("Caffe has no such backend" if b.enum is None
               else f"add 'backend: {pb.DataParameter.DB.Name(b.enum)}' to data_param")
        get_logger().warning("layer '%s': data_param.backend is %s but '%s' is %s: reading "
                             "it as one (Caffe would not); %s", L.name, setting, p.source,
                             b.article, fix)
    return found


@register("Data", export="data")  # a deploy export's input
def data_layer(L: LayerBuild):
    L.expect(0, (1, 2))
    if _reuse(L):
        return None
    p = L.param.data_param
    if not p.source:
        raise L.error("data_param.source is empty; give the LMDB or LevelDB folder")
    backend = _data_backend(L, p)
    batch = _batch_size(L, p.batch_size, "data_param")
    tf = _transformer(L, p, force_color=p.force_encoded_color)
    try:
        src = db.open_source(p.source, backend)
        key, value = src.first()
        where = f"{src.kind} '{src.path}': record '{datum.show_key(key)}'"
        flag = datum.decode_flag(tf.force_color, tf.force_gray)
        image = datum.datum_image(datum.parse_datum(value, where), flag, where)
        shape = tf.output_shape(image.shape, where)
    except DataError as e:
        raise L.error(str(e)) from None
    get_logger().info("Opened %s %s", backend, src.path)
    labels = len(L.param.top) > 1
    batches = lmdb_source.DatumBatches(
        src, batch, tf, labels=labels, dtype=L.net.dtype, seed=L.net.seed,
        index=L.index, replica=L.net.replica, skip=_skip(L, p.rand_skip))
    source = prefetch.Prefetcher(batches.reader, p.prefetch, f"layer '{L.name}'")
    L.keep_state("cursor", source)
    _add_forward(L, [(batch,) + shape] + ([(batch,)] if labels else []), source)
    return None


@register("ImageData", export="data")  # a deploy export's input
def image_data_layer(L: LayerBuild):
    L.expect(0, 2)
    p = L.param.image_data_param
    if _reuse(L):
        return None
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
    batches = image_list.ImageBatches(images, batch, tf, dtype=L.net.dtype,
                                      seed=L.net.seed, index=L.index, replica=L.net.replica,
                                      skip=skip)
    source = prefetch.Prefetcher(batches.reader, 4, f"layer '{L.name}'")
    L.keep_state("cursor", source)
    _add_forward(L, [(batch,) + shape, (batch,)], source)
    return None


@register("MemoryData", export="data")  # a deploy export's input
def memory_data_layer(L: LayerBuild):
    L.expect(0, 2)
    p = L.param.memory_data_param
    if _reuse(L):
        return None
    dims = (p.batch_size, p.channels, p.height, p.width)
    if min(dims) <= 0:
        raise L.error(f"batch_size, channels, height and width must be specified and positive "
                      f"in memory_data_param, got {dims}")
    feed = memory.MemoryFeed(L.name, p.batch_size, dims[1:], L.net.dtype, _transformer(L),
                             seed=L.net.seed, index=L.index)
    L.keep_state("cursor", feed)
    _add_forward(L, [dims, (p.batch_size,)], feed)
    return None


@register("HDF5Data", export="data")  # a deploy export's input
def hdf5_data_layer(L: LayerBuild):
    L.expect(0, (1, None))
    if _reuse(L):
        return None
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


# -- WindowData and HDF5Output -------------------------------------------------------------
_WINDOW_LEGACY = ("mean_file", "crop_size", "mirror")  # read from transform_param instead


@register("WindowData", export="data")  # a deploy export's input
def window_data_layer(L: LayerBuild):
    L.expect(0, 2)
    p, tp = L.param.window_data_param, L.param.transform_param
    if _reuse(L):
        return None
    if not p.source:
        raise L.error("window_data_param.source is empty; give the window file")
    batch = _batch_size(L, p.batch_size, "window_data_param")
    log = get_logger()
    old = [f for f in _WINDOW_LEGACY if p.HasField(f)]
    if old:
        log.warning("layer '%s': %s in window_data_param are ignored, as Caffe ignores them; "
                    "put them in transform_param", L.name, ", ".join(old))
    if tp.HasField("scale"):
        log.warning("layer '%s': WindowData scales by window_data_param.scale; "
                    "transform_param.scale is ignored, as in Caffe", L.name)
    crop = int(tp.crop_size)
    if crop <= 0:
        raise L.error("WindowData needs transform_param.crop_size > 0, the size windows are "
                      "warped to")
    if p.crop_mode not in ("warp", "square"):
        raise L.error(f"window_data_param.crop_mode '{p.crop_mode}': expected 'warp' or "
                      "'square'")
    if crop - 2 * p.context_pad <= 0:
        raise L.error(f"context_pad {p.context_pad} leaves no room for the window in a crop of "
                      f"{crop}: expected 2 * context_pad < crop_size")
    if not 0 <= p.fg_fraction <= 1:
        raise L.error(f"window_data_param.fg_fraction is {p.fg_fraction:g}; expected a "
                      "fraction in [0, 1]")
    if not p.bg_threshold <= p.fg_threshold:
        raise L.error(f"bg_threshold {p.bg_threshold:g} is above fg_threshold "
                      f"{p.fg_threshold:g}; expected bg_threshold <= fg_threshold (windows "
                      "between them are left out)")
    if tp.HasField("mean_file") and len(tp.mean_value):
        raise L.error("transform_param: cannot specify mean_file and mean_value at the same "
                      "time")
    try:
        windows = window.read_window_file(p.source, p.root_folder)
        mean = datum.read_mean(tp.mean_file) if tp.HasField("mean_file") else None
        batches = window.WindowBatches(
            windows, batch, crop=crop, context_pad=p.context_pad,
            square=p.crop_mode == "square", mirror=tp.mirror, fg_threshold=p.fg_threshold,
            bg_threshold=p.bg_threshold, fg_fraction=p.fg_fraction, scale=p.scale, mean=mean,
            mean_file=tp.mean_file, mean_values=list(tp.mean_value),
            cache_images=p.cache_images, dtype=L.net.dtype, seed=L.net.seed, index=L.index,
            replica=L.net.replica)
    except DataError as e:
        raise L.error(str(e)) from None
    log.info("Number of images: %d", len(windows.images))
    for label, count in batches.class_counts().items():
        log.info("class %d has %d samples", label, count)
    source = prefetch.Prefetcher(batches.reader, 4, f"layer '{L.name}'")
    L.keep_state("cursor", source)
    _add_forward(L, [(batch, 3, crop, crop), (batch,)], source)
    return None


@register("HDF5Output")
def hdf5_output_layer(L: LayerBuild):
    L.expect(2, 0)
    data, label = L.bottom(0), L.bottom(1)
    for b in (data, label):
        if len(b.shape) > 4:
            raise L.error(f"bottom '{b.name}' {b.shape} has {len(b.shape)} axes; HDF5Output "
                          "writes Caffe's (num, channels, height, width), at most 4 axes")
    n_data, n_label = hdf5.legacy_shape(data.shape)[0], hdf5.legacy_shape(label.shape)[0]
    if n_data != n_label:
        raise L.error(f"data and label must have the same batch size; got {L.shapes()}")
    name = L.param.hdf5_output_param.file_name
    if not name:
        raise L.error("hdf5_output_param.file_name is empty; give the .h5 file to write")
    output = L.kept("output")  # another build of the net writes on to the same file
    if output is None:
        try:
            output = hdf5.HDF5Output(name)
        except DataError as e:
            raise L.error(str(e)) from None
        L.share("output", output)
    L.forward(hdf5.write_output, [data, label], [], op_type="HDF5Output", output=output)
    # Caffe's HDF5Output has no gradient: force_backward leaves it out, and a bottom
    # forced by propagate_down gets the zero gradient of a layer whose backward is empty.
    L.no_force_backward.update((0, 1))

    def backward():
        L.zero_diff(range(2), "HDF5OutputBackward")
    return backward
