"""SSD's MultiBoxLoss (weiliu89/caffe): matching priors to ground-truth boxes, hard negative
mining, and the localization + confidence loss with its backward. Matching and mining run on
the host and leave fixed-shape targets; the loss and its gradient are array code over them."""

from __future__ import annotations

from typing import Any

import numpy as np

from purine.backend import assign, get_array_module, to_host
from purine.errors import LabelError
from purine.ops.detection import CORNER, decode_boxes, encode_boxes, jaccard

Array = Any

FLT_MIN = 1.1754943508222875e-38  # the fork clamps probabilities here before the log
OVERLAP_EPS = 1e-6  # the fork records an overlap only above this


# -- ground truth and matching -------------------------------------------------------------
def ground_truth(label: np.ndarray, background_label_id: int, use_difficult_gt: bool
                 ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The AnnotatedData label rows [item_id, label, instance_id, xmin, ymin, xmax, ymax,
    difficult] as item -> (boxes (g, 4), labels (g,)), in row order; rows with item_id -1
    are padding and difficult boxes are dropped unless ``use_difficult_gt``."""
    rows = np.asarray(label, dtype=np.float64).reshape(-1, 8)
    rows = rows[rows[:, 0].astype(np.int64) != -1]
    labels = rows[:, 1].astype(np.int64)
    if (labels == background_label_id).any():
        raise LabelError(f"a ground-truth box has the background label {background_label_id}"
                         " (MultiBoxLoss's background_label_id); boxes must be objects")
    if not use_difficult_gt:
        rows = rows[rows[:, 7] == 0]
    items = rows[:, 0].astype(np.int64)
    return {int(i): (rows[items == i, 3:7], rows[items == i, 1].astype(np.int64))
            for i in dict.fromkeys(items.tolist())}


def match_boxes(gt: np.ndarray, boxes: np.ndarray, *, match_type: str = "PER_PREDICTION",
                overlap_threshold: float = 0.5, ignore_cross_boundary: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
    """The fork's MatchBBox: for each of the (P, 4) ``boxes`` the index of its ground truth
    (-1: none, -2: ignored as crossing the image border) and its best overlap. Bipartite
    first: repeatedly the highest remaining overlap pairs a box and a ground truth (ties: the
    lowest box, then the lowest ground truth); PER_PREDICTION then gives each unmatched box
    its best ground truth with overlap >= ``overlap_threshold``."""
    n = len(boxes)
    idx = np.full(n, -1, np.int64)
    if len(gt) == 0:
        return idx, np.zeros(n)
    iou = jaccard(boxes, gt)
    if ignore_cross_boundary:
        cross = ((boxes < 0) | (boxes > 1)).any(axis=1)
        idx[cross] = -2
        iou[cross] = 0.0
    iou = np.where(iou > OVERLAP_EPS, iou, 0.0)
    overlap = iou.max(axis=1)
    work = iou.copy()
    for _ in range(len(gt)):
        k = int(work.argmax())  # row-major: the lowest box, then the lowest ground truth
        p, j = divmod(k, len(gt))
        if work[p, j] <= 0:
            break
        idx[p], overlap[p] = j, work[p, j]
        work[p, :] = 0.0
        work[:, j] = 0.0
    if match_type == "PER_PREDICTION":
        ok = (iou > 0) & (iou >= overlap_threshold)
        best = np.where(ok, iou, -1.0)
        take = (idx == -1) & ok.any(axis=1)
        idx[take] = best[take].argmax(axis=1)
        overlap[take] = best[take].max(axis=1)
    return idx, overlap


def _matches(gt: np.ndarray, gt_labels: np.ndarray, priors: np.ndarray, var: np.ndarray,
             loc: np.ndarray, p: dict) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The fork's FindMatches for one image: loc class (-1 when shared) -> (indices,
    overlaps)."""
    opts = dict(match_type=p["match_type"], overlap_threshold=p["overlap_threshold"],
                ignore_cross_boundary=p["ignore_cross_boundary_bbox"])
    classes = [-1] if p["share_location"] else [c for c in range(p["num_classes"])
                                                 if c != p["background_label_id"]]
    out = {}
    if p["use_prior_for_matching"]:
        idx, ovl = match_boxes(gt, priors, **opts)
        for c in classes:
            if c == -1:
                out[c] = (idx, ovl)
            else:  # each class keeps the matches to its own ground truths
                own = (idx > -1) & (gt_labels[np.maximum(idx, 0)] == c)
                out[c] = (np.where(own, idx, np.minimum(idx, -1)), ovl)
        return out
    for c in classes:
        boxes = decode_boxes(loc[:, 0 if c == -1 else c], priors, var, code_type=p["code_type"],
                             variance_encoded_in_target=p["encode_variance_in_target"])
        subset = np.arange(len(gt)) if c == -1 else np.flatnonzero(gt_labels == c)
        idx, ovl = match_boxes(gt[subset], boxes, **opts)
        out[c] = (np.where(idx > -1, subset[np.maximum(idx, 0)], idx), ovl)
    return out


def _conf_loss(conf: np.ndarray, labels: np.ndarray, logistic: bool) -> np.ndarray:
    """Per-prior confidence loss of (P, C) scores against class ``labels`` (the fork's
    ComputeConfLoss, which mining ranks by)."""
    if logistic:
        t = np.zeros_like(conf)
        t[np.arange(len(conf)), labels] = 1.0
        return _sigmoid_ce(np, conf, t).sum(axis=1)
    z = conf - conf.max(axis=1, keepdims=True)
    prob = np.exp(z[np.arange(len(conf)), labels]) / np.exp(z).sum(axis=1)
    return -np.log(np.maximum(prob, FLT_MIN))


def multibox_targets(loc: Array, conf: Array, prior: Array, label: Array, loc_w: Array,
                     loc_t: Array, conf_t: Array, conf_sel: Array, stats: Array, *,
                     num_classes: int, share_location: bool = True,
                     match_type: str = "PER_PREDICTION", overlap_threshold: float = 0.5,
                     use_prior_for_matching: bool = True, background_label_id: int = 0,
                     use_difficult_gt: bool = True, mining_type: str = "MAX_NEGATIVE",
                     neg_pos_ratio: float = 3.0, neg_overlap: float = 0.5,
                     code_type: int = CORNER, encode_variance_in_target: bool = False,
                     ignore_cross_boundary_bbox: bool = False, conf_loss_type: str = "SOFTMAX",
                     normalization: str = "VALID") -> None:
    """Match, mine, and write the targets the loss kernels read: ``loc_w``/``loc_t`` (shaped
    as loc: per matched slot the weight on the prediction, 1 or 1/variance, and the encoded
    ground truth over the variance; 0 elsewhere), ``conf_t`` (shaped as conf: the target per
    class) and ``conf_sel`` (N, P: 1 for the priors the confidence loss takes), and
    ``stats`` = [matches, mined negatives, normalizer]."""
    p = dict(locals())
    n, n_priors = loc.shape[0], prior.shape[2] // 4
    lc = 1 if share_location else num_classes
    loc_h = to_host(loc).reshape(n, n_priors, lc, 4).astype(np.float64)
    conf_h = to_host(conf).reshape(n, n_priors, num_classes).astype(np.float64)
    pri = to_host(prior).reshape(2, n_priors, 4).astype(np.float64)
    priors, var = pri[0], pri[1]
    gts = ground_truth(to_host(label), background_label_id, use_difficult_gt)
    w, t = np.zeros_like(loc_h), np.zeros_like(loc_h)
    ct = np.zeros_like(conf_h)
    sel = np.zeros((n, n_priors))
    logistic = conf_loss_type == "LOGISTIC"
    mining = mining_type != "NONE"
    n_match = n_neg = 0
    rows = np.arange(n_priors)
    for i in range(n):
        if not mining and not logistic:
            ct[i, :, background_label_id] = 1.0
        if i not in gts:
            if not mining:
                sel[i] = 1.0
            continue
        gt, gt_labels = gts[i]
        matches = _matches(gt, gt_labels, priors, var, loc_h[i], p)
        pos_label = np.full(n_priors, background_label_id)  # the first match's, for mining
        seen = np.zeros(n_priors, bool)
        for c, (idx, _) in matches.items():  # ascending class, as the fork's std::map
            m = idx > -1
            # The target is the encoding over the variance whether or not the variance is
            # 'in the target': the fork divides both prediction and target by it then.
            enc = encode_boxes(gt[idx[m]], priors[m], var[m], code_type=code_type)
            slot = 0 if c == -1 else c
            w[i, m, slot] = 1.0 / var[m] if encode_variance_in_target else 1.0
            t[i, m, slot] = enc
            first = m & ~seen
            pos_label[first] = gt_labels[idx[first]]
            seen |= m
            n_match += int(m.sum())
            ct[i, m] = 0.0
            ct[i, m, gt_labels[idx[m]]] = 1.0  # a later class overwrites, as in the fork
            if mining:
                sel[i, m] = 1.0
        if not mining:
            sel[i] = 1.0
            continue
        losses = _conf_loss(conf_h[i], pos_label, logistic)
        for idx, ovl in matches.values():
            eligible = (idx == -1) & (ovl < neg_overlap)
            num_pos = int((idx > -1).sum())
            k = min(int(np.float32(num_pos) * np.float32(neg_pos_ratio)), int(eligible.sum()))
            cand = rows[eligible]
            # The fork sorts (loss, index) pairs by loss, descending; a stable sort breaks
            # ties by the lower prior.
            order = cand[np.argsort(-losses[cand], kind="stable")][:k]
            neg = np.sort(order)
            sel[i, neg] = 1.0
            if logistic:
                ct[i, neg] = 0.0
                if 0 <= background_label_id < num_classes:
                    ct[i, neg, background_label_id] = 1.0
            else:
                ct[i, neg, background_label_id] = 1.0
            n_neg += len(neg)
    norm = {"FULL": n * n_priors, "VALID": n_match, "BATCH_SIZE": n, "NONE": 1}[normalization]
    assign(loc_w, w.reshape(loc_w.shape))
    assign(loc_t, t.reshape(loc_t.shape))
    assign(conf_t, ct.reshape(conf_t.shape))
    assign(conf_sel, sel)
    assign(stats, np.array([n_match, n_neg, max(1.0, float(norm))]))


# -- the loss over fixed targets -----------------------------------------------------------
def _sigmoid_ce(xp: Any, x: Array, t: Array) -> Array:
    """Caffe's stable sigmoid cross-entropy per element."""
    pos = (x >= 0).astype(x.dtype)
    return -(x * (t - pos) - xp.log1p(xp.exp(x - 2 * x * pos)))


def _softmax(xp: Any, x: Array) -> Array:
    z = xp.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def multibox_loss_forward(loc: Array, conf: Array, loc_w: Array, loc_t: Array, conf_t: Array,
                          conf_sel: Array, stats: Array, loss: Array, *, num_classes: int,
                          loc_loss_type: str = "SMOOTH_L1", conf_loss_type: str = "SOFTMAX",
                          loc_weight: float = 1.0, use_loc: bool = True,
                          use_conf: bool = True) -> None:
    """``loss = (loc_weight * L_loc + L_conf) / normalizer``: L_loc sums SmoothL1 (or half
    the squared error, for L2) of ``loc * loc_w - loc_t`` over matched slots; L_conf sums
    the softmax (or logistic) cross-entropy of the selected priors' scores."""
    xp = get_array_module(loc)
    total = xp.zeros((), dtype=loss.dtype)
    norm = stats[2]
    if use_loc:
        d = loc * loc_w - loc_t
        a = xp.abs(d)
        per = xp.where(a < 1, 0.5 * d * d, a - 0.5) if loc_loss_type == "SMOOTH_L1" else 0.5 * d * d
        total = total + loc_weight * per.sum() / norm
    if use_conf:
        x = conf.reshape(conf.shape[0], -1, num_classes)
        t = conf_t.reshape(x.shape)
        if conf_loss_type == "LOGISTIC":
            per = _sigmoid_ce(xp, x, t).sum(axis=-1)
        else:
            per = -(t * xp.log(xp.maximum(_softmax(xp, x), FLT_MIN))).sum(axis=-1)
        total = total + (per * conf_sel).sum() / norm
    assign(loss, total)


def multibox_loc_backward(loc: Array, loc_w: Array, loc_t: Array, stats: Array, dloss: Array,
                          dloc: Array, *, loc_loss_type: str = "SMOOTH_L1",
                          loc_weight: float = 1.0) -> None:
    """The fork's gradient to ``loc``: the loss's derivative in ``loc * loc_w - loc_t`` at
    the matched slots, copied back without the chain factor ``loc_w`` (the fork's; it
    differs from the true gradient only with encode_variance_in_target)."""
    xp = get_array_module(loc)
    d = loc * loc_w - loc_t
    g = xp.clip(d, -1.0, 1.0) if loc_loss_type == "SMOOTH_L1" else d
    # Caffe's SmoothL1 derivative is sign(d) at |d| >= 1, which is clip(d) there too.
    assign(dloc, xp.where(loc_w != 0, g, 0.0) * (loc_weight * dloss / stats[2]))


def multibox_conf_backward(conf: Array, conf_t: Array, conf_sel: Array, stats: Array,
                           dloss: Array, dconf: Array, *, num_classes: int,
                           conf_loss_type: str = "SOFTMAX") -> None:
    """Gradient to ``conf``: (softmax or sigmoid - target) on the selected priors."""
    xp = get_array_module(conf)
    x = conf.reshape(conf.shape[0], -1, num_classes)
    prob = 1 / (1 + xp.exp(-x)) if conf_loss_type == "LOGISTIC" else _softmax(xp, x)
    g = (prob - conf_t.reshape(x.shape)) * conf_sel[..., None]
    assign(dconf, (g * (dloss / stats[2])).reshape(dconf.shape))
