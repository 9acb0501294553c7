"""Requests' sequence hashes, compiled: XXH3-64 of the 16-byte (parent ‖ local) pair, seed 1337, exactly
`kvledger.core.hashing.chain_hash` (tests/test_decide_hashing.py checks it bit for bit)."""

from __future__ import annotations

import struct

import numpy as np

from kvledger.core.hashing import HASH_SEED

# Sets numba's kernel cache folder before any kernel below is decorated.
from kvledger.decide.compiled import compiled as _compiled, inlined as _inlined

# XXH3's "9 to 16 bytes" path: the two words xored with constants from the default secret
# (bytes 24..56) and the seed, a 64×64→128 multiply folded to 64 bits, then the avalanche.
_U32 = np.uint64(0xFFFFFFFF)
_AVALANCHE = np.uint64(0x165667919E3779F9)
_SIXTEEN = np.uint64(16)
_S32, _S37, _S8 = np.uint64(32), np.uint64(37), np.uint64(8)
_BYTE = np.uint64(0xFF)


def _secret_constants() -> tuple[np.uint64, np.uint64]:
    words = struct.unpack("<4Q", bytes.fromhex("7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221b8084674f743248e"))
    mask = (1 << 64) - 1
    return np.uint64(((words[0] ^ words[1]) + HASH_SEED) & mask), np.uint64(((words[2] ^ words[3]) - HASH_SEED) & mask)


_BITFLIP_PARENT, _BITFLIP_LOCAL = _secret_constants()


@_inlined
def _byteswap(value):
    result = np.uint64(0)
    for _ in range(8):
        result = (result << _S8) | (value & _BYTE)
        value >>= _S8
    return result


@_inlined
def wide_product(a, b):
    """The 128-bit product of two u64 words, as (high word, low word)."""
    a0, a1 = a & _U32, a >> _S32
    b0, b1 = b & _U32, b >> _S32
    ll, lh, hl = a0 * b0, a0 * b1, a1 * b0
    middle = (ll >> _S32) + (lh & _U32) + (hl & _U32)
    return a1 * b1 + (lh >> _S32) + (hl >> _S32) + (middle >> _S32), a * b


@_inlined
def chain_hash(parent, local):
    """`kvledger.core.hashing.chain_hash`: xxh3_64(parent ‖ local as little-endian u64s, seed 1337)."""
    low = parent ^ _BITFLIP_PARENT
    high = local ^ _BITFLIP_LOCAL
    product_high, product_low = wide_product(low, high)
    folded = product_high ^ product_low
    acc = _byteswap(low) + high + _SIXTEEN + folded
    acc ^= acc >> _S37
    acc *= _AVALANCHE
    return acc ^ (acc >> _S32)


@_compiled
def chain_hashes(local, offsets):
    """Every request's sequence hashes: `seq[0] = local[0]`, `seq[i] = chain_hash(seq[i-1], local[i])`."""
    result = local.copy()
    for request in range(offsets.size - 1):
        for block in range(offsets[request] + 1, offsets[request + 1]):
            result[block] = chain_hash(result[block - 1], local[block])
    return result
