"""Shadow decisions, in-flight credit and the recorded requests a what-if replay answers again.

Adds to decisions what reuse would have chosen under the shadow settings (decide.shadow)
and the target's in-flight credit (decide.inflight_ttl_ms); a table of each decision's
request as its record carried it; and redefines decision_block_stays for the new roles of
decision_blocks (`shadow_source`: the shadow's transferred blocks on its source and tier;
`inflight`: the target's in-flight blocks, on any local tier of the target).
Decisions recorded before this version have no shadow, no in-flight blocks and no request.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_STAYS_0005 = """CREATE VIEW decision_block_stays AS
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

# Each block a decision relies on, beside every native stay of it on the worker it was relied
# on: a source's (live or shadow) chosen tier, or any local tier of the target.
DECISION_BLOCK_STAYS = """CREATE VIEW decision_block_stays AS
SELECT b.stream_seq, b.role, b.position, b.sequence_hash, d.inventory_seq, d.decided_ts,
       s.tier, s.stored_seq, s.removed_seq, s.removed_ts
FROM decision_blocks b
JOIN decisions d ON d.stream_seq = b.stream_seq
LEFT JOIN block_residency s
  ON s.sequence_hash = b.sequence_hash AND s.provenance = 'native'
 AND s.publisher = CASE b.role WHEN 'source' THEN d.chosen_source WHEN 'shadow_source' THEN d.shadow_source
                   ELSE d.target_publisher END
 AND s.dp_rank = CASE b.role WHEN 'source' THEN d.chosen_dp_rank WHEN 'shadow_source' THEN d.shadow_dp_rank
                 ELSE d.target_dp_rank END
 AND s.tier IN ('device', 'host', 'disk')
 AND (b.role IN ('target', 'inflight')
      OR s.tier = CASE b.role WHEN 'source' THEN d.chosen_tier ELSE d.shadow_tier END)"""

_SHADOW_COLUMNS = (
    ("shadow_settings_digest", sa.String(128)),
    ("shadow_reason", sa.String(32)),
    ("shadow_target", sa.String(160)),
    ("shadow_baseline_blocks", sa.Integer),
    ("shadow_source", sa.String(128)),
    ("shadow_dp_rank", sa.Integer),
    ("shadow_tier", sa.String(32)),
    ("shadow_prefix_blocks", sa.Integer),
    ("shadow_transfer_blocks", sa.Integer),
    ("shadow_saving_ms", sa.Double),
)


def upgrade() -> None:
    op.execute("DROP VIEW decision_block_stays")
    for name, kind in _SHADOW_COLUMNS:
        op.add_column("decisions", sa.Column(name, kind))
    op.add_column("decisions", sa.Column("inflight_blocks", sa.Integer, nullable=False, server_default="0"))
    op.add_column("decisions", sa.Column("inflight_credit", sa.Double))
    op.create_table(
        "decision_requests",
        sa.Column("stream_seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("block_size", sa.Integer, nullable=False),
        sa.Column("blocks", sa.Integer, nullable=False),
        sa.Column("requested_target", sa.String(160)),
        sa.Column("fallback", sa.String(160)),
        sa.Column("local_hashes", sa.LargeBinary, nullable=False),
    )
    op.execute(DECISION_BLOCK_STAYS)


def downgrade() -> None:
    op.execute("DROP VIEW decision_block_stays")
    op.drop_table("decision_requests")
    with op.batch_alter_table("decisions") as batch:
        for name in ("inflight_credit", "inflight_blocks", *reversed([name for name, _ in _SHADOW_COLUMNS])):
            batch.drop_column(name)
    op.execute(_STAYS_0005)
