"""Solver snapshots as bytes (no net here: arrays and messages in, bytes out): the binary
.solverstate (Caffe's SolverState fields, then our private state at an unused field number),
and the private state's JSON and schema, checked before anything is restored. The HDF5 form
is purine.formats.hdf5_snapshot."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from purine.errors import ProtoError, PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import Chunks, blob_chunks, blob_to_array, nested_field
from purine.formats.files import BINARY_LIMIT, read_bounded
from purine.formats.hdf5_snapshot import PRIVATE_DATASET, read_private
from purine.formats.prototxt import parse_binary
from purine.formats.wire import len_field, length_fields

# A SolverState field number Caffe does not use: Caffe's reader keeps it as an unknown
# field and ignores it, so our .solverstate files still load in Caffe.
PRIVATE_STATE_FIELD = 1001

# Our JSON beside Caffe's fields: {"seed": int or null, "stateful": {key: state}}, where each
# state is what the receiving object's state() gives. Its schema is that object's current
# state(): the same keys and JSON kinds, so it cannot drift from the writers.
_INT64 = 2**63
_SEED_END = 2**63  # SolverParameter.random_seed is an int64; a run's seed is 0 or more


def field_where(path: str) -> str:
    return f"{path}: purine state (field {PRIVATE_STATE_FIELD})"


def h5_where(path: str) -> str:
    return f"{path}: purine state (dataset '{PRIVATE_DATASET}')"


def private_fields(data: bytes, path: str) -> list[bytes]:
    """The private-state payloads of a binary SolverState's bytes."""
    try:
        return list(length_fields(data, PRIVATE_STATE_FIELD))
    except ProtoError as e:  # the wire reader does not know the file
        raise ProtoError(f"{path}: {e}") from None


def _kind(v: Any) -> str:
    """A JSON value's kind, as a message names it (bool before int: bool is an int)."""
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
                    (str, "a string"), (list, "a list"), (dict, "an object")):
        if isinstance(v, t):
            return name
    return "null"


def parse_private(payload: str | bytes, where: str) -> dict:
    """The private state's JSON, checked at the top: an object with ``seed`` (null or an
    integer in [0, 2**63)) and ``stateful`` (an object of objects). Other top-level keys
    are left alone, as unknown keys of ``stateful`` are."""
    try:
        state = json.loads(payload)
    except RecursionError:  # nesting deeper than the interpreter's stack
        raise PurineError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # not JSON, not UTF-8, or an integer of thousands of digits
        raise PurineError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(state, dict) or "seed" not in state or "stateful" not in state:
        raise PurineError(f"{where}: {_kind(state)}; expected an object with keys 'seed' "
                          "and 'stateful'")
    seed = state["seed"]
    if seed is not None and (_kind(seed) != "an integer" or not 0 <= seed < _SEED_END):
        raise PurineError(f"{where}: seed is {_show(seed)}; expected null or an integer from "
                          f"0 to {_SEED_END - 1}")
    stateful = state["stateful"]
    if not isinstance(stateful, dict):
        raise PurineError(f"{where}: stateful is {_kind(stateful)}; expected an object")
    for key, value in stateful.items():
        if not isinstance(value, dict):
            raise PurineError(f"{where}: '{key}' is {_kind(value)}; expected an object")
    return state


def _show(v: Any) -> str:
    """A JSON scalar for a message, cut short."""
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def state_problem(want: Any, got: Any, at: str = "") -> str | None:
    """Why ``got`` lacks the JSON structure of ``want`` (an object's state() now), or None:
    the same keys, the same kinds (an integer may stand for a number), integers within
    int64; a list's items each like ``want``'s first, or scalars where ``want`` is empty.
    ``at`` is the path inside the state ("count", "shape[1]")."""
    name = f"'{at}'" if at else "the state"
    kind, got_kind = _kind(want), _kind(got)
    if got_kind != kind and not (kind == "a number" and got_kind == "an integer"):
        return f"{name} is {got_kind}; expected {kind}"
    if got_kind == "an integer" and not -_INT64 <= got < _INT64:
        return f"{name} is {_show(got)}, outside the 64-bit integer range"
    if kind == "an object":
        if got.keys() != want.keys():
            return f"{name} has keys {sorted(got)}; expected {sorted(want)}"
        for k, w in want.items():
            problem = state_problem(w, got[k], f"{at}.{k}" if at else k)
            if problem:
                return problem
    if kind == "a list":
        for i, item in enumerate(got):
            if want:
                problem = state_problem(want[0], item, f"{at}[{i}]")
            elif isinstance(item, list | dict):
                problem = f"'{at}[{i}]' is {_kind(item)}; expected a scalar"
            else:
                problem = None
            if problem:
                return problem
    return None


# -- the binary .solverstate ------------------------------------------------------------------
def encode_solverstate(iteration: int, learned_net: str, current_step: int,
                       history: Iterable[np.ndarray], private: dict) -> Chunks:
    """A binary SolverState: Caffe's fields (``history`` in Caffe's order) and the private
    state, as chunks for atomic_write (a history array is not copied)."""
    head = pb.SolverState(iter=iteration, learned_net=learned_net,
                          current_step=current_step).SerializeToString()
    parts: Chunks = [head]
    for a in history:
        parts += nested_field(3, blob_chunks(a))
    parts += len_field(PRIVATE_STATE_FIELD, json.dumps(private).encode())
    return parts


def read_solverstate(path: str | os.PathLike) -> tuple[pb.SolverState, list[bytes]]:
    """A binary SolverState's message and its private-state payloads (none in Caffe's)."""
    path = os.fspath(path)
    data = read_bounded(path, BINARY_LIMIT, error=ProtoError)  # read once: parsed twice
    return parse_binary(data, pb.SolverState(), path), private_fields(data, path)


def history_array(path: str, k: int, blob: pb.BlobProto, name: str, count: int) -> np.ndarray:
    """History blob ``k`` of file ``path`` as an array, checked to hold the ``count`` values
    of parameter ``name`` (Caffe's blob may be in the legacy 4-d shape)."""
    try:
        a = blob_to_array(blob)
    except ProtoError as e:
        raise ProtoError(f"{path}: history blob {k}: {e}") from None
    if a.size != count:
        raise PurineError(f"{path}: history blob {k} has {a.size} values, parameter "
                          f"'{name}' needs {count}")
    return a


def snapshot_seed(path: str | os.PathLike) -> int | None:
    """The random seed a .solverstate of ours was trained with (None for Caffe's), so a
    run with ``random_seed`` unset can resume with the same random streams. A private state
    that breaks its schema is an error naming the file."""
    path = os.fspath(path)
    if path.endswith(".h5"):
        payload = read_private(path)
        return None if payload is None else parse_private(payload, h5_where(path))["seed"]
    try:
        data = read_bounded(path, BINARY_LIMIT, error=ProtoError)
    except ProtoError:
        return None  # the restore reports the file
    for payload in private_fields(data, path):
        return parse_private(payload, field_where(path))["seed"]
    return None
