"""Caffe's net set-up log: the INFO lines Net::Init writes while it builds a net (the rules that
dropped layers, the filtered net's text, each layer's bottoms, tops, top shapes and running
memory total, which layers need a backward pass, the outputs), for a Net's first build."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from google.protobuf import text_encoding
from google.protobuf.message import Message

from purine.errors import one_line
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import filter_net, is_repeated
from purine.log import get_logger

if TYPE_CHECKING:
    from purine.caffe.layer import LayerBuild


class NetBuilder(Protocol):
    """What the log reads of purine.caffe.net's NetBuilder (named here, not imported: the
    builder imports this module)."""

    param: pb.NetParameter  # the filtered net with Caffe's splits, as built
    layers: list[LayerBuild]
    layer_need: list[bool]  # Caffe's backward verdicts per layer, before force_backward
    dtype: str
    replica: tuple[int, int]


# -- the filtered net's text, as protobuf's C++ DebugString prints it ------------------------
def _number(value: float, short: int, full: int, kind: type) -> str:
    """C++ protobuf's SimpleFtoa / SimpleDtoa: %g with 6 (15) digits where that reads back
    as the same value, else 9 (17); Python's text format would print ``1.0`` for ``1``."""
    text = f"{value:.{short}g}"
    if np.isfinite(value) and kind(text) != kind(value):
        text = f"{value:.{full}g}"
    return text


def _scalar(field: Any, value: Any) -> str:
    if field.cpp_type == field.CPPTYPE_ENUM:
        known = field.enum_type.values_by_number.get(value)
        return known.name if known is not None else str(value)
    if field.cpp_type == field.CPPTYPE_STRING:
        return '"' + text_encoding.CEscape(value, False) + '"'
    if field.cpp_type == field.CPPTYPE_BOOL:
        return "true" if value else "false"
    if field.cpp_type == field.CPPTYPE_FLOAT:
        return _number(value, 6, 9, np.float32)
    if field.cpp_type == field.CPPTYPE_DOUBLE:
        return _number(value, 15, 17, float)
    return str(value)


def debug_string(message: Message, indent: int = 0) -> str:
    """``message`` in protobuf text format as C++'s ``DebugString()`` writes it (fields in
    number order, two-space indents, C escapes, C++'s float digits)."""
    pad, out = " " * indent, []
    for field, value in message.ListFields():
        for v in value if is_repeated(field) else [value]:
            if field.cpp_type == field.CPPTYPE_MESSAGE:
                out.append(f"{pad}{field.name} {{\n{debug_string(v, indent + 2)}{pad}}}\n")
            else:
                out.append(f"{pad}{field.name}: {_scalar(field, v)}\n")
    return "".join(out)


# -- the lines --------------------------------------------------------------------------------
def _unmet(state: pb.NetState, rule: pb.NetStateRule, layer: str) -> str | None:
    """Why ``rule`` does not hold for ``state``, in Caffe's words (its first reason); None
    where it holds. Caffe prints the phase as its enum number and says "above" for the
    min_level too."""
    where = f"specified by a rule in layer {layer}"
    if rule.HasField("phase") and rule.phase != state.phase:
        return f"The NetState phase ({state.phase}) differed from the phase ({rule.phase}) {where}"
    if rule.HasField("min_level") and state.level < rule.min_level:
        return (f"The NetState level ({state.level}) is above the min_level "
                f"({rule.min_level}) {where}")
    if rule.HasField("max_level") and state.level > rule.max_level:
        return (f"The NetState level ({state.level}) is above the max_level "
                f"({rule.max_level}) {where}")
    for s in rule.stage:
        if s not in state.stage:
            return f"The NetState did not contain stage '{s}' {where}"
    for s in rule.not_stage:
        if s in state.stage:
            return f"The NetState contained a not_stage '{s}' {where}"
    return None


def filter_lines(param: pb.NetParameter, state: pb.NetState) -> list[str]:
    """A line per rule that Caffe's FilterNet checks and finds unmet, in its order: exclude
    rules until one holds, then include rules until one holds."""
    lines = []
    for layer in param.layer:
        included = not layer.include
        for rule in layer.exclude:
            why = _unmet(state, rule, layer.name)
            if why is None:
                included = False
                break
            lines.append(why)
        for rule in layer.include if not included else ():
            why = _unmet(state, rule, layer.name)
            if why is None:
                break
            lines.append(why)
    return lines


def header(param: pb.NetParameter, state: pb.NetState) -> str:
    """``Initializing net from parameters:`` and the filtered net with the state it was built
    for (its level shown where the model sets it or it is not 0: Caffe's solver nets omit a
    level left at 0, its ``Net(file, phase)`` shows it)."""
    shown = filter_net(param, state)
    shown.state.Clear()
    shown.state.MergeFrom(param.state)
    shown.state.phase = state.phase
    if state.level or param.state.HasField("level"):
        shown.state.level = state.level
    shown.state.stage[:] = state.stage
    if not shown.debug_info:  # a solver sets the field on its train net; Caffe's text lacks it
        shown.ClearField("debug_info")
    # glog ends a message with one newline; the text brings its own
    return "Initializing net from parameters: \n" + debug_string(shown).removesuffix("\n")


def creating_lines(lp: pb.LayerParameter) -> list[str]:
    """The lines before a layer's set-up: its creation (the layer factory's line and the
    net's), then its bottoms and tops."""
    name = lp.name
    lines = [f"Creating layer {name}", f"Creating Layer {name}"]
    lines += [f"{name} <- {b}" for b in lp.bottom]
    lines += [f"{name} -> {t}" + (" (in-place)" if t in lp.bottom else "") for t in lp.top]
    return lines


def set_up_lines(L: LayerBuild, memory: int, itemsize: int,
                 owners: dict[str, tuple[str, int]]) -> tuple[list[str], int]:
    """The lines after layer ``L``'s set-up and the running memory total after its tops:
    Caffe adds count x sizeof(Dtype) for every top, in-place tops and Split tops included.
    ``owners``: the shared parameter names seen so far (name -> layer, index)."""
    lp, name = L.param, L.param.name
    lines = [f"Setting up {name}"]
    for j, top in enumerate(L.tops):
        count = int(np.prod(top.shape, dtype=np.int64))
        lines.append("Top shape: " + "".join(f"{d} " for d in top.shape) + f"({count})")
        weight = L.loss_weights[j] if j < len(L.loss_weights) else 0.0
        if weight:
            lines.append(f"    with loss weight {weight:g}")
        memory += count * itemsize
    lines.append(f"Memory required for data: {memory}")
    for k in range(len(L.params)):
        share = lp.param[k].name if k < len(lp.param) else ""
        if share in owners:
            owner, index = owners[share]
            lines.append(f"Sharing parameters '{share}' owned by layer '{owner}', param "
                         f"index {index}")
        elif share:
            owners[share] = (name, k)
    return lines, memory


def closing_lines(builder: NetBuilder) -> list[str]:
    """Caffe's verdicts on the backward pass, last layer first, as its backward analysis
    (the builder's, before force_backward) left them; then the net's outputs (tops no later
    layer reads, in name order) and the closing line."""
    lines = []
    for L, need in zip(reversed(builder.layers), reversed(builder.layer_need)):
        lines.append(f"{L.param.name} " + ("needs backward computation." if need
                                           else "does not need backward computation."))
    available: set[str] = set()
    for L in builder.layers:
        available.difference_update(L.param.bottom)
        available.update(L.param.top)
    lines += [f"This network produces output {t}" for t in sorted(available)]
    lines.append("Network initialization done.")
    return lines


class _Hold(logging.Filter):
    """Keeps what the building thread logs, tagged with the layer being built, so that it
    goes out among that layer's set-up lines (other threads' lines pass)."""

    def __init__(self, builder: NetBuilder):
        super().__init__()
        self.builder, self.thread = builder, threading.get_ident()
        self.records: list[tuple[int, logging.LogRecord]] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if threading.get_ident() != self.thread:
            return True
        self.records.append((len(self.builder.layers), record))
        return False


@contextmanager
def setup_log(builder: NetBuilder, param: pb.NetParameter, state: pb.NetState,
              on: bool) -> Iterator[None]:
    """Around ``builder``'s build from ``param`` for ``state``: Caffe's set-up lines at INFO
    through the project's logger (so ``caffe.init_log(1)`` or a quiet rank silences them),
    where ``on`` (a Net's first build) and the build is the first replica's. The layers'
    own lines go out in their place among them; a build that fails ends its lines at the
    layer that failed, as Caffe's log ends there."""
    log = get_logger()
    if not on or builder.replica[0] != 0 or not log.isEnabledFor(logging.INFO):
        yield
        return
    for line in filter_lines(param, state):
        log.info("%s", one_line(line))
    log.info("%s", header(param, state))
    hold = _Hold(builder)
    log.addFilter(hold)
    built = False
    try:
        yield
        built = True
    finally:
        log.removeFilter(hold)
        _write(log, builder, hold.records, built)


def _write(log: logging.Logger, builder: NetBuilder,
           records: list[tuple[int, logging.LogRecord]], built: bool) -> None:
    def out(items: list[str], i: int | None = None) -> None:
        for line in items:  # a name with a newline in it keeps its line whole
            log.info("%s", one_line(line))
        for at, record in records if i is not None else ():
            if at == i:  # stamped now, so that the log's times never run backwards
                record.created = time.time()
                log.handle(record)

    memory, itemsize = 0, np.dtype(builder.dtype).itemsize
    owners: dict[str, tuple[str, int]] = {}
    for i, L in enumerate(builder.layers):
        out(creating_lines(L.param), i)  # then what the layer's builder logged
        lines, memory = set_up_lines(L, memory, itemsize, owners)
        out(lines)
    n = len(builder.layers)
    if not built and n < len(builder.param.layer):  # the layer whose build failed
        out(creating_lines(builder.param.layer[n]), n)
        return
    out([], n)  # logged after the last layer (while the backward pass was built)
    if built:
        out(closing_lines(builder))
