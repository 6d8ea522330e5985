"""Predicted data-parallel scaling to N = 2..64 devices from one device's measured per-op
times and the graph, with and without overlapping the gradient exchange with the backward
pass, as a table and a plot: what overlap buys before renting machines.

    python bench/simulate_scaling.py [--net cifar10_quick|alexnet|lenet] [--batch B]
        [--iterations N] [--bandwidth GB/s] [--latency us] [--plot out.png]

Measurement: the net's train phase (its Data layer replaced by constant DummyData of the
same shape, so reading data costs nothing) runs ``--iterations`` solver iterations in one
worker with the dispatcher's profiler on, after one warm-up; each op's time is its median.
From the program order of the forward and backward ops follows, for every parameter
gradient, the time in the iteration when its last writer finishes (it is ready); its size
is that of the gradient blob; its update is the parameter's ``prepare`` and ``update`` ops.

Model (``predict``): every device keeps the per-device batch and runs the measured ops.
One gradient of b bytes crosses a ring all-reduce of N devices in
``2(N-1)/N * b / bandwidth + 2(N-1) * latency`` (reduce-scatter, then all-gather: 2(N-1)
steps of b/N bytes each). The link carries one exchange at a time, in the order purine
issues them (reverse parameter order); a parameter's update runs on the device after its
exchange and after the backward pass. Without overlap, all exchanges follow the backward
pass and the updates follow the exchanges. Speed-up is N x one device's iteration time
over the predicted one (images/s); efficiency is speed-up / N. Not modelled: contention
between the exchange and compute for memory bandwidth, stragglers, the data pipeline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benches' shared parts

DEVICES = (2, 4, 8, 16, 32, 64)
# (train net, solver, one image's shape C x H x W after the data layer's transform)
NETS = {"lenet": ("lenet/lenet_train_test.prototxt", "lenet/lenet_solver.prototxt",
                  (1, 28, 28)),
        "cifar10_quick": ("cifar10_quick/cifar10_quick_train_test.prototxt",
                          "cifar10_quick/cifar10_quick_solver.prototxt", (3, 32, 32)),
        "alexnet": ("bvlc_alexnet/train_val.prototxt", "bvlc_alexnet/solver.prototxt",
                    (3, 227, 227))}


# -- the model ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gradient:
    name: str
    nbytes: int
    ready_s: float   # when the backward pass has written it, from the iteration's start
    update_s: float  # its parameter's update ops


@dataclass(frozen=True)
class Profile:
    """One device's iteration: ``compute_s`` is every op but the parameters' updates (the
    forward and backward passes, the learning rate and iteration counter); ``gradients``
    in the order they are exchanged."""

    compute_s: float
    gradients: tuple[Gradient, ...]

    @property
    def one_device_s(self) -> float:
        return self.compute_s + sum(g.update_s for g in self.gradients)


@dataclass(frozen=True)
class Prediction:
    devices: int
    serial_s: float   # exchanges after the backward pass
    overlap_s: float  # each exchange as soon as its gradient is ready


def ring_all_reduce_s(nbytes: int, devices: int, bandwidth: float, latency: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``devices`` (bandwidth in bytes/s,
    latency in s per step); 0 for one device."""
    n = devices
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def predict(profile: Profile, devices: int, bandwidth: float, latency: float) -> Prediction:
    """The iteration time on ``devices`` devices, without and with overlap (module doc)."""
    grads = profile.gradients
    cost = [ring_all_reduce_s(g.nbytes, devices, bandwidth, latency) for g in grads]
    serial = profile.compute_s + sum(cost) + sum(g.update_s for g in grads)
    link = 0.0                   # when the link is next free
    device = profile.compute_s   # updates queue on the device behind the backward pass
    for g, c in zip(grads, cost, strict=True):
        link = max(link, g.ready_s) + c
        device = max(device, link) + g.update_s
    return Prediction(devices, serial, device)


# -- measuring ------------------------------------------------------------------------------
def solver_param(name: str, batch: int | None = None):
    """The net's solver with its train Data layer replaced by constant DummyData (images
    0.5, labels 0) of the batch's shape; no tests, displays or snapshots."""
    from data_parallel import bench_solver

    from purine.formats.prototxt import read_net
    from purine.zoo import model_file

    net_file, solver_file, image = NETS[name]
    net = read_net(model_file(net_file))
    for layer in net.layer:
        if layer.type == "Data" and not any(r.phase == 1 for r in layer.include):
            n = batch or layer.data_param.batch_size
            layer.type = "DummyData"
            layer.ClearField("data_param")
            layer.ClearField("transform_param")
            d = layer.dummy_data_param
            d.shape.add().dim[:] = [n, *image]
            d.shape.add().dim[:] = [n]
            d.data_filler.add(type="constant", value=0.5)
            d.data_filler.add(type="constant", value=0.0)
    s = bench_solver(solver_file, net)
    s.ClearField("solver_mode")
    return s


def profile_ops(solver, op_s: dict) -> Profile:
    """The model's input from a solver's graph and each op's seconds."""
    from purine.runtime.memory import blob_nbytes

    clock, ready = 0.0, {}
    for op in solver.net._forward_ops + solver.net._backward_ops:  # run in this order
        clock += op_s[op]
        ready.update((b, clock) for b in op.outputs)
    active = [u for u in solver.updates if u.param.meta["lr_mult"] != 0]
    update_s = defaultdict(float)
    for op in solver.update_ops:
        update_s[op.name.rsplit("/", 1)[0].removeprefix("solver/")] += op_s[op]
    grads = tuple(Gradient(u.param.name, blob_nbytes(u.grad), ready.get(u.grad, clock),
                           update_s[u.param.name]) for u in reversed(active))
    compute = sum(op_s.values()) - sum(g.update_s for g in grads)
    return Profile(compute, grads)


def measure(param, iterations: int) -> tuple[Profile, float]:
    """The profile of ``iterations`` profiled iterations (median per op) and their mean
    wall time in seconds."""
    from purine.caffe.solver import Solver

    with Solver(param) as s:
        s.step(1)  # arrays allocated, convolution primitives built
        d = s.net.dispatcher
        d.profile, d.trace = True, []
        t0 = time.perf_counter()
        s.step(iterations)
        wall = (time.perf_counter() - t0) / iterations
        d.profile = False
        times: dict = defaultdict(list)
        for e in d.trace:
            times[e.op].append(e.end - e.start)
        d.trace = []
        return profile_ops(s, {op: statistics.median(v) for op, v in times.items()}), wall


# -- output ---------------------------------------------------------------------------------
def table(profile: Profile, predictions: Sequence[Prediction]) -> list[str]:
    one = profile.one_device_s
    rows = ["    N  no overlap ms  overlap ms  speed-up (no / with)  efficiency (no / with)",
            f"    1  {one * 1e3:13.1f}  {one * 1e3:10.1f}  {1:9.2f} / {1:<8.2f}"
            f"  {1:11.2f} / {1:.2f}"]
    for p in predictions:
        n = p.devices
        rows.append(f"{n:5d}  {p.serial_s * 1e3:13.1f}  {p.overlap_s * 1e3:10.1f}  "
                    f"{n * one / p.serial_s:9.2f} / {n * one / p.overlap_s:<8.2f}  "
                    f"{one / p.serial_s:11.2f} / {one / p.overlap_s:.2f}")
    return rows


def plot(profile: Profile, predictions: Sequence[Prediction], title: str, path: str) -> None:
    """Efficiency and iteration time against N, both curves, to a PNG (no pyplot state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("no plot: matplotlib is missing (pip install 'purine-caffe[plot]')")
        return
    one = profile.one_device_s
    n = [1] + [p.devices for p in predictions]
    serial = [one] + [p.serial_s for p in predictions]
    overlap = [one] + [p.overlap_s for p in predictions]
    fig = Figure(figsize=(10, 4.2))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    left.axhline(1.0, linestyle=":", color="grey", label="ideal")
    for times, label in ((serial, "without overlap"), (overlap, "with overlap")):
        left.plot(n, [one / t for t in times], "o-", label=label)
        right.plot(n, [t * 1e3 for t in times], "o-", label=label)
    for ax, ylabel in ((left, "efficiency (speed-up / devices)"),
                       (right, "iteration time (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(k) for k in n])
        ax.set_xlabel("devices")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower left")
    left.set_ylim(top=1.05)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="cifar10_quick", choices=sorted(NETS))
    ap.add_argument("--batch", type=int, default=None,
                    help="per-device batch (default: the net's own)")
    ap.add_argument("--iterations", type=int, default=5, help="profiled iterations")
    ap.add_argument("--bandwidth", type=float, default=1.25,
                    help="link GB/s (default 1.25: 10 Gb Ethernet)")
    ap.add_argument("--latency", type=float, default=25.0, help="per-step latency in us")
    ap.add_argument("--plot", default=None, help="write the curves to this PNG")
    args = ap.parse_args(argv)
    param = solver_param(args.net, args.batch)
    batch = next(layer.dummy_data_param.shape[0].dim[0] for layer in param.net_param.layer
                 if layer.type == "DummyData")
    profile, wall = measure(param, args.iterations)
    total = sum(g.nbytes for g in profile.gradients)
    print(f"{args.net}, batch {batch} per device, {args.iterations} profiled iterations: "
          f"ops {profile.one_device_s * 1e3:.1f} ms per iteration (wall {wall * 1e3:.1f} ms), "
          f"{len(profile.gradients)} gradients, {total / 1e6:.2f} MB")
    print(f"link {args.bandwidth:g} GB/s, {args.latency:g} us latency; ring all-reduce")
    bandwidth, latency = args.bandwidth * 1e9, args.latency * 1e-6
    predictions = [predict(profile, n, bandwidth, latency) for n in DEVICES]
    print("\n".join(table(profile, predictions)))
    if args.plot:
        plot(profile, predictions, f"{args.net}, batch {batch} per device, measured on "
             f"{os.cpu_count()} CPUs; link {args.bandwidth:g} GB/s, {args.latency:g} us",
             args.plot)


if __name__ == "__main__":
    main()
