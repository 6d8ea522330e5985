"""The binary .solverstate codec of purine.formats.solverstate against hand-built bytes and
protobuf's own parser: Caffe's fields, the history blobs, and the private field 1001."""

from __future__ import annotations

import json

import numpy as np
import pytest

from purine.errors import ProtoError, PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.solverstate import (
    encode_solverstate,
    history_array,
    read_solverstate,
    snapshot_seed,
)


def test_encoded_bytes_and_their_round_trip(tmp_path):
    private = {"seed": 7, "stateful": {}}
    h = np.array([1.5, -2.0], dtype=np.float32)
    data = b"".join(bytes(c) for c in encode_solverstate(3, "m.caffemodel", 1, [h], private))
    # iter (field 1) = 3, learned_net (field 2), current_step (field 4) = 1
    head = b"\x08\x03" + b"\x12\x0cm.caffemodel" + b"\x20\x01"
    assert data.startswith(head)
    text = json.dumps(private).encode()
    # field 1001, wire type 2: tag 8010 = varint CA 3E, then the length and the JSON
    assert data.endswith(b"\xca\x3e" + bytes([len(text)]) + text)
    state = pb.SolverState.FromString(data)  # protobuf keeps 1001 as an unknown field
    assert (state.iter, state.learned_net, state.current_step) == (3, "m.caffemodel", 1)
    assert list(state.history[0].data) == [1.5, -2.0]
    path = tmp_path / "x.solverstate"
    path.write_bytes(data)
    read, payloads = read_solverstate(path)
    assert read.iter == 3 and [json.loads(p) for p in payloads] == [private]
    assert snapshot_seed(path) == 7


def test_caffes_solverstate_has_no_private_state(tmp_path):
    path = tmp_path / "caffe.solverstate"
    path.write_bytes(pb.SolverState(iter=5).SerializeToString())
    state, payloads = read_solverstate(path)
    assert state.iter == 5 and payloads == []
    assert snapshot_seed(path) is None


def test_history_array_checks_the_parameter_size():
    blob = pb.BlobProto(data=[1.0, 2.0, 3.0])
    blob.shape.dim.extend([3])
    np.testing.assert_array_equal(history_array("f", 0, blob, "w", 3), [1.0, 2.0, 3.0])
    with pytest.raises(PurineError, match=r"^f: history blob 2 has 3 values, parameter 'w' "
                                          r"needs 4$"):
        history_array("f", 2, blob, "w", 4)
    bad = pb.BlobProto(data=[1.0])
    bad.shape.dim.extend([2])
    with pytest.raises(ProtoError, match=r"^f: history blob 1: "):
        history_array("f", 1, bad, "w", 2)
