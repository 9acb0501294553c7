"""decide's Prometheus metrics, in a registry of their own per service."""

from __future__ import annotations

from kvledger.runtime.metric_set import MetricSet


class DecideMetrics(MetricSet):
    def __init__(self) -> None:
        super().__init__()
        self.decisions = self.counter("kvledger_decide_decisions", "Decisions answered.", ["backend", "reason"])
        self.latency = self.histogram(
            "kvledger_decide_latency_seconds", "Time to rank one request or one batch.", ["backend", "kind"],
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
        )
        self.batch_size = self.histogram("kvledger_decide_batch_size", "Requests per batch.",
                                         buckets=(1, 2, 4, 16, 64, 256, 1024, 4096, 16384, 65536))
        self.budget_exhausted = self.counter("kvledger_decide_budget_exhausted",
                                             "Answers whose scan stopped at the lookup budget.")
        self.malformed = self.counter("kvledger_decide_malformed_requests", "Requests refused, by offending field.",
                                      ["field"])
        self.index_size = self.gauge("kvledger_decide_index_size", "Sequence hashes held by at least one worker.")
        self.workers = self.gauge("kvledger_decide_workers", "Workers in the index.")
        self.promoted_workers = self.gauge(
            "kvledger_decide_promoted_workers",
            "Workers whose records the fold holds as objects (beyond the plain case); the rest are in compact arrays.")
        self.index_bytes = self.gauge("kvledger_decide_index_bytes",
                                      "Bytes of the index's arrays: compact records, bitmask rows, hash table.")
        self.inventory_seq = self.gauge("kvledger_decide_inventory_seq", "KV_EVENTS stream sequence the index reflects.")
        self.inventory_lag = self.gauge("kvledger_decide_inventory_lag", "KV_EVENTS messages not yet applied to the index.")
        self.refetch_requests = self.counter(
            "kvledger_decide_refetch_requests",
            "Holes mid-stream in KV_EVENTS the index found and asked ingest to fetch again (kvledger.runtime.refetch).")
        self.reader_queries_passed_on = self.counter(
            "kvledger_decide_reader_queries_passed_on",
            "Index queries an index reader passed on to decide (decide busy writing, or its layout unreadable).")
        self.reader_restarts = self.counter(
            "kvledger_decide_reader_restarts", "Index reader processes decide started again after one ended.")
        self.undecodable_events = self.counter("kvledger_decide_undecodable_events",
                                               "KV_EVENTS messages that could not be decoded.")
        self.stream_regressions = self.counter(
            "kvledger_decide_stream_regressions",
            "Times KV_EVENTS no longer held the message the index applied last (it lost acknowledged messages); "
            "each rebuilt the index.")
        self.rebuild_seconds = self.gauge(
            "kvledger_decide_rebuild_seconds",
            "Seconds from the last detected stream regression until the rebuilt index caught up with KV_EVENTS.")
        self.warm_up = self.gauge("kvledger_decide_warm_up_seconds",
                                  "Seconds the backend took to compile and answer its first request at startup.")
