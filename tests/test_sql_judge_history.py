"""The SQL judge's work per decision does not grow with how often a relied-on block was stored before.

A ledger written row by row into a migrated SQLite: one worker's device tier, one block stored and
evicted `history` times and then stored once more, a decision relying on it after that. SQLite's own
count of virtual-machine steps (its progress handler) measures the judge's work, not a clock.
"""

from __future__ import annotations

import sqlalchemy as sa

from kvledger.store import database, tables
from kvledger.store.verdicts import judge_into

BLOCK = 77
HORIZON_MS = 500.0


def _ledger(url: str, history: int) -> tuple[int, float]:
    """The ledger with `history` earlier stays of BLOCK; returns the decision's (stream seq, decided_ts)."""
    with database.opened(url) as engine:
        database.upgrade(engine)
        with engine.begin() as connection:
            connection.execute(tables.placements.insert(), [{
                "placement_id": 1, "publisher": "w", "dp_rank": 0, "provenance": "native", "tier": "device",
                "group_idx": 0}])
            seqs = range(1, 2 * history + 4)
            connection.execute(tables.event_log.insert(), [{
                "stream_seq": seq, "event_idx": 0, "publisher": "w", "dp_rank": 0, "epoch": 1, "engine_seq": seq,
                "provenance": "native", "kind": "stored" if seq % 2 else "removed", "block_count": 1,
                "engine_ts": float(seq), "ingest_ts": float(seq)} for seq in seqs])
            stays = [2 * n + 1 for n in range(history + 1)]  # stored at odd seqs, each removed at the next seq
            connection.execute(tables.block_stays.insert(), [{
                "stored_seq": seq, "engine_hash": BLOCK, "sequence_hash": BLOCK, "local_hash": BLOCK,
                "stored_ts": float(seq), "slot": 0, "placement_id": 1} for seq in stays])
            connection.execute(tables.block_removals.insert(), [{
                "stored_seq": seq, "removed_seq": seq + 1, "removed_ts": float(seq + 1), "placement_id": 1,
                "first_slot": 0, "last_slot": 0, "removal_cause": "removed"} for seq in stays[:-1]])
            decided_seq, decided_ts = stays[-1], float(stays[-1]) + 0.1  # the last stay is open from here on
            connection.execute(tables.decisions.insert(), [{
                "stream_seq": 1, "request_id": "r", "inventory_seq": decided_seq, "target": "w",
                "credited_blocks": 0.0, "baseline_blocks": 0, "chosen_source": "w", "chosen_dp_rank": 0,
                "chosen_tier": "device", "reason": "chosen", "backend": "cpu", "settings_digest": "",
                "uncertain_workers": "[]", "candidates": "[]", "worker_overlaps": "{}", "decided_ts": decided_ts,
                "target_publisher": "w", "target_dp_rank": 0}])
            connection.execute(tables.decision_blocks.insert(), [
                {"stream_seq": 1, "role": "source", "position": 0, "sequence_hash": BLOCK}])
    return 1, decided_ts


def _judged_with_steps(url: str, decision: tuple[int, float]) -> tuple[list, int]:
    """The verdict, and the SQLite steps (in tens) of the judge's own statement."""
    seq, decided_ts = decision
    steps = {}

    with database.opened(url) as engine, engine.connect() as connection:
        connection.exec_driver_sql("CREATE TEMPORARY TABLE decision_verdicts AS "
                                   "SELECT * FROM main.decision_verdicts WHERE 1 = 0")
        driver = connection.connection.driver_connection

        @sa.event.listens_for(connection, "before_cursor_execute")
        def counting(conn, cursor, statement, parameters, context, executemany) -> None:
            counted = steps.setdefault(statement, [0])

            def step() -> int:
                counted[0] += 1
                return 0

            driver.set_progress_handler(step, 10)

        judged = judge_into(connection, "temp.decision_verdicts", [(seq, HORIZON_MS, decided_ts + HORIZON_MS / 1000)])
        driver.set_progress_handler(None, 0)
        rows = connection.execute(sa.text(
            "SELECT stale, source_blocks, source_gone FROM temp.decision_verdicts")).all()
    assert judged == 1
    (judge_steps,) = [counted for statement, (counted,) in steps.items()
                      if statement.startswith("INSERT INTO temp.decision_verdicts")]
    return [tuple(row) for row in rows], judge_steps


def test_the_judge_reads_a_blocks_stays_from_the_decisions_window_not_its_whole_history(tmp_path) -> None:
    short = _judged_with_steps(f"sqlite:///{tmp_path / 'short.db'}", _ledger(f"sqlite:///{tmp_path / 'short.db'}", 5))
    long = _judged_with_steps(f"sqlite:///{tmp_path / 'long.db'}", _ledger(f"sqlite:///{tmp_path / 'long.db'}", 2000))
    assert short[0] == long[0] == [(0, 1, 0)]  # held through the horizon: not stale, one block, none gone
    # 400 times the history, and the judge's steps barely move (reading every earlier stay: 80 times as many)
    assert long[1] < 2 * short[1], (short[1], long[1])
