"""Block hashing: local (content) hashes and the chained sequence hashes.

Local hashes match Dynamo's `compute_block_hash_for_seq` (XXH3-64, seed 1337, token ids
as little-endian u32), so kvledger and Dynamo's router agree on what a block is.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

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
