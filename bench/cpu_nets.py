"""CPU forward+backward time and peak memory of LeNet (batch 64), CIFAR-10 quick (batch 100)
and AlexNet (batch 16), purine-caffe beside PyTorch's CPU build in the same run, then the
whole training loop of each (bench/train_loop.py: from an LMDB) beside PyTorch's.

    python bench/cpu_nets.py [--iterations N] [--nets lenet,cifar10_quick,alexnet]
                             [--train-iterations N] [--no-train-loop]
    python bench/cpu_nets.py --layers cifar10_quick [--iterations N]

Each (framework, net) pair runs in a fresh subprocess so that its peak resident memory
(ru_maxrss above the level after imports, the kernel libraries' loading and input creation:
PyTorch's libraries load with ``import torch``, purine's oneDNN is loaded before the level
is taken, so neither side counts its library) is its own. Times are medians of N timed
iterations after 2 warm-up iterations. The header names what ran purine's convolutions:
oneDNN where it is installed (``PURINE_ONEDNN=0`` turns it off), else numpy. PyTorch is a
peer for the bench only, never a dependency of the package.

``--layers NET`` prints where one forward+backward of NET spends its time, per Caffe layer
and direction: purine's from its dispatcher's profiler (each op's kernel time, summed over
the ops a layer builds), PyTorch's from ``torch.profiler`` (see ``run_torch_layers``).
Medians of N profiled iterations after 3 warm-up ones. Then, for each Convolution and
InnerProduct layer, the GFLOP/s those times give and their share of the practical peak: the
best of five 2048^3 float32 GEMMs through each side's own library (oneDNN's matmul for
purine where it is loaded, else numpy's BLAS; torch.mm for PyTorch), on the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETS = {
    # name: (train prototxt, data shape)
    "lenet": ("models/lenet/lenet_train_test.prototxt", (64, 1, 28, 28)),
    "cifar10_quick": ("models/cifar10_quick/cifar10_quick_train_test.prototxt",
                      (100, 3, 32, 32)),
    "alexnet": ("models/bvlc_alexnet/train_val.prototxt", (16, 3, 227, 227)),
}


def train_net_param(name: str):
    """The TRAIN net with its data layers replaced by Input layers of the bench shapes."""
    from purine.formats import caffe_pb2 as pb
    from purine.formats.prototxt import filter_net, read_net, replace_data_layers

    path, shape = NETS[name]
    net = filter_net(read_net(os.path.join(ROOT, path)), pb.NetState(phase=pb.TRAIN))
    return replace_data_layers(net, {"data": shape, "label": shape[:1]})


def inputs(name: str, seed: int = 0):
    import numpy as np

    shape = NETS[name][1]
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(shape).astype(np.float32)
    label = rng.integers(0, 10, shape[0]).astype(np.float32)
    return data, label


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def load_kernels() -> None:
    """Load purine's kernel library (oneDNN where installed) now, as ``import torch`` loads
    PyTorch's, so that the peak memory above the level taken next is the run's own."""
    from purine.backend import onednn

    onednn.get()


def run_purine(name: str, iterations: int) -> dict:
    from purine.caffe import TRAIN, Net

    data, label = inputs(name)
    load_kernels()
    base = rss_mb()
    net = Net(train_net_param(name), phase=TRAIN)
    net.blobs["data"].data[...] = data
    net.blobs["label"].data[...] = label
    times = []
    for i in range(iterations + 2):
        t0 = time.perf_counter()
        net.forward()
        net.backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    # Where the time goes: one profiled iteration, summed by op type.
    d = net.dispatcher
    d.profile, d.trace = True, []
    net.forward()
    net.backward()
    by_type: dict[str, float] = {}
    for e in d.trace:
        by_type[e.op.type] = by_type.get(e.op.type, 0.0) + (e.end - e.start) * 1e3
    top = sorted(by_type.items(), key=lambda kv: -kv[1])[:6]
    return {"ms": statistics.median(times) * 1e3, "peak_mb": rss_mb() - base,
            "top_ops": [(k, round(v, 2)) for k, v in top]}


def torch_model(name: str):
    """The same TRAIN net as PyTorch functional calls (bench-only transcription)."""
    import torch
    import torch.nn.functional as F

    param = train_net_param(name)
    shapes = {}
    weights = []
    layers = []
    data_shape = NETS[name][1]
    shapes["data"] = data_shape
    for layer in param.layer:
        t = layer.type
        if t == "Input":
            continue
        b, top = layer.bottom[0], layer.top[0]
        if t == "Convolution":
            p = layer.convolution_param
            k = p.kernel_size[0]
            s = p.stride[0] if p.stride else 1
            pad = p.pad[0] if p.pad else 0
            c = shapes[b][1]
            w = torch.randn(p.num_output, c // p.group, k, k) * 0.01
            bias = torch.zeros(p.num_output)
            w.requires_grad_(True)
            bias.requires_grad_(True)
            weights += [w, bias]
            layers.append((top, b, lambda x, w=w, bias=bias, s=s, pad=pad, g=p.group:
                           F.conv2d(x, w, bias, s, pad, 1, g)))
            h = (shapes[b][2] + 2 * pad - k) // s + 1
            shapes[top] = (shapes[b][0], p.num_output, h, h)
        elif t == "Pooling":
            p = layer.pooling_param
            k, s = p.kernel_size, p.stride
            if p.pool == 0:
                fn = lambda x, k=k, s=s: F.max_pool2d(x, k, s, ceil_mode=True)  # noqa: E731
            else:
                fn = lambda x, k=k, s=s: F.avg_pool2d(x, k, s, ceil_mode=True)  # noqa: E731
            layers.append((top, b, fn))
            h = -(-(shapes[b][2] - k) // s) + 1
            shapes[top] = shapes[b][:2] + (h, h)
        elif t == "ReLU":
            layers.append((top, b, F.relu))
            shapes[top] = shapes[b]
        elif t == "LRN":
            p = layer.lrn_param
            layers.append((top, b, lambda x, p=p: F.local_response_norm(
                x, p.local_size, p.alpha, p.beta, p.k)))
            shapes[top] = shapes[b]
        elif t == "InnerProduct":
            p = layer.inner_product_param
            k = 1
            for d in shapes[b][1:]:
                k *= d
            w = (torch.randn(p.num_output, k) * 0.01).requires_grad_(True)
            bias = torch.zeros(p.num_output).requires_grad_(True)
            weights += [w, bias]
            layers.append((top, b, lambda x, w=w, bias=bias: F.linear(
                x.reshape(x.shape[0], -1), w, bias)))
            shapes[top] = (shapes[b][0], p.num_output)
        elif t == "Dropout":
            r = layer.dropout_param.dropout_ratio
            layers.append((top, b, lambda x, r=r: F.dropout(x, r, True)))
            shapes[top] = shapes[b]
        elif t == "SoftmaxWithLoss":
            layers.append((top, tuple(layer.bottom),
                           lambda x, y: F.cross_entropy(x, y.long())))
        else:
            raise SystemExit(f"bench: no PyTorch transcription for layer type {t}")
    return layers, weights


def run_torch(name: str, iterations: int) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    data, label = inputs(name)
    base = rss_mb()
    layers, weights = torch_model(name)
    x0, y0 = torch.from_numpy(data), torch.from_numpy(label)

    def step():
        blobs = {"data": x0, "label": y0}
        for top, b, fn in layers:
            blobs[top] = fn(*(blobs[n] for n in b)) if isinstance(b, tuple) else fn(blobs[b])
        loss = blobs[layers[-1][0]]
        for w in weights:
            w.grad = None
        loss.backward()

    times = []
    for i in range(iterations + 2):
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return {"ms": statistics.median(times) * 1e3, "peak_mb": rss_mb() - base}


# -- per-layer times (--layers) --------------------------------------------------------------
LAYER_WARMUP = 3


def layer_names(name: str) -> list[tuple[str, str]]:
    """(name, type) of the net's layers other than its Input layers: the order both the
    purine net and ``torch_model`` run them in."""
    return [(L.name, L.type) for L in train_net_param(name).layer if L.type != "Input"]


def medians(samples: list[dict[str, list[float]]], names: list[str],
            walls: list[float]) -> dict:
    """Per-layer [fwd, bwd] medians of the iterations' samples, the median of the
    iterations' totals (not the sum of the medians), and the median wall time (ms) of a
    profiled forward+backward, which adds what runs between the layers' ops."""
    rows = {n: [statistics.median(s[n][k] for s in samples) for k in (0, 1)] for n in names}
    total = [statistics.median(sum(s[n][k] for n in names) for s in samples) for k in (0, 1)]
    return {"rows": rows, "total": total, "wall": statistics.median(walls)}


PEAK_N = 2048  # the GEMM that measures the practical peak: (n, n) @ (n, n), float32


def layer_flops(name: str) -> dict[str, list[float]]:
    """[forward, backward] floating-point operations (a multiply-add is two) of each
    Convolution and InnerProduct layer, from the net's shapes: forward 2 MACs per output
    product term; backward the weight gradient (as many) and, unless the bottom is the
    net's input (no gradient wanted there, as in Caffe), the bottom's gradient (as many)."""
    import math

    from purine.caffe import TRAIN, Net

    param = train_net_param(name)
    net = Net(param, phase=TRAIN)
    inputs_ = {t for L in param.layer if L.type == "Input" for t in L.top}
    out = {}
    for L in param.layer:
        if L.type not in ("Convolution", "InnerProduct"):
            continue
        w = net.params[L.name][0].data.shape  # (Cout, Cin/g, kh, kw) or (N, K)
        if L.type == "Convolution":
            macs = math.prod(net.blobs[L.top[0]].data.shape) * math.prod(w[1:])
        else:
            macs = math.prod(net.blobs[L.bottom[0]].data.shape) * w[0]
        out[L.name] = [2.0 * macs, 2.0 * macs * (1 if L.bottom[0] in inputs_ else 2)]
    return out


def gemm_peak(matmul, np_module) -> float:
    """GFLOP/s of the best of 5 (PEAK_N)^3 float32 products through ``matmul(a, b, c)``: the
    practical peak of that library on this machine's cores."""
    a = np_module.ones((PEAK_N, PEAK_N), dtype=np_module.float32)
    b, c = a + 0, a + 0
    matmul(a, b, c)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        matmul(a, b, c)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * PEAK_N ** 3 / best / 1e9


def purine_peak() -> tuple[float, str]:
    """The peak through the library purine's float32 products use: oneDNN's matmul where
    it is loaded, else numpy's BLAS."""
    import numpy as np

    from purine.backend import onednn

    dnnl = onednn.get()
    if dnnl is not None:
        with onednn.pass_scope():  # as in a pass: OpenBLAS at one thread beside oneDNN
            return gemm_peak(lambda a, b, c: dnnl.matmul(a, b, None, c, PEAK_N, PEAK_N,
                                                         PEAK_N), np), "oneDNN matmul"
    return gemm_peak(lambda a, b, c: np.matmul(a, b, out=c), np), "numpy matmul (BLAS)"


def run_purine_layers(name: str, iterations: int) -> dict:
    """Each op's kernel time from the dispatcher's trace, summed per layer: forward ops in
    [0], backward ops in [1]. The loss-weight seeds (the first backward ops) count towards
    the backward of the loss layer they belong to."""
    from purine.caffe import TRAIN, Net

    data, label = inputs(name)
    net = Net(train_net_param(name), phase=TRAIN)
    net.blobs["data"].data[...] = data
    net.blobs["label"].data[...] = label
    names = [n for n, _ in layer_names(name)]
    owner = {}
    for L in net.builder.layers:
        owner.update({op: (L.name, 0) for op in L.forward_ops})
        owner.update({op: (L.name, 1) for op in L.backward_ops})
    for op in net.builder.seed_ops:  # named "<loss layer>/LossWeight#i"
        owner[op] = (op.name.split("/")[0], 1)
    d = net.dispatcher
    samples, walls = [], []
    for i in range(LAYER_WARMUP + iterations):
        d.profile, d.trace = i >= LAYER_WARMUP, []
        t0 = time.perf_counter()
        net.forward()
        net.backward()
        walls.append((time.perf_counter() - t0) * 1e3)
        if d.profile:
            ms = {n: [0.0, 0.0] for n in names}
            for e in d.trace:
                layer, k = owner[e.op]
                ms[layer][k] += (e.end - e.start) * 1e3
            samples.append(ms)
    d.profile, d.trace = False, []
    peak, library = purine_peak()
    return {**medians(samples, names, walls[LAYER_WARMUP:]), "flops": layer_flops(name),
            "peak": peak, "peak_library": library}


def run_torch_layers(name: str, iterations: int) -> dict:
    """Forward: the ``record_function`` range around each layer's call. Backward: autograd
    runs one node at a time on this thread; each "evaluate_function: XBackward0" event
    belongs to the layer whose forward ops carry its sequence number, and the nodes without
    one (AccumulateGrad of a layer's weights, which autograd runs right after that layer's
    node; the loss's ones_like seed) to the layer of the node before them."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(os.cpu_count() or 1)
    data, label = inputs(name)
    layers, weights = torch_model(name)
    names = [n for n, _ in layer_names(name)]
    x0, y0 = torch.from_numpy(data), torch.from_numpy(label)

    def step() -> None:
        blobs = {"data": x0, "label": y0}
        for n, (top, b, fn) in zip(names, layers):
            with record_function("layer:" + n):
                blobs[top] = fn(*(blobs[x] for x in b)) if isinstance(b, tuple) else fn(blobs[b])
        for w in weights:
            w.grad = None
        blobs[layers[-1][0]].backward()

    def seqs(e, out: set[int]) -> set[int]:
        if e.sequence_nr >= 0:
            out.add(e.sequence_nr)
        for c in e.cpu_children:
            seqs(c, out)
        return out

    for _ in range(LAYER_WARMUP):
        step()
    samples, walls = [], []
    for _ in range(iterations):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            step()
            walls.append((time.perf_counter() - t0) * 1e3)
        top_level = sorted((e for e in prof.events() if e.cpu_parent is None),
                           key=lambda e: e.time_range.start)
        ms = {n: [0.0, 0.0] for n in names}
        seq_owner: dict[int, str] = {}
        for e in top_level:
            if e.name.startswith("layer:"):
                ms[e.name[6:]][0] += e.cpu_time_total / 1e3
                seq_owner.update(dict.fromkeys(seqs(e, set()), e.name[6:]))
        current = names[-1]
        for e in top_level:
            if e.name.startswith("layer:"):
                continue
            if "evaluate_function" in e.name and e.sequence_nr >= 0:
                current = seq_owner[e.sequence_nr]
            ms[current][1] += e.cpu_time_total / 1e3
        samples.append(ms)
    peak = gemm_peak(lambda a, b, c: torch.mm(a, b, out=c), torch)
    return {**medians(samples, names, walls), "peak": peak}


def print_layers(net: str, ours: dict, theirs: dict) -> None:
    print(f"{'layer':8s} {'type':16s} {'ours fwd':>9s} {'torch fwd':>9s} {'ours bwd':>9s} "
          f"{'torch bwd':>9s}   (ms; purine convolutions: {purine_convolutions()})")
    for n, t in layer_names(net):
        (pf, pb), (tf, tb) = ours["rows"][n], theirs["rows"][n]
        print(f"{n:8s} {t:16s} {pf:9.2f} {tf:9.2f} {pb:9.2f} {tb:9.2f}")
    (pf, pb), (tf, tb) = ours["total"], theirs["total"]
    print(f"{'total':8s} {'':16s} {pf:9.2f} {tf:9.2f} {pb:9.2f} {tb:9.2f}")
    print(f"wall time of a profiled forward+backward: ours {ours['wall']:.2f} ms, "
          f"torch {theirs['wall']:.2f} ms")
    print()
    print(f"practical peak, a {PEAK_N}^3 float32 GEMM: ours {ours['peak']:.1f} GFLOP/s "
          f"({ours['peak_library']}), torch {theirs['peak']:.1f} GFLOP/s (torch.mm)")
    print(f"{'layer':8s} {'GFLOP f/b':>11s} {'ours fwd':>14s} {'torch fwd':>14s} "
          f"{'ours bwd':>14s} {'torch bwd':>14s}   (GFLOP/s, % of that side's peak)")

    def rate(flops: float, ms: float, peak: float) -> str:
        g = flops / (ms * 1e6) if ms > 0 else float("nan")
        return f"{g:7.1f} ({100 * g / peak:3.0f}%)"

    for n, (ff, fb) in ours["flops"].items():
        (pf, pb), (tf, tb) = ours["rows"][n], theirs["rows"][n]
        print(f"{n:8s} {ff / 1e9:5.2f}/{fb / 1e9:5.2f} {rate(ff, pf, ours['peak'])} "
              f"{rate(ff, tf, theirs['peak'])} {rate(fb, pb, ours['peak'])} "
              f"{rate(fb, tb, theirs['peak'])}")


def worker_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def purine_convolutions() -> str:
    """What runs purine's float32 CPU convolutions in a worker ("oneDNN 3.2.0 (OpenMP)" or
    "numpy"), asked in a fresh process, so that this one loads no kernel library."""
    out = subprocess.run([sys.executable, "-c", "from purine.backend import onednn; "
                          "print(onednn.describe())"], capture_output=True, text=True,
                         env=worker_env())
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def in_workers(script: str, net: str, flags: list[str]) -> tuple[dict, dict]:
    """``script --worker FRAMEWORK net`` for purine, then torch, each in a fresh process (its
    own peak memory); their JSON results."""
    env = worker_env()
    res = []
    for fw in ("purine", "torch"):
        out = subprocess.run([sys.executable, script, *flags, "--worker", fw, net],
                             capture_output=True, text=True, env=env)
        if out.returncode:
            raise SystemExit(f"{fw} {net} failed:\n{out.stderr}")
        res.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return res[0], res[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--layers", metavar="NET", choices=list(NETS),
                    help="per-layer forward/backward times of NET, purine beside PyTorch")
    ap.add_argument("--train-iterations", type=int, default=20, metavar="N",
                    help="timed iterations of the training-loop comparison (default 20)")
    ap.add_argument("--no-train-loop", action="store_true",
                    help="skip the training-loop comparison")
    ap.add_argument("--train-repeat", type=int, default=1, metavar="N",
                    help="alternate purine's and PyTorch's training loops N times per net, "
                         "medians reported (default 1)")
    ap.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "NET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fw, net = args.worker
        if args.layers:
            run = run_purine_layers if fw == "purine" else run_torch_layers
        else:
            run = run_purine if fw == "purine" else run_torch
        print(json.dumps(run(net, args.iterations)))
        return
    if args.layers:
        flags = ["--iterations", str(args.iterations), "--layers", args.layers]
        print_layers(args.layers, *in_workers(__file__, args.layers, flags))
        return
    print(f"{'net':15s} {'purine ms':>10s} {'torch ms':>10s} {'ratio':>6s} "
          f"{'purine MB':>10s} {'torch MB':>9s} {'ratio':>6s}   purine convolutions: "
          f"{purine_convolutions()}")
    for net in args.nets.split(","):
        p, t = in_workers(__file__, net, ["--iterations", str(args.iterations)])
        print(f"{net:15s} {p['ms']:10.1f} {t['ms']:10.1f} {p['ms'] / t['ms']:6.2f} "
              f"{p['peak_mb']:10.1f} {t['peak_mb']:9.1f} "
              f"{p['peak_mb'] / max(t['peak_mb'], 1e-9):6.2f}")
        print(f"{'':15s} purine's costliest op types (ms): {p['top_ops']}")
    if not args.no_train_loop:
        import train_loop  # this folder; it imports this module's helpers

        nets = [n for n in args.nets.split(",") if n in train_loop.SETTINGS]
        if nets:
            print()
            train_loop.compare(nets, args.train_iterations, train_loop.RECORDS,
                               args.train_repeat)


if __name__ == "__main__":
    main()
