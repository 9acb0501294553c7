"""Block hashing: local (content) hashes and the chained sequence hashes.

Local hashes match Dynamo's `compute_block_hash_for_seq` (XXH3-64, seed 1337, token ids
as little-endian u32; a LoRA adapter and a cache salt in the seed, multimodal hashes after
the tokens, EAGLE's one-token lookahead window), so kvledger and Dynamo's router agree on
what a block is. Where Dynamo defines nothing (a vLLM-native mm identifier, a prompt-
embedding digest, vLLM's salt on a request's first block only) kvledger's rule is
documented beside the function that applies it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import attrs
import xxhash

HASH_SEED = 1337
_xxh3 = xxhash.xxh3_64_intdigest
_U64 = (1 << 64) - 1
_pack_pair = struct.Struct("<QQ").pack


def block_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The XXH3 seed of a block: 1337, plus the LoRA adapter's and the cache salt's own hashes.

    Dynamo's `compute_salt_hash`: seed = 1337 + xxh3(lora, seed 0) + xxh3(salt, seed 1),
    wrapping at 2**64; an empty string counts as absent. Blocks computed under an adapter
    or a salt never match the base model's.
    """
    seed = HASH_SEED
    if lora_name:
        seed = (seed + _xxh3(lora_name.encode(), seed=0)) & _U64
    if cache_salt:
        seed = (seed + _xxh3(cache_salt.encode(), seed=1)) & _U64
    return seed


@attrs.frozen
class BlockKeys:
    """What besides its tokens enters one block's local hash (vLLM's per-block extra keys).

    `mm_hashes`: the block's multimodal inputs (and prompt-embedding digests) as u64s,
    appended to the token bytes in ascending order as Dynamo appends its mm objects.
    `cache_salt`: the salt declared on this block (vLLM declares it on a request's first
    block only; the chain keeps every later block apart).
    """

    mm_hashes: tuple[int, ...] = ()
    cache_salt: str | None = None


PLAIN_BLOCK = BlockKeys()
# Dynamo hands vLLM its mm hashes as 16 hex digits padded to 64 characters, and its cache
# namespace as a tagged salt; both are read back as Dynamo reads them.
_DYNAMO_SALT_PREFIX = "dynamo-cache-salt:"
_HEX = frozenset("0123456789abcdefABCDEF")


def mm_hash(identifier: str) -> int:
    """A multimodal input's u64: a 64-hex-digit identifier by its first 16 digits (Dynamo's
    form, and a sha256 digest's leading bits), any other identifier by its XXH3 (seed 0)."""
    if len(identifier) == 64 and _HEX.issuperset(identifier):
        return int(identifier[:16], 16)
    return _xxh3(identifier.encode(), seed=0)


def parse_extra_keys(extra_keys: object, lora_name: str | None = None) -> tuple[BlockKeys, ...]:
    """vLLM's `extra_keys` (one entry per block, tags stripped) as each block's hash keys.

    An entry holds, in order: the LoRA name (when the event has one; it already seeds the
    hash), `(mm_identifier, offset)` pairs, the cache salt (a string), prompt-embedding
    digests (bytes). Raises ValueError naming the block and item it cannot read.
    """
    if extra_keys is None:
        return ()
    if not isinstance(extra_keys, (list, tuple)):
        raise ValueError(f"extra_keys must be a list (one entry per block), got {type(extra_keys).__name__}")
    return tuple(_block_keys(entry, lora_name, position) for position, entry in enumerate(extra_keys))


def _block_keys(entry: object, lora_name: str | None, position: int) -> BlockKeys:
    if entry is None:
        return PLAIN_BLOCK
    if not isinstance(entry, (list, tuple)):
        raise ValueError(f"extra_keys[{position}] must be a list or null, got {type(entry).__name__}")
    hashes: list[int] = []
    salt: str | None = None
    lora_pending = bool(lora_name)
    for item in entry:
        if isinstance(item, str):
            if lora_pending and item == lora_name:
                lora_pending = False  # the adapter, already in the seed
            elif item.startswith(_DYNAMO_SALT_PREFIX) and len(item) > len(_DYNAMO_SALT_PREFIX):
                salt = item[len(_DYNAMO_SALT_PREFIX):]
            else:
                salt = item
        elif isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str):
            hashes.append(mm_hash(item[0]))  # the offset places the input; the identifier is what it is
        elif isinstance(item, (bytes, bytearray)):
            hashes.append(_xxh3(bytes(item), seed=0))  # a prompt-embedding digest
        else:
            raise ValueError(f"extra_keys[{position}] has an item kvledger cannot hash: {item!r:.80}")
    if not hashes and salt is None:
        return PLAIN_BLOCK
    return BlockKeys(tuple(sorted(hashes)), salt)


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        # struct checks every token is an integer in [0, 2**32) at C speed.
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except (struct.error, TypeError) as error:
        raise ValueError(f"token ids must be integers in [0, 2**32): {error}") from None


def local_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    block_keys: Sequence[BlockKeys] = (),
    lookahead: int = 0,
    lookahead_token_ids: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Hash every full block of `token_ids`; a trailing partial block is not a cache block.

    `cache_salt` is a request's salt: it enters its first block, as vLLM declares it.
    `block_keys[i]` are block i's extra keys. A block's lookahead tokens (vLLM's
    `lookahead_token_ids[i]`, or the next `lookahead` tokens of the request; 1 is Dynamo's
    EAGLE window) follow its own tokens in the hashed bytes; with `lookahead`, a block
    without that many tokens after it is not yet a cache block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if lookahead < 0:
        raise ValueError(f"lookahead must not be negative, got {lookahead}")
    count = (len(token_ids) - lookahead) // block_size if lookahead else len(token_ids) // block_size
    if count <= 0:
        return []
    if not block_keys and not cache_salt and not lookahead and lookahead_token_ids is None:
        full = count * block_size
        raw = _pack_tokens(token_ids[:full])
        step = block_size * 4
        seed = block_seed(lora_name)
        return [_xxh3(raw[offset : offset + step], seed=seed) for offset in range(0, len(raw), step)]
    if lookahead_token_ids is not None and len(lookahead_token_ids) < count:
        raise ValueError(f"{count} blocks but lookahead token ids for {len(lookahead_token_ids)}")
    raw = _pack_tokens(token_ids[: count * block_size + lookahead])
    step = block_size * 4
    base_seed = block_seed(lora_name)
    result = []
    for position in range(count):
        offset = position * step
        data = raw[offset : offset + step + lookahead * 4]
        if lookahead_token_ids is not None:
            data += _pack_tokens(lookahead_token_ids[position])
        keys = block_keys[position] if position < len(block_keys) else PLAIN_BLOCK
        if keys.mm_hashes:
            data += struct.pack(f"<{len(keys.mm_hashes)}Q", *keys.mm_hashes)
        salt = keys.cache_salt or (cache_salt if position == 0 else None)
        result.append(_xxh3(data, seed=block_seed(lora_name, salt) if salt else base_seed))
    return result


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
