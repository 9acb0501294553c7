"""The canonical record: round trips, schema versions, worker identity."""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.events import (
    SCHEMA_VERSION,
    Cleared,
    EventBatch,
    Gap,
    GapReason,
    Provenance,
    RecordError,
    Removed,
    Stored,
    Tier,
    WorkerId,
    decode_batch,
    encode_batch,
    validate_publisher,
)

U64 = st.integers(min_value=0, max_value=2**64 - 1)
HIGH_U64 = st.integers(min_value=2**63, max_value=2**64 - 1)
HASH = st.one_of(U64, HIGH_U64)
PUBLISHER = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-", min_size=1, max_size=40)
TEXT_OR_NONE = st.one_of(st.none(), st.text(max_size=20))


@st.composite
def stored_events(draw) -> Stored:
    hashes = draw(st.lists(HASH, max_size=8))
    local = draw(st.lists(HASH, min_size=len(hashes), max_size=len(hashes)))
    return Stored(
        tier=draw(st.sampled_from(Tier)),
        block_hashes=tuple(hashes),
        parent_hash=draw(st.one_of(st.none(), HASH)),
        block_size=draw(st.integers(min_value=1, max_value=1024)),
        local_hashes=tuple(local),
        lora_name=draw(TEXT_OR_NONE),
        cache_salt=draw(TEXT_OR_NONE),
        group_idx=draw(st.integers(min_value=0, max_value=8)),
    )


EVENTS = st.one_of(
    stored_events(),
    st.builds(Removed, st.sampled_from(Tier), st.lists(HASH, max_size=8).map(tuple)),
    st.just(Cleared()),
    st.builds(Gap, U64, U64, st.sampled_from(GapReason)),
)

BATCHES = st.builds(
    EventBatch,
    worker=st.builds(WorkerId, PUBLISHER, st.integers(min_value=0, max_value=63)),
    epoch=st.integers(min_value=0, max_value=2**32),
    seq=U64,
    engine_ts=st.floats(allow_nan=False, allow_infinity=False),
    ingest_ts=st.floats(allow_nan=False, allow_infinity=False),
    provenance=st.sampled_from(Provenance),
    events=st.lists(EVENTS, max_size=6).map(tuple),
)


@settings(deadline=None)
@given(BATCHES)
def test_every_batch_round_trips(batch: EventBatch) -> None:
    assert decode_batch(encode_batch(batch)) == batch


@settings(deadline=None)
@given(st.lists(HIGH_U64, min_size=1, max_size=20))
def test_hashes_at_or_above_2_63_survive_the_codec(hashes: list[int]) -> None:
    batch = EventBatch(
        WorkerId("w"), 0, 2**64 - 1, 0.0, 0.0, Provenance.NATIVE,
        (Stored(Tier.DEVICE, tuple(hashes), hashes[0], 16, tuple(hashes)), Removed(Tier.HOST, tuple(hashes))),
    )
    decoded = decode_batch(encode_batch(batch))
    assert decoded.events[0].block_hashes == tuple(hashes)
    assert decoded.events[1].block_hashes == tuple(hashes)
    assert all(h >= 2**63 for h in decoded.events[0].local_hashes)


def _raw_record(**overrides) -> bytes:
    record = {
        "v": SCHEMA_VERSION, "publisher": "w", "dp_rank": 0, "epoch": 0, "seq": 1,
        "engine_ts": 1.0, "ingest_ts": 2.0, "provenance": "native", "events": [["C"]],
    }
    record.update(overrides)
    return msgspec.msgpack.encode(record)


def test_a_record_from_a_newer_schema_fails_clearly() -> None:
    with pytest.raises(RecordError, match=rf"schema version {SCHEMA_VERSION + 1} is newer than this kvledger understands \(up to {SCHEMA_VERSION}\)"):
        decode_batch(_raw_record(v=SCHEMA_VERSION + 1))


def test_a_newer_record_with_a_changed_layout_still_reports_the_version() -> None:
    with pytest.raises(RecordError, match="schema version 7 is newer"):
        decode_batch(_raw_record(v=7, events="a different layout"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"events": [["S", "gpu", [1], None, 16, [1], None, None, 0]]}, "Invalid enum value 'gpu'"),
        ({"events": [["R", "device", [-1]]]}, r"Expected `int` >= 0"),
        ({"events": [["X"]]}, "Invalid value 'X'"),
        ({"events": [["S", "device", [1, 2], None, 16, [1], None, None, 0]]}, "2 block hashes but 1 local hashes"),
        ({"publisher": "a.b"}, "character '.' at position 1"),
        ({"provenance": "maybe"}, "Invalid enum value 'maybe'"),
    ],
)
def test_malformed_records_raise_a_record_error_that_says_why(overrides: dict, message: str) -> None:
    with pytest.raises(RecordError, match=message):
        decode_batch(_raw_record(**overrides))


def test_garbage_bytes_raise_a_record_error() -> None:
    with pytest.raises(RecordError, match="malformed kvledger record"):
        decode_batch(b"\xc1\xff not msgpack")


@pytest.mark.parametrize(
    ("name", "bad"),
    [("a.b", "'.'"), ("a b", "' '"), ("a*", "'*'"), ("a>", "'>'"), ("x:y", "':'"), ("tab\there", "'\\t'"), ("é", "'é'")],
)
def test_publisher_names_that_are_not_subject_tokens_are_rejected_naming_the_character(name: str, bad: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"character {bad}")):
        WorkerId(name)
    with pytest.raises(ValueError, match=re.escape(f"character {bad}")):
        validate_publisher(name)


def test_empty_publisher_and_negative_rank_are_rejected() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        WorkerId("")
    with pytest.raises(ValueError, match="dp_rank must be a non-negative integer"):
        WorkerId("w", -1)


def test_worker_identity_names_subjects_and_message_ids() -> None:
    assert WorkerId("vllm-a").name == "vllm-a"
    assert WorkerId("vllm-a", 3).name == "vllm-a/3"
    assert WorkerId.parse("vllm-a/3") == WorkerId("vllm-a", 3)
    assert WorkerId.parse("vllm-a") == WorkerId("vllm-a", 0)
    assert sorted([WorkerId("b"), WorkerId("a", 2), WorkerId("a", 10)]) == [WorkerId("a", 2), WorkerId("a", 10), WorkerId("b")]
    native = EventBatch(WorkerId("vllm-a", 2), 3, 41, 0.0, 0.0, Provenance.NATIVE, ())
    assert native.subject == "kv.ev.vllm-a.2"
    assert native.msg_id == "vllm-a:2:3:41"
    retained = EventBatch(WorkerId("vllm-a", 2), 3, 41, 0.0, 0.0, Provenance.RETAINED, ())
    assert retained.msg_id == "vllm-a:2:retained:3:41"
    assert retained.subject == "kv.ev.vllm-a.2.retained"


def test_dead_letters_round_trip_with_raw_frames() -> None:
    from kvledger.core.events import DeadLetter, decode_dead_letter, encode_dead_letter

    letter = DeadLetter("vllm-a", 1, "unknown medium 'TAPE'", (b"topic", b"\x00" * 8, b"\xc1garbage"), 3.5, "tcp://h:1")
    assert decode_dead_letter(encode_dead_letter(letter)) == letter
    with pytest.raises(RecordError, match="malformed dead letter"):
        decode_dead_letter(b"\x01")
