"""Reading Caffe's protobuf files (text prototxt and binary), the NetState include/exclude
rules, and the implicit Split layers Caffe inserts for blobs with several consumers."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import TypeVar

from google.protobuf import message, text_format

from purine.errors import ProtoError
from purine.formats import caffe_pb2 as pb
from purine.formats.files import BINARY_LIMIT, TEXT_LIMIT, read_bounded
from purine.formats.fork_fields import renumber_net
from purine.formats.upgrade import net_needs_upgrade, upgrade_net, upgrade_net_input

M = TypeVar("M", bound=message.Message)

BINARY_SUFFIXES = (".caffemodel", ".binaryproto", ".solverstate", ".pb")


def is_repeated(field) -> bool:
    """Whether a protobuf field descriptor is a repeated field, on every supported protobuf
    (``is_repeated`` since 6; ``label`` before, and gone in 7)."""
    repeated = getattr(field, "is_repeated", None)
    if repeated is None:
        repeated = field.label == field.LABEL_REPEATED
    return bool(repeated)


def parse_text(text: str, msg: M, filename: str = "<string>") -> M:
    try:
        text_format.Merge(text, msg)
    except text_format.ParseError as e:
        line, col = e.GetLine(), e.GetColumn()
        where = f"{filename}:{line}:{col}" if line else filename
        reason = str(e).split(" : ", 1)[-1]
        raise ProtoError(f"{where}: {reason}") from None
    check_strings(msg, filename)
    return msg


def check_strings(msg: message.Message, filename: str, prefix: str = "") -> None:
    """Refuse a string field that holds a NUL character (every path and name Caffe reads is
    a C string, which ends at the first NUL) or, in a binary file, bytes that are not UTF-8
    (protobuf hands those back as bytes); the error names the field."""
    for fd, value in msg.ListFields():
        if fd.type not in (fd.TYPE_MESSAGE, fd.TYPE_STRING):
            continue
        single = isinstance(value, str | bytes | message.Message)
        for i, v in enumerate([value] if single else value):
            where = prefix + fd.name + ("" if single else f"[{i}]")
            if fd.type == fd.TYPE_MESSAGE:
                check_strings(v, filename, where + ".")
            elif isinstance(v, bytes):
                raise ProtoError(f"{filename}: field {where} is not UTF-8 text ({v[:40]!r})")
            elif "\0" in v:
                raise ProtoError(f"{filename}: field {where} holds a NUL character ({v!r}); "
                                 "paths and names cannot contain one")


def _read_bytes(path: str, limit: int) -> bytes:
    return read_bounded(path, limit, error=ProtoError)


def read_binary(path: str | os.PathLike, msg: M, what: str = "") -> M:
    """Parse the binary protobuf file ``path`` into ``msg``, whatever its suffix; errors
    call the file ``what`` (default: the message's name)."""
    path = os.fspath(path)
    return parse_binary(_read_bytes(path, BINARY_LIMIT), msg, path, what)


def parse_binary(data: bytes, msg: M, path: str, what: str = "") -> M:
    """``read_binary`` of bytes already read from ``path`` (which the errors name)."""
    if isinstance(msg, pb.NetParameter):
        # layers written by Caffe forks whose field numbers clash with BVLC's
        data = renumber_net(data)
    try:
        msg.ParseFromString(data)
    except message.DecodeError as e:
        raise ProtoError(f"{path}: not a binary {what or msg.DESCRIPTOR.name} ({e})") from None
    check_strings(msg, path)
    return msg


def read_text(path: str | os.PathLike, msg: M) -> M:
    """Parse the text protobuf file ``path`` into ``msg``, whatever its suffix."""
    path = os.fspath(path)
    try:
        text = _read_bytes(path, TEXT_LIMIT).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtoError(
            f"{path}: not a text {msg.DESCRIPTOR.name} (binary data); binary files should "
            f"end in {', '.join(BINARY_SUFFIXES)}") from None
    return parse_text(text, msg, path)


def read_message(path: str | os.PathLike, msg: M) -> M:
    """Read ``path`` into ``msg``: binary for Caffe's binary suffixes, else text."""
    if os.fspath(path).endswith(BINARY_SUFFIXES):
        return read_binary(path, msg)
    return read_text(path, msg)


def read_net(source: str | os.PathLike | pb.NetParameter) -> pb.NetParameter:
    """A NetParameter from a file path, a prototxt string, or a NetParameter (copied)."""
    if isinstance(source, pb.NetParameter):
        net = pb.NetParameter()
        net.CopyFrom(source)
    elif isinstance(source, str) and not os.path.exists(source) and (
        "\n" in source or "{" in source
    ):
        net = parse_text(source, pb.NetParameter(), "<string>")
    else:
        net = read_message(source, pb.NetParameter())
        try:
            return _upgrade(net)
        except ProtoError as e:  # the upgrade names the net, not its file
            raise ProtoError(f"{os.fspath(source)}: {e}") from None
    return _upgrade(net)


def _upgrade(net: pb.NetParameter) -> pb.NetParameter:
    if net_needs_upgrade(net):
        net = upgrade_net(net)
    return upgrade_net_input(net)


# -- NetState rules ------------------------------------------------------------------------
def state_meets_rule(state: pb.NetState, rule: pb.NetStateRule) -> bool:
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(s not in stages for s in rule.stage):
        return False
    return not any(s in stages for s in rule.not_stage)


def filter_net(net: pb.NetParameter, state: pb.NetState) -> pb.NetParameter:
    """Keep the layers whose include/exclude rules admit ``state`` (Caffe's FilterNet)."""
    out = pb.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    for layer in net.layer:
        if layer.include and layer.exclude:
            raise ProtoError(
                f"layer '{layer.name}': specify either include or exclude rules, not both")
        if layer.include:
            keep = any(state_meets_rule(state, r) for r in layer.include)
        else:
            keep = not any(state_meets_rule(state, r) for r in layer.exclude)
        if keep:
            out.layer.add().CopyFrom(layer)
    return out


# -- implicit splits -----------------------------------------------------------------------
def split_layer_name(layer: str, blob: str, top_index: int) -> str:
    return f"{blob}_{layer}_{top_index}_split"


def split_blob_name(layer: str, blob: str, top_index: int, split_index: int) -> str:
    return f"{blob}_{layer}_{top_index}_split_{split_index}"


def insert_splits(net: pb.NetParameter) -> pb.NetParameter:
    """Give every top consumed by several bottoms a Split layer with one top per consumer,
    named as Caffe names them, so that the gradient of such a blob is the sum of its
    consumers' gradients."""
    last_top: dict[str, tuple[int, int]] = {}
    source: dict[tuple[int, int], tuple[int, int]] = {}
    consumers: dict[tuple[int, int], int] = defaultdict(int)
    loss_weight: dict[tuple[int, int], float] = {}
    names: dict[int, str] = {}
    for i, layer in enumerate(net.layer):
        names[i] = layer.name
        for j, bottom in enumerate(layer.bottom):
            if bottom not in last_top:
                raise ProtoError(
                    f"layer '{layer.name}' (type {layer.type}): unknown bottom blob "
                    f"'{bottom}' (bottom {j}); no earlier layer has it as a top")
            source[(i, j)] = last_top[bottom]
            consumers[last_top[bottom]] += 1
        for j, top in enumerate(layer.top):
            last_top[top] = (i, j)
            if j < len(layer.loss_weight) and layer.loss_weight[j]:
                loss_weight[(i, j)] = layer.loss_weight[j]
                consumers[(i, j)] += 1  # the loss counts as one consumer
    if all(c <= 1 for c in consumers.values()):
        return net
    out = pb.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    next_split: dict[tuple[int, int], int] = defaultdict(int)
    for i, layer in enumerate(net.layer):
        new = out.layer.add()
        new.CopyFrom(layer)
        for j, bottom in enumerate(layer.bottom):
            src = source[(i, j)]
            if consumers[src] > 1:
                new.bottom[j] = split_blob_name(names[src[0]], bottom, src[1], next_split[src])
                next_split[src] += 1
        for j, top in enumerate(layer.top):
            n = consumers[(i, j)]
            if n <= 1:
                continue
            split = pb.LayerParameter(
                name=split_layer_name(layer.name, top, j), type="Split", bottom=[top],
                top=[split_blob_name(layer.name, top, j, k) for k in range(n)])
            w = loss_weight.get((i, j), 0.0)
            if w:
                # The loss moves to the split's first top, as in Caffe.
                split.loss_weight.extend([w] + [0.0] * (n - 1))
                new.ClearField("loss_weight")
                next_split[(i, j)] += 1
            out.layer.add().CopyFrom(split)
    return out


DATA_LAYER_TYPES = ("Data", "ImageData", "HDF5Data", "MemoryData", "WindowData", "Python")


def is_data_layer(layer: pb.LayerParameter) -> bool:
    """A layer that reads a dataset: a data type, or a Python layer with no bottoms (one with
    bottoms computes, as pycaffe's loss layers do)."""
    return layer.type in DATA_LAYER_TYPES and not (layer.type == "Python" and layer.bottom)


def replace_data_layers(net: pb.NetParameter, shapes: dict[str, tuple[int, ...]]
                        ) -> pb.NetParameter:
    """The net with each data layer replaced by an Input layer whose tops get ``shapes``
    (by top name): a stand-in for timing or testing a net without its dataset."""
    out = pb.NetParameter()
    out.CopyFrom(net)
    for layer in out.layer:
        if not is_data_layer(layer):
            continue
        missing = [t for t in layer.top if t not in shapes]
        if missing:
            raise ProtoError(f"layer '{layer.name}' ({layer.type}): no stand-in shape for "
                             f"top(s) {', '.join(missing)}")
        stand_in = pb.LayerParameter(
            name=layer.name, type="Input", top=list(layer.top), include=list(layer.include),
            exclude=list(layer.exclude))
        stand_in.input_param.shape.extend(pb.BlobShape(dim=shapes[t]) for t in layer.top)
        layer.CopyFrom(stand_in)
    return out
