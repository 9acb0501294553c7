"""Workers' reachability: whether ingest can reach each worker's engine, and since when.

ingest publishes a liveness record to KV_EVENTS when an engine stops answering and when it
answers again (docs/ingest.md, liveness). The workers row says since which stream seq a
worker is unreachable (NULL: reachable), per announcement stream; `unreachable_periods`
keeps every period, as `uncertain_periods` does for uncertainty.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("unreachable_since", sa.BigInteger))
        batch.add_column(sa.Column("retained_unreachable_since", sa.BigInteger))
    op.create_table(
        "unreachable_periods",
        sa.Column("publisher", sa.String(128), primary_key=True),
        sa.Column("dp_rank", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("provenance", sa.String(32), primary_key=True),
        sa.Column("since_seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("since_ts", sa.Double, nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("until_seq", sa.BigInteger),
        sa.Column("until_ts", sa.Double),
    )


def downgrade() -> None:
    op.drop_table("unreachable_periods")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("retained_unreachable_since")
        batch.drop_column("unreachable_since")
