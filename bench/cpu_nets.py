"""CPU forward+backward time and peak memory of LeNet (batch 64), CIFAR-10 quick (batch 100)
and AlexNet (batch 16), purine-caffe beside PyTorch's CPU build in the same run.

    python bench/cpu_nets.py [--iterations N] [--nets lenet,cifar10_quick,alexnet]

Each (framework, net) pair runs in a fresh subprocess so that its peak resident memory
(ru_maxrss above the level after imports and input creation) is its own. Times are medians
of N timed iterations after 2 warm-up iterations. The header names what ran purine's
convolutions: oneDNN where it is installed (``PURINE_ONEDNN=0`` turns it off), else numpy.
PyTorch is a peer for the bench only, never a dependency of the package.
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


def run_purine(name: str, iterations: int) -> dict:
    from purine.caffe import TRAIN, Net

    data, label = inputs(name)
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


def worker_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def purine_convolutions() -> str:
    """What runs purine's float32 CPU convolutions in a worker ("oneDNN 3.2.0 (OpenMP)" or
    "numpy"), asked in a fresh process: loading oneDNN here would set OMP_WAIT_POLICY for
    the torch workers too."""
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
    ap.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "NET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fw, net = args.worker
        result = (run_purine if fw == "purine" else run_torch)(net, args.iterations)
        print(json.dumps(result))
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


if __name__ == "__main__":
    main()
