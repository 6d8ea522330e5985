"""Caffe's offline dataset tools (convert_imageset, compute_image_mean, binaryproto <-> .npy)
and what they share: their error type and gflags-style flags (one dash or two, ``--flag=true``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from purine.errors import PurineError, run_reporting


class ConvertError(PurineError):
    """A dataset tool that cannot go on: names the file (and line) and what was expected."""


_TRUE = ("true", "t", "yes", "y", "1")
_FALSE = ("false", "f", "no", "n", "0")


def flag(p: argparse.ArgumentParser, name: str, **kw) -> None:
    """A valued flag spelled ``-name``, ``--name``, ``-name=V`` or ``--name V``."""
    p.add_argument(f"-{name}", f"--{name}", dest=name, **kw)


def bool_flag(p: argparse.ArgumentParser, name: str, help: str) -> None:
    """A boolean flag as gflags reads it: ``--name``, ``--name=true|false``, ``--noname``.

    argparse looks an argument up whole before it splits at '=', so the spelled-out forms
    are registered as hidden aliases; a bare ``--name`` never swallows the next argument.
    """
    p.add_argument(f"-{name}", f"--{name}", dest=name, action="store_true", default=False,
                   help=help)

    def spellings(values: tuple[str, ...]) -> list[str]:
        return [f"{dash}{name}={w}" for dash in ("-", "--") for v in values
                for w in dict.fromkeys((v, v.upper(), v.capitalize()))]

    p.add_argument(*spellings(_TRUE), dest=name, action="store_true", help=argparse.SUPPRESS)
    p.add_argument(*spellings(_FALSE), f"-no{name}", f"--no{name}", dest=name,
                   action="store_false", help=argparse.SUPPRESS)


def run_main(prog: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             argv: list[str] | None) -> int:
    """Parse ``argv`` for one tool and run it; a PurineError becomes one line and exit 1."""
    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors and --help: argparse has printed why
        return e.code if isinstance(e.code, int) else 2
    return run_reporting(prog, lambda: args.run(args))
