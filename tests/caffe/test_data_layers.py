"""The data layers in nets: Data over LMDBs written here (raw and encoded records, Caffe's
transforms, wrap-around, rand_skip, replicas, determinism, cursor restore, prefetch errors
that surface instead of hanging), ImageData, MemoryData, HDF5Data, and a Data-layer net
that trains, snapshots and resumes with exactly the batches of an uninterrupted run."""

import threading

import cv2
import h5py
import lmdb
import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.caffe.layers.data import add_images, set_input_arrays
from purine.caffe.solver import Solver
from purine.errors import LayerError, PurineError
from tests.data.helpers import (
    caffe_transform,
    data_layer,
    data_net,
    encoded_datum,
    images,
    match_transform,
    raw_datum,
    replica_labels,
    train_step,
    write_lmdb,
    write_mean,
)


def batches(net, n):
    """Every blob of ``n`` forward passes, by name."""
    out = []
    for _ in range(n):
        net.forward()
        out.append({k: v.data.copy() for k, v in net.blobs.items()})
    return out


def forward_within(net, seconds=10.0):
    """net.forward() in a helper thread: returns its exception, and fails on a hang."""
    result = {}

    def run():
        try:
            net.forward()
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the forward pass hung"
    return result.get("error")


@pytest.fixture
def raw_db(tmp_path):
    imgs = images(10, (3, 8, 9), seed=1)
    return write_lmdb(tmp_path / "raw", [raw_datum(im, i) for i, im in enumerate(imgs)]), imgs


# -- Data: records and order -----------------------------------------------------------------
def test_raw_records_in_key_order_wrapping(raw_db):
    db, imgs = raw_db
    net = data_net(db, dtype="float64")
    assert net.blobs["data"].shape == (4, 3, 8, 9) and net.blobs["label"].shape == (4,)
    got = batches(net, 3)
    order = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    for b, idx in zip(got, order):
        assert b["label"].tolist() == idx
        np.testing.assert_array_equal(b["data"], imgs[idx].astype(np.float64))
    # One top: no labels, as Caffe's output_labels_ = top.size() > 1.
    single = data_net(db, tops=("data",), batch=3)
    assert list(single.blobs) == ["data"]
    np.testing.assert_array_equal(batches(single, 1)[0]["data"], imgs[:3])


def test_encoded_records(tmp_path):
    rng = np.random.default_rng(2)
    bgr = rng.integers(0, 256, (5, 6, 7, 3), dtype=np.uint8)
    png = write_lmdb(tmp_path / "png", [encoded_datum(im, i) for i, im in enumerate(bgr)])
    got = batches(data_net(png, batch=5), 1)[0]
    np.testing.assert_array_equal(got["data"], bgr.transpose(0, 3, 1, 2))
    assert got["label"].tolist() == [0, 1, 2, 3, 4]
    gray = data_net(png, batch=2, transform="force_gray: true")
    assert gray.blobs["data"].shape == (2, 1, 6, 7)
    recs = [encoded_datum(im, 0, ext=".jpg") for im in bgr]
    jpg = write_lmdb(tmp_path / "jpg", recs)
    want = [cv2.imdecode(np.frombuffer(r.data, np.uint8), cv2.IMREAD_UNCHANGED) for r in recs]
    np.testing.assert_array_equal(batches(data_net(jpg, batch=5), 1)[0]["data"],
                                  np.stack(want).transpose(0, 3, 1, 2))
    # Gray images stay 1-channel natively and become 3 channels with force_color.
    g = write_lmdb(tmp_path / "g", [encoded_datum(im[..., 0], 0) for im in bgr])
    assert data_net(g, batch=2).blobs["data"].shape == (2, 1, 6, 7)
    colored = batches(data_net(g, batch=2, transform="force_color: true"), 1)[0]["data"]
    np.testing.assert_array_equal(colored, np.repeat(bgr[:2, None, ..., 0], 3, axis=1))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_train_transforms_match_caffe(tmp_path, raw_db, dtype):
    db, imgs = raw_db
    mean = np.random.default_rng(3).uniform(0, 255, (3, 8, 9)).astype(np.float32)
    mf = write_mean(tmp_path / "mean.binaryproto", mean)
    net = data_net(db, batch=5, dtype=dtype,
                   transform=f'crop_size: 5 mirror: true scale: 0.125 mean_file: "{mf}"')
    seen = set()
    for k, b in enumerate(batches(net, 4)):
        for i in range(5):
            rec = (k * 5 + i) % 10
            seen.add(match_transform(b["data"][i], imgs[rec], True, crop=5, mirror=True,
                                     scale=0.125, mean=mean, dtype=dtype))
    assert len(seen) > 5 and {m for *_, m in seen} == {False, True}


def test_test_phase_centre_crop(raw_db):
    db, imgs = raw_db
    net = data_net(db, phase=TEST, batch=2, transform="crop_size: 4 mean_value: 100 "
                   "mean_value: 50 mean_value: 0")
    b = batches(net, 1)[0]
    for i in range(2):  # centre of (8, 9) for 4: (2, 2)
        np.testing.assert_array_equal(
            b["data"][i], caffe_transform(imgs[i], crop=4, h_off=2, w_off=2,
                                          mean_values=[100, 50, 0]))


def test_rand_skip(raw_db):
    db, imgs = raw_db
    skips = set()
    for seed in range(8):
        first = batches(data_net(db, batch=3, extra="rand_skip: 4", seed=seed), 2)
        s = int(first[0]["label"][0])
        assert 0 <= s < 4
        assert first[0]["label"].tolist() == [s, s + 1, s + 2]
        assert first[1]["label"].tolist() == [(s + i) % 10 for i in range(3, 6)]
        again = batches(data_net(db, batch=3, extra="rand_skip: 4", seed=seed), 1)
        assert int(again[0]["label"][0]) == s  # seeded
        skips.add(s)
    assert len(skips) > 1


def test_replicas_read_disjoint_batches(tmp_path):
    db = write_lmdb(tmp_path / "db", [raw_datum(im, i) for i, im in
                                      enumerate(images(12, (1, 2, 2)))])
    text = data_layer(db, batch=2)
    got = [replica_labels(text, r, 3, 2) for r in range(3)]
    # Replica r's batch k is database batch k*R + r.
    assert got == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    assert replica_labels(text, 0, 1, 6) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9],
                                             [10, 11]]


def test_same_seed_same_batches_and_restore_continues_exactly(raw_db):
    db, _ = raw_db
    t = "crop_size: 5 mirror: true"
    a = batches(data_net(db, batch=3, transform=t, seed=7), 5)
    b = batches(data_net(db, batch=3, transform=t, seed=7), 5)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["data"], y["data"])
    on_demand = batches(data_net(db, batch=3, transform=t, seed=7, extra="prefetch: 0"), 5)
    for x, y in zip(a, on_demand):  # no thread, same batches
        np.testing.assert_array_equal(x["data"], y["data"])
    other = batches(data_net(db, batch=3, transform=t, seed=8), 5)
    assert any(not np.array_equal(x["data"], y["data"]) for x, y in zip(a, other))

    net = data_net(db, batch=3, transform=t, seed=7)
    batches(net, 2)
    cursor = net.builder.stateful["data/cursor"]
    state = cursor.state()
    assert state == {"batch": 2}
    fresh = data_net(db, batch=3, transform=t, seed=7)
    fresh.builder.stateful["data/cursor"].restore(state)
    for x, y in zip(batches(fresh, 3), a[2:]):
        np.testing.assert_array_equal(x["data"], y["data"])
        np.testing.assert_array_equal(x["label"], y["label"])
    batches(net, 2)  # prefetched batches are discarded on restore
    cursor.restore({"batch": 1})
    np.testing.assert_array_equal(batches(net, 1)[0]["data"], a[1]["data"])


# -- Data: errors ----------------------------------------------------------------------------
def test_corrupt_record_surfaces_without_hang(tmp_path):
    recs = [raw_datum(im, i) for i, im in enumerate(images(6, (1, 3, 3)))]
    recs[3] = (b"00000003", b"\xff\xfe garbage")
    db = write_lmdb(tmp_path / "bad", recs)
    for prefetch in (4, 0):
        net = data_net(db, batch=2, extra=f"prefetch: {prefetch}")
        assert forward_within(net) is None
        err = forward_within(net)
        assert isinstance(err, PurineError)
        assert f"LMDB '{db}': record '00000003': not a serialized Datum" in str(err)
        assert "op 'data/Data'" in str(err)
        assert isinstance(forward_within(net), PurineError)  # the same batch again


def test_truncated_jpeg_surfaces_without_hang(tmp_path):
    bgr = images(4, (8, 8, 3))
    recs = [encoded_datum(im, i, ext=".jpg") for i, im in enumerate(bgr)]
    recs[2].data = recs[2].data[:60]
    db = write_lmdb(tmp_path / "jpg", recs)
    net = data_net(db, batch=2)
    assert forward_within(net) is None
    err = forward_within(net)
    assert isinstance(err, PurineError)
    assert "record '00000002': cannot decode the encoded image" in str(err)


def test_record_of_another_size(tmp_path):
    recs = [raw_datum(im, 0) for im in images(3, (3, 8, 8))] + [raw_datum(images(1, (3, 6, 8))[0])]
    db = write_lmdb(tmp_path / "db", recs)
    err = forward_within(data_net(db, batch=4))
    assert "record '00000003': image (channels, height, width) = (3, 6, 8)" in str(err)
    assert "takes (3, 8, 8)" in str(err)
    # With a crop, records of any size >= crop_size are fine, as in Caffe.
    assert forward_within(data_net(db, batch=4, transform="crop_size: 5")) is None
    err = forward_within(data_net(db, batch=4, transform="crop_size: 7"))
    assert "record '00000003': crop_size 7 is larger than the image" in str(err)


def test_each_batch_takes_its_first_records_size(tmp_path):
    # Caffe's DataLayer reshapes to each batch's first record: a batch of one takes any size,
    # and a net after the layer follows (here a convolution and a global pooling).
    sizes = [(3, 8, 8), (3, 6, 9), (3, 8, 8), (3, 5, 7)]
    imgs = [images(1, s, seed=i)[0] for i, s in enumerate(sizes)]
    db = write_lmdb(tmp_path / "db", [raw_datum(im, i) for i, im in enumerate(imgs)])
    conv = ('layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" '
            'convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "gaussian" '
            'std: 0.1 } } } layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" '
            'pooling_param { pool: AVE global_pooling: true } }')
    net = Net(data_layer(db, batch=1) + conv, phase=TEST, dtype="float64")
    w, b = net.params["conv"][0].data, net.params["conv"][1].data
    for k in range(6):  # wrapping: the first record again
        im = imgs[k % 4].astype(np.float64)
        out = net.forward()
        np.testing.assert_array_equal(net.blobs["data"].data, im[None])
        assert net.blobs["conv"].shape == (1, 2, im.shape[1] - 2, im.shape[2] - 2)
        win = np.lib.stride_tricks.sliding_window_view(im, (3, 3), axis=(1, 2))
        conv_ref = np.einsum("chwij,ocij->ohw", win, w) + b[:, None, None]
        np.testing.assert_allclose(out["pool"].ravel(), conv_ref.mean(axis=(1, 2)), rtol=1e-12)
    assert len(net.builds()) == 3  # one per size, made once
    # Records of one batch must agree with its first: batches of two, the second mixing.
    sizes = [(3, 8, 8), (3, 8, 8), (3, 5, 7), (3, 6, 6)]
    db2 = write_lmdb(tmp_path / "db2", [raw_datum(images(1, s, seed=i)[0], i)
                                        for i, s in enumerate(sizes)])
    net2 = data_net(db2, batch=2)
    net2.forward()
    assert net2.blobs["data"].shape == (2, 3, 8, 8)
    err = forward_within(net2)
    assert "record '00000003': image (channels, height, width) = (3, 6, 6) gives (3, 6, 6); " \
           "its batch takes (3, 5, 7)" in str(err)


def test_build_errors(tmp_path, raw_db):
    db, _ = raw_db
    with pytest.raises(LayerError, match="layer 'data' .*LMDB '.*nowhere' does not exist"):
        data_net(tmp_path / "nowhere")
    with pytest.raises(LayerError, match="LMDB '.*empty' has no records"):
        data_net(write_lmdb(tmp_path / "empty", []))
    assert data_net(db, backend=None).blobs["data"].shape == (4, 3, 8, 9)  # read as what it is
    with pytest.raises(LayerError, match="batch_size must be positive"):
        data_net(db, batch=0)
    with pytest.raises(LayerError, match=r"record '00000000': crop_size 9 is larger than the "
                                         r"image .* \(3, 8, 9\)"):
        data_net(db, transform="crop_size: 9")
    bad = write_mean(tmp_path / "m.binaryproto", np.zeros((3, 9, 8), np.float32))
    with pytest.raises(LayerError, match=r"\(3, 8, 9\), but the mean file '.*m.binaryproto' "
                                         r"is \(3, 9, 8\)"):
        data_net(db, transform=f'mean_file: "{bad}"')
    with pytest.raises(LayerError, match="mean_file and mean_value"):
        data_net(db, transform=f'mean_file: "{bad}" mean_value: 1')
    with pytest.raises(LayerError, match="needs 1-2 top"):
        data_net(db, tops=("a", "b", "c"))


# -- ImageData -------------------------------------------------------------------------------
@pytest.fixture
def image_files(tmp_path):
    rng = np.random.default_rng(4)
    imgs = []
    for i in range(5):
        im = rng.integers(0, 256, (6 + i, 7, 3), dtype=np.uint8)  # sizes differ
        cv2.imwrite(str(tmp_path / f"im{i}.png"), im)
        imgs.append(im)
    (tmp_path / "list.txt").write_text("".join(f"im{i}.png {10 + i}\n" for i in range(5)))
    return tmp_path, imgs


def image_net(root, extra="", transform="", seed=0, batch=5):
    return Net(f'''layer {{ name: "img" type: "ImageData" top: "data" top: "label"
      image_data_param {{ source: "{root}/list.txt" root_folder: "{root}/" batch_size: {batch}
      new_height: 4 new_width: 5 {extra} }} transform_param {{ {transform} }} }}''',
               phase=TRAIN, seed=seed)


def test_image_data_resize_and_order(image_files):
    root, imgs = image_files
    net = image_net(root, batch=3)
    assert net.blobs["data"].shape == (3, 3, 4, 5)
    want = [cv2.resize(im, (5, 4)).transpose(2, 0, 1) for im in imgs]
    got = batches(net, 2)
    assert got[0]["label"].tolist() == [10, 11, 12] and got[1]["label"].tolist() == [13, 14, 10]
    np.testing.assert_array_equal(got[1]["data"], np.stack([want[3], want[4], want[0]]))
    gray = image_net(root, extra="is_color: false", batch=1)
    assert gray.blobs["data"].shape == (1, 1, 4, 5)


def test_image_data_shuffle_is_seeded_per_epoch_and_resumes(image_files):
    root, imgs = image_files
    want = {10 + i: cv2.resize(im, (5, 4)).transpose(2, 0, 1) for i, im in enumerate(imgs)}
    net = image_net(root, extra="shuffle: true", seed=3)
    epochs = batches(net, 4)
    for b in epochs:
        assert sorted(b["label"].tolist()) == [10, 11, 12, 13, 14]
        for lab, img in zip(b["label"].astype(int), b["data"]):
            np.testing.assert_array_equal(img, want[lab])
    assert len({tuple(b["label"]) for b in epochs}) > 1
    again = image_net(root, extra="shuffle: true", seed=3)
    again.builder.stateful["img/cursor"].restore({"batch": 2})
    assert [b["label"].tolist() for b in batches(again, 2)] == [
        b["label"].tolist() for b in epochs[2:]]


def test_image_data_errors(image_files):
    root, _ = image_files
    (root / "list.txt").write_text("im0.png 1\nim1.png\n")
    with pytest.raises(LayerError, match=r"list.txt:2: expected 'path label'"):
        image_net(root)
    (root / "list.txt").write_text("im0.png 1\nnothere.png 2\n")
    err = forward_within(image_net(root, batch=2))
    assert "list.txt:2: image '" in str(err) and "nothere.png': cannot read" in str(err)
    with pytest.raises(LayerError, match="new_height .* and new_width .* must be set together"):
        Net(f'''layer {{ name: "img" type: "ImageData" top: "data" top: "label"
          image_data_param {{ source: "{root}/list.txt" batch_size: 1 new_height: 4 }} }}''')


# -- MemoryData ------------------------------------------------------------------------------
MEMORY = '''layer { name: "mem" type: "MemoryData" top: "data" top: "label"
  memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 } %s }'''


def test_memory_data_set_input_arrays():
    net = Net(MEMORY % "", phase=TRAIN)
    with pytest.raises(PurineError, match="call set_input_arrays"):
        net.forward()
    data = np.arange(6 * 6, dtype=np.float32).reshape(6, 1, 2, 3)
    labels = np.arange(6, dtype=np.float32)
    set_input_arrays(net, data, labels)
    got = batches(net, 4)
    for b, start in zip(got, (0, 2, 4, 0)):
        np.testing.assert_array_equal(b["data"], data[start:start + 2])
        np.testing.assert_array_equal(b["label"], labels[start:start + 2])
    set_input_arrays(net, data[:2], labels[:2, None, None, None])  # pycaffe's 4-d labels
    np.testing.assert_array_equal(batches(net, 1)[0]["data"], data[:2])
    with pytest.raises(PurineError, match="multiple of the batch size 2"):
        set_input_arrays(net, data[:3], labels[:3])
    with pytest.raises(PurineError, match="same first dimension, got 4 and 2"):
        set_input_arrays(net, data[:4], labels[:2])
    with pytest.raises(PurineError, match=r"data array of shape \(2, 1, 3, 2\)"):
        set_input_arrays(net, data[:2].reshape(2, 1, 3, 2), labels[:2])
    with pytest.raises(PurineError, match="has no MemoryData layer"):
        set_input_arrays(Net('layer { name: "i" type: "Input" top: "x" input_param { '
                             'shape { dim: 1 } } }'), data, labels)


def test_memory_data_add_images_applies_the_transformer():
    net = Net(MEMORY % "transform_param { scale: 0.5 mean_value: 4 }", phase=TRAIN)
    ims = [np.full((2, 3), 10 * i, np.uint8) for i in range(4)]
    add_images(net, ims, [0, 1, 2, 3])
    got = batches(net, 2)
    np.testing.assert_array_equal(got[1]["data"][:, 0], [(np.full((2, 3), 10 * i) - 4) * 0.5
                                                         for i in (2, 3)])
    assert got[1]["label"].tolist() == [2, 3]
    # Arrays fed with set_input_arrays are not transformed, as in Caffe's Reset.
    set_input_arrays(net, np.ones((2, 1, 2, 3), np.float32), np.zeros(2, np.float32))
    np.testing.assert_array_equal(batches(net, 1)[0]["data"], np.ones((2, 1, 2, 3)))


# -- HDF5Data --------------------------------------------------------------------------------
def test_hdf5_data(tmp_path):
    for name, rows in (("a", range(0, 3)), ("b", range(3, 8))):
        with h5py.File(tmp_path / f"{name}.h5", "w") as f:
            f["data"] = np.array([np.full((2, 2), r) for r in rows], np.float64)
            f["label"] = np.array(rows, np.int32)
    (tmp_path / "list.txt").write_text(f"{tmp_path}/a.h5\n{tmp_path}/b.h5\n")

    def net(extra="", transform=""):
        return Net(f'''layer {{ name: "h5" type: "HDF5Data" top: "data" top: "label"
          hdf5_data_param {{ source: "{tmp_path}/list.txt" batch_size: 3 {extra} }}
          {transform} }}''', phase=TRAIN)

    n = net()
    assert n.blobs["data"].shape == (3, 2, 2) and n.blobs["label"].shape == (3,)
    got = batches(n, 3)
    assert [b["label"].tolist() for b in got] == [[0, 1, 2], [3, 4, 5], [6, 7, 0]]
    np.testing.assert_array_equal(got[1]["data"][:, 0, 0], [3, 4, 5])
    shuffled = [b["label"].tolist() for b in batches(net("shuffle: true"), 8)]
    flat = sum(shuffled, [])
    for e in range(3):
        assert sorted(flat[8 * e: 8 * e + 8]) == list(range(8))
    assert flat[:8] != list(range(8)) or flat[8:16] != list(range(8))
    with pytest.raises(LayerError, match="HDF5Data does not transform data"):
        net(transform="transform_param { scale: 2 }")


# -- training end to end ---------------------------------------------------------------------
TRAIN_NET = '''name: "tiny"
%s
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


def test_data_layer_net_trains_and_resumes_with_the_same_batches(tmp_path):
    imgs = images(14, (1, 6, 6), seed=9)
    db = write_lmdb(tmp_path / "train", [raw_datum(im, i % 3) for i, im in enumerate(imgs)])
    layers = (data_layer(db, batch=4, transform="crop_size: 4 mirror: true scale: 0.01")
              .replace('type: "Data"', 'type: "Data" include { phase: TRAIN }')
              + "\n" + data_layer(db, batch=2, transform="crop_size: 4 scale: 0.01")
              .replace('name: "data"', 'name: "test_data" include { phase: TEST }'))
    (tmp_path / "net.prototxt").write_text(TRAIN_NET % layers)
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path}/net.prototxt"\nbase_lr: 0.1\nmomentum: 0.9\nlr_policy: "fixed"\n'
        f'max_iter: 10\ntest_iter: 1\ntest_interval: 1000\nrandom_seed: 11\n'
        f'snapshot_prefix: "{tmp_path}/snap"\n')

    a = Solver(str(tmp_path / "solver.prototxt"))
    losses = []
    for _ in range(3):
        train_step(a)
        losses.append(a.net.loss)
    _, state = a.snapshot()
    straight = [train_step(a) for _ in range(3)]
    weights = a.net.params["ip"][0].data.copy()
    assert np.isfinite(losses).all()

    b = Solver(str(tmp_path / "solver.prototxt"))
    b.restore(state)
    assert b.iter == 3
    assert b.net.builder.stateful["data/cursor"].state() == {"batch": 3}
    for (data, label), (want_data, want_label) in zip([train_step(b) for _ in range(3)], straight):
        np.testing.assert_array_equal(data, want_data)
        np.testing.assert_array_equal(label, want_label)
    np.testing.assert_array_equal(b.net.params["ip"][0].data, weights)
    # The test net reads the same database (one LMDB environment shared in the process).
    out = b.test(0)
    assert np.isfinite(out["loss"])


def test_lmdb_open_for_writing_in_this_process(tmp_path):
    path = str(tmp_path / "db")
    env = lmdb.open(path, map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(b"a", raw_datum(images(1, (1, 2, 2))[0], 5).SerializeToString())
    with pytest.raises(LayerError, match="is open elsewhere in this process .* close that "
                                         "environment"):
        data_net(path, batch=1)
    env.close()
    assert batches(data_net(path, batch=1), 1)[0]["label"].tolist() == [5]
