"""History retention: what is older than the window goes, in bounded transactions; nothing else changes.

A worker stores and removes blocks for a while (ingested three hours ago), then goes on
(ingested now). With a one-hour window the store removes the old event-log rows and the
stays that ended in the old part, and the old decisions; the live inventory, every row
newer than the window and the inventory as of any later seq are exactly as before, and an
audit of an older seq says that its history was pruned.
"""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from builders import BLOCK_SIZE, local_hashes
from kvledger.app.cli import main
from kvledger.core.events import EventBatch, Provenance, Removed, Stored, Tier, WorkerId
from kvledger.store import audit, database, tables
from kvledger.store.pruning import DECISIONS_PRUNED, HISTORY_PRUNED, HistoryPruned, pruned_through, prune_once
from store_harness import RunningStore, checkpoint, publish, store_settings

pytestmark = pytest.mark.service

WORKER = WorkerId("keep-w1")
HOUR = 3600.0
OLD_BATCHES = 40  # stream seqs 1..40, ingested three hours ago


def stream(now: float) -> list[EventBatch]:
    """Old: store blocks 1..20, remove 1..10, store 21..30. New: remove 11..15, store 31..45."""
    steps = ([Stored(Tier.DEVICE, (block,), None, BLOCK_SIZE, local_hashes([block])) for block in range(1, 21)]
             + [Removed(Tier.DEVICE, (block,)) for block in range(1, 11)]
             + [Stored(Tier.DEVICE, (block,), None, BLOCK_SIZE, local_hashes([block])) for block in range(21, 31)]
             + [Removed(Tier.DEVICE, (block,)) for block in range(11, 16)]
             + [Stored(Tier.DEVICE, (block,), None, BLOCK_SIZE, local_hashes([block])) for block in range(31, 46)])
    batches = []
    for seq, event in enumerate(steps):
        ingested = now - 3 * HOUR + seq if seq < OLD_BATCHES else now - 60 + seq
        batches.append(EventBatch(WORKER, 0, seq, ingested, ingested, Provenance.NATIVE, (event,)))
    return batches


def snapshot(url: str) -> dict:
    """What retention must not change, and what it removes, read from SQL."""
    with database.opened(url) as engine, engine.connect() as connection:
        ledger = audit.Audit(connection)
        log_c, residency_c = tables.event_log.c, tables.block_residency.c
        return {
            "live": sorted(row["engine_hash"] for row in ledger.inventory(WORKER, [Tier.DEVICE], 10**9)),
            "later": {seq: sorted(row["engine_hash"] for row in ledger.inventory(WORKER, [Tier.DEVICE], seq))
                      for seq in (41, 45, 50, 60)},
            "log_seqs": [row[0] for row in connection.execute(sa.select(log_c.stream_seq).order_by(log_c.stream_seq))],
            "closed": sorted(row[0] for row in connection.execute(
                sa.select(residency_c.removed_seq).where(residency_c.removed_seq.is_not(None)))),
            "decisions": [row[0] for row in connection.execute(
                sa.select(tables.decisions.c.request_id).order_by(tables.decisions.c.stream_seq))],
        }


def add_decisions(url: str, now: float) -> None:
    """Two decisions three hours old and one from now (rows as the decisions projector writes them)."""
    rows = [dict(stream_seq=seq, request_id=request_id, inventory_seq=seq, target=None, credited_blocks=0.0,
                 baseline_blocks=0, reason="no_candidates", backend="cpu", settings_digest="d", uncertain_workers="[]",
                 candidates="[]", worker_overlaps="{}", decided_ts=decided)
            for seq, request_id, decided in ((1, "old-1", now - 3 * HOUR), (2, "old-2", now - 3 * HOUR + 1),
                                             (3, "new-1", now - 5))]
    with database.opened(url) as engine, engine.begin() as connection:
        connection.execute(tables.decisions.insert(), rows)


async def test_history_older_than_the_window_is_removed_and_nothing_newer_changes(nats_server, db_url, capsys) -> None:
    now = time.time()
    settings = store_settings(nats_server.url, db_url)
    last = await publish(nats_server.url, stream(now), settings)
    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(db_url) >= last, f"checkpoint {last}")
    add_decisions(db_url, now)
    before = snapshot(db_url)
    assert before["log_seqs"] == list(range(1, last + 1)) and before["closed"] == list(range(21, 31)) + list(range(41, 46))

    # The store's own pruner, with a one-hour window and small transactions.
    retained = store_settings(nats_server.url, db_url, history_retention_s=HOUR, prune_every_s=0.05,
                              prune_batch_seqs=7)
    async with RunningStore(retained) as running:
        await running.until(lambda: _pruned(db_url) == (OLD_BATCHES, 2), "history pruned to the window")
        assert running.service.metrics.pruned.labels("event_log").value == OLD_BATCHES

    after = snapshot(db_url)
    assert after["live"] == before["live"]  # the live inventory is untouched
    assert after["later"] == before["later"]  # as of any seq after the horizon, nothing changed
    assert after["log_seqs"] == list(range(OLD_BATCHES + 1, last + 1))  # only what the window holds
    assert after["closed"] == list(range(41, 46))  # the stays that ended before the horizon are gone
    assert after["decisions"] == ["new-1"]

    with database.opened(db_url) as engine, engine.connect() as connection:
        with pytest.raises(HistoryPruned, match=f"at or before KV_EVENTS seq {OLD_BATCHES} was pruned"):
            audit.Audit(connection).inventory(WORKER, [Tier.DEVICE], OLD_BATCHES)
    capsys.readouterr()
    assert main(["audit", "inventory", "--worker", WORKER.name, "--at-seq", "30", "--db", db_url]) == 1
    assert "was pruned (store.history_retention_s)" in capsys.readouterr().err
    assert main(["audit", "decision", "old-1", "--db", db_url]) == 1
    assert "decisions at or before KV_DECISIONS seq 2 were pruned" in capsys.readouterr().out


async def test_pruning_again_removes_nothing_more_and_a_window_of_zero_keeps_everything(nats_server, db_url) -> None:
    now = time.time()
    settings = store_settings(nats_server.url, db_url)
    last = await publish(nats_server.url, stream(now), settings)
    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(db_url) >= last, f"checkpoint {last}")
    with database.opened(db_url) as engine:
        everything = snapshot(db_url)
        kept = prune_once(engine, settings.store, events_stream="KV_EVENTS", decisions_stream="KV_DECISIONS", now=now)
        assert kept.horizon == 0 and sum(kept.rows.values()) == 0  # no window: nothing goes
        assert snapshot(db_url) == everything
        windowed = store_settings(nats_server.url, db_url, history_retention_s=HOUR, prune_batch_seqs=1000).store
        first = prune_once(engine, windowed, events_stream="KV_EVENTS", decisions_stream="KV_DECISIONS", now=now)
        again = prune_once(engine, windowed, events_stream="KV_EVENTS", decisions_stream="KV_DECISIONS", now=now)
    assert first.horizon == OLD_BATCHES and first.rows["event_log"] == OLD_BATCHES
    assert first.rows["block_residency"] == 10
    assert again.horizon == OLD_BATCHES and sum(again.rows.values()) == 0


def _pruned(url: str) -> tuple[int, int]:
    with database.opened(url) as engine, engine.connect() as connection:
        return pruned_through(connection, HISTORY_PRUNED), pruned_through(connection, DECISIONS_PRUNED)
