"""Decision verdicts: each decision judged once per configured horizon, kept as a row.

`decision_verdicts` holds what `kvledger audit quality` used to derive on every run by joining
each relied-on block to its stays: one row per decision and horizon, written by store in the
transaction of the event that settles it (or, for a decision that reached store after its
horizon, by the set-based SQL judge). `verdict_horizons` says which horizons store judges, and
since when; `verdicts_pending` holds the decisions that no verdict settles yet, by when one is due.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "decision_verdicts",
        sa.Column("stream_seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("horizon_ms", sa.Double, primary_key=True),
        sa.Column("horizon_seq", sa.BigInteger, nullable=False),
        sa.Column("stale", sa.SmallInteger),
        sa.Column("source_blocks", sa.Integer, nullable=False),
        sa.Column("source_gone", sa.Integer, nullable=False),
        sa.Column("source_gone_after_ms", sa.Double),
        sa.Column("first_eviction_ms", sa.Double),
        sa.Column("lost_credit", sa.SmallInteger),
        sa.Column("target_blocks", sa.Integer, nullable=False),
        sa.Column("target_gone", sa.Integer, nullable=False),
        sa.Column("target_gone_after_ms", sa.Double),
        sa.Column("shadow_stale", sa.SmallInteger),
        sa.Column("shadow_source_blocks", sa.Integer, nullable=False),
        sa.Column("shadow_source_gone", sa.Integer, nullable=False),
        sa.Column("shadow_source_gone_after_ms", sa.Double),
        sa.Column("shadow_first_eviction_ms", sa.Double),
        sa.Column("inflight_blocks", sa.Integer, nullable=False),
        sa.Column("inflight_gone", sa.Integer, nullable=False),
        sa.Column("judged_by", sa.String(32), nullable=False),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "verdicts_pending",
        sa.Column("stream_seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("horizon_ms", sa.Double, primary_key=True),
        sa.Column("due_ts", sa.Double, nullable=False),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_verdicts_pending_due", "verdicts_pending", ["due_ts"])
    op.create_table(
        "verdict_horizons",
        sa.Column("horizon_ms", sa.Double, primary_key=True),
        sa.Column("since_ts", sa.Double, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("verdict_horizons")
    op.drop_index("ix_verdicts_pending_due", "verdicts_pending")
    op.drop_table("verdicts_pending")
    op.drop_table("decision_verdicts")
