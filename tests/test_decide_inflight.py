"""In-flight credit (decide/serving/inflight.py): a burst that shares a new prefix, routed by kvledger, lands on one worker.

Scripted, with the truth known: workers a, b and c hold nothing of prefix P (12 blocks).
The burst's first request names no target and falls back to `b` (nobody has credit): it
is placed there, and P is in flight on `b`. The next three (P plus a suffix each, their
fallbacks c, a, c) arrive before b's engine said anything: with in-flight credit they go to
`b` (12 in-flight blocks each, no execution credit); without it, each to its fallback. Then
b's engine stores P (confirmed: native credit, nothing in flight beyond it but the
suffixes), and evicts P's last 4 blocks: those confirmed entries are contradicted and
never count again. SQL keeps each answer's in-flight blocks (role `inflight`), and the
audit judges them at the horizon.
"""

from __future__ import annotations

import json

import nats
import pytest
import sqlalchemy as sa

from kvledger.core.decision_codec import ANSWER_DECODER
from kvledger.core.events import WorkerId
from kvledger.core.settings import load_settings
from kvledger.runtime.streams import DECIDE_BATCH_SUBJECT, DECIDE_SUBJECT, ensure_stream, events_stream
from builders import BLOCK_SIZE, Stream, local_hashes, publish, removed, stored
from engines import wait_until
from kvledger.store import database
from kvledger.store.audit import Audit
from store_harness import RunningStore, checkpoint, store_settings
from quality_workload import DEADLINE_S, at

from kvledger.decide.serving.service import DecideService

pytestmark = pytest.mark.service

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
PREFIX = list(range(1, 13))


def settings_for(url: str, ttl_ms: float):
    return load_settings(environ={}, overrides={
        "nats.url": url, "decide.http_port": 0, "decide.backend": "cpu", "decide.inflight_ttl_ms": ttl_ms,
    }).settings


def ask(request_id: str, blocks: list[int], fallback: WorkerId) -> dict:
    return {"request_id": request_id, "block_size": BLOCK_SIZE, "fallback": fallback.name,
            "local_hashes": [str(h) for h in local_hashes(blocks)]}


BURST = [ask("p0", PREFIX, B), ask("p1", PREFIX + [101], C), ask("p2", PREFIX + [102, 103], A),
         ask("p3", PREFIX + [104], C)]


async def burst(nats_url: str, db_url: str | None, ttl_ms: float, *, batched: bool) -> tuple[list[dict], list]:
    settings = settings_for(nats_url, ttl_ms)
    stream = Stream()
    # Each worker holds an unrelated block, so decide knows all three.
    known = [at(stream.batch(worker, stored([1000 + n])), 1000.0) for n, worker in enumerate((A, B, C))]
    async with await nats.connect(nats_url) as nc:
        js = nc.jetstream()
        await ensure_stream(js, events_stream(settings.stream))
        await publish(js, known)
        async with DecideService(settings) as decide:
            await decide.wait_ready(DEADLINE_S)
            await wait_until(lambda: decide.index.inventory_seq >= 3, DEADLINE_S, "decide at seq 3")
            if batched:  # the burst in one micro-batch: each request still sees those before it
                answers = json.loads((await nc.request(DECIDE_BATCH_SUBJECT, json.dumps(BURST).encode(), timeout=10)).data)
            else:
                answers = [json.loads((await nc.request(DECIDE_SUBJECT, json.dumps(body).encode(), timeout=10)).data)
                           for body in BURST]
            later = []
            if ttl_ms:
                # b's engine confirms P, then evicts its last four blocks.
                await publish(js, [at(stream.batch(B, stored(PREFIX)), 1000.1)])
                await wait_until(lambda: decide.index.inventory_seq >= 4, DEADLINE_S, "decide at seq 4")
                later.append(json.loads((await nc.request(
                    DECIDE_SUBJECT, json.dumps(ask("p4", PREFIX + [101], A)).encode(), timeout=10)).data))
                await publish(js, [at(stream.batch(B, removed([9, 10, 11, 12])), 1000.2)])
                await wait_until(lambda: decide.index.inventory_seq >= 5, DEADLINE_S, "decide at seq 5")
                later.append(json.loads((await nc.request(
                    DECIDE_SUBJECT, json.dumps(ask("p5", PREFIX, A)).encode(), timeout=10)).data))
                assert decide.inflight.ledger.contradicted >= 1
    return answers, later


@pytest.mark.parametrize("batched", [False, True], ids=["singles", "one-batch"])
async def test_a_burst_on_a_new_prefix_follows_its_first_request(nats_server, batched) -> None:
    answers, later = await burst(nats_server.url, None, 2000.0, batched=batched)
    assert [answer["target"] for answer in answers] == ["b", "b", "b", "b"]
    assert "inflight" not in answers[0]  # nothing was in flight yet: placed on its fallback
    assert [answer["inflight"] for answer in answers[1:]] == [{"blocks": 12, "credit": 12.0}] * 3
    # Routing credit only: no execution credit until b's engine holds them.
    assert all(answer["credited_blocks"] == 0 for answer in answers)
    assert all(ANSWER_DECODER.decode(json.dumps(answer).encode()).inflight is not None for answer in answers[1:])
    confirmed, contradicted = later
    # P confirmed by b's engine: native credit; the suffix block p1 sent there is still in flight.
    assert (confirmed["target"], confirmed["credited_blocks"], confirmed["inflight"]) == ("b", 12.0, {"blocks": 1, "credit": 1.0})
    # P's last four blocks evicted after b confirmed them: only the eight it still holds count.
    assert (contradicted["target"], contradicted["credited_blocks"], contradicted.get("inflight")) == ("b", 8.0, None)


async def test_without_in_flight_credit_the_burst_scatters_to_its_fallbacks(nats_server) -> None:
    answers, _ = await burst(nats_server.url, None, 0.0, batched=False)
    assert [answer["target"] for answer in answers] == ["b", "c", "a", "c"]
    assert not any("inflight" in answer for answer in answers)


async def test_in_flight_credit_is_recorded_in_sql_and_judged(nats_server, db_url) -> None:
    async with RunningStore(store_settings(nats_server.url, db_url, quality_horizon_s=0.5)):
        answers, _ = await burst(nats_server.url, db_url, 2000.0, batched=False)
        async with await nats.connect(nats_server.url) as nc:
            js = nc.jetstream()
            await publish(js, [at(Stream().batch(WorkerId("later"), stored([5000])), 1e10)])  # every horizon passed
        await wait_until(lambda: checkpoint(db_url, "decisions") >= 6 and checkpoint(db_url) >= 6, DEADLINE_S,
                         "decisions and events in SQL")
    with database.opened(db_url) as engine, engine.connect() as connection:
        rows = dict(connection.execute(sa.text("SELECT request_id, inflight_blocks FROM decisions")).all())
        assert {key: rows[key] for key in ("p0", "p1", "p2", "p3", "p4", "p5")} == \
            {"p0": 0, "p1": 12, "p2": 12, "p3": 12, "p4": 1, "p5": 0}
        assert connection.execute(sa.text(
            "SELECT COUNT(*) FROM decision_blocks WHERE role = 'inflight'")).scalar_one() == 12 * 3 + 1
        [row] = [row for row in Audit(connection).inflight_quality_summary(0.5) if row["worker"] == "b"]
        # At the horizon b holds P's first eight blocks only (the last four evicted), and p4's suffix
        # block was never stored: none of the four in-flight credits was confirmed.
        assert (row["inflight_decisions"], row["inflight_blocks"], row["confirmed"]) == (4, 37, 0)
