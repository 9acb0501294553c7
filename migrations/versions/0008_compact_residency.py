"""Compact residency: a stay is written once, its placement kept once, its end inserted.

block_residency (one wide row per stay, closed by an UPDATE) becomes three tables and a
view of the old name and columns: `placements` (worker, tier, provenance, group,
ownership, declared kind and window, once each, under a small integer id),
`block_stays` (hashes, stored seq and time per stay, keyed by placement first) and
`block_removals` (one inserted row per stay that ended). Existing rows are moved over.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

SEQ = sa.BigInteger
HASH = sa.BigInteger
TS = sa.Double
PUBLISHER = sa.String(128)
NAME = sa.String(32)
OWNERSHIP = sa.String(128)

PLACEMENT_COLUMNS = ("publisher", "dp_rank", "provenance", "tier", "group_idx", "ownership", "kv_cache_spec_kind", "sliding_window")



BLOCK_RESIDENCY = """CREATE VIEW block_residency AS
SELECT s.stored_seq, s.slot, p.publisher, p.dp_rank, p.tier, p.provenance, s.engine_hash, s.sequence_hash,
       s.parent_hash, s.local_hash, s.stored_ts, s.conflict_since, r.removed_seq, r.removed_ts, r.removal_cause,
       p.group_idx, p.ownership, p.kv_cache_spec_kind, p.sliding_window, COALESCE(s.refs, 1) AS refs,
       COALESCE(s.unresolved, FALSE) AS unresolved, s.placement_id
FROM block_stays s
JOIN placements p ON p.placement_id = s.placement_id
LEFT JOIN block_removals r
  ON r.placement_id = s.placement_id AND r.stored_seq = s.stored_seq AND r.slot = s.slot"""

# The views over block_residency, as 0003 and 0007 defined them (unchanged: the view keeps the columns).
_UNSIGNED = {
    "sqlite": "printf('%u', {column})",
    "postgresql": "(CASE WHEN {column} < 0 THEN {column}::numeric + 18446744073709551616 ELSE {column}::numeric END)",
}

DECISION_BLOCK_STAYS = """CREATE VIEW decision_block_stays AS
SELECT b.stream_seq, b.role, b.position, b.sequence_hash, d.inventory_seq, d.decided_ts,
       s.tier, s.stored_seq, s.removed_seq, s.removed_ts
FROM decision_blocks b
JOIN decisions d ON d.stream_seq = b.stream_seq
LEFT JOIN block_residency s
  ON s.sequence_hash = b.sequence_hash AND s.provenance = 'native'
 AND s.publisher = CASE b.role WHEN 'source' THEN d.chosen_source WHEN 'shadow_source' THEN d.shadow_source
                   ELSE d.target_publisher END
 AND s.dp_rank = CASE b.role WHEN 'source' THEN d.chosen_dp_rank WHEN 'shadow_source' THEN d.shadow_dp_rank
                 ELSE d.target_dp_rank END
 AND s.tier IN ('device', 'host', 'disk')
 AND (b.role IN ('target', 'inflight')
      OR s.tier = CASE b.role WHEN 'source' THEN d.chosen_tier ELSE d.shadow_tier END)"""


def _view_columns(dialect: str) -> str:
    unsigned = _UNSIGNED.get(dialect, _UNSIGNED["postgresql"])
    hashes = ",\n    ".join(
        f"{unsigned.format(column=column)} AS {column}" for column in ("engine_hash", "sequence_hash", "parent_hash")
    )
    columns = (
        "publisher, dp_rank, tier, group_idx, kv_cache_spec_kind, ownership, provenance,\n    "
        + hashes
        + ",\n    stored_seq, stored_ts, conflict_since IS NOT NULL AS conflict,"
        " removed_seq, removed_ts, COALESCE(removal_cause, 'stored') AS removal_cause, refs, unresolved"
    )
    if dialect == "sqlite":
        columns = columns.replace(
            "printf('%u', parent_hash)", "CASE WHEN parent_hash IS NULL THEN NULL ELSE printf('%u', parent_hash) END"
        )
    return columns


def _create_views() -> None:
    columns = _view_columns(op.get_bind().dialect.name)
    op.execute(f"CREATE VIEW current_inventory AS SELECT {columns}\nFROM block_residency WHERE removed_seq IS NULL")
    op.execute(f"CREATE VIEW block_history AS SELECT {columns}\nFROM block_residency")
    op.execute(DECISION_BLOCK_STAYS)


def _drop_views() -> None:
    op.execute("DROP VIEW decision_block_stays")
    op.execute("DROP VIEW block_history")
    op.execute("DROP VIEW current_inventory")


def _same(dialect: str, left: str, right: str) -> str:
    return f"{left} IS {right}" if dialect == "sqlite" else f"{left} IS NOT DISTINCT FROM {right}"


def upgrade() -> None:
    bind = op.get_bind()
    dialect = bind.dialect.name
    _drop_views()
    op.create_table(
        "placements",
        sa.Column("placement_id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("publisher", PUBLISHER, nullable=False),
        sa.Column("dp_rank", sa.Integer, nullable=False),
        sa.Column("provenance", NAME, nullable=False),
        sa.Column("tier", NAME, nullable=False),
        sa.Column("group_idx", sa.Integer, nullable=False),
        sa.Column("ownership", OWNERSHIP),
        sa.Column("kv_cache_spec_kind", NAME),
        sa.Column("sliding_window", sa.Integer),
    )
    op.create_index("ix_placements_worker", "placements", ["publisher", "dp_rank", "tier"])
    op.create_table(
        "block_stays",
        sa.Column("placement_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("stored_seq", SEQ, primary_key=True, autoincrement=False),
        sa.Column("slot", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("engine_hash", HASH, nullable=False),
        sa.Column("sequence_hash", HASH, nullable=False),
        sa.Column("parent_hash", HASH),
        sa.Column("local_hash", HASH, nullable=False),
        sa.Column("stored_ts", TS, nullable=False),
        sa.Column("conflict_since", SEQ),
        sa.Column("refs", sa.Integer),
        sa.Column("unresolved", sa.Boolean),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_stays_engine_hash", "block_stays", ["engine_hash"])
    op.create_index("ix_stays_sequence_hash", "block_stays", ["sequence_hash"])
    op.create_table(
        "block_removals",
        sa.Column("placement_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("stored_seq", SEQ, primary_key=True, autoincrement=False),
        sa.Column("slot", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("removed_seq", SEQ, nullable=False),
        sa.Column("removed_ts", TS, nullable=False),
        sa.Column("removal_cause", NAME, nullable=False),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_removals_removed_seq", "block_removals", ["removed_seq"])

    columns = ", ".join(PLACEMENT_COLUMNS)
    op.execute(f"INSERT INTO placements ({columns}) SELECT DISTINCT {columns} FROM block_residency")
    match = " AND ".join(_same(dialect, f"p.{c}", f"r.{c}") for c in PLACEMENT_COLUMNS)
    op.execute(
        "INSERT INTO block_stays (placement_id, stored_seq, slot, engine_hash, sequence_hash, parent_hash, local_hash, "
        "stored_ts, conflict_since, refs, unresolved) "
        "SELECT p.placement_id, r.stored_seq, r.slot, r.engine_hash, r.sequence_hash, r.parent_hash, r.local_hash, "
        "r.stored_ts, r.conflict_since, CASE WHEN r.refs = 1 THEN NULL ELSE r.refs END, "
        "CASE WHEN r.unresolved THEN r.unresolved END "
        f"FROM block_residency r JOIN placements p ON {match}"
    )
    op.execute(
        "INSERT INTO block_removals (placement_id, stored_seq, slot, removed_seq, removed_ts, removal_cause) "
        "SELECT p.placement_id, r.stored_seq, r.slot, r.removed_seq, r.removed_ts, r.removal_cause "
        f"FROM block_residency r JOIN placements p ON {match} WHERE r.removed_seq IS NOT NULL"
    )
    op.drop_table("block_residency")
    op.execute(BLOCK_RESIDENCY)
    _create_views()


def downgrade() -> None:
    _drop_views()
    op.execute("CREATE TABLE residency_0008 AS SELECT * FROM block_residency")
    op.execute("DROP VIEW block_residency")
    op.drop_table("block_removals")
    op.drop_table("block_stays")
    op.drop_table("placements")
    op.create_table(
        "block_residency",
        sa.Column("stored_seq", SEQ, primary_key=True, autoincrement=False),
        sa.Column("slot", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("publisher", PUBLISHER, nullable=False),
        sa.Column("dp_rank", sa.Integer, nullable=False),
        sa.Column("tier", NAME, nullable=False),
        sa.Column("provenance", NAME, nullable=False),
        sa.Column("engine_hash", HASH, nullable=False),
        sa.Column("sequence_hash", HASH, nullable=False),
        sa.Column("parent_hash", HASH),
        sa.Column("local_hash", HASH, nullable=False),
        sa.Column("stored_ts", TS, nullable=False),
        sa.Column("conflict_since", SEQ),
        sa.Column("removed_seq", SEQ),
        sa.Column("removed_ts", TS),
        sa.Column("removal_cause", NAME),
        sa.Column("group_idx", sa.Integer, nullable=False, server_default="0"),
        sa.Column("ownership", OWNERSHIP),
        sa.Column("kv_cache_spec_kind", NAME),
        sa.Column("sliding_window", sa.Integer),
        sa.Column("refs", sa.Integer, nullable=False, server_default="1"),
        sa.Column("unresolved", sa.Boolean, nullable=False, server_default=sa.false()),
        sqlite_with_rowid=False,
    )
    columns = (
        "stored_seq, slot, publisher, dp_rank, tier, provenance, engine_hash, sequence_hash, parent_hash, local_hash, "
        "stored_ts, conflict_since, removed_seq, removed_ts, removal_cause, group_idx, ownership, kv_cache_spec_kind, "
        "sliding_window, refs, unresolved"
    )
    op.execute(f"INSERT INTO block_residency ({columns}) SELECT {columns} FROM residency_0008")
    op.execute("DROP TABLE residency_0008")
    op.create_index("ix_residency_worker_removed", "block_residency", ["publisher", "dp_rank", "tier", "removed_seq"])
    op.create_index("ix_residency_engine_hash", "block_residency", ["engine_hash"])
    op.create_index("ix_residency_removed_seq", "block_residency", ["removed_seq"])
    op.create_index("ix_residency_sequence_hash", "block_residency", ["sequence_hash"])
    _create_views()
