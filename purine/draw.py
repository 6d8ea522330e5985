"""Pictures of a net as Graphviz dot text: the bi-graph (blobs as ellipses, ops as boxes,
forward / backward / solver ops each in a colour of their own) or Caffe's layer view (layers
as boxes joined by their blobs, as Caffe's draw_net.py). ``dot`` renders .svg/.png."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from purine.caffe.facts import facts
from purine.errors import PurineError, run_reporting
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import atomic_write
from purine.formats.prototxt import (
    filter_net,
    is_data_layer,
    read_net,
    replace_data_layers,
    state_meets_rule,
)

if TYPE_CHECKING:
    from purine.caffe.net import NetBuilder
    from purine.caffe.solver import Solver
    from purine.graph import Graph, Op


class DrawError(PurineError):
    """A picture that cannot be drawn or written: names the file and what is missing."""


_PHASES = {"TRAIN": pb.TRAIN, "TEST": pb.TEST}
TEXT_SUFFIXES = (".dot", ".gv")
RENDERED = ("svg", "png", "pdf")

# Op groups in drawing order: (cluster name, label, fill colour).
OP_GROUPS = (("forward", "forward", "#cfe2ff"), ("backward", "backward", "#f8d7da"),
             ("solver", "solver update", "#d1e7dd"), ("other", "other", "#eeeeee"))
COLOUR_NAMES = {"#cfe2ff": "blue", "#f8d7da": "red", "#d1e7dd": "green", "#eeeeee": "grey"}
BLOB_COLOURS = {"data": "#ffffff", "param": "#fff3cd", "diff": "#e2e3e5",
                "solver": "#d1e7dd", "scratch": "#f8f9fa"}
# Caffe's draw_net colour of a type that declares none (purine.caffe.facts: ``colour``).
LAYER_DEFAULT_COLOUR = "#6495ED"


def quote(text: str) -> str:
    """A dot string: quotes and backslashes escaped, line breaks as dot's ``\\n``."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(**kw: str) -> str:
    return "[" + ", ".join(f"{k}={quote(v)}" for k, v in kw.items()) + "]"


def _shape(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


# -- the bi-graph -------------------------------------------------------------------------
def _op_label(op: Op) -> str:
    # Layer ops are named "layer/Type"; the type is repeated only where the name lacks it.
    last = op.name.rsplit("/", 1)[-1]
    return op.name if last.split("#")[0] == op.type else f"{op.name}\n{op.type}"


def graph_dot(graph: Graph, groups: Mapping[str, Sequence[Op]], *, name: str = "net",
              title: str = "", blob_kinds: Mapping[str, str] | None = None,
              rankdir: str = "LR", clusters: bool = False) -> str:
    """Dot text of ``graph``: every blob and op; ops listed in ``groups`` (keys of
    OP_GROUPS) get that group's colour and ``class`` (in a cluster of their own with
    ``clusters``: tidy groups, but the data flow is easier to follow without); the rest
    are "other"."""
    kinds = dict(blob_kinds or {})
    group_of: dict[int, str] = {}
    for key, ops in groups.items():
        for op in ops:
            group_of.setdefault(id(op), key)
    legend = ", ".join(f"{label} ops {COLOUR_NAMES[colour]}" for key, label, colour
                       in OP_GROUPS if key in groups)
    label = f"{title}\n{legend}" if title else legend
    lines = [f"digraph {quote(name)} {{",
             f"  graph {_attrs(rankdir=rankdir, label=label, labelloc='t', fontsize='14')};",
             '  node [fontname="Helvetica", fontsize="10"];',
             '  edge [fontname="Helvetica", fontsize="9"];']
    for b in graph.blobs.values():
        kind = kinds.get(b.name, "data")
        lines.append(f"  {quote('blob:' + b.name)} "
                     + _attrs(label=f"{b.name}\n{_shape(b.shape)}", shape="ellipse",
                              style="filled", fillcolor=BLOB_COLOURS[kind], **{"class": kind}))
    for key, label, colour in OP_GROUPS:
        members = [op for op in graph.ops if group_of.get(id(op), "other") == key]
        if not members:
            continue
        indent = "  "
        if clusters:
            lines.append(f"  subgraph {quote('cluster_' + key)} {{")
            lines.append(f"    graph {_attrs(label=f'{label} ops', style='rounded,dashed')};")
            indent = "    "
        for op in members:
            lines.append(f"{indent}{quote('op:' + op.name)} "
                         + _attrs(label=_op_label(op), shape="box", style="filled",
                                  fillcolor=colour, **{"class": key}))
        if clusters:
            lines.append("  }")
    for op in graph.ops:
        o = quote("op:" + op.name)
        for b in op.inputs:
            if b not in op.outputs:
                lines.append(f"  {quote('blob:' + b.name)} -> {o};")
        for b in op.outputs:
            # An in-place op reads and writes the blob: one edge with two heads.
            extra = " [dir=both]" if b in op.inputs else ""
            lines.append(f"  {o} -> {quote('blob:' + b.name)}{extra};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _blob_kinds(b: NetBuilder) -> dict[str, str]:
    kinds: dict[str, str] = {}
    data = {blob.name for blob in b.data.values()}
    params = {p.name for L in b.layers for p in L.params}
    for name in b.graph.blobs:
        if name.startswith("solver/"):
            kinds[name] = "solver"
        elif name in params:
            kinds[name] = "param"
        elif name.endswith("@diff"):
            kinds[name] = "diff"
        elif name in data:
            kinds[name] = "data"
        else:
            kinds[name] = "scratch"
    return kinds


def op_groups(b: NetBuilder, solver: Solver | None = None) -> dict[str, list[Op]]:
    """The net's ops by role: forward (layer order), backward (loss seeds, then layers in
    reverse), solver (the update subgraph, and iter_size's zero / accumulate ops)."""
    groups = {"forward": [op for L in b.layers for op in L.forward_ops],
              "backward": list(b.seed_ops) + [op for L in reversed(b.layers)
                                              for op in L.backward_ops]}
    if solver is not None:
        groups["solver"] = list(solver.update_ops) + list(solver.zero_ops) \
            + list(solver.accumulate_ops)
    return groups


def net_dot(builder: NetBuilder, solver: Solver | None = None, *, rankdir: str = "LR",
            clusters: bool = False) -> str:
    """The bi-graph of a built net (``Net.builder``); with ``solver``, whose train net it
    is, the update ops too."""
    name = builder.param.name
    what = "with solver update" if solver is not None else pb.Phase.Name(builder.phase)
    title = f"net '{name}' ({what}): blobs ellipses, ops boxes"
    return graph_dot(builder.graph, op_groups(builder, solver), name=name or "net",
                     title=title, blob_kinds=_blob_kinds(builder), rankdir=rankdir,
                     clusters=clusters)


# -- Caffe's layer view -------------------------------------------------------------------
def layer_colour(layer_type: str) -> str:
    """Caffe's draw_net fill colour of a layer type, as the type declares it."""
    return facts(layer_type).colour or LAYER_DEFAULT_COLOUR


def _layer_label(lp: pb.LayerParameter) -> str:
    # The type's declared label adds its lines (a convolution's window, num_output ...).
    label = facts(lp.type).label
    return "\n".join([lp.name, f"({lp.type})", *(label(lp) if label else [])])


def _phases(lp: pb.LayerParameter) -> frozenset[int]:
    """The phases whose nets hold layer ``lp`` (its include / exclude rules by phase)."""
    out = set()
    for phase in (pb.TRAIN, pb.TEST):
        state = pb.NetState(phase=phase)
        if lp.include:
            keep = any(state_meets_rule(state, r) for r in lp.include)
        else:
            keep = not any(state_meets_rule(state, r) for r in lp.exclude)
        if keep:
            out.add(phase)
    return frozenset(out)


def layers_dot(param: pb.NetParameter, *, phase: int | None = None, rankdir: str = "LR"
               ) -> str:
    """Caffe's layer view: a box per layer (of ``phase``, else every layer), an edge per
    blob from the layer that last wrote it to each reader, labelled with the blob's name;
    blobs no layer reads end in an ellipse. Without a phase, layers of different phases
    writing one blob (a TRAIN and a TEST data layer) are alternatives, both drawn."""
    if phase is not None:
        param = filter_net(param, pb.NetState(phase=phase))
    suffix = f" ({pb.Phase.Name(phase)})" if phase is not None else ""
    title = f"net '{param.name}'{suffix}: layers"
    lines = [f"digraph {quote(param.name or 'net')} {{",
             f"  graph {_attrs(rankdir=rankdir, label=title, labelloc='t', fontsize='16')};",
             '  node [fontname="Helvetica", fontsize="10"];',
             '  edge [fontname="Helvetica", fontsize="9"];']
    # blob -> the nodes holding its current value, with the phases each is in
    writers: dict[str, list[tuple[str, frozenset[int]]]] = {}
    read: set[tuple[str, str]] = set()  # (blob, writer node) pairs some layer reads
    for i, lp in enumerate(param.layer):
        node, phases = quote(f"layer:{i}:{lp.name}"), _phases(lp)
        colour = layer_colour(lp.type)
        lines.append(f"  {node} " + _attrs(label=_layer_label(lp), shape="box", style="filled",
                                           fillcolor=colour, **{"class": "layer"}))
        for b in lp.bottom:
            if b not in writers:  # read before any layer writes it: a net input
                src = quote(f"blob:{b}")
                writers[b] = [(src, frozenset((pb.TRAIN, pb.TEST)))]
                lines.append(f"  {src} " + _attrs(label=b, shape="ellipse",
                                                  **{"class": "blob"}))
            for src, where in writers[b]:
                if where & phases:
                    read.add((b, src))
                    lines.append(f"  {src} -> {node} {_attrs(label=b)};")
        for t in lp.top:
            kept = [(n, w) for n, w in writers.get(t, []) if not w & phases]
            writers[t] = kept + [(node, phases)]
    for t, held in writers.items():
        unread = [src for src, _ in held if (t, src) not in read and src.startswith('"layer:')]
        if unread:
            out = quote(f"output:{t}")
            lines.append(f"  {out} " + _attrs(label=t, shape="ellipse", style="filled",
                                              fillcolor="#ffffff", **{"class": "output"}))
            lines += [f"  {src} -> {out};" for src in unread]
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- building what is drawn ---------------------------------------------------------------
def _stand_ins(param: pb.NetParameter, stand_in: Mapping[str, Sequence[int]]
               ) -> pb.NetParameter:
    return replace_data_layers(param, {k: tuple(v) for k, v in stand_in.items()}) \
        if stand_in else param


def _build_hint(e: PurineError, param: pb.NetParameter) -> DrawError:
    data = [lp for lp in param.layer if is_data_layer(lp)]
    hint = ""
    if data:
        tops = sorted({t for lp in data for t in lp.top})
        hint = ("; to draw a net whose data sources are not at hand, give stand-in shapes "
                "for its data layers' tops, e.g. " + " ".join(
                    f"--stand_in {t}=N,..." for t in tops) + ", or use --layers")
    return DrawError(f"cannot build the net: {e}{hint}")


def build_net(model: str | os.PathLike | pb.NetParameter, phase: int,
              stand_in: Mapping[str, Sequence[int]] | None = None) -> NetBuilder:
    """The graph of the net for ``phase`` (no arrays are allocated), data layers replaced
    by Input layers of ``stand_in`` shapes."""
    from purine.caffe.net import NetBuilder

    param = _stand_ins(read_net(model), stand_in or {})
    try:
        return NetBuilder(param, phase)
    except PurineError as e:
        raise _build_hint(e, param) from None


def _train_net_param(sp: pb.SolverParameter, path: str) -> pb.NetParameter:
    given = [f for f in ("net", "net_param", "train_net", "train_net_param") if sp.HasField(f)]
    if len(given) != 1:
        raise DrawError(f"solver {path}: give exactly one of net, net_param, train_net, "
                        f"train_net_param (found: {', '.join(given) or 'none'})")
    value = getattr(sp, given[0])
    if isinstance(value, pb.NetParameter):
        return read_net(value)
    # Relative to the working directory as in Caffe, else to the solver's folder.
    alt = os.path.join(os.path.dirname(path), value)
    if not os.path.isabs(value) and not os.path.exists(value) and os.path.exists(alt):
        value = alt
    return read_net(value)


def build_solver(path: str | os.PathLike, stand_in: Mapping[str, Sequence[int]] | None = None
                 ) -> Solver:
    """A Solver over the train net of solver prototxt ``path``; test nets are left out
    (they share the train net's parameters and add no update ops)."""
    from purine.caffe.solver import Solver, read_solver

    path = os.fspath(path)
    sp = read_solver(path)
    net = _stand_ins(_train_net_param(sp, path), stand_in or {})
    for f in ("net", "train_net", "train_net_param", "test_net", "test_net_param",
              "test_iter", "test_state"):
        sp.ClearField(f)
    sp.net_param.CopyFrom(net)
    try:
        return Solver(sp, path=path)
    except PurineError as e:
        raise _build_hint(e, net) from None


# -- writing ------------------------------------------------------------------------------
def write(text: str, output: str | os.PathLike) -> None:
    """Write dot ``text`` to ``output``: as is for .dot/.gv, rendered by Graphviz's ``dot``
    for .svg/.png/.pdf (written whole or not at all)."""
    path = os.fspath(output)
    suffix = os.path.splitext(path)[1].lower()
    if suffix in TEXT_SUFFIXES:
        data = text.encode("utf-8")
    elif suffix[1:] in RENDERED:
        data = render(text, suffix[1:], where=path,
                      instead="write a .dot file and render it elsewhere")
    else:
        names = [*TEXT_SUFFIXES, *("." + r for r in RENDERED)]
        raise DrawError(f"{path}: the output must end in {', '.join(names[:-1])} or "
                        f"{names[-1]}")
    try:
        atomic_write(path, data)
    except OSError as e:
        raise DrawError(f"{path}: cannot write: {e.strerror}") from None


def render(text: str, fmt: str, *, where: str, instead: str,
           missing: type[DrawError] = DrawError) -> bytes:
    """Dot ``text`` rendered by Graphviz's ``dot`` in format ``fmt`` (png, svg, ...).
    Errors name ``where``; without Graphviz, ``missing`` says to install it or ``instead``."""
    dot = shutil.which("dot")
    if dot is None:
        raise missing(f"{where}: rendering .{fmt} needs Graphviz's 'dot' program, which is "
                      "not installed; install Graphviz (e.g. apt-get install graphviz, brew "
                      f"install graphviz) or {instead}")
    done = subprocess.run([dot, f"-T{fmt}"], input=text.encode("utf-8"), capture_output=True,
                          check=False)
    if done.returncode != 0:
        why = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise DrawError(f"{where}: dot -T{fmt} failed (exit {done.returncode}): "
                        f"{why[0] if why else 'no message'}")
    return done.stdout


def draw(output: str | os.PathLike, *, model: str | os.PathLike | None = None,
         solver: str | os.PathLike | None = None, phase: int | None = None,
         layers: bool = False, stand_in: Mapping[str, Sequence[int]] | None = None,
         rankdir: str = "LR", clusters: bool = False) -> str:
    """Draw ``model`` (built for ``phase``, default TRAIN) or the train net of ``solver``
    with its update ops; ``layers``: Caffe's layer view instead of the bi-graph (of the
    layers of ``phase``, default all). Returns the dot text."""
    from purine.caffe.solver import read_solver

    if (model is None) == (solver is None):
        raise DrawError("give either --model or --solver")
    if layers:
        if solver is not None:
            path = os.fspath(solver)
            param, phase = _train_net_param(read_solver(path), path), pb.TRAIN
        else:
            param = read_net(model)
        text = layers_dot(param, phase=phase, rankdir=rankdir)
    elif solver is not None:
        s = build_solver(solver, stand_in)
        text = net_dot(s.net.builder, s, rankdir=rankdir, clusters=clusters)
    else:
        net = build_net(model, pb.TRAIN if phase is None else phase, stand_in)
        text = net_dot(net, rankdir=rankdir, clusters=clusters)
    write(text, output)
    return text


# -- the command --------------------------------------------------------------------------
def _stand_in(text: str) -> tuple[str, tuple[int, ...]]:
    name, _, dims = text.partition("=")
    try:
        shape = tuple(int(d) for d in dims.split(",") if d.strip())
    except ValueError:
        shape = ()
    if not name or not shape or min(shape) < 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not NAME=D1,D2,... (e.g. "
                                         "data=64,1,28,28)")
    return name, shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``draw --model PROTOTXT [--phase TRAIN|TEST] | --solver S  [--layers] OUT``."""
    if parser.description is None:
        parser.description = (
            "Draw a net as Graphviz dot: its bi-graph (blobs as ellipses, ops as boxes; "
            "forward, backward and, with --solver, solver update ops each in a colour of "
            "their own) or, with --layers, Caffe's layer view. OUT ending in .svg/.png/.pdf "
            "is rendered with Graphviz's dot.")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("-model", "--model", default=None, help="the net prototxt")
    which.add_argument("-solver", "--solver", default=None,
                       help="a solver prototxt: draw its train net with the update ops")
    parser.add_argument("-phase", "--phase", default=None, type=str.upper,
                        choices=sorted(_PHASES),
                        help="the phase of --model (default: TRAIN; with --layers, every "
                             "layer, as Caffe's draw_net)")
    parser.add_argument("-layers", "--layers", action="store_true",
                        help="Caffe's layer view: layers as boxes, blobs as edges")
    parser.add_argument("-clusters", "--clusters", action="store_true",
                        help="put forward, backward and solver ops in boxes of their own")
    parser.add_argument("-stand_in", "--stand_in", action="append", type=_stand_in,
                        default=[], metavar="BLOB=D1,D2,...",
                        help="replace the data layers by Input layers, this top with this "
                             "shape (repeat per top), to draw without the datasets")
    parser.add_argument("-rankdir", "--rankdir", default="LR", choices=["LR", "TB", "RL", "BT"],
                        help="the direction of the drawing (default LR, as Caffe's draw_net)")
    parser.add_argument("output", metavar="OUT", help="OUT.dot, OUT.svg or OUT.png")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    phase = None if args.phase is None else _PHASES[args.phase]
    draw(args.output, model=args.model, solver=args.solver, phase=phase,
         layers=args.layers, stand_in=dict(args.stand_in), rankdir=args.rankdir,
         clusters=args.clusters)
    print(f"drew {args.model or args.solver} -> {args.output}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draw")
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors and --help: argparse has printed why
        return e.code if isinstance(e.code, int) else 2
    return run_reporting("draw", lambda: args.run(args))


if __name__ == "__main__":
    sys.exit(main())
