"""Fuzzing net prototxt: the shipped nets (data layers turned into tiny Input layers, widths
cut to 8 so a net builds in milliseconds) mutated line by line, then parsed, built in the
TEST phase and run forward."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from google.protobuf import text_format
from hypothesis import given

from purine.caffe import TEST, Net
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import is_data_layer, read_net
from tests.fuzz.harness import (
    check,
    counted,
    field_names,
    mutated_text,
    share,
    skip_if_too_big,
)

ROOT = Path(__file__).resolve().parents[2]
# GoogLeNet (2,000 lines, 50 ms a build) and nets that need a Python module or a stage are
# left out: the rest build and run forward in a few milliseconds.
LEFT_OUT = ("googlenet", "linreg", "mnist_autoencoder")
IMAGE_SHAPES = ((2, 1, 28, 28), (2, 2, 28, 28), (1, 3, 67, 67))

V1_NET = """name: "v1"
input: "data"
input_dim: 2 input_dim: 1 input_dim: 8 input_dim: 8
layers { name: "conv" type: CONVOLUTION bottom: "data" top: "conv" blobs_lr: 1 blobs_lr: 2
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layers { name: "pool" type: POOLING bottom: "conv" top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layers { name: "relu" type: RELU bottom: "pool" top: "pool" }
layers { name: "ip" type: INNER_PRODUCT bottom: "pool" top: "ip"
  inner_product_param { num_output: 3 } }
layers { name: "prob" type: SOFTMAX bottom: "ip" top: "prob" }
"""


# The Caffe forks' layers (SSD, R-CNN, DeepLab, ShuffleNet, MobileNet, SENet, YOLO ports) in
# one small net, so that their parameters are mutated too.
FORK_NET = """name: "forks"
layer { name: "data" type: "Input" top: "data" top: "rois"
  input_param { shape { dim: 1 dim: 4 dim: 8 dim: 8 } shape { dim: 2 dim: 5 } } }
layer { name: "dw" type: "ConvolutionDepthwise" bottom: "data" top: "dw"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu6" type: "ReLU6" bottom: "dw" top: "dw" }
layer { name: "shuffle" type: "ShuffleChannel" bottom: "dw" top: "shuffle"
  shuffle_channel_param { group: 2 } }
layer { name: "mish" type: "Mish" bottom: "shuffle" top: "mish" }
layer { name: "gap" type: "Pooling" bottom: "mish" top: "gap"
  pooling_param { pool: AVE global_pooling: true } }
layer { name: "axpy" type: "Axpy" bottom: "gap" bottom: "mish" bottom: "data" top: "axpy" }
layer { name: "interp" type: "Interp" bottom: "axpy" top: "interp"
  interp_param { zoom_factor: 2 } }
layer { name: "up" type: "Upsample" bottom: "axpy" top: "up" upsample_param { scale: 2 } }
layer { name: "roi" type: "ROIPooling" bottom: "axpy" bottom: "rois" top: "roi"
  roi_pooling_param { pooled_h: 2 pooled_w: 2 spatial_scale: 0.5 } }
layer { name: "norm" type: "Normalize" bottom: "axpy" top: "norm"
  norm_param { across_spatial: false channel_shared: false
               scale_filler { type: "constant" value: 20 } } }
layer { name: "loc" type: "Convolution" bottom: "norm" top: "loc"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "loc_perm" type: "Permute" bottom: "loc" top: "loc_perm"
  permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "loc_flat" type: "Flatten" bottom: "loc_perm" top: "loc_flat" }
layer { name: "conf" type: "Convolution" bottom: "norm" top: "conf"
  convolution_param { num_output: 12 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "conf_perm" type: "Permute" bottom: "conf" top: "conf_perm"
  permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "conf_flat" type: "Flatten" bottom: "conf_perm" top: "conf_flat" }
layer { name: "prior" type: "PriorBox" bottom: "norm" bottom: "data" top: "prior"
  prior_box_param { min_size: 3 max_size: 6 aspect_ratio: 2 flip: true clip: true
                    variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 } }
layer { name: "det" type: "DetectionOutput" bottom: "loc_flat" bottom: "conf_flat"
  bottom: "prior" top: "det"
  detection_output_param { num_classes: 3 share_location: true background_label_id: 0
    nms_param { nms_threshold: 0.45 top_k: 20 } keep_top_k: 10 confidence_threshold: 0.01
    code_type: CENTER_SIZE } }
"""


def shrink(net: pb.NetParameter, image: tuple[int, ...]) -> pb.NetParameter:
    """The net with its data layers as Input layers (``image`` for the first top, a label
    vector for the others), batches of at most 2 and widths of at most 8."""
    out = pb.NetParameter()
    out.CopyFrom(net)
    for layer in out.layer:
        if is_data_layer(layer):
            stand_in = pb.LayerParameter(name=layer.name, type="Input", top=layer.top,
                                         include=layer.include, exclude=layer.exclude)
            for k in range(len(layer.top)):
                stand_in.input_param.shape.add(dim=image if k == 0 else image[:1])
            layer.CopyFrom(stand_in)
        for shape in list(layer.input_param.shape) + list(layer.dummy_data_param.shape):
            if shape.dim:
                shape.dim[0] = min(shape.dim[0], 2)
        for p in (layer.convolution_param, layer.inner_product_param):
            if p.num_output > 8:
                group = max(getattr(p, "group", 1), 1)
                p.num_output = max(group, 8 // group * group)
    return out


def builds(net: pb.NetParameter) -> bool:
    try:
        with Net(net, phase=TEST) as n:
            n.forward()
        return True
    except Exception:  # noqa: BLE001 - a seed that does not build is left out
        return False


@functools.cache
def seeds() -> list[str]:
    """The shipped nets, shrunk, each in a form that builds, as one-field-a-line text."""
    texts = {V1_NET, text_format.MessageToString(read_net(FORK_NET))}
    files = sorted(ROOT.glob("tests/fixtures/bvlc/*.prototxt")) + sorted(
        ROOT.glob("models/*/*.prototxt"))
    for f in files:
        if any(s in str(f) for s in LEFT_OUT) or "solver" in f.name:
            continue
        net = read_net(str(f))
        for image in IMAGE_SHAPES:
            small = shrink(net, image)
            if builds(small):
                texts.add(text_format.MessageToString(small))
                break
    return sorted(texts)


KEYS = field_names(pb.NetParameter)


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prototxt")


def test_the_seeds_build():
    assert len(seeds()) >= 20  # every shipped net but the ones left out, less duplicates


def build_and_run(path: str) -> None:
    with Net(path, phase=TEST) as net:
        net.forward()


@share(1.0)
@given(data=mutated_text(seeds(), KEYS))
@counted
def test_mutated_net_prototxt(case_dir: Path, data: bytes) -> None:
    path = case_dir / "net.prototxt"
    path.write_bytes(data)
    parsed: list[pb.NetParameter] = []
    if check(lambda: parsed.append(read_net(str(path))), path) != "success":
        return
    if skip_if_too_big(parsed[0]):
        return
    # A net that parses but does not build may name the layer instead of the file.
    check(lambda: build_and_run(str(path)), path, also=("layer '",))
