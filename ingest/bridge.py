"""The ingest service: every engine stream → canonical batches → JetStream, losing nothing.

One `EngineStream` task per (publisher, dp_rank, provenance). Each resumes from the last
(epoch, seq) JetStream holds for its subject, checks by content that the engine is the
incarnation it followed (`ingest/incarnation.py`), replays what the engine still buffers from
there, then follows the SUB socket, probing the replay socket whenever it is idle so a
lost last message is noticed too. An engine that stops answering becomes an `unreachable`
worker, and reachable again when it answers (`ingest/liveness.py`), its incarnation checked
then. All publishing goes through one ordered publisher.
Each stream remembers where JetStream stored what it acknowledged; on every connection to
NATS, before the first write after a quiet spell and every `ingest.stream_check_interval_s`,
the publisher pauses between writes while the streams check that KV_EVENTS still holds it,
and puts what it lost back in front (`ingest/stream_repair.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import nats
import nats.js.errors
import zmq
import zmq.asyncio

from kvledger.ingest.endpoints import StreamSource
from kvledger.ingest.incarnation import Incarnation, is_restart_marker, judge, same_engine_batch
from kvledger.ingest.liveness import BATCH_ARRIVED, DISCONNECTED, NEVER_CONNECTED, EngineWatch, heartbeat_ms, liveness_batch
from kvledger.ingest.metrics import IngestMetrics
from kvledger.ingest.publisher import JetStreamPublisher, Queued, StreamCheckIncomplete
from kvledger.ingest.replay_client import ReplayClient
from kvledger.ingest.sequence import Emit, SequenceTracker
from kvledger.ingest.stream_repair import AckedPositions, LostBatch, LostRun, Loss, Position, Repair, plan_repair
from kvledger.ingest.subscriber import EngineSubscriber
from kvledger.ingest.wire import EngineBatch, WireError, decode_payload, split_publisher_frames, well_framed_seq
from kvledger.core.events import (
    DeadLetter, EventBatch, Gap, GapReason, Provenance, Reachability, decode_batch, encode_batch,
    encode_dead_letter, events_subject, liveness_subject,
)
from kvledger.core.settings import Settings
from kvledger.runtime.backoff import Backoff
from kvledger.runtime.http import HttpFront, health_routes
from kvledger.runtime.lifetime import AsyncLifetime, cancel_and_wait
from kvledger.runtime.nats_options import connect_options
from kvledger.runtime.refetch import REFETCH_SUBJECT, RefetchRequest, decode_refetch
from kvledger.runtime.streams import dead_letter_subject, dead_letters_stream, events_stream

if TYPE_CHECKING:
    from nats.js import JetStreamContext

log = logging.getLogger("kvledger.ingest")

IDLE_PROBE_S = 1.0  # how long a quiet stream waits before asking replay for a lost tail
BURST_LIMIT = 128  # most engine batches handled between yields (and at most half the publish window)
DEAD_LETTER_LIMIT = 256 * 1024  # raw bytes kept per dead letter: it must fit in one NATS message
# A hole asked for again within this long (store and decide both ask) is fetched once.
REFETCH_DEBOUNCE_S = 5.0
NO_MESSAGE_FOUND = 10037  # JetStream's error code for a seq it does not hold (a missing stream is 10059)


def _kind_of(event: object) -> str:
    return type(event).__name__


class EngineStream:
    """Follows one engine stream and turns it into canonical batches."""

    def __init__(
        self, source: StreamSource, bridge: Bridge, context: zmq.asyncio.Context, *, replay_timeout_s: float,
        max_batch_bytes: int, publish_window: int = 256, engine_timeout_s: float = 2.0,
    ) -> None:
        self.source = source
        self._bridge = bridge
        self._context = context
        self.replay = ReplayClient(source.replay_url, context, timeout_s=replay_timeout_s) if source.replay_url else None
        self._max_batch_bytes = max_batch_bytes
        self._burst_limit = max(1, min(BURST_LIMIT, publish_window // 2))
        self.ready = asyncio.Event()
        self.tracker: SequenceTracker | None = None
        self._subject = events_subject(source.worker, source.provenance)
        self.subscriber: EngineSubscriber | None = None
        self.positions = AckedPositions()  # where JetStream stored what it acknowledged, for the stream check
        self._letters: list[Queued] = []  # dead letters the live batch being built caused, sent before it
        self._resumed_from: EventBatch | None = None  # the last batch KV_EVENTS held for us at start
        self.incarnation_check_s: float | None = None  # how long the last reconnection's check took
        self.engine_timeout_s = engine_timeout_s
        # What KV_EVENTS last said of the engine (read back at the first start: ingest may have
        # stopped while it was unreachable), and when ingest published that it was gone.
        self.reachable: bool | None = None
        self.unreachable_published_at: float | None = None  # wall clock
        self._reachable_again = asyncio.Event()
        self._refetched: dict[tuple[int, int, int], float] = {}  # (epoch, first, end) -> when fetched again
        self._refetches = 0

    @property
    def name(self) -> str:
        suffix = "" if self.source.provenance is Provenance.NATIVE else " (retained)"
        return f"{self.source.worker.name}{suffix}"

    async def run(self) -> None:
        if self.tracker is None:
            # Only the first start reads the position back: after a stream failure the tracker
            # is ahead of JetStream (batches may still wait in the publisher) and stays.
            epoch, next_seq, self._resumed_from = await self._bridge.resume_from(self.source)
            fetch = self._fetch if self.replay is not None else None
            self.tracker = SequenceTracker(epoch, next_seq, fetch)
            self.reachable = await self._bridge.logged_reachability(self.source)
        log.info(
            "%s: following %s from epoch %d seq %d", self.name, self.source.pub_url, self.tracker.epoch, self.tracker.next_seq,
        )
        subscriber_heartbeat = heartbeat_ms(self.engine_timeout_s)
        async with EngineSubscriber(self.source.pub_url, self._context, heartbeat_ms=subscriber_heartbeat) as subscriber:
            self.subscriber = subscriber
            watch = EngineWatch(subscriber, self.replay, self.engine_timeout_s)
            # An engine that is not there when ingest starts is as unreachable as one that left.
            if self.reachable is not False:
                await self._silence_ends(watch, NEVER_CONNECTED)
            while self.reachable is False and not await self._answers_again(watch):
                pass
            await subscriber.connected.wait()
            # Replay after the handshake: whatever was sent before the SUB joined (or
            # while ingest was down) comes from the engine's buffer, in order, once the
            # engine is known to be the one followed before.
            await self._publish(await self._reconnected())
            self.ready.set()
            log.info("%s: ready", self.name)
            # Silence is watched beside the stream, so a replay or a publish in flight when the engine
            # went does not hold back saying so.
            watchdog = asyncio.create_task(self._watch_for_silence(watch), name=f"liveness-{self.name}")
            try:
                await self._follow(subscriber, watch)
            finally:
                await cancel_and_wait([watchdog])

    async def _follow(self, subscriber: EngineSubscriber, watch: EngineWatch) -> None:
        while True:
            # While the engine is unreachable, `_answers_again` does the waiting (for a reconnect or a reply).
            burst = await subscriber.recv_burst(IDLE_PROBE_S if self.reachable is not False else 0.01, self._burst_limit)
            if not burst:
                if self.reachable is False:
                    if await self._answers_again(watch):
                        # Published unreachable, and it answers again: the incarnation check says
                        # whether what it held still stands (ingest/incarnation.py).
                        await self._publish(await self._reconnected())
                else:
                    await self._publish(await self.tracker.catch_up())
                await self._dead_letter_replies()
            elif self.reachable is False:
                await self._publish_reachability(True, BATCH_ARRIVED, time.time())
            for frames in burst:
                emit = self._next_in_order(frames)
                if emit is not None:
                    await self._publish_one(emit)
                else:  # bad framing, a gap, a duplicate or a restart: the full rules
                    await self._publish(await self._on_frames(frames))
            # Nothing above waits while ZMQ has data: yield, so the publisher reads acks and
            # tops up its window between bursts instead of once the buffer is full.
            await asyncio.sleep(0)

    async def _watch_for_silence(self, watch: EngineWatch) -> None:
        """Publish the engine unreachable once its SUB connection has been down, and its replay socket
        silent, for `engine_timeout_s` (ingest/liveness.py); the stream itself publishes its return."""
        subscriber = watch.subscriber
        while True:
            await subscriber.dropped.wait()
            if self.reachable is False:
                await self._reachable_again.wait()
                continue
            if await self._silence_ends(watch, DISCONNECTED) and not subscriber.connected.is_set():
                # Its replay socket answered while its PUB is down: look again in a while.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(subscriber.connected.wait(), IDLE_PROBE_S)

    async def _silence_ends(self, watch: EngineWatch, reason: str) -> bool:
        """Whether the engine answers within `engine_timeout_s` of falling silent; if not, it is
        published unreachable. A silence already past the timeout gets half of it to end."""
        since, since_wall = watch.silent_since()
        why = await watch.answers_by(since + self.engine_timeout_s, least_s=self.engine_timeout_s / 2)
        if why is not None:
            return True
        if self.reachable is not False:
            await self._publish_reachability(False, reason, since_wall)
        return False

    async def _answers_again(self, watch: EngineWatch) -> bool:
        """Whether an engine published unreachable answers within a probe's time; if so it is published
        reachable (said in KV_EVENTS before anything else of it), except an engine without a replay
        socket: nothing can vouch for what it holds but its first batch (`_follow`)."""
        why = await watch.answers_by(asyncio.get_running_loop().time() + IDLE_PROBE_S, least_s=IDLE_PROBE_S)
        await self._dead_letter_replies()
        if why is None:
            return False
        if self.replay is None:
            log.warning("%s: the engine's PUB is back (%s); reachable again with its first batch", self.name, why)
            return True
        await self._publish_reachability(True, why, time.time())
        return True

    async def _publish_reachability(self, reachable: bool, reason: str, since_ts: float) -> None:
        """Say in KV_EVENTS that the engine is gone or back (a liveness record, `Reachability`)."""
        tracker = self.tracker
        batch, msg_id = liveness_batch(self.source, tracker.epoch, tracker.next_seq, reachable, reason, since_ts)
        metrics = self._bridge.metrics
        metrics.events.labels(_kind_of(batch.events[0])).inc()
        worker = self.source.worker.publisher
        self.reachable = reachable
        if reachable:
            metrics.reachable_again.labels(worker).inc()
            log.warning("%s: the engine answers again (%s): reachable", self.name, reason)
            self._reachable_again.set()
        else:
            metrics.unreachable.labels(worker).inc()
            self.unreachable_published_at = batch.ingest_ts
            log.warning(
                "%s: the engine has not answered for %.1f s (%s): unreachable, not credited until it answers",
                self.name, batch.ingest_ts - since_ts, reason,
            )
            self._reachable_again.clear()
        await self._bridge.publisher.publish(batch.subject, encode_batch(batch), msg_id)

    async def _dead_letter_replies(self) -> None:
        """Dead-letter the replay replies that could not be read (the batches they stood for are Gaps)."""
        if self.replay is None:
            return
        for reason, frames in self.replay.take_malformed():
            await self._bridge.dead_letter(self.source, reason, frames)

    async def _fetch(self, start: int) -> list[tuple[int, bytes]]:
        return await self.replay.fetch(start)

    async def _reconnected(self) -> list[Emit]:
        """What the engine buffers past the last seq published, once its batch at that seq shows
        it is the same incarnation; a new epoch from seq 0 if it restarted (ingest/incarnation.py).

        The check asks the replay socket to start one seq earlier than catching up would, so
        a continuation costs one batch more on the replay it needed anyway.
        """
        tracker = self.tracker
        last = tracker.next_seq - 1
        if self.replay is None or last < 0:
            return await tracker.catch_up()  # nothing published to compare with (or no replay to ask)
        started = time.perf_counter()
        replies, complete = await self.replay.fetch_complete(last)
        await self._dead_letter_replies()
        tracker.counters.incarnation_checks += 1
        verdict = judge(last, replies, complete, lambda payload: self._same_as_published(last, payload))
        self.incarnation_check_s = time.perf_counter() - started
        if verdict.incarnation is Incarnation.CONTINUATION:
            return tracker.accept_replayed(replies)
        if verdict.incarnation is Incarnation.UNVERIFIED:
            log.warning(
                "%s: cannot tell a restart from a continuation at epoch %d seq %d (%s): going on behind a "
                "Gap(replay_incomplete), the worker uncertain", self.name, tracker.epoch, last, verdict.why,
            )
            tracker.unverified(verdict.first)
            return tracker.accept_replayed(replies)
        old_epoch = tracker.epoch
        gap = tracker.restarted()
        log.warning(
            "%s: the engine restarted while ingest was away (%s): epoch %d from seq 0, Gap(publisher_restart)",
            self.name, verdict.why, tracker.epoch,
        )
        emits = await tracker.catch_up()
        if not emits:
            # The new engine has published nothing yet, and its cache is empty now: say so now,
            # not with its first batch, or the old inventory stands until then.
            await self._publish_restart_marker(old_epoch, gap)
        return emits

    def _same_as_published(self, seq: int, payload: bytes) -> bool | None:
        """Whether the engine's batch at `seq` (current epoch) is the one published: by its bytes
        while this process remembers them, else by the canonical batch KV_EVENTS held at start."""
        emitted = self.tracker.emitted_matches(seq, payload)
        if emitted is not None:
            return emitted
        record = self._resumed_from
        if record is None or (record.epoch, record.seq) != (self.tracker.epoch, seq):
            return None
        return same_engine_batch(record, payload, engine=self.source.engine, max_bytes=self._max_batch_bytes)

    async def _publish_restart_marker(self, epoch: int, gap: Gap) -> None:
        """A batch of its own at the old epoch's next seq whose only event is the restart `gap`
        (`is_restart_marker`): it clears the old inventory; ingest resumes after it at the new epoch."""
        seq = gap.expected_seq
        batch = EventBatch(self.source.worker, epoch, seq, 0.0, time.time(), self.source.provenance, (gap,))
        metrics = self._bridge.metrics
        metrics.events.inc_each((_kind_of(gap),))
        metrics.gaps.labels(gap.reason.value).inc()
        self.positions.note_gaps(epoch, seq, (gap,))
        await self._bridge.publisher.publish(
            self._subject, encode_batch(batch), batch.msg_id, None, self.positions, epoch, seq,
        )

    def _next_in_order(self, frames: list[bytes]) -> Emit | None:
        seq = well_framed_seq(frames)
        return None if seq is None else self.tracker.next_in_order(seq, frames[2])

    async def _on_frames(self, frames: list[bytes]) -> list[Emit]:
        try:
            message = split_publisher_frames(frames)
        except WireError as error:
            await self._bridge.dead_letter(self.source, str(error), frames)
            return []
        return await self.tracker.on_live(message.seq, message.payload)

    async def _publish(self, emits: list[Emit]) -> None:
        for emit in emits:
            await self._publish_one(emit)

    def _reject_events(self, decoded: EngineBatch, emit: Emit, letters: list[Queued]) -> tuple[Gap, ...]:
        """Dead-letter each unusable event alone; the gaps the batch then carries.

        The batch's other events still apply. Only a lost event that may hide an eviction
        makes the worker uncertain (`RejectedEvent.loses_state`).
        """
        for rejected in decoded.rejected:
            self._bridge.metrics.rejected_events.labels(rejected.tag or "untagged").inc()
            letters.append(self._bridge.dead_letter_message(
                self.source, f"event {rejected.position} ({rejected.tag or 'untagged'}): {rejected.reason}",
                [rejected.raw], emit, position=rejected.position,
            ))
        if any(rejected.loses_state for rejected in decoded.rejected):
            return (*emit.gaps, Gap(emit.seq, emit.seq + 1, GapReason.MISSED))
        return emit.gaps

    async def _publish_one(self, emit: Emit) -> None:
        """Decode, count, encode and queue one batch (the hot path: one call per engine batch)."""
        batch, record = self._record(emit, self._letters)
        publisher = self._bridge.publisher
        if self._letters:
            letters, self._letters = self._letters, []
            for letter in letters:
                await publisher.publish(letter.subject, letter.payload, letter.msg_id)
        if emit.gaps:
            self.positions.note_gaps(emit.epoch, emit.seq, emit.gaps)
        engine_ts = batch.engine_ts
        await publisher.publish(
            self._subject, record, batch.msg_id, engine_ts if engine_ts > 0 else None, self.positions, emit.epoch, emit.seq,
        )

    def _record(self, emit: Emit, letters: list[Queued]) -> tuple[EventBatch, bytes]:
        """The canonical batch of an engine batch and its record; the dead letters it causes go to `letters`.

        One path for live, replayed and repaired batches, so a batch fetched again after the
        stream lost it is the same record under the same id.
        """
        metrics = self._bridge.metrics
        source = self.source
        metrics.batches_in.labels(source.worker.publisher).inc()
        engine_ts = 0.0
        try:
            decoded = decode_payload(emit.payload, max_bytes=self._max_batch_bytes, engine=source.engine)
        except WireError as error:
            letters.append(self._bridge.dead_letter_message(source, str(error), [emit.payload], emit))
            # The batch's events are lost to us: say so, so the worker is reported uncertain.
            events = (*emit.gaps, Gap(emit.seq, emit.seq + 1, GapReason.MISSED))
            gaps = events  # all of them
        else:
            engine_ts = decoded.engine_ts
            gaps = emit.gaps  # usually none: then the batch is the engine's events as decoded
            if decoded.rejected:
                gaps = self._reject_events(decoded, emit, letters)
            events = (*gaps, *decoded.events) if gaps else decoded.events
            if decoded.skipped_remote:
                metrics.remote_skipped.inc(decoded.skipped_remote)
            if decoded.unaligned_tokens:
                metrics.unaligned_tokens.inc(decoded.unaligned_tokens)
        metrics.events.inc_each(map(_kind_of, events))
        if gaps:
            metrics.gaps.inc_each(gap.reason.value for gap in gaps)
        batch = EventBatch(source.worker, emit.epoch, emit.seq, engine_ts, time.time(), source.provenance, events)
        record = encode_batch(batch)
        publisher = self._bridge.publisher
        largest = publisher.max_record(batch.msg_id)
        if len(record) > largest:
            # NATS would refuse it on every retry and stall every stream behind it.
            letters.append(self._bridge.dead_letter_message(
                self.source, f"canonical record of {len(record)} bytes exceeds the NATS max_payload of "
                f"{publisher.max_payload} less its {publisher.max_payload - largest}-byte header", [emit.payload], emit,
            ))
            batch = attrs.evolve(batch, events=(*emit.gaps, Gap(emit.seq, emit.seq + 1, GapReason.MISSED)))
            metrics.gaps.labels(GapReason.MISSED.value).inc()
            record = encode_batch(batch)
        return batch, record

    async def check_stream(self, js: JetStreamContext) -> list[Queued]:
        """Whether KV_EVENTS still holds what it acknowledged for this stream; if not, what to
        republish before anything newer: the lost batches the engine still buffers, the rest as
        `Gap(stream_lost)`. Called by the publisher with nothing of ours in flight."""
        stream = self._bridge.settings.stream.events_stream

        async def held(position: Position) -> bool:
            try:
                message = await js.get_msg(stream, seq=position[2])
            except nats.js.errors.NotFoundError as error:
                if error.err_code == NO_MESSAGE_FOUND:
                    return False
                raise  # the stream itself is missing (or offline): that says nothing about the batch
            found = (message.headers or {}).get("Nats-Msg-Id")
            return message.subject == self._subject and found == self._msg_id(position[0], position[1])

        async def last_held() -> Position | None:
            try:
                message = await js.get_last_msg(stream, self._subject)
            except nats.js.errors.NotFoundError as error:
                if error.err_code == NO_MESSAGE_FOUND:
                    return None
                raise
            last = decode_batch(message.data)
            return last.epoch, last.seq, message.seq

        metrics = self._bridge.metrics
        metrics.stream_checks.inc()
        started = time.perf_counter()
        loss = await self.positions.find_loss(held, last_held)
        if loss is None:
            return []
        tracker = self.tracker
        replayed: list[tuple[int, bytes]] = []
        current = [run.first for run in loss.runs if run.epoch == tracker.epoch]
        if self.replay is not None and current:
            replayed = await self.replay.fetch(min(current))
            tracker.counters.replays += 1
            tracker.counters.replayed_batches += len(replayed)
        repair = plan_repair(loss, tracker.epoch, replayed, tracker.published, self.positions.gaps_of)
        queued = self._repair_queue(repair, positions=self.positions)
        metrics.stream_lost.inc(repair.lost)
        metrics.stream_repaired.inc(repair.repaired)
        log.warning(
            "%s: KV_EVENTS lost %d acknowledged batches (%s%s); %d fetched again from the engine and republished, "
            "%d no longer buffered there (Gap stream_lost); found and fetched in %.0f ms",
            self.name, loss.batches, loss.describe(), "" if loss.reaches_back else ", from the last one it holds",
            repair.repaired, repair.lost, (time.perf_counter() - started) * 1000,
        )
        return queued

    async def refetch(self, request: RefetchRequest) -> str:
        """Publish again the batches [first, end) of the current epoch that a fold found missing mid-stream,
        from the engine's replay buffer, each under a Msg-Id of its own (the lost copy's may still sit in
        JetStream's duplicate window); what it no longer buffers as `Gap(stream_lost)` at the end of each
        missing run. The folds hold the worker's later batches back until these come. Returns the outcome."""
        tracker, now = self.tracker, time.monotonic()
        if request.epoch != tracker.epoch:
            return "not_this_epoch"  # a restart since: the new epoch's Gap already ended the wait
        if request.end > tracker.next_seq:
            return "not_published"  # seqs this ingest never published: not a hole it can fill
        key = (request.epoch, request.first, request.end)
        if now - self._refetched.get(key, -REFETCH_DEBOUNCE_S) < REFETCH_DEBOUNCE_S:
            return "repeated"  # store and decide both ask: once is enough
        self._refetched = {k: at for k, at in self._refetched.items() if now - at < REFETCH_DEBOUNCE_S}
        self._refetched[key] = now
        self._refetches += 1
        suffix = f":refetched{self._refetches}"  # asked again later, published again (the folds drop repeats)
        replayed = dict(await self._fetch(request.first)) if self.replay is not None else {}
        if self.replay is not None:
            tracker.counters.replays += 1
            await self._dead_letter_replies()
        # As the stream check repairs a lost tail: only a batch the engine buffers under that seq and that is
        # the one published is taken; what it no longer has becomes Gap(stream_lost).
        repair = plan_repair(Loss((LostRun(request.epoch, request.first, request.end),)), tracker.epoch,
                             replayed, tracker.published, self.positions.gaps_of)
        publisher, metrics = self._bridge.publisher, self._bridge.metrics
        for item in self._repair_queue(repair, msg_suffix=suffix):
            await publisher.publish(item.subject, item.payload, item.msg_id)
        metrics.refetched.inc(repair.repaired)
        metrics.refetch_lost.inc(repair.lost)
        log.warning("%s: fetched seqs %d-%d of epoch %d again for %s (%d from the engine's buffer, %d lost)",
                    self.name, request.first, request.end - 1, request.epoch, request.asked_by, repair.repaired,
                    repair.lost)
        return "fetched"

    def _repair_queue(self, repair: Repair, *, positions: AckedPositions | None = None,
                      msg_suffix: str = "") -> list[Queued]:
        """A repair's batches as messages, in order, each engine batch's dead letters just before it; a lost
        run's stand-in batch carries only its Gap(stream_lost)."""
        metrics = self._bridge.metrics
        queued: list[Queued] = []
        for item in repair.batches:
            if isinstance(item, LostBatch):
                batch = EventBatch(
                    self.source.worker, item.epoch, item.seq, 0.0, time.time(), self.source.provenance, (item.gap,),
                )
                record = encode_batch(batch)
                metrics.events.inc_each((_kind_of(item.gap),))
                metrics.gaps.labels(item.gap.reason.value).inc()
            else:
                batch, record = self._record(item, queued)  # its dead letters go just before it
                if item.gaps:
                    self.positions.note_gaps(item.epoch, item.seq, item.gaps)
            queued.append(Queued(
                self._subject, record, batch.msg_id + msg_suffix, time.perf_counter(), None, positions, batch.epoch,
                batch.seq,
            ))
        return queued

    def _msg_id(self, epoch: int, seq: int) -> str:
        return EventBatch(self.source.worker, epoch, seq, 0.0, 0.0, self.source.provenance, ()).msg_id


class Bridge(AsyncLifetime):
    """Runs every engine stream, the publisher, and the health/metrics endpoint."""

    def __init__(self, settings: Settings, sources: list[StreamSource], *, http_port: int | None = None) -> None:
        if not sources:
            raise ValueError("ingest needs at least one endpoint (--endpoint tcp://HOST:PORT --publisher NAME)")
        self.settings = settings
        self.metrics = IngestMetrics()
        self.metrics.expect("publisher", sorted({source.worker.publisher for source in sources}))
        self.metrics.expect("reason", [reason.value for reason in GapReason])
        self._http_port = settings.ingest.http_port if http_port is None else http_port
        self._context = zmq.asyncio.Context()
        self.publisher = JetStreamPublisher(
            settings.nats,
            [events_stream(settings.stream), dead_letters_stream(settings.stream)],
            window=settings.ingest.publish_window,
            max_buffered=settings.ingest.max_buffered_batches,
            on_ack=self._acked,
            check_stream=self._check_stream,
            on_stream_back=self._stream_went_back,
        )
        self.streams = [
            EngineStream(
                source, self, self._context, replay_timeout_s=settings.ingest.replay_timeout_s,
                max_batch_bytes=settings.ingest.max_batch_bytes, publish_window=settings.ingest.publish_window,
                engine_timeout_s=settings.ingest.engine_timeout_s,
            )
            for source in sources
        ]
        self.metrics.streams = self.streams
        self.metrics.publisher = self.publisher
        self._reader: nats.NATS | None = None
        self._tasks: list[asyncio.Task] = []
        self._checker: asyncio.Task | None = None
        self._http: HttpFront | None = None
        self.http_port: int | None = None
        # Benchmarks hook here to see every engine-send → JetStream-ack latency.
        self.ack_observer: Callable[[float], None] | None = None

    async def start(self) -> None:
        await self.publisher.__aenter__()
        await self.publisher.wait_connected(timeout=self.settings.nats.connect_timeout_s * 3)
        self._reader = await nats.connect(**connect_options(self.settings.nats, name="kvledger-ingest-reader"))
        await self._reader.subscribe(REFETCH_SUBJECT, cb=self._on_refetch)
        router = health_routes(self.is_ready, self.metrics.text)
        self._http = await HttpFront(router, self.settings.ingest.http_host, self._http_port).start()
        self.http_port = self._http.port
        self._tasks = [asyncio.create_task(self._supervise(stream), name=f"stream-{stream.name}") for stream in self.streams]
        self._checker = asyncio.create_task(self._check_periodically(), name="stream-check")

    async def close(self) -> None:
        try:
            # Cancelled more than once if need be: a stream resuming from JetStream right after
            # start can swallow one cancel in nats-py's request and follow its engine forever.
            await cancel_and_wait([*self._tasks, *([self._checker] if self._checker is not None else [])])
            self._tasks, self._checker = [], None
            await self.publisher.close()
            if self._http is not None:
                await self._http.close()
                self._http = None
            if self._reader is not None:
                await self._reader.close()
                self._reader = None
        finally:
            # Even if closing was itself cancelled: destroy closes every socket still open
            # (term alone would block the loop until they were), then terminates the context.
            for task in self._tasks:
                task.cancel()
            if self._checker is not None:
                self._checker.cancel()
            self._context.destroy(linger=0)

    def is_ready(self) -> bool:
        return all(stream.ready.is_set() for stream in self.streams)

    async def _on_refetch(self, msg) -> None:
        """A fold's request to fetch a hole mid-stream again (kvledger.runtime.refetch): answered by the
        stream that follows that engine, if this ingest has it; a request that cannot be read is refused,
        counted and logged, and ingest goes on."""
        try:
            request = decode_refetch(msg.data)
        except ValueError as error:
            self.metrics.refetch_requests.labels("refused").inc()
            log.warning("refused a refetch request: %s", error)
            return
        provenance = Provenance(request.provenance)
        for stream in self.streams:
            if stream.source.worker == request.worker and stream.source.provenance is provenance \
                    and stream.tracker is not None:
                try:
                    outcome = await stream.refetch(request)
                except Exception as error:  # noqa: BLE001 - the engine's replay socket or NATS: the fold waits on
                    outcome = "failed"
                    log.warning("%s: fetching seqs %d-%d again failed: %s", stream.name, request.first,
                                request.end - 1, error)
                self.metrics.refetch_requests.labels(outcome).inc()
                return

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Every stream subscribed (handshake done) and caught up with its engine's replay buffer."""
        waiters = [asyncio.ensure_future(stream.ready.wait()) for stream in self.streams]
        pending: set = set(waiters)
        try:
            async with asyncio.timeout(timeout):
                while pending:
                    done, pending = await asyncio.wait(pending | set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
                    for task in self._tasks:
                        if task in done:
                            task.result()
                    pending -= set(self._tasks)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def wait_failed(self) -> None:
        """Return only if publishing stopped for good (refused login, stream conflict): by raising it."""
        await self.publisher.finished()

    async def _supervise(self, stream: EngineStream) -> None:
        # A bug or a vanished socket in one stream must not stop the others; its tracker
        # survives the restart, so no position is lost.
        backoff = Backoff(first_s=0.1, limit_s=5.0)
        while True:
            try:
                await stream.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                if self.publisher.failed:
                    raise  # nothing can be published any more: restarting would only spin
                log.exception("%s: stream failed; restarting", stream.name)
                stream.ready.clear()
                await backoff.wait()

    async def _check_periodically(self) -> None:
        # A loss under a connection that stays up (a cluster's stream leader replaced by a
        # stale one) is not seen at a reconnect: look between writes now and then too.
        while True:
            await asyncio.sleep(self.settings.ingest.stream_check_interval_s)
            self.publisher.request_check()

    async def _check_stream(self, js: JetStreamContext | None) -> list[Queued]:
        """Every engine stream's check, together; what the stream lost, to be sent first.

        On a new connection (`js` given) a check that could not ask about every stream stops
        that connection (it is tried again): sending before knowing could put newer batches
        ahead of lost ones. Between writes it is only logged, and asked again next time.
        """
        reconnecting = js is not None
        if js is None:
            if self._reader is None or not self._reader.is_connected:
                return []  # NATS is away: the reconnection checks
            js = self._reader.jetstream()
        results = await asyncio.gather(*(stream.check_stream(js) for stream in self.streams), return_exceptions=True)
        first: list[Queued] = []
        failures: list[str] = []
        for stream, result in zip(self.streams, results):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                # Nothing changed for that stream: a failed check leaves its positions as they were.
                failures.append(f"{stream.name}: {type(result).__name__}: {result}")
                continue
            first.extend(result)
        if failures and reconnecting:
            raise StreamCheckIncomplete(f"could not check KV_EVENTS for {'; '.join(failures)}", first)
        for failure in failures:
            log.warning("checking KV_EVENTS failed (%s); asked again at the next check", failure)
        return first

    def _stream_went_back(self) -> None:
        for stream in self.streams:
            stream.positions.stream_went_back()

    async def logged_reachability(self, source: StreamSource) -> bool | None:
        """What the last liveness record in KV_EVENTS says of the stream's engine (None: none was ever published)."""
        subject = liveness_subject(source.worker, source.provenance)
        try:
            message = await self._reader.jetstream().get_last_msg(self.settings.stream.events_stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        event = decode_batch(message.data).events[0]
        return event.reachable if type(event) is Reachability else None

    async def resume_position(self, source: StreamSource) -> tuple[int, int]:
        """(epoch, next seq) after the last batch JetStream holds for this stream; (0, 0) if none."""
        epoch, next_seq, _ = await self.resume_from(source)
        return epoch, next_seq

    async def resume_from(self, source: StreamSource) -> tuple[int, int, EventBatch | None]:
        """`resume_position`, and the last batch itself, to check the engine against (None if none).

        After a restart marker the next epoch starts at seq 0, with nothing of it to check.
        """
        subject = events_subject(source.worker, source.provenance)
        try:
            message = await self._reader.jetstream().get_last_msg(self.settings.stream.events_stream, subject)
        except nats.js.errors.NotFoundError:
            return 0, 0, None
        last = decode_batch(message.data)
        if is_restart_marker(last):
            return last.epoch + 1, 0, None
        return last.epoch, last.seq + 1, last

    async def dead_letter(
        self, source: StreamSource, reason: str, frames: list[bytes], emit: Emit | None = None,
        position: int | None = None,
    ) -> None:
        letter = self.dead_letter_message(source, reason, frames, emit, position)
        await self.publisher.publish(letter.subject, letter.payload, letter.msg_id)

    def dead_letter_message(
        self, source: StreamSource, reason: str, frames: list[bytes], emit: Emit | None = None,
        position: int | None = None,
    ) -> Queued:
        """Log and count one dead letter; the message to publish for it."""
        worker = source.worker
        log.warning("%s: dead-lettered: %s", worker.name, reason)
        self.metrics.dead_letters.labels(worker.publisher).inc()
        kept, room = [], DEAD_LETTER_LIMIT
        for frame in frames:
            kept.append(bytes(frame[:room]))
            room -= len(kept[-1])
        if sum(len(frame) for frame in frames) > DEAD_LETTER_LIMIT:
            reason = f"{reason} (frames truncated to {DEAD_LETTER_LIMIT} bytes in all)"
        kept = tuple(kept)
        letter = DeadLetter(worker.publisher, worker.dp_rank, reason, kept, time.time(), source.pub_url)
        # A dead letter tied to an engine seq is published once however often it is replayed.
        msg_id = (
            f"dlq:{worker.publisher}:{worker.dp_rank}:{source.provenance.value}:{emit.epoch}:{emit.seq}"
            if emit is not None else f"dlq:{uuid.uuid4()}"
        )
        if position is not None:
            msg_id += f":{position}"  # one dead letter per rejected event of the batch
        return Queued(dead_letter_subject(worker.publisher), encode_dead_letter(letter), msg_id, time.perf_counter(), None)

    def _acked(self, latency_s: float, engine_ts: float | None) -> None:
        self.metrics.publish_latency.observe(latency_s)
        if engine_ts is not None:
            end_to_end = time.time() - engine_ts
            self.metrics.engine_to_ack.observe(end_to_end)
            if self.ack_observer is not None:
                self.ack_observer(end_to_end)
