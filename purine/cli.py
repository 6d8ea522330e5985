"""The ``purine-caffe`` command: Caffe's verbs and flags (one dash or two)."""

from __future__ import annotations

import argparse
import sys
import time

from purine.errors import PurineError
from purine.log import get_logger


def _flag(p: argparse.ArgumentParser, name: str, **kw) -> None:
    p.add_argument(f"-{name}", f"--{name}", **kw)


def _stages(s: str | None) -> list[str]:
    return [x for x in (s or "").split(",") if x]


def cmd_time(args: argparse.Namespace) -> int:
    from purine.caffe import TRAIN, Net
    from purine.timing import time_net

    log = get_logger()
    if args.gpu:
        raise PurineError("--gpu: the GPU backend is not available yet; run without --gpu")
    net = Net(args.model, phase=TRAIN, level=args.level, stages=_stages(args.stage),
              threads=args.threads)
    log.info("Performing Forward")
    net.forward()
    log.info("Initial loss: %g", net.loss)
    log.info("Performing Backward")
    net.backward()
    log.info("*** Benchmark begins ***")
    log.info("Testing for %d iterations.", args.iterations)
    t0 = time.perf_counter()
    t = time_net(net, args.iterations, log)
    total = (time.perf_counter() - t0) * 1e3
    log.info("Average time per layer: ")
    for name, f, b in t.layers:
        log.info("%10s\tforward: %g ms.", name, f)
        log.info("%10s\tbackward: %g ms.", name, b)
    log.info("Average Forward pass: %g ms.", t.forward_ms)
    log.info("Average Backward pass: %g ms.", t.backward_ms)
    log.info("Average Forward-Backward: %g ms.", t.forward_ms + t.backward_ms)
    log.info("Total Time: %g ms.", total)
    log.info("*** Benchmark ends ***")
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
    _flag(p, "iterations", type=int, default=50, help="iterations to time (default 50)")
    _flag(p, "gpu", default=None, help="GPU ids (the GPU backend is not available yet)")
    _flag(p, "level", type=int, default=0, help="NetState level")
    _flag(p, "stage", default=None, help="comma-separated NetState stages")
    _flag(p, "threads", type=int, default=1,
          help="spread the ops over this many dispatcher worker threads")
    p.set_defaults(run=cmd_time)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except PurineError as e:
        print(f"purine-caffe {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"purine-caffe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
