"""Binary NetParameters written by Caffe forks whose LayerParameter numbers clash with BVLC's
or with each other: before parsing, such a layer's field is renumbered to the field this
schema gives it, decided by the layer's ``type`` (text prototxts need nothing: names decide)."""

from __future__ import annotations

from purine.formats import caffe_pb2 as pb
from purine.formats.wire import WireError, read_varint, varint
from purine.formats.wire import fields as wire_fields

# (number the fork writes, layer types that mean it, field name in proto/caffe.proto).
# A rule fires only inside a layer of one of those types, so the same number keeps its
# BVLC meaning everywhere else (143 is input_param in an Input layer, interp_param in
# DeepLab's Interp layer).
FORK_NUMBERS: tuple[tuple[int, frozenset[str], str], ...] = (
    # DeepLab v2 (deeplab-public-ver2): 143 is BVLC's input_param.
    (143, frozenset({"Interp"}), "interp_param"),
    # OpenCV's merged schema: 147 / 148 are BVLC's swish_param / clip_param.
    (147, frozenset({"DetectionOutput"}), "detection_output_param"),
    (148, frozenset({"Permute"}), "permute_param"),
    # SSD (weiliu89/caffe): 201 is OpenCV's proposal_param; 203 / 206 are the SSD
    # fork's own numbers for what OpenCV numbers 150 / 149.
    (201, frozenset({"MultiBoxLoss"}), "multibox_loss_param"),
    (203, frozenset({"PriorBox"}), "prior_box_param"),
    (206, frozenset({"Normalize", "NormalizeBBox"}), "norm_param"),
    # SegNet (137 is BVLC's embed_param) and YOLOv3 ports (149 / 150).
    (137, frozenset({"Upsample"}), "upsample_param"),
    (149, frozenset({"Upsample"}), "upsample_param"),
    (150, frozenset({"Upsample"}), "upsample_param"),
    # ShuffleNet forks that use 159 instead of 164.
    (159, frozenset({"ShuffleChannel"}), "shuffle_channel_param"),
    # daijifeng001/caffe-rfcn (OpenCV and py-R-FCN use 10002).
    (10001, frozenset({"PSROIPooling"}), "psroi_pooling_param"),
)

_NET_LAYER = 100  # NetParameter.layer
_LAYER_TYPE = 2  # LayerParameter.type


def _table() -> dict[str, dict[int, int]]:
    """{layer type: {fork number: number here}}, numbers read from the generated schema."""
    fields = pb.LayerParameter.DESCRIPTOR.fields_by_name
    out: dict[str, dict[int, int]] = {}
    for number, types, name in FORK_NUMBERS:
        for t in types:
            out.setdefault(t, {})[number] = fields[name].number
    return out


_BY_TYPE: dict[str, dict[int, int]] | None = None


def _renumber_layer(layer: memoryview) -> bytes | None:
    """The layer with its fork numbers moved, or None when nothing applies."""
    fields = list(wire_fields(layer))
    ltype = None
    for number, wire, _, value, end in fields:
        if number == _LAYER_TYPE and wire == 2:
            _, body = read_varint(layer, value)
            ltype = bytes(layer[body:end]).decode("utf-8", "replace")
    moves = _BY_TYPE.get(ltype) if ltype is not None else None  # type: ignore[union-attr]
    if not moves or not any(f[0] in moves for f in fields):
        return None
    parts: list[bytes | memoryview] = []
    for number, wire, start, value, end in fields:
        if number in moves:
            parts += [varint(moves[number] << 3 | wire), layer[value:end]]
        else:
            parts.append(layer[start:end])
    return b"".join(parts)


def renumber_net(data: bytes) -> bytes:
    """A binary NetParameter with every layer's fork-numbered fields moved to this schema's
    numbers (see FORK_NUMBERS); ``data`` itself when no layer needs it or when it does not
    scan as protobuf (the parser then reports the damage)."""
    global _BY_TYPE
    if _BY_TYPE is None:
        _BY_TYPE = _table()
    view = memoryview(data)
    try:
        fields = list(wire_fields(view))
        parts: list[bytes | memoryview] = []
        changed = False
        for number, wire, start, value, end in fields:
            if number == _NET_LAYER and wire == 2:
                _, body = read_varint(view, value)
                new = _renumber_layer(view[body:end])
                if new is not None:
                    parts += [view[start:value], varint(len(new)), new]
                    changed = True
                    continue
            parts.append(view[start:end])
    except WireError:  # not protobuf: the parser reports the damage
        return data
    return b"".join(parts) if changed else data
