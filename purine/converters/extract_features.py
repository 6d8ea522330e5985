"""Caffe's extract_features: run a trained net in the TEST phase for a number of batches and
store, for each named blob, one Datum per item (its values as float_data, the blob's
channels/height/width) in a new LMDB or LevelDB under the item's running index, ``%010d``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np

from purine.converters import ConvertError, run_main
from purine.converters.convert_imageset import open_writer
from purine.converters.progress import Progress
from purine.data import db as backends
from purine.data.datum import encode_datums
from purine.data.db import DatumWriter
from purine.log import get_logger


def _legacy_dims(name: str, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """num, channels, height, width as Caffe's Blob::num()... read them: missing axes are 1;
    Caffe's legacy accessors refuse a blob of more than 4 axes."""
    if len(shape) > 4:
        raise ConvertError(f"blob '{name}' has shape {shape}: a Datum holds a blob of at most "
                           "4 axes (num, channels, height, width)")
    n, c, h, w = tuple(shape) + (1,) * (4 - len(shape))
    return n, c, h, w


def _location(mode: str, device_id: int):
    """Where the net runs: Caffe's trailing ``CPU`` or ``GPU [DEVICE_ID]``."""
    import purine.backend as backend
    from purine.graph import CPU, Location

    if mode.upper() == "CPU":
        return CPU
    if mode.upper() != "GPU":
        raise ConvertError(f"device '{mode}': expected CPU or GPU")
    why = backend.gpu_unavailable()
    if why is not None:
        raise ConvertError(f"GPU {device_id}: {why}; give CPU (or nothing) to use the CPU")
    n = backend.gpu_count()
    if not 0 <= device_id < n:
        raise ConvertError(f"GPU {device_id}: this machine has {n} GPU(s), ids 0..{n - 1}")
    return Location("gpu", device_id)


def datum_records(values: np.ndarray, channels: int, height: int, width: int) -> list[bytes]:
    """Each row of ``values`` (N, C*H*W) as a serialized Datum of float_data, the bytes
    protobuf writes for ``Datum(channels, height, width, float_data=row)``."""
    return encode_datums(values.reshape(len(values), channels, height, width))


def extract_features(weights: str | os.PathLike, model: str | os.PathLike,
                     blobs: Sequence[str], dbs: Sequence[str | os.PathLike], num_batches: int,
                     backend: str = "lmdb", *, mode: str = "CPU", device_id: int = 0,
                     log=None) -> int:
    """Caffe's extract_features: ``num_batches`` forward passes of the TEST net ``model``
    with the parameters of ``weights``; blob ``blobs[i]``'s items go to the new database
    ``dbs[i]``. Returns the number of items stored per blob."""
    from purine.backend import to_host
    from purine.caffe import TEST, Net

    log = log or get_logger()
    blobs, dbs = list(blobs), [os.fspath(d) for d in dbs]
    if len(blobs) != len(dbs):
        raise ConvertError(f"{len(blobs)} blob name(s) ({','.join(blobs)}) but {len(dbs)} "
                           f"database name(s) ({','.join(dbs)}): the counts must be equal")
    backends.require(backend, ConvertError)
    if num_batches < 0:
        raise ConvertError(f"num_mini_batches must be 0 or more, got {num_batches}")
    seen = set()
    for d in dbs:
        if os.path.normpath(d) in seen:
            raise ConvertError(f"database '{d}' is named twice; give each blob its own")
        seen.add(os.path.normpath(d))
        if os.path.exists(d):
            raise ConvertError(f"{d}: already exists; remove it or choose another name "
                               "(Caffe's tools never write into an existing database)")
    location = _location(mode, device_id)
    log.info("Using %s", "CPU" if location.device == "cpu" else f"GPU {device_id}")
    # Closed on the way out, an error's too: the input database is free again at once.
    with Net(model, phase=TEST, location=location) as net:
        net.copy_from(weights)
        for name in blobs:
            if name not in net.blobs:
                raise ConvertError(f"Unknown feature blob name '{name}' in the network "
                                   f"{os.fspath(model)}")
        dims = {name: _legacy_dims(name, net.blobs[name].shape) for name in blobs}

        writers: list[DatumWriter] = []
        try:
            for d in dbs:
                log.info("Opening dataset %s", d)
                writers.append(open_writer(d, backend, log))
            log.info("Extracting Features")
            counts = [0] * len(blobs)
            with Progress(num_batches, "extract_features", unit="batch", log=log) as progress:
                for batch in range(num_batches):
                    net.forward()
                    for i, name in enumerate(blobs):
                        n, c, h, w = dims[name]
                        values = to_host(net.blobs[name].data).reshape(n, -1)
                        for record in datum_records(values, c, h, w):
                            committed = writers[i].put(f"{counts[i]:010d}", record)
                            counts[i] += 1
                            if committed:
                                log.info("Extracted features of %d query images for "
                                         "feature blob %s", counts[i], name)
                    progress.update(batch + 1)
            for i, name in enumerate(blobs):
                writers[i].close()
                log.info("Extracted features of %d query images for feature blob %s", counts[i],
                         name)
        except BaseException:
            for wr in writers:
                wr.abort()
            raise
    log.info("Successfully extracted the features!")
    return counts[0] if counts else 0


# -- the command --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Caffe's extract_features arguments, positional as Caffe takes them."""
    if parser.description is None:
        parser.description = (
            "Run a trained net in the TEST phase and store the named blobs' values, one Datum "
            "per item keyed %010d, in new databases. Several blobs and databases: separate "
            "them with ',' (as many of each).")
    parser.add_argument("weights", metavar="PRETRAINED_NET_PARAM", help="the .caffemodel")
    parser.add_argument("model", metavar="FEATURE_EXTRACTION_PROTO_FILE",
                        help="the net prototxt (with its data layer)")
    parser.add_argument("blobs", metavar="BLOB_NAME1[,NAME2,...]", help="blobs to extract")
    parser.add_argument("dbs", metavar="DATASET_NAME1[,NAME2,...]",
                        help="the databases to create, one per blob")
    parser.add_argument("num_batches", metavar="NUM_MINI_BATCHES", type=int,
                        help="forward passes to run")
    parser.add_argument("backend", metavar="DB_TYPE", help="lmdb or leveldb")
    parser.add_argument("mode", metavar="CPU/GPU", nargs="?", default="CPU",
                        help="where to run (default CPU)")
    parser.add_argument("device_id", metavar="DEVICE_ID", nargs="?", type=int, default=0,
                        help="the GPU (default 0)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    extract_features(args.weights, args.model, args.blobs.split(","), args.dbs.split(","),
                     args.num_batches, args.backend, mode=args.mode, device_id=args.device_id)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("extract_features", add_arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
