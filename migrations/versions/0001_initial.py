"""The initial audit schema: event log, block residency, workers, decisions, checkpoints,
dead letters, snapshots.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Spelled out rather than imported from store.tables: a version must keep meaning what it
# meant when it shipped, whatever the tables module says later.
SEQ = sa.BigInteger
HASH = sa.BigInteger
TS = sa.Double
PUBLISHER = sa.String(128)
NAME = sa.String(32)


def upgrade() -> None:
    op.create_table(
        "event_log",
        sa.Column("stream_seq", SEQ, primary_key=True, autoincrement=False),
        sa.Column("event_idx", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("publisher", PUBLISHER, nullable=False),
        sa.Column("dp_rank", sa.Integer, nullable=False),
        sa.Column("epoch", SEQ, nullable=False),
        sa.Column("engine_seq", SEQ, nullable=False),
        sa.Column("provenance", NAME, nullable=False),
        sa.Column("kind", NAME, nullable=False),
        sa.Column("tier", NAME),
        sa.Column("block_count", sa.Integer, nullable=False),
        sa.Column("gap_reason", NAME),
        sa.Column("gap_expected_seq", SEQ),
        sa.Column("gap_received_seq", SEQ),
        sa.Column("engine_ts", TS, nullable=False),
        sa.Column("ingest_ts", TS, nullable=False),
    )
    op.create_index("ix_event_log_worker", "event_log", ["publisher", "dp_rank", "stream_seq"])
    op.create_index("ix_event_log_ingest_ts", "event_log", ["ingest_ts", "stream_seq"])
    op.create_index(
        "ix_event_log_gaps", "event_log", ["publisher", "dp_rank", "stream_seq"],
        sqlite_where=sa.text("kind = 'gap'"), postgresql_where=sa.text("kind = 'gap'"),
    )

    op.create_table(
        "block_residency",
        sa.Column("stored_seq", SEQ, primary_key=True, autoincrement=False),
        sa.Column("slot", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("publisher", PUBLISHER, nullable=False),
        sa.Column("dp_rank", sa.Integer, nullable=False),
        sa.Column("tier", NAME, nullable=False),
        sa.Column("provenance", NAME, nullable=False),
        sa.Column("engine_hash", HASH, nullable=False),
        sa.Column("sequence_hash", HASH, nullable=False),
        sa.Column("parent_hash", HASH),
        sa.Column("local_hash", HASH, nullable=False),
        sa.Column("stored_ts", TS, nullable=False),
        sa.Column("conflict_since", SEQ),
        sa.Column("removed_seq", SEQ),
        sa.Column("removed_ts", TS),
        sa.Column("removal_cause", NAME),
        sqlite_with_rowid=False,
    )
    op.create_index(
        "ix_residency_worker_removed", "block_residency", ["publisher", "dp_rank", "tier", "removed_seq"]
    )
    op.create_index("ix_residency_engine_hash", "block_residency", ["engine_hash"])

    op.create_table(
        "workers",
        sa.Column("publisher", PUBLISHER, primary_key=True),
        sa.Column("dp_rank", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("epoch", SEQ),
        sa.Column("engine_seq", SEQ),
        sa.Column("uncertain_since", SEQ),
        sa.Column("retained_epoch", SEQ),
        sa.Column("retained_engine_seq", SEQ),
        sa.Column("retained_uncertain_since", SEQ),
        sa.Column("first_stream_seq", SEQ, nullable=False),
        sa.Column("last_stream_seq", SEQ, nullable=False),
        sa.Column("last_ingest_ts", TS, nullable=False),
        sa.Column("counters", sa.Text, nullable=False),
    )

    op.create_table(
        "uncertain_periods",
        sa.Column("publisher", PUBLISHER, primary_key=True),
        sa.Column("dp_rank", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("provenance", NAME, primary_key=True),
        sa.Column("since_seq", SEQ, primary_key=True, autoincrement=False),
        sa.Column("since_ts", TS, nullable=False),
        sa.Column("reason", NAME, nullable=False),
        sa.Column("until_seq", SEQ),
        sa.Column("until_ts", TS),
        sa.Column("resolved_by", NAME),
    )

    op.create_table(
        "decisions",
        sa.Column("stream_seq", SEQ, primary_key=True, autoincrement=False),
        sa.Column("request_id", sa.String(256), nullable=False),
        sa.Column("inventory_seq", SEQ, nullable=False),
        sa.Column("target", sa.String(160)),
        sa.Column("credited_blocks", sa.Double, nullable=False),
        sa.Column("baseline_blocks", sa.Integer, nullable=False),
        sa.Column("chosen_source", PUBLISHER),
        sa.Column("chosen_dp_rank", sa.Integer),
        sa.Column("chosen_tier", NAME),
        sa.Column("chosen_transfer_blocks", sa.Integer),
        sa.Column("chosen_saving_ms", sa.Double),
        sa.Column("reason", NAME, nullable=False),
        sa.Column("backend", NAME, nullable=False),
        sa.Column("settings_digest", sa.String(128), nullable=False),
        sa.Column("uncertain_workers", sa.Text, nullable=False),
        sa.Column("candidates", sa.Text, nullable=False),
        sa.Column("worker_overlaps", sa.Text, nullable=False),
        sa.Column("decided_ts", TS, nullable=False),
    )
    op.create_index("ix_decisions_request_id", "decisions", ["request_id"])

    op.create_table(
        "checkpoints",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("stream", sa.String(64), nullable=False),
        sa.Column("stream_seq", SEQ, nullable=False),
        sa.Column("updated_ts", TS, nullable=False),
        sa.Column("counters", sa.Text, nullable=False),
    )

    op.create_table(
        "dead_letters",
        sa.Column("source", NAME, primary_key=True),
        sa.Column("stream_seq", SEQ, primary_key=True, autoincrement=False),
        sa.Column("subject", sa.String(256), nullable=False),
        sa.Column("publisher", PUBLISHER),
        sa.Column("dp_rank", sa.Integer),
        sa.Column("endpoint", sa.String(256)),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("frames", sa.Integer, nullable=False),
        sa.Column("raw", sa.LargeBinary, nullable=False),
        sa.Column("ingest_ts", TS),
        sa.Column("recorded_ts", TS, nullable=False),
    )

    op.create_table(
        "snapshots",
        sa.Column("inventory_seq", SEQ, primary_key=True, autoincrement=False),
        sa.Column("bucket", sa.String(64), nullable=False),
        sa.Column("object_name", sa.String(128), nullable=False),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column("blocks", sa.BigInteger, nullable=False),
        sa.Column("workers", sa.Integer, nullable=False),
        sa.Column("created_ts", TS, nullable=False),
    )


def downgrade() -> None:
    for table in (
        "snapshots", "dead_letters", "checkpoints", "decisions", "uncertain_periods", "workers",
        "block_residency", "event_log",
    ):
        op.drop_table(table)
