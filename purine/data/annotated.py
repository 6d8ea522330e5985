"""SSD's AnnotatedData source (weiliu89/caffe): AnnotatedDatum records (an image and its
boxes) read from an LMDB, put through the fork's training pipeline (photometric distortion,
zoom-out expansion, constrained random crops, warp resize, mirror, mean) with the boxes moved
along, and batched as the data blob plus the [1, 1, num_boxes, 8] label blob."""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np
from google.protobuf.message import DecodeError

from purine.data import DataError
from purine.data.datum import datum_image, decode_flag
from purine.data.lmdb_source import DatumBatches, DatumReader, DatumSource
from purine.data.prefetch import Batch, BufferPool, data_span, stream_batch
from purine.formats import caffe_pb2 as pb

# A record's boxes as rows [group_label, instance_id, xmin, ymin, xmax, ymax, difficult], in
# the record's group order: filtering rows keeps the fork's group-then-annotation order.
Boxes = np.ndarray
UNIT = np.array([0.0, 0.0, 1.0, 1.0])
_INTERP = {1: cv2.INTER_LINEAR, 2: cv2.INTER_AREA, 3: cv2.INTER_NEAREST, 4: cv2.INTER_CUBIC,
           5: cv2.INTER_LANCZOS4}


def parse_annotated(value: bytes, where: str) -> pb.AnnotatedDatum:
    a = pb.AnnotatedDatum()
    try:
        a.ParseFromString(value)
    except DecodeError as e:
        raise DataError(f"{where}: not a serialized AnnotatedDatum ({len(value)} bytes: {e})"
                        ) from None
    return a


def record_boxes(a: pb.AnnotatedDatum) -> Boxes:
    rows = [(g.group_label, an.instance_id, an.bbox.xmin, an.bbox.ymin, an.bbox.xmax,
             an.bbox.ymax, float(an.bbox.difficult))
            for g in a.annotation_group for an in g.annotation]
    return np.array(rows, np.float64).reshape(-1, 7)


# -- box geometry, as the fork's bbox_util ------------------------------------------------
def _size(b: np.ndarray) -> np.ndarray:
    w, h = b[..., 2] - b[..., 0], b[..., 3] - b[..., 1]
    return np.where((w < 0) | (h < 0), 0.0, w * h)


def _intersection(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Intersection areas of boxes ``a`` (..., 4) with one box ``b`` (4,); 0 where they do
    not meet (touching edges meet with area 0)."""
    lo, hi = np.maximum(a[..., :2], b[:2]), np.minimum(a[..., 2:], b[2:])
    wh = hi - lo
    return np.where((wh[..., 0] > 0) & (wh[..., 1] > 0), wh[..., 0] * wh[..., 1], 0.0)


def clip_box(b: np.ndarray) -> np.ndarray:
    return np.clip(b, 0.0, 1.0)


def project_boxes(src: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fork's ProjectBBox: (n, 4) boxes in the frame of box ``src``, clipped to it, and
    which of them keep a positive area there."""
    meet = ~((boxes[:, 0] >= src[2]) | (boxes[:, 2] <= src[0]) | (boxes[:, 1] >= src[3])
             | (boxes[:, 3] <= src[1]))
    wh = np.array([src[2] - src[0], src[3] - src[1]] * 2)
    proj = clip_box((boxes - np.tile(src[:2], 2)) / wh)
    return proj, meet & (_size(proj) > 0)


def emit_ok(param: pb.TransformationParameter, crop: np.ndarray, boxes: np.ndarray
            ) -> np.ndarray:
    """The fork's MeetEmitConstraint per box (all true without an emit_constraint)."""
    if not param.HasField("emit_constraint"):
        return np.ones(len(boxes), bool)
    ec = param.emit_constraint
    if ec.emit_type == pb.EmitConstraint.CENTER:
        cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        return (cx >= crop[0]) & (cx <= crop[2]) & (cy >= crop[1]) & (cy <= crop[3])
    with np.errstate(divide="ignore", invalid="ignore"):
        cover = np.where(_size(boxes) > 0, _intersection(boxes, crop) / _size(boxes), 0.0)
    return cover > ec.emit_overlap


def transform_boxes(param: pb.TransformationParameter, boxes: Boxes, crop: np.ndarray,
                    mirror: bool = False, resize: bool = False) -> Boxes:
    """The fork's TransformAnnotation: the boxes (rows) that stay inside ``crop`` after the
    warp's clipping and the emit constraint, in the crop's frame, mirrored if asked."""
    b = boxes[:, 2:6].copy()
    if resize and param.HasField("resize_param"):  # WARP: clipped to the image
        b[:, :2] = np.maximum(b[:, :2], 0.0)
        b[:, 2:] = np.minimum(b[:, 2:], 1.0)
    keep = emit_ok(param, crop, b)
    proj, valid = project_boxes(crop, b)
    keep &= valid
    out = boxes[keep].copy()
    out[:, 2:6] = proj[keep]
    if mirror:
        out[:, [2, 4]] = 1.0 - out[:, [4, 2]]
    return out


# -- batch samplers (the fork's sampler.cpp) -----------------------------------------------
def sample_boxes(sampler: pb.BatchSampler, objects: np.ndarray,
                 rng: np.random.Generator) -> list[np.ndarray]:
    """Up to ``max_sample`` boxes of ``max_trials`` random draws that meet the sampler's
    constraint against the (n, 4) object boxes."""
    s, trials = sampler.sampler, int(sampler.max_trials)
    if trials == 0:
        return []
    scale = rng.uniform(s.min_scale, s.max_scale, trials)
    ratio = rng.uniform(s.min_aspect_ratio, s.max_aspect_ratio, trials)
    ratio = np.minimum(np.maximum(ratio, scale ** 2), 1 / scale ** 2)
    w, h = scale * np.sqrt(ratio), scale / np.sqrt(ratio)
    x0, y0 = rng.uniform(0, 1, trials) * (1 - w), rng.uniform(0, 1, trials) * (1 - h)
    cand = np.stack([x0, y0, x0 + w, y0 + h], axis=1)
    ok = np.array([satisfies(c, objects, sampler.sample_constraint) for c in cand], bool)
    found = cand[ok]
    if sampler.HasField("max_sample"):
        found = found[:sampler.max_sample]
    return list(found)


def satisfies(box: np.ndarray, objects: np.ndarray, c: pb.SampleConstraint) -> bool:
    """The fork's SatisfySampleConstraint. As its loop is written, an object passing the
    first constraint kind present (Jaccard, else sample coverage, else object coverage)
    already satisfies it: a later kind failing only moves on to the next object."""
    kinds = [("jaccard", c.HasField("min_jaccard_overlap"), c.HasField("max_jaccard_overlap"),
              c.min_jaccard_overlap, c.max_jaccard_overlap),
             ("sample", c.HasField("min_sample_coverage"), c.HasField("max_sample_coverage"),
              c.min_sample_coverage, c.max_sample_coverage),
             ("object", c.HasField("min_object_coverage"), c.HasField("max_object_coverage"),
              c.min_object_coverage, c.max_object_coverage)]
    present = [k for k in kinds if k[1] or k[2]]
    if not present:
        return True
    if len(objects) == 0:
        return False
    kind, has_lo, has_hi, lo, hi = present[0]
    inter = _intersection(objects, box)
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == "jaccard":
            v = inter / (_size(objects) + _size(box) - inter)
        elif kind == "sample":
            v = inter / _size(box)
        else:
            v = inter / _size(objects)
    v = np.nan_to_num(v)
    ok = np.ones(len(objects), bool)
    if has_lo:
        ok &= v >= np.float32(lo)
    if has_hi:
        ok &= v <= np.float32(hi)
    return bool(ok.any())


# -- photometric distortion (the fork's im_transforms ApplyDistort) -----------------------
def _convert(img: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """OpenCV's convertTo(alpha, beta) on uint8: rounded and saturated."""
    return np.clip(np.rint(img.astype(np.float32) * alpha + beta), 0, 255).astype(np.uint8)


def _hsv_channel(img: np.ndarray, ch: int, alpha: float, beta: float) -> np.ndarray:
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
    hsv[..., ch] = _convert(hsv[..., ch], alpha, beta)
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)


def distort(img: np.ndarray, d: pb.DistortionParameter, rng: np.random.Generator
            ) -> np.ndarray:
    """Random brightness, contrast, saturation, hue and channel order on an (H, W, 3) BGR
    image; contrast goes before saturation or after hue, at even odds, as in the fork."""
    def brightness(im):
        if rng.uniform() < d.brightness_prob:
            return _convert(im, 1.0, rng.uniform(-d.brightness_delta, d.brightness_delta))
        return im

    def contrast(im):
        if rng.uniform() < d.contrast_prob:
            return _convert(im, rng.uniform(d.contrast_lower, d.contrast_upper), 0.0)
        return im

    def saturation(im):
        if rng.uniform() < d.saturation_prob:
            return _hsv_channel(im, 1, rng.uniform(d.saturation_lower, d.saturation_upper), 0)
        return im

    def hue(im):
        if rng.uniform() < d.hue_prob:
            return _hsv_channel(im, 0, 1.0, rng.uniform(-d.hue_delta, d.hue_delta))
        return im

    def order(im):
        if rng.uniform() < d.random_order_prob:
            return np.ascontiguousarray(im[..., rng.permutation(im.shape[2])])
        return im

    steps = ((brightness, contrast, saturation, hue, order) if rng.uniform() > 0.5
             else (brightness, saturation, hue, contrast, order))
    for step in steps:
        img = step(img)
    return img


# -- the whole pipeline --------------------------------------------------------------------
class AnnotatedTransform:
    """The fork's per-record pipeline for AnnotatedData: distort, expand, sample and crop,
    then resize (WARP), crop_size crop, mirror, mean and scale. Options it does not build
    are refused by name when it is made."""

    def __init__(self, param: pb.TransformationParameter, samplers: Sequence[pb.BatchSampler],
                 phase: int, dtype: str = "float32"):
        for field, why in (("mean_file", "use mean_value"), ("noise_param", "")):
            if param.HasField(field):
                raise DataError(f"transform_param.{field} is not built for AnnotatedData"
                                + (f"; {why}" if why else ""))
        if param.force_color and param.force_gray:
            raise DataError("transform_param: cannot set both force_color and force_gray")
        if param.HasField("resize_param"):
            r = param.resize_param
            if r.resize_mode != pb.ResizeParameter.WARP:
                mode = pb.ResizeParameter.Resize_mode.Name(r.resize_mode)
                raise DataError(f"transform_param.resize_param.resize_mode {mode} is not built"
                                " for AnnotatedData; use WARP")
            if r.height <= 0 or r.width <= 0:
                raise DataError("transform_param.resize_param needs height and width > 0, got "
                                f"{r.height} x {r.width}")
        if param.HasField("expand_param") and not param.expand_param.max_expand_ratio > 1:
            raise DataError("transform_param.expand_param.max_expand_ratio must be > 1, got "
                            f"{param.expand_param.max_expand_ratio:g}")
        for s in samplers:
            if not 0 < s.sampler.min_scale <= s.sampler.max_scale <= 1:
                raise DataError(f"batch_sampler: scales {s.sampler.min_scale:g}.."
                                f"{s.sampler.max_scale:g}; expected 0 < min_scale <= max_scale"
                                " <= 1")
            if not 0 < s.sampler.min_aspect_ratio <= s.sampler.max_aspect_ratio:
                raise DataError("batch_sampler: aspect ratios "
                                f"{s.sampler.min_aspect_ratio:g}..{s.sampler.max_aspect_ratio:g};"
                                " expected 0 < min_aspect_ratio <= max_aspect_ratio")
        self.param, self.samplers = param, list(samplers)
        self.train = phase == pb.TRAIN
        self.dtype = np.dtype(dtype)
        self.crop_h = int(param.crop_size or param.crop_h)
        self.crop_w = int(param.crop_size or param.crop_w)
        self.mean = np.asarray(param.mean_value, np.float32) if len(param.mean_value) else None
        self.flag = decode_flag(param.force_color, param.force_gray)

    def output_shape(self, c: int, h: int, w: int, where: str) -> tuple[int, int, int]:
        """The fork's InferBlobShape for an image of (c, h, w)."""
        if self.param.HasField("resize_param"):
            h, w = int(self.param.resize_param.height), int(self.param.resize_param.width)
        if h < self.crop_h or w < self.crop_w:
            raise DataError(f"{where}: crop {self.crop_h} x {self.crop_w} is larger than the "
                            f"image {h} x {w}")
        if self.mean is not None and len(self.mean) not in (1, c):
            raise DataError(f"{where}: {len(self.mean)} mean_value entries for an image of {c}"
                            " channels; give 1 mean_value or one per channel")
        return c, self.crop_h or h, self.crop_w or w

    def _expand(self, img: np.ndarray, boxes: Boxes, rng: np.random.Generator
                ) -> tuple[np.ndarray, Boxes]:
        e = self.param.expand_param
        if rng.uniform() > e.prob or abs(e.max_expand_ratio - 1) < 1e-2:
            return img, boxes
        ratio = rng.uniform(1.0, e.max_expand_ratio)
        h, w = img.shape[:2]
        eh, ew = int(h * ratio), int(w * ratio)
        top, left = np.floor(rng.uniform(0, eh - h)), np.floor(rng.uniform(0, ew - w))
        canvas = np.zeros((eh, ew, img.shape[2]), np.uint8)
        if self.mean is not None:  # the fork fills with the mean values, cast to bytes
            canvas[...] = np.broadcast_to(self.mean, (img.shape[2],)).astype(np.uint8)
        canvas[int(top):int(top) + h, int(left):int(left) + w] = img
        frame = np.array([-left / w, -top / h, (ew - left) / w, (eh - top) / h])
        return canvas, transform_boxes(self.param, boxes, frame)

    def _sample(self, img: np.ndarray, boxes: Boxes, rng: np.random.Generator
                ) -> tuple[np.ndarray, Boxes]:
        found: list[np.ndarray] = []
        for s in self.samplers:
            if s.use_original_image:
                found += sample_boxes(s, boxes[:, 2:6], rng)
        if not found:
            return img, boxes
        box = clip_box(found[int(rng.integers(len(found)))])
        h, w = img.shape[:2]
        x0, y0, x1, y1 = box * [w, h, w, h]
        left, top = int(x0), int(y0)
        img = img[top:top + int(y1 - y0), left:left + int(x1 - x0)]
        return img, transform_boxes(self.param, boxes, box)

    def __call__(self, img: np.ndarray, boxes: Boxes, rng: np.random.Generator,
                 out: np.ndarray, where: str) -> Boxes:
        """Transform one (H, W, C) uint8 image into ``out`` (C, h, w) and return its boxes
        in the output's frame."""
        p = self.param
        if p.HasField("distort_param"):
            if img.shape[2] != 3:
                raise DataError(f"{where}: distort_param needs 3-channel images, got "
                                f"{img.shape[2]}")
            img = distort(img, p.distort_param, rng)
        if p.HasField("expand_param"):
            img, boxes = self._expand(img, boxes, rng)
        if self.samplers:
            img, boxes = self._sample(img, boxes, rng)
        if p.HasField("resize_param"):
            r = p.resize_param
            modes = list(r.interp_mode)
            mode = modes[int(rng.integers(len(modes)))] if modes else 1
            img = cv2.resize(img, (int(r.width), int(r.height)), interpolation=_INTERP[mode])
            if img.ndim == 2:
                img = img[..., None]
        h, w = img.shape[:2]
        ch, cw = self.crop_h or h, self.crop_w or w
        if (ch, cw) != tuple(out.shape[1:]) or img.shape[2] != out.shape[0]:
            raise DataError(f"{where}: transformed to {img.shape[2]} x {ch} x {cw} but its "
                            f"batch is {' x '.join(map(str, out.shape))}; give transform_param"
                            ".resize_param (WARP) so that every record has one size")
        top = left = 0
        if self.crop_h and self.crop_w:
            if self.train:
                top, left = int(rng.integers(h - ch + 1)), int(rng.integers(w - cw + 1))
            else:
                top, left = (h - ch) // 2, (w - cw) // 2
        mirror = bool(p.mirror and rng.integers(2))
        crop = np.array([left / w, top / h, (left + cw) / w, (top + ch) / h])
        pix = img[top:top + ch, left:left + cw].astype(self.dtype)
        if self.mean is not None:
            pix -= np.broadcast_to(self.mean, (img.shape[2],)).astype(self.dtype)
        pix *= self.dtype.type(np.float32(p.scale))
        if mirror:
            pix = pix[:, ::-1]
        out[...] = pix.transpose(2, 0, 1)
        return transform_boxes(p, boxes, crop, mirror=mirror, resize=True)


def label_rows(per_item: Sequence[Boxes]) -> np.ndarray:
    """The fork's label blob [1, 1, num_boxes, 8] of rows [item_id, group_label,
    instance_id, xmin, ymin, xmax, ymax, difficult]; one row of -1 when no box is left."""
    rows = [np.column_stack([np.full(len(b), i, np.float64), b])
            for i, b in enumerate(per_item) if len(b)]
    if not rows:
        return -np.ones((1, 1, 1, 8))
    r = np.concatenate(rows)
    return r.reshape(1, 1, len(r), 8)


class AnnotatedBatches(DatumBatches):
    """The batches of one AnnotatedData layer over an LMDB: ``read(k)`` gives (data,
    label), or (data,) with one top; records without an annotation type give Datum labels
    (batch,) instead, as in the fork. DatumBatches gives ``where``, ``reader`` and ``close``
    over this class's own ``read``; its Datum transformer is not used (no super().__init__),
    the fork's annotated transform stands in."""

    def __init__(self, source: DatumSource, batch_size: int, transform: AnnotatedTransform,
                 *, labels: bool, rich: bool, dtype: str, seed: int, index: int,
                 replica: tuple[int, int] = (0, 1), skip: int = 0):
        self.source, self.batch_size, self.transform = source, batch_size, transform
        self.labels, self.rich, self.dtype = labels, rich, np.dtype(dtype)
        self.seed, self.index, self.replica, self.skip = seed, index, replica, skip

    def decode(self, value: bytes, where: str) -> tuple[np.ndarray, Boxes, pb.AnnotatedDatum]:
        a = parse_annotated(value, where)
        img = datum_image(a.datum, self.transform.flag, where)
        if img.dtype != np.uint8:
            raise DataError(f"{where}: float_data images are not transformed by AnnotatedData;"
                            " store 8-bit pixels")
        return np.ascontiguousarray(img.transpose(1, 2, 0)), record_boxes(a), a

    def first_shape(self) -> tuple[int, int, int]:
        key, value = self.source.first()
        img, _, _ = self.decode(value, self.where(key))
        h, w, c = img.shape
        return self.transform.output_shape(c, h, w, self.where(key))

    def read(self, r: DatumReader, k: int, pool: BufferPool) -> Batch:
        g = stream_batch(k, self.replica)
        with data_span("read"):
            recs = r.records(self.skip + g * self.batch_size, self.batch_size)
        rng = np.random.default_rng([self.seed, self.index, g])
        with data_span("transform"):
            first = None
            out = boxes = plain = None
            for i, (key, value) in enumerate(recs):
                where = self.where(key)
                img, b, a = self.decode(value, where)
                if first is None:
                    first = self.transform.output_shape(img.shape[2], *img.shape[:2], where)
                    out = pool.array((self.batch_size,) + first, self.dtype)
                    boxes, plain = [], np.empty(self.batch_size, self.dtype)
                boxes.append(self.transform(img, b, rng, out[i], where))
                plain[i] = a.datum.label
        if not self.labels:
            return (out,)
        if not self.rich:
            return out, plain
        return out, label_rows(boxes).astype(self.dtype)
