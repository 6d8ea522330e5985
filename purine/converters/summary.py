"""``caffemodel_summary``: a readable table of a .caffemodel's layers (name, type, parameter
blob shapes and counts, the total); given the net prototxt too, the net is built and each
layer's top shapes are shown beside the file's blobs, with any blob the net disagrees with."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

import numpy as np

from purine.converters import flag, run_main
from purine.converters.caffemodel_npz import layer_type, legacy_shape_match
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import blob_arrays, read_caffemodel
from purine.formats.prototxt import read_net

_PHASES = {"TRAIN": pb.TRAIN, "TEST": pb.TEST}


def shape_text(shape: Sequence[int]) -> str:
    """``20x1x5x5``; a scalar is ``()``."""
    return "x".join(str(d) for d in shape) if len(shape) else "()"


def _table(header: Sequence[str], rows: list[list[str]], numeric: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [list(header)] + rows) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in numeric else c.ljust(w)
               for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


class _FileLayer:
    """One layer of the caffemodel: its type, blob arrays and which blobs share a name."""

    def __init__(self, layer: pb.LayerParameter | pb.V1LayerParameter, path: str):
        self.name, self.type = layer.name, layer_type(layer)
        self.arrays = blob_arrays(layer.blobs, f"{path}: layer '{layer.name}'")
        specs = list(layer.param)
        self.share_names = [specs[k].name if k < len(specs) else ""
                            for k in range(len(self.arrays))]


def _count(arrays: Sequence[np.ndarray], share_names: Sequence[str], seen: set[str]
           ) -> tuple[int, bool]:
    """Parameters of ``arrays`` not counted before (a blob shared by ParamSpec name counts
    once, as it is one blob in the net), and whether any was shared."""
    n, shared = 0, False
    for a, name in zip(arrays, share_names):
        if name and name in seen:
            shared = True
            continue
        if name:
            seen.add(name)
        n += int(a.size)
    return n, shared


def summarize(caffemodel: str | os.PathLike, model: str | os.PathLike | None = None, *,
              phase: int = pb.TEST) -> str:
    """The summary table as text (see the module docstring)."""
    path = os.fspath(caffemodel)
    net = read_caffemodel(path)
    layers = [_FileLayer(lp, path) for lp in list(net.layer) + list(net.layers)]
    if model is None:
        return _summary_file(path, net.name, layers)
    return _summary_net(path, net.name, layers, model, phase)


def _summary_file(path: str, name: str, layers: list[_FileLayer]) -> str:
    rows, seen, total = [], set(), 0
    for fl in layers:
        n, shared = _count(fl.arrays, fl.share_names, seen)
        total += n
        blobs = ", ".join(shape_text(a.shape) for a in fl.arrays) or "-"
        rows.append([fl.name, fl.type, blobs, str(n) + (" (shared)" if shared else "")])
    with_params = sum(1 for fl in layers if fl.arrays)
    lines = [f"{path}: net '{name}', {len(layers)} layers, {with_params} with parameters", ""]
    lines += _table(["layer", "type", "blobs", "params"], rows, {3})
    lines += ["", f"total parameters: {total}"]
    return "\n".join(lines) + "\n"


def _summary_net(path: str, name: str, layers: list[_FileLayer],
                 model: str | os.PathLike, phase: int) -> str:
    from purine.caffe.net import NetBuilder

    builder = NetBuilder(read_net(model), phase)
    in_file = {fl.name: fl for fl in layers}
    rows, seen, total, notes = [], set(), 0, 0
    built = [L for L in builder.layers if L.type != "Split"]
    for L in built:
        tops = ", ".join(f"{t} {shape_text(builder.data[t].shape)}" for t in L.param.top)
        fl = in_file.get(L.name)
        note = ""
        if fl is None or not fl.arrays:
            arrays, share_names = [], []
            blobs = "-"
            if L.params:
                note = "not in the file; net: " + ", ".join(shape_text(p.shape)
                                                            for p in L.params)
        else:
            arrays, share_names = fl.arrays, fl.share_names
            blobs = ", ".join(shape_text(a.shape) for a in arrays)
            want = [p.shape for p in L.params]
            have = [a.shape for a in arrays]
            if len(have) != len(want) or any(
                    h != w and (math.prod(h) != math.prod(w) or not legacy_shape_match(h, w))
                    for h, w in zip(have, want)):
                note = "net expects " + (", ".join(shape_text(w) for w in want) or "none")
        n, shared = _count(arrays, share_names, seen)
        total += n
        notes += bool(note)
        rows.append([L.name, L.type, tops or "-", blobs, str(n) + (" (shared)" if shared
                                                                   else ""), note])
    net_names = {L.name for L in built}
    extra = [fl for fl in layers if fl.name not in net_names and fl.arrays]
    extra_total = 0
    for fl in extra:
        n, shared = _count(fl.arrays, fl.share_names, seen)
        extra_total += n
        rows.append([fl.name, fl.type, "-", ", ".join(shape_text(a.shape) for a in fl.arrays),
                     str(n) + (" (shared)" if shared else ""), "not in the net"])
    phase_name = pb.Phase.Name(phase)
    lines = [f"{path}: net '{name}', {len(layers)} layers in the file; "
             f"{os.fspath(model)} ({phase_name}): {len(built)} layers, "
             f"{sum(1 for L in built if L.params)} with parameters", ""]
    header = ["layer", "type", "tops", "blobs (file)", "params", ""]
    if not notes and not extra:
        header, rows = header[:-1], [r[:-1] for r in rows]
    lines += _table(header, rows, {4})
    lines += ["", f"total parameters: {total}"]
    if extra_total:
        lines[-1] += f" (and {extra_total} in layers the net lacks)"
    return "\n".join(lines) + "\n"


# -- the command --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``caffemodel_summary IN.caffemodel [--model PROTOTXT] [--phase TEST]``."""
    if parser.description is None:
        parser.description = ("Print a table of a .caffemodel's layers: type, parameter blob "
                              "shapes and counts, the total. With --model, also each "
                              "layer's top shapes from building the net.")
    parser.add_argument("input", metavar="IN.caffemodel", help="the binary caffemodel")
    flag(parser, "model", default=None, help="the net prototxt, to show top shapes")
    flag(parser, "phase", default="TEST", type=str.upper, choices=sorted(_PHASES),
         help="the phase the --model net is built in (default TEST)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(summarize(args.input, args.model, phase=_PHASES[args.phase]))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("caffemodel_summary", add_arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
