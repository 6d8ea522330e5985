"""pycaffe's ``caffe.draw``: a NetParameter as Caffe's draw_net.py draws it, a pydot graph of
layers (records coloured by type, in-place layers green) and blobs (octagons), rendered by
Graphviz's ``dot``. pydot is imported on first use, so ``import caffe.draw`` works without it."""

from __future__ import annotations

import os
from typing import Any

from purine.caffe.facts import facts
from purine.draw import LAYER_DEFAULT_COLOUR, DrawError, layer_colour, quote, render
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import atomic_write
from purine.formats.upgrade import upgrade_net

__all__ = ["BLOB_STYLE", "DrawError", "GraphvizMissingError", "LAYER_STYLE_DEFAULT",
           "NEURON_LAYER_STYLE", "NetDrawError", "PydotMissingError",
           "choose_color_by_layertype", "draw_net", "draw_net_to_file", "get_edge_label",
           "get_layer_label", "get_layer_lr_mult", "get_pooling_types_dict", "get_pydot_graph"]

# Node styles of Caffe's drawing.
LAYER_STYLE_DEFAULT = {"shape": "record", "fillcolor": LAYER_DEFAULT_COLOUR, "style": "filled"}
NEURON_LAYER_STYLE = {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}

RANKDIRS = ("LR", "TB", "BT", "RL")
EMPTY_LABEL = '""'


class PydotMissingError(DrawError, ImportError):
    """Drawing was asked for and pydot is not installed."""


class GraphvizMissingError(DrawError, OSError):
    """Rendering was asked for and Graphviz's ``dot`` is not on the PATH."""


class NetDrawError(DrawError, ValueError):
    """A net or an argument that Caffe's drawing refuses (a ValueError, as in Caffe)."""


def _pydot() -> Any:
    try:
        import pydot
    except ImportError:
        raise PydotMissingError("caffe.draw needs the pydot package to build the graph; "
                                "install it: pip install pydot (or purine-caffe[draw])") from None
    return pydot


def get_pooling_types_dict() -> dict[int, str]:
    """PoolingParameter's methods by number: ``{0: 'MAX', 1: 'AVE', 2: 'STOCHASTIC'}``."""
    return {v.number: v.name for v in pb.PoolingParameter.PoolMethod.DESCRIPTOR.values}


def get_edge_label(layer: pb.LayerParameter) -> str:
    """The label of a layer's top edges: ``Batch N`` for Data, ``num_output`` for
    the convolutions (depthwise too) and InnerProduct, else the empty dot string ``""``."""
    if layer.type == "Data":
        return f"Batch {layer.data_param.batch_size}"
    num_output = facts(layer.type).num_output  # the learning layers declare theirs
    return EMPTY_LABEL if num_output is None else str(num_output(layer))


def get_layer_lr_mult(layer: pb.LayerParameter) -> tuple[float, float]:
    """``(weight, bias)`` learning-rate multipliers of a Convolution, Deconvolution or
    InnerProduct layer; 1.0 where its ``param`` entries leave them unset."""
    if facts(layer.type).num_output is None:
        raise NetDrawError(f"layer '{layer.name}': {layer.type} layers have no learning rate "
                           "multiplier")
    if len(layer.param) > 2:
        raise NetDrawError(f"layer '{layer.name}' ({layer.type}): {len(layer.param)} param "
                           "entries; expected at most 2 (weights, bias)")
    # ParamSpec.lr_mult defaults to 1, as does a param entry that is not there.
    mults = [p.lr_mult for p in layer.param] + [1.0] * (2 - len(layer.param))
    return mults[0], mults[1]


def get_layer_label(layer: pb.LayerParameter, rankdir: str, display_lrm: bool = False) -> str:
    """The node label, as a quoted dot string: name, ``(type)`` (``(Pooling MAX)`` ...),
    ``kernel size:``, ``stride:`` and ``pad:`` for window layers and, with ``display_lrm``,
    ``lr mult: w, b`` for learning layers whose multipliers are not both 0. Parts are
    separated by dot's line break for LR/RL drawings, by spaces for TB/BT ones."""
    sep = " " if rankdir in ("TB", "BT") else "\\n"
    kind = layer.type
    if kind == "Pooling":
        kind += " " + get_pooling_types_dict()[layer.pooling_param.pool]
    parts = [quote(layer.name)[1:-1], f"({quote(kind)[1:-1]})"]
    window = facts(layer.type).window  # kernel, stride, pad of a window layer
    if window is not None:
        kernel, stride, pad = window(layer)
        parts.append(sep.join([f"kernel size: {kernel}", f"stride: {stride}", f"pad: {pad}"]))
    if display_lrm and facts(layer.type).num_output is not None:
        weight, bias = get_layer_lr_mult(layer)
        if weight or bias:
            parts.append(f"lr mult: {weight:.1f}, {bias:.1f}")
    return '"' + sep.join(parts) + '"'


def choose_color_by_layertype(layertype: str) -> str:
    """Caffe's fill colour for a layer type: red for (de)convolution, orange for pooling,
    purple for inner product, blue otherwise."""
    return layer_colour(layertype)


def _in_phase(layer: pb.LayerParameter, phase: int) -> bool:
    """Whether Caffe's drawing keeps ``layer`` for ``phase``: its include rules name the phase
    (or it has none) and no exclude rule does. A rule without a phase matches every phase."""
    if layer.include and layer.exclude:
        raise NetDrawError(f"layer '{layer.name}' has both include and exclude rules; give "
                           "one kind")

    def names_phase(rule: pb.NetStateRule) -> bool:
        return not rule.HasField("phase") or rule.phase == phase

    if layer.include:
        return any(names_phase(r) for r in layer.include)
    return not any(names_phase(r) for r in layer.exclude)


def get_pydot_graph(caffe_net: pb.NetParameter, rankdir: str, label_edges: bool = True,
                    phase: int | None = None, display_lrm: bool = False) -> Any:
    """A ``pydot.Dot`` of the net's layers (of ``phase``; every layer when None): a record
    per layer named by its label, a node per blob, an edge from each bottom blob to its layer
    and from the layer to each top blob, the latter labelled by ``get_edge_label`` when
    ``label_edges``. V0/V1 nets (``layers`` entries) are upgraded first."""
    pydot = _pydot()
    if rankdir not in RANKDIRS:
        raise NetDrawError(f"rankdir '{rankdir}': expected one of {', '.join(RANKDIRS)}")
    if not hasattr(caffe_net, "layer"):
        raise NetDrawError(f"caffe.draw: expected a caffe_pb2.NetParameter, got "
                           f"{type(caffe_net).__name__} (read a prototxt with "
                           "text_format.Merge first)")
    net = upgrade_net(caffe_net, problems=[]) if len(caffe_net.layers) else caffe_net
    graph = pydot.Dot(net.name or "Net", graph_type="digraph", rankdir=rankdir)
    # A blob's node keeps its first place but takes the style of its last mention: a blob
    # some layer reads is an octagon, an output a plain ellipse (Caffe's drawing).
    nodes: dict[tuple[str, str], Any] = {}
    edges: list[tuple[tuple[str, str], tuple[str, str], str]] = []
    for layer in net.layer:
        if phase is not None and not _in_phase(layer, phase):
            continue
        key = ("layer", f"{layer.name}\0{layer.type}")
        in_place = len(layer.bottom) == 1 and list(layer.top) == list(layer.bottom)
        style = NEURON_LAYER_STYLE if in_place else {
            **LAYER_STYLE_DEFAULT, "fillcolor": choose_color_by_layertype(layer.type)}
        nodes[key] = pydot.Node(get_layer_label(layer, rankdir, display_lrm), **style)
        for name in layer.bottom:
            # Quoted here: pydot would read "a:b" as node a, port b.
            nodes[("blob", name)] = pydot.Node(quote(name), **BLOB_STYLE)
            edges.append((("blob", name), key, EMPTY_LABEL))
        label = get_edge_label(layer) if label_edges else EMPTY_LABEL
        for name in layer.top:
            nodes[("blob", name)] = pydot.Node(quote(name))
            edges.append((key, ("blob", name), label))
    for node in nodes.values():
        graph.add_node(node)
    # Edges join the nodes as finally kept (a layer name and type drawn twice is one node).
    for src, dst, label in edges:
        graph.add_edge(pydot.Edge(nodes[src], nodes[dst], label=label))
    return graph


def draw_net(caffe_net: pb.NetParameter, rankdir: str, ext: str = "png",
             phase: int | None = None, display_lrm: bool = False) -> bytes:
    """The drawing of ``caffe_net`` in Graphviz output format ``ext`` (png, svg, pdf, ...);
    ``raw``: the dot text itself, without Graphviz."""
    graph = get_pydot_graph(caffe_net, rankdir, phase=phase, display_lrm=display_lrm)
    text = graph.to_string()
    if ext == "raw":
        return text.encode("utf-8")
    return render(text, ext, where="caffe.draw", instead="ask for ext 'raw' to get the dot text",
                  missing=GraphvizMissingError)


def draw_net_to_file(caffe_net: pb.NetParameter, filename: str | os.PathLike,
                     rankdir: str = "LR", phase: int | None = None,
                     display_lrm: bool = False) -> None:
    """Draw ``caffe_net`` into ``filename`` in the format its extension names (``.png``,
    ``.svg``, ...; ``.raw`` writes the dot text)."""
    path = os.fspath(filename)
    ext = os.path.splitext(path)[1][1:]
    if not ext:
        raise NetDrawError(f"{path}: the file name needs an extension naming the format "
                           "(.png, .svg, .pdf, .raw ...)")
    data = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    try:
        atomic_write(path, data)
    except OSError as e:
        raise DrawError(f"{path}: cannot write: {e.strerror}") from None
