"""A block's KV-cache group and offload ownership: block identity is (tier, group, ownership, hash).

Adds to block_residency the group, its declared cache-spec kind and window, the
ownership (secondary offload tier), the count of announcements not yet removed, and the
flag of a store without tokens whose block was unknown; to event_log each store's and
removal's group and ownership; to workers each group's declared kind and the groups seen per tier. The audit views
show group, kind and ownership.
Existing rows become group 0 with no ownership, which is what version-1 records meant.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

NAME = sa.String(32)
OWNERSHIP = sa.String(128)

# As in 0002: hashes are stored signed and shown unsigned.
_UNSIGNED = {
    "sqlite": "printf('%u', {column})",
    "postgresql": "(CASE WHEN {column} < 0 THEN {column}::numeric + 18446744073709551616 ELSE {column}::numeric END)",
}


def _columns(dialect: str, *, with_groups: bool) -> str:
    unsigned = _UNSIGNED.get(dialect, _UNSIGNED["postgresql"])
    hashes = ",\n    ".join(
        f"{unsigned.format(column=column)} AS {column}" for column in ("engine_hash", "sequence_hash", "parent_hash")
    )
    groups = "group_idx, kv_cache_spec_kind, ownership, " if with_groups else ""
    columns = (
        f"publisher, dp_rank, tier, {groups}provenance,\n    "
        + hashes
        + ",\n    stored_seq, stored_ts, conflict_since IS NOT NULL AS conflict,"
        " removed_seq, removed_ts, COALESCE(removal_cause, 'stored') AS removal_cause"
    )
    if with_groups:
        columns += ", refs, unresolved"
    if dialect == "sqlite":
        columns = columns.replace(
            "printf('%u', parent_hash)", "CASE WHEN parent_hash IS NULL THEN NULL ELSE printf('%u', parent_hash) END"
        )
    return columns


def _create_views(with_groups: bool) -> None:
    columns = _columns(op.get_bind().dialect.name, with_groups=with_groups)
    op.execute(f"CREATE VIEW current_inventory AS SELECT {columns}\nFROM block_residency WHERE removed_seq IS NULL")
    op.execute(f"CREATE VIEW block_history AS SELECT {columns}\nFROM block_residency")


def _drop_views() -> None:
    op.execute("DROP VIEW block_history")
    op.execute("DROP VIEW current_inventory")


def upgrade() -> None:
    _drop_views()  # SQLite's batch mode rebuilds tables, which a view over them would block
    with op.batch_alter_table("block_residency") as table:
        table.add_column(sa.Column("group_idx", sa.Integer, nullable=False, server_default="0"))
        table.add_column(sa.Column("ownership", OWNERSHIP))
        table.add_column(sa.Column("kv_cache_spec_kind", NAME))
        table.add_column(sa.Column("sliding_window", sa.Integer))
        table.add_column(sa.Column("refs", sa.Integer, nullable=False, server_default="1"))
        table.add_column(sa.Column("unresolved", sa.Boolean, nullable=False, server_default=sa.false()))
    with op.batch_alter_table("event_log") as table:
        table.add_column(sa.Column("group_idx", sa.Integer))
        table.add_column(sa.Column("ownership", OWNERSHIP))
    with op.batch_alter_table("workers") as table:
        table.add_column(sa.Column("kv_cache_groups", sa.Text, nullable=False, server_default="{}"))
    _create_views(with_groups=True)


def downgrade() -> None:
    _drop_views()
    with op.batch_alter_table("workers") as table:
        table.drop_column("kv_cache_groups")
    with op.batch_alter_table("event_log") as table:
        table.drop_column("ownership")
        table.drop_column("group_idx")
    with op.batch_alter_table("block_residency") as table:
        for column in ("unresolved", "refs", "sliding_window", "kv_cache_spec_kind", "ownership", "group_idx"):
            table.drop_column(column)
    _create_views(with_groups=False)
