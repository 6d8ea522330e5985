"""Training throughput of a fully convolutional net whose input size changes at every pass
(Caffe's reshape-before-forward, as FCN trains on whole images of differing sizes), against
the same net trained at one fixed size, and the time a shape costs the first time it is seen.

    python bench/changing_shapes.py [--iterations N] [--repeats R] [--sizes 96x128,...]

The net is FCN-AlexNet (fcn.berkeleyvision.org's voc-fcn-alexnet) with narrower layers: the
AlexNet trunk (conv1 64, conv2 192, conv3/conv4 256, conv5 192 channels) with conv1's ``pad:
100``, fc6/fc7 as 2048-wide convolutions, a 1x1 score layer, a fixed bilinear
``Deconvolution`` (stride 32, bias_term false, lr_mult 0), a ``Crop`` (axis 2, offset 18) of
the upsampled score to the data blob, and ``SoftmaxWithLoss`` (ignore_label 255) against a
per-pixel label; batch 1. The upsampling kernel is FCN-AlexNet's 63, not FCN-32s's 64: on
this trunk a 64 kernel puts the data blob at a half-pixel offset (18.5) that Caffe's
coord_map refuses. A Python data layer (``type: "Python"``, a module this script writes to a
temporary directory) loads a seeded random image (1, 3, H, W) and label (1, 1, H, W) in
``reshape()``, as FCN's data layers do, and advances to the next item in ``forward()``; its
param_str lists the sizes and says whether to cycle through them. Training is SGD (base_lr
1e-4, momentum 0.9) through ``Solver.step(1)``, each call timed alone with perf_counter; one
iteration took 0.14-0.2 s on 2 cores (oneDNN).

Each repeat runs, in turn: (a) the fixed runs, one solver per size whose layer serves that
size only: 2 warm-up iterations, then N timed ones; (b) the cycling run, one solver whose
layer cycles through the sizes in order: one cycle of warm-up iterations (where each shape
is first seen; each one's time is kept), then 2N timed ones. Throughput is pixels (the sum of
H*W over the timed iterations) per second. Each repeat's line gives the cycling throughput
over the fixed throughput for the same mix of sizes (the fixed runs' mean time per size
weighted by how often the cycling run saw each size; when 2N is a whole number of cycles,
as with the default four sizes and an even N, that is the four fixed runs' total pixels over
their total time); the last line the ratios and their median over the repeats. The table
gives per size, as medians over the repeats: the fixed solver's build time (s), then in ms
its first iteration and its steady one (the median of its N), the cycling run's steady
iteration (the median of those at that size) and first-cycle iteration, and "first seen",
the time of a shape change the first time: the first-cycle iteration minus the fixed steady
iteration at that size. The cycling run's first iteration is at the size its net was built
at, a freshly built solver's first iteration: compare it with "fixed 1st". The header names
what ran the convolutions, decided as in bench/cpu_nets.py: oneDNN where it is installed
(``PURINE_ONEDNN=0`` turns it off), else numpy.

An engine that cannot change a net's shapes during a pass fails the cycling run: the script
prints the fixed runs' table, then the error in one line, and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIZES = ((96, 128), (128, 96), (112, 112), (80, 144))
CLASSES = 21
WARMUP = 2  # iterations before a fixed run's timed ones
OFFSET = 18  # FCN-AlexNet's crop offset: where the data blob's pixel 0 lies in upscore
MODULE = "changing_shapes_data"
# conv1..conv5, fc6, fc7 widths: AlexNet's are 96, 256, 384, 384, 256, 4096, 4096.
WIDTHS = (64, 192, 256, 256, 192, 2048, 2048)

# The data layer module, written as a Caffe user writes one (FCN's voc_layers.py pattern).
LAYER_SOURCE = '''\
"""bench/changing_shapes.py's data layer: a seeded random image and per-pixel label per
pass, loaded in reshape() as FCN's data layers load theirs."""

import json

import numpy as np

import caffe

LAST = None  # the newest layer object: the bench reads what it served


class ShapesData(caffe.Layer):
    def setup(self, bottom, top):
        global LAST
        if len(top) != 2:
            raise Exception("ShapesData makes two tops: data and label")
        params = json.loads(self.param_str)
        self.sizes = [tuple(s) for s in params["sizes"]]
        self.cycle = bool(params["cycle"])
        self.classes = int(params["classes"])
        self.seed = int(params["seed"])
        self.index = 0  # the item the next forward hands out
        self.loaded = None  # the item reshape() loaded
        self.served = []  # (H, W) of each forward
        LAST = self

    def reshape(self, bottom, top):
        if self.loaded != self.index:  # the net may call reshape more than once a pass
            h, w = self.sizes[self.index % len(self.sizes) if self.cycle else 0]
            rng = np.random.default_rng((self.seed, self.index))
            self.data = rng.standard_normal((1, 3, h, w), dtype=np.float32)
            self.label = rng.integers(0, self.classes, (1, 1, h, w)).astype(np.float32)
            self.loaded = self.index
        top[0].reshape(*self.data.shape)
        top[1].reshape(*self.label.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.data
        top[1].data[...] = self.label
        self.served.append(tuple(self.data.shape[2:]))
        self.index += 1

    def backward(self, top, propagate_down, bottom):
        pass
'''

FILL = 'weight_filler { type: "gaussian" std: %g } bias_filler { type: "constant" value: %g }'


def conv(name: str, bottom: str, n: int, k: int, stride: int = 1, pad: int = 0,
         group: int = 1, std: float = 0.01, bias: float = 0.0) -> str:
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" '
            "param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 } "
            f"convolution_param {{ num_output: {n} kernel_size: {k} stride: {stride} "
            f"pad: {pad} group: {group} {FILL % (std, bias)} }} }}\n"
            f'layer {{ name: "relu_{name}" type: "ReLU" bottom: "{name}" top: "{name}" }}\n')


def pool(name: str, bottom: str) -> str:
    return (f'layer {{ name: "{name}" type: "Pooling" bottom: "{bottom}" top: "{name}" '
            "pooling_param { pool: MAX kernel_size: 3 stride: 2 } }\n")


def lrn(name: str, bottom: str) -> str:
    return (f'layer {{ name: "{name}" type: "LRN" bottom: "{bottom}" top: "{name}" '
            "lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }\n")


def dropout(name: str, blob: str) -> str:
    return (f'layer {{ name: "{name}" type: "Dropout" bottom: "{blob}" top: "{blob}" '
            "dropout_param { dropout_ratio: 0.5 } }\n")


def net_text(sizes: list[tuple[int, int]], cycle: bool, seed: int = 0) -> str:
    """FCN-AlexNet with WIDTHS (about 2/3 of AlexNet's convolution channels, half its fc6
    and fc7) fed by the Python data layer serving ``sizes`` (cycling through them or the
    first one)."""
    param_str = json.dumps({"sizes": sizes, "cycle": cycle, "classes": CLASSES, "seed": seed})
    score = CLASSES
    c1, c2, c3, c4, c5, f6, f7 = WIDTHS
    return (
        'name: "FCN-AlexNet-narrow"\n'
        'layer { name: "data" type: "Python" top: "data" top: "label" python_param { '
        f"module: \"{MODULE}\" layer: \"ShapesData\" param_str: '{param_str}' }} }}\n"
        + conv("conv1", "data", c1, 11, stride=4, pad=100) + lrn("norm1", "conv1")
        + pool("pool1", "norm1")
        + conv("conv2", "pool1", c2, 5, pad=2, group=2, bias=0.1) + lrn("norm2", "conv2")
        + pool("pool2", "norm2")
        + conv("conv3", "pool2", c3, 3, pad=1)
        + conv("conv4", "conv3", c4, 3, pad=1, group=2, bias=0.1)
        + conv("conv5", "conv4", c5, 3, pad=1, group=2, bias=0.1) + pool("pool5", "conv5")
        + conv("fc6", "pool5", f6, 6, std=0.005, bias=0.1) + dropout("drop6", "fc6")
        + conv("fc7", "fc6", f7, 1, std=0.005, bias=0.1) + dropout("drop7", "fc7")
        + f'layer {{ name: "score_fr" type: "Convolution" bottom: "fc7" top: "score_fr" '
        "param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 } "
        f"convolution_param {{ num_output: {score} kernel_size: 1 {FILL % (0.01, 0)} }} }}\n"
        'layer { name: "upscore" type: "Deconvolution" bottom: "score_fr" top: "upscore" '
        "param { lr_mult: 0 } convolution_param { "
        f"num_output: {score} group: {score} kernel_size: 63 stride: 32 bias_term: false "
        'weight_filler { type: "bilinear" } } }\n'
        'layer { name: "score" type: "Crop" bottom: "upscore" bottom: "data" top: "score" '
        f"crop_param {{ axis: 2 offset: {OFFSET} }} }}\n"
        'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" '
        'top: "loss" loss_param { ignore_label: 255 normalize: true } }\n')


def solver_text(sizes: list[tuple[int, int]], cycle: bool) -> str:
    net = net_text(sizes, cycle).replace("\n", "\n  ")
    return ("base_lr: 0.0001\nmomentum: 0.9\nweight_decay: 0.0005\nlr_policy: \"fixed\"\n"
            "max_iter: 100000\ndisplay: 0\nrandom_seed: 1\nsnapshot_after_train: false\n"
            f"net_param {{\n  {net}}}\n")


def served_layer():
    """The data layer object of the solver built last (None before its set-up), from the
    module the Python layer imported (which imports ``caffe``: the net provides it)."""
    module = sys.modules.get(MODULE)
    return None if module is None else module.LAST


def train(sizes: list[tuple[int, int]], cycle: bool, warmup: int, timed: int) -> dict:
    """Build a solver whose data layer serves ``sizes``; time each of ``warmup + timed``
    ``step(1)`` calls. The sizes are those the layer served, checked against the net's data
    blob after each step. A failed step's error says where: ``run["failed"]``."""
    from purine.caffe.solver import Solver
    from purine.errors import PurineError

    if MODULE in sys.modules:
        sys.modules[MODULE].LAST = None  # not the last solver's layer
    run: dict = {"times": [], "sizes": [], "failed": None}
    t0 = time.perf_counter()
    with Solver(solver_text(sizes, cycle)) as solver:
        run["build"] = time.perf_counter() - t0
        for i in range(warmup + timed):
            t0 = time.perf_counter()
            try:
                solver.step(1)
            except PurineError as e:
                layer = served_layer()  # the size its reshape() loaded last
                where = "" if layer is None else " ({}x{})".format(*layer.data.shape[2:])
                run["failed"] = (f"iteration {i}{where}: "
                                 + (str(e).splitlines() or [type(e).__name__])[0])
                return run
            run["times"].append(time.perf_counter() - t0)
            layer = served_layer()
            count = 0 if layer is None else len(layer.served)
            served = layer.served[-1] if count else None
            blob = tuple(solver.net.blobs["data"].data.shape[2:])
            if count != i + 1 or blob != served:
                raise SystemExit(f"bench: after step {i} the data layer had served {count} "
                                 f"items, the last {served}; the net's data blob is {blob}")
            run["sizes"].append(served)
        run["loss"] = float(solver.net.blobs["loss"].data.sum())
    return run


def by_size(run: dict, start: int) -> dict[tuple[int, int], list[float]]:
    """The run's iteration times from ``start`` on, grouped by size."""
    out: dict[tuple[int, int], list[float]] = {}
    for s, t in zip(run["sizes"][start:], run["times"][start:]):
        out.setdefault(s, []).append(t)
    return out


def fixed_runs(sizes: list[tuple[int, int]], iterations: int) -> dict:
    """One solver per size: its build time, first iteration and steady iteration times."""
    out = {}
    for s in sizes:
        run = train([s], False, WARMUP, iterations)
        if run["failed"]:
            raise SystemExit(f"bench: fixed run at {s[0]}x{s[1]} failed at {run['failed']}")
        out[s] = {"build": run["build"], "first": run["times"][0],
                  "steady": run["times"][WARMUP:], "loss": run["loss"]}
    return out


def cycling_run(sizes: list[tuple[int, int]], iterations: int) -> dict:
    """One solver cycling through ``sizes``: one cycle of warm-up (its times kept), then
    ``2 * iterations`` timed ones."""
    n = len(sizes)
    run = train(sizes, True, n, 2 * iterations)
    if run["failed"]:
        return run
    if run["sizes"][:n] != list(sizes):
        raise SystemExit(f"bench: the first cycle served {run['sizes'][:n]}, not {sizes}")
    run["first_cycle"] = run["times"][:n]
    run["steady"] = by_size(run, n)
    return run


def ratio(fixed: dict, cycling: dict) -> tuple[float, float, float]:
    """(cycling px/s, fixed px/s over the cycling run's mix of sizes, their ratio)."""
    steady = cycling["steady"]
    pixels = sum(h * w * len(ts) for (h, w), ts in steady.items())
    cyc = pixels / sum(sum(ts) for ts in steady.values())
    fix = pixels / sum(len(ts) * statistics.mean(fixed[s]["steady"]) for s, ts in steady.items())
    return cyc, fix, cyc / fix


def fixed_rate(fixed: dict) -> float:
    pixels = sum(h * w * len(r["steady"]) for (h, w), r in fixed.items())
    return pixels / sum(sum(r["steady"]) for r in fixed.values())


def print_table(sizes: list[tuple[int, int]], fixed: list[dict], cycling: list[dict]) -> None:
    """Medians over the repeats, in ms (build in s)."""
    def med(values: list[float]) -> str:
        return f"{statistics.median(values):10.1f}" if values else f"{'-':>10s}"

    print(f"{'size':>8s} {'build s':>8s} {'fixed 1st':>10s} {'fixed':>10s} {'cycling':>10s} "
          f"{'1st cycle':>10s} {'first seen':>10s}   (ms; medians over repeats)")
    for k, s in enumerate(sizes):
        steady = [statistics.median(f[s]["steady"]) * 1e3 for f in fixed]
        cyc = [statistics.median(c["steady"][s]) * 1e3 for c in cycling if s in c["steady"]]
        first = [c["first_cycle"][k] * 1e3 for c in cycling]
        extra = [c["first_cycle"][k] * 1e3 - st for c, st in zip(cycling, steady)]
        print(f"{s[0]:>4d}x{s[1]:<3d} {statistics.median(f[s]['build'] for f in fixed):8.2f}"
              f"{med([f[s]['first'] * 1e3 for f in fixed])}{med(steady)}{med(cyc)}"
              f"{med(first)}{med(extra)}")


def parse_sizes(text: str) -> list[tuple[int, int]]:
    try:
        sizes = [tuple(int(d) for d in s.split("x")) for s in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) < 2 or len(set(sizes)) != len(sizes) or any(
            len(s) != 2 or min(s) < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"expected two or more distinct HxW sizes, got {text}")
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=8,
                    help="timed iterations of a fixed run; the cycling run times twice as many "
                         "(default 8)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="fixed runs and cycling run, alternated this many times (default 3)")
    ap.add_argument("--sizes", type=parse_sizes, default=list(SIZES),
                    help="the HxW input sizes, comma-separated (default "
                         + ",".join(f"{h}x{w}" for h, w in SIZES) + ")")
    args = ap.parse_args()
    if args.iterations < 1 or args.repeats < 1:
        ap.error("--iterations and --repeats must be at least 1")
    sizes = args.sizes

    from purine.backend import onednn
    from purine.log import get_logger

    get_logger().setLevel(logging.WARNING)  # each solver logs its net at INFO
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, MODULE + ".py"), "w") as f:
            f.write(LAYER_SOURCE)
        sys.path.insert(0, tmp)
        print(f"FCN-AlexNet (narrow), batch 1, sizes {' '.join(f'{h}x{w}' for h, w in sizes)}; "
              f"{args.iterations} timed iterations per fixed run, {2 * args.iterations} "
              f"cycling; {os.cpu_count()} CPUs; purine convolutions: {onednn.describe()}")
        fixed, cycling, ratios = [], [], []
        for r in range(args.repeats):
            fixed.append(fixed_runs(sizes, args.iterations))
            line = f"repeat {r + 1}: fixed {fixed_rate(fixed[-1]) / 1e3:8.1f} kpx/s"
            run = cycling_run(sizes, args.iterations)
            if run["failed"]:
                print(line)
                print_table(sizes, fixed, [])
                print(f"cycling run failed at {run['failed']}", file=sys.stderr)
                sys.exit(1)
            cycling.append(run)
            cyc, fix, q = ratio(fixed[-1], run)
            ratios.append(q)
            print(f"{line}, cycling {cyc / 1e3:8.1f} kpx/s, cycling / fixed (same mix "
                  f"{fix / 1e3:.1f} kpx/s) {q:.3f}")
        print_table(sizes, fixed, cycling)
        losses = [f[s]["loss"] for f in fixed for s in sizes] + [c["loss"] for c in cycling]
        print(f"cycling / fixed throughput: {' '.join(f'{q:.3f}' for q in ratios)}; median "
              f"{statistics.median(ratios):.3f} (last losses {min(losses):.3f}.."
              f"{max(losses):.3f})")


if __name__ == "__main__":
    main()
