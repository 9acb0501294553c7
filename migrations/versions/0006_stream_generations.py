"""Stream generations: a stream that lost acknowledged messages is read again past every ledger seq used.

JetStream can lose its acknowledged tail in a crash and reuse those seqs; SQL's seqs become
ledger seqs, equal to stream seqs until the first loss and mapped through this table after
it (store/cursor.py). Batches SQL held already that the stream delivered again are noted in
recovered_batches, so the audit can tell which exist only in SQL.

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
    op.create_table(
        "recovered_batches",
        sa.Column("publisher", sa.String(128), primary_key=True),
        sa.Column("dp_rank", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("provenance", sa.String(32), primary_key=True),
        sa.Column("epoch", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("engine_seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("stream_seq", sa.BigInteger, nullable=False),
        sa.Column("ledger_seq", sa.BigInteger, nullable=False),
        sa.Column("recovered_ts", sa.Double, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("recovered_batches")
    op.drop_table("stream_generations")
