"""Where the model zoo's prototxt files are: ``models/`` of a source checkout (the working
directory or next to the package), or the copy a wheel installs under
``<prefix>/share/purine-caffe/models``."""

from __future__ import annotations

import os
import sys

from purine.errors import PurineError


def model_dirs() -> list[str]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [os.path.join(os.getcwd(), "models"), os.path.join(here, "models"),
            os.path.join(sys.prefix, "share", "purine-caffe", "models")]


def model_file(relative: str) -> str:
    """The path of ``relative`` (e.g. "lenet/lenet_solver.prototxt") in the model zoo."""
    for d in model_dirs():
        path = os.path.join(d, relative)
        if os.path.exists(path):
            return path
    raise PurineError(f"model zoo file {relative} not found in " + ", ".join(model_dirs()))
