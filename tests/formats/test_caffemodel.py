"""caffemodel I/O: our fast encoding parses as protobuf's own, arrays round-trip, weights
copy by layer name, mismatches are named, writes are atomic."""

import os

import numpy as np
import pytest

from purine.caffe import TRAIN, Net
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import blob_to_array, encode_blob, load_weights

NET = """
name: "tiny"
layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 6 } } }
layer { name: "fc" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
"""


@pytest.mark.parametrize("shape", [(3,), (2, 3), (4, 1, 5, 5), ()])
def test_encoded_blob_parses_as_protobuf_and_round_trips(shape):
    a = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    blob = pb.BlobProto()
    blob.ParseFromString(encode_blob(a))
    assert list(blob.shape.dim) == list(shape)
    assert np.array_equal(np.array(blob.data, np.float32).reshape(shape), a)
    reference = pb.BlobProto(shape=pb.BlobShape(dim=shape), data=a.ravel().tolist())
    assert blob.SerializeToString() == reference.SerializeToString()


def test_legacy_4d_blob_and_double_data():
    b = pb.BlobProto(num=1, channels=1, height=2, width=3, double_data=[1, 2, 3, 4, 5, 6])
    a = blob_to_array(b)
    assert a.shape == (1, 1, 2, 3) and a.dtype == np.float32 and a[0, 0, 1, 2] == 6


def test_save_and_load_round_trip(tmp_path):
    net = Net(NET, phase=TRAIN, seed=5)
    path = tmp_path / "tiny.caffemodel"
    net.save(path)
    parsed = pb.NetParameter()
    parsed.ParseFromString(path.read_bytes())
    assert parsed.name == "tiny"
    assert [(l.name, l.type, len(l.blobs)) for l in parsed.layer] == [
        ("data", "Input", 0), ("fc", "InnerProduct", 2)]
    w = load_weights(path)
    assert np.array_equal(w["fc"][0], net.params["fc"][0].data)
    other = Net(NET, phase=TRAIN, seed=6)
    assert not np.array_equal(other.params["fc"][0].data, net.params["fc"][0].data)
    other.copy_from(path)
    assert np.array_equal(other.params["fc"][0].data, net.params["fc"][0].data)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_v1_caffemodel_layers_load_by_name(tmp_path):
    old = pb.NetParameter()
    layer = old.layers.add(name="fc", type=pb.V1LayerParameter.INNER_PRODUCT)
    w = np.arange(18, dtype=np.float32).reshape(3, 6)
    layer.blobs.add(num=1, channels=1, height=3, width=6, data=w.ravel().tolist())
    layer.blobs.add(num=1, channels=1, height=1, width=3, data=[1, 2, 3])
    path = tmp_path / "v1.caffemodel"
    path.write_bytes(old.SerializeToString())
    net = Net(NET)
    net.copy_from(path)
    assert np.array_equal(net.params["fc"][0].data, w)
    assert net.params["fc"][1].data.tolist() == [1, 2, 3]


def test_shape_mismatch_names_layer_and_both_shapes(tmp_path):
    other = NET.replace("num_output: 3", "num_output: 4")
    Net(other).save(tmp_path / "o.caffemodel")
    with pytest.raises(PurineError, match=r"layer 'fc' parameter 0 has shape \(4, 6\) in the "
                                          r"file, the net expects \(3, 6\)"):
        Net(NET).copy_from(tmp_path / "o.caffemodel")


def test_written_files_follow_the_umask(tmp_path):
    import stat

    old = os.umask(0o022)
    try:
        Net(NET).save(tmp_path / "m.caffemodel")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "m.caffemodel").st_mode) == 0o644


def test_an_empty_blob_with_a_dimension_past_caffes_int_is_refused():
    """Found by the long fuzz profile: (0, 2^62) holds 0 values, as its data says, but numpy
    cannot shape even an empty array so; Caffe's dims are C ints."""
    blob = pb.BlobProto()
    blob.shape.dim.extend([0, 2**62])
    with pytest.raises(PurineError, match=r"^BlobProto of shape \(0, 4611686018427387904\) has "
                                          r"dimension 1 = 4611686018427387904; at most "
                                          r"2147483647$"):
        blob_to_array(blob)
