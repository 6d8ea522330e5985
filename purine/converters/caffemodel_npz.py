"""A .caffemodel's parameter blobs to and from numpy's .npz: one float32 array per
``layer/index`` key ("conv1/0" the weights, "conv1/1" the bias). Back to a .caffemodel the
arrays are placed by layer name and index into the parameter shapes of a net prototxt."""

from __future__ import annotations

import argparse
import io
import os
import sys
import zipfile

import numpy as np

from purine.converters import ConvertError, flag, run_main
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import (
    atomic_write,
    encode_net,
    load_weights,
    shape_problem,
)
from purine.formats.prototxt import read_net
from purine.formats.weights import fit_shape, legacy_shape_match  # noqa: F401 (summary.py's)
from purine.log import get_logger

_PHASES = {"TRAIN": pb.TRAIN, "TEST": pb.TEST}


def layer_type(layer: pb.LayerParameter | pb.V1LayerParameter) -> str:
    """The type string of a current layer, or the enum name of a V1 ``layers`` entry."""
    if isinstance(layer, pb.V1LayerParameter):
        return pb.V1LayerParameter.LayerType.Name(layer.type)
    return layer.type


def caffemodel_arrays(path: str | os.PathLike) -> dict[str, list[np.ndarray]]:
    """The parameter arrays of each layer of a caffemodel that has any, in file order."""
    return load_weights(path)


def npz_key(layer: str, index: int) -> str:
    return f"{layer}/{index}"


def caffemodel_to_npz(src: str | os.PathLike, dst: str | os.PathLike) -> dict[str, np.ndarray]:
    """Write the parameter blobs of caffemodel ``src`` to ``dst`` as ``layer/index`` arrays
    (float32, in the shapes the file stores); returns them."""
    arrays = {npz_key(name, k): a for name, blobs in caffemodel_arrays(src).items()
              for k, a in enumerate(blobs)}
    if not arrays:
        raise ConvertError(f"{os.fspath(src)}: no layer holds parameter blobs; nothing to "
                           "write")
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    _write(dst, buf.getvalue())
    return arrays


def read_npz(path: str | os.PathLike) -> dict[tuple[str, int], np.ndarray]:
    """The arrays of an .npz by (layer, index), from keys ``layer/index`` (a layer name may
    hold '/' itself: the index follows the last one). Never unpickles."""
    path = os.fspath(path)
    try:
        npz = np.load(path, allow_pickle=False)
    except OSError as e:
        raise ConvertError(f"{path}: cannot read: {e.strerror or e}") from None
    except (zipfile.BadZipFile, ValueError) as e:
        raise ConvertError(f"{path}: not an .npz archive ({e})") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise ConvertError(f"{path}: holds one array (.npy); give an .npz of 'layer/index' "
                           "arrays")
    out: dict[tuple[str, int], np.ndarray] = {}
    with npz, zipfile.ZipFile(path) as z:
        members = set(z.namelist())
        for key in npz.files:
            layer, _, index = key.rpartition("/")
            # ASCII digits only: str.isdigit also takes '²', which int() refuses
            if not layer or not (index.isascii() and index.isdigit() and len(index) < 10):
                raise ConvertError(f"{path}: key '{key}' is not 'layer/index' (e.g. 'conv1/0' "
                                   "for conv1's weights)")
            _check_npy_shape(path, z, key + ".npy" if key + ".npy" in members else key, key)
            out[(layer, int(index))] = _npz_array(path, npz, key)
    return out


def _check_npy_shape(path: str, z: zipfile.ZipFile, member: str, key: str) -> None:
    """The shape in a member's .npy header, checked before numpy allocates the array it
    describes (a few bytes may claim terabytes); a member that is not .npy is left to
    _npz_array, and so is a version 3 header (which numpy has no public reader for)."""
    readers = {(1, 0): np.lib.format.read_array_header_1_0,
               (2, 0): np.lib.format.read_array_header_2_0}
    try:
        with z.open(member) as f:
            read = readers.get(np.lib.format.read_magic(f))
            if read is None:
                return
            shape = read(f)[0]
    except (ValueError, OSError, zipfile.BadZipFile):
        return  # np.load meets the same and says why
    problem = shape_problem(shape)
    if problem:
        raise ConvertError(f"{path}: array '{key}' {problem}")


def _npz_array(path: str, npz: np.lib.npyio.NpzFile, key: str) -> np.ndarray:
    """Member ``key``: a .npy array (never unpickled) of a real number type and a shape a
    blob can have."""
    try:
        a = npz[key]
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise ConvertError(f"{path}: array '{key}' is not a plain array ({e})") from None
    except MemoryError as e:  # its header asks for more than this machine has
        raise ConvertError(f"{path}: array '{key}' cannot be loaded ({e})") from None
    if not isinstance(a, np.ndarray):  # a member that is not in .npy format: raw bytes
        raise ConvertError(f"{path}: member '{key}' is not a .npy array")
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_) or np.iscomplexobj(a):
        raise ConvertError(f"{path}: array '{key}' has dtype {a.dtype}, not a real number type")
    problem = shape_problem(a.shape)
    if problem:
        raise ConvertError(f"{path}: array '{key}' {problem}")
    return a


def npz_to_caffemodel(model: str | os.PathLike | pb.NetParameter, src: str | os.PathLike,
                      dst: str | os.PathLike, *, phase: int = pb.TRAIN, log=None) -> int:
    """Write caffemodel ``dst`` for net ``model`` (as built for ``phase``) with the
    parameters from .npz ``src``. Every parameter blob needs its ``layer/index`` array of
    the net's shape (a legacy 4-d shape of the same values is accepted); a layer sharing
    another's blob (ParamSpec name) may leave it out. Returns the number of arrays used."""
    from purine.caffe.net import NetBuilder

    log = log or get_logger()
    src = os.fspath(src)
    arrays = read_npz(src)
    builder = NetBuilder(read_net(model), phase)
    used: set[tuple[str, int]] = set()
    shared: dict[str, tuple[np.ndarray, str]] = {}  # blob name -> (value, from which key)
    for L in builder.layers:
        for k, blob in enumerate(L.params):
            key = (L.name, k)
            if key not in arrays:
                if blob.meta["layer"] != L.name:
                    continue  # a shared blob: its owner (or another sharer) gives it
                raise ConvertError(f"{src}: no array '{npz_key(*key)}' for layer '{L.name}' "
                                   f"parameter {k}; the net expects shape {blob.shape}")
            a = arrays[key]
            fit = fit_shape(a, blob.shape)
            if fit is None:
                raise ConvertError(
                    f"{src}: array '{npz_key(*key)}' (layer '{L.name}' parameter {k}) has "
                    f"shape {a.shape}, the net expects {blob.shape}")
            a = np.ascontiguousarray(fit, dtype=np.float32)
            used.add(key)
            if blob.name in shared:
                first, where = shared[blob.name]
                if not np.array_equal(first, a):
                    raise ConvertError(
                        f"{src}: arrays '{where}' and '{npz_key(*key)}' differ, but layer "
                        f"'{L.name}' parameter {k} shares that blob (ParamSpec name "
                        f"'{blob.meta['share_name']}')")
            else:
                shared[blob.name] = (a, npz_key(*key))
    missing = [(L.name, k, p) for L in builder.layers for k, p in enumerate(L.params)
               if p.name not in shared]
    if missing:
        name, k, p = missing[0]
        raise ConvertError(f"{src}: no array '{npz_key(name, k)}' for layer '{name}' "
                           f"parameter {k}; the net expects shape {p.shape}")
    unused = sorted(npz_key(*key) for key in arrays if key not in used)
    if unused:
        log.warning("%s: %d array(s) match no parameter of the net and are not written: %s",
                    src, len(unused), ", ".join(unused))
    params = {L.name: [shared[p.name][0] for p in L.params] for L in builder.layers
              if L.params}
    layers = [L.param for L in builder.layers if L.type != "Split"]
    _write(dst, encode_net(builder.param.name, layers, params))
    return len(used)


def _write(path: str | os.PathLike, data: bytes) -> None:
    try:
        atomic_write(path, data)
    except OSError as e:
        raise ConvertError(f"{os.fspath(path)}: cannot write: {e.strerror}") from None


# -- the commands -------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``caffemodel_to_npz IN.caffemodel OUT.npz``."""
    if parser.description is None:
        parser.description = ("Write the parameter blobs of a .caffemodel to a numpy .npz, "
                              "one array per 'layer/index' key (e.g. 'conv1/0').")
    parser.add_argument("input", metavar="IN.caffemodel", help="the binary caffemodel")
    parser.add_argument("output", metavar="OUT.npz", help="the .npz to write")
    parser.set_defaults(run=run)


def add_npz_arguments(parser: argparse.ArgumentParser) -> None:
    """``npz_to_caffemodel --model PROTOTXT IN.npz OUT.caffemodel``."""
    if parser.description is None:
        parser.description = ("Write a .caffemodel for a net prototxt with the parameters of "
                              "a numpy .npz ('layer/index' arrays, as caffemodel_to_npz "
                              "writes them).")
    flag(parser, "model", required=True, help="the net prototxt giving layers and shapes")
    flag(parser, "phase", default="TRAIN", type=str.upper, choices=sorted(_PHASES),
         help="the phase the net is built in (default TRAIN, as Caffe's snapshots)")
    parser.add_argument("input", metavar="IN.npz", help="the arrays")
    parser.add_argument("output", metavar="OUT.caffemodel", help="the caffemodel to write")
    parser.set_defaults(run=run_npz)


def run(args: argparse.Namespace) -> int:
    arrays = caffemodel_to_npz(args.input, args.output)
    layers = {k.rpartition("/")[0] for k in arrays}
    print(f"{args.input} -> {args.output}: {len(arrays)} arrays of {len(layers)} layers",
          file=sys.stderr)
    return 0


def run_npz(args: argparse.Namespace) -> int:
    n = npz_to_caffemodel(args.model, args.input, args.output, phase=_PHASES[args.phase])
    print(f"{args.input} -> {args.output}: {n} arrays", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("caffemodel_to_npz", add_arguments, argv)


def npz_main(argv: list[str] | None = None) -> int:
    return run_main("npz_to_caffemodel", add_npz_arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
