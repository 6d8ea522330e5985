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


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(data):
            raise ProtoError("truncated varint")
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, pos
        shift += 7


def length_fields(data: bytes, number: int) -> Iterator[bytes]:
    """The payloads of the top-level length-delimited fields ``number`` of a message."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _read_varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, pos = _read_varint(data, pos)
            if field == number:
                yield data[pos: pos + n]
            pos += n
        else:
            raise ProtoError(f"unsupported wire type {wire} for field {field}")
