"""Does a dispatcher worker of their own for the solver's update ops pay? Images/s of whole
training iterations (LMDB Data layer, forward, backward, SGD update) with the update ops on
the net's worker (the sequential order) and on a second worker, where a parameter's update
runs as soon as its gradient is final, beside the rest of the backward pass. The two
settings alternate, ``--repeat`` times each, so a slow spell of this shared machine hits
both; the table gives every run and the ratio of the medians.

    python bench/update_worker.py [--net lenet|cifar10_quick] [--iterations 30] [--repeat 5]
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

from data_parallel import NETS, database, solver  # noqa: E402

from purine.caffe.solver import Solver  # noqa: E402


def images_per_s(param, update_worker: bool, iterations: int) -> float:
    with Solver(param, update_worker=update_worker) as s:
        batch = s.net.builder.data[s.net.inputs[0]].shape[0] if s.net.inputs else next(
            lp.data_param.batch_size for lp in param.net_param.layer if lp.type == "Data"
            and (not lp.include or lp.include[0].phase == 0))
        s.step(3)  # warm-up: caches, prefetch queue, first-use allocations
        t0 = time.perf_counter()
        s.step(iterations)
        return iterations * batch / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="cifar10_quick", choices=sorted(NETS))
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        param = solver(args.net, database(args.net, tmp))
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeat):
            for worker in (False, True):
                runs[worker].append(images_per_s(param, worker, args.iterations))
        print(f"{os.cpu_count()} CPUs, {args.net}, {args.iterations} iterations per run, "
              f"PURINE_ONEDNN={os.environ.get('PURINE_ONEDNN', '(default)')}")
        for worker, rates in runs.items():
            name = "update ops on a worker of their own" if worker else "one worker"
            print(f"{name:>36}: " + " ".join(f"{r:7.0f}" for r in rates)
                  + f"  median {statistics.median(rates):7.0f} images/s")
        ratio = statistics.median(runs[True]) / statistics.median(runs[False])
        print(f"own update worker / one worker: {ratio:.3f} (above 1: the worker pays)")


if __name__ == "__main__":
    main()
