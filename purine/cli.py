"""The ``purine-caffe`` command: Caffe's verbs and flags (one dash or two)."""

from __future__ import annotations

import argparse
import logging
import sys

from purine.errors import PurineError, run_reporting
from purine.log import get_logger


def _flag(p: argparse.ArgumentParser, name: str, **kw) -> None:
    p.add_argument(f"-{name}", f"--{name}", **kw)


INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
MAX_THREADS = 1024  # more workers than that only contend for the same cores
MAX_REPLICAS = 4096  # each replica builds a whole copy of the net in this process


def _int_in(lo: int, hi: int, why: str = ""):
    """An argparse ``type`` that takes an integer in [lo, hi]; outside, argparse's one-line
    error (exit code 2) says the range and, when given, why it is bounded so."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(
                f"expected an integer from {lo} to {hi}{why}, got {v}")
        return v
    parse.__name__ = "integer"
    return parse


_COUNT = _int_in(0, INT32_MAX, " (a 32-bit count, as Caffe's)")
_LEVEL = _int_in(INT32_MIN, INT32_MAX, " (NetState.level is a 32-bit integer)")
_THREADS = _int_in(1, MAX_THREADS, f" (more than {MAX_THREADS} workers only contend)")
_REPLICAS = _int_in(1, MAX_REPLICAS, " (each replica is a whole copy of the net in this "
                    "process; use MPI across machines for more)")


def _stages(s: str | None) -> list[str]:
    return [x for x in (s or "").split(",") if x]


def cmd_time(args: argparse.Namespace) -> int:
    from purine.caffe import TRAIN, Net
    from purine.timing import time_net

    log = get_logger()
    gpus = _gpus(args)
    model, placement, split = args.model, None, None
    if args.placement:
        from purine.formats.prototxt import read_net
        from purine.parallel.placement import place

        split = place(read_net(args.model), args.placement, phase=TRAIN, level=args.level,
                      stages=_stages(args.stage))
        model, placement = split.net, split.placement
        log.info("Placement %s: %d layers placed, %d split into towers", args.placement,
                 len(placement), len(split.towers))
    with Net(model, phase=TRAIN, level=args.level, stages=_stages(args.stage),
             threads=args.threads, placement=placement, location=_location(gpus)) as net:
        if split is not None:  # the towers draw their parts of each Dropout mask, as in train
            split.key_streams(net.builder.stateful)
        time_net(net, args.iterations, log)  # Caffe's passes and lines
    return 0


def _gpus(args: argparse.Namespace, default: str | None = None) -> list[int]:
    """The GPU ids of ``--gpu`` (Caffe's "0", "0,1", "all"); [] for the CPU. ``default`` is
    what the solver's solver_mode/device_id ask for when --gpu is not given."""
    from purine.backend import gpu_count, gpu_unavailable, set_tf32

    spec = getattr(args, "gpu", None) or default
    if not spec:
        if getattr(args, "tf32", False):
            raise PurineError("--tf32 applies to GPU matrix products; give --gpu too")
        return []
    why = gpu_unavailable()
    if why is not None:
        raise PurineError(f"--gpu {spec}: {why}; run without --gpu to use the CPU")
    n = gpu_count()
    if spec.strip() == "all":
        ids = list(range(n))
    else:
        try:
            ids = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            raise PurineError(f"--gpu {spec}: expected GPU ids such as 0 or 0,1, or 'all'"
                              ) from None
    bad = [i for i in ids if not 0 <= i < n]
    if bad or not ids or len(set(ids)) != len(ids):
        raise PurineError(f"--gpu {spec}: this machine has {n} GPU(s), ids 0..{n - 1}, each "
                          "at most once")
    set_tf32(bool(getattr(args, "tf32", False)))
    return ids


def _local_gpu(comm) -> str:
    """``--gpu local``: the GPU whose id is this rank's index among the ranks on its machine
    (one rank per GPU, whatever the launcher's numbering)."""
    from purine.backend import gpu_count, gpu_unavailable
    from purine.parallel.mpi import local_rank

    if comm is None:
        raise PurineError("--gpu local gives each MPI rank one GPU by its rank on its machine; "
                          "launch with mpirun, or give GPU ids")
    k = local_rank(comm)  # collective: every rank asks before any may fail
    why = gpu_unavailable()
    if why is not None:
        raise PurineError(f"--gpu local: {why}; run without --gpu to use the CPU")
    if k >= gpu_count():
        raise PurineError(f"--gpu local: rank {comm.rank} is rank {k} on its machine, which "
                          f"has {gpu_count()} GPU(s); start at most that many ranks per machine")
    return str(k)


def _location(gpus: list[int]):
    from purine.graph import CPU, Location

    return Location("gpu", gpus[0]) if gpus else CPU


def cmd_train(args: argparse.Namespace) -> int:
    from purine.parallel import mpi

    comm = mpi.world(args.mpi)  # MPI: several processes train one model
    if comm is not None and comm.rank != 0:
        get_logger().setLevel(logging.WARNING)  # rank 0 alone logs
    with mpi.abort_on_error(comm):
        if comm is not None:
            shared = mpi.share_cores(comm)
            if shared:
                get_logger().info("MPI: %s", shared)
        return _train(args, comm)


def _train(args: argparse.Namespace, comm) -> int:
    from purine.caffe.solver import SignalHandler, read_solver, snapshot_seed
    from purine.parallel import build_solver

    log = get_logger()
    if args.weights and args.snapshot:
        raise PurineError("give --snapshot to resume training or --weights to fine-tune, "
                          "not both")
    param = read_solver(args.solver)
    if args.snapshot:  # Caffe: resuming ignores the solver's weights; --weights replaces them
        param.ClearField("weights")
    elif args.weights:
        param.ClearField("weights")
        param.weights.append(args.weights)
    default = None
    if not args.gpu and param.HasField("solver_mode") and param.solver_mode == param.GPU:
        from purine.backend import gpu_unavailable

        why = gpu_unavailable()
        if why is None:  # Caffe: solver_mode GPU trains on device_id (default 0)
            default = str(param.device_id)
            log.info("solver_mode is GPU: using GPU %s", default)
        else:
            log.warning("solver_mode is GPU but %s; training on the CPU", why)
    if args.gpu and args.gpu.strip() == "local":
        args.gpu = _local_gpu(comm)
    gpus = _gpus(args, default)  # under MPI: these GPUs on every rank, one NCCL communicator
    if comm is not None:
        from purine.parallel.mpi import same_on_every_rank

        # collective, before any rank builds: a rank on the CPU beside ranks on GPUs, or
        # ranks of unequal GPU counts, would issue different collectives
        same_on_every_rank(comm, len(gpus), "the number of GPUs (--gpu)")
        per_rank = len(gpus) if len(gpus) > 1 else args.replicas
        if args.staleness is None:  # Downpour logs its own layout
            log.info("MPI: %d ranks x %d replicas (%d replicas in all)", comm.size, per_rank,
                     comm.size * per_rank)
    if gpus and args.staleness is not None:
        raise PurineError("--async runs on the CPU; drop --gpu or --async")
    if len(gpus) > 1 and args.replicas > 1:
        raise PurineError("--replicas with several GPUs: each GPU is one replica (give "
                          "--gpu 0,1,... alone)")
    if args.level is not None:
        param.train_state.level = args.level
    param.train_state.stage.extend(_stages(args.stage))
    if args.iterations is not None:  # its range was checked with the arguments
        param.max_iter = args.iterations
    if args.snapshot and param.random_seed < 0:  # resume with the run's own random streams
        seed = snapshot_seed(args.snapshot)
        if seed is not None:
            param.random_seed = seed
    if args.placement and args.staleness is not None:
        raise PurineError("--placement with --async is not supported: a placed net trains "
                          "synchronously")
    if args.staleness is not None:  # asynchronous: a parameter server and stale replicas
        if comm is not None:  # Downpour over MPI: rank 0 serves, every other rank works
            if args.replicas > 1:
                raise PurineError("--async under MPI runs one worker per rank: drop "
                                  "--replicas and start more ranks")
            if args.trace:
                raise PurineError("--trace with --async under MPI is not supported: the "
                                  "workers' passes run in other processes")
            from purine.parallel import mpi_async

            return mpi_async.leave(*mpi_async.train(
                param, comm, staleness=args.staleness, heartbeat=args.heartbeat,
                resume=args.snapshot, sigint=args.sigint_effect, sighup=args.sighup_effect,
                log=log, path=args.solver, threads=args.threads))
        solver = build_solver(param, path=args.solver, threads=args.threads, log=log,
                              replicas=args.replicas, staleness=args.staleness)
    else:
        replicas, others = args.replicas, None
        if len(gpus) > 1:  # one replica per GPU, each taking batch_size samples
            from purine.graph import Location

            replicas, others = len(gpus), [Location("gpu", i) for i in gpus[1:]]
            log.info("Training on GPUs %s (one replica each)", ",".join(map(str, gpus)))
        solver = build_solver(param, path=args.solver, threads=args.threads, log=log,
                              replicas=replicas, comm=comm, replica_locations=others,
                              location=_location(gpus), share_memory=args.share_memory,
                              placement=args.placement, update_worker=args.update_worker)
        if args.placement:
            log.info("Placement %s: each layer it names runs where it says, split into towers "
                     "where it gives several locations", args.placement)
    with solver:  # closed on the way out, an error's too: its databases are free again
        if args.trace and args.staleness is not None:  # async: trace one push up front
            if args.snapshot:
                solver.restore(args.snapshot)
                args.snapshot = None
            solver.trace_iteration(args.trace)
        elif args.trace:
            solver.trace_path = args.trace  # the first iteration the solve runs
        with SignalHandler(args.sigint_effect, args.sighup_effect) as signals:
            solver.requested = signals
            solver.solve(resume=args.snapshot)
    return 0


def cmd_test(args: argparse.Namespace) -> int:
    import numpy as np

    from purine.backend import to_host
    from purine.caffe import TEST, Net
    from purine.converters.progress import Progress

    log = get_logger()
    gpus = _gpus(args)
    with Net(args.model, phase=TEST, level=args.level or 0, stages=_stages(args.stage),
             location=_location(gpus)) as net:
        if args.weights:
            net.copy_from(args.weights)
        else:
            log.warning("no --weights given: testing the net's initial weights")
        log.info("Running for %d iterations.", args.iterations)
        weights = {b.name: w for b, w in net.builder.loss_tops}  # by name: any build
        sums: dict[str, np.ndarray] = {}
        loss = 0.0
        with Progress(args.iterations, "test", unit="batch", log=log) as progress:
            for i in range(args.iterations):
                out = net.forward()
                loss += net.loss
                for name, v in out.items():
                    v = to_host(v).astype(np.float64).ravel()
                    sums[name] = sums.get(name, 0) + v
                    for k, x in enumerate(v):
                        label = name if v.size == 1 else f"{name}[{k}]"
                        log.info("Batch %d, %s = %g", i, label, x)
                progress.update(i + 1)
        n = max(1, args.iterations)
        log.info("Loss: %g", loss / n)
        for name, total in sums.items():
            w = weights.get(net.builder.data[name].name, 0.0)
            for x in total / n:
                extra = f" (* {w:g} = {w * x:g} loss)" if w else ""
                log.info("%s = %g%s", name, x, extra)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from purine.demo import run_demo

    run_demo(args.dir, max_iter=args.iterations, threads=args.threads,
             data_only=args.data_only)  # its last line says where its files are
    return 0


def cmd_device_query(args: argparse.Namespace) -> int:
    import os

    from purine.backend import gpu_device_properties, gpu_unavailable

    log = get_logger()
    log.info("CPU: %d cores (numpy backend)", os.cpu_count() or 1)
    why = gpu_unavailable()
    if why is not None:
        if args.gpu:
            raise PurineError(f"--gpu {args.gpu}: {why}")
        log.info("GPU: none (%s)", why)
        return 0
    for i in _gpus(args) if args.gpu else _gpus(args, "all"):
        log.info("Querying GPUs %d", i)
        for key, value in gpu_device_properties(i).items():
            log.info("%-28s %s", key, value)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="purine-caffe",
        description="Train and run Caffe models (prototxt, caffemodel, LMDB) without Caffe.")
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True

    p = sub.add_parser("time", help="benchmark the forward and backward pass of a net, "
                                    "per layer, as `caffe time` does")
    _flag(p, "model", required=True, help="the net prototxt")
    _flag(p, "iterations", type=_COUNT, default=50, help="iterations to time (default 50)")
    _flag(p, "gpu", default=None, help="GPU ids: 0, or 0,1 (one replica each), or all")
    _flag(p, "tf32", action="store_true",
          help="TF32 tensor cores in GPU matrix products (faster, ~1e-3 relative error)")
    _flag(p, "level", type=_LEVEL, default=0, help="NetState level")
    _flag(p, "stage", default=None, help="comma-separated NetState stages")
    _flag(p, "threads", type=_THREADS, default=1,
          help="spread the ops over this many dispatcher worker threads")
    _flag(p, "placement", default=None,
          help="a placement file: where each named layer runs; a layer given several "
               "locations is split into towers (models/bvlc_alexnet/two_tower.placement)")
    p.set_defaults(run=cmd_time)

    p = sub.add_parser("train", help="train a model from a solver prototxt")
    _flag(p, "solver", required=True, help="the solver prototxt")
    _flag(p, "weights", default=None,
          help="comma-separated .caffemodel (or .caffemodel.h5) files to fine-tune "
               "from (copied by layer name); replaces the solver's weights field")
    _flag(p, "snapshot", default=None,
          help="a .solverstate (or .solverstate.h5) to resume training from")
    _flag(p, "gpu", default=None,
          help="GPU ids: 0, or 0,1 (one replica each), or all; under mpirun the same ids on "
               "every rank, or local: one GPU per rank, by its rank on its machine")
    _flag(p, "tf32", action="store_true",
          help="TF32 tensor cores in GPU matrix products (faster, ~1e-3 relative error)")
    _flag(p, "iterations", type=_COUNT, default=None, help="override the solver's max_iter")
    _flag(p, "sigint_effect", default="stop", choices=["stop", "snapshot", "none"],
          help="what Ctrl-C does (default stop)")
    _flag(p, "sighup_effect", default="snapshot", choices=["stop", "snapshot", "none"],
          help="what SIGHUP does (default snapshot)")
    _flag(p, "level", type=_LEVEL, default=None, help="the train net's NetState level")
    _flag(p, "stage", default=None, help="comma-separated stages added to the train net")
    _flag(p, "threads", type=_THREADS, default=1,
          help="spread the ops over this many dispatcher worker threads")
    _flag(p, "replicas", type=_REPLICAS, default=1,
          help="data-parallel CPU replicas, each taking batch_size samples per iteration "
               "(gradients are averaged: N replicas train as one net with N x batch_size); "
               "under mpirun, per rank")
    p.add_argument("-share-memory", "--share-memory", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="let blobs whose lifetimes in an iteration do not overlap share "
                        "buffers (the memory planner; default on)")
    _flag(p, "async", dest="staleness", type=_COUNT, default=None, metavar="S",
          help="asynchronous parameter-server training (Downpour style): the --replicas "
               "replicas pull the weights, compute and push their gradients on their own, "
               "each push one solver iteration; a replica waits while it is more than S "
               "pushes ahead of the slowest (0: in rounds). Not deterministic. Under "
               "mpiexec -n N: rank 0 is the server and ranks 1..N-1 one worker each")
    _flag(p, "heartbeat", type=_int_in(1, 86400, " (seconds)"), default=30, metavar="T",
          help="--async under MPI: a worker (or the server) silent for T seconds is lost; "
               "training goes on with the others (default 30)")
    p.add_argument("-mpi", "--mpi", action=argparse.BooleanOptionalAction, default=None,
                   help="train one model across the processes of `mpirun -np R` (needs "
                        "mpi4py; the default when an MPI launcher started several): rank k "
                        "runs replicas k*N..k*N+N-1 of R*N, gradients are averaged over all, "
                        "rank 0 alone logs and snapshots")
    _flag(p, "trace", default=None,
          help="write a Chrome trace (chrome://tracing, Perfetto) of the first iteration")
    _flag(p, "placement", default=None,
          help="a placement file (model parallelism): where each named layer runs and "
               "updates its parameters; a layer given several locations is split into towers; "
               "snapshots stay the unsplit net's files")
    _flag(p, "update-worker", action="store_true", dest="update_worker",
          help="run the solver's update ops on a dispatcher worker of their own, beside the "
               "backward pass (same numbers; off by default: on 2 cores it was 0.88-1.0x "
               "as fast, bench/update_worker.py)")
    p.set_defaults(run=cmd_train)

    p = sub.add_parser("test", help="score a model: run the TEST net and average outputs")
    _flag(p, "model", required=True, help="the net prototxt")
    _flag(p, "weights", default=None, help="the .caffemodel to test")
    _flag(p, "iterations", type=_COUNT, default=50, help="batches to run (default 50)")
    _flag(p, "gpu", default=None, help="GPU ids: 0, or 0,1 (one replica each), or all")
    _flag(p, "tf32", action="store_true",
          help="TF32 tensor cores in GPU matrix products (faster, ~1e-3 relative error)")
    _flag(p, "level", type=_LEVEL, default=None, help="NetState level")
    _flag(p, "stage", default=None, help="comma-separated NetState stages")
    p.set_defaults(run=cmd_test)

    from purine.converters import (
        binaryproto,
        compute_image_mean,
        convert_imageset,
        create_annoset,
        extract_features,
    )

    for name, module, text in (
        ("convert_imageset", convert_imageset,
         "images and a list file -> an LMDB or LevelDB of Datums, as Caffe's convert_imageset"),
        ("create_annoset", create_annoset,
         "images and box files -> an LMDB of AnnotatedDatums, as SSD's create_annoset"),
        ("compute_image_mean", compute_image_mean,
         "the mean image of an LMDB or LevelDB -> .binaryproto, as Caffe's compute_image_mean"),
        ("extract_features", extract_features,
         "a trained net's blobs over its data -> LMDBs or LevelDBs of Datums, as Caffe's "
         "extract_features"),
        ("binaryproto", binaryproto, "convert .binaryproto <-> .npy"),
    ):
        module.add_arguments(sub.add_parser(name, help=text))

    from purine.converters import caffe_datasets

    for name, (add, text) in caffe_datasets.TOOLS.items():
        add(sub.add_parser(name, help=text))

    from purine.converters import upgrade

    for name, (add, text) in upgrade.TOOLS.items():
        add(sub.add_parser(name, help=text))

    from purine import draw
    from purine.converters import caffemodel_npz, onnx_export, pytorch_export, summary

    for name, module, text in (
        ("caffemodel_to_npz", caffemodel_npz,
         "a .caffemodel's parameter blobs -> .npz of 'layer/index' arrays"),
        ("caffemodel_summary", summary,
         "a table of a .caffemodel's layers, blob shapes and parameter counts"),
        ("caffe_to_onnx", onnx_export, "a deploy prototxt and its .caffemodel -> an ONNX model"),
        ("caffe_to_pytorch", pytorch_export,
         "a deploy prototxt and its .caffemodel -> a PyTorch module and .safetensors"),
        ("draw", draw, "draw a net's bi-graph or layer view as Graphviz .dot/.svg/.png"),
    ):
        module.add_arguments(sub.add_parser(name, help=text))
    caffemodel_npz.add_npz_arguments(sub.add_parser(
        "npz_to_caffemodel", help="an .npz of 'layer/index' arrays + a net prototxt -> "
                                  ".caffemodel"))

    from purine.converters import plot, training_log

    for name, module, text in (
        ("parse_log", training_log,
         "a training log -> the LOG.train and LOG.test CSVs of Caffe's parse_log.py"),
        ("plot", plot, "training curves (loss, test outputs, lr) of one or more logs -> "
                       ".png/.svg (needs matplotlib)"),
    ):
        module.add_arguments(sub.add_parser(name, help=text))

    p = sub.add_parser("demo", help="train Caffe's LeNet on the embedded MNIST digits "
                                    "(offline, about half a minute on 2 cores)")
    _flag(p, "dir", default="purine-demo", help="where the LMDBs and the final snapshot go "
                                               "(default ./purine-demo; examples/mnist "
                                               "gives models/lenet the LMDBs it expects)")
    _flag(p, "iterations", type=_COUNT, default=1000, help="training iterations (default 1000)")
    _flag(p, "threads", type=_THREADS, default=1, help="dispatcher worker threads")
    _flag(p, "data-only", action="store_true",
          help="write the two LMDBs and exit (--dir examples/mnist: models/lenet's data)")
    p.set_defaults(run=cmd_demo)

    sub.add_parser("python", help="run a pycaffe script, module (-m) or notebook kernel with "
                                  "`import caffe` giving purine-caffe (purine-caffe python -h)",
                   add_help=False)

    p = sub.add_parser("device_query", help="show the devices purine-caffe can use")
    _flag(p, "gpu", default=None, help="GPU ids to query")
    p.set_defaults(run=cmd_device_query)
    return parser


def _pycaffe_face() -> bool:
    from purine import pycaffe

    return pycaffe.install_as_caffe()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["python"]:  # its arguments are Python's, not argparse's
        from purine.pycaffe import run

        return run.main(argv[1:])
    args = build_parser().parse_args(argv)
    # A user's Python layer module that says `import caffe` gets the whole pycaffe face, as
    # under Caffe's own tool: registered here, imported only when a net has a Python layer
    # (pycaffe, once imported, has registered itself).
    if "purine.pycaffe" not in sys.modules:
        from purine.caffe.layers.python import provide_caffe

        provide_caffe(_pycaffe_face)
    return run_reporting(f"purine-caffe {args.command}", lambda: args.run(args))


if __name__ == "__main__":
    sys.exit(main())
