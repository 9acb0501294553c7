"""Decision quality: what each decision relied on, so an audit can tell whether it was still true.

Adds to decisions the target as a worker, the target's credited prefix and the chosen
source's prefix; a table of the blocks each decision relies on; and an index on
block_residency's sequence hash, by which the audit finds those blocks' stays.
Decisions recorded before this version have no blocks and count as relying on none.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


# Each block a decision relies on, beside every native stay of it on the worker it was relied
# on (the chosen source's tier, or any local tier of the target), or NULLs when none: the
# quality audit (store/audit.py) reads this with a horizon.
DECISION_BLOCK_STAYS = """CREATE VIEW decision_block_stays AS
SELECT b.stream_seq, b.role, b.position, b.sequence_hash, d.inventory_seq, d.decided_ts,
       s.tier, s.stored_seq, s.removed_seq, s.removed_ts
FROM decision_blocks b
JOIN decisions d ON d.stream_seq = b.stream_seq
LEFT JOIN block_residency s
  ON s.sequence_hash = b.sequence_hash AND s.provenance = 'native'
 AND s.publisher = CASE WHEN b.role = 'source' THEN d.chosen_source ELSE d.target_publisher END
 AND s.dp_rank = CASE WHEN b.role = 'source' THEN d.chosen_dp_rank ELSE d.target_dp_rank END
 AND s.tier IN ('device', 'host', 'disk')
 AND (b.role = 'target' OR s.tier = d.chosen_tier)"""


def upgrade() -> None:
    op.add_column("decisions", sa.Column("target_publisher", sa.String(128)))
    op.add_column("decisions", sa.Column("target_dp_rank", sa.Integer))
    op.add_column("decisions", sa.Column("target_prefix_blocks", sa.Integer, nullable=False, server_default="0"))
    op.add_column("decisions", sa.Column("chosen_prefix_blocks", sa.Integer))
    op.create_table(
        "decision_blocks",
        sa.Column("stream_seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("role", sa.String(32), primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("sequence_hash", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_residency_sequence_hash", "block_residency", ["sequence_hash"])
    op.execute(DECISION_BLOCK_STAYS)


def downgrade() -> None:
    op.execute("DROP VIEW decision_block_stays")
    op.drop_index("ix_residency_sequence_hash", table_name="block_residency")
    op.drop_table("decision_blocks")
    with op.batch_alter_table("decisions") as batch:
        for column in ("chosen_prefix_blocks", "target_prefix_blocks", "target_dp_rank", "target_publisher"):
            batch.drop_column(column)
