"""The demo's default output folder is ignored by git: running `purine-caffe demo` in a checkout
leaves `git status` clean."""

import os
import shutil
import subprocess

import pytest

from purine.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")),
                    reason="needs git and a git checkout of the project")
def test_the_demo_folder_is_ignored():
    default = build_parser().parse_args(["demo"]).dir
    assert default == "purine-demo"
    for path in (f"{default}/mnist_train_lmdb/data.mdb", f"{default}/lenet_iter_1000.caffemodel"):
        r = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT,
                           timeout=60)
        assert r.returncode == 0, f"{path} is not ignored by .gitignore"
    # and only that folder: the package's own files stay tracked
    r = subprocess.run(["git", "check-ignore", "--no-index", "-q", "purine/demo.py"], cwd=ROOT,
                       timeout=60)
    assert r.returncode == 1
