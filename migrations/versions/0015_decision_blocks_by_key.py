"""decision_blocks kept in its primary key's order (SQLite: WITHOUT ROWID).

A decision relies on about 28 blocks, a `decision_blocks` row each: the table holds more rows
than `block_stays`. As a rowid table, SQLite kept every row twice, once in the table and once
in the index of its primary key (0.86 GB and 0.71 GB of a 1 M-decision ledger, a tenth of it),
and wrote both on every insert. Keyed by (stream_seq, role, position) itself, the table is the
index. PostgreSQL keeps its table as it was: its heap has no such twin.

SQLite cannot change how a table is stored in place: the rows move to a new table, in key
order, and the views that read `decision_blocks` are made again over it.

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

COLUMNS = "stream_seq, role, position, sequence_hash"


def _rebuild(with_rowid: bool) -> None:
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return
    # Every view, whatever it reads: SQLite checks them all when a table is renamed.
    views = bind.exec_driver_sql("SELECT name, sql FROM sqlite_master WHERE type = 'view' ORDER BY rowid").all()
    for name, _ in reversed(views):
        op.execute(f"DROP VIEW {name}")
    op.create_table(
        "decision_blocks_next",
        sa.Column("stream_seq", sa.BigInteger, nullable=False, autoincrement=False),
        sa.Column("role", sa.String(32), nullable=False),
        sa.Column("position", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("sequence_hash", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("stream_seq", "role", "position"),
        sqlite_with_rowid=with_rowid,
    )
    op.execute(f"INSERT INTO decision_blocks_next ({COLUMNS}) SELECT {COLUMNS} FROM decision_blocks "
               "ORDER BY stream_seq, role, position")
    op.drop_table("decision_blocks")
    op.rename_table("decision_blocks_next", "decision_blocks")
    for _, sql in views:
        op.execute(sql)


def upgrade() -> None:
    _rebuild(with_rowid=False)


def downgrade() -> None:
    _rebuild(with_rowid=True)
