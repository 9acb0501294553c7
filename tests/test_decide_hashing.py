"""decide's compiled chaining: XXH3 over many requests equals `sequence_hashes`, bit for bit;
and a batch's hashes, ids and block sizes and a kernel's texts, passed through MessagePack,
come back as they went in."""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.hashing import HASH_SEED, sequence_hashes
from kvledger.core.reuse import ReuseRequest

from kvledger.decide.inventory.chain import chain_hash, chain_hashes
from kvledger.decide.ranking.packed import packed_requests, split_text_pairs, split_texts, unpacked_requests
from kvledger.decide.ranking.ranked import RequestArrays, local_hashes_of, request_ids_of

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


# Every width MessagePack writes an unsigned integer in: fixint, 8, 16, 32 and 64 bits.
PACKED_WIDTHS = st.sampled_from([0, 127, 128, 255, 256, 2**16 - 1, 2**16, 2**32 - 1, 2**32, 2**64 - 1])
# Ids in every string header MessagePack writes (fixstr, str 8, str 16), and not ASCII.
REQUEST_IDS = st.one_of(st.text(max_size=40), st.sampled_from(["x" * 31, "y" * 32, "z" * 255, "w" * 256, "é" * 40000]))
BLOCK_SIZES = st.one_of(st.integers(min_value=0, max_value=2**63 - 1), st.sampled_from([0, 127, 128, 2**16, 2**63 - 1]))


def general_arrays(batch: list[ReuseRequest]) -> RequestArrays:
    """The general conversion's arrays, which the packed path must equal."""
    return RequestArrays(*flat([list(r.local_hashes) for r in batch]), *request_ids_of(batch),
                         np.array([r.block_size for r in batch], dtype=np.int64))


@settings(max_examples=300, deadline=None)
@given(requests=st.lists(st.tuples(REQUEST_IDS, st.lists(st.one_of(U64, PACKED_WIDTHS), max_size=20), BLOCK_SIZES),
                         min_size=2, max_size=20))
def test_a_batch_packed_through_messagepack_reads_back_as_numpy_converts_it(requests) -> None:
    batch = [ReuseRequest(request_id, tuple(hashes), block_size) for request_id, hashes, block_size in requests]
    packed = packed_requests(batch)
    assert packed is not None
    local, offsets, ids, id_bounds, block_sizes = packed
    expected = general_arrays(batch)
    assert local.dtype == np.uint64 and local.tolist() == expected.local.tolist()
    assert offsets.tolist() == expected.offsets.tolist()
    assert ids.tobytes() == expected.ids.tobytes() and id_bounds.tolist() == expected.id_bounds.tolist()
    assert block_sizes.dtype == np.int64 and block_sizes.tolist() == expected.block_sizes.tolist()
    assert [ids[id_bounds[i]:id_bounds[i + 1]].tobytes().decode() for i in range(len(batch))] == [r[0] for r in requests]


def test_lists_longer_than_messagepacks_short_headers_read_back() -> None:
    # 16 items need a 16-bit array header, 65 536 a 32-bit one; 17 lists need one outside.
    requests = [list(range(length)) for length in (15, 16, 65_536)] + [[2**63]] * 14
    hashes, offsets, *_ = packed_requests([ReuseRequest("r", tuple(r), 16) for r in requests])
    assert hashes.tolist() == [h for r in requests for h in r]
    assert offsets.tolist() == flat(requests)[1].tolist()


@pytest.mark.parametrize("value", [-1, 2**64, True, 1.5, "7"])
def test_a_hash_that_is_not_an_unsigned_64_bit_integer_is_left_to_numpy_to_name(value) -> None:
    batch = [ReuseRequest("good", (1, 2), 16), ReuseRequest("bad", (3, value), 16)]
    assert packed_requests(batch) is None
    # The general conversion then raises on what it cannot convert.
    if value in (-1, 2**64):
        with pytest.raises(OverflowError):
            local_hashes_of(batch)


@pytest.mark.parametrize("block_size", [-1, 2**63, 2**64, 1.5, None])
def test_a_block_size_that_is_not_a_non_negative_int64_is_left_to_numpy(block_size) -> None:
    batch = [ReuseRequest("good", (1, 2), 16), ReuseRequest("bad", (3,), block_size)]
    assert packed_requests(batch) is None
    if block_size in (-1, 1.5):  # numpy converts these as it did before there was a packed path
        assert RequestArrays.of(batch).block_sizes.tolist() == [16, int(block_size)]
    else:
        with pytest.raises((OverflowError, TypeError)):
            RequestArrays.of(batch)


def test_a_request_id_that_is_not_a_string_is_left_to_the_general_way() -> None:
    batch = [ReuseRequest("good", (1, 2), 16), ReuseRequest(7, (3,), 16)]
    assert packed_requests(batch) is None
    with pytest.raises(TypeError):
        RequestArrays.of(batch)


def test_a_truncated_or_misshapen_buffer_is_reported_not_read_past() -> None:
    whole = msgspec.msgpack.encode((["a", "b"], [[1, 2**64 - 1], [3]], [16, 16]))
    for end in range(len(whole)):
        *arrays, bad = unpacked_requests(np.frombuffer(whole[:end], dtype=np.uint8))
        assert bad >= 0 and arrays[0].size == 0
    for misshapen in ((["a"], [[1]]), (["a", "b"], [[1]], [16]), (["a"], [[1]], [16, 16]), [[1, 2]], b""):
        *arrays, bad = unpacked_requests(np.frombuffer(msgspec.msgpack.encode(misshapen), dtype=np.uint8))
        assert bad >= 0 and arrays[0].size == 0
    *arrays, bad = unpacked_requests(np.frombuffer(whole, dtype=np.uint8))
    assert bad == -1 and arrays[0].tolist() == [1, 2**64 - 1, 3]


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(st.binary(max_size=300), max_size=20))
def test_texts_end_to_end_split_back_into_the_same_bytes(texts: list[bytes]) -> None:
    bounds = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum([len(text) for text in texts], out=bounds[1:])
    buffer = np.frombuffer(b"".join(texts), dtype=np.uint8)
    assert split_texts(buffer, bounds, len(texts)) == texts


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.binary(max_size=300), st.binary(max_size=300)), max_size=20))
def test_two_buffers_of_texts_split_back_in_one_decoding(pairs: list[tuple[bytes, bytes]]) -> None:
    buffers = []
    for texts in ([first for first, _ in pairs], [second for _, second in pairs]):
        bounds = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum([len(text) for text in texts], out=bounds[1:])
        buffers += [np.frombuffer(b"".join(texts), dtype=np.uint8), bounds]
    firsts, seconds = split_text_pairs(*buffers, len(pairs))
    assert firsts == [first for first, _ in pairs] and seconds == [second for _, second in pairs]
