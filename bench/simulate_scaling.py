"""Predicted data-parallel scaling to N = 2..64 devices from one rank's measured per-op
times and the graph, with and without overlapping the gradient exchange with the backward
pass, beside the 2-rank efficiency bench/mpi_scaling.py measures in the same run.

    python bench/simulate_scaling.py [--net cifar10_quick|alexnet|lenet] [--batch B]
        [--iterations N] [--bandwidth GB/s] [--latency us] [--ranks-per-machine R]
        [--measure-repeat K] [--plot out.png]

Measurement: the net's train phase (its Data layer replaced by constant DummyData of the
same shape) runs ``--iterations`` solver iterations in a child process with one BLAS thread
(as bench/mpi_scaling.py runs a rank) and the dispatcher's profiler on, after one warm-up;
each op's time is its median. From the program order of the forward and backward ops
follows, for every parameter gradient, the time when it is ready; its size is the
gradient blob's; its update is the parameter's ``prepare`` and ``update`` ops.

Calibration, on this machine, each run: ``contention``: R such children at once, their
forward/backward time over the lone child's; the link: a 2-rank MPI Allreduce of 8 bytes
(2 latency steps) and of 4 MB (adds the bytes over the bandwidth and MPI's sum of half of
them); ``memory_bandwidth``: numpy's ``a += b`` over 64 MB; the per-message cost: the lone
child's wall time less its ops' time, per op (the dispatcher's cost of one op, which an
exchange op pays too); cores per rank: the CPUs over R.

Model (``predict``, ``iteration_s``), as purine runs a rank over MPI: the forward and
backward ops on the compute thread; on one more thread, first come first served, each
gradient's exchange (in purine's order, once ready) and each parameter's update (once its
exchange is done). An exchange of b bytes over N ranks costs a ring all-reduce,
``2(N-1)/N * b / bandwidth + 2(N-1) * latency``, plus the per-message cost, plus the sums
(``(N-1)/N * b``) and the mean's scale (``b``) at the memory bandwidth; MPI polls, so its
thread is busy throughout. While both threads run they share the rank's cores (each gets
min(1, cores / 2)); the iteration ends when both are done. Without overlap the exchanges
start after the backward pass. Speed-up is N x one device's iteration (its ops, updates
after the backward pass) over the predicted one; efficiency is speed-up / N. Not
modelled: stragglers and the per-iteration loss all-reduce, the data pipeline (the
measured figure reads an LMDB), network contention beyond the ring.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benches' shared parts

DEVICES = (2, 4, 8, 16, 32, 64)
RESULT = "simulate_scaling result: "  # the line a measuring child prints
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


@dataclass(frozen=True)
class Machine:
    """What one rank's iteration is charged besides its measured ops. ``bandwidth`` (bytes/s)
    and ``latency`` (s per ring step): the link; ``message_s``: the CPU cost of one exchange
    op (the dispatcher's and the MPI call's); ``memory_bandwidth``: bytes/s of gradient that
    the reduction sums (and scales by 1/N); ``cores``: the cores one rank has for its
    compute thread and its exchange/update thread; ``contention``: how much slower the
    forward and backward ops run while the machine's other ranks compute too."""

    bandwidth: float
    latency: float
    message_s: float = 0.0
    memory_bandwidth: float = float("inf")
    cores: float = float("inf")
    contention: float = 1.0


def ring_all_reduce_s(nbytes: int, devices: int, bandwidth: float, latency: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``devices`` (bandwidth in bytes/s,
    latency in s per step); 0 for one device."""
    n = devices
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def exchange_s(nbytes: int, devices: int, m: Machine) -> float:
    """One gradient's exchange op: the ring, the per-message cost, and the arithmetic: the
    reduce-scatter sums N-1 chunks of b/N into this rank's, and the mean scales all b."""
    if devices <= 1:
        return 0.0
    arithmetic = ((devices - 1) / devices + 1) * nbytes / m.memory_bandwidth
    return (ring_all_reduce_s(nbytes, devices, m.bandwidth, m.latency) + m.message_s
            + arithmetic)


def iteration_s(profile: Profile, cost: Sequence[float], m: Machine, overlap: bool) -> float:
    """One iteration on one rank, as purine runs it over MPI: the forward and backward ops
    on the compute thread (``contention`` times slower); the exchanges (in order, each once
    its gradient is ready, or all after the backward pass without ``overlap``) and each
    parameter's update (once its exchange is done) on one more thread, first come first
    served. MPI waits by polling, so an exchange keeps its thread busy throughout. While
    both threads run, each gets min(1, cores / 2) of a core (processor sharing). The
    iteration ends when both threads are done."""
    grads = profile.gradients
    total = profile.compute_s * m.contention
    ready = [total if not overlap else g.ready_s * m.contention for g in grads]
    both, alone = min(1.0, m.cores / 2), min(1.0, m.cores)
    t, done = 0.0, 0.0                          # the clock; compute work done
    queue: list[tuple[str, int, float]] = []    # the exchange thread's jobs, in arrival
    job: list | None = None                     # [kind, k, work left] running there
    nxt, queued = 0, False                      # the next exchange; whether it is on its way
    while True:
        if not queued and nxt < len(grads) and done >= ready[nxt] - 1e-15:
            queue.append(("x", nxt, cost[nxt]))
            queued = True
        if job is None and queue:
            job = list(queue.pop(0))
        computing, serving = done < total - 1e-15, job is not None
        if not computing and not serving:
            return t
        rate_c = both if serving else alone
        rate_s = both if computing else alone
        steps = []
        if computing:  # to the next gradient the exchanges wait for, or the end
            goal = min(total, ready[nxt]) if not queued and nxt < len(grads) else total
            steps.append((goal - done) / rate_c)
        if serving:
            steps.append(job[2] / rate_s)
        dt = min(steps)
        t += dt
        if computing:
            done = min(total, done + dt * rate_c)
        if serving:
            job[2] -= dt * rate_s
            if job[2] <= 1e-15:
                kind, k, _ = job
                job = None
                if kind == "x":  # its update may run, and the next exchange may start
                    queue.append(("u", k, grads[k].update_s))
                    nxt, queued = nxt + 1, False


def predict(profile: Profile, devices: int, machine: Machine) -> Prediction:
    """The iteration time on ``devices`` devices, without and with overlap (module doc)."""
    cost = [exchange_s(g.nbytes, devices, machine) for g in profile.gradients]
    return Prediction(devices, iteration_s(profile, cost, machine, overlap=False),
                      iteration_s(profile, cost, machine, overlap=True))


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


def measure(param, iterations: int) -> tuple[Profile, float, int]:
    """The profile of ``iterations`` profiled iterations (median per op), their mean wall
    time in seconds and the number of ops of one iteration."""
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
        return (profile_ops(s, {op: statistics.median(v) for op, v in times.items()}), wall,
                len(times))


# -- calibrating: what the model charges, measured on this machine ---------------------------
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _child(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, **ONE_THREAD,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(child: subprocess.Popen) -> dict:
    out, err = child.communicate(timeout=1800)
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
    if child.returncode or not lines:
        sys.exit(f"simulate_scaling: a measuring child failed:\n{out}{err}")
    return json.loads(lines[-1].removeprefix(RESULT))


def profile_json(profile: Profile, wall: float, ops: int) -> dict:
    return {"compute_s": profile.compute_s, "wall": wall, "ops": ops,
            "gradients": [[g.name, g.nbytes, g.ready_s, g.update_s] for g in profile.gradients]}


def profile_from_json(d: dict) -> tuple[Profile, float, int]:
    return (Profile(d["compute_s"], tuple(Gradient(*g) for g in d["gradients"])), d["wall"],
            d["ops"])


def measure_alone_and_together(net: str, batch: int | None, iterations: int,
                               ranks: int) -> tuple[Profile, float, int, float]:
    """One rank's profile, measured alone with one BLAS thread (as bench/mpi_scaling.py runs
    a rank), then ``ranks`` copies measured at once: the contention is the mean of their
    forward/backward time over the lone one's."""
    extra = ["--measure-only", "--net", net, "--iterations", str(iterations)]
    extra += ["--batch", str(batch)] if batch else []
    profile, wall, ops = profile_from_json(_result(_child(extra)))
    together = [_child(extra) for _ in range(ranks)]
    slow = [profile_from_json(_result(c))[0].compute_s for c in together]
    return profile, wall, ops, statistics.mean(slow) / profile.compute_s


def memory_bandwidth(nbytes: int = 64 << 20) -> float:
    """Bytes/s of one operand that ``a += b`` sums on this machine (the reduction's kernel),
    best of 5 over arrays far larger than the caches."""
    import numpy as np

    a, b = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def link_probe(small: int, large: int, repeat: int) -> None:
    """Under mpiexec -n 2: rank 0 prints the median seconds of an Allreduce of ``small``
    and of ``large`` bytes (float32, in place), each rank one BLAS thread."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = {}
    for nbytes in (small, large):
        x = np.ones(max(1, nbytes // 4), np.float32)
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)  # connections set up
        times = []
        for _ in range(repeat):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            times.append(time.perf_counter() - t0)
        out[str(nbytes)] = statistics.median(times)
    if comm.rank == 0:
        print(RESULT + json.dumps(out), flush=True)


def measure_link(memory: float, small: int = 8, large: int = 4 << 20
                 ) -> tuple[float, float] | None:
    """(bandwidth, latency) of the 2-rank MPI link here, from Allreduce timings: a tiny one
    is 2 latency steps; a large one adds b / bandwidth (2(N-1)/N = 1 at N = 2) and MPI's sum
    of b/2 bytes. None without mpi4py or mpiexec."""
    from mpi_scaling import missing, mpiexec

    if missing():
        return None
    env = dict(os.environ, **ONE_THREAD,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([mpiexec(), "-n", "2", sys.executable, os.path.abspath(__file__),
                          "--link-probe"], env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(RESULT)]
    if run.returncode or not lines:
        return None
    t = json.loads(lines[-1].removeprefix(RESULT))
    t_small, t_large = t[str(small)], t[str(large)]
    moving = max(t_large - t_small - 0.5 * large / memory, 1e-9)
    return large / moving, t_small / 2


def measured_efficiency(net: str, iterations: int, repeat: int) -> tuple[float | None, str]:
    """bench/mpi_scaling.py's 2-rank efficiency for ``net``, run now, and its summary line;
    None where it does not run that net or MPI is missing."""
    from mpi_scaling import NETS as MEASURED

    if net not in MEASURED:
        return None, f"not measured: bench/mpi_scaling.py runs {', '.join(MEASURED)}"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "mpi_scaling.py"),
                          "--net", net, "--iterations", str(iterations), "--repeat",
                          str(repeat)], stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=3600)
    found = re.search(r"^efficiency ([0-9.]+)", run.stdout, re.M)
    if run.returncode or not found:
        return None, f"not measured: bench/mpi_scaling.py: {run.stdout}{run.stderr}".strip()
    runs = [ln for ln in run.stdout.splitlines() if "rank(s):" in ln]
    return float(found[1]), "; ".join(ln.strip() for ln in runs)


# -- output ---------------------------------------------------------------------------------
def table(profile: Profile, predictions: Sequence[Prediction],
          measured: dict[int, float] | None = None) -> list[str]:
    """The predictions, and beside a device count with a measured efficiency that figure
    and the error of the prediction with overlap (purine overlaps), in points."""
    one, measured = profile.one_device_s, measured or {}
    rows = ["    N  no overlap ms  overlap ms  speed-up (no / with)  efficiency (no / with)"
            "  measured  error",
            f"    1  {one * 1e3:13.1f}  {one * 1e3:10.1f}  {1:9.2f} / {1:<8.2f}"
            f"  {1:11.2f} / {1:.2f}"]
    for p in predictions:
        n = p.devices
        row = (f"{n:5d}  {p.serial_s * 1e3:13.1f}  {p.overlap_s * 1e3:10.1f}  "
               f"{n * one / p.serial_s:9.2f} / {n * one / p.overlap_s:<8.2f}  "
               f"{one / p.serial_s:11.2f} / {one / p.overlap_s:.2f}")
        if n in measured:
            row += f"  {measured[n]:8.2f}  {(one / p.overlap_s - measured[n]) * 100:+5.1f}"
        rows.append(row)
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
    ap.add_argument("--bandwidth", type=float, default=None,
                    help="link GB/s (default: measured between 2 MPI ranks here, else 1.25)")
    ap.add_argument("--latency", type=float, default=None,
                    help="per-step latency in us (default: measured as the bandwidth)")
    ap.add_argument("--ranks-per-machine", type=int, default=2,
                    help="ranks sharing one machine's cores (default 2, as mpi_scaling runs)")
    ap.add_argument("--measure-repeat", type=int, default=3,
                    help="bench/mpi_scaling.py's --repeat for the measured 2-rank figure; 0: "
                         "do not measure")
    ap.add_argument("--plot", default=None, help="write the curves to this PNG")
    ap.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--link-probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.link_probe:
        link_probe(8, 4 << 20, 50)
        return
    if args.measure_only:
        profile, wall, ops = measure(solver_param(args.net, args.batch), args.iterations)
        print(RESULT + json.dumps(profile_json(profile, wall, ops)), flush=True)
        return
    param = solver_param(args.net, args.batch)
    batch = next(layer.dummy_data_param.shape[0].dim[0] for layer in param.net_param.layer
                 if layer.type == "DummyData")
    ranks = args.ranks_per_machine
    profile, wall, ops, contention = measure_alone_and_together(args.net, args.batch,
                                                                args.iterations, ranks)
    memory = memory_bandwidth()
    link = measure_link(memory)
    where = "measured between 2 MPI ranks here" if link else "given (no MPI to measure)"
    bandwidth, latency = link or (1.25e9, 25e-6)
    if args.bandwidth is not None:
        bandwidth, where = args.bandwidth * 1e9, "given"
    if args.latency is not None:
        latency = args.latency * 1e-6
    machine = Machine(bandwidth, latency, message_s=max(wall - profile.one_device_s, 0) / ops,
                      memory_bandwidth=memory, cores=(os.cpu_count() or 1) / ranks,
                      contention=contention)
    total = sum(g.nbytes for g in profile.gradients)
    print(f"{args.net}, batch {batch} per device, {args.iterations} profiled iterations, one "
          f"BLAS thread: ops {profile.one_device_s * 1e3:.1f} ms per iteration (wall "
          f"{wall * 1e3:.1f} ms), {len(profile.gradients)} gradients, {total / 1e6:.2f} MB")
    print(f"link {bandwidth / 1e9:.3g} GB/s, {latency * 1e6:.3g} us per step ({where}); "
          f"ring all-reduce; {machine.message_s * 1e6:.0f} us per message (the dispatcher's "
          f"cost per op); sums at {memory / 1e9:.3g} GB/s; {ranks} ranks per machine: "
          f"{machine.cores:g} core(s) each, forward/backward x{contention:.2f} together")
    measured = {}
    if args.measure_repeat > 0:
        efficiency, how = measured_efficiency(args.net, 20, args.measure_repeat)
        print(f"bench/mpi_scaling.py now: {how}")
        if efficiency is not None:
            measured[2] = efficiency
    predictions = [predict(profile, n, machine) for n in DEVICES]
    print("\n".join(table(profile, predictions, measured)))
    if args.plot:
        plot(profile, predictions, f"{args.net}, batch {batch} per device, measured on "
             f"{os.cpu_count()} CPUs; link {bandwidth / 1e9:.3g} GB/s, "
             f"{latency * 1e6:.3g} us", args.plot)


if __name__ == "__main__":
    main()
