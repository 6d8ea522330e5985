"""ImageData's list file and read order: 'path label' split at the last space, errors
naming file and line, epochs in list order or a fresh seeded permutation each epoch, and
images read color or gray and resized as Caffe's ReadImageToCVMat does."""

import cv2
import numpy as np
import pytest

from purine.data import DataError
from purine.data.image_list import ImageList, read_list


def test_read_list(tmp_path):
    f = tmp_path / "list.txt"
    f.write_text("a.png 3\n\nmy dir/b c.png 0\r\nd.png   -1  \n")
    assert read_list(f) == [("a.png", 3, 1), ("my dir/b c.png", 0, 3), ("d.png  ", -1, 4)]


@pytest.mark.parametrize("line", ["lonely.png", "x.png cat", " 4"])
def test_bad_lines_name_file_and_line(tmp_path, line):
    f = tmp_path / "list.txt"
    f.write_text(f"a.png 1\n{line}\n")
    with pytest.raises(DataError, match=f"{f}:2: expected 'path label'"):
        read_list(f)


def test_empty_and_missing_lists(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n")
    assert read_list(tmp_path / "empty.txt") == []
    with pytest.raises(DataError, match="lists no images"):
        ImageList(tmp_path / "empty.txt")
    with pytest.raises(DataError, match="cannot read"):
        read_list(tmp_path / "missing.txt")


def lines(tmp_path, n):
    f = tmp_path / "list.txt"
    f.write_text("".join(f"img{i}.png {i}\n" for i in range(n)))
    return f


def test_order_plain_and_shuffled(tmp_path):
    f = lines(tmp_path, 10)
    plain = ImageList(f)
    assert [plain.line(p)[1] for p in range(23)] == [p % 10 for p in range(23)]
    a = ImageList(f, shuffle=True, seed=3, index=1)
    epochs = [[a.line(e * 10 + i)[1] for i in range(10)] for e in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(10))
    assert epochs[0] != epochs[1] != epochs[2]
    b = ImageList(f, shuffle=True, seed=3, index=1)  # resume-exact: any position, any order
    assert [b.line(p)[1] for p in (25, 3, 14)] == [epochs[2][5], epochs[0][3], epochs[1][4]]
    assert [ImageList(f, shuffle=True, seed=4, index=1).line(i)[1]
            for i in range(10)] != epochs[0]


def test_images_color_gray_resize(tmp_path):
    bgr = np.random.default_rng(0).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    cv2.imwrite(str(tmp_path / "a.png"), bgr)
    (tmp_path / "list.txt").write_text("a.png 1\nmissing.png 2\n")
    color = ImageList(tmp_path / "list.txt", root_folder=f"{tmp_path}/")
    np.testing.assert_array_equal(color.image(color.line(0)), bgr.transpose(2, 0, 1))
    gray = ImageList(tmp_path / "list.txt", root_folder=f"{tmp_path}/", is_color=False,
                     new_height=3, new_width=5)
    want = cv2.resize(cv2.imread(str(tmp_path / "a.png"), cv2.IMREAD_GRAYSCALE), (5, 3))
    np.testing.assert_array_equal(gray.image(gray.line(0)), want[None])
    with pytest.raises(DataError, match=r"list.txt:2: image '.*missing.png': cannot read"):
        color.image(color.line(1))
