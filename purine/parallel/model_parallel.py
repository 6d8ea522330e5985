"""Model parallelism in training: the solver's nets are built from the placed net (layers
split into towers, each layer at its location; purine.parallel.placement), the update ops
of each parameter run where the parameter lives (purine.caffe.update.build_update), and every
file the solver reads or writes is in the layout of the net the user gave: snapshots are the
unsplit net's .caffemodel and .solverstate, and fine-tuning weights are the unsplit net's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from purine.caffe.net import Net
from purine.caffe.solver import HistoryLayout, Scheme
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import load_weights
from purine.formats.hdf5_snapshot import is_hdf5, read_weights
from purine.graph import CPU, Blob, Location, Stateful
from purine.parallel.placement import REPLICAS, SplitNet, read_placement, split_towers

Placement = Mapping[str, Location | str | Sequence[Location | str]]  # str: REPLICAS


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
    with N times the batch.

    With ``comm``, an mpi4py communicator of R ranks, the placement spans processes: a
    location ``rankH/cpu:0`` is on rank H, the word ``replicas`` stands for the R ranks (one
    replica each; a placement without the word keeps the batch as written, nothing
    replicated), and every rank builds the whole graph and runs its share of it; a Copy
    op between ranks is an MPI message (purine.parallel.mpi.Messages). Rank 0 holds the
    loss and the outputs, logs, tests and writes snapshots with every rank's weights
    gathered to it."""

    concurrent = True  # towers and replicas run on concurrent workers

    def __init__(self, placement: str | os.PathLike | Placement, replicas: int = 1,
                 locations: Sequence[Location] | None = None, comm: Any = None):
        comm = comm if comm is not None and comm.size > 1 else None
        if comm is not None:
            if replicas > 1 or locations:
                raise PurineError("a placement over MPI ranks takes one replica per rank: "
                                  "drop --replicas and --gpu lists")
            replicas = comm.size
        super().__init__(f"{replicas} replicas and a placement" if replicas > 1 else None)
        if replicas < 1:
            raise PurineError(f"a placement needs at least 1 replica, got {replicas}")
        if locations is not None and len(locations) != replicas - 1:
            raise PurineError(f"{replicas} replicas need {replicas - 1} locations besides the "
                              f"first, got {len(locations)}")
        self.comm = comm
        if comm is not None:
            from purine.parallel.mpi import Messages, Ranks

            self.ranks, self.messages = Ranks(comm, 1), Messages(comm)
            self.root = comm.rank == 0
            self.description = f"a placement over {comm.size} MPI ranks"
        self.source, self.count, self.locations = placement, replicas, locations
        self.where: Placement | None = None if isinstance(placement, str | os.PathLike) \
            else placement
        self._splits: list[tuple[Net, SplitNet]] = []
        self._hosts: dict[str, int] = {}  # train net layer -> its rank (over ranks)

    def _placement(self, param: pb.NetParameter) -> Placement:
        if self.where is None:  # the file names the train net's layers (checked there)
            self.where = read_placement(self.source, param)
        return self.where

    def make_net(self, param: pb.NetParameter, **kwargs: Any) -> Net:
        stages = kwargs.get("stages") or ()
        at = kwargs.get("location", CPU)
        replicas = [Location(at.device, at.index, r, at.host) for r in range(self.count)]
        if self.comm is not None:  # a replica per rank
            replicas = [Location(at.device, at.index, 0, r) for r in range(self.count)]
        elif self.locations is not None:
            replicas = [at, *self.locations]
        train = kwargs["phase"] == pb.TRAIN
        where = self._placement(param)
        # Over ranks, the ranks are replicas only where the placement says "replicas": a
        # placement that names none is model parallelism with the batch as written.
        replicate = train and (self.comm is None or any(
            loc == REPLICAS for locs in where.values()
            for loc in (locs if isinstance(locs, tuple | list) else (locs,))))
        split = split_towers(param, where, phase=kwargs["phase"],
                             level=kwargs.get("level", 0), stages=stages, default=at,
                             replicas=replicas, data_parallel=replicate)
        if train and self.count > 1 and self.comm is None and not split.replicated:
            raise PurineError(f"{self.count} replicas with a placement that names the net's "
                              "first layer: no layer is left to run once per replica (name "
                              "only the layers from the first model-parallel one on)")
        placement = split.placement
        if self.comm is not None and not train:  # rank 0 alone tests, all of it its own
            placement = {k: replace(loc, host=0) for k, loc in placement.items()}
        host = self.comm.rank if self.comm is not None and train else None
        net = Net(split.net, placement=placement, replica_of=split.replica_of, host=host,
                  **kwargs)
        # Random streams keyed by the user's layers, not by their places in the new net:
        # towers and replicas draw their parts of the unsplit net's Dropout masks.
        split.key_streams(net.builder.stateful)
        if host is not None:
            net.dispatcher.transport = self.messages
            self._check_root(net, split)
            self._hosts = {L.name: L.location.host for L in net.builder.layers}
            for L in net.builder.layers:  # a split layer's snapshot entry: its first part's
                self._hosts.setdefault(split.origin.get(L.name, (L.name,))[0],
                                       L.location.host)
        self._splits.append((net, split))
        return net

    @staticmethod
    def _check_root(net: Net, split: SplitNet) -> None:
        """Rank 0 logs the loss and the outputs: they must be computed there."""
        b = net.builder
        away = [t.name for t, _ in b.loss_tops if t.location.host != 0]
        away += [n for n in net.outputs if b.data[n].location.host != 0]
        if away:
            raise PurineError(f"net '{split.original.name}': a placement over MPI ranks must "
                              f"leave the loss and the outputs on rank 0, where the solver "
                              f"logs them; {', '.join(sorted(set(away)))} would be elsewhere")

    # -- the collectives of a placement over ranks ---------------------------------------
    def loss(self, loss: Any, dispatcher: Any) -> Any:  # noqa: ARG002
        if self.comm is None:
            return loss
        return self.comm.bcast(float(loss) if self.root else None, root=0)

    def agree(self, action: str) -> str:
        return action if self.comm is None else self.ranks.agree(action)

    def state_objects(self, solver: Any) -> dict[str, Stateful]:
        """The run-time state under the unsplit net's keys: the random streams of a layer's
        towers or replicas are one entry, the layer's (SplitNet.unsplit_states)."""
        objects = super().state_objects(solver)
        return self.split_of(solver.net).unsplit_states(objects)

    def gather_state(self, private: dict) -> dict | None:
        """Rank 0's private state, with each rank's run-time state (random streams, data
        cursors) of the layers placed on it: a layer's own rank is where it advanced."""
        if self.comm is None:
            return private
        rank = self.comm.rank
        mine = {k: v for k, v in private.get("stateful", {}).items()
                if self._hosts.get(k.rsplit("/", 1)[0], 0) == rank}
        parts = self.comm.gather(mine, root=0)
        if not self.root:
            return None
        merged = dict(private.get("stateful", {}))
        for part in parts:
            merged.update(part)
        return dict(private, stateful=merged)

    def gather_trace(self, events: list[dict]) -> list[dict] | None:
        return self.ranks.gather_trace(events) if self.comm is not None else events

    def gather_weights(self, solver: Any) -> None:
        """Every parameter and history blob held by another rank comes to rank 0, in one
        order on every rank (blocking messages, tags above the graph's ops)."""
        if self.comm is None:
            return
        d, rank = solver.net.dispatcher, self.comm.rank
        blobs = [b for u in solver.updates for b in [u.param, *u.history]
                 if b.location.host != 0]
        tag0 = len(solver.net.graph.ops)
        for i, b in enumerate(blobs):
            if rank == b.location.host:
                self.messages.send(d.array(b), 0, tag0 + i)
            elif rank == 0:
                self.messages.receive(d.array(b), b.location.host, tag0 + i)

    def split_of(self, net: Net) -> SplitNet:
        for n, split in self._splits:
            if n is net:
                return split
        raise PurineError("this net was not built by the model-parallel scheme")

    def save_weights(self, net: Net, path: str, hdf5: bool) -> None:
        self.split_of(net).save(net, path, hdf5=hdf5)

    def load_weights(self, net: Net, path: str) -> None:
        if is_hdf5(path):
            weights = {}
            for name, sets in read_weights(path).items():
                missing = [str(k) for k in range(len(sets)) if str(k) not in sets]
                if missing:
                    raise PurineError(f"{path}: layer '{name}' has datasets "
                                      f"{', '.join(sorted(sets))}; expected data/{name}/0 .. "
                                      f"data/{name}/{len(sets) - 1}")
                weights[name] = [sets[str(k)] for k in range(len(sets))]
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
