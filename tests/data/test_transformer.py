"""The batch transformer against a per-element transcription of Caffe's Transform loops:
crop (random in TRAIN, centre in TEST), mirror, mean file at the full-size index, mean
values, scale, float records, images of several sizes, and the errors Caffe checks."""

import numpy as np
import pytest

from purine.data import DataError
from purine.data.transformer import Transformer
from purine.formats import caffe_pb2 as pb
from tests.data.helpers import caffe_transform, images, match_transform, write_mean


def transform(param: pb.TransformationParameter, batch, phase=pb.TRAIN, dtype="float32",
              seed=0):
    t = Transformer(param, phase, dtype)
    shape = t.output_shape(batch[0].shape, "test")
    out = np.full((len(batch),) + shape, np.nan, dtype)
    t(list(batch), out, np.random.default_rng(seed), lambda i: f"image {i}")
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", ["mean_file", "mean_value1", "mean_value3", "none"])
def test_train_crop_mirror_mean_scale_match_caffe(tmp_path, dtype, kind):
    batch = images(24, (3, 7, 8), seed=1)
    mean = np.random.default_rng(2).uniform(0, 255, (3, 7, 8)).astype(np.float32)
    p = pb.TransformationParameter(crop_size=5, mirror=True, scale=0.0172)
    kw = dict(crop=5, scale=0.0172, dtype=dtype, mirror=True)
    if kind == "mean_file":
        p.mean_file = write_mean(tmp_path / "mean.binaryproto", mean)
        kw["mean"] = mean
    elif kind == "mean_value1":
        p.mean_value.append(104.5)
        kw["mean_values"] = [104.5]
    elif kind == "mean_value3":
        p.mean_value.extend([104.0, 117.25, 123.5])
        kw["mean_values"] = [104.0, 117.25, 123.5]
    out = transform(p, batch, dtype=dtype)
    assert out.shape == (24, 3, 5, 5) and out.dtype == dtype
    seen = {match_transform(out[i], batch[i], True, **kw) for i in range(len(batch))}
    # Random offsets and mirroring really vary over the batch.
    assert len({(h, w) for h, w, _ in seen}) > 3
    assert {m for _, _, m in seen} == {False, True}


def test_test_phase_centre_crop_with_mean_file(tmp_path):
    batch = images(4, (3, 9, 8), seed=3)
    mean = np.random.default_rng(4).uniform(0, 255, (3, 9, 8)).astype(np.float32)
    p = pb.TransformationParameter(crop_size=4, scale=0.5,
                                   mean_file=write_mean(tmp_path / "m.binaryproto", mean))
    out = transform(p, batch, phase=pb.TEST)
    for i in range(4):  # the centre: ((9-4)//2, (8-4)//2) = (2, 2)
        np.testing.assert_array_equal(
            out[i], caffe_transform(batch[i], crop=4, h_off=2, w_off=2, mean=mean, scale=0.5))


def test_mirror_is_random_in_test_too_as_in_caffe():
    # Caffe's Transform draws do_mirror = mirror() && Rand(2) in both phases.
    batch = images(16, (1, 4, 6), seed=5)
    out = transform(pb.TransformationParameter(mirror=True), batch, phase=pb.TEST)
    flips = [match_transform(out[i], batch[i], False, mirror=True)[2] for i in range(16)]
    assert set(flips) == {False, True}


def test_no_transform_is_a_cast():
    batch = images(3, (2, 3, 4))
    np.testing.assert_array_equal(transform(pb.TransformationParameter(), batch, dtype="float64"),
                                  batch.astype(np.float64))


def test_float_records_and_hwc_views():
    rng = np.random.default_rng(6)
    floats = rng.normal(size=(5, 2, 6, 6)).astype(np.float32)
    p = pb.TransformationParameter(crop_size=3, mirror=True, mean_value=[0.25], scale=3.0)
    out = transform(p, floats, dtype="float64")
    for i in range(5):
        match_transform(out[i], floats[i], True, crop=3, mirror=True, mean_values=[0.25],
                        scale=3.0, dtype="float64")
    # OpenCV (H, W, C) images seen as (C, H, W) views give the same as contiguous copies.
    hwc = images(6, (6, 7, 3), seed=7)
    views = [im.transpose(2, 0, 1) for im in hwc]
    a = transform(pb.TransformationParameter(crop_size=4, mirror=True), views, seed=9)
    b = transform(pb.TransformationParameter(crop_size=4, mirror=True),
                  [np.ascontiguousarray(v) for v in views], seed=9)
    np.testing.assert_array_equal(a, b)


def test_images_of_several_sizes_with_crop():
    # Caffe crops images of any size >= crop_size; each size is transformed as a group.
    rng = np.random.default_rng(8)
    batch = [rng.integers(0, 256, (3, h, w), dtype=np.uint8)
             for h, w in [(6, 7), (9, 5), (6, 7), (5, 5), (8, 8)]]
    p = pb.TransformationParameter(crop_size=5, mirror=True, mean_value=[10, 20, 30])
    out = transform(p, batch)
    for i, im in enumerate(batch):
        match_transform(out[i], im, True, crop=5, mirror=True, mean_values=[10, 20, 30])
    centre = transform(pb.TransformationParameter(crop_size=5), batch, phase=pb.TEST)
    for i, im in enumerate(batch):
        h, w = (im.shape[1] - 5) // 2, (im.shape[2] - 5) // 2
        np.testing.assert_array_equal(centre[i], caffe_transform(im, crop=5, h_off=h, w_off=w))


def test_same_generator_same_batch():
    batch = images(8, (3, 10, 10))
    p = pb.TransformationParameter(crop_size=6, mirror=True)
    np.testing.assert_array_equal(transform(p, batch, seed=3), transform(p, batch, seed=3))
    assert not np.array_equal(transform(p, batch, seed=3), transform(p, batch, seed=4))


def test_errors(tmp_path):
    mean = write_mean(tmp_path / "m.binaryproto", np.zeros((3, 5, 5), np.float32))
    with pytest.raises(DataError, match="mean_file and mean_value"):
        Transformer(pb.TransformationParameter(mean_file=mean, mean_value=[1]), pb.TRAIN)
    with pytest.raises(DataError, match="force_color and force_gray"):
        Transformer(pb.TransformationParameter(force_color=True, force_gray=True), pb.TRAIN)
    t = Transformer(pb.TransformationParameter(crop_size=6), pb.TRAIN)
    with pytest.raises(DataError, match=r"rec 7: crop_size 6 is larger than the image.*"
                                        r"\(3, 5, 8\)"):
        t.output_shape((3, 5, 8), "rec 7")
    t = Transformer(pb.TransformationParameter(mean_file=mean), pb.TRAIN)
    with pytest.raises(DataError, match=r"\(3, 6, 5\).*m\.binaryproto' is \(3, 5, 5\)"):
        t.output_shape((3, 6, 5), "rec")
    t = Transformer(pb.TransformationParameter(mean_value=[1, 2]), pb.TRAIN)
    with pytest.raises(DataError, match="2 mean_value entries for an image of 3 channels"):
        t.output_shape((3, 4, 4), "rec")
    with pytest.raises(DataError, match="cannot read"):
        Transformer(pb.TransformationParameter(mean_file=str(tmp_path / "none")), pb.TRAIN)
    bad = tmp_path / "bad.binaryproto"
    bad.write_bytes(b"\xff\xff\xff")
    with pytest.raises(DataError, match="not a binary BlobProto"):
        Transformer(pb.TransformationParameter(mean_file=str(bad)), pb.TRAIN)
    # A record whose size differs from the layer's first record.
    t = Transformer(pb.TransformationParameter(), pb.TRAIN)
    out = np.empty((2, 3, 4, 4), np.float32)
    with pytest.raises(DataError, match=r"image 1: image .* \(3, 4, 5\).*takes \(3, 4, 4\)"):
        t([np.zeros((3, 4, 4), np.uint8), np.zeros((3, 4, 5), np.uint8)], out, None,
          lambda i: f"image {i}")


def test_mean_file_with_blob_shape(tmp_path):
    mean = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    path = write_mean(tmp_path / "m.binaryproto", mean[None], legacy=False)
    batch = images(2, (2, 3, 4))
    out = transform(pb.TransformationParameter(mean_file=path), batch)
    np.testing.assert_array_equal(out, batch.astype(np.float32) - mean)
