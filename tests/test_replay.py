"""What-if replay (store/whatif_reference.py, `kvledger replay`) on a scripted workload whose truth is known.

The scripted workload of tests/quality_workload.py, answered with reuse off: the source holds 8
blocks, `target` 3 and `target2` 2; three requests (`hint` and `credit-only` to target,
`hint2` to target2); 100 ms after the decisions the source evicts its last three blocks and
target2 its second block. Replayed with reuse on, exactly `hint` and `hint2` flip to a
transfer from the source (5 and 6 blocks); with minimum_transfer_prefix_blocks = 6, only
`hint2`; with the live settings, nothing. Their would-be hints are stale at 500 ms and fresh
at 50 ms, and the recorded decisions' own figures equal the quality audit's. The same report,
to the last float, on SQLite and PostgreSQL, and from the streams (KV_DECISIONS, KV_EVENTS
folded) as from SQL; once store has pruned the window's history, `--source auto` reads the
streams.
"""

from __future__ import annotations

import asyncio
import json
import time

import attrs
import nats
import pytest
import sqlalchemy as sa

from kvledger.app.cli import main as kvledger
from kvledger.core.events import WorkerId
from kvledger.core.settings import ReuseSettings, reuse_settings_from
from builders import BLOCK_SIZE
from kvledger.store import database
from kvledger.store.audit import Audit
from kvledger.store.pruning import prune_once
from kvledger.store.whatif_reference import ReplayRefused, replay, replay_stream
from store_harness import checkpoint, store_settings
from quality_workload import decided_workload
from test_decide_shadow import shadow_settings

pytestmark = pytest.mark.service

# What the whole report must be, on either database (1 ms a token, 40 µs a device block).
SAVING = BLOCK_SIZE * 1.0 - 0.04


async def _record_workload(nats_url: str, db_url: str) -> None:
    settings = shadow_settings(nats_url)
    async with decided_workload(nats_url, db_url, settings) as workload:
        await workload.running.until(lambda: checkpoint(db_url, "decisions") >= 3, "the decisions in SQL")
        await workload.evict()


def _sweep(tmp_path, live):
    on = tmp_path / "on.toml"
    on.write_text("[reuse]\nenable_decode_to_prefill_reuse = true\nenable_decode_to_prefill_gpu_reuse = true\n")
    six = tmp_path / "six.toml"
    six.write_text("[reuse]\nenable_decode_to_prefill_gpu_reuse = true\nminimum_transfer_prefix_blocks = 6\n")
    same = tmp_path / "same.toml"
    same.write_text("[reuse]\n")
    return [(str(path), reuse_settings_from(path, live)) for path in (same, on, six)]


async def test_a_setting_change_flips_exactly_the_known_decisions_judged_as_the_audit_judges(
        nats_server, db_url, tmp_path) -> None:
    await _record_workload(nats_server.url, db_url)
    live = shadow_settings(nats_server.url).reuse
    sweep = _sweep(tmp_path, live)
    with database.opened(db_url) as engine, engine.connect() as connection:
        late = replay(connection, sweep, horizon_s=0.5)
        early = replay(connection, sweep, horizon_s=0.05)
        audit = {row["key"]: row for row in Audit(connection).decision_quality_summary(0.5) if row["dimension"] == "tier"}
        again = replay(connection, sweep, horizon_s=0.5)
    assert again == late  # deterministic
    assert (late.replayed, late.unreplayable, late.truncated, late.source) == (3, 0, 0, "sql")
    same, on, six = late.settings
    assert (same.changed, same.hints) == (0, 0)
    assert {change["request_id"] for change in on.changes} == {"hint", "hint2"}
    assert [change["request_id"] for change in six.changes] == ["hint2"]
    assert on.changes[0]["replayed"] == "target target: source/1 device 8 blocks (chosen)"
    # Transfers of 5 (hint: target holds 3) and 6 blocks (hint2: target2 holds 2), both stale at 500 ms.
    assert (on.hints, on.blocks_moved, on.tokens_moved) == (2, 11, 11 * BLOCK_SIZE)
    assert on.estimated_ttft_saved_ms == pytest.approx(11 * SAVING)
    assert (on.judged_hints, on.stale_hints, on.fresh_ttft_saved_ms) == (2, 2, 0.0)
    assert (six.hints, six.blocks_moved, six.stale_hints) == (1, 6, 1)
    early_on = early.settings[1]
    assert (early_on.judged_hints, early_on.stale_hints) == (2, 0)
    assert early_on.fresh_ttft_saved_ms == pytest.approx(11 * SAVING)
    # Credit: hint and credit-only rely on target's 3 blocks (kept), hint2 on target2's 2 (one evicted).
    for tally in (late.recorded, *late.settings):
        assert (tally.credited, tally.lost_credit, tally.pending) == (3, 1, 0)
    # The recorded decisions' own figures are the quality audit's.
    assert (late.recorded.credited, late.recorded.lost_credit) == (audit["none"]["credited"], audit["none"]["lost_credit"])
    assert late.recorded.hints == 0 and "device" not in audit

    # The command: same figures, as JSON; the changes listed.
    settings_args = [arg for path, _ in sweep for arg in ("--settings", path)]
    assert kvledger(["replay", "--db", db_url, *settings_args, "--decisions", "--json"]) == 0


async def test_the_command_prints_the_report(nats_server, sqlite_url, tmp_path, capsys) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    await _record_workload(nats_server.url, sqlite_url)
    sweep = _sweep(tmp_path, shadow_settings(nats_server.url).reuse)
    # The command lays each file over the configured [reuse]: here the defaults, so the file says the cost model.
    on = tmp_path / "on-1ms.toml"
    on.write_text(sweep[1][0] and (tmp_path / "on.toml").read_text() + "transfer_source_prefill_token_us = 1000.0\n")
    capsys.readouterr()
    assert kvledger(["replay", "--db", sqlite_url, "--settings", str(on), "--decisions", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    [recorded, replayed] = printed["rows"]
    assert (recorded["changed"], replayed["changed"], replayed["hints"], replayed["stale_hint_rate"]) == (0, 2, 2, 1.0)
    assert sorted(change["request_id"] for change in printed["changes"][str(on)]) == ["hint", "hint2"]
    assert kvledger(["replay", "--db", sqlite_url, "--settings", str(on), "--from", "2000-01-01", "--to", "2000-01-02"]) == 0
    assert "replayed 0 recorded requests" in capsys.readouterr().out
    assert kvledger(["replay", "--db", sqlite_url, "--settings", str(tmp_path / "missing.toml")]) == 2


def test_docs_audit_quotes_every_replay_query_verbatim() -> None:
    from pathlib import Path

    from kvledger.store import whatif_reference as replay_queries

    text = (Path(__file__).resolve().parent.parent / "docs" / "audit.md").read_text()
    for query in replay_queries.QUERIES:
        assert f"```sql\n{query.sql}\n```" in text, f"docs/audit.md lacks the current {query.name} query"


async def _from_streams(nats_url: str, sweep, **options):
    async with await nats.connect(nats_url) as nc:
        return await replay_stream(nc.jetstream(), shadow_settings(nats_url).stream, sweep, **options)


async def test_the_streams_give_the_report_sql_gives(nats_server, db_url, tmp_path) -> None:
    await _record_workload(nats_server.url, db_url)
    sweep = _sweep(tmp_path, shadow_settings(nats_server.url).reuse)
    for placed in (False, True):
        for horizon_s in (0.5, 0.05, 60.0):  # judged stale, fresh, and pending (no event that late)
            with database.opened(db_url) as engine, engine.connect() as connection:
                from_sql = replay(connection, sweep, horizon_s=horizon_s, placed=placed)
            from_streams = await _from_streams(nats_server.url, sweep, horizon_s=horizon_s, placed=placed)
            assert from_streams.source == "stream"
            assert attrs.evolve(from_streams, source="sql") == from_sql, (placed, horizon_s)
    assert [change["request_id"] for change in from_streams.settings[2].changes] == ["hint2"]
    assert from_streams.recorded.pending == 3 and from_streams.settings[1].changed == 2
    # A window: the decisions' own times, as SQL keeps them.
    with database.opened(db_url) as engine, engine.connect() as connection:
        decided = min(connection.execute(sa.text("SELECT decided_ts FROM decisions")).scalars())
        later = replay(connection, sweep, horizon_s=0.5, from_ts=decided + 1e-3)
    assert (await _from_streams(nats_server.url, sweep, horizon_s=0.5, from_ts=decided + 1e-3)).replayed \
        == later.replayed


async def test_auto_reads_the_streams_once_sql_history_is_pruned(nats_server, sqlite_url, tmp_path, capsys) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    await _record_workload(nats_server.url, sqlite_url)
    # The command lays each file over the configured [reuse] (the defaults): the files say the cost model.
    paths = [path for path, _ in _sweep(tmp_path, ReuseSettings())]
    for path in paths:
        with open(path, "a") as file:
            file.write("transfer_source_prefill_token_us = 1000.0\n")
    sweep = [(path, reuse_settings_from(path, ReuseSettings())) for path in paths]
    with database.opened(sqlite_url) as engine:
        with engine.connect() as connection:
            before = replay(connection, sweep, horizon_s=0.5)
        assert [tally.changed for tally in before.settings] == [0, 2, 1]
        settings = store_settings(nats_server.url, sqlite_url, history_retention_s=1.0).store
        pruned = prune_once(engine, settings, events_stream="KV_EVENTS", decisions_stream="KV_DECISIONS",
                            now=time.time() + 3600)
        assert pruned.horizon >= 6 and pruned.rows["decisions"] == 3
        with engine.connect() as connection, pytest.raises(ReplayRefused, match="were pruned"):
            replay(connection, sweep, horizon_s=0.5)
    settings_args = [arg for path, _ in sweep for arg in ("--settings", path)]
    common = ["replay", "--db", sqlite_url, "--nats", nats_server.url, *settings_args, "--decisions"]
    capsys.readouterr()
    assert kvledger([*common, "--source", "sql"]) == 2
    assert "pruned (store.history_retention_s)" in capsys.readouterr().err
    # The command runs its own event loop: off this test's.
    assert await asyncio.to_thread(kvledger, [*common, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["source"] == "stream" and "were pruned" in printed["sql_refused"]
    assert printed["rows"] == [before.recorded.row(), *(tally.row() for tally in before.settings)]
    assert printed["changes"] == {tally.name: tally.changes for tally in before.settings}
    assert await asyncio.to_thread(kvledger, common) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("replayed 3 recorded requests from KV_DECISIONS over KV_EVENTS folded (SQL no longer")

    # Once a stream's own retention drops what the window needs, neither source holds it: refused, both say why.
    async with await nats.connect(nats_server.url) as nc:
        await nc.jetstream().delete_msg("KV_EVENTS", 1)
    with pytest.raises(ReplayRefused, match="KV_EVENTS holds seqs from 2 on"):
        await _from_streams(nats_server.url, sweep, horizon_s=0.5)
    assert await asyncio.to_thread(kvledger, common) == 2
    assert "SQL: decisions at or before" in capsys.readouterr().err
    async with await nats.connect(nats_server.url) as nc:
        await nc.jetstream().delete_msg("KV_DECISIONS", 1)
    with pytest.raises(ReplayRefused, match="KV_DECISIONS holds records from seq 2 on"):
        await _from_streams(nats_server.url, sweep, horizon_s=0.5)


def test_the_horizon_on_the_stream_is_the_seq_before_the_first_event_that_late() -> None:
    from kvledger.core.events import EventBatch, Provenance
    from kvledger.store.whatif_reference import _horizon_seqs

    def batch(ingest_ts: float) -> EventBatch:
        return EventBatch(WorkerId("w", 0), 1, 0, 0.0, ingest_ts, Provenance.NATIVE, ())

    # Ingest times need not rise with the seq (seq 4 was ingested before seq 3): as SQL's MIN(stream_seq) finds it.
    batches = [(1, batch(1.0)), (2, batch(2.0)), (3, batch(5.0)), (4, batch(4.0)), (6, batch(7.0))]
    assert _horizon_seqs(batches, [0.5, 2.0, 3.0, 4.5, 6.0, 8.0]) == [0, 1, 2, 2, 5, None]
