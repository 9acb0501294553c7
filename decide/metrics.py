"""decide's Prometheus metrics, in a registry of their own per service."""

from __future__ import annotations

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@attrs.frozen
class DecideMetrics:
    registry: CollectorRegistry
    decisions: Counter
    latency: Histogram
    batch_size: Histogram
    budget_exhausted: Counter
    malformed: Counter
    index_size: Gauge
    workers: Gauge
    inventory_seq: Gauge
    inventory_lag: Gauge
    undecodable_events: Counter
    warm_up: Gauge

    @classmethod
    def create(cls) -> DecideMetrics:
        registry = CollectorRegistry()
        return cls(
            registry,
            Counter("kvledger_decide_decisions", "Decisions answered.", ["backend", "reason"], registry=registry),
            Histogram("kvledger_decide_latency_seconds", "Time to rank one request or one batch.",
                      ["backend", "kind"], registry=registry,
                      buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)),
            Histogram("kvledger_decide_batch_size", "Requests per batch.", registry=registry,
                      buckets=(1, 2, 4, 16, 64, 256, 1024, 4096, 16384, 65536)),
            Counter("kvledger_decide_budget_exhausted", "Answers whose scan stopped at the lookup budget.",
                    registry=registry),
            Counter("kvledger_decide_malformed_requests", "Requests refused, by offending field.", ["field"],
                    registry=registry),
            Gauge("kvledger_decide_index_size", "Sequence hashes held by at least one worker.", registry=registry),
            Gauge("kvledger_decide_workers", "Workers in the index.", registry=registry),
            Gauge("kvledger_decide_inventory_seq", "KV_EVENTS stream sequence the index reflects.", registry=registry),
            Gauge("kvledger_decide_inventory_lag", "KV_EVENTS messages not yet applied to the index.",
                  registry=registry),
            Counter("kvledger_decide_undecodable_events", "KV_EVENTS messages that could not be decoded.",
                    registry=registry),
            Gauge("kvledger_decide_warm_up_seconds",
                  "Seconds the backend took to compile and answer its first request at startup.", registry=registry),
        )
