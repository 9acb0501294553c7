"""store when JetStream loses acknowledged messages and reuses their seqs (a crash before its fsync).

The fault: nats-server is paused and its store folder copied (what was on disk), traffic
goes on and is acknowledged (and projected), then nats-server is killed, the copy put back
and the server restarted on the same port. Then, as ingest does, the lost batches are
published again under their Msg-Ids (worker by worker, so the reused seqs hold other
messages than before) and new traffic follows. After that, SQL must hold every batch once,
each worker's inventory as the batches fold in engine order, and say what the stream lost.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import attrs
import pytest
import sqlalchemy as sa

from kvledger.core.events import EventBatch
from kvledger.core.fold import InventoryFold
from services import LocalNatsServer, copy_nats_store, restore_nats_store
from kvledger.store import audit, database, tables
from store_harness import RunningStore, checkpoint, publish, recorded_stream, store_settings

pytestmark = pytest.mark.service

BATCHES = 1800
ON_DISK = 600  # batches on disk when the copy is taken
ACKED = 1200  # batches acknowledged (and projected) before the crash


def _batches() -> list[EventBatch]:
    return [item for item in recorded_stream(seed=31, batches=BATCHES) if isinstance(item, EventBatch)]


def _by_subject(batches: list[EventBatch]) -> list[EventBatch]:
    """The same batches as ingest publishes them again: each subject's in its order, subjects one after
    another, each encoded anew (so at another ingest time)."""
    again = [attrs.evolve(batch, ingest_ts=batch.ingest_ts + 10_000.0) for batch in batches]
    return sorted(again, key=lambda batch: batch.subject)  # sorted() is stable


def _truth(batches: list[EventBatch]) -> InventoryFold:
    fold = InventoryFold()
    for seq, batch in enumerate(batches, start=1):
        fold.apply(batch, seq)
    return fold


def _held(fold: InventoryFold) -> set:
    return {
        (r.worker.publisher, r.worker.dp_rank, r.provenance.value, r.tier.value, r.group_idx, r.ownership,
         r.engine_hash, r.sequence_hash, r.parent_hash, int(r.conflict))
        for r in fold.iter_records()
    }  # fmt: skip


def _sql_held(url: str) -> set:
    r = tables.block_residency.c
    with database.opened(url) as engine, engine.connect() as connection:
        rows = connection.execute(sa.select(
            r.publisher, r.dp_rank, r.provenance, r.tier, r.group_idx, r.ownership, r.engine_hash, r.sequence_hash,
            r.parent_hash, r.conflict_since,
        ).where(r.removed_seq.is_(None)))
        return {
            (p, d, prov, tier, group, own, tables.to_unsigned(e), tables.to_unsigned(s),
             None if parent is None else tables.to_unsigned(parent), int(conflict is not None))
            for p, d, prov, tier, group, own, e, s, parent, conflict in rows
        }  # fmt: skip


def _sql_batches(url: str) -> list[tuple]:
    e = tables.event_log.c
    with database.opened(url) as engine, engine.connect() as connection:
        return [tuple(row) for row in connection.execute(
            sa.select(e.publisher, e.dp_rank, e.provenance, e.epoch, e.engine_seq).where(e.event_idx == 0)
        )]


def _generations(url: str) -> list:
    with database.opened(url) as engine, engine.connect() as connection:
        return connection.execute(sa.select(tables.stream_generations)).all()


def _uncertain(fold: InventoryFold) -> set:
    return {worker.name for worker in fold.uncertain_workers()}


def _sql_uncertain(url: str) -> set:
    w = tables.workers.c
    with database.opened(url) as engine, engine.connect() as connection:
        rows = connection.execute(sa.select(w.publisher, w.dp_rank).where(
            sa.or_(w.uncertain_since.is_not(None), w.retained_uncertain_since.is_not(None))))
        return {f"{p}/{d}" if d else p for p, d in rows}


def _assert_healed(url: str, batches: list[EventBatch]) -> None:
    truth = _truth(batches)
    assert _sql_held(url) == _held(truth)
    with_events = [batch for batch in batches if batch.events]
    recorded = _sql_batches(url)
    assert len(recorded) == len(set(recorded)), "a batch was written twice"
    assert sorted(recorded) == sorted(
        (b.worker.publisher, b.worker.dp_rank, b.provenance.value, b.epoch, b.seq) for b in with_events
    )


def _local(nats_server) -> LocalNatsServer:
    if not isinstance(nats_server, LocalNatsServer):
        pytest.skip("needs nats-server's store folder on this machine (the local binary)")
    return nats_server


@pytest.mark.parametrize("store_during_crash", ["running", "restarted"])
async def test_the_lost_tail_is_read_again_by_identity_and_every_batch_is_once_in_sql(
    nats_server, db_url, tmp_path, store_during_crash,
) -> None:
    server = _local(nats_server)
    batches = _batches()
    settings = store_settings(server.url, db_url, batch_size=64)
    await publish(server.url, batches[:ON_DISK])
    store = await RunningStore(settings).__aenter__()
    try:
        await store.until(lambda: checkpoint(db_url) >= ON_DISK, "the first part projected")
        copy_nats_store(server, tmp_path / "on-disk")
        acked = await publish(server.url, batches[ON_DISK:ACKED])
        await store.until(lambda: checkpoint(db_url) >= acked, "the acknowledged part projected")
        if store_during_crash == "restarted":
            await store.__aexit__(None, None, None)
        restore_nats_store(server, tmp_path / "on-disk")
        if store_during_crash == "restarted":
            store = await RunningStore(settings).__aenter__()
        # ingest's repair, then new traffic: the reused seqs now hold other batches than SQL recorded.
        await publish(server.url, _by_subject(batches[ON_DISK:ACKED]) + batches[ACKED:])
        await store.until(lambda: len(_generations(db_url)) >= 1, "the loss found")
        generation = _generations(db_url)[0]
        await store.until(lambda: checkpoint(db_url) >= len(batches) + generation.ledger_offset, "everything projected")
        metrics = store.service.metrics
        assert metrics.stream_losses.labels("KV_EVENTS").value >= 1
        assert metrics.duplicates.labels("KV_EVENTS").value >= 1
    finally:
        await store.__aexit__(None, None, None)
    _assert_healed(db_url, batches)
    assert _sql_uncertain(db_url) == _uncertain(_truth(batches))
    # SQL says which ledger seqs the stream lost (the acknowledged part after the copy) and
    # that the stream delivered every batch of them again: none exists only in SQL.
    assert (generation.first_stream_seq, generation.lost_first_ledger_seq, generation.lost_last_ledger_seq) == (
        ON_DISK + 1, ON_DISK + 1, acked,
    )
    assert generation.ledger_offset == acked - ON_DISK
    with database.opened(db_url) as engine, engine.connect() as connection:
        assert audit.Audit(connection).only_in_sql() == []
        recovered = connection.execute(sa.select(sa.func.count()).select_from(tables.recovered_batches)).scalar_one()
    assert recovered == sum(1 for batch in batches[ON_DISK:ACKED] if batch.events)


async def test_sql_rolled_back_with_the_stream_heals_from_the_stream(nats_server, sqlite_url, tmp_path) -> None:
    """A power loss that takes both back: SQL (a copy of the SQLite file) older than the stream."""
    server = _local(nats_server)
    batches = _batches()
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    settings = store_settings(server.url, sqlite_url, batch_size=64)
    await publish(server.url, batches[:ON_DISK])
    async with RunningStore(settings) as store:
        await store.until(lambda: checkpoint(sqlite_url) >= ON_DISK // 2, "part projected")
        path = Path(sqlite_url.removeprefix("sqlite:///"))
        source = sqlite3.connect(path)
        source.backup(sqlite3.connect(tmp_path / "ledger-copy.db"))  # what SQL had on disk
        source.close()
        copy_nats_store(server, tmp_path / "on-disk")
        acked = await publish(server.url, batches[ON_DISK:ACKED])
        await store.until(lambda: checkpoint(sqlite_url) >= acked, "the acknowledged part projected")
    restore_nats_store(server, tmp_path / "on-disk")
    shutil.copyfile(tmp_path / "ledger-copy.db", path)
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    await publish(server.url, _by_subject(batches[ON_DISK:ACKED]) + batches[ACKED:])
    async with RunningStore(settings) as store:
        await store.until(lambda: checkpoint(sqlite_url) >= len(batches), "everything projected")
    _assert_healed(sqlite_url, batches)
    assert _generations(sqlite_url) == []  # SQL was behind the loss: nothing of it was lost to SQL


async def test_a_loss_nobody_repairs_leaves_sql_ahead_and_says_so(nats_server, db_url, tmp_path) -> None:
    """No engine buffers the lost batches any more: SQL keeps them, new traffic still lands once, nothing silently skipped."""
    server = _local(nats_server)
    batches = _batches()
    settings = store_settings(server.url, db_url, batch_size=64)
    await publish(server.url, batches[:ON_DISK])
    copy_nats_store(server, tmp_path / "on-disk")
    acked = await publish(server.url, batches[ON_DISK:ACKED])
    async with RunningStore(settings) as store:
        await store.until(lambda: checkpoint(db_url) >= acked, "the acknowledged part projected")
    restore_nats_store(server, tmp_path / "on-disk")
    await publish(server.url, batches[ACKED:])
    async with RunningStore(settings) as store:
        await store.until(lambda: len(_generations(db_url)) == 1, "the loss found")
        generation = _generations(db_url)[0]
        await store.until(
            lambda: checkpoint(db_url) >= (len(batches) - ACKED + ON_DISK) + generation.ledger_offset, "new traffic",
        )
    _assert_healed(db_url, batches)  # SQL kept the lost batches and applied the new ones
    assert (generation.first_stream_seq, generation.lost_first_ledger_seq, generation.lost_last_ledger_seq) == (
        ON_DISK + 1, ON_DISK + 1, acked,
    )
    with database.opened(db_url) as engine, engine.connect() as connection:
        only_in_sql = audit.Audit(connection).only_in_sql()
    assert sorted((row["publisher"], row["dp_rank"], row["provenance"], row["epoch"], row["engine_seq"])
                  for row in only_in_sql) == sorted(
        (b.worker.publisher, b.worker.dp_rank, b.provenance.value, b.epoch, b.seq) for b in batches[ON_DISK:ACKED] if b.events
    )


async def _publish_decisions(url: str, request_ids: list[str]) -> int:
    """Decision records as decide writes them (one per request id) into KV_DECISIONS; the last stream seq."""
    import json

    import nats

    from builders import BLOCK_SIZE, local_hashes
    from kvledger.core.decision_codec import decision_to_json
    from kvledger.core.reuse import ReuseRequest, decide
    from kvledger.runtime.streams import DECISIONS_SUBJECT, decisions_stream, ensure_stream
    from kvledger.core.settings import ReuseSettings, Settings

    decision = decide(InventoryFold(), ReuseRequest("template", local_hashes([1, 2]), BLOCK_SIZE), ReuseSettings())
    template = decision_to_json(decision)
    connection = await nats.connect(url)
    try:
        js = connection.jetstream()
        await ensure_stream(js, decisions_stream(Settings().stream))
        last = 0
        for request_id in request_ids:
            record = json.dumps({**template, "request_id": request_id}).encode()
            last = (await js.publish(DECISIONS_SUBJECT, record, headers={"Nats-Msg-Id": request_id})).seq
        return last
    finally:
        await connection.close()


def _sql_request_ids(url: str) -> list[str]:
    with database.opened(url) as engine, engine.connect() as connection:
        return [row[0] for row in connection.execute(sa.select(tables.decisions.c.request_id))]


@pytest.mark.parametrize("store_during_crash", ["running", "restarted"])
async def test_decisions_the_stream_lost_stay_in_sql_and_new_ones_on_reused_seqs_are_projected(
    nats_server, db_url, tmp_path, store_during_crash,
) -> None:
    server = _local(nats_server)
    settings = store_settings(server.url, db_url, batch_size=16)
    ids = [f"req-{n}" for n in range(300)]
    await _publish_decisions(server.url, ids[:100])
    store = await RunningStore(settings).__aenter__()
    try:
        await store.until(lambda: checkpoint(db_url, "decisions") >= 100, "the first decisions projected")
        copy_nats_store(server, tmp_path / "on-disk")
        await _publish_decisions(server.url, ids[100:200])
        await store.until(lambda: checkpoint(db_url, "decisions") >= 200, "the acknowledged decisions projected")
        if store_during_crash == "restarted":
            await store.__aexit__(None, None, None)
        restore_nats_store(server, tmp_path / "on-disk")
        if store_during_crash == "restarted":
            store = await RunningStore(settings).__aenter__()
        await _publish_decisions(server.url, ids[200:])  # take the lost seqs 101-200
        await store.until(lambda: len(_sql_request_ids(db_url)) >= 300, "the new decisions projected")
    finally:
        await store.__aexit__(None, None, None)
    recorded = _sql_request_ids(db_url)
    assert sorted(recorded) == sorted(ids)  # each once: none lost, none deleted, none twice
    (generation,) = [g for g in _generations(db_url) if g.stream == "KV_DECISIONS"]
    assert (generation.first_stream_seq, generation.lost_first_ledger_seq, generation.lost_last_ledger_seq) == (101, 101, 200)
