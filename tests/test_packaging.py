"""Packaging: the wheel holds every package under purine/ (the converters as
purine.converters, never a top-level module) and the package data."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _package_folders() -> set[str]:
    """The folders under purine/ that hold an __init__.py, as wheel paths."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "purine")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in filenames:
            found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "/"))
    return found


def test_the_wheel_holds_every_package_and_no_top_level_converters(tmp_path):
    pytest.importorskip("setuptools", reason="the wheel is built without build isolation, "
                                              "from this environment's setuptools")
    # Built from a copy so that no stale build/ folder of the checkout leaks into the wheel.
    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("purine", "models"):
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

    packed = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert packed == _package_folders()
    folder = os.path.join(ROOT, "purine", "converters")
    sources = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
    assert "convert_imageset.py" in sources
    assert sorted(n.split("/")[-1] for n in names
                  if n.startswith("purine/converters/")) == sources
    assert top_level.decode().split() == ["purine"]
    assert "purine/py.typed" in names
    assert any(n.startswith("purine/ops/cuda/") and n.endswith(".cu") for n in names)
    assert any(n.startswith("purine/datasets/") and n.endswith(".npz") for n in names)
