"""The shadow read off the live ranking (`decide.serving.shadow.answer_with_shadow`) equals the shadow ranked again.

On hypothesis inventories and requests, under live and shadow settings that share their
credit weights (the condition for one ranking): the live answers are byte for byte
`answer_texts`'s, each `Kvledger-Shadow` header decodes to what the second ranking's
answer gives (`decision_codec.shadow_header`), and each relied-on prefix is the longer of
the two answers' (what the service recorded before).
"""

from __future__ import annotations

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.core.decision_codec import shadow_from_header, shadow_header
from kvledger.core.events import WorkerId
from kvledger.core.reuse import ReuseRequest
from kvledger.core.settings import ReuseSettings

from kvledger.decide.inventory.index import InventoryIndex
from kvledger.decide.ranking.cpu import CpuBackend
from kvledger.decide.serving.shadow import ShadowDecisions, answer_with_shadow, shares_the_live_ranking
from builders import BLOCK_SIZE, local_hashes
from decide_inventories import batches, plain_batches, requests, reuse_settings


def _index(stream) -> InventoryIndex:
    index = InventoryIndex()
    for batch, stream_seq in stream:
        index.apply(batch, stream_seq)
    return index


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=st.one_of(batches(), plain_batches()), asked=st.lists(requests(), min_size=2, max_size=8),
       live=reuse_settings(), shadow=reuse_settings())
def test_the_shadow_read_off_the_live_ranking_equals_a_second_ranking(stream, asked, live: ReuseSettings,
                                                                      shadow: ReuseSettings) -> None:
    shadow = attrs.evolve(shadow, device_credit_weight=live.device_credit_weight,
                          host_credit_weight=live.host_credit_weight, disk_credit_weight=live.disk_credit_weight)
    backend = CpuBackend(_index(stream))
    asked = [attrs.evolve(request, request_id=f"r{i}") for i, request in enumerate(asked)]
    assert shares_the_live_ranking(backend, asked, live, shadow, inflight=False)
    answers, shadows = answer_with_shadow(backend, asked, live, shadow)
    expected_live = backend.answer_texts(asked, live)
    assert (answers.answers, answers.reason_counts) == (expected_live.answers, expected_live.reason_counts)
    again = ShadowDecisions(shadow).answer(backend, asked, expected_live)
    assert shadows.relied_prefixes == again.relied_prefixes == answers.relied_prefixes
    assert [shadow_from_header(text) for text in shadows.headers.texts()] == [
        shadow_from_header(text) for text in again.headers.texts()]
    # The fields shadow_header keeps, from the second ranking's own answers.
    second = backend.answer_texts(asked, shadow).answers
    assert [shadow_from_header(text) for text in shadows.headers.texts()] == [
        shadow_from_header(shadow_header(answer)) for answer in second]


def test_a_fallback_in_flight_credit_or_other_weights_rank_the_shadow_again() -> None:
    backend = CpuBackend(InventoryIndex())
    live = ReuseSettings()
    asked = [ReuseRequest(f"r{i}", local_hashes([1, 2, 3]), BLOCK_SIZE, WorkerId("w")) for i in range(3)]
    assert shares_the_live_ranking(backend, asked, live, live, inflight=False)
    assert not shares_the_live_ranking(backend, asked, live, live, inflight=True)
    assert not shares_the_live_ranking(backend, asked, live, attrs.evolve(live, host_credit_weight=0.5), inflight=False)
    placed = [attrs.evolve(asked[0], target=None, fallback=WorkerId("w")), *asked[1:]]
    assert not shares_the_live_ranking(backend, placed, live, live, inflight=False)
    assert not shares_the_live_ranking(backend, asked[:1], live, live, inflight=False)  # a single request's own way
