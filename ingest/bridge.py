"""The ingest service: every engine stream → canonical batches → JetStream, losing nothing.

One `EngineStream` task per (publisher, dp_rank, provenance). Each resumes from the last
(epoch, seq) JetStream holds for its subject, replays what the engine still buffers from
there, then follows the SUB socket, probing the replay socket whenever it is idle so a
lost last message is noticed too. All publishing goes through one ordered publisher.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import math
import time
import uuid
from collections.abc import Callable

import attrs
import nats
import nats.js.errors
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ingest.endpoints import StreamSource
from ingest.publisher import JetStreamPublisher
from ingest.replay import ReplayClient
from ingest.sequence import Emit, SequenceTracker
from ingest.subscriber import EngineSubscriber
from ingest.wire import EngineBatch, WireError, decode_payload, split_publisher_frames, well_framed_seq
from kvledger.events import (
    DeadLetter, EventBatch, Gap, GapReason, Provenance, decode_batch, encode_batch,
    encode_dead_letter, events_subject,
)
from kvledger.runtime.backoff import Backoff
from kvledger.runtime.http import HttpFront, health_routes
from kvledger.runtime.lifetime import AsyncLifetime, cancel_and_wait
from kvledger.runtime.nats_options import connect_options
from kvledger.settings import Settings
from kvledger.runtime.streams import dead_letter_subject, dead_letters_stream, events_stream

log = logging.getLogger("kvledger.ingest")

IDLE_PROBE_S = 1.0  # how long a quiet stream waits before asking replay for a lost tail
BURST_LIMIT = 128  # most engine batches handled between yields (and at most half the publish window)
DEAD_LETTER_LIMIT = 256 * 1024  # raw bytes kept per dead letter: it must fit in one NATS message


class LatencyHistogram:
    """A histogram that costs one bisect per observation; Prometheus reads it at scrape time.

    (prometheus_client's Histogram takes a lock and walks every bucket, twice per batch.)
    """

    def __init__(self, name: str, help_text: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.help_text = help_text
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # `le` buckets include their bound
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        return HistogramMetricFamily(self.name, self.help_text, buckets=buckets, sum_value=self.sum)


class IngestMetrics:
    """Counters are plain ints on the hot path, turned into Prometheus families at scrape time."""

    def __init__(self) -> None:
        self.batches_in: collections.Counter[str] = collections.Counter()  # per publisher
        self.events: collections.Counter[str] = collections.Counter()  # per event kind
        self.gaps: collections.Counter[str] = collections.Counter()  # per reason
        self.dead_letters: collections.Counter[str] = collections.Counter()  # per publisher
        self.remote_skipped = 0
        self.rejected_events: collections.Counter[str] = collections.Counter()  # per event type tag
        self.unaligned_tokens = 0
        self.streams: list[EngineStream] = []
        self.publisher: JetStreamPublisher | None = None
        self.publish_latency = LatencyHistogram(
            "kvledger_ingest_publish_latency_seconds", "from queueing to JetStream ack",
            (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.engine_to_ack = LatencyHistogram(
            "kvledger_ingest_engine_to_ack_seconds", "from the engine's batch timestamp to the JetStream ack "
            "(includes clock skew between hosts)",
            (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60),
        )
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self):
        """The prometheus_client collector protocol: current values as metric families."""

        def family(name: str, help_text: str, label: str | None, values) -> CounterMetricFamily:
            metric = CounterMetricFamily(name, help_text, labels=[label] if label else None)
            for key, value in (values.items() if label else [((), values)]):
                metric.add_metric([key] if label else [], value)
            return metric

        trackers = [stream.tracker for stream in self.streams if stream.tracker is not None]
        yield family("kvledger_ingest_batches_in", "engine batches received (SUB and replay)", "publisher", self.batches_in)
        yield family("kvledger_ingest_events", "canonical events published", "kind", self.events)
        yield family("kvledger_ingest_gaps", "Gap events synthesised", "reason", self.gaps)
        yield family("kvledger_ingest_dead_letters", "malformed inputs dead-lettered", "publisher", self.dead_letters)
        yield family("kvledger_ingest_remote_events_skipped", "events about REMOTE blocks kept out", None, self.remote_skipped)
        yield family("kvledger_ingest_rejected_events", "single events dead-lettered while the rest of their batch applied",
                     "type", self.rejected_events)
        yield family("kvledger_ingest_unaligned_token_stores", "stores whose token ids do not line up with their hashes "
                     "(null blocks): hashed from the worker's other groups", None, self.unaligned_tokens)
        yield family("kvledger_ingest_replays", "replay requests sent to engines", None, sum(t.counters.replays for t in trackers))
        yield family("kvledger_ingest_duplicates", "engine batches dropped as already published", None,
                     sum(t.counters.duplicates for t in trackers))
        yield family("kvledger_ingest_engine_restarts", "engine restarts detected", None, sum(t.counters.restarts for t in trackers))
        yield family("kvledger_ingest_replayed_batches", "engine batches received from replay sockets", None,
                     sum(t.counters.replayed_batches for t in trackers))
        replays = [stream.replay for stream in self.streams if stream.replay is not None]
        yield family("kvledger_ingest_replays_incomplete", "replays that timed out before the end marker", None,
                     sum(r.incomplete_replays for r in replays))
        yield family("kvledger_ingest_replay_malformed_replies", "replay replies with unreadable framing, skipped", None,
                     sum(r.malformed_replies for r in replays))
        yield self.publish_latency.family()
        yield self.engine_to_ack.family()
        ready = GaugeMetricFamily("kvledger_ingest_ready_streams", "engine streams subscribed and caught up")
        ready.add_metric([], sum(stream.ready.is_set() for stream in self.streams))
        yield ready
        if self.publisher is not None:
            counters = self.publisher.counters
            yield family("kvledger_ingest_batches_out", "canonical batches acknowledged by JetStream", None, counters.published)
            yield family("kvledger_ingest_publish_retries", "publishes sent again after a failure", None, counters.retries)
            yield family("kvledger_ingest_nats_reconnects", "NATS connections re-established", None, counters.reconnects)
            for name, help_text, value in (
                ("kvledger_ingest_in_flight", "publishes awaiting an ack", self.publisher.in_flight),
                ("kvledger_ingest_buffered", "batches buffered until acknowledged", self.publisher.buffered),
            ):
                gauge = GaugeMetricFamily(name, help_text)
                gauge.add_metric([], value)
                yield gauge


class EngineStream:
    """Follows one engine stream and turns it into canonical batches."""

    def __init__(
        self, source: StreamSource, bridge: Bridge, context: zmq.asyncio.Context, *, replay_timeout_s: float,
        max_batch_bytes: int, publish_window: int = 256,
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

    @property
    def name(self) -> str:
        suffix = "" if self.source.provenance is Provenance.NATIVE else " (retained)"
        return f"{self.source.worker.name}{suffix}"

    async def run(self) -> None:
        if self.tracker is None:
            # Only the first start reads the position back: after a stream failure the tracker
            # is ahead of JetStream (batches may still wait in the publisher) and stays.
            epoch, next_seq = await self._bridge.resume_position(self.source)
            fetch = self._fetch if self.replay is not None else None
            self.tracker = SequenceTracker(epoch, next_seq, fetch)
        log.info(
            "%s: following %s from epoch %d seq %d", self.name, self.source.pub_url, self.tracker.epoch, self.tracker.next_seq,
        )
        async with EngineSubscriber(self.source.pub_url, self._context) as subscriber:
            self.subscriber = subscriber
            await subscriber.connected.wait()
            # Replay after the handshake: whatever was sent before the SUB joined (or
            # while ingest was down) comes from the engine's buffer, in order.
            await self._publish(await self.tracker.catch_up())
            self.ready.set()
            log.info("%s: ready", self.name)
            while True:
                burst = await subscriber.recv_burst(IDLE_PROBE_S, self._burst_limit)
                if not burst:
                    await self._publish(await self.tracker.catch_up())
                for frames in burst:
                    emit = self._next_in_order(frames)
                    if emit is not None:
                        await self._publish_one(emit)
                    else:  # bad framing, a gap, a duplicate or a restart: the full rules
                        await self._publish(await self._on_frames(frames))
                # Nothing above waits while ZMQ has data: yield, so the publisher reads acks and
                # tops up its window between bursts instead of once the buffer is full.
                await asyncio.sleep(0)

    async def _fetch(self, start: int) -> list[tuple[int, bytes]]:
        return await self.replay.fetch(start)

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

    async def _reject_events(self, decoded: EngineBatch, emit: Emit) -> tuple[Gap, ...]:
        """Dead-letter each unusable event alone; the gaps the batch then carries.

        The batch's other events still apply. Only a lost event that may hide an eviction
        makes the worker uncertain (`RejectedEvent.loses_state`).
        """
        for rejected in decoded.rejected:
            self._bridge.metrics.rejected_events[rejected.tag or "untagged"] += 1
            await self._bridge.dead_letter(
                self.source, f"event {rejected.position} ({rejected.tag or 'untagged'}): {rejected.reason}",
                [rejected.raw], emit, position=rejected.position,
            )
        if any(rejected.loses_state for rejected in decoded.rejected):
            return (*emit.gaps, Gap(emit.seq, emit.seq + 1, GapReason.MISSED))
        return emit.gaps

    async def _publish_one(self, emit: Emit) -> None:
        """Decode, count, encode and queue one batch (the hot path: one call per engine batch)."""
        metrics = self._bridge.metrics
        source = self.source
        metrics.batches_in[source.worker.publisher] += 1
        engine_ts = 0.0
        try:
            decoded = decode_payload(emit.payload, max_bytes=self._max_batch_bytes, engine=source.engine)
        except WireError as error:
            await self._bridge.dead_letter(source, str(error), [emit.payload], emit)
            # The batch's events are lost to us: say so, so the worker is reported uncertain.
            events = (*emit.gaps, Gap(emit.seq, emit.seq + 1, GapReason.MISSED))
            gaps = events  # all of them
        else:
            engine_ts = decoded.engine_ts
            gaps = emit.gaps  # usually none: then the batch is the engine's events as decoded
            if decoded.rejected:
                gaps = await self._reject_events(decoded, emit)
            events = (*gaps, *decoded.events) if gaps else decoded.events
            metrics.remote_skipped += decoded.skipped_remote
            metrics.unaligned_tokens += decoded.unaligned_tokens
        kinds = metrics.events
        for event in events:
            kinds[type(event).__name__] += 1
        for gap in gaps:
            metrics.gaps[gap.reason.value] += 1
        batch = EventBatch(source.worker, emit.epoch, emit.seq, engine_ts, time.time(), source.provenance, events)
        record = encode_batch(batch)
        publisher = self._bridge.publisher
        largest = publisher.max_record(batch.msg_id)
        if len(record) > largest:
            # NATS would refuse it on every retry and stall every stream behind it.
            await self._bridge.dead_letter(
                self.source, f"canonical record of {len(record)} bytes exceeds the NATS max_payload of "
                f"{publisher.max_payload} less its {publisher.max_payload - largest}-byte header", [emit.payload], emit,
            )
            batch = attrs.evolve(batch, events=(*emit.gaps, Gap(emit.seq, emit.seq + 1, GapReason.MISSED)))
            metrics.gaps[GapReason.MISSED.value] += 1
            record = encode_batch(batch)
        await publisher.publish(self._subject, record, batch.msg_id, engine_ts if engine_ts > 0 else None)


class Bridge(AsyncLifetime):
    """Runs every engine stream, the publisher, and the health/metrics endpoint."""

    def __init__(self, settings: Settings, sources: list[StreamSource], *, http_port: int | None = None) -> None:
        if not sources:
            raise ValueError("ingest needs at least one endpoint (--endpoint tcp://HOST:PORT --publisher NAME)")
        self.settings = settings
        self.metrics = IngestMetrics()
        self._http_port = settings.ingest.http_port if http_port is None else http_port
        self._context = zmq.asyncio.Context()
        self.publisher = JetStreamPublisher(
            settings.nats,
            [events_stream(settings.stream), dead_letters_stream(settings.stream)],
            window=settings.ingest.publish_window,
            max_buffered=settings.ingest.max_buffered_batches,
            on_ack=self._acked,
        )
        self.streams = [
            EngineStream(
                source, self, self._context, replay_timeout_s=settings.ingest.replay_timeout_s,
                max_batch_bytes=settings.ingest.max_batch_bytes, publish_window=settings.ingest.publish_window,
            )
            for source in sources
        ]
        self.metrics.streams = self.streams
        self.metrics.publisher = self.publisher
        self._reader: nats.NATS | None = None
        self._tasks: list[asyncio.Task] = []
        self._http: HttpFront | None = None
        self.http_port: int | None = None
        # Benchmarks hook here to see every engine-send → JetStream-ack latency.
        self.ack_observer: Callable[[float], None] | None = None

    async def start(self) -> None:
        await self.publisher.__aenter__()
        await self.publisher.wait_connected(timeout=self.settings.nats.connect_timeout_s * 3)
        self._reader = await nats.connect(**connect_options(self.settings.nats, name="kvledger-ingest-reader"))
        router = health_routes(self.is_ready, lambda: generate_latest(self.metrics.registry))
        self._http = await HttpFront(router, self.settings.ingest.http_host, self._http_port).start()
        self.http_port = self._http.port
        self._tasks = [asyncio.create_task(self._supervise(stream), name=f"stream-{stream.name}") for stream in self.streams]

    async def close(self) -> None:
        try:
            # Cancelled more than once if need be: a stream resuming from JetStream right after
            # start can swallow one cancel in nats-py's request and follow its engine forever.
            await cancel_and_wait(self._tasks)
            self._tasks = []
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
            self._context.destroy(linger=0)

    def is_ready(self) -> bool:
        return all(stream.ready.is_set() for stream in self.streams)

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

    async def resume_position(self, source: StreamSource) -> tuple[int, int]:
        """(epoch, next seq) after the last batch JetStream holds for this stream; (0, 0) if none."""
        subject = events_subject(source.worker, source.provenance)
        try:
            message = await self._reader.jetstream().get_last_msg(self.settings.stream.events_stream, subject)
        except nats.js.errors.NotFoundError:
            return 0, 0
        last = decode_batch(message.data)
        return last.epoch, last.seq + 1

    async def dead_letter(
        self, source: StreamSource, reason: str, frames: list[bytes], emit: Emit | None = None,
        position: int | None = None,
    ) -> None:
        worker = source.worker
        log.warning("%s: dead-lettered: %s", worker.name, reason)
        self.metrics.dead_letters[worker.publisher] += 1
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
        await self.publisher.publish(dead_letter_subject(worker.publisher), encode_dead_letter(letter), msg_id)

    def _acked(self, latency_s: float, engine_ts: float | None) -> None:
        self.metrics.publish_latency.observe(latency_s)
        if engine_ts is not None:
            end_to_end = time.time() - engine_ts
            self.metrics.engine_to_ack.observe(end_to_end)
            if self.ack_observer is not None:
                self.ack_observer(end_to_end)
