"""Removal runs: one row per run of a batch's stays ended by one event; stays keyed by placement.

An engine evicts blocks in runs (the oldest of a stored batch, one after another), so a
removal is no longer a row per block: `block_removals` holds one row per run of
consecutive slots of one stored batch ended at one seq, `first_slot`..`last_slot`, beside
the placement they were in. `block_stays` is keyed by `(placement_id, stored_seq, slot)`,
so one worker's stays are one range of the key, read in log order without a secondary
index or a sort; `ix_placements_worker` ends in the placement id, so the as-of statement
reads a worker's placements in its ORDER BY. The engine-hash index goes: it cost a fifth
of the bytes and of the writes, for one lookup (`kvledger audit block`) that now reads the
stays. Existing removals become runs of one slot.

Revision ID: 0010
Revises: 0009
"""

import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

SEQ = sa.BigInteger
HASH = sa.BigInteger
TS = sa.Double
NAME = sa.String(32)

BLOCK_RESIDENCY = """CREATE VIEW block_residency AS
SELECT s.stored_seq, s.slot, p.publisher, p.dp_rank, p.tier, p.provenance, s.engine_hash, s.sequence_hash,
       s.parent_hash, s.local_hash, s.stored_ts, s.conflict_since, r.removed_seq, r.removed_ts, r.removal_cause,
       p.group_idx, p.ownership, p.kv_cache_spec_kind, p.sliding_window, COALESCE(s.refs, 1) AS refs,
       COALESCE(s.unresolved, FALSE) AS unresolved, s.placement_id
FROM block_stays s
JOIN placements p ON p.placement_id = s.placement_id
LEFT JOIN block_removals r
  ON r.placement_id = s.placement_id AND r.stored_seq = s.stored_seq
 AND r.first_slot <= s.slot AND r.last_slot >= s.slot"""

PLACEMENT_ORDER = ["publisher", "dp_rank", "tier", "placement_id"]


def _load(name: str, module: str):
    """An earlier migration's module (their file names start with a digit)."""
    spec = importlib.util.spec_from_file_location(module, Path(__file__).with_name(name))
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def _stays_table(name: str) -> None:
    op.create_table(
        name,
        sa.Column("stored_seq", SEQ, nullable=False),
        sa.Column("engine_hash", HASH, nullable=False),
        sa.Column("sequence_hash", HASH, nullable=False),
        sa.Column("parent_hash", HASH),
        sa.Column("local_hash", HASH, nullable=False),
        sa.Column("stored_ts", TS, nullable=False),
        sa.Column("conflict_since", SEQ),
        sa.Column("slot", sa.Integer, nullable=False),
        sa.Column("placement_id", sa.Integer, nullable=False),
        sa.Column("refs", sa.Integer),
        sa.Column("unresolved", sa.Boolean),
        sa.PrimaryKeyConstraint("placement_id", "stored_seq", "slot"),
        sqlite_with_rowid=False,
    )


def _removals_table(name: str) -> None:
    op.create_table(
        name,
        sa.Column("stored_seq", SEQ, nullable=False),
        sa.Column("removed_seq", SEQ, nullable=False),
        sa.Column("removed_ts", TS, nullable=False),
        sa.Column("placement_id", sa.Integer, nullable=False),
        sa.Column("first_slot", sa.Integer, nullable=False),
        sa.Column("last_slot", sa.Integer, nullable=False),
        sa.Column("removal_cause", NAME, nullable=False),
        sa.PrimaryKeyConstraint("placement_id", "stored_seq", "first_slot"),
        sqlite_with_rowid=False,
    )


def _rename_new_tables() -> None:
    op.drop_table("block_removals")
    op.drop_table("block_stays")
    op.rename_table("block_stays_next", "block_stays")
    op.rename_table("block_removals_next", "block_removals")
    if op.get_bind().dialect.name == "postgresql":  # the primary keys' indexes keep the names they were made under
        op.execute("ALTER INDEX block_stays_next_pkey RENAME TO block_stays_pkey")
        op.execute("ALTER INDEX block_removals_next_pkey RENAME TO block_removals_pkey")


def upgrade() -> None:
    views = _load("0008_compact_residency.py", "kvledger_migration_0008")
    previous = _load("0009_stays_in_seq_order.py", "kvledger_migration_0009")
    views._drop_views()
    op.execute("DROP VIEW block_residency")
    _stays_table("block_stays_next")
    _removals_table("block_removals_next")
    stays = ", ".join(previous.STAY_COLUMNS)  # the stays' columns are 0009's, only the key moves
    op.execute(
        f"INSERT INTO block_stays_next ({stays}) SELECT {stays} FROM block_stays ORDER BY placement_id, stored_seq, slot"
    )
    op.execute(
        "INSERT INTO block_removals_next "
        "(placement_id, stored_seq, first_slot, last_slot, removed_seq, removed_ts, removal_cause) "
        "SELECT s.placement_id, r.stored_seq, r.slot, r.slot, r.removed_seq, r.removed_ts, r.removal_cause "
        "FROM block_removals r JOIN block_stays s ON s.stored_seq = r.stored_seq AND s.slot = r.slot "
        "ORDER BY s.placement_id, r.stored_seq, r.slot"
    )
    _rename_new_tables()
    op.create_index("ix_stays_sequence_hash", "block_stays", ["sequence_hash"])
    op.create_index("ix_removals_removed_seq", "block_removals", ["removed_seq"])
    op.drop_index("ix_placements_worker", "placements")
    op.create_index("ix_placements_worker", "placements", PLACEMENT_ORDER)
    op.execute(BLOCK_RESIDENCY)
    views._create_views()


def downgrade() -> None:
    views = _load("0008_compact_residency.py", "kvledger_migration_0008")
    previous = _load("0009_stays_in_seq_order.py", "kvledger_migration_0009")
    views._drop_views()
    op.execute("DROP VIEW block_residency")
    previous._stays_table("block_stays_next", True)
    previous._removals_table("block_removals_next", True)
    stays = ", ".join(previous.STAY_COLUMNS)
    op.execute(f"INSERT INTO block_stays_next ({stays}) SELECT {stays} FROM block_stays ORDER BY stored_seq, slot")
    # Each run back to a row per slot.
    op.execute(
        "INSERT INTO block_removals_next (stored_seq, removed_seq, removed_ts, slot, removal_cause) "
        "WITH RECURSIVE slots (stored_seq, slot, last_slot, removed_seq, removed_ts, removal_cause) AS ("
        " SELECT stored_seq, first_slot, last_slot, removed_seq, removed_ts, removal_cause FROM block_removals"
        " UNION ALL"
        " SELECT stored_seq, slot + 1, last_slot, removed_seq, removed_ts, removal_cause FROM slots WHERE slot < last_slot"
        ") SELECT stored_seq, removed_seq, removed_ts, slot, removal_cause FROM slots ORDER BY stored_seq, slot"
    )
    _rename_new_tables()
    op.create_index("ix_stays_placement", "block_stays", ["placement_id", "stored_seq"])
    op.create_index("ix_stays_engine_hash", "block_stays", ["engine_hash"])
    op.create_index("ix_stays_sequence_hash", "block_stays", ["sequence_hash"])
    op.create_index("ix_removals_removed_seq", "block_removals", ["removed_seq"])
    op.drop_index("ix_placements_worker", "placements")
    op.create_index("ix_placements_worker", "placements", ["publisher", "dp_rank", "tier"])
    op.execute(previous.BLOCK_RESIDENCY)
    views._create_views()
