"""ingest's Prometheus metrics, in a registry of their own per bridge.

Counts on the hot path (per engine batch, per event) are plain additions; what the engine
streams and the publisher count themselves is read from them at scrape time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from kvledger.runtime.metric_set import MetricSet


class CountedStream(Protocol):
    """What the metrics read of an engine stream (ingest.bridge.EngineStream) at scrape time."""

    tracker: Any  # its sequence tracker (counters: replays, duplicates, restarts, replayed_batches), or None
    replay: Any  # its replay client (incomplete_replays, malformed_replies, probes, unanswered_probes), or None
    reachable: bool | None
    ready: Any  # an asyncio.Event


class CountingPublisher(Protocol):
    """What the metrics read of the JetStream publisher (ingest.publisher.JetStreamPublisher)."""

    counters: Any  # published, retries, reconnects
    in_flight: int
    buffered: int

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class IngestMetrics(MetricSet):
    def __init__(self) -> None:
        super().__init__()
        self.streams: list[CountedStream] = []
        self.publisher: CountingPublisher | None = None
        self.batches_in = self.counter("kvledger_ingest_batches_in", "engine batches received (SUB and replay)",
                                       ["publisher"])
        self.events = self.counter("kvledger_ingest_events", "canonical events published", ["kind"])
        self.gaps = self.counter("kvledger_ingest_gaps", "Gap events synthesised", ["reason"])
        self.dead_letters = self.counter("kvledger_ingest_dead_letters", "malformed inputs dead-lettered", ["publisher"])
        self.remote_skipped = self.counter("kvledger_ingest_remote_events_skipped", "events about REMOTE blocks kept out")
        self.rejected_events = self.counter(
            "kvledger_ingest_rejected_events", "single events dead-lettered while the rest of their batch applied", ["type"])
        self.unaligned_tokens = self.counter(
            "kvledger_ingest_unaligned_token_stores",
            "stores whose token ids do not line up with their hashes (null blocks): hashed from the worker's other groups")
        self.stream_checks = self.counter(
            "kvledger_ingest_stream_checks", "engine-stream checks that KV_EVENTS still holds what it acknowledged")
        self.stream_repaired = self.counter(
            "kvledger_ingest_stream_repaired_batches",
            "acknowledged batches KV_EVENTS lost, fetched again from the engine and republished")
        self.stream_lost = self.counter(
            "kvledger_ingest_stream_lost_batches",
            "acknowledged batches KV_EVENTS lost that no engine buffered any more (published as Gap stream_lost)")
        self.refetched = self.counter(
            "kvledger_ingest_refetched_batches",
            "batches a hole mid-stream lacked, fetched again from the engine when store or decide asked")
        self.refetch_lost = self.counter(
            "kvledger_ingest_refetch_lost_batches",
            "batches a hole mid-stream lacked that the engine no longer buffered (published as Gap stream_lost)")
        self.refetch_requests = self.counter(
            "kvledger_ingest_refetch_requests", "requests to fetch a hole mid-stream again, by outcome", ["outcome"])
        self.unreachable = self.counter(
            "kvledger_ingest_engines_unreachable",
            "times an engine was published unreachable (silent for ingest.engine_timeout_s)", ["publisher"])
        self.reachable_again = self.counter(
            "kvledger_ingest_engines_reachable_again", "times an unreachable engine was published reachable again",
            ["publisher"])
        self.gauge("kvledger_ingest_unreachable_streams", "engine streams whose engine KV_EVENTS says is unreachable",
                   read=lambda: sum(stream.reachable is False for stream in self.streams))
        # What the engine streams count themselves (their sequence trackers and replay clients).
        for name, help_text, counter in (
            ("kvledger_ingest_replays", "replay requests sent to engines", lambda counters: counters.replays),
            ("kvledger_ingest_duplicates", "engine batches dropped as already published",
             lambda counters: counters.duplicates),
            ("kvledger_ingest_engine_restarts", "engine restarts detected", lambda counters: counters.restarts),
            ("kvledger_ingest_replayed_batches", "engine batches received from replay sockets",
             lambda counters: counters.replayed_batches),
        ):
            self.counter(name, help_text, read=functools.partial(self._trackers, counter))
        for name, help_text, counter in (
            ("kvledger_ingest_replays_incomplete", "replays that timed out before the end marker",
             lambda replay: replay.incomplete_replays),
            ("kvledger_ingest_replay_malformed_replies", "replay replies with unreadable framing, dead-lettered",
             lambda replay: replay.malformed_replies),
            ("kvledger_ingest_replay_probes", "liveness probes sent to replay sockets", lambda replay: replay.probes),
            ("kvledger_ingest_replay_probes_unanswered", "liveness probes no replay socket answered in time",
             lambda replay: replay.unanswered_probes),
        ):
            self.counter(name, help_text, read=functools.partial(self._replays, counter))
        self.publish_latency = self.histogram(
            "kvledger_ingest_publish_latency_seconds", "from queueing to JetStream ack", buckets=_LATENCY_BUCKETS)
        self.engine_to_ack = self.histogram(
            "kvledger_ingest_engine_to_ack_seconds",
            "from the engine's batch timestamp to the JetStream ack (includes clock skew between hosts)",
            buckets=(*_LATENCY_BUCKETS, 60))
        self.gauge("kvledger_ingest_ready_streams", "engine streams subscribed and caught up",
                   read=lambda: sum(stream.ready.is_set() for stream in self.streams))
        for name, help_text, counter in (
            ("kvledger_ingest_batches_out", "canonical batches acknowledged by JetStream",
             lambda counters: counters.published),
            ("kvledger_ingest_publish_retries", "publishes sent again after a failure", lambda counters: counters.retries),
            ("kvledger_ingest_nats_reconnects", "NATS connections re-established", lambda counters: counters.reconnects),
        ):
            self.counter(name, help_text, read=functools.partial(self._publisher, counter))
        self.gauge("kvledger_ingest_in_flight", "publishes awaiting an ack",
                   read=lambda: self.publisher.in_flight if self.publisher else 0)
        self.gauge("kvledger_ingest_buffered", "batches buffered until acknowledged",
                   read=lambda: self.publisher.buffered if self.publisher else 0)

    def _trackers(self, count: Callable[[Any], int]) -> int:
        return sum(count(stream.tracker.counters) for stream in self.streams if stream.tracker is not None)

    def _replays(self, count: Callable[[Any], int]) -> int:
        return sum(count(stream.replay) for stream in self.streams if stream.replay is not None)

    def _publisher(self, count: Callable[[Any], int]) -> int:
        return count(self.publisher.counters) if self.publisher is not None else 0
