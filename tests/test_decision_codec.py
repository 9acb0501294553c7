"""The decision API's JSON codec: requests validated field by field, answers round-tripped."""

from __future__ import annotations

import json

import attrs
import msgspec
import pytest

from kvledger.core.decision_codec import (
    ANSWER_DECODER, RequestError, answer_of, decision_to_json, decode_request, request_from_json,
)
from kvledger.core.events import Tier, WorkerId
from kvledger.core.fold import InventoryFold
from kvledger.core.hashing import local_block_hashes
from kvledger.core.reuse import decide
from kvledger.core.settings import ReuseSettings
from builders import BLOCK_SIZE, Stream, stored, tokens_for


def test_a_request_with_token_ids_is_hashed_like_the_engine() -> None:
    request = request_from_json(
        {"request_id": "r1", "target": "vllm-a/2", "token_ids": tokens_for([1, 2]), "block_size": BLOCK_SIZE, "lora_name": None}
    )
    assert request.target == WorkerId("vllm-a", 2)
    assert request.local_hashes == tuple(local_block_hashes(tokens_for([1, 2]), BLOCK_SIZE))


def test_local_hashes_accept_u64_ints_and_decimal_strings() -> None:
    request = request_from_json({"request_id": "r", "local_hashes": [2**64 - 1, str(2**63)], "block_size": 16})
    assert request.local_hashes == (2**64 - 1, 2**63)
    assert request.target is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "request"),
        ({"block_size": 16, "token_ids": []}, "request_id"),
        # each would share a Nats-Msg-Id with another id, and its answer vanish from KV_DECISIONS
        ({"request_id": " a", "block_size": 16, "token_ids": []}, "request_id"),
        ({"request_id": "a ", "block_size": 16, "token_ids": []}, "request_id"),
        ({"request_id": "a\nb", "block_size": 16, "token_ids": []}, "request_id"),
        ({"request_id": "a\tb", "block_size": 16, "token_ids": []}, "request_id"),
        ({"request_id": "r" * 257, "block_size": 16, "token_ids": []}, "request_id"),
        ({"request_id": "r", "token_ids": [1]}, "block_size"),
        ({"request_id": "r", "block_size": 0, "token_ids": [1]}, "block_size"),
        ({"request_id": "r", "block_size": 16}, "token_ids"),
        ({"request_id": "r", "block_size": 16, "token_ids": [1], "local_hashes": [1]}, "token_ids"),
        ({"request_id": "r", "block_size": 16, "token_ids": [1, -5]}, "token_ids[1]"),
        ({"request_id": "r", "block_size": 16, "local_hashes": [2**64]}, "local_hashes[0]"),
        ({"request_id": "r", "block_size": 16, "local_hashes": ["\u00b2"]}, "local_hashes[0]"),
        ({"request_id": "r", "block_size": 16, "token_ids": "abc"}, "token_ids"),
        ({"request_id": "r", "block_size": 16, "token_ids": [], "target": "bad.name"}, "target"),
        ({"request_id": "r", "block_size": 16, "token_ids": [], "lora_name": 3}, "lora_name"),
        ({"request_id": "r", "block_size": 16, "token_ids": [], "surprise": 1}, "surprise"),
    ],
)
def test_malformed_requests_name_the_field(body: object, field: str) -> None:
    with pytest.raises(RequestError) as caught:
        request_from_json(body)
    assert caught.value.field == field
    assert caught.value.as_json("r")["error"]["field"] == field


@pytest.mark.parametrize(("data", "field", "top_field", "request_id"), [
    (b'{"request_id":"q","block_size":16,"token_ids":[1,2,-3]}', "token_ids[2]", "token_ids", "q"),
    (b'{"request_id":"q","block_size":16,"extra_keys":[["a",[1]]],"token_ids":[1]}', "extra_keys", "extra_keys", "q"),
    (b'{"request_id":"q","block_size":16,"token_ids":[],"x-custom-1":1}', "x-custom-1", "unknown", "q"),
    (b'{"request_id":7,"block_size":16,"token_ids":[]}', "request_id", "request_id", None),
    (b'{"request_id":"q",', "request", "request", None),
])
def test_encoded_requests_decode_typed_and_errors_carry_the_path_and_the_id(
    data: bytes, field: str, top_field: str, request_id: str | None,
) -> None:
    with pytest.raises(RequestError) as caught:
        decode_request(data)
    assert (caught.value.field, caught.value.top_field, caught.value.request_id) == (field, top_field, request_id)
    assert caught.value.as_json()["request_id"] == request_id


def test_json_and_msgpack_requests_decode_to_the_same_request() -> None:
    body = {"request_id": "m", "block_size": BLOCK_SIZE, "token_ids": tokens_for([1, 2]), "target": "w/1"}
    from_json = decode_request(json.dumps(body).encode())
    assert decode_request(msgspec.msgpack.encode(body), msgpack=True) == from_json == request_from_json(body)


def test_a_decision_round_trips_through_json() -> None:
    stream = Stream()
    fold = InventoryFold()
    fold.apply(*stream.batch(WorkerId("a"), stored([1, 2, 3, 4, 5, 6])))
    fold.apply(*stream.batch(WorkerId("b", 1), stored([1, 2, 3, 4, 5, 6], tier=Tier.HOST)))
    settings = ReuseSettings(
        enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True,
        transfer_source_prefill_token_us=1000.0, transfer_source_lookup_budget_ms=1e9,
    )
    request = request_from_json({"request_id": "q", "target": "c", "token_ids": tokens_for([1, 2, 3, 4, 5, 6]), "block_size": BLOCK_SIZE})
    decision = decide(fold, request, settings)
    assert decision.chosen is not None and len(decision.candidates) == 2
    body = json.loads(json.dumps(decision_to_json(decision)))
    assert body["chosen"]["tier"] == "device"
    assert body["overlaps"]["b/1"] == {"device": 0, "host": 6, "disk": 0, "any": 6, "retained_device": 0}
    assert set(body) >= {
        "request_id", "inventory_seq", "target", "credited_blocks", "baseline_blocks", "overlaps",
        "candidates", "chosen", "reason", "uncertain_workers", "backend",
    }
    assert ANSWER_DECODER.decode(json.dumps(body)) == answer_of(decision)
    assert ANSWER_DECODER.decode(json.dumps(body)) == answer_of(attrs.evolve(decision))
