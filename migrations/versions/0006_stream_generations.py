"""Stream generations: a stream that lost acknowledged messages is read again past every ledger seq used.

JetStream can lose its acknowledged tail in a crash and reuse those seqs; SQL's seqs become
ledger seqs, equal to stream seqs until the first loss and mapped through this table after
it (store/cursor.py).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stream_generations",
        sa.Column("stream", sa.String(64), primary_key=True),
        sa.Column("generation", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("first_stream_seq", sa.BigInteger, nullable=False),
        sa.Column("ledger_offset", sa.BigInteger, nullable=False),
        sa.Column("lost_first_ledger_seq", sa.BigInteger, nullable=False),
        sa.Column("lost_last_ledger_seq", sa.BigInteger, nullable=False),
        sa.Column("stream_last_seq", sa.BigInteger, nullable=False),
        sa.Column("checkpoint_name", sa.String(64), nullable=False),
        sa.Column("detected_ts", sa.Double, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("stream_generations")
