"""Block hashing: local (content) hashes and the chained sequence hashes.

Local hashes match Dynamo's `compute_block_hash_for_seq` (XXH3-64, seed 1337, token ids
as little-endian u32), so kvledger and Dynamo's router agree on what a block is.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

HASH_SEED = 1337
_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack


def block_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The XXH3 seed for a request's blocks: 1337, or one derived from its LoRA and cache salt.

    Blocks computed under an adapter or a salt must never match the base model's, so
    both are folded into the seed. (kvledger's own scheme: Dynamo's LoRA hashing differs.)
    """
    if not lora_name and not cache_salt:
        return HASH_SEED
    material = b"kvledger/lora\x00" + (lora_name or "").encode() + b"\x00salt\x00" + (cache_salt or "").encode()
    return _xxh3(material, seed=HASH_SEED)


def local_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Hash every full block of `token_ids`; a trailing partial block is not a cache block."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(token_ids) // block_size * block_size
    if not full:
        return []
    try:
        # struct checks every token is an integer in [0, 2**32) at C speed.
        raw = struct.pack(f"<{full}I", *token_ids[:full])
    except (struct.error, TypeError) as error:
        raise ValueError(f"token ids must be integers in [0, 2**32): {error}") from None
    step = block_size * 4
    seed = block_seed(lora_name, cache_salt)
    return [_xxh3(raw[offset : offset + step], seed=seed) for offset in range(0, len(raw), step)]


def chain_hash(parent_sequence_hash: int, local_hash: int) -> int:
    """Sequence hash of a block whose parent has `parent_sequence_hash` (Dynamo's chaining)."""
    return _xxh3(_pack_pair(parent_sequence_hash, local_hash), seed=HASH_SEED)


def sequence_hashes(local_hashes: Iterable[int], parent_sequence_hash: int | None = None) -> list[int]:
    """Chain local hashes: `seq[0] = local[0]` at a root, `seq[i] = xxh3(seq[i-1] ‖ local[i])`."""
    result: list[int] = []
    previous = parent_sequence_hash
    for local in local_hashes:
        previous = local if previous is None else _xxh3(_pack_pair(previous, local), seed=HASH_SEED)
        result.append(previous)
    return result


# XXH3-64 of a 16-byte input (the parent ‖ local pair) is its "9 to 16 bytes" path: two
# words xored with constants from the default secret and the seed, a 64×64→128 multiply
# folded to 64 bits, then the avalanche. The constants are those of xxHash's XXH3_kSecret
# bytes 24..56 with seed 1337; tests check every output against the xxhash library.
_SECRET_24_56 = bytes.fromhex("7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221b8084674f743248e")
_U64 = (1 << 64) - 1
_words = struct.unpack("<4Q", _SECRET_24_56)
_BITFLIP_PARENT = np.uint64(((_words[0] ^ _words[1]) + HASH_SEED) & _U64)
_BITFLIP_LOCAL = np.uint64(((_words[2] ^ _words[3]) - HASH_SEED) & _U64)
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32, _SHIFT37 = np.uint64(32), np.uint64(37)
_AVALANCHE = np.uint64(0x165667919E3779F9)
_INPUT_LENGTH = np.uint64(16)
# Below this many requests still chaining, one numpy step costs more than xxhash per block.
_VECTOR_MIN_REQUESTS = 64


def _chain_step(
    parents: np.ndarray, flipped: np.ndarray, flipped_low: np.ndarray, flipped_high: np.ndarray, out: np.ndarray,
) -> None:
    """`chain_hash` elementwise into `out`, given each local hash xored with its bitflip and split in 32-bit limbs."""
    low = parents ^ _BITFLIP_PARENT
    a0, a1 = low & _LOW32, low >> _SHIFT32
    # The 128-bit product from 32×32→64 limb products, which never overflow.
    ll, lh, hl = a0 * flipped_low, a0 * flipped_high, a1 * flipped_low
    carry = ll >> _SHIFT32
    carry += lh & _LOW32
    carry += hl & _LOW32
    carry >>= _SHIFT32
    product_high = a1 * flipped_high
    product_high += lh >> _SHIFT32
    product_high += hl >> _SHIFT32
    product_high += carry
    product_high ^= low * flipped  # the low half is the wrapping product
    acc = low.byteswap()
    acc += flipped
    acc += _INPUT_LENGTH
    acc += product_high
    acc ^= acc >> _SHIFT37
    acc *= _AVALANCHE
    np.bitwise_xor(acc, acc >> _SHIFT32, out=out)


def batch_sequence_hashes(local: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`sequence_hashes` of many requests at once, bit for bit.

    `local` (uint64) holds every request's local hashes end to end, request r's at
    `local[offsets[r]:offsets[r + 1]]`. The chain is sequential along a request, so the
    loop runs over block positions, each step hashing that position of every request long
    enough to have it; the few longest requests finish with xxhash once too few remain.
    """
    local = np.asarray(local, dtype=np.uint64)
    result = local.copy()  # seq[0] = local[0]
    lengths = np.diff(offsets)
    if not lengths.size or int(lengths.max(initial=0)) < 2:
        return result
    by_length = np.argsort(-lengths, kind="stable")
    # remaining[k]: how many requests are longer than k blocks (requests sorted longest first).
    remaining = np.searchsorted(-lengths[by_length], -np.arange(int(lengths.max())), side="left")
    steps = int(np.count_nonzero(remaining >= _VECTOR_MIN_REQUESTS))  # positions 0 .. steps-1 in numpy
    if steps > 1:
        # Position-major, packed: row k holds block k of the `remaining[k]` requests longer
        # than k, longest first, so each step reads a prefix of the row before it and
        # writes its own row, both views: no gathers inside the loop, and no padding.
        row_start = np.zeros(steps + 1, dtype=np.int64)
        np.cumsum(remaining[:steps], out=row_start[1:])
        position = np.repeat(np.arange(steps), remaining[:steps])
        blocks = offsets[by_length[np.arange(row_start[-1]) - row_start[position]]] + position
        chained = np.take(local, blocks)
        flipped = chained ^ _BITFLIP_LOCAL
        flipped_low, flipped_high = flipped & _LOW32, flipped >> _SHIFT32
        with np.errstate(over="ignore"):
            for step in range(1, steps):
                parents = slice(row_start[step - 1], row_start[step - 1] + remaining[step])
                row = slice(row_start[step], row_start[step + 1])
                _chain_step(chained[parents], flipped[row], flipped_low[row], flipped_high[row], out=chained[row])
        result[blocks] = chained
    for request in by_length[: remaining[steps]].tolist() if steps < remaining.size else ():
        start, stop = int(offsets[request]) + max(steps, 1), int(offsets[request + 1])
        previous = int(result[start - 1])
        chained_tail = []
        for local_hash in local[start:stop].tolist():
            previous = _xxh3(_pack_pair(previous, local_hash), HASH_SEED)  # seed passed by position: faster
            chained_tail.append(previous)
        result[start:stop] = chained_tail
    return result
