"""One parity suite for decide's ranking backends: every answer equals the reference model's.

Parametrised over backends (STYLE: one mechanism, several backends, one contract test);
cuda runs where a GPU answers and is skipped, with the reason, everywhere else.
"""

from __future__ import annotations

import struct

import itertools
import json
import random

import attrs
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvledger.core.decision_codec import decision_to_json
from kvledger.core.events import Provenance, Stored, Tier, WorkerId
from kvledger.core.fold import InventoryFold
from kvledger.core.reuse import Reason, ReuseRequest, decide
from kvledger.core.settings import ReuseSettings
from builders import BLOCK_SIZE, Stream, local_hashes, stored

from kvledger.decide.inventory.index import InventoryIndex
from kvledger.decide.ranking.ranked import AnswerTexts
from decide_inventories import batches, plain_batches, requests, reuse_settings

BACKENDS = ("cpu", "cuda")


def make_backend(name: str, index: InventoryIndex):
    if name == "cpu":
        from kvledger.decide.ranking.cpu import CpuBackend

        return CpuBackend(index)
    from kvledger.decide.ranking.cuda import CudaBackend, device_unavailable_reason

    reason = device_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuda backend not exercised: {reason}")
    return CudaBackend(index)


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda":
        from kvledger.decide.ranking.cuda import device_unavailable_reason

        reason = device_unavailable_reason()
        if reason is not None:
            pytest.skip(f"cuda backend not exercised: {reason}")
    return request.param


def service_json(decision) -> bytes:
    """The reference answer as the decision codec writes it, compact."""
    return json.dumps(decision_to_json(decision), separators=(",", ":")).encode()


def relied_prefix(request, answer) -> bytes:
    """What a record's relied-prefix header must name: the longer of the chosen prefix and the target's credited one."""
    chosen = answer.chosen.prefix_blocks if answer.chosen else 0
    credited = answer.overlaps[answer.target].any if answer.target is not None else 0
    hashes = request.sequence_hashes[:max(chosen, credited)]
    return struct.pack(f"<{len(hashes)}Q", *hashes).hex().encode()


def _fold_and_index(stream) -> tuple[InventoryFold, InventoryIndex]:
    fold, index = InventoryFold(), InventoryIndex()
    for batch, stream_seq in stream:
        fold.apply(batch, stream_seq)
        index.apply(batch, stream_seq)
    return fold, index


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(stream=st.one_of(batches(), plain_batches()), asked=st.lists(requests(), min_size=1, max_size=6),
       reuse=reuse_settings())
def test_every_answer_equals_the_reference_model(backend_name: str, stream, asked, reuse: ReuseSettings) -> None:
    fold, index = _fold_and_index(stream)
    backend = make_backend(backend_name, index)
    asked = [attrs.evolve(request, request_id=f"r{i}") for i, request in enumerate(asked)]
    expected = [decide(fold, request, reuse, backend=backend_name) for request in asked]
    assert backend.decide_batch(asked, reuse) == expected
    assert backend.decide(asked[0], reuse) == expected[0]
    # The service's path: straight from the arrays to JSON, byte for byte the codec's.
    answers = backend.answer_batch(asked, reuse)
    assert answers.encoded() == [service_json(answer) for answer in expected]
    assert answers.relied_prefixes() == [relied_prefix(request, answer) for request, answer in zip(asked, expected)]
    # What the service sends and records, ranked and written in one call on cpu.
    assert backend.answer_texts(asked, reuse) == AnswerTexts.of(answers)
    # A request alone takes the single-request way in: the same texts.
    assert [backend.answer_texts([request], reuse) for request in asked] == [
        AnswerTexts([text], [relied], {answer.reason: 1})
        for text, relied, answer in zip(answers.encoded(), answers.relied_prefixes(), expected)]
    for answer in expected:
        event(f"reason {answer.reason}")
        event(f"uncertain workers: {bool(answer.uncertain_workers)}; credit {answer.credited_blocks > 0}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(stream=st.one_of(batches(max_batches=60), plain_batches(max_batches=60)),
       asked=st.lists(requests(), min_size=1, max_size=3), reuse=reuse_settings())
def test_answers_stay_equal_while_the_index_follows_the_stream(backend_name: str, stream, asked, reuse) -> None:
    """Asked after every batch, so incremental updates (and the device scatter) are exercised."""
    fold, index = InventoryFold(), InventoryIndex()
    backend = make_backend(backend_name, index)
    for batch, stream_seq in stream:
        fold.apply(batch, stream_seq)
        index.apply(batch, stream_seq)
        assert backend.decide_batch(asked, reuse) == [decide(fold, r, reuse, backend=backend_name) for r in asked]


def test_many_workers_span_several_mask_words(backend_name: str) -> None:
    """200 workers: bitmasks of four 64-bit words, and worker order differing from arrival order."""
    stream = Stream()
    fold, index = InventoryFold(), InventoryIndex()
    ids = list(range(1, 11))
    for n in range(200):
        worker = WorkerId(f"w{(n * 37) % 200:03d}", n % 3)
        tier = (Tier.DEVICE, Tier.HOST, Tier.DISK)[n % 3]
        batch = stream.batch(worker, stored(ids[: 1 + n % 10], tier=tier, engine_offset=1 << 63),
                             provenance=Provenance.RETAINED if n % 7 == 0 else Provenance.NATIVE)
        fold.apply(*batch)
        index.apply(*batch)
    assert index.words == 4
    backend = make_backend(backend_name, index)
    reuse = ReuseSettings(enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True,
                          minimum_transfer_prefix_blocks=1, minimum_estimated_ttft_saving_ms=0.0,
                          transfer_source_lookup_budget_ms=1e12)
    asked = [ReuseRequest(f"r{n}", local_hashes(ids[:n]), BLOCK_SIZE, target)
             for n, target in itertools.product(range(11), (None, WorkerId("w005", 2), WorkerId("w100")))]
    answers = backend.decide_batch(asked, reuse)
    expected = [decide(fold, request, reuse, backend=backend_name) for request in asked]
    assert answers == expected
    assert any(len(answer.candidates) > 50 for answer in answers)
    assert backend.answer_batch(asked, reuse).encoded() == [service_json(answer) for answer in expected]


def test_answers_encode_names_and_ids_that_need_escaping(backend_name: str) -> None:
    """Quotes, backslashes, control and non-ASCII characters in request ids; dp ranks > 0; unknown targets."""
    stream = Stream()
    fold, index = InventoryFold(), InventoryIndex()
    for worker, n in ((WorkerId("source-1", 3), 12), (WorkerId("target_x"), 2), (WorkerId("plain"), 5)):
        batch = stream.batch(worker, stored(list(range(1, n + 1))))
        fold.apply(*batch)
        index.apply(*batch)
    backend = make_backend(backend_name, index)
    reuse = ReuseSettings(enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True,
                          transfer_source_prefill_token_us=1000.0, transfer_source_lookup_budget_ms=1e12)
    blocks = local_hashes(list(range(1, 13)))
    asked = [ReuseRequest(request_id, blocks[:n], BLOCK_SIZE, target)
             for request_id, n, target in (("q\"1\\\n\u00e9\u2603\U0001F600\x7f\x01", 12, WorkerId("target_x")), ("q2", 12, None),
                                           ("q3", 0, WorkerId("never", 2)), ("q4", 3, WorkerId("plain")))]
    expected = [decide(fold, request, reuse, backend=backend_name) for request in asked]
    assert backend.decide_batch(asked, reuse) == expected
    assert expected[0].chosen is not None and expected[2].target == "never/2"
    encoded = backend.answer_batch(asked, reuse).encoded()
    assert encoded == [service_json(answer) for answer in expected]
    assert [json.loads(answer) for answer in encoded] == [decision_to_json(answer) for answer in expected]
    assert backend.answer_batch([], reuse).encoded() == []


def test_long_prefixes_and_extreme_costs_encode_like_the_codec(backend_name: str) -> None:
    """Prefixes past the encoder's number tables (4096) and floats that print with exponents."""
    rng = random.Random(11)
    stream = Stream()
    fold, index = InventoryFold(), InventoryIndex()
    local = tuple(rng.getrandbits(64) for _ in range(5000))
    for worker, n, tier in ((WorkerId("source", 2), 5000, Tier.HOST), (WorkerId("target"), 4100, Tier.DEVICE)):
        engine = tuple(rng.getrandbits(64) for _ in range(n))
        batch = stream.batch(worker, Stored(tier, engine, None, BLOCK_SIZE, local[:n]))
        fold.apply(*batch)
        index.apply(*batch)
    backend = make_backend(backend_name, index)
    asked = [ReuseRequest(f"r{n}", local[:n], BLOCK_SIZE, target)
             for n in (5000, 4500, 4097) for target in (WorkerId("target"), None)] * 3
    for prefill_us in (1e13, 3.3e-7, 50.0):
        reuse = ReuseSettings(enable_decode_to_prefill_reuse=True, minimum_estimated_ttft_saving_ms=0.0,
                              transfer_source_prefill_token_us=prefill_us, transfer_source_estimated_block_us=1e-12,
                              transfer_source_lookup_budget_ms=1e12)
        expected = [decide(fold, request, reuse, backend=backend_name) for request in asked]
        assert any(answer.chosen is not None and answer.chosen.prefix_blocks == 5000 for answer in expected)
        answers = backend.answer_batch(asked, reuse)
        assert answers.decisions() == expected
        assert answers.encoded() == [service_json(answer) for answer in expected]
        # Floats only Python writes (1e13 µs per token) are written from inside the one call on cpu.
        assert backend.answer_texts(asked, reuse) == AnswerTexts.of(answers)
        assert backend.answer_texts(asked[:1], reuse).answers == answers.encoded()[:1]


def test_an_exhausted_budget_stops_the_scan_like_the_reference(backend_name: str) -> None:
    """A clock that jumps a second per reading exhausts a zero budget before the first worker."""
    stream = Stream()
    fold, index = InventoryFold(), InventoryIndex()
    for worker, n in ((WorkerId("source"), 12), (WorkerId("target"), 2)):
        batch = stream.batch(worker, stored(list(range(1, n + 1))))
        fold.apply(*batch)
        index.apply(*batch)
    reuse = ReuseSettings(enable_decode_to_prefill_gpu_reuse=True, transfer_source_prefill_token_us=1000.0,
                          transfer_source_lookup_budget_ms=0.0)
    request = ReuseRequest("r", local_hashes(list(range(1, 13))), BLOCK_SIZE, WorkerId("target"))

    def jumping_clock(readings=itertools.count()) -> float:
        return float(next(readings))

    expected = decide(fold, request, reuse, clock=jumping_clock, backend=backend_name)
    answer = make_backend(backend_name, index).decide(request, reuse, clock=jumping_clock)
    assert answer.reason == Reason.BUDGET_EXHAUSTED
    assert answer == expected
    answers = make_backend(backend_name, index).answer_batch([request], reuse, clock=jumping_clock)
    assert answers.encoded() == [service_json(expected)]
    texts = make_backend(backend_name, index).answer_texts([request], reuse, clock=itertools.count().__next__)
    assert texts.answers == [service_json(expected)]
    assert texts.reason_counts == {Reason.BUDGET_EXHAUSTED: 1}
    roomy = attrs.evolve(reuse, transfer_source_lookup_budget_ms=1e12)
    assert make_backend(backend_name, index).decide(request, roomy).reason == Reason.CHOSEN
