"""Model parallelism from a placement file: where each layer of a Caffe net runs, and the
rewrite that splits a layer into towers (Krizhevsky's two-GPU AlexNet) so that each tower
sits at a location of its own; the engine then puts Copy ops on the edges between them.

A placement file lists layers with one location (the layer runs there) or several (the layer
is split into that many towers, tower k at the k-th location)::

    # a comment
    layer: "conv1" location: "cpu:0"
    layer { name: "conv2" location: "cpu:0" location: "cpu:1" }

A location is written as ``str(Location)`` writes it: ``cpu:1``, ``gpu:0/t2`` (worker thread
or stream 2), ``rank1/cpu:0`` (MPI rank 1). The word ``replicas`` stands for the locations of
the data-parallel replicas (hybrid parallelism, ``split_towers(..., replicas=...)``): a layer
given ``location: "replicas"`` is split into one tower per replica::

    layer { name: "fc6" location: "replicas" }
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from purine.backend import RandomStream, StreamPart, random_stream_key, stream_key
from purine.caffe.facts import CHANNELS, SplitRefused, TowerSplit, facts, types_with
from purine.errors import LayerError, ProtoError, PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import load_weights, save_net
from purine.formats.files import TEXT_LIMIT, read_bounded
from purine.formats.hdf5_snapshot import write_weights
from purine.formats.prototxt import filter_net, insert_splits, read_net
from purine.formats.weights import fit_shape, layer_arrays
from purine.graph import CPU, Location, Stateful

if TYPE_CHECKING:
    from purine.caffe.net import Net

REPLICAS = "replicas"  # a placement's word for the replicas' locations, one tower each
_LOCATION = re.compile(r"(?:rank(\d+)/)?(cpu|gpu):(\d+)(?:/t(\d+))?")
_TOKEN = re.compile(r'(?P<space>[ \t\r\n]+)|(?P<comment>#[^\n]*)|"(?P<string>[^"\n]*)"'
                    r'|(?P<word>[A-Za-z_]\w*)|(?P<punct>[:{}])')


# -- the placement file ---------------------------------------------------------------------
def parse_location(text: str) -> Location:
    """A Location from the form ``str(Location)`` writes: ``[rankH/](cpu|gpu):N[/tT]``."""
    m = _LOCATION.fullmatch(text.strip())
    if m is None:
        raise PurineError(f"bad location '{text}': expected [rankH/]cpu:N or [rankH/]gpu:N, "
                          "optionally followed by /tT (thread), e.g. \"cpu:1\", \"gpu:0/t1\"")
    host, device, index, thread = m.groups()
    return Location(device, int(index), int(thread or 0), int(host or 0))


def _tokens(text: str, path: str) -> list[tuple[str, str, int]]:
    """(kind, text, line) of each word, string and punctuation mark."""
    out, pos, line = [], 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            what = "unterminated string" if text[pos] == '"' else f"unexpected '{text[pos]}'"
            raise ProtoError(f"{path}:{line}: {what}")
        kind = m.lastgroup
        if kind in ("string", "word", "punct"):
            out.append((kind, m.group(kind), line))
        line += m.group(0).count("\n")
        pos = m.end()
    return out


def read_placement(path: str | os.PathLike, net_param: pb.NetParameter
                   ) -> dict[str, tuple[Location | str, ...]]:
    """The placement file at ``path`` for ``net_param`` (all phases): each layer it names
    with its locations (a Location, or REPLICAS), in file order. Errors name the file and
    line."""
    path = os.fspath(path)
    try:
        text = read_bounded(path, TEXT_LIMIT, error=ProtoError).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtoError(f"{path}: cannot read: {e}") from None
    known = [layer.name for layer in net_param.layer]
    toks = _tokens(text, path)
    out: dict[str, tuple[Location | str, ...]] = {}
    lines: dict[str, int] = {}
    i = 0

    def take(kind: str, value: str | None = None) -> tuple[str, int]:
        nonlocal i
        want = f"'{value}'" if value else ("a quoted string" if kind == "string" else kind)
        if i >= len(toks):
            last = toks[-1][2] if toks else 1
            raise ProtoError(f"{path}:{last}: expected {want}, found the end of the file")
        k, v, line = toks[i]
        if k != kind or (value is not None and v != value):
            shown = f'"{v}"' if k == "string" else f"'{v}'"
            raise ProtoError(f"{path}:{line}: expected {want}, found {shown}")
        i += 1
        return v, line

    def location() -> Location | str:
        take("punct", ":")
        text, line = take("string")
        if text == REPLICAS:
            return REPLICAS
        try:
            return parse_location(text)
        except PurineError as e:
            raise ProtoError(f"{path}:{line}: {e}") from None

    while i < len(toks):
        _, line = take("word", "layer")
        name, locs = None, []
        if i < len(toks) and toks[i][1] == "{":
            take("punct", "{")
            while i < len(toks) and toks[i][1] != "}":
                field, fline = take("word")
                if field == "name":
                    if name is not None:
                        raise ProtoError(f"{path}:{fline}: a layer block has one name")
                    take("punct", ":")
                    name, line = take("string")
                elif field == "location":
                    locs.append(location())
                else:
                    raise ProtoError(f"{path}:{fline}: unknown field '{field}' in a layer "
                                     "block (expected name or location)")
            take("punct", "}")
            if name is None:
                raise ProtoError(f"{path}:{line}: a layer block needs a name")
        else:
            take("punct", ":")
            name, line = take("string")
            while i < len(toks) and toks[i][1] == "location":
                i += 1
                locs.append(location())
        if not locs:
            raise ProtoError(f"{path}:{line}: layer '{name}' has no location")
        if name not in known:
            near = difflib.get_close_matches(name, known, n=3)
            hint = f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""
            raise ProtoError(f"{path}:{line}: net '{net_param.name}' has no layer '{name}'"
                             f"{hint}")
        if name in out:
            raise ProtoError(f"{path}:{line}: layer '{name}' is placed twice (first on line "
                             f"{lines[name]})")
        out[name], lines[name] = tuple(locs), line
    return out


# -- splitting layers into towers ----------------------------------------------------------
@dataclass
class Towers:
    """One layer of the original net split into towers: their layer names, and for each
    parameter blob the axis along which the towers' blobs join into the original."""

    names: list[str]
    axes: list[int]


@dataclass
class SplitNet:
    """What ``split_towers`` made of a net: the new net and where its layers go, the towers
    of each split layer, and for each blob of the original net where its final value is
    (one blob name, or the towers' parts to join along the channel axis)."""

    net: pb.NetParameter
    placement: dict[str, Location]
    towers: dict[str, Towers]
    blobs: dict[str, tuple[str, ...]]
    original: pb.NetParameter  # the original net, filtered for the phase
    # data-parallel copies of a layer (hybrid parallelism): copy name -> the layer's name
    # (the layer itself included); build the net with ``Net(..., replica_of=...)``
    replica_of: dict[str, str] = field(default_factory=dict)
    batched: frozenset[str] = frozenset()  # blobs held as the replicas' parts of the batch
    replicated: bool = False  # some layers run once per replica (hybrid parallelism)
    # each layer of the new net that is (a part of) a layer of the original: its name
    # there, and which part of the layer's draws it makes (None: all of them)
    origin: dict[str, tuple[str, StreamPart | None]] = field(default_factory=dict)

    def key_streams(self, stateful: Mapping[str, Stateful]) -> None:
        """Key the random streams of a Net of the split net (its builder's ``stateful``,
        before its first pass) by what each layer is in the original net: a layer's
        stream becomes the one the unsplit net's layer of that name has (its index there,
        the same seed), and a tower's or replica's draws its part of that layer's draws
        (``RandomStream.uniform``). Dropout then drops in the split net what it drops in
        the unsplit net, whatever the placement."""
        index: dict[str, int] = {}
        for i, lp in enumerate(insert_splits(self.original).layer):
            index.setdefault(lp.name, i)
        for key, obj in stateful.items():
            got = random_stream_key(key)
            if got is None or not isinstance(obj, RandomStream):
                continue
            layer, n = got
            name, part = self.origin.get(layer, (None, None))
            if name in index:
                obj.key, obj.part = stream_key(index[name], n), part

    def unsplit_states(self, objects: Mapping[str, Stateful]) -> dict[str, Stateful]:
        """``objects`` (the train net's run-time state by key) with the random streams of
        the towers and replicas of a layer under the original layer's key, as one object:
        a snapshot holds the unsplit net's keys, which unsplit and split runs restore."""
        out: dict[str, Stateful] = {}
        groups: dict[str, list[RandomStream]] = {}
        for key, obj in objects.items():
            got = random_stream_key(key)
            name = self.origin.get(got[0], (None,))[0] if got else None
            if name is None or not isinstance(obj, RandomStream):
                out[key] = obj
                continue
            groups.setdefault(f"{name}/random#{got[1]}", []).append(obj)
        for key, streams in groups.items():
            out[key] = streams[0] if len(streams) == 1 else _Streams(streams)
        return out

    def split_params(self, params: Mapping[str, Sequence[np.ndarray]]
                     ) -> dict[str, list[np.ndarray]]:
        """The original net's parameter arrays by layer name (a caffemodel's) in the split
        net's layout: tower k of T takes part k of T of each array along its axis, e.g.
        ``weight[k*M/T:(k+1)*M/T]`` of a Convolution's (M, C/group, kh, kw) weight."""
        out: dict[str, list[np.ndarray]] = {}
        for name, arrays in params.items():
            t = self.towers.get(name)
            if t is None:
                out[name] = list(arrays)
                continue
            if len(arrays) != len(t.axes):
                raise PurineError(f"layer '{name}' has {len(t.axes)} parameter blobs, got "
                                  f"{len(arrays)}")
            n = len(t.names)
            for a, axis in zip(arrays, t.axes, strict=True):
                if a.ndim <= axis or a.shape[axis] % n:
                    raise PurineError(f"layer '{name}': a parameter of shape {a.shape} does "
                                      f"not split into {n} towers along axis {axis}")
            for k, tower in enumerate(t.names):
                out[tower] = [np.split(np.asarray(a), n, axis)[k].copy()
                              for a, axis in zip(arrays, t.axes, strict=True)]
        return out

    def join_params(self, params: Mapping[str, Sequence[np.ndarray]]
                    ) -> dict[str, list[np.ndarray]]:
        """The inverse of ``split_params``: the towers' arrays joined back by original
        layer name (for a caffemodel of the original net, or to compare gradients)."""
        tower_of = {n: name for name, t in self.towers.items() for n in t.names}
        out: dict[str, list[np.ndarray]] = {}
        for name, arrays in params.items():
            orig = tower_of.get(name)
            if orig is None:
                out[name] = list(arrays)
            elif orig not in out:
                t = self.towers[orig]
                out[orig] = [np.concatenate([params[n][j] for n in t.names], axis)
                             for j, axis in enumerate(t.axes)]
        return out

    def params(self, net: Net, diff: bool = False) -> dict[str, list[np.ndarray]]:
        """``net``'s (a Net of the split net) parameters, or their gradients, in the
        original net's layout."""
        return self.join_params({name: [v.diff if diff else v.data for v in views]
                                 for name, views in net.params.items()})

    def blob(self, net: Net, name: str, diff: bool = False) -> np.ndarray:
        """The data (or diff) of the original net's blob ``name`` in ``net``, a Net of the
        split net, its towers' parts joined along the channel axis (the replicas' along the
        batch axis)."""
        if name not in self.blobs:
            raise PurineError(f"net '{self.original.name}' has no blob '{name}'")
        arrays = [net.blobs[n].diff if diff else net.blobs[n].data for n in self.blobs[name]]
        axis = 0 if name in self.batched else 1
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis)

    def load(self, net: Net, weights: str | os.PathLike | Mapping[str, Sequence[np.ndarray]]
             ) -> None:
        """Copy the original net's parameters (a caffemodel's path, or arrays by layer
        name) into ``net``, a Net of the split net; layers the weights lack keep theirs."""
        if not isinstance(weights, Mapping):
            weights = load_weights(weights)
        weights = {name: [self._legacy(net, name, j, np.asarray(a)) for j, a in enumerate(arrays)]
                   for name, arrays in weights.items()}
        for name, arrays in self.split_params(weights).items():
            views = net.params.get(name)
            if views is None:
                continue
            arrays = layer_arrays(name, arrays, [v.shape for v in views], source="in the weights")
            for v, a in zip(views, arrays, strict=True):
                if net.host is None or v._data.location.host == net.host:  # another rank's
                    v.data[...] = a

    def save(self, net: Net, path: str | os.PathLike, hdf5: bool = False) -> None:
        """Write ``net``'s (a Net of the split net) parameters as a caffemodel (``hdf5``: a
        .caffemodel.h5) of the original net, which Caffe and unsplit nets load."""
        layers = [lp for lp in self.original.layer if lp.type != "Split"]
        params = self.params(net)
        if hdf5:
            write_weights(path, [(lp.name, params[lp.name]) for lp in layers
                                 if lp.name in params])
        else:
            save_net(self.original.name, layers, params, path)

    def _legacy(self, net: Net, name: str, j: int, a: np.ndarray) -> np.ndarray:
        """Old caffemodels store every blob as 4-d, e.g. (1, 1, N, K): give a split
        layer's blob the original shape (a tower's, times T along the split axis) before
        it is cut."""
        t = self.towers.get(name)
        views = net.params.get(t.names[0]) if t else None
        if t is None or views is None or j >= len(views):
            return a
        want = tuple(d * len(t.names) if i == t.axes[j] else d
                     for i, d in enumerate(views[j].shape))
        fit = fit_shape(a, want)
        return a if fit is None else fit


class _Streams:
    """The streams of a layer's towers or replicas as one snapshot entry: they draw once per
    pass each, so the count of the furthest one (an MPI rank advances only its own) is
    the layer's."""

    def __init__(self, streams: Sequence[RandomStream]):
        self.streams = list(streams)

    def state(self) -> dict:
        return {"count": max(s.count for s in self.streams)}

    def restore(self, state: dict) -> None:
        for s in self.streams:
            s.restore(state)


@dataclass
class _Value:
    """The current forms of one blob of the original net in the split net: whole copies at
    locations, and the towers' channel parts (None while stale or never made)."""

    full: list[tuple[str, Location]]
    parts: list[tuple[str, Location]] | None = None  # the towers' channel parts
    batch: list[tuple[str, Location]] | None = None  # the replicas' parts of the batch


class _Rewrite:
    """The layer-by-layer rewrite behind ``split_towers``."""

    def __init__(self, net: pb.NetParameter, default: Location):
        self.default = default
        self.out = pb.NetParameter()
        self.out.CopyFrom(net)
        del self.out.layer[:]
        self.placement: dict[str, Location] = {}
        self.towers: dict[str, Towers] = {}
        self.values: dict[str, _Value] = {}
        self.old_layers = {lp.name for lp in net.layer}
        self.old_blobs = {t for lp in net.layer for t in list(lp.top) + list(lp.bottom)}
        self.new_layers: set[str] = set()
        self.new_blobs: set[str] = set()
        self.replica_of: dict[str, str] = {}
        self.origin: dict[str, tuple[str, StreamPart | None]] = {}

    # -- names ---------------------------------------------------------------------------
    def _fresh(self, base: str, taken: set[str], reserved: set[str], own: str = "") -> str:
        name, n = base, 1
        while name in taken or (name in reserved and name != own):
            n += 1
            name = f"{base}#{n}"
        taken.add(name)
        return name

    def blob_name(self, base: str, own: str = "") -> str:
        return self._fresh(base, self.new_blobs, self.old_blobs, own)

    def layer_name(self, base: str) -> str:
        return self._fresh(base, self.new_layers, self.old_layers)

    def add(self, lp: pb.LayerParameter, loc: Location | None) -> None:
        self.new_layers.add(lp.name)
        self.new_blobs.update(lp.top)
        self.out.layer.add().CopyFrom(lp)
        if loc is not None:
            self.placement[lp.name] = loc

    # -- the forms of a blob -------------------------------------------------------------
    def full(self, blob: str, at: Location, consumer: str) -> str:
        """A name of ``blob``'s whole value for a layer at ``at``: a copy in that memory
        space, else a Concat of the towers' parts made there (so that only the parts from
        elsewhere travel), else a copy elsewhere (the engine adds the Copy op)."""
        v = self.values.get(blob)
        if v is None:
            return blob  # not produced: the net builder reports the unknown bottom
        for name, loc in v.full:
            if loc.memory == at.memory:
                return name
        join, axis = (v.parts, 1) if v.parts is not None else (v.batch, 0)
        if join is None:
            return v.full[0][0]
        name = blob if blob not in self.new_blobs else self.blob_name(f"{blob}@{consumer}")
        self.new_blobs.add(name)
        cat = pb.LayerParameter(name=self.layer_name(f"{name}/concat"), type="Concat",
                                bottom=[n for n, _ in join], top=[name])
        cat.concat_param.axis = axis
        self.add(cat, at)
        v.full.append((name, at))
        return name

    def parts(self, blob: str, count: int, consumer: pb.LayerParameter) -> list[str]:
        """Names of ``blob``'s ``count`` channel parts: the towers' own, else a Slice of a
        whole copy, made where that copy is."""
        return self._cut(blob, count, consumer, 1)

    def batch(self, blob: str, count: int, consumer: pb.LayerParameter) -> list[str]:
        """Names of ``blob``'s ``count`` parts of the batch (axis 0): the replicas' own,
        else a Slice of a whole copy, made where that copy is."""
        return self._cut(blob, count, consumer, 0)

    def _cut(self, blob: str, count: int, consumer: pb.LayerParameter, axis: int) -> list[str]:
        v = self.values.get(blob)
        if v is None:
            raise LayerError(consumer.name, consumer.type, f"unknown bottom blob '{blob}'; no "
                             "earlier layer has it as a top")
        have = v.parts if axis == 1 else v.batch
        if have is not None and len(have) == count:
            return [n for n, _ in have]
        if v.full:
            src, at = v.full[0]
        else:  # parts of another kind or number: join them, then cut anew
            at = (v.parts or v.batch)[0][1]
            src = self.full(blob, at, consumer.name)
        kind = "tower" if axis == 1 else "replica"
        names = [self.blob_name(f"{blob}/{kind}{k}") for k in range(count)]
        cut = pb.LayerParameter(name=self.layer_name(f"{blob}/slice"), type="Slice",
                                bottom=[src], top=names)
        if axis != 1:  # Slice's default axis is the channels
            cut.slice_param.axis = axis
        self.add(cut, at)
        if axis == 1:
            v.parts = [(n, at) for n in names]
        else:
            v.batch = [(n, at) for n in names]
        return names

    # -- layers --------------------------------------------------------------------------
    def keep(self, lp: pb.LayerParameter, loc: Location | None) -> None:
        at = loc or self.default
        new = pb.LayerParameter()
        new.CopyFrom(lp)
        for j, b in enumerate(lp.bottom):
            new.bottom[j] = self.full(b, at, lp.name)
        for j, t in enumerate(lp.top):
            if t in lp.bottom:  # in place: the whole copy it writes is the only current one
                name = new.bottom[list(lp.bottom).index(t)]
                held = dict(self.values[t].full) if t in self.values else {}
                if name in held and held[name].memory != at.memory:
                    # its bottom is in another memory space: it reads a copy there, so it
                    # writes a top of its own, which then holds the value
                    name = self.blob_name(f"{t}@{lp.name}")
                new.top[j] = name
                self.values[t] = _Value([(name, at)])
            else:
                self.values[t] = _Value([(t, at)])
        self.add(new, loc)
        self.origin[new.name] = (lp.name, None)

    def replicate(self, lp: pb.LayerParameter, locs: Sequence[Location]) -> None:
        """Data parallelism inside the net: copy r of the layer runs at ``locs[r]`` on part r
        of the batch of each bottom. Copy 0 keeps the layer's name and so its parameters;
        copy r, named ``<layer>/replica<r>``, uses the same parameter blobs, whose gradient
        is then the sum over the copies: the whole batch's, as in the unsplit net."""
        n = len(locs)
        # A layer that declares replicates=False (BatchNorm) writes its parameters (the
        # statistics) in the forward pass, which copies sharing them cannot all do.
        alone = not facts(lp.type).replicates
        if alone or any(lp.loss_weight) or lp.type.endswith("Loss"):
            what = ("its forward pass writes its parameters (the statistics)"
                    if alone else "it computes a loss over its batch")
            raise LayerError(lp.name, lp.type, f"cannot run once per replica: {what}; "
                             "name it (or a layer before it) in the placement file so that "
                             "it sees the whole batch")
        inputs = [self.batch(b, n, lp) for b in lp.bottom]
        names = [lp.name] + [self.layer_name(f"{lp.name}/replica{r}") for r in range(1, n)]
        tops = []
        for t in lp.top:
            if t in lp.bottom:  # in place where the copy's part is in its memory
                mine = inputs[list(lp.bottom).index(t)]
                held = [loc for _, loc in self.values[t].batch or []]
                tops.append([mine[r] if held[r].memory == locs[r].memory
                             else self.blob_name(f"{t}/replica{r}") for r in range(n)])
            else:
                tops.append([self.blob_name(f"{t}/replica{r}") for r in range(n)])
        for r in range(n):
            copy = pb.LayerParameter()
            copy.CopyFrom(lp)
            copy.name = names[r]
            for i in range(len(lp.bottom)):
                copy.bottom[i] = inputs[i][r]
            for j in range(len(lp.top)):
                copy.top[j] = tops[j][r]
            self.add(copy, locs[r])
            self.replica_of[names[r]] = lp.name
            self.origin[names[r]] = (lp.name, StreamPart(0, r, n))  # rows r of n
        for j, t in enumerate(lp.top):
            self.values[t] = _Value([], batch=list(zip(tops[j], locs, strict=True)))

    def whole_batch(self, lp: pb.LayerParameter, n: int) -> None:
        """A data layer of a net whose replicas take ``batch_size`` samples each: it reads
        the ``n`` replicas' batches at once, which the replicated layers then cut."""
        new = pb.LayerParameter()
        new.CopyFrom(lp)
        sizes = {"Data": new.data_param, "ImageData": new.image_data_param,
                 "HDF5Data": new.hdf5_data_param, "MemoryData": new.memory_data_param,
                 "WindowData": new.window_data_param}
        if lp.type in sizes:
            sizes[lp.type].batch_size *= n
        elif lp.type in ("Input", "DummyData"):
            shapes = new.input_param.shape if lp.type == "Input" else new.dummy_data_param.shape
            for shape in shapes:
                if shape.dim:
                    shape.dim[0] *= n
            for field_ in ("num",) if lp.type == "DummyData" else ():
                values = getattr(new.dummy_data_param, field_)
                for i in range(len(values)):
                    values[i] *= n
        else:
            raise LayerError(lp.name, lp.type, "a layer without bottoms in a net of "
                             f"{n} replicas must read their {n} batches at once, and the "
                             "rewrite cannot tell this type's batch size")
        self.keep(new, None)

    def split(self, lp: pb.LayerParameter, locs: tuple[Location, ...]) -> None:
        n = len(locs)

        def error(message: str) -> LayerError:
            return LayerError(lp.name, lp.type, f"cannot be split into {n} towers: {message}")

        if len(lp.bottom) != 1 or len(lp.top) != 1:
            raise error(f"it has {len(lp.bottom)} bottoms and {len(lp.top)} tops; a split "
                        "layer has one of each")
        if any(spec.name for spec in lp.param):
            raise error("it shares parameters by name")
        rule = facts(lp.type).split
        if rule is None:
            rules = types_with(lambda f: f.split is not None and f.split != CHANNELS)
            raise error(f"towers can split {', '.join(rules)} and the per-channel layers "
                        f"{', '.join(types_with(lambda f: f.split == CHANNELS))}")
        try:  # a per-channel layer: tower k computes channels k of T of the bottom
            how = TowerSplit(True) if rule == CHANNELS else rule(lp, n)
        except SplitRefused as e:
            raise error(str(e)) from None
        x, y = lp.bottom[0], lp.top[0]
        names = [self.layer_name(f"{lp.name}/tower{k}") for k in range(n)]
        if how.by_input:
            inputs = self.parts(x, n, lp)
        else:
            inputs = [self.full(x, loc, name) for loc, name in zip(locs, names, strict=True)]
        # In place where the part is in the tower's memory; elsewhere the tower reads a
        # copy of it, so it writes a top of its own, which then holds the part's value.
        here = [loc for _, loc in self.values[x].parts] if x == y and how.by_input else []
        outputs = [inputs[k] if here and here[k].memory == locs[k].memory
                   else self.blob_name(f"{y}/tower{k}") for k in range(n)]
        for k in range(n):
            tower = pb.LayerParameter()
            tower.CopyFrom(lp)
            tower.name, tower.bottom[0], tower.top[0] = names[k], inputs[k], outputs[k]
            if how.tower is not None:
                how.tower(tower)
            self.add(tower, locs[k])
            self.origin[names[k]] = (lp.name, StreamPart(1, k, n))  # its top's channels
        self.values[y] = _Value([], list(zip(outputs, locs, strict=True)))
        self.towers[lp.name] = Towers(names, list(how.axes))

    def finish(self, net: pb.NetParameter) -> None:
        """Join the towers' parts of the net's outputs, so that the split net has the
        original's outputs (Caffe's rule: tops no later layer consumes)."""
        available: list[str] = []
        for lp in net.layer:
            available = [t for t in available if t not in lp.bottom]
            available += [t for t in lp.top if t not in available]
        for blob in available:
            if not self.values[blob].full:
                self.full(blob, self.default, "output")


def split_towers(net_param: pb.NetParameter,
                 placement: Mapping[str, Location | str | Sequence[Location | str]], *,
                 phase: int = pb.TRAIN, level: int = 0, stages: Sequence[str] = (),
                 default: Location = CPU, replicas: Sequence[Location] = (),
                 data_parallel: bool = False) -> SplitNet:
    """The net for one NetState (phase, level, stages) with each layer that ``placement``
    gives several locations split into towers, tower k at location k:

    - a Convolution with ``group`` a multiple of T: T Convolutions of group/T, each taking
      its part of the bottom's channels (a Slice where the bottom is whole);
    - a Convolution with group 1, or an InnerProduct: each tower computes num_output/T of
      the outputs from the whole bottom;
    - a per-channel layer (ReLU, Pooling, LRN within channels, ...): on the towers' parts.

    Tower layers are named ``conv2/tower0``, their tops ``conv2/tower0``; a layer left whole
    that reads a split blob reads a Concat of the parts under the original name, made at
    that layer's location, so the rest of the net is unchanged and a Copy op appears only
    where data crosses between towers. Parameters split along their first axis (an
    InnerProduct's transposed weight along its second): ``SplitNet.split_params`` maps the
    original net's weights to the towers. ``default`` is where unplaced layers run (the
    ``location`` of the Net that will be built). Layers of other phases are ignored, so one
    placement serves a train net and its test nets.

    Hybrid parallelism (Krizhevsky's "one weird trick"): ``replicas`` are the locations the
    word ``replicas`` stands for in ``placement`` (default: ``default`` alone). With
    ``data_parallel``, each replica takes ``batch_size`` samples: the data layers read all
    replicas' batches at once, and every layer before the first one ``placement`` names
    runs once per replica on its part of the batch (``_Rewrite.replicate``); the named
    layers and all after them see the whole batch, e.g. fully connected layers split into
    one tower per replica. The result equals the unsplit net with the whole batch. Where
    the placement names the first layer with bottoms, nothing is replicated and the batch
    stays as written (``SplitNet.replicated`` is False)."""
    param = read_net(net_param)
    state = pb.NetState()
    state.CopyFrom(param.state)
    state.phase, state.level = phase, level
    state.stage.extend(s for s in stages if s not in state.stage)
    param = filter_net(param, state)
    replicas = list(replicas) or [default]
    where: dict[str, tuple[Location, ...]] = {}
    for name, locs in placement.items():
        locs = (locs,) if isinstance(locs, Location | str) else tuple(locs)
        if not locs:
            raise PurineError(f"placement gives layer '{name}' no location")
        where[name] = tuple(x for loc in locs
                            for x in (replicas if loc == REPLICAS else [loc]))
    r = _Rewrite(param, default)
    # The replicated layers come first: those with bottoms before the first layer named.
    first = next((i for i, lp in enumerate(param.layer) if lp.name in where), len(param.layer))
    replicated = data_parallel and len(replicas) > 1 and any(
        lp.bottom for lp in param.layer[:first])
    trunk = replicated
    for lp in param.layer:
        locs = where.get(lp.name)
        trunk = trunk and locs is None
        if replicated and not lp.bottom:
            r.whole_batch(lp, len(replicas))
        elif trunk:
            r.replicate(lp, replicas)
        elif locs is not None and len(locs) > 1:
            r.split(lp, locs)
        else:
            r.keep(lp, locs[0] if locs else None)
    r.finish(param)
    blobs, batched = {}, set()
    for name, v in r.values.items():
        whole = [n for n, _ in v.full]
        if whole:
            blobs[name] = (name,) if name in whole else (whole[0],)
        else:
            blobs[name] = tuple(n for n, _ in v.parts or v.batch or [])
            if v.parts is None:
                batched.add(name)
    return SplitNet(r.out, r.placement, r.towers, blobs, param, r.replica_of,
                    frozenset(batched), replicated, r.origin)


def place(net_param: pb.NetParameter, path: str | os.PathLike, *, phase: int = pb.TRAIN,
          level: int = 0, stages: Sequence[str] = (), default: Location = CPU) -> SplitNet:
    """``split_towers`` of ``net_param`` with the placement file at ``path``."""
    param = read_net(net_param)
    return split_towers(param, read_placement(path, param), phase=phase, level=level,
                        stages=stages, default=default)
