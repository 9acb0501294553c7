"""The SQL schema of the audit database, as SQLAlchemy Core tables (docs/decide.md, the decision API).

Alembic's versions in `migrations/` create exactly these tables; a test compares the two.
Block hashes are u64 in the core and stored as signed 64-bit two's complement, because
neither SQLite nor PostgreSQL has an unsigned 64-bit integer that indexes.
"""

from __future__ import annotations

import sqlalchemy as sa

from kvledger.core.fold import REASON_LIMIT

U64 = 1 << 64
I64_LIMIT = 1 << 63

metadata = sa.MetaData()


def to_signed(value: int) -> int:
    """u64 → the signed 64-bit integer with the same bits (what SQL stores)."""
    return value - U64 if value >= I64_LIMIT else value


def to_unsigned(value: int) -> int:
    """Signed 64-bit from SQL → the u64 the core and the CLI speak."""
    return value + U64 if value < 0 else value


def parse_hash(text: str) -> int:
    """A block hash as a user types it: unsigned decimal, signed decimal or hex (`0x…`); returns u64."""
    cleaned = text.strip().replace("_", "")
    try:
        if cleaned.lower().startswith(("0x", "-0x")):
            value = int(cleaned, 16)
        else:
            value = int(cleaned, 10)
    except ValueError:
        raise ValueError(f"not a block hash: {text!r} (give unsigned or signed decimal, or hex 0x…)") from None
    if not -I64_LIMIT <= value < U64:
        raise ValueError(f"block hash {text!r} does not fit in 64 bits")
    return value % U64


_SEQ = sa.BigInteger
_HASH = sa.BigInteger
_TS = sa.Double
_PUBLISHER = sa.String(128)
_NAME = sa.String(32)
_OWNERSHIP = sa.String(128)

# One row per canonical event; a batch of n events has rows event_idx 0..n-1.
event_log = sa.Table(
    "event_log",
    metadata,
    sa.Column("stream_seq", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("event_idx", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("publisher", _PUBLISHER, nullable=False),
    sa.Column("dp_rank", sa.Integer, nullable=False),
    sa.Column("epoch", _SEQ, nullable=False),
    sa.Column("engine_seq", _SEQ, nullable=False),
    sa.Column("provenance", _NAME, nullable=False),
    sa.Column("kind", _NAME, nullable=False),  # stored | removed | cleared | gap
    sa.Column("tier", _NAME),
    sa.Column("block_count", sa.Integer, nullable=False),
    sa.Column("gap_reason", _NAME),
    sa.Column("gap_expected_seq", _SEQ),
    sa.Column("gap_received_seq", _SEQ),
    sa.Column("engine_ts", _TS, nullable=False),
    sa.Column("ingest_ts", _TS, nullable=False),
    # a store's or removal's KV-cache group and offload ownership (NULL for clears and gaps)
    sa.Column("group_idx", sa.Integer),
    sa.Column("ownership", _OWNERSHIP),
    sa.Index("ix_event_log_worker", "publisher", "dp_rank", "stream_seq"),
    sa.Index("ix_event_log_ingest_ts", "ingest_ts", "stream_seq"),
    # gaps are rare: a partial index finds them without scanning the log
    sa.Index("ix_event_log_gaps", "publisher", "dp_rank", "stream_seq", sqlite_where=sa.text("kind = 'gap'"), postgresql_where=sa.text("kind = 'gap'")),
)

# Where a block stays: one worker's tier, provenance, KV-cache group and ownership, with the
# kind and window the group's stores declared. Kept once here, not on every stay: a stay
# names its placement by `placement_id`, a small integer SQL assigns (store/fold_loader.py
# `PlacementIds`); a store shard adds only its own publishers' placements.
placements = sa.Table(
    "placements",
    metadata,
    sa.Column("placement_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("publisher", _PUBLISHER, nullable=False),
    sa.Column("dp_rank", sa.Integer, nullable=False),
    sa.Column("provenance", _NAME, nullable=False),
    sa.Column("tier", _NAME, nullable=False),
    sa.Column("group_idx", sa.Integer, nullable=False),
    sa.Column("ownership", _OWNERSHIP),
    sa.Column("kv_cache_spec_kind", _NAME),
    sa.Column("sliding_window", sa.Integer),
    # a worker's placements in id order: the as-of statement's ORDER BY, read without a sort
    sa.Index("ix_placements_worker", "publisher", "dp_rank", "tier", "placement_id"),
)

# One row per stay of a block in a placement, written once when the block is stored.
# (stored_seq, slot) is the fact's position in the log, so every replay produces the same rows.
# One worker's stays are one range of (placement_id, stored_seq): in SQLite the table itself,
# clustered on the primary key (placement_id, stored_seq, slot); in PostgreSQL a
# deduplicated index on (placement_id, stored_seq) beside a heap without a primary key
# (migration 0011): a batch's stays share one index entry, where a unique key took an entry of
# 32 bytes per stay in pages split half-empty, 27 % of the database. A stay is still written
# once: its rows go in the transaction that adds its batch to `event_log`, whose key refuses a
# batch twice. Columns widest first: PostgreSQL pads none. `refs` NULL means 1 and `unresolved`
# NULL means false: the common values take no bytes.
# A stay a replay reads apart (`ix_stays_flagged`); the same words in the queries that use the index.
STAYS_FLAGGED = "unresolved OR conflict_since IS NOT NULL"
block_stays = sa.Table(
    "block_stays",
    metadata,
    sa.Column("stored_seq", _SEQ, nullable=False),
    sa.Column("engine_hash", _HASH, nullable=False),
    sa.Column("sequence_hash", _HASH, nullable=False),
    sa.Column("parent_hash", _HASH),
    sa.Column("local_hash", _HASH, nullable=False),
    sa.Column("stored_ts", _TS, nullable=False),
    # stream seq from which a retained record disagreed with native topology (audit-only)
    sa.Column("conflict_since", _SEQ),
    sa.Column("slot", sa.Integer, nullable=False),
    sa.Column("placement_id", sa.Integer, nullable=False),
    sa.Column("refs", sa.Integer),  # announcements not yet removed, when more than one
    # a store without tokens whose block was unknown: hashes 0, kept for audit, never indexed
    sa.Column("unresolved", sa.Boolean),
    sa.PrimaryKeyConstraint("placement_id", "stored_seq", "slot").ddl_if(dialect="sqlite"),
    sa.Index("ix_stays_placement", "placement_id", "stored_seq").ddl_if(dialect="postgresql"),
    # The quality audit finds a decision's blocks by sequence hash. Engine hashes are not
    # indexed (migration 0010): the index cost a fifth of the bytes and of the writes, for
    # `kvledger audit block` alone, which reads the stays instead.
    sa.Index("ix_stays_sequence_hash", "sequence_hash"),
    # The few unresolved or conflicting stays, which a replay reads apart from the rest (migration 0014).
    sa.Index("ix_stays_flagged", "placement_id", "stored_seq", "slot", sqlite_where=sa.text(STAYS_FLAGGED),
             postgresql_where=sa.text(STAYS_FLAGGED)),
    sqlite_with_rowid=False,
)

# One row per run of stays that ended together: consecutive slots first_slot..last_slot of
# one stored batch in one placement, ended at one seq for one cause (an engine evicts the
# oldest blocks of a batch one after another, so a run is typically a whole batch). Inserted,
# never an UPDATE of the stays. removal_cause: removed | cleared | restart | resolved (an
# unresolved stay replaced, at that seq, by its resolved copy).
block_removals = sa.Table(
    "block_removals",
    metadata,
    sa.Column("stored_seq", _SEQ, nullable=False),
    sa.Column("removed_seq", _SEQ, nullable=False),
    sa.Column("removed_ts", _TS, nullable=False),
    sa.Column("placement_id", sa.Integer, nullable=False),
    sa.Column("first_slot", sa.Integer, nullable=False),
    sa.Column("last_slot", sa.Integer, nullable=False),
    sa.Column("removal_cause", _NAME, nullable=False),
    sa.PrimaryKeyConstraint("placement_id", "stored_seq", "first_slot"),
    sa.Index("ix_removals_removed_seq", "removed_seq"),  # history pruning walks closed stays by seq
    sqlite_with_rowid=False,
)


def run_covers_stay() -> sa.ColumnElement[bool]:
    """A run of `block_removals` covers a stay of `block_stays`: the stay ended then (the view's join condition)."""
    ends, stays = block_removals.c, block_stays.c
    return sa.and_(
        ends.placement_id == stays.placement_id, ends.stored_seq == stays.stored_seq,
        ends.first_slot <= stays.slot, ends.last_slot >= stays.slot,
    )


# The view `block_residency` (migrations 0008-0011) joins the three: one row per stay of a block on
# a worker's tier, as the audit reads it. Inventory as of seq S is
# `stored_seq <= S AND (removed_seq IS NULL OR removed_seq > S)`. Described here, outside
# `metadata`, so code can select from it; the migrations create it.
views = sa.MetaData()
block_residency = sa.Table(
    "block_residency",
    views,
    sa.Column("stored_seq", _SEQ),
    sa.Column("slot", sa.Integer),
    sa.Column("publisher", _PUBLISHER),
    sa.Column("dp_rank", sa.Integer),
    sa.Column("tier", _NAME),
    sa.Column("provenance", _NAME),
    sa.Column("engine_hash", _HASH),
    sa.Column("sequence_hash", _HASH),
    sa.Column("parent_hash", _HASH),
    sa.Column("local_hash", _HASH),
    sa.Column("stored_ts", _TS),
    sa.Column("conflict_since", _SEQ),
    sa.Column("removed_seq", _SEQ),
    sa.Column("removed_ts", _TS),
    sa.Column("removal_cause", _NAME),
    sa.Column("group_idx", sa.Integer),
    sa.Column("ownership", _OWNERSHIP),
    sa.Column("kv_cache_spec_kind", _NAME),
    sa.Column("sliding_window", sa.Integer),
    sa.Column("refs", sa.Integer),
    sa.Column("unresolved", sa.Boolean),
    sa.Column("placement_id", sa.Integer),
)

# One row per worker: where each of its two announcement streams stands.
workers = sa.Table(
    "workers",
    metadata,
    sa.Column("publisher", _PUBLISHER, primary_key=True),
    sa.Column("dp_rank", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("epoch", _SEQ),
    sa.Column("engine_seq", _SEQ),
    sa.Column("uncertain_since", _SEQ),
    sa.Column("retained_epoch", _SEQ),
    sa.Column("retained_engine_seq", _SEQ),
    sa.Column("retained_uncertain_since", _SEQ),
    sa.Column("first_stream_seq", _SEQ, nullable=False),
    sa.Column("last_stream_seq", _SEQ, nullable=False),
    sa.Column("last_ingest_ts", _TS, nullable=False),
    sa.Column("counters", sa.Text, nullable=False),  # JSON: the fold's counters for this worker
    # JSON per provenance: each KV-cache group's declared kind and the groups seen per tier
    sa.Column("kv_cache_groups", sa.Text, nullable=False, server_default="{}"),
    # the stream seq of the liveness record that said ingest cannot reach the engine (NULL: reachable)
    sa.Column("unreachable_since", _SEQ),
    sa.Column("retained_unreachable_since", _SEQ),
)

# Periods during which ingest could not reach a worker's engine (docs/ingest.md, liveness):
# from the liveness record that said so to the one that said it answered again (NULL: still).
# since_ts / until_ts are when the change began (the SUB connection dropped, the engine
# answered), not when the record was written.
unreachable_periods = sa.Table(
    "unreachable_periods",
    metadata,
    sa.Column("publisher", _PUBLISHER, primary_key=True),
    sa.Column("dp_rank", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("provenance", _NAME, primary_key=True),
    sa.Column("since_seq", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("since_ts", _TS, nullable=False),
    sa.Column("reason", sa.String(REASON_LIMIT), nullable=False),
    sa.Column("until_seq", _SEQ),
    sa.Column("until_ts", _TS),
)

uncertain_periods = sa.Table(
    "uncertain_periods",
    metadata,
    sa.Column("publisher", _PUBLISHER, primary_key=True),
    sa.Column("dp_rank", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("provenance", _NAME, primary_key=True),
    sa.Column("since_seq", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("since_ts", _TS, nullable=False),
    # The fold keeps every uncertainty reason within REASON_LIMIT; a longer one would make
    # PostgreSQL refuse the transaction and the projector retry it forever.
    sa.Column("reason", sa.String(REASON_LIMIT), nullable=False),
    sa.Column("until_seq", _SEQ),
    sa.Column("until_ts", _TS),
    sa.Column("resolved_by", _NAME),
)

decisions = sa.Table(
    "decisions",
    metadata,
    sa.Column("stream_seq", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("request_id", sa.String(256), nullable=False),
    sa.Column("inventory_seq", _SEQ, nullable=False),
    sa.Column("target", sa.String(160)),
    sa.Column("credited_blocks", sa.Double, nullable=False),
    sa.Column("baseline_blocks", sa.Integer, nullable=False),
    sa.Column("chosen_source", _PUBLISHER),
    sa.Column("chosen_dp_rank", sa.Integer),
    sa.Column("chosen_tier", _NAME),
    sa.Column("chosen_transfer_blocks", sa.Integer),
    sa.Column("chosen_saving_ms", sa.Double),
    sa.Column("reason", _NAME, nullable=False),
    sa.Column("backend", _NAME, nullable=False),
    sa.Column("settings_digest", sa.String(128), nullable=False),
    sa.Column("uncertain_workers", sa.Text, nullable=False),  # JSON list
    sa.Column("candidates", sa.Text, nullable=False),  # JSON list, ranked
    sa.Column("worker_overlaps", sa.Text, nullable=False),  # JSON object
    sa.Column("decided_ts", _TS, nullable=False),
    # What the quality audit joins on: the target as a worker, the target's credited prefix
    # (blocks held natively on any local tier) and the chosen source's prefix.
    sa.Column("target_publisher", _PUBLISHER),
    sa.Column("target_dp_rank", sa.Integer),
    sa.Column("target_prefix_blocks", sa.Integer, nullable=False, server_default="0"),
    sa.Column("chosen_prefix_blocks", sa.Integer),
    # What reuse would have chosen under the shadow settings (decide.shadow), never in the reply:
    # its blocks are decision_blocks of role `shadow_source`.
    sa.Column("shadow_settings_digest", sa.String(128)),
    sa.Column("shadow_reason", _NAME),
    sa.Column("shadow_target", sa.String(160)),
    sa.Column("shadow_baseline_blocks", sa.Integer),
    sa.Column("shadow_source", _PUBLISHER),
    sa.Column("shadow_dp_rank", sa.Integer),
    sa.Column("shadow_tier", _NAME),
    sa.Column("shadow_prefix_blocks", sa.Integer),
    sa.Column("shadow_transfer_blocks", sa.Integer),
    sa.Column("shadow_saving_ms", sa.Double),
    # In-flight credit on the target (decide.inflight_ttl_ms): blocks past its native prefix,
    # decision_blocks of role `inflight`; routing credit, never execution credit.
    sa.Column("inflight_blocks", sa.Integer, nullable=False, server_default="0"),
    sa.Column("inflight_credit", sa.Double),
    sa.Index("ix_decisions_request_id", "request_id"),
    sa.Index("ix_decisions_decided_ts", "decided_ts"),  # history pruning finds old decisions by time
)

# One row per block a decision relies on: role `source` for the chosen source's transferred
# blocks (positions baseline_blocks .. chosen_prefix_blocks - 1), role `target` for the
# target's credited ones (0 .. target_prefix_blocks - 1), from the record's relied-prefix header.
decision_blocks = sa.Table(
    "decision_blocks",
    metadata,
    sa.Column("stream_seq", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("role", _NAME, primary_key=True),  # source | target
    sa.Column("position", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("sequence_hash", _HASH, nullable=False),
    sqlite_with_rowid=False,  # the key is the table: a rowid table kept every row twice (migration 0015)
)

# The request of each decision as its record carried it (header Kvledger-Request), so a
# what-if replay can answer it again: block size, the target and fallback it named (NULL:
# none), its block count, and its first local hashes (at most 16 384) as little-endian u64.
decision_requests = sa.Table(
    "decision_requests",
    metadata,
    sa.Column("stream_seq", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("block_size", sa.Integer, nullable=False),
    sa.Column("blocks", sa.Integer, nullable=False),
    sa.Column("requested_target", sa.String(160)),
    sa.Column("fallback", sa.String(160)),
    sa.Column("local_hashes", sa.LargeBinary, nullable=False),
)

# Each decision's verdict at each horizon store judges (`store.quality_horizons_ms`): was the
# chosen source still holding the transferred blocks on its tier (`stale`), the target its
# credited ones on some local tier (`lost_credit`), the shadow source its would-be transfer
# (`shadow_stale`), and how many in-flight blocks the target held, all at the horizon seq.
# Written once, in the transaction of the event that settles the decision (`judged_by` fold),
# or by the set-based SQL judge for a decision that came too late for that (`judged_by` sql).
decision_verdicts = sa.Table(
    "decision_verdicts",
    metadata,
    sa.Column("stream_seq", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("horizon_ms", sa.Double, primary_key=True),
    sa.Column("horizon_seq", _SEQ, nullable=False),
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
    sa.Column("judged_by", _NAME, nullable=False),
    sqlite_with_rowid=False,
)

# Decisions no verdict settles yet, per horizon, by when one is due (decided_ts + horizon):
# what the SQL judge looks at, so it never scans the decisions already judged.
verdicts_pending = sa.Table(
    "verdicts_pending",
    metadata,
    sa.Column("stream_seq", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("horizon_ms", sa.Double, primary_key=True),
    sa.Column("due_ts", _TS, nullable=False),
    sa.Index("ix_verdicts_pending_due", "due_ts"),
    sqlite_with_rowid=False,
)

# The horizons store judges, since when: an audit at one of them reads verdicts.
verdict_horizons = sa.Table(
    "verdict_horizons",
    metadata,
    sa.Column("horizon_ms", sa.Double, primary_key=True),
    sa.Column("since_ts", _TS, nullable=False),
)

# One row per consumer: the last stream seq whose effects are committed.
checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("stream", sa.String(64), nullable=False),
    sa.Column("stream_seq", _SEQ, nullable=False),
    sa.Column("updated_ts", _TS, nullable=False),
    sa.Column("counters", sa.Text, nullable=False),  # JSON
)

dead_letters = sa.Table(
    "dead_letters",
    metadata,
    sa.Column("source", _NAME, primary_key=True),  # events (undecodable KV_EVENTS record) | ingest (KV_DEAD_LETTERS)
    sa.Column("stream_seq", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("subject", sa.String(256), nullable=False),
    sa.Column("publisher", _PUBLISHER),
    sa.Column("dp_rank", sa.Integer),
    sa.Column("endpoint", sa.String(256)),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("frames", sa.Integer, nullable=False),
    sa.Column("raw", sa.LargeBinary, nullable=False),
    sa.Column("ingest_ts", _TS),
    sa.Column("recorded_ts", _TS, nullable=False),
)

snapshots = sa.Table(
    "snapshots",
    metadata,
    sa.Column("inventory_seq", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("bucket", sa.String(64), nullable=False),
    sa.Column("object_name", sa.String(128), nullable=False),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("blocks", sa.BigInteger, nullable=False),
    sa.Column("workers", sa.Integer, nullable=False),
    sa.Column("created_ts", _TS, nullable=False),
)

# One row per loss a projector found in a stream: from `first_stream_seq` on, the stream's
# messages are ledger seqs `stream seq + ledger_offset` (store/cursor.py). Ledger seqs
# lost_first_ledger_seq..lost_last_ledger_seq were committed from messages the stream no
# longer holds: their rows stay, and this row says so.
stream_generations = sa.Table(
    "stream_generations",
    metadata,
    sa.Column("stream", sa.String(64), primary_key=True),
    sa.Column("generation", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("first_stream_seq", _SEQ, nullable=False),
    sa.Column("ledger_offset", _SEQ, nullable=False),
    sa.Column("lost_first_ledger_seq", _SEQ, nullable=False),
    sa.Column("lost_last_ledger_seq", _SEQ, nullable=False),
    sa.Column("stream_last_seq", _SEQ, nullable=False),  # where the stream ended when the loss was found
    sa.Column("checkpoint_name", sa.String(64), nullable=False),  # the projector that found it
    sa.Column("detected_ts", _TS, nullable=False),
)

# One row per batch SQL held already that the stream delivered again after a loss (ingest
# republished it, or the stream kept it at another seq): where the stream holds it now. A
# batch in a generation's lost range without a row here exists only in SQL.
recovered_batches = sa.Table(
    "recovered_batches",
    metadata,
    sa.Column("publisher", _PUBLISHER, primary_key=True),
    sa.Column("dp_rank", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("provenance", _NAME, primary_key=True),
    sa.Column("epoch", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("engine_seq", _SEQ, primary_key=True, autoincrement=False),
    sa.Column("stream_seq", _SEQ, nullable=False),  # KV_EVENTS seq holding it now
    sa.Column("ledger_seq", _SEQ, nullable=False),  # the ledger seq that delivery mapped to (not written)
    sa.Column("recovered_ts", _TS, nullable=False),
)
