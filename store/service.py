"""`kvledger store`: the store service, its projectors, snapshots, pruning, verdicts and health front.

The projectors themselves (KV_EVENTS into the inventory and its history; KV_DECISIONS and
ingest's dead letters into their tables) are in store/projector.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.js import JetStreamContext

from kvledger.core.settings import Settings
from kvledger.runtime.backoff import Backoff
from kvledger.runtime.http import HttpFront, health_routes
from kvledger.runtime.streams import dead_letters_stream, decisions_stream, ensure_stream, events_stream
from kvledger.runtime.system import install_stop_signals
from kvledger.store import tables
from kvledger.store.database import create_engine, require_current
from kvledger.store.gc_policy import young_collections_deferred
from kvledger.store.jetstream import connect
from kvledger.store.projector import (
    DATABASE_ERRORS, DEAD_LETTERS_DURABLE, DECISIONS_DURABLE, NATS_ERRORS, DecisionsHold, EventsProjector, RowProjector, StoreMetrics, TableRow, VerdictsBacklogHold, decision_identities, decision_parts, decision_rows, ingest_dead_letter_row, recorded_decisions,
)
from kvledger.store.pruning import HistoryPruner
from kvledger.store.quality import QualityTracker, RelyOn
from kvledger.store.sharding import parse_shard
from kvledger.store.verdicts import VerdictSweeper, pending_rows, register_horizons

log = logging.getLogger("kvledger.store")


class StoreService:
    """Everything `kvledger store` runs: three projectors, snapshots, and the health/metrics front.

    A shard other than 0 (`store.shard`) runs the events projector only: decisions, ingest's
    dead letters and history pruning are database-wide, so one store (shard 0) does them.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = StoreMetrics()
        self.metrics.expect("stream", [
            settings.stream.events_stream, settings.stream.decisions_stream, dead_letters_stream(settings.stream).name,
        ])
        self.engine = create_engine(settings.db.url)
        self.horizons_ms = settings.store.quality_horizons_ms
        # Judging as events are folded needs the whole inventory in one fold: one store, not
        # shards (sharded, the SQL judge settles every decision once all shards are past it).
        self.quality = QualityTracker(
            self.metrics.quality, self.horizons_ms, settings.store.quality_max_pending,
            settings.store.metrics_horizon_ms,
        ) if parse_shard(settings.store.shard).single and self.horizons_ms else None
        self.events = EventsProjector(settings, self.engine, self.metrics, self.quality)
        # What each decision made into rows and not yet committed relies on, by ledger seq, for the tracker
        self._rely_on: dict[int, RelyOn] = {}
        batch = settings.store.batch_size
        self.decisions = RowProjector(
            "decisions", settings.stream.decisions_stream, DECISIONS_DURABLE, self._decision_rows,
            self.engine, self.metrics, batch, self._decisions_committed if self.quality else None,
            decision_identities, recorded_decisions,
        )  # fmt: skip
        if self.quality is not None:
            # Neither projector runs so far ahead of the other that the fold could not judge: events wait
            # for decisions up to a horizon, decisions for the fold to make room for them.
            self.events.hold = DecisionsHold(self.decisions, min(self.horizons_ms) / 1000)
            self.decisions.hold = VerdictsBacklogHold(self.events, self.quality, batch)
        self.dead_letters = RowProjector(
            "dead_letters", dead_letters_stream(settings.stream).name, DEAD_LETTERS_DURABLE,
            ingest_dead_letter_row, self.engine, self.metrics, batch,
        )  # fmt: skip
        self.leads = self.events.shard.index == 0
        self.projectors = (self.events, self.decisions, self.dead_letters) if self.leads else (self.events,)
        self.pruner = HistoryPruner(
            self.engine, settings.store, events_stream=settings.stream.events_stream,
            decisions_stream=settings.stream.decisions_stream, metrics=self.metrics,
        )
        self.http_port: int | None = None

    def is_ready(self) -> bool:
        return all(projector.ready for projector in self.projectors)

    def _decision_rows(self, message, seq: int) -> list[TableRow]:
        """A decision's rows, and a pending verdict per configured horizon beside them."""
        if not self.horizons_ms:
            return decision_rows(message, seq)
        rows, rely_on = decision_parts(message, seq)
        if self.quality is not None:
            self._rely_on[seq] = rely_on
        return rows + pending_rows(rows, self.horizons_ms)

    def _decisions_committed(self, rows: list[TableRow]) -> None:
        """Hand the tracker the decisions just committed, with what each relies on. (What was made into
        rows for a transaction that failed is made again when its messages are fetched again.)"""
        decisions = [row for table, row in rows if table is tables.decisions]
        rely_on = self._rely_on
        self.quality.decisions_committed(decisions, [rely_on.get(row["stream_seq"], {}) for row in decisions])
        if decisions:
            newest = max(row["stream_seq"] for row in decisions)
            for seq in [seq for seq in rely_on if seq <= newest]:
                del rely_on[seq]

    async def run(self, stop: asyncio.Event) -> None:
        with young_collections_deferred():
            await self._run(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        # Refuse an old schema before touching NATS: the fix is a command, not a retry.
        await asyncio.to_thread(require_current, self.engine, self.settings.db.url)
        router = health_routes(self.is_ready, self.metrics.text)
        server = await HttpFront(router, self.settings.store.http_host, self.settings.store.http_port).start()
        self.http_port = server.port
        log.info("store http on port %d", self.http_port)
        try:
            connection = await connect(self.settings.nats, stop)
            if connection is None:
                return
            try:
                js = connection.jetstream()
                self.events.nc = connection
                await self._ensure_streams(js, stop)
                if self.leads and self.horizons_ms:
                    try:
                        await asyncio.to_thread(register_horizons, self.engine, self.horizons_ms)
                    except DATABASE_ERRORS as error:  # audits judge in SQL until a later start registers them
                        log.warning("could not record the verdict horizons (%s); continuing without", error)
                async with asyncio.TaskGroup() as group:
                    for projector in self.projectors:
                        group.create_task(projector.run(js, stop))
                    if self.leads:
                        group.create_task(self.pruner.run(stop))
                        if self.horizons_ms:
                            group.create_task(VerdictSweeper(self.engine, self.metrics.quality).run(stop))
            finally:
                # Not drain(): every ack has been awaited already, and drain would wait out
                # the pull requests still parked on the server.
                with contextlib.suppress(Exception):
                    await connection.close()
        finally:
            await server.close()
            self.engine.dispose()


    async def _ensure_streams(self, js: JetStreamContext, stop: asyncio.Event) -> None:
        """Make sure the three streams exist as specified, waiting out a NATS restart.

        Connected is not yet served: a nats-server killed just after store connected (or one
        still recovering JetStream) times the stream lookups out, and the store must then
        wait like its projectors do, not end. A stream that differs from the spec stays fatal.
        """
        backoff = Backoff()
        specs = (
            events_stream(self.settings.stream), dead_letters_stream(self.settings.stream),
            decisions_stream(self.settings.stream),
        )
        while not stop.is_set():
            try:
                for spec in specs:
                    await ensure_stream(js, spec)
                return
            except NATS_ERRORS as error:
                self.metrics.nats_errors.inc()
                log.warning("NATS error while making sure the streams exist (%s); retrying", error)
                await backoff.wait(stop)


async def serve(settings: Settings) -> None:
    """Run the store service until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    await StoreService(settings).run(stop)
