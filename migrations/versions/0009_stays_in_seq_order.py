"""Stays in seq order: block_stays and block_removals keyed by (stored_seq, slot), appended at the end.

A stay's (stored_seq, slot) is unique on its own (a batch is one ledger seq; slot counts its
stores), so the placement no longer leads the keys: every insert lands on the rightmost
leaf of both primary keys instead of in the middle of one range per placement (in
PostgreSQL those pages split half-empty), and `block_removals` drops `placement_id`. A
secondary index `(placement_id, stored_seq)` finds one worker's stays; its duplicate seqs
(one per stay of a batch) are deduplicated by PostgreSQL. Columns are ordered widest
first, so PostgreSQL pads no 4-byte column before an 8-byte one.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

SEQ = sa.BigInteger
HASH = sa.BigInteger
TS = sa.Double
NAME = sa.String(32)

STAY_COLUMNS = (
    "stored_seq", "engine_hash", "sequence_hash", "parent_hash", "local_hash", "stored_ts", "conflict_since", "slot",
    "placement_id", "refs", "unresolved",
)  # fmt: skip

BLOCK_RESIDENCY = """CREATE VIEW block_residency AS
SELECT s.stored_seq, s.slot, p.publisher, p.dp_rank, p.tier, p.provenance, s.engine_hash, s.sequence_hash,
       s.parent_hash, s.local_hash, s.stored_ts, s.conflict_since, r.removed_seq, r.removed_ts, r.removal_cause,
       p.group_idx, p.ownership, p.kv_cache_spec_kind, p.sliding_window, COALESCE(s.refs, 1) AS refs,
       COALESCE(s.unresolved, FALSE) AS unresolved, s.placement_id
FROM block_stays s
JOIN placements p ON p.placement_id = s.placement_id
LEFT JOIN block_removals r ON r.stored_seq = s.stored_seq AND r.slot = s.slot"""

# 0008's, for the downgrade
BLOCK_RESIDENCY_0008 = """CREATE VIEW block_residency AS
SELECT s.stored_seq, s.slot, p.publisher, p.dp_rank, p.tier, p.provenance, s.engine_hash, s.sequence_hash,
       s.parent_hash, s.local_hash, s.stored_ts, s.conflict_since, r.removed_seq, r.removed_ts, r.removal_cause,
       p.group_idx, p.ownership, p.kv_cache_spec_kind, p.sliding_window, COALESCE(s.refs, 1) AS refs,
       COALESCE(s.unresolved, FALSE) AS unresolved, s.placement_id
FROM block_stays s
JOIN placements p ON p.placement_id = s.placement_id
LEFT JOIN block_removals r
  ON r.placement_id = s.placement_id AND r.stored_seq = s.stored_seq AND r.slot = s.slot"""


def _stays_table(name: str, seq_order: bool) -> None:
    columns = {
        "stored_seq": sa.Column("stored_seq", SEQ, nullable=False),
        "slot": sa.Column("slot", sa.Integer, nullable=False),
        "placement_id": sa.Column("placement_id", sa.Integer, nullable=False),
        "engine_hash": sa.Column("engine_hash", HASH, nullable=False),
        "sequence_hash": sa.Column("sequence_hash", HASH, nullable=False),
        "parent_hash": sa.Column("parent_hash", HASH),
        "local_hash": sa.Column("local_hash", HASH, nullable=False),
        "stored_ts": sa.Column("stored_ts", TS, nullable=False),
        "conflict_since": sa.Column("conflict_since", SEQ),
        "refs": sa.Column("refs", sa.Integer),
        "unresolved": sa.Column("unresolved", sa.Boolean),
    }
    if seq_order:
        order, key = STAY_COLUMNS, ("stored_seq", "slot")
    else:
        order = ("placement_id", "stored_seq", "slot", "engine_hash", "sequence_hash", "parent_hash", "local_hash",
                 "stored_ts", "conflict_since", "refs", "unresolved")  # fmt: skip
        key = ("placement_id", "stored_seq", "slot")
    op.create_table(name, *(columns[c] for c in order), sa.PrimaryKeyConstraint(*key), sqlite_with_rowid=False)


def _removals_table(name: str, seq_order: bool) -> None:
    if seq_order:
        op.create_table(
            name,
            sa.Column("stored_seq", SEQ, nullable=False),
            sa.Column("removed_seq", SEQ, nullable=False),
            sa.Column("removed_ts", TS, nullable=False),
            sa.Column("slot", sa.Integer, nullable=False),
            sa.Column("removal_cause", NAME, nullable=False),
            sa.PrimaryKeyConstraint("stored_seq", "slot"),
            sqlite_with_rowid=False,
        )
    else:
        op.create_table(
            name,
            sa.Column("placement_id", sa.Integer, nullable=False),
            sa.Column("stored_seq", SEQ, nullable=False),
            sa.Column("slot", sa.Integer, nullable=False),
            sa.Column("removed_seq", SEQ, nullable=False),
            sa.Column("removed_ts", TS, nullable=False),
            sa.Column("removal_cause", NAME, nullable=False),
            sa.PrimaryKeyConstraint("placement_id", "stored_seq", "slot"),
            sqlite_with_rowid=False,
        )


def _swap(seq_order: bool) -> None:
    """Move stays and removals into tables of the other layout, in (stored_seq, slot) order."""
    dialect = op.get_bind().dialect.name
    views = _load_0008()
    views._drop_views()
    op.execute("DROP VIEW block_residency")
    _stays_table("block_stays_next", seq_order)
    _removals_table("block_removals_next", seq_order)
    stays = ", ".join(STAY_COLUMNS)
    op.execute(f"INSERT INTO block_stays_next ({stays}) SELECT {stays} FROM block_stays ORDER BY stored_seq, slot")
    if seq_order:
        op.execute(
            "INSERT INTO block_removals_next (stored_seq, removed_seq, removed_ts, slot, removal_cause) "
            "SELECT stored_seq, removed_seq, removed_ts, slot, removal_cause FROM block_removals "
            "ORDER BY stored_seq, slot"
        )
    else:
        op.execute(
            "INSERT INTO block_removals_next (placement_id, stored_seq, slot, removed_seq, removed_ts, removal_cause) "
            "SELECT s.placement_id, r.stored_seq, r.slot, r.removed_seq, r.removed_ts, r.removal_cause "
            "FROM block_removals r JOIN block_stays s ON s.stored_seq = r.stored_seq AND s.slot = r.slot"
        )
    op.drop_table("block_removals")
    op.drop_table("block_stays")
    op.rename_table("block_stays_next", "block_stays")
    op.rename_table("block_removals_next", "block_removals")
    if dialect == "postgresql":  # the primary keys' indexes keep the names they were made under
        op.execute("ALTER INDEX block_stays_next_pkey RENAME TO block_stays_pkey")
        op.execute("ALTER INDEX block_removals_next_pkey RENAME TO block_removals_pkey")
    if seq_order:
        op.create_index("ix_stays_placement", "block_stays", ["placement_id", "stored_seq"])
    op.create_index("ix_stays_engine_hash", "block_stays", ["engine_hash"])
    op.create_index("ix_stays_sequence_hash", "block_stays", ["sequence_hash"])
    op.create_index("ix_removals_removed_seq", "block_removals", ["removed_seq"])
    op.execute(BLOCK_RESIDENCY if seq_order else BLOCK_RESIDENCY_0008)
    views._create_views()


def _load_0008():
    """0008's module (its file name starts with a digit), for the views it defines over block_residency."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name("0008_compact_residency.py")
    spec = importlib.util.spec_from_file_location("kvledger_migration_0008", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    _swap(seq_order=True)


def downgrade() -> None:
    _swap(seq_order=False)
