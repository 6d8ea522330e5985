"""Solver kernels: Caffe's learning-rate policies, gradient clipping, Normalize + Regularize,
and one update kernel per SGD-family solver (ComputeUpdateValue followed by Net::Update).
The solver graph (which blobs feed which op, per parameter) is wired in purine/caffe/update.py.

Scalars (``lr``, ``it``, the clipping ``scale``) are 0-d arrays so they stay on the device.
Update kernels take the parameter and its histories both as inputs and as outputs; the
in-place call passes the same array twice. The gradient ``g`` is read only.

On a GPU the learning rate, prepare_gradient and each update are one fused elementwise kernel
(``FUSED``) that reads the 0-d scalars on the device: nothing waits for the host. They repeat
the numpy path's operations in its order with one rounding each, so they give the CPU's numbers
bit for bit, except where pow/exp enter (the lr policies, Adam's bias correction): CUDA's and
the host's libm may differ in the last place there.

On the host, a parameter of more than ``BLOCKED_ABOVE`` values is updated in blocks
(``blockwise``): each block's temporaries stay in cache instead of each operation streaming
whole arrays through memory. The operations and their order are the same, so are the bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from purine.backend import device_variant, get_array_module, is_device_array
from purine.errors import PurineError
from purine.ops.tensor import elementwise, scalar_arg

Array = Any

LR_POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")
REGULARIZATION_TYPES = ("L2", "L1")


# -- learning rate -------------------------------------------------------------------------
def rate(policy: str, it: int, *, base_lr: float, gamma: float = 0.0, power: float = 0.0,
         stepsize: int = 0, stepvalues: Sequence[int] = (), max_iter: int = 0) -> float:
    """Caffe's SGDSolver::GetLearningRate at iteration ``it`` (the iteration being computed,
    counted from 0), as a Python float."""
    it = int(it)
    if policy in ("step", "exp", "inv", "multistep", "sigmoid") and gamma < 0:
        raise PurineError(f"lr_policy '{policy}' needs gamma >= 0, got {gamma}")
    if policy in ("step", "sigmoid") and stepsize <= 0:
        raise PurineError(f"lr_policy '{policy}' needs stepsize > 0, got {stepsize}")
    if policy == "poly" and max_iter <= 0:
        raise PurineError(f"lr_policy 'poly' needs max_iter > 0, got {max_iter}")
    if policy not in LR_POLICIES:
        raise PurineError(
            f"unknown lr_policy '{policy}': expected one of {', '.join(LR_POLICIES)}")
    # float64 scalars and silenced flags give C's IEEE results where Python's float raises:
    # a power or exp past 1e308 is inf (sigmoid's 1 / (1 + inf) is then 0), 0 ** -p is inf,
    # a negative base with a fractional power is NaN (never a complex number)
    f = np.float64
    with np.errstate(all="ignore"):
        if policy == "fixed":
            r = f(base_lr)
        elif policy == "step":
            r = f(base_lr) * f(gamma) ** f(it // stepsize)
        elif policy == "exp":
            r = f(base_lr) * f(gamma) ** f(it)
        elif policy == "inv":
            r = f(base_lr) * (f(1.0) + f(gamma) * f(it)) ** f(-power)
        elif policy == "multistep":
            # Caffe advances current_step_ by at most one per iteration; from iteration 0
            # (or a solverstate that saved it) that is the number of step values reached.
            r = f(base_lr) * f(gamma) ** f(sum(1 for s in stepvalues if it >= s))
        elif policy == "poly":
            r = f(base_lr) * (f(1.0) - f(it) / f(max_iter)) ** f(power)
        else:  # sigmoid; the host libm's exp (numpy's may differ in the last place)
            r = f(base_lr) / (f(1.0) + _exp(float(-f(gamma) * f(it - stepsize))))
    return float(r)


def _exp(x: float) -> np.float64:
    """C's exp: inf past the largest double, where math.exp raises."""
    try:
        return np.float64(math.exp(x))
    except OverflowError:
        return np.float64(math.inf)


def _learning_rate_gpu(it: Array, lr_out: Array, *, policy: str, base_lr: float,
                       gamma: float, power: float, stepsize: int, stepvalues: tuple,
                       max_iter: int) -> None:
    rate(policy, 0, base_lr=base_lr, gamma=gamma, power=power, stepsize=stepsize,
         stepvalues=stepvalues, max_iter=max_iter)  # the host path's parameter errors
    code = _lr_code(policy, stepvalues)
    elementwise(f"lr_{policy}", _LR_PARAMS, "L lr", code)(
        scalar_arg(it), float(base_lr), float(gamma), float(power), int(stepsize),
        float(max_iter), lr_out)


@device_variant(_learning_rate_gpu)
def learning_rate(it: Array, lr_out: Array, *, policy: str, base_lr: float, gamma: float,
                  power: float, stepsize: int, stepvalues: tuple, max_iter: int) -> None:
    """lr_out = rate(policy, it, ...); ``it`` is a 0-d array holding the iteration."""
    lr_out[...] = rate(policy, int(it), base_lr=base_lr, gamma=gamma, power=power,
                       stepsize=stepsize, stepvalues=stepvalues, max_iter=max_iter)


_LR_PARAMS = ("float64 it, float64 base_lr, float64 gamma, float64 power, int64 stepsize, "
              "float64 max_iter")


def _lr_code(policy: str, stepvalues: Sequence[int]) -> str:
    """``rate`` in CUDA C over the 0-d ``it``, the same double arithmetic as the host's."""
    if policy == "multistep":
        reached = "".join(f"k += (it >= {int(s)}.0);\n" for s in stepvalues)
        r = f"double k = 0.0;\n{reached}double r = base_lr * pow(gamma, k);"
    else:
        r = "double r = " + {
            "fixed": "base_lr;",
            "step": "base_lr * pow(gamma, (double)((long long)it / stepsize));",
            "exp": "base_lr * pow(gamma, it);",
            "inv": "base_lr * pow(1.0 + gamma * it, -power);",
            # pow of a negative base and a fractional power is NaN, as the host path's
            "poly": "base_lr * pow(1.0 - it / max_iter, power);",
            "sigmoid": "base_lr / (1.0 + exp(-gamma * (it - (double)stepsize)));",
        }[policy]
    return r + "\nlr = (L)r;"


# -- clipping, Normalize, Regularize ---------------------------------------------------------
def _sum_of_squares(grads: Sequence[Array]) -> Array:
    """The sum over every gradient of <g, g>, a 0-d array of the gradients' dtype (vdot
    makes no squared temporary and leaves the result on the device)."""
    xp = get_array_module(*grads)
    total = xp.zeros((), dtype=grads[0].dtype)
    for g in grads:
        total += xp.vdot(g.ravel(), g.ravel())
    return total


def global_l2_norm(*grads_and_out: Array) -> None:
    """norm_out = sqrt(sum over all gradients of ||g||^2); the last argument is the output."""
    *grads, norm_out = grads_and_out
    xp = get_array_module(norm_out, *grads)
    norm_out[...] = xp.sqrt(_sum_of_squares(grads))


def sum_of_squares(*grads_and_out: Array) -> None:
    """out = the sum over all gradients of ||g||^2 (0-d); the last argument is the output.
    Where the parameters live in several memory spaces, each space sums its own."""
    *grads, out = grads_and_out
    out[...] = _sum_of_squares(grads)


def gradient_scale(*grads_and_out: Array, clip: float, partials: int = 0) -> None:
    """Caffe's ClipGradients as a factor: the last argument (0-d) gets clip / norm when the
    global L2 norm of the given gradients exceeds ``clip``, else 1; ``clip < 0`` disables it.
    Caffe clips the gradients summed over iter_size, before Normalize divides them. The
    last ``partials`` inputs are sums of squares made elsewhere (sum_of_squares)."""
    *grads, scale_out = grads_and_out
    if clip < 0:
        scale_out[...] = 1
        return
    xp = get_array_module(scale_out, *grads)
    own = grads[:len(grads) - partials]
    total = _sum_of_squares(own) if own else xp.zeros((), dtype=grads[0].dtype)
    for s in grads[len(grads) - partials:]:
        total = total + s
    norm = xp.sqrt(total)
    if clip == 0:  # every nonzero gradient is scaled to 0; an all-zero one is left alone
        scale_out[...] = norm == 0
        return
    # clip / max(norm, clip) is exactly 1 when norm <= clip and stays on the device
    clip_t = norm.dtype.type(clip)
    scale_out[...] = clip_t / xp.maximum(norm, clip_t)


# Parameters of more than BLOCKED_ABOVE values are updated BLOCK values at a time. On 2 cores,
# AlexNet's fc6 (37.7M values) took 86-93 ms for prepare_gradient and the SGD update over
# whole arrays and 43 ms in blocks of 2^17; LeNet's ip1 (400K values, in cache anyway) took
# 250 us whole and 300-370 us in blocks, so smaller parameters stay whole.
BLOCK = 1 << 17
BLOCKED_ABOVE = 1 << 20


def blockwise(body: Callable[..., None]) -> Callable[..., None]:
    """Run an elementwise host body over blocks of its array arguments: every argument of the
    first one's size is cut into the same BLOCK-value slices of its flat view, the others
    (0-d scalars) pass whole. The in-place calls stay in place (the slices of one array at
    one offset), and each block sees the whole body's operations in order."""

    @functools.wraps(body)
    def run(*arrays: Array, **kwargs: Any) -> None:
        n = arrays[0].size
        if n <= BLOCKED_ABOVE or not all(a.flags.c_contiguous for a in arrays if a.size == n):
            body(*arrays, **kwargs)
            return
        flat = [a.reshape(-1) if a.size == n else None for a in arrays]
        for start in range(0, n, BLOCK):
            part = slice(start, start + BLOCK)
            body(*(a if f is None else f[part] for a, f in zip(arrays, flat)), **kwargs)

    return run


def _check_regularization(decay: float, regularization: str) -> None:
    """Caffe skips the regularizer when ``decay`` is 0, and then never checks its type."""
    if decay and regularization not in REGULARIZATION_TYPES:
        raise PurineError(f"unknown regularization_type '{regularization}': expected one of "
                          f"{', '.join(REGULARIZATION_TYPES)}")


def _prepare_gradient_gpu(w: Array, g: Array, scale: Array, g_out: Array, *, iter_size: int,
                          decay: float, regularization: str) -> None:
    _check_regularization(decay, regularization)
    dt = g_out.dtype.type
    _prime(g, g_out)
    reg = 0 if not decay else REGULARIZATION_TYPES.index(regularization) + 1
    inv = float(dt(1) / dt(iter_size)) if iter_size > 1 else 1.0
    _fused("prepare_gradient")(w, scalar_arg(scale), inv, float(decay), reg, g_out)


@device_variant(_prepare_gradient_gpu)
@blockwise
def prepare_gradient(w: Array, g: Array, scale: Array, g_out: Array, *, iter_size: int,
                     decay: float, regularization: str) -> None:
    """g_out = g * scale / iter_size + decay * R(w), R(w) = w (L2) or sign(w) (L1), in Caffe's
    order: clipping scale, Normalize, Regularize. ``decay`` is weight_decay * decay_mult;
    Caffe skips the regularizer when it is 0 (and then never checks its type)."""
    _check_regularization(decay, regularization)
    dt = g_out.dtype.type
    np.multiply(g, scale.astype(g_out.dtype, copy=False), out=g_out)
    if iter_size > 1:
        g_out *= dt(1) / dt(iter_size)
    if not decay:
        return
    if regularization == "L2":
        g_out += np.multiply(w, dt(decay))
    else:
        r = np.sign(w)
        r *= dt(decay)
        g_out += r


# -- updates: ComputeUpdateValue then w -= update ------------------------------------------
def _local_rate(lr: Array, lr_mult: float, dtype: Any) -> Array:
    """lr * lr_mult as a 0-d array of the parameter dtype (a float64 0-d lr would otherwise
    promote whole float32 operations under NumPy 2's casting rules)."""
    return lr.astype(dtype, copy=False) * dtype.type(lr_mult)


def _sgd_update_gpu(g: Array, lr: Array, w: Array, h: Array, w_out: Array, h_out: Array, *,
                    lr_mult: float, momentum: float) -> None:
    _update("sgd", g, lr, (w, h), (w_out, h_out), lr_mult, momentum)


@device_variant(_sgd_update_gpu)
@blockwise
def sgd_update(g: Array, lr: Array, w: Array, h: Array, w_out: Array, h_out: Array, *,
               lr_mult: float, momentum: float) -> None:
    """h = momentum * h + local_rate * g; w -= h."""
    t = np.multiply(g, _local_rate(lr, lr_mult, w.dtype))
    np.multiply(h, w.dtype.type(momentum), out=h_out)
    h_out += t
    np.subtract(w, h_out, out=w_out)


def _nesterov_update_gpu(g: Array, lr: Array, w: Array, h: Array, w_out: Array, h_out: Array, *,
                         lr_mult: float, momentum: float) -> None:
    _update("nesterov", g, lr, (w, h), (w_out, h_out), lr_mult, momentum)


@device_variant(_nesterov_update_gpu)
@blockwise
def nesterov_update(g: Array, lr: Array, w: Array, h: Array, w_out: Array, h_out: Array, *,
                    lr_mult: float, momentum: float) -> None:
    """h' = momentum * h + local_rate * g; w -= (1 + momentum) * h' - momentum * h."""
    m = w.dtype.type(momentum)
    back = np.multiply(h, -m)  # read before h_out (possibly h itself) is written
    t = np.multiply(g, _local_rate(lr, lr_mult, w.dtype))
    np.multiply(h, m, out=h_out)
    h_out += t
    np.multiply(h_out, w.dtype.type(1) + m, out=t)
    t += back
    np.subtract(w, t, out=w_out)


def _adagrad_update_gpu(g: Array, lr: Array, w: Array, h: Array, w_out: Array, h_out: Array, *,
                        lr_mult: float, delta: float) -> None:
    _update("adagrad", g, lr, (w, h), (w_out, h_out), lr_mult, delta)


@device_variant(_adagrad_update_gpu)
@blockwise
def adagrad_update(g: Array, lr: Array, w: Array, h: Array, w_out: Array, h_out: Array, *,
                   lr_mult: float, delta: float) -> None:
    """h += g^2; w -= local_rate * g / (sqrt(h) + delta)."""
    t = np.multiply(g, g)
    np.add(h, t, out=h_out)
    np.sqrt(h_out, out=t)
    t += w.dtype.type(delta)
    np.divide(g, t, out=t)
    t *= _local_rate(lr, lr_mult, w.dtype)
    np.subtract(w, t, out=w_out)


def _rmsprop_update_gpu(g: Array, lr: Array, w: Array, h: Array, w_out: Array, h_out: Array, *,
                        lr_mult: float, rms_decay: float, delta: float) -> None:
    _update("rmsprop", g, lr, (w, h), (w_out, h_out), lr_mult, rms_decay, delta)


@device_variant(_rmsprop_update_gpu)
@blockwise
def rmsprop_update(g: Array, lr: Array, w: Array, h: Array, w_out: Array, h_out: Array, *,
                   lr_mult: float, rms_decay: float, delta: float) -> None:
    """h = rms_decay * h + (1 - rms_decay) * g^2; w -= local_rate * g / (sqrt(h) + delta)."""
    d = w.dtype.type(rms_decay)
    t = np.multiply(g, g)
    t *= w.dtype.type(1) - d
    np.multiply(h, d, out=h_out)
    h_out += t
    np.sqrt(h_out, out=t)
    t += w.dtype.type(delta)
    np.divide(g, t, out=t)
    t *= _local_rate(lr, lr_mult, w.dtype)
    np.subtract(w, t, out=w_out)


def _adadelta_update_gpu(g: Array, lr: Array, w: Array, h: Array, h2: Array, w_out: Array,
                         h_out: Array, h2_out: Array, *, lr_mult: float, momentum: float,
                         delta: float) -> None:
    _update("adadelta", g, lr, (w, h, h2), (w_out, h_out, h2_out), lr_mult, momentum,
            delta)


@device_variant(_adadelta_update_gpu)
@blockwise
def adadelta_update(g: Array, lr: Array, w: Array, h: Array, h2: Array, w_out: Array,
                    h_out: Array, h2_out: Array, *, lr_mult: float, momentum: float,
                    delta: float) -> None:
    """``h`` averages squared gradients, ``h2`` squared updates (Caffe's second history):
    h = m h + (1-m) g^2;  u = g sqrt((h2 + delta) / (h + delta));
    h2 = m h2 + (1-m) u^2;  w -= local_rate * u."""
    dt = w.dtype.type
    m, one_m, eps = dt(momentum), dt(1) - dt(momentum), dt(delta)
    u = np.multiply(g, g)
    u *= one_m
    np.multiply(h, m, out=h_out)
    h_out += u
    np.add(h2, eps, out=u)
    t = np.add(h_out, eps)
    u /= t
    np.sqrt(u, out=u)
    u *= g
    np.multiply(u, u, out=t)
    t *= one_m
    np.multiply(h2, m, out=h2_out)
    h2_out += t
    u *= _local_rate(lr, lr_mult, w.dtype)
    np.subtract(w, u, out=w_out)


def _adam_update_gpu(g: Array, lr: Array, it: Array, w: Array, m: Array, v: Array, w_out: Array,
                     m_out: Array, v_out: Array, *, lr_mult: float, beta1: float, beta2: float,
                     delta: float) -> None:
    _update("adam", g, lr, (w, m, v), (w_out, m_out, v_out), scalar_arg(it), lr_mult,
            beta1, beta2, delta)


@device_variant(_adam_update_gpu)
@blockwise
def adam_update(g: Array, lr: Array, it: Array, w: Array, m: Array, v: Array, w_out: Array,
                m_out: Array, v_out: Array, *, lr_mult: float, beta1: float, beta2: float,
                delta: float) -> None:
    """m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
    w -= local_rate * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + delta),  t = it + 1.
    Caffe adds ``delta`` to the uncorrected sqrt(v) and folds the correction into the rate."""
    dt = w.dtype.type
    b1, b2 = dt(beta1), dt(beta2)
    # Caffe evaluates the correction in double from the Dtype betas (std::pow(float, int)).
    t = it.astype(np.float64) + 1
    correction = np.sqrt(1 - np.power(np.float64(b2), t)) / (1 - np.power(np.float64(b1), t))
    step = (_local_rate(lr, lr_mult, w.dtype) * correction).astype(w.dtype)
    tmp = np.multiply(g, dt(1) - b1)
    np.multiply(m, b1, out=m_out)
    m_out += tmp
    np.multiply(g, g, out=tmp)
    tmp *= dt(1) - b2
    np.multiply(v, b2, out=v_out)
    v_out += tmp
    np.sqrt(v_out, out=tmp)
    tmp += dt(delta)
    np.divide(m_out, tmp, out=tmp)
    tmp *= step
    np.subtract(w, tmp, out=w_out)


# -- the fused GPU kernels --------------------------------------------------------------------
# (inputs, outputs, body) of each cupy.ElementwiseKernel. Outputs are read before they are
# written (the parameter and its histories are updated in place); every line is one operation
# of the numpy path above, in the same order and the same dtype T. ``rate`` is the local rate
# lr * lr_mult rounded to T, as _local_rate does.
_RATE = "T rate = (T)lr * (T)lr_mult;\n"
FUSED: dict[str, tuple[str, str, str]] = {
    "prepare_gradient": (
        "T w, float64 scale, float64 inv_iter, float64 decay, int32 reg", "T g", """
T v = g * (T)scale;
if (inv_iter != 1.0) v = v * (T)inv_iter;
if (reg == 1) {
  v = v + w * (T)decay;
} else if (reg == 2) {
  T s = w > (T)0 ? (T)1 : (w < (T)0 ? (T)-1 : (w == (T)0 ? (T)0 : w));
  v = v + s * (T)decay;
}
g = v;
"""),
    "sgd": ("T g, float64 lr, float64 lr_mult, float64 momentum", "T w, T h", _RATE + """
T t = g * rate;
h = h * (T)momentum + t;
w = w - h;
"""),
    "nesterov": ("T g, float64 lr, float64 lr_mult, float64 momentum", "T w, T h", _RATE + """
T m = (T)momentum;
T back = h * (-m);
T t = g * rate;
T hn = h * m + t;
h = hn;
t = hn * ((T)1 + m) + back;
w = w - t;
"""),
    "adagrad": ("T g, float64 lr, float64 lr_mult, float64 delta", "T w, T h", _RATE + """
T t = g * g;
T hn = h + t;
h = hn;
t = sqrt(hn) + (T)delta;
t = g / t;
t = t * rate;
w = w - t;
"""),
    "rmsprop": ("T g, float64 lr, float64 lr_mult, float64 rms_decay, float64 delta",
                "T w, T h", _RATE + """
T d = (T)rms_decay;
T t = g * g;
t = t * ((T)1 - d);
T hn = h * d + t;
h = hn;
t = sqrt(hn) + (T)delta;
t = g / t;
t = t * rate;
w = w - t;
"""),
    "adadelta": ("T g, float64 lr, float64 lr_mult, float64 momentum, float64 delta",
                 "T w, T h, T h2", _RATE + """
T m = (T)momentum;
T one_m = (T)1 - m;
T eps = (T)delta;
T u = g * g;
u = u * one_m;
T hn = h * m + u;
h = hn;
u = h2 + eps;
T t = hn + eps;
u = u / t;
u = sqrt(u);
u = u * g;
t = u * u;
t = t * one_m;
h2 = h2 * m + t;
u = u * rate;
w = w - u;
"""),
    # Caffe evaluates the bias correction in double from the T betas, as the numpy path does.
    "adam": ("T g, float64 lr, float64 it, float64 lr_mult, float64 beta1, float64 beta2, "
             "float64 delta", "T w, T h, T h2", _RATE + """
T b1 = (T)beta1;
T b2 = (T)beta2;
double tt = it + 1.0;
double corr = sqrt(1.0 - pow((double)b2, tt)) / (1.0 - pow((double)b1, tt));
T step = (T)((double)rate * corr);
T t = g * ((T)1 - b1);
T mn = h * b1 + t;
h = mn;
t = g * g;
t = t * ((T)1 - b2);
T vn = h2 * b2 + t;
h2 = vn;
t = sqrt(vn) + (T)delta;
t = mn / t;
t = t * step;
w = w - t;
"""),
}


def _fused(name: str) -> Any:
    return elementwise(name, *FUSED[name])


def _prime(src: Array, dst: Array) -> None:
    """The fused kernels update their outputs in place: an output that is not its input
    first gets the input's values."""
    if dst is not src:
        dst[...] = src


def _update(name: str, g: Array, lr: Array, state: tuple, state_out: tuple,
            *scalars: Any) -> None:
    """One fused update on the GPU: ``state`` (w and its histories) into ``state_out``.
    Adam's ``it`` comes first among ``scalars``, already a kernel argument."""
    for a, b in zip(state, state_out, strict=True):
        _prime(a, b)
    args = [s if is_device_array(s) else float(s) for s in scalars]
    _fused(name)(g, scalar_arg(lr), *args, *state_out)


@dataclass(frozen=True)
class SolverType:
    """One SGD-family solver, declared once: the solver graph, the settings checks, pycaffe's
    ``<name>Solver`` class and the tests read this. ``update`` takes (g, lr, [it,] w,
    *histories, w_out, *histories_out, lr_mult=..., **keywords); its GPU body runs the fused
    kernel ``FUSED[fused]``. ``reads`` maps each keyword to the SolverParameter field it
    takes; a rule that does not read ``momentum`` refuses one (Caffe's AdaGrad and RMSProp)."""

    name: str                      # Caffe's ``type`` string
    update: Callable[..., None]
    fused: str
    histories: int                 # history blobs per parameter, in a solverstate's order
    reads: tuple[tuple[str, str], ...]
    reads_iter: bool = False       # the update also reads the iteration (Adam's correction)

    def keywords(self, param: Any) -> dict[str, float]:
        """The rule's keywords from a SolverParameter (any object with its fields)."""
        return {k: getattr(param, f) for k, f in self.reads}


# The V0 ``solver_type`` enum is a closed fact of Caffe's file format (a new solver gets no
# enum value), so its names stay with the upgrade in purine/formats/upgrade.py, which sits
# below this package and cannot read this table; a test keeps the two in agreement.
SOLVER_TYPES: dict[str, SolverType] = {t.name: t for t in (
    SolverType("SGD", sgd_update, "sgd", 1, (("momentum", "momentum"),)),
    SolverType("Nesterov", nesterov_update, "nesterov", 1, (("momentum", "momentum"),)),
    SolverType("AdaGrad", adagrad_update, "adagrad", 1, (("delta", "delta"),)),
    SolverType("RMSProp", rmsprop_update, "rmsprop", 1,
               (("rms_decay", "rms_decay"), ("delta", "delta"))),
    SolverType("AdaDelta", adadelta_update, "adadelta", 2,
               (("momentum", "momentum"), ("delta", "delta"))),
    SolverType("Adam", adam_update, "adam", 2,
               (("beta1", "momentum"), ("beta2", "momentum2"), ("delta", "delta")),
               reads_iter=True),
)}
"""Caffe's solver type string -> its SolverType."""

SOLVERS: dict[str, tuple[Callable[..., None], int]] = {
    k: (t.update, t.histories) for k, t in SOLVER_TYPES.items()}
"""A view of SOLVER_TYPES: type string -> (update kernel, history blobs per parameter)."""
