"""A batch JetStream stored out of order, through the real store into SQLite and PostgreSQL.

Within one publish window JetStream can refuse batch k yet store k+1…n; ingest's resend
then stores k after n. The fold marks the worker uncertain at the hole and drops the late
batch; the audit must show both.
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
        ("eng-late", 4, f"hole: seq {BASE + 5}", "still uncertain"),
        ("eng-wide", 5, "hole: 3 seqs", "still uncertain"),  # 1..3 in full would not fit
    }
    assert workers["eng-late"]["uncertain_since"] == 4 and workers["eng-late"]["engine_seq"] == BASE + 7
    assert workers["eng-steady"]["uncertain_since"] is None
    assert json.loads(counters["eng-late"]) == {"late_batch": 1, "sequence_hole": 1}
    assert json.loads(counters["eng-wide"]) == {"late_batch": 1, "sequence_hole": 1}
    # the late batch's store of 2 is not in the inventory; the SQL-rebuilt fold agrees
    assert [r.engine_hash for r in rebuilt.records(LATE, Provenance.NATIVE, stream[0].events[0].tier)] == [1, 3, 4]
    assert rebuilt.uncertain_workers() == [LATE, WIDE]
