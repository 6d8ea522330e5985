"""BVLC Caffe's own pycaffe unit tests (python/caffe/test/, 52 tests), stored unchanged in
tests/fixtures/bvlc/python/caffe/test/, run by pytest under ``purine-caffe python`` from a
stand-in Caffe checkout: the layout they expect (``models/`` and ``examples/`` three folders
up, for test_draw) and BVLC's unbuilt ``python/caffe`` package beside them, which
``import caffe`` must pass over."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent.parent / "fixtures" / "bvlc"
TESTS = sorted((FIXTURES / "python" / "caffe" / "test").glob("test_*.py"))
BVLC_COUNT = 52  # the tests BVLC's suite holds (all pass on a CPU build of Caffe)


def caffe_checkout(root: Path) -> Path:
    """A Caffe source tree as BVLC's tests see it: the tests, an unbuilt ``python/caffe``
    (``_caffe.cpp`` and no compiled ``_caffe``), and BVLC's net prototxts under ``models/``
    and ``examples/``; returns the test folder."""
    tests = root / "python" / "caffe" / "test"
    tests.mkdir(parents=True)
    for f in TESTS:
        shutil.copyfile(f, tests / f.name)
    pkg = tests.parent
    (pkg / "__init__.py").write_text("from ._caffe import *  # built by `make pycaffe`\n")
    (pkg / "_caffe.cpp").write_text("// the extension's source; never compiled here\n")
    for f in FIXTURES.glob("*.prototxt"):  # examples__mnist__lenet.prototxt -> examples/mnist/
        dest = root.joinpath(*f.name.split("__"))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
    return tests


def run_suite(tests: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "purine.cli", "python", "-m", "pytest", "-q",
           "-p", "no:cacheprovider", "-o", "addopts=", str(tests), *extra]
    # The checkout's python/ folder first on sys.path, as the notebooks put it.
    env_path = str(tests.parent.parent)
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [env_path, *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_fixture_holds_bvlcs_ten_files():
    assert [f.name for f in TESTS] == [
        "test_coord_map.py", "test_draw.py", "test_io.py", "test_layer_type_list.py",
        "test_nccl.py", "test_net.py", "test_net_spec.py", "test_python_layer.py",
        "test_python_layer_with_param_str.py", "test_solver.py"]


def test_bvlc_pycaffe_tests_pass_unchanged(tmp_path):
    tests = caffe_checkout(tmp_path / "caffe")
    work = tmp_path / "work"
    work.mkdir()
    extra: tuple[str, ...] = ()
    expected = BVLC_COUNT
    if shutil.which("dot") is None:
        # caffe.draw.draw_net renders through Graphviz, as Caffe's does.
        extra, expected = ("--deselect", "test_draw.py::TestDraw::test_draw_net"), expected - 1
    r = run_suite(tests, work, *extra)
    out = r.stdout + r.stderr
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0, out[-6000:]
    assert re.search(rf"\b{expected} passed\b", summary), out[-3000:]
    assert "failed" not in summary and "error" not in summary, summary
    assert "`import caffe` is purine-caffe's pycaffe" in r.stderr
    if shutil.which("dot") is None:
        pytest.skip("BVLC's test_draw deselected: Graphviz's `dot` is not installed here "
                    f"(the other {expected} passed)")
