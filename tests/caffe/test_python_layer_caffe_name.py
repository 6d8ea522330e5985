"""``import caffe`` inside a Python layer's module: the builder calls the installer that
purine.pycaffe registers when it loads, and without that face loaded it installs a stand-in
made from purine.caffe alone (Layer, TRAIN, TEST, proto); pycaffe later replaces it."""

import subprocess
import sys
import textwrap

import pytest

import purine.caffe.layers.python as pylayer
import purine.pycaffe

MODULE = """
import caffe


class Double(caffe.Layer):
    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = 2 * bottom[0].data
"""

NET = """
layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: 3 }} }} }}
layer {{ name: "d" type: "Python" bottom: "x" top: "y"
        python_param {{ module: "{module}" layer: "Double" }} }}
"""

# Run in a fresh interpreter: the test session has imported purine.pycaffe already.
SCRIPT = """
import sys
import numpy as np
from purine.caffe import TEST, Net
from purine.caffe.layers.python import Layer
net = Net({net!r}, TEST)
net.blobs["x"].data[...] = [1, 2, 3]
print(net.forward()["y"].tolist(), "purine.pycaffe" in sys.modules)
caffe = sys.modules["caffe"]
print(caffe.Layer is Layer, caffe.TEST == TEST, caffe.proto.caffe_pb2.NetParameter.__name__)
try:
    caffe.io
except AttributeError as e:
    print("AttributeError:", e)
import purine.pycaffe
print(purine.pycaffe.install_as_caffe(), sys.modules["caffe"] is purine.pycaffe)
"""


def _fresh(monkeypatch):
    """As in a fresh process: no ``caffe`` imported, no alias finder (both restored after)."""
    for name in [n for n in sys.modules if n == "caffe" or n.startswith("caffe.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if not isinstance(f, purine.pycaffe.alias.CaffeAlias)])


def _write(tmp_path, name: str) -> str:
    (tmp_path / f"{name}.py").write_text(MODULE)
    net = tmp_path / f"{name}.prototxt"
    net.write_text(NET.format(module=name))
    return str(net)


def test_without_pycaffe_loaded_the_builder_installs_a_stand_in(tmp_path):
    net = _write(tmp_path, "standin_double")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT.format(net=net))],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[2.0, 4.0, 6.0] False"  # built and ran; pycaffe never imported
    assert lines[1] == "True True NetParameter"
    assert lines[2].startswith("AttributeError: caffe.io: while purine.pycaffe is not imported")
    assert lines[3] == "True True"  # the pycaffe face replaces the stand-in


def test_with_pycaffe_loaded_the_builder_installs_pycaffe(tmp_path, monkeypatch):
    _fresh(monkeypatch)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert pylayer._caffe_installer is purine.pycaffe.install_as_caffe
    net = purine.pycaffe.Net(_write(tmp_path, "face_double"), purine.pycaffe.TEST)
    assert sys.modules["caffe"] is purine.pycaffe
    assert sys.modules["caffe.io"] is purine.pycaffe.io
    net.blobs["x"].data[...] = [1, -1, 0.5]
    assert net.forward()["y"].tolist() == [2.0, -2.0, 1.0]


def test_the_stand_in_gives_way_to_an_installed_caffe(tmp_path, monkeypatch):
    _fresh(monkeypatch)
    monkeypatch.setattr(pylayer, "_caffe_installer", None)
    (tmp_path / "caffe").mkdir()
    (tmp_path / "caffe" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not pylayer.caffe_name_free()
    pylayer._import_caffe()
    assert "caffe" not in sys.modules


@pytest.mark.parametrize("checkout", [False, True])
def test_the_stand_in_is_installed_over_nothing_or_a_source_checkout(tmp_path, monkeypatch,
                                                                      checkout):
    _fresh(monkeypatch)
    monkeypatch.setattr(pylayer, "_caffe_installer", None)
    if checkout:  # a caffe/ directory without __init__.py is no installed Caffe
        (tmp_path / "caffe" / "python").mkdir(parents=True)
        monkeypatch.syspath_prepend(str(tmp_path))
    pylayer._import_caffe()
    caffe = sys.modules["caffe"]
    assert caffe.Layer is pylayer.Layer and getattr(caffe, pylayer.STANDIN)
    with pytest.raises(AttributeError, match="caffe.Net: while purine.pycaffe is not imported"):
        caffe.Net  # noqa: B018
    assert pylayer.caffe_name_free()  # the stand-in may be replaced


# The command: pycaffe is registered when it starts, imported only by a net's Python layer.
CLI_SCRIPT = """
import sys
from purine import cli
code = cli.main(["device_query"])
print(code, "purine.pycaffe" in sys.modules)
code = cli.main(["test", "--model", {net!r}, "--iterations", "1"])
print(code, "purine.pycaffe" in sys.modules, sys.modules["caffe"] is sys.modules["purine.pycaffe"])
"""


def test_the_command_imports_pycaffe_only_for_a_python_layer(tmp_path):
    net = _write(tmp_path, "cli_double")
    script = CLI_SCRIPT.format(net=net)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["0 False", "0 True True"]
