"""Caffe's upgrade tools: upgrade_net_proto_text and upgrade_net_proto_binary rewrite V0/V1 net
prototxts and caffemodels in the current form (blobs carried), upgrade_solver_proto_text
rewrites the old solver_type enum as the type string. Like Caffe's tools they always write
the output, and exit 1 after writing when part of the net could not be carried over."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from google.protobuf import text_format

from purine.converters import run_main
from purine.formats import caffe_pb2 as pb
from purine.formats import upgrade as up
from purine.formats.caffemodel import atomic_write
from purine.formats.prototxt import read_binary, read_text
from purine.log import get_logger


def _upgrade(net: pb.NetParameter, path: str) -> tuple[pb.NetParameter, list[str]]:
    """Caffe's UpgradeNetAsNeeded as its tools apply it, input fields included."""
    log = get_logger()
    problems: list[str] = []
    if not up.net_needs_upgrade(net):
        log.error("File already in latest proto format: %s", path)
        return net, problems
    net = up.upgrade_net_inputs(up.upgrade_net(net, problems))
    for p in problems:
        log.error("%s", p)
    if problems:
        log.error("Encountered error(s) while upgrading %s; see details above.", path)
    return net, problems


def upgrade_net_proto_text(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Upgrade the net prototxt ``src`` and write it to ``dst``; returns what could not be
    carried over (empty when everything was)."""
    src, dst = os.fspath(src), os.fspath(dst)
    net, problems = _upgrade(read_text(src, pb.NetParameter()), src)
    atomic_write(dst, text_format.MessageToString(net).encode())
    get_logger().info("Wrote upgraded NetParameter text proto to %s", dst)
    return problems


def upgrade_net_proto_binary(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Upgrade the binary net (a caffemodel) ``src``, parameter blobs included, and write it
    to ``dst``; returns what could not be carried over."""
    src, dst = os.fspath(src), os.fspath(dst)
    net, problems = _upgrade(read_binary(src, pb.NetParameter()), src)
    atomic_write(dst, net.SerializeToString())
    get_logger().info("Wrote upgraded NetParameter binary proto to %s", dst)
    return problems


def upgrade_solver_proto_text(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    """Upgrade the solver prototxt ``src`` and write it to ``dst``; returns whether it
    needed an upgrade."""
    src, dst = os.fspath(src), os.fspath(dst)
    param = read_text(src, pb.SolverParameter())
    needed = up.solver_needs_upgrade(param)
    if needed:
        param = up.upgrade_solver(param, f"solver {src}")
    else:
        get_logger().error("File already in latest proto format: %s", src)
    atomic_write(dst, text_format.MessageToString(param).encode())
    get_logger().info("Wrote upgraded SolverParameter text proto to %s", dst)
    return needed


# -- command line -----------------------------------------------------------------------------
def _in_out(parser: argparse.ArgumentParser, what: str, description: str,
            run: Callable[[argparse.Namespace], int]) -> None:
    if parser.description is None:
        parser.description = description
    parser.add_argument("input", metavar="IN", help=f"the old {what}")
    parser.add_argument("output", metavar="OUT", help=f"where the upgraded {what} goes")
    parser.set_defaults(run=run)


def _run_net_text(args: argparse.Namespace) -> int:
    return 1 if upgrade_net_proto_text(args.input, args.output) else 0


def _run_net_binary(args: argparse.Namespace) -> int:
    return 1 if upgrade_net_proto_binary(args.input, args.output) else 0


def _run_solver_text(args: argparse.Namespace) -> int:
    upgrade_solver_proto_text(args.input, args.output)
    return 0


def add_net_text_arguments(parser: argparse.ArgumentParser) -> None:
    _in_out(parser, "net prototxt", "Upgrade a V0/V1 net prototxt to the current format "
            "(Caffe's upgrade_net_proto_text).", _run_net_text)


def add_net_binary_arguments(parser: argparse.ArgumentParser) -> None:
    _in_out(parser, "binary net (.caffemodel)", "Upgrade a V0/V1 binary net (a caffemodel, "
            "weights included) to the current format (Caffe's upgrade_net_proto_binary).",
            _run_net_binary)


def add_solver_text_arguments(parser: argparse.ArgumentParser) -> None:
    _in_out(parser, "solver prototxt", "Upgrade a solver prototxt's solver_type enum to the "
            "type string (Caffe's upgrade_solver_proto_text).", _run_solver_text)


TOOLS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], str]] = {
    "upgrade_net_proto_text": (add_net_text_arguments,
                               "old (V0/V1) net prototxt -> the current format"),
    "upgrade_net_proto_binary": (add_net_binary_arguments,
                                 "old (V0/V1) caffemodel -> the current format, with weights"),
    "upgrade_solver_proto_text": (add_solver_text_arguments,
                                  "old solver prototxt (solver_type enum) -> the current format"),
}
"""Tool name -> (adds its arguments to a parser, one-line help)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The three tools as sub-commands: ``TOOL IN OUT``."""
    sub = parser.add_subparsers(dest="tool", metavar="tool")
    sub.required = True
    for name, (add, text) in TOOLS.items():
        add(sub.add_parser(name, help=text))


def main(argv: list[str] | None = None) -> int:
    """``python -m purine.converters.upgrade TOOL IN OUT``."""
    return run_main("upgrade", add_arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
