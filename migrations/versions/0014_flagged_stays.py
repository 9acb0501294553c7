"""Flagged stays: a partial index of the stays that are unresolved or in conflict.

`kvledger replay` reads every stay's integer columns in bulk and then the few stays whose
`unresolved` or `conflict_since` is set (NULL for nearly all); without an index that second
read scanned the whole of `block_stays`, a sixth of a replay's time. The index holds only
those rows, so it costs the writes nothing else.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

FLAGGED = "unresolved OR conflict_since IS NOT NULL"


def upgrade() -> None:
    op.create_index("ix_stays_flagged", "block_stays", ["placement_id", "stored_seq", "slot"],
                    sqlite_where=sa.text(FLAGGED), postgresql_where=sa.text(FLAGGED))


def downgrade() -> None:
    op.drop_index("ix_stays_flagged", "block_stays")
