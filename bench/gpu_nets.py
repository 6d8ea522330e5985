"""GPU training images/s (forward + backward + SGD update) and peak GPU memory of AlexNet
(batch 256), LeNet (batch 64) and CIFAR-10 quick (batch 100): purine-caffe beside PyTorch
eager fp32 on the same GPU in the same run.

    python bench/gpu_nets.py [--iterations N] [--warmup W] [--nets lenet,cifar10_quick,...]
                             [--device gpu|cpu] [--tf32] [--workdir DIR] [--skip-torch]

Nets: lenet, cifar10_quick, alexnet (the TRAIN nets of models/, data layers replaced by Input
layers whose arrays are written once: data from memory) and alexnet_lmdb (AlexNet's TRAIN net
reading a raw LMDB of random 3x256x256 uint8 Datums through the real Data layer: crop 227,
mirror, mean_value 104/117/123 standing in for the mean file; the LMDB is written once and
kept in --workdir).

purine-caffe trains with its Solver (base_lr 0.01, momentum 0.9, weight_decay 5e-4, fixed
policy); PyTorch with the same architectures in torch.nn, torch.optim.SGD with the same
hyperparameters and CrossEntropyLoss, inputs already on the GPU, TF32 off unless --tf32,
cudnn.benchmark on. PyTorch uses cuDNN; purine-caffe does not.

Each (framework, net) pair runs in a fresh subprocess, so its memory figures are its own.
Per pair: W warm-up steps, then N steps each followed by a synchronize (their median is
"step ms"), then N steps back to back and one synchronize (their rate is "images/s", the
throughput figure). Peak memory: PyTorch's max_memory_allocated / max_memory_reserved;
purine-caffe's live bytes of CuPy's memory pool, tracked by a memory hook from before the
Solver is built to the end of the warm-up steps (then removed, so that it costs the timed
steps nothing), and the pool's total bytes after the run as "reserved". PyTorch is a peer
for the bench only, never a dependency of the package.

--device cpu is a smoke mode (tiny batches, numpy and PyTorch's CPU build) for checking
the script on a machine without a GPU; its memory columns are empty.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETS = {
    # name: (TRAIN prototxt, image shape, classes, batch on a GPU, batch in the CPU smoke mode)
    "lenet": ("models/lenet/lenet_train_test.prototxt", (1, 28, 28), 10, 64, 8),
    "cifar10_quick": ("models/cifar10_quick/cifar10_quick_train_test.prototxt", (3, 32, 32),
                      10, 100, 8),
    "alexnet": ("models/bvlc_alexnet/train_val.prototxt", (3, 227, 227), 1000, 256, 2),
}
LMDB_NET = "alexnet_lmdb"  # AlexNet fed by its Data layer from a raw LMDB
LMDB_SIZE = 256  # the Datums' height and width (cropped to 227)
MEAN_VALUE = (104.0, 117.0, 123.0)
SOLVER = {"base_lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}


def base_net(name: str) -> str:
    return "alexnet" if name == LMDB_NET else name


def batch_size(name: str, device: str) -> int:
    _, _, _, gpu_batch, cpu_batch = NETS[base_net(name)]
    return gpu_batch if device == "gpu" else cpu_batch


def lmdb_path(workdir: str, batch: int) -> str:
    return os.path.join(workdir, f"alexnet_raw_{2 * batch}x{LMDB_SIZE}_lmdb")


# -- the LMDB (written once, in the parent process) --------------------------------------
def ensure_lmdb(path: str, records: int) -> None:
    """A raw LMDB of ``records`` random uint8 3 x 256 x 256 Datums at ``path``, unless a
    complete one is already there (it is written under another name and renamed when done)."""
    if os.path.isdir(path):
        return
    import numpy as np

    from purine.converters.convert_imageset import write_datums
    from purine.formats import caffe_pb2 as pb

    partial = path + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    size = 3 * LMDB_SIZE * LMDB_SIZE
    pixels = np.random.default_rng(0).bytes(records * size)

    def datums():
        for i in range(records):
            yield f"{i:08d}", pb.Datum(channels=3, height=LMDB_SIZE, width=LMDB_SIZE,
                                       data=pixels[i * size:(i + 1) * size], label=i % 1000)

    write_datums(partial, datums(), total=records)
    os.rename(partial, path)


# -- purine-caffe ------------------------------------------------------------------------
def memory_net(name: str, batch: int):
    """The TRAIN net with its data layers replaced by Input layers of the bench's shapes."""
    from purine.formats import caffe_pb2 as pb
    from purine.formats.prototxt import filter_net, read_net, replace_data_layers

    path, shape = NETS[name][:2]
    net = filter_net(read_net(os.path.join(ROOT, path)), pb.NetState(phase=pb.TRAIN))
    return replace_data_layers(net, {"data": (batch, *shape), "label": (batch,)})


def lmdb_net(db: str, batch: int):
    """AlexNet's TRAIN net with its Data layer reading ``db``: crop 227, mirror, mean_value
    instead of the mean file."""
    from purine.formats import caffe_pb2 as pb
    from purine.formats.prototxt import filter_net, read_net

    net = filter_net(read_net(os.path.join(ROOT, NETS["alexnet"][0])),
                     pb.NetState(phase=pb.TRAIN))
    (layer,) = [x for x in net.layer if x.type == "Data"]
    layer.data_param.source = db
    layer.data_param.backend = pb.DataParameter.LMDB
    layer.data_param.batch_size = batch
    t = layer.transform_param
    t.ClearField("mean_file")
    t.ClearField("mean_value")
    t.mean_value.extend(MEAN_VALUE)
    t.mirror, t.crop_size = True, 227
    return net


def solver_param(net, gpu: bool):
    from purine.formats import caffe_pb2 as pb

    p = pb.SolverParameter(lr_policy="fixed", max_iter=10**8, display=0, snapshot=0,
                           snapshot_after_train=False, random_seed=1, **SOLVER)
    p.solver_mode = pb.SolverParameter.GPU if gpu else pb.SolverParameter.CPU
    p.net_param.CopyFrom(net)
    return p


def inputs(name: str, batch: int, seed: int = 0):
    import numpy as np

    _, shape, classes = NETS[name][:3]
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((batch, *shape)).astype(np.float32)
    label = rng.integers(0, classes, batch).astype(np.float32)
    return data, label


class _Tracker:
    """Live bytes of CuPy's memory pool and their peak, from a MemoryHook registered in every
    thread: CuPy keeps the registered hooks per thread, and the dispatcher's workers, not the
    main thread, allocate most of the arrays."""

    def __init__(self):
        import cupy
        from cupy.cuda import memory_hook

        tracker = self
        self.lock = threading.Lock()
        self.live: dict[int, int] = {}
        self.bytes = self.peak = self.untracked_frees = 0
        self.tables: list[dict] = []  # each registered thread's hook table

        class PeakMemory(cupy.cuda.MemoryHook):
            name = "purine_bench_peak"

            def malloc_postprocess(self, **kw):
                ptr, size = kw["mem_ptr"], kw["mem_size"]
                if ptr:
                    with tracker.lock:
                        tracker.live[ptr] = size
                        tracker.bytes += size
                        tracker.peak = max(tracker.peak, tracker.bytes)

            def free_postprocess(self, **kw):
                with tracker.lock:
                    size = tracker.live.pop(kw["mem_ptr"], None)
                    if size is None:
                        tracker.untracked_frees += 1
                    else:
                        tracker.bytes -= size

        self.hook = PeakMemory()
        self._get_table = memory_hook.get_memory_hooks
        self._register()

        def register_in_new_thread(frame, event, arg):  # noqa: ARG001
            sys.setprofile(None)  # this profile function only registers the hook, once
            self._register()

        threading.setprofile(register_in_new_thread)

    def _register(self) -> None:
        self.hook.__enter__()
        with self.lock:
            self.tables.append(self._get_table())

    def stop(self) -> None:
        """Unregister from every thread (call while no op runs)."""
        threading.setprofile(None)
        with self.lock:
            for table in self.tables:
                table.pop(self.hook.name, None)


def run_purine(name: str, args) -> dict:
    gpu = args.device == "gpu"
    tracker = _Tracker() if gpu else None  # before anything allocates or starts a thread
    from purine.backend import assign, synchronize
    from purine.caffe.solver import Solver
    from purine.graph import CPU, Location

    location = Location("gpu", 0) if gpu else CPU
    batch = batch_size(name, args.device)
    t0 = time.perf_counter()
    if name == LMDB_NET:
        net = lmdb_net(lmdb_path(args.workdir, batch), batch)
    else:
        net = memory_net(name, batch)
    solver = Solver(solver_param(net, gpu), location=location)
    if name != LMDB_NET:
        data, label = inputs(name, batch)
        assign(solver.net.blobs["data"].data, data)
        assign(solver.net.blobs["label"].data, label)
    synchronize(location)
    setup_s = time.perf_counter() - t0

    def step() -> None:
        solver.step(1)

    result = {"batch": batch, "setup_s": setup_s}
    result.update(timed(step, lambda: synchronize(location), batch, args,
                        after_warmup=tracker.stop if gpu else None))
    if gpu:
        import cupy

        result["peak_mb"] = tracker.peak / 2**20
        result["reserved_mb"] = cupy.get_default_memory_pool().total_bytes() / 2**20
        result["untracked_frees"] = tracker.untracked_frees
        props = cupy.cuda.runtime.getDeviceProperties(0)
        gpu_name = props["name"]
        result["gpu"] = gpu_name.decode() if isinstance(gpu_name, bytes) else str(gpu_name)
        result["cupy"] = cupy.__version__
    import numpy

    result["numpy"] = numpy.__version__
    result["loss"] = float(solver.net.loss)
    return result


def timed(step, sync, batch: int, args, after_warmup=None) -> dict:
    """W warm-up steps; N steps each synchronized (median, ms); N steps back to back and one
    synchronize (images/s)."""
    t0 = time.perf_counter()
    step()
    sync()
    first_s = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        step()
        sync()
    if after_warmup is not None:
        after_warmup()
    times = []
    for _ in range(args.iterations):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(args.iterations):
        step()
    sync()
    total = time.perf_counter() - t0
    return {"first_step_s": first_s, "step_ms": statistics.median(times) * 1e3,
            "images_per_s": args.iterations * batch / total,
            "synced_images_per_s": batch / statistics.median(times)}


# -- PyTorch (bench-only peer) -----------------------------------------------------------
def torch_model(name: str):
    """The net in torch.nn, layer for layer as in its prototxt (Caffe's pooling rounds up:
    ceil_mode; Caffe's LRN across channels is PyTorch's LocalResponseNorm)."""
    from torch import nn

    def lrn():
        return nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=1.0)

    def max_pool(k, s):
        return nn.MaxPool2d(k, s, ceil_mode=True)

    if name == "lenet":
        return nn.Sequential(
            nn.Conv2d(1, 20, 5), max_pool(2, 2), nn.Conv2d(20, 50, 5), max_pool(2, 2),
            nn.Flatten(), nn.Linear(50 * 4 * 4, 500), nn.ReLU(inplace=True),
            nn.Linear(500, 10))
    if name == "cifar10_quick":
        return nn.Sequential(
            nn.Conv2d(3, 32, 5, padding=2), max_pool(3, 2), nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, 5, padding=2), nn.ReLU(inplace=True),
            nn.AvgPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(inplace=True),
            nn.AvgPool2d(3, 2, ceil_mode=True),
            nn.Flatten(), nn.Linear(64 * 4 * 4, 64), nn.Linear(64, 10))
    if name == "alexnet":
        return nn.Sequential(
            nn.Conv2d(3, 96, 11, stride=4), nn.ReLU(inplace=True), lrn(), max_pool(3, 2),
            nn.Conv2d(96, 256, 5, padding=2, groups=2), nn.ReLU(inplace=True), lrn(),
            max_pool(3, 2),
            nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 384, 3, padding=1, groups=2), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1, groups=2), nn.ReLU(inplace=True),
            max_pool(3, 2),
            nn.Flatten(), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(4096, 1000))
    raise SystemExit(f"gpu_nets: no PyTorch model for net '{name}'")


def run_torch(name: str, args) -> dict:
    import torch

    gpu = args.device == "gpu"
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
        torch.backends.cudnn.benchmark = True
        device = torch.device("cuda", 0)
        sync = torch.cuda.synchronize
    else:
        torch.set_num_threads(os.cpu_count() or 1)
        device = torch.device("cpu")

        def sync() -> None:
            pass

    batch = batch_size(name, args.device)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = torch_model(name).to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=SOLVER["base_lr"],
                          momentum=SOLVER["momentum"], weight_decay=SOLVER["weight_decay"])
    loss_fn = torch.nn.CrossEntropyLoss()
    data, label = inputs(name, batch)
    x = torch.from_numpy(data).to(device)
    y = torch.from_numpy(label).long().to(device)
    sync()
    setup_s = time.perf_counter() - t0
    out = {}

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        out["loss"] = loss

    result = {"batch": batch, "setup_s": setup_s}
    result.update(timed(step, sync, batch, args))
    if gpu:
        result["peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        result["reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
        result["gpu"] = torch.cuda.get_device_name(device)
        result["cudnn"] = torch.backends.cudnn.version()
    result["torch"] = torch.__version__
    result["loss"] = float(out["loss"])
    return result


# -- the driver ----------------------------------------------------------------------------
def run_case(fw: str, net: str, args) -> dict:
    """One (framework, net) in a fresh subprocess; its JSON result, or its error."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", fw, net,
           "--device", args.device, "--iterations", str(args.iterations),
           "--warmup", str(args.warmup), "--workdir", args.workdir]
    if args.tf32:
        cmd.append("--tf32")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    case = {"bench": "gpu_nets", "framework": fw, "net": base_net(net),
            "data": "lmdb" if net == LMDB_NET else "memory", "device": args.device,
            "tf32": args.tf32 if fw == "torch" else False}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                             timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**case, "error": f"timed out after {args.timeout} s"}
    if out.returncode:
        lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
        return {**case, "error": lines[-1] if lines else f"exit status {out.returncode}",
                "stderr": out.stderr[-4000:]}
    return {**case, **json.loads(out.stdout.strip().splitlines()[-1])}


def mb(v) -> str:
    return f"{v:10.0f}" if isinstance(v, int | float) else f"{'-':>10s}"


def print_table(results: list[dict], args) -> None:
    where = next((r["gpu"] for r in results if "gpu" in r), "CPU (smoke mode)")
    found: dict[str, object] = {}
    for r in results:
        for k in ("numpy", "cupy", "torch", "cudnn"):
            if k in r:
                found.setdefault(k, r[k])
    versions = ", ".join(f"{k} {v}" for k, v in found.items()) or "no run succeeded"
    peer = ("; PyTorch uses cuDNN (benchmark mode), purine-caffe does not"
            if args.device == "gpu" else "")
    print(f"\n{where}; {versions}; {args.iterations} timed steps after {args.warmup} "
          f"warm-up; TF32 for PyTorch {'on' if args.tf32 else 'off'}{peer}")
    print("images/s: N steps back to back, one synchronize; step ms: median of N "
          "synchronized steps (sync im/s = batch / step ms); start s: set-up and the first "
          "step (kernel compilation)")
    print(f"{'framework':10s} {'net':14s} {'data':6s} {'batch':>5s} {'images/s':>9s} "
          f"{'step ms':>8s} {'sync im/s':>9s} {'peak MB':>10s} {'reserved MB':>11s} "
          f"{'start s':>7s}")
    for r in results:
        head = f"{r['framework']:10s} {r['net']:14s} {r['data']:6s}"
        if "error" in r:
            print(f"{head} FAILED: {r['error']}")
            continue
        print(f"{head} {r['batch']:5d} {r['images_per_s']:9.1f} {r['step_ms']:8.2f} "
              f"{r['synced_images_per_s']:9.1f} {mb(r.get('peak_mb'))} "
              f" {mb(r.get('reserved_mb'))} {r['setup_s'] + r['first_step_s']:7.1f}")
    torch_rate = {r["net"]: r["images_per_s"] for r in results
                  if r["framework"] == "torch" and "error" not in r}
    for r in results:
        if r["framework"] != "purine" or "error" in r or r["net"] not in torch_rate:
            continue
        ratio = r["images_per_s"] / torch_rate[r["net"]]
        goal = "  (goal >= 0.80)" if r["net"] == "alexnet" and args.device == "gpu" else ""
        print(f"purine/PyTorch images/s, {r['net']} batch {r['batch']}, purine's data from "
              f"{r['data']}: {ratio:.2f}{goal}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--nets", default=f"lenet,cifar10_quick,alexnet,{LMDB_NET}",
                    help=f"comma-separated, of {', '.join([*NETS, LMDB_NET])}")
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--tf32", action="store_true", help="let PyTorch use TF32 (default off)")
    ap.add_argument("--workdir", default=os.path.join(os.sep, "tmp", "purine-bench"),
                    help="where the AlexNet LMDB is written once and kept")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per (framework, net)")
    ap.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "NET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.iterations < 1 or args.warmup < 1:
        ap.error("--iterations and --warmup must be at least 1")
    if args.worker:
        fw, net = args.worker
        result = run_purine(net, args) if fw == "purine" else run_torch(base_net(net), args)
        print(json.dumps(result))
        return
    nets = [n for n in args.nets.split(",") if n]
    unknown = [n for n in nets if n not in NETS and n != LMDB_NET]
    if unknown:
        ap.error(f"unknown net(s) {', '.join(unknown)}; known: {', '.join([*NETS, LMDB_NET])}")
    sys.path.insert(0, ROOT)
    if args.device == "gpu":
        from purine.backend import gpu_unavailable

        reason = gpu_unavailable()
        if reason is not None:
            raise SystemExit(f"gpu_nets: cannot bench on a GPU: {reason}")
    if LMDB_NET in nets:
        batch = batch_size(LMDB_NET, args.device)
        ensure_lmdb(lmdb_path(args.workdir, batch), 2 * batch)
    cases = []
    for net in nets:
        cases.append(("purine", net))
        if not args.skip_torch and net != LMDB_NET and ("torch", net) not in cases:
            cases.append(("torch", net))
    if LMDB_NET in nets and "alexnet" not in nets and not args.skip_torch:
        cases.append(("torch", "alexnet"))  # the peer the LMDB figure is compared with
    results = []
    for fw, net in cases:
        r = run_case(fw, net, args)
        print(json.dumps({k: v for k, v in r.items() if k != "stderr"}), flush=True)
        if "stderr" in r:
            print(r["stderr"], file=sys.stderr)
        results.append(r)
    print_table(results, args)
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
