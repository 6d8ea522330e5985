"""WindowData over a window file and small images written here: parsing, foreground and
background by overlap, the foreground share of a batch, warped crops against a cv2 reference
(plain warp, context padding clipped at the image border, square mode, mirroring, mean file
and mean values, scale), seeded sampling that resumes, cached images, and the errors."""

import cv2
import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.data.window import c_round, read_window_file, warp_geometry
from purine.errors import LayerError, PurineError
from tests.data.helpers import batches, write_mean

# image a: 30 x 40, image b: 20 x 25 (rows x cols)
WINDOWS = """# 0
a.png
3
30
40
4
1 0.9 5 5 20 15
2 0.6 0 0 39 29
4 0.45 3 3 9 9
0 0.1 10 10 30 25
# 1
b.png
3
20
25
2
3 0.2 1 1 10 10
0 0.0 2 2 24 19
"""
FG = {(5, 5, 20, 15): 1, (0, 0, 39, 29): 2}  # box -> class, image a
BG = {("a", (10, 10, 30, 25)), ("b", (1, 1, 10, 10)), ("b", (2, 2, 24, 19))}


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    imgs = {"a": rng.integers(0, 256, (30, 40, 3), dtype=np.uint8),
            "b": rng.integers(0, 256, (20, 25, 3), dtype=np.uint8)}
    for name, im in imgs.items():
        cv2.imwrite(str(tmp_path / f"{name}.png"), im)
    (tmp_path / "win.txt").write_text(WINDOWS)
    return tmp_path, imgs


def window_net(root, batch=8, param="", transform="crop_size: 6", seed=0, phase=TRAIN,
               dtype="float32", source="win.txt"):
    return Net(f'''layer {{ name: "win" type: "WindowData" top: "data" top: "label"
      window_data_param {{ source: "{root}/{source}" root_folder: "{root}/" batch_size: {batch}
      fg_threshold: 0.5 bg_threshold: 0.3 {param} }}
      transform_param {{ {transform} }} }}''', phase=phase, seed=seed, dtype=dtype)


def warp(img, box, crop):
    """The plain warp (no context padding): the inclusive box resized to crop x crop, CHW."""
    x1, y1, x2, y2 = box
    return cv2.resize(img[y1:y2 + 1, x1:x2 + 1], (crop, crop),
                      interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1).astype(np.float64)


# -- the window file -------------------------------------------------------------------------
def test_read_window_file(files):
    root, _ = files
    w = read_window_file(root / "win.txt", root_folder="R/")
    assert w.images == ["R/a.png", "R/b.png"] and w.image_lines == [2, 12]
    assert w.boxes.tolist() == [[0, 1, 5, 5, 20, 15], [0, 2, 0, 0, 39, 29],
                                [0, 4, 3, 3, 9, 9], [0, 0, 10, 10, 30, 25],
                                [1, 3, 1, 1, 10, 10], [1, 0, 2, 2, 24, 19]]
    assert w.overlap.dtype == np.float32
    np.testing.assert_array_equal(w.overlap, np.float32([0.9, 0.6, 0.45, 0.1, 0.2, 0.0]))
    assert w.lines.tolist() == [7, 8, 9, 10, 17, 18]


def test_blank_lines_are_skipped(tmp_path):
    (tmp_path / "w.txt").write_text("\n# 0\nx.png\n3\n4\n4\n\n2\n1 0.5 0 0 1 1\n\n"
                                    "0 0.25 1 1 2 3\n\n")
    w = read_window_file(tmp_path / "w.txt")
    assert w.boxes[:, 2:].tolist() == [[0, 0, 1, 1], [1, 1, 2, 3]]
    assert w.lines.tolist() == [9, 11]


@pytest.mark.parametrize("text, message", [
    ("# 0\na.png\n3\n30\n40\n1\n1 0.9 5 5 20\n", r"win.txt:7: expected a window 'class_index "
     r"overlap x1 y1 x2 y2' \(integers and a number\), found '1 0.9 5 5 20'"),
    ("# 0\na.png\n3\n30\n40\n2\n1 0.9 5 5 20 15\n", r"win.txt:7: expected window 2 of 2 .* "
     "found the end of the file"),
    ("# 0\na.png\n3\n30\n40\n1\n1 high 5 5 20 15\n", r"win.txt:7: expected a window"),
    ("# 0\na.png\n3\n30\n40\n2\n1 0.9 5 5 20 15\n1 0.9 5.5 5 nan 15\n",
     r"win.txt:8: expected a window .* found '1 0.9 5.5 5 nan 15'"),
    ("# 0\na.png\n3\n30\nforty\n1\n", r"win.txt:5: expected the width of image 0 \(a "
     r"non-negative integer\), found 'forty'"),
    ("# 0\na.png\n3\n30\n", r"win.txt:4: expected the width of image 0, found the end"),
    ("0\na.png\n", r"win.txt:1: expected '# 0' opening image block 0, found '0'"),
    ("# 1\na.png\n3\n30\n40\n0\n", r"win.txt:1: image index 1, expected 0"),
    ("# 0\na.png\n1\n30\n40\n0\n", r"win.txt:3: image 0 has 1 channels"),
    ("\n\n", r"win.txt: the window file is empty"),
])
def test_malformed_window_file(files, text, message):
    root, _ = files
    (root / "win.txt").write_text(text)
    with pytest.raises(LayerError, match=message):
        window_net(root)


# -- foreground and background ---------------------------------------------------------------
@pytest.mark.parametrize("batch, fraction, n_fg", [(8, 0.25, 2), (5, 0.5, 2), (4, 1.0, 4),
                                                   (3, 0.0, 0), (10, 0.7, 7)])
def test_labels_and_foreground_share(files, batch, fraction, n_fg):
    """int(batch * fg_fraction) foreground windows come last; each sample is the warp of a
    window of its kind, with its class (background 0); the window of overlap 0.45, between
    the thresholds, is never drawn."""
    root, imgs = files
    fg = {cls: warp(imgs["a"], box, 6) for box, cls in FG.items()}
    bg = [warp(imgs[im], box, 6) for im, box in BG]
    seen = set()
    for data, label in batches(window_net(root, batch, f"fg_fraction: {fraction}"), 6):
        assert data.shape == (batch, 3, 6, 6) and label.shape == (batch,)
        assert (label[:batch - n_fg] == 0).all() and (label[batch - n_fg:] > 0).all()
        for x, cls in zip(data, label.astype(int)):
            if cls:
                np.testing.assert_array_equal(x, fg[cls])
            else:
                assert any(np.array_equal(x, ref) for ref in bg)
            seen.add(cls)
    assert seen == ({0} if n_fg < batch else set()) | ({1, 2} if n_fg else set())


def test_class_counts_and_batch_shape(files):
    root, _ = files
    net = window_net(root, 4, transform="crop_size: 7")
    assert net.blobs["data"].shape == (4, 3, 7, 7) and net.blobs["label"].shape == (4,)
    counts = net.builder.stateful["win/cursor"].make_reader.__self__.class_counts()
    assert counts == {0: 3, 1: 1, 2: 1}


# -- crop values -----------------------------------------------------------------------------
ONLY_A = "# 0\na.png\n3\n30\n40\n2\n1 0.9 5 5 20 15\n0 0.1 {}\n"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_warp_values_with_mean_values_and_scale(files, dtype):
    root, imgs = files
    (root / "one.txt").write_text(ONLY_A.format("3 4 17 12"))
    net = window_net(root, 3, "fg_fraction: 0.34 scale: 0.5", source="one.txt", dtype=dtype,
                     transform="crop_size: 8 mean_value: 10 mean_value: 20 mean_value: 30")
    data, label = batches(net, 1)[0]
    assert data.dtype == dtype and label.tolist() == [0, 0, 1]
    mean = np.array([10, 20, 30], np.float64)[:, None, None]
    np.testing.assert_allclose(data[0], (warp(imgs["a"], (3, 4, 17, 12), 8) - mean) * 0.5,
                               rtol=0, atol=1e-5)
    np.testing.assert_allclose(data[2], (warp(imgs["a"], (5, 5, 20, 15), 8) - mean) * 0.5,
                               rtol=0, atol=1e-5)


def test_mean_file_centre_crop_taken_by_the_width(files):
    """The mean's crop starts at (width - crop) // 2 on both axes, as in Caffe."""
    root, imgs = files
    (root / "one.txt").write_text(ONLY_A.format("3 4 17 12"))
    mean = np.random.default_rng(5).uniform(0, 255, (3, 12, 10)).astype(np.float32)
    write_mean(root / "mean.binaryproto", mean)
    net = window_net(root, 1, "fg_fraction: 0", source="one.txt",
                     transform=f'crop_size: 6 mean_file: "{root}/mean.binaryproto"')
    data, _ = batches(net, 1)[0]
    want = warp(imgs["a"], (3, 4, 17, 12), 6) - mean[:, 2:8, 2:8]
    np.testing.assert_allclose(data[0], want, rtol=0, atol=1e-4)


def test_geometry_by_hand():
    """Square mode and context padding of 2 in a crop of 12, box x 2..11, y 3..8 in a
    20 x 20 image: the square of half-side 5 grown by 12/8 about (7, 6) is x -1..15,
    y -2..14 (C rounds -0.5 to -1 and 14.5 to 15), 17 x 17; clipped to x 0..15, y 0..14,
    warped at 12/17 to 11 x 11 with 1 pixel padding top and left (right when mirrored)."""
    box = np.array([[2, 3, 11, 8]] * 2)
    n = np.array([20, 20])
    roi, size, pad = warp_geometry(box, n, n, np.array([False, True]), crop=12,
                                   context_pad=2, square=True, dtype=np.float32)
    assert roi.tolist() == [[0, 0, 15, 14]] * 2
    assert size.tolist() == [[11, 11]] * 2 and pad.tolist() == [[1, 1], [1, 0]]
    # warp mode, box x 10..29, y 20..29 in 30 x 40, crop 10, pad 1: grown x 8..33, y 19..31,
    # clipped at the bottom by 2 rows: 11 of 13 rows at 10/13 give round(8.46) = 8 rows.
    roi, size, pad = warp_geometry(np.array([[10, 20, 29, 29]]), np.array([30]),
                                   np.array([40]), np.array([False]), crop=10, context_pad=1,
                                   square=False, dtype=np.float32)
    assert roi.tolist() == [[8, 19, 33, 29]] and size.tolist() == [[8, 10]]
    assert pad.tolist() == [[0, 0]]
    assert c_round(np.array([-2.5, -0.5, 0.5, 1.5, 2.5, 2.4999])).tolist() == [
        -3, -1, 1, 2, 3, 2]


def test_context_pad_square_and_mirror_values(files):
    """The geometry above through the layer: the clipped region warped to 11 x 11 and
    placed at (1, 1), or mirrored and placed at (1, 0); the rest of the square is zero."""
    root, _ = files
    img = np.random.default_rng(7).integers(0, 256, (20, 20, 3), dtype=np.uint8)
    cv2.imwrite(str(root / "c.png"), img)
    (root / "sq.txt").write_text("# 0\nc.png\n3\n20\n20\n2\n1 1 0 0 5 5\n0 0 2 3 11 8\n")
    part = cv2.resize(img[0:15, 0:16], (11, 11)).transpose(2, 0, 1).astype(np.float32)
    plain = np.zeros((3, 12, 12), np.float32)
    plain[:, 1:12, 1:12] = part
    flipped = np.zeros((3, 12, 12), np.float32)
    flipped[:, 1:12, 0:11] = part[..., ::-1]
    net = window_net(root, 4, 'fg_fraction: 0 context_pad: 2 crop_mode: "square"',
                     source="sq.txt", transform="crop_size: 12 mirror: true", phase=TEST)
    kinds = []
    for data, label in batches(net, 3):
        assert label.tolist() == [0] * 4
        for x in data:
            kinds.append(0 if np.array_equal(x, plain) else 1 if np.array_equal(x, flipped)
                         else None)
    assert None not in kinds and set(kinds) == {0, 1}


# -- sampling --------------------------------------------------------------------------------
def test_same_seed_same_batches_and_resume(files):
    root, _ = files
    a = batches(window_net(root, 6, transform="crop_size: 6 mirror: true", seed=3), 4)
    b = batches(window_net(root, 6, transform="crop_size: 6 mirror: true", seed=3), 4)
    c = batches(window_net(root, 6, transform="crop_size: 6 mirror: true", seed=4), 4)
    for (xa, la), (xb, lb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(la, lb)
    assert any(not np.array_equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    again = window_net(root, 6, transform="crop_size: 6 mirror: true", seed=3)
    again.builder.stateful["win/cursor"].restore({"batch": 2})
    for (x, lab), (xa, la) in zip(batches(again, 2), a[2:]):
        np.testing.assert_array_equal(x, xa)
        np.testing.assert_array_equal(lab, la)


def test_cached_images_give_the_same_batches(files):
    root, _ = files
    a = batches(window_net(root, 5, "context_pad: 1", seed=2), 2)
    b = batches(window_net(root, 5, "context_pad: 1 cache_images: true", seed=2), 2)
    for (xa, la), (xb, lb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(la, lb)


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("param, transform, message", [
    ("bg_threshold: 0.6", "crop_size: 6", r"bg_threshold 0.6 is above fg_threshold 0.5"),
    ("fg_fraction: 1.5", "crop_size: 6", r"fg_fraction is 1.5; expected a fraction in \[0, 1\]"),
    ("", "", r"needs transform_param.crop_size > 0"),
    ('crop_mode: "wrap"', "crop_size: 6", r"crop_mode 'wrap': expected 'warp' or 'square'"),
    ("context_pad: 3", "crop_size: 6", r"context_pad 3 leaves no room .* crop of 6"),
    ("", "crop_size: 6 mean_value: 1 mean_value: 2", r"2 mean_value entries"),
    ("fg_threshold: 0.95", "crop_size: 6", r"has no foreground windows \(overlap >= "
     r"fg_threshold 0.95\)"),
])
def test_parameter_errors(files, param, transform, message):
    root, _ = files
    with pytest.raises(LayerError, match=message):
        window_net(root, param=param, transform=transform)


def test_window_errors(files):
    root, _ = files
    with pytest.raises(LayerError, match=r"nowhere.txt: cannot read the window file"):
        window_net(root, source="nowhere.txt")
    (root / "win.txt").write_text(WINDOWS.replace("a.png", "nothere.png"))
    with pytest.raises(LayerError, match=r"win.txt:2: image '.*nothere.png' does not exist"):
        window_net(root)
    (root / "win.txt").write_text(WINDOWS.replace("1 0.9 5 5 20 15", "0 0.9 5 5 20 15"))
    with pytest.raises(LayerError, match=r"win.txt:7: a foreground window \(overlap 0.9 >= "
                                         r"fg_threshold 0.5\) has class 0"):
        window_net(root)
    (root / "win.txt").write_text(WINDOWS.replace("1 0.9 5 5 20 15", "1 0.9 20 5 5 15"))
    with pytest.raises(LayerError, match=r"win.txt:7: window x1 y1 x2 y2 = \(20, 5, 5, 15\); "
                                         "expected x1 <= x2"):
        window_net(root)
    # Without context padding a window is cut as it is, so it must lie in the image.
    (root / "one.txt").write_text(ONLY_A.format("30 20 45 29"))
    with pytest.raises(PurineError, match=r"one.txt:8: window x1 y1 x2 y2 = \(30, 20, 45, 29\) "
                                          r"leaves no region of .*a.png' \(height, width = "
                                          r"\(30, 40\)\)"):
        batches(window_net(root, 2, "fg_fraction: 0", source="one.txt"), 1)


# -- hostile window files (issue 28): sizes before allocation, C ints, ASCII digits ----------
HEAD = "# 0\na.png\n3\n30\n40\n"


@pytest.mark.parametrize("text, message", [
    # a count the file cannot hold: refused before anything is allocated for it
    (HEAD + "1000000000000\n1 0.9 5 5 20 15\n", r"w.txt:6: the num_windows of image 0 is "
     r"1000000000000; expected a non-negative integer up to "
     r"2147483647"),
    (HEAD + "2147483647\n1 0.9 5 5 20 15\n", r"w.txt:7: expected window 2 of 2147483647 .* "
     r"found the end of the file \(line 6 gives 2147483647 windows\)"),
    (HEAD + "3\n1 0.9 5 5 20 15\n\n\n", r"w.txt:9: expected window 2 of 3 .*end of the file"),
    # numbers past a C int, up to 2^63 and beyond
    (HEAD + "1\n1 0.9 5 5 20 9223372036854775808\n", r"w.txt:7: window y2 = "
     r"9223372036854775808; expected an integer from -2147483648 to 2147483647"),
    (HEAD + "1\n1 0.9 -2147483649 5 20 15\n", r"w.txt:7: window x1 = -2147483649"),
    (HEAD + "1\n4294967296 0.9 5 5 20 15\n", r"w.txt:7: window class_index = 4294967296"),
    ("# 0\na.png\n3\n99999999999999999999\n40\n0\n", r"w.txt:4: the height of image 0 is "
     r"99999999999999999999; expected a non-negative integer up to 2147483647"),
    (HEAD + "1\n1 0.9 5 5 20 " + "9" * 5000 + "\n", r"w.txt:7: window y2 = 9{40}\.\.\.; "
     r"expected an integer from"),  # past int()'s 4300 digits
    ("# 0\na.png\n3\n" + "1" * 5000 + "\n", r"w.txt:4: the height of image 0 is 1{40}\.\.\.;"),
    (HEAD + "1\n1 1e39 5 5 20 15\n", r"w.txt:7: window overlap 1e39 does not fit a float"),
    # digits str.isdigit() takes and int() refuses, or int() takes and C++ streams refuse
    ("# \u00b2\na.png\n", r"w.txt:1: expected '# 0' opening image block 0, found '# \u00b2'"),
    ("# 0\na.png\n\u00b3\n", r"w.txt:3: expected the channels of image 0 \(a non-negative "
     r"integer\), found '\u00b3'"),
    ("# 0\na.png\n3\n\u0663\u0660\n40\n0\n", r"w.txt:4: expected the height of image 0"),
    (HEAD + "\u00b9\n", r"w.txt:6: expected the num_windows of image 0"),
    (HEAD + "1\n1 0.9 5 5 20 1_5\n", r"w.txt:7: expected a window .* found '1 0.9 5 5 20 1_5'"),
    (HEAD + "1\n1 0.9 5 5 20 \u00b9\u2075\n", r"w.txt:7: expected a window"),
    (HEAD + "1\n1 \u0660.9 5 5 20 15\n", r"w.txt:7: expected a window"),
    (HEAD + "1\n1 0.9 5 5 20\u300015\n", r"w.txt:7: expected a window"),
    (HEAD + "1\n1 0.9 5 5 20 1e1\n", r"w.txt:7: expected a window"),
    (HEAD + "1\n1 nan 5 5 20 15\n", r"w.txt:7: expected a window"),
])
def test_hostile_window_files(tmp_path, text, message):
    (tmp_path / "w.txt").write_text(text, encoding="utf-8")
    with pytest.raises(PurineError, match=message):
        read_window_file(tmp_path / "w.txt")


def test_numbers_at_the_c_int_edges_are_read(tmp_path):
    (tmp_path / "w.txt").write_text("# +0\na.png\n+3\n+30\n040\n+2\n2147483647 0.5 -2147483648 +0 007 2147483647\n"
                                           "1 .25 1 2 3 4\r\n")
    w = read_window_file(tmp_path / "w.txt")
    assert w.boxes.tolist() == [[0, 2147483647, -2147483648, 0, 7, 2147483647],
                                [0, 1, 1, 2, 3, 4]]
    assert w.overlap.tolist() == [0.5, 0.25]


def test_endless_window_file_is_one_line():
    with pytest.raises(PurineError, match=r"^/dev/zero: cannot read the window file: it is "
                                          r"not a regular file \(a device\)$"):
        read_window_file("/dev/zero")


def test_damaged_cached_image_is_one_line(files):
    root, _ = files
    data = (root / "a.png").read_bytes()
    (root / "a.png").write_bytes(data[:len(data) // 2])
    with pytest.raises(PurineError, match=r"win.txt:2: image '.*a.png': cannot read the image"):
        batches(window_net(root, 4, "cache_images: true"), 1)
