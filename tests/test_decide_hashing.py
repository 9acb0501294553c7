"""decide's compiled chaining: XXH3 over many requests equals `sequence_hashes`, bit for bit."""

from __future__ import annotations

import struct

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.hashing import HASH_SEED, sequence_hashes

from decide.kernels import chain_hash, chain_hashes

U64 = st.integers(min_value=0, max_value=2**64 - 1)
# Edges of the 64×64→128 multiply's limbs and of the sign bit, besides random words.
EDGES = st.sampled_from([0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1])
HASHES = st.one_of(U64, EDGES)


def flat(requests: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum([len(request) for request in requests], out=offsets[1:])
    return np.array([h for request in requests for h in request], dtype=np.uint64), offsets


@settings(max_examples=300, deadline=None)
@given(requests=st.lists(st.lists(HASHES, max_size=12), max_size=12))
def test_batch_chaining_equals_sequence_hashes(requests: list[list[int]]) -> None:
    local, offsets = flat(requests)
    assert chain_hashes(local, offsets).tolist() == [h for r in requests for h in sequence_hashes(r)]


@settings(max_examples=200, deadline=None)
@given(parent=HASHES, local=HASHES)
def test_one_step_is_xxh3_of_parent_then_local(parent: int, local: int) -> None:
    expected = xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=HASH_SEED)
    assert int(chain_hash(np.uint64(parent), np.uint64(local))) == expected
    assert chain_hashes(*flat([[parent, local]])).tolist() == [parent, expected]


def test_no_requests_and_empty_requests() -> None:
    assert chain_hashes(*flat([])).tolist() == []
    assert chain_hashes(*flat([[], [5], []])).tolist() == [5]


def test_a_few_long_requests_among_many_short_ones() -> None:
    rng = np.random.default_rng(7)
    requests = [rng.integers(0, 2**64, size=3000, dtype=np.uint64).tolist() for _ in range(64)]
    requests += [rng.integers(0, 2**64, size=2, dtype=np.uint64).tolist() for _ in range(20_000)]
    local, offsets = flat(requests)
    assert chain_hashes(local, offsets).tolist() == [h for r in requests for h in sequence_hashes(r)]
