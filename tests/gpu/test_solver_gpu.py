"""The solver kernels on a GPU: the fused updates, prepare_gradient, the learning rate and the
clipping scale against the numpy path. Without a GPU the fused kernels' CUDA C still runs here:
it compiles for sm_90 with nvcc, and a serial C++ build of each body (``emulate``) must give the
numpy path's numbers bit for bit."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from purine.ops import solver as so
from tests.gpu.common import requires_gpu

# -- running a fused kernel's body on the CPU ------------------------------------------------
C_TYPES = {"float64": "double", "float32": "float", "int32": "int", "int64": "long long",
           "uint8": "unsigned char", "bool": "bool"}
CT_TYPES = {"double": ctypes.c_double, "float": ctypes.c_float, "int": ctypes.c_int,
            "long long": ctypes.c_longlong, "unsigned char": ctypes.c_ubyte,
            "bool": ctypes.c_bool}
HEADER = """#include <cmath>
using std::sqrt; using std::pow; using std::exp; using std::log; using std::log1p;
using std::trunc; using std::fabs; using std::tanh; using std::expm1;
"""
_CACHE = os.path.join(tempfile.gettempdir(), f"purine-emulate-{os.getuid()}")


def _params(spec: str) -> list[tuple[str, str]]:
    return [tuple(p.split()) for p in spec.split(",")]  # type: ignore[misc]


def _kernel_source(in_params: str, out_params: str, operation: str, args: list,
                   gpu: bool) -> tuple[str, list[str]]:
    """The body in a loop over the elements (or one CUDA thread per element); arrays of one
    element broadcast. Placeholder types (T, L) take their arrays' dtypes."""
    ins, outs = _params(in_params), _params(out_params)
    assert len(ins) + len(outs) == len(args), (in_params, out_params, len(args))
    typedefs: dict[str, str] = {}
    sig, local, kinds = [], [], []
    for k, ((ty, name), a) in enumerate(zip(ins + outs, args, strict=True)):
        out = k >= len(ins)
        if isinstance(a, np.ndarray):
            if ty not in C_TYPES:
                typedefs.setdefault(ty, C_TYPES[a.dtype.name])
            cty = C_TYPES.get(ty, ty)
            step = 0 if a.size == 1 else 1
            sig.append(f"{'' if out else 'const '}{cty}* {name}_p")
            ref = "&" if out else ""
            local.append(f"{'' if out else 'const '}{cty}{ref} {name} = {name}_p[i * {step}];")
            kinds.append("ptr")
        else:
            cty = C_TYPES[ty] if ty in C_TYPES else typedefs[ty]
            sig.append(f"{cty} {name}")
            kinds.append(cty)
    tdef = "".join(f"typedef {c} {t};\n" for t, c in typedefs.items())
    lines = "\n    ".join(local)
    if gpu:
        head = (f'extern "C" __global__ void kern(long long n, {", ".join(sig)}) {{\n'
                "  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
                "  if (i < n) {\n")
    else:
        head = (f'extern "C" void kern(long long n, {", ".join(sig)}) {{\n'
                "  for (long long i = 0; i < n; ++i) {\n")
    src = f"{'' if gpu else HEADER}{tdef}{head}    {lines}\n{operation}\n  }}\n}}\n"
    return src, kinds


def emulate(spec: tuple[str, str, str], *args) -> None:
    """Run a fused kernel ``(inputs, outputs, body)`` serially on the CPU over numpy arrays
    (outputs are updated in place) and Python scalars, compiled by g++ without contraction
    of a * b + c, as the GPU build is."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: cannot emulate the fused kernels")
    src, kinds = _kernel_source(*spec, list(args), gpu=False)
    os.makedirs(_CACHE, exist_ok=True)
    lib_path = os.path.join(_CACHE, hashlib.sha256(src.encode()).hexdigest()[:20] + ".so")
    if not os.path.exists(lib_path):
        with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
            f.write(src)
        tmp = lib_path + f".{os.getpid()}"
        subprocess.run(["g++", "-O1", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC",
                        "-o", tmp, f.name], check=True, capture_output=True, text=True)
        os.replace(tmp, lib_path)
        os.unlink(f.name)
    n = max(a.size for a in args if isinstance(a, np.ndarray))
    cargs = [ctypes.c_longlong(n)]
    for a, kind in zip(args, kinds, strict=True):
        if kind == "ptr":
            assert a.flags.c_contiguous
            cargs.append(ctypes.c_void_p(a.ctypes.data))
        else:
            cargs.append(CT_TYPES[kind](a))
    ctypes.CDLL(lib_path).kern(*cargs)


def nvcc_compiles(kernels: dict[str, tuple[tuple[str, str, str], list]], tmp_path) -> None:
    """Each kernel (spec, example arguments) compiles to PTX for sm_90 with --fmad=false."""
    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists(
        "/usr/local/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    for name, (spec, args) in kernels.items():
        src, _ = _kernel_source(*spec, args, gpu=True)
        cu = tmp_path / f"{name}.cu"
        cu.write_text(src)
        r = subprocess.run([nvcc, "-ptx", "-arch=sm_90", "--fmad=false", "-o",
                            str(tmp_path / f"{name}.ptx"), str(cu)],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{name}:\n{src}\n{r.stderr}"


# -- the cases ------------------------------------------------------------------------------
RULES = [
    ("SGD", "sgd", dict(momentum=0.9)),
    ("SGD", "sgd", dict(momentum=0.0)),
    ("Nesterov", "nesterov", dict(momentum=0.95)),
    ("AdaGrad", "adagrad", dict(delta=1e-8)),
    ("RMSProp", "rmsprop", dict(rms_decay=0.98, delta=1e-8)),
    ("AdaDelta", "adadelta", dict(momentum=0.95, delta=1e-6)),
    ("Adam", "adam", dict(beta1=0.9, beta2=0.999, delta=1e-8)),
]
RULE_IDS = [f"{t}-{'-'.join(f'{k}{v}' for k, v in p.items())}" for t, _, p in RULES]
PREPARE = [dict(iter_size=1, decay=0.0, regularization="L2", scale=1.0),
           dict(iter_size=3, decay=5e-4, regularization="L2", scale=1.0),
           dict(iter_size=1, decay=1e-3, regularization="L1", scale=0.37),
           dict(iter_size=2, decay=2e-4, regularization="L1", scale=1.0),
           dict(iter_size=1, decay=0.0, regularization="bogus-but-unused", scale=0.5)]
LR_POLICIES = [
    dict(policy="fixed", base_lr=0.01),
    dict(policy="step", base_lr=0.01, gamma=0.1, stepsize=7),
    dict(policy="exp", base_lr=0.01, gamma=0.97),
    dict(policy="inv", base_lr=0.01, gamma=1e-4, power=0.75),
    dict(policy="multistep", base_lr=0.1, gamma=0.5, stepvalues=(3, 10, 11)),
    dict(policy="poly", base_lr=0.02, power=0.5, max_iter=20),
    dict(policy="poly", base_lr=0.02, power=2.0, max_iter=10),
    dict(policy="sigmoid", base_lr=0.01, gamma=0.3, stepsize=9),
]
ITERS = [0, 1, 2, 6, 7, 10, 11, 12, 19, 20, 25, 1000]
DTYPES = ["float64", "float32"]


def _lr_kwargs(p: dict) -> dict:
    full = dict(gamma=0.0, power=0.0, stepsize=0, stepvalues=(), max_iter=0)
    full.update(p)
    return full


def _start(dtype: str, shape=(5, 7), seed: int = 0):
    """A parameter (with exact zeros, for L1's sign) and positive histories."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(dtype)
    w.reshape(-1)[::9] = 0
    hist = [np.abs(rng.standard_normal(shape)).astype(dtype) * 0.1 for _ in range(2)]
    return w, hist


def _grads(dtype: str, steps: int, shape=(5, 7), seed: int = 1):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(steps)]


def _numpy_steps(solver: str, params: dict, lr_mult: float, dtype: str, steps: int = 5):
    fn, n_hist = so.SOLVERS[solver]
    w, hist = _start(dtype)
    hist = hist[:n_hist]
    for k, g in enumerate(_grads(dtype, steps)):
        lr = np.array(0.05 / (k + 1))
        it = np.array(float(k))
        extra = [it] if solver == "Adam" else []
        fn(g, lr, *extra, w, *hist, w, *hist, lr_mult=lr_mult, **params)
    return [w, *hist]


# -- without a GPU: compile and emulate ------------------------------------------------------
def test_fused_kernels_compile_for_sm90(tmp_path):
    kernels = {}
    for dtype in DTYPES:
        a = np.zeros(4, dtype)
        lr = np.zeros((), "float64")
        for name, (ins, outs, body) in so.FUSED.items():
            args = [a if t == "T" else lr if nm in ("lr", "it", "scale")
                    else 1 if t.startswith("int") else 1.0 for t, nm in _params(ins)]
            kernels[f"{name}_{dtype}"] = ((ins, outs, body), args + [a] * len(_params(outs)))
    for p in LR_POLICIES:
        kw = _lr_kwargs(p)
        code = so._lr_code(kw["policy"], kw["stepvalues"])
        spec = (so._LR_PARAMS, "L lr", code)
        kernels[f"lr_{kw['policy']}"] = (spec, [np.zeros((), "float64"), 0.1, 0.1, 0.1, 3, 5.0,
                                                np.zeros((), "float64")])
    nvcc_compiles(kernels, tmp_path)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lr_mult", [1.0, 2.5])
@pytest.mark.parametrize(("solver", "name", "params"), RULES, ids=RULE_IDS)
def test_fused_update_bit_for_bit_emulated(solver, name, params, lr_mult, dtype):
    """The fused body, run serially, repeats the numpy path exactly over several steps."""
    expected = _numpy_steps(solver, params, lr_mult, dtype)
    n_hist = so.SOLVERS[solver][1]
    w, hist = _start(dtype)
    state = [w, *hist[:n_hist]]
    for k, g in enumerate(_grads(dtype, 5)):
        scalars = ([float(k)] if solver == "Adam" else []) + [lr_mult, *params.values()]
        emulate(so.FUSED[name], g, 0.05 / (k + 1), *scalars, *state)
    for got, want in zip(state, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(state[0], _start(dtype)[0])  # the parameter did move


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREPARE, ids=lambda c: "-".join(map(str, c.values())))
def test_prepare_gradient_bit_for_bit_emulated(case, dtype):
    w, _ = _start(dtype)
    g = _grads(dtype, 1)[0]
    want = g.copy()
    kw = {k: case[k] for k in ("iter_size", "decay", "regularization")}
    so.prepare_gradient(w, want, np.array(case["scale"]), want, **kw)
    got = g.copy()
    dt = np.dtype(dtype).type
    reg = 0 if not case["decay"] else so.REGULARIZATION_TYPES.index(case["regularization"]) + 1
    inv = float(dt(1) / dt(case["iter_size"])) if case["iter_size"] > 1 else 1.0
    emulate(so.FUSED["prepare_gradient"], w, case["scale"], inv, case["decay"], reg, got)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("p", LR_POLICIES, ids=lambda p: p["policy"])
def test_learning_rate_code_emulated(p):
    kw = _lr_kwargs(p)
    code = so._lr_code(kw["policy"], kw["stepvalues"])
    for it in ITERS:
        out = np.zeros((), "float64")
        emulate((so._LR_PARAMS, "L lr", code), np.array(float(it)), kw["base_lr"], kw["gamma"],
                kw["power"], kw["stepsize"], float(kw["max_iter"]), out)
        want = so.rate(it=it, **kw)
        np.testing.assert_array_equal(out, want, err_msg=f"{p} at iteration {it}")


# -- on a GPU: the real kernels ----------------------------------------------------------------
def _tol(dtype: str) -> dict:
    """float64: the fused kernels repeat the numpy operations (only pow may differ in the last
    place); float32: a few float32 roundings."""
    return dict(rtol=1e-12, atol=1e-15) if dtype == "float64" else dict(rtol=2e-6, atol=1e-7)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lr_mult", [1.0, 2.5])
@pytest.mark.parametrize(("solver", "name", "params"), RULES, ids=RULE_IDS)
def test_fused_update_on_gpu(solver, name, params, lr_mult, dtype):
    import cupy

    expected = _numpy_steps(solver, params, lr_mult, dtype)
    fn, n_hist = so.SOLVERS[solver]
    w, hist = _start(dtype)
    state = [cupy.asarray(a) for a in [w, *hist[:n_hist]]]
    for k, g in enumerate(_grads(dtype, 5)):
        lr = cupy.asarray(np.array(0.05 / (k + 1)))
        extra = [cupy.asarray(np.array(float(k)))] if solver == "Adam" else []
        fn(cupy.asarray(g), lr, *extra, *state, *state, lr_mult=lr_mult, **params)
    for got, want in zip(state, expected, strict=True):
        np.testing.assert_allclose(got.get(), want, **_tol(dtype))


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_update_out_of_place_on_gpu(dtype):
    """Outputs that are not the inputs: the inputs stay as they were."""
    import cupy

    w, hist = _start(dtype)
    g = _grads(dtype, 1)[0]
    want_w, want_h = w.copy(), hist[0].copy()
    so.sgd_update(g, np.array(0.1), want_w, want_h, want_w, want_h, lr_mult=1.0, momentum=0.9)
    dw, dh = cupy.asarray(w), cupy.asarray(hist[0])
    ow, oh = cupy.zeros_like(dw), cupy.zeros_like(dh)
    so.sgd_update(cupy.asarray(g), cupy.asarray(np.array(0.1)), dw, dh, ow, oh, lr_mult=1.0,
                  momentum=0.9)
    np.testing.assert_allclose(ow.get(), want_w, **_tol(dtype))
    np.testing.assert_allclose(oh.get(), want_h, **_tol(dtype))
    np.testing.assert_array_equal(dw.get(), w)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREPARE, ids=lambda c: "-".join(map(str, c.values())))
def test_prepare_gradient_on_gpu(case, dtype):
    import cupy

    w, _ = _start(dtype)
    g = _grads(dtype, 1)[0]
    kw = {k: case[k] for k in ("iter_size", "decay", "regularization")}
    want = g.copy()
    so.prepare_gradient(w, want, np.array(case["scale"]), want, **kw)
    got = cupy.asarray(g)
    so.prepare_gradient(cupy.asarray(w), got, cupy.asarray(np.array(case["scale"])), got, **kw)
    np.testing.assert_allclose(got.get(), want, **_tol(dtype))


@requires_gpu
@pytest.mark.parametrize("p", LR_POLICIES, ids=lambda p: p["policy"])
def test_learning_rate_on_gpu(p):
    import cupy

    kw = _lr_kwargs(p)
    for it in ITERS:
        out = cupy.zeros((), "float64")
        so.learning_rate(cupy.asarray(np.array(float(it))), out, **kw)
        np.testing.assert_allclose(out.get(), so.rate(it=it, **kw), rtol=1e-14,
                                   err_msg=f"{p} at iteration {it}")


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip", [-1.0, 0.0, 0.5, 1e6])
def test_gradient_scale_and_norm_on_gpu(clip, dtype):
    import cupy

    grads = [g * 0.1 for g in _grads(dtype, 3)]
    want, want_norm = np.zeros((), dtype), np.zeros((), dtype)
    so.gradient_scale(*grads, want, clip=clip)
    so.global_l2_norm(*grads, want_norm)
    dev = [cupy.asarray(g) for g in grads]
    got, got_norm = cupy.zeros((), dtype), cupy.zeros((), dtype)
    so.gradient_scale(*dev, got, clip=clip)
    so.global_l2_norm(*dev, got_norm)
    np.testing.assert_allclose(got.get(), want, **_tol(dtype))
    np.testing.assert_allclose(got_norm.get(), want_norm, **_tol(dtype))
