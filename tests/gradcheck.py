"""The shared gradient check: build a one-layer net in float64, take the objective
sum_i <top_i, R_i> (R_i random, or the loss weight for loss tops), and compare the
backward pass's bottom and parameter gradients with central differences."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from purine.caffe import TRAIN, Net


def layer_spec(name: str, type_: str, bottoms: Sequence[str], tops: Sequence[str],
               params: str = "") -> str:
    """The body of a layer { } with these bottoms, tops and parameter text."""
    b = " ".join(f'bottom: "{x}"' for x in bottoms)
    t = " ".join(f'top: "{x}"' for x in tops)
    return f'name: "{name}" type: "{type_}" {b} {t} {params}'


def gaussian(*shape: int, seed: int = 0) -> np.ndarray:
    """Standard normal float64 values of ``shape``, the same for the same seed."""
    return np.random.default_rng(seed).standard_normal(shape)


def layer_net(layer: str, bottoms: dict[str, Sequence[int]], force_backward: bool = True) -> str:
    """A prototxt with one Input layer per bottom followed by ``layer``."""
    inputs = "\n".join(
        f'layer {{ name: "in_{n}" type: "Input" top: "{n}" '
        f'input_param {{ shape {{ {" ".join(f"dim: {d}" for d in s)} }} }} }}'
        for n, s in bottoms.items())
    fb = "force_backward: true\n" if force_backward else ""
    return f"{fb}{inputs}\nlayer {{ {layer} }}\n"


def forward_layer(layer: str, phase: int = TRAIN, **bottoms: np.ndarray) -> Net:
    """The float64 net of ``layer`` over Input bottoms, run forward on ``bottoms``."""
    net = Net(layer_net(layer, {n: np.shape(v) for n, v in bottoms.items()}), phase=phase,
              dtype="float64")
    net.forward(**{n: np.asarray(v, dtype=np.float64) for n, v in bottoms.items()})
    return net


def random_labels(rng: np.random.Generator, shape: Sequence[int], classes: int,
                  ignore: int | None = None, frac: float = 0.3) -> np.ndarray:
    """Class labels in [0, classes) as floats; with ``ignore``, about ``frac`` of them set
    to that value."""
    lab = rng.integers(0, classes, size=shape).astype(np.float64)
    if ignore is not None:
        lab[rng.random(shape) < frac] = ignore
    return lab


def objective(net: Net, weights: dict[str, np.ndarray]) -> float:
    total = 0.0
    for name, r in weights.items():
        total += float(np.sum(net.blobs[name].data * r))
    return total


def numeric_gradient(loss, array: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of ``loss()`` over each value of ``array`` (changed in place and
    put back)."""
    g = np.zeros_like(array)
    flat, gflat = array.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        plus = loss()
        flat[i] = old - eps
        minus = loss()
        flat[i] = old
        gflat[i] = (plus - minus) / (2 * eps)
    return g


def check_gradients(
    layer: str,
    bottoms: dict[str, np.ndarray],
    *,
    check: Sequence[str] | None = None,
    tops: Sequence[str] | None = None,
    phase: int = TRAIN,
    eps: float = 1e-6,
    rtol: float = 1e-5,
    atol: float = 1e-7,
    seed: int = 0,
) -> Net:
    """Check d(objective)/d(bottom) for the bottoms in ``check`` (default: all) and for
    every parameter blob of the layer; the objective weighs ``tops`` (default: the layer's
    tops). Returns the net, holding the forward values of ``bottoms``."""
    shapes = {n: np.asarray(v).shape for n, v in bottoms.items()}
    net = Net(layer_net(layer, shapes), phase=phase, dtype="float64", seed=seed)
    rng = np.random.default_rng(seed + 1)
    top_names = list(tops or net.builder.layers[-1].param.top)
    loss_w = {t.name: w for t, w in net.builder.loss_tops}
    inputs = {n: np.asarray(v, dtype=np.float64) for n, v in bottoms.items()}

    def run() -> float:
        net.forward(**inputs)
        return objective(net, weights)

    net.forward(**inputs)
    weights = {t: (np.full(net.blobs[t].shape, loss_w[t]) if t in loss_w
                   else rng.standard_normal(net.blobs[t].shape)) for t in top_names}
    run()
    net.backward(**{t: w for t, w in weights.items() if t not in loss_w})
    analytic = {n: net.blobs[n].diff.copy() for n in (check if check is not None else bottoms)}
    params = [(f"{layer_name}[{k}]", v) for layer_name, vs in net.params.items()
              for k, v in enumerate(vs)]
    analytic_params = {name: v.diff.copy() for name, v in params}

    def numeric(array: np.ndarray, restore=None) -> np.ndarray:
        return numeric_gradient(run, array, eps)

    for n, got in analytic.items():
        want = numeric(inputs[n])
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                                   err_msg=f"gradient of bottom '{n}'")
    for name, v in params:
        want = numeric(v.data)
        np.testing.assert_allclose(analytic_params[name], want, rtol=rtol, atol=atol,
                                   err_msg=f"gradient of parameter {name}")
    run()  # leave the net holding the unperturbed inputs' values
    return net
