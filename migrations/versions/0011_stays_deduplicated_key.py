"""PostgreSQL's stays without a primary key: one deduplicated index entry per stored batch.

A unique key (placement_id, stored_seq, slot) took one 32-byte index entry per stay, and
with every worker's range growing at once in the middle of the index its pages split
half-empty: 27 % of the database. A non-unique index on (placement_id, stored_seq) finds the
same range; PostgreSQL deduplicates it, so a batch's stays share one entry (a list of row
pointers). Nothing loses its guard: a stay is written in the transaction that adds its batch to
`event_log`, whose key refuses a batch twice. SQLite keeps its clustered primary key (the
table is the key there; there is no index beside it).

Revision ID: 0011
Revises: 0010
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_index("ix_stays_placement", "block_stays", ["placement_id", "stored_seq"])
        op.drop_constraint("block_stays_pkey", "block_stays", type_="primary")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_primary_key("block_stays_pkey", "block_stays", ["placement_id", "stored_seq", "slot"])
        op.drop_index("ix_stays_placement", "block_stays")
