"""The whole system end to end: engines → ingest → JetStream → store (SQLite and PostgreSQL) + decide.

At the end the SQL inventory equals what the simulated engines hold, and decide answers
exactly as the reference model does on that truth. The same with faults injected.
"""

from __future__ import annotations

import asyncio
import itertools

import nats.errors

from kvledger.core.decision_codec import decision_to_json
from kvledger.core.reuse import ReuseRequest, decide
from kvledger.sim.fleet import SimulatedFleet
from kvledger.sim.workload import DEMO_BLOCK_SIZE, Request, request_tokens, synthetic_requests
from pipeline import Pipeline, TruthView, pipeline_settings, truth_inventory
from engines import wait_until

REUSE_ON = {"reuse.enable_decode_to_prefill_reuse": True, "reuse.enable_decode_to_prefill_gpu_reuse": True,
            "reuse.transfer_source_lookup_budget_ms": 1e6}


async def serve_round_robin(fleet: SimulatedFleet, requests, start: int = 0) -> int:
    count = 0
    for number, request in enumerate(requests, start):
        await fleet.workers[number % len(fleet.workers)].serve(request)
        count += 1
    return count


def batches_sent(fleet: SimulatedFleet) -> int:
    return sum(worker.engine.batches_published for worker in fleet.workers)


async def assert_decide_matches_reference(pipeline: Pipeline, fleet: SimulatedFleet, requests: list[Request], last_seq: int) -> None:
    settings = pipeline.settings
    probe = {"request_id": "probe", "local_hashes": [], "block_size": DEMO_BLOCK_SIZE}
    await wait_until(lambda: _caught_up(pipeline, probe, last_seq), 30, f"decide at inventory_seq {last_seq}")
    view = TruthView(fleet, last_seq)
    targets = [None, *[w.worker for w in fleet.workers]]
    for number, (request, target) in enumerate(zip(requests, itertools.cycle(targets))):
        body = {"request_id": f"check-{number}", "token_ids": request_tokens(request), "block_size": DEMO_BLOCK_SIZE,
                "target": target.name if target else None}
        answer = await pipeline.ask(body)
        expected = decision_to_json(decide(
            view, ReuseRequest.from_tokens(body["request_id"], body["token_ids"], DEMO_BLOCK_SIZE, target),
            settings.reuse, backend=answer["backend"],
        ))
        assert answer == expected


async def _caught_up(pipeline: Pipeline, probe: dict, last_seq: int) -> bool:
    try:
        return (await pipeline.ask(probe))["inventory_seq"] >= last_seq
    except nats.errors.NoRespondersError:
        # decide rebuilding its index after a stream loss answers nobody for a moment: asked again
        return False


async def test_the_pipeline_materialises_exactly_what_the_engines_hold(nats_server, db_url) -> None:
    requests = list(itertools.islice(synthetic_requests(10_000, seed=3), 240))
    async with SimulatedFleet(3, gpu_blocks=48, cpu_blocks=96) as fleet:
        settings = pipeline_settings(nats_server.url, db_url, **REUSE_ON)
        async with Pipeline(settings, fleet) as pipeline:
            await serve_round_robin(fleet, requests)
            last = await pipeline.settled(batches_sent(fleet))
            assert pipeline.sql_inventory() == truth_inventory(fleet)
            assert pipeline.sql("SELECT COUNT(*) FROM event_log WHERE kind = 'gap'") == [(0,)]
            assert pipeline.sql("SELECT COUNT(*) FROM workers WHERE uncertain_since IS NOT NULL") == [(0,)]
            duplicates = pipeline.sql(
                "SELECT publisher, dp_rank, tier, engine_hash FROM block_residency WHERE removed_seq IS NULL "
                "GROUP BY publisher, dp_rank, tier, engine_hash HAVING COUNT(*) > 1"
            )
            assert duplicates == []
            assert pipeline.sql("SELECT COUNT(DISTINCT stream_seq) FROM event_log") == [(batches_sent(fleet),)]
            await assert_decide_matches_reference(pipeline, fleet, requests[-12:], last)
            decisions = await wait_until(
                lambda: pipeline.sql("SELECT COUNT(*) FROM decisions WHERE request_id LIKE 'check-%'")[0][0] >= 12,
                30, "decisions projected into SQL",
            )
            assert decisions


async def test_the_pipeline_survives_faults_and_reports_exactly_what_it_lost(nats_server, db_url) -> None:
    requests = synthetic_requests(100_000, seed=5)
    async with SimulatedFleet(3, gpu_blocks=48, cpu_blocks=96) as fleet:
        stalled = fleet.workers[2]
        settings = pipeline_settings(nats_server.url, db_url, **REUSE_ON)
        async with Pipeline(settings, fleet, ingest_as_process=True) as pipeline:
            served = await serve_round_robin(fleet, itertools.islice(requests, 60))

            # 1. kill -9 of nats-server mid-run, then a restart on the same store
            nats_server.kill()
            served += await serve_round_robin(fleet, itertools.islice(requests, 30), served)
            await asyncio.to_thread(nats_server.restart)
            served += await serve_round_robin(fleet, itertools.islice(requests, 30), served)

            # 2. kill -9 of ingest, then a restart: it resumes from JetStream and replay
            pipeline.ingest.kill()
            served += await serve_round_robin(fleet, itertools.islice(requests, 30), served)
            await pipeline.ingest.start()

            # 3. an engine restart: the sequence starts over, the cache is empty
            restarted = fleet.workers[1]
            restarted.engine.restart()
            restarted.cache.gpu.clear()
            restarted.cache.cpu.clear()
            served += await serve_round_robin(fleet, itertools.islice(requests, 30), served)

            # 4. a stall longer than the replay buffer on one publisher: its batches never arrive
            await pipeline.settled(batches_sent(fleet))
            in_stream = (await pipeline.nc.jetstream().stream_info(settings.stream.events_stream)).state.messages
            stalled.engine.shrink_replay_buffer(5)  # so the stall outlasts what replay can supply
            stall_start = stalled.engine.next_seq
            for request in itertools.islice(requests, 12):
                change = stalled.cache.serve(request.block_ids)
                await stalled.engine.publish(_events_of(change, stalled), send=False)
            await stalled.serve(next(requests))  # new blocks, so a batch that does arrive
            still_buffered = [seq for seq in stalled.engine.buffered_seqs if seq >= stall_start]
            last = await pipeline.settled(in_stream + len(still_buffered), timeout=60)

            gaps = pipeline.sql("SELECT publisher, gap_reason FROM event_log WHERE kind = 'gap' ORDER BY stream_seq")
            assert gaps == [(restarted.worker.publisher, "publisher_restart"), (stalled.worker.publisher, "replay_incomplete")]
            probe = {"request_id": "u", "local_hashes": [], "block_size": DEMO_BLOCK_SIZE}
            await wait_until(lambda: _caught_up(pipeline, probe, last), 30, f"decide at {last}")
            assert (await pipeline.ask(probe))["uncertain_workers"] == [stalled.worker.name]
            assert pipeline.sql("SELECT publisher FROM workers WHERE uncertain_since IS NOT NULL") == [(stalled.worker.publisher,)]
            # everything the engines still had arrived exactly once
            for worker in fleet.workers:
                seqs = pipeline.sql(
                    f"SELECT epoch, engine_seq FROM event_log WHERE publisher = '{worker.worker.publisher}' "
                    "GROUP BY epoch, engine_seq ORDER BY epoch, engine_seq"
                )
                if worker is stalled:
                    expected = [(0, s) for s in range(stall_start)] + [(0, s) for s in still_buffered]
                elif worker is restarted:
                    expected = seqs  # checked below through the inventory
                else:
                    expected = [(0, s) for s in range(worker.engine.next_seq)]
                assert seqs == expected, worker.worker.name
            assert pipeline.sql(
                "SELECT COUNT(*) FROM (SELECT stream_seq, event_idx FROM event_log GROUP BY stream_seq, event_idx HAVING COUNT(*) > 1) d"
            ) == [(0,)]

            # the stalled worker's inventory is unknown until it clears; everyone else's is exact
            truth, sql = truth_inventory(fleet), pipeline.sql_inventory()
            for key in truth.keys() | sql.keys():
                if key[0] != stalled.worker.publisher:
                    assert sql.get(key) == truth.get(key), key

            # A restart: the stalled worker is certain again and its inventory exact. (vLLM's
            # AllBlocksCleared would not do: it resets the GPU pool only, and the CPU tier's
            # removals lost in the stall would still be unknown.)
            stalled.engine.restart()
            stalled.cache.gpu.clear()
            stalled.cache.cpu.clear()
            await stalled.serve(next(requests))
            await pipeline.settled(in_stream + len(still_buffered) + 1)
            assert pipeline.sql_inventory() == truth_inventory(fleet)
            await wait_until(lambda: _certain(pipeline), 30, "no uncertain workers after Cleared")
            assert pipeline.sql(
                "SELECT COUNT(*) FROM workers WHERE uncertain_since IS NOT NULL"
            ) == [(0,)]


async def _certain(pipeline: Pipeline) -> bool:
    answer = await pipeline.ask({"request_id": "certain", "local_hashes": [], "block_size": DEMO_BLOCK_SIZE})
    return answer["uncertain_workers"] == []


def _events_of(change, worker):
    from kvledger.sim.fleet import _stored_runs
    from kvledger.sim.vllm import VllmBlockRemoved

    size = worker.cache.block_size
    events = list(_stored_runs(change.stored_gpu, size, "GPU"))
    if change.evicted_gpu:
        events.append(VllmBlockRemoved(change.evicted_gpu, "GPU"))
    events.extend(_stored_runs(change.offloaded_cpu, size, "CPU"))
    if change.evicted_cpu:
        events.append(VllmBlockRemoved(change.evicted_cpu, "CPU"))
    return events
