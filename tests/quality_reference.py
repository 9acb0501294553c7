"""The quality audit's former statement, kept as the oracle the verdicts are checked against.

Before verdicts were kept in SQL (migration 0012), `kvledger audit quality` derived every
verdict on each run by joining each relied-on block to every stay of it in the decision's
window (through the view block_residency). tests/test_decision_verdicts.py checks that the
stored verdicts, and the set-based SQL judge of store/verdicts.py, say what it said.
"""

from __future__ import annotations

import sqlalchemy as sa

# fmt: off
_FORMER_JUDGED = """WITH judged AS (
  SELECT d.stream_seq, d.request_id, d.decided_ts, d.inventory_seq, d.reason, d.target,
         d.chosen_source, d.chosen_dp_rank, d.chosen_tier,
         (SELECT MIN(e.stream_seq) FROM event_log e WHERE e.ingest_ts >= d.decided_ts + :horizon_s) - 1 AS horizon_seq
  FROM decisions d
),
blocks AS (
  SELECT b.stream_seq, b.role, b.position,
         MAX(CASE WHEN s.stored_seq <= j.horizon_seq AND (s.removed_seq IS NULL OR s.removed_seq > j.horizon_seq)
                  THEN 1 ELSE 0 END) AS held,
         MIN(CASE WHEN s.stored_seq <= j.inventory_seq AND s.removed_seq > j.inventory_seq
                   AND s.removed_seq <= j.horizon_seq THEN s.removed_ts END) AS first_removed_ts,
         MAX(CASE WHEN s.removed_seq > j.inventory_seq AND s.removed_seq <= j.horizon_seq
                  THEN s.removed_ts END) AS last_removed_ts
  FROM judged j
  JOIN decision_blocks b ON b.stream_seq = j.stream_seq
  JOIN decisions d ON d.stream_seq = b.stream_seq
  LEFT JOIN block_residency s
    ON s.sequence_hash = b.sequence_hash AND s.provenance = 'native'
   AND s.publisher = CASE WHEN b.role = 'source' THEN d.chosen_source ELSE d.target_publisher END
   AND s.dp_rank = CASE WHEN b.role = 'source' THEN d.chosen_dp_rank ELSE d.target_dp_rank END
   AND s.tier IN ('device', 'host', 'disk')
   AND (b.role = 'target' OR s.tier = d.chosen_tier)
   AND s.stored_seq <= j.horizon_seq AND (s.removed_seq IS NULL OR s.removed_seq > j.inventory_seq)
  WHERE j.horizon_seq IS NOT NULL AND b.role IN ('source', 'target')
  GROUP BY b.stream_seq, b.role, b.position
),
quality AS (
  SELECT j.stream_seq, j.request_id, j.decided_ts, j.reason, j.target, j.chosen_source, j.chosen_dp_rank,
         j.chosen_tier, j.inventory_seq, j.horizon_seq,
         SUM(CASE WHEN b.role = 'source' THEN 1 ELSE 0 END) AS source_blocks,
         SUM(CASE WHEN b.role = 'source' AND b.held = 0 THEN 1 ELSE 0 END) AS source_gone,
         (MIN(CASE WHEN b.role = 'source' AND b.held = 0 THEN b.last_removed_ts END) - j.decided_ts) * 1000
           AS source_gone_after_ms,
         (MIN(CASE WHEN b.role = 'source' THEN b.first_removed_ts END) - j.decided_ts) * 1000 AS first_eviction_ms,
         SUM(CASE WHEN b.role = 'target' THEN 1 ELSE 0 END) AS target_blocks,
         SUM(CASE WHEN b.role = 'target' AND b.held = 0 THEN 1 ELSE 0 END) AS target_gone,
         (MIN(CASE WHEN b.role = 'target' AND b.held = 0 THEN b.last_removed_ts END) - j.decided_ts) * 1000
           AS target_gone_after_ms
  FROM judged j LEFT JOIN blocks b ON b.stream_seq = j.stream_seq
  GROUP BY j.stream_seq, j.request_id, j.decided_ts, j.reason, j.target, j.chosen_source, j.chosen_dp_rank,
           j.chosen_tier, j.inventory_seq, j.horizon_seq
),
judged_quality AS (
  SELECT q.*,
         CASE WHEN q.horizon_seq IS NULL OR q.source_blocks = 0 THEN NULL
              WHEN q.source_gone > 0 THEN 1 ELSE 0 END AS stale,
         CASE WHEN q.horizon_seq IS NULL OR q.target_blocks = 0 THEN NULL
              WHEN q.target_gone > 0 THEN 1 ELSE 0 END AS lost_credit
  FROM quality q
)"""

# fmt: on


def reference_verdicts(connection: sa.Connection, horizon_s: float) -> dict[int, tuple]:
    """Per judged decision: (stale, source_gone, source_gone_after_ms, first_eviction_ms, lost_credit,
    target_gone, target_gone_after_ms), as the former audit statement computed them."""
    rows = connection.execute(sa.text(_FORMER_JUDGED + """
SELECT stream_seq, stale, source_gone, source_gone_after_ms, first_eviction_ms, lost_credit, target_gone,
       target_gone_after_ms
FROM judged_quality WHERE horizon_seq IS NOT NULL"""), {"horizon_s": horizon_s})
    return {row[0]: tuple(int(v) if isinstance(v, bool) else v for v in row[1:]) for row in rows}
