"""Bounded reads of user files: an endless input (/dev/zero, a FIFO that never ends) given as
--model, --weights, --solver or to caffemodel_summary is one line, and every reader's bound
is checked against files made here (exact bytes, one past the limit, pipes, devices)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from purine.errors import ProtoError, PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats import files
from purine.formats.files import BINARY_LIMIT, TEXT_LIMIT, read_bounded, read_bounded_text
from purine.formats.prototxt import read_binary, read_text

REPO = Path(__file__).resolve().parents[2]


def test_limits_are_protobufs_and_a_generous_text_bound():
    assert BINARY_LIMIT == 2147483647  # protobuf's (and Caffe's kProtoReadBytesLimit) INT_MAX
    assert TEXT_LIMIT == 1 << 30


def test_regular_file_up_to_the_limit(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"0123456789")
    assert read_bounded(p, 10) == b"0123456789"
    assert read_bounded(tmp_path / "f", 1000) == b"0123456789"
    with pytest.raises(PurineError, match=r"/f: cannot read: it is larger than 9 bytes "
                                          r"\(10 bytes\)$"):
        read_bounded(p, 9)
    p.write_bytes(b"")
    assert read_bounded(p, 0) == b""


def test_text_keeps_bytes_that_are_not_utf8(tmp_path):
    (tmp_path / "t").write_bytes(b"caf\xc3\xa9 \xff\n")
    text = read_bounded_text(tmp_path / "t")
    assert text == "caf\u00e9 \udcff\n"
    assert text.encode("utf-8", "surrogateescape") == b"caf\xc3\xa9 \xff\n"


def test_devices_directories_missing_files_and_nul(tmp_path):
    class Mine(PurineError):
        pass

    with pytest.raises(Mine, match=r"^/dev/zero: cannot read the thing: it is not a regular "
                                   r"file \(a device\)$"):
        read_bounded("/dev/zero", 100, what="the thing", error=Mine)
    with pytest.raises(PurineError, match=r"cannot read: (Is a directory|it is not a regular)"):
        read_bounded(tmp_path, 100)
    with pytest.raises(PurineError, match=r"/nope: cannot read: No such file or directory$"):
        read_bounded(tmp_path / "nope", 100)
    with pytest.raises(PurineError, match=r"not a valid file name \(it holds a NUL"):
        read_bounded("a\0b", 100)


def _fifo(tmp_path: Path, data: bytes, repeat: int) -> Path:
    """A FIFO a thread writes ``data`` into ``repeat`` times (0: until the reader leaves)."""
    path = tmp_path / "fifo"
    os.mkfifo(path)

    def write() -> None:
        try:
            with open(path, "wb") as f:
                k = 0
                while not repeat or k < repeat:
                    f.write(data)
                    k += 1
        except BrokenPipeError:
            pass

    threading.Thread(target=write, daemon=True).start()
    return path


def test_fifo_that_ends_is_read_whole(tmp_path):
    path = _fifo(tmp_path, b"abc" * 1000, 5)
    assert read_bounded(path, 15000) == b"abc" * 5000


def test_fifo_that_never_ends_stops_at_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_CHUNK", 4096)
    path = _fifo(tmp_path, b"x" * 1000, 0)
    with pytest.raises(PurineError, match=r"fifo: cannot read: it is larger than 100000 bytes "
                                          r"\(it did not end\)$"):
        read_bounded(path, 100_000)


def test_prototxt_and_binary_readers_use_the_bound(tmp_path, monkeypatch):
    (tmp_path / "n.prototxt").write_text('name: "tiny"\n')
    assert read_text(tmp_path / "n.prototxt", pb.NetParameter()).name == "tiny"
    monkeypatch.setattr("purine.formats.prototxt.TEXT_LIMIT", 5)
    with pytest.raises(ProtoError, match=r"n.prototxt: cannot read: it is larger than 5 bytes "
                                         r"\(13 bytes\)"):
        read_text(tmp_path / "n.prototxt", pb.NetParameter())
    (tmp_path / "b.binaryproto").write_bytes(pb.BlobProto(data=[1.0, 2.0]).SerializeToString())
    assert list(read_binary(tmp_path / "b.binaryproto", pb.BlobProto()).data) == [1.0, 2.0]
    monkeypatch.setattr("purine.formats.prototxt.BINARY_LIMIT", 3)
    with pytest.raises(ProtoError, match=r"larger than 3 bytes"):
        read_binary(tmp_path / "b.binaryproto", pb.BlobProto())


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.mark.parametrize("args, prog", [
    (("purine.cli", "train", "--solver", "/dev/zero"), "purine-caffe train"),
    (("purine.cli", "test", "--model", "/dev/zero"), "purine-caffe test"),
    (("purine.cli", "test", "--model", "models/lenet/lenet.prototxt", "--weights",
      "/dev/zero"), "purine-caffe test"),
    (("purine.converters.summary", "/dev/zero"), "caffemodel_summary"),
])
def test_dev_zero_is_one_line(args, prog):
    r = _cli(*args)
    assert r.returncode == 1, r.stderr
    # --weights is read once the net is built, after Caffe's set-up log lines
    errors = [line for line in r.stderr.splitlines() if not line.startswith(("I1", "I0"))]
    assert "Traceback" not in r.stderr
    assert errors[-1] == f"{prog}: /dev/zero: cannot read: it is not a regular file (a device)"
    assert r.stderr.endswith(errors[-1] + "\n")


def test_endless_fifo_as_model_is_one_line(tmp_path):
    """The real bound (1 GiB of text) in a subprocess: a FIFO that never ends."""
    path = _fifo(tmp_path, b"layer {\n" * 8192, 0)
    r = _cli("purine.cli", "test", "--model", str(path), timeout=300)
    assert r.returncode == 1
    assert r.stderr == (f"purine-caffe test: {path}: cannot read: it is larger than "
                        f"{1 << 30} bytes (it did not end)\n")
