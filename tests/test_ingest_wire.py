"""Engine wire formats: golden frames for every variant docs/ingest.md lists, and a fuzz test."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.events import Cleared, Removed, Stored, Tier
from kvledger.core.hashing import local_block_hashes
from kvledger.ingest import wire
from kvledger.ingest.wire import MEDIUM_TIERS, WireError, block_hash, decode_payload, replay_request, split_publisher_frames, split_replay_frames
from kvledger.sim.vllm import VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored, encode_vllm_batch

TOKENS = list(range(1, 33))
LOCAL = tuple(local_block_hashes(TOKENS, 16))
BIG = 2**64 - 5  # above 2**63: normal for engine hashes
pack = msgspec.msgpack.encode


def stored_map(**overrides) -> dict:
    event = {
        "type": "BlockStored", "block_hashes": [BIG, 7], "parent_block_hash": 3, "token_ids": TOKENS,
        "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None,
        "group_idx": 0, "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None,
        "locality": "LOCAL", "ownership": "OWNED", "session_id": None,
    }
    event.update(overrides)
    return event


def test_vllm_current_format_batch_array_with_tagged_maps() -> None:
    payload = pack([1700000000.5, [stored_map(), {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}, {"type": "AllBlocksCleared"}], 2])
    batch = decode_payload(payload)
    assert batch.engine_ts == 1700000000.5 and batch.dp_rank == 2
    assert batch.events == (
        Stored(Tier.DEVICE, (BIG, 7), 3, 16, LOCAL, None, None, 0, "OWNED", "full_attention"),
        Removed(Tier.HOST, (7,)),
        Cleared(Tier.DEVICE),  # vLLM's clear is its GPU pool's
    )


def test_the_encoder_speaks_what_the_decoder_reads() -> None:
    payload = encode_vllm_batch(
        5.0,
        [VllmBlockStored((BIG, 7), None, tuple(TOKENS), 16, "CPU_TIER2", "adapter"), VllmBlockRemoved((BIG,), None), VllmAllBlocksCleared()],
        1,
    )
    assert msgspec.msgpack.decode(payload)[1][0]["type"] == "BlockStored"
    batch = decode_payload(payload)
    assert batch.events == (
        Stored(Tier.DISK, (BIG, 7), None, 16, tuple(local_block_hashes(TOKENS, 16, lora_name="adapter")), "adapter", None, 0,
               None, "full_attention"),
        Removed(Tier.DEVICE, (BIG,)),
        Cleared(Tier.DEVICE),
    )


def test_older_tagged_array_events_with_trailing_fields_missing() -> None:
    full = ["BlockStored", [1, 2], None, TOKENS, 16, None, "CPU", None, None]
    short = ["BlockStored", [1, 2], 9, TOKENS, 16]  # no lora_id, medium, ... : device tier
    longer = ["BlockStored", [1, 2], None, TOKENS, 16, None, "DISK", None, None, 0, "full", None, "LOCAL", "OWNED", None, "future-field"]
    batch = decode_payload(pack([1.0, [full, short, longer, ["BlockRemoved", [1], "GPU"], ["BlockRemoved", [2]], ["AllBlocksCleared"]], None]))
    assert [type(e).__name__ for e in batch.events] == ["Stored", "Stored", "Stored", "Removed", "Removed", "Cleared"]
    assert batch.events[0].tier is Tier.HOST and batch.events[0].parent_hash is None
    assert batch.events[1].tier is Tier.DEVICE and batch.events[1].parent_hash == 9
    assert batch.events[2].tier is Tier.DISK
    assert batch.events[4] == Removed(Tier.DEVICE, (2,))


def test_sglang_two_element_batch() -> None:
    batch = decode_payload(pack([2.5, [stored_map(medium=None)]]))
    assert batch.dp_rank is None and batch.events[0].tier is Tier.DEVICE


def test_tensorrt_llm_map_events_in_a_map_batch_with_unknown_keys() -> None:
    event = {"type": "BlockStored", "block_hashes": [-1], "parent_block_hash": None, "token_ids": TOKENS[:16],
             "block_size": 16, "medium": "CPU_PINNED", "window_size": 4096, "priority": 35}
    batch = decode_payload(pack({"ts": 9.0, "events": [event], "data_parallel_rank": 0, "attention_dp_rank": 0}))
    assert batch.events == (Stored(Tier.HOST, (2**64 - 1,), None, 16, LOCAL[:1], None, None, 0),)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (0, 0), (2**63, 2**63), (2**64 - 1, 2**64 - 1), (-1, 2**64 - 1), (-(2**63), 2**63),
        (b"\x01\x02", 0x0102), (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),
    ],
)
def test_block_hash_normalisation(raw, expected: int) -> None:
    assert block_hash(raw) == expected


@pytest.mark.parametrize("raw", [2**64, -(2**63) - 1, 1.5, "abc", None, True, b""])
def test_block_hashes_that_are_not_u64_are_wire_errors(raw) -> None:
    with pytest.raises(WireError):
        block_hash(raw)


@pytest.mark.parametrize(("medium", "tier"), sorted(MEDIUM_TIERS.items(), key=lambda item: str(item[0])))
def test_every_medium_maps_to_its_tier(medium, tier: Tier) -> None:
    batch = decode_payload(pack([1.0, [stored_map(medium=medium), {"type": "BlockRemoved", "block_hashes": [1], "medium": medium}]]))
    assert batch.events[0].tier is tier and batch.events[1].tier is tier


def test_expected_tiers_from_design() -> None:
    assert {m for m, t in MEDIUM_TIERS.items() if t is Tier.DEVICE} == {None, "GPU", "DEVICE"}
    assert {m for m, t in MEDIUM_TIERS.items() if t is Tier.HOST} == {"CPU", "CPU_PINNED", "CPU_TIER1"}
    assert {m for m, t in MEDIUM_TIERS.items() if t is Tier.DISK} == {"CPU_TIER2", "DISK", "NVME", "STORAGE", "SHARED_STORAGE"}
    assert {m for m, t in MEDIUM_TIERS.items() if t is Tier.EXTERNAL} == {"EXTERNAL", "NETWORK", "REMOTE", "SHARED", "OBJECT_STORE"}


def test_remote_locality_is_kept_out_of_inventory_and_counted() -> None:
    batch = decode_payload(pack([1.0, [stored_map(locality="REMOTE"), {"type": "BlockRemoved", "block_hashes": [1], "locality": "REMOTE"}, stored_map()]]))
    assert len(batch.events) == 1 and batch.skipped_remote == 2


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (pack(["x", []]), "ts must be a number"),
        (pack([1.0, "events"]), "events must be a list"),
        (pack([1.0]), "batch must be"),
        (pack([1.0, [], -1]), "data_parallel_rank"),
        (b"\xc1", "not msgpack"),
    ],
)
def test_malformed_batches_give_a_precise_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        decode_payload(payload)


@pytest.mark.parametrize(
    ("bad", "tag", "reason"),
    [
        (stored_map(medium="TAPE"), "BlockStored", "unknown medium 'TAPE'"),
        (stored_map(token_ids=TOKENS[:20]), "BlockStored", "2 blocks of 16 tokens but 20 token ids"),
        (stored_map(block_size=0), "BlockStored", "block_size must be positive when token ids are given"),
        (stored_map(block_size=-1), "BlockStored", "block_size must be a non-negative integer"),
        (stored_map(token_ids=[1.5] * 32), "BlockStored", "token ids"),
        (stored_map(extra_keys=[None]), "BlockStored", "extra_keys has 1 entries for 2 blocks"),
        (stored_map(ownership="x" * 200), "BlockStored", "ownership is longer than 128"),
        ({"type": "BlockMoved"}, "BlockMoved", "unknown event type 'BlockMoved'"),
        ({"no": "type"}, "", "no string 'type' tag"),
        (42, "", "tagged map or a tagged array"),
    ],
)
def test_one_bad_event_is_rejected_alone_and_the_rest_of_its_batch_decodes(bad, tag: str, reason: str) -> None:
    good = stored_map()
    batch = decode_payload(pack([1.0, [good, bad, {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}]]))
    assert [type(event).__name__ for event in batch.events] == ["Stored", "Removed"]
    [rejected] = batch.rejected
    assert (rejected.position, rejected.tag) == (1, tag) and reason in rejected.reason
    assert msgspec.msgpack.decode(rejected.raw) == bad  # the dead-letter copy is the event as sent
    assert rejected.loses_state is (tag != "BlockStored")


def test_oversized_batches_are_refused_before_decoding() -> None:
    with pytest.raises(WireError, match="exceeds the limit of 10"):
        decode_payload(b"x" * 11, max_bytes=10)


def test_publisher_frames() -> None:
    frames = split_publisher_frames([b"kv", (2**64 - 1).to_bytes(8, "big"), b"p"])
    assert frames.seq == 2**64 - 1 and frames.payload == b"p" and frames.topic == b"kv"
    with pytest.raises(WireError, match="expected 3 frames"):
        split_publisher_frames([b"kv", b"p"])
    with pytest.raises(WireError, match="8 bytes"):
        split_publisher_frames([b"kv", b"\x01", b"p"])


def test_replay_framings_old_and_new_and_the_end_marker() -> None:
    seq = (5).to_bytes(8, "big")
    assert split_replay_frames([b"", seq, b"p"]).seq == 5  # older
    assert split_replay_frames([b"kv", seq, b"p"]).seq == 5  # newer, topic first
    assert split_replay_frames([b"", b"kv", seq, b"p"]).payload == b"p"  # newer, with delimiter
    end = split_replay_frames([b"", b"kv", (-1).to_bytes(8, "big", signed=True), b""])
    assert end.seq is None
    assert replay_request(7) == [b"", (7).to_bytes(8, "big")]
    with pytest.raises(WireError):
        split_replay_frames([b"only"])


MSGPACK_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=10),
              st.binary(max_size=10), st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type"])),
    lambda children: st.one_of(st.lists(children, max_size=6), st.dictionaries(st.sampled_from(
        ["type", "block_hashes", "token_ids", "block_size", "medium", "parent_block_hash", "ts", "events", "locality", "x"]), children, max_size=6)),
    max_leaves=30,
)


@settings(deadline=None, max_examples=400)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_ever_raise_wire_errors(data: bytes) -> None:
    try:
        decode_payload(data)
    except WireError:
        pass


@settings(deadline=None, max_examples=400)
@given(st.one_of(MSGPACK_VALUES, st.tuples(st.floats(), st.lists(MSGPACK_VALUES, max_size=4)).map(list),
                 st.tuples(st.floats(), st.lists(st.lists(MSGPACK_VALUES, max_size=10), max_size=3), MSGPACK_VALUES).map(list)))
def test_arbitrary_msgpack_only_ever_raises_wire_errors(value) -> None:
    try:
        decode_payload(pack(value))
    except WireError:
        pass


# vLLM's own layout goes through a typed fast path; it must decide exactly as the generic one.
_HASHES = st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=1, max_size=9)), max_size=3)
_MEDIA = st.sampled_from([None, "GPU", "cpu", "DISK", "NVME", "REMOTE", "nowhere", ""])
_OPTIONAL_TEXT = st.one_of(st.none(), st.sampled_from(["", "adapter", "salt"]), st.integers(0, 3))


@st.composite
def _vllm_like_events(draw) -> dict:
    kind = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Unknown"]))
    hashes = draw(_HASHES)
    event: dict = {"type": kind, "block_hashes": hashes, "medium": draw(_MEDIA)}
    if kind == "BlockStored":
        block_size = draw(st.one_of(st.integers(-1, 4), st.just(True)))
        blocks = len(hashes) if draw(st.booleans()) else len(hashes) + 1
        size = block_size if isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > 0 else 2
        tokens = draw(st.lists(st.one_of(st.integers(0, 2**32 + 1), st.integers(-2, -1)), min_size=blocks * size,
                               max_size=blocks * size))
        event.update(
            token_ids=tokens, block_size=block_size, parent_block_hash=draw(st.one_of(st.none(), _HASHES.map(lambda h: h[0] if h else None))),
            lora_name=draw(_OPTIONAL_TEXT), cache_salt=draw(_OPTIONAL_TEXT),
            group_idx=draw(st.one_of(st.none(), st.integers(-1, 3), st.just(False))),
        )
        if draw(st.booleans()):
            # what hybrid models, offload tiers and multimodal requests add
            blocks_keys = draw(st.sampled_from([len(hashes), len(hashes) + 1]))
            event.update(
                extra_keys=draw(st.sampled_from([None, [None] * blocks_keys, [[["a" * 64, 0]]] * blocks_keys, [["salt"]] * blocks_keys])),
                ownership=draw(st.sampled_from([None, "kvcr", "x" * 200, 7])),
                kv_cache_spec_kind=draw(st.sampled_from([None, "full_attention", "sliding_window"])),
                kv_cache_spec_sliding_window=draw(st.sampled_from([None, -1, 64])),
            )
            if draw(st.booleans()):
                event["token_ids"] = []  # an offload placeholder
    if draw(st.booleans()):
        event["locality"] = draw(st.sampled_from(["LOCAL", "remote", "REMOTE", 5]))
    for name in draw(st.lists(st.sampled_from(["block_hashes", "medium", "token_ids", "block_size"]), max_size=1)):
        event.pop(name, None)
    return event


def _generic_or_error(payload: bytes):
    try:
        return wire._decode_any_variant(payload, wire.Engine.VLLM)
    except WireError as error:
        return ("WireError", str(error))


@settings(max_examples=400)
@given(
    st.one_of(st.floats(allow_nan=False), st.integers(-5, 5), st.just(True)),
    st.lists(_vllm_like_events(), max_size=3),
    st.one_of(st.none(), st.integers(-1, 3), st.just(False)),
)
def test_the_typed_fast_path_decides_exactly_as_the_generic_path(ts, events, dp_rank) -> None:
    payload = pack([ts, events, dp_rank])
    fast = wire._decode_vllm_layout(payload, wire.Engine.VLLM)
    if fast is not None:
        assert fast == wire._decode_any_variant(payload, wire.Engine.VLLM)
    result = decode_payload(payload) if fast is not None else None
    assert fast is None or result == fast
    try:
        assert decode_payload(payload) == _generic_or_error(payload)
    except WireError as error:
        assert _generic_or_error(payload) == ("WireError", str(error))


def test_the_fast_path_takes_vllm_batches_with_lora_salt_and_big_hashes() -> None:
    events = [stored_map(lora_name="adapter", cache_salt="s"), {"type": "BlockRemoved", "block_hashes": [BIG], "medium": "CPU"},
              {"type": "AllBlocksCleared"}]
    payload = pack([1.5, events, 2])
    fast = wire._decode_vllm_layout(payload, wire.Engine.VLLM)
    assert fast is not None and fast == wire._decode_any_variant(payload, wire.Engine.VLLM)
    # A salt enters a request's first block; these blocks continue a chain (parent 3), which keeps them apart.
    assert fast.events[0].local_hashes == tuple(local_block_hashes(TOKENS, 16, lora_name="adapter"))
    assert fast.events[0].cache_salt == "s"


def test_the_fast_path_leaves_a_wrong_count_of_extra_keys_to_the_generic_path() -> None:
    payload = pack([1.0, [stored_map(extra_keys=[None]), stored_map(extra_keys=[None, None])], 0])
    assert wire._decode_vllm_layout(payload, wire.Engine.VLLM) is None
    batch = decode_payload(payload)
    assert len(batch.events) == 1 and "extra_keys has 1 entries for 2 blocks" in batch.rejected[0].reason
