"""Images per second of the Data layer: the forward op alone, in a loop, from a net holding
just the data layer, over temporary LMDBs this script builds from synthetic images.

    python bench/data_layer.py [--records N] [--batches N] [--batch B] [--cases a,b,c]

(a) encoded JPEG 256x256 color records, crop 227, mirror, mean_file (AlexNet's train input);
(b) raw uint8 256x256x3 records, the same transforms;
(c) raw uint8 28x28 gray records, scale 1/256, batch 64 (LeNet's train input).
Each case runs with the default prefetching (data_param.prefetch 4) and with prefetch 0
(batches made on demand in the forward op: the cost of one batch on one thread). The
steady-state rate with prefetching is the rate the prefetch thread sustains; the time of
the forward op once its batch is prefetched is what a training iteration pays. The same run
measures the images/s at which the net the data feeds trains (forward + backward of
AlexNet at batch 16, LeNet at batch 64): the data layer must be faster.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import cv2  # noqa: E402
import lmdb  # noqa: E402
import numpy as np  # noqa: E402

from purine.caffe import TRAIN, Net  # noqa: E402
from purine.formats import caffe_pb2 as pb  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_nets import NETS, inputs, train_net_param  # noqa: E402


def training_images_per_s(name: str, iterations: int = 3) -> float:
    """Forward + backward images/s of a model-zoo net with stand-in inputs."""
    net = Net(train_net_param(name), phase=TRAIN)
    data, label = inputs(name)
    net.forward(data=data, label=label)
    net.backward()
    t0 = time.perf_counter()
    for _ in range(iterations):
        net.forward()
        net.backward()
    return iterations * NETS[name][1][0] / (time.perf_counter() - t0)


def synthetic_image(rng: np.random.Generator, size: int, channels: int) -> np.ndarray:
    """A smooth image with edges (JPEG sizes like a photo's, unlike white noise)."""
    small = rng.integers(0, 256, (size // 16, size // 16, channels), dtype=np.uint8)
    img = cv2.resize(small, (size, size), interpolation=cv2.INTER_CUBIC)
    for _ in range(4):
        x, y = (int(v) for v in rng.integers(0, size, 2))
        r = int(rng.integers(size // 16, size // 4))
        cv2.circle(img, (x, y), r, tuple(int(v) for v in rng.integers(0, 256, channels)), -1)
    noise = rng.integers(0, 24, img.shape, dtype=np.uint8)
    return cv2.add(img, noise).reshape(size, size, channels)


def build_lmdb(path: str, n: int, size: int, channels: int, encoded: bool) -> None:
    rng = np.random.default_rng(0)
    env = lmdb.open(path, map_size=1 << 34)
    with env.begin(write=True) as txn:
        for i in range(n):
            img = synthetic_image(rng, size, channels)
            if encoded:
                ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
                d = pb.Datum(channels=channels, height=size, width=size, data=buf.tobytes(),
                             label=i % 1000, encoded=True)
            else:
                d = pb.Datum(channels=channels, height=size, width=size,
                             data=img.transpose(2, 0, 1).tobytes(), label=i % 10)
            txn.put(f"{i:08d}".encode(), d.SerializeToString())
    env.close()


def write_mean(path: str, shape: tuple[int, int, int]) -> None:
    c, h, w = shape
    blob = pb.BlobProto(num=1, channels=c, height=h, width=w)
    blob.data.extend(np.full(c * h * w, 110.0, np.float32).tolist())
    with open(path, "wb") as f:
        f.write(blob.SerializeToString())


def data_net(db: str, batch: int, transform: str, prefetch: int) -> Net:
    return Net(f'''name: "bench" layer {{ name: "data" type: "Data" top: "data" top: "label"
      data_param {{ source: "{db}" backend: LMDB batch_size: {batch} prefetch: {prefetch} }}
      transform_param {{ {transform} }} }}''', phase=TRAIN)


def images_per_s(db: str, batch: int, transform: str, batches: int, prefetch: int) -> float:
    net = data_net(db, batch, transform, prefetch)
    ops = net._forward_ops
    for _ in range(2):  # start the thread, fill the queue's first slot
        net.dispatcher.run(ops)
    t0 = time.perf_counter()
    for _ in range(batches):
        net.dispatcher.run(ops)
    return batches * batch / (time.perf_counter() - t0)


def ready_ms(db: str, batch: int, transform: str, samples: int = 5) -> float:
    """The forward op's time when its batch is already prefetched (the copy into the tops):
    what a training iteration pays while the prefetch thread keeps up."""
    net = data_net(db, batch, transform, 4)
    ops = net._forward_ops
    net.dispatcher.run(ops)
    cursor = net.builder.stateful["data/cursor"]
    times = []
    for _ in range(samples):
        while not cursor._queue.full():
            time.sleep(0.01)
        t0 = time.perf_counter()
        net.dispatcher.run(ops)
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--batch", type=int, default=256, help="batch size of cases a and b")
    ap.add_argument("--cases", default="a,b,c")
    args = ap.parse_args()
    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        mean = os.path.join(tmp, "mean.binaryproto")
        write_mean(mean, (3, 256, 256))
        alex = f'crop_size: 227 mirror: true mean_file: "{mean}"'
        runs = []
        if "a" in cases:
            build_lmdb(os.path.join(tmp, "jpeg"), args.records, 256, 3, encoded=True)
            runs.append(("(a) JPEG 256x256 -> crop 227, mirror, mean_file",
                         os.path.join(tmp, "jpeg"), args.batch, alex, "alexnet"))
        if "b" in cases:
            build_lmdb(os.path.join(tmp, "raw"), args.records, 256, 3, encoded=False)
            runs.append(("(b) raw 256x256x3 -> crop 227, mirror, mean_file",
                         os.path.join(tmp, "raw"), args.batch, alex, "alexnet"))
        if "c" in cases:
            build_lmdb(os.path.join(tmp, "mnist"), max(args.records, 4096), 28, 1,
                       encoded=False)
            runs.append(("(c) raw 28x28 gray -> scale 1/256", os.path.join(tmp, "mnist"), 64,
                         "scale: 0.00390625", "lenet"))
        print(f"{os.cpu_count()} CPUs; images/s of the Data layer's forward op "
              f"({args.batches} batches after 2 warm-up)")
        trains: dict[str, float] = {}
        for name, db, batch, transform, net in runs:
            n = args.batches * (8 if batch <= 64 else 1)
            fast = images_per_s(db, batch, transform, n, 4)
            sync = images_per_s(db, batch, transform, n, 0)
            ready = ready_ms(db, batch, transform)
            if net not in trains:
                trains[net] = training_images_per_s(net)
            print(f"{name}, batch {batch}: {fast:9.0f} images/s prefetched, "
                  f"{sync:9.0f} images/s made on demand; the forward op takes "
                  f"{ready:.2f} ms when its batch is ready; {net} trains at "
                  f"{trains[net]:.0f} images/s (data / training = {fast / trains[net]:.0f}x)")


if __name__ == "__main__":
    main()
