"""Liveness: whether the engine behind a stream is still there, told without mistaking an idle one for a gone one.

A ZMQ PUB sends nothing while its engine is idle, so silence proves nothing. Two things do:

- the SUB connection: ZMQ's socket monitor reports it dropped (the process died and its
  kernel closed the socket), or its ZMTP heartbeat went unanswered (the process froze, or
  its host vanished: the engine's ZMQ I/O thread answers heartbeats, so a live engine,
  however busy or idle, keeps its connection);
- the replay socket: a probe asking for batches from a seq no engine reaches, which a live
  engine answers at once with the end marker alone.

An engine is **unreachable** once its SUB connection has been down for `ingest.engine_timeout_s`
and its replay socket has not answered since (an engine without a replay socket: once the
connection has been down that long; it is reachable again only with its first batch, as
nothing else can tell what it holds). ingest then publishes a liveness record
(`kvledger.core.events.Reachability`, reachable false) to KV_EVENTS; when the engine answers
again (its SUB reconnects or its replay socket answers), a record saying reachable, then the
incarnation check (ingest/incarnation.py) decides continuation or restart.

An engine whose replay socket is gone while its PUB lives is reachable: its SUB connection
says it lives. What replay would have supplied it cannot, which the sequence rules make a
`Gap(replay_incomplete)` (the worker uncertain) where a batch is missed, and which the
unanswered probes and incomplete replays count.
"""

from __future__ import annotations

import asyncio
import time

from kvledger.core.events import EventBatch, Reachability
from kvledger.ingest.endpoints import StreamSource
from kvledger.ingest.replay_client import ReplayClient
from kvledger.ingest.subscriber import EngineSubscriber
from kvledger.runtime.lifetime import cancel_and_wait

# Reasons fit kvledger.core.fold.REASON_LIMIT (SQL sizes unreachable_periods.reason by it).
DISCONNECTED = "pub down, replay silent"
NEVER_CONNECTED = "no pub connection, replay silent"
PUB_CONNECTED = "pub connected"
REPLAY_ANSWERED = "replay answered"
BATCH_ARRIVED = "batch arrived"  # an engine without a replay socket: only its batches vouch for it


def heartbeat_ms(engine_timeout_s: float) -> int:
    """The SUB's ZMTP heartbeat interval: a quarter of the timeout, so a frozen engine's connection
    drops (three unanswered intervals) within the timeout, and is then counted like a dead one."""
    return max(50, int(engine_timeout_s * 1000 / 4))


def liveness_batch(
    source: StreamSource, epoch: int, next_seq: int, reachable: bool, reason: str, since_ts: float,
) -> tuple[EventBatch, str]:
    """The liveness record of a stream and its Nats-Msg-Id.

    It carries the stream's current (epoch, next seq) for the reader's orientation; the fold
    takes it outside the engine's sequence. Its Msg-Id adds the change and its ingest time:
    the next engine batch has the same (epoch, seq), and JetStream must not take one for a
    duplicate of the other.
    """
    batch = EventBatch(
        source.worker, epoch, next_seq, 0.0, time.time(), source.provenance, (Reachability(reachable, reason, since_ts),),
    )
    change = "reachable" if reachable else "unreachable"
    return batch, f"{batch.msg_id}:{change}:{batch.ingest_ts!r}"


class EngineWatch:
    """Asks whether one engine answers: its SUB connection, else a probe of its replay socket."""

    def __init__(self, subscriber: EngineSubscriber, replay: ReplayClient | None, timeout_s: float) -> None:
        self.subscriber = subscriber
        self.replay = replay
        self.timeout_s = timeout_s

    def silent_since(self) -> tuple[float, float]:
        """(loop time, wall clock) the engine's silence is counted from: when the SUB connection
        dropped, or now when none was ever made."""
        subscriber = self.subscriber
        if subscriber.disconnected_at is not None:
            return subscriber.disconnected_at, subscriber.disconnected_wall
        return asyncio.get_running_loop().time(), time.time()

    async def answers_by(self, deadline: float, least_s: float = 0.0) -> str | None:
        """Why the engine counts as alive (`PUB_CONNECTED`, `REPLAY_ANSWERED`), or None if it did not
        answer by `deadline` (loop time; waiting at least `least_s` for the replay socket)."""
        connected = self.subscriber.connected
        if connected.is_set():
            return PUB_CONNECTED
        window = max(deadline - asyncio.get_running_loop().time(), least_s)
        if window <= 0:
            return None
        waiting = [asyncio.ensure_future(connected.wait())]
        probe = asyncio.ensure_future(self.replay.probe(window)) if self.replay is not None else None
        if probe is not None:
            waiting.append(probe)
        try:
            pending = set(waiting)
            # A little past the probe's own window, so an answer at its very end still counts.
            async with asyncio.timeout(window + 0.05):
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    if connected.is_set():
                        return PUB_CONNECTED
                    if probe is not None and probe in done and probe.result():
                        return REPLAY_ANSWERED
        except TimeoutError:
            pass
        finally:
            await cancel_and_wait([task for task in waiting if not task.done()])
        return PUB_CONNECTED if connected.is_set() else None
