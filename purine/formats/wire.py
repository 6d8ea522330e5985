"""The few pieces of protobuf's wire format we write by hand: packed float fields straight
from array bytes (protobuf's own repeated-field conversion is element by element), and the
project's private fields, which Caffe's readers skip as unknown fields."""

from __future__ import annotations

from collections.abc import Iterator

from purine.errors import ProtoError


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def len_field(number: int, payload: bytes | memoryview) -> list[bytes | memoryview]:
    """A length-delimited field: tag, length, payload."""
    return [varint(number << 3 | 2), varint(len(payload)), payload]


class WireError(ProtoError):
    """Bytes that do not scan as protobuf fields: a truncated varint or value, or a group."""


def read_varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    n = shift = 0
    while True:
        if pos >= len(data):
            raise WireError("truncated varint")
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, pos
        shift += 7


def fields(data: bytes | memoryview) -> Iterator[tuple[int, int, int, int, int]]:
    """The top-level fields of a message, in order: (number, wire type, start of the tag,
    start of the value, end). A length-delimited value starts at its length varint."""
    pos = 0
    while pos < len(data):
        start = pos
        key, pos = read_varint(data, pos)
        number, wire = key >> 3, key & 7
        value = pos
        if wire == 0:
            _, pos = read_varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, pos = read_varint(data, pos)
            pos += n
        else:  # groups: long obsolete, never in Caffe's schema
            raise WireError(f"unsupported wire type {wire} for field {number}")
        if pos > len(data):
            raise WireError(f"field {number} runs past the end of the message")
        yield number, wire, start, value, pos


def length_fields(data: bytes, number: int) -> Iterator[bytes]:
    """The payloads of the top-level length-delimited fields ``number`` of a message."""
    for field, wire, _, value, end in fields(data):
        if field == number and wire == 2:
            _, body = read_varint(data, value)
            yield data[body:end]
