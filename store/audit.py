"""Audit queries over the store's tables: plain SQL that runs unchanged in sqlite3 and psql.

Each query here is printed verbatim in docs/audit.md (a test checks), so what the CLI
answers and what an auditor types are the same statement. Parameters are `:name`
placeholders: SQLAlchemy binds them here, `.parameter set` does in sqlite3, and `\\set`
does in psql. Hashes in the tables are signed 64-bit; results here are converted to u64.
"""

from __future__ import annotations

import decimal
import json
from collections.abc import Mapping, Sequence

import attrs
import sqlalchemy as sa

from kvledger.core.events import Tier, WorkerId
from kvledger.store import tables
from kvledger.store.pruning import DECISIONS_PRUNED, HistoryPruned, pruned_through, refuse_pruned
from kvledger.store.sharding import sharded_events_checkpoint
from kvledger.store.tables import to_signed, to_unsigned
from kvledger.store.verdicts import horizon_ms_of, judge_into, newest_ingest_ts, settled_pending


@attrs.frozen
class Query:
    name: str
    title: str
    sql: str
    params: tuple[str, ...]
    # columns holding signed hashes, shown unsigned
    hash_columns: tuple[str, ...] = ()


_RESIDENCY_HASHES = ("engine_hash", "sequence_hash", "parent_hash")

SEQ_AT_TIME = Query(
    "seq_at_time",
    "The stream seq in effect at a time: the last event ingested at or before it",
    """SELECT COALESCE(MAX(stream_seq), 0) AS stream_seq
FROM event_log
WHERE ingest_ts = (SELECT MAX(ingest_ts) FROM event_log WHERE ingest_ts <= :ts);""",
    ("ts",),
)

# The as-of statements read the tables rather than the view: one worker's placements in id
# order (ix_placements_worker), each placement's stays as one range of (placement_id, stored_seq) in log
# order, and a stay left out when a run of ends covers it by :seq. Ordered by numbers only:
# PostgreSQL compares text under the database's collation, which made sorting an answer of
# 20 000 rows by provenance and ownership cost more than finding them. The worker and
# tier are the parameters, so the rows do not repeat them (`Audit.inventory` adds them).
INVENTORY_AT_SEQ = Query(
    "inventory_at_seq",
    "Inventory of one worker's tier as of a stream seq, per KV-cache group and ownership",
    """SELECT p.provenance, p.group_idx, p.kv_cache_spec_kind, p.ownership, s.engine_hash, s.sequence_hash,
       s.parent_hash, s.stored_seq, s.stored_ts,
       CASE WHEN s.conflict_since <= :seq THEN 1 ELSE 0 END AS conflict,
       CASE WHEN s.unresolved THEN 1 ELSE 0 END AS unresolved
FROM placements p
JOIN block_stays s ON s.placement_id = p.placement_id AND s.stored_seq <= :seq
WHERE p.publisher = :publisher AND p.dp_rank = :dp_rank AND p.tier = :tier
  AND NOT EXISTS (SELECT 1 FROM block_removals r
                  WHERE r.placement_id = s.placement_id AND r.stored_seq = s.stored_seq
                    AND r.first_slot <= s.slot AND r.last_slot >= s.slot AND r.removed_seq <= :seq)
ORDER BY p.placement_id, s.stored_seq, s.slot;""",
    ("publisher", "dp_rank", "tier", "seq"),
    _RESIDENCY_HASHES,
)

INVENTORY_SUMMARY_AT_SEQ = Query(
    "inventory_summary_at_seq",
    "How many blocks one worker held per tier, group, ownership and provenance as of a stream seq",
    """SELECT p.tier, p.group_idx, MAX(p.kv_cache_spec_kind) AS kv_cache_spec_kind, p.ownership, p.provenance,
       COUNT(*) AS blocks,
       SUM(CASE WHEN s.conflict_since <= :seq THEN 1 ELSE 0 END) AS conflicting
FROM placements p
JOIN block_stays s ON s.placement_id = p.placement_id AND s.stored_seq <= :seq
WHERE p.publisher = :publisher AND p.dp_rank = :dp_rank
  AND p.tier IN ('device', 'host', 'disk', 'external')
  AND NOT EXISTS (SELECT 1 FROM block_removals r
                  WHERE r.placement_id = s.placement_id AND r.stored_seq = s.stored_seq
                    AND r.first_slot <= s.slot AND r.last_slot >= s.slot AND r.removed_seq <= :seq)
GROUP BY p.tier, p.group_idx, p.ownership, p.provenance
ORDER BY p.tier, p.group_idx, p.ownership, p.provenance;""",
    ("publisher", "dp_rank", "seq"),
)

BLOCK_HISTORY = Query(
    "block_history",
    "Every stay of one block (by its engine hash, signed) on every worker and tier",
    """SELECT publisher, dp_rank, tier, group_idx, kv_cache_spec_kind, ownership, provenance,
       engine_hash, sequence_hash, parent_hash, stored_seq, stored_ts, conflict_since,
       removed_seq, removed_ts, COALESCE(removal_cause, 'stored') AS state
FROM block_residency
WHERE engine_hash = :hash
ORDER BY stored_seq, slot;""",
    ("hash",),
    _RESIDENCY_HASHES,
)

DECISION = Query(
    "decision",
    "A decision and what it saw: inventory seq, target, baseline, candidates",
    """SELECT stream_seq, request_id, inventory_seq, target, credited_blocks, baseline_blocks,
       chosen_source, chosen_dp_rank, chosen_tier, chosen_transfer_blocks, chosen_saving_ms,
       reason, backend, settings_digest, uncertain_workers, candidates, worker_overlaps, decided_ts
FROM decisions
WHERE request_id = :request_id
ORDER BY stream_seq;""",
    ("request_id",),
)

# A decision saw the inventory as of its inventory_seq: the workers unreachable then were not credited.
DECISION_UNREACHABLE_WORKERS = Query(
    "decision_unreachable_workers",
    "The workers a decision did not credit because their engine was unreachable at its inventory seq",
    """SELECT d.stream_seq, d.request_id, d.inventory_seq, u.publisher, u.dp_rank, u.since_seq, u.since_ts, u.reason
FROM decisions d
JOIN unreachable_periods u
  ON u.provenance = 'native' AND u.since_seq <= d.inventory_seq AND (u.until_seq IS NULL OR u.until_seq > d.inventory_seq)
WHERE d.request_id = :request_id
ORDER BY d.stream_seq, u.publisher, u.dp_rank;""",
    ("request_id",),
)

GAPS = Query(
    "gaps",
    "Sequence gaps ingest recorded, per worker",
    """SELECT publisher, dp_rank, stream_seq, provenance, epoch, engine_seq,
       gap_reason, gap_expected_seq, gap_received_seq, ingest_ts
FROM event_log
WHERE kind = 'gap'
ORDER BY publisher, dp_rank, stream_seq;""",
    (),
)

UNCERTAIN_PERIODS = Query(
    "uncertain_periods",
    "Periods during which a worker's inventory was uncertain (after a gap or a sequence hole, until a clear or restart)",
    """SELECT publisher, dp_rank, provenance, since_seq, since_ts, reason,
       until_seq, until_ts, COALESCE(resolved_by, 'still uncertain') AS resolved_by
FROM uncertain_periods
ORDER BY publisher, dp_rank, since_seq;""",
    (),
)

UNREACHABLE_PERIODS = Query(
    "unreachable_periods",
    "Periods during which ingest could not reach a worker's engine (from its liveness record until it answered again)",
    """SELECT publisher, dp_rank, provenance, since_seq, since_ts, reason,
       until_seq, until_ts, CASE WHEN until_seq IS NULL THEN 'still unreachable' ELSE 'reachable again' END AS state
FROM unreachable_periods
ORDER BY publisher, dp_rank, since_seq;""",
    (),
)

WORKERS = Query(
    "workers",
    "Every worker: epoch, last engine seq, uncertainty, reachability, stream seqs seen",
    """SELECT w.publisher, w.dp_rank, w.epoch, w.engine_seq, w.uncertain_since,
       CASE WHEN w.unreachable_since IS NULL THEN 'reachable' ELSE 'unreachable' END AS reachability,
       w.unreachable_since, u.since_ts AS unreachable_since_ts, u.reason AS unreachable_reason,
       w.retained_epoch, w.retained_engine_seq, w.retained_uncertain_since, w.retained_unreachable_since,
       w.first_stream_seq, w.last_stream_seq, w.last_ingest_ts
FROM workers w
LEFT JOIN unreachable_periods u
  ON u.publisher = w.publisher AND u.dp_rank = w.dp_rank AND u.provenance = 'native' AND u.since_seq = w.unreachable_since
ORDER BY w.publisher, w.dp_rank;""",
    (),
)

DEAD_LETTERS = Query(
    "dead_letters",
    "Records that could not be used, newest first, with why",
    """SELECT source, stream_seq, subject, publisher, dp_rank, endpoint, reason,
       frames, LENGTH(raw) AS raw_bytes, ingest_ts, recorded_ts
FROM dead_letters
ORDER BY recorded_ts DESC, source, stream_seq
LIMIT :limit;""",
    ("limit",),
)

CHECKPOINTS = Query(
    "checkpoints",
    "How far each projector has committed",
    """SELECT name, stream, stream_seq, updated_ts
FROM checkpoints
ORDER BY name;""",
    (),
)

# The quality audit reads each decision's verdict at a horizon: whether the relied-on blocks
# were still held at the horizon seq, the seq just before the first event ingested at or
# after decided_ts + horizon (store/verdicts.py's JUDGE_SQL says how it is derived from the
# stays). store writes the verdicts of its configured horizons (decision_verdicts) as events
# settle them; for any other horizon the audit judges every decision in SQL first, into a
# temporary table of the same name. A decision without a verdict is pending: no event has
# been ingested that late yet.
_JUDGED = """WITH judged_quality AS (
  SELECT d.stream_seq, d.request_id, d.decided_ts, d.reason, d.target, d.chosen_source, d.chosen_dp_rank,
         d.chosen_tier, d.inventory_seq, v.horizon_seq, v.stale, COALESCE(v.source_blocks, 0) AS source_blocks,
         COALESCE(v.source_gone, 0) AS source_gone, v.source_gone_after_ms, v.first_eviction_ms, v.lost_credit,
         COALESCE(v.target_blocks, 0) AS target_blocks, COALESCE(v.target_gone, 0) AS target_gone,
         v.target_gone_after_ms
  FROM decisions d
  LEFT JOIN decision_verdicts v ON v.stream_seq = d.stream_seq AND v.horizon_ms = :horizon_ms
)"""

DECISION_QUALITY = Query(
    "decision_quality",
    "Whether each decision was still true at its horizon: the chosen source's transferred blocks, the target's credited ones",
    _JUDGED + """
SELECT stream_seq, request_id, decided_ts, reason, target, chosen_source, chosen_dp_rank, chosen_tier,
       inventory_seq, horizon_seq, stale, source_blocks, source_gone, source_gone_after_ms, first_eviction_ms,
       lost_credit, target_blocks, target_gone, target_gone_after_ms
FROM judged_quality
ORDER BY stream_seq;""",
    ("horizon_ms",),
)

DECISION_QUALITY_SUMMARY = Query(
    "decision_quality_summary",
    "Stale-hint and lost-credit rates at a horizon, per worker, tier, reason and hour, with the median time to a chosen block's first eviction",
    """WITH
-- each judged decision once with its keys, read from the two tables (only the columns used); the counts are
-- summed per combination of keys first, so each dimension then adds up a few rows per key instead of every
-- decision; the hour stays a number until then
keys AS (
  SELECT CASE WHEN v.stale IS NULL THEN NULL WHEN d.chosen_dp_rank = 0 THEN d.chosen_source
              ELSE d.chosen_source || '/' || CAST(d.chosen_dp_rank AS VARCHAR(12)) END AS source,
         d.target, COALESCE(d.chosen_tier, 'none') AS tier, d.reason,
         (CAST(d.decided_ts / 3600 AS BIGINT)
          - CASE WHEN CAST(d.decided_ts / 3600 AS BIGINT) > d.decided_ts / 3600 THEN 1 ELSE 0 END) * 3600 AS hour,
         v.stale, v.lost_credit, v.first_eviction_ms
  FROM decision_verdicts v
  JOIN decisions d ON d.stream_seq = v.stream_seq
  WHERE v.horizon_ms = :horizon_ms AND (v.stale IS NOT NULL OR v.lost_credit IS NOT NULL)
),
combined AS (
  SELECT source, target, tier, reason, hour, COUNT(stale) AS hints, COALESCE(SUM(stale), 0) AS stale_hints,
         COUNT(lost_credit) AS credited, COALESCE(SUM(lost_credit), 0) AS lost, COUNT(first_eviction_ms) AS evictions
  FROM keys
  GROUP BY source, target, tier, reason, hour
),
per_key AS (
  SELECT 'worker' AS dimension, source AS key, hints, stale_hints, 0 AS credited, 0 AS lost, evictions
  FROM combined WHERE hints > 0
  UNION ALL
  SELECT 'worker', target, 0, 0, credited, lost, 0 FROM combined WHERE credited > 0
  UNION ALL
  SELECT 'tier', tier, hints, stale_hints, credited, lost, evictions FROM combined
  UNION ALL
  SELECT 'reason', reason, hints, stale_hints, credited, lost, evictions FROM combined
  UNION ALL
  SELECT 'hour', CAST(hour AS VARCHAR(20)), hints, stale_hints, credited, lost, evictions FROM combined
),
totals AS (
  SELECT dimension, key, SUM(hints) AS hints, SUM(stale_hints) AS stale_hints, SUM(credited) AS credited,
         SUM(lost) AS lost_credit, CAST(SUM(evictions) AS BIGINT) AS evictions
  FROM per_key
  GROUP BY dimension, key
),
-- the median first eviction of each group: only the hints that saw one are ranked
evicted AS (
  SELECT 'worker' AS dimension, source AS key, first_eviction_ms FROM keys WHERE first_eviction_ms IS NOT NULL
  UNION ALL
  SELECT 'tier', tier, first_eviction_ms FROM keys WHERE first_eviction_ms IS NOT NULL
  UNION ALL
  SELECT 'reason', reason, first_eviction_ms FROM keys WHERE first_eviction_ms IS NOT NULL
  UNION ALL
  SELECT 'hour', CAST(hour AS VARCHAR(20)), first_eviction_ms FROM keys WHERE first_eviction_ms IS NOT NULL
),
ranked AS (
  SELECT dimension, key, first_eviction_ms,
         ROW_NUMBER() OVER (PARTITION BY dimension, key ORDER BY first_eviction_ms) AS n
  FROM evicted
),
medians AS (
  SELECT r.dimension, r.key, AVG(r.first_eviction_ms) AS median_first_eviction_ms
  FROM ranked r
  JOIN totals t ON t.dimension = r.dimension AND t.key = r.key
  WHERE r.n IN ((t.evictions + 1) / 2, (t.evictions + 2) / 2)
  GROUP BY r.dimension, r.key
)
SELECT t.dimension, t.key, t.hints, t.stale_hints,
       CAST(t.stale_hints AS DOUBLE PRECISION) / NULLIF(t.hints, 0) AS stale_hint_rate,
       t.credited, t.lost_credit,
       CAST(t.lost_credit AS DOUBLE PRECISION) / NULLIF(t.credited, 0) AS lost_credit_rate,
       t.evictions, m.median_first_eviction_ms
FROM totals t
LEFT JOIN medians m ON m.dimension = t.dimension AND m.key = t.key
ORDER BY t.dimension, t.key;""",
    ("horizon_ms",),
)

# Shadow decisions (decide.shadow) are judged as live hints are: the shadow's chosen source
# must still hold the blocks it would have transferred, on its tier, at the horizon seq.
_SHADOW_JUDGED = """WITH judged_shadow AS (
  SELECT d.stream_seq, d.request_id, d.decided_ts, d.inventory_seq, v.horizon_seq, d.shadow_settings_digest,
         d.shadow_reason, d.target, d.shadow_source, d.shadow_dp_rank, d.shadow_tier, d.shadow_transfer_blocks,
         d.shadow_saving_ms, COALESCE(v.shadow_source_blocks, 0) AS source_blocks,
         COALESCE(v.shadow_source_gone, 0) AS source_gone, v.shadow_source_gone_after_ms AS source_gone_after_ms,
         v.shadow_first_eviction_ms AS first_eviction_ms, v.shadow_stale AS stale
  FROM decisions d
  LEFT JOIN decision_verdicts v ON v.stream_seq = d.stream_seq AND v.horizon_ms = :horizon_ms
  WHERE d.shadow_source IS NOT NULL
)"""

SHADOW_QUALITY = Query(
    "shadow_quality",
    "Whether each shadow decision's would-be hint was still true at its horizon: the shadow source's transferred blocks",
    _SHADOW_JUDGED + """
SELECT stream_seq, request_id, decided_ts, shadow_settings_digest, target, shadow_source, shadow_dp_rank,
       shadow_tier, shadow_transfer_blocks, shadow_saving_ms, inventory_seq, horizon_seq, stale, source_blocks,
       source_gone, source_gone_after_ms, first_eviction_ms
FROM judged_shadow
ORDER BY stream_seq;""",
    ("horizon_ms",),
)

SHADOW_QUALITY_SUMMARY = Query(
    "shadow_quality_summary",
    "Would-be hints of shadow decisions at a horizon, per shadow settings, worker and tier: stale-hint rate, estimated TTFT saved, blocks moved",
    _SHADOW_JUDGED + """,
keyed AS (
  SELECT 'settings' AS dimension, shadow_settings_digest AS key, stale, shadow_saving_ms, shadow_transfer_blocks
  FROM judged_shadow WHERE stale IS NOT NULL
  UNION ALL
  SELECT 'worker',
         CASE WHEN shadow_dp_rank = 0 THEN shadow_source
              ELSE shadow_source || '/' || CAST(shadow_dp_rank AS VARCHAR(12)) END,
         stale, shadow_saving_ms, shadow_transfer_blocks
  FROM judged_shadow WHERE stale IS NOT NULL
  UNION ALL
  SELECT 'tier', shadow_tier, stale, shadow_saving_ms, shadow_transfer_blocks
  FROM judged_shadow WHERE stale IS NOT NULL
)
SELECT dimension, key, COUNT(*) AS hints, SUM(stale) AS stale_hints,
       CAST(SUM(stale) AS DOUBLE PRECISION) / NULLIF(COUNT(*), 0) AS stale_hint_rate,
       SUM(shadow_saving_ms) AS estimated_ttft_saved_ms,
       SUM(CASE WHEN stale = 0 THEN shadow_saving_ms ELSE 0 END) AS fresh_ttft_saved_ms,
       SUM(shadow_transfer_blocks) AS blocks_moved
FROM keyed
GROUP BY dimension, key
ORDER BY dimension, key;""",
    ("horizon_ms",),
)

# In-flight credit (decide.inflight_ttl_ms) is confirmed when the target held every in-flight
# block at the horizon; lost credit counted with it covers the credited and in-flight blocks.
INFLIGHT_QUALITY_SUMMARY = Query(
    "inflight_quality_summary",
    "In-flight credit at a horizon, per target: decisions that had it, how many the engine confirmed, lost credit with and without it",
    """WITH per_decision AS (
  SELECT d.stream_seq, d.target, v.target_blocks, v.target_gone, v.inflight_blocks, v.inflight_gone
  FROM decisions d
  JOIN decision_verdicts v ON v.stream_seq = d.stream_seq AND v.horizon_ms = :horizon_ms
  WHERE d.target_publisher IS NOT NULL AND v.target_blocks + v.inflight_blocks > 0
)
SELECT target AS worker,
       SUM(CASE WHEN inflight_blocks > 0 THEN 1 ELSE 0 END) AS inflight_decisions,
       SUM(inflight_blocks) AS inflight_blocks,
       SUM(CASE WHEN inflight_blocks > 0 AND inflight_gone = 0 THEN 1 ELSE 0 END) AS confirmed,
       CAST(SUM(CASE WHEN inflight_blocks > 0 AND inflight_gone = 0 THEN 1 ELSE 0 END) AS DOUBLE PRECISION)
         / NULLIF(SUM(CASE WHEN inflight_blocks > 0 THEN 1 ELSE 0 END), 0) AS confirmed_rate,
       SUM(CASE WHEN target_blocks > 0 THEN 1 ELSE 0 END) AS credited,
       SUM(CASE WHEN target_gone > 0 THEN 1 ELSE 0 END) AS lost_credit,
       SUM(CASE WHEN target_blocks + inflight_blocks > 0 THEN 1 ELSE 0 END) AS credited_with_inflight,
       SUM(CASE WHEN target_gone + inflight_gone > 0 THEN 1 ELSE 0 END) AS lost_with_inflight
FROM per_decision
GROUP BY target
ORDER BY target;""",
    ("horizon_ms",),
)

STREAM_LOSSES = Query(
    "stream_losses",
    "Every time a stream was found to have lost acknowledged messages, and the ledger seqs SQL holds from them",
    """SELECT g.stream, g.generation, g.detected_ts, g.checkpoint_name, g.stream_last_seq,
       g.first_stream_seq, g.ledger_offset, g.lost_first_ledger_seq, g.lost_last_ledger_seq,
       (SELECT COUNT(*) FROM event_log e
        WHERE g.stream = 'KV_EVENTS' AND e.event_idx = 0
          AND e.stream_seq BETWEEN g.lost_first_ledger_seq AND g.lost_last_ledger_seq) AS batches_in_sql
FROM stream_generations g
ORDER BY g.stream, g.generation;""",
    (),
)

ONLY_IN_SQL = Query(
    "only_in_sql",
    "Batches SQL holds whose KV_EVENTS message was lost and that the stream never delivered again",
    """SELECT e.publisher, e.dp_rank, e.provenance, e.epoch, e.engine_seq, e.stream_seq AS ledger_seq,
       e.ingest_ts, g.generation
FROM event_log e
JOIN stream_generations g
  ON g.stream = 'KV_EVENTS' AND e.stream_seq BETWEEN g.lost_first_ledger_seq AND g.lost_last_ledger_seq
WHERE e.event_idx = 0
  AND NOT EXISTS (SELECT 1 FROM recovered_batches r
                  WHERE r.publisher = e.publisher AND r.dp_rank = e.dp_rank AND r.provenance = e.provenance
                    AND r.epoch = e.epoch AND r.engine_seq = e.engine_seq)
ORDER BY e.publisher, e.dp_rank, e.provenance, e.epoch, e.engine_seq;""",
    (),
)

QUERIES: tuple[Query, ...] = (
    SEQ_AT_TIME, INVENTORY_AT_SEQ, INVENTORY_SUMMARY_AT_SEQ, BLOCK_HISTORY, DECISION, DECISION_UNREACHABLE_WORKERS, GAPS,
    UNCERTAIN_PERIODS, UNREACHABLE_PERIODS, WORKERS, DEAD_LETTERS, CHECKPOINTS, DECISION_QUALITY, DECISION_QUALITY_SUMMARY,
    SHADOW_QUALITY, SHADOW_QUALITY_SUMMARY, INFLIGHT_QUALITY_SUMMARY, STREAM_LOSSES, ONLY_IN_SQL,
)  # fmt: skip


def run(connection: sa.Connection, query: Query, **params: object) -> list[dict]:
    """Run one audit query; hash columns come back unsigned."""
    missing = set(query.params) - set(params)
    if missing:
        raise TypeError(f"{query.name} needs {sorted(missing)}")
    result = connection.execute(sa.text(query.sql.rstrip(";")), params)
    keys = tuple(result.keys())
    rows = [dict(zip(keys, row)) for row in result.all()]
    for column in query.hash_columns:
        if column in keys:
            for out in rows:
                value = out[column]
                if value is not None and value < 0:
                    out[column] = to_unsigned(value)
    return rows


class Audit:
    """The audit questions of docs/audit.md, answered from SQL."""

    def __init__(self, connection: sa.Connection) -> None:
        self.connection = connection

    def checkpoint(self, name: str = "events") -> int:
        """How far a projector committed; for "events" written by store shards, the least shard's."""
        seqs = {row["name"]: row["stream_seq"] for row in run(self.connection, CHECKPOINTS)}
        if name == "events":
            sharded = sharded_events_checkpoint(seqs)
            if sharded is not None:
                return sharded
        return seqs.get(name, 0)

    def stream_losses(self) -> list[dict]:
        return run(self.connection, STREAM_LOSSES)

    def only_in_sql(self) -> list[dict]:
        return run(self.connection, ONLY_IN_SQL)

    def seq_at_time(self, ts: float) -> int:
        return run(self.connection, SEQ_AT_TIME, ts=ts)[0]["stream_seq"] or 0

    def inventory(self, worker: WorkerId, tiers: Sequence[Tier], seq: int) -> list[dict]:
        """Raises HistoryPruned for a seq at or before the retention window's horizon."""
        refuse_pruned(self.connection, seq)
        rows = []
        for tier in tiers:
            where = {"publisher": worker.publisher, "dp_rank": worker.dp_rank, "tier": tier.value}
            rows += [
                {**where, **row} for row in run(self.connection, INVENTORY_AT_SEQ, **where, seq=seq)
            ]
        return rows

    def inventory_summary(self, worker: WorkerId, seq: int) -> list[dict]:
        refuse_pruned(self.connection, seq)
        return run(self.connection, INVENTORY_SUMMARY_AT_SEQ, publisher=worker.publisher, dp_rank=worker.dp_rank, seq=seq)

    def history_pruned_through(self) -> int:
        """KV_EVENTS seq at or before which history was removed by the retention window (0: none)."""
        return pruned_through(self.connection)

    def decisions_pruned_through(self) -> int:
        return pruned_through(self.connection, DECISIONS_PRUNED)

    def block_history(self, block_hash: int) -> list[dict]:
        """`block_hash` is u64 (parse user input with store.tables.parse_hash)."""
        return run(self.connection, BLOCK_HISTORY, hash=to_signed(block_hash))

    def decision(self, request_id: str) -> list[dict]:
        """Each recording of the decision, with its candidates and the target's inventory at its seq."""
        found = []
        unreachable = run(self.connection, DECISION_UNREACHABLE_WORKERS, request_id=request_id)
        for row in run(self.connection, DECISION, request_id=request_id):
            row = dict(row)
            for column in ("uncertain_workers", "candidates", "worker_overlaps"):
                row[column] = json.loads(row[column])
            row["unreachable_workers"] = [
                WorkerId(found["publisher"], found["dp_rank"]).name
                for found in unreachable if found["stream_seq"] == row["stream_seq"]
            ]
            try:
                row["target_inventory"] = (
                    self.inventory_summary(WorkerId.parse(row["target"]), row["inventory_seq"]) if row["target"] else []
                )
            except HistoryPruned as pruned:
                row["target_inventory"], row["history_pruned"] = [], str(pruned)
            found.append(row)
        return found

    def gaps(self, worker: WorkerId | None = None) -> list[dict]:
        return _for_worker(run(self.connection, GAPS), worker)

    def uncertain_periods(self, worker: WorkerId | None = None) -> list[dict]:
        return _for_worker(run(self.connection, UNCERTAIN_PERIODS), worker)

    def unreachable_periods(self, worker: WorkerId | None = None) -> list[dict]:
        return _for_worker(run(self.connection, UNREACHABLE_PERIODS), worker)

    def workers(self) -> list[dict]:
        return run(self.connection, WORKERS)

    def dead_letters(self, limit: int = 100) -> list[dict]:
        return run(self.connection, DEAD_LETTERS, limit=limit)

    def decision_quality(self, horizon_s: float) -> list[dict]:
        """Each decision judged at its horizon; `stale` / `lost_credit` are None while pending or when it relied on nothing."""
        return self._judged(DECISION_QUALITY, horizon_s)

    def decisions_not_judged(self, horizon_s: float) -> int:
        """Decisions no event has been ingested `horizon_s` after yet: the rates leave them out."""
        return self.connection.execute(sa.text(
            # (decided_ts > newest - horizon rather than decided_ts + horizon > newest: the index on decided_ts
            # finds them, where the sum read every decision)
            "SELECT COUNT(*) FROM decisions WHERE decided_ts > "
            "(SELECT COALESCE(MAX(ingest_ts), 0) FROM event_log) - :horizon_s"), {"horizon_s": horizon_s}).scalar_one()

    def decision_quality_summary(self, horizon_s: float) -> list[dict]:
        """The rates per (dimension, key): dimension worker, tier, reason or hour (its start, epoch seconds)."""
        return self._judged(DECISION_QUALITY_SUMMARY, horizon_s)

    def shadow_quality(self, horizon_s: float) -> list[dict]:
        """Each shadow decision with a would-be hint, judged at its horizon; `stale` None while pending."""
        return self._judged(SHADOW_QUALITY, horizon_s)

    def shadow_quality_summary(self, horizon_s: float) -> list[dict]:
        """Would-be hints per (dimension, key): dimension settings (digest), worker or tier."""
        return self._judged(SHADOW_QUALITY_SUMMARY, horizon_s)

    def inflight_quality_summary(self, horizon_s: float) -> list[dict]:
        """In-flight credit per target worker: confirmed at the horizon, lost credit with and without it."""
        return self._judged(INFLIGHT_QUALITY_SUMMARY, horizon_s)

    def verdict_source(self, horizon_s: float) -> str:
        """Where the verdicts at a horizon come from: `store` (every settled decision has its row), `store+sql`
        (store judges it, the SQL judge settles what it has not written yet) or `sql` (store does not judge it)."""
        horizon_ms = horizon_ms_of(horizon_s)
        h = tables.verdict_horizons.c
        if self.connection.execute(sa.select(h.horizon_ms).where(h.horizon_ms == horizon_ms)).first() is None:
            return "sql"
        due = self.connection.execute(self._due_pending(horizon_ms).limit(1)).first()
        return "store" if due is None else "store+sql"

    @staticmethod
    def _due_pending(horizon_ms: float) -> sa.Select:
        """The pending verdicts at `horizon_ms` an event in SQL has settled: the SQL judge's until store writes them."""
        return settled_pending(newest_ingest_ts()).where(tables.verdicts_pending.c.horizon_ms == horizon_ms)

    def _judged(self, query: Query, horizon_s: float) -> list[dict]:
        """`query` over the verdicts at `horizon_s`: store's where it judges that horizon, with what it has not
        settled yet (or every decision, at a horizon it does not judge) judged in SQL into a temporary
        decision_verdicts, which the statement then reads instead of the table."""
        horizon_ms = horizon_ms_of(horizon_s)
        source = self.verdict_source(horizon_s)
        if source == "store":
            return [_plain_numbers(row) for row in run(self.connection, query, horizon_ms=horizon_ms)]
        connection = self.connection
        if connection.dialect.name == "sqlite":
            stored, temporary = "main.decision_verdicts", "temp.decision_verdicts"
        else:
            schema = connection.exec_driver_sql("SELECT current_schema()").scalar_one()
            stored, temporary = f'"{schema}".decision_verdicts', "pg_temp.decision_verdicts"
        connection.exec_driver_sql(f"CREATE TEMPORARY TABLE decision_verdicts AS SELECT * FROM {stored} WHERE 1 = 0")
        try:
            if source == "sql":
                d = tables.decisions.c
                decisions = [(seq, horizon_ms, decided_ts + horizon_ms / 1000)
                             for seq, decided_ts in connection.execute(sa.select(d.stream_seq, d.decided_ts))]
            else:
                connection.execute(sa.text(f"INSERT INTO {temporary} SELECT * FROM {stored} WHERE horizon_ms = :h"),
                                   {"h": horizon_ms})
                decisions = [tuple(row) for row in connection.execute(self._due_pending(horizon_ms))]
            judge_into(connection, temporary, decisions)
            return [_plain_numbers(row) for row in run(connection, query, horizon_ms=horizon_ms)]
        finally:
            connection.exec_driver_sql(f"DROP TABLE {temporary}")


def _plain_numbers(row: dict) -> dict:
    """PostgreSQL sums integers as numeric (Decimal); the same answer as SQLite's, in ints and floats."""
    return {name: (float(value) if name.endswith(("_rate", "_ms")) else int(value))
            if isinstance(value, decimal.Decimal) else value for name, value in row.items()}


def _for_worker(rows: list[Mapping], worker: WorkerId | None) -> list[dict]:
    if worker is None:
        return [dict(row) for row in rows]
    return [dict(row) for row in rows if row["publisher"] == worker.publisher and row["dp_rank"] == worker.dp_rank]
