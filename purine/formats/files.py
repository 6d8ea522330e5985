"""Bounded reads of the files a user names: every reader of a prototxt, caffemodel,
solverstate, binaryproto, mean, window or list file takes its bytes from ``read_bounded``,
so an endless input (``/dev/zero``, a FIFO that never ends) is one line, not a hung read."""

from __future__ import annotations

import os
import stat

from purine.errors import PurineError

# protobuf refuses a message of 2 GiB or more (Caffe's kProtoReadBytesLimit is INT_MAX):
# a binary Caffe file can never be longer than this.
BINARY_LIMIT = 2**31 - 1
# Text files (prototxts, window and list files): a net prototxt is kilobytes and the
# ImageNet list files tens of megabytes; a gigabyte is far past any real one.
TEXT_LIMIT = 2**30
_CHUNK = 1 << 20  # what one read() asks of a pipe, so memory grows only with what came


def _refuse(error: type[PurineError], path: str, what: str, why: str) -> PurineError:
    return error(f"{path}: cannot read{' ' + what if what else ''}: {why}")


def read_bounded(path: str | os.PathLike, limit: int, *, what: str = "",
                 error: type[PurineError] = PurineError) -> bytes:
    """The bytes of the file ``path``, at most ``limit`` of them. A regular file longer
    than ``limit`` is refused before anything is read; a pipe or FIFO is read until it ends
    or passes ``limit``; a device (``/dev/zero``), a directory or a missing file is refused.
    Errors are ``error``: ``<path>: cannot read <what>: <why>`` in one line."""
    path = os.fspath(path)
    try:
        f = open(path, "rb", buffering=0)
    except ValueError:  # a NUL in the path
        raise error(f"{path!r}: not a valid file name (it holds a NUL character)") from None
    except OSError as e:
        raise _refuse(error, path, what, e.strerror or str(e)) from None
    with f:
        try:
            st = os.fstat(f.fileno())
            if stat.S_ISREG(st.st_mode):
                if st.st_size > limit:
                    raise _refuse(error, path, what, f"it is larger than {limit} bytes "
                                                     f"({st.st_size} bytes)")
                first = st.st_size + 1  # one more: a file that grows meanwhile shows it
            elif stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                first = _CHUNK  # a pipe or process substitution (<(...)): bounded below
            else:
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device"
                raise _refuse(error, path, what, f"it is not a regular file ({kind})")
            chunks, total = [], 0
            size = min(first, limit + 1)
            while True:
                chunk = f.read(size)
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > limit:
                    raise _refuse(error, path, what, f"it is larger than {limit} bytes "
                                                     "(it did not end)")
                size = min(_CHUNK, limit + 1 - total)
        except OSError as e:
            raise _refuse(error, path, what, e.strerror or str(e)) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_bounded_text(path: str | os.PathLike, limit: int = TEXT_LIMIT, *, what: str = "",
                      error: type[PurineError] = PurineError) -> str:
    """``read_bounded`` decoded as UTF-8; bytes that are not UTF-8 are kept as surrogate
    escapes (a path in a list file is bytes to the file system, as in Caffe)."""
    return read_bounded(path, limit, what=what, error=error).decode("utf-8", "surrogateescape")
