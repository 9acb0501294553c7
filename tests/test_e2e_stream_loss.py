"""The whole system when JetStream loses acknowledged messages: engines → ingest → KV_EVENTS → store + decide.

The fault, as a power loss of the NATS machine leaves it: nats-server paused and its store
folder copied (what was on disk), traffic goes on and is acknowledged and projected, then
nats-server is SIGKILLed, the copy put back and the server restarted on the same port; more
traffic follows and takes the lost stream seqs. After recovery, every batch an engine
still buffers is once in KV_EVENTS and once in SQL, SQL holds what the engines hold, no
worker is uncertain, and decide answers as the reference model does on the engines' truth.
Where an engine no longer buffers what was lost, the stream says so with a Gap(stream_lost).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from engines import read_batches, wait_until
from kvledger.core.events import GapReason
from kvledger.sim.fleet import SimulatedFleet
from kvledger.sim.workload import DEMO_BLOCK_SIZE, synthetic_requests
from pipeline import Pipeline, pipeline_settings, truth_inventory
from services import copy_nats_store, restore_nats_store
from kvledger.store import audit, database
from test_e2e import REUSE_ON, assert_decide_matches_reference, batches_sent, serve_round_robin

pytestmark = pytest.mark.service

WORKERS = 4
PART = 80  # requests served per phase


def _requests() -> list:
    return list(itertools.islice(synthetic_requests(10_000, seed=17), 3 * PART))


def _sql_identities(pipeline: Pipeline) -> Counter:
    return Counter(pipeline.sql(
        "SELECT publisher, dp_rank, provenance, epoch, engine_seq FROM event_log WHERE event_idx = 0"
    ))


async def _stream_identities(url: str) -> Counter:
    return Counter((b.worker.publisher, b.worker.dp_rank, b.provenance.value, b.epoch, b.seq) for b in await read_batches(url))


def _every_engine_batch(fleet: SimulatedFleet) -> Counter:
    return Counter(
        (worker.worker.publisher, worker.worker.dp_rank, "native", 0, seq)
        for worker in fleet.workers for seq in range(worker.engine.batches_published)
    )


async def _healed(pipeline: Pipeline, fleet: SimulatedFleet, url: str) -> int:
    expected = _every_engine_batch(fleet)
    await wait_until(lambda: _sql_identities(pipeline) == expected, 60, "every engine batch once in SQL")

    async def stream_complete() -> bool:
        return await _stream_identities(url) == expected

    await wait_until(stream_complete, 60, "every engine batch once in KV_EVENTS")
    return await pipeline.events_last_seq()


async def _acknowledged_after_the_copy(pipeline: Pipeline, fleet: SimulatedFleet, requests: list, server, copy) -> None:
    """Serve and project a part; copy nats-server's store (what a power loss leaves on disk); serve and project
    another part, acknowledged and in SQL, that the copy lacks."""
    await serve_round_robin(fleet, requests[:PART])
    await pipeline.settled(batches_sent(fleet))
    copy_nats_store(server, copy)
    await serve_round_robin(fleet, requests[PART:2 * PART], start=PART)
    await wait_until(lambda: sum(_sql_identities(pipeline).values()) == batches_sent(fleet), 60, "the acknowledged part in SQL")


def _assert_truth(pipeline: Pipeline, fleet: SimulatedFleet) -> None:
    assert pipeline.sql_inventory() == truth_inventory(fleet)
    assert pipeline.sql("SELECT COUNT(*) FROM workers WHERE uncertain_since IS NOT NULL") == [(0,)]
    assert pipeline.sql("SELECT COUNT(*) FROM event_log WHERE kind = 'gap'") == [(0,)]


@pytest.mark.parametrize("stages", ["running", "restarted"])
async def test_a_lost_acknowledged_tail_is_fetched_again_and_nothing_diverges(nats_server, db_url, tmp_path, stages) -> None:
    requests = _requests()
    async with SimulatedFleet(WORKERS, gpu_blocks=48, cpu_blocks=96) as fleet:
        settings = pipeline_settings(nats_server.url, db_url, **REUSE_ON)
        pipeline = await Pipeline(settings, fleet).__aenter__()
        try:
            await _acknowledged_after_the_copy(pipeline, fleet, requests, nats_server, tmp_path / "on-disk")
            if stages == "restarted":
                await pipeline.__aexit__(None, None, None)
            restore_nats_store(nats_server, tmp_path / "on-disk")
            if stages == "restarted":
                pipeline = await Pipeline(settings, fleet).__aenter__()
            await serve_round_robin(fleet, requests[2 * PART:], start=2 * PART)
            last = await _healed(pipeline, fleet, nats_server.url)
            _assert_truth(pipeline, fleet)
            repaired = pipeline.bridge.metrics.stream_repaired.value if stages == "running" else None
            await assert_decide_matches_reference(pipeline, fleet, requests[-12:], last)
        finally:
            await pipeline.__aexit__(None, None, None)
    if repaired is not None:
        assert repaired > 0, "ingest should have published the lost batches again"
    with database.opened(db_url) as engine, engine.connect() as connection:
        losses = audit.Audit(connection).stream_losses()
        assert [loss["stream"] for loss in losses if loss["stream"] == "KV_EVENTS"] == ["KV_EVENTS"]
        assert audit.Audit(connection).only_in_sql() == []


async def test_what_no_engine_buffers_any_more_is_a_stream_lost_gap_and_sql_keeps_it(nats_server, db_url, tmp_path) -> None:
    requests = _requests()
    async with SimulatedFleet(WORKERS, gpu_blocks=48, cpu_blocks=96) as fleet:
        settings = pipeline_settings(nats_server.url, db_url, **REUSE_ON)
        async with Pipeline(settings, fleet) as pipeline:
            await _acknowledged_after_the_copy(pipeline, fleet, requests, nats_server, tmp_path / "on-disk")
            # The engines move on: none still buffers what the stream is about to lose.
            for worker in fleet.workers:
                worker.engine.shrink_replay_buffer(1)
            restore_nats_store(nats_server, tmp_path / "on-disk")
            await serve_round_robin(fleet, requests[2 * PART:], start=2 * PART)
            expected = _every_engine_batch(fleet)
            await wait_until(lambda: _sql_identities(pipeline) == expected, 60, "every engine batch once in SQL")
            # SQL committed the lost batches before the loss: it keeps them, and holds the truth.
            assert pipeline.sql_inventory() == truth_inventory(fleet)

            async def stream_lost_gaps() -> list:
                return [b for b in await read_batches(nats_server.url)
                        if any(getattr(e, "reason", None) is GapReason.STREAM_LOST for e in b.events)]

            gaps = await wait_until(stream_lost_gaps, 60, "a Gap(stream_lost) per worker in KV_EVENTS")
            assert {b.worker.publisher for b in gaps} == {w.worker.publisher for w in fleet.workers}
            assert pipeline.bridge.metrics.stream_lost.value > 0
        with database.opened(db_url) as engine, engine.connect() as connection:
            only_in_sql = audit.Audit(connection).only_in_sql()
        assert only_in_sql, "the batches no engine could give again exist only in SQL, and the audit says so"
        # A store that had not projected them reads the stream as it is now: every worker
        # uncertain for that reason, never silently whole.
        fresh = pipeline_settings(nats_server.url, f"sqlite:///{tmp_path / 'replayed.db'}", **REUSE_ON)
        async with Pipeline(fresh, fleet) as replay:
            await wait_until(lambda: replay.sql("SELECT COUNT(*) FROM uncertain_periods WHERE reason = 'stream_lost'")[0][0]
                             >= WORKERS, 60, "every worker uncertain in a store that replays the stream")
            last = await replay.events_last_seq()
            probe = {"request_id": "probe", "local_hashes": [], "block_size": DEMO_BLOCK_SIZE}

            async def answered_at_last() -> dict | None:
                answer = await replay.ask(probe)
                return answer if answer["inventory_seq"] >= last else None

            answer = await wait_until(answered_at_last, 30, "decide caught up with KV_EVENTS")
            assert sorted(answer["uncertain_workers"]) == sorted(w.worker.name for w in fleet.workers)
