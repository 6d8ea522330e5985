"""The cost of writing AlexNet's 61M parameters as a .caffemodel, beside the plain disk
write of the same bytes and beside protobuf's own encoding (repeated-field ``extend``).

    python bench/snapshot.py [--skip-protobuf]

"encode" is building the file's chunks from the arrays (headers; the arrays' memory is
written as it is); "write" is the atomic write (temporary file, fsync, rename); the plain
disk write of the same floats is the floor.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from purine.caffe import TEST, Net  # noqa: E402
from purine.formats import caffe_pb2 as pb  # noqa: E402
from purine.formats.caffemodel import atomic_write, net_chunks  # noqa: E402
from purine.zoo import model_file  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-protobuf", action="store_true",
                    help="skip protobuf's own (slow) encoding")
    args = ap.parse_args()
    net = Net(model_file("bvlc_alexnet/deploy.prototxt"), phase=TEST)
    params = {name: [v.data for v in views] for name, views in net.params.items()}
    layers = [L.param for L in net.builder.layers]
    count = sum(a.size for arrays in params.values() for a in arrays)
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        t0 = time.perf_counter()
        chunks = net_chunks(net.model.name, layers, params)
        t1 = time.perf_counter()
        atomic_write(os.path.join(tmp, "a.caffemodel"), chunks)
        data = open(os.path.join(tmp, "a.caffemodel"), "rb").read()
        t2 = time.perf_counter()
        raw = np.concatenate([a.ravel() for arrays in params.values() for a in arrays])
        t3 = time.perf_counter()
        with open(os.path.join(tmp, "raw.bin"), "wb") as f:
            f.write(raw.tobytes())
            f.flush()
            os.fsync(f.fileno())
        t4 = time.perf_counter()
        t5 = time.perf_counter()
        net.save(os.path.join(tmp, "b.caffemodel"))
        t6 = time.perf_counter()
        print(f"AlexNet: {count:,} parameters, {len(data) / 1e6:.1f} MB")
        print(f"encode {1e3 * (t1 - t0):.0f} ms, atomic write {1e3 * (t2 - t1):.0f} ms, "
              f"Net.save in all {1e3 * (t6 - t5):.0f} ms; plain write of the raw floats "
              f"{1e3 * (t4 - t3):.0f} ms")
        if not args.skip_protobuf:
            t7 = time.perf_counter()
            msg = pb.NetParameter(name=net.model.name)
            for layer in layers:
                lp = msg.layer.add()
                lp.CopyFrom(layer)
                for a in params.get(layer.name, ()):
                    blob = lp.blobs.add()
                    blob.shape.dim.extend(a.shape)
                    blob.data.extend(a.ravel())
            msg.SerializeToString()
            t8 = time.perf_counter()
            ours = pb.NetParameter()
            ours.ParseFromString(data)
            assert ours == msg, "the fast encoding must hold the same message"
            print(f"protobuf's own extend + serialize: {1e3 * (t8 - t7):.0f} ms "
                  f"(the same message as ours)")


if __name__ == "__main__":
    main()
