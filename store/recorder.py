"""Writing ChangeSets to SQL in one transaction each, and reading the fold back after a restart.

One contract, two recorders: SQLite through `executemany` on the sqlite3 connection (WAL
mode), PostgreSQL through psycopg 3 with COPY for the bulk rows (the stays as one binary
COPY made from their columns by numpy). Both only insert stays and runs of their ends; an
UPDATE touches a stay only for its rare reference count or conflict. Both write the
checkpoint in the same transaction as the rows, which is what makes projection
exactly-once: a crash either keeps both or neither.
"""

from __future__ import annotations

import abc
import json
import time
from collections.abc import Iterable

import numpy as np
import sqlalchemy as sa

from kvledger.events import Provenance, Tier, WorkerId
from kvledger.fold import BlockRecord, InventoryFold, ProvenancePosition
from store import tables
from store.changes import (
    DEAD_LETTER_COLUMNS,
    EVENT_LOG_COLUMNS,
    PLACEMENT_COLUMNS,
    REMOVAL_COLUMNS,
    STAY_COLUMNS,
    UNCERTAIN_COLUMNS,
    WORKER_COLUMNS,
    ChangeSet,
    NewStays,
    ResidencyIndex,
)
from store.sharding import SINGLE, Shard
from store.tables import to_unsigned

EVENTS_CHECKPOINT = "events"


def _insert(table: str, columns: Iterable[str]) -> str:
    columns = tuple(columns)
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def _upsert(table: str, columns: tuple[str, ...], key: tuple[str, ...], keep: tuple[str, ...] = ()) -> str:
    updates = ", ".join(f"{column} = excluded.{column}" for column in columns if column not in key + keep)
    return f"{_insert(table, columns)} ON CONFLICT ({', '.join(key)}) DO UPDATE SET {updates}"


CHECKPOINT_COLUMNS = ("name", "stream", "stream_seq", "updated_ts", "counters")
SQL_CHECKPOINT = _upsert("checkpoints", CHECKPOINT_COLUMNS, ("name",))
SQL_WORKER = _upsert("workers", WORKER_COLUMNS, ("publisher", "dp_rank"), keep=("first_stream_seq",))
SQL_EVENT = _insert("event_log", EVENT_LOG_COLUMNS)
SQL_STAY = _insert("block_stays", STAY_COLUMNS)
SQL_REMOVAL = _insert("block_removals", REMOVAL_COLUMNS)
SQL_UNCERTAIN = _insert("uncertain_periods", UNCERTAIN_COLUMNS)
SQL_DEAD_LETTER = _insert("dead_letters", DEAD_LETTER_COLUMNS)
# Ends every open stay of a worker's provenance on the named tiers begun before this transaction
# (`tier IN (...)`: a clear of one tier names it four times, a clear of all names each). Runs
# after the transaction's own removals, so a stay removed earlier in it keeps its own cause.
# (A run of one slot per stay: clears are rare.)
SQL_CLEAR = (
    "INSERT INTO block_removals (stored_seq, removed_seq, removed_ts, placement_id, first_slot, last_slot, removal_cause) "
    "SELECT s.stored_seq, ?, ?, s.placement_id, s.slot, s.slot, ? FROM block_stays s "
    "JOIN placements p ON p.placement_id = s.placement_id "
    "WHERE p.publisher = ? AND p.dp_rank = ? AND p.provenance = ? AND p.tier IN (?, ?, ?, ?) AND s.stored_seq < ? "
    "AND NOT EXISTS (SELECT 1 FROM block_removals r WHERE r.placement_id = s.placement_id "
    "AND r.stored_seq = s.stored_seq AND r.first_slot <= s.slot AND r.last_slot >= s.slot)"
)
SQL_REFERENCES = "UPDATE block_stays SET refs = ? WHERE placement_id = ? AND stored_seq = ? AND slot = ?"
SQL_CONFLICT = "UPDATE block_stays SET conflict_since = ? WHERE placement_id = ? AND stored_seq = ? AND slot = ?"
SQL_RESOLVE = (
    "UPDATE uncertain_periods SET until_seq = ?, until_ts = ?, resolved_by = ? "
    "WHERE publisher = ? AND dp_rank = ? AND provenance = ? AND until_seq IS NULL"
)


class Recorder(abc.ABC):
    """Owns one database connection and writes ChangeSets, each in one transaction."""

    overlaps_folding: bool  # whether a write may run in a thread while the next batch folds

    def __init__(self, engine: sa.Engine, stream: str, checkpoint_name: str = EVENTS_CHECKPOINT) -> None:
        self.stream = stream
        self.checkpoint_name = checkpoint_name  # the shard's (store.sharding.Shard.checkpoint_name)
        proxy = engine.raw_connection()
        self.connection = proxy.driver_connection
        # Detached: this connection lives and dies with the recorder, never back in the pool.
        proxy.detach()
        self._proxy = proxy

    def close(self) -> None:
        try:
            self._proxy.close()
        except Exception:  # closing a connection to a dead server may itself fail
            pass

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def write(self, changes: ChangeSet) -> None:
        checkpoint = (self.checkpoint_name, self.stream, changes.last_seq, time.time(), changes.checkpoint_counters)
        try:
            self._write(changes, checkpoint)
        except BaseException:
            try:
                self.connection.rollback()
            except Exception:
                pass
            raise

    @abc.abstractmethod
    def _write(self, changes: ChangeSet, checkpoint: tuple) -> None: ...

    def _updates(self, cursor, changes: ChangeSet, sql) -> None:
        # After the removals: a clear ends what is still open, and a stay ended earlier in the
        # transaction keeps its own cause. References and conflicts name stays already written.
        for statement, rows in (
            (SQL_CONFLICT, changes.conflicts),
            (SQL_REFERENCES, changes.references),
            (SQL_CLEAR, [(*row, changes.first_seq) for row in changes.clears]),
            (SQL_RESOLVE, changes.resolved_uncertain),
        ):
            if rows:
                cursor.executemany(sql(statement), rows)


class SqliteRecorder(Recorder):
    # sqlite3 binds parameters holding the GIL, row by row: overlapping it with folding
    # makes both threads wait on the GIL, so SQLite writes run between folds instead.
    overlaps_folding = False

    def __init__(self, engine: sa.Engine, stream: str, checkpoint_name: str = EVENTS_CHECKPOINT) -> None:
        super().__init__(engine, stream, checkpoint_name)
        self.connection.isolation_level = None  # explicit BEGIN/COMMIT below

    def _write(self, changes: ChangeSet, checkpoint: tuple) -> None:
        cursor = self.connection.cursor()
        cursor.execute("BEGIN IMMEDIATE")
        if changes.removals:
            cursor.executemany(SQL_REMOVAL, changes.removals)
        self._updates(cursor, changes, lambda statement: statement)
        if changes.event_rows:
            cursor.executemany(SQL_EVENT, changes.event_rows)
        if changes.new_stays:
            cursor.executemany(SQL_STAY, changes.new_stays.rows())
        _write_common(cursor, changes, checkpoint, lambda statement: statement)
        cursor.execute("COMMIT")


def _write_common(cursor, changes: ChangeSet, checkpoint: tuple, sql) -> None:
    uncertain = changes.uncertain_rows
    if uncertain:
        cursor.executemany(sql(SQL_UNCERTAIN), uncertain)
    if changes.worker_rows:
        cursor.executemany(sql(SQL_WORKER), changes.worker_rows)
    if changes.dead_letters:
        cursor.executemany(sql(SQL_DEAD_LETTER), changes.dead_letters)
    cursor.execute(sql(SQL_CHECKPOINT), checkpoint)


def _pg(statement: str) -> str:
    return statement.replace("?", "%s")


class PostgresRecorder(Recorder):
    # COPY hands whole buffers to libpq and waits on the network without the GIL.
    overlaps_folding = True

    def _write(self, changes: ChangeSet, checkpoint: tuple) -> None:
        connection = self.connection
        with connection.cursor() as cursor:
            if changes.removals:
                _copy(cursor, "block_removals", REMOVAL_COLUMNS, changes.removals)
            self._updates(cursor, changes, _pg)
            if changes.event_rows:
                _copy(cursor, "event_log", EVENT_LOG_COLUMNS, changes.event_rows)
            if changes.new_stays:
                with cursor.copy(f"COPY block_stays ({', '.join(STAY_COLUMNS)}) FROM STDIN (FORMAT binary)") as copy:
                    copy.write(stays_copy_binary(changes.new_stays))
            _write_common(cursor, changes, checkpoint, _pg)
        connection.commit()


def _copy(cursor, table: str, columns: tuple[str, ...], rows: Iterable) -> None:
    with cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # signature, flags, header extension length
_COPY_TRAILER = b"\xff\xff"
# STAY_COLUMNS' types in PostgreSQL's binary COPY (big-endian): a field is its length, then its bytes
_STAY_TYPES = (">i8", ">i8", ">i8", ">i8", ">i8", ">f8", ">i8", ">i4", ">i4", ">i4", "u1")
_NULLABLE = {"parent_hash": 3, "conflict_since": 6, "refs": 9, "unresolved": 10}


def stays_copy_binary(stays: NewStays) -> bytes:
    """The stays as PostgreSQL's binary COPY format, built a column at a time.

    A binary COPY row is fixed-size once it is known which of its fields are NULL (a NULL
    field is its length, -1, alone), so the rows are grouped by which rare values they
    carry and each group is one numpy record array; the order of rows does not matter to
    the table.
    """
    count = len(stays)
    values: list[np.ndarray] = [
        np.frombuffer(stays.stored_seq, dtype=np.int64),
        np.frombuffer(stays.engine_hash, dtype=np.int64),  # the unsigned bits, read as signed
        np.frombuffer(stays.sequence_hash, dtype=np.int64),
        np.frombuffer(stays.parent_hash, dtype=np.int64),
        np.frombuffer(stays.local_hash, dtype=np.int64),
        np.frombuffer(stays.stored_ts, dtype=np.float64),
        np.zeros(count, dtype=np.int64),
        np.frombuffer(stays.slot, dtype=np.int32),
        np.frombuffer(stays.placement_id, dtype=np.int32),
        np.zeros(count, dtype=np.int32),
        np.zeros(count, dtype=np.uint8),
    ]
    # which nullable fields each row carries, one bit each (parent_hash: most rows have one)
    bits = {column: 1 << n for n, column in enumerate(_NULLABLE.values())}
    carried = np.full(count, bits[_NULLABLE["parent_hash"]], dtype=np.int8)
    if stays.no_parent:
        carried[list(stays.no_parent)] = 0
    for name, rare in (("conflict_since", stays.conflict_since), ("refs", stays.refs)):
        if rare:
            rows = np.fromiter(rare.keys(), dtype=np.int64, count=len(rare))
            values[_NULLABLE[name]][rows] = np.fromiter(rare.values(), dtype=np.int64, count=len(rare))
            carried[rows] |= bits[_NULLABLE[name]]
    if stays.unresolved:
        rows = list(stays.unresolved)
        values[_NULLABLE["unresolved"]][rows] = 1
        carried[rows] |= bits[_NULLABLE["unresolved"]]
    parts = [_COPY_HEADER]
    patterns = np.unique(carried)
    for pattern in patterns:
        rows = None if len(patterns) == 1 else np.flatnonzero(carried == pattern)
        here = [column not in bits or bool(pattern & bits[column]) for column in range(len(_STAY_TYPES))]
        fields = [("fields", ">i2")]
        for column, kind in enumerate(_STAY_TYPES):
            fields.append((f"length{column}", ">i4"))
            if here[column]:
                fields.append((f"value{column}", kind))
        records = np.empty(count if rows is None else len(rows), dtype=np.dtype(fields))
        records["fields"] = len(_STAY_TYPES)
        for column, kind in enumerate(_STAY_TYPES):
            if here[column]:
                records[f"length{column}"] = np.dtype(kind).itemsize
                records[f"value{column}"] = values[column] if rows is None else values[column][rows]
            else:
                records[f"length{column}"] = -1
        parts.append(records.tobytes())
    parts.append(_COPY_TRAILER)
    return b"".join(parts)


class PlacementIds:
    """A placement's id, from SQL: found, or added in a transaction of its own the first time it is met.

    Called while folding, so once per placement and process (cached): a worker's tier, group and
    ownership. Only this projector adds its publishers' placements (store shards own disjoint
    publishers), so finding and adding need no lock; one added by a transaction that later fails
    is merely unused.
    """

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self._known: dict[tuple, int] = {}

    def __call__(self, values: tuple) -> int:
        found = self._known.get(values)
        if found is None:
            found = self._known[values] = self._find_or_add(values)
        return found

    def _find_or_add(self, values: tuple) -> int:
        p = tables.placements.c
        with self.engine.begin() as connection:
            found = connection.execute(sa.select(p.placement_id).where(
                *(p[name].is_not_distinct_from(value) for name, value in zip(PLACEMENT_COLUMNS, values))
            ).order_by(p.placement_id).limit(1)).scalar_one_or_none()
            if found is None:
                found = connection.execute(
                    tables.placements.insert().values(dict(zip(PLACEMENT_COLUMNS, values))).returning(p.placement_id)
                ).scalar_one()
        return found


def open_recorder(engine: sa.Engine, stream: str, checkpoint_name: str = EVENTS_CHECKPOINT) -> Recorder:
    if engine.dialect.name == "sqlite":
        return SqliteRecorder(engine, stream, checkpoint_name)
    if engine.dialect.name == "postgresql":
        return PostgresRecorder(engine, stream, checkpoint_name)
    raise ValueError(f"unsupported database {engine.dialect.name!r}: use SQLite or PostgreSQL")


# --- reading back -------------------------------------------------------------------


def read_checkpoint(connection: sa.Connection, name: str) -> int:
    seq = connection.execute(
        sa.select(tables.checkpoints.c.stream_seq).where(tables.checkpoints.c.name == name)
    ).scalar_one_or_none()
    return seq or 0


def last_ingest_ts(engine: sa.Engine) -> float | None:
    """Ingest time of the newest event SQL holds (None: none yet): where a fold rebuilt from SQL stands in stream time."""
    with engine.connect() as connection:
        return connection.execute(sa.select(sa.func.max(tables.workers.c.last_ingest_ts))).scalar_one()


def load_fold(engine: sa.Engine, shard: Shard = SINGLE) -> tuple[InventoryFold, ResidencyIndex]:
    """Rebuild the fold as it was at the shard's events checkpoint, from its open residency rows and workers.

    Records go back in (stored_seq, slot) order, the order the fold stored them, so
    topology ends as folding left it (the same rule as snapshot restore). Rows of other
    shards' publishers, in the same database, are left out.
    """
    fold = InventoryFold()
    index: ResidencyIndex = {}
    t = tables
    with engine.connect() as connection:
        row = connection.execute(
            sa.select(t.checkpoints.c.stream_seq, t.checkpoints.c.counters).where(t.checkpoints.c.name == shard.checkpoint_name)
        ).one_or_none()
        if row is None:
            return fold, index
        fold.inventory_seq = row.stream_seq
        fold.counters.update(json.loads(row.counters))
        # per worker: (positions, records in stored order, counters), for fold.restore_worker
        kept: dict[WorkerId, tuple[dict, list[BlockRecord], dict]] = {}
        for w in connection.execute(sa.select(t.workers)):
            if not shard.owns_publisher(w.publisher):
                continue
            groups = json.loads(w.kv_cache_groups)
            positions = {
                Provenance.NATIVE: ProvenancePosition(w.epoch, w.engine_seq, w.uncertain_since, groups.get("native", {})),
                Provenance.RETAINED: ProvenancePosition(
                    w.retained_epoch, w.retained_engine_seq, w.retained_uncertain_since, groups.get("retained", {}),
                ),
            }
            kept[WorkerId(w.publisher, w.dp_rank)] = (positions, [], json.loads(w.counters))
        s, p = t.block_stays.c, t.placements.c
        # The open stays, from the tables rather than the view: a stay no run of ends covers.
        rows = connection.execution_options(yield_per=50_000).execute(
            sa.select(
                s.stored_seq, s.slot, p.publisher, p.dp_rank, p.tier, p.provenance, s.engine_hash,
                s.sequence_hash, s.parent_hash, s.local_hash, s.conflict_since, p.group_idx, p.ownership,
                p.kv_cache_spec_kind, p.sliding_window, sa.func.coalesce(s.refs, 1), s.unresolved, s.placement_id,
            )
            .join_from(t.block_stays, t.placements, p.placement_id == s.placement_id)
            .where(~sa.exists().where(tables.run_covers_stay()))
            .order_by(s.stored_seq, s.slot)
        )
        tiers = {tier.value: tier for tier in Tier}
        provenances = {provenance.value: provenance for provenance in Provenance}
        workers: dict[tuple[str, int], WorkerId | None] = {}
        for (
            stored_seq, slot, publisher, dp_rank, tier_name, provenance_name, engine, sequence, parent, local, conflict,
            group, ownership, spec_kind, window, refs, unresolved, place,
        ) in rows:
            key = (publisher, dp_rank)
            if key in workers:
                worker = workers[key]
            else:  # None: another shard's publisher, whose rows share the database
                worker = workers[key] = WorkerId(publisher, dp_rank) if shard.owns_publisher(publisher) else None
            if worker is None:
                continue
            tier, provenance = tiers[tier_name], provenances[provenance_name]
            engine_hash = to_unsigned(engine)
            record = BlockRecord(
                worker, tier, provenance, engine_hash, to_unsigned(sequence),
                None if parent is None else to_unsigned(parent), to_unsigned(local), stored_seq, conflict is not None,
                group, ownership, spec_kind, window, refs, bool(unresolved),
            )  # fmt: skip
            kept[worker][1].append(record)
            index.setdefault((worker, provenance), {}).setdefault(tier, {})[record.key] = (stored_seq, slot, place)
    for worker, (positions, records, counters) in kept.items():
        fold.restore_worker(worker, positions, records, counters)
    return fold, index
