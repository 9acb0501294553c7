"""What the `kvledger store`, `kvledger db …` and `kvledger audit …` commands do.

kvledger/app/cli.py parses arguments and calls these; they print and return an exit code.
"""

from __future__ import annotations

import datetime
import functools
import json
import sys
from collections.abc import Sequence

import sqlalchemy as sa

from kvledger.core.events import Tier, WorkerId
from kvledger.core.settings import Settings
from kvledger.store import database
from kvledger.store.audit import Audit
from kvledger.store.pruning import HistoryPruned
from kvledger.store.tables import parse_hash
from kvledger.store.verdicts import newest_ingest_ts, settled_pending


def run_store(settings: Settings) -> int:
    from kvledger.runtime.entry import run_stage
    from kvledger.store.service import serve

    return run_stage("store", lambda: serve(settings), refusals=(database.SchemaError,))


def db_upgrade(settings: Settings, revision: str) -> int:
    with database.opened(settings.db.url) as engine:
        before = database.current_revision(engine)
        database.upgrade(engine, revision)
        after = database.current_revision(engine)
    print(f"database schema: {before or 'empty'} -> {after}")
    return 0


def db_downgrade(settings: Settings, revision: str) -> int:
    with database.opened(settings.db.url) as engine:
        before = database.current_revision(engine)
        database.downgrade(engine, revision)
        after = database.current_revision(engine)
    print(f"database schema: {before or 'empty'} -> {after or 'empty'}")
    return 0


def db_current(settings: Settings) -> int:
    with database.opened(settings.db.url) as engine:
        current = database.current_revision(engine)
    print(f"current: {current or 'empty'}  head: {database.head_revision()}")
    return 0


# --- audit ------------------------------------------------------------------------------


def _display(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6f}".rstrip("0").rstrip(".")
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def print_table(rows: Sequence[dict], columns: Sequence[str] | None = None, out=None) -> None:
    out = out or sys.stdout
    if not rows:
        print("(no rows)", file=out)
        return
    columns = list(columns or rows[0].keys())
    cells = [[_display(row.get(column)) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    print("  ".join(column.ljust(width) for column, width in zip(columns, widths)).rstrip(), file=out)
    for line in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip(), file=out)


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _emit(rows, as_json: bool, columns: Sequence[str] | None = None) -> None:
    if as_json:
        # Hashes stay integers: JSON has no limit, and decimal strings would invite mistakes.
        print(json.dumps(rows, indent=2, default=_json_default))
    else:
        print_table(rows, columns)


def _parse_time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    moment = datetime.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def _refusing_old_schemas(function):
    """Audit commands print a schema problem as one line (with the command to fix it), exit 2."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs) -> int:
        try:
            return function(*args, **kwargs)
        except database.SchemaError as error:
            print(f"kvledger audit: {error}", file=sys.stderr)
            return 2

    return wrapper


def _audit(settings: Settings) -> tuple[sa.Engine, Audit, sa.Connection]:
    engine = database.create_engine(settings.db.url)
    database.require_current(engine, settings.db.url)
    connection = engine.connect()
    if connection.dialect.name == "sqlite":
        # SQLite's own page cache size, not the projector's 256 MB: an audit reads each page about once, and
        # filling a large cache cost `audit quality` at 1 M decisions a fifth of its time (5.5 s against 4.5 s).
        connection.exec_driver_sql(f"PRAGMA cache_size={database.SQLITE_READ_CACHE}")
    return engine, Audit(connection), connection


@_refusing_old_schemas
def audit_inventory(settings: Settings, worker: str, tier: str | None, at_seq: int | None, at_time: str | None, as_json: bool) -> int:
    engine, audit, connection = _audit(settings)
    try:
        if at_time is not None:
            seq = audit.seq_at_time(_parse_time(at_time))
        elif at_seq is not None:
            seq = at_seq
        else:
            seq = audit.checkpoint()
        tiers = [Tier(tier)] if tier else list(Tier)
        try:
            rows = audit.inventory(WorkerId.parse(worker), tiers, seq)
        except HistoryPruned as pruned:
            print(f"kvledger audit inventory: {pruned}", file=sys.stderr)
            return 1
        if as_json:
            _emit({"worker": worker, "stream_seq": seq, "blocks": rows}, True)
        else:
            print(f"inventory of {worker} as of stream seq {seq}: {len(rows)} block(s)")
            print_table(rows, [
                "tier", "group_idx", "kv_cache_spec_kind", "ownership", "provenance", "engine_hash", "sequence_hash",
                "parent_hash", "stored_seq", "conflict",
            ])
    finally:
        connection.close()
        engine.dispose()
    return 0


@_refusing_old_schemas
def audit_block(settings: Settings, block_hash: str, as_json: bool) -> int:
    try:
        value = parse_hash(block_hash)
    except ValueError as error:
        print(f"kvledger audit block: {error}", file=sys.stderr)
        return 2
    engine, audit, connection = _audit(settings)
    try:
        rows = audit.block_history(value)
        horizon = audit.history_pruned_through()
        if as_json:
            _emit({"hash": value, "history": rows, "history_pruned_through_seq": horizon}, True)
        else:
            print(f"block {value} (0x{value:016x}): {len(rows)} stay(s)")
            if horizon:
                print(f"(history at or before KV_EVENTS seq {horizon} was pruned: stays that ended then are not shown)")
            print_table(rows, [
                "publisher", "dp_rank", "tier", "group_idx", "kv_cache_spec_kind", "ownership", "provenance",
                "engine_hash", "sequence_hash", "parent_hash", "stored_seq", "removed_seq", "state",
            ])  # fmt: skip
    finally:
        connection.close()
        engine.dispose()
    return 0 if rows else 1


@_refusing_old_schemas
def audit_decision(settings: Settings, request_id: str, as_json: bool) -> int:
    engine, audit, connection = _audit(settings)
    try:
        found = audit.decision(request_id)
        if as_json:
            _emit(found, True)
        elif not found:
            horizon = audit.decisions_pruned_through()
            print(f"no decision {request_id!r}" + (
                f" (decisions at or before KV_DECISIONS seq {horizon} were pruned)" if horizon else ""))
        for row in [] if as_json else found:
            print(f"decision {row['request_id']} (KV_DECISIONS seq {row['stream_seq']})")
            for key in ("inventory_seq", "target", "credited_blocks", "baseline_blocks", "reason", "backend",
                        "settings_digest", "uncertain_workers", "unreachable_workers"):  # fmt: skip
                print(f"  {key}: {_display(row[key])}")
            chosen = row["chosen_source"]
            print(f"  chosen: {chosen}/{row['chosen_dp_rank']} {row['chosen_tier']}" if chosen else "  chosen: none")
            print("candidates:")
            print_table(row["candidates"])
            print(f"target inventory as of seq {row['inventory_seq']}:")
            if "history_pruned" in row:
                print(f"  {row['history_pruned']}")
            else:
                print_table(row["target_inventory"])
    finally:
        connection.close()
        engine.dispose()
    return 0 if found else 1


@_refusing_old_schemas
def audit_gaps(settings: Settings, worker: str | None, as_json: bool) -> int:
    engine, audit, connection = _audit(settings)
    try:
        who = WorkerId.parse(worker) if worker else None
        gaps, periods = audit.gaps(who), audit.uncertain_periods(who)
        unreachable = audit.unreachable_periods(who)
        if as_json:
            _emit({"gaps": gaps, "uncertain_periods": periods, "unreachable_periods": unreachable}, True)
        else:
            print("gaps:")
            print_table(gaps)
            print("uncertain periods:")
            print_table(periods)
            print("unreachable periods:")
            print_table(unreachable)
    finally:
        connection.close()
        engine.dispose()
    return 0


@_refusing_old_schemas
def audit_stream_losses(settings: Settings, batches: bool, as_json: bool) -> int:
    """Losses found in the streams; with `batches`, the batches that exist only in SQL."""
    engine, audit, connection = _audit(settings)
    try:
        losses = audit.stream_losses()
        only_in_sql = audit.only_in_sql() if batches else None
        if as_json:
            _emit({"losses": losses, **({"only_in_sql": only_in_sql} if batches else {})}, True)
        else:
            print("stream losses:" if losses else "stream losses: none found")
            if losses:
                print_table(losses)
            if batches:
                print("batches that exist only in SQL (their stream message lost, never delivered again):")
                print_table(only_in_sql)
    finally:
        connection.close()
        engine.dispose()
    return 0


@_refusing_old_schemas
def audit_dead_letters(settings: Settings, limit: int, as_json: bool) -> int:
    engine, audit, connection = _audit(settings)
    try:
        _emit(audit.dead_letters(limit), as_json)
    finally:
        connection.close()
        engine.dispose()
    return 0


@_refusing_old_schemas
def audit_workers(settings: Settings, as_json: bool) -> int:
    engine, audit, connection = _audit(settings)
    try:
        _emit(audit.workers(), as_json)
    finally:
        connection.close()
        engine.dispose()
    return 0


_QUALITY_COLUMNS = ("dimension", "key", "hints", "stale_hints", "stale_hint_rate", "credited", "lost_credit",
                    "lost_credit_rate", "median_first_eviction_ms")
_DECISION_QUALITY_COLUMNS = ("stream_seq", "request_id", "reason", "target", "chosen_source", "chosen_dp_rank",
                             "chosen_tier", "inventory_seq", "horizon_seq", "stale", "source_blocks", "source_gone",
                             "source_gone_after_ms", "first_eviction_ms", "lost_credit", "target_blocks",
                             "target_gone", "target_gone_after_ms")


@_refusing_old_schemas
def audit_quality(settings: Settings, horizon_ms: float, by: Sequence[str] | None, per_decision: bool,
                  as_json: bool, judged: str = "live", ceiling: bool = False) -> int:
    if not horizon_ms >= 0:
        print(f"kvledger audit quality: --horizon-ms must be 0 or more, got {horizon_ms}", file=sys.stderr)
        return 2
    engine, audit, connection = _audit(settings)
    try:
        if ceiling:
            return _ceiling(connection, settings, as_json)
        if not as_json:
            source = audit.verdict_source(horizon_ms / 1000)
            print(_VERDICT_SOURCES[source].format(horizon=f"{horizon_ms:g}"), file=sys.stderr)
        if judged == "shadow":  # the would-be hints of decide.shadow
            rows = (audit.shadow_quality(horizon_ms / 1000) if per_decision else
                    [row for row in audit.shadow_quality_summary(horizon_ms / 1000) if not by or row["dimension"] in by])
            _emit(rows, as_json)
            return 0
        if judged == "inflight":
            _emit(audit.inflight_quality_summary(horizon_ms / 1000), as_json)
            return 0
        if per_decision:
            _emit(audit.decision_quality(horizon_ms / 1000), as_json, _DECISION_QUALITY_COLUMNS)
            return 0
        rows = [row for row in audit.decision_quality_summary(horizon_ms / 1000) if not by or row["dimension"] in by]
        if not as_json:
            for row in rows:
                if row["dimension"] == "hour":  # the hour's start, as people read it
                    row["key"] = datetime.datetime.fromtimestamp(int(row["key"]), datetime.timezone.utc).strftime(
                        "%Y-%m-%dT%H:00Z")
        _emit(rows, as_json, _QUALITY_COLUMNS)
        pending = audit.decisions_not_judged(horizon_ms / 1000)
        if pending and not as_json:
            print(f"({pending} decisions not judged yet: no event ingested {horizon_ms:g} ms after them)")
        return 0
    finally:
        connection.close()
        engine.dispose()


_VERDICT_SOURCES = {
    "store": "verdicts at {horizon} ms as store judged them (decision_verdicts)",
    "store+sql": "verdicts at {horizon} ms as store judged them, and in SQL those an event settled since",
    "sql": "judged in SQL at {horizon} ms (store does not judge this horizon: store.quality_horizons_ms)",
}
_CEILING_COLUMNS = ("policy", "requests", "request_blocks", "hit_blocks", "prefix_hit_rate", "ttft_saving_ms",
                    "workers", "capacity_blocks", "unreplayable", "truncated")


def _ceiling(connection: sa.Connection, settings: Settings, as_json: bool) -> int:
    """kvledger's achieved prefix hits beside round-robin's and an oracle's on the same requests (store/ceiling.py)."""
    from kvledger.store.ceiling import ceiling
    from kvledger.store.whatif_reference import ReplayRefused

    try:
        report = ceiling(connection, settings.reuse)
    except ReplayRefused as refused:
        print(f"kvledger audit quality --ceiling: {refused}", file=sys.stderr)
        return 1
    _emit(report.rows(), as_json, _CEILING_COLUMNS)
    return 0


def ceiling_figures(url: str, reuse) -> dict[str, object] | None:
    """The oracle's, round-robin's and kvledger's prefix hits on the ledger's recorded requests (None: none)."""
    from kvledger.store.ceiling import ceiling
    from kvledger.store.whatif_reference import ReplayRefused

    with database.opened(url) as engine, engine.connect() as connection:
        try:
            report = ceiling(connection, reuse)
        except ReplayRefused:
            return None
    return {row["policy"]: row for row in report.rows()}


def quality_totals(url: str, horizon_s: float) -> dict[str, int]:
    """Hints, stale hints, credited and lost-credit decisions over the whole ledger at one horizon."""
    engine = database.create_engine(url)
    try:
        with engine.connect() as connection:
            rows = Audit(connection).decision_quality_summary(horizon_s)
    finally:
        engine.dispose()
    by_reason = [row for row in rows if row["dimension"] == "reason"]  # every judged decision once
    return {name: sum(row[name] or 0 for row in by_reason) for name in ("hints", "stale_hints", "credited", "lost_credit")}


def shadow_totals(url: str, horizon_s: float) -> dict[str, float]:
    """Shadow decisions' would-be hints over the whole ledger at one horizon (every shadow setting together)."""
    with database.opened(url) as engine, engine.connect() as connection:
        rows = [row for row in Audit(connection).shadow_quality_summary(horizon_s) if row["dimension"] == "tier"]
    return {name: sum(row[name] or 0 for row in rows)
            for name in ("hints", "stale_hints", "estimated_ttft_saved_ms", "fresh_ttft_saved_ms", "blocks_moved")}


def inflight_totals(url: str, horizon_s: float) -> dict[str, int]:
    """In-flight credit over the whole ledger at one horizon: how often, how often confirmed, lost credit with it."""
    with database.opened(url) as engine, engine.connect() as connection:
        rows = Audit(connection).inflight_quality_summary(horizon_s)
    return {name: sum(row[name] or 0 for row in rows)
            for name in ("inflight_decisions", "confirmed", "credited", "lost_credit", "credited_with_inflight",
                         "lost_with_inflight")}


def ledger_counts(url: str) -> dict[str, int]:
    """Headline counts for the demo summary: batches and events logged, blocks held, decisions."""
    queries = {
        "batches": "SELECT COUNT(DISTINCT stream_seq) FROM event_log",
        "events": "SELECT COUNT(*) FROM event_log",
        "blocks_held": "SELECT COUNT(*) FROM block_residency WHERE removed_seq IS NULL",
        "decisions": "SELECT COUNT(*) FROM decisions",
    }
    with database.opened(url) as engine, engine.connect() as connection:
        return {name: connection.exec_driver_sql(sql).scalar() or 0 for name, sql in queries.items()}


def store_progress(url: str) -> tuple[dict[str, int], int]:
    """The last stream seq the store committed, per stream; and the verdicts an event in SQL has settled that
    store has not written yet (its sweeper judges them shortly; until then an audit judges them itself, in
    SQL, each time it is asked). One connection for both: a caller polls this."""
    with database.opened(url) as engine, engine.connect() as connection:
        checkpoints = dict(connection.exec_driver_sql(
            "SELECT stream, MAX(stream_seq) FROM checkpoints GROUP BY stream").all())
        due = connection.execute(sa.select(sa.func.count()).select_from(
            settled_pending(newest_ingest_ts()).subquery())).scalar_one()
        return checkpoints, due
