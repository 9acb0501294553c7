"""Each KV_DECISIONS record's request header: the batch writer (decide/serving/recorder.py) writes
`kvledger.core.decision_codec.request_header`'s text, byte for byte, and store reads it back."""

from __future__ import annotations

import random

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.core.decision_codec import MAX_RELIED_BLOCKS, request_from_header, request_header
from kvledger.core.events import WorkerId
from kvledger.core.reuse import ReuseRequest
from kvledger.core.settings import ReuseSettings

from kvledger.decide.inventory.index import InventoryIndex
from kvledger.decide.ranking.cpu import CpuBackend
from kvledger.decide.ranking.ranked import RequestArrays
from kvledger.decide.serving.recorder import request_header_texts, request_texts
from kvledger.decide.serving.shadow import answer_with_shadow
from decide_inventories import batches, plain_batches, requests, reuse_settings


def _requests(count: int, seed: int = 1) -> list[ReuseRequest]:
    rng = random.Random(seed)
    return [ReuseRequest(
        f"q{number}", tuple(rng.getrandbits(64) for _ in range(rng.choice([0, 1, 3, 30]))),
        rng.choice([1, 16, 512, 1 << 20]), rng.choice([None, WorkerId("w1"), WorkerId("eng-b_2", 3)]), None,
        rng.choice([None, WorkerId("f", 2)]),
    ) for number in range(count)]


@pytest.mark.parametrize("count", [1, 2, 300])
def test_the_batch_writer_writes_request_header_s_text(count: int) -> None:
    requests = _requests(count)
    expected = [request_header(request) for request in requests]
    assert request_texts(requests) == expected
    assert request_texts(requests, RequestArrays.of(requests)) == expected


def test_a_request_past_the_limit_keeps_its_first_blocks_and_its_count() -> None:
    long = ReuseRequest("long", tuple(range(MAX_RELIED_BLOCKS + 5)), 16, WorkerId("w", 1))
    [text] = request_texts([long, _requests(1)[0]])[:1]
    assert text == request_header(long)
    recorded = request_from_header(text)
    assert (recorded.blocks, recorded.complete, recorded.target) == (MAX_RELIED_BLOCKS + 5, False, "w/1")
    assert recorded.reuse_request("long").local_hashes == tuple(range(MAX_RELIED_BLOCKS))


def test_no_requests_no_texts() -> None:
    assert request_texts([]) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=st.one_of(batches(), plain_batches()), asked=st.lists(requests(), min_size=2, max_size=12),
       live=reuse_settings(), shadow=reuse_settings())
def test_target_names_read_off_the_ranking_s_slots_are_request_header_s(stream, asked, live: ReuseSettings,
                                                                          shadow: ReuseSettings) -> None:
    """The service writes each target's name from the slot the ranking found (the index's names), and
    from the request where a target is one the index has never seen: the same text either way."""
    index = InventoryIndex()
    for batch, stream_seq in stream:
        index.apply(batch, stream_seq)
    backend = CpuBackend(index)
    asked = [attrs.evolve(request, request_id=f"r{i}") for i, request in enumerate(asked)]
    expected = [request_header(request) for request in asked]
    answers = backend.answer_texts(asked, live)
    assert answers.targets is not None
    assert request_header_texts(asked, answers.arrays, answers.targets).texts() == expected
    shadow = attrs.evolve(shadow, device_credit_weight=live.device_credit_weight,
                          host_credit_weight=live.host_credit_weight, disk_credit_weight=live.disk_credit_weight)
    live_answers, _ = answer_with_shadow(backend, asked, live, shadow)
    assert request_header_texts(asked, live_answers.arrays, live_answers.targets).texts() == expected
