"""Fuzzing .solverstate files: a small Adam solver's snapshot (random streams, a recurrent
layer's carried state, two history blobs per parameter), mutated in its SolverState fields,
its history blobs, the JSON of the project's private field and its wire bytes, then restored
into a fresh solver that takes one more step."""

from __future__ import annotations

import base64
import copy
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from purine.caffe.solver import PRIVATE_STATE_FIELD, Solver
from purine.formats import caffe_pb2 as pb
from purine.formats.wire import len_field
from tests.fuzz.harness import (
    INT32,
    Draw,
    check,
    counted,
    ints_in,
    mutated_blob,
    mutated_bytes,
    share,
)

NET = """name: "state"
layer { name: "data" type: "DummyData" top: "x" top: "y" top: "cont" dummy_data_param {
  shape { dim: 2 dim: 3 dim: 4 } shape { dim: 2 dim: 3 dim: 2 } shape { dim: 2 dim: 3 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 }
  data_filler { type: "constant" value: 1 } } }
layer { name: "rnn" type: "RNN" bottom: "x" bottom: "cont" top: "h"
  recurrent_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "drop" type: "Dropout" bottom: "h" top: "h" }
layer { name: "loss" type: "EuclideanLoss" bottom: "h" bottom: "y" top: "loss" }
"""
SEED_DIR = Path(tempfile.mkdtemp(prefix="purine-fuzz-solverstate-"))
SOLVER = (f'net_param {{ {NET} }}\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 100\n'
          f'type: "Adam"\nmomentum: 0.9\nrandom_seed: 3\nsnapshot_prefix: "{SEED_DIR}/s"\n')


def snapshot() -> tuple[pb.SolverState, dict, str]:
    """The seed: the solver state after two steps, its private JSON, its caffemodel."""
    with Solver(SOLVER) as s:
        s.step(2)
        model, state = s.snapshot()
    data = Path(state).read_bytes()
    message = pb.SolverState.FromString(data)  # the private field stays an unknown field
    plain = pb.SolverState()
    plain.CopyFrom(message)
    plain.DiscardUnknownFields()
    return plain, s._private_state(), model


STATE, PRIVATE, MODEL = snapshot()
JSON_VALUES = (None, True, "x", "", [], {}, -1, 0, 2 ** 31, 10 ** 30, -(10 ** 30), 1.5, 1e308,
               float("nan"), float("inf"), [1, 2], {"count": 1}, "AAAA", "!!", [[[[[0]]]]])
BY_KEY: dict[str, tuple[Any, ...]] = {
    "dtype": ("<f8", "|O", "<U4", "bogus", "<f2", "V8", "<c16", "<f4"),
    "shape": ([], [1, 3, 2], [-1], [2 ** 40], [1, 3, 2, 1], [3, 2], "x", [1.5, 3, 2]),
    "data": ("", "AAAA", base64.b64encode(bytes(24)).decode(), "!!", "AAA",
             base64.b64encode(bytes(25)).decode()),
}
NEW_KEYS = ("count", "batch", "pos", "added", "dtype", "shape", "data", "stateful", "seed", "z")
LEARNED = ("", "/nonexistent/x.caffemodel", str(SEED_DIR), "relative.caffemodel", "\xff")


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) in a JSON value, the root's () first."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _at(root: Any, path: tuple) -> Any:
    for k in path:
        root = root[k]
    return root


def mutate_json(draw: Draw, root: Any) -> Any:
    """One structured change: a value of another type or size, a key gone or added."""
    path = draw(st.sampled_from(_paths(root)))
    what = draw(st.sampled_from(("set", "set", "delete", "add")))
    if what == "set":
        key = path[-1] if path else None
        pool = BY_KEY.get(key, JSON_VALUES) if isinstance(key, str) else JSON_VALUES
        value = copy.deepcopy(draw(st.sampled_from(pool)))  # later changes stay in this case
        if not path:
            return value
        _at(root, path[:-1])[path[-1]] = value
    elif what == "delete" and path:
        del _at(root, path[:-1])[path[-1]]
    elif what == "add" and isinstance(_at(root, path), dict):
        _at(root, path)[draw(st.sampled_from(NEW_KEYS))] = copy.deepcopy(
            draw(st.sampled_from(JSON_VALUES)))
    return root


@st.composite
def private_payload(draw: Draw) -> bytes:
    """The private field's payload: the seed JSON after structured changes, or text that
    is cut short, not UTF-8 or nested past any sane depth."""
    root = json.loads(json.dumps(PRIVATE))
    for _ in range(draw(st.integers(0, 3))):
        root = mutate_json(draw, root)
    text = json.dumps(root).encode()
    tail = draw(st.sampled_from(("none", "none", "none", "cut", "bytes", "deep")))
    if tail == "cut":
        text = text[:draw(st.integers(0, len(text)))]
    elif tail == "bytes":
        text += b"\xff"
    elif tail == "deep":
        depth = draw(st.sampled_from((100, 10 ** 4, 10 ** 5)))
        text = b'{"seed": 1, "stateful": ' + b"[" * depth + b"]" * depth + b"}"
    return text


def _history(draw: Draw, s: pb.SolverState) -> None:
    what = draw(st.sampled_from(("blob", "blob", "drop", "repeat", "clear")))
    k = draw(st.integers(0, len(s.history) - 1)) if s.history else None
    if what == "blob" and k is not None:
        s.history[k].CopyFrom(draw(mutated_blob(s.history[k])))
    elif what == "drop" and k is not None:
        del s.history[k]
    elif what == "repeat" and k is not None:
        s.history.add().CopyFrom(s.history[k])
    elif what == "clear":
        s.ClearField("history")


def _fields(draw: Draw, s: pb.SolverState) -> None:
    what = draw(st.sampled_from(("iter", "current_step", "learned_net")))
    if what == "learned_net":
        s.learned_net = draw(st.sampled_from(LEARNED))
    else:
        setattr(s, what, draw(ints_in(INT32)))


@st.composite
def mutated_state(draw: Draw) -> bytes:
    """The seed state with its fields, history and private JSON mutated (0..3 changes
    each), the private field repeated or left out, and possibly byte mutations."""
    s = pb.SolverState()
    s.CopyFrom(STATE)
    for _ in range(draw(st.integers(0, 2))):
        draw(st.sampled_from((_history, _fields)))(draw, s)
    parts = [s.SerializeToString()]
    for _ in range(draw(st.sampled_from((1, 1, 1, 0, 2)))):
        parts += len_field(PRIVATE_STATE_FIELD, draw(private_payload()))
    data = b"".join(parts)
    if draw(st.integers(0, 3)) == 0:
        data = draw(mutated_bytes(data))
    return data


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("solverstate")
    shutil.rmtree(SEED_DIR, ignore_errors=True)


def restore_and_step(path: Path) -> None:
    with Solver(SOLVER) as s:
        s.restore(path)
        s.step(1)


def learned_net(data: bytes) -> tuple[str, ...]:
    """The state's learned_net, if it has a readable one."""
    try:
        name = pb.SolverState.FromString(data).learned_net
    except Exception:  # noqa: BLE001 - a state protobuf cannot parse names no model
        return ()
    return (name,) if isinstance(name, str) and name else ()


@share(1.0)
@given(data=mutated_state())
@counted
def test_mutated_solverstate(case_dir: Path, data: bytes) -> None:
    path = case_dir / "s.solverstate"
    path.write_bytes(data)
    # An unreadable learned_net may be named instead of the state that refers to it.
    check(lambda: restore_and_step(path), path, also=learned_net(data))
