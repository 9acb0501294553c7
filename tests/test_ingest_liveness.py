"""An engine that is gone becomes an `unreachable` worker, and reachable again when it answers (ingest/liveness.py).

Driven by vLLM 0.33's and SGLang 0.5.23's own `ZmqEventPublisher`s in a process of their own
(`engines.EngineProcess`, skipped where a wheel is not at hand), so an engine can be killed
(SIGKILL) or frozen (SIGSTOP) and thawed as an engine is. After each case, KV_EVENTS is projected into SQL by store and followed
by decide's index: each must equal the engine's truth, or report the worker unreachable or
uncertain; never silently wrong. The rules alone (fold, store rows, decide's credit, the record
codec) are checked without sockets below.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import msgspec
import pytest
import sqlalchemy as sa
import zmq
import zmq.asyncio

from engines import (
    EngineProcess, engine_endpoints, engine_wheel, one_block, read_stream, settings_for, wait_until,
)
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.ingest.liveness import BATCH_ARRIVED, DISCONNECTED, NEVER_CONNECTED, PUB_CONNECTED, REPLAY_ANSWERED, heartbeat_ms
from kvledger.core.events import (
    ENGINE_BATCH_VERSION, SCHEMA_VERSION, EventBatch, Gap, GapReason, Provenance, Reachability, RecordError, Stored,
    Tier, WorkerId, decode_batch, encode_batch, is_liveness, liveness_subject,
)
from kvledger.core.fold import REASON_LIMIT, InventoryFold, ReachabilityFact
from kvledger.core.snapshot import decode_snapshot, encode_snapshot
from kvledger.decide.inventory.index import CLASSES, NATIVE_DEVICE, InventoryIndex
from kvledger.sim.engine import SimulatedEngine
from kvledger.sim.vllm import encode_vllm_batch
from kvledger.store import audit, database
from store_harness import project, store_settings
from test_decide_index import held_by_class

BATCHES = 6  # what the engine publishes before it goes


ENGINES = ("vllm", "sglang")


def _wheel(engine: str = "vllm"):
    wheel = engine_wheel(engine)
    if wheel is None:
        pytest.skip(f"{engine}'s wheel is not at hand (KVLEDGER_TEST_{engine.upper()}_WHEEL, or ~/.cache/kvledger/wheels)")
    return wheel


class Truth:
    """What the engine holds after the batches it published (a chain of stores, an eviction now and then)."""

    def __init__(self, engine: EngineProcess, base: int) -> None:
        self.engine, self.base = engine, base
        self.count = 0
        self.held: set[int] = set()
        self.seqs: list[int] = []

    async def publish(self, batches: int) -> None:
        for _ in range(batches):
            i, block = self.count, self.base + self.count
            events = [("store", block, block - 1 if i else None)]
            self.held.add(block)
            if i % 3 == 2:
                events.append(("remove", block - 2, None))
                self.held.discard(block - 2)
            self.seqs.append(await self.engine.publish(events, 1_000_000.0 + i))
            self.count += 1


async def _liveness(nats_url: str, worker: WorkerId) -> list[Reachability]:
    messages = await read_stream(nats_url, subject=liveness_subject(worker, Provenance.NATIVE))
    return [decode_batch(data).events[0] for _, _, data in messages]


async def _wait_liveness(nats_url: str, worker: WorkerId, count: int, timeout: float) -> list[Reachability]:
    async def enough():
        found = await _liveness(nats_url, worker)
        return found if len(found) >= count else None
    return await wait_until(enough, timeout, f"{count} liveness records", interval=0.02)


async def _ledger(nats_url: str) -> tuple[list[tuple[int, EventBatch]], InventoryFold, InventoryIndex]:
    """KV_EVENTS, folded as store folds it and followed by decide's index."""
    fold, index, batches = InventoryFold(), InventoryIndex(), []
    for stream_seq, _, data in await read_stream(nats_url):
        batch = decode_batch(data)
        batches.append((stream_seq, batch))
        fold.apply(batch, stream_seq)
        index.apply(batch, stream_seq)
    return batches, fold, index


def _held(fold: InventoryFold, worker: WorkerId) -> set[int]:
    return {record.engine_hash for record in fold.records(worker, Provenance.NATIVE, Tier.DEVICE)}


def _credited(index: InventoryIndex, worker: WorkerId) -> set[int]:
    """The sequence hashes decide credits the worker with on its device tier."""
    return {key[0] for key in held_by_class(index) if key[1] == worker.name and key[2] == NATIVE_DEVICE}


async def _project(nats_url: str, db_url: str, last_seq: int) -> None:
    with database.opened(db_url) as engine:
        database.upgrade(engine)
    await project(store_settings(nats_url, db_url), last_seq)


def _sql_worker(db_url: str, worker: WorkerId) -> tuple[dict, list[dict]]:
    with database.opened(db_url) as engine, engine.connect() as connection:
        found = audit.Audit(connection)
        [row] = [row for row in found.workers() if row["publisher"] == worker.publisher]
        return dict(row), [dict(period) for period in found.unreachable_periods(worker)]


def _sql_held(db_url: str, worker: WorkerId) -> set[int]:
    with database.opened(db_url) as engine, engine.connect() as connection:
        seq = connection.execute(sa.text("SELECT MAX(stream_seq) FROM checkpoints")).scalar_one()
        rows = audit.Audit(connection).inventory(worker, [Tier.DEVICE], seq)
        return {int(row["engine_hash"]) for row in rows if row["provenance"] == "native"}


def _never_silently_wrong(truth: set[int], fold: InventoryFold, index: InventoryIndex, sql: set[int], worker: WorkerId) -> None:
    reported = fold.is_unreachable(worker) or fold.is_uncertain(worker)
    assert (_held(fold, worker) == truth and sql == truth) or reported
    assert worker.name in index.uncertain_names() if reported else worker.name not in index.uncertain_names()


@pytest.mark.parametrize("kind", ENGINES)
async def test_an_engine_killed_for_good_becomes_unreachable_within_3_s_and_is_no_longer_credited(
    nats_server, sqlite_url, kind,
) -> None:
    worker = WorkerId(f"live-killed-{kind}")
    engine = EngineProcess(kind, _wheel(kind), *engine_endpoints())
    await engine.start()
    source = StreamSource(worker, engine.pub_endpoint, engine.replay_endpoint, Provenance.NATIVE)
    truth = Truth(engine, 1_000)
    try:
        async with Bridge(settings_for(nats_server.url), [source]) as bridge:
            await bridge.wait_ready(timeout=15)
            await truth.publish(BATCHES)
            await wait_until(lambda: _count(nats_server.url, worker, BATCHES), 10, f"{BATCHES} batches")
            # An idle engine is not a gone one: longer than the timeout without a batch, still reachable.
            await asyncio.sleep(bridge.settings.ingest.engine_timeout_s * 1.5)
            assert await _liveness(nats_server.url, worker) == []
            killed = time.time()
            engine.signal(signal.SIGKILL)
            [gone] = await _wait_liveness(nats_server.url, worker, 1, 10)
            noticed = bridge.streams[0].unreachable_published_at - killed
            metrics = bridge.metrics.text().decode()
    finally:
        await engine.stop()
    print(f"\n{kind} killed: unreachable published {noticed:.2f} s after SIGKILL (engine_timeout_s 2.0)")
    assert noticed <= 3.0
    assert (gone.reachable, gone.reason) == (False, DISCONNECTED) and killed - 1.6 <= gone.since_ts <= killed + 1.0
    assert f'kvledger_ingest_engines_unreachable_total{{publisher="live-killed-{kind}"}} 1.0' in metrics
    assert "kvledger_ingest_unreachable_streams 1.0" in metrics

    batches, fold, index = await _ledger(nats_server.url)
    last_seq = batches[-1][0]
    await _project(nats_server.url, sqlite_url, last_seq)
    row, periods = _sql_worker(sqlite_url, worker)
    # The inventory is what the engine held when it went, and it is reported unreachable, not credited.
    assert _held(fold, worker) == truth.held and fold.is_unreachable(worker)
    assert index.unreachable_names() == (worker.name,) and _credited(index, worker) == set()
    assert (row["reachability"], row["unreachable_since"], row["unreachable_reason"]) == ("unreachable", last_seq, DISCONNECTED)
    assert [(p["since_seq"], p["until_seq"], p["state"]) for p in periods] == [(last_seq, None, "still unreachable")]
    _never_silently_wrong(truth.held, fold, index, _sql_held(sqlite_url, worker), worker)


@pytest.mark.parametrize("kind", ENGINES)
async def test_an_engine_frozen_and_thawed_is_unreachable_then_reachable_and_continues(
    nats_server, sqlite_url, kind,
) -> None:
    worker = WorkerId(f"live-frozen-{kind}")
    engine = EngineProcess(kind, _wheel(kind), *engine_endpoints())
    await engine.start()
    source = StreamSource(worker, engine.pub_endpoint, engine.replay_endpoint, Provenance.NATIVE)
    truth = Truth(engine, 5_000)
    try:
        async with Bridge(settings_for(nats_server.url), [source]) as bridge:
            await bridge.wait_ready(timeout=15)
            await truth.publish(BATCHES)
            await wait_until(lambda: _count(nats_server.url, worker, BATCHES), 10, f"{BATCHES} batches")
            frozen = time.time()
            engine.signal(signal.SIGSTOP)
            [gone] = await _wait_liveness(nats_server.url, worker, 1, 15)
            noticed = bridge.streams[0].unreachable_published_at - frozen
            # decide stops crediting it at once; SQL says so
            _, fold, index = await _ledger(nats_server.url)
            assert fold.is_unreachable(worker) and _credited(index, worker) == set()
            engine.signal(signal.SIGCONT)
            thawed = time.time()
            _, back = await _wait_liveness(nats_server.url, worker, 2, 15)
            answered = time.time() - thawed
            await truth.publish(BATCHES)  # it goes on where it was
            await wait_until(lambda: _count(nats_server.url, worker, 2 * BATCHES), 10, f"{2 * BATCHES} batches")
            await bridge.publisher.flush(10)
    finally:
        await engine.stop()
    print(f"\n{kind} frozen: unreachable published {noticed:.2f} s after SIGSTOP; reachable again {answered:.2f} s after SIGCONT")
    assert (gone.reachable, back.reachable, back.reason) == (False, True, PUB_CONNECTED)
    batches, fold, index = await _ledger(nats_server.url)
    engine_batches = [batch for _, batch in batches if not is_liveness(batch)]
    # a continuation: one epoch, every seq once, no gap (the incarnation check found its batch the one published)
    assert [(batch.epoch, batch.seq) for batch in engine_batches] == [(0, seq) for seq in range(2 * BATCHES)]
    assert not any(isinstance(event, Gap) for batch in engine_batches for event in batch.events)
    assert _held(fold, worker) == truth.held and not fold.is_unreachable(worker) and not fold.is_uncertain(worker)
    assert index.unreachable_names() == () and len(_credited(index, worker)) == len(truth.held)
    await _project(nats_server.url, sqlite_url, batches[-1][0])
    row, periods = _sql_worker(sqlite_url, worker)
    assert row["reachability"] == "reachable" and row["unreachable_since"] is None
    [period] = periods
    assert period["state"] == "reachable again" and period["since_ts"] == gone.since_ts and period["until_ts"] == back.since_ts
    _never_silently_wrong(truth.held, fold, index, _sql_held(sqlite_url, worker), worker)


async def _count(nats_url: str, worker: WorkerId, count: int) -> bool:
    return len(await read_stream(nats_url, subject=worker.events_subject)) >= count


async def _last_seq(nats_url: str, worker: WorkerId, seq: int) -> bool:
    messages = await read_stream(nats_url, subject=worker.events_subject)
    return bool(messages) and decode_batch(messages[-1][2]).seq == seq


# --- an engine whose replay socket is gone, or answers garbage -------------------------------


async def test_an_engine_whose_replay_socket_is_gone_while_its_pub_lives_stays_reachable(nats_server) -> None:
    """Its SUB connection says it lives; what replay cannot supply is a Gap, never a liveness change."""
    pub, replay = engine_endpoints()  # nobody binds the replay port
    worker = WorkerId("live-no-replay")
    async with SimulatedEngine(pub) as engine:
        source = StreamSource(worker, engine.pub_endpoint, replay, Provenance.NATIVE)
        settings = settings_for(nats_server.url, **{"ingest.replay_timeout_s": 0.3, "ingest.engine_timeout_s": 0.5})
        async with Bridge(settings, [source]) as bridge:
            await bridge.wait_ready(timeout=15)
            await engine.publish([one_block(1)], ts=1.0)
            await wait_until(lambda: _count(nats_server.url, worker, 1), 10, "a batch")
            await asyncio.sleep(2.0)  # four timeouts of idleness, replay probes unanswered
            assert await _liveness(nats_server.url, worker) == []
            assert bridge.streams[0].reachable is not False


async def test_a_replay_socket_answering_garbage_is_dead_lettered_and_a_gap_never_a_crash(nats_server) -> None:
    pub, replay = engine_endpoints()
    worker = WorkerId("live-garbage")
    context = zmq.asyncio.Context()
    publisher, router = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    publisher.bind(pub.replace("127.0.0.1", "*"))
    router.bind(replay.replace("127.0.0.1", "*"))
    answered = asyncio.Event()

    async def answer_garbage() -> None:
        # For a start seq s: unreadable framing where s should be, s + 1 intact, an undecodable
        # payload at s + 2, then the end marker.
        while True:
            client, _, start = await router.recv_multipart()
            s = int.from_bytes(start, "big")
            if s < 1 << 40:
                await router.send_multipart([client, b"", b"\x00\x01", b"garbage"])
                await router.send_multipart([client, b"", (s + 1).to_bytes(8, "big"), encode_vllm_batch(2.0, [one_block(2)], 0)])
                await router.send_multipart([client, b"", (s + 2).to_bytes(8, "big"), b"\xc1\xc1"])
                answered.set()
            await router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    server = asyncio.create_task(answer_garbage())
    try:
        source = StreamSource(worker, pub, replay, Provenance.NATIVE)
        async with Bridge(settings_for(nats_server.url), [source]) as bridge:
            await bridge.wait_ready(timeout=15)
            await publisher.send_multipart([b"kv-events", (0).to_bytes(8, "big"), encode_vllm_batch(1.0, [one_block(1)], 0)])
            await wait_until(answered.is_set, 10, "a replay")
            await wait_until(lambda: _count(nats_server.url, worker, 3), 10, "the replayed batches")
            letters = await wait_until(lambda: _letters(nats_server.url, 2), 10, "two dead letters")
            assert all(task.done() is False for task in bridge._tasks)  # no stream failed
    finally:
        server.cancel()
        publisher.close(0)
        router.close(0)
        context.term()
    batches = [decode_batch(data) for _, _, data in await read_stream(nats_server.url, subject=worker.events_subject)]
    gaps = [event for batch in batches for event in batch.events if isinstance(event, Gap)]
    # (each idle replay answers the same way) the seq that came as garbage is a replay_incomplete gap, the
    # undecodable one after the intact one a missed gap
    hole = next(gap for gap in gaps if gap.reason is GapReason.REPLAY_INCOMPLETE)
    assert hole.received_seq == hole.expected_seq + 1 and Gap(hole.expected_seq + 2, hole.expected_seq + 3, GapReason.MISSED) in gaps
    assert any("replay reply" in letter["reason"] for letter in letters)
    fold = InventoryFold()
    for seq, batch in enumerate(batches, 1):
        fold.apply(batch, seq)
    assert fold.is_uncertain(worker)


async def _letters(nats_url: str, count: int) -> list[dict] | None:
    messages = await read_stream(nats_url, "KV_DEAD_LETTERS")
    letters = [msgspec.msgpack.decode(data) for _, _, data in messages]
    return letters if len(letters) >= count else None


# --- the rules alone ---------------------------------------------------------------------------

W = WorkerId("w")


def _batch(seq: int, *events, epoch: int = 0) -> EventBatch:
    return EventBatch(W, epoch, seq, 1.0, 2.0, Provenance.NATIVE, tuple(events))


def _store(block: int, parent: int | None = None) -> Stored:
    return Stored(Tier.DEVICE, (block,), parent, 4, (block * 7,))


def _liveness_batch(seq: int, reachable: bool, since_ts: float = 10.0) -> EventBatch:
    return _batch(seq, Reachability(reachable, "pub connected" if reachable else DISCONNECTED, since_ts))


def test_a_liveness_record_sits_outside_the_engine_sequence_and_survives_snapshots() -> None:
    fold = InventoryFold()
    fold.apply(_batch(0, _store(1)), 1)
    fold.apply(_batch(1, _store(2, 1)), 2)
    facts = fold.apply(_liveness_batch(2, False), 3)
    assert facts == [ReachabilityFact(W, Provenance.NATIVE, False, DISCONNECTED, 10.0, 3)]
    assert fold.apply(_liveness_batch(2, False), 4) == []  # said again: nothing changes
    assert fold.is_unreachable(W) and fold.unreachable_workers() == [W] and not fold.is_uncertain(W)
    # the engine's next batch is seq 2, at the liveness record's seq: neither a duplicate nor a hole
    fold.apply(_batch(2, _store(3, 2)), 5)
    assert fold.counters["duplicate_batch"] == fold.counters["sequence_hole"] == 0
    restored = _restored(fold)
    assert restored.is_unreachable(W) and restored.worker_state(W).position(Provenance.NATIVE) == fold.worker_state(W).position(Provenance.NATIVE)
    fold.apply(_liveness_batch(3, True, 20.0), 6)
    assert not fold.is_unreachable(W) and {r.engine_hash for r in fold.records(W, Provenance.NATIVE, Tier.DEVICE)} == {1, 2, 3}
    assert "unreachable" not in fold.worker_state(W).position(Provenance.NATIVE).groups


def _restored(fold: InventoryFold) -> InventoryFold:
    return decode_snapshot(encode_snapshot(fold))


def test_decide_withdraws_an_unreachable_workers_credit_and_gives_it_back() -> None:
    index = InventoryIndex()
    for seq, batch in enumerate([_batch(0, _store(1)), _batch(1, _store(2, 1))], 1):
        index.apply(batch, seq)
    credited = _bits(index)
    assert credited and index.uncertain_names() == ()
    index.apply(_liveness_batch(2, False), 3)
    assert _bits(index) == set() and index.unreachable_names() == ("w",) and index.uncertain_names() == ("w",)
    index.apply(_batch(2, _store(3, 2)), 4)  # a late batch of the gone engine is not credited either
    assert _bits(index) == set()
    index.apply(_liveness_batch(3, True, 20.0), 5)
    assert len(_bits(index)) == 3 and index.unreachable_names() == () == index.uncertain_names()
    # an index started from a snapshot taken while the worker was unreachable does not credit it
    index.apply(_liveness_batch(3, False, 30.0), 6)
    assert _bits(InventoryIndex(_restored(index.fold))) == set()


def _bits(index: InventoryIndex) -> set:
    return {key for key in held_by_class(index) if CLASSES[key[2]][0] is Provenance.NATIVE}


def test_liveness_records_are_version_3_and_engine_batches_stay_readable_by_older_readers() -> None:
    record = msgspec.msgpack.decode(encode_batch(_liveness_batch(0, False)))
    assert record["v"] == SCHEMA_VERSION == 3
    assert msgspec.msgpack.decode(encode_batch(_batch(0, _store(1))))["v"] == ENGINE_BATCH_VERSION == 2
    assert decode_batch(encode_batch(_liveness_batch(0, False))) == _liveness_batch(0, False)
    assert _liveness_batch(0, False).subject == "kv.ev.w.0.liveness" and _batch(0).subject == "kv.ev.w.0"
    with pytest.raises(RecordError, match="newer"):
        decode_batch(msgspec.msgpack.encode({**record, "v": 4}))


def test_the_subscriber_heartbeat_lets_a_frozen_engine_drop_within_the_timeout() -> None:
    assert heartbeat_ms(2.0) * 3 <= 2000 and heartbeat_ms(0.01) == 50
    # every reason fits the column SQL keeps it in
    assert all(len(reason) <= REASON_LIMIT for reason in (DISCONNECTED, NEVER_CONNECTED, PUB_CONNECTED, REPLAY_ANSWERED, BATCH_ARRIVED))


def test_store_keeps_each_unreachable_period_and_the_workers_reachability() -> None:
    from kvledger.store.changes import ChangeBuilder

    fold = InventoryFold()
    builder = ChangeBuilder(None, lambda values: 1)
    changes = builder.begin(1)
    for seq, batch in enumerate([_batch(0, _store(1)), _liveness_batch(1, False), _liveness_batch(1, True, 20.0),
                                 _liveness_batch(1, False, 30.0)], 1):
        builder.add_batch(changes, batch, seq, fold.apply(batch, seq), fold)
    changes = builder.finish(changes, fold)
    assert changes.new_unreachable == [
        ["w", 0, "native", 2, 10.0, DISCONNECTED, 3, 20.0], ["w", 0, "native", 4, 30.0, DISCONNECTED, None, None],
    ]
    [row] = changes.worker_rows
    assert row[-2:] == (4, None)
    assert [event_row[7] for event_row in changes.event_rows] == ["stored", "unreachable", "reachable", "unreachable"]
    assert json.loads(row[12])["native"]["unreachable"] == {"since": 4, "reason": DISCONNECTED, "ts": 30.0}


def test_a_decision_audit_names_the_workers_it_did_not_credit_as_unreachable(sqlite_url) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
        with engine.begin() as connection:
            for publisher, since, until in (("gone", 5, None), ("back", 2, 4), ("later", 9, None)):
                connection.execute(sa.text(
                    "INSERT INTO unreachable_periods (publisher, dp_rank, provenance, since_seq, since_ts, reason, "
                    "until_seq, until_ts) VALUES (:p, 0, 'native', :s, 1.0, 'pub down, replay silent', :u, NULL)",
                ), {"p": publisher, "s": since, "u": until})
            connection.execute(sa.text(
                "INSERT INTO decisions (stream_seq, request_id, inventory_seq, credited_blocks, baseline_blocks, reason, "
                "backend, settings_digest, uncertain_workers, candidates, worker_overlaps, decided_ts) "
                "VALUES (1, 'r', 7, 0, 0, 'disabled', 'cpu', 'd', '[\"gone\"]', '[]', '{}', 1.0)"))
        with engine.connect() as connection:
            [decision] = audit.Audit(connection).decision("r")
    # unreachable at seq 7: "gone" (since 5); "back" was reachable again at 4, "later" went at 9
    assert decision["unreachable_workers"] == ["gone"] and decision["uncertain_workers"] == ["gone"]


async def test_an_engine_back_after_it_was_unreachable_is_checked_by_content_even_across_an_ingest_restart(
    nats_server,
) -> None:
    """Killed, published unreachable; ingest stops; a new engine starts on the same ports and publishes;
    ingest starts again: reachable (KV_EVENTS said unreachable), then the incarnation check finds the restart."""
    worker = WorkerId("live-reborn")
    pub, replay = engine_endpoints()
    first = EngineProcess("vllm", _wheel(), pub, replay)
    await first.start()
    source = StreamSource(worker, pub, replay, Provenance.NATIVE)
    try:
        async with Bridge(settings_for(nats_server.url), [source]) as bridge:
            await bridge.wait_ready(timeout=15)
            await Truth(first, 1_000).publish(BATCHES)
            await wait_until(lambda: _count(nats_server.url, worker, BATCHES), 10, f"{BATCHES} batches")
            first.signal(signal.SIGKILL)
            await _wait_liveness(nats_server.url, worker, 1, 10)
    finally:
        await first.stop()
    second = EngineProcess("vllm", _wheel(), pub, replay)
    await second.start()
    truth = Truth(second, 9_000)
    try:
        await truth.publish(3)
        async with Bridge(settings_for(nats_server.url), [source]) as bridge:
            await bridge.wait_ready(timeout=15)
            await wait_until(lambda: _count(nats_server.url, worker, BATCHES + 3), 10, "the new engine's batches")
            await bridge.publisher.flush(10)
    finally:
        await second.stop()
    gone, back = await _liveness(nats_server.url, worker)
    assert (gone.reachable, back.reachable) == (False, True)
    batches, fold, index = await _ledger(nats_server.url)
    liveness_seqs = [seq for seq, batch in batches if is_liveness(batch)]
    restart = [seq for seq, batch in batches if any(
        isinstance(event, Gap) and event.reason is GapReason.PUBLISHER_RESTART for event in batch.events)]
    assert len(restart) == 1 and liveness_seqs[1] < restart[0]  # reachable first, then what the check found
    assert [(b.epoch, b.seq) for _, b in batches if not is_liveness(b)] == [(0, s) for s in range(BATCHES)] + [(1, s) for s in range(3)]
    assert _held(fold, worker) == truth.held and not fold.is_unreachable(worker) and not fold.is_uncertain(worker)
    assert len(_credited(index, worker)) == len(truth.held)


async def test_an_engine_without_a_replay_socket_is_unreachable_once_its_connection_is_down_that_long(nats_server) -> None:
    """Nothing to probe: the connection alone decides. Back on the same port, its seq going back is the restart."""
    pub, _ = engine_endpoints()
    worker = WorkerId("live-no-replay-socket")
    settings = settings_for(nats_server.url, **{"ingest.engine_timeout_s": 0.5})
    source = StreamSource(worker, pub, None, Provenance.NATIVE)
    first = SimulatedEngine(pub)
    await first.__aenter__()
    async with Bridge(settings, [source]) as bridge:
        await bridge.wait_ready(timeout=15)
        async def seen() -> bool:
            # (a batch sent before the PUB took the subscription is lost: nothing replays it)
            seq = await first.publish([one_block(first.next_seq + 1)], ts=float(first.next_seq + 1))
            return await _count(nats_server.url, worker, 1) and seq >= 2
        await wait_until(seen, 10, "batches of the first engine", interval=0.05)
        await wait_until(lambda: _last_seq(nats_server.url, worker, first.next_seq - 1), 10, "its last batch")
        await first.close()
        [gone] = await _wait_liveness(nats_server.url, worker, 1, 10)
        truth: set[int] = set()
        async with SimulatedEngine(pub) as second:
            await wait_until(bridge.streams[0].subscriber.connected.is_set, 10, "the SUB to reconnect")
            # connected, but nothing vouches for what it holds yet: still unreachable
            assert len(await _liveness(nats_server.url, worker)) == 1 and bridge.streams[0].reachable is False

            async def one_more_batch() -> bool:
                # (a batch sent before the PUB took the new subscription is lost: nothing replays it)
                block = 7 + len(truth)
                truth.add(block)
                await second.publish([one_block(block)], ts=float(block))
                return len(await _liveness(nats_server.url, worker)) == 2
            await wait_until(one_more_batch, 10, "a batch of the new engine", interval=0.05)
            _, back = await _liveness(nats_server.url, worker)
            await bridge.publisher.flush(10)
    assert (gone.reachable, gone.reason, back.reachable, back.reason) == (False, DISCONNECTED, True, BATCH_ARRIVED)
    batches, fold, index = await _ledger(nats_server.url)
    # reachable first, then its batch: seq back to 0 (or a few), a restart; a lost first batch leaves it uncertain
    reachable_at = [n for n, (_, batch) in enumerate(batches) if is_liveness(batch)][1]
    assert [batch.epoch for _, batch in batches[reachable_at + 1:]] == [1] * (len(batches) - reachable_at - 1)
    assert not fold.is_unreachable(worker) and index.unreachable_names() == ()
    assert _held(fold, worker) <= truth and (_held(fold, worker) == truth or fold.is_uncertain(worker))
