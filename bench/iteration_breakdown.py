"""Where each microsecond of one training iteration goes: the kernels, op type by op type,
the dispatcher between them, and the solver's step around the passes.

    python bench/iteration_breakdown.py [--net lenet] [--iterations 50]

The net trains as in bench/train_loop.py (its Data layer reading a temporary LMDB of raw
Datums, SGD with momentum, ``Solver.step`` in-process). First the plain rate: the median
over blocks of ``step(10)`` per iteration, nothing profiled. Then ``--iterations`` profiled
iterations, one ``step(1)`` each: the dispatcher's trace gives each op's kernel time (medians
per op type); "between the ops" is the span from the first op's start to the last op's end
less the kernel times (the dispatcher choosing, recording and handing over, per op);
"around the passes" is the rest of ``step(1)`` (the solver's bookkeeping, the learning rate
on the host, the loss read back). Profiling itself adds a little to both of those.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_nets import NETS, load_kernels, train_net_param  # noqa: E402
from train_loop import SETTINGS, write_lmdb  # noqa: E402


def solver_for(name: str, db: str):
    from purine.caffe.solver import Solver
    from purine.formats import caffe_pb2 as pb
    from purine.formats.prototxt import parse_text

    _, _, transform, lr, decay = SETTINGS[name]
    net = train_net_param(name)
    net.layer[0].CopyFrom(parse_text(
        f'name: "data" type: "Data" top: "data" top: "label" transform_param {{ {transform} }}'
        f' data_param {{ source: "{db}" backend: LMDB batch_size: {NETS[name][1][0]} }}',
        pb.LayerParameter()))
    param = pb.SolverParameter(base_lr=lr, momentum=0.9, weight_decay=decay, lr_policy="fixed",
                               max_iter=10 ** 9, random_seed=1, display=0,
                               snapshot_after_train=False)
    param.net_param.CopyFrom(net)
    return Solver(param)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", default="lenet", choices=list(SETTINGS))
    ap.add_argument("--iterations", type=int, default=50)
    args = ap.parse_args()
    from purine.backend import onednn

    load_kernels()
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "train_lmdb")
        write_lmdb(args.net, db, 2000)
        with solver_for(args.net, db) as s:
            s.step(5)
            blocks = []
            for _ in range(max(3, args.iterations // 10)):
                t0 = time.perf_counter()
                s.step(10)
                blocks.append((time.perf_counter() - t0) / 10 * 1e6)
            plain = statistics.median(blocks)
            d = s.net.dispatcher
            per_type: dict[str, list[float]] = {}
            calls: dict[str, int] = {}
            between, around, steps, ops = [], [], [], []
            for _ in range(args.iterations):
                d.profile, d.trace = True, []
                t0 = time.perf_counter()
                s.step(1)
                wall = time.perf_counter() - t0
                d.profile = False
                trace = d.trace
                kernels: dict[str, float] = {}
                for e in trace:
                    kernels[e.op.type] = kernels.get(e.op.type, 0.0) + (e.end - e.start)
                for k, v in kernels.items():
                    per_type.setdefault(k, []).append(v * 1e6)
                calls = {k: sum(e.op.type == k for e in trace) for k in kernels}
                span = max(e.end for e in trace) - min(e.start for e in trace)
                busy = sum(kernels.values())
                between.append((span - busy) * 1e6)
                around.append((wall - span) * 1e6)
                steps.append(wall * 1e6)
                ops.append(len(trace))
    med = {k: statistics.median(v) for k, v in per_type.items()}
    step = statistics.median(steps)
    print(f"{args.net}, batch {NETS[args.net][1][0]}, convolutions: {onednn.describe()}")
    print(f"an iteration, unprofiled (step(10) / 10): {plain:8.0f} us")
    print(f"an iteration, profiled (step(1)):         {step:8.0f} us, {statistics.median(ops):.0f}"
          " ops")
    print(f"{'op type':28s} {'calls':>5s} {'us':>8s} {'% of step':>9s}")
    for k, v in sorted(med.items(), key=lambda kv: -kv[1]):
        print(f"{k:28s} {calls[k]:5d} {v:8.0f} {100 * v / step:8.1f}%")
    kern = sum(med.values())
    b, a = statistics.median(between), statistics.median(around)
    n = statistics.median(ops)
    print(f"{'kernels, all':28s} {'':5s} {kern:8.0f} {100 * kern / step:8.1f}%")
    print(f"{'between the ops':28s} {'':5s} {b:8.0f} {100 * b / step:8.1f}%   "
          f"({b / n:.1f} us per op)")
    print(f"{'around the passes':28s} {'':5s} {a:8.0f} {100 * a / step:8.1f}%")


if __name__ == "__main__":
    main()
