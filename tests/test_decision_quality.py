"""Decision quality: was each decision still true at its horizon? (store/audit.py, store/quality.py)

A scripted workload whose truth is known, through a real nats-server, decide and store:
the source holds 8 blocks, the targets 3 and 2. Three decisions in one batch: one chooses
the source for `target`, one finds nothing to transfer (it counts only for its target),
one chooses the source for `target2`. 100 ms after the decisions the source evicts its
last three blocks and `target2` its second; 700 ms after them another worker stores a
block. Ingest times are written into the batches, so the horizons fall exactly where the
script puts them. At a 500 ms horizon the two hints are stale and target2's credit is
lost; at 50 ms everything still held. SQL (SQLite and PostgreSQL) and store's metrics
must both say so.
"""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from kvledger.app.cli import main
from kvledger.runtime.metric_set import MetricSet
from engines import wait_until
from kvledger.store import database

from kvledger.core.settings import load_settings
from kvledger.store import audit as audit_queries
from kvledger.store.audit import Audit
from kvledger.store.quality import QualityMetrics, QualityTracker
from store_harness import assert_shell_agrees, checkpoint
from quality_workload import DEADLINE_S, decided_workload

pytestmark = pytest.mark.service

def decide_settings(url: str):
    return load_settings(environ={}, overrides={
        "nats.url": url, "decide.http_port": 0, "decide.backend": "cpu",
        "reuse.enable_decode_to_prefill_gpu_reuse": True, "reuse.transfer_source_prefill_token_us": 1000.0,
    }).settings


def sample(service, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_a_source_evicting_100_ms_after_the_decision_is_stale_at_500_ms_and_fresh_at_50_ms(nats_server, db_url) -> None:
    settings = decide_settings(nats_server.url)
    async with decided_workload(nats_server.url, db_url, settings) as workload:
        running, answers = workload.running, workload.answers
        assert [answer["reason"] for answer in answers] == ["chosen", "no_candidates", "chosen"]
        assert answers[0]["chosen"]["prefix_blocks"] == 8 and answers[0]["baseline_blocks"] == 3
        quality = running.service.quality
        await running.until(lambda: checkpoint(db_url, "decisions") >= 3, "the decisions in SQL")
        await wait_until(lambda: quality.waiting == 3, DEADLINE_S, "the three decisions waiting for their horizon")
        decided, evicted = await workload.evict()
        await wait_until(lambda: quality.waiting == 0, DEADLINE_S, "the decisions judged")

        service = running.service
        assert sample(service, "kvledger_store_decision_hints_total", worker="source/1", tier="device") == 2
        assert sample(service, "kvledger_store_decision_stale_hints_total", worker="source/1", tier="device") == 2
        assert sample(service, "kvledger_store_decision_credits_total", worker="target", reason="chosen") == 1
        assert sample(service, "kvledger_store_decision_credits_total", worker="target", reason="no_candidates") == 1
        assert sample(service, "kvledger_store_decision_lost_credits_total", worker="target", reason="chosen") == 0
        assert sample(service, "kvledger_store_decision_lost_credits_total", worker="target2", reason="chosen") == 1
        assert sample(service, "kvledger_store_decision_first_eviction_seconds_count", tier="device") == 2
        assert sample(service, "kvledger_store_decision_first_eviction_seconds_bucket", tier="device", le="0.25") == 2
        assert sample(service, "kvledger_store_decision_first_eviction_seconds_bucket", tier="device", le="0.05") == 0

    with database.opened(db_url) as engine, engine.connect() as connection:
        audit = Audit(connection)
        judged = {row["request_id"]: row for row in audit.decision_quality(0.5)}
        hint, credit_only, hint2 = judged["hint"], judged["credit-only"], judged["hint2"]
        assert (hint["stale"], hint["source_blocks"], hint["source_gone"]) == (1, 5, 3)
        assert (hint["lost_credit"], hint["target_blocks"], hint["target_gone"]) == (0, 3, 0)
        assert hint["first_eviction_ms"] == pytest.approx((evicted - decided_ts(connection, "hint")) * 1000, abs=1e-3)
        assert hint["source_gone_after_ms"] == pytest.approx(hint["first_eviction_ms"], abs=1e-3)
        assert (credit_only["stale"], credit_only["source_blocks"], credit_only["lost_credit"]) == (None, 0, 0)
        assert (hint2["stale"], hint2["lost_credit"], hint2["target_blocks"], hint2["target_gone"]) == (1, 1, 2, 1)

        fresh = {row["request_id"]: row for row in audit.decision_quality(0.05)}
        assert [(fresh[r]["stale"], fresh[r]["lost_credit"]) for r in ("hint", "credit-only", "hint2")] == \
            [(0, 0), (None, 0), (0, 0)]
        assert fresh["hint"]["first_eviction_ms"] is None and fresh["hint"]["source_gone"] == 0

        summary = {(row["dimension"], row["key"]): row for row in audit.decision_quality_summary(0.5)}
        source = summary["worker", "source/1"]
        assert (source["hints"], source["stale_hints"], source["stale_hint_rate"]) == (2, 2, 1.0)
        assert source["median_first_eviction_ms"] == pytest.approx(
            sorted([hint["first_eviction_ms"], hint2["first_eviction_ms"]])[0] / 2
            + sorted([hint["first_eviction_ms"], hint2["first_eviction_ms"]])[1] / 2, abs=1e-3)
        target = summary["worker", "target"]
        assert (target["hints"], target["credited"], target["lost_credit"], target["lost_credit_rate"]) == (0, 2, 0, 0.0)
        assert (summary["worker", "target2"]["lost_credit_rate"], summary["tier", "device"]["hints"]) == (1.0, 2)
        assert (summary["tier", "none"]["hints"], summary["tier", "none"]["credited"]) == (0, 1)
        assert summary["reason", "chosen"]["stale_hint_rate"] == 1.0
        assert summary["reason", "no_candidates"]["lost_credit_rate"] == 0.0
        [hour] = [row for (dimension, _), row in summary.items() if dimension == "hour"]
        assert (hour["hints"], hour["stale_hints"], hour["credited"], hour["lost_credit"]) == (2, 2, 3, 1)
        assert int(hour["key"]) == int(decided // 3600 * 3600)
        # The same answers as an auditor gets pasting the documented statements into sqlite3 or psql.
        for query, rows in ((audit_queries.DECISION_QUALITY, audit.decision_quality(0.5)),
                            (audit_queries.DECISION_QUALITY_SUMMARY, audit.decision_quality_summary(0.5))):
            assert_shell_agrees(db_url, query, {"horizon_ms": 500.0}, rows, (
                "request_id", "stale", "source_gone", "lost_credit", "target_gone", "dimension", "key", "hints",
                "stale_hints", "credited"))
        fresh_summary = {(row["dimension"], row["key"]): row for row in audit.decision_quality_summary(0.05)}
        assert fresh_summary["worker", "source/1"]["stale_hint_rate"] == 0.0
        assert fresh_summary["worker", "source/1"]["median_first_eviction_ms"] is None


def test_a_fold_rebuilt_from_sql_leaves_what_waited_to_the_sql_judge() -> None:
    # A store whose fold is rebuilt from SQL (a restart, a failed write) no longer holds what
    # it saw of the waiting decisions' windows: they go to the SQL judge (store/verdicts.py),
    # but for those whose window the rebuilt fold sees whole (taken at or after its seq).
    metric_set = MetricSet()
    registry = metric_set.registry
    metrics = QualityMetrics(metric_set)
    tracker = QualityTracker(metrics, [500.0], max_pending=10)
    row = {"stream_seq": 1, "decided_ts": 100.0, "inventory_seq": 3, "reason": "chosen", "chosen_source": "source",
           "chosen_dp_rank": 1, "chosen_tier": "device", "target_publisher": "target", "target_dp_rank": 0}
    rely_on = {"source": [(1 << 64) - 5]}
    tracker.decisions_committed([row], [rely_on])  # at inventory seq 3: its window began before the rebuilt fold's 5
    tracker.decisions_committed([{**row, "stream_seq": 3, "inventory_seq": 5}], [rely_on])  # at 5: seen whole
    # after it, but its horizon (100.3) has passed in the rebuilt fold (100.4)
    tracker.decisions_committed([{**row, "stream_seq": 4, "inventory_seq": 6, "decided_ts": 99.8}], [rely_on])
    assert tracker.waiting == 3
    tracker.resume_at(100.4, 5)
    assert [pending.stream_seq for pending in tracker.due(200.0)] == [3]  # the one the rebuilt fold still judges
    assert registry.get_sample_value("kvledger_store_decision_quality_unjudged_total", {"reason": "late"}) == 2
    assert registry.get_sample_value("kvledger_store_decision_hints_total", {"worker": "source/1", "tier": "device"}) is None
    # and a decision made before the rebuilt fold's seq is not taken in: its window began before it
    tracker.decisions_committed([{**row, "stream_seq": 2, "decided_ts": 100.3}], [rely_on])
    assert tracker.waiting == 0
    assert registry.get_sample_value(
        "kvledger_store_decision_quality_unjudged_total", {"reason": "before_remembered"}) == 1


def decided_ts(connection: sa.Connection, request_id: str) -> float:
    return connection.execute(sa.text("SELECT decided_ts FROM decisions WHERE request_id = :r"),
                              {"r": request_id}).scalar_one()


def test_the_quality_command_on_an_empty_ledger_and_a_bad_horizon(sqlite_url, capsys) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    assert main(["audit", "quality", "--db", sqlite_url]) == 0
    assert "(no rows)" in capsys.readouterr().out
    assert main(["audit", "quality", "--db", sqlite_url, "--decisions", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["audit", "quality", "--db", sqlite_url, "--horizon-ms", "-1"]) == 2
    assert "--horizon-ms must be 0 or more" in capsys.readouterr().err
