"""extract_features: the features of a small net with known weights over a Data layer, read
back from the LMDB / LevelDB with lmdb / plyvel and caffe_pb2.Datum, against the net's own
forward outputs and a numpy transcription; keys, Datum shape fields, commits of 1000, the
command line (purine-caffe extract_features) and its errors."""

import numpy as np
import plyvel
import pytest

import purine.backend
from purine import cli
from purine.caffe import TEST, Net
from purine.converters import ConvertError
from purine.converters.extract_features import datum_records, extract_features, main
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from tests.converters.helpers import Lines, read_lmdb
from tests.data.helpers import images, raw_datum, write_lmdb

NET = '''name: "feat"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  data_param {{ source: "{db}" backend: LMDB batch_size: {batch} }}
  transform_param {{ scale: 0.01 }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 2 kernel_size: 3 }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "conv" top: "ip1"
  inner_product_param {{ num_output: 5 }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 3 }} }}
'''


@pytest.fixture
def model(tmp_path):
    """(weights path, prototxt path, images (5, 1, 4, 4) uint8, {layer: [arrays]})."""
    imgs = images(5, (1, 4, 4), seed=11)
    db = write_lmdb(tmp_path / "input", [raw_datum(im, i) for i, im in enumerate(imgs)])
    proto = tmp_path / "net.prototxt"
    proto.write_text(NET.format(db=db, batch=3))
    net = Net(str(proto), phase=TEST)
    rng = np.random.default_rng(12)
    params = {}
    for name, views in net.params.items():
        params[name] = []
        for v in views:
            v.data[...] = rng.normal(size=v.shape).astype(np.float32)
            params[name].append(v.data.copy())
    weights = tmp_path / "w.caffemodel"
    net.save(weights)
    return str(weights), str(proto), imgs, params


def numpy_features(x, params):
    """conv (3x3, no pad), ip1 + ReLU, ip2 as plain numpy in float64."""
    w, b = (p.astype(np.float64) for p in params["conv"])
    n, _, hh, ww = x.shape
    conv = np.zeros((n, 2, hh - 2, ww - 2))
    for i in range(hh - 2):
        for j in range(ww - 2):
            conv[:, :, i, j] = np.einsum("nchw,ochw->no", x[:, :, i:i + 3, j:j + 3], w) + b
    w1, b1 = (p.astype(np.float64) for p in params["ip1"])
    ip1 = np.maximum(conv.reshape(n, -1) @ w1.T + b1, 0)
    w2, b2 = (p.astype(np.float64) for p in params["ip2"])
    return {"conv": conv, "ip1": ip1, "ip2": ip1 @ w2.T + b2}


def read_db(path, backend):
    if backend == "lmdb":
        items = read_lmdb(path)
    else:
        db = plyvel.DB(str(path))
        items = list(db)
        db.close()
    out = []
    for key, value in items:
        d = pb.Datum()
        d.ParseFromString(value)
        out.append((key.decode(), d, value))
    return out


@pytest.mark.parametrize("backend", ["lmdb", "leveldb"])
def test_features_equal_forward_outputs_and_numpy(tmp_path, model, backend):
    weights, proto, imgs, params = model
    dbs = [str(tmp_path / "f_conv"), str(tmp_path / "f_ip1")]
    lines = Lines()
    n = extract_features(weights, proto, ["conv", "ip1"], dbs, 3, backend, log=lines.log)
    assert n == 9
    assert lines.lines[-3:] == ["Extracted features of 9 query images for feature blob conv",
                                "Extracted features of 9 query images for feature blob ip1",
                                "Successfully extracted the features!"]

    net = Net(proto, weights, phase=TEST)  # the same batches, by the net's own forward
    want = {"conv": [], "ip1": []}
    for _ in range(3):
        net.forward()
        for name in want:
            want[name].extend(net.blobs[name].data.copy())
    order = [0, 1, 2, 3, 4, 0, 1, 2, 3]  # batches of 3 over 5 records, wrapping
    ref = numpy_features(imgs[order].astype(np.float64) * 0.01, params)
    for path, name, chw in zip(dbs, ("conv", "ip1"), ((2, 2, 2), (5, 1, 1))):
        got = read_db(path, backend)
        assert [k for k, _, _ in got] == [f"{i:010d}" for i in range(9)]
        for i, (_, d, raw) in enumerate(got):
            assert (d.channels, d.height, d.width) == chw
            assert not d.HasField("label") and not d.data and not d.encoded
            values = np.array(d.float_data, np.float32)
            np.testing.assert_array_equal(values, want[name][i].ravel())
            np.testing.assert_allclose(values, ref[name][i].ravel(), rtol=1e-5, atol=1e-5)
            # Exactly the fields Caffe's tool sets, so the bytes are its bytes.
            expect = pb.Datum(channels=chw[0], height=chw[1], width=chw[2],
                              float_data=want[name][i].ravel().tolist())
            assert raw == expect.SerializeToString()
    assert np.abs(ref["ip1"]).max() > 0.1 and (ref["ip1"] == 0).any()  # ReLU did clip


def test_commits_of_1000_and_the_count(tmp_path, model):
    weights, proto, imgs, _ = model
    big = tmp_path / "big.prototxt"
    big.write_text(NET.format(db=tmp_path / "input", batch=100))
    lines = Lines()
    out = tmp_path / "ip2"
    assert extract_features(weights, big, ["ip2"], [out], 11, "lmdb", log=lines.log) == 1100
    assert [s for s in lines.lines if s.startswith("Extracted")] == [
        "Extracted features of 1000 query images for feature blob ip2",
        "Extracted features of 1100 query images for feature blob ip2"]
    got = read_db(out, "lmdb")
    assert len(got) == 1100 and got[-1][0] == "0000001099"
    assert (got[0][1].channels, got[0][1].height, got[0][1].width) == (3, 1, 1)
    # Items 0 and 500 are both record 0 (500 = 100 wraps of 5 records).
    assert list(got[0][1].float_data) == list(got[500][1].float_data)


def test_the_command(tmp_path, model, capsys, monkeypatch):
    weights, proto, _, _ = model
    a, b = str(tmp_path / "a"), str(tmp_path / "b")

    def run(*args):
        return cli.main(["extract_features", weights, proto, *args])

    assert run("ip2,ip1", f"{a},{b}", "2", "leveldb", "CPU") == 0
    assert len(read_db(a, "leveldb")) == 6 and len(read_db(b, "leveldb")) == 6
    capsys.readouterr()

    assert run("ip2,nope", f"{tmp_path}/c,{tmp_path}/d", "1", "lmdb") == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"purine-caffe extract_features: Unknown feature blob name 'nope' in the network "
        f"{proto}")
    assert run("ip2,ip1", f"{tmp_path}/c", "1", "lmdb") == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "purine-caffe extract_features: 2 blob name(s) (ip2,ip1) but 1 database name(s) "
        f"({tmp_path}/c): the counts must be equal")
    assert run("ip1,ip2", f"{tmp_path}/c,{a}", "1", "lmdb") == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"purine-caffe extract_features: {a}: already exists; remove it or choose another "
        "name (Caffe's tools never write into an existing database)")
    assert run("ip1", f"{tmp_path}/c", "1", "rocksdb") == 1
    assert "unknown backend 'rocksdb'; use lmdb or leveldb" in capsys.readouterr().err
    assert run("ip1", f"{tmp_path}/c", "1", "lmdb", "TPU") == 1
    assert "device 'TPU': expected CPU or GPU" in capsys.readouterr().err
    assert run("ip1", f"{tmp_path}/c", "-1", "lmdb") == 1
    assert "num_mini_batches must be 0 or more, got -1" in capsys.readouterr().err
    monkeypatch.setattr(purine.backend, "gpu_unavailable", lambda: "CuPy is not installed")
    assert run("ip1", f"{tmp_path}/c", "1", "lmdb", "GPU", "1") == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "purine-caffe extract_features: GPU 1: CuPy is not installed; give CPU (or nothing) "
        "to use the CPU")
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
    with pytest.raises(SystemExit) as usage:  # too few arguments: argparse's usage error
        run("ip1", f"{tmp_path}/c")
    assert usage.value.code == 2
    assert "the following arguments are required: NUM_MINI_BATCHES, DB_TYPE" in (
        capsys.readouterr().err)
    # The module's own entry point, as the other converters have.
    assert main([weights, proto, "ip1", str(tmp_path / "e"), "1", "lmdb"]) == 0
    assert len(read_db(tmp_path / "e", "lmdb")) == 3


def test_an_error_mid_run_leaves_no_database(tmp_path, model):
    weights, _, imgs, _ = model
    recs = [raw_datum(im, i) for i, im in enumerate(imgs)]
    recs[4] = (b"00000004", b"\xff\xfe not a datum")
    db = write_lmdb(tmp_path / "bad", recs)
    proto = tmp_path / "bad.prototxt"
    proto.write_text(NET.format(db=db, batch=3))
    with pytest.raises(PurineError, match="record '00000004': not a serialized Datum"):
        extract_features(weights, proto, ["ip1"], [tmp_path / "out"], 3, "lmdb",
                         log=Lines().log)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConvertError, match="blob 'x' has shape"):
        from purine.converters.extract_features import _legacy_dims
        _legacy_dims("x", (1, 2, 3, 4, 5))


def test_records_are_the_bytes_protobuf_writes_for_each_datum():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((4, 12))  # float64 blobs are stored as float32, as Caffe's
    values[0, 0], values[1, 3] = np.nan, -0.0
    records = datum_records(values, 3, 2, 2)
    assert len(records) == 4
    for row, record in zip(values, records, strict=True):
        datum = pb.Datum(channels=3, height=2, width=2)
        datum.float_data.extend(row.astype(np.float32).tolist())
        assert record == datum.SerializeToString()
