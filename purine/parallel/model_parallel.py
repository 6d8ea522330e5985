"""Model parallelism in training: the solver's nets are built from the placed net (layers
split into towers, each layer at its location; purine.parallel.placement), the update ops
of each parameter run where the parameter lives (Solver._build_update), and every file the
solver reads or writes is in the layout of the net the user gave: snapshots are the
unsplit net's .caffemodel and .solverstate, and fine-tuning weights are the unsplit net's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from purine.caffe.net import Net
from purine.caffe.solver import HistoryLayout, Scheme
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import load_weights
from purine.formats.hdf5_snapshot import is_hdf5, read_weights
from purine.graph import CPU, Blob, Location
from purine.parallel.placement import SplitNet, read_placement, split_towers

Placement = Mapping[str, Location | Sequence[Location]]


class ModelParallel(Scheme):
    """Train a net placed by ``placement``: a placement file's path, or locations by layer
    name (several locations split the layer into towers).

    With ``replicas`` N > 1, hybrid parallelism: each replica takes ``batch_size`` samples,
    the layers before the first one the placement names run once per replica on its
    part of the batch, and the rest see the whole batch, split into towers where the
    placement says (``location: "replicas"``: one tower per replica). Replica r runs at
    worker thread r of the solver's location, or at ``locations[r - 1]`` (replica 0 at the
    solver's location), e.g. one GPU each: a copy in another memory space reads the
    weights through a Copy op and sends its gradients home. The run equals the unsplit net
    with N times the batch."""

    concurrent = True  # towers and replicas run on concurrent workers

    def __init__(self, placement: str | os.PathLike | Placement, replicas: int = 1,
                 locations: Sequence[Location] | None = None):
        super().__init__(f"{replicas} replicas and a placement" if replicas > 1 else None)
        if replicas < 1:
            raise PurineError(f"a placement needs at least 1 replica, got {replicas}")
        if locations is not None and len(locations) != replicas - 1:
            raise PurineError(f"{replicas} replicas need {replicas - 1} locations besides the "
                              f"first, got {len(locations)}")
        self.source, self.count, self.locations = placement, replicas, locations
        self.where: Placement | None = None if isinstance(placement, str | os.PathLike) \
            else placement
        self._splits: list[tuple[Net, SplitNet]] = []

    def _placement(self, param: pb.NetParameter) -> Placement:
        if self.where is None:  # the file names the train net's layers (checked there)
            self.where = read_placement(self.source, param)
        return self.where

    def make_net(self, param: pb.NetParameter, **kwargs: Any) -> Net:
        stages = kwargs.get("stages") or ()
        at = kwargs.get("location", CPU)
        replicas = [Location(at.device, at.index, r, at.host) for r in range(self.count)]
        if self.locations is not None:
            replicas = [at, *self.locations]
        split = split_towers(param, self._placement(param), phase=kwargs["phase"],
                             level=kwargs.get("level", 0), stages=stages, default=at,
                             replicas=replicas, data_parallel=kwargs["phase"] == pb.TRAIN)
        net = Net(split.net, placement=split.placement, replica_of=split.replica_of, **kwargs)
        self._splits.append((net, split))
        return net

    def split_of(self, net: Net) -> SplitNet:
        for n, split in self._splits:
            if n is net:
                return split
        raise PurineError("this net was not built by the model-parallel scheme")

    def save_weights(self, net: Net, path: str, hdf5: bool) -> None:
        self.split_of(net).save(net, path, hdf5=hdf5)

    def load_weights(self, net: Net, path: str) -> None:
        if is_hdf5(path):
            weights = {name: [sets[str(k)] for k in range(len(sets))]
                       for name, sets in read_weights(path).items()}
        else:
            weights = load_weights(path)
        self.split_of(net).load(net, weights)

    def history_layout(self, params: list[Blob]) -> HistoryLayout:
        return TowerHistory(self._splits[0][1], params)


class TowerHistory(HistoryLayout):
    """The train net's history in the unsplit net's layout: a parameter the towers share
    (conv2's weight, cut into conv2/tower0's and conv2/tower1's) is one entry, the towers'
    arrays joined along the axis they were cut along, at the position of its first tower."""

    def __init__(self, split: SplitNet, params: Sequence[Blob]):
        self.split, self.own = split, list(params)
        tower_of = {n: (name, t) for name, t in split.towers.items() for n in t.names}
        entries: dict[tuple[str, int], Blob] = {}
        for p in self.own:
            layer, k = p.meta["layer"], p.meta["index"]
            name, t = tower_of.get(layer, (layer, None))
            if (name, k) in entries:
                continue
            shape = p.shape
            if t is not None:
                axis = t.axes[k]
                shape = shape[:axis] + (shape[axis] * len(t.names),) + shape[axis + 1:]
            entries[name, k] = Blob(f"{name}[{k}]", shape, p.dtype, p.location)
        super().__init__(list(entries.values()))
        self._keys = list(entries)

    def to_file(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        mine = {(p.meta["layer"], p.meta["index"]): a for p, a in zip(self.own, arrays,
                                                                       strict=True)}
        towers = self.split.towers
        joined = self.split.join_params({
            n: [mine[n, j] for j in range(len(t.axes))]
            for name, t in towers.items() for n in t.names if (n, 0) in mine})
        return [joined[name][k] if name in towers else mine[name, k] for name, k in self._keys]

    def from_file(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        given = dict(zip(self._keys, arrays, strict=True))
        towers = self.split.towers
        cut = self.split.split_params({
            name: [given[name, j] for j in range(len(t.axes))]
            for name, t in towers.items() if (name, 0) in given})
        out = []
        for p in self.own:
            layer, k = p.meta["layer"], p.meta["index"]
            out.append(cut[layer][k] if layer in cut else given[layer, k])
        return out
