"""A batch JetStream stored out of order, through the real store into SQLite and PostgreSQL.

Within one publish window JetStream can refuse batch k yet store k+1…n; ingest's resend
then stores k after n. The fold marks the worker uncertain at the hole and holds k+1…n back
until k comes: then all apply in engine order and the uncertainty ends ("hole healed"). A hole
still open at the end keeps its worker uncertain, its held batches kept in SQL for a restart.
"""

from __future__ import annotations

import json

import pytest

from builders import stored
from kvledger.core.events import EventBatch, Provenance, WorkerId
from kvledger.store import audit, database
from kvledger.store.fold_loader import load_fold
from store_harness import RunningStore, checkpoint, publish, store_settings

pytestmark = pytest.mark.service

LATE = WorkerId("eng-late")
WIDE = WorkerId("eng-wide")
STEADY = WorkerId("eng-steady")
BASE = 10**12  # engine seqs of a long-running engine: the reasons must still fit the audit column


def batch(worker: WorkerId, seq: int, *events) -> EventBatch:
    return EventBatch(worker, 0, seq, 1.0, 2.0 + seq - BASE, Provenance.NATIVE, tuple(events))


async def test_a_batch_stored_after_later_ones_is_an_uncertain_period_in_the_audit(nats_server, db_url) -> None:
    stream = [
        batch(LATE, BASE + 4, stored([1])),
        batch(WIDE, BASE + 0, stored([1])),
        batch(STEADY, BASE + 0, stored([1])),
        batch(LATE, BASE + 6, stored([3])),  # 5 was refused: the hole
        batch(WIDE, BASE + 4, stored([2], parent=1)),  # 1..3 were refused
        batch(STEADY, BASE + 1, stored([2], parent=1)),
        batch(LATE, BASE + 7, stored([4], parent=3)),
        batch(LATE, BASE + 5, stored([2], parent=1)),  # the resend of 5, stored last
        batch(WIDE, BASE + 2, stored([9])),
    ]
    last = await publish(nats_server.url, stream)
    assert last == len(stream)
    settings = store_settings(nats_server.url, db_url)
    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(db_url) >= last, f"checkpoint {last}")

    with database.opened(db_url) as engine:
        with engine.connect() as connection:
            records = audit.Audit(connection)
            periods = {
                (row["publisher"], row["since_seq"], row["reason"], row["resolved_by"]) for row in records.uncertain_periods()
            }
            workers = {row["publisher"]: row for row in records.workers()}
            counters = dict(connection.exec_driver_sql(
                "SELECT publisher, counters FROM workers ORDER BY publisher"
            ).all())
        rebuilt, _ = load_fold(engine)
    assert periods == {
        ("eng-late", 4, f"hole: seq {BASE + 5}", "hole healed"),
        ("eng-wide", 5, "hole: 3 seqs", "still uncertain"),  # 1..3 in full would not fit
    }
    assert workers["eng-late"]["uncertain_since"] is None and workers["eng-late"]["engine_seq"] == BASE + 7
    assert workers["eng-steady"]["uncertain_since"] is None
    assert json.loads(counters["eng-late"]) == {"held_batch": 2, "sequence_hole": 1, "healed_hole": 1}
    assert json.loads(counters["eng-wide"]) == {"held_batch": 2, "sequence_hole": 1}
    # the resent batch and the two held behind it applied in engine order; the SQL-rebuilt fold agrees
    tier = stream[0].events[0].tier
    assert [r.engine_hash for r in rebuilt.records(LATE, Provenance.NATIVE, tier)] == [1, 2, 3, 4]
    assert rebuilt.uncertain_workers() == [WIDE]
    # eng-wide still waits for seq 1 and 3, seqs 2 and 4 held in SQL: given them, it heals after a restart
    assert workers["eng-wide"]["engine_seq"] == BASE
    behind = rebuilt.worker_state(WIDE).by_provenance[Provenance.NATIVE].behind_hole
    assert [held.seq for held in behind.held] == [BASE + 2, BASE + 4]
    rebuilt.apply(batch(WIDE, BASE + 1, stored([5])), last + 1)
    rebuilt.apply(batch(WIDE, BASE + 3, stored([6])), last + 2)
    assert [r.engine_hash for r in rebuilt.records(WIDE, Provenance.NATIVE, tier)] == [1, 2, 5, 6, 9]
    assert rebuilt.uncertain_workers() == []
