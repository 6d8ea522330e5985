"""``purine-caffe python``: run a pycaffe script, module, command or notebook kernel with
``import caffe`` giving purine.pycaffe, so BVLC's scripts, notebooks and tests run as they
are written. ``python -m purine.pycaffe.run ...`` is the same entry without the CLI."""

from __future__ import annotations

import code
import json
import os
import runpy
import sys
from pathlib import Path

from purine.caffe.layers.python import installed_caffe

USAGE = """usage: purine-caffe python [-q] (SCRIPT | -m MODULE | -c COMMAND) [ARGS ...]
       purine-caffe python --install-kernel [--user | --prefix DIR] [--name NAME]

Runs Python with `import caffe` (and caffe.io, caffe.proto.caffe_pb2, caffe.draw, ...)
giving purine-caffe's pycaffe, ahead of any caffe folder on sys.path, then the script, module
(-m) or command (-c) with ARGS as its sys.argv[1:], as `python` itself would. Without one of
them: an interactive console. -q: no line on stderr saying which caffe is in use.
--install-kernel: a Jupyter kernel "purine-caffe" whose notebooks get the same `import caffe`
(into this environment's share/jupyter, --user's, or --prefix's)."""

KERNEL_NAME = "purine-caffe"


class UsageError(Exception):
    pass


def kernel_spec() -> dict:
    """The Jupyter kernel.json of a kernel whose notebooks import purine as ``caffe``."""
    return {
        "argv": [sys.executable, "-m", "purine.pycaffe.run", "-q", "-m", "ipykernel_launcher",
                 "-f", "{connection_file}"],
        "display_name": "Python 3 (purine-caffe as caffe)",
        "language": "python",
        "metadata": {"debugger": True},
    }


def _kernels_dir(user: bool, prefix: str | None) -> Path:
    if prefix is not None:
        return Path(prefix) / "share" / "jupyter" / "kernels"
    if user:
        base = os.environ.get("JUPYTER_DATA_DIR") or os.path.join(
            os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "jupyter")
        return Path(base) / "kernels"
    return Path(sys.prefix) / "share" / "jupyter" / "kernels"


def install_kernel(argv: list[str]) -> int:
    user, prefix, name = False, None, KERNEL_NAME
    it = iter(argv)
    for a in it:
        if a == "--user":
            user = True
        elif a in ("--prefix", "--name"):
            value = next(it, None)
            if value is None:
                raise UsageError(f"{a} needs a value")
            prefix, name = (value, name) if a == "--prefix" else (prefix, value)
        else:
            raise UsageError(f"--install-kernel: unknown argument {a!r}")
    folder = _kernels_dir(user, prefix) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.json").write_text(json.dumps(kernel_spec(), indent=1) + "\n")
    print(f"purine-caffe python: installed the Jupyter kernel '{name}' in {folder} (needs "
          "`pip install ipykernel`); pick it in a notebook and `import caffe` is purine-caffe")
    return 0


def announce() -> None:
    """One stderr line: which ``caffe`` this process imports, and what it shadows."""
    import purine.pycaffe as caffe

    line = (f"purine-caffe python: `import caffe` is purine-caffe's pycaffe "
            f"{caffe.__version__} ({Path(caffe.__file__).parent})")
    real = installed_caffe()
    if real is not None:
        line += f", ahead of the Caffe installed at {real}"
    print(line, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet = False
    while argv and argv[0] in ("-q", "--quiet"):
        quiet, argv = True, argv[1:]
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        if argv and argv[0] == "--install-kernel":
            return install_kernel(argv[1:])
        if argv and argv[0] in ("-m", "-c") and len(argv) < 2:
            raise UsageError(f"{argv[0]} needs an argument")
    except UsageError as e:
        print(f"purine-caffe python: {e}\n{USAGE}", file=sys.stderr)
        return 2

    import purine.pycaffe as caffe

    caffe.install_as_caffe(force=True)
    if not quiet:
        announce()
    if not argv:
        sys.argv = [""]
        sys.path.insert(0, "")
        code.interact(banner=f"Python {sys.version.split()[0]}, `import caffe` is purine-caffe",
                      local={"__name__": "__main__"}, exitmsg="")
        return 0
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())  # as `python -m`
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        return 0
    script = argv[0]
    if not os.path.exists(script):
        print(f"purine-caffe python: can't open file {script!r}: no such file",
              file=sys.stderr)
        return 2
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py`
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
