"""Audit views that show block hashes unsigned: current_inventory and block_history.

Revision ID: 0002
Revises: 0001
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Hashes are stored signed (two's complement); people compare them with what engines log,
# which is unsigned. SQLite has no u64, so it renders text with printf('%u'); PostgreSQL
# computes a numeric.
_UNSIGNED = {
    "sqlite": "printf('%u', {column})",
    "postgresql": "(CASE WHEN {column} < 0 THEN {column}::numeric + 18446744073709551616 ELSE {column}::numeric END)",
}


def _columns(dialect: str) -> str:
    unsigned = _UNSIGNED.get(dialect, _UNSIGNED["postgresql"])
    hashes = ",\n    ".join(
        f"{unsigned.format(column=column)} AS {column}" for column in ("engine_hash", "sequence_hash", "parent_hash")
    )
    return (
        "publisher, dp_rank, tier, provenance,\n    "
        + hashes
        + ",\n    stored_seq, stored_ts, conflict_since IS NOT NULL AS conflict,"
        " removed_seq, removed_ts, COALESCE(removal_cause, 'stored') AS removal_cause"
    )


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    columns = _columns(dialect)
    # A parent_hash of NULL stays NULL under both renderings except SQLite's printf, hence the CASE.
    if dialect == "sqlite":
        columns = columns.replace("printf('%u', parent_hash)", "CASE WHEN parent_hash IS NULL THEN NULL ELSE printf('%u', parent_hash) END")
    op.execute(f"CREATE VIEW current_inventory AS SELECT {columns}\nFROM block_residency WHERE removed_seq IS NULL")
    op.execute(f"CREATE VIEW block_history AS SELECT {columns}\nFROM block_residency")


def downgrade() -> None:
    op.execute("DROP VIEW block_history")
    op.execute("DROP VIEW current_inventory")
