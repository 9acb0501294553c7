"""Between Python objects and the kernels' arrays, by way of MessagePack, where numpy is slow.

A batch's requests, from Python values to the kernels' arrays: numpy (`np.fromiter`,
`np.array`) converts about 20–30 ns an integer, reading each one through the
interpreter's generic item protocol; at 30 blocks a request that was a fifth of a batched
answer's time. msgspec's MessagePack encoder writes the ids, the hashes and the block sizes
in one call in C (a hash as a 9-byte big-endian record), and `unpacked_requests` reads them
back: the hashes into words, the ids' UTF-8 end to end with its bounds, the block sizes.
Only the shape the encoder writes for (ids, hash lists, block sizes) is read: three arrays
of strs, of arrays of unsigned integers, and of unsigned integers. Anything else (a
negative number, a bool, a float, an integer of more than 64 bits, which the encoder
refuses; an id not a str) sends the caller back to the general conversion, which says what
is wrong.

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

from kvledger.decide.compiled import compiled as _compiled, inlined as _inlined
from kvledger.decide.ranking.kernels import copy_bytes

_encode = msgspec.msgpack.Encoder().encode
_decode_texts = msgspec.msgpack.Decoder(list[bytes]).decode

_FIXARRAY, _FIXARRAY_LAST = 0x90, 0x9F
_ARRAY16, _ARRAY32 = 0xDC, 0xDD
_FIXINT_LAST = 0x7F
_UINT8, _UINT16, _UINT32, _UINT64 = 0xCC, 0xCD, 0xCE, 0xCF
_FIXSTR, _FIXSTR_LAST = 0xA0, 0xBF
_STR8, _STR16, _STR32 = 0xD9, 0xDA, 0xDB
_BIN32 = 0xC6
_NOT_AN_ARRAY = -1
_INT64_MAX = np.uint64(2**63 - 1)


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


_U1, _U2, _U3, _U4, _U5, _U6, _U7 = (np.uint64(offset) for offset in range(1, 8))


@_inlined
def _eight_bytes(packed, at):
    """The big-endian u64 at `at` (a uint64), as one expression: with unsigned indices (no
    negative-index wrap-around per byte) the eight loads become one load and a byte swap,
    four times faster."""
    return ((np.uint64(packed[at]) << np.uint64(56)) | (np.uint64(packed[at + _U1]) << np.uint64(48))
            | (np.uint64(packed[at + _U2]) << np.uint64(40)) | (np.uint64(packed[at + _U3]) << np.uint64(32))
            | (np.uint64(packed[at + _U4]) << np.uint64(24)) | (np.uint64(packed[at + _U5]) << np.uint64(16))
            | (np.uint64(packed[at + _U6]) << np.uint64(8)) | np.uint64(packed[at + _U7]))


@_inlined
def _string_header(packed, position):
    """(length in bytes, position after the header) of a str, or (_NOT_AN_ARRAY, position)."""
    size = packed.size
    if position >= size:
        return _NOT_AN_ARRAY, position
    tag = packed[position]
    if _FIXSTR <= tag <= _FIXSTR_LAST:
        return np.int64(tag & 0x1F), position + 1
    if tag == _STR8 and position + 2 <= size:
        return np.int64(packed[position + 1]), position + 2
    if tag == _STR16 and position + 3 <= size:
        return np.int64(_big_endian(packed, position + 1, 2)), position + 3
    if tag == _STR32 and position + 5 <= size:
        return np.int64(_big_endian(packed, position + 1, 4)), position + 5
    return _NOT_AN_ARRAY, position


@_inlined
def _unsigned(packed, position, out, item):
    """Read the unsigned integer at `position` into `out[item]`; the position after it, or
    _NOT_AN_ARRAY when it is another kind of item or runs past the end."""
    size = packed.size
    if position >= size:
        return _NOT_AN_ARRAY
    tag = packed[position]
    if tag == _UINT64 and position + 9 <= size:  # what hashes mostly are
        out[item] = _eight_bytes(packed, np.uint64(position + 1))
        return position + 9
    if tag <= _FIXINT_LAST:
        out[item] = np.uint64(tag)
        return position + 1
    width = _width_of(tag)
    if width <= 0 or position + 1 + width > size:
        return _NOT_AN_ARRAY
    out[item] = _big_endian(packed, position + 1, width)
    return position + 1 + width


@_compiled
def unpacked_requests(packed):
    """From MessagePack of (request ids, lists of local hashes, block sizes), three arrays of
    the same length: (hashes end to end, offsets where each request's hashes start, the ids' UTF-8
    end to end, their bounds, block sizes, and -1, or the number of requests read before
    something was not of that shape: a str, unsigned integers, a block size below 2**63)."""
    size = packed.size
    nothing = (np.zeros(0, dtype=np.uint64), np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.uint8),
               np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    parts, position = _array_header(packed, 0)
    count, position = _array_header(packed, position)
    if parts != 3 or count < 0:
        return (*nothing, np.int64(0))
    id_bounds = np.zeros(count + 1, dtype=np.int64)
    # Every id's header takes a byte at least, so the bytes left bound the ids' bytes; and
    # every hash takes one at least, so they bound the hashes.
    ids = np.empty(size - position, dtype=np.uint8)
    for item in range(count):
        length, position = _string_header(packed, position)
        if length < 0 or position + length > size:
            return (*nothing, np.int64(item))
        id_bounds[item + 1] = copy_bytes(ids, id_bounds[item], packed, position, length)
        position += length
    lists, position = _array_header(packed, position)
    if lists != count:
        return (*nothing, np.int64(0))
    offsets = np.zeros(count + 1, dtype=np.int64)
    hashes = np.empty(size - position, dtype=np.uint64)
    total = 0
    for item in range(count):
        length, position = _array_header(packed, position)
        if length < 0:
            return (*nothing, np.int64(item))
        for _ in range(length):
            position = _unsigned(packed, position, hashes, total)
            if position < 0:
                return (*nothing, np.int64(item))
            total += 1
        offsets[item + 1] = total
    sizes, position = _array_header(packed, position)
    if sizes != count:
        return (*nothing, np.int64(0))
    block_sizes = np.empty(count, dtype=np.uint64)
    for item in range(count):
        position = _unsigned(packed, position, block_sizes, item)
        if position < 0 or block_sizes[item] > _INT64_MAX:
            return (*nothing, np.int64(item))
    return hashes[:total], offsets, ids[:id_bounds[count]], id_bounds, block_sizes.view(np.int64), np.int64(-1)


_request_id = operator.attrgetter("request_id")
_block_size = operator.attrgetter("block_size")


def packed_requests(requests: Sequence) -> tuple[np.ndarray, ...] | None:
    """The requests' local hashes end to end (uint64) and the offsets where each starts, their
    ids' UTF-8 end to end and its bounds, and their block sizes (int64), from one MessagePack
    encoding; None when some hash is not an integer in [0, 2**64), a block size not one in
    [0, 2**63), an id not a str, or the hashes not lists or tuples (the caller then converts
    them the general way, which names what is wrong)."""
    try:
        packed = _encode((list(map(_request_id, requests)), [request.local_hashes for request in requests],
                          list(map(_block_size, requests))))
    except (TypeError, OverflowError):
        return None
    *arrays, bad = unpacked_requests(np.frombuffer(packed, dtype=np.uint8))
    return tuple(arrays) if bad < 0 else None


@_inlined
def _put_big_endian_32(out, position, value):
    for offset in range(4):
        out[position + offset] = (value >> (8 * (3 - offset))) & 0xFF


@_inlined
def _framed_list(out, items):
    """A MessagePack `array 32` header of `items` items; the position after it."""
    out[0] = _ARRAY32
    _put_big_endian_32(out, 1, items)
    return 5


@_inlined
def _put_bin(out, position, buffer, bounds, item):
    """`buffer[bounds[item]:bounds[item + 1]]` as a MessagePack `bin 32`; the position after it."""
    length = bounds[item + 1] - bounds[item]
    out[position] = _BIN32
    _put_big_endian_32(out, position + 1, length)
    # Not a slice assignment: numba copies those byte by byte, slower than the Python loop
    # this replaces.
    return copy_bytes(out, position + 5, buffer, bounds[item], length)


@_compiled
def framed_texts(buffer, bounds):
    """MessagePack of a list of `bin` items, item i being `buffer[bounds[i]:bounds[i + 1]]`."""
    count = bounds.size - 1
    out = np.empty(5 + 5 * count + (bounds[count] - bounds[0]), dtype=np.uint8)
    position = _framed_list(out, count)
    for item in range(count):
        position = _put_bin(out, position, buffer, bounds, item)
    return out


def split_texts(buffer: np.ndarray, bounds: np.ndarray, count: int) -> list[bytes]:
    """A kernel's texts written end to end, as one bytes value per item (`bounds[i]:bounds[i + 1]`)."""
    if count == 1:
        return [buffer[bounds[0]:bounds[1]].tobytes()]
    return _decode_texts(framed_texts(buffer, bounds))


@_compiled
def framed_text_pairs(first, first_bounds, second, second_bounds):
    """MessagePack of a list of `bin` items: item 2i is `first`'s text i, item 2i + 1 `second`'s."""
    count = first_bounds.size - 1
    out = np.empty(5 + 10 * count + (first_bounds[count] - first_bounds[0]) + (second_bounds[count] - second_bounds[0]),
                   dtype=np.uint8)
    position = _framed_list(out, 2 * count)
    for item in range(count):
        position = _put_bin(out, position, first, first_bounds, item)
        position = _put_bin(out, position, second, second_bounds, item)
    return out


def split_text_pairs(first: np.ndarray, first_bounds: np.ndarray, second: np.ndarray, second_bounds: np.ndarray,
                     count: int) -> tuple[list[bytes], list[bytes]]:
    """`split_texts` of two buffers of `count` texts each, in one decoding."""
    texts = _decode_texts(framed_text_pairs(first, first_bounds, second, second_bounds))
    return texts[0::2], texts[1::2]
