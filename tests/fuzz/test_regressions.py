"""The fuzz suite's findings, shrunk by hand to a few lines each: every case must end in
success or one line of PurineError naming the file (or, for a net, the layer), as
harness.check asserts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from purine.caffe import TEST, Net
from purine.caffe.solver import PRIVATE_STATE_FIELD, Solver
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import load_weights
from purine.formats.prototxt import read_net
from purine.formats.wire import len_field, length_fields
from tests.fuzz.harness import check
from tests.fuzz.test_solver_settings import NET

SOLVER = f'net_param {{ {NET} }}\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 10\n'


def input_layer(*dims: int) -> str:
    shape = " ".join(f"dim: {d}" for d in dims)
    return f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ {shape} }} }} }}\n'


def build_and_forward(path: Path) -> None:
    with Net(str(path), phase=TEST) as net:
        net.forward()


def net_outcome(tmp_path: Path, text: str) -> str:
    """Build ``text`` from a file and run it forward; the checked outcome."""
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    return check(lambda: build_and_forward(path), path, also=("layer '",))


# -- binary files whose string fields are not UTF-8 (TypeError in the NUL check) ---------
def test_a_caffemodel_whose_net_name_is_not_utf8(tmp_path):
    path = tmp_path / "m.caffemodel"
    layer = pb.LayerParameter(name="ip", blobs=[pb.BlobProto(shape=pb.BlobShape(dim=[1]),
                                                             data=[1.0])])
    path.write_bytes(b"\x0a\x01\xff" + pb.NetParameter(layer=[layer]).SerializeToString())
    check(lambda: load_weights(path), path)


def test_a_solverstate_whose_learned_net_is_not_utf8(tmp_path):
    path = tmp_path / "s.solverstate"
    path.write_bytes(pb.SolverState(iter=1).SerializeToString() + b"\x12\x01\xff")
    with Solver(SOLVER) as s:
        check(lambda: s.restore(path), path)


# -- net files: errors of the input upgrade name the net, not the file -------------------
@pytest.mark.parametrize("head", [
    'input: "data"\n',  # no input_dim or input_shape
    'input: "data"\ninput_dim: 1 input_dim: 2\n',  # 2 input_dim values, 4 needed
])
def test_input_upgrade_errors_name_the_file(tmp_path, head):
    path = tmp_path / "net.prototxt"
    path.write_text(head + 'layer { name: "r" type: "ReLU" bottom: "data" top: "r" }\n')
    assert check(lambda: read_net(str(path)), path) == "ProtoError"


# -- blobs with a zero dimension (ValueError, ZeroDivisionError) -------------------------
@pytest.mark.parametrize("dims", [(0, 8, 4, 4), (2, 0, 4, 4)])
def test_lrn_over_an_empty_blob(tmp_path, dims):
    net_outcome(tmp_path, input_layer(*dims)
                + 'layer { name: "norm" type: "LRN" bottom: "data" top: "norm" }')


def test_convolution_of_zero_channels(tmp_path):
    net_outcome(tmp_path, input_layer(1, 0, 5, 5) + 'layer { name: "conv" type: "Convolution" '
                'bottom: "data" top: "conv" convolution_param { num_output: 2 kernel_size: 3 } }')


@pytest.mark.parametrize("layer", [
    'layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { '
    'num_output: 2 kernel_size: 1 weight_filler { type: "xavier" } } }',
    'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { '
    'num_output: 2 weight_filler { type: "msra" variance_norm: FAN_OUT } } }',
])
def test_fan_scaled_fillers_of_a_blob_with_zero_inputs(tmp_path, layer):
    net_outcome(tmp_path, input_layer(1, 0, 5, 5) + layer)


# -- fillers checked only when they run, naming an op ------------------------------------
@pytest.mark.parametrize("filler", ['type: ""', 'type: "gaussian" std: inf'])
def test_a_bad_dummy_data_filler_names_the_layer(tmp_path, filler):
    text = ('layer { name: "data" type: "DummyData" top: "x" dummy_data_param { '
            f"shape {{ dim: 2 dim: 3 }} data_filler {{ {filler} }} }} }}")
    assert net_outcome(tmp_path, text) != "success"


# -- solver settings refused without the file's name -------------------------------------
@pytest.mark.parametrize("setting", [
    "iter_size: 0",
    'type: "AdaGrad"\nmomentum: 0.9',
    'type: "sgd"',
    'type: "SGD"\nsolver_type: ADAM',
])
def test_refused_solver_settings_name_the_file(tmp_path, setting):
    path = tmp_path / "solver.prototxt"
    path.write_text(f"{SOLVER}{setting}\n")
    assert check(lambda: Solver(str(path)).close(), path) == "ProtoError"


# -- solver state: a private state the schema lets through -------------------------------
def test_a_negative_random_stream_count_is_refused(tmp_path):
    with Solver(SOLVER + f'snapshot_prefix: "{tmp_path}/s"\n') as s:
        s.step(1)
        _, state = s.snapshot()
    data = Path(state).read_bytes()
    private = json.loads(next(length_fields(data, PRIVATE_STATE_FIELD)))
    private["stateful"]["data/random#0"]["count"] = -1
    head = pb.SolverState.FromString(data)
    head.DiscardUnknownFields()
    Path(state).write_bytes(head.SerializeToString() + b"".join(
        len_field(PRIVATE_STATE_FIELD, json.dumps(private).encode())))

    def restore_and_step() -> None:
        with Solver(SOLVER) as s:
            s.restore(state)
            s.step(1)

    assert check(restore_and_step, state) != "success"


# -- sizes: refused by the memory check, never allocated ---------------------------------
def test_an_input_of_petabytes_is_refused_naming_the_layer(tmp_path):
    text = input_layer(2 ** 20, 2 ** 20, 2 ** 10) + \
        'layer { name: "r" type: "ReLU" bottom: "data" top: "r" }'
    assert net_outcome(tmp_path, text) == "LayerError"


# -- found by the long profile ---------------------------------------------------------
@pytest.mark.parametrize("bottoms", ["", 'bottom: "nowhere" '])
def test_a_split_layer_without_its_bottom_is_refused(tmp_path, bottoms):
    path = tmp_path / "net.prototxt"
    path.write_text(f'layer {{ name: "data" type: "Split" {bottoms}top: "x" top: "y" }}\n')
    with pytest.raises(PurineError, match="layer .data. \\(type Split\\): "):
        Net(str(path), TEST)
