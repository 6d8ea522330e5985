"""``import caffe`` with no code change (``purine-caffe python``, the Jupyter kernel, the
IPython extension) and the rest of pycaffe's module-level face: apply_update,
clear_param_diffs, backward(end=), Phase, param_str_, Timer, logging, NCCL, versions."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import purine.pycaffe as caffe
from purine.errors import ProtoError
from purine.formats import caffe_pb2 as pb
from purine.pycaffe import alias, process

SCRIPT = """\
import sys
import caffe
import caffe.io
from caffe.proto import caffe_pb2
print(__name__, sys.argv[1:], caffe.__name__, caffe.io.__name__, caffe.__version__)
print(caffe.__file__)
sys.exit(int(sys.argv[-1]))
"""


def purine_python(*args: str, cwd: Path, pythonpath: Path | None = None
                  ) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-m", "purine.cli", "python", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def unbuilt_checkout(root: Path) -> Path:
    """BVLC's python/ folder before ``make pycaffe``: importing its caffe fails."""
    pkg = root / "python" / "caffe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from ._caffe import Net  # not built\n")
    (pkg / "_caffe.cpp").write_text("")
    return root / "python"


def test_a_script_runs_as_main_with_its_arguments_and_exit_code(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    python = unbuilt_checkout(tmp_path / "caffe_root")  # on sys.path: passed over
    r = purine_python("s.py", "a", "--flag", "3", cwd=tmp_path, pythonpath=python)
    assert r.returncode == 3, r.stderr
    first, second = r.stdout.splitlines()
    assert first == ("__main__ ['a', '--flag', '3'] purine.pycaffe purine.pycaffe.io "
                     f"{caffe.__version__}")
    # purine's own file (the installed copy where the install is not editable)
    assert second.endswith(os.path.join("purine", "pycaffe", "__init__.py"))
    assert r.stderr.splitlines() == [
        f"purine-caffe python: `import caffe` is purine-caffe's pycaffe {caffe.__version__} "
        f"({Path(second).parent})"]


def test_a_module_and_a_command_run_and_quiet_says_nothing(tmp_path):
    (tmp_path / "mod_q7.py").write_text(SCRIPT)
    r = purine_python("-q", "-m", "mod_q7", "x", "0", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines()[0].startswith("__main__ ['x', '0'] purine.pycaffe ")
    r = purine_python("-q", "-c", "import sys, caffe; print(sys.argv, caffe.TEST)", "y",
                      cwd=tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (0, "['-c', 'y'] 1\n", "")


def test_a_missing_script_is_one_line(tmp_path):
    r = purine_python("nope.py", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == ("purine-caffe python: can't open file 'nope.py': "
                                         "no such file")


def test_an_installed_caffe_is_shadowed_only_when_asked_and_named(tmp_path):
    real = tmp_path / "site" / "caffe"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    (real / "_caffe.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")  # a built pycaffe
    plain = subprocess.run(
        [sys.executable, "-c", "import purine.pycaffe as p, caffe; "
                               "print(p.install_as_caffe(), getattr(caffe, 'REAL', False))"],
        env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")), capture_output=True,
        text=True, timeout=120)
    assert plain.stdout.split() == ["False", "True"], plain.stderr  # the real one stays
    (tmp_path / "s.py").write_text(SCRIPT)
    r = purine_python("s.py", "0", cwd=tmp_path, pythonpath=tmp_path / "site")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].endswith(os.path.join("purine", "pycaffe", "__init__.py"))
    assert r.stderr.rstrip().endswith(f", ahead of the Caffe installed at {real}")


def test_the_jupyter_kernel_runs_its_launcher_with_purine_as_caffe(tmp_path):
    r = purine_python("--install-kernel", "--prefix", str(tmp_path / "env"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    spec = json.loads((tmp_path / "env/share/jupyter/kernels/purine-caffe/kernel.json")
                      .read_text())
    assert spec["argv"] == [sys.executable, "-m", "purine.pycaffe.run", "-q", "-m",
                            "ipykernel_launcher", "-f", "{connection_file}"]
    assert spec["language"] == "python"
    # The kernel's command line, with a stand-in for ipykernel's launcher module.
    (tmp_path / "launcher_k3.py").write_text(
        "import sys, caffe\nprint(sys.argv[1:], caffe.__name__)\n")
    argv = [a.replace("ipykernel_launcher", "launcher_k3").replace("{connection_file}", "c.json")
            for a in spec["argv"]]
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (out.stdout, out.stderr) == ("['-f', 'c.json'] purine.pycaffe\n", "")


def test_the_ipython_extension_installs_the_alias(monkeypatch):
    for name in [n for n in sys.modules if n == "caffe" or n.startswith("caffe.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if not isinstance(f, alias.CaffeAlias)])
    alias.load_ipython_extension(None)
    import caffe.coord_map
    import caffe.proto.caffe_pb2 as imported_pb2

    assert sys.modules["caffe"] is sys.modules["purine.pycaffe"]
    assert sys.modules["caffe.coord_map"] is sys.modules["purine.pycaffe.coord_map"]
    assert imported_pb2.NetParameter is pb.NetParameter
    assert sys.modules["purine.pycaffe"].__spec__.name == "purine.pycaffe"  # kept its own
    with pytest.raises(ModuleNotFoundError):
        import caffe.no_such_module_x  # noqa: F401


# -- pycaffe's Net and Solver methods ----------------------------------------------------
NET = """name: "tiny" force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 }
                              bias_filler { type: "constant" value: 0.5 } } }
layer { name: "out" type: "InnerProduct" bottom: "ip" top: "out"
        inner_product_param { num_output: 1 weight_filler { type: "constant" value: 2 } } }
"""


def tiny(tmp_path) -> caffe.Net:
    path = tmp_path / "tiny.prototxt"
    path.write_text(NET)
    return caffe.Net(str(path), caffe.TRAIN)


def test_backward_to_a_layer_returns_its_bottoms_diffs(tmp_path):
    net = tiny(tmp_path)
    net.blobs["data"].data[...] = np.arange(6).reshape(2, 3)
    net.forward()
    net.blobs["out"].diff[...] = [[1.0], [-2.0]]
    got = net.backward(start="out", end="out")
    assert list(got) == ["ip"]
    # out = ip @ W2.T with W2 = [[2, 2]]: d ip = d out @ W2
    np.testing.assert_array_equal(got["ip"], [[2.0, 2.0], [-4.0, -4.0]])
    assert list(net.backward()) == ["data"]  # the whole pass: the net's inputs


def test_clear_param_diffs_zeroes_every_parameter_diff(tmp_path):
    net = tiny(tmp_path)
    net.blobs["data"].data[...] = 1.0
    net.forward()
    net.blobs["out"].diff[...] = 1.0
    net.backward()
    assert np.abs(net.params["ip"][0].diff).sum() > 0
    net.clear_param_diffs()
    for views in net.params.values():
        for v in views:
            assert not v.diff.any()


def test_apply_update_is_one_sgd_step_without_advancing_the_iteration(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt" base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 '
        'lr_policy: "fixed" max_iter: 10 snapshot_after_train: false')
    solver = caffe.SGDSolver(str(tmp_path / "solver.prototxt"))
    w = solver.net.params["out"][0]
    w.data[...] = 0.0
    w.diff[...] = 1.0
    solver.apply_update()
    np.testing.assert_allclose(w.data, -0.01, rtol=1e-6)  # 0.01 x (1 + 0.0005 x 0)
    w.diff[...] = 1.0
    solver.apply_update()
    # history 0.01; gradient 1 + 0.0005 x (-0.01); step 0.9 x 0.01 + 0.01 x 0.999995
    np.testing.assert_allclose(w.data, -0.01 - (0.009 + 0.00999995), rtol=1e-6)
    assert solver.iter == 0


def test_a_python_layer_sees_phase_by_name_and_param_str_(tmp_path, monkeypatch):
    (tmp_path / "phase_layer_p4.py").write_text(
        "import caffe\n"
        "class L(caffe.Layer):\n"
        "    def setup(self, bottom, top):\n"
        "        self.seen = (str(self.phase), repr(self.phase), self.phase == caffe.TEST,\n"
        "                     f'{self.phase}', self.param_str_, self.param_str)\n"
        "    def reshape(self, bottom, top):\n"
        "        top[0].reshape(*bottom[0].data.shape)\n"
        "    def forward(self, bottom, top):\n"
        "        top[0].data[...] = bottom[0].data\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "n.prototxt").write_text(
        'layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 } } }\n'
        'layer { name: "p" type: "Python" bottom: "x" top: "y" python_param { '
        'module: "phase_layer_p4" layer: "L" param_str: "{\'k\': 1}" } }\n')
    for phase, name in ((caffe.TEST, "TEST"), (caffe.TRAIN, "TRAIN")):
        net = caffe.Net(str(tmp_path / "n.prototxt"), phase)
        assert net.layer_dict["p"].seen == (name, f"caffe.{name}", phase == caffe.TEST, name,
                                             "{'k': 1}", "{'k': 1}")
        assert net.layer_dict["p"].phase == phase


# -- module-level functions ----------------------------------------------------------------
def test_version_file_and_layer_types():
    assert caffe.__version__.startswith("1.0.0+purine.")
    assert caffe.__file__ == str(Path(caffe.__file__).resolve())
    assert {"Data", "Convolution", "Python"} <= set(caffe.layer_type_list())


def test_nccl_is_absent_as_in_a_caffe_built_without_it():
    assert caffe.has_nccl() is False
    for make in (caffe.NCCL.new_uid, lambda: caffe.NCCL(None, b"")):
        with pytest.raises(process.NCCLUnavailable, match="caffe.NCCL: .* has no NCCL.*"
                                                          "purine-caffe train --gpu 0,1"):
            make()


def test_timer_measures_from_start_to_stop():
    t = caffe.Timer()
    assert t.ms == 0.0
    t.start()
    time.sleep(0.05)
    t.stop()
    first = t.ms
    time.sleep(0.02)
    assert 45 <= first == t.ms < 1000  # stopped: no longer moving


def test_init_log_and_log(capsys):
    log = logging.getLogger("purine")
    level = log.level
    try:
        caffe.init_log()
        caffe.log("hello from pycaffe")
        err = capsys.readouterr().err
        assert err.startswith("I") and err.rstrip().endswith("] hello from pycaffe")
        caffe.init_log(1)  # WARNING and above
        caffe.log("quiet")
        assert capsys.readouterr().err == ""
        with pytest.raises(ValueError, match="level must be 0 .INFO. to 3 .FATAL., got 7"):
            caffe.init_log(7)
    finally:
        log.setLevel(level)  # setLevel, not the attribute: the logger caches its decision


def test_solver_count_rank_and_multiprocess(monkeypatch):
    monkeypatch.setattr(process, "solvers", process._Solvers())
    assert (caffe.solver_count(), caffe.solver_rank()) == (1, 0)
    caffe.set_solver_count(4)
    caffe.set_solver_rank(3)
    caffe.set_multiprocess(True)
    assert (caffe.solver_count(), caffe.solver_rank(), process.solvers.multiprocess) == (
        4, 3, True)
    with pytest.raises(ValueError, match="count >= 1"):
        caffe.set_solver_count(0)


def test_a_blobproto_without_a_shape_is_a_value_error():
    blob = pb.BlobProto()
    blob.data.extend([0.0] * 100)
    with pytest.raises(ValueError, match="BlobProto data") as e:
        caffe.io.blobproto_to_array(blob)
    assert isinstance(e.value, ProtoError)


def test_glog_minloglevel_silences_the_set_up_log(tmp_path):
    (tmp_path / "n.prototxt").write_text(NET)
    code = ("import purine.pycaffe as caffe; "
            f"caffe.Net({str(tmp_path / 'n.prototxt')!r}, caffe.TEST); print('built')")
    for level, logged in (("0", True), ("1", False)):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, GLOG_minloglevel=level))
        assert r.stdout == "built\n", r.stderr
        assert ("Network initialization done." in r.stderr) is logged
