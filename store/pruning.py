"""History retention: closed residencies, event-log rows and decisions older than a window are removed.

The window is `store.history_retention_s` of ingest time (0 keeps everything). History is
cut at a stream seq, not at a time: the *horizon* is the last KV_EVENTS seq before the
first event ingested inside the window, so every event after it is kept, and a closed
residency is removed only when its removal is at or before the horizon. Inventory as of
any seq after the horizon is therefore exactly what it was before pruning, and the live
inventory (open residencies) is never touched. Decisions are cut the same way on their
own stream, by decision time.

Each transaction removes at most `store.prune_batch_seqs` seqs' worth of rows, and the
horizon reached is saved in `checkpoints` (`history_pruned`, `decisions_pruned`) in the
same transaction, so a query older than the horizon can say that history was pruned.
"""

from __future__ import annotations

import asyncio
import logging
import time

import attrs
import sqlalchemy as sa

from kvledger.core.settings import StoreSettings
from kvledger.store import tables

log = logging.getLogger("kvledger.store")

HISTORY_PRUNED = "history_pruned"  # checkpoint: KV_EVENTS history up to this seq is gone
DECISIONS_PRUNED = "decisions_pruned"  # checkpoint: KV_DECISIONS rows up to this seq are gone


class HistoryPruned(LookupError):
    """An audit question about a seq whose history was removed by the retention window."""


@attrs.frozen
class PruneResult:
    horizon: int  # KV_EVENTS seq: history at or before it is gone
    decisions_horizon: int
    rows: dict[str, int]  # rows removed, by table


def pruned_through(connection: sa.Connection, name: str = HISTORY_PRUNED) -> int:
    """The seq up to which history was removed (0: none)."""
    c = tables.checkpoints.c
    seq = connection.execute(sa.select(c.stream_seq).where(c.name == name)).scalar_one_or_none()
    return int(seq or 0)


def refuse_pruned(connection: sa.Connection, seq: int) -> None:
    """Raise HistoryPruned when the inventory as of `seq` can no longer be told."""
    horizon = pruned_through(connection)
    if seq <= horizon:
        raise HistoryPruned(
            f"history at or before KV_EVENTS seq {horizon} was pruned (store.history_retention_s); "
            f"seq {seq} is older: ask about a later seq"
        )


def _horizon(connection: sa.Connection, ts_column, seq_column, cutoff_ts: float) -> int:
    """The last seq before the first row inside the window (every row up to it is older)."""
    first_kept = connection.execute(sa.select(sa.func.min(seq_column)).where(ts_column >= cutoff_ts)).scalar()
    if first_kept is not None:
        return int(first_kept) - 1
    last = connection.execute(sa.select(sa.func.max(seq_column))).scalar()
    return int(last or 0)


def _save(connection: sa.Connection, name: str, stream: str, seq: int, now: float) -> None:
    c = tables.checkpoints.c
    updated = connection.execute(
        tables.checkpoints.update().where(c.name == name).values(stream_seq=seq, updated_ts=now)
    ).rowcount
    if not updated:
        connection.execute(tables.checkpoints.insert().values(
            name=name, stream=stream, stream_seq=seq, updated_ts=now, counters="{}"))


def prune_once(engine: sa.Engine, settings: StoreSettings, *, events_stream: str, decisions_stream: str,
               now: float | None = None) -> PruneResult:
    """Remove everything older than the window, in transactions of at most `prune_batch_seqs` seqs."""
    now = time.time() if now is None else now
    if not settings.history_retention_s:  # no window: all history is kept
        return PruneResult(0, 0, {"event_log": 0, "block_residency": 0, "decisions": 0})
    cutoff = now - settings.history_retention_s
    step = settings.prune_batch_seqs
    removed = {"event_log": 0, "block_residency": 0, "decisions": 0}
    log_c, decision_c = tables.event_log.c, tables.decisions.c
    stays_c, ends_c = tables.block_stays.c, tables.block_removals.c
    with engine.connect() as connection:
        horizon = _horizon(connection, log_c.ingest_ts, log_c.stream_seq, cutoff)
        decisions_horizon = _horizon(connection, decision_c.decided_ts, decision_c.stream_seq, cutoff)
        done, decisions_done = pruned_through(connection), pruned_through(connection, DECISIONS_PRUNED)
    while done < horizon:
        upto = min(done + step, horizon)
        with engine.begin() as connection:
            removed["event_log"] += connection.execute(tables.event_log.delete().where(
                log_c.stream_seq > done, log_c.stream_seq <= upto)).rowcount
            # Only closed stays, and only those closed at or before the horizon: the stays, then their ends.
            # (The batches the runs name narrow the delete to ranges of (placement_id, stored_seq); the run itself
            # says which slots.)
            ended = sa.select(ends_c.placement_id, ends_c.stored_seq).where(
                ends_c.removed_seq > done, ends_c.removed_seq <= upto)
            in_run = sa.exists().where(tables.run_covers_stay(), ends_c.removed_seq > done, ends_c.removed_seq <= upto)
            removed["block_residency"] += connection.execute(tables.block_stays.delete().where(
                sa.tuple_(stays_c.placement_id, stays_c.stored_seq).in_(ended), in_run)).rowcount
            connection.execute(tables.block_removals.delete().where(ends_c.removed_seq > done, ends_c.removed_seq <= upto))
            _save(connection, HISTORY_PRUNED, events_stream, upto, now)
        done = upto
    while decisions_done < decisions_horizon:
        upto = min(decisions_done + step, decisions_horizon)
        with engine.begin() as connection:
            removed["decisions"] += connection.execute(tables.decisions.delete().where(
                decision_c.stream_seq > decisions_done, decision_c.stream_seq <= upto)).rowcount
            connection.execute(tables.decision_blocks.delete().where(
                tables.decision_blocks.c.stream_seq > decisions_done, tables.decision_blocks.c.stream_seq <= upto))
            for table in (tables.decision_requests, tables.decision_verdicts, tables.verdicts_pending):
                connection.execute(table.delete().where(table.c.stream_seq > decisions_done, table.c.stream_seq <= upto))
            _save(connection, DECISIONS_PRUNED, decisions_stream, upto, now)
        decisions_done = upto
    return PruneResult(done, decisions_done, removed)


class HistoryPruner:
    """Runs `prune_once` every `store.prune_every_s` while the store runs (when a window is set)."""

    def __init__(self, engine: sa.Engine, settings: StoreSettings, *, events_stream: str, decisions_stream: str,
                 metrics) -> None:
        self._engine = engine
        self._settings = settings
        self._streams = {"events_stream": events_stream, "decisions_stream": decisions_stream}
        self._metrics = metrics

    async def run(self, stop: asyncio.Event) -> None:
        if not self._settings.history_retention_s:
            return
        while not stop.is_set():
            try:
                result = await asyncio.to_thread(prune_once, self._engine, self._settings, **self._streams)
            except sa.exc.SQLAlchemyError as error:  # the projector has its own retries; try again next round
                log.warning("history pruning failed (%s); trying again in %.0f s", error, self._settings.prune_every_s)
            else:
                for table, count in result.rows.items():
                    self._metrics.pruned.labels(table).inc(count)
                self._metrics.history_horizon.set(result.horizon)
            try:
                await asyncio.wait_for(stop.wait(), self._settings.prune_every_s)
            except TimeoutError:
                pass
