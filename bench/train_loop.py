"""Images per second of whole training iterations (data layer, forward, backward, SGD with
momentum), purine-caffe beside a plain PyTorch training loop, in the same run.

    python bench/train_loop.py [--iterations N] [--nets lenet,cifar10_quick,alexnet] [--records N]
                               [--repeat N]

purine-caffe trains the model zoo's TRAIN net from its solver settings (SGD, momentum 0.9, the
zoo's lr, weight decay and batch) with its Data layer reading a temporary LMDB of raw Datums
that this script writes (LeNet: 28x28 gray, scale 1/256; CIFAR-10 quick: 32x32 color, no mean
file; AlexNet, batch 16: 256x256 color cropped to 227 at random and mirrored, no mean file, 200
MB of records), through ``Solver.step`` in-process, as ``purine-caffe train`` runs it. PyTorch
runs the same layers (bench/cpu_nets.py's transcription) over the same images held in memory as
float tensors, with ``torch.optim.SGD(momentum=0.9, weight_decay=...)``: it pays no decoding,
cropping or mirroring, which is PyTorch's best case. Each (framework, net) pair runs in a fresh
subprocess for its own peak resident memory (counted as in bench/cpu_nets.py, which runs this
comparison too); the rate is the median of the timed iterations after 3 warm-up iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_nets import (  # noqa: E402
    NETS,
    in_workers,
    load_kernels,
    rss_mb,
    torch_model,
    train_net_param,
)

# net: (channels, record size, transform_param text, lr, weight decay)
SETTINGS = {
    "lenet": (1, 28, "scale: 0.00390625", 0.01, 0.0005),
    "cifar10_quick": (3, 32, "", 0.001, 0.004),
    # 256x256 records cropped to 227 at random and mirrored, as models/bvlc_alexnet trains
    # (no mean file); PyTorch gets the 227x227 corners in memory. Batch 16 (bench/cpu_nets).
    "alexnet": (3, 256, "crop_size: 227 mirror: true", 0.01, 0.0005),
}
WARMUP = 3
RECORDS = 2000
MAX_BYTES = 200 << 20  # fewer records of a large image: AlexNet's 2000 would take 393 MB


def records_of(name: str, records: int) -> int:
    channels, size = SETTINGS[name][:2]
    return max(NETS[name][1][0] + 1, min(records, MAX_BYTES // (channels * size * size)))


def images(name: str, n: int):
    import numpy as np

    channels, size = SETTINGS[name][:2]
    n = records_of(name, n)
    rng = np.random.default_rng(0)
    return (rng.integers(0, 256, (n, channels, size, size), dtype=np.uint8),
            rng.integers(0, 10, n))


def write_lmdb(name: str, path: str, n: int) -> None:
    from purine.converters.convert_imageset import write_datums
    from purine.formats import caffe_pb2 as pb

    x, y = images(name, n)
    write_datums(path, ((f"{i:08d}", pb.Datum(channels=x.shape[1], height=x.shape[2],
                                               width=x.shape[3], data=x[i].tobytes(),
                                               label=int(y[i]))) for i in range(len(x))),
                 total=len(x))


def run_purine(name: str, iterations: int, records: int) -> dict:
    from purine.caffe.solver import Solver
    from purine.formats import caffe_pb2 as pb
    from purine.formats.prototxt import parse_text

    channels, size, transform, lr, decay = SETTINGS[name]
    batch = NETS[name][1][0]
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "train_lmdb")
        write_lmdb(name, db, records)
        net = train_net_param(name)  # Input stand-ins; the data layer goes back in below
        net.layer[0].CopyFrom(parse_text(
            f'name: "data" type: "Data" top: "data" top: "label" transform_param '
            f'{{ {transform} }} data_param {{ source: "{db}" backend: LMDB batch_size: {batch} }}',
            pb.LayerParameter()))
        param = pb.SolverParameter(base_lr=lr, momentum=0.9, weight_decay=decay,
                                   lr_policy="fixed", max_iter=iterations + WARMUP,
                                   random_seed=1, display=0, snapshot_after_train=False)
        param.net_param.CopyFrom(net)
        load_kernels()
        base = rss_mb()
        with Solver(param) as solver:
            solver.step(WARMUP)
            times = []
            for _ in range(iterations):
                t0 = time.perf_counter()
                solver.step(1)
                times.append(time.perf_counter() - t0)
        return {"img_s": batch / statistics.median(times), "peak_mb": rss_mb() - base}


def run_torch(name: str, iterations: int, records: int) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    _, _, transform, lr, decay = SETTINGS[name]
    batch = NETS[name][1][0]
    x, y = images(name, records)
    records = len(x)
    crop = NETS[name][1][2]
    x = x[..., :crop, :crop]
    scale = 0.00390625 if "scale" in transform else 1.0
    base = rss_mb()
    data = torch.from_numpy(x.astype("float32") * scale)
    label = torch.from_numpy(y.astype("float32"))
    layers, weights = torch_model(name)
    opt = torch.optim.SGD(weights, lr=lr, momentum=0.9, weight_decay=decay)
    times = []
    for i in range(iterations + WARMUP):
        t0 = time.perf_counter()
        lo = (i * batch) % (records - batch + 1)
        blobs = {"data": data[lo:lo + batch], "label": label[lo:lo + batch]}
        for top, b, fn in layers:
            blobs[top] = fn(*(blobs[n] for n in b)) if isinstance(b, tuple) else fn(blobs[b])
        opt.zero_grad(set_to_none=True)
        blobs[layers[-1][0]].backward()
        opt.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return {"img_s": batch / statistics.median(times), "peak_mb": rss_mb() - base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--nets", default=",".join(SETTINGS))
    ap.add_argument("--records", type=int, default=RECORDS)
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="alternate purine and PyTorch N times per net and report the medians")
    ap.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "NET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fw, net = args.worker
        run = run_purine if fw == "purine" else run_torch
        print(json.dumps(run(net, args.iterations, args.records)))
        return
    compare(args.nets.split(","), args.iterations, args.records, args.repeat)


def compare(nets: list[str], iterations: int, records: int, repeat: int = 1) -> None:
    """Print the table: each net's images/s and peak MB, purine beside PyTorch. With
    ``repeat`` > 1 the two alternate, purine then PyTorch, ``repeat`` times, and the table
    gives the medians (the ratio of the median rates) with each side's range: on a shared
    machine whose speed drifts from minute to minute, alternating runs compare where one
    run of each does not."""
    print(f"{'training loop':15s} {'purine img/s':>13s} {'torch img/s':>12s} {'ratio':>6s} "
          f"{'purine MB':>10s} {'torch MB':>9s} {'ratio':>6s}")
    for net in nets:
        runs = [in_workers(__file__, net, ["--iterations", str(iterations),
                                           "--records", str(records)])
                for _ in range(repeat)]
        p = {k: statistics.median(r[0][k] for r in runs) for k in ("img_s", "peak_mb")}
        t = {k: statistics.median(r[1][k] for r in runs) for k in ("img_s", "peak_mb")}
        # ratio: purine's time per image over PyTorch's (below 1: purine-caffe is faster)
        print(f"{net:15s} {p['img_s']:13.0f} {t['img_s']:12.0f} {t['img_s'] / p['img_s']:6.2f} "
              f"{p['peak_mb']:10.1f} {t['peak_mb']:9.1f} "
              f"{p['peak_mb'] / max(t['peak_mb'], 1e-9):6.2f}")
        if repeat > 1:
            ratios = sorted(r[1]["img_s"] / r[0]["img_s"] for r in runs)
            print(f"{'':15s} {repeat} alternating runs: purine "
                  f"{min(r[0]['img_s'] for r in runs):.0f}-{max(r[0]['img_s'] for r in runs):.0f}"
                  f" img/s, torch {min(r[1]['img_s'] for r in runs):.0f}-"
                  f"{max(r[1]['img_s'] for r in runs):.0f}, ratio per pair "
                  f"{ratios[0]:.2f}-{ratios[-1]:.2f}")


if __name__ == "__main__":
    main()
