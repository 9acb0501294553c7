"""Between Python objects and the kernels' arrays, by way of MessagePack, where numpy is slow.

A batch's local hashes, from Python integers to one uint64 array: numpy (`np.fromiter`,
`np.array`) converts about 20–30 ns an integer, reading each one through the
interpreter's generic item protocol; at 30 blocks a request that was a fifth of a batched
answer's time. msgspec's MessagePack encoder writes the same integers in C, a 9-byte
big-endian record each, and `unpacked_hashes` reads them back into words: about half the
time in all. Only the shape the encoder writes for a list of hash tuples is read: an array
of arrays of unsigned integers. Anything else (a negative number, a bool, a float, an
integer of more than 64 bits, which the encoder refuses) sends the caller back to numpy's
conversion, which says what is wrong.

A kernel's texts, end to end in one buffer, back to one bytes value each: slicing them in a
Python loop cost about 140 ns a text (an answer of 450 bytes); `framed_texts` puts a
MessagePack `bin 32` header before each (a copy of the buffer, 20 ns a text) and msgspec's
decoder makes the bytes values in C (60 ns).

Compiled by numba and cached with the other kernels.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import msgspec
import numpy as np

from decide.compiled import compiled as _compiled, inlined as _inlined
from decide.kernels import copy_bytes

_encode = msgspec.msgpack.Encoder().encode
_decode_texts = msgspec.msgpack.Decoder(list[bytes]).decode
_local_hashes = operator.attrgetter("local_hashes")

_FIXARRAY, _FIXARRAY_LAST = 0x90, 0x9F
_ARRAY16, _ARRAY32 = 0xDC, 0xDD
_FIXINT_LAST = 0x7F
_UINT8, _UINT16, _UINT32, _UINT64 = 0xCC, 0xCD, 0xCE, 0xCF
_BIN32 = 0xC6
_NOT_AN_ARRAY = -1


@_inlined
def _big_endian(packed, position, width):
    value = np.uint64(0)
    for offset in range(width):
        value = (value << np.uint64(8)) | np.uint64(packed[position + offset])
    return value


@_inlined
def _array_header(packed, position):
    """(items, position after the header), or (_NOT_AN_ARRAY, position)."""
    if position >= packed.size:
        return _NOT_AN_ARRAY, position
    tag = packed[position]
    if _FIXARRAY <= tag <= _FIXARRAY_LAST:
        return np.int64(tag & 0x0F), position + 1
    if tag == _ARRAY16 and position + 3 <= packed.size:
        return np.int64(_big_endian(packed, position + 1, 2)), position + 3
    if tag == _ARRAY32 and position + 5 <= packed.size:
        return np.int64(_big_endian(packed, position + 1, 4)), position + 5
    return _NOT_AN_ARRAY, position


@_inlined
def _width_of(tag):
    """Bytes after the tag of an unsigned integer with this tag; -1 for any other kind of item."""
    if tag <= _FIXINT_LAST:
        return 0
    if tag == _UINT8:
        return 1
    if tag == _UINT16:
        return 2
    if tag == _UINT32:
        return 4
    if tag == _UINT64:
        return 8
    return -1


@_inlined
def _eight_bytes(packed, position):
    """The big-endian u64 at `position`, as one expression (a single load and byte swap)."""
    return ((np.uint64(packed[position]) << np.uint64(56)) | (np.uint64(packed[position + 1]) << np.uint64(48))
            | (np.uint64(packed[position + 2]) << np.uint64(40)) | (np.uint64(packed[position + 3]) << np.uint64(32))
            | (np.uint64(packed[position + 4]) << np.uint64(24)) | (np.uint64(packed[position + 5]) << np.uint64(16))
            | (np.uint64(packed[position + 6]) << np.uint64(8)) | np.uint64(packed[position + 7]))


@_compiled
def unpacked_hashes(packed):
    """(hashes end to end, offsets where each list starts, -1 or the number of good items
    before the first that is not an unsigned integer or runs past the end) from MessagePack of
    a list of lists of unsigned integers."""
    lists, position = _array_header(packed, 0)
    if lists < 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(1, dtype=np.int64), np.int64(0)
    offsets = np.zeros(lists + 1, dtype=np.int64)
    # One pass: every item takes at least one byte, so the bytes left bound the items.
    hashes = np.empty(packed.size - position, dtype=np.uint64)
    size = packed.size
    total = 0
    for item in range(lists):
        length, position = _array_header(packed, position)
        if length < 0:
            return np.zeros(0, dtype=np.uint64), offsets, np.int64(total)
        for _ in range(length):
            if position >= size:
                return np.zeros(0, dtype=np.uint64), offsets, np.int64(total)
            tag = packed[position]
            if tag == _UINT64 and position + 9 <= size:  # what hashes mostly are
                hashes[total] = _eight_bytes(packed, position + 1)
                position += 9
            elif tag <= _FIXINT_LAST:
                hashes[total] = np.uint64(tag)
                position += 1
            else:
                width = _width_of(tag)
                if width <= 0 or position + 1 + width > size:
                    return np.zeros(0, dtype=np.uint64), offsets, np.int64(total)
                hashes[total] = _big_endian(packed, position + 1, width)
                position += 1 + width
            total += 1
        offsets[item + 1] = total
    return hashes[:total], offsets, np.int64(-1)


def packed_local_hashes(requests: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
    """All requests' local hashes end to end as uint64, and the offsets where each request
    starts; None when some hash is not an integer in [0, 2**64) or the hashes are not lists
    or tuples (the caller then converts them the general way, which names what is wrong)."""
    try:
        packed = _encode(list(map(_local_hashes, requests)))
    except (TypeError, OverflowError):
        return None
    hashes, offsets, bad = unpacked_hashes(np.frombuffer(packed, dtype=np.uint8))
    return (hashes, offsets) if bad < 0 else None


@_inlined
def _put_big_endian_32(out, position, value):
    for offset in range(4):
        out[position + offset] = (value >> (8 * (3 - offset))) & 0xFF


@_compiled
def framed_texts(buffer, bounds):
    """MessagePack of a list of `bin` items, item i being `buffer[bounds[i]:bounds[i + 1]]`."""
    count = bounds.size - 1
    out = np.empty(5 + 5 * count + (bounds[count] - bounds[0]), dtype=np.uint8)
    out[0] = _ARRAY32
    _put_big_endian_32(out, 1, count)
    position = 5
    for item in range(count):
        length = bounds[item + 1] - bounds[item]
        out[position] = _BIN32
        _put_big_endian_32(out, position + 1, length)
        # Not a slice assignment: numba copies those byte by byte, slower than the Python loop
        # this replaces.
        position = copy_bytes(out, position + 5, buffer, bounds[item], length)
    return out


def split_texts(buffer: np.ndarray, bounds: np.ndarray, count: int) -> list[bytes]:
    """A kernel's texts written end to end, as one bytes value per item (`bounds[i]:bounds[i + 1]`)."""
    if count == 1:
        return [buffer[bounds[0]:bounds[1]].tobytes()]
    return _decode_texts(framed_texts(buffer, bounds))
