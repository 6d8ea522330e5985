"""Solver kernels against a plain transcription of Caffe's SGDSolver family: the learning-rate
policies, ClipGradients, Normalize, Regularize and every ComputeUpdateValue, element by
element with Python floats."""

from __future__ import annotations

import math

import numpy as np
import pytest

from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.upgrade import SOLVER_TYPE_NAMES
from purine.ops.solver import (
    FUSED,
    SOLVER_TYPES,
    SOLVERS,
    global_l2_norm,
    gradient_scale,
    learning_rate,
    prepare_gradient,
    rate,
)


# -- the reference: Caffe's Solver::Step / SGDSolver::ApplyUpdate, one element at a time -----
def ref_rate(policy, it, p):
    if policy == "fixed":
        return p["base_lr"]
    if policy == "step":
        return p["base_lr"] * p["gamma"] ** math.floor(it / p["stepsize"])
    raise AssertionError(policy)


def ref_update(kind, g, w, hist, local_rate, s, it):
    """One parameter element: returns (new w, new histories). ``g`` is already clipped,
    normalized and regularized."""
    if kind == "SGD":
        (h,) = hist
        h = s["momentum"] * h + local_rate * g
        return w - h, [h]
    if kind == "Nesterov":
        (h,) = hist
        h_new = s["momentum"] * h + local_rate * g
        update = (1 + s["momentum"]) * h_new - s["momentum"] * h
        return w - update, [h_new]
    if kind == "AdaGrad":
        (h,) = hist
        h = h + g * g
        return w - local_rate * g / (math.sqrt(h) + s["delta"]), [h]
    if kind == "RMSProp":
        (h,) = hist
        h = s["rms_decay"] * h + (1 - s["rms_decay"]) * g * g
        return w - local_rate * g / (math.sqrt(h) + s["delta"]), [h]
    if kind == "AdaDelta":
        h, h2 = hist
        m, d = s["momentum"], s["delta"]
        h = m * h + (1 - m) * g * g
        u = g * math.sqrt((h2 + d) / (h + d))
        h2 = m * h2 + (1 - m) * u * u
        return w - local_rate * u, [h, h2]
    if kind == "Adam":
        m, v = hist
        b1, b2 = s["momentum"], s["momentum2"]
        t = it + 1
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        corr = math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        return w - local_rate * corr * m / (math.sqrt(v) + s["delta"]), [m, v]
    raise AssertionError(kind)


def ref_apply_update(kind, s, params, grads, hists, it):
    """params/grads: lists of flat Python lists (grads summed over iter_size); hists: per
    parameter a list of flat lists. Updates params and hists in place."""
    lr = ref_rate(s["lr_policy"], it, s)
    sumsq = sum(x * x for g in grads for x in g)
    norm = math.sqrt(sumsq)
    clip_scale = s["clip"] / norm if s["clip"] >= 0 and norm > s["clip"] else 1.0
    for k, (w, g) in enumerate(zip(params, grads, strict=True)):
        local_decay = s["weight_decay"] * s["decay_mult"][k]
        local_rate = lr * s["lr_mult"][k]
        for i in range(len(w)):
            gi = g[i] * clip_scale
            if s["iter_size"] > 1:
                gi = gi * (1.0 / s["iter_size"])
            if local_decay:
                if s["regularization"] == "L2":
                    gi += local_decay * w[i]
                else:
                    gi += local_decay * ((w[i] > 0) - (w[i] < 0))
            new_w, new_h = ref_update(kind, gi, w[i], [h[i] for h in hists[k]], local_rate,
                                      s, it)
            w[i] = new_w
            for h, x in zip(hists[k], new_h, strict=True):
                h[i] = x


SETTINGS = {
    "SGD": dict(momentum=0.9, base_lr=0.05),
    "Nesterov": dict(momentum=0.9, base_lr=0.05),
    "AdaGrad": dict(momentum=0.0, base_lr=0.05, delta=1e-6),
    "RMSProp": dict(momentum=0.0, base_lr=0.01, rms_decay=0.9, delta=1e-6),
    "AdaDelta": dict(momentum=0.95, base_lr=1.0, delta=1e-6),
    "Adam": dict(momentum=0.9, momentum2=0.999, base_lr=0.01, delta=1e-8),
}
SHAPES = [(3, 4), (3,)]
STEPS = 6


def kernel_params(kind, s, k):
    p = {"lr_mult": s["lr_mult"][k]}
    if kind in ("SGD", "Nesterov"):
        p["momentum"] = s["momentum"]
    elif kind == "AdaGrad":
        p["delta"] = s["delta"]
    elif kind == "RMSProp":
        p.update(rms_decay=s["rms_decay"], delta=s["delta"])
    elif kind == "AdaDelta":
        p.update(momentum=s["momentum"], delta=s["delta"])
    else:
        p.update(beta1=s["momentum"], beta2=s["momentum2"], delta=s["delta"])
    return p


def run_kernels(kind, s, w0, grad_seq, start_iter, dtype, in_place=True):
    """Drive the kernels the way the solver graph does; returns params and histories."""
    kernel, n_hist = SOLVERS[kind]
    ws = [w.astype(dtype) for w in w0]
    hists = [[np.zeros_like(w) for _ in range(n_hist)] for w in ws]
    lr = np.zeros((), dtype)
    it_arr = np.zeros((), np.int64)
    scale = np.zeros((), dtype)
    for step, grads in enumerate(grad_seq):
        it_arr[...] = start_iter + step
        learning_rate(it_arr, lr, policy=s["lr_policy"], base_lr=s["base_lr"],
                      gamma=s["gamma"], power=0.0, stepsize=s["stepsize"], stepvalues=(),
                      max_iter=0)
        gs = [g.astype(dtype) for g in grads]
        gradient_scale(*gs, scale, clip=s["clip"])
        for k, (w, g) in enumerate(zip(ws, gs, strict=True)):
            prepare_gradient(w, g, scale, g, iter_size=s["iter_size"],
                             decay=s["weight_decay"] * s["decay_mult"][k],
                             regularization=s["regularization"])
            scalars = (lr, it_arr) if kind == "Adam" else (lr,)
            if in_place:
                kernel(g, *scalars, w, *hists[k], w, *hists[k], **kernel_params(kind, s, k))
            else:
                g_before, w_before = g.copy(), w.copy()
                h_before = [h.copy() for h in hists[k]]
                w_new = np.full_like(w, np.nan)
                h_new = [np.full_like(h, np.nan) for h in hists[k]]
                kernel(g, *scalars, w, *hists[k], w_new, *h_new, **kernel_params(kind, s, k))
                # an out-of-place call writes only its outputs
                np.testing.assert_array_equal(g, g_before)
                np.testing.assert_array_equal(w, w_before)
                for h, hb in zip(hists[k], h_before, strict=True):
                    np.testing.assert_array_equal(h, hb)
                ws[k] = w_new
                hists[k] = h_new
    return ws, hists


def make_problem(kind, regularization, seed=0):
    rng = np.random.default_rng(seed)
    s = dict(lr_policy="step", gamma=0.5, stepsize=3, clip=1.5, weight_decay=0.01,
             regularization=regularization, iter_size=2, lr_mult=[1.0, 2.0],
             decay_mult=[1.0, 0.5], momentum2=0.999, rms_decay=0.99, delta=1e-8)
    s.update(SETTINGS[kind])
    w0 = [rng.standard_normal(shape) for shape in SHAPES]
    # sums of two sub-batch gradients (iter_size 2), alternating large and small so that the
    # clip threshold is crossed on some steps only
    grad_seq = [[(rng.standard_normal(shape) + rng.standard_normal(shape))
                 * (0.6 if step % 2 else 0.1) for shape in SHAPES]
                for step in range(STEPS)]
    return s, w0, grad_seq


def reference(kind, s, w0, grad_seq, start_iter):
    params = [w.ravel().tolist() for w in w0]
    hists = [[[0.0] * w.size for _ in range(SOLVERS[kind][1])] for w in w0]
    clipped = 0
    for step, grads in enumerate(grad_seq):
        flat = [g.ravel().tolist() for g in grads]
        clipped += math.sqrt(sum(x * x for g in flat for x in g)) > s["clip"]
        ref_apply_update(kind, s, params, flat, hists, start_iter + step)
    assert 0 < clipped < len(grad_seq), "the test data must clip on some steps only"
    return ([np.array(p).reshape(w.shape) for p, w in zip(params, w0, strict=True)],
            [[np.array(h).reshape(w.shape) for h in hs] for hs, w in zip(hists, w0, strict=True)])


@pytest.mark.parametrize("start_iter", [0, 7])
@pytest.mark.parametrize("regularization", ["L2", "L1"])
@pytest.mark.parametrize("kind", list(SOLVERS))
def test_solver_matches_caffe_float64(kind, regularization, start_iter):
    s, w0, grad_seq = make_problem(kind, regularization)
    want_w, want_h = reference(kind, s, w0, grad_seq, start_iter)
    for in_place in (True, False):
        got_w, got_h = run_kernels(kind, s, w0, grad_seq, start_iter, np.float64, in_place)
        for g, w in zip(got_w, want_w, strict=True):
            assert g.dtype == np.float64
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-12)
        for gs, ws in zip(got_h, want_h, strict=True):
            for g, w in zip(gs, ws, strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-12)
    # the weights really moved
    assert not np.allclose(want_w[0], w0[0], rtol=1e-3)


@pytest.mark.parametrize("kind", list(SOLVERS))
def test_solver_float32_stays_float32(kind):
    s, w0, grad_seq = make_problem(kind, "L2", seed=1)
    want_w, want_h = reference(kind, s, w0, grad_seq, 0)
    got_w, got_h = run_kernels(kind, s, w0, grad_seq, 0, np.float32)
    for g, w in zip(got_w, want_w, strict=True):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    for gs, ws in zip(got_h, want_h, strict=True):
        for g, w in zip(gs, ws, strict=True):
            assert g.dtype == np.float32
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-5)


def test_sgd_by_hand():
    g, w, h = np.array([2.0]), np.array([1.0]), np.array([0.5])
    SOLVERS["SGD"][0](g, np.array(0.1), w, h, w, h, lr_mult=2.0, momentum=0.9)
    # h = 0.9 * 0.5 + 0.2 * 2 = 0.85; w = 1 - 0.85
    np.testing.assert_allclose(h, [0.85])
    np.testing.assert_allclose(w, [0.15])


def test_adam_first_step_by_hand():
    # at t = 1 the corrected step is local_rate * g / (|g| + delta) = local_rate * sign(g)
    g, w = np.array([3.0, -0.5]), np.array([1.0, 1.0])
    m, v = np.zeros(2), np.zeros(2)
    SOLVERS["Adam"][0](g, np.array(0.01), np.array(0), w, m, v, w, m, v, lr_mult=1.0,
                       beta1=0.9, beta2=0.999, delta=0.0)
    np.testing.assert_allclose(w, [0.99, 1.01])
    np.testing.assert_allclose(m, [0.3, -0.05])
    np.testing.assert_allclose(v, [0.009, 0.00025])


# -- learning-rate policies --------------------------------------------------------------
LR_CASES = [
    # policy, params, [(it, expected written out by hand)]
    ("fixed", dict(base_lr=0.01), [(0, 0.01), (12345, 0.01)]),
    ("step", dict(base_lr=0.01, gamma=0.1, stepsize=100),
     [(0, 0.01), (99, 0.01), (100, 0.001), (250, 0.0001)]),
    ("exp", dict(base_lr=0.5, gamma=0.99), [(0, 0.5), (10, 0.5 * 0.99 ** 10)]),
    ("inv", dict(base_lr=0.01, gamma=1e-4, power=0.75),
     [(0, 0.01), (1000, 0.01 * 1.1 ** -0.75), (10000, 0.01 * 2 ** -0.75)]),
    ("multistep", dict(base_lr=1.0, gamma=0.5, stepvalues=(10, 20)),
     [(0, 1.0), (9, 1.0), (10, 0.5), (19, 0.5), (20, 0.25), (25, 0.25)]),
    ("poly", dict(base_lr=0.1, power=2.0, max_iter=1000),
     [(0, 0.1), (500, 0.025), (900, 0.1 * 0.01)]),
    ("sigmoid", dict(base_lr=1.0, gamma=0.05, stepsize=100),
     [(0, 1 / (1 + math.exp(5))), (100, 0.5), (140, 1 / (1 + math.exp(-2)))]),
]


@pytest.mark.parametrize("policy,params,cases", LR_CASES, ids=[c[0] for c in LR_CASES])
def test_lr_policy(policy, params, cases):
    full = dict(base_lr=0.0, gamma=0.0, power=0.0, stepsize=0, stepvalues=(), max_iter=0)
    full.update(params)
    for it, want in cases:
        assert rate(policy, it, **full) == pytest.approx(want, rel=1e-12)
        for dtype in (np.float64, np.float32):
            out = np.full((), np.nan, dtype)
            learning_rate(np.array(it), out, policy=policy, **full)
            assert out.dtype == dtype
            assert float(out) == pytest.approx(want, rel=1e-6)


def test_multistep_equals_caffe_incremental_step():
    """Caffe's current_step_ advances by one when iter_ reaches the next step value."""
    stepvalues = (3, 7, 8, 15)
    current_step = 0
    for it in range(20):
        if current_step < len(stepvalues) and it >= stepvalues[current_step]:
            current_step += 1
        assert rate("multistep", it, base_lr=2.0, gamma=0.1,
                    stepvalues=stepvalues) == pytest.approx(2.0 * 0.1 ** current_step)


def test_unknown_lr_policy():
    with pytest.raises(PurineError, match="'cosine'.*fixed.*multistep.*sigmoid"):
        rate("cosine", 0, base_lr=0.1)
    with pytest.raises(PurineError, match="unknown lr_policy ''"):
        learning_rate(np.array(0), np.zeros(()), policy="", base_lr=0.1, gamma=0.0,
                      power=0.0, stepsize=0, stepvalues=(), max_iter=0)


def test_lr_policy_checks_like_caffe():
    with pytest.raises(PurineError, match="stepsize > 0"):
        rate("step", 5, base_lr=0.1, gamma=0.1, stepsize=0)
    with pytest.raises(PurineError, match="gamma >= 0"):
        rate("exp", 5, base_lr=0.1, gamma=-1.0)


# -- clipping and gradient preparation -----------------------------------------------------
def test_gradient_scale_and_norm():
    a, b = np.array([[3.0, 0.0]]), np.array([4.0])  # global norm 5
    out = np.zeros(())
    gradient_scale(a, b, out, clip=10.0)
    assert float(out) == 1.0
    gradient_scale(a, b, out, clip=5.0)  # Caffe clips only when norm > clip
    assert float(out) == 1.0
    gradient_scale(a, b, out, clip=2.0)
    assert float(out) == pytest.approx(0.4)
    gradient_scale(a, b, out, clip=-1.0)
    assert float(out) == 1.0
    gradient_scale(np.zeros(3), out, clip=0.0)
    assert float(out) == 1.0
    gradient_scale(a, b, out, clip=0.0)
    assert float(out) == 0.0
    out32 = np.zeros((), np.float32)
    gradient_scale(a.astype(np.float32), b.astype(np.float32), out32, clip=1.0)
    assert float(out32) == pytest.approx(0.2)
    norm = np.zeros(())
    global_l2_norm(a, b, norm)
    assert float(norm) == pytest.approx(5.0)


@pytest.mark.parametrize("regularization", ["L2", "L1"])
def test_prepare_gradient_by_hand(regularization):
    w = np.array([2.0, -0.5, 0.0])
    g = np.array([1.0, 2.0, 3.0])
    out = np.zeros(3)
    prepare_gradient(w, g, np.array(0.5), out, iter_size=2, decay=0.1,
                     regularization=regularization)
    reg = w if regularization == "L2" else np.array([1.0, -1.0, 0.0])
    np.testing.assert_allclose(out, g * 0.5 / 2 + 0.1 * reg)
    np.testing.assert_array_equal(g, [1.0, 2.0, 3.0])
    prepare_gradient(w, g, np.array(1.0), g, iter_size=1, decay=0.0,
                     regularization=regularization)
    np.testing.assert_array_equal(g, [1.0, 2.0, 3.0])


def test_unknown_regularization():
    w, g = np.ones(2), np.ones(2)
    with pytest.raises(PurineError, match="'L3'.*L2.*L1"):
        prepare_gradient(w, g, np.array(1.0), g, iter_size=1, decay=0.1, regularization="L3")
    # Caffe only looks at the type when there is something to decay
    prepare_gradient(w, g, np.array(1.0), g, iter_size=1, decay=0.0, regularization="L3")


def test_solver_tables():
    assert {k: n for k, (_, n) in SOLVERS.items()} == {
        "SGD": 1, "Nesterov": 1, "AdaGrad": 1, "RMSProp": 1, "AdaDelta": 2, "Adam": 2}
    # the V0 enum (upgraded in purine.formats) names exactly the types of the real table,
    # each as its name upper-cased, and covers every value of caffe.proto's enum
    enum = pb.SolverParameter.SolverType
    assert {enum.Name(v): name for v, name in SOLVER_TYPE_NAMES.items()} == {
        "SGD": "SGD", "NESTEROV": "Nesterov", "ADAGRAD": "AdaGrad", "RMSPROP": "RMSProp",
        "ADADELTA": "AdaDelta", "ADAM": "Adam"}
    assert sorted(SOLVER_TYPE_NAMES) == sorted(enum.values())
    assert sorted(SOLVER_TYPE_NAMES.values()) == sorted(SOLVER_TYPES)
    for name, t in SOLVER_TYPES.items():
        assert t.name == name and SOLVERS[name] == (t.update, t.histories)
        ins, outs, _ = FUSED[t.fused]  # the fused GPU form exists and updates every history
        assert outs.count("T ") == 1 + t.histories
        assert ("float64 it" in ins) == t.reads_iter
        for keyword, fld in t.reads:  # every field the rule reads is a SolverParameter field
            assert f"float64 {keyword}" in ins
            assert fld in pb.SolverParameter.DESCRIPTOR.fields_by_name


def test_rule_keywords_come_from_the_solver_fields():
    p = pb.SolverParameter(momentum=0.5, momentum2=0.25, delta=0.125, rms_decay=0.75)
    assert SOLVER_TYPES["Adam"].keywords(p) == {"beta1": 0.5, "beta2": 0.25, "delta": 0.125}
    assert SOLVER_TYPES["RMSProp"].keywords(p) == {"rms_decay": 0.75, "delta": 0.125}
    assert SOLVER_TYPES["SGD"].keywords(p) == {"momentum": 0.5}


@pytest.mark.parametrize("kind", list(SOLVERS))
def test_blocked_updates_give_the_whole_arrays_bits(kind, monkeypatch):
    """A large parameter is updated in blocks (solver.blockwise): the same float32 bits as
    the whole-array update, in place and out of place, with a last block shorter than the
    others and arrays of several dimensions."""
    from purine.ops import solver

    s, w0, grad_seq = make_problem(kind, "L2", seed=2)
    whole = {place: run_kernels(kind, s, w0, grad_seq, 3, np.float32, place)
             for place in (True, False)}
    monkeypatch.setattr(solver, "BLOCK", 7)
    monkeypatch.setattr(solver, "BLOCKED_ABOVE", 8)
    assert max(w.size for w in w0) > 8 and any(w.size % 7 and w.ndim > 1 for w in w0)
    for place in (True, False):
        got_w, got_h = run_kernels(kind, s, w0, grad_seq, 3, np.float32, place)
        want_w, want_h = whole[place]
        for g, w in zip(got_w + sum(got_h, []), want_w + sum(want_h, []), strict=True):
            np.testing.assert_array_equal(g, w)
