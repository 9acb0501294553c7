"""A hole in the middle of KV_EVENTS healed end to end (docs/ingest.md, "Holes mid-stream").

Simulated engines → ingest → a real nats-server → store (SQLite, PostgreSQL) and decide. A batch of
one worker is deleted from the middle of KV_EVENTS before store and decide read it; they hold the
worker's later batches back, ask ingest over NATS (kvledger.runtime.refetch), ingest fetches the seq
again from the engine's replay buffer, and both end exactly at the engines' truth, the worker certain
again. Where the engine no longer buffers it, the hole becomes Gap(stream_lost) and the worker stays
uncertain: never silently wrong.
"""

from __future__ import annotations

import itertools
import json

import pytest

from engines import wait_until
from kvledger.runtime.refetch import REFETCH_SUBJECT
from kvledger.sim.fleet import SimulatedFleet
from kvledger.sim.workload import synthetic_requests
from pipeline import Pipeline, pipeline_settings, truth_inventory
from test_e2e import REUSE_ON, assert_decide_matches_reference, batches_sent, serve_round_robin

pytestmark = pytest.mark.service


async def _delete_a_middle_batch(pipeline: Pipeline, publisher: str) -> int:
    """Delete from KV_EVENTS the third batch of `publisher` (not its first: a hole needs a batch before it);
    its engine seq."""
    js = pipeline.nc.jetstream()
    stream = pipeline.settings.stream.events_stream
    info = await js.stream_info(stream)
    seen = 0
    for stream_seq in range(info.state.first_seq, info.state.last_seq + 1):
        message = await js.get_msg(stream, stream_seq)
        if f".{publisher}." in f"{message.subject}.":
            seen += 1
            if seen == 3:
                await pipeline.nc.jsm().delete_msg(stream, stream_seq)
                from kvledger.core.events import decode_batch
                return decode_batch(message.data).seq
    raise AssertionError(f"no third batch of {publisher}")


async def _serve_and_delete(pipeline: Pipeline, fleet: SimulatedFleet, requests) -> tuple[int, int]:
    served = await serve_round_robin(fleet, itertools.islice(requests, 30))
    await wait_until(lambda: _stream_holds(pipeline, batches_sent(fleet)), 30, "the first batches in KV_EVENTS")
    seq = await _delete_a_middle_batch(pipeline, fleet.workers[0].worker.publisher)
    served += await serve_round_robin(fleet, itertools.islice(requests, 30), served)
    return served, seq


async def _stream_holds(pipeline: Pipeline, batches: int) -> bool:
    info = await pipeline.nc.jetstream().stream_info(pipeline.settings.stream.events_stream)
    return info.state.messages >= batches


async def test_a_batch_lost_mid_stream_is_fetched_again_and_store_and_decide_end_at_the_truth(nats_server, db_url) -> None:
    requests = synthetic_requests(10_000, seed=11)
    async with SimulatedFleet(2, gpu_blocks=48, cpu_blocks=96) as fleet:
        settings = pipeline_settings(nats_server.url, db_url, **REUSE_ON)
        async with Pipeline(settings, fleet, readers=False) as pipeline:
            _, lost_seq = await _serve_and_delete(pipeline, fleet, requests)
            await wait_until(lambda: _stream_holds(pipeline, batches_sent(fleet) - 1), 30, "the rest in KV_EVENTS")
            # Requests ingest cannot act on are refused or passed over, counted, and ingest goes on.
            publisher = fleet.workers[0].worker.publisher
            outcomes = pipeline.bridge.metrics.refetch_requests
            await pipeline.nc.publish(REFETCH_SUBJECT, b"{not json")
            await pipeline.nc.publish(REFETCH_SUBJECT, json.dumps({
                "publisher": publisher, "dp_rank": 0, "provenance": "native", "epoch": 0, "first": 5, "end": 2,
                "asked_by": "test"}).encode())
            await pipeline.nc.publish(REFETCH_SUBJECT, json.dumps({
                "publisher": publisher, "dp_rank": 0, "provenance": "native", "epoch": 9, "first": 1, "end": 2,
                "asked_by": "test"}).encode())
            await wait_until(lambda: outcomes.labels("refused").value == 2 and outcomes.labels("not_this_epoch").value == 1,
                             10, "the bad requests counted")
            await pipeline.start_readers()
            # The deleted batch comes back (published again by ingest), so the stream holds every batch once more.
            last = await pipeline.settled(batches_sent(fleet))
            await wait_until(lambda: pipeline.sql_inventory() == truth_inventory(fleet), 30, "SQL at the truth")
            assert pipeline.sql("SELECT COUNT(*) FROM workers WHERE uncertain_since IS NOT NULL") == [(0,)]
            periods = pipeline.sql(f"SELECT reason, resolved_by FROM uncertain_periods WHERE publisher = '{publisher}'")
            assert periods == [(f"hole: seq {lost_seq}", "hole healed")], periods
            assert pipeline.sql("SELECT COUNT(*) FROM event_log WHERE kind = 'gap'") == [(0,)]
            assert pipeline.bridge.metrics.refetched.value >= 1
            assert pipeline.store.events.metrics.refetch_requests.value >= 1
            await assert_decide_matches_reference(pipeline, fleet, list(itertools.islice(requests, 8)), last)
            assert fleet.workers[0].worker.name not in pipeline.decide.index.uncertain_names()


async def test_a_batch_lost_mid_stream_the_engine_no_longer_buffers_is_a_gap_and_the_worker_stays_uncertain(
        nats_server, sqlite_url) -> None:
    requests = synthetic_requests(10_000, seed=12)
    async with SimulatedFleet(2, gpu_blocks=48, cpu_blocks=96) as fleet:
        settings = pipeline_settings(nats_server.url, sqlite_url, **REUSE_ON)
        async with Pipeline(settings, fleet, readers=False) as pipeline:
            fleet.workers[0].engine.shrink_replay_buffer(3)  # the deleted batch will have left it
            _, lost_seq = await _serve_and_delete(pipeline, fleet, requests)
            await pipeline.start_readers()
            publisher = fleet.workers[0].worker.publisher

            def gap_in_sql() -> bool:
                return bool(pipeline.sql(
                    f"SELECT 1 FROM event_log WHERE kind = 'gap' AND gap_reason = 'stream_lost' AND publisher = '{publisher}'"))

            await wait_until(gap_in_sql, 30, "Gap(stream_lost) for the batch the engine no longer buffers")
            await wait_until(lambda: pipeline.sql(
                f"SELECT uncertain_since IS NOT NULL FROM workers WHERE publisher = '{publisher}'") == [(1,)],
                30, "the worker uncertain")
            assert pipeline.sql(
                f"SELECT gap_expected_seq, gap_received_seq FROM event_log WHERE kind = 'gap' AND publisher = '{publisher}'"
            ) == [(lost_seq, lost_seq + 1)]
            # The other worker is exact and certain.
            other = fleet.workers[1].worker
            truth = {key: value for key, value in truth_inventory(fleet).items() if key[0] == other.publisher}
            await wait_until(lambda: {key: value for key, value in pipeline.sql_inventory().items()
                                      if key[0] == other.publisher} == truth, 30, "the other worker at the truth")
            assert pipeline.bridge.metrics.refetch_lost.value == 1
