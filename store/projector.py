"""The projector: KV_EVENTS (and KV_DECISIONS, KV_DEAD_LETTERS) into SQL, exactly once.

A fetched batch of messages is folded in memory, written in one transaction together
with the checkpoint (the last ledger seq), and only then acknowledged. When the database
fails, nothing is acknowledged; the fold is rebuilt from SQL once the database is back,
and the consumer restarts after the checkpoint.

Exactly-once rests on identity, not position: a stream seq is a cursor that goes backwards
when JetStream loses acknowledged messages (store/cursor.py maps stream seqs to ledger
seqs and checks, before every bind, that the stream still holds what SQL committed). A
batch SQL already holds is dropped by the fold's per-worker (epoch, seq) rule, a decision
by its request id and record time, never because its seq number was seen before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import operator
import sqlite3
import time
from collections.abc import Callable

import attrs
import msgspec
import nats.errors
import psycopg
import sqlalchemy as sa
import sqlalchemy.exc
from nats.js import JetStreamContext

from kvledger.core.decision_codec import (
    ANSWER_DECODER, RELIED_PREFIX_HEADER, REQUEST_HEADER, SHADOW_HEADER, relied_prefix_from_header,
    request_from_header, shadow_from_header,
)
from kvledger.core.events import Provenance, RecordError, WorkerId, decode_batch, decode_dead_letter
from kvledger.core.fold import InventoryFold
from kvledger.core.settings import Settings
from kvledger.core.snapshot import StreamPosition
from kvledger.runtime.backoff import Backoff
from kvledger.runtime.metric_set import MetricSet
from kvledger.runtime.refetch import ask_refetch
from kvledger.store import tables
from kvledger.store.changes import ChangeBuilder, ChangeSet, ResidencyIndex
from kvledger.store.cursor import SqlIdentity, StreamCursor, Verdict, ledger_high, msg_id_of
from kvledger.store.jetstream import (
    ConsumerWatch, SkippedMessagesError, StreamRegressedError, bind_consumer, fetch, stream_seq,
)
from kvledger.store.fold_loader import PlacementIds, last_ingest_ts, load_fold, read_checkpoint
from kvledger.store.planner_statistics import PlannerStatistics
from kvledger.store.quality import QualityMetrics, QualityTracker, RelyOn, open_native_records
from kvledger.store.sharding import parse_shard
from kvledger.store.snapshots import SnapshotWriter
from kvledger.store.transactions import CheckpointMoved, CheckpointRow
from kvledger.store.writer import RecorderProcess, WriterError, encode_changes

log = logging.getLogger("kvledger.store")

EVENTS_DURABLE = "kvledger-store-events"
DECISIONS_DURABLE = "kvledger-store-decisions"
DEAD_LETTERS_DURABLE = "kvledger-store-dead-letters"
FETCH_TIMEOUT_S = 1.0
# Transactions the fold may run ahead of SQL: while the writer process starts (it imports
# its drivers and connects, a few tenths of a second) or a commit stalls, batches go on
# being folded, their transactions queued, each waiting for the one before it.
WRITES_AHEAD = 8

# Errors after which the database state is unknown: roll back, rebuild, retry. (Not
# OSError: TimeoutError is one, and a slow fetch is no reason to distrust the fold.)
DATABASE_ERRORS = (sa.exc.SQLAlchemyError, psycopg.Error, sqlite3.Error, WriterError, CheckpointMoved)
NATS_ERRORS = (nats.errors.Error, asyncio.TimeoutError)


class StoreMetrics(MetricSet):
    """The projector's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.messages = self.counter("kvledger_store_messages", "Stream messages projected", ["stream"])
        self.skipped = self.counter(
            "kvledger_store_skipped_messages", "Redelivered messages at or below the checkpoint", ["stream"]
        )
        self.other_shards = self.counter(
            "kvledger_store_other_shards_messages", "Messages passed over as another store shard's (store.shard)",
            ["stream"],
        )
        self.blocks = self.counter("kvledger_store_block_changes", "Block stores and removals written")
        self.dead_letters = self.counter("kvledger_store_dead_letters", "Records that could not be decoded", ["stream"])
        self.transactions = self.counter("kvledger_store_transactions", "Committed transactions", ["stream"])
        self.database_errors = self.counter("kvledger_store_database_errors", "Failed database transactions")
        self.nats_errors = self.counter("kvledger_store_nats_errors", "NATS errors that restarted a consumer")
        self.rewinds = self.counter(
            "kvledger_store_consumer_rewinds", "Consumers rebound at the checkpoint after delivering past held messages",
            ["stream"],
        )
        self.stream_losses = self.counter(
            "kvledger_store_stream_losses",
            "Times a stream no longer held what SQL committed (acknowledged messages lost): read again from the last agreement",
            ["stream"],
        )
        self.lost_ledger_seqs = self.counter(
            "kvledger_store_lost_ledger_seqs", "Ledger seqs SQL holds whose stream messages were lost", ["stream"]
        )
        self.aged_out = self.counter(
            "kvledger_store_aged_out_messages", "Stream messages removed by the stream's limits before they were projected",
            ["stream"],
        )
        self.refetch_requests = self.counter(
            "kvledger_store_refetch_requests",
            "Holes mid-stream in KV_EVENTS the fold found and asked ingest to fetch again (kvledger.runtime.refetch)")
        self.duplicates = self.counter(
            "kvledger_store_duplicate_messages", "Messages whose batch or decision SQL already held (by identity)",
            ["stream"],
        )
        self.snapshots = self.counter("kvledger_store_snapshots", "Inventory snapshots written")
        self.pruned = self.counter(
            "kvledger_store_pruned_rows", "History rows removed by the retention window", ["table"]
        )
        self.history_horizon = self.gauge(
            "kvledger_store_history_horizon_seq", "KV_EVENTS seq at or before which history was removed"
        )
        self.checkpoint = self.gauge("kvledger_store_checkpoint_seq", "Last committed stream seq", ["stream"])
        self.pending = self.gauge(
            "kvledger_store_pending_messages", "Messages the stream holds past the last one committed (store's lag)",
            ["stream"],
        )
        self.analyzes = self.counter(
            "kvledger_store_analyzes", "ANALYZE runs store started on the tables it fills (PostgreSQL; store/planner_statistics.py)"
        )
        self.uncertain_workers = self.gauge(
            "kvledger_store_uncertain_workers", "Workers whose inventory is uncertain (a hole, a lost replay)"
        )
        self.transaction_seconds = self.histogram(
            "kvledger_store_transaction_seconds", "Time to write one transaction", ["stream"]
        )
        self.quality = QualityMetrics(self)


async def _refuse_skips(
    watch: ConsumerWatch, messages: list, last_stream_seq: int, metrics: StoreMetrics, stream: str,
) -> list[int]:
    """The batch's stream seqs, in order. Raise (and count) SkippedMessagesError when a fetched batch jumps past
    messages the stream holds, and StreamRegressedError when it goes back to a stream seq already read (a
    restored consumer)."""
    seqs = [stream_seq(message) for message in messages]
    if seqs[0] <= last_stream_seq:
        raise StreamRegressedError(
            f"{stream} delivered seq {seqs[0]} after seq {last_stream_seq}: checking the stream against SQL"
        )
    try:
        await watch.check_no_skip(seqs, last_stream_seq)
    except SkippedMessagesError:
        metrics.rewinds.labels(stream).inc()
        raise
    return seqs



@attrs.define(eq=False)
class Fetched:
    """One fetch from a projector's consumer: every message (the last one is acknowledged for all), and those at
    ledger seqs not applied yet, as (message, stream seq, ledger seq)."""

    messages: list
    fresh: list[tuple[object, int, int]]


class StreamReader:
    """The fetch-and-skip loop both projectors read their stream with.

    Each fetch's messages come in order, checked for a jump past messages the stream holds and for a
    stream that went back (`_refuse_skips`); those at ledger seqs the projector applied already (a
    redelivery) are counted as skipped and left out. With `prefetch`, the next fetch is requested before
    the caller works on this one, so the server's reply arrives in the socket buffer meanwhile instead of
    after a round trip; every fetched batch is still handed out in order (with AckPolicy.ALL a skipped
    one would be acknowledged by the next ack). `close` cancels a fetch in flight.
    """

    def __init__(self, subscription, watch: ConsumerWatch, last_stream_seq: int, batch_size: int,
                 metrics: StoreMetrics, stream: str, ledger: Callable[[int], int], *, prefetch: bool) -> None:
        self.subscription, self.watch, self.batch_size = subscription, watch, batch_size
        self.metrics, self.stream, self.ledger = metrics, stream, ledger
        self.last_stream_seq = last_stream_seq
        self._fetching = asyncio.ensure_future(self._fetch()) if prefetch else None

    def _fetch(self):
        return fetch(self.subscription, self.batch_size, FETCH_TIMEOUT_S)

    async def next(self, applied: int) -> Fetched | None:
        """The next fetch, less what is at or below ledger seq `applied`; None when the stream had nothing
        (the fetch timed out: the caller does its idle work, then `idle`). An empty `messages`: a fetch cut short,
        as on shutdown."""
        try:
            if self._fetching is None:
                messages = await self._fetch()
            else:
                try:
                    messages = await self._fetching
                finally:
                    self._fetching = asyncio.ensure_future(self._fetch())
        except TimeoutError:  # nats-py raises its own and asyncio's; both are this
            return None
        self.watch.delivered()
        if not messages:
            return Fetched(messages, [])
        seqs = await _refuse_skips(self.watch, messages, self.last_stream_seq, self.metrics, self.stream)
        self.last_stream_seq = seqs[-1]
        fresh, ledger, skipped = [], self.ledger, 0
        for message, message_seq in zip(messages, seqs):
            seq = ledger(message_seq)
            if seq <= applied:
                skipped += 1
            else:
                fresh.append((message, message_seq, seq))
        if skipped:
            self.metrics.skipped.labels(self.stream).inc(skipped)
        return Fetched(messages, fresh)

    async def idle(self) -> bool:
        """Call after `next` returned None: whether the stream has nothing more for this reader. A fetch times out
        with messages pending when the process was too busy to read the reply within FETCH_TIMEOUT_S, so only the
        server's count of what it still holds says caught up."""
        return await self.watch.idle(self.last_stream_seq) == 0

    async def close(self) -> None:
        if self._fetching is not None:
            self._fetching.cancel()
            with contextlib.suppress(BaseException):
                await self._fetching


def _note_verdict(verdict: Verdict, stream: str, metrics: StoreMetrics) -> None:
    if verdict.opened is not None:
        metrics.stream_losses.labels(stream).inc()
        metrics.lost_ledger_seqs.labels(stream).inc(max(verdict.lost_last_ledger - verdict.lost_first_ledger + 1, 0))
    if verdict.aged_out is not None:
        metrics.aged_out.labels(stream).inc(verdict.aged_out[1] - verdict.aged_out[0] + 1)


def event_identities(connection: sa.Connection, ledger_seqs: list[int]) -> dict[int, str]:
    """What SQL recorded at each ledger seq (those with events): the batch's Nats-Msg-Id and ingest time.

    The ingest time makes it the record, not only the batch: a batch ingest publishes again
    after a loss is encoded again, at another time, so a reused seq that happens to hold the
    same batch as before still reads as another message.
    """
    e = tables.event_log.c
    rows = connection.execute(
        sa.select(e.stream_seq, e.publisher, e.dp_rank, e.epoch, e.engine_seq, e.provenance, e.ingest_ts)
        .where(e.stream_seq.in_(ledger_seqs), e.event_idx == 0)
    )
    return {
        row.stream_seq: _record_identity(
            f"{row.publisher}:{row.dp_rank}:{row.epoch}:{row.engine_seq}" if row.provenance == Provenance.NATIVE.value
            else f"{row.publisher}:{row.dp_rank}:retained:{row.epoch}:{row.engine_seq}",
            row.ingest_ts,
        )
        for row in rows
    }


def event_message_identity(message) -> str | None:
    """`event_identities`' text for a KV_EVENTS message (None: not a readable batch)."""
    try:
        batch = decode_batch(message.data)
    except RecordError:
        return None
    return _record_identity(batch.msg_id, batch.ingest_ts)


def _record_identity(msg_id: str, ingest_ts: float) -> str:
    return f"{msg_id}@{ingest_ts!r}"


def decision_identities(connection: sa.Connection, ledger_seqs: list[int]) -> dict[int, str]:
    """The request id SQL recorded at each ledger seq of KV_DECISIONS (its Nats-Msg-Id)."""
    d = tables.decisions.c
    rows = connection.execute(sa.select(d.stream_seq, d.request_id).where(d.stream_seq.in_(ledger_seqs)))
    return {row.stream_seq: row.request_id for row in rows}


def no_identities(connection: sa.Connection, ledger_seqs: list[int]) -> dict[int, str]:
    """For a stream whose rows keep no message identity: only a stream ending below SQL is noticed."""
    return {}


async def verify_stream(
    cursor: StreamCursor, js: JetStreamContext, checkpoint: int, sql_identity, *, name: str, metrics: StoreMetrics,
    message_identity=msg_id_of,
) -> Verdict:
    """`StreamCursor.verify`, its findings counted."""
    verdict = await cursor.verify(
        js, checkpoint, sql_identity, message_identity, name=name,
        ledger_high=lambda: ledger_high(cursor.engine, cursor.stream),
    )
    _note_verdict(verdict, cursor.stream, metrics)
    return verdict


def _recovered_row(batch, stream_seq: int, ledger_seq: int) -> dict:
    worker = batch.worker
    return {
        "publisher": worker.publisher, "dp_rank": worker.dp_rank, "provenance": batch.provenance.value,
        "epoch": batch.epoch, "engine_seq": batch.seq, "stream_seq": stream_seq, "ledger_seq": ledger_seq,
        "recovered_ts": time.time(),
    }  # fmt: skip


def _note_recovered(engine: sa.Engine, rows: list[dict]) -> None:
    """Insert `rows` into recovered_batches, keeping a row already there (the first recovery found)."""
    if engine.dialect.name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        from sqlalchemy.dialects.postgresql import insert
    with engine.begin() as connection:
        connection.execute(insert(tables.recovered_batches).on_conflict_do_nothing(), rows)


async def _wait_out_failure(error: Exception, stream: str, metrics: StoreMetrics, backoff: Backoff, stop: asyncio.Event) -> None:
    """Count and log a failed projector session, then back off; the caller starts a fresh session."""
    if isinstance(error, DATABASE_ERRORS):
        metrics.database_errors.inc()
        log.warning("database error on %s (%r); nothing acked, retrying", stream, error)
    else:
        metrics.nats_errors.inc()
        log.warning("NATS error on %s (%s); rebinding the consumer", stream, error)
    await backoff.wait(stop)


_NEVER_STALLED = object()


async def _wait_while(holds: Callable[[], bool], progress: asyncio.Event, mark: Callable[[], object],
                      limit_s: Callable[[], float]) -> float | None:
    """Wait while `holds()`, looking again whenever `progress` is set; give up once `limit_s()` seconds (read at
    each look) have passed with `mark()` (what the awaited projector has done) unchanged. A projector that
    goes on, however slowly, is waited for: on a large backlog one step of it can take seconds. None once it no
    longer holds, else the seconds waited since its last step when it gave up."""
    since, last = time.monotonic(), mark()
    while True:
        progress.clear()  # before the look, so progress made after it wakes the wait below
        if not holds():
            return None
        if mark() != last:
            since, last = time.monotonic(), mark()
        waited, limit = time.monotonic() - since, limit_s()
        if waited > limit:
            return waited
        try:
            await asyncio.wait_for(progress.wait(), limit - waited + 0.01)
        except TimeoutError:
            pass


class DecisionsHold:
    """Keeps the events fold from passing a decision's horizon before the decision reaches it.

    While store catches up on a backlog, its events projector runs far ahead of its decisions
    projector, and every decision would arrive after its horizon had passed in the fold, left to
    the SQL judge at many times the fold's cost. So the fold waits before an event ingested later
    than the newest committed decision plus the shortest horizon, while the decisions stream
    still has records for store, or its projector is still starting (at a start, the events
    projector may be ready first). A decisions projector that makes no progress for STALL_S
    (WRITING_STALL_S while a transaction of its is in flight: on a large ledger one can wait that
    long for the database, SQLite's lock among others) is not waited for (its decisions go to the
    SQL judge), so a broken decisions stream never stops events.
    """

    STALL_S = 2.0
    WRITING_STALL_S = 30.0

    def __init__(self, decisions: RowProjector, shortest_horizon_s: float) -> None:
        self.decisions = decisions
        self.shortest_horizon_s = shortest_horizon_s
        self._stalled_at: object = _NEVER_STALLED  # decisions' newest ts (None: none yet) when it last stalled us

    def holds(self, ingest_ts: float) -> bool:
        decisions = self.decisions
        if decisions.caught_up:
            return False
        newest = decisions.last_decided_ts
        if newest is not None and ingest_ts < newest + self.shortest_horizon_s:
            return False
        return self._stalled_at != newest

    async def wait(self, ingest_ts: float) -> None:
        decisions = self.decisions
        waited = await _wait_while(lambda: self.holds(ingest_ts), decisions.progressed,
                                   lambda: decisions.last_decided_ts,
                                   lambda: self.WRITING_STALL_S if decisions.writing else self.STALL_S)
        if waited is not None:
            self._stalled_at = decisions.last_decided_ts
            log.info("the decisions projector made no progress for %.0f s: events no longer wait for it "
                     "(its late decisions are judged in SQL)", waited)


class VerdictsBacklogHold:
    """Keeps the decisions projector from handing the events fold more decisions than it keeps waiting.

    The mirror of DecisionsHold: while store catches up on a backlog, its decisions projector (a few
    rows a decision) can run far ahead of its events projector (the fold and every block's rows),
    and each decision beyond the fold's limit (store.quality_max_pending) would be left to the SQL
    judge. So the decisions projector waits before a transaction that could take the fold past its
    limit, while the events projector folds batches that settle decisions. It does not wait while
    the events projector is not ready, has caught up (no event there could settle them), waits for
    the decisions itself (DecisionsHold: each would wait on the other), or has folded nothing for
    STALL_S (WRITING_STALL_S while its fold waits for its transactions in flight: on a large ledger
    they can take that long); its decisions then go to the SQL judge, as before this hold.
    """

    STALL_S = DecisionsHold.STALL_S
    WRITING_STALL_S = DecisionsHold.WRITING_STALL_S

    def __init__(self, events: EventsProjector, quality: QualityTracker, transaction_decisions: int) -> None:
        self.events = events
        self.quality = quality
        self.room = transaction_decisions * len(quality.horizons_ms)  # what one decisions transaction can add
        self._stalled_at: int | None = None  # the events' folded fetches when they last stalled us

    def holds(self) -> bool:
        events = self.events
        if not events.ready or events.caught_up or events.waiting_for_decisions:
            return False
        if self.quality.waiting + self.room <= self.quality.max_pending:
            return False
        return self._stalled_at != events.folded_fetches

    async def wait(self) -> None:
        events = self.events
        waited = await _wait_while(self.holds, events.folded, lambda: events.folded_fetches,
                                   lambda: self.WRITING_STALL_S if events.draining else self.STALL_S)
        if waited is not None:
            self._stalled_at = events.folded_fetches
            log.info("the events projector folded nothing for %.0f s: decisions no longer wait for it "
                     "(those beyond store.quality_max_pending are judged in SQL)", waited)


class EventsProjector:
    """KV_EVENTS → fold → event_log, block_residency, workers, uncertain_periods, checkpoint.

    With `store.shard` K/N (N > 1) it folds only the publishers its shard owns, through its
    own durable consumer and checkpoint row, and writes no snapshots: a snapshot of one
    shard's fold would hold only its workers, and decide would take it for the whole.
    """

    def __init__(self, settings: Settings, engine: sa.Engine, metrics: StoreMetrics,
                 quality: QualityTracker | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.quality = quality  # told about every applied batch, to judge decisions at their horizon
        self.hold: DecisionsHold | None = None  # set by StoreService beside a decisions projector
        # What the decisions projector's hold reads (VerdictsBacklogHold): fetches folded (`folded` is set at
        # each), whether the stream had nothing more at the last fetch, whether this waits on DecisionsHold.
        self.folded_fetches = 0
        self.folded = asyncio.Event()
        self.caught_up = False
        self.waiting_for_decisions = False
        self.draining = False  # the fold waits for its transactions in flight (VerdictsBacklogHold waits longer)
        self.stream = settings.stream.events_stream
        self.shard = parse_shard(settings.store.shard)
        self.durable = self.shard.durable(EVENTS_DURABLE)
        self.fold: InventoryFold | None = None  # None: must be rebuilt from SQL before use
        self.index: ResidencyIndex = {}
        self.ready = False
        self.snapshots: SnapshotWriter | None = None
        self.cursor = StreamCursor(engine, self.stream)
        self.last_folded = None  # the last KV_EVENTS message folded: a snapshot's position, read when one is written
        self.statistics = PlannerStatistics(engine)
        self._analyzing: asyncio.Task | None = None
        # The service's NATS connection, on which the holes the fold finds are asked for (kvledger.runtime.refetch).
        self.nc = None

    async def run(self, js: JetStreamContext, stop: asyncio.Event) -> None:
        backoff = Backoff()
        if self.shard.single:
            self.snapshots = SnapshotWriter(js, self.engine, self.settings.store, replicas=self.settings.stream.replicas)
        else:
            log.info("store shard %s of KV_EVENTS: no inventory snapshots are written (decide replays KV_EVENTS)", self.shard)
        recorder = None
        try:
            while not stop.is_set():
                try:
                    if recorder is None:
                        # Waited for by the first commit: its start (a process importing its
                        # modules and connecting, a few tenths of a second) overlaps the fold's
                        # rebuild, the consumer's binding and the first transactions' folding.
                        recorder = RecorderProcess(self.settings.db.url, self.stream, self.shard.checkpoint_name)
                    if self.fold is None:
                        self.fold, self.index = await asyncio.to_thread(load_fold, self.engine, self.shard)
                        log.info("fold rebuilt from SQL at stream seq %d", self.fold.inventory_seq)
                        if self.quality is not None:
                            self.quality.resume_at(
                                await asyncio.to_thread(last_ingest_ts, self.engine), self.fold.inventory_seq)
                        await asyncio.to_thread(self.statistics.read_catalog)
                    verdict = await verify_stream(
                        self.cursor, js, self.fold.inventory_seq, event_identities, name=self.shard.checkpoint_name,
                        metrics=self.metrics, message_identity=event_message_identity,
                    )
                    subscription = await bind_consumer(
                        js, self.stream, self.durable, verdict.start_stream_seq - 1, batch_size=self.settings.store.batch_size
                    )
                    self.ready = True
                    backoff.reset()
                    watch = ConsumerWatch(js, self.stream, self.durable)
                    await self._consume(subscription, watch, verdict.start_stream_seq - 1, recorder, stop)
                except DATABASE_ERRORS + NATS_ERRORS as error:
                    self.ready = False
                    if isinstance(error, DATABASE_ERRORS):
                        # The transaction may or may not have committed: the SQL checkpoint decides,
                        # through a fresh fold and a fresh writer (its connection may be broken).
                        self.fold = None
                        if recorder is not None:
                            await asyncio.to_thread(recorder.close)
                            recorder = None
                    # A NATS failure keeps the writer: starting one is a process start, which
                    # would delay every rebind (a lost stream's included) by a second or more.
                    await _wait_out_failure(error, self.stream, self.metrics, backoff, stop)
        finally:
            if recorder is not None:
                await asyncio.to_thread(recorder.close)
            if self._analyzing is not None:
                await self._analyzing
        self.ready = False

    async def _consume(self, subscription, watch: ConsumerWatch, last_stream_seq: int, recorder, stop: asyncio.Event) -> None:
        # Pipeline: while transaction n is written (by the writer process), batches after it are
        # fetched and folded, up to WRITES_AHEAD transactions ahead. The fold then runs ahead of
        # SQL, so any write failure throws the fold away; it is rebuilt from SQL, which holds
        # exactly what was committed (only committed batches are acknowledged).
        fold, builder = self.fold, ChangeBuilder(self.index, PlacementIds(self.engine))
        owns = None if self.shard.single else self.shard.owns
        quality = self.quality
        batch_size = self.settings.store.batch_size
        writing: asyncio.Task | None = None  # the newest transaction's; it waits for those before it
        ahead: collections.deque[asyncio.Task] = collections.deque()  # transactions not known committed
        # The next fetch is requested before this batch is folded (StreamReader's prefetch).
        reader = StreamReader(subscription, watch, last_stream_seq, batch_size, self.metrics, self.stream,
                              self.cursor.ledger, prefetch=True)
        try:
            while not stop.is_set():
                fetched = await reader.next(fold.inventory_seq)
                if fetched is None:
                    writing = await self._drain(writing, ahead)
                    if not recorder.ready:  # nothing to commit yet: a writer that cannot start is said now
                        await asyncio.to_thread(recorder.wait_ready)
                    await self._maybe_snapshot()
                    self.caught_up = await reader.idle()
                    self.folded.set()
                    continue
                messages = fetched.messages
                if not messages:  # a fetch cut short (e.g. on shutdown) returns nothing
                    continue
                self.caught_up = False
                changes = builder.begin(fold.inventory_seq + 1)
                fresh = others = 0
                duplicates_before = fold.counters["duplicate_batch"]
                recovered: list[dict] = []
                for message, message_seq, seq in fetched.fresh:
                    self.last_folded = message
                    if owns is not None and not owns(message.subject):
                        # Another shard's: not decoded, but passed, so the checkpoint moves over it
                        # and a restart does not fetch it again.
                        fold.inventory_seq = changes.last_seq = seq
                        others += 1
                        continue
                    fresh += 1
                    try:
                        batch = decode_batch(message.data)
                    except RecordError as error:
                        # A bad record must not stop the log: keep it whole, move past it.
                        builder.add_dead_letter(changes, seq, message.subject, str(error), message.data)
                        fold.inventory_seq = seq
                        self.metrics.dead_letters.labels(self.stream).inc()
                        continue
                    settling, verdicts, open_before = [], (), None
                    if quality is not None:
                        # Judged on the fold as of the seq before the first event written at or after
                        # their horizon (the SQL judge's horizon seq: a batch without events writes no
                        # event_log row, so it settles nothing). Those committed already are taken
                        # before any wait for more: the room they leave is what a decisions projector
                        # waiting on this fold (VerdictsBacklogHold) needs to go on.
                        if batch.events:
                            settling = quality.due(batch.ingest_ts)
                        if self.hold is not None and self.hold.holds(batch.ingest_ts):
                            self.waiting_for_decisions = True
                            self.folded.set()  # a decisions projector waiting on this one goes on
                            try:
                                await self.hold.wait(batch.ingest_ts)
                            except BaseException:
                                quality.put_back(settling)
                                raise
                            finally:
                                self.waiting_for_decisions = False
                            if batch.events:
                                settling += quality.due(batch.ingest_ts)
                        if settling:
                            verdicts = quality.judge(settling, fold, seq - 1)
                        open_before = open_native_records(batch, fold)
                    duplicates = fold.counters["duplicate_batch"]
                    facts, accepted = fold.begin(batch, seq)
                    for ready in fold.batches_to_apply(batch, accepted):  # with those a hole held back
                        for event in ready.events:
                            fold.apply_event(ready.worker, ready.provenance, event, seq, facts)
                    if quality is not None:
                        quality.after_event(facts, seq, batch.ingest_ts, open_before)
                    if not accepted and (
                        fold.counters["duplicate_batch"] != duplicates or self._recorded_before(batch)
                    ):
                        # SQL holds this batch already (read again after a rewind, or published
                        # twice): its rows are not written a second time.
                        fold.inventory_seq = changes.last_seq = seq
                        if self.cursor.generations and batch.events:
                            recovered.append(_recovered_row(batch, message_seq, seq))
                        if settling:
                            quality.put_back(settling)  # the next written event settles them
                        continue
                    builder.add_batch(changes, batch, seq, facts, fold)
                    if settling:
                        changes.verdicts.extend(verdicts)
                        quality.settled(settling, verdicts)
                self.folded_fetches += 1  # decisions waiting for the fold to make room look again
                self.folded.set()
                encoded = None
                if recovered:
                    # Before the transaction that moves the checkpoint past them, idempotently:
                    # a crash in between reads them again and notes them again.
                    await asyncio.to_thread(_note_recovered, self.engine, recovered)
                if fold.counters["duplicate_batch"] > duplicates_before:
                    self.metrics.duplicates.labels(self.stream).inc(fold.counters["duplicate_batch"] - duplicates_before)
                if others:
                    self.metrics.other_shards.labels(self.stream).inc(others)
                holes = fold.take_holes()
                if holes and self.nc is not None:
                    self.metrics.refetch_requests.inc(await ask_refetch(self.nc, holes, "store"))
                if fresh or others:
                    builder.finish(changes, fold)
                    if self.snapshots is not None:
                        self.snapshots.count(fresh)
                    # Encoded here, while the writer is still busy with the previous transaction:
                    # in the writer's thread it would queue for the GIL behind the next fold.
                    encoded = encode_changes(changes)
                if len(ahead) >= WRITES_AHEAD:
                    await self._drain(ahead.popleft())
                writing = asyncio.create_task(self._commit(recorder, changes, encoded, fresh, messages[-1], writing))
                ahead.append(writing)
                # Let the commit reach the writer now: awaiting an already-arrived fetch does not
                # yield, so without this the next batch would be folded before the write began.
                await asyncio.sleep(0)
                if not recorder.overlaps_folding:
                    writing = await self._drain(writing, ahead)
                if self.snapshots is not None and self.snapshots.due(fold.inventory_seq):
                    writing = await self._drain(writing, ahead)
                    await self._maybe_snapshot()
        finally:
            await reader.close()
            # Let a transaction in flight finish either way, so shutdown never leaves it unacked
            # (a write that already failed raises again here, the same error).
            await asyncio.shield(self._drain(writing))

    def _recorded_before(self, batch) -> bool:
        """Whether SQL's event log holds `batch` already: asked only of a batch the fold refused as late or
        of an older epoch (a duplicate the fold knows by itself), and only once the stream has lost messages,
        since only a stream read again can bring such a batch a second time."""
        if not self.cursor.generations or not batch.events:
            return False
        e = tables.event_log.c
        worker = batch.worker
        with self.engine.connect() as connection:
            return connection.execute(sa.select(e.stream_seq).where(
                e.publisher == worker.publisher, e.dp_rank == worker.dp_rank, e.provenance == batch.provenance.value,
                e.epoch == batch.epoch, e.engine_seq == batch.seq, e.event_idx == 0,
            ).limit(1)).first() is not None

    async def _drain(self, writing: asyncio.Task | None, ahead: collections.deque | None = None) -> None:
        """Wait for a transaction in flight (the newest: for every one); on a failure the fold is no longer trusted."""
        if ahead is not None:
            ahead.clear()
        if writing is not None:
            self.draining = True
            try:
                await writing
            except BaseException:
                self.fold = None  # folded past what SQL holds
                raise
            finally:
                self.draining = False
        return None

    async def _commit(self, recorder, changes: ChangeSet, encoded: bytes | None, fresh: int, last_message,
                      after: asyncio.Task | None) -> None:
        if after is not None:
            await after  # transactions commit, and are acknowledged, in stream order; one failed fails the rest
        if not recorder.ready:
            await asyncio.to_thread(recorder.wait_ready)
        if encoded is not None:
            started = time.perf_counter()
            await asyncio.to_thread(recorder.write, encoded)
            self.metrics.transaction_seconds.labels(self.stream).observe(time.perf_counter() - started)
            self.metrics.transactions.labels(self.stream).inc()
            self.metrics.messages.labels(self.stream).inc(fresh)
            self.metrics.blocks.inc(changes.blocks)
            self.metrics.checkpoint.labels(self.stream).set(changes.last_seq)
            if self.fold is not None:
                self.metrics.uncertain_workers.set(len(self.fold.uncertain_workers()))
            self.statistics.wrote(changes.rows)
        pending = last_message.metadata.num_pending
        self.metrics.pending.labels(self.stream).set(pending)
        if self.statistics.due(caught_up=pending == 0) and (self._analyzing is None or self._analyzing.done()):
            self._analyzing = asyncio.create_task(self._analyze())
        # Only after the commit: acking first could lose the batch in a crash.
        await last_message.ack()

    async def _analyze(self) -> None:
        """ANALYZE beside the projection (its own connection, in a thread); a failure only leaves it to autovacuum."""
        try:
            seconds = await asyncio.to_thread(self.statistics.analyze)
        except Exception as error:  # upkeep, not projection: whatever went wrong, the rows are committed
            log.warning("ANALYZE of store's tables failed (%s); autovacuum's statistics remain", error)
            return
        self.metrics.analyzes.inc()
        log.info("analyzed store's tables in %.2f s (about %d rows)", seconds, self.statistics.rows_at_last)

    async def _maybe_snapshot(self) -> None:
        if self.fold is not None and self.snapshots is not None and self.snapshots.due(self.fold.inventory_seq):
            try:
                last = self.last_folded
                position = None if last is None else StreamPosition(last.metadata.sequence.stream, msg_id_of(last) or "")
                await self.snapshots.write(self.fold, position)
                self.metrics.snapshots.inc()
            except DATABASE_ERRORS + NATS_ERRORS as error:  # a missed snapshot is retried later
                log.warning("snapshot at seq %d failed: %s", self.fold.inventory_seq, error)


# --- the small projectors: decisions and ingest's dead letters -------------------------

TableRow = tuple[sa.Table, dict]
RowMaker = Callable[[object, int], list[TableRow]]  # a message and its ledger seq → its rows, each with its table
Committed = Callable[[list[TableRow]], None]


def decision_rows(message, seq: int) -> list[TableRow]:
    """A KV_DECISIONS record (at ledger seq `seq`): its `decisions` row, and a `decision_blocks` row per block it relies on."""
    return decision_parts(message, seq)[0]


def decision_parts(message, seq: int) -> tuple[list[TableRow], RelyOn]:
    """`decision_rows`, and the sequence hashes each role relies on (unsigned, in position order): what the
    verdict tracker takes in, without reading them back out of the block rows."""
    decision = ANSWER_DECODER.decode(message.data)
    chosen = decision.chosen
    target = WorkerId.parse(decision.target) if decision.target else None
    target_prefix = decision.overlaps[decision.target].any if decision.target in decision.overlaps else 0
    headers = message.headers or {}
    relied = relied_prefix_from_header(headers.get(RELIED_PREFIX_HEADER))
    shadow = shadow_from_header(headers.get(SHADOW_HEADER))
    shadow_chosen = shadow.chosen if shadow is not None else None
    inflight = decision.inflight
    row = {
        "stream_seq": seq,
        "request_id": decision.request_id,
        "inventory_seq": decision.inventory_seq,
        "target": decision.target,
        "credited_blocks": decision.credited_blocks,
        "baseline_blocks": decision.baseline_blocks,
        "chosen_source": chosen.source if chosen else None,
        "chosen_dp_rank": chosen.dp_rank if chosen else None,
        "chosen_tier": chosen.tier if chosen else None,
        "chosen_transfer_blocks": chosen.transfer_blocks if chosen else None,
        "chosen_saving_ms": chosen.saving_ms if chosen else None,
        "reason": decision.reason,
        "backend": decision.backend,
        "settings_digest": decision.settings_digest,
        "uncertain_workers": _json_text(decision.uncertain_workers),
        "candidates": _json_text(decision.candidates),
        "worker_overlaps": _json_text(decision.overlaps),
        "decided_ts": message.metadata.timestamp.timestamp() if message.metadata.timestamp else time.time(),
        "target_publisher": target.publisher if target else None,
        "target_dp_rank": target.dp_rank if target else None,
        "target_prefix_blocks": min(target_prefix, len(relied)),
        "chosen_prefix_blocks": chosen.prefix_blocks if chosen else None,
        "shadow_settings_digest": shadow.settings_digest if shadow else None,
        "shadow_reason": shadow.reason if shadow else None,
        "shadow_target": shadow.target if shadow else None,
        "shadow_baseline_blocks": shadow.baseline_blocks if shadow else None,
        "shadow_source": shadow_chosen.source if shadow_chosen else None,
        "shadow_dp_rank": shadow_chosen.dp_rank if shadow_chosen else None,
        "shadow_tier": shadow_chosen.tier if shadow_chosen else None,
        "shadow_prefix_blocks": shadow_chosen.prefix_blocks if shadow_chosen else None,
        "shadow_transfer_blocks": shadow_chosen.transfer_blocks if shadow_chosen else None,
        "shadow_saving_ms": shadow_chosen.saving_ms if shadow_chosen else None,
        "inflight_blocks": inflight.blocks if inflight else 0,
        "inflight_credit": inflight.credit if inflight else None,
    }
    rows = [(tables.decisions, row)]
    rely_on: RelyOn = {}
    spans = [("target", 0, target_prefix)]
    if chosen is not None:
        spans.insert(0, ("source", decision.baseline_blocks, chosen.prefix_blocks))
    if shadow_chosen is not None:
        spans.append(("shadow_source", shadow.baseline_blocks, shadow_chosen.prefix_blocks))
    if inflight is not None:
        spans.append(("inflight", target_prefix, target_prefix + inflight.blocks))
    for role, first, end in spans:
        end = min(end, len(relied))
        if first < end:
            rely_on[role] = relied[first:end]
            rows += _relied_rows(seq, role, relied, first, end)
    request = request_from_header(headers.get(REQUEST_HEADER))
    if request is not None:
        rows.append((tables.decision_requests, {
            "stream_seq": seq, "block_size": request.block_size, "blocks": request.blocks,
            "requested_target": request.target, "fallback": request.fallback,
            "local_hashes": bytes.fromhex(request.local_hashes),
        }))
    return rows, rely_on


def _json_text(value: object) -> str:
    # Object keys sorted, so one worker set always reads as the same text in SQL.
    return msgspec.json.encode(value, order="deterministic").decode()


def _relied_rows(seq: int, role: str, relied: list[int], first: int, end: int) -> list[TableRow]:
    return [
        (tables.decision_blocks, {"stream_seq": seq, "role": role, "position": position,
                                  "sequence_hash": tables.to_signed(relied[position])})
        for position in range(first, end)
    ]


def ingest_dead_letter_row(message, seq: int) -> list[TableRow]:
    try:
        letter = decode_dead_letter(message.data)
    except RecordError as error:
        return [(tables.dead_letters, _undecodable_row("ingest", seq, message, str(error)))]
    return [(tables.dead_letters, {
        "source": "ingest", "stream_seq": seq, "subject": message.subject, "publisher": letter.publisher,
        "dp_rank": letter.dp_rank, "endpoint": letter.endpoint or None, "reason": letter.reason,
        "frames": len(letter.frames), "raw": message.data, "ingest_ts": letter.ingest_ts, "recorded_ts": time.time(),
    })]  # fmt: skip


def recorded_decisions(connection: sa.Connection, rows: list[TableRow]) -> set[int]:
    """The ledger seqs among `rows` whose decision SQL already holds: the same request id recorded at the same time.

    A request id alone is not enough (a client may reuse one after the de-duplication
    window); the record's stream timestamp is the server's and survives a re-read.
    """
    wanted = {(row["request_id"], row["decided_ts"]): row["stream_seq"] for table, row in rows if table is tables.decisions}
    if not wanted:
        return set()
    d = tables.decisions.c
    held = connection.execute(
        sa.select(d.request_id, d.decided_ts).where(d.request_id.in_({request_id for request_id, _ in wanted}))
    )
    return {wanted[key] for key in map(tuple, held) if key in wanted}


def _undecodable_row(source: str, seq: int, message, reason: str) -> dict:
    return {
        "source": source, "stream_seq": seq, "subject": message.subject, "publisher": None, "dp_rank": None,
        "endpoint": None, "reason": reason, "frames": 1, "raw": message.data, "ingest_ts": None, "recorded_ts": time.time(),
    }  # fmt: skip


@attrs.define
class RowProjector:
    """One stream → its rows (a few per message), checkpointed in the same transaction."""

    name: str  # checkpoint name
    stream: str
    durable: str
    make_rows: RowMaker
    engine: sa.Engine
    metrics: StoreMetrics
    batch_size: int
    committed: Committed | None = None  # told each transaction's rows once they are committed
    sql_identity: SqlIdentity = no_identities  # what SQL recorded at ledger seqs, to check the stream against
    # the ledger seqs among a transaction's rows that SQL already holds (None: nothing is held twice)
    already_recorded: Callable[[sa.Connection, list[TableRow]], set[int]] | None = None
    ready: bool = False
    cursor: StreamCursor | None = None
    # What the events projector's hold reads (DecisionsHold): the newest decision committed, and whether
    # the stream had nothing more for this projector at its last fetch.
    last_decided_ts: float | None = None
    caught_up: bool = False
    # set whenever either changes, so the hold wakes at once rather than on a timer
    progressed: asyncio.Event = attrs.field(factory=asyncio.Event)
    hold: VerdictsBacklogHold | None = None  # the decisions projector's, set by StoreService beside the events fold
    writing: bool = False  # a transaction in flight (DecisionsHold waits longer for one)

    async def run(self, js: JetStreamContext, stop: asyncio.Event) -> None:
        backoff = Backoff()
        self.cursor = StreamCursor(self.engine, self.stream)
        while not stop.is_set():
            try:
                checkpoint = await asyncio.to_thread(self._checkpoint)
                verdict = await verify_stream(
                    self.cursor, js, checkpoint, self.sql_identity, name=self.name, metrics=self.metrics,
                )
                after = verdict.start_stream_seq - 1
                subscription = await bind_consumer(js, self.stream, self.durable, after, batch_size=self.batch_size)
                self.ready = True
                self.progressed.set()
                backoff.reset()
                watch = ConsumerWatch(js, self.stream, self.durable)
                await self._consume(subscription, watch, checkpoint, after, stop)
            except DATABASE_ERRORS + NATS_ERRORS as error:
                self.ready = False
                self.progressed.set()
                await _wait_out_failure(error, self.stream, self.metrics, backoff, stop)
        self.ready = False
        self.progressed.set()

    def _checkpoint(self) -> int:
        with self.engine.connect() as connection:
            return read_checkpoint(connection, self.name)

    async def _consume(
        self, subscription, watch: ConsumerWatch, checkpoint: int, last_stream_seq: int, stop: asyncio.Event,
    ) -> None:
        reader = StreamReader(subscription, watch, last_stream_seq, self.batch_size, self.metrics, self.stream,
                              self.cursor.ledger, prefetch=False)
        while not stop.is_set():
            if self.hold is not None and self.hold.holds():
                await self.hold.wait()  # before the fetch: what is fetched is written and acknowledged at once
            fetched = await reader.next(checkpoint)
            if fetched is None:
                self.caught_up = await reader.idle()
                self.progressed.set()
                continue
            messages = fetched.messages
            if not messages:  # a fetch cut short (e.g. on shutdown) returns nothing
                continue
            self.caught_up = False
            rows: list[TableRow] = []
            fresh = 0
            committed = checkpoint  # where SQL's checkpoint must still be when this batch is written
            for message, _, seq in fetched.fresh:
                fresh += 1
                try:
                    rows += self.make_rows(message, seq)
                except (ValueError, KeyError, TypeError) as error:  # msgspec.ValidationError is a ValueError
                    # An unreadable decision is kept as a dead letter rather than stopping the stream.
                    self.metrics.dead_letters.labels(self.stream).inc()
                    rows.append((tables.dead_letters, _undecodable_row(self.name, seq, message, f"unreadable: {error}")))
                checkpoint = seq
            if fresh:
                self.writing = True
                try:
                    rows = await asyncio.to_thread(self._write, rows, checkpoint, committed)
                finally:
                    self.writing = False
                self.metrics.transactions.labels(self.stream).inc()
                self.metrics.messages.labels(self.stream).inc(fresh)
                self.metrics.checkpoint.labels(self.stream).set(checkpoint)
                if self.committed is not None:
                    self.committed(rows)
                decided = [row["decided_ts"] for table, row in rows if table is tables.decisions]
                if decided:
                    self.last_decided_ts = max(decided + [self.last_decided_ts or decided[0]])
            pending = messages[-1].metadata.num_pending
            self.metrics.pending.labels(self.stream).set(pending)
            await messages[-1].ack()
            self.caught_up = pending == 0
            self.progressed.set()

    def _write(self, rows: list[TableRow], checkpoint: int, after: int) -> list[TableRow]:
        """Write `rows` (less those SQL already holds) and the checkpoint in one transaction, over SQL's checkpoint
        at `after` (CheckpointMoved otherwise); return what was written."""
        with self.engine.begin() as connection:
            # Only a stream read again after a loss can bring a record SQL holds (within one
            # generation a redelivery is below the checkpoint): asked only once there was one.
            if self.already_recorded is not None and self.cursor.generations:
                held = self.already_recorded(connection, rows)
                if held:
                    self.metrics.duplicates.labels(self.stream).inc(len(held))
                    rows = [(table, row) for table, row in rows if row["stream_seq"] not in held]
            by_table: dict[sa.Table, list[dict]] = {}
            for table, row in rows:
                by_table.setdefault(table, []).append(row)
            for table, table_rows in by_table.items():
                insert_rows(connection, table, table_rows)
            _save_checkpoint(connection, self.name, self.stream, checkpoint, after)
        return rows


def insert_rows(connection: sa.Connection, table: sa.Table, rows: list[dict]) -> None:
    """`rows` inserted into `table`. Where every row names the same columns and SQLAlchemy would pass each value as
    it is (no column has a bind processor for the dialect), through the driver's `executemany`, a tuple per row:
    SQLAlchemy's own processing of a dict per row was half the inserts' CPU (a decision relies on about 28 blocks,
    a `decision_blocks` row each). Otherwise as SQLAlchemy inserts them."""
    columns = tuple(rows[0])
    plain = _plain_columns(connection.dialect, table, columns)
    if plain is not None and all(len(row) == len(columns) for row in rows):
        try:
            values = list(map(operator.itemgetter(*columns), rows)) if len(columns) > 1 else [
                (row[columns[0]],) for row in rows]
        except KeyError:  # a row names another column: not one shape
            values = None
        if values is not None:
            connection.exec_driver_sql(plain, values)
            return
    connection.execute(table.insert(), rows)


@functools.lru_cache(maxsize=64)  # per engine's dialect, table and columns: a few in a store
def _plain_columns(dialect: sa.Dialect, table: sa.Table, columns: tuple[str, ...]) -> str | None:
    """The driver's INSERT of `columns` into `table`, or None where a column's type processes its values. A float
    column's processor only makes a number a float, which both databases do themselves for a column of doubles."""
    if any(not isinstance(table.c[name].type, sa.Float) and table.c[name].type.bind_processor(dialect) is not None
           for name in columns):
        return None
    marker = "?" if dialect.paramstyle == "qmark" else "%s"
    quote = dialect.identifier_preparer.quote
    return (f"INSERT INTO {quote(table.name)} ({', '.join(map(quote, columns))}) "
            f"VALUES ({', '.join([marker] * len(columns))})")


def _save_checkpoint(connection: sa.Connection, name: str, stream: str, seq: int, after: int) -> None:
    sqlite = connection.dialect.name == "sqlite"
    CheckpointRow(name, stream, seq, time.time(), "{}", after).write(
        lambda statement, values: connection.exec_driver_sql(statement if sqlite else statement.replace("?", "%s"), values)
    )
