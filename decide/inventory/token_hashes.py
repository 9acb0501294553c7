"""Blocks' local hashes from token ids, compiled: XXH3-64 of each block's tokens as little-endian u32.

`kvledger.core.hashing.local_block_hashes` calls the xxhash library once per block from
Python; a router's query hashes a dozen blocks or more, and those calls cost more than the
index walk after them. Here one compiled call hashes every block of a request, for blocks of
up to `MAX_BLOCK_TOKENS` tokens (240 bytes: XXH3's short and mid-size paths, which need no
derived secret); longer blocks, and what the compiled path does not hash (a cache salt,
per-block extra keys), stay with `local_block_hashes`. tests/test_token_hashes.py checks
every length and seeds against the xxhash library.
"""

from __future__ import annotations

import numpy as np

from kvledger.decide.compiled import compiled as _compiled, inlined as _inlined

MAX_BLOCK_TOKENS = 60  # 240 bytes, XXH3_MIDSIZE_MAX

# XXH3's default secret (kSecret), 192 bytes.
_SECRET = np.array([
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
], dtype=np.uint8)

_PRIME64_1 = np.uint64(0x9E3779B185EBCA87)
_PRIME_MX1 = np.uint64(0x165667919E3779F9)
_PRIME_MX2 = np.uint64(0x9FB21C651E98DF25)
_LOW32 = np.uint64(0xFFFFFFFF)
_U = np.uint64


@_inlined
def _secret64(offset):
    value = _U(0)
    for byte in range(8):
        value |= _U(_SECRET[offset + byte]) << _U(8 * byte)
    return value


@_inlined
def _input64(tokens, first, byte_offset):
    """Little-endian u64 at `byte_offset` (a multiple of 4) of the block starting at token `first`."""
    at = first + byte_offset // 4
    return _U(tokens[at]) | (_U(tokens[at + 1]) << _U(32))


@_inlined
def _mul128_fold64(a, b):
    a_lo, a_hi, b_lo, b_hi = a & _LOW32, a >> _U(32), b & _LOW32, b >> _U(32)
    lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    cross = (lo_lo >> _U(32)) + (hi_lo & _LOW32) + lo_hi
    upper = (hi_lo >> _U(32)) + (cross >> _U(32)) + hi_hi
    lower = (cross << _U(32)) | (lo_lo & _LOW32)
    return lower ^ upper


@_inlined
def _avalanche(h):
    h ^= h >> _U(37)
    h *= _PRIME_MX1
    return h ^ (h >> _U(32))


@_inlined
def _rotl(value, bits):
    return (value << _U(bits)) | (value >> _U(64 - bits))


@_inlined
def _swap64(value):
    swapped = _U(0)
    for byte in range(8):
        swapped |= ((value >> _U(8 * byte)) & _U(0xFF)) << _U(8 * (7 - byte))
    return swapped


@_inlined
def _mix16(tokens, first, byte_offset, secret_offset, seed):
    low = _input64(tokens, first, byte_offset) ^ (_secret64(secret_offset) + seed)
    high = _input64(tokens, first, byte_offset + 8) ^ (_secret64(secret_offset + 8) - seed)
    return _mul128_fold64(low, high)


@_compiled
def xxh3_block(tokens, first, count, seed):
    """XXH3-64 with `seed` of tokens[first:first + count] as little-endian u32 (1 <= count <= 60)."""
    length = _U(4 * count)
    size = 4 * count
    if size <= 8:
        seed ^= (((seed & _LOW32) >> _U(24)) | (((seed >> _U(16)) & _U(0xFF)) << _U(8))
                 | (((seed >> _U(8)) & _U(0xFF)) << _U(16)) | ((seed & _U(0xFF)) << _U(24))) << _U(32)
        input1, input2 = _U(tokens[first]), _U(tokens[first + count - 1])
        bitflip = (_secret64(8) ^ _secret64(16)) - seed
        keyed = (input2 + (input1 << _U(32))) ^ bitflip
        keyed ^= _rotl(keyed, 49) ^ _rotl(keyed, 24)
        keyed *= _PRIME_MX2
        keyed ^= (keyed >> _U(35)) + length
        keyed *= _PRIME_MX2
        return keyed ^ (keyed >> _U(28))
    if size <= 16:
        low = _input64(tokens, first, 0) ^ ((_secret64(24) ^ _secret64(32)) + seed)
        high = _input64(tokens, first, size - 8) ^ ((_secret64(40) ^ _secret64(48)) - seed)
        return _avalanche(length + _swap64(low) + high + _mul128_fold64(low, high))
    acc = length * _PRIME64_1
    if size <= 128:
        if size > 32:
            if size > 64:
                if size > 96:
                    acc += _mix16(tokens, first, 48, 96, seed)
                    acc += _mix16(tokens, first, size - 64, 112, seed)
                acc += _mix16(tokens, first, 32, 64, seed)
                acc += _mix16(tokens, first, size - 48, 80, seed)
            acc += _mix16(tokens, first, 16, 32, seed)
            acc += _mix16(tokens, first, size - 32, 48, seed)
        acc += _mix16(tokens, first, 0, 0, seed)
        acc += _mix16(tokens, first, size - 16, 16, seed)
        return _avalanche(acc)
    for round_number in range(8):
        acc += _mix16(tokens, first, 16 * round_number, 16 * round_number, seed)
    acc = _avalanche(acc)
    for round_number in range(8, size // 16):
        acc += _mix16(tokens, first, 16 * round_number, 16 * (round_number - 8) + 3, seed)
    acc += _mix16(tokens, first, size - 16, 136 - 17, seed)
    return _avalanche(acc)


@_compiled
def token_block_hashes(tokens, block_size, seed):
    """Every full block's local hash (XXH3-64 of its tokens, `seed`); a trailing partial block is not hashed."""
    count = tokens.size // block_size
    hashes = np.empty(count, dtype=np.uint64)
    for block in range(count):
        hashes[block] = xxh3_block(tokens, block * block_size, block_size, seed)
    return hashes
