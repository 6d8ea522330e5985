"""convert_imageset: the LMDB it writes, read back with the lmdb package and caffe_pb2.Datum,
against images made with OpenCV and a hand-written PNG; raw, encoded, gray, resize, shuffle,
check_size, transactions, map growth, the flags as gflags spells them, and user errors."""

import io
import os
import re
import subprocess
import sys

import cv2
import lmdb
import numpy as np
import pytest

import purine.converters.convert_imageset as ci
from purine.converters import ConvertError
from purine.converters.convert_imageset import (
    Encoded,
    Progress,
    convert_imageset,
    main,
    write_images,
)
from purine.formats import caffe_pb2 as pb
from tests.converters.helpers import (
    Lines,
    chw_bytes,
    datums,
    make_imageset,
    read_lmdb,
    write_png_rgb,
)


@pytest.fixture
def imageset(tmp_path):
    listfile, entries = make_imageset(tmp_path / "images", n=5)
    return tmp_path, listfile, entries


def run(tmp_path, listfile, *flags, db="db"):
    return main([*flags, str(tmp_path / "images") + "/", str(listfile), str(tmp_path / db)])


def test_raw_datums_keys_shapes_bgr_labels_pixels(imageset):
    tmp_path, listfile, entries = imageset
    assert run(tmp_path, listfile) == 0
    got = datums(tmp_path / "db")
    assert [k for k, _ in got] == [f"{i:08d}_{name}" for i, (name, _, _) in enumerate(entries)]
    for (name, label, image), (_, d) in zip(entries, got):
        assert (d.channels, d.height, d.width, d.label) == (3, 6, 5, label)
        assert d.HasField("encoded") and not d.encoded and not d.float_data
        if name.endswith(".jpg"):  # lossy: the oracle is OpenCV's decode, as Caffe's
            image = cv2.imread(str(tmp_path / "images" / name))
        assert d.data == chw_bytes(image)


def test_channel_order_is_bgr_from_a_hand_written_png(tmp_path):
    rgb = np.array([[[255, 0, 0], [0, 255, 0], [0, 0, 255]],
                    [[10, 20, 30], [200, 100, 50], [1, 2, 3]]], np.uint8)
    (tmp_path / "images").mkdir()
    write_png_rgb(tmp_path / "images" / "x.png", rgb)
    listfile = tmp_path / "list.txt"
    listfile.write_text("x.png 7\n")
    assert run(tmp_path, listfile) == 0
    [(key, d)] = datums(tmp_path / "db")
    assert key == "00000000_x.png" and d.label == 7
    planes = np.frombuffer(d.data, np.uint8).reshape(3, 2, 3)
    assert planes[0].tolist() == [[0, 0, 255], [30, 50, 3]]  # blue
    assert planes[1].tolist() == [[0, 255, 0], [20, 100, 2]]  # green
    assert planes[2].tolist() == [[255, 0, 0], [10, 200, 1]]  # red


def test_lmdb_equals_one_built_independently_from_datums(imageset):
    tmp_path, listfile, entries = imageset
    assert run(tmp_path, listfile) == 0
    # The reference: Datum messages filled field by field, one lmdb transaction.
    env = lmdb.open(str(tmp_path / "ref"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i, (name, label, _) in enumerate(entries):
            image = cv2.imread(str(tmp_path / "images" / name), cv2.IMREAD_COLOR)
            d = pb.Datum()
            d.channels, d.height, d.width = 3, image.shape[0], image.shape[1]
            d.data = chw_bytes(image)
            d.label = label
            d.encoded = False
            txn.put(f"{i:08d}_{name}".encode(), d.SerializeToString())
    env.close()
    assert read_lmdb(tmp_path / "db") == read_lmdb(tmp_path / "ref")


def test_encoded_keeps_the_files_bytes(imageset):
    tmp_path, listfile, entries = imageset
    assert run(tmp_path, listfile, "--encoded") == 0
    for (name, label, _), (_, d) in zip(entries, datums(tmp_path / "db")):
        assert d.encoded and d.label == label
        assert not d.HasField("channels") and not d.HasField("height")
        assert d.data == (tmp_path / "images" / name).read_bytes()


def test_encode_type_re_encodes_and_implies_encoded(imageset):
    tmp_path, listfile, entries = imageset
    assert run(tmp_path, listfile, "-encode_type=png") == 0
    for (name, _, _), (_, d) in zip(entries, datums(tmp_path / "db")):
        assert d.encoded and d.data.startswith(b"\x89PNG")
        decoded = cv2.imdecode(np.frombuffer(d.data, np.uint8), cv2.IMREAD_UNCHANGED)
        assert np.array_equal(decoded, cv2.imread(str(tmp_path / "images" / name)))
        if name.endswith((".png", ".PNG")):
            assert d.data == (tmp_path / "images" / name).read_bytes()


def test_encoded_gray_re_encodes_color_files_as_gray(imageset):
    tmp_path, listfile, entries = imageset
    assert run(tmp_path, listfile, "--encoded", "--gray") == 0
    for (name, _, _), (_, d) in zip(entries, datums(tmp_path / "db")):
        decoded = cv2.imdecode(np.frombuffer(d.data, np.uint8), cv2.IMREAD_UNCHANGED)
        expected = cv2.imread(str(tmp_path / "images" / name), cv2.IMREAD_GRAYSCALE)
        assert decoded.ndim == 2
        if name.endswith(".jpg"):  # re-encoded as JPEG: lossy
            assert np.abs(decoded.astype(int) - expected).mean() < 8
        else:
            assert np.array_equal(decoded, expected)


def test_gray(imageset):
    tmp_path, listfile, entries = imageset
    assert run(tmp_path, listfile, "-gray") == 0
    for (name, _, _), (_, d) in zip(entries, datums(tmp_path / "db")):
        gray = cv2.imread(str(tmp_path / "images" / name), cv2.IMREAD_GRAYSCALE)
        assert (d.channels, d.height, d.width) == (1, 6, 5)
        assert d.data == gray.tobytes()
    # It is the ITU-R 601 luma of the color image (libpng rounds its own way: +-1).
    name, _, image = entries[0]
    luma = np.frombuffer(datums(tmp_path / "db")[0][1].data, np.uint8).reshape(6, 5)
    assert np.abs(luma.astype(int) - cv2.cvtColor(image, cv2.COLOR_BGR2GRAY)).max() <= 1


def test_resize_when_both_sizes_are_given(imageset):
    tmp_path, listfile, entries = imageset
    assert run(tmp_path, listfile, "--resize_width=4", "--resize_height", "3") == 0
    for (name, _, _), (_, d) in zip(entries, datums(tmp_path / "db")):
        expected = cv2.resize(cv2.imread(str(tmp_path / "images" / name)), (4, 3),
                              interpolation=cv2.INTER_LINEAR)
        assert (d.channels, d.height, d.width) == (3, 3, 4)
        assert d.data == chw_bytes(expected)
    # One size alone resizes nothing, as in Caffe.
    assert run(tmp_path, listfile, "--resize_width=4", db="db2") == 0
    assert {(d.height, d.width) for _, d in datums(tmp_path / "db2")} == {(6, 5)}


def test_shuffle_is_seeded_and_keeps_labels_with_images(imageset):
    tmp_path, listfile, entries = imageset
    assert run(tmp_path, listfile, "--shuffle") == 0
    assert run(tmp_path, listfile, "--shuffle", db="again") == 0
    assert run(tmp_path, listfile, "--shuffle", "--seed", "5", db="seed5") == 0
    first = datums(tmp_path / "db")
    assert read_lmdb(tmp_path / "db") == read_lmdb(tmp_path / "again")
    names = [k[9:] for k, _ in first]
    assert sorted(names) == sorted(n for n, _, _ in entries)
    assert names != [n for n, _, _ in entries]  # seed 0 moves this list
    assert [k[:9] for k, _ in first] == [f"{i:08d}_" for i in range(len(entries))]
    by_name = {n: (label, image) for n, label, image in entries}
    for key, d in first:
        label, image = by_name[key[9:]]
        assert d.label == label
        if not key.endswith(".jpg"):
            assert d.data == chw_bytes(image)
    assert sorted(k[9:] for k, _ in datums(tmp_path / "seed5")) == sorted(names)


def test_check_size(imageset, capsys):
    tmp_path, listfile, entries = imageset
    cv2.imwrite(str(tmp_path / "images" / "big.png"), np.zeros((7, 5, 3), np.uint8))
    listfile.write_text(listfile.read_text() + "big.png 3\n")
    assert run(tmp_path, listfile) == 0  # mixed sizes are allowed without the flag
    assert run(tmp_path, listfile, "--check_size", db="checked") == 1
    err = capsys.readouterr().err
    assert f"{listfile}:6: 'big.png': image is 3x7x5 (CxHxW) but the first was 3x6x5" in err
    assert "--check_size" in err
    assert not (tmp_path / "checked").exists()  # no half-written database is left


@pytest.mark.parametrize("line, message", [
    ("a/img1.png", "has no label"),
    ("a/img1.png seven", "label 'seven' of 'a/img1.png' is not an integer"),
    ("a/img1.png 99999999999", "does not fit"),
])
def test_bad_list_line(imageset, capsys, line, message):
    tmp_path, listfile, _ = imageset
    listfile.write_text("a/img0.png 1\n\n" + line + "\n")
    assert run(tmp_path, listfile) == 1
    err = capsys.readouterr().err
    assert f"{listfile}:3:" in err and message in err
    assert not (tmp_path / "db").exists()


def test_missing_and_unreadable_images(imageset, capsys):
    tmp_path, listfile, _ = imageset
    listfile.write_text("a/img0.png 1\nnope/gone.png 2\n")
    assert run(tmp_path, listfile) == 1
    err = capsys.readouterr().err
    assert f"{listfile}:2: image not found: {tmp_path}/images/nope/gone.png" in err
    assert not (tmp_path / "db").exists()
    (tmp_path / "images" / "junk.png").write_bytes(b"not an image at all")
    listfile.write_text("junk.png 0\n")
    assert run(tmp_path, listfile) == 1
    err = capsys.readouterr().err
    assert f"{listfile}:1: cannot read {tmp_path}/images/junk.png" in err


def test_paths_with_spaces_crlf_and_negative_labels(imageset):
    tmp_path, listfile, entries = imageset
    listfile.write_bytes(b"b/img 2.png -3\r\n  a/img0.png\t4  \r\n")
    assert run(tmp_path, listfile) == 0
    got = datums(tmp_path / "db")
    assert [(k, d.label) for k, d in got] == [("00000000_b/img 2.png", -3),
                                               ("00000001_a/img0.png", 4)]


def test_user_errors(imageset, capsys):
    tmp_path, listfile, _ = imageset
    assert run(tmp_path, listfile, "--backend", "rocksdb") == 1
    assert "unknown backend 'rocksdb'; use lmdb or leveldb" in capsys.readouterr().err
    (tmp_path / "db").mkdir()
    assert run(tmp_path, listfile) == 1
    assert "already exists" in capsys.readouterr().err
    assert run(tmp_path, listfile, "--encode_type", "xyz", db="x") == 1
    assert "OpenCV cannot write that format" in capsys.readouterr().err
    assert main([str(tmp_path), str(tmp_path / "nolist.txt"), str(tmp_path / "y")]) == 1
    assert "cannot read the list file" in capsys.readouterr().err
    assert main(["only", "two"]) == 2  # usage


def test_gflags_spellings(imageset):
    tmp_path, listfile, _ = imageset
    args = ["-gray=true", "--shuffle=false", "-check_size=1", "--noencoded", "-resize_width=4",
            "-resize_height=3"]
    assert run(tmp_path, listfile, *args) == 0
    got = datums(tmp_path / "db")
    assert [k[:11] for k, _ in got][:2] == ["00000000_a/", "00000001_a/"]  # not shuffled
    assert {(d.channels, d.height, d.width, d.encoded) for _, d in got} == {(1, 3, 4, False)}


def test_python_function_and_logs(imageset):
    tmp_path, listfile, entries = imageset
    lines = Lines()
    n = convert_imageset(tmp_path / "images/", listfile, tmp_path / "db", gray=True,
                         resize=(3, 4), shuffle=True, seed=1, log=lines.log)
    assert n == len(entries)
    assert lines.lines[:3] == ["Shuffling data (seed 1)", f"A total of {n} images.",
                               f"Opened lmdb {tmp_path / 'db'}"]
    assert lines.lines[-1] == f"Processed {n} files."
    assert {(d.channels, d.height, d.width) for _, d in datums(tmp_path / "db")} == {(1, 3, 4)}


def test_transactions_of_1000_from_arrays(tmp_path, monkeypatch):
    commits = []
    real = ci._commit
    monkeypatch.setattr(ci, "_commit", lambda env, batch: (commits.append(len(batch)),
                                                           real(env, batch)))
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (2345, 2, 3), dtype=np.uint8)
    lines = Lines()
    n = write_images(tmp_path / "db", ((f"{i:08d}", im, i % 10) for i, im in
                                       enumerate(images)), log=lines.log)
    assert n == 2345 and commits == [1000, 1000, 345]
    assert [s for s in lines.lines if s.startswith("Processed")] == [
        "Processed 1000 files.", "Processed 2000 files.", "Processed 2345 files."]
    got = datums(tmp_path / "db")
    assert len(got) == 2345
    for i in (0, 999, 1000, 2344):
        key, d = got[i]
        assert key == f"{i:08d}" and d.label == i % 10
        assert (d.channels, d.height, d.width) == (1, 2, 3) and d.data == images[i].tobytes()


def test_map_grows_when_full(tmp_path, monkeypatch):
    from purine.data import db

    monkeypatch.setattr(db, "MAP_SIZE", 1 << 16)  # the LMDB writer's first map
    images = np.random.default_rng(2).integers(0, 256, (300, 30, 30, 3), dtype=np.uint8)
    n = write_images(tmp_path / "db", ((f"{i:08d}", im, 0) for i, im in enumerate(images)),
                     log=Lines().log)
    assert n == 300
    env = lmdb.open(str(tmp_path / "db"), readonly=True, lock=False)
    assert env.stat()["entries"] == 300 and env.info()["map_size"] > 1 << 16
    env.close()
    assert datums(tmp_path / "db")[-1][1].data == chw_bytes(images[-1])


def test_write_images_encoded_check_size_and_errors(tmp_path):
    a = np.arange(12, dtype=np.uint8).reshape(3, 4)
    png = cv2.imencode(".png", a)[1].tobytes()
    write_images(tmp_path / "db", [("k0", a, 1), ("k1", Encoded(png, (1, 3, 4)), 2)],
                 encoding="png", check_size=True, log=Lines().log)
    (k0, d0), (k1, d1) = datums(tmp_path / "db")
    assert d0.encoded and d1.data == png
    assert np.array_equal(cv2.imdecode(np.frombuffer(d0.data, np.uint8), -1), a)
    with pytest.raises(ConvertError, match="record 'k1': image is 1x3x5"):
        write_images(tmp_path / "db2", [("k0", a, 0), ("k1", np.zeros((3, 5), np.uint8), 0)],
                     check_size=True, log=Lines().log)
    assert not (tmp_path / "db2").exists()
    with pytest.raises(ConvertError, match="must be uint8"):
        write_images(tmp_path / "db3", [("k", a.astype(np.float32), 0)], log=Lines().log)
    with pytest.raises(ConvertError, match="LMDB keys are 1 to 511 bytes"):
        write_images(tmp_path / "db4", [("k" * 600, a, 0)], log=Lines().log)


def test_progress_bar_is_plain_text_on_a_terminal(monkeypatch):
    monkeypatch.delenv("PURINE_PROGRESS", raising=False)  # the terminal alone decides
    out = io.StringIO()
    bar = Progress(2000, "train_lmdb", stream=out, enabled=True)
    bar.update(1000, force=True)
    bar.clear()
    bar.close(2000)
    text = out.getvalue()
    # half the bar filled; the bar narrows from its 30 cells when the line would pass 80
    # columns (this instant run's rate, millions of it/s, makes it long)
    half = re.search(r"\rtrain_lmdb \[(#+)(\.+)\] 1000/2000  50%", text)
    assert half and abs(len(half[1]) - len(half[2])) <= 1 and len(half[1] + half[2]) <= 30
    assert "] 2000/2000 100%" in text and text.endswith("\n")
    quiet = io.StringIO()  # not a terminal: nothing
    Progress(5000, "x", stream=quiet).close(5000)
    assert quiet.getvalue() == ""


def test_database_folder_holds_the_lmdb_files(imageset):
    tmp_path, listfile, _ = imageset
    assert run(tmp_path, listfile) == 0
    assert sorted(os.listdir(tmp_path / "db")) == ["data.mdb", "lock.mdb"]


# -- issue 28: every flag checked before the database exists; codecs silent ------------------
@pytest.mark.parametrize("flags, message", [
    (("--encode_type", "exr"), r"encode_type 'exr': OpenCV cannot write that format as 8-bit "
     r"color images that read back; use one of jpg, jpeg, jpe, png, bmp"),
    (("--encode_type", "hdr"), r"encode_type 'hdr': .*use one of jpg"),  # float on reading
    (("--encode_type", "png/x"), r"encode_type 'png/x'"),
    (("--gray", "--encode_type", "ppm"), r"as 8-bit gray images .* use one of .*pgm"),
    (("--resize_width", "2147483647", "--resize_height", "2147483647"),
     r"a resized image holds 13835058042397261827 bytes, more than the 2147483583"),
    (("--resize_width", "2147483648", "--resize_height", "1"),
     r"--resize_width 2147483648: expected an int32"),
    (("--backend", "rocksdb"), r"unknown backend 'rocksdb'"),
])
def test_bad_flags_refused_before_the_database(imageset, capsys, flags, message):
    tmp_path, listfile, _ = imageset
    assert run(tmp_path, listfile, *flags) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert not (tmp_path / "db").exists()


def test_guessed_encodings_checked_before_the_database(imageset, capsys):
    tmp_path, listfile, _ = imageset
    listfile.write_text(listfile.read_text() + "d/pic.exr 1\n")
    assert run(tmp_path, listfile, "--encoded") == 1
    err = capsys.readouterr().err
    assert re.search(r"list.txt:6: the encoding of 'd/pic.exr', 'exr': OpenCV cannot write", err)
    assert not (tmp_path / "db").exists()


def test_negative_seed_shuffles_as_caffe_does(imageset):
    """Caffe's seed -1 means 'unseeded': the order is a permutation drawn from the system's
    entropy, and the seed drawn is logged, so that giving it repeats the order."""
    tmp_path, listfile, entries = imageset
    lines = Lines()
    n = convert_imageset(tmp_path / "images", listfile, tmp_path / "db", shuffle=True, seed=-1,
                         log=lines.log)
    assert n == len(entries)
    m = re.fullmatch(r"Shuffling data \(seed -1: unseeded, as in Caffe; drew seed (\d+)\)",
                     lines.lines[0])
    assert m, lines.lines[0]
    got = [(k[9:], d.label) for k, d in datums(tmp_path / "db")]
    assert sorted(got) == sorted((name, label) for name, label, _ in entries)
    assert convert_imageset(tmp_path / "images", listfile, tmp_path / "again", shuffle=True,
                            seed=int(m.group(1))) == n
    assert [(k[9:], d.label) for k, d in datums(tmp_path / "again")] == got
    assert main(["--shuffle", "--seed", "-1", str(tmp_path / "images") + "/", str(listfile),
                 str(tmp_path / "cli")]) == 0


def test_damaged_images_give_only_our_line(tmp_path):
    """Damaged PNG, JPEG and TIFF files: stderr holds our one line, no word of OpenCV,
    libpng, libjpeg or libtiff (they are silenced or captured)."""
    rng = np.random.default_rng(3)
    image = cv2.GaussianBlur(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), (5, 5), 2)
    (tmp_path / "i").mkdir()
    for ext in ("png", "jpg", "tiff", "bmp", "jp2"):
        data = bytearray(cv2.imencode("." + ext, image)[1].tobytes())
        cases = {"cut": data[:len(data) // 2], "head": data[:12]}
        if ext == "png":
            cases["crc"] = data[:60] + bytes([data[60] ^ 0x40]) + data[61:]
        for name, bad in cases.items():
            (tmp_path / "i" / f"{name}.{ext}").write_bytes(bytes(bad))
            (tmp_path / "list.txt").write_text(f"{name}.{ext} 0\n")
            r = subprocess.run([sys.executable, "-m", "purine.converters.convert_imageset",
                                str(tmp_path / "i") + "/", str(tmp_path / "list.txt"),
                                str(tmp_path / f"db_{name}_{ext}")],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 1
            errors = [s for s in r.stderr.splitlines() if not s.startswith("I1")]
            assert errors == [f"convert_imageset: {tmp_path}/list.txt:1: cannot read "
                              f"{tmp_path}/i/{name}.{ext}: OpenCV cannot decode it as an "
                              "image"], (ext, name, r.stderr)
