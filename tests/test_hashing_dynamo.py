"""Local hashes with extra keys equal Dynamo's `compute_block_hash_for_seq` wherever Dynamo defines one.

The wheel (`ai-dynamo-runtime`, in the test extra) is the oracle: LoRA adapters, multimodal
objects, EAGLE's one-token window, and a cache namespace on a request's first block
(kvledger salts only that block, as vLLM declares it; the chain keeps the rest apart).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.hashing import PLAIN_BLOCK, BlockKeys, local_block_hashes, mm_hash, parse_extra_keys

dynamo = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is not installed")

TOKENS = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=70)
BLOCK_SIZES = st.sampled_from((1, 4, 16))
NAMES = st.one_of(st.none(), st.text(min_size=1, max_size=12))
MM = st.lists(st.integers(0, 2**64 - 1), max_size=3)


@settings(max_examples=300, deadline=None)
@given(tokens=TOKENS, block_size=BLOCK_SIZES, lora=NAMES, mm=st.lists(MM, max_size=6))
def test_lora_and_multimodal_blocks_hash_as_dynamo_hashes_them(tokens, block_size, lora, mm) -> None:
    blocks = len(tokens) // block_size
    mm = (mm + [[]] * blocks)[:blocks]
    infos = [{"mm_objects": [{"mm_hash": h, "offsets": [[0, 1]]} for h in hashes]} if hashes else None for hashes in mm]
    keys = [BlockKeys(tuple(sorted(hashes))) if hashes else PLAIN_BLOCK for hashes in mm]
    expected = dynamo.compute_block_hash_for_seq(tokens, block_size, block_mm_infos=infos or None, lora_name=lora)
    assert local_block_hashes(tokens, block_size, lora_name=lora, block_keys=keys) == expected


@settings(max_examples=200, deadline=None)
@given(tokens=TOKENS, block_size=BLOCK_SIZES, lora=NAMES)
def test_one_token_of_lookahead_is_dynamos_eagle_window(tokens, block_size, lora) -> None:
    expected = dynamo.compute_block_hash_for_seq(tokens, block_size, lora_name=lora, is_eagle=True)
    assert local_block_hashes(tokens, block_size, lora_name=lora, lookahead=1) == expected


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=64), salt=st.text(min_size=1, max_size=12), lora=NAMES)
def test_a_salted_requests_first_block_is_dynamos_namespaced_block(tokens, salt, lora) -> None:
    ours = local_block_hashes(tokens, 16, lora_name=lora, cache_salt=salt)
    namespaced = dynamo.compute_block_hash_for_seq(tokens, 16, lora_name=lora, cache_namespace=salt)
    plain = dynamo.compute_block_hash_for_seq(tokens, 16, lora_name=lora)
    assert ours[0] == namespaced[0] != plain[0]
    assert ours[1:] == plain[1:]  # later blocks: apart through the chain, not the seed


def test_vllm_extra_keys_read_as_dynamo_reads_its_own_mm_identifiers() -> None:
    """Dynamo hands vLLM an mm hash as 16 hex digits padded with zeros, and reads it back the same way."""
    identifier = f"{0x1234ABCD:016x}" + "0" * 48
    keys = parse_extra_keys([[[identifier, 4]], [[identifier, -12], "ignored-salt"]])
    assert keys[0] == BlockKeys((0x1234ABCD,)) and keys[1] == BlockKeys((0x1234ABCD,), "ignored-salt")
    tokens = list(range(32))
    infos = [{"mm_objects": [{"mm_hash": 0x1234ABCD, "offsets": [[4, 20]]}]}] * 2
    assert local_block_hashes(tokens, 16, block_keys=keys[:1] * 2) == dynamo.compute_block_hash_for_seq(
        tokens, 16, block_mm_infos=infos)
    # vLLM's own identifiers (a sha256 hex digest, or any other string) stay distinct from one another.
    assert mm_hash("ab" * 32) == int("ab" * 8, 16) and mm_hash("image-a") != mm_hash("image-b")
