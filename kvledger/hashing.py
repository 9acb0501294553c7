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


def _chain_pairs(parents: np.ndarray, flipped_locals: np.ndarray) -> np.ndarray:
    """`chain_hash` elementwise; `flipped_locals` are local hashes already xored with their bitflip."""
    low = parents ^ _BITFLIP_PARENT
    a0, a1 = low & _LOW32, low >> _SHIFT32
    b0, b1 = flipped_locals & _LOW32, flipped_locals >> _SHIFT32
    ll, lh, hl, hh = a0 * b0, a0 * b1, a1 * b0, a1 * b1  # 32×32→64 limb products never overflow
    middle = (ll >> _SHIFT32) + (lh & _LOW32) + (hl & _LOW32)
    product_low = (middle << _SHIFT32) | (ll & _LOW32)
    product_high = hh + (lh >> _SHIFT32) + (hl >> _SHIFT32) + (middle >> _SHIFT32)
    acc = _INPUT_LENGTH + low.byteswap() + flipped_locals + (product_low ^ product_high)
    acc ^= acc >> _SHIFT37
    acc *= _AVALANCHE
    acc ^= acc >> _SHIFT32
    return acc


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
    starts = np.asarray(offsets[:-1], dtype=np.int64)
    flipped = local ^ _BITFLIP_LOCAL
    by_length = np.argsort(-lengths, kind="stable")
    # remaining[k]: how many requests are longer than k blocks (requests sorted longest first).
    remaining = np.searchsorted(-lengths[by_length], -np.arange(int(lengths.max())), side="left")
    position = 1
    with np.errstate(over="ignore"):
        while position < remaining.size and remaining[position] >= _VECTOR_MIN_REQUESTS:
            blocks = starts[by_length[: remaining[position]]] + position
            result[blocks] = _chain_pairs(result[blocks - 1], flipped[blocks])
            position += 1
    if position < remaining.size:
        for request in by_length[: remaining[position]].tolist():
            start, stop = int(offsets[request]) + position, int(offsets[request + 1])
            previous = int(result[start - 1])
            tail = local[start:stop].tolist()
            chained = []
            for local_hash in tail:
                previous = _xxh3(_pack_pair(previous, local_hash), seed=HASH_SEED)
                chained.append(previous)
            result[start:stop] = chained
    return result
