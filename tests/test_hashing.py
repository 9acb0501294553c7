"""Block hashing vectors, Dynamo compatibility, chaining, LoRA and salt separation."""

from __future__ import annotations

import struct

import pytest
import xxhash

from kvledger.core.hashing import HASH_SEED, block_seed, chain_hash, local_block_hashes, sequence_hashes


def test_local_hashes_match_dynamo_compute_block_hash_for_seq() -> None:
    # Dynamo's vector: tokens 1..32, block size 16.
    assert local_block_hashes(list(range(1, 33)), 16) == [16863443419780771464, 2287610619914608821]


def test_local_hash_is_xxh3_over_little_endian_u32_with_seed_1337() -> None:
    tokens = [0, 1, 2**32 - 1, 70000]
    assert local_block_hashes(tokens, 4) == [xxhash.xxh3_64_intdigest(struct.pack("<4I", *tokens), seed=1337)]
    assert HASH_SEED == 1337


def test_a_trailing_partial_block_is_not_hashed() -> None:
    assert len(local_block_hashes(list(range(40)), 16)) == 2
    assert local_block_hashes(list(range(15)), 16) == []


def test_sequence_chain_starts_at_the_local_hash_and_chains_parent_then_local() -> None:
    local = local_block_hashes(list(range(1, 49)), 16)
    chained = sequence_hashes(local)
    assert chained[0] == local[0]
    assert chained[1] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", chained[0], local[1]), seed=1337)
    assert chained[2] == chain_hash(chained[1], local[2])
    # continuing from a known parent gives the same tail
    assert sequence_hashes(local[1:], parent_sequence_hash=chained[0]) == chained[1:]


def test_chain_handles_hashes_above_2_63() -> None:
    big = 2**64 - 1
    assert 0 <= chain_hash(big, 2**63) < 2**64


def test_lora_and_salt_give_disjoint_blocks_and_none_equals_empty() -> None:
    tokens = list(range(1, 33))
    base = local_block_hashes(tokens, 16)
    lora = local_block_hashes(tokens, 16, lora_name="adapter-a")
    other_lora = local_block_hashes(tokens, 16, lora_name="adapter-b")
    salted = local_block_hashes(tokens, 16, cache_salt="tenant-1")
    assert len({tuple(base), tuple(lora), tuple(other_lora), tuple(salted)}) == 4
    assert local_block_hashes(tokens, 16, lora_name="", cache_salt="") == base
    assert block_seed() == block_seed("", None) == 1337
    # the separator keeps ("ab", "") and ("a", "b") apart
    assert block_seed("ab", "") != block_seed("a", "b")


@pytest.mark.parametrize("tokens", [[-1] * 16, [2**32] * 16, ["x"] * 16, [1.5] * 16, [None] * 16, [[1]] * 16, [2**70] * 16])
def test_tokens_outside_u32_are_rejected(tokens: list) -> None:
    with pytest.raises(ValueError, match="token ids"):
        local_block_hashes(tokens, 16)


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        local_block_hashes([1, 2], 0)
