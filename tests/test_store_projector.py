"""The store contract suite: one set of tests, run against SQLite and PostgreSQL.

A recorded stream (several workers, native and retained, clears, gaps, restarts, hashes
above 2**63, one undecodable record) is published to a real nats-server and projected by
the real projector into a real database; SQL must agree with the in-memory fold.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Callable, Iterable

import attrs
import nats
import pytest
import sqlalchemy as sa

from builders import BLOCK_SIZE, local_hashes
from kvledger.events import (
    Cleared,
    EventBatch,
    Gap,
    GapReason,
    Provenance,
    Removed,
    Stored,
    Tier,
    WorkerId,
    encode_batch,
)
from kvledger.fold import InventoryFold, groups_state
from kvledger.settings import Settings, load_settings
from kvledger.snapshot import decode_snapshot
from kvledger.streams import SNAPSHOTS_BUCKET, events_stream
from store import audit, database
from kvledger.streams import ensure_stream
from store.projector import StoreService
from store.recorder import load_fold
from store.tables import to_signed

pytestmark = pytest.mark.service

DEADLINE_S = 60.0
BAD_RECORD = b"\x93not a kvledger record"
TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


# --- the recorded stream ------------------------------------------------------------------


def recorded_stream(seed: int, batches: int) -> list[EventBatch | bytes]:
    """A deterministic stream of canonical batches exercising every fold rule; bytes = a bad record."""
    rng = random.Random(seed)
    workers = [WorkerId("eng-a"), WorkerId("eng-a", 1), WorkerId("eng-b")]
    epoch = {w: 0 for w in workers}
    seq = {(w, p): -1 for w in workers for p in Provenance}
    held: dict[WorkerId, dict[Tier, list[int]]] = {w: {t: [] for t in TIERS} for w in workers}
    next_id = {w: 1 for w in workers}
    out: list[EventBatch | bytes] = []

    def engine_hash(worker: WorkerId, block_id: int) -> int:
        # eng-b's hashes all sit above 2**63, where signed storage matters.
        base = (1 << 63) if worker.publisher == "eng-b" else 0
        return base + (worker.dp_rank << 32) + block_id

    def batch(worker: WorkerId, provenance: Provenance, *events) -> EventBatch:
        seq[(worker, provenance)] += 1
        ts = 1000.0 + len(out)
        return EventBatch(worker, epoch[worker], seq[(worker, provenance)], ts - 0.5, ts, provenance, tuple(events))

    for _ in range(batches):
        worker = rng.choice(workers)
        roll = rng.random()
        tier = rng.choice(TIERS)
        blocks = held[worker][tier]
        if roll < 0.5:
            count = rng.randint(1, 8)
            ids = list(range(next_id[worker], next_id[worker] + count))
            next_id[worker] += count
            parent = rng.choice(blocks) if blocks and rng.random() < 0.7 else None
            if rng.random() < 0.05:
                parent = engine_hash(worker, 10_000_000)  # unknown parent
            hashes = tuple(engine_hash(worker, i) for i in ids)
            event = Stored(tier, hashes, parent, BLOCK_SIZE, local_hashes([i + 7919 * worker.dp_rank for i in ids]),
                           spec_kind="full_attention")
            # A hybrid model stores each block in its sliding-window group too, under the same hashes.
            window = (attrs.evolve(event, group_idx=1, spec_kind="sliding_window", sliding_window=64),) if rng.random() < 0.3 else ()
            out.append(batch(worker, Provenance.NATIVE, event, *window))
            blocks.extend(hashes)
        elif roll < 0.75:
            victims = rng.sample(blocks, min(len(blocks), rng.randint(1, 4)))
            for victim in victims:
                blocks.remove(victim)
            if rng.random() < 0.1:
                victims.append(engine_hash(worker, 20_000_000))  # unknown block
            # Sometimes the sliding-window group's eviction: the full-attention copy stays.
            group = 1 if rng.random() < 0.2 else 0
            out.append(batch(worker, Provenance.NATIVE, Removed(tier, tuple(victims), group)))
        elif roll < 0.87:
            # A retained layer announcing some of the worker's blocks, sometimes under another parent.
            pool = held[worker][Tier.DEVICE] or [engine_hash(worker, 30_000_000 + len(out))]
            pick = rng.sample(pool, min(len(pool), rng.randint(1, 3)))
            parent = rng.choice(pool) if rng.random() < 0.5 else None
            if rng.random() < 0.3:
                event = Removed(Tier.DEVICE, tuple(pick))
            else:
                event = Stored(Tier.DEVICE, tuple(pick), parent, BLOCK_SIZE, local_hashes([p % 100_000 for p in pick]))
            out.append(batch(worker, Provenance.RETAINED, event))
        elif roll < 0.9:
            if rng.random() < 0.5:
                out.append(batch(worker, Provenance.NATIVE, Cleared(Tier.DEVICE)))  # vLLM's: its GPU pool only
                held[worker][Tier.DEVICE] = []
            else:
                out.append(batch(worker, Provenance.NATIVE, Cleared()))
                held[worker] = {t: [] for t in TIERS}
        elif roll < 0.93:
            reason = rng.choice([GapReason.MISSED, GapReason.REPLAY_INCOMPLETE])
            out.append(batch(worker, Provenance.NATIVE, Gap(seq[(worker, Provenance.NATIVE)] + 1, seq[(worker, Provenance.NATIVE)] + 5, reason)))
            seq[(worker, Provenance.NATIVE)] += 4
        elif roll < 0.95:
            epoch[worker] += 1
            seq[(worker, Provenance.NATIVE)] = -1
            event = Gap(0, 0, GapReason.PUBLISHER_RESTART)
            explicit = rng.random() < 0.5
            out.append(batch(worker, Provenance.NATIVE, *((event,) if explicit else ())))
            held[worker] = {t: [] for t in TIERS}
        elif roll < 0.96:
            out.append(BAD_RECORD)
        else:
            # A batch with several events, stores and removes mixed.
            ids = list(range(next_id[worker], next_id[worker] + 3))
            next_id[worker] += 3
            hashes = tuple(engine_hash(worker, i) for i in ids)
            out.append(batch(
                worker, Provenance.NATIVE,
                # a placeholder ahead of the store it copies: unresolved, then resolved in this batch
                Stored(Tier.DISK, hashes[:1], None, 0, ()),
                Stored(tier, hashes, None, BLOCK_SIZE, local_hashes(ids)),
                Removed(tier, hashes[:1]),
                Stored(tier, hashes[:1], hashes[2], BLOCK_SIZE, local_hashes(ids[:1])),
                Stored(tier, hashes[2:], hashes[1], BLOCK_SIZE, local_hashes(ids[2:])),  # one more reference
                # offload placeholders (no tokens), one known, one not, under an ownership
                Stored(Tier.DISK, (hashes[1], engine_hash(worker, 40_000_000 + len(out))), None, 0, (), ownership="kvcr"),
                # and one for the next block this worker will store, resolved by a later transaction
                Stored(Tier.HOST, (engine_hash(worker, next_id[worker]),), None, 0, (), ownership="kvcr"),
            ))  # fmt: skip
            blocks.extend(hashes[1:])
            blocks.append(hashes[0])
    return out


def reference_folds(stream: list[EventBatch | bytes], every: int) -> tuple[InventoryFold, dict[int, set]]:
    """Fold the stream in memory; return the final fold and the inventory at every `every`-th seq."""
    fold = InventoryFold()
    at: dict[int, set] = {}
    for seq, item in enumerate(stream, start=1):
        if isinstance(item, EventBatch):
            fold.apply(item, seq)
        if seq % every == 0:
            at[seq] = fold_rows(fold, seq)
    return fold, at


def fold_rows(fold: InventoryFold, seq: int | None = None) -> set:
    return {
        (r.worker.publisher, r.worker.dp_rank, r.provenance.value, r.tier.value, r.group_idx, r.spec_kind, r.ownership,
         r.engine_hash, r.sequence_hash, r.parent_hash, r.stream_seq, int(r.conflict), int(r.unresolved))
        for r in fold.iter_records()
    }  # fmt: skip


def fold_state(fold: InventoryFold) -> dict:
    """Everything the fold knows, comparable across folds."""
    workers = {}
    for worker in fold.workers():
        state = fold.worker_state(worker)
        workers[worker.name] = (
            {p.value: (s.epoch, s.seq, s.uncertain_since, groups_state(s)) for p, s in state.by_provenance.items()},
            {k: v for k, v in state.counters.items() if v},
        )
    return {
        "inventory_seq": fold.inventory_seq,
        "counters": {k: v for k, v in fold.counters.items() if v},
        "workers": workers,
        "records": fold_rows(fold),
        "references": {(r.worker, r.provenance, r.tier, r.key): r.refs for r in fold.iter_records() if r.refs > 1},
    }


# --- harness ------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")
    with database.opened(url) as engine:
        database.upgrade(engine)
    return url


def store_settings(nats_url: str, db_url: str, **store: object) -> Settings:
    overrides = {"nats.url": nats_url, "db.url": db_url, "store.http_port": 0}
    overrides.update({f"store.{key}": value for key, value in store.items()})
    return load_settings(None, environ={}, overrides=overrides).settings


async def publish(nats_url: str, stream: Iterable[EventBatch | bytes], settings: Settings | None = None) -> int:
    """Publish the stream in order (the store's stream spec); return the last stream seq."""
    connection = await nats.connect(nats_url)
    try:
        js = connection.jetstream()
        await ensure_stream(js, events_stream((settings or Settings()).stream))
        last = 0
        pending = []
        for item in stream:
            if isinstance(item, bytes):
                pending.append(js.publish("kv.ev.broken.0", item))
            else:
                pending.append(js.publish(item.subject, encode_batch(item), headers={"Nats-Msg-Id": item.msg_id}))
            if len(pending) >= 256:
                last = max(ack.seq for ack in await asyncio.gather(*pending))
                pending = []
        if pending:
            last = max(ack.seq for ack in await asyncio.gather(*pending))
        return last
    finally:
        await connection.close()


def checkpoint(url: str, name: str = "events") -> int:
    with database.opened(url) as engine, engine.connect() as connection:
        try:
            return audit.Audit(connection).checkpoint(name)
        except sa.exc.OperationalError:
            return -1


async def poll(
    condition: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S, *, watch: asyncio.Task | None = None
) -> None:
    """Wait for `condition`; fail at the deadline, or at once if the watched task ended."""
    deadline = time.monotonic() + deadline_s
    while not await asyncio.to_thread(condition):
        if watch is not None and watch.done():
            watch.result()
            raise AssertionError(f"the store stopped before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class RunningStore:
    """The store service in this process, for as long as the `async with` lasts."""

    def __init__(self, settings: Settings) -> None:
        self.service = StoreService(settings)
        self.stop = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> RunningStore:
        self.task = asyncio.create_task(self.service.run(self.stop))
        return self

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        await poll(condition, what, watch=self.task)

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 30)


async def project(settings: Settings, until_seq: int) -> None:
    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(settings.db.url) >= until_seq, f"checkpoint {until_seq}")


def sql_inventory_at(connection: sa.Connection, workers: list[WorkerId], seq: int) -> set:
    rows = set()
    for worker in workers:
        for row in audit.Audit(connection).inventory(worker, list(Tier), seq):
            rows.add((
                row["publisher"], row["dp_rank"], row["provenance"], row["tier"], row["group_idx"],
                row["kv_cache_spec_kind"], row["ownership"], row["engine_hash"], row["sequence_hash"],
                row["parent_hash"], row["stored_seq"], int(row["conflict"]), int(row["unresolved"]),
            ))  # fmt: skip
    return rows


def content_digest(url: str) -> tuple[dict[str, int], str]:
    """Row counts and a digest of every table's deterministic content."""
    skip = {"dead_letters": {"recorded_ts"}, "checkpoints": {"updated_ts"}}
    counts, digest = {}, hashlib.sha256()
    with database.opened(url) as engine, engine.connect() as connection:
        for table in ("event_log", "block_residency", "workers", "uncertain_periods", "dead_letters", "checkpoints"):
            meta = sa.Table(table, sa.MetaData(), autoload_with=connection)
            columns = [c for c in meta.columns if c.name not in skip.get(table, set())]
            keys = [c for c in meta.primary_key.columns]
            rows = connection.execute(sa.select(*columns).order_by(*keys)).all()
            counts[table] = len(rows)
            for row in rows:
                digest.update(repr(tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)).encode())
    return counts, digest.hexdigest()


# --- the contract -------------------------------------------------------------------------


async def test_replaying_a_recorded_stream_gives_the_folds_inventory_at_every_100th_seq(nats_server, db_url) -> None:
    stream = recorded_stream(seed=7, batches=1500)
    last = await publish(nats_server.url, stream)
    assert last == len(stream)
    settings = store_settings(nats_server.url, db_url, batch_size=64, snapshot_every_events=400)
    await project(settings, last)

    expected, at = reference_folds(stream, every=100)
    workers = expected.workers()
    with database.opened(db_url) as engine, engine.connect() as connection:
        for seq, rows in at.items():
            assert sql_inventory_at(connection, workers, seq) == rows, f"inventory as of seq {seq}"
        assert sql_inventory_at(connection, workers, last) == fold_rows(expected)
        # as of a time: ingest_ts of the batch at seq k is 1000 + k - 1
        assert audit.Audit(connection).seq_at_time(1000.0 + 299.5) == 300
        dead = audit.Audit(connection).dead_letters()
        assert {row["stream_seq"] for row in dead} == {i for i, item in enumerate(stream, 1) if isinstance(item, bytes)}
        assert all(row["source"] == "events" and row["raw_bytes"] == len(BAD_RECORD) for row in dead)
        gaps = audit.Audit(connection).gaps()
        assert len(gaps) == sum(
            1 for item in stream if isinstance(item, EventBatch) for e in item.events
            if isinstance(e, Gap) and e.reason is not GapReason.PUBLISHER_RESTART
        ) + sum(1 for item in stream if isinstance(item, EventBatch) for e in item.events if isinstance(e, Gap) and e.reason is GapReason.PUBLISHER_RESTART)
        periods = audit.Audit(connection).uncertain_periods()
        assert periods and any(p["until_seq"] is not None for p in periods)
        snapshot_rows = connection.execute(sa.text("SELECT inventory_seq FROM snapshots ORDER BY inventory_seq")).scalars().all()

    # Restart correctness: the fold rebuilt from SQL is the fold.
    with database.opened(db_url) as engine:
        rebuilt, _ = load_fold(engine)
    assert fold_state(rebuilt) == fold_state(expected)

    # Snapshots: manifest rows match objects, and each decodes to the fold at its seq.
    assert snapshot_rows, "no snapshot written"
    connection = await nats.connect(nats_server.url)
    try:
        store = await connection.jetstream().object_store(SNAPSHOTS_BUCKET)
        newest = snapshot_rows[-1]
        data = (await store.get(f"inventory-{newest:020d}")).data
    finally:
        await connection.close()
    replay = InventoryFold()
    for seq, item in enumerate(stream[:newest], start=1):
        if isinstance(item, EventBatch):
            replay.apply(item, seq)
    assert fold_rows(decode_snapshot(data)) == fold_rows(replay)


async def test_health_metrics_and_redelivery_after_restart_change_nothing(nats_server, db_url) -> None:
    stream = recorded_stream(seed=3, batches=300)
    last = await publish(nats_server.url, stream)
    settings = store_settings(nats_server.url, db_url, batch_size=50)
    async with RunningStore(settings) as running:
        service = running.service
        await running.until(lambda: checkpoint(db_url) >= last, "projection")
        await running.until(service.is_ready, "readiness")
        reader, writer = await asyncio.open_connection("127.0.0.1", service.http_port)
        writer.write(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
        body = (await reader.read()).decode()
        writer.close()
        assert "kvledger_store_checkpoint_seq" in body and f'stream="KV_EVENTS"}} {float(last)}' in body
    before = content_digest(db_url)

    # Redelivery: a consumer handing the whole stream again (seq <= checkpoint) changes nothing.
    from store.jetstream import ConsumerWatch, bind_consumer
    from store.snapshots import SnapshotWriter
    from store.writer import RecorderProcess

    service = StoreService(settings)
    projector = service.events
    projector.fold, projector.index = load_fold(service.engine)
    connection = await nats.connect(nats_server.url)
    recorder = RecorderProcess(db_url, "KV_EVENTS")
    try:
        js = connection.jetstream()
        projector.snapshots = SnapshotWriter(js, service.engine, settings.store)
        subscription = await bind_consumer(js, "KV_EVENTS", "redelivery-test", 0, batch_size=50)
        await asyncio.to_thread(recorder.wait_ready)
        stop = asyncio.Event()
        watch = ConsumerWatch(js, "KV_EVENTS", "redelivery-test")
        consuming = asyncio.create_task(projector._consume(subscription, watch, recorder, stop))
        skipped = service.metrics.skipped.labels("KV_EVENTS")
        await poll(lambda: skipped._value.get() >= last, "every message redelivered", watch=consuming)
        stop.set()
        await consuming
    finally:
        recorder.close()
        await connection.close()
        service.engine.dispose()
    assert content_digest(db_url) == before
    # And a restarted store resumes at the checkpoint.
    await project(settings, last)
    assert content_digest(db_url) == before


async def test_hashes_above_2_63_round_trip_and_the_audit_cli_finds_them_in_three_notations(
    nats_server, db_url, capsys
) -> None:
    from kvledger.cli import main

    worker = WorkerId("hash-test")
    big = (1 << 64) - 2
    event = Stored(Tier.DEVICE, (big, 1 << 63), None, BLOCK_SIZE, local_hashes([1, 2]))
    stream = [EventBatch(worker, 0, 0, 1.0, 2.0, Provenance.NATIVE, (event,))]
    last = await publish(nats_server.url, stream)
    await project(store_settings(nats_server.url, db_url), last)
    with database.opened(db_url) as engine, engine.connect() as connection:
        stored = connection.execute(sa.text("SELECT engine_hash FROM block_residency ORDER BY slot")).scalars().all()
    assert stored == [to_signed(big), -(1 << 63)]
    capsys.readouterr()
    for notation in (str(big), str(big - (1 << 64)), hex(big)):
        assert main(["audit", "block", notation, "--db", db_url, "--json"]) == 0
        found = json.loads(capsys.readouterr().out)
        assert found["hash"] == big
        assert [row["engine_hash"] for row in found["history"]] == [big]
        assert found["history"][0]["state"] == "stored"
    assert main(["audit", "inventory", "--worker", "hash-test", "--tier", "device", "--db", db_url]) == 0
    table = capsys.readouterr().out
    assert str(big) in table and str(1 << 63) in table


async def test_decisions_and_ingest_dead_letters_are_projected_and_audited(nats_server, db_url, capsys) -> None:
    from kvledger.cli import main
    from kvledger.decision_codec import decision_to_json
    from kvledger.events import DeadLetter, encode_dead_letter
    from kvledger.reuse import ReuseRequest, decide
    from kvledger.settings import ReuseSettings
    from kvledger.streams import DECISIONS_SUBJECT, dead_letters_stream, decisions_stream

    prefill, decode = WorkerId("prefill"), WorkerId("decode", 1)
    ids = list(range(1, 9))
    stream = [
        EventBatch(decode, 0, 0, 1.0, 2.0, Provenance.NATIVE, (Stored(Tier.DEVICE, tuple(ids), None, BLOCK_SIZE, local_hashes(ids)),)),
        EventBatch(prefill, 0, 0, 1.0, 3.0, Provenance.NATIVE, (Stored(Tier.DEVICE, (101, 102), None, BLOCK_SIZE, local_hashes(ids[:2])),)),
    ]
    last = await publish(nats_server.url, stream)
    fold, _ = reference_folds(stream, every=1)
    reuse = ReuseSettings(enable_decode_to_prefill_gpu_reuse=True, minimum_transfer_prefix_blocks=1, minimum_estimated_ttft_saving_ms=0.0)
    decision = decide(fold, ReuseRequest("req-1", local_hashes(ids), BLOCK_SIZE, prefill), reuse)
    assert decision.chosen is not None

    settings = store_settings(nats_server.url, db_url)
    connection = await nats.connect(nats_server.url)
    try:
        js = connection.jetstream()
        await ensure_stream(js, decisions_stream(settings.stream))
        await ensure_stream(js, dead_letters_stream(settings.stream))
        await js.publish(DECISIONS_SUBJECT, json.dumps(decision_to_json(decision)).encode(), headers={"Nats-Msg-Id": "req-1"})
        await js.publish(DECISIONS_SUBJECT, b"{not json", headers={"Nats-Msg-Id": "req-broken"})
        letter = DeadLetter("prefill", 0, "unknown medium 'FLOPPY'", (b"topic", b"\x00" * 8, b"payload"), 5.0, "tcp://h:1")
        await js.publish("kv.dlq.prefill", encode_dead_letter(letter))
    finally:
        await connection.close()

    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(db_url) >= last and checkpoint(db_url, "decisions") >= 2
                            and checkpoint(db_url, "dead_letters") >= 1, "all three streams")
    capsys.readouterr()
    assert main(["audit", "decision", "req-1", "--db", db_url, "--json"]) == 0
    (seen,) = json.loads(capsys.readouterr().out)
    assert seen["inventory_seq"] == decision.inventory_seq == last
    assert seen["target"] == "prefill" and seen["baseline_blocks"] == decision.baseline_blocks == 2
    assert seen["chosen_source"] == "decode" and seen["chosen_dp_rank"] == 1 and seen["chosen_tier"] == "device"
    assert seen["candidates"] == decision_to_json(decision)["candidates"]
    assert seen["target_inventory"] == [{
        "tier": "device", "group_idx": 0, "kv_cache_spec_kind": None, "ownership": None, "provenance": "native",
        "blocks": 2, "conflicting": 0,
    }]
    assert main(["audit", "decision", "req-1", "--db", db_url]) == 0
    assert "decode" in capsys.readouterr().out
    assert main(["audit", "dead-letters", "--db", db_url, "--json"]) == 0
    dead = {row["source"]: row for row in json.loads(capsys.readouterr().out)}
    assert dead["ingest"]["reason"] == "unknown medium 'FLOPPY'" and dead["ingest"]["frames"] == 3
    assert dead["ingest"]["endpoint"] == "tcp://h:1"
    assert dead["decisions"]["reason"].startswith("unreadable")
