"""Each KV_DECISIONS record's request header: the batch writer (decide/serving/recorder.py) writes
`kvledger.core.decision_codec.request_header`'s text, byte for byte, and store reads it back."""

from __future__ import annotations

import random

import pytest

from kvledger.core.decision_codec import MAX_RELIED_BLOCKS, request_from_header, request_header
from kvledger.core.events import WorkerId
from kvledger.core.reuse import ReuseRequest

from kvledger.decide.ranking.ranked import RequestArrays
from kvledger.decide.serving.recorder import request_texts


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
