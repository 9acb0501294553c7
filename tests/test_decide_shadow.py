"""Shadow decisions: with reuse off, decide records what reuse would have chosen, and the audit judges it.

The scripted workload of tests/quality_workload.py, whose truth is known (the source
holds 8 blocks, `target` 3 and `target2` 2; 100 ms after the decisions the source evicts
its last three blocks), answered with reuse off and `decide.shadow` on: the replies choose
nothing (reason `disabled`), while the records carry the would-be hints (the source for
both targets), which the shadow audit finds stale at 500 ms and fresh at 50 ms, in SQL
(SQLite and PostgreSQL) and in the shell alike. The records also carry each request, which
store keeps in `decision_requests` for a what-if replay.
"""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from kvledger.core.decision_codec import SHADOW_HEADER, request_from_header, REQUEST_HEADER
from kvledger.core.settings import ReuseSettings, enabled_reuse, load_settings, reuse_settings_from, settings_digest
from builders import BLOCK_SIZE, local_hashes
from kvledger.store import audit as audit_queries
from kvledger.store import database
from kvledger.store.audit import Audit
from store_harness import assert_shell_agrees, checkpoint
from quality_workload import decided_workload

pytestmark = pytest.mark.service


def shadow_settings(url: str, **decide: object):
    overrides = {"nats.url": url, "decide.http_port": 0, "decide.backend": "cpu", "decide.shadow": True,
                 "reuse.transfer_source_prefill_token_us": 1000.0}
    overrides.update({f"decide.{key}": value for key, value in decide.items()})
    return load_settings(environ={}, overrides=overrides).settings


def test_shadow_settings_come_from_a_file_laid_over_the_live_ones(tmp_path) -> None:
    alt = tmp_path / "alt.toml"
    alt.write_text("[reuse]\nenable_decode_to_prefill_gpu_reuse = true\nminimum_transfer_prefix_blocks = 9\n"
                   "[decide]\nbackend = 'cpu'\n")
    live = ReuseSettings(transfer_source_prefill_token_us=1000.0)
    shadow = reuse_settings_from(alt, live)
    assert (shadow.enable_decode_to_prefill_gpu_reuse, shadow.enable_decode_to_prefill_reuse) == (True, False)
    assert (shadow.minimum_transfer_prefix_blocks, shadow.transfer_source_prefill_token_us) == (9, 1000.0)
    both = enabled_reuse(live)
    assert both.enable_decode_to_prefill_reuse and both.enable_decode_to_prefill_gpu_reuse
    assert settings_digest(both) != settings_digest(live)


async def test_with_reuse_off_the_shadow_hints_are_recorded_and_judged_as_real_ones(nats_server, db_url) -> None:
    settings = shadow_settings(nats_server.url)
    async with decided_workload(nats_server.url, db_url, settings) as workload:
        answers = workload.answers
        # The replies are the live answers: reuse is off, nothing is chosen, no shadow in sight.
        assert [(answer["reason"], answer["chosen"]) for answer in answers] == [("disabled", None)] * 3
        assert all("shadow" not in answer for answer in answers)
        record = await workload.js.get_msg(settings.stream.decisions_stream, 1)
        assert json.loads(record.data) == answers[0]
        shadow = json.loads(record.headers[SHADOW_HEADER])
        assert (shadow["reason"], shadow["chosen"]["source"], shadow["chosen"]["prefix_blocks"]) == ("chosen", "source", 8)
        assert shadow["settings_digest"] == settings_digest(enabled_reuse(settings.reuse))
        recorded = request_from_header(record.headers[REQUEST_HEADER])
        assert recorded.reuse_request("hint").local_hashes == tuple(local_hashes(list(range(1, 13))))
        assert (recorded.target, recorded.blocks, recorded.complete) == ("target", 12, True)

        await workload.running.until(lambda: checkpoint(db_url, "decisions") >= 3, "the decisions in SQL")
        decided, evicted = await workload.evict()

    with database.opened(db_url) as engine, engine.connect() as connection:
        rows = {row.request_id: row for row in connection.execute(sa.text(
            "SELECT request_id, chosen_source, shadow_source, shadow_dp_rank, shadow_tier, shadow_prefix_blocks, "
            "shadow_transfer_blocks, shadow_baseline_blocks, shadow_reason FROM decisions"))}
        assert rows["hint"].chosen_source is None
        assert tuple(rows["hint"])[2:] == ("source", 1, "device", 8, 5, 3, "chosen")
        assert tuple(rows["hint2"])[2:] == ("source", 1, "device", 8, 6, 2, "chosen")
        assert rows["credit-only"].shadow_source is None and rows["credit-only"].shadow_reason == "no_candidates"
        assert connection.execute(sa.text("SELECT COUNT(*) FROM decision_requests")).scalar_one() == 3
        audit = Audit(connection)
        # The live audit sees no hints: reuse was off.
        assert all(row["stale"] is None for row in audit.decision_quality(0.5))
        judged = {row["request_id"]: row for row in audit.shadow_quality(0.5)}
        assert set(judged) == {"hint", "hint2"}
        assert (judged["hint"]["stale"], judged["hint"]["source_blocks"], judged["hint"]["source_gone"]) == (1, 5, 3)
        assert (judged["hint2"]["stale"], judged["hint2"]["source_blocks"], judged["hint2"]["source_gone"]) == (1, 6, 3)
        assert judged["hint"]["first_eviction_ms"] == pytest.approx((evicted - decided) * 1000, abs=50)
        fresh = {row["request_id"]: row["stale"] for row in audit.shadow_quality(0.05)}
        assert fresh == {"hint": 0, "hint2": 0}
        summary = {(row["dimension"], row["key"]): row for row in audit.shadow_quality_summary(0.5)}
        source = summary["worker", "source/1"]
        assert (source["hints"], source["stale_hints"], source["stale_hint_rate"], source["blocks_moved"]) == (2, 2, 1.0, 11)
        # 1 ms a token, BLOCK_SIZE tokens a block, 40 µs a device block, 5 + 6 blocks.
        assert source["estimated_ttft_saved_ms"] == pytest.approx(11 * (BLOCK_SIZE * 1.0 - 0.04))
        assert source["fresh_ttft_saved_ms"] == 0
        assert summary["tier", "device"]["hints"] == 2
        assert summary["settings", judged["hint"]["shadow_settings_digest"]]["hints"] == 2
        fresh_summary = {(row["dimension"], row["key"]): row for row in audit.shadow_quality_summary(0.05)}
        assert fresh_summary["worker", "source/1"]["stale_hint_rate"] == 0.0
        assert fresh_summary["worker", "source/1"]["fresh_ttft_saved_ms"] == pytest.approx(source["estimated_ttft_saved_ms"])
        for query, rows in ((audit_queries.SHADOW_QUALITY, audit.shadow_quality(0.5)),
                            (audit_queries.SHADOW_QUALITY_SUMMARY, audit.shadow_quality_summary(0.5))):
            assert_shell_agrees(db_url, query, {"horizon_ms": 500.0}, rows, (
                "request_id", "stale", "source_gone", "dimension", "key", "hints", "stale_hints", "blocks_moved"))
