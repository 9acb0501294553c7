"""Unusable single events in an engine batch: dead-lettered alone, the rest of the batch applies.

A simulated engine sends vLLM-shaped batches (`[ts, [tagged maps], dp_rank]`) mixing good
events with ones ingest cannot use; an in-process `Bridge` follows it over real ZMQ into a
real nats-server. Checked here:

- KV_EVENTS carries the good events only, in order;
- each bad event is one dead letter on KV_DEAD_LETTERS: reason `event <position> (<tag>): ...`,
  frames = [the event re-encoded as msgpack], Msg-Id `dlq:<pub>:<rank>:<prov>:<epoch>:<seq>:<pos>`,
  so a batch delivered twice (two ingests, each through a replay) is dead-lettered once;
- a Gap(missed) for the batch's seq only where a lost event may hide an eviction (a removal
  or an unknown event), never for a lost store alone;
- the ingest metrics count rejected events per type tag and dead letters per publisher;
- a batch that is not msgpack at all is still dead-lettered whole, with a Gap;
- through store (SQLite): residency holds the good blocks, dead_letters one row per rejected
  event, uncertain_periods a row only for the worker whose removal was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import nats
import pytest
import sqlalchemy as sa

from engines import engine_endpoints, http_get, one_block, read_batches, read_stream, settings_for, wait_until
from kvledger.core.events import DeadLetter, Gap, GapReason, Provenance, WorkerId, decode_batch, decode_dead_letter
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.ingest.wire import decode_event
from kvledger.runtime.streams import DEAD_LETTERS_STREAM
from kvledger.sim.engine import SimulatedEngine
from kvledger.store import audit, database
from kvledger.store.service import StoreService

pytestmark = pytest.mark.service

GOOD_1, GOOD_2 = one_block(1).as_wire(), one_block(2).as_wire()
TAPE_STORE = {**one_block(7).as_wire(), "medium": "TAPE"}
SHORT_STORE = {**one_block(8).as_wire(), "token_ids": [8, 8, 8]}  # 1 block of 4 tokens, 3 token ids
MOVED = {"type": "BlockMoved", "block_hashes": [1]}
TAPE_REMOVAL = {"type": "BlockRemoved", "block_hashes": [1], "medium": "TAPE", "group_idx": 0}

# bad event → (tag in the reason, the rest of the reason, whether the worker becomes uncertain)
BAD_EVENTS = {
    "store on an unknown medium": (TAPE_STORE, "BlockStored", "unknown medium 'TAPE'", False),
    "store whose tokens do not fit": (SHORT_STORE, "BlockStored", "BlockStored has 1 blocks of 4 tokens but 3 token ids", False),
    "unknown event type": (MOVED, "BlockMoved", "unknown event type 'BlockMoved'", True),
    "not a map": (42, "untagged", "event must be a tagged map or a tagged array, got int", True),
    "removal on an unknown medium": (TAPE_REMOVAL, "BlockRemoved", "unknown medium 'TAPE'", True),
}


def payload(events: list[object], dp_rank: int = 0) -> bytes:
    return msgspec.msgpack.encode([time.time(), events, dp_rank])


def canonical(*wire_events: dict) -> tuple:
    return tuple(decode_event(event) for event in wire_events)


def missed(seq: int) -> Gap:
    return Gap(seq, seq + 1, GapReason.MISSED)


@contextlib.asynccontextmanager
async def following(nats_url: str, *publishers: str, db_url: str | None = None):
    """One simulated engine per publisher and a Bridge following all of them, ready."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(SimulatedEngine(*engine_endpoints())) for _ in publishers]
        sources = [
            StreamSource(WorkerId(name), engine.pub_endpoint, engine.replay_endpoint, Provenance.NATIVE)
            for name, engine in zip(publishers, engines)
        ]
        overrides = {"db.url": db_url, "store.http_port": 0, "store.snapshot_every_events": 1_000_000} if db_url else {}
        bridge = await stack.enter_async_context(Bridge(settings_for(nats_url, **overrides), sources))
        await bridge.wait_ready(timeout=10)
        yield engines, bridge


async def settled(nats_url: str, bridges: list[Bridge], batches: int) -> None:
    """KV_EVENTS holds `batches` batches and every bridge's dead letters are acknowledged too."""
    async def enough() -> bool:
        return len(await read_stream(nats_url)) >= batches

    await wait_until(enough, 15, f"{batches} batches in KV_EVENTS")
    for bridge in bridges:
        await bridge.publisher.flush(10)


async def dead_letters(nats_url: str) -> list[tuple[str, DeadLetter]]:
    """Every message on KV_DEAD_LETTERS, in order, as (Msg-Id, dead letter)."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        state = (await js.stream_info(DEAD_LETTERS_STREAM)).state
        if state.messages == 0:
            return []
        messages = [await js.get_msg(DEAD_LETTERS_STREAM, seq) for seq in range(state.first_seq, state.last_seq + 1)]
        return [(m.headers["Nats-Msg-Id"], decode_dead_letter(m.data)) for m in messages]
    finally:
        await nc.close()


def metric_values(text: str) -> dict[str, float]:
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


@pytest.mark.parametrize("case", list(BAD_EVENTS))
async def test_one_unusable_event_is_dead_lettered_alone_and_its_neighbours_apply(nats_server, case) -> None:
    bad, tag, reason, uncertain = BAD_EVENTS[case]
    async with following(nats_server.url, "w") as ([engine], bridge):
        assert await engine.publish_payload(payload([GOOD_1, bad, GOOD_2])) == 0
        await settled(nats_server.url, [bridge], 1)
    [batch] = await read_batches(nats_server.url)
    gap = (missed(0),) if uncertain else ()
    assert batch.seq == 0 and batch.events == (*gap, *canonical(GOOD_1, GOOD_2))
    [(msg_id, letter)] = await dead_letters(nats_server.url)
    assert msg_id == "dlq:w:0:native:0:0:1"
    assert (letter.publisher, letter.dp_rank, letter.endpoint) == ("w", 0, engine.pub_endpoint)
    assert letter.reason == f"event 1 ({tag}): {reason}"
    assert letter.frames == (msgspec.msgpack.encode(bad),)


async def test_several_bad_events_and_an_unreadable_batch_are_counted_on_metrics(nats_server) -> None:
    async with following(nats_server.url, "w") as ([engine], bridge):
        await engine.publish_payload(payload([TAPE_STORE, GOOD_1, SHORT_STORE]))  # stores only: no Gap
        await engine.publish_payload(payload([GOOD_2, MOVED, 42, TAPE_REMOVAL]))
        await engine.publish_payload(b"\xc1 not msgpack at all")
        await settled(nats_server.url, [bridge], 3)
        status, metrics = await http_get(bridge.http_port, "/metrics")
    batches = await read_batches(nats_server.url)
    assert [(b.seq, b.events) for b in batches] == [
        (0, canonical(GOOD_1)),
        (1, (missed(1), *canonical(GOOD_2))),
        (2, (missed(2),)),  # unreadable: nothing of it survives, the worker is uncertain
    ]
    letters = await dead_letters(nats_server.url)
    assert [msg_id for msg_id, _ in letters] == [
        "dlq:w:0:native:0:0:0", "dlq:w:0:native:0:0:2",
        "dlq:w:0:native:0:1:1", "dlq:w:0:native:0:1:2", "dlq:w:0:native:0:1:3",
        "dlq:w:0:native:0:2",  # the whole batch: no position
    ]
    reasons = [letter.reason for _, letter in letters]
    assert reasons[:5] == [
        "event 0 (BlockStored): unknown medium 'TAPE'",
        "event 2 (BlockStored): BlockStored has 1 blocks of 4 tokens but 3 token ids",
        "event 1 (BlockMoved): unknown event type 'BlockMoved'",
        "event 2 (untagged): event must be a tagged map or a tagged array, got int",
        "event 3 (BlockRemoved): unknown medium 'TAPE'",
    ]
    assert reasons[5].startswith("payload is not msgpack")
    assert [letter.frames for _, letter in letters] == [
        *((msgspec.msgpack.encode(event),) for event in (TAPE_STORE, SHORT_STORE, MOVED, 42, TAPE_REMOVAL)),
        (b"\xc1 not msgpack at all",),
    ]
    assert status == 200
    values = metric_values(metrics)
    assert {name: value for name, value in values.items() if name.startswith("kvledger_ingest_rejected_events")} == {
        'kvledger_ingest_rejected_events_total{type="BlockStored"}': 2.0,
        'kvledger_ingest_rejected_events_total{type="BlockMoved"}': 1.0,
        'kvledger_ingest_rejected_events_total{type="untagged"}': 1.0,
        'kvledger_ingest_rejected_events_total{type="BlockRemoved"}': 1.0,
    }
    assert values['kvledger_ingest_dead_letters_total{publisher="w"}'] == 6.0
    assert values['kvledger_ingest_gaps_total{reason="missed"}'] == 2.0
    assert values["kvledger_ingest_batches_out_total"] == 3.0 + 6.0  # batches and dead letters


async def test_a_batch_replayed_to_two_ingests_is_dead_lettered_once_per_bad_event(nats_server) -> None:
    async with following(nats_server.url, "w") as ([engine], first):
        # A second ingest on the same engine (an overlapping restart): both publish every seq.
        source = first.streams[0].source
        async with Bridge(first.settings, [source]) as second:
            await second.wait_ready(timeout=10)
            await engine.publish([one_block(0)])
            await engine.publish_payload(payload([GOOD_2, TAPE_REMOVAL, 42]), send=False)  # lost on the wire
            await engine.publish([one_block(3)])  # reveals the gap: both replay seq 1
            bridges = [first, second]
            await wait_until(lambda: all(b.metrics.dead_letters.labels("w").value == 2 for b in bridges), 15, "both dead-lettering")
            await settled(nats_server.url, bridges, 3)
            assert all(b.streams[0].tracker.counters.replayed_batches >= 2 for b in bridges)
    batches = await read_batches(nats_server.url)
    assert [b.seq for b in batches] == [0, 1, 2]
    assert batches[1].events == (missed(1), *canonical(GOOD_2))
    letters = await dead_letters(nats_server.url)
    assert [(msg_id, letter.reason.split(":")[0]) for msg_id, letter in letters] == [
        ("dlq:w:0:native:0:1:1", "event 1 (BlockRemoved)"),
        ("dlq:w:0:native:0:1:2", "event 2 (untagged)"),
    ]


def checkpoint(db_url: str, name: str) -> int:
    with database.opened(db_url) as engine, engine.connect() as connection:
        return audit.Audit(connection).checkpoint(name)


def sql(db_url: str, query: str) -> list[tuple]:
    with database.opened(db_url) as engine, engine.connect() as connection:
        return [tuple(row) for row in connection.execute(sa.text(query))]


async def test_store_keeps_the_good_blocks_one_dead_letter_each_and_uncertainty_only_for_a_lost_removal(
    nats_server, sqlite_url
) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    async with following(nats_server.url, "stores", "removals", db_url=sqlite_url) as (engines, bridge):
        stores, removals = engines
        await stores.publish_payload(payload([one_block(1).as_wire(), TAPE_STORE, one_block(2).as_wire()]))
        await removals.publish_payload(payload([one_block(10).as_wire(), one_block(11).as_wire()]))
        lost_removal = {**TAPE_REMOVAL, "block_hashes": [10]}  # 10 stays believed held: uncertain
        await removals.publish_payload(payload([lost_removal, one_block(12).as_wire()]))
        await settled(nats_server.url, [bridge], 3)
        settings = bridge.settings
    events = await read_stream(nats_server.url)
    letters = await read_stream(nats_server.url, DEAD_LETTERS_STREAM)
    stop = asyncio.Event()
    store = asyncio.create_task(StoreService(settings).run(stop))
    try:
        last_event, last_letter = events[-1][0], letters[-1][0]
        await wait_until(
            lambda: store.done() or (checkpoint(sqlite_url, "events") >= last_event
                                     and checkpoint(sqlite_url, "dead_letters") >= last_letter),
            30, "store checkpoints",
        )
    finally:
        stop.set()
        await asyncio.wait_for(store, 30)  # raises whatever stopped it early
    inventory = sql(sqlite_url, "SELECT publisher, engine_hash, tier FROM current_inventory")
    assert sorted((publisher, int(engine_hash), tier) for publisher, engine_hash, tier in inventory) == [
        ("removals", 10, "device"), ("removals", 11, "device"), ("removals", 12, "device"),
        ("stores", 1, "device"), ("stores", 2, "device"),
    ]
    assert sql(sqlite_url, "SELECT COUNT(*) FROM block_residency WHERE removed_seq IS NOT NULL") == [(0,)]
    assert sorted(sql(sqlite_url, "SELECT source, publisher, dp_rank, reason, frames FROM dead_letters")) == [
        ("ingest", "removals", 0, "event 0 (BlockRemoved): unknown medium 'TAPE'", 1),
        ("ingest", "stores", 0, "event 1 (BlockStored): unknown medium 'TAPE'", 1),
    ]
    [removal_seq] = [seq for seq, subject, data in events if subject == "kv.ev.removals.0" and decode_batch(data).seq == 1]
    assert sql(sqlite_url, "SELECT publisher, dp_rank, provenance, since_seq, reason, until_seq FROM uncertain_periods") == [
        ("removals", 0, "native", removal_seq, "missed", None),
    ]

