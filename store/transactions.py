"""Writing ChangeSets to SQL in one transaction each, through the database driver alone.

One contract, two recorders: SQLite through `executemany` on the sqlite3 connection (WAL
mode), PostgreSQL through psycopg 3 with COPY for the bulk rows (the stays as one binary
COPY made from their columns by numpy). Both only insert stays and runs of their ends; an
UPDATE touches a stay only for its rare reference count or conflict. Both write the
checkpoint in the same transaction as the rows, which is what makes projection
exactly-once: a crash either keeps both or neither.

No SQLAlchemy here: store's writer process (store/writer.py) imports this module and its
driver only, and is ready in a fraction of the time SQLAlchemy's import takes. What the
connection needs (its arguments, SQLite's pragmas) comes from store/database.py, which
opens every other connection with the same settings.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from kvledger.store.changes import (
    DEAD_LETTER_COLUMNS,
    EVENT_LOG_COLUMNS,
    REMOVAL_COLUMNS,
    STAY_COLUMNS,
    UNCERTAIN_COLUMNS,
    UNREACHABLE_COLUMNS,
    VERDICT_COLUMNS,
    WORKER_COLUMNS,
    ChangeSet,
    NewStays,
)

# Every SQLite connection of kvledger's: WAL so audit readers never block the projector.
SQLITE_CONNECT_ARGS = {"timeout": 30}
SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    # NORMAL in WAL mode loses at most the last commits on power loss, never consistency;
    # a process crash (kill -9) loses nothing committed.
    "PRAGMA synchronous=NORMAL",
    "PRAGMA foreign_keys=ON",
    # Hash indexes take inserts at random places; a page cache that holds them (rather
    # than SQLite's 2 MB default) keeps projection from waiting on reads.
    "PRAGMA cache_size=-262144",
)


def apply_sqlite_pragmas(connection) -> None:
    cursor = connection.cursor()
    for pragma in SQLITE_PRAGMAS:
        cursor.execute(pragma)
    cursor.close()


def connect_driver(dialect: str, args: tuple, kwargs: dict):
    """A DB-API connection opened as store/database.py's engines open theirs (`driver_connect_args`)."""
    if dialect == "sqlite":
        import sqlite3

        connection = sqlite3.connect(*args, **kwargs)
        apply_sqlite_pragmas(connection)
        return connection
    if dialect == "postgresql":
        import psycopg

        return psycopg.connect(*args, **kwargs)
    raise ValueError(f"unsupported database {dialect!r}: use SQLite or PostgreSQL")


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
SQL_UNREACHABLE = _insert("unreachable_periods", UNREACHABLE_COLUMNS)
SQL_DEAD_LETTER = _insert("dead_letters", DEAD_LETTER_COLUMNS)
SQL_REFERENCES = "UPDATE block_stays SET refs = ? WHERE placement_id = ? AND stored_seq = ? AND slot = ?"
SQL_CONFLICT = "UPDATE block_stays SET conflict_since = ? WHERE placement_id = ? AND stored_seq = ? AND slot = ?"
# A decision's verdict, and its pending row gone, in the transaction of the event that settles it
# (store/quality.py); a verdict the SQL judge wrote first is kept (the key is the decision and horizon).
SQL_VERDICT = _insert("decision_verdicts", VERDICT_COLUMNS) + " ON CONFLICT (stream_seq, horizon_ms) DO NOTHING"
SQL_SETTLED = "DELETE FROM verdicts_pending WHERE stream_seq = ? AND horizon_ms = ?"
SQL_REACHED_AGAIN = (
    "UPDATE unreachable_periods SET until_seq = ?, until_ts = ? "
    "WHERE publisher = ? AND dp_rank = ? AND provenance = ? AND until_seq IS NULL"
)
SQL_RESOLVE = (
    "UPDATE uncertain_periods SET until_seq = ?, until_ts = ?, resolved_by = ? "
    "WHERE publisher = ? AND dp_rank = ? AND provenance = ? AND until_seq IS NULL"
)


# --- the checkpoint moves only from where its projector left it ----------------------------
# A database restored from an older backup under a running store (its connections broken
# and reopened, or kept, as by pg_restore --clean) holds an older checkpoint than the fold
# or the decisions projector was built on; a transaction written over it would leave a
# hole below its rows. So the checkpoint row is written only over the one its projector
# last committed, and the transaction fails whole when SQL's is elsewhere.

# (a row at 0 reads as no checkpoint, as it does to the fold's rebuild)
SQL_CHECKPOINT_FIRST = SQL_CHECKPOINT + " WHERE checkpoints.stream_seq = 0"
SQL_CHECKPOINT_FROM = (
    "UPDATE checkpoints SET stream = ?, stream_seq = ?, updated_ts = ?, counters = ? WHERE name = ? AND stream_seq = ?"
)
SQL_CHECKPOINT_NOW = "SELECT stream_seq FROM checkpoints WHERE name = ?"


class CheckpointMoved(RuntimeError):
    """SQL's checkpoint is not where its projector last left it (the database went back to a backup, or another
    store moved it): nothing of the transaction is written, and the projector starts again from what SQL holds."""


class CheckpointRow(NamedTuple):
    """A transaction's checkpoint row, and the ledger seq SQL's row must hold for it to be written."""

    name: str
    stream: str
    stream_seq: int
    updated_ts: float
    counters: str
    after: int | None = None  # 0: no row yet; None: written over whatever SQL holds

    def write(self, execute: Callable[[str, tuple], object]) -> None:
        """Write the row with `execute(statement in '?' style, values)`, which returns its cursor;
        CheckpointMoved when SQL's checkpoint is not at `after`."""
        values = (self.name, self.stream, self.stream_seq, self.updated_ts, self.counters)
        if self.after is None:
            execute(SQL_CHECKPOINT, values)
            return
        if self.after > 0:
            written = execute(SQL_CHECKPOINT_FROM, (*values[1:], self.name, self.after)).rowcount
        else:
            written = execute(SQL_CHECKPOINT_FIRST, values).rowcount
        if written != 1:
            found = execute(SQL_CHECKPOINT_NOW, (self.name,)).fetchone()
            raise CheckpointMoved(
                f"checkpoint {self.name!r} of {self.stream} is at ledger seq {found[0] if found else 'none'} in SQL, "
                f"not at {self.after} where this store committed it last: the database was restored from an older "
                "backup (or another store writes it); projecting again from what SQL holds"
            )


class Recorder(abc.ABC):
    """Owns one DB-API connection and writes ChangeSets, each in one transaction."""

    overlaps_folding: bool  # whether a write may run in a thread while the next batch folds

    def __init__(self, connection, stream: str, checkpoint_name: str = EVENTS_CHECKPOINT,
                 close: Callable[[], None] | None = None) -> None:
        self.connection = connection
        self.stream = stream
        self.checkpoint_name = checkpoint_name  # the shard's (store.sharding.Shard.checkpoint_name)
        self._close = close or connection.close

    def close(self) -> None:
        try:
            self._close()
        except Exception:  # closing a connection to a dead server may itself fail
            pass

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def write(self, changes: ChangeSet, after: int | None = None) -> None:
        """Commit `changes` in one transaction; with `after`, only over SQL's checkpoint at that ledger seq
        (CheckpointMoved otherwise)."""
        checkpoint = CheckpointRow(
            self.checkpoint_name, self.stream, changes.last_seq, time.time(), changes.checkpoint_counters, after,
        )
        try:
            self._write(changes, checkpoint)
        except BaseException:
            try:
                self.connection.rollback()
            except Exception:
                pass
            raise

    @abc.abstractmethod
    def _write(self, changes: ChangeSet, checkpoint: CheckpointRow) -> None: ...

    def _updates(self, cursor, changes: ChangeSet, sql) -> None:
        # References and conflicts name stays already written.
        for statement, rows in (
            (SQL_CONFLICT, changes.conflicts),
            (SQL_REFERENCES, changes.references),
            (SQL_RESOLVE, changes.resolved_uncertain),
            (SQL_REACHED_AGAIN, changes.reached_again),
        ):
            if rows:
                cursor.executemany(sql(statement), rows)


class SqliteRecorder(Recorder):
    # sqlite3 binds parameters holding the GIL, row by row: overlapping it with folding
    # makes both threads wait on the GIL, so SQLite writes run between folds instead.
    overlaps_folding = False

    def __init__(self, connection, stream: str, checkpoint_name: str = EVENTS_CHECKPOINT,
                 close: Callable[[], None] | None = None) -> None:
        super().__init__(connection, stream, checkpoint_name, close)
        self.connection.isolation_level = None  # explicit BEGIN/COMMIT below

    def _write(self, changes: ChangeSet, checkpoint: CheckpointRow) -> None:
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


def _write_common(cursor, changes: ChangeSet, checkpoint: CheckpointRow, sql) -> None:
    uncertain = changes.uncertain_rows
    if uncertain:
        cursor.executemany(sql(SQL_UNCERTAIN), uncertain)
    if changes.new_unreachable:
        cursor.executemany(sql(SQL_UNREACHABLE), changes.new_unreachable)
    if changes.worker_rows:
        cursor.executemany(sql(SQL_WORKER), changes.worker_rows)
    if changes.dead_letters:
        cursor.executemany(sql(SQL_DEAD_LETTER), changes.dead_letters)
    if changes.verdicts:
        cursor.executemany(sql(SQL_VERDICT), changes.verdicts)
        cursor.executemany(sql(SQL_SETTLED), [(row[0], row[1]) for row in changes.verdicts])
    checkpoint.write(lambda statement, values: cursor.execute(sql(statement), values))


def _pg(statement: str) -> str:
    return statement.replace("?", "%s")


class PostgresRecorder(Recorder):
    # COPY hands whole buffers to libpq and waits on the network without the GIL.
    overlaps_folding = True

    def _write(self, changes: ChangeSet, checkpoint: CheckpointRow) -> None:
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


def recorder_for(dialect: str, connection, stream: str, checkpoint_name: str = EVENTS_CHECKPOINT,
                 close: Callable[[], None] | None = None) -> Recorder:
    """The recorder of `dialect` on an open DB-API connection, which it then owns."""
    if dialect == "sqlite":
        return SqliteRecorder(connection, stream, checkpoint_name, close)
    if dialect == "postgresql":
        return PostgresRecorder(connection, stream, checkpoint_name, close)
    raise ValueError(f"unsupported database {dialect!r}: use SQLite or PostgreSQL")

