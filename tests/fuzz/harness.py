"""The fuzz suite's shared pieces: the outcome check (success, or one line of PurineError that
names the file), the example counter conftest reports, the size bound a case must stay under,
and the mutation strategies over wire bytes, BlobProto messages and prototxt text."""

from __future__ import annotations

import functools
import math
import os
import re
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import currently_in_test_context, event, settings
from hypothesis import strategies as st

from purine.caffe.solver import DivergenceError
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.wire import varint as wire_varint

F = TypeVar("F", bound=Callable[..., Any])
Draw = st.DrawFn

# -- running a case ----------------------------------------------------------------------
EXAMPLES: Counter[str] = Counter()
"""Examples run, by ``module::test``: conftest prints them when the session ends."""

SKIPPED: Counter[str] = Counter()
"""Cases skipped for asking more than the size bound, by the setting that asked."""


def counted(test: F) -> F:
    """Count each example ``test`` runs (put it under ``@given``)."""
    key = f"{test.__module__.rsplit('.', 1)[-1]}::{test.__name__}"

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        EXAMPLES[key] += 1
        return test(*args, **kwargs)

    return run  # type: ignore[return-value]


def share(fraction: float) -> settings:
    """Settings giving a test ``fraction`` of the active profile's max_examples, so ``long``
    scales every test alike."""
    return settings(max_examples=max(1, round(settings.default.max_examples * fraction)))


def check(run: Callable[[], object], path: str | os.PathLike | None,
          also: tuple[str, ...] = ()) -> str:
    """Run one case. Success, a one-line PurineError naming ``path`` (or one of ``also``: a
    layer, for a net that parses but does not build; a file the given one refers to), or an
    OSError about a file that does not exist pass; anything else fails the test. Returns
    the outcome's name (an error's class name, or "success")."""
    where = None if path is None else os.fspath(path)
    names = ([where] if where else []) + list(also)
    names += [repr(n)[1:-1] for n in names]  # shown escaped: a control character as \\x05
    try:
        run()
    except PurineError as e:
        name, msg = type(e).__name__, str(e)
        assert msg and "\n" not in msg, f"{name} is not one line: {msg!r}"
        # A run that diverges is the training's outcome, not a fault of any one file.
        assert where is None or isinstance(e, DivergenceError) or any(n in msg for n in names), (
            f"{name} does not name {where}: {msg!r}")
        _event(f"error {name}")
        return name
    except OSError as e:
        if e.filename is None or os.path.exists(e.filename):
            raise
        _event("error OSError (no such file)")
        return "OSError"
    _event("success")
    return "success"


def _event(outcome: str) -> None:
    """Hypothesis' statistics of outcomes (regression tests call check outside hypothesis)."""
    if currently_in_test_context():
        event(outcome)


# -- the size bound ----------------------------------------------------------------------
INT_BOUND = 256
"""A mutated integer setting above this (a dim, num_output, pad, iter_size ...) may ask for
gigabytes or hours. The project refuses a blob larger than the machine's memory, but one
just under it would still fill the memory or take minutes, so the harness skips such cases
and counts them (conftest prints the count)."""
CELLS_BOUND = 1 << 20
"""Values in one declared shape (an Input, DummyData, Reshape shape)."""
_FREE_INTS = {"seed", "random_seed", "ignore_label", "level", "min_level", "max_level",
              "label", "iter", "current_step", "max_iter", "snapshot", "display",
              "test_interval", "stepsize", "stepvalue", "average_loss", "device_id", "axis",
              "top_k", "snapshot_format", "solver_mode", "type", "phase"}
_INT_TYPES = {FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64,
              FieldDescriptor.CPPTYPE_UINT32, FieldDescriptor.CPPTYPE_UINT64}


def _repeated(field: FieldDescriptor) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf 6.31+, where ``label`` is going away
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


def too_big(msg: Message) -> tuple[str, int] | None:
    """The first setting of ``msg`` (searched recursively) past the bounds, as (field name,
    value), or None; a shape past CELLS_BOUND is ("shape", its product). Seeds, enums,
    iteration counts and the like are not sizes."""
    for field, value in msg.ListFields():
        values = value if _repeated(field) else [value]
        if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            for m in values:
                found = too_big(m)
                if found:
                    return found
        elif field.cpp_type in _INT_TYPES and field.name not in _FREE_INTS:
            for v in values:
                if v > INT_BOUND:
                    return field.name, v
    if isinstance(msg, pb.BlobShape):
        cells = math.prod(abs(d) for d in msg.dim)
        if cells > CELLS_BOUND:
            return "shape", cells
    return None


def skip_if_too_big(msg: Message) -> bool:
    """Whether to skip a case whose settings pass the bound (see INT_BOUND); counted."""
    found = too_big(msg)
    if found is None:
        return False
    SKIPPED[found[0]] += 1
    _event(f"skipped past the size bound: {found[0]}")
    return True


# -- values ------------------------------------------------------------------------------
INT32 = (-(2 ** 31), 2 ** 31 - 1)
INT64 = (-(2 ** 63), 2 ** 63 - 1)
EXTREME_INTS = (0, 1, -1, 2, 3, 2 ** 31 - 1, 2 ** 31, -(2 ** 31), 2 ** 32, 2 ** 62, 2 ** 63 - 1,
                -(2 ** 63), 2 ** 64 - 1)
EXTREME_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e38, 3.5e38, 1e308, -1e308, math.inf,
                  -math.inf, math.nan)


def ints_in(lo_hi: tuple[int, int]) -> st.SearchStrategy[int]:
    """Small integers and the extremes, clipped to a field's range."""
    lo, hi = lo_hi
    return st.one_of(st.integers(-2, 6), st.sampled_from(EXTREME_INTS)).map(
        lambda v: min(max(v, lo), hi))


def varint(n: int) -> bytes:
    """Protobuf's varint of ``n`` (a negative number as its 64-bit two's complement)."""
    return wire_varint(n & ((1 << 64) - 1))


# -- byte mutations ----------------------------------------------------------------------
def _index(draw: Draw, b: bytearray) -> int:
    return draw(st.integers(0, max(len(b) - 1, 0)))


def _flip(draw: Draw, b: bytearray) -> bytearray:
    if b:
        b[_index(draw, b)] ^= draw(st.sampled_from((0x01, 0x80, 0xFF, 0x7F, 0x08)))
    return b


def _truncate(draw: Draw, b: bytearray) -> bytearray:
    return b[:draw(st.integers(0, len(b)))]


def _delete(draw: Draw, b: bytearray) -> bytearray:
    i = _index(draw, b)
    del b[i:i + draw(st.integers(1, 8))]
    return b


def _insert(draw: Draw, b: bytearray) -> bytearray:
    i = draw(st.integers(0, len(b)))
    b[i:i] = draw(st.binary(min_size=1, max_size=8))
    return b


def _duplicate(draw: Draw, b: bytearray) -> bytearray:
    i = _index(draw, b)
    chunk = b[i:i + draw(st.integers(1, 32))]
    j = draw(st.integers(0, len(b)))
    b[j:j] = chunk
    return b


def _splice_varint(draw: Draw, b: bytearray) -> bytearray:
    """Replace the varint starting at a byte with another value, or an overlong varint."""
    if not b:
        return b
    i = j = _index(draw, b)
    while j < len(b) and b[j] & 0x80:
        j += 1
    new = draw(st.one_of(st.sampled_from(EXTREME_INTS).map(varint),
                         st.just(b"\xff" * 10 + b"\x01"), st.integers(0, 300).map(varint)))
    b[i:j + 1] = new
    return b


BYTE_OPS = (_flip, _truncate, _delete, _insert, _duplicate, _splice_varint)


@st.composite
def mutated_bytes(draw: Draw, data: bytes, max_ops: int = 4) -> bytes:
    """``data`` after 1..max_ops byte-level mutations."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, max_ops))):
        b = draw(st.sampled_from(BYTE_OPS))(draw, b)
    return bytes(b)


# -- BlobProto mutations -----------------------------------------------------------------
def _tricky_shapes(n: int) -> list[tuple[int, ...]]:
    """Shapes whose product, taken naively or in int64, equals ``n`` or 0 although they are
    no shape for ``n`` values."""
    return [(-1, -n), (-n,), (2 ** 32, 2 ** 32), (2 ** 62, 4), (n, 0), (0,), (), (n, 1, 1, 1, 1),
            (1, n), (2 ** 63 - 1,), (n, -1)]


def _blob_shape(draw: Draw, b: pb.BlobProto) -> None:
    n = len(b.data) or len(b.double_data)
    dims = draw(st.one_of(st.lists(ints_in(INT64), max_size=5),
                          st.sampled_from(_tricky_shapes(n))))
    b.shape.ClearField("dim")
    b.shape.dim.extend(dims)


def _blob_clear_shape(draw: Draw, b: pb.BlobProto) -> None:
    b.ClearField("shape")


def _blob_legacy(draw: Draw, b: pb.BlobProto) -> None:
    field = draw(st.sampled_from(("num", "channels", "height", "width")))
    setattr(b, field, draw(ints_in(INT32)))


def _blob_values(draw: Draw, b: pb.BlobProto) -> None:
    field = draw(st.sampled_from(("data", "double_data", "diff", "double_diff")))
    values = list(getattr(b, field))
    keep = draw(st.integers(0, len(values)))
    extra = draw(st.lists(st.sampled_from(EXTREME_FLOATS), max_size=4))
    b.ClearField(field)
    getattr(b, field).extend(values[:keep] + extra)


def _blob_double(draw: Draw, b: pb.BlobProto) -> None:
    """Both float and double payloads, or the payload moved to double_data."""
    b.double_data.extend(b.data)
    if draw(st.booleans()):
        b.ClearField("data")


BLOB_OPS = (_blob_shape, _blob_clear_shape, _blob_legacy, _blob_values, _blob_double)


@st.composite
def mutated_blob(draw: Draw, blob: pb.BlobProto, max_ops: int = 3) -> pb.BlobProto:
    """A copy of ``blob`` after 1..max_ops structured mutations (shape, legacy dims, payload
    lengths, float vs double)."""
    out = pb.BlobProto()
    out.CopyFrom(blob)
    for _ in range(draw(st.integers(1, max_ops))):
        draw(st.sampled_from(BLOB_OPS))(draw, out)
    return out


# -- prototxt text mutations -------------------------------------------------------------
NUMBER = re.compile(r"(?<![\w.])-?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)(?![\w.])")
ENUM = re.compile(r"(?<=:)\s*[A-Z][A-Z0-9_]*\b")
STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
KEY = re.compile(r"\b[a-z_][a-z0-9_]*(?=\s*[:{])")
TEXT_NUMBERS = ("0", "-1", "1", "2147483647", "2147483648", "-2147483649", "4294967296",
                "9223372036854775808", "18446744073709551616", "1e308", "-1e308", "1e-320",
                "nan", "inf", "-inf", "0.5", "-0", "0x10", "1e39", "3")
ENUM_NAMES = ("MAX", "AVE", "STOCHASTIC", "SUM", "PROD", "TRAIN", "TEST", "LMDB", "LEVELDB",
              "CAFFE", "CUDNN", "DEFAULT", "VALID", "FULL", "BATCH_SIZE", "NONE", "L1", "L2",
              "GPU", "CPU", "ACROSS_CHANNELS", "WITHIN_CHANNEL", "FAN_IN", "AVERAGE", "BOGUS",
              "max", "0", "7", "-1")
STRINGS = ('""', '"x"', '"a\\nb"', '"a\nb"', '"\\000"', '"data"', '"label"', '"loss"',
           '"Convolution"', '"InnerProduct"', '"Pooling"', '"Input"', '"Python"',
           '"DummyData"', '"Data"', '"Reshape"', '"Split"', '"Concat"', '"Slice"', '"Eltwise"',
           '"Crop"', '"Tile"', '"Embed"', '"Deconvolution"', '"LSTM"', '"Softmax"',
           '"/nonexistent/x"', '"\\xff\\xfe"', '"é"', '"' + "n" * 300 + '"', "'single'",
           '"unterminated')
JUNK = ("\x00", "{", "}", ":", '"', "#", "\\", "é", "\ufeff", "\n", " layer {", "\t", "<",
        "\x7f", ";", "[", "]", "0")


def _field_names(desc: Any, seen: set[str]) -> set[str]:
    names: set[str] = set()
    if desc.full_name in seen:
        return names
    seen.add(desc.full_name)
    for f in desc.fields:
        names.add(f.name)
        if f.message_type is not None:
            names |= _field_names(f.message_type, seen)
    return names


def field_names(msg: type[Message]) -> tuple[str, ...]:
    """Every field name reachable from ``msg``'s schema, sorted (a pool for renaming keys)."""
    return tuple(sorted(_field_names(msg.DESCRIPTOR, set())))


FIELD_LINE = re.compile(r"^[^{}]*:[^{}]*$")
"""A line holding one scalar field: dropping or repeating it keeps the braces balanced."""


def _pick_line(draw: Draw, lines: list[str], pattern: re.Pattern | None = None) -> int | None:
    idx = [i for i, line in enumerate(lines) if pattern is None or pattern.search(line)]
    return draw(st.sampled_from(idx)) if idx else None


def _replace_match(draw: Draw, lines: list[str], pattern: re.Pattern,
                   values: st.SearchStrategy[str]) -> list[str]:
    i = _pick_line(draw, lines, pattern)
    if i is not None:
        matches = list(pattern.finditer(lines[i]))
        m = matches[draw(st.integers(0, len(matches) - 1))]
        lines[i] = lines[i][:m.start()] + draw(values) + lines[i][m.end():]
    return lines


def _drop(draw: Draw, lines: list[str], keys: tuple[str, ...]) -> list[str]:
    i = _pick_line(draw, lines)
    if i is not None:
        del lines[i]
    return lines


def _drop_field(draw: Draw, lines: list[str], keys: tuple[str, ...]) -> list[str]:
    i = _pick_line(draw, lines, FIELD_LINE)
    if i is not None:
        del lines[i]
    return lines


def _dup_field(draw: Draw, lines: list[str], keys: tuple[str, ...]) -> list[str]:
    i = _pick_line(draw, lines, FIELD_LINE)
    if i is not None:
        lines.insert(i, lines[i])
    return lines


def _swap(draw: Draw, lines: list[str], keys: tuple[str, ...]) -> list[str]:
    i, j = _pick_line(draw, lines), _pick_line(draw, lines)
    if i is not None and j is not None:
        lines[i], lines[j] = lines[j], lines[i]
    return lines


def _number(draw: Draw, lines: list[str], keys: tuple[str, ...]) -> list[str]:
    return _replace_match(draw, lines, NUMBER, st.sampled_from(TEXT_NUMBERS))


def _small_number(draw: Draw, lines: list[str], keys: tuple[str, ...]) -> list[str]:
    """A small value in place of a number: zero sizes and strides, odd kernels, big pads."""
    return _replace_match(draw, lines, NUMBER, st.integers(-1, 40).map(str))


def _enum(draw: Draw, lines: list[str], keys: tuple[str, ...]) -> list[str]:
    return _replace_match(draw, lines, ENUM, st.sampled_from(ENUM_NAMES).map(" ".__add__))


def _string(draw: Draw, lines: list[str], keys: tuple[str, ...]) -> list[str]:
    return _replace_match(draw, lines, STRING, st.sampled_from(STRINGS))


def _key(draw: Draw, lines: list[str], keys: tuple[str, ...]) -> list[str]:
    return _replace_match(draw, lines, KEY, st.sampled_from(keys))


def _junk(draw: Draw, lines: list[str], keys: tuple[str, ...]) -> list[str]:
    i = _pick_line(draw, lines)
    if i is not None:
        p = draw(st.integers(0, len(lines[i])))
        lines[i] = lines[i][:p] + draw(st.sampled_from(JUNK)) + lines[i][p:]
    return lines


# Weighted towards mutations that keep the text parseable, so that most cases reach the
# builders rather than stop at the parser.
LINE_OPS = (_drop_field, _drop_field, _dup_field, _dup_field, _number, _number, _small_number,
            _small_number, _small_number, _enum, _string, _string, _drop, _swap, _key, _junk)


@st.composite
def mutated_text(draw: Draw, seeds: list[str], keys: tuple[str, ...],
                 max_ops: int = 4) -> bytes:
    """A seed prototxt after 1..max_ops line mutations (drop, duplicate, swap lines; numbers
    to extremes; other enum names, strings, keys; junk characters), then possibly cut short
    or given bytes that are not UTF-8. Returns the file's bytes."""
    lines = draw(st.sampled_from(seeds)).splitlines()
    for _ in range(draw(st.integers(1, max_ops))):
        lines = draw(st.sampled_from(LINE_OPS))(draw, lines, keys)
    data = "\n".join(lines).encode()
    tail = draw(st.sampled_from(("none",) * 6 + ("truncate", "bytes")))
    if tail == "truncate":
        data = data[:draw(st.integers(0, len(data)))]
    elif tail == "bytes":
        p = draw(st.integers(0, len(data)))
        data = data[:p] + draw(st.sampled_from((b"\xff", b"\xc3", b"\x00", b"\xed\xa0\x80"))) \
            + data[p:]
    return data
