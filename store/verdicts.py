"""The set-based SQL judge: decision verdicts derived from the stays, for what the events fold did not judge.

store judges decisions as it folds (store/quality.py), in the transaction of the event that
settles each one. What the fold cannot judge, this module judges from SQL with the same rule:

- decisions that reached store after their horizon had passed in the fold (a store restart, a
  decisions projector behind the events one, a fold rebuilt after a failed write for those
  taken before the seq it was rebuilt at), and those
  of every shard when store runs sharded (no fold holds the whole inventory): their
  `verdicts_pending` rows, once SQL holds the event that settles them (`VerdictSweeper`);
- decisions recorded before a horizon was configured (`register_horizons` queues them);
- an audit at a horizon store does not judge (`judge`, into a temporary table).

A decision's horizon seq is the seq before the first event ingested at or after decided_ts +
horizon. It is found here from the event log's (seq, ingest time) pairs, read once per call
from the earliest deadline on, with a running maximum of ingest time over seq order (ingest
times of several ingest processes need not rise with the seq): linear in the events read and
the decisions judged, where a correlated MIN per decision scanned the log's tail each time.
A relied-on block is held at the horizon seq when a native stay of it on that worker's
placement (the chosen tier; any local tier for the target and in-flight blocks) is open there.
Only the stays that overlap the decision's window count (ended after the earlier of its
inventory and horizon seqs): they are found through the stays' sequence-hash index, whose
entries carry the placement and stored seq. The fold holds at most one stay of a block per
placement at a time (a second store of a held block counts in its `refs`), so no stay stored
before the last one stored at or before the window's start can still be open in it: the index
is read from that stay on (one seek for it), not from the block's first stay ever — a block
stored and evicted a thousand times cost a thousand lookups per decision relying on it. (The fold
keys a placement's blocks by engine hash; one sequence hash is one engine hash wherever the
engine's block hash covers what kvledger's does — tokens, adapter, salt, extra keys — and an
engine restart, which could change its hashes, clears its inventory. Checked on the 60 s demo's
ledger and the 1 M bench ledger: no stay of a block and placement overlaps the next one.)
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import operator
import time
from collections.abc import Iterable, Sequence

import sqlalchemy as sa

from kvledger.store import tables
from kvledger.store.changes import VERDICT_COLUMNS
from kvledger.store.sharding import sharded_events_checkpoint

log = logging.getLogger("kvledger.store.verdicts")

# Decisions judged per sweeping transaction: a backlog (a newly configured horizon over a
# large ledger) is worked through in transactions that hold SQLite's write lock briefly.
SWEEP_CHUNK = 5000
SWEEP_EVERY_S = 0.5

# What one SQL judgement reads: verdict_work (decision, horizon, horizon seq), filled by `judge`.
_WORK_TABLE = "verdict_work"

# The judge itself: one decision_verdicts row (VERDICT_COLUMNS) per row of verdict_work.
JUDGE_SQL = """WITH judged AS (
  SELECT w.stream_seq, w.horizon_ms, w.horizon_seq, d.decided_ts, d.inventory_seq,
         d.chosen_source, d.chosen_dp_rank, d.chosen_tier, d.target_publisher, d.target_dp_rank,
         d.shadow_source, d.shadow_dp_rank, d.shadow_tier
  FROM verdict_work w
  JOIN decisions d ON d.stream_seq = w.stream_seq
),
placed AS (
  SELECT j.stream_seq, j.horizon_ms, j.horizon_seq, j.inventory_seq, b.role, b.position, b.sequence_hash,
         p.placement_id,
         CASE WHEN j.inventory_seq < j.horizon_seq THEN j.inventory_seq ELSE j.horizon_seq END AS window_seq
  FROM judged j
  JOIN decision_blocks b ON b.stream_seq = j.stream_seq
  LEFT JOIN placements p
    ON p.provenance = 'native'
   AND p.publisher = CASE b.role WHEN 'source' THEN j.chosen_source WHEN 'shadow_source' THEN j.shadow_source
                     ELSE j.target_publisher END
   AND p.dp_rank = CASE b.role WHEN 'source' THEN j.chosen_dp_rank WHEN 'shadow_source' THEN j.shadow_dp_rank
                   ELSE j.target_dp_rank END
   AND p.tier IN ('device', 'host', 'disk')
   AND (b.role IN ('target', 'inflight')
        OR p.tier = CASE b.role WHEN 'source' THEN j.chosen_tier ELSE j.shadow_tier END)
),
relied AS (
  SELECT r.*,
         COALESCE((SELECT MAX(s.stored_seq) FROM block_stays s
                   WHERE s.sequence_hash = r.sequence_hash AND s.placement_id = r.placement_id
                     AND s.stored_seq <= r.window_seq), 0) AS first_stored_seq
  FROM placed r
),
windowed AS (
  SELECT r.stream_seq, r.horizon_ms, r.role, r.position,
         CASE WHEN e.removed_seq IS NULL OR e.removed_seq > r.horizon_seq THEN 1 ELSE 0 END AS held,
         CASE WHEN s.stored_seq <= r.inventory_seq AND e.removed_seq > r.inventory_seq
               AND e.removed_seq <= r.horizon_seq THEN e.removed_ts END AS first_removed_ts,
         CASE WHEN e.removed_seq > r.inventory_seq AND e.removed_seq <= r.horizon_seq
              THEN e.removed_ts END AS last_removed_ts
  FROM relied r
  JOIN block_stays s
    ON s.sequence_hash = r.sequence_hash AND s.placement_id = r.placement_id
   AND s.stored_seq >= r.first_stored_seq AND s.stored_seq <= r.horizon_seq
  LEFT JOIN block_removals e
    ON e.placement_id = s.placement_id AND e.stored_seq = s.stored_seq
   AND e.first_slot <= s.slot AND e.last_slot >= s.slot
  WHERE e.removed_seq IS NULL OR e.removed_seq > r.window_seq
),
blocks AS (
  SELECT b.stream_seq, j.horizon_ms, b.role, b.position, COALESCE(MAX(w.held), 0) AS held,
         MIN(w.first_removed_ts) AS first_removed_ts, MAX(w.last_removed_ts) AS last_removed_ts
  FROM judged j
  JOIN decision_blocks b ON b.stream_seq = j.stream_seq
  LEFT JOIN windowed w
    ON w.stream_seq = b.stream_seq AND w.horizon_ms = j.horizon_ms AND w.role = b.role AND w.position = b.position
  GROUP BY b.stream_seq, j.horizon_ms, b.role, b.position
),
counted AS (
  SELECT j.stream_seq, j.horizon_ms, j.horizon_seq, j.decided_ts,
         SUM(CASE WHEN b.role = 'source' THEN 1 ELSE 0 END) AS source_blocks,
         SUM(CASE WHEN b.role = 'source' AND b.held = 0 THEN 1 ELSE 0 END) AS source_gone,
         MIN(CASE WHEN b.role = 'source' AND b.held = 0 THEN b.last_removed_ts END) AS source_gone_ts,
         MIN(CASE WHEN b.role = 'source' THEN b.first_removed_ts END) AS first_eviction_ts,
         SUM(CASE WHEN b.role = 'target' THEN 1 ELSE 0 END) AS target_blocks,
         SUM(CASE WHEN b.role = 'target' AND b.held = 0 THEN 1 ELSE 0 END) AS target_gone,
         MIN(CASE WHEN b.role = 'target' AND b.held = 0 THEN b.last_removed_ts END) AS target_gone_ts,
         SUM(CASE WHEN b.role = 'shadow_source' THEN 1 ELSE 0 END) AS shadow_source_blocks,
         SUM(CASE WHEN b.role = 'shadow_source' AND b.held = 0 THEN 1 ELSE 0 END) AS shadow_source_gone,
         MIN(CASE WHEN b.role = 'shadow_source' AND b.held = 0 THEN b.last_removed_ts END) AS shadow_gone_ts,
         MIN(CASE WHEN b.role = 'shadow_source' THEN b.first_removed_ts END) AS shadow_eviction_ts,
         SUM(CASE WHEN b.role = 'inflight' THEN 1 ELSE 0 END) AS inflight_blocks,
         SUM(CASE WHEN b.role = 'inflight' AND b.held = 0 THEN 1 ELSE 0 END) AS inflight_gone
  FROM judged j
  LEFT JOIN blocks b ON b.stream_seq = j.stream_seq AND b.horizon_ms = j.horizon_ms
  GROUP BY j.stream_seq, j.horizon_ms, j.horizon_seq, j.decided_ts
)
SELECT stream_seq, horizon_ms, horizon_seq,
       CASE WHEN source_blocks = 0 THEN NULL WHEN source_gone > 0 THEN 1 ELSE 0 END AS stale,
       source_blocks, source_gone, (source_gone_ts - decided_ts) * 1000 AS source_gone_after_ms,
       (first_eviction_ts - decided_ts) * 1000 AS first_eviction_ms,
       CASE WHEN target_blocks = 0 THEN NULL WHEN target_gone > 0 THEN 1 ELSE 0 END AS lost_credit,
       target_blocks, target_gone, (target_gone_ts - decided_ts) * 1000 AS target_gone_after_ms,
       CASE WHEN shadow_source_blocks = 0 THEN NULL WHEN shadow_source_gone > 0 THEN 1 ELSE 0 END AS shadow_stale,
       shadow_source_blocks, shadow_source_gone, (shadow_gone_ts - decided_ts) * 1000 AS shadow_source_gone_after_ms,
       (shadow_eviction_ts - decided_ts) * 1000 AS shadow_first_eviction_ms,
       inflight_blocks, inflight_gone, 'sql' AS judged_by
FROM counted"""

_VERDICT_LIST = ", ".join(VERDICT_COLUMNS)


def horizon_ms_of(horizon_s: float) -> float:
    """A horizon in seconds as verdicts key it, in milliseconds (0.05 s is 50.0 ms, not 50.00000000000001)."""
    return round(horizon_s * 1000, 6)


def first_seq_at_or_after(seqs_and_times: Iterable[tuple[int, float]], thresholds: Sequence[float]) -> list[int | None]:
    """For each threshold, the seq before the first (seq, ingest time) in seq order ingested at or after it (None:
    none yet). Ingest times need not rise with the seq; their running maximum does, so one pass and a bisection
    per threshold find it."""
    seqs, running_max = [], []
    highest = float("-inf")
    for seq, ingest_ts in seqs_and_times:
        if ingest_ts > highest:
            highest = ingest_ts
        seqs.append(seq)
        running_max.append(highest)
    found: list[int | None] = []
    for threshold in thresholds:
        at = bisect.bisect_left(running_max, threshold)
        found.append(seqs[at] - 1 if at < len(seqs) else None)
    return found


def horizon_seqs(connection: sa.Connection, deadlines: Sequence[float]) -> list[int | None]:
    """Each deadline's horizon seq: the seq before the first event ingested at or after it (None: none yet).

    Reads the event log from the earliest deadline on, once; only events ingested at or after
    a deadline can settle it, and among them the one with the least seq does. Read in the order of
    `ix_event_log_ingest_ts` and put in seq order here: asked for in seq order, SQLite scanned the
    whole log by its key to skip a sort (4.0 s at 1 M decisions for the newest second of events,
    while the sweeper holds the write lock the events projector waits for).
    """
    if not deadlines:
        return []
    e = tables.event_log.c
    rows = connection.execute(
        sa.select(e.stream_seq, e.ingest_ts).where(e.event_idx == 0, e.ingest_ts >= min(deadlines))
        .order_by(e.ingest_ts, e.stream_seq)
    ).all()
    rows.sort(key=operator.itemgetter(0))
    return first_seq_at_or_after(rows, deadlines)


def _fill_work(connection: sa.Connection, work: Iterable[tuple[int, float, int]]) -> None:
    connection.exec_driver_sql(
        f"CREATE TEMPORARY TABLE IF NOT EXISTS {_WORK_TABLE} "
        "(stream_seq BIGINT, horizon_ms DOUBLE PRECISION, horizon_seq BIGINT, PRIMARY KEY (stream_seq, horizon_ms))"
    )
    connection.exec_driver_sql(f"DELETE FROM {_WORK_TABLE}")
    rows = [{"stream_seq": seq, "horizon_ms": horizon_ms, "horizon_seq": horizon_seq}
            for seq, horizon_ms, horizon_seq in work]
    if rows:
        connection.execute(
            sa.text(f"INSERT INTO {_WORK_TABLE} (stream_seq, horizon_ms, horizon_seq) "
                    "VALUES (:stream_seq, :horizon_ms, :horizon_seq)"), rows)


def _settled_through(connection: sa.Connection) -> int | None:
    """With sharded events projectors, the seq below which every shard has written (None: one store).

    A horizon seq is final only once every event up to it is in SQL; one store writes in seq order.
    """
    rows = connection.execute(sa.select(tables.checkpoints.c.name, tables.checkpoints.c.stream_seq)).all()
    return sharded_events_checkpoint(dict(rows))


def _judgeable(connection: sa.Connection, decisions: Sequence[tuple[int, float, float]]) -> list[tuple[int, float, int]]:
    """(stream_seq, horizon_ms, horizon_seq) of those `decisions` (stream_seq, horizon_ms, deadline) SQL can settle."""
    seqs = horizon_seqs(connection, [deadline for _, _, deadline in decisions])
    through = _settled_through(connection)
    return [(seq, horizon_ms, horizon_seq) for (seq, horizon_ms, _), horizon_seq in zip(decisions, seqs)
            if horizon_seq is not None and (through is None or horizon_seq + 1 <= through)]


def judge_into(connection: sa.Connection, table: str, decisions: Sequence[tuple[int, float, float]]) -> int:
    """Judge `decisions` (stream_seq, horizon_ms, deadline) in SQL and insert their verdicts into `table`
    (decisions no event has settled yet are left out); returns how many were judged."""
    work = _judgeable(connection, decisions)
    if not work:
        return 0
    _fill_work(connection, work)
    # (`WHERE 1 = 1`: SQLite reads an ON after a bare FROM as a join's, so an upsert's SELECT needs a WHERE.)
    conflict = " WHERE 1 = 1 ON CONFLICT (stream_seq, horizon_ms) DO NOTHING" if table == "decision_verdicts" else ""
    connection.exec_driver_sql(f"INSERT INTO {table} ({_VERDICT_LIST}) {JUDGE_SQL}{conflict}")
    connection.exec_driver_sql(f"DELETE FROM {_WORK_TABLE}")
    return len(work)


def register_horizons(engine: sa.Engine, horizons_ms: Sequence[float]) -> None:
    """Record the horizons store judges; a horizon new to the database queues every decision it holds
    (judged by the sweeper), so its verdicts cover the whole ledger, not only what came after."""
    h, d, p, v = tables.verdict_horizons.c, tables.decisions.c, tables.verdicts_pending.c, tables.decision_verdicts.c
    with engine.begin() as connection:
        known = set(connection.execute(sa.select(h.horizon_ms)).scalars())
        for horizon_ms in horizons_ms:
            if horizon_ms in known:
                continue
            connection.execute(tables.verdict_horizons.insert().values(horizon_ms=horizon_ms, since_ts=time.time()))
            judged = sa.select(v.stream_seq).where(v.stream_seq == d.stream_seq, v.horizon_ms == horizon_ms)
            queued = sa.select(p.stream_seq).where(p.stream_seq == d.stream_seq, p.horizon_ms == horizon_ms)
            connection.execute(tables.verdicts_pending.insert().from_select(
                ["stream_seq", "horizon_ms", "due_ts"],
                sa.select(d.stream_seq, sa.literal(horizon_ms, sa.Double), d.decided_ts + horizon_ms / 1000)
                .where(~judged.exists(), ~queued.exists()),
            ))
            log.info("decision verdicts at %g ms: every decision recorded so far is queued for the SQL judge", horizon_ms)


def pending_rows(rows: Iterable[tuple[sa.Table, dict]], horizons_ms: Sequence[float]) -> list[tuple[sa.Table, dict]]:
    """A `verdicts_pending` row per decision among `rows` and horizon: written with the decision."""
    return [
        (tables.verdicts_pending, {"stream_seq": row["stream_seq"], "horizon_ms": horizon_ms,
                                   "due_ts": row["decided_ts"] + horizon_ms / 1000})
        for table, row in rows if table is tables.decisions for horizon_ms in horizons_ms
    ]


def settled_pending(newest) -> sa.Select:
    """The pending verdicts an event in SQL has settled: due (decided_ts + horizon) no later than `newest`,
    the newest event's ingest_ts (a value, or `newest_ingest_ts()` to have SQL find it)."""
    p = tables.verdicts_pending.c
    return sa.select(p.stream_seq, p.horizon_ms, p.due_ts).where(p.due_ts <= newest)


def newest_ingest_ts() -> sa.ScalarSelect:
    return sa.select(sa.func.max(tables.event_log.c.ingest_ts)).scalar_subquery()


def sweep_once(engine: sa.Engine, limit: int = SWEEP_CHUNK) -> int:
    """Judge in SQL the pending decisions an event in SQL has settled (oldest due first, at most `limit`),
    and drop their pending rows, in one transaction; returns how many were judged."""
    p = tables.verdicts_pending.c
    with engine.begin() as connection:
        if connection.dialect.name == "sqlite":
            # Take the write lock first: a transaction that reads before it writes fails to write
            # (SQLITE_BUSY_SNAPSHOT) whenever the events writer committed in between.
            connection.exec_driver_sql("UPDATE verdict_horizons SET since_ts = since_ts WHERE 1 = 0")
        newest = connection.execute(sa.select(newest_ingest_ts())).scalar_one()
        if newest is None:
            return 0
        due = connection.execute(settled_pending(newest).order_by(p.due_ts).limit(limit)).all()
        if not due:
            return 0
        judged = judge_into(connection, "decision_verdicts", [tuple(row) for row in due])
        if judged:
            settled = sa.select(tables.decision_verdicts.c.stream_seq).where(
                tables.decision_verdicts.c.stream_seq == p.stream_seq,
                tables.decision_verdicts.c.horizon_ms == p.horizon_ms,
            ).exists()
            first, last = min(row[0] for row in due), max(row[0] for row in due)
            connection.execute(tables.verdicts_pending.delete().where(
                p.stream_seq >= first, p.stream_seq <= last, settled))
        return judged


class VerdictSweeper:
    """Runs `sweep_once` beside the projectors, until nothing due is left, every SWEEP_EVERY_S."""

    def __init__(self, engine: sa.Engine, metrics=None) -> None:
        self.engine = engine
        self.metrics = metrics  # store's QualityMetrics (counts kvledger_store_decision_verdicts{judged_by="sql"})

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                judged = await asyncio.to_thread(sweep_once, self.engine)
            except sa.exc.DBAPIError as error:  # a busy or restarting database: the next round retries
                log.warning("judging pending decisions in SQL failed (%s); retrying", error)
                judged = 0
            if judged and self.metrics is not None:
                self.metrics.verdicts.labels("sql").inc(judged)
            if judged >= SWEEP_CHUNK:
                continue
            try:
                await asyncio.wait_for(stop.wait(), SWEEP_EVERY_S)
            except TimeoutError:
                pass
