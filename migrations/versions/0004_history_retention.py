"""History retention: the indexes that let store remove old history in bounded batches.

Closed residencies are removed by `removed_seq`, decisions by `decided_ts`; event-log rows
already have their primary key on `stream_seq` and an index on `ingest_ts`.

Revision ID: 0004
Revises: 0003
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_residency_removed_seq", "block_residency", ["removed_seq"])
    op.create_index("ix_decisions_decided_ts", "decisions", ["decided_ts"])


def downgrade() -> None:
    op.drop_index("ix_decisions_decided_ts", table_name="decisions")
    op.drop_index("ix_residency_removed_seq", table_name="block_residency")
