"""Packaging: the repository's top-level converters/ folder installs as purine.converters, never
as a top-level module, and pyproject.toml's explicit package list names every package folder."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    # The standard library reads TOML from Python 3.11; the project also supports 3.10.
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _package_folders() -> set[str]:
    """Dotted names of the folders under purine/ that hold an __init__.py."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "purine")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in filenames:
            found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    return found


def test_package_list_names_every_package_folder():
    # The list is explicit (find cannot rename a folder), so a new subpackage must be added by hand.
    tool = _pyproject()["tool"]["setuptools"]
    assert sorted(tool["packages"]) == sorted(_package_folders() | {"purine.converters"})
    assert tool["package-dir"] == {"purine.converters": "converters"}
    assert not any(p == "converters" or p.startswith("converters.") for p in tool["packages"])


def test_wheel_puts_converters_inside_purine(tmp_path):
    pytest.importorskip("setuptools", reason="the wheel is built without build isolation, "
                                              "from this environment's setuptools")
    # Built from a copy so that no stale build/ folder of the checkout leaks into the wheel.
    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("purine", "converters", "models"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(src)], check=True, capture_output=True)
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top_level = z.read(next(n for n in names if n.endswith(".dist-info/top_level.txt")))

    sources = sorted(f for f in os.listdir(os.path.join(ROOT, "converters")) if f.endswith(".py"))
    assert "convert_imageset.py" in sources
    packed = sorted(n.split("/")[-1] for n in names if n.startswith("purine/converters/"))
    assert packed == sources
    assert not [n for n in names if n.startswith("converters/")]
    assert top_level.decode().split() == ["purine"]
    # Package data still travels with the explicit list.
    assert "purine/py.typed" in names
    assert any(n.startswith("purine/ops/cuda/") and n.endswith(".cu") for n in names)
