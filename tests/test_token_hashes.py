"""decide's compiled block hashing (decide/inventory/token_hashes.py) against the xxhash library, which
`kvledger.core.hashing.local_block_hashes` (the reference) calls: every block length it takes, any seed."""

from __future__ import annotations

import struct

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.hashing import block_seed, local_block_hashes

from kvledger.decide.inventory.token_hashes import MAX_BLOCK_TOKENS, token_block_hashes, xxh3_block

TOKENS = st.integers(0, 2**32 - 1)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(TOKENS, min_size=1, max_size=MAX_BLOCK_TOKENS), seed=st.integers(0, 2**64 - 1))
def test_a_block_hashes_as_xxhash_does(tokens: list[int], seed: int) -> None:
    expected = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=seed)
    assert int(xxh3_block(np.array(tokens, dtype=np.uint32), 0, len(tokens), np.uint64(seed))) == expected


def test_every_length_at_the_paths_bounds() -> None:
    rng = np.random.default_rng(3)
    for count in range(1, MAX_BLOCK_TOKENS + 1):  # 4..240 bytes: the 4-8, 9-16, 17-128 and 129-240 byte paths
        tokens = rng.integers(0, 2**32, size=count, dtype=np.uint64).astype(np.uint32)
        for seed in (0, 1337, 2**63, 2**64 - 1):
            expected = xxhash.xxh3_64_intdigest(tokens.astype("<u4").tobytes(), seed=seed)
            assert int(xxh3_block(tokens, 0, count, np.uint64(seed))) == expected, (count, seed)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(TOKENS, max_size=400), block_size=st.integers(1, MAX_BLOCK_TOKENS),
       lora=st.none() | st.text(min_size=1, max_size=8))
def test_a_requests_blocks_equal_the_reference(tokens: list[int], block_size: int, lora: str | None) -> None:
    expected = local_block_hashes(tokens, block_size, lora_name=lora)
    found = token_block_hashes(np.array(tokens, dtype=np.uint32), block_size, np.uint64(block_seed(lora)))
    assert found.tolist() == expected
